//! The relay's side of the bus: a bounded queue the proxy hands messages to without ever
//! waiting, and one task that connects to NATS in the background and publishes what the queue
//! holds through JetStream, in queue order. When the queue is full, or a message cannot be
//! stored, the message is dropped, counted and logged (never its body): the exchange it belongs to
//! goes on unharmed.

use super::wire::Kind;
use crate::bus::{self, Retry};
use crate::config::Settings;
use crate::telemetry;
use async_nats::jetstream::context::{PublishAckFuture, PublishErrorKind};
use bytes::Bytes;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// One message for the raw stream.
#[derive(Debug)]
pub struct Outgoing {
    pub subject: String,
    pub headers: async_nats::HeaderMap,
    pub payload: Bytes,
    pub kind: Kind,
}

impl Outgoing {
    /// The bytes this message holds and sends: its payload and its headers as the NATS
    /// protocol writes them (`NATS/1.0`, `name: value` lines, the blank line). The queue's
    /// byte bound and the server's `max_payload` count both.
    pub fn wire_len(&self) -> usize {
        headers_wire_len(&self.headers).saturating_add(self.payload.len())
    }
}

/// The size of `headers` on the wire (none: no header block at all).
pub fn headers_wire_len(headers: &async_nats::HeaderMap) -> usize {
    if headers.is_empty() {
        return 0;
    }
    let lines: usize = headers
        .iter()
        .map(|(name, values)| {
            let name: &str = name.as_ref();
            values
                .iter()
                .map(|v| {
                    let v: &str = v.as_ref();
                    name.len() + v.len() + 4
                })
                .sum::<usize>()
        })
        .sum();
    "NATS/1.0\r\n".len() + lines + 2
}

/// Why a message never reached the raw stream: the `reason` label of
/// `collab_relay_dropped_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// The queue was full: NATS is slow or unreachable, or the relay is busier than its queue.
    QueueFull,
    /// Larger than `--max-message-bytes` or the server's `max_payload`.
    TooLarge,
    /// In a `Content-Encoding` the relay cannot read.
    Encoded,
    /// No stream captures the subject (the raw stream is not provisioned), after retries.
    NoStream,
    /// The server refused to store it, after retries.
    Rejected,
    /// Still queued when the relay stopped and its drain time ran out.
    Shutdown,
}

impl DropReason {
    pub const ALL: [DropReason; 6] = [
        DropReason::QueueFull,
        DropReason::TooLarge,
        DropReason::Encoded,
        DropReason::NoStream,
        DropReason::Rejected,
        DropReason::Shutdown,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::QueueFull => "queue_full",
            DropReason::TooLarge => "too_large",
            DropReason::Encoded => "encoded",
            DropReason::NoStream => "no_stream",
            DropReason::Rejected => "rejected",
            DropReason::Shutdown => "shutdown",
        }
    }

    /// What an operator can do about it, for the log line.
    fn hint(self) -> &'static str {
        match self {
            DropReason::QueueFull => {
                "the publish queue is full: NATS is slow or unreachable, or --queue-size is too small for the traffic"
            }
            DropReason::TooLarge => {
                "the message is larger than --max-message-bytes or the server's max_payload"
            }
            DropReason::Encoded => {
                "the answer is compressed in an encoding the relay does not read (it reads gzip and deflate)"
            }
            DropReason::NoStream => {
                "no stream captures the raw subjects: run `collab-projector provision` (or `run`) against this server and prefix"
            }
            DropReason::Rejected => "the server refused to store the message",
            DropReason::Shutdown => "the relay stopped before the message could be published",
        }
    }
}

/// Why one publish attempt failed: the `reason` label of `collab_relay_publish_failures_total`.
fn failure_label(kind: &PublishErrorKind) -> &'static str {
    match kind {
        PublishErrorKind::TimedOut => "timeout",
        PublishErrorKind::BrokenPipe => "disconnected",
        PublishErrorKind::StreamNotFound => "no_stream",
        PublishErrorKind::MaxPayloadExceeded => "too_large",
        PublishErrorKind::MaxAckPending => "busy",
        _ => "rejected",
    }
}

/// The failure labels, registered at zero so their rates exist before the first failure.
pub const FAILURE_LABELS: [&str; 6] = [
    "timeout",
    "disconnected",
    "no_stream",
    "too_large",
    "busy",
    "rejected",
];

/// What to do with a message whose publish failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    /// Again, after a pause: the server is away or busy, the message is fine.
    Retry,
    /// Again, up to a few attempts: a stream leader election answers "no responders" and
    /// server-side errors for a moment, then the stream is back.
    RetryFew(DropReason),
    /// Never: it cannot be stored as it is.
    Drop(DropReason),
}

