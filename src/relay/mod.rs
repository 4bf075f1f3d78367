//! The `relay` command: an HTTP reverse proxy in front of one A2A or AG-UI agent that puts the
//! traffic it forwards onto the raw stream, because no A2A or AG-UI product publishes to NATS.
//!
//! Every request goes to the upstream agent as it came (hop-by-hop headers aside) and every answer
//! comes back as the agent sent it, SSE frames as they arrive. Beside that, each request body,
//! response body and SSE frame becomes one raw message (docs/contract.md sections 2a and 2b), handed to a
//! bounded queue that a publisher task serves; when NATS is slow or away the queue fills and
//! messages are dropped and counted, and the exchange is never slowed or failed by it.
//!
//! An exchange is published only once the agent has accepted it (a 2xx status): what a caller
//! sends that the agent refuses, and what the relay refuses itself (a path outside the agent's
//! base, a caller it cannot name, a caller over its rate), reaches the bus in no form. The
//! relay, not the bodies, says which side spoke: the request is the caller's, every answer the
//! agent's (`Collab-Direction`).
//!
//! - `wire`: the pure reading of the traffic: methods, keys, SSE framing, hop-by-hop headers,
//!   paths.
//! - `trust`: who the caller is, and its rate limit.
//! - `publisher`: the queue, the background connection and the JetStream publishes.

mod publisher;
pub mod trust;
pub mod wire;

pub use publisher::DropReason;
pub use wire::Protocol;

use crate::config::Settings;
use crate::model::encode_id;
use crate::telemetry;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use bytes::{Bytes, BytesMut};
use futures::{Stream, StreamExt};
use metrics_exporter_prometheus::PrometheusHandle;
use publisher::{Outgoing, PublisherOptions, Queue, Shared};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};
use wire::{Frame, Kind, SseParser};

/// Headers the relay sets on the messages it publishes: the names the projector reads them by.
pub mod headers {
    use crate::ingest::RelayHeaders;
    pub const FROM_AGENT: &str = RelayHeaders::FROM_AGENT;
    pub const TO_AGENT: &str = RelayHeaders::TO_AGENT;
    pub const EXCHANGE: &str = RelayHeaders::EXCHANGE;
    pub const A2A_METHOD: &str = RelayHeaders::A2A_METHOD;
    pub const RUN_ID: &str = RelayHeaders::RUN_ID;
    pub const DIRECTION: &str = RelayHeaders::DIRECTION;
}

/// How one relay runs.
#[derive(Debug, Clone)]
pub struct RelayOptions {
    pub protocol: Protocol,
    /// Where the proxy listens; every path on it belongs to the agent.
    pub listen: String,
    /// The agent's base URL; a request's path and query are appended to its path.
    pub upstream: reqwest::Url,
    /// The caller's agent id (fixed mode), or the one a trusted proxy's request without
    /// `from_agent_header` gets (header mode). Not allowed with `caller_tokens`.
    pub from_agent: Option<String>,
    /// The agent behind this relay.
    pub to_agent: String,
    /// A request header naming the caller's agent id, set by an authenticating proxy; only with
    /// `trust_header_from`.
    pub from_agent_header: Option<HeaderName>,
    /// The peers (the authenticating proxies) whose connections header mode serves.
    pub trust_header_from: Vec<ipnet::IpNet>,
    /// A token file (`AGENT_ID TOKEN` lines): each caller presents its token in
    /// `Proxy-Authorization: Bearer <token>`.
    pub caller_tokens: Option<std::path::PathBuf>,
    /// The requests each caller may make, sustained; `None`: no limit.
    pub rate_limit: Option<trust::Rate>,
    /// Requests a caller may make at once before the rate applies.
    pub rate_burst: u32,
    /// Request body bytes each caller may send, per second sustained; 0: no byte budget.
    pub rate_limit_bytes: u32,
    /// Request body bytes a caller may send at once before `rate_limit_bytes` applies; at least
    /// `max_message_bytes`.
    pub rate_limit_bytes_burst: u32,
    /// Messages waiting for the publisher; past that they are dropped.
    pub queue_size: usize,
    /// Payload bytes waiting for the publisher or being published; past that new messages are
    /// dropped.
    pub queue_bytes: usize,
    /// The largest body or frame published; larger ones are forwarded, not published.
    pub max_message_bytes: usize,
    /// Where `/metrics`, `/healthz` and `/readyz` are served; `None`: nowhere.
    pub http_addr: Option<String>,
    /// How long to wait for the upstream to accept a connection.
    pub connect_timeout: Duration,
    /// After a stop: how long open exchanges may take to finish, and then how long queued
    /// messages may take to be published.
    pub drain_timeout: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("relay: cannot listen on {addr}: {source}")]
    Listen {
        addr: String,
        source: std::io::Error,
    },
    #[error("relay: {0}")]
    Invalid(String),
    #[error("relay: cannot build the HTTP client for the upstream: {0}")]
    Client(String),
}

/// A running relay.
pub struct RunningRelay {
    /// Where the proxy listens.
    pub addr: SocketAddr,
    /// Where `/metrics` is served.
    pub http_addr: Option<SocketAddr>,
    server: tokio::task::JoinHandle<()>,
    tracker: TaskTracker,
    exchanges: TaskTracker,
    cut: CancellationToken,
    publisher_stop: CancellationToken,
    cancel: CancellationToken,
    drain_timeout: Duration,
}

