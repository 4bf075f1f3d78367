//! The operational HTTP endpoints: `/healthz` (the process runs), `/readyz` (connected and
//! owning its partitions), `/metrics` (Prometheus text).

use crate::bus::worker::WorkerState;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use metrics_exporter_prometheus::PrometheusHandle;
use std::sync::atomic::Ordering;
use std::sync::Arc;

#[derive(Clone)]
pub struct HttpState {
    pub worker: Option<Arc<WorkerState>>,
    pub client: Option<async_nats::Client>,
    pub metrics: Option<PrometheusHandle>,
}

pub fn router(state: HttpState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(state)
}

async fn readyz(State(s): State<HttpState>) -> impl IntoResponse {
    let connected = s
        .client
        .as_ref()
        .is_some_and(|c| c.connection_state() == async_nats::connection::State::Connected);
    let (owned, running) = s
        .worker
        .as_ref()
        .map(|w| {
            (
                w.partitions_owned.load(Ordering::Relaxed),
                w.partitions_running.load(Ordering::Relaxed),
            )
        })
        .unwrap_or((0, 0));
    // A worker is ready once every partition it owns runs (owning none is fine: others do).
    let ready = connected && running >= owned;
    let body = Json(serde_json::json!({
        "ready": ready,
        "natsConnected": connected,
        "partitionsRunning": running,
        "partitionsOwned": owned,
    }));
    let code = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, body)
}

async fn metrics(State(s): State<HttpState>) -> impl IntoResponse {
    match s.metrics {
        Some(h) => (StatusCode::OK, h.render()),
        None => (
            StatusCode::NOT_FOUND,
            "metrics are not enabled\n".to_string(),
        ),
    }
}
