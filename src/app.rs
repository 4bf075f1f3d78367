//! The `run` command: connect, provision, start the partition workers and the HTTP endpoints,
//! and drain on cancellation (SIGTERM / Ctrl-C).

use crate::api;
use crate::bus::context::WorkerContext;
use crate::bus::stats::WorkerState;
use crate::bus::{self, leases, provision};
use crate::config::Settings;
use crate::http::{self, HttpState};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{error, info, warn};

/// `<host>-<pid>-<random>`: unique per process, readable in logs and in the leases bucket.
fn default_worker_id() -> String {
    let host = std::fs::read_to_string("/etc/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty() && crate::model::is_key_token(h))
        .unwrap_or_else(|| "worker".to_string());
    format!(
        "{host}-{}-{:04x}",
        std::process::id(),
        rand::random::<u16>()
    )
}

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error(transparent)]
    Connect(#[from] bus::ConnectError),
    #[error(transparent)]
    Provision(#[from] provision::ProvisionError),
    #[error(transparent)]
    Worker(#[from] bus::error::WorkerError),
    #[error("HTTP: {0}")]
    Refused(String),
    #[error("{}", listen_text(addr, source))]
    Listen {
        addr: String,
        source: std::io::Error,
    },
    /// SIGTERM / Ctrl-C came while waiting for NATS: nothing was started.
    #[error("stopped before NATS answered")]
    Stopped,
    /// Settings that can be checked before connecting, and are wrong.
    #[error("{0}")]
    Settings(String),
}

/// A refused HTTP address, with the flag that changes it.
fn listen_text(addr: &str, source: &std::io::Error) -> String {
    if source.kind() == std::io::ErrorKind::AddrInUse {
        format!(
            "HTTP address {addr} is already in use (another collab-projector on this machine?): give this process its own with --http-addr (e.g. --http-addr 127.0.0.1:8081, or 127.0.0.1:0 for any free port), or start it with --no-http (an extra worker needs no HTTP)"
        )
    } else {
        format!("HTTP: cannot listen on {addr} (--http-addr / http.addr): {source}")
    }
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
    /// Kept alive for `$SRV.PING` / `$SRV.INFO` / `$SRV.STATS` discovery.
    _service: Option<async_nats::service::Service>,
    pub client: async_nats::Client,
    pub js: async_nats::jetstream::Context,
    pub worker: Option<Arc<WorkerContext>>,
    pub http_addr: Option<std::net::SocketAddr>,
    tracker: TaskTracker,
}

impl Running {
    /// Wait until every task has drained after cancellation.
    pub async fn wait(self) {
        self.tracker.close();
        self.tracker.wait().await;
        // Acknowledgements are written asynchronously: make sure the last ones reach the server
        // before the process exits, or their messages would be redelivered.
        match tokio::time::timeout(std::time::Duration::from_secs(5), self.client.flush()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => warn!(error = %e, "flushing the last acknowledgements failed"),
            Err(_) => warn!("flushing the last acknowledgements timed out (server unreachable?)"),
        }
    }
}

/// Cancelled on the first Ctrl-C or SIGTERM; its handlers are installed by
/// [`catch_shutdown_signals`].
static SHUTDOWN: std::sync::OnceLock<CancellationToken> = std::sync::OnceLock::new();

/// Install the handlers of Ctrl-C and SIGTERM (the signals that stop `run`, `demo` and `bench`)
/// now, within a Tokio runtime: a signal from here on is kept for [`shutdown_signal`], so one
/// that comes while the process is still starting (loading its settings, connecting) stops it
/// cleanly instead of ending it by the signal's default action. Called again, it installs
/// nothing more. The token cancelled by the first signal.
pub fn catch_shutdown_signals() -> &'static CancellationToken {
    SHUTDOWN.get_or_init(|| {
        let token = CancellationToken::new();
        let fired = token.clone();
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            // Installed here, before the task below first runs; a signal whose handler cannot
            // be installed is waited for never.
            let received = |kind| {
                let stream = signal(kind);
                async move {
                    match stream {
                        Ok(mut s) => {
                            s.recv().await;
                        }
                        Err(_) => std::future::pending::<()>().await,
                    }
                }
            };
            let (term, int) = (
                received(SignalKind::terminate()),
                received(SignalKind::interrupt()),
            );
            tokio::spawn(async move {
                tokio::select! {
                    _ = term => {}
                    _ = int => {}
                }
                fired.cancel();
            });
        }
        #[cfg(not(unix))]
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                fired.cancel();
            }
        });
        token
    })
}

