//! `GET /api/threads/{key}`: one conversation, AG-UI thread or session as people read it: its
//! runs with messages assembled from their deltas, tool calls with arguments and results, steps,
//! durations and outcomes, and its turns with their replies in place ([`crate::threads`]).
//!
//! The newest [`MAX_EVENTS`] projections of the key in the caller's roles are read and
//! assembled; `truncated` says when older ones exist.

use super::auth::Caller;
use super::error::ApiError;
use super::query::{self, Params, PathParam, QueryPairs};
use super::state::ApiState;
use super::store;
use crate::model::{Envelope, Role};
use crate::threads::{self, ThreadView};
use axum::extract::State;
use axum::{Extension, Json};
use schemars::JsonSchema;
use serde::Serialize;

/// Projections of one key read per request (the newest).
pub const MAX_EVENTS: usize = 5000;

const PARAMS: [&str; 1] = ["role"];

pub async fn one(
    State(state): State<ApiState>,
    Extension(caller): Extension<Caller>,
    PathParam(key): PathParam,
    QueryPairs(pairs): QueryPairs,
) -> Result<Json<ThreadResponse>, ApiError> {
    let params = Params::new(pairs, &PARAMS)?;
    let requested = query::roles(&params)?;
    let roles = caller.roles(requested.as_deref())?;
    let key = query::path_key(&key)?;
    // The subject's key token: the id itself when it is one, else its encoding (as producers'
    // subjects carry it).
    let token = crate::model::key_token(key);
    let names = state.names();
    let filters = query::subject_filters(&names.prefix, &roles, std::slice::from_ref(&token), &[]);
    let (stream, first, last) = store::bounds(state.js(), &names.proj_stream).await?;
    let (events, more) =
        store::newest_before(&stream, &filters, last.saturating_add(1), first, MAX_EVENTS).await?;
    let envelopes: Vec<(Envelope, &str)> = events
        .iter()
        .filter_map(|e| {
            serde_json::from_slice::<Envelope>(&e.payload)
                .ok()
                .map(|env| (env, e.stored_at.as_str()))
        })
        .collect();
    let stored: Vec<threads::Stored<'_>> = envelopes
        .iter()
        .map(|(envelope, stored_at)| threads::Stored {
            envelope,
            stored_at,
        })
        .collect();
    let thread = threads::assemble(&token, &stored, more, state.prices());
    if thread.events == 0 {
        return Err(ApiError::not_found(format!(
            "no events of key `{key}` in the roles {}",
            roles
                .iter()
                .map(|r| r.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    Ok(Json(ThreadResponse {
        thread,
        role: roles,
    }))
}

/// `/api/threads/{key}`: one thread, assembled, seen through `role`.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct ThreadResponse {
    /// The thread.
    pub thread: ThreadView,
    /// The roles it is seen through.
    pub role: Vec<Role>,
}
