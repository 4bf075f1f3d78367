//! The operational HTTP endpoints: `/healthz` (not wedged: no partition has had messages
//! waiting for `http.stall_after` without progress), `/readyz` (connected, and consuming every
//! owned partition), `/metrics` (Prometheus text).

use crate::bus::stats::WorkerState;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use metrics_exporter_prometheus::PrometheusHandle;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::telemetry;

#[derive(Clone)]
pub struct HttpState {
    pub worker: Option<Arc<WorkerState>>,
    pub client: Option<async_nats::Client>,
    pub metrics: Option<PrometheusHandle>,
    /// `http.stall_after`.
    pub stall_after: Duration,
}

/// `listener`, with each accepted connection closed by the kernel once what it sends has waited
/// `stall` on a client that takes nothing: unacknowledged, or held back by a receive window at
/// zero (`TCP_USER_TIMEOUT`, `http.client_stall_timeout`). Without it, a response body the
/// client stopped reading (an event stream ended `slow_consumer`) is kept, with its place among
/// the capped streams and its buffer, until the client closes the socket, which it need never
/// do. An idle connection sends nothing and is not affected. A zero window is covered from
/// Linux 5.11; elsewhere than on Linux the listener is returned as it is.
pub fn stall_bounded(
    listener: tokio::net::TcpListener,
    stall: Duration,
) -> impl axum::serve::Listener<Io = tokio::net::TcpStream, Addr = std::net::SocketAddr> {
    use axum::serve::ListenerExt;
    listener.tap_io(move |tcp| {
        #[cfg(any(target_os = "linux", target_os = "android"))]
        if let Err(e) = socket2::SockRef::from(&*tcp).set_tcp_user_timeout(Some(stall)) {
            tracing::warn!(error = %e, "TCP_USER_TIMEOUT not set on an HTTP connection: a client that stops reading keeps its connection (http.client_stall_timeout)");
        }
        #[cfg(not(any(target_os = "linux", target_os = "android")))]
        let _ = (tcp, stall);
    })
}

pub fn router(state: HttpState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(state)
}

fn code(ok: bool) -> StatusCode {
    if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

/// Whether `client` is connected to NATS now.
pub fn connected(client: Option<&async_nats::Client>) -> bool {
    client.is_some_and(|c| c.connection_state() == async_nats::connection::State::Connected)
}

/// Whether the worker is ready: connected, and consuming every partition it owns (owning none
/// is fine: others do).
pub fn ready(client: Option<&async_nats::Client>, worker: Option<&WorkerState>) -> bool {
    connected(client)
        && worker.is_none_or(|w| {
            w.partitions_running.load(Ordering::Relaxed)
                >= w.partitions_owned.load(Ordering::Relaxed)
        })
}

async fn healthz(State(s): State<HttpState>) -> impl IntoResponse {
    // Stalled while disconnected is the server's outage, not this process's: a restart would not
    // help, so only a connected worker can be wedged.
    let connected = connected(s.client.as_ref());
    let stalled = match (&s.worker, connected) {
        (Some(w), true) => w.stalled(crate::bus::now_ms(), s.stall_after),
        _ => Vec::new(),
    };
    let healthy = stalled.is_empty();
    let body = Json(serde_json::json!({
        "healthy": healthy,
        "stalledPartitions": stalled,
        "stallAfterSeconds": s.stall_after.as_secs(),
    }));
    (code(healthy), body)
}

async fn readyz(State(s): State<HttpState>) -> impl IntoResponse {
    let connected = connected(s.client.as_ref());
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
    let ready = ready(s.client.as_ref(), s.worker.as_deref());
    let body = Json(serde_json::json!({
        "ready": ready,
        "natsConnected": connected,
        "partitionsRunning": running,
        "partitionsOwned": owned,
    }));
    (code(ready), body)
}

async fn metrics(State(s): State<HttpState>) -> impl IntoResponse {
    match s.metrics {
        Some(h) => {
            // Gauges of "now", set when scraped.
            let ready = ready(s.client.as_ref(), s.worker.as_deref());
            metrics::gauge!(telemetry::READY).set(if ready { 1.0 } else { 0.0 });
            if let Some(w) = &s.worker {
                let last = w.last_processed_ms.load(Ordering::Relaxed);
                if last > 0 {
                    let age = crate::bus::now_ms().saturating_sub(last).max(0);
                    metrics::gauge!(telemetry::LAST_PROCESSED_AGE).set(age as f64 / 1000.0);
                }
            }
            (StatusCode::OK, h.render())
        }
        None => (
            StatusCode::NOT_FOUND,
            "metrics are not enabled\n".to_string(),
        ),
    }
}
