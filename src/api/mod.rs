//! The projection HTTP API, for UIs that do not speak NATS (docs/contract.md section 7).
//!
//! - `GET /api/events`: filtered projections with cursors ([`events`]);
//! - `GET /api/events/stream`: the same as Server-Sent Events, resumable ([`stream`]);
//! - `GET /api/work-sessions`, `GET /api/work-sessions/{id}` (`?format=mplp`): grouped sessions
//!   ([`sessions`], [`mplp`]);
//! - `GET /api/blobs/{id}`: a large field moved out of a projection ([`blobs`]);
//! - `GET /api/threads/{key}`: one thread's runs and turns assembled ([`threads`]);
//! - `GET /api/tree/{key}`: the delegation tree below a thread, run or turn ([`tree`]);
//! - `GET /api/waiting`: the turns and runs waiting now ([`waiting`]);
//! - `GET /api/search`: events by agent, outcome, time and text ([`search`]);
//! - `GET /api/me`: the caller's grant and the roles it may read ([`me`]);
//! - `GET /api/openapi.json`: the OpenAPI 3.1 description ([`openapi`]);
//! - `GET /api/schemas`, `GET /api/schemas/{name}`: the JSON Schemas of the envelope, the
//!   payloads the processor writes and every API body ([`schemas`]).
//!
//! Everything is read from JetStream ([`store`]), never from a worker's memory, so any instance
//! serves any client. Access control ([`auth`]) applies to every route but the OpenAPI document and
//! the schemas; errors are JSON ([`error`]). What the handlers share is [`state`]; the
//! router here is the only thing that names the handlers. Event streams, work-session lists and
//! scans are capped per token and in total, and a scan is stopped at `http.scan_timeout`
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
pub mod search;
pub mod sessions;
pub mod slots;
pub mod state;
pub mod store;
pub mod stream;
pub mod threads;
pub mod tree;
pub mod waiting;

pub use auth::{check_bind, Caller, Grants};
pub use error::ApiError;
pub use query::QueryPairs;
pub use state::{ApiState, ApiStats, SseLimits};

use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, MethodRouter};
use axum::{middleware, Extension, Router};

async fn not_found() -> ApiError {
    ApiError::not_found("no such API endpoint; see /api/openapi.json")
}

/// Every API endpoint is read-only: another method gets a JSON error naming the one served.
async fn method_not_allowed() -> Response {
    let mut resp = ApiError::new(
        axum::http::StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "the API is read-only: use GET (see /api/openapi.json)",
    )
    .into_response();
    resp.headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
    resp
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

/// Name the projection version served in every protected response (`Collab-Projection-Version`,
/// empty for the deployment's own), so a client can tell a switch happened.
async fn served_version(
    axum::extract::State(state): axum::extract::State<ApiState>,
    mut resp: Response,
) -> Response {
    if let Ok(v) = HeaderValue::from_str(&state.names().version) {
        resp.headers_mut().insert(VERSION_HEADER, v);
    }
    resp
}

/// The response header that names the projection version served.
pub const VERSION_HEADER: &str = "collab-projection-version";

/// Around a scanning route: a place among the scans ([`Capped::SCANS`]) for the caller's grant,
/// and the scan stopped at `http.scan_timeout` (503 `scan_timeout`). A stopped scan's ephemeral
/// consumers expire on the server by themselves.
async fn scan_guard(
    State(state): State<ApiState>,
    Extension(caller): Extension<Caller>,
    request: Request,
    next: Next,
) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_default();
    slots::guarded(
        state.scan_slots(),
        state.scan_timeout(),
        caller.name.as_deref(),
        &route,
        next.run(request),
    )
    .await
}

/// A route that scans the projection stream (an event page counts and reads a range of it
/// too): capped and stopped by [`scan_guard`].
fn scan(route: MethodRouter<ApiState>, state: &ApiState) -> MethodRouter<ApiState> {
    route.layer(middleware::from_fn_with_state(state.clone(), scan_guard))
}

/// The API routes. Merge into the server's router: `http::router(..).merge(api::router(state))`.
pub fn router(state: ApiState) -> Router {
    let protected = Router::new()
        .route("/api/events", scan(get(events::list), &state))
        .route("/api/events/stream", get(stream::stream))
        .route("/api/work-sessions", get(sessions::list))
        .route("/api/work-sessions/{id}", get(sessions::one))
        .route("/api/threads/{key}", scan(get(threads::one), &state))
        .route("/api/search", scan(get(search::search), &state))
        .route("/api/tree/{key}", scan(get(tree::tree), &state))
        .route("/api/waiting", scan(get(waiting::waiting), &state))
        .route("/api/blobs/{id}", get(blobs::one))
        .route("/api/me", get(me::me))
        .route_layer(middleware::map_response_with_state(
            state.clone(),
            served_version,
        ))
        .route_layer(middleware::from_fn_with_state(
            state.shared_grants(),
            auth::require,
        ));
    Router::new()
        .route("/api/openapi.json", get(openapi::handler))
        .route("/api/schemas", get(schemas::index))
        .route("/api/schemas/{name}", get(schemas::one))
        .merge(protected)
        .route("/api", get(not_found))
        .route("/api/", get(not_found))
        .route("/api/{*rest}", get(not_found))
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::map_response(no_sniff_no_store))
        .with_state(state)
}
