//! `GET /api/search`: find events by agent, outcome, time range and text, newest first.
//!
//! The projection stream is scanned backwards from the newest event (or from `before`) in
//! windows, each event of the caller's roles (and `type`, when given) tested against the
//! criteria, until `limit` events match, the scan passes `since`, or [`SCAN_BUDGET`] events were
//! read; `prev` continues an unfinished scan further back. Matching is done on the projections
//! themselves, which hold no secret (redacted before they are stored).

use super::auth::Caller;
use super::error::ApiError;
use super::query::{self, decode_cursor, encode_cursor, Params, QueryPairs};
use super::state::ApiState;
use super::store::{self, EventItem, StoredEvent};
use crate::model::Role;
use axum::extract::State;
use axum::{Extension, Json};
use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::Serialize;
use serde_json::Value;

pub const DEFAULT_LIMIT: usize = 50;
pub const MAX_LIMIT: usize = 500;
/// Events read per request at most; an unfinished scan says where to go on (`prev`).
pub const SCAN_BUDGET: u64 = 50_000;
/// Sequences read per window.
const WINDOW: u64 = 2_000;

const PARAMS: [&str; 9] = [
    "q", "agent", "outcome", "since", "until", "role", "type", "limit", "before",
];

/// What a search looks for.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Criteria {
    /// Lower-cased text the event's JSON must contain.
    pub text: Option<String>,
    /// An agent the event names (as `agentId`, `fromAgent`, `toAgent` or its publisher).
    pub agent: Option<String>,
    pub outcome: Option<Outcome>,
    pub since: Option<DateTime<Utc>>,
    pub until: Option<DateTime<Utc>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// A blocked `a2a.response`.
    Blocked,
    /// An answer that asks for input or credentials, or a run that ended on an interrupt.
    Waiting,
    /// A failure: a blocked turn, `run.failed`, `tool.failed`, `a2a.error`.
    Error,
}

impl Outcome {
    const ALL: [&'static str; 3] = ["blocked", "waiting", "error"];

    fn parse(s: &str) -> Option<Outcome> {
        match s {
            "blocked" => Some(Outcome::Blocked),
            "waiting" => Some(Outcome::Waiting),
            "error" => Some(Outcome::Error),
            _ => None,
        }
    }
}

/// The event's time: its `timestamp`, else its store time.
fn event_time(env: &Value, stored_at: &str) -> Option<DateTime<Utc>> {
    env.get("timestamp")
        .and_then(Value::as_str)
        .unwrap_or(stored_at)
        .parse::<DateTime<Utc>>()
        .ok()
}

impl Criteria {
    /// Whether `env` (a projected envelope, as JSON) stored at `stored_at` matches.
    pub fn matches(&self, env: &Value, stored_at: &str) -> bool {
        let p = env.get("payload");
        let s = |v: Option<&Value>| v.and_then(Value::as_str).map(str::to_string);
        if self.since.is_some() || self.until.is_some() {
            let Some(t) = event_time(env, stored_at) else {
                return false;
            };
            if self.since.is_some_and(|since| t < since) || self.until.is_some_and(|u| t >= u) {
                return false;
            }
        }
        if let Some(agent) = &self.agent {
            let publisher = env
                .get("rawEventRef")
                .and_then(|r| r.get("subject"))
                .and_then(Value::as_str)
                .and_then(crate::model::publishing_agent_of);
            let named = [
                s(env.get("agentId")),
                s(p.and_then(|p| p.get("fromAgent"))),
                s(p.and_then(|p| p.get("toAgent"))),
                publisher,
            ];
            if !named
                .iter()
                .flatten()
                .any(|a| a.eq_ignore_ascii_case(agent))
            {
                return false;
            }
        }
        if let Some(outcome) = self.outcome {
            let kind = env.get("type").and_then(Value::as_str).unwrap_or_default();
            let map = p.and_then(Value::as_object);
            let blocked = kind == "a2a.response" && crate::facts::is_blocked(map);
            let waiting = (kind == "a2a.response" && crate::facts::answer_waits_for(map).is_some())
                || (kind == "run.finished"
                    && env.get("phase").and_then(Value::as_str) == Some("interrupted"));
            let failed = matches!(kind, "run.failed" | "tool.failed" | "a2a.error");
            let hit = match outcome {
                Outcome::Blocked => blocked,
                Outcome::Waiting => waiting && !blocked,
                Outcome::Error => blocked || failed,
            };
            if !hit {
                return false;
            }
        }
        if let Some(text) = &self.text {
            if !env.to_string().to_lowercase().contains(text) {
                return false;
            }
        }
        true
    }
}

fn criteria(params: &Params) -> Result<Criteria, ApiError> {
    let time = |name: &'static str| -> Result<Option<DateTime<Utc>>, ApiError> {
        params
            .one_trimmed(name)?
            .map(|v| {
                // The strict RFC 3339 parser (four-digit years, `T` or a space between date and
                // time, an offset), as the OpenAPI document's `date-time` says: the relaxed one
                // behind `str::parse` also takes years of any length, up to where arithmetic on
                // them overflows.
                DateTime::parse_from_rfc3339(&v)
                    .map(|t| t.with_timezone(&Utc))
                    .map_err(|_| {
                        ApiError::bad_request(
                            "invalid_time",
                            format!(
                            "`{name}` is {v:?}: give an RFC 3339 time such as 2026-11-27T09:00:00Z"
                        ),
                        )
                    })
            })
            .transpose()
    };
    let outcome = params
        .one_trimmed("outcome")?
        .map(|v| {
            Outcome::parse(&v).ok_or_else(|| {
                ApiError::bad_request(
                    "invalid_outcome",
                    format!("unknown outcome `{v}`; valid outcomes are: blocked, waiting, error"),
                )
                .with_valid(Outcome::ALL)
            })
        })
        .transpose()?;
    let text = |name: &str| -> Result<Option<String>, ApiError> {
        Ok(params
            .one(name)?
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty()))
    };
    let c = Criteria {
        text: text("q")?.map(|t| t.to_lowercase()),
        agent: text("agent")?,
        outcome,
        since: time("since")?,
        until: time("until")?,
    };
    // `since` at or after `until` matches nothing: an empty page, not an error.
    Ok(c)
}