/// Resolves on the first Ctrl-C or SIGTERM since [`catch_shutdown_signals`] (called here if it
/// was not yet).
pub async fn shutdown_signal() {
    catch_shutdown_signals().cancelled().await;
}

/// Start everything and return at once; cancel `cancel` to stop, then [`Running::wait`].
///
/// While NATS does not answer, waits for it (a line every few attempts), until `cancel`
/// ([`AppError::Stopped`]); refused credentials, TLS, an old server or a missing JetStream stop
/// at once, as waiting would not change them.
pub async fn start(
    mut settings: Settings,
    opts: RunOptions,
    cancel: CancellationToken,
) -> Result<Running, AppError> {
    if settings
        .roles
        .main_agents
        .iter()
        .all(|a| a.trim().is_empty())
    {
        warn!("no main agents configured (roles.main_agents / --main-agents): only events with explicit session types or agent:<id>:main session keys can be conversation.main");
    }
    // Settings wrong in a way no server changes stop the process before it connects (the
    // workers resolve them again when they start).
    if opts.workers {
        crate::otel::resolve(&settings.otel, |k| std::env::var(k).ok())
            .map_err(|e| AppError::Settings(format!("the OpenTelemetry export settings: {e}")))?;
    }
    // Bind first: a taken or refused address stops the process before it connects or takes
    // any partition.
    let listener = if opts.http && settings.http.enabled {
        Some(bind(&settings).await?)
    } else {
        None
    };
    let (client, js) = connect_waiting(&settings, &cancel).await?;
    info!(url = %settings.nats.url, server = %client.server_info().version, "connected");
    provision::adopt_layout(&js, &mut settings).await?;
    let report = provision::provision(&js, &settings).await?;
    if !report.created.is_empty() {
        info!(
            created = report.created.len(),
            "provisioned missing resources"
        );
    }
    let tracker = TaskTracker::new();
    let worker_id = settings
        .workers
        .id
        .clone()
        .unwrap_or_else(default_worker_id);
    let shared = if opts.workers {
        Some(start_workers(&js, &settings, &worker_id, &tracker, &cancel).await?)
    } else {
        None
    };
    // Registered before HTTP reports it is listening: once the process says it is up, `nats micro`
    // and `$SRV.PING` find it.
    let reporter = Reporter {
        worker_id,
        client: client.clone(),
        state: shared.as_ref().map(|s| s.state.clone()),
        started: std::time::Instant::now(),
    };
    let service = start_service(&client, reporter, &tracker, cancel.clone()).await;
    let mut running = Running {
        _service: service,
        client,
        js,
        worker: shared,
        http_addr: None,
        tracker,
    };
    if let Some(listener) = listener {
        running.http_addr = serve_http(listener, &running, &settings, &opts, &cancel);
    }
    Ok(running)
}

/// The worker's shared context, and the lease loop that takes and hands back its partitions.
async fn start_workers(
    js: &async_nats::jetstream::Context,
    settings: &Settings,
    worker_id: &str,
    tracker: &TaskTracker,
    cancel: &CancellationToken,
) -> Result<Arc<WorkerContext>, AppError> {
    let shared = WorkerContext::new(js.clone(), settings.clone()).await?;
    let names = settings.names();
    let store = shared
        .leases_side
        .js
        .get_key_value(&names.leases_bucket)
        .await
        .map_err(|e| {
            bus::error::WorkerError::setup(0, format!("leases bucket {}", names.leases_bucket), e)
        })?;
    let partitions = settings.nats.partitions;
    info!(worker = %worker_id, partitions, "worker started; taking its share of the partitions");
    tracker.spawn_on(
        leases::run(shared.clone(), store, worker_id.to_string(), cancel.clone()),
        &shared.leases_side.rt.handle,
    );
    tracker.spawn(bus::storage::sample(
        js.clone(),
        settings.clone(),
        shared.state.clone(),
        shared.publisher.clone(),
        cancel.clone(),
    ));
    Ok(shared)
}

