//! `GET /api/waiting`: every turn and run waiting now, who waits on whom, for what, since when,
//! with the thread and item to open ([`crate::waiting`]), longest waiting first.
//!
//! The newest [`SCAN_BUDGET`] turn and run events (`a2a.send`, `a2a.response`, `run.started`,
//! `run.finished`, `run.failed`; other traffic is not read) in the caller's roles are read,
//! grouped by key and assembled as `/api/threads` does; `complete` says whether they reach back
//! to the oldest such event kept.

use super::auth::Caller;
use super::error::ApiError;
use super::query::{self, Params, QueryPairs};
use super::state::ApiState;
use super::store::{self, subject_parts};
use crate::model::{Envelope, Role};
use crate::threads::{self, Stored};
use crate::waiting::{self, Wait};
use axum::extract::State;
use axum::{Extension, Json};
use schemars::JsonSchema;
use serde::Serialize;
use std::collections::HashMap;

pub const DEFAULT_LIMIT: usize = 100;
pub const MAX_LIMIT: usize = 500;
/// Turn and run events read per request at most (the newest).
pub const SCAN_BUDGET: usize = 10_000;
/// The event types a wait is decided by.
const TYPES: [&str; 5] = [
    "a2a.send",
    "a2a.response",
    "run.started",
    "run.finished",
    "run.failed",
];

const PARAMS: [&str; 2] = ["role", "limit"];

pub async fn waiting(
    State(state): State<ApiState>,
    Extension(caller): Extension<Caller>,
    QueryPairs(pairs): QueryPairs,
) -> Result<Json<WaitingList>, ApiError> {
    let params = Params::new(pairs, &PARAMS)?;
    let limit = query::limit(&params, DEFAULT_LIMIT, MAX_LIMIT)?;
    let requested = query::roles(&params)?;
    let roles = caller.roles(requested.as_deref())?;
    let names = state.names();
    let prefix = names.prefix.clone();
    let types: Vec<String> = TYPES.iter().map(|t| (*t).to_string()).collect();
    let filters = query::subject_filters(&prefix, &roles, &[], &types);
    let (stream, first, last) = store::bounds(state.js(), &names.proj_stream).await?;
    // The newest turn and run events, whatever else the stream holds; each key's in stream
    // order.
    let (events, more) = store::newest_before(
        &stream,
        &filters,
        last.saturating_add(1),
        first,
        SCAN_BUDGET,
    )
    .await?;
    let scanned = events.len();
    let complete = !more;
    let mut by_key: HashMap<String, Vec<(Envelope, String)>> = HashMap::new();
    for e in events {
        let (_, Some(k), _) = subject_parts(&prefix, &e.subject) else {
            continue;
        };
        if let Ok(env) = serde_json::from_slice::<Envelope>(&e.payload) {
            by_key.entry(k).or_default().push((env, e.stored_at));
        }
    }
    let mut waits: Vec<Wait> = Vec::new();
    for (k, events) in &by_key {
        let stored: Vec<Stored<'_>> = events
            .iter()
            .map(|(envelope, stored_at)| Stored {
                envelope,
                stored_at,
            })
            .collect();
        let view = threads::assemble(k, &stored, false, state.prices());
        waits.extend(waiting::of_thread(&view));
    }
    // Longest waiting first; the same instant in key order, so pages are stable.
    waits.sort_by(|a, b| {
        let t = |w: &Wait| chrono::DateTime::parse_from_rfc3339(&w.since).ok();
        t(a).cmp(&t(b))
            .then_with(|| a.key.cmp(&b.key))
            .then_with(|| a.item.cmp(&b.item))
    });
    let total = waits.len();
    waits.truncate(limit);
    Ok(Json(WaitingList {
        count: waits.len(),
        total,
        waits,
        scanned,
        complete,
        role: roles,
        limit,
    }))
}

/// The body of `GET /api/waiting`.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(deny_unknown_fields)]
pub struct WaitingList {
    /// What waits now, longest waiting first (at most `limit`).
    pub waits: Vec<Wait>,
    pub count: usize,
    /// Waits found, before `limit`.
    pub total: usize,
    /// Turn and run events read (the newest, at most 10,000).
    pub scanned: usize,
    /// Whether those are all the turn and run events kept; when not, a wait that began before
    /// them is not listed.
    pub complete: bool,
    /// The roles read.
    pub role: Vec<Role>,
    #[schemars(range(min = 1))]
    pub limit: usize,
}