impl RunningRelay {
    /// After `cancel` fires: let open exchanges finish for up to the drain time, then publish
    /// what is queued (for up to the drain time again) and return.
    pub async fn wait(mut self) {
        self.cancel.cancelled().await;
        if tokio::time::timeout(self.drain_timeout, &mut self.server)
            .await
            .is_err()
        {
            warn!(
                drain_timeout = ?self.drain_timeout,
                "exchanges still open after the drain time are cut off"
            );
            self.server.abort();
        }
        // Exchanges whose callers left may still be reading their answers; they get the drain
        // time too, then stop.
        self.exchanges.close();
        if tokio::time::timeout(self.drain_timeout, self.exchanges.wait())
            .await
            .is_err()
        {
            warn!(
                drain_timeout = ?self.drain_timeout,
                "answers still being read after the drain time are cut off"
            );
            self.cut.cancel();
            self.exchanges.wait().await;
        }
        self.publisher_stop.cancel();
        self.tracker.close();
        self.tracker.wait().await;
    }
}

/// Everything one exchange needs from the relay.
struct Proxy {
    protocol: Protocol,
    upstream: reqwest::Url,
    client: reqwest::Client,
    callers: trust::Callers,
    limiter: Option<trust::Limiter>,
    bytes: Option<trust::ByteBudget>,
    to_agent: String,
    prefix: String,
    max_message: usize,
    queue: Queue,
    /// Exchanges in flight: each runs on a task of its own, so a caller that hangs up does not
    /// cut off an exchange the agent has accepted (see [`forward`]).
    exchanges: TaskTracker,
    /// Fired when the drain time is over: exchanges still reading an answer stop.
    cut: CancellationToken,
}

/// After its caller has gone, how long an exchange still reads the agent's answer to publish
/// it.
pub const LINGER_AFTER_CALLER: Duration = Duration::from_secs(30);

/// Check the options, bind the proxy (and the metrics endpoint), and start the publisher. The
/// relay serves at once; NATS is connected in the background.
pub async fn start(
    settings: Settings,
    opts: RelayOptions,
    metrics: Option<PrometheusHandle>,
    cancel: CancellationToken,
) -> Result<RunningRelay, RelayError> {
    let callers = checked(&opts)?;
    let client = reqwest::Client::builder()
        // A relay passes redirects and proxies on to its caller as they are; it follows none.
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .connect_timeout(opts.connect_timeout)
        .build()
        .map_err(|e| RelayError::Client(e.to_string()))?;
    let listener = bind(&opts.listen).await?;
    let addr = listener.local_addr().map_err(|source| RelayError::Listen {
        addr: opts.listen.clone(),
        source,
    })?;
    let metrics_listener = match &opts.http_addr {
        Some(a) => Some(bind(a).await?),
        None => None,
    };
    register_metrics();

    let (queue, rx) = Queue::new(opts.queue_size, opts.queue_bytes);
    let shared = queue.shared();
    let tracker = TaskTracker::new();
    let publisher_stop = CancellationToken::new();
    tracker.spawn(publisher::run(
        settings.clone(),
        shared.clone(),
        rx,
        PublisherOptions {
            window: settings.consumer.publish_window.clamp(1, 1024),
            flush_timeout: opts.drain_timeout,
        },
        publisher_stop.clone(),
    ));

    let exchanges = TaskTracker::new();
    let cut = CancellationToken::new();
    let proxy = Arc::new(Proxy {
        protocol: opts.protocol,
        upstream: opts.upstream.clone(),
        client,
        callers: callers.clone(),
        limiter: trust::Limiter::new(opts.rate_limit, opts.rate_burst),
        bytes: trust::ByteBudget::new(opts.rate_limit_bytes, opts.rate_limit_bytes_burst),
        to_agent: opts.to_agent.clone(),
        prefix: settings.nats.prefix.clone(),
        max_message: opts.max_message_bytes,
        queue,
        exchanges: exchanges.clone(),
        cut: cut.clone(),
    });
    if proxy.limiter.is_some() || proxy.bytes.is_some() {
        // Buckets that filled up again are forgotten, so the map holds only recent callers.
        let idle = proxy.clone();
        let stop = publisher_stop.clone();
        tracker.spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(60));
            loop {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tick.tick() => {
                        if let Some(l) = &idle.limiter {
                            l.forget_idle();
                        }
                        if let Some(b) = &idle.bytes {
                            b.forget_idle();
                        }
                    }
                }
            }
        });
    }
    let router = Router::new().fallback(forward).with_state(proxy);
    let stop = cancel.clone();
    let server = tokio::spawn(async move {
        // The peer's address is what header mode trusts.
        let serve = axum::serve(
            listener,
            router.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .with_graceful_shutdown(async move { stop.cancelled().await });
        if let Err(e) = serve.await {
            warn!(error = %e, "relay proxy stopped");
        }
    });

    let mut http_addr = None;
    if let Some(listener) = metrics_listener {
        http_addr = listener.local_addr().ok();
        let router = ops_router(OpsState {
            metrics,
            shared: shared.clone(),
            protocol: opts.protocol,
        });
        let stop = publisher_stop.clone();
        tracker.spawn(async move {
            let serve = axum::serve(listener, router)
                .with_graceful_shutdown(async move { stop.cancelled().await });
            if let Err(e) = serve.await {
                warn!(error = %e, "relay metrics endpoint stopped");
            }
        });
    }
    info!(
        protocol = opts.protocol.as_str(),
        %addr,
        upstream = %shown_url(&opts.upstream),
        to_agent = %opts.to_agent,
        callers = callers.mode(),
        rate_limit = ?opts.rate_limit,
        rate_limit_bytes = opts.rate_limit_bytes,
        "relay listening"
    );
    Ok(RunningRelay {
        addr,
        http_addr,
        server,
        tracker,
        exchanges,
        cut,
        publisher_stop,
        cancel,
        drain_timeout: opts.drain_timeout,
    })
}

