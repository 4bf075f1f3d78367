//! `GET /api/work-sessions` and `GET /api/work-sessions/{id}`: the work-session bucket, seen
//! through the caller's roles, with the status computed now.

use super::auth::Caller;
use super::error::ApiError;
use super::query::{self, Params, PathParam, QueryPairs};
use super::state::ApiState;
use super::{mplp, store};
use crate::bus::sessions::session_key;
use crate::model::Role;
use crate::sessions::{SessionView, Status, ViewOptions, WorkSession};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use chrono::{SecondsFormat, Utc};
use schemars::JsonSchema;
use serde::Serialize;
use std::cmp::Ordering;
use std::collections::BinaryHeap;
use tracing::warn;

pub const DEFAULT_LIMIT: usize = 100;
pub const MAX_LIMIT: usize = 1000;

const LIST_PARAMS: [&str; 4] = ["role", "type", "status", "limit"];
const ONE_PARAMS: [&str; 2] = ["role", "format"];

fn statuses(params: &Params) -> Result<Vec<Status>, ApiError> {
    params
        .list("status")
        .iter()
        .map(|s| {
            Status::parse(s).ok_or_else(|| {
                ApiError::bad_request(
                    "invalid_status",
                    format!("unknown status `{s}`; valid statuses are: ACTIVE, QUIET, ARCHIVED"),
                )
                .with_valid(Status::ALL.map(Status::as_str))
            })
        })
        .collect()
}

pub async fn list(
    State(state): State<ApiState>,
    Extension(caller): Extension<Caller>,
    QueryPairs(pairs): QueryPairs,
) -> Result<Json<WorkSessionList>, ApiError> {
    let params = Params::new(pairs, &LIST_PARAMS)?;
    let requested = query::roles(&params)?;
    let types = query::types(&params)?;
    let statuses = statuses(&params)?;
    let limit = query::limit(&params, DEFAULT_LIMIT, MAX_LIMIT)?;
    let roles = caller.roles(requested.as_deref())?;
    // Held until the list is built: a list reads the whole bucket, so how many run at once is
    // capped, in all and per token.
    let _slot = state.list_slots().acquire(caller.name.as_deref())?;
    // Read before the sessions, which are then written at least this far.
    let progress = state.fold_progress().await;
    let opts = ViewOptions {
        roles: &roles,
        now: Utc::now(),
        quiet_after: state.quiet_after(),
        archive_after: state.archive_after(),
        prices: state.prices(),
    };
    // The bucket is read as a stream and only the newest `limit` matches are kept: a request
    // holds one fetched batch and at most `limit` views, however large the bucket.
    let mut newest = Newest::new(limit);
    let mut matched = 0usize;
    // Sessions with events in the roles seen through: a grant learns nothing of the others, not
    // even how many there are.
    let mut visible = 0usize;
    store::each_session(state.js(), &state.names().sessions_bucket, |v| {
        let session = match serde_json::from_slice::<WorkSession>(&v) {
            Ok(s) => s,
            Err(e) => {
                warn!(error = %e, "unreadable work session skipped");
                return;
            }
        };
        if !session.matches(&roles, &[]) {
            return;
        }
        visible += 1;
        if !types.is_empty() && !session.matches(&roles, &types) {
            return;
        }
        let Some(view) = session.view(&opts) else {
            return;
        };
        if statuses.is_empty() || statuses.contains(&view.status) {
            matched += 1;
            newest.offer(Ranked(view));
        }
    })
    .await?;
    let views: Vec<SessionView> = newest.into_sorted().into_iter().map(|r| r.0).collect();
    Ok(Json(WorkSessionList {
        count: views.len(),
        sessions: views,
        total_matched: matched,
        total_sessions: visible,
        role: roles,
        types,
        status: statuses,
        limit,
        folded_to: progress.map(|p| p.0),
        behind: progress.map(|p| p.1),
    }))
}

/// The first `limit` items offered in their order (`Ord`: the least is listed first), kept in
/// a heap whose top is the item to drop next.
struct Newest<T: Ord> {
    limit: usize,
    heap: BinaryHeap<T>,
}

impl<T: Ord> Newest<T> {
    fn new(limit: usize) -> Newest<T> {
        Newest {
            limit,
            heap: BinaryHeap::with_capacity(limit.saturating_add(1)),
        }
    }

    fn offer(&mut self, item: T) {
        self.heap.push(item);
        if self.heap.len() > self.limit {
            self.heap.pop();
        }
    }

    /// The items kept, in order.
    fn into_sorted(self) -> Vec<T> {
        self.heap.into_sorted_vec()
    }
}

/// A session view in list order: newest `updated_at` first, then by id.
struct Ranked(SessionView);