/// Serve health, readiness, metrics and (when enabled) the API and the viewer on `listener`
/// until `cancel`; returns the address served.
fn serve_http(
    listener: tokio::net::TcpListener,
    running: &Running,
    settings: &Settings,
    opts: &RunOptions,
    cancel: &CancellationToken,
) -> Option<std::net::SocketAddr> {
    let addr = listener.local_addr().ok();
    let state = HttpState {
        worker: running.worker.as_ref().map(|s| s.state.clone()),
        client: Some(running.client.clone()),
        metrics: opts.metrics.clone(),
        stall_after: settings.http.stall_after,
    };
    let mut router = http::router(state);
    if settings.http.api {
        // Settings are validated at load, the price table with them.
        let prices = settings.prices().unwrap_or_default();
        let api_state = api::ApiState::new(running.js.clone(), settings.names(), &settings.http)
            .with_prices(prices)
            .with_shutdown(cancel.clone());
        if settings.nats.version.is_empty() {
            // The deployment's API serves the version the control bucket names (a version's own
            // workers serve theirs).
            running.tracker.spawn(crate::served::follow(
                running.js.clone(),
                settings.names(),
                api_state.served_sender(),
                cancel.clone(),
            ));
        }
        router = router.merge(api::router(api_state));
        if settings.http.viewer {
            router = router.merge(crate::viewer::router());
        }
    }
    let cancel = cancel.clone();
    let listener = http::stall_bounded(listener, settings.http.client_stall_timeout);
    running.tracker.spawn(async move {
        let serve = axum::serve(listener, router)
            .with_graceful_shutdown(async move { cancel.cancelled().await });
        if let Err(e) = serve.await {
            error!(error = %e, "HTTP server stopped");
        }
    });
    if let Some(a) = addr {
        info!(addr = %a, "HTTP listening");
    }
    addr
}

/// Listen on `http.addr`, refusing an address the access settings do not allow.
async fn bind(settings: &Settings) -> Result<tokio::net::TcpListener, AppError> {
    let listen = |source| AppError::Listen {
        addr: settings.http.addr.clone(),
        source,
    };
    let l = tokio::net::TcpListener::bind(&settings.http.addr)
        .await
        .map_err(listen)?;
    let bound = l.local_addr().map_err(listen)?;
    api::check_bind(&bound, &settings.http).map_err(AppError::Refused)?;
    Ok(l)
}

/// Connect, waiting with backoff while no server answers (a worker started before NATS, or
/// during a NATS restart, comes up by itself once it does).
async fn connect_waiting(
    settings: &Settings,
    cancel: &CancellationToken,
) -> Result<(async_nats::Client, async_nats::jetstream::Context), AppError> {
    let mut retry = bus::Retry::new(
        std::time::Duration::from_millis(250),
        std::time::Duration::from_secs(5),
    );
    let mut attempts = 0u32;
    loop {
        let attempt = tokio::select! {
            r = bus::connect_as(settings, "collab-projector") => r,
            _ = cancel.cancelled() => return Err(AppError::Stopped),
        };
        match attempt {
            Ok(pair) => return Ok(pair),
            // Only a server that does not answer is waited for; what waiting cannot fix (an
            // unparsable URL, refused credentials, TLS, an old server) is reported at once.
            Err(e @ bus::ConnectError::Connect { .. }) => {
                attempts += 1;
                // The first failure, then one line every ten: a clear message, not a flood.
                if attempts % 10 == 1 {
                    warn!(error = %e, attempts, "waiting for NATS; retrying until it answers (Ctrl-C / SIGTERM stops)");
                }
            }
            Err(e) => return Err(e.into()),
        }
        if !retry.wait(cancel).await {
            return Err(AppError::Stopped);
        }
    }
}