/// The options checked before anything is bound: how callers are named (see [`callers_of`]),
/// agent ids that can name identity subjects, a byte burst that fits one publishable request,
/// and an http(s) upstream.
fn checked(opts: &RelayOptions) -> Result<trust::Callers, RelayError> {
    let callers = callers_of(opts)?;
    for (flag, id) in [
        ("--from-agent", opts.from_agent.as_deref()),
        ("--to-agent", Some(opts.to_agent.as_str())),
    ] {
        let Some(id) = id else { continue };
        if !crate::identity::agent_token_ok(id) {
            return Err(RelayError::Invalid(format!(
                "{flag} {id:?} cannot be an agent id: each message is published under its speaker's identity subject (`<prefix>.raw.<key>._as.<agent>.<type>`), so an agent id is at most 128 letters, digits, `-` and `_`, not starting with `_`"
            )));
        }
    }
    if opts.rate_limit_bytes > 0
        && usize::try_from(opts.rate_limit_bytes_burst).unwrap_or(usize::MAX)
            < opts.max_message_bytes
    {
        return Err(RelayError::Invalid(format!(
            "--rate-limit-bytes-burst {} is below --max-message-bytes {}: a caller could never send one request as large as the relay publishes; raise the burst or lower --max-message-bytes",
            opts.rate_limit_bytes_burst, opts.max_message_bytes
        )));
    }
    if !matches!(opts.upstream.scheme(), "http" | "https") {
        return Err(RelayError::Invalid(format!(
            "--upstream must be an http:// or https:// URL, not {}://",
            opts.upstream.scheme()
        )));
    }
    Ok(callers)
}

/// How the relay names its callers, from the flags; a combination that would let a caller name
/// itself is refused, with the flag to add.
fn callers_of(opts: &RelayOptions) -> Result<trust::Callers, RelayError> {
    let invalid = |m: &str| Err(RelayError::Invalid(m.to_string()));
    match (&opts.caller_tokens, &opts.from_agent_header) {
        (Some(_), Some(_)) => invalid(
            "--caller-tokens and --from-agent-header are two ways to name the caller; use one",
        ),
        (Some(_), None) if opts.from_agent.is_some() => invalid(
            "--caller-tokens names each caller by its token; drop --from-agent, which would name them all",
        ),
        (Some(_), None) if !opts.trust_header_from.is_empty() => invalid(
            "--trust-header-from only applies to --from-agent-header; drop it with --caller-tokens",
        ),
        (Some(path), None) => trust::CallerTokens::load(path)
            .map(trust::Callers::Tokens)
            .map_err(RelayError::Invalid),
        (None, Some(name)) if opts.trust_header_from.is_empty() => Err(RelayError::Invalid(format!(
            "--from-agent-header {name} lets a request name its own caller, so anyone who can reach the relay could speak as any agent; add --trust-header-from CIDR[,CIDR] with the addresses of the authenticating proxy that sets {name} (only connections from them are then served), or name callers by token with --caller-tokens FILE"
        ))),
        (None, Some(name)) => match &opts.from_agent {
            Some(default) => Ok(trust::Callers::Header {
                name: name.clone(),
                trusted: opts.trust_header_from.clone(),
                default: default.clone(),
            }),
            None => Err(RelayError::Invalid(format!(
                "--from-agent-header {name} needs --from-agent too: the caller of a request that comes through the proxy without {name}"
            ))),
        },
        (None, None) if !opts.trust_header_from.is_empty() => invalid(
            "--trust-header-from only applies to --from-agent-header; add that flag or drop this one",
        ),
        (None, None) => match &opts.from_agent {
            Some(agent) => Ok(trust::Callers::Fixed(agent.clone())),
            None => invalid(
                "name the caller: --from-agent ID (one caller), --caller-tokens FILE (a token per caller), or --from-agent-header NAME with --trust-header-from CIDR (behind an authenticating proxy)",
            ),
        },
    }
}

async fn bind(addr: &str) -> Result<tokio::net::TcpListener, RelayError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| RelayError::Listen {
            addr: addr.to_string(),
            source,
        })
}

/// The URL without its credentials, for logs and error bodies.
fn shown_url(url: &reqwest::Url) -> String {
    let mut shown = url.clone();
    let _ = shown.set_username("");
    let _ = shown.set_password(None);
    shown.to_string()
}

/// Whether `value` can be a NATS header value: no control characters (a CR or LF would end the
/// header block).
/// The headers every message of an exchange carries.
fn shared_headers(
    id: &str,
    from_agent: &str,
    to_agent: &str,
    plan: &wire::Plan,
) -> async_nats::HeaderMap {
    let mut shared = async_nats::HeaderMap::new();
    shared.insert(headers::FROM_AGENT, from_agent);
    shared.insert(headers::TO_AGENT, to_agent);
    shared.insert(headers::EXCHANGE, id);
    if let Some(m) = plan.rest_method {
        shared.insert(headers::A2A_METHOD, m);
    }
    // A run id is named here only while it is short: the caller chooses it, and every frame
    // of the exchange would store it again.
    if let Some(r) = plan
        .run_id
        .as_deref()
        .filter(|r| header_safe(r) && r.len() <= MAX_RUN_ID_HEADER)
    {
        shared.insert(headers::RUN_ID, r);
    }
    shared
}

/// The longest run id (bytes) the relay names in the `Collab-Run-Id` header of an exchange's
/// messages; a longer one stays in the events' own bodies only.
pub const MAX_RUN_ID_HEADER: usize = 256;

fn header_safe(value: &str) -> bool {
    !value.chars().any(char::is_control)
}

