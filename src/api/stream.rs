//! `GET /api/events/stream`: the same filters as Server-Sent Events.
//!
//! Each event's `id` is its cursor and its `data` the item `/api/events` returns. A client resumes
//! with `Last-Event-ID` (or `after`): delivery restarts right after that sequence, so nothing is
//! lost or repeated. Without either, the stream starts with the next event stored.
//!
//! One ordered consumer per client reads from JetStream into a bounded buffer (events and bytes,
//! counted as the memory the buffered events take, not just their length). A client that reads
//! more slowly than events arrive fills it; it then gets what was buffered, a final
//! `event: error` (code `slow_consumer`, with the cursor to resume from), and the stream closes,
//! so a slow client never makes the server hold unbounded memory. Every stream ends after
//! `http.sse_max_stream_lifetime` the same way (code `lifetime_reached`), so a client that stopped
//! reading a quiet stream, whose buffer would take hours to fill, holds its place no longer than
//! that; a reading client reconnects at once and misses nothing. How many streams may be open
//! at once is capped per token and in total ([`super::slots`]); a stream's place is taken before
//! anything is opened and freed when its response body is dropped.

use super::auth::Caller;
use super::error::ApiError;
use super::events::{expired, resolve};
use super::query::{bad_cursor, decode_cursor, encode_cursor, Params, QueryPairs};
use super::state::ApiState;
use super::store::{self, StoredEvent};
use crate::served::Served;
use async_nats::jetstream::consumer;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use futures::StreamExt;
use schemars::JsonSchema;
use serde::Serialize;
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::{mpsc, watch};
use tracing::{debug, warn};

const PARAMS: [&str; 5] = ["role", "type", "key", "view", "after"];
/// Most messages one pull of a stream's consumer brings.
const PULL_BATCH: i64 = 64;
/// Consecutive consumer errors after which a stream gives up.
const MAX_ERRORS: u32 = 10;

/// Why a stream ended, told to the client in a final `event: error`.
#[derive(Debug, Clone)]
struct Termination {
    code: StreamErrorCode,
    message: String,
}

/// The `data` of the final `event: error` of `/api/events/stream`.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct StreamError {
    pub error: StreamErrorDetail,
}

/// Why the stream ended, and where to resume.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(deny_unknown_fields)]
pub struct StreamErrorDetail {
    pub code: StreamErrorCode,
    /// What happened and what to do, for a person.
    pub message: String,
    /// The cursor of the last event sent, or, when none was sent, of where the stream started
    /// (send it as `Last-Event-ID`); after `lifetime_reached`, of the stream's end when nothing
    /// the stream's filters match was stored after the last event sent. Always set by this
    /// version; older ones sent `null` when nothing was sent and the stream did not resume from a
    /// cursor.
    pub resume_from: Option<String>,
}

/// `slow_consumer`: the client read more slowly than events arrived and its buffer filled;
/// `unavailable`: the event store stopped answering or closed the stream; `version_switched`:
/// the API now serves another projection version, whose positions the stream's cursors are not
/// (reconnect without `Last-Event-ID`); `lifetime_reached`: the stream was open for
/// `http.sse_max_stream_lifetime` (reconnect at once with `Last-Event-ID`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum StreamErrorCode {
    SlowConsumer,
    Unavailable,
    VersionSwitched,
    LifetimeReached,
}

impl StreamErrorCode {
    /// The code as the client reads it.
    fn as_str(self) -> &'static str {
        match self {
            StreamErrorCode::SlowConsumer => "slow_consumer",
            StreamErrorCode::Unavailable => "unavailable",
            StreamErrorCode::VersionSwitched => "version_switched",
            StreamErrorCode::LifetimeReached => "lifetime_reached",
        }
    }
}

struct Item {
    id: String,
    data: String,
}

impl Item {
    /// The memory the item holds while buffered (allocations, not lengths: a string built by
    /// serialisation may have up to twice its length allocated).
    fn held(&self) -> usize {
        std::mem::size_of::<Item>() + self.id.capacity() + self.data.capacity()
    }
}

pub async fn stream(
    State(state): State<ApiState>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    QueryPairs(pairs): QueryPairs,
) -> Result<Response, ApiError> {
    let params = Params::new(pairs, &PARAMS)?;
    // Watching from before the version is read: a switch from here on ends the stream.
    let switches = state.switches();
    let served = state.served();
    let r = resolve(&served, &caller, &params)?;
    let slot = state.stream_slots().acquire(caller.name.as_deref())?;
    let resume = resume_cursor(served.tag, &headers, &params)?;
    let (stream, first, last) = store::bounds(state.js(), &served.names.proj_stream).await?;
    let start = match resume {
        Some(c) if c.saturating_add(1) < first => return Err(expired(served.tag, first)),
        Some(c) if !super::events::issued_for(c, last) => {
            return Err(super::events::ahead(served.tag, first, last))
        }
        Some(c) => c.saturating_add(1),
        None => last.saturating_add(1),
    };
    let messages = open_consumer(&stream, &r.filters, start).await?;

    let limits = state.sse_limits();
    let (tx, rx) = mpsc::channel::<Item>(limits.buffer_events.max(1));
    let inflight = Arc::new(AtomicUsize::new(0));
    let ending: Arc<Mutex<Option<StreamErrorDetail>>> = Arc::new(Mutex::new(None));
    state.stats().sse_clients.fetch_add(1, Ordering::Relaxed);
    tokio::spawn(pump(
        messages,
        tx,
        inflight.clone(),
        ending.clone(),
        state.clone(),
        (served.clone(), switches),
        Reading {
            stream,
            filters: r.filters.clone(),
            sent: start.saturating_sub(1),
        },
    ));
    let body = Body {
        rx,
        inflight,
        ending,
        done: false,
        _slot: slot,
    };
    let events = futures::stream::unfold(body, Body::next_event);
    // A comment first, so the client (and any proxy) sees the stream open at once.
    let opening = futures::stream::once(async { Ok(Event::default().comment("stream open")) });
    Ok(Sse::new(opening.chain(events))
        .keep_alive(KeepAlive::new().interval(limits.keep_alive))
        .into_response())
}