fn verdict(kind: &PublishErrorKind) -> Verdict {
    match kind {
        PublishErrorKind::TimedOut
        | PublishErrorKind::BrokenPipe
        | PublishErrorKind::MaxAckPending => Verdict::Retry,
        PublishErrorKind::StreamNotFound => Verdict::RetryFew(DropReason::NoStream),
        PublishErrorKind::MaxPayloadExceeded => Verdict::Drop(DropReason::TooLarge),
        _ => Verdict::RetryFew(DropReason::Rejected),
    }
}

/// The longest one send may wait for a publish permit.
const SEND_TIMEOUT: Duration = Duration::from_secs(10);

/// Attempts for a [`Verdict::RetryFew`] failure before the message is dropped.
const FEW_ATTEMPTS: u32 = 5;

/// How often a drop or failure warning may be logged; the ones in between are counted and
/// summed into the next line.
const LOG_EVERY: Duration = Duration::from_secs(10);

/// The proxy's handle on the queue: offering never waits.
#[derive(Clone)]
pub struct Queue {
    tx: mpsc::Sender<Outgoing>,
    shared: Arc<Shared>,
}

/// What the proxy, the publisher and the metrics endpoint share.
pub struct Shared {
    capacity: usize,
    /// Payload bytes queued or being published, and their bound: with messages of up to 1 MiB a
    /// count alone would not bound memory.
    bytes: AtomicUsize,
    max_bytes: usize,
    connected: AtomicBool,
    drops: RateLimited,
}

impl Shared {
    pub fn nats_connected(&self) -> bool {
        self.connected.load(Ordering::Relaxed)
    }
}

/// A log line at most every [`LOG_EVERY`], with the number of events since the last one.
struct RateLimited {
    last: Mutex<Option<Instant>>,
    since: AtomicU64,
}

impl RateLimited {
    fn new() -> RateLimited {
        RateLimited {
            last: Mutex::new(None),
            since: AtomicU64::new(0),
        }
    }

    /// Count one; `Some(n)` when a line is due, `n` events since the last line.
    fn tick(&self) -> Option<u64> {
        self.since.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        let mut last = self.last.lock().ok()?;
        if last.is_some_and(|at| now.duration_since(at) < LOG_EVERY) {
            return None;
        }
        *last = Some(now);
        Some(self.since.swap(0, Ordering::Relaxed))
    }
}

impl Queue {
    /// A queue of at most `capacity` messages and `max_bytes` payload bytes (those being
    /// published included), and its receiving end, for [`run`].
    pub fn new(capacity: usize, max_bytes: usize) -> (Queue, mpsc::Receiver<Outgoing>) {
        let capacity = capacity.max(1);
        let (tx, rx) = mpsc::channel(capacity);
        let shared = Arc::new(Shared {
            capacity,
            bytes: AtomicUsize::new(0),
            max_bytes,
            connected: AtomicBool::new(false),
            drops: RateLimited::new(),
        });
        (Queue { tx, shared }, rx)
    }

    pub fn shared(&self) -> Arc<Shared> {
        self.shared.clone()
    }

    /// Hand `msg` to the publisher, or drop it when the queue is full.
    pub fn offer(&self, msg: Outgoing) {
        let size = msg.wire_len();
        let before = self.shared.bytes.fetch_add(size, Ordering::Relaxed);
        if before.saturating_add(size) > self.shared.max_bytes {
            self.shared.release(size);
            self.shared.dropped(DropReason::QueueFull);
            return;
        }
        match self.tx.try_send(msg) {
            Ok(()) => self.shared.depth(&self.tx),
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.shared.release(size);
                self.shared.dropped(DropReason::QueueFull);
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                self.shared.release(size);
                self.shared.dropped(DropReason::Shutdown);
            }
        }
    }

    /// Count a message the proxy chose not to publish.
    pub fn dropped(&self, reason: DropReason) {
        self.shared.dropped(reason);
    }
}

impl Shared {
    /// `size` payload bytes are no longer held.
    fn release(&self, size: usize) {
        self.bytes.fetch_sub(size, Ordering::Relaxed);
    }

    fn depth(&self, tx: &mpsc::Sender<Outgoing>) {
        let depth = self.capacity.saturating_sub(tx.capacity());
        metrics::gauge!(telemetry::RELAY_QUEUE_DEPTH).set(depth as f64);
    }

    fn dropped(&self, reason: DropReason) {
        metrics::counter!(telemetry::RELAY_DROPPED, "reason" => reason.as_str()).increment(1);
        if let Some(n) = self.drops.tick() {
            warn!(
                reason = reason.as_str(),
                dropped_since_last_line = n,
                "relay dropped a message instead of publishing it: {}",
                reason.hint()
            );
        }
    }
}