/// Series of the relay's families at zero, so their rates exist before the first event.
fn register_metrics() {
    telemetry::describe_metrics();
    for reason in DropReason::ALL {
        metrics::counter!(telemetry::RELAY_DROPPED, "reason" => reason.as_str()).absolute(0);
    }
    for reason in publisher::FAILURE_LABELS {
        metrics::counter!(telemetry::RELAY_PUBLISH_FAILURES, "reason" => reason).absolute(0);
    }
    for kind in Kind::ALL {
        metrics::counter!(telemetry::RELAY_PUBLISHED, "kind" => kind.label()).absolute(0);
    }
    for outcome in RequestOutcome::ALL {
        metrics::counter!(telemetry::RELAY_REQUESTS, "outcome" => outcome.as_str()).absolute(0);
    }
    metrics::gauge!(telemetry::RELAY_QUEUE_DEPTH).set(0.0);
    metrics::gauge!(telemetry::RELAY_NATS_CONNECTED).set(0.0);
}

/// How a request through the relay went: the `outcome` label of `collab_relay_requests_total`.
/// Every outcome but `forwarded` publishes nothing of the exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RequestOutcome {
    /// The upstream accepted the request (2xx); the answer was passed on, the exchange published.
    Forwarded,
    /// The upstream answered with another status (a 401, a 404, a 500, a redirect); the answer
    /// was passed on, nothing was published.
    RejectedStatus,
    /// No connection to the upstream could be made: the caller got a 502.
    UpstreamUnreachable,
    /// The connection was made but no answer came: the caller got a 502.
    UpstreamFailed,
    /// The caller's request body could not be read.
    BadRequest,
    /// The path would leave the upstream's base path: a 400, not forwarded.
    BadPath,
    /// Token mode, no valid token: a 401, not forwarded.
    Unauthorized,
    /// Header mode, a peer outside `--trust-header-from`: a 403, not forwarded.
    UntrustedPeer,
    /// The caller is over its rate: a 429, not forwarded.
    RateLimited,
    /// The caller is over its byte budget: a 429, not forwarded.
    RateLimitedBytes,
}

impl RequestOutcome {
    const ALL: [RequestOutcome; 10] = [
        RequestOutcome::Forwarded,
        RequestOutcome::RejectedStatus,
        RequestOutcome::UpstreamUnreachable,
        RequestOutcome::UpstreamFailed,
        RequestOutcome::BadRequest,
        RequestOutcome::BadPath,
        RequestOutcome::Unauthorized,
        RequestOutcome::UntrustedPeer,
        RequestOutcome::RateLimited,
        RequestOutcome::RateLimitedBytes,
    ];

    fn as_str(self) -> &'static str {
        match self {
            RequestOutcome::Forwarded => "forwarded",
            RequestOutcome::RejectedStatus => "rejected_status",
            RequestOutcome::UpstreamUnreachable => "upstream_unreachable",
            RequestOutcome::UpstreamFailed => "upstream_failed",
            RequestOutcome::BadRequest => "bad_request",
            RequestOutcome::BadPath => "bad_path",
            RequestOutcome::Unauthorized => "unauthorized",
            RequestOutcome::UntrustedPeer => "untrusted_peer",
            RequestOutcome::RateLimited => "rate_limited",
            RequestOutcome::RateLimitedBytes => "rate_limited_bytes",
        }
    }

    fn count(self) {
        metrics::counter!(telemetry::RELAY_REQUESTS, "outcome" => self.as_str()).increment(1);
    }
}

/// The relay's own error answer, in the API's error shape; it names no internals.
fn relay_error(status: StatusCode, code: &str, message: String) -> Response {
    let body = serde_json::json!({ "error": { "code": code, "message": message } });
    (status, axum::Json(body)).into_response()
}

/// A `429` with `Retry-After` (whole seconds, at least 1): nothing is forwarded or published.
fn too_many(code: &str, wait: Duration, what: &str) -> Response {
    let secs = (wait.as_secs() + u64::from(wait.subsec_nanos() > 0)).max(1);
    let mut answer = relay_error(
        StatusCode::TOO_MANY_REQUESTS,
        code,
        format!("{what}; retry after {secs} s"),
    );
    answer
        .headers_mut()
        .insert(axum::http::header::RETRY_AFTER, HeaderValue::from(secs));
    answer
}

/// The messages of one HTTP exchange: their key, the headers they share, and their order.
struct Exchange {
    id: String,
    key: String,
    /// Who speaks each side: the caller the request, the fronted agent every answer. Each
    /// message is published under its speaker's identity subject.
    caller: String,
    agent: String,
    headers: async_nats::HeaderMap,
    /// The next message's number in the exchange (its `Nats-Msg-Id` is `<id>:<n>`).
    next: u64,
    prefix: String,
    queue: Queue,
    max_message: usize,
}

impl Exchange {
    /// Queue one message; too large ones are counted and skipped.
    fn emit(&mut self, kind: Kind, payload: Bytes) {
        if payload.len() > self.max_message {
            self.skip(kind, DropReason::TooLarge, payload.len());
            return;
        }
        let speaker = match kind {
            Kind::A2aRequest => &self.caller,
            Kind::A2aResponse | Kind::A2aStream | Kind::Agui => &self.agent,
        };
        let Some(subject) = wire::subject(&self.prefix, &self.key, speaker, kind) else {
            // Every id is checked before the relay serves; never published without one.
            self.skip(kind, DropReason::Rejected, payload.len());
            return;
        };
        let n = self.next;
        self.next += 1;
        let mut message_headers = self.headers.clone();
        message_headers.insert("Nats-Msg-Id", format!("{}:{n}", self.id).as_str());
        // The side of the exchange, told by the relay: the request is the caller's words, all
        // else the agent's, whatever the bodies look like.
        message_headers.insert(headers::DIRECTION, kind.direction());
        self.queue.offer(Outgoing {
            subject,
            headers: message_headers,
            payload,
            kind,
        });
    }

    /// Count a message of the exchange that is forwarded but not published.
    fn skip(&mut self, kind: Kind, reason: DropReason, bytes: usize) {
        self.next += 1;
        debug!(
            exchange = %self.id,
            kind = kind.label(),
            reason = reason.as_str(),
            bytes,
            "forwarded, not published"
        );
        self.queue.dropped(reason);
    }
}

