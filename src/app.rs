//! The `run` command: connect, provision, start the partition workers and the HTTP endpoints,
//! and drain on cancellation (SIGTERM / Ctrl-C).

use crate::bus::{self, provision, worker};
use crate::config::Settings;
use crate::http::{self, HttpState};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{error, info, warn};

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error(transparent)]
    Connect(#[from] bus::ConnectError),
    #[error(transparent)]
    Provision(#[from] provision::ProvisionError),
    #[error(transparent)]
    Worker(#[from] worker::WorkerError),
    #[error("HTTP: cannot listen on {addr}: {source}")]
    Listen {
        addr: String,
        source: std::io::Error,
    },
}

/// What `run` hosts; each part can be switched off.
#[derive(Debug, Clone)]
pub struct RunOptions {
    pub workers: bool,
    pub http: bool,
    pub metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
}

/// A running instance, for callers (demo, tests) that need its pieces.
pub struct Running {
    pub client: async_nats::Client,
    pub js: async_nats::jetstream::Context,
    pub worker: Option<Arc<worker::Shared>>,
    pub http_addr: Option<std::net::SocketAddr>,
    tracker: TaskTracker,
}

impl Running {
    /// Wait until every task has drained after cancellation.
    pub async fn wait(self) {
        self.tracker.close();
        self.tracker.wait().await;
    }
}

/// Start everything and return at once; cancel `cancel` to stop, then [`Running::wait`].
pub async fn start(
    settings: Settings,
    opts: RunOptions,
    cancel: CancellationToken,
) -> Result<Running, AppError> {
    if settings.roles.main_agents.is_empty() {
        warn!("no main agents configured (roles.main_agents / --main-agents): only events with explicit session types or agent:<id>:main session keys can be conversation.main");
    }
    let (client, js) = bus::connect(
        &settings.nats.url,
        settings.nats.creds_file.as_deref(),
        settings.consumer.publish_window,
        "collab-projector",
    )
    .await?;
    info!(url = %settings.nats.url, server = %client.server_info().version, "connected");
    let report = provision::provision(&js, &settings).await?;
    if !report.created.is_empty() {
        info!(
            created = report.created.len(),
            "provisioned missing resources"
        );
    }
    let tracker = TaskTracker::new();
    let partitions = settings.nats.partitions;
    let shared = if opts.workers {
        let shared = worker::Shared::new(js.clone(), settings.clone()).await?;
        metrics::gauge!(crate::telemetry::PARTITIONS_OWNED).set(f64::from(partitions));
        for p in 0..partitions {
            let shared = shared.clone();
            let cancel = cancel.clone();
            tracker.spawn(async move {
                // A partition that fails to start (e.g. during a server restart) is retried.
                let mut backoff = Duration::from_millis(200);
                while !cancel.is_cancelled() {
                    match worker::run_partition(shared.clone(), p, cancel.clone()).await {
                        Ok(()) => break,
                        Err(e) => {
                            error!(error = %e, "partition failed; restarting");
                            tokio::select! {
                                _ = tokio::time::sleep(backoff) => {}
                                _ = cancel.cancelled() => break,
                            }
                            backoff = (backoff * 2).min(Duration::from_secs(5));
                        }
                    }
                }
            });
        }
        info!(partitions, "workers started");
        Some(shared)
    } else {
        None
    };
    let mut http_addr = None;
    if opts.http && settings.http.enabled {
        let listener = tokio::net::TcpListener::bind(&settings.http.addr)
            .await
            .map_err(|source| AppError::Listen {
                addr: settings.http.addr.clone(),
                source,
            })?;
        let addr = listener.local_addr().ok();
        http_addr = addr;
        let state = HttpState {
            worker: shared.as_ref().map(|s| s.state.clone()),
            client: Some(client.clone()),
            metrics: opts.metrics.clone(),
            expected_partitions: usize::from(partitions),
        };
        let router = http::router(state);
        let cancel = cancel.clone();
        tracker.spawn(async move {
            let serve = axum::serve(listener, router)
                .with_graceful_shutdown(async move { cancel.cancelled().await });
            if let Err(e) = serve.await {
                error!(error = %e, "HTTP server stopped");
            }
        });
        if let Some(a) = addr {
            info!(addr = %a, "HTTP listening");
        }
    }
    Ok(Running {
        client,
        js,
        worker: shared,
        http_addr,
        tracker,
    })
}
