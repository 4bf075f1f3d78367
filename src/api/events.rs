//! `GET /api/events`: filtered projections, newest `limit` by default, with cursors.
//!
//! - no cursor: the newest `limit` matching events, oldest first;
//! - `after=<cursor>`: the oldest `limit` matching events after it;
//! - `before=<cursor>`: the newest `limit` matching events before it;
//! - both: the oldest `limit` matching events between them.
//!
//! `next` continues with newer events (`after=next`; it is returned even when the page is empty,
//! for polling), `prev` with older ones (`before=prev`; `null` when there are none), `oldest`
//! starts from the beginning of what the stream retains. A cursor older than retention is a 410
//! carrying `oldestCursor`.

use super::auth::Caller;
use super::error::ApiError;
use super::query::{self, decode_cursor, encode_cursor, Params, QueryPairs, Selection};
use super::state::ApiState;
use super::store::{self, EventItem};
use crate::model::Role;
use crate::served::Served;
use axum::extract::State;
use axum::http::StatusCode;
use axum::{Extension, Json};
use schemars::JsonSchema;
use serde::Serialize;

pub const DEFAULT_LIMIT: usize = 100;
pub const MAX_LIMIT: usize = 1000;

const PARAMS: [&str; 7] = ["role", "type", "key", "view", "limit", "after", "before"];

/// A selection resolved against the caller's grant.
pub struct Resolved {
    pub roles: Vec<Role>,
    pub selection: Selection,
    pub filters: Vec<String>,
}

/// Check the selection against the grant and build the subject filters.
pub fn resolve(served: &Served, caller: &Caller, params: &Params) -> Result<Resolved, ApiError> {
    let selection = query::selection(params)?;
    let roles = caller.roles(selection.roles.as_deref())?;
    let filters = query::subject_filters(
        &served.names.prefix,
        &roles,
        &selection.keys,
        &selection.types,
    );
    if filters.len() > query::MAX_FILTERS {
        return Err(ApiError::bad_request(
            "too_many_filters",
            format!(
                "roles x keys x types expand to {} subject filters; at most {} are allowed",
                filters.len(),
                query::MAX_FILTERS
            ),
        ));
    }
    Ok(Resolved {
        roles,
        selection,
        filters,
    })
}

/// 410 for a cursor whose events are no longer retained (`tag`: the served version's).
pub fn expired(tag: u16, first: u64) -> ApiError {
    ApiError::new(
        StatusCode::GONE,
        "cursor_expired",
        "the cursor points before the oldest retained event: events after it were removed by retention; continue from oldestCursor",
    )
    .with_oldest_cursor(encode_cursor(tag, first.saturating_sub(1)))
}

/// 410 for a cursor past the stream's newest event (`last`): no server issued it for this
/// stream, so the stream was deleted and made again since (its sequences started over), or the
/// cursor was made up. Waiting would never reach it; the client starts again.
pub fn ahead(tag: u16, first: u64, last: u64) -> ApiError {
    ApiError::new(
        StatusCode::GONE,
        "cursor_ahead",
        format!(
            "the cursor is past the newest event (sequence {last}): the projection stream was made again since it was issued, or it was never issued here; start again without a cursor, or continue from oldestCursor"
        ),
    )
    .with_oldest_cursor(encode_cursor(tag, first.saturating_sub(1)))
}

/// Whether a cursor at `seq` can have been issued for a stream whose newest event is `last`:
/// `next` is at most `last`, `prev` at most one past it.
pub fn issued_for(seq: u64, last: u64) -> bool {
    seq <= last.saturating_add(1)
}

pub async fn list(
    State(state): State<ApiState>,
    Extension(caller): Extension<Caller>,
    QueryPairs(pairs): QueryPairs,
) -> Result<Json<EventPage>, ApiError> {
    let params = Params::new(pairs, &PARAMS)?;
    let limit = query::limit(&params, DEFAULT_LIMIT, MAX_LIMIT)?;
    // One version for the whole request, whatever a switch does meanwhile.
    let served = state.served();
    let tag = served.tag;
    let after = params
        .one("after")?
        .filter(|c| !c.is_empty())
        .map(|c| decode_cursor(tag, &c))
        .transpose()?;
    let before = params
        .one("before")?
        .filter(|c| !c.is_empty())
        .map(|c| decode_cursor(tag, &c))
        .transpose()?;
    let r = resolve(&served, &caller, &params)?;
    let (stream, first, last) = store::bounds(state.js(), &served.names.proj_stream).await?;
    if [after, before]
        .into_iter()
        .flatten()
        .any(|c| !issued_for(c, last))
    {
        return Err(ahead(tag, first, last));
    }

    let (events, next, prev) = match (after, before) {
        (Some(a), before) => {
            if a.saturating_add(1) < first {
                return Err(expired(tag, first));
            }
            // With `before` too: only the events between the two cursors.
            let to = before.map_or(last, |b| last.min(b.saturating_sub(1)));
            let events =
                store::read_range(&stream, &r.filters, a.saturating_add(1), to, limit).await?;
            let next = if events.len() >= limit {
                events.last().map_or(to, |e| e.seq)
            } else {
                to.max(a)
            };
            let prev = Some(events.first().map_or(a.saturating_add(1), |e| e.seq));
            (events, next, prev)
        }
        (None, Some(b)) => {
            // Sequences start at 1: nothing ever came before 0 or 1 (`before=oldest` on a stream
            // retention never trimmed is an empty page), so only a later cursor can have expired.
            if b < first && b > 1 {
                return Err(expired(tag, first));
            }
            let hi = b.min(last.saturating_add(1));
            let (events, more) =
                store::newest_before(&stream, &r.filters, hi, first, limit).await?;
            let next = events.last().map_or(b.saturating_sub(1), |e| e.seq);
            let prev = if more {
                events.first().map(|e| e.seq)
            } else {
                None
            };
            (events, next, prev)
        }
        (None, None) => {
            let (events, more) =
                store::newest_before(&stream, &r.filters, last.saturating_add(1), first, limit)
                    .await?;
            let prev = if more {
                events.first().map(|e| e.seq)
            } else {
                None
            };
            (events, last, prev)
        }
    };
    let prefix = &served.names.prefix;
    let events: Vec<EventItem> = events.iter().map(|e| e.item(prefix, tag)).collect();
    Ok(Json(EventPage {
        count: events.len(),
        events,
        next: encode_cursor(tag, next),
        prev: prev.map(|p| encode_cursor(tag, p)),
        oldest: encode_cursor(tag, first.saturating_sub(1)),
        role: r.roles,
        types: r.selection.types,
        keys: r.selection.keys,
        limit,
    }))
}

/// A page of `/api/events`: the events, the cursors to continue with, and the selection it was
/// read with.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(deny_unknown_fields)]
pub struct EventPage {
    /// The matching events, oldest first.
    pub events: Vec<EventItem>,
    /// How many events the page holds.
    pub count: usize,
    /// `after=next` reads newer events (also for polling an empty page).
    pub next: String,
    /// `before=prev` reads older events; `null` when there are none.
    pub prev: Option<String>,
    /// `after=oldest` reads from the oldest retained event.
    pub oldest: String,
    /// The roles read.
    pub role: Vec<Role>,
    /// The event types selected (empty: all).
    #[serde(rename = "type")]
    pub types: Vec<String>,
    /// The ordering keys selected (empty: all).
    #[serde(rename = "key")]
    pub keys: Vec<String>,
    /// The page size asked for.
    #[schemars(range(min = 1))]
    pub limit: usize,
}