/// Where to resume: `Last-Event-ID`, else `after` (both are checked). An empty one is no
/// cursor; anything else must be one.
fn resume_cursor(tag: u16, headers: &HeaderMap, params: &Params) -> Result<Option<u64>, ApiError> {
    let header_cursor = match headers.get("last-event-id").map(|v| v.to_str()) {
        None => None,
        Some(Ok(v)) => Some(v.to_string()).filter(|v| !v.is_empty()),
        Some(Err(_)) => return Err(bad_cursor()),
    };
    let after = params
        .one("after")?
        .filter(|c| !c.is_empty())
        .map(|c| decode_cursor(tag, &c))
        .transpose()?;
    match header_cursor {
        Some(c) => Ok(Some(decode_cursor(tag, &c)?)),
        None => Ok(after),
    }
}

/// An ordered consumer over the projection stream's `filters`, from `start`.
async fn open_consumer(
    stream: &async_nats::jetstream::stream::Stream,
    filters: &[String],
    start: u64,
) -> Result<consumer::pull::Ordered, ApiError> {
    let (filter_subject, filter_subjects) = match filters {
        [one] => (one.clone(), Vec::new()),
        many => (String::new(), many.to_vec()),
    };
    let ordered = stream
        .create_consumer(consumer::pull::OrderedConfig {
            filter_subject,
            filter_subjects,
            deliver_policy: consumer::DeliverPolicy::ByStartSequence {
                start_sequence: start.max(1),
            },
            // The client library pulls 500 messages at a time by default, whatever their size;
            // a smaller pull bounds what one stream has in flight besides its buffer.
            max_batch: PULL_BATCH,
            ..Default::default()
        })
        .await
        .map_err(|e| ApiError::unavailable("stream consumer", e))?;
    ordered
        .messages()
        .await
        .map_err(|e| ApiError::unavailable("stream consumer", e))
}

/// The response body's state: what the pump buffered, and how the stream ended.
struct Body {
    rx: mpsc::Receiver<Item>,
    inflight: Arc<AtomicUsize>,
    /// Why the stream ended and where to resume, once the reader has stopped.
    ending: Arc<Mutex<Option<StreamErrorDetail>>>,
    done: bool,
    // Held for as long as the response body lives.
    _slot: super::slots::Slot,
}

impl Body {
    /// The next SSE event: a buffered item, else (once) the `error` event saying why the stream
    /// ended and where to resume.
    async fn next_event(mut self) -> Option<(Result<Event, Infallible>, Body)> {
        if self.done {
            return None;
        }
        match self.rx.recv().await {
            Some(item) => {
                self.inflight.fetch_sub(item.held(), Ordering::Relaxed);
                let ev = Event::default().id(item.id).data(item.data);
                Some((Ok(ev), self))
            }
            None => {
                self.done = true;
                let error = self.ending.lock().ok().and_then(|mut e| e.take())?;
                let data = serde_json::to_string(&StreamError { error }).unwrap_or_default();
                let ev = Event::default().event("error").data(data);
                Some((Ok(ev), self))
            }
        }
    }
}

/// What a stream reads: the projection stream, its filters, and the last position handed to the
/// client (where it started, until an event is): every event buffered is sent before the final
/// one, so that is where the client resumes.
struct Reading {
    stream: async_nats::jetstream::stream::Stream,
    filters: Vec<String>,
    sent: u64,
}

/// The projection stream's last sequence, when nothing `filters` match was stored after `sent`:
/// a client resuming from there misses nothing, and its next stream does not read the same quiet
/// stretch again (on a stream that matches nothing for days, its cursor would otherwise age out
/// of the retention). `None` when something was, or the store did not answer within 5 s.
async fn quiet_through(
    stream: &async_nats::jetstream::stream::Stream,
    filters: &[String],
    sent: u64,
) -> Option<u64> {
    let look = async {
        // Read before the filters' last messages: anything stored later is past it.
        let last = stream.clone().info().await.ok()?.state.last_sequence;
        if last <= sent || filters.is_empty() {
            return None;
        }
        for filter in filters {
            match crate::bus::publish::last_from_leader(stream, filter).await {
                Ok(None) => {}
                Ok(Some(m)) if m.sequence <= sent => {}
                _ => return None,
            }
        }
        Some(last)
    };
    tokio::time::timeout(std::time::Duration::from_secs(5), look)
        .await
        .ok()
        .flatten()
}