impl Ord for Ranked {
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .0
            .updated_at
            .cmp(&self.0.updated_at)
            .then_with(|| self.0.id.cmp(&other.0.id))
    }
}

impl PartialOrd for Ranked {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Ranked {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Ranked {}

pub async fn one(
    State(state): State<ApiState>,
    Extension(caller): Extension<Caller>,
    PathParam(id): PathParam,
    QueryPairs(pairs): QueryPairs,
) -> Result<Response, ApiError> {
    let params = Params::new(pairs, &ONE_PARAMS)?;
    let requested = query::roles(&params)?;
    let format = params.one("format")?.unwrap_or_default();
    if !matches!(format.as_str(), "" | "json" | "mplp") {
        return Err(ApiError::bad_request(
            "invalid_format",
            format!("unknown format `{format}`; valid formats are: json, mplp"),
        )
        .with_valid(["json", "mplp"]));
    }
    let roles = caller.roles(requested.as_deref())?;
    let missing = || ApiError::not_found(format!("work session `{id}` not found"));
    // Read before the session, which is then written at least this far.
    let progress = state.fold_progress().await;
    let kv = state.sessions_kv().await?;
    let value = kv
        .get(session_key(&id))
        .await
        .map_err(|e| ApiError::unavailable("work session", e))?
        .ok_or_else(missing)?;
    let session: WorkSession = serde_json::from_slice(&value).map_err(|e| {
        warn!(error = %e, "unreadable work session");
        missing()
    })?;
    let now = Utc::now();
    let view = session
        .view(&ViewOptions {
            roles: &roles,
            now,
            quiet_after: state.quiet_after(),
            archive_after: state.archive_after(),
            prices: state.prices(),
        })
        .ok_or_else(missing)?;
    if format == "mplp" {
        let now = now.to_rfc3339_opts(SecondsFormat::Millis, true);
        return Ok(Json(mplp::collab(&session, &view, &roles, &now)).into_response());
    }
    Ok(Json(WorkSessionResponse {
        session: view,
        role: roles,
        folded_to: progress.map(|p| p.0),
        behind: progress.map(|p| p.1),
    })
    .into_response())
}

/// `/api/work-sessions`: the sessions holding events of the selected roles and types, most
/// recently updated first, and the selection they were read with.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(deny_unknown_fields)]
pub struct WorkSessionList {
    /// The sessions, most recently updated first, at most `limit`.
    pub sessions: Vec<SessionView>,
    /// How many sessions are listed.
    pub count: usize,
    /// How many sessions matched before `limit` applied.
    pub total_matched: usize,
    /// How many sessions hold events of the roles seen through (whatever `type` and `status`
    /// select).
    pub total_sessions: usize,
    /// The roles the sessions are seen through.
    pub role: Vec<Role>,
    /// The event types selected (empty: all).
    #[serde(rename = "type")]
    pub types: Vec<String>,
    /// The statuses selected (empty: all).
    pub status: Vec<Status>,
    /// The most sessions listed.
    #[schemars(range(min = 1))]
    pub limit: usize,
    /// The projection-stream sequence up to which the sessions are written (the work-session
    /// fold's checkpoint, read before the sessions). Left out before a fold has run, or when it
    /// could not be read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub folded_to: Option<u64>,
    /// Messages the projection stream holds after `foldedTo` (partition owners' fence claims
    /// among them): how far the sessions lag the projections. Left out with `foldedTo`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub behind: Option<u64>,
}

/// `/api/work-sessions/{id}`: one work session, seen through `role`.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(deny_unknown_fields)]
pub struct WorkSessionResponse {
    /// The session.
    pub session: SessionView,
    /// The roles it is seen through.
    pub role: Vec<Role>,
    /// The projection-stream sequence up to which the session is written (the work-session
    /// fold's checkpoint, read before the session). Left out before a fold has run, or when it
    /// could not be read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub folded_to: Option<u64>,
    /// Messages the projection stream holds after `foldedTo` (partition owners' fence claims
    /// among them): how far the session may lag the projections. Left out with `foldedTo`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub behind: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::Newest;

    #[test]
    fn the_list_keeps_only_the_first_limit_items_in_order() {
        let mut kept = Newest::new(3);
        for n in [7u32, 3, 9, 1, 8, 2, 2, 6] {
            kept.offer(n);
        }
        assert_eq!(kept.into_sorted(), vec![1, 2, 2]);
        let mut none = Newest::new(0);
        none.offer(1u32);
        assert!(none.into_sorted().is_empty());
        let mut all = Newest::new(10);
        for n in [5u32, 4] {
            all.offer(n);
        }
        assert_eq!(all.into_sorted(), vec![4, 5]);
    }
}
