//! The projection HTTP API, for UIs that do not speak NATS (docs/contract.md section 7).
//!
//! - `GET /api/events`: filtered projections with cursors ([`events`]);
//! - `GET /api/events/stream`: the same as Server-Sent Events, resumable ([`stream`]);
//! - `GET /api/work-sessions`, `GET /api/work-sessions/{id}` (`?format=mplp`): grouped sessions
//!   ([`sessions`], [`mplp`]);
//! - `GET /api/blobs/{id}`: a large field moved out of a projection ([`blobs`]);
//! - `GET /api/me`: the caller's grant and the roles it may read ([`me`]);
//! - `GET /api/openapi.json`: the OpenAPI 3.1 description ([`openapi`]);
//! - `GET /api/schemas`, `GET /api/schemas/{name}`: the JSON Schemas of the envelope, the
//!   payloads the processor writes and every API body ([`schemas`]).
//!
//! Everything is read from JetStream ([`store`]), never from a worker's memory, so any instance
//! serves any client. Access control ([`auth`]) applies to every route but the OpenAPI document and
//! the schemas; errors are JSON ([`error`]). Event streams are capped per token and in total
//! ([`slots`]). Every response, errors included, is sent with `X-Content-Type-Options: nosniff`
//! and `Cache-Control: no-store`: bodies are data for the caller's eyes only, never to be
//! sniffed into something else or kept by a cache.

pub mod auth;
pub mod blobs;
pub mod error;
pub mod events;
pub mod me;
pub mod mplp;
pub mod openapi;
pub mod query;
pub mod schemas;
pub mod sessions;
pub mod slots;
pub mod store;
pub mod stream;

pub use auth::{check_bind, Caller, Grants};
pub use error::ApiError;

use crate::config::{HttpSettings, Names};
use async_nats::jetstream::{self, kv, object_store::ObjectStore};
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{header, HeaderValue};
use axum::response::Response;
use axum::routing::get;
use axum::{middleware, Router};
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;

/// Per-client bounds of the event stream.
#[derive(Debug, Clone, Copy)]
pub struct SseLimits {
    /// Events buffered for a client before it counts as too slow.
    pub buffer_events: usize,
    /// Bytes buffered for a client before it counts as too slow.
    pub buffer_bytes: usize,
    /// Keep-alive comment interval.
    pub keep_alive: Duration,
}

impl Default for SseLimits {
    fn default() -> Self {
        SseLimits::from_settings(&HttpSettings::default())
    }
}

impl SseLimits {
    /// The limits `http.sse_buffer_events` and `http.sse_buffer_bytes` set.
    pub fn from_settings(http: &HttpSettings) -> SseLimits {
        SseLimits {
            buffer_events: http.sse_buffer_events,
            buffer_bytes: http.sse_buffer_bytes,
            keep_alive: Duration::from_secs(15),
        }
    }
}

/// Counters of the API, for tests and the demo.
#[derive(Debug, Default)]
pub struct ApiStats {
    /// Event streams open now.
    pub sse_clients: AtomicUsize,
    /// Event streams closed because their client was too slow.
    pub sse_overflows: AtomicU64,
}

/// What the handlers share. Cheap to clone.
#[derive(Clone)]
pub struct ApiState {
    js: jetstream::Context,
    names: Arc<Names>,
    grants: Arc<Grants>,
    quiet_after: Duration,
    archive_after: Duration,
    sse: SseLimits,
    slots: Arc<slots::StreamSlots>,
    shutdown: CancellationToken,
    sessions: Arc<OnceCell<kv::Store>>,
    blobs: Arc<OnceCell<ObjectStore>>,
    stats: Arc<ApiStats>,
}