pub async fn search(
    State(state): State<ApiState>,
    Extension(caller): Extension<Caller>,
    QueryPairs(pairs): QueryPairs,
) -> Result<Json<SearchPage>, ApiError> {
    let params = Params::new(pairs, &PARAMS)?;
    let c = criteria(&params)?;
    let limit = query::limit(&params, DEFAULT_LIMIT, MAX_LIMIT)?;
    let requested = query::roles(&params)?;
    let roles = caller.roles(requested.as_deref())?;
    let types = query::types(&params)?;
    let served = state.served();
    let filters = query::subject_filters(&served.names.prefix, &roles, &[], &types);
    if filters.len() > query::MAX_FILTERS {
        return Err(ApiError::bad_request(
            "too_many_filters",
            "roles x types expand to too many subject filters",
        ));
    }
    let before = params
        .one("before")?
        .filter(|c| !c.is_empty())
        .map(|c| decode_cursor(served.tag, &c))
        .transpose()?;
    let (stream, first, last) = store::bounds(state.js(), &served.names.proj_stream).await?;
    let mut hi = before.map_or(last.saturating_add(1), |b| b.min(last.saturating_add(1)));
    let mut found: Vec<StoredEvent> = Vec::new();
    let mut scanned = 0u64;
    let mut past_since = false;
    while found.len() < limit && hi > first && scanned < SCAN_BUDGET && !past_since {
        let lo = hi.saturating_sub(WINDOW).max(first);
        let window = store::read_range(&stream, &filters, lo, hi - 1, usize::MAX).await?;
        scanned += hi - lo;
        // Newest first within the window.
        for e in window.iter().rev() {
            let Ok(env) = serde_json::from_slice::<Value>(&e.payload) else {
                continue;
            };
            if let (Some(since), Some(stored)) =
                (c.since, e.stored_at.parse::<DateTime<Utc>>().ok())
            {
                // Store times only grow along the stream: once they are before `since` (with a
                // minute for producers' clocks), nothing older can match.
                let floor = since
                    .checked_sub_signed(chrono::Duration::minutes(1))
                    .unwrap_or(DateTime::<Utc>::MIN_UTC);
                if stored < floor {
                    past_since = true;
                    break;
                }
            }
            if c.matches(&env, &e.stored_at) {
                found.push(e.clone());
                if found.len() >= limit {
                    hi = e.seq;
                    break;
                }
            }
        }
        if found.len() < limit && !past_since {
            hi = lo;
        }
    }
    let complete = past_since || hi <= first;
    let prefix = &served.names.prefix;
    let events: Vec<EventItem> = found.iter().map(|e| e.item(prefix, served.tag)).collect();
    Ok(Json(SearchPage {
        count: events.len(),
        events,
        prev: (!complete).then(|| encode_cursor(served.tag, hi)),
        scanned,
        role: roles,
        limit,
    }))
}