/// The publisher's settings.
#[derive(Debug, Clone)]
pub struct PublisherOptions {
    /// Messages taken from the queue and published before their acknowledgements are awaited.
    pub window: usize,
    /// After `stop`, how long queued messages may still take to be published.
    pub flush_timeout: Duration,
}

/// Connect (retrying in the background until it works) and publish what the queue holds, until
/// `stop`: then publish what is still queued for up to `flush_timeout` and drop the rest.
pub async fn run(
    settings: Settings,
    shared: Arc<Shared>,
    mut rx: mpsc::Receiver<Outgoing>,
    opts: PublisherOptions,
    stop: CancellationToken,
) {
    let Some((client, js)) = connect(&settings, &stop).await else {
        drain_dropping(&shared, &mut rx);
        return;
    };
    let watcher = watch_connection(client.clone(), shared.clone(), stop.clone());
    let window = opts.window.max(1);
    let mut batch = Vec::with_capacity(window);
    let failures = RateLimited::new();
    let mut deadline = None;
    loop {
        batch.clear();
        let n = tokio::select! {
            biased;
            n = rx.recv_many(&mut batch, window) => n,
            _ = stop.cancelled() => break,
        };
        if n == 0 {
            break;
        }
        shared.depth_of(&rx);
        let flush = Flush {
            stop: &stop,
            timeout: opts.flush_timeout,
            deadline: &mut deadline,
        };
        publish_batch(&client, &js, &mut batch, &shared, &failures, flush).await;
    }
    // Stopping: what is queued now still gets its chance, within the flush time.
    let mut deadline = Some(deadline.unwrap_or_else(|| Instant::now() + opts.flush_timeout));
    while deadline.is_some_and(|d| Instant::now() < d) {
        batch.clear();
        while batch.len() < window {
            match rx.try_recv() {
                Ok(msg) => batch.push(msg),
                Err(_) => break,
            }
        }
        if batch.is_empty() {
            break;
        }
        shared.depth_of(&rx);
        let flush = Flush {
            stop: &stop,
            timeout: opts.flush_timeout,
            deadline: &mut deadline,
        };
        publish_batch(&client, &js, &mut batch, &shared, &failures, flush).await;
    }
    drain_dropping(&shared, &mut rx);
    watcher.abort();
    shared.connected.store(false, Ordering::Relaxed);
    metrics::gauge!(telemetry::RELAY_NATS_CONNECTED).set(0.0);
}

impl Shared {
    fn depth_of(&self, rx: &mpsc::Receiver<Outgoing>) {
        metrics::gauge!(telemetry::RELAY_QUEUE_DEPTH).set(rx.len() as f64);
    }
}

/// Count everything still queued as dropped at shutdown.
fn drain_dropping(shared: &Shared, rx: &mut mpsc::Receiver<Outgoing>) {
    rx.close();
    while let Ok(msg) = rx.try_recv() {
        shared.release(msg.wire_len());
        shared.dropped(DropReason::Shutdown);
    }
    metrics::gauge!(telemetry::RELAY_QUEUE_DEPTH).set(0.0);
}

/// Connect with the configured URL, credentials and TLS, retrying with backoff until it works or
/// `stop` fires. The proxy serves meanwhile; the queue holds what it can.
async fn connect(
    settings: &Settings,
    stop: &CancellationToken,
) -> Option<(async_nats::Client, async_nats::jetstream::Context)> {
    let mut retry = Retry::new(Duration::from_millis(250), Duration::from_secs(10));
    let failures = RateLimited::new();
    loop {
        let attempt = tokio::select! {
            r = bus::connect_producer_as(settings, "collab-projector relay") => r,
            _ = stop.cancelled() => return None,
        };
        match attempt {
            Ok(pair) => {
                info!(server = %pair.0.server_info().version, "relay connected to NATS");
                return Some(pair);
            }
            Err(e) => {
                if let Some(n) = failures.tick() {
                    warn!(error = %e, attempts_since_last_line = n, "relay cannot connect to NATS yet; forwarding goes on, messages queue and then drop until it can");
                }
                if !retry.wait(stop).await {
                    return None;
                }
            }
        }
    }
}

/// Keep the connected flag and gauge current; async-nats reconnects on its own.
fn watch_connection(
    client: async_nats::Client,
    shared: Arc<Shared>,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let up = client.connection_state() == async_nats::connection::State::Connected;
            shared.connected.store(up, Ordering::Relaxed);
            metrics::gauge!(telemetry::RELAY_NATS_CONNECTED).set(if up { 1.0 } else { 0.0 });
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                _ = stop.cancelled() => return,
            }
        }
    })
}