impl ApiState {
    /// The API over `js`, with the tokens and session periods of `http`.
    pub fn new(js: jetstream::Context, names: Names, http: &HttpSettings) -> ApiState {
        ApiState {
            js,
            names: Arc::new(names),
            grants: Arc::new(Grants::new(http)),
            quiet_after: http.quiet_after,
            archive_after: http.archive_after,
            sse: SseLimits::from_settings(http),
            slots: Arc::new(slots::StreamSlots::new(
                http.sse_max_streams,
                http.sse_max_streams_per_token,
            )),
            shutdown: CancellationToken::new(),
            sessions: Arc::new(OnceCell::new()),
            blobs: Arc::new(OnceCell::new()),
            stats: Arc::new(ApiStats::default()),
        }
    }

    /// End open event streams when `token` is cancelled, so a graceful shutdown is not held up
    /// by clients that never disconnect.
    pub fn with_shutdown(mut self, token: CancellationToken) -> ApiState {
        self.shutdown = token;
        self
    }

    pub fn with_sse_limits(mut self, limits: SseLimits) -> ApiState {
        self.sse = limits;
        self
    }

    pub fn js(&self) -> &jetstream::Context {
        &self.js
    }
    pub fn names(&self) -> &Names {
        &self.names
    }
    pub fn grants(&self) -> &Grants {
        &self.grants
    }
    pub fn quiet_after(&self) -> Duration {
        self.quiet_after
    }
    pub fn archive_after(&self) -> Duration {
        self.archive_after
    }
    pub fn sse_limits(&self) -> SseLimits {
        self.sse
    }
    pub fn stream_slots(&self) -> &Arc<slots::StreamSlots> {
        &self.slots
    }
    pub fn shutdown(&self) -> &CancellationToken {
        &self.shutdown
    }
    pub fn stats(&self) -> &ApiStats {
        &self.stats
    }

    /// The work-session bucket, looked up once.
    pub async fn sessions_kv(&self) -> Result<&kv::Store, ApiError> {
        self.sessions
            .get_or_try_init(|| async {
                self.js
                    .get_key_value(&self.names.sessions_bucket)
                    .await
                    .map_err(|e| ApiError::unavailable("work-session bucket", e))
            })
            .await
    }

    /// The object store of offloaded fields, looked up once.
    pub async fn blobs_store(&self) -> Result<&ObjectStore, ApiError> {
        self.blobs
            .get_or_try_init(|| async {
                self.js
                    .get_object_store(&self.names.blobs_store)
                    .await
                    .map_err(|e| ApiError::unavailable("object store", e))
            })
            .await
    }
}

/// Query pairs, with a JSON error for a malformed query string.
pub struct QueryPairs(pub Vec<(String, String)>);

impl<S: Send + Sync> FromRequestParts<S> for QueryPairs {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        axum::extract::Query::<Vec<(String, String)>>::from_request_parts(parts, state)
            .await
            .map(|q| QueryPairs(q.0))
            .map_err(|_| {
                ApiError::bad_request("bad_query", "the query string is not valid URL encoding")
            })
    }
}

async fn not_found() -> ApiError {
    ApiError::not_found("no such API endpoint; see /api/openapi.json")
}

/// Mark every API response as not to be sniffed nor stored.
async fn no_sniff_no_store(mut resp: Response) -> Response {
    let h = resp.headers_mut();
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

/// The API routes. Merge into the server's router: `http::router(..).merge(api::router(state))`.
pub fn router(state: ApiState) -> Router {
    let protected = Router::new()
        .route("/api/events", get(events::list))
        .route("/api/events/stream", get(stream::stream))
        .route("/api/work-sessions", get(sessions::list))
        .route("/api/work-sessions/{id}", get(sessions::one))
        .route("/api/blobs/{id}", get(blobs::one))
        .route("/api/me", get(me::me))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth::require));
    Router::new()
        .route("/api/openapi.json", get(openapi::handler))
        .route("/api/schemas", get(schemas::index))
        .route("/api/schemas/{name}", get(schemas::one))
        .merge(protected)
        .route("/api", get(not_found))
        .route("/api/{*rest}", get(not_found))
        .layer(middleware::map_response(no_sniff_no_store))
        .with_state(state)
}