/// What the service API reports of this process.
#[derive(Clone)]
struct Reporter {
    worker_id: String,
    client: async_nats::Client,
    state: Option<Arc<WorkerState>>,
    started: std::time::Instant,
}

impl Reporter {
    fn status(&self) -> crate::telemetry::WorkerStatus {
        use std::sync::atomic::Ordering::Relaxed;
        let now = crate::bus::now_ms();
        let connected = crate::http::connected(Some(&self.client));
        let mut status = crate::telemetry::WorkerStatus {
            worker_id: self.worker_id.clone(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            uptime_ms: u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX),
            ready: crate::http::ready(Some(&self.client), self.state.as_deref()),
            nats_connected: connected,
            workers: self.state.is_some(),
            ..Default::default()
        };
        if let Some(w) = &self.state {
            let last = w.last_processed_ms.load(Relaxed);
            status.partitions_owned = w.partitions_owned.load(Relaxed);
            status.partitions_running = w.partitions_running.load(Relaxed);
            status.partitions = w.partition_status(now);
            status.inputs = w.inputs.load(Relaxed);
            status.projected = w.projected.load(Relaxed);
            status.dead_lettered = w.dead_lettered.load(Relaxed);
            status.redeliveries = w.redeliveries.load(Relaxed);
            status.publish_retries = w.publish_retries.load(Relaxed);
            status.lease_renewals = w.lease_renewals.load(Relaxed);
            status.lease_losses = w.lease_losses.load(Relaxed);
            status.takeovers = w.takeovers.load(Relaxed);
            status.open_turns = w.open_turns.load(Relaxed);
            status.last_processed_age_ms =
                (last > 0).then(|| u64::try_from(now.saturating_sub(last)).unwrap_or(0));
            if let Ok(fills) = w.storage.lock() {
                status.storage = fills.values().cloned().collect();
            }
            status.session_fold = w.fold_status();
        }
        status
    }

    fn json(&self) -> serde_json::Value {
        serde_json::to_value(self.status()).unwrap_or(serde_json::Value::Null)
    }
}

/// Register with the NATS service API, so `nats micro ls` / `$SRV.PING` find every instance, and
/// answer `collab-projector.status` requests with the worker's counters.
async fn start_service(
    client: &async_nats::Client,
    reporter: Reporter,
    tracker: &TaskTracker,
    cancel: CancellationToken,
) -> Option<async_nats::service::Service> {
    use async_nats::service::ServiceExt;
    use futures::StreamExt;
    let stats = reporter.clone();
    let service = match client
        .service_builder()
        .description(
            "collab-projector: role-partitioned, turn-checked projections of collaboration events",
        )
        .stats_handler(move |_, _| stats.json())
        .start("collab-projector", env!("CARGO_PKG_VERSION"))
        .await
    {
        Ok(s) => s,
        Err(e) => {
            warn!(error = %e, "NATS service API registration failed; discovery via $SRV is off");
            return None;
        }
    };
    match service.endpoint("collab-projector.status").await {
        Ok(mut endpoint) => {
            tracker.spawn(async move {
                loop {
                    tokio::select! {
                        _ = cancel.cancelled() => break,
                        req = endpoint.next() => {
                            let Some(req) = req else { break };
                            let body = reporter.json().to_string();
                            let _ = req.respond(Ok(body.into())).await;
                        }
                    }
                }
            });
        }
        Err(e) => warn!(error = %e, "status endpoint registration failed"),
    }
    // The service's subscriptions are sent, not yet known to be in place: a request from
    // another connection right after the process says it is up could find no responder. A
    // flush returns once the server has read everything sent before it.
    if let Err(e) = client.flush().await {
        warn!(error = %e, "the service API's subscriptions were not confirmed by the server");
    }
    Some(service)
}