/// A request body: whole when it fits in the publish limit, else the part read so far and the
/// rest still streaming from the caller.
enum RequestBody {
    Whole(Bytes),
    Large {
        head: Vec<Bytes>,
        rest: axum::body::BodyDataStream,
    },
}

impl RequestBody {
    /// The bytes read from the caller before the exchange was forwarded.
    fn read_len(&self) -> usize {
        match self {
            RequestBody::Whole(b) => b.len(),
            RequestBody::Large { head, .. } => head.iter().map(Bytes::len).sum(),
        }
    }
}

async fn read_body(body: Body, limit: usize) -> Result<RequestBody, axum::Error> {
    let mut stream = body.into_data_stream();
    let mut head = Vec::new();
    let mut seen = 0usize;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        seen += chunk.len();
        head.push(chunk);
        if seen > limit {
            return Ok(RequestBody::Large { head, rest: stream });
        }
    }
    Ok(RequestBody::Whole(match head.len() {
        0 => Bytes::new(),
        1 => head.pop().unwrap_or_default(),
        _ => {
            let mut all = BytesMut::with_capacity(seen);
            for c in head {
                all.extend_from_slice(&c);
            }
            all.freeze()
        }
    }))
}

/// Every request, whatever its method and path: check it, forward it, pass the answer back, and
/// publish the exchange once the agent has accepted it.
async fn forward(State(proxy): State<Arc<Proxy>>, req: Request) -> Response {
    let exchange_id = uuid::Uuid::new_v4().to_string();
    let (parts, body) = req.into_parts();
    let path = match wire::confine_path(parts.uri.path()) {
        Ok(p) => p,
        Err(refusal) => {
            RequestOutcome::BadPath.count();
            // The rule, never the path: it is the caller's text.
            info!(exchange = %exchange_id, reason = refusal.as_str(), "a path that could leave the agent's base is refused: not forwarded, not published");
            return relay_error(
                StatusCode::BAD_REQUEST,
                "bad_path",
                refusal.message().into(),
            );
        }
    };
    let peer = parts
        .extensions
        .get::<axum::extract::ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip());
    let caller = match proxy.callers.identify(&parts.headers, peer) {
        Ok(c) => c,
        Err(refusal) => return proxy.refuse(refusal, &exchange_id),
    };
    if let Some(limiter) = &proxy.limiter {
        if let Err(wait) = limiter.check(&caller) {
            RequestOutcome::RateLimited.count();
            info!(exchange = %exchange_id, caller = %caller, "the caller is over its rate: not forwarded, not published");
            return too_many(
                "rate_limited",
                wait,
                &format!("too many requests from {caller}"),
            );
        }
    }
    let body = match read_body(body, proxy.max_message).await {
        Ok(b) => b,
        Err(e) => {
            RequestOutcome::BadRequest.count();
            info!(exchange = %exchange_id, error = %e, "the caller's request body could not be read: not forwarded, not published");
            return relay_error(
                StatusCode::BAD_REQUEST,
                "bad_request",
                "the relay could not read the request body".into(),
            );
        }
    };
    if let Some(budget) = &proxy.bytes {
        // What the request could store: its body, up to the publish limit.
        let cost = body.read_len().min(proxy.max_message);
        if let Err(wait) = budget.take(&caller, cost) {
            RequestOutcome::RateLimitedBytes.count();
            info!(exchange = %exchange_id, caller = %caller, bytes = cost, "the caller is over its byte budget: not forwarded, not published");
            return too_many(
                "rate_limited_bytes",
                wait,
                &format!("{caller} sent more request bytes than --rate-limit-bytes allows"),
            );
        }
    }
    let plan = plan_of(proxy.protocol, parts.method.as_str(), &path, &body);
    if let Some(note) = plan.note {
        debug!(exchange = %exchange_id, method = %parts.method, "{note}");
    }
    let exchange = proxy.exchange(exchange_id, &caller, &plan);
    // What the request contributes once the agent accepts it: the body, or a count.
    let request = plan.request.map(|kind| match &body {
        RequestBody::Whole(b) => (kind, Some(b.clone())),
        RequestBody::Large { .. } => (kind, None),
    });
    let head = parts.method == axum::http::Method::HEAD;
    let url = upstream_url(&proxy.upstream, &path, parts.uri.query());
    // From here the exchange runs on a task of its own: a caller that hangs up while the agent
    // works drops this handler, not the exchange, so what the agent accepted is still
    // published (and its answer, read for up to LINGER_AFTER_CALLER after the caller left).
    let publish_answers = plan.publish_answers;
    let own = proxy.clone();
    let exchange_task = proxy.exchanges.spawn(async move {
        let (proxy, mut exchange) = (own, exchange);
        match proxy.send(parts, url, body).await {
            Ok(answer) if answer.status().is_success() => {
                RequestOutcome::Forwarded.count();
                // The request goes to the queue before anything of the answer: on the bus it
                // comes first.
                match request {
                    Some((kind, Some(b))) => exchange.emit(kind, b),
                    Some((kind, None)) => {
                        exchange.skip(kind, DropReason::TooLarge, proxy.max_message + 1)
                    }
                    None => {}
                }
                proxy.pass_back(answer, publish_answers, head, exchange)
            }
            Ok(answer) => {
                RequestOutcome::RejectedStatus.count();
                info!(
                    exchange = %exchange.id,
                    caller = %exchange.caller,
                    status = answer.status().as_u16(),
                    "the agent did not accept the request: its answer is passed on, nothing of the exchange is published"
                );
                proxy.pass_back(answer, false, head, exchange)
            }
            Err(e) => proxy.bad_gateway(e, &exchange.id),
        }
    });
    match exchange_task.await {
        Ok(response) => response,
        Err(e) => {
            warn!(error = %e, "an exchange's task failed");
            relay_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "relay_error",
                "the relay failed while forwarding the request".into(),
            )
        }
    }
}

