//! `GET /api/tree/{key}`: the delegation tree below a conversation, AG-UI thread or session, or
//! below one of its runs or turns (`item=run:<id>` / `item=turn:<id>`): the conversations it
//! delegated to, the tasks and runs it started and their tool calls, across keys, with start,
//! duration, outcome and the tokens and cost rolled up from below ([`crate::tree`]).
//!
//! Bounded like `/api/threads`: the newest [`KEY_EVENTS`] events of the key are read; what it
//! caused comes after it, so the [`LINK_SCAN`] projections (in the caller's roles) stored from its
//! first event on (the item's, with `item`; [`LINK_MARGIN`] earlier, as partitions are
//! projected in parallel) are read for link facts; then the newest
//! [`KEY_EVENTS`] events of each linked key, at most [`MAX_KEYS`] keys in all (breadth first).
//! `truncated` and `scanComplete` say when a bound cut something off.

use super::auth::Caller;
use super::error::ApiError;
use super::query::{self, Params, PathParam, QueryPairs};
use super::state::ApiState;
use super::store::{self, subject_parts};
use crate::model::{Envelope, Role};
use crate::threads::Stored;
use crate::tree::{self, ItemRef, KeyEvents, LinkIndex, TreeNode};
use async_nats::jetstream::stream::Stream;
use axum::extract::State;
use axum::{Extension, Json};
use schemars::JsonSchema;
use serde::Serialize;
use std::collections::{HashSet, VecDeque};

/// Keys in one tree at most (the root's included).
pub const MAX_KEYS: usize = 64;
/// Projections of one key read (the newest).
pub const KEY_EVENTS: usize = 2000;
/// Projections scanned for the links between keys, from the root's first event on.
pub const LINK_SCAN: u64 = 50_000;
/// Projections before the root's first event the scan starts at: keys are projected by
/// partitions in parallel, so what came after the root in event time may be stored a little
/// before it.
pub const LINK_MARGIN: u64 = 5_000;
/// Sequences read per window of the scan.
const WINDOW: u64 = 2_000;

const PARAMS: [&str; 2] = ["role", "item"];