/// The body of `GET /api/search`.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(deny_unknown_fields)]
pub struct SearchPage {
    /// Matching events, newest first.
    pub events: Vec<EventItem>,
    pub count: usize,
    /// `before=prev` goes on scanning older events; `null` when the scan reached the start of
    /// the stream (or passed `since`).
    pub prev: Option<String>,
    /// Events read to answer (at most 50,000 per request).
    pub scanned: u64,
    /// The roles searched.
    pub role: Vec<Role>,
    #[schemars(range(min = 1))]
    pub limit: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn c() -> Criteria {
        Criteria::default()
    }

    #[test]
    fn only_ascii_blanks_count_as_no_outcome_or_time() {
        let read = |name: &str, v: &str| {
            criteria(&Params::new(vec![(name.to_string(), v.to_string())], &PARAMS).unwrap())
        };
        assert!(read("outcome", "").unwrap().outcome.is_none());
        assert!(read("outcome", " \t").unwrap().outcome.is_none());
        assert_eq!(
            read("outcome", " blocked ").unwrap().outcome,
            Some(Outcome::Blocked)
        );
        // U+00A0 is no ASCII blank: the value is there, and no outcome.
        assert!(read("outcome", "\u{a0}").is_err());
        assert!(read("since", "\u{a0}").is_err());
        assert!(read("since", "").unwrap().since.is_none());
    }

    #[test]
    fn times_are_rfc_3339_with_four_digit_years() {
        let read = |v: &str| {
            criteria(&Params::new(vec![("since".to_string(), v.to_string())], &PARAMS).unwrap())
        };
        for good in [
            "2026-11-27T09:00:00Z",
            "2026-11-27T09:00:00.250+01:00",
            "0000-01-01T00:00:00Z",
        ] {
            assert!(read(good).is_ok_and(|c| c.since.is_some()), "{good}");
        }
        // Years the relaxed parser takes, the earliest of which overflowed the search's floor.
        for bad in [
            "-262143-01-01T00:00:00Z",
            "+10000-01-01T00:00:00Z",
            "2026-11-27T09:00:00 UTC",
        ] {
            assert!(
                read(bad).is_err_and(|e| e.code == "invalid_time"),
                "{bad} should be refused"
            );
        }
    }

    #[test]
    fn criteria_match_agent_outcome_time_and_text() {
        let blocked = json!({"type": "a2a.response", "timestamp": "2026-11-27T10:00:00Z",
            "payload": {"outcome": "blocked", "reason": "timeout", "fromAgent": "ruda",
                "toAgent": "main", "goal": "Book the Flight"}});
        let waiting = json!({"type": "a2a.response", "payload": {"state": "input-required",
            "fromAgent": "eden"}});
        let failed = json!({"type": "run.failed", "rawEventRef": {"subject":
            "collab.raw.t._as.planner.agui"}, "payload": {"code": "rate_limited"}});
        let stored = "2026-11-27T10:00:00Z";
        let agent = |a: &str| Criteria {
            agent: Some(a.into()),
            ..c()
        };
        assert!(agent("MAIN").matches(&blocked, stored));
        assert!(
            agent("planner").matches(&failed, stored),
            "the publishing agent"
        );
        assert!(!agent("eden").matches(&blocked, stored));
        let outcome = |o| Criteria {
            outcome: Some(o),
            ..c()
        };
        assert!(outcome(Outcome::Blocked).matches(&blocked, stored));
        assert!(!outcome(Outcome::Blocked).matches(&waiting, stored));
        assert!(outcome(Outcome::Waiting).matches(&waiting, stored));
        assert!(outcome(Outcome::Error).matches(&failed, stored));
        assert!(outcome(Outcome::Error).matches(&blocked, stored));
        assert!(!outcome(Outcome::Error).matches(&waiting, stored));
        let text = Criteria {
            text: Some("book the flight".into()),
            ..c()
        };
        assert!(text.matches(&blocked, stored));
        assert!(!text.matches(&waiting, stored));
        let at = |s: &str| s.parse::<DateTime<Utc>>().ok();
        let window = Criteria {
            since: at("2026-11-27T09:00:00Z"),
            until: at("2026-11-27T10:00:00Z"),
            ..c()
        };
        assert!(!window.matches(&blocked, stored), "until is exclusive");
        let window = Criteria {
            since: at("2026-11-27T09:00:00Z"),
            until: at("2026-11-27T11:00:00Z"),
            ..c()
        };
        assert!(window.matches(&blocked, stored));
        // No timestamp: the store time counts.
        assert!(window.matches(&waiting, "2026-11-27T09:30:00Z"));
        assert!(!window.matches(&waiting, "2026-11-27T08:30:00Z"));
    }
}