/// What to publish of an exchange, from its request.
fn plan_of(protocol: Protocol, method: &str, path: &str, body: &RequestBody) -> wire::Plan {
    match body {
        RequestBody::Whole(b) => wire::plan(protocol, method, path, wire::RequestBytes::Whole(b)),
        RequestBody::Large { head, .. } => {
            let head: Vec<u8> = head
                .iter()
                .flat_map(|c| c.iter().copied())
                .take(wire::HEAD_BYTES)
                .collect();
            wire::plan(protocol, method, path, wire::RequestBytes::Head(&head))
        }
    }
}

impl Proxy {
    /// The caller's 401 or 403: nothing is forwarded or published.
    fn refuse(&self, refusal: trust::Refusal, exchange: &str) -> Response {
        let (outcome, message) = match (refusal, &self.callers) {
            (trust::Refusal::UntrustedPeer, trust::Callers::Header { name, .. }) => (
                RequestOutcome::UntrustedPeer,
                format!(
                    "this relay names callers by the {name} header of its authenticating proxy and serves only connections from that proxy; send the request through it"
                ),
            ),
            (trust::Refusal::UntrustedPeer, _) => (
                RequestOutcome::UntrustedPeer,
                "this relay serves only connections from its authenticating proxy".to_string(),
            ),
            (trust::Refusal::BadCaller, _) => (
                RequestOutcome::UntrustedPeer,
                "the caller header's value cannot be an agent id (at most 128 letters, digits, `-` and `_`)"
                    .to_string(),
            ),
            (trust::Refusal::AmbiguousHeader, _) => (
                RequestOutcome::UntrustedPeer,
                "the caller header came more than once; the authenticating proxy must replace the caller's own header, not add to it"
                    .to_string(),
            ),
            (trust::Refusal::Unauthorized, _) => (
                RequestOutcome::Unauthorized,
                "the relay needs a caller token it knows: send `Proxy-Authorization: Bearer <token>`"
                    .to_string(),
            ),
        };
        outcome.count();
        info!(
            exchange,
            outcome = outcome.as_str(),
            "caller refused: not forwarded, not published"
        );
        let mut answer = relay_error(refusal.status(), refusal.as_str(), message);
        if refusal == trust::Refusal::Unauthorized {
            answer.headers_mut().insert(
                axum::http::header::PROXY_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"collab-relay\""),
            );
        }
        answer
    }

    /// The exchange's key and the headers its messages share.
    fn exchange(&self, id: String, from_agent: &str, plan: &wire::Plan) -> Exchange {
        let key = encode_id(plan.context_id.as_deref().unwrap_or(&id));
        Exchange {
            key,
            caller: from_agent.to_string(),
            agent: self.to_agent.clone(),
            headers: shared_headers(&id, from_agent, &self.to_agent, plan),
            id,
            next: 0,
            prefix: self.prefix.clone(),
            queue: self.queue.clone(),
            max_message: self.max_message,
        }
    }

    /// The caller's request, to the upstream.
    async fn send(
        &self,
        parts: axum::http::request::Parts,
        url: reqwest::Url,
        body: RequestBody,
    ) -> reqwest::Result<reqwest::Response> {
        let mut upstream = self.client.request(parts.method.clone(), url);
        let whole = matches!(body, RequestBody::Whole(_));
        for (name, value) in forwarded_headers(&parts.headers) {
            // A whole body gets its length from the client library; a streamed one keeps the
            // caller's framing.
            if whole && name == axum::http::header::CONTENT_LENGTH {
                continue;
            }
            upstream = upstream.header(name, value);
        }
        upstream = match body {
            RequestBody::Whole(b) => upstream.body(b),
            RequestBody::Large { head, rest } => upstream.body(reqwest::Body::wrap_stream(
                futures::stream::iter(head.into_iter().map(Ok::<_, axum::Error>)).chain(rest),
            )),
        };
        upstream.send().await
    }

    /// The answer's body for the caller, read from the agent by a task of its own: when the
    /// caller hangs up, an answer that is published is still read to its end (for up to
    /// [`LINGER_AFTER_CALLER`]) and published; one that is not is dropped at once.
    fn pumped(&self, mut tap: Tap) -> Body {
        let (tx, rx) = tokio::sync::mpsc::channel::<reqwest::Result<Bytes>>(4);
        let publishes = !matches!(tap.watch, Watch::Nothing);
        let cut = self.cut.clone();
        self.exchanges.spawn(async move {
            let mut caller = Some(tx);
            let linger = tokio::time::sleep(Duration::MAX);
            tokio::pin!(linger);
            let mut lingering = false;
            loop {
                let next = tokio::select! {
                    next = tap.next() => next,
                    _ = cut.cancelled() => break,
                    _ = &mut linger, if lingering => {
                        debug!(exchange = %tap.exchange.id, "the caller left and the answer did not end in time: the rest is not published");
                        break;
                    }
                };
                let Some(item) = next else { break };
                let Some(to_caller) = &caller else { continue };
                let sent = tokio::select! {
                    sent = to_caller.send(item) => sent.is_ok(),
                    _ = cut.cancelled() => break,
                };
                if !sent {
                    caller = None;
                    if !publishes {
                        break;
                    }
                    debug!(exchange = %tap.exchange.id, "the caller left before the answer ended: reading the rest to publish it");
                    lingering = true;
                    linger
                        .as_mut()
                        .reset(tokio::time::Instant::now() + LINGER_AFTER_CALLER);
                }
            }
        });
        Body::from_stream(futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|item| (item, rx))
        }))
    }

    /// The caller's 502 when the upstream gave no answer.
    fn bad_gateway(&self, e: reqwest::Error, exchange: &str) -> Response {
        let unreachable = e.is_connect() || e.is_timeout();
        let outcome = if unreachable {
            RequestOutcome::UpstreamUnreachable
        } else {
            RequestOutcome::UpstreamFailed
        };
        outcome.count();
        // The URL may carry credentials; the relay's own is shown without them.
        let e = e.without_url();
        warn!(exchange, outcome = outcome.as_str(), error = %e, "the upstream agent did not answer");
        let upstream = shown_url(&self.upstream);
        let message = if unreachable {
            format!("the relay could not reach the upstream agent at {upstream}")
        } else {
            format!("the upstream agent at {upstream} closed the connection without an answer")
        };
        relay_error(StatusCode::BAD_GATEWAY, outcome.as_str(), message)
    }

    /// The upstream's answer, to the caller unchanged, with what it carries published on the
    /// way.
    fn pass_back(
        &self,
        answer: reqwest::Response,
        publish: bool,
        head: bool,
        mut exchange: Exchange,
    ) -> Response {
        let status = answer.status();
        let mut headers = HeaderMap::new();
        for (name, value) in forwarded_headers(answer.headers()) {
            headers.append(name.clone(), value.clone());
        }
        let sse = answer
            .headers()
            .get(axum::http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(wire::is_event_stream);
        let encoding = ContentEncoding::parse(
            answer
                .headers()
                .get(axum::http::header::CONTENT_ENCODING)
                .and_then(|v| v.to_str().ok()),
        );
        let watch = match (self.protocol, publish, sse) {
            (_, false, _) => Watch::Nothing,
            (Protocol::A2a, true, false) => Watch::Whole(Kind::A2aResponse),
            (Protocol::Agui, true, false) => {
                debug!(exchange = %exchange.id, "AG-UI answer is not an SSE stream: forwarded, not published");
                Watch::Nothing
            }
            (protocol, true, true) => {
                let kind = match protocol {
                    Protocol::A2a => Kind::A2aStream,
                    Protocol::Agui => Kind::Agui,
                };
                if encoding == ContentEncoding::Identity {
                    Watch::Frames(kind)
                } else {
                    exchange.skip(kind, DropReason::Encoded, 0);
                    Watch::Nothing
                }
            }
        };
        // A HEAD answer carries the length of a body it does not send.
        let expected = answer
            .content_length()
            .filter(|_| !head)
            .and_then(|n| usize::try_from(n).ok());
        let tap = Tap::new(
            answer.bytes_stream().boxed(),
            watch,
            exchange,
            encoding,
            expected,
        );
        let mut response = Response::new(self.pumped(tap));
        *response.status_mut() = status;
        *response.headers_mut() = headers;
        response
    }
}