pub async fn tree(
    State(state): State<ApiState>,
    Extension(caller): Extension<Caller>,
    PathParam(key): PathParam,
    QueryPairs(pairs): QueryPairs,
) -> Result<Json<TreeResponse>, ApiError> {
    let params = Params::new(pairs, &PARAMS)?;
    let requested = query::roles(&params)?;
    let roles = caller.roles(requested.as_deref())?;
    let key = query::path_key(&key)?;
    let item = params
        .one("item")?
        .filter(|v| !v.is_empty())
        .map(|v| {
            ItemRef::parse(&v).ok_or_else(|| {
                ApiError::bad_request(
                    "invalid_item",
                    format!("`item` is {v:?}: give `run:<run id>` or `turn:<turn id>`, as the thread's links name them"),
                )
            })
        })
        .transpose()?;
    let root = crate::model::key_token(key);
    let names = state.names();
    let prefix = names.prefix.clone();
    let (stream, first, last) = store::bounds(state.js(), &names.proj_stream).await?;

    // 1. The root's key, and where what it caused begins: its first event (of the item, when
    // one is asked for). What a turn or run causes comes after it.
    let mut index = LinkIndex::default();
    let (root_events, mut truncated) =
        key_events(&stream, &prefix, &roles, &root, first, last).await?;
    if root_events.is_empty() {
        return Err(ApiError::not_found(format!(
            "no events of key `{key}` in the roles {}",
            role_list(&roles)
        )));
    }
    let from = root_events
        .iter()
        .find(|e| {
            item.is_none() || tree::Facts::of(&root, &e.envelope).item.as_ref() == item.as_ref()
        })
        .or(root_events.first())
        .map_or(first, |e| e.seq);

    // 2. Link facts of the projections stored from there on.
    let all = query::subject_filters(&prefix, &roles, &[], &[]);
    let mut lo = from.saturating_sub(LINK_MARGIN).max(first);
    let mut scanned = 0u64;
    while lo <= last && scanned < LINK_SCAN {
        let hi = lo.saturating_add(WINDOW - 1).min(last);
        for e in store::read_range(&stream, &all, lo, hi, usize::MAX).await? {
            let (_, Some(k), _) = subject_parts(&prefix, &e.subject) else {
                continue;
            };
            if let Ok(env) = serde_json::from_slice::<Envelope>(&e.payload) {
                index.add(&k, &env);
            }
        }
        scanned += hi - lo + 1;
        lo = hi.saturating_add(1);
    }
    let scan_complete = lo > last;

    // 3. The keys below the root, breadth first, each read whole (its newest events).
    let mut read: Vec<(String, Vec<Read>)> = Vec::new();
    let mut queue = VecDeque::from([(root.clone(), Some(root_events))]);
    let mut included: HashSet<String> = HashSet::from([root.clone()]);
    while let Some((k, known)) = queue.pop_front() {
        let events = match known {
            Some(events) => events,
            None => {
                let (events, more) = key_events(&stream, &prefix, &roles, &k, first, last).await?;
                truncated |= more;
                events
            }
        };
        for e in &events {
            index.add(&k, &e.envelope);
        }
        read.push((k.clone(), events));
        for child in index.children(&k) {
            if included.contains(&child) {
                continue;
            }
            if included.len() >= MAX_KEYS {
                truncated = true;
                break;
            }
            included.insert(child.clone());
            queue.push_back((child, None));
        }
    }
    let events: usize = read.iter().map(|(_, e)| e.len()).sum();
    let keys: Vec<KeyEvents<'_>> = read
        .iter()
        .map(|(k, events)| KeyEvents {
            key: k.clone(),
            events: events
                .iter()
                .map(|e| Stored {
                    envelope: &e.envelope,
                    stored_at: &e.stored_at,
                })
                .collect(),
        })
        .collect();
    let Some(built) = tree::build(&keys, item.as_ref(), state.prices()) else {
        return Err(ApiError::not_found(format!(
            "no {} in the newest events of key `{key}` in the roles {}",
            params.one("item")?.unwrap_or_default(),
            role_list(&roles)
        )));
    };
    Ok(Json(TreeResponse {
        tree: built.root,
        keys: read.iter().map(|(k, _)| k.clone()).collect(),
        events,
        truncated: truncated || built.cut,
        scanned,
        scan_complete,
        role: roles,
    }))
}

fn role_list(roles: &[Role]) -> String {
    roles
        .iter()
        .map(|r| r.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// One event read.
struct Read {
    envelope: Envelope,
    stored_at: String,
    seq: u64,
}

/// The newest [`KEY_EVENTS`] events of one key, parsed, and whether older ones exist.
async fn key_events(
    stream: &Stream,
    prefix: &str,
    roles: &[Role],
    key: &str,
    first: u64,
    last: u64,
) -> Result<(Vec<Read>, bool), ApiError> {
    let filters = query::subject_filters(prefix, roles, &[key.to_string()], &[]);
    let (events, more) =
        store::newest_before(stream, &filters, last.saturating_add(1), first, KEY_EVENTS).await?;
    let parsed = events
        .into_iter()
        .filter_map(|e| {
            serde_json::from_slice::<Envelope>(&e.payload)
                .ok()
                .map(|envelope| Read {
                    envelope,
                    stored_at: e.stored_at,
                    seq: e.seq,
                })
        })
        .collect();
    Ok((parsed, more))
}

/// The body of `GET /api/tree/{key}`.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(deny_unknown_fields)]
pub struct TreeResponse {
    /// The root (the key's conversation, or the run or turn asked for) and everything below it.
    pub tree: TreeNode,
    /// The keys read, the root's first (at most 64).
    pub keys: Vec<String>,
    /// Events assembled.
    pub events: usize,
    /// Whether a bound cut something off: more than 64 linked keys, a key with more than 2000
    /// events (its newest are assembled), or more than 5000 nodes (the earliest are kept).
    pub truncated: bool,
    /// Projections scanned for links between keys: those stored from shortly (5,000
    /// projections) before the root's first event on, at most 50,000.
    pub scanned: u64,
    /// Whether that scan reached the newest projection; when not, keys linked only by later
    /// events are missing.
    pub scan_complete: bool,
    /// The roles read.
    pub role: Vec<Role>,
}
