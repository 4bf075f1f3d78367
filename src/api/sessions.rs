//! `GET /api/work-sessions` and `GET /api/work-sessions/{id}`: the work-session bucket, seen
//! through the caller's roles, with the status computed now.

use super::auth::Caller;
use super::error::ApiError;
use super::query::{self, Params};
use super::{mplp, store, ApiState};
use crate::bus::sessions::session_key;
use crate::sessions::{SessionView, Status, ViewOptions, WorkSession};
use axum::extract::{Path, State};
use axum::{Extension, Json};
use chrono::{SecondsFormat, Utc};
use serde_json::{json, Value};
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
                .with("valid", json!(["ACTIVE", "QUIET", "ARCHIVED"]))
            })
        })
        .collect()
}

pub async fn list(
    State(state): State<ApiState>,
    Extension(caller): Extension<Caller>,
    super::QueryPairs(pairs): super::QueryPairs,
) -> Result<Json<Value>, ApiError> {
    let params = Params::new(pairs, &LIST_PARAMS)?;
    let requested = query::roles(&params)?;
    let types = query::types(&params)?;
    let statuses = statuses(&params)?;
    let limit = query::limit(&params, DEFAULT_LIMIT, MAX_LIMIT)?;
    let roles = caller.roles(requested.as_deref())?;
    let values = store::all_sessions(state.js(), &state.names().sessions_bucket).await?;
    let total = values.len();
    let opts = ViewOptions {
        roles: &roles,
        now: Utc::now(),
        quiet_after: state.quiet_after(),
        archive_after: state.archive_after(),
    };
    let mut views: Vec<SessionView> = values
        .iter()
        .filter_map(|v| match serde_json::from_slice::<WorkSession>(v) {
            Ok(s) => Some(s),
            Err(e) => {
                warn!(error = %e, "unreadable work session skipped");
                None
            }
        })
        .filter(|s| types.is_empty() || s.matches(&roles, &types))
        .filter_map(|s| s.view(&opts))
        .filter(|v| statuses.is_empty() || statuses.contains(&v.status))
        .collect();
    views.sort_by(|a, b| {
        b.updated_at
            .cmp(&a.updated_at)
            .then_with(|| a.id.cmp(&b.id))
    });
    let matched = views.len();
    views.truncate(limit);
    Ok(Json(json!({
        "sessions": views,
        "count": views.len(),
        "totalMatched": matched,
        "totalSessions": total,
        "role": roles,
        "type": types,
        "status": statuses,
        "limit": limit,
    })))
}

pub async fn one(
    State(state): State<ApiState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    super::QueryPairs(pairs): super::QueryPairs,
) -> Result<Json<Value>, ApiError> {
    let params = Params::new(pairs, &ONE_PARAMS)?;
    let requested = query::roles(&params)?;
    let format = params.one("format")?.unwrap_or_default();
    if !matches!(format.as_str(), "" | "json" | "mplp") {
        return Err(ApiError::bad_request(
            "invalid_format",
            format!("unknown format `{format}`; valid formats are: json, mplp"),
        )
        .with("valid", json!(["json", "mplp"])));
    }
    let roles = caller.roles(requested.as_deref())?;
    let missing = || ApiError::not_found(format!("work session `{id}` not found"));
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
        })
        .ok_or_else(missing)?;
    if format == "mplp" {
        let now = now.to_rfc3339_opts(SecondsFormat::Millis, true);
        return Ok(Json(mplp::collab(&session, &view, &now)));
    }
    Ok(Json(json!({ "session": view, "role": roles })))
}