/// `base` with the request's path (already confined by [`wire::confine_path`]) appended to its
/// path, and the request's query.
fn upstream_url(base: &reqwest::Url, path: &str, query: Option<&str>) -> reqwest::Url {
    let mut url = base.clone();
    let joined = format!("{}{}", base.path().trim_end_matches('/'), path);
    url.set_path(if joined.is_empty() { "/" } else { &joined });
    url.set_query(query);
    url
}

/// The headers a proxy passes on: all but the hop-by-hop ones and those the `Connection`
/// header names.
fn forwarded_headers(headers: &HeaderMap) -> impl Iterator<Item = (&HeaderName, &HeaderValue)> {
    let named: Vec<String> = headers
        .get_all(axum::http::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| {
            wire::connection_tokens(v)
                .map(str::to_ascii_lowercase)
                .collect::<Vec<_>>()
        })
        .collect();
    headers.iter().filter(move |(name, _)| {
        let n = name.as_str();
        !wire::is_hop_by_hop(n) && !named.iter().any(|c| c == n)
    })
}

/// What to publish of an answer as it streams past.
enum Watch {
    Nothing,
    /// Each SSE event's data, as soon as its closing blank line has passed.
    Frames(Kind),
    /// The whole body, once it has ended.
    Whole(Kind),
}

/// The `Content-Encoding` of a whole answer, which the published copy is decoded from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ContentEncoding {
    Identity,
    Gzip,
    Deflate,
    Other,
}

impl ContentEncoding {
    fn parse(value: Option<&str>) -> ContentEncoding {
        let Some(v) = value.map(|v| v.trim().to_ascii_lowercase()) else {
            return ContentEncoding::Identity;
        };
        match v.as_str() {
            "" | "identity" => ContentEncoding::Identity,
            "gzip" | "x-gzip" => ContentEncoding::Gzip,
            "deflate" => ContentEncoding::Deflate,
            _ => ContentEncoding::Other,
        }
    }
}

/// Decode a compressed body, reading at most `limit + 1` bytes of output so a small body that
/// inflates hugely is caught as too large.
fn decode(encoding: ContentEncoding, body: &[u8], limit: usize) -> Result<Bytes, DropReason> {
    use std::io::Read;
    let cap = u64::try_from(limit).unwrap_or(u64::MAX).saturating_add(1);
    let mut out = Vec::new();
    let read = match encoding {
        ContentEncoding::Identity => return Ok(Bytes::copy_from_slice(body)),
        ContentEncoding::Gzip => flate2::read::MultiGzDecoder::new(body)
            .take(cap)
            .read_to_end(&mut out),
        // `deflate` in HTTP means zlib-wrapped; some servers send raw deflate.
        ContentEncoding::Deflate => flate2::read::ZlibDecoder::new(body)
            .take(cap)
            .read_to_end(&mut out)
            .or_else(|_| {
                out.clear();
                flate2::read::DeflateDecoder::new(body)
                    .take(cap)
                    .read_to_end(&mut out)
            }),
        ContentEncoding::Other => return Err(DropReason::Encoded),
    };
    match read {
        Ok(_) if out.len() > limit => Err(DropReason::TooLarge),
        Ok(_) => Ok(Bytes::from(out)),
        Err(_) => Err(DropReason::Encoded),
    }
}