/// Read the consumer into the client's buffer until the client goes, falls behind, the server
/// shuts down, the store fails, or the stream's lifetime is over.
async fn pump(
    mut messages: consumer::pull::Ordered,
    tx: mpsc::Sender<Item>,
    inflight: Arc<AtomicUsize>,
    ending: Arc<Mutex<Option<StreamErrorDetail>>>,
    state: ApiState,
    (served, mut switches): (Arc<Served>, watch::Receiver<Arc<Served>>),
    mut reading: Reading,
) {
    let limits = state.sse_limits();
    let shutdown = state.shutdown();
    let prefix = served.names.prefix.clone();
    let mut errors = 0u32;
    let lifetime = tokio::time::sleep(limits.lifetime);
    tokio::pin!(lifetime);
    let end = loop {
        let next = tokio::select! {
            _ = tx.closed() => break None,
            _ = shutdown.cancelled() => break None,
            () = &mut lifetime => break Some(Termination {
                code: StreamErrorCode::LifetimeReached,
                message: format!(
                    "the stream was open for http.sse_max_stream_lifetime ({} s); reconnect at once with Last-Event-ID (resumeFrom) to continue without loss",
                    limits.lifetime.as_secs()
                ),
            }),
            changed = switches.changed() => {
                if changed.is_err() || switches.borrow_and_update().tag == served.tag {
                    // The API is going away, or a switch back before this stream noticed.
                    if changed.is_err() {
                        break None;
                    }
                    continue;
                }
                break Some(Termination {
                    code: StreamErrorCode::VersionSwitched,
                    message: "the API now serves another projection version; reconnect without Last-Event-ID (this stream's cursors are positions in the version it left)".into(),
                });
            }
            m = messages.next() => m,
        };
        let m = match next {
            Some(Ok(m)) => {
                errors = 0;
                m
            }
            Some(Err(e)) => {
                errors += 1;
                debug!(error = %e, "event stream consumer error");
                if errors >= MAX_ERRORS {
                    warn!(error = %e, "event stream consumer keeps failing; closing the stream");
                    break Some(Termination {
                        code: StreamErrorCode::Unavailable,
                        message: "the event store stopped answering; reconnect with Last-Event-ID to resume".into(),
                    });
                }
                continue;
            }
            None => {
                break Some(Termination {
                    code: StreamErrorCode::Unavailable,
                    message:
                        "the event store closed the stream; reconnect with Last-Event-ID to resume"
                            .into(),
                })
            }
        };
        let Some(ev) = StoredEvent::from_message(&m) else {
            continue;
        };
        let data = serde_json::to_string(&ev.item(&prefix, served.tag)).unwrap_or_default();
        drop(m);
        let item = Item {
            id: encode_cursor(served.tag, ev.seq),
            data,
        };
        let seq = ev.seq;
        let len = item.held();
        let held = inflight.load(Ordering::Relaxed);
        let over_bytes = held > 0 && held + len > limits.buffer_bytes;
        if over_bytes {
            break Some(slow());
        }
        inflight.fetch_add(len, Ordering::Relaxed);
        match tx.try_send(item) {
            Ok(()) => reading.sent = seq,
            Err(mpsc::error::TrySendError::Full(_)) => break Some(slow()),
            Err(mpsc::error::TrySendError::Closed(_)) => break None,
        }
    };
    debug!(
        reason = end.as_ref().map_or("client gone", |t| t.code.as_str()),
        buffered_bytes = inflight.load(Ordering::Relaxed),
        "event stream reader stopped"
    );
    if let Some(t) = end {
        if t.code == StreamErrorCode::SlowConsumer {
            state.stats().sse_overflows.fetch_add(1, Ordering::Relaxed);
        }
        // A stream at its lifetime's end with nothing of its filters stored since the last
        // event sent resumes past that quiet stretch, so its cursor does not age out.
        let resume_after = match t.code {
            StreamErrorCode::LifetimeReached => {
                quiet_through(&reading.stream, &reading.filters, reading.sent)
                    .await
                    .unwrap_or(reading.sent)
            }
            _ => reading.sent,
        };
        let detail = StreamErrorDetail {
            code: t.code,
            message: t.message,
            resume_from: Some(encode_cursor(served.tag, resume_after)),
        };
        if let Ok(mut slot) = ending.lock() {
            *slot = Some(detail);
        }
    }
    state.stats().sse_clients.fetch_sub(1, Ordering::Relaxed);
    // Dropping `tx` ends the body after what is buffered; dropping `messages` stops the consumer.
}

fn slow() -> Termination {
    Termination {
        code: StreamErrorCode::SlowConsumer,
        message: "the client read events more slowly than they arrived and its buffer filled; reconnect with Last-Event-ID (resumeFrom) to continue without loss".into(),
    }
}