/// When retries must end: once `stop` fires, within `timeout` of it.
struct Flush<'a> {
    stop: &'a CancellationToken,
    timeout: Duration,
    /// Set when the stop is first seen.
    deadline: &'a mut Option<Instant>,
}

/// Publish `batch` in order: send every message, then await the acknowledgements in order. A
/// message whose publish failed is sent again after a pause (its `Nats-Msg-Id` makes a second
/// store of one that did arrive a no-op) until it is stored, dropped by its [`Verdict`], or the
/// flush deadline passes (then it is dropped as `shutdown`).
async fn publish_batch(
    client: &async_nats::Client,
    js: &async_nats::jetstream::Context,
    batch: &mut Vec<Outgoing>,
    shared: &Shared,
    failures: &RateLimited,
    flush: Flush<'_>,
) {
    let held: usize = batch.iter().map(Outgoing::wire_len).sum();
    let mut todo: Vec<(Outgoing, u32)> = batch.drain(..).map(|m| (m, 0)).collect();
    publish_until_done(client, js, &mut todo, shared, failures, flush).await;
    // Released only now: while NATS is away the batch is held, and it counts against the bound.
    shared.release(held);
}

async fn publish_until_done(
    client: &async_nats::Client,
    js: &async_nats::jetstream::Context,
    todo: &mut Vec<(Outgoing, u32)>,
    shared: &Shared,
    failures: &RateLimited,
    flush: Flush<'_>,
) {
    let mut retry = Retry::new(Duration::from_millis(100), Duration::from_secs(5));
    loop {
        let max_payload = client.server_info().max_payload;
        let mut sent: Vec<(Outgoing, u32, Result<PublishAckFuture, PublishErrorKind>)> =
            Vec::with_capacity(todo.len());
        for (msg, attempts) in todo.drain(..) {
            if max_payload > 0 && msg.wire_len() > max_payload {
                shared.dropped(DropReason::TooLarge);
                continue;
            }
            let send = js.publish_with_headers(
                msg.subject.clone(),
                msg.headers.clone(),
                msg.payload.clone(),
            );
            // A send waits for a publish permit; bounded so a stalled connection cannot hold the
            // batch forever, nor a stopping relay past its flush time.
            let bound = flush.deadline.map_or(SEND_TIMEOUT, |d| {
                SEND_TIMEOUT.min(d.saturating_duration_since(Instant::now()))
            });
            let r = match tokio::time::timeout(bound, send).await {
                Ok(Ok(ack)) => Ok(ack),
                Ok(Err(e)) => Err(e.kind()),
                Err(_) => Err(PublishErrorKind::TimedOut),
            };
            sent.push((msg, attempts + 1, r));
        }
        for (msg, attempts, sent) in sent {
            let result = match sent {
                Ok(ack) => ack.await.map_err(|e| e.kind()),
                Err(kind) => Err(kind),
            };
            match result {
                Ok(ack) => {
                    metrics::counter!(telemetry::RELAY_PUBLISHED, "kind" => msg.kind.label())
                        .increment(1);
                    if ack.duplicate {
                        debug!(subject = %msg.subject, "already stored (a retried publish)");
                    }
                }
                Err(kind) => {
                    metrics::counter!(telemetry::RELAY_PUBLISH_FAILURES, "reason" => failure_label(&kind))
                        .increment(1);
                    if let Some(n) = failures.tick() {
                        warn!(reason = failure_label(&kind), error = %kind, failures_since_last_line = n, "publishing to NATS failed; retrying");
                    }
                    match verdict(&kind) {
                        Verdict::Retry => todo.push((msg, attempts)),
                        Verdict::RetryFew(reason) if attempts >= FEW_ATTEMPTS => {
                            shared.dropped(reason)
                        }
                        Verdict::RetryFew(_) => todo.push((msg, attempts)),
                        Verdict::Drop(reason) => shared.dropped(reason),
                    }
                }
            }
        }
        if todo.is_empty() {
            return;
        }
        if flush.stop.is_cancelled() && flush.deadline.is_none() {
            *flush.deadline = Some(Instant::now() + flush.timeout);
        }
        let deadline = *flush.deadline;
        if deadline.is_some_and(|d| Instant::now() >= d) {
            for _ in todo.drain(..) {
                shared.dropped(DropReason::Shutdown);
            }
            return;
        }
        let pause = retry.next_delay();
        match deadline {
            Some(d) => {
                tokio::time::sleep(pause.min(d.saturating_duration_since(Instant::now()))).await
            }
            None => {
                tokio::select! {
                    _ = tokio::time::sleep(pause) => {}
                    _ = flush.stop.cancelled() => {}
                }
            }
        }
    }
}