type UpstreamStream = Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>;

/// The answer's body on its way to the caller, unchanged and unbuffered, with what it carries
/// queued for publishing as it passes.
struct Tap {
    inner: UpstreamStream,
    watch: Watch,
    exchange: Exchange,
    encoding: ContentEncoding,
    sse: SseParser,
    frames: Vec<Frame>,
    /// The whole body so far (for [`Watch::Whole`]), until it passes the limit.
    body: BytesMut,
    body_size: usize,
    /// Bytes passed to the caller.
    passed: usize,
    /// The answer's `Content-Length`: the server stops reading the body once it has sent that
    /// many bytes, so the stream's end may never be polled.
    expected: Option<usize>,
    /// What the answer carries has been published (or judged not publishable).
    done: bool,
}

impl Tap {
    fn new(
        inner: UpstreamStream,
        watch: Watch,
        exchange: Exchange,
        encoding: ContentEncoding,
        expected: Option<usize>,
    ) -> Tap {
        let mut tap = Tap {
            inner,
            sse: SseParser::new(exchange.max_message),
            watch,
            exchange,
            encoding,
            frames: Vec::new(),
            body: BytesMut::new(),
            body_size: 0,
            passed: 0,
            expected,
            done: false,
        };
        if expected == Some(0) {
            tap.end();
        }
        tap
    }

    fn chunk(&mut self, chunk: &Bytes) {
        match self.watch {
            Watch::Nothing => {}
            Watch::Frames(kind) => {
                self.sse.push(chunk, &mut self.frames);
                for frame in std::mem::take(&mut self.frames) {
                    match frame {
                        Frame::Data(data) if wire::is_json_object(&data) => {
                            self.exchange.emit(kind, data)
                        }
                        Frame::Data(_) => {
                            debug!(exchange = %self.exchange.id, "an SSE frame that is not a JSON object is forwarded, not published");
                        }
                        Frame::TooLarge(bytes) => {
                            self.exchange.skip(kind, DropReason::TooLarge, bytes)
                        }
                    }
                }
            }
            Watch::Whole(_) => {
                self.body_size = self.body_size.saturating_add(chunk.len());
                // A compressed body inflates to more than its own size, so the limit holds for
                // the bytes as sent too.
                if self.body_size <= self.exchange.max_message {
                    self.body.extend_from_slice(chunk);
                } else {
                    self.body.clear();
                }
            }
        }
        self.passed = self.passed.saturating_add(chunk.len());
        if self.expected.is_some_and(|n| self.passed >= n) {
            self.end();
        }
    }

    fn end(&mut self) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        match self.watch {
            Watch::Nothing => {}
            Watch::Frames(_) => {
                if self.sse.pending() > 0 {
                    debug!(exchange = %self.exchange.id, bytes = self.sse.pending(), "the stream ended inside an SSE event: that event is not published");
                }
            }
            Watch::Whole(kind) => {
                if self.body_size > self.exchange.max_message {
                    self.exchange
                        .skip(kind, DropReason::TooLarge, self.body_size);
                    return;
                }
                let body = self.body.split().freeze();
                if body.is_empty() {
                    return;
                }
                let body = match decode(self.encoding, &body, self.exchange.max_message) {
                    Ok(b) => b,
                    Err(reason) => {
                        self.exchange.skip(kind, reason, body.len());
                        return;
                    }
                };
                if wire::is_json_object(&body) {
                    self.exchange.emit(kind, body);
                } else {
                    debug!(exchange = %self.exchange.id, "the answer is not a JSON object: forwarded, not published");
                }
            }
        }
    }
}

impl Stream for Tap {
    type Item = reqwest::Result<Bytes>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let item = match self.inner.poll_next_unpin(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(item) => item,
        };
        match &item {
            Some(Ok(chunk)) => self.chunk(chunk),
            Some(Err(e)) => {
                // The caller sees the cut-off answer as the upstream gave it; nothing partial
                // is published as if it were whole.
                debug!(exchange = %self.exchange.id, error = %e, "the upstream answer broke off");
                self.done = true;
            }
            None => self.end(),
        }
        Poll::Ready(item)
    }
}

impl Drop for Tap {
    fn drop(&mut self) {
        if !self.done && !matches!(self.watch, Watch::Nothing) {
            debug!(exchange = %self.exchange.id, "the answer was not read to its end: what had been read is published, the rest is not");
        }
    }
}

#[derive(Clone)]
struct OpsState {
    metrics: Option<PrometheusHandle>,
    shared: Arc<Shared>,
    protocol: Protocol,
}

/// The relay's own endpoints, on their own address: the proxied port belongs to the agent.
fn ops_router(state: OpsState) -> Router {
    use axum::routing::get;
    Router::new()
        .route("/metrics", get(ops_metrics))
        .route("/healthz", get(ops_health))
        .route("/readyz", get(ops_health))
        .with_state(state)
}

async fn ops_metrics(State(s): State<OpsState>) -> Response {
    match s.metrics {
        Some(h) => (StatusCode::OK, h.render()).into_response(),
        None => (StatusCode::NOT_FOUND, "metrics are not enabled\n").into_response(),
    }
}

/// Healthy and ready while it serves: forwarding does not depend on NATS, which is reported
/// beside.
async fn ops_health(State(s): State<OpsState>) -> Response {
    axum::Json(serde_json::json!({
        "healthy": true,
        "ready": true,
        "protocol": s.protocol.as_str(),
        "natsConnected": s.shared.nats_connected(),
    }))
    .into_response()
}

#[cfg(test)]
mod tests;
