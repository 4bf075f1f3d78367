//! The partition worker: pull a partition's raw messages in batches, project them, publish with
//! deterministic Msg-Ids, and acknowledge each input only after its outputs are stored.
//!
//! Two tasks per partition keep publishes pipelined without giving up order or durability:
//! the *reader* processes messages strictly in stream order and issues their publishes and
//! turn-record writes; the *acker* awaits the publish acks in the same order, retries a failed
//! publish in place (same Msg-Id, so a publish that did land collapses in the duplicate window),
//! awaits the turn-record writes (a refused one restarts the partition), counts the decided turns
//! whose responses are now stored towards the partition's published checkpoint (written at most
//! once a second), and only then acknowledges the inputs. A crash anywhere in between is
//! repaired by redelivery: the Msg-Ids (and the turn records) make reprocessing idempotent.
//! Nothing here waits for the work sessions: they are folded from the projection stream by
//! [`super::sessions::run_fold`], off this path.
//!
//! A partition that starts with messages a previous owner had in flight (delivered, not yet
//! acknowledged) first reads those from the stream itself and processes them, in order, before
//! pulling anything new: event-time decisions and per-key order then hold across a handover or a
//! crash, instead of waiting for their redelivery behind newer messages.

use super::publish::{self, Failure, Fence};
use super::turns::{
    Checkpoint, Effects, Flush, Hold, KvWrite, Mark, PartitionTurns, TurnIoError, WriteError,
    CHECKPOINT_EVERY,
};
use crate::config::{Names, Settings};
use crate::ingest;
use crate::pipeline::{self, OutKind, Outgoing, RawMessage};
use crate::telemetry;
use crate::turns::book::Watermark;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer};
use async_nats::jetstream::{self, message::PublishMessage, AckKind};
use futures::{FutureExt, StreamExt};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("partition {partition}: {detail}")]
    Setup { partition: u16, detail: String },
    /// The partition skipped messages it had been delivered (a lapsed lease, a broken batch):
    /// run it again, which first takes over what is in flight, in order.
    #[error("partition {partition} interrupted: {why}")]
    Interrupted { partition: u16, why: &'static str },
    /// An output could not be stored and waiting will not change that: the partition stops
    /// (and is restarted, with backoff, until an operator fixes the cause).
    #[error("partition {partition} stopped: {source}")]
    Publish {
        partition: u16,
        #[source]
        source: Failure,
    },
}

/// Why issuing an output stopped before it was stored.
#[derive(Debug)]
pub(crate) enum Halt {
    /// The worker is stopping while the publish keeps failing: leave the input for redelivery.
    Cancelled,
    /// A failure waiting does not heal (see [`publish::classify`]).
    Failed(Failure),
}

impl Halt {
    /// What the partition does about it: a lost fence is an interruption (the new owner has
    /// the partition); anything else stops it loudly.
    fn into_error(self, partition: u16) -> Option<WorkerError> {
        match self {
            Halt::Cancelled => None,
            Halt::Failed(Failure::Deposed { .. }) => Some(WorkerError::Interrupted {
                partition,
                why: "another owner claimed the partition",
            }),
            Halt::Failed(source) => Some(WorkerError::Publish { partition, source }),
        }
    }
}

/// A single-threaded runtime on a thread of its own, stopped when dropped: for work that must
/// neither hold the partitions' threads nor wait for them.
pub struct ThreadRuntime {
    pub handle: tokio::runtime::Handle,
    stop: CancellationToken,
}

impl ThreadRuntime {
    pub fn start(name: &str) -> std::io::Result<ThreadRuntime> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let handle = rt.handle().clone();
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || rt.block_on(stopped.cancelled()))?;
        Ok(ThreadRuntime { handle, stop })
    }

    /// A NATS connection of its own whose I/O runs on this thread, so a busy partition runtime
    /// never delays what this thread sends or receives.
    pub async fn connect(
        &self,
        settings: &Settings,
        name: &'static str,
    ) -> Result<jetstream::Context, super::ConnectError> {
        let failed = |detail: String| super::ConnectError::Connect {
            url: settings.nats.url.clone(),
            detail,
        };
        let settings = settings.clone();
        self.handle
            .spawn(async move { super::connect_as(&settings, name).await.map(|(_, js)| js) })
            .await
            .map_err(|e| failed(format!("connection thread: {e}")))?
    }
}

impl Drop for ThreadRuntime {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The publish-ack permits of the turn-record context: far above what the partitions can have
/// in flight (their channels and acker groups bound it), so a write never waits for one.
const KV_WRITES_IN_FLIGHT: usize = 1 << 20;

/// What the worker tells health checks and the demo.
#[derive(Debug)]
pub struct WorkerState {
    pub partitions_owned: AtomicUsize,
    pub partitions_running: AtomicUsize,
    pub inputs: AtomicU64,
    pub projected: AtomicU64,
    pub dead_lettered: AtomicU64,
    pub publish_retries: AtomicU64,
    /// Open turns over the partitions this worker runs (each partition adds its own count).
    pub open_turns: AtomicI64,
    pub redeliveries: AtomicU64,
    pub lease_renewals: AtomicU64,
    pub lease_losses: AtomicU64,
    pub takeovers: AtomicU64,
    /// Partition consumers this worker found missing and recreated.
    pub consumers_recreated: AtomicU64,
    /// When this worker last processed a raw message (ms since the epoch; 0: never).
    pub last_processed_ms: AtomicI64,
    /// The running partitions' lag, as last sampled.
    pub partitions: std::sync::Mutex<std::collections::BTreeMap<u16, PartitionLag>>,
    /// Inputs projected and projections published, by role and type class.
    inputs_projected: telemetry::RoleClassCounters,
    projections: telemetry::RoleClassCounters,
}

impl Default for WorkerState {
    fn default() -> Self {
        WorkerState {
            partitions_owned: AtomicUsize::new(0),
            partitions_running: AtomicUsize::new(0),
            inputs: AtomicU64::new(0),
            projected: AtomicU64::new(0),
            dead_lettered: AtomicU64::new(0),
            publish_retries: AtomicU64::new(0),
            open_turns: AtomicI64::new(0),
            redeliveries: AtomicU64::new(0),
            lease_renewals: AtomicU64::new(0),
            lease_losses: AtomicU64::new(0),
            takeovers: AtomicU64::new(0),
            consumers_recreated: AtomicU64::new(0),
            last_processed_ms: AtomicI64::new(0),
            partitions: std::sync::Mutex::new(std::collections::BTreeMap::new()),
            inputs_projected: telemetry::RoleClassCounters::new(
                telemetry::INPUTS,
                &[("outcome", "projected")],
            ),
            projections: telemetry::RoleClassCounters::new(telemetry::PROJECTED, &[]),
        }
    }
}

/// One running partition's lag, sampled from its consumer every [`LAG_SAMPLE_EVERY`].
#[derive(Debug, Clone, Default)]
pub struct PartitionLag {
    /// Raw messages not yet acknowledged (waiting and in flight).
    pub pending: u64,
    /// Store time of the oldest of them (ms since the epoch).
    pub oldest_pending_ms: Option<i64>,
    /// The partition's event-time watermark (ms since the epoch; 0 before the first message).
    pub watermark_ms: Arc<AtomicI64>,
    /// The consumer's acknowledgement floor at the last sample, and when it last moved (or the
    /// partition started), in ms since the epoch.
    ack_floor: u64,
    pub progress_ms: i64,
}

impl PartitionLag {
    /// As reported on the service API, at `now_ms`.
    pub fn status(&self, partition: u16, now_ms: i64) -> crate::telemetry::PartitionStatus {
        let age = |t: i64| u64::try_from(now_ms.saturating_sub(t)).unwrap_or(0);
        let watermark = self.watermark_ms.load(Ordering::Relaxed);
        crate::telemetry::PartitionStatus {
            partition,
            pending: self.pending,
            oldest_pending_age_ms: self.oldest_pending_ms.map(age),
            // Nothing pending: the partition is caught up, its watermark is now (the idle rule).
            watermark_age_ms: if self.pending == 0 {
                Some(0)
            } else {
                (watermark > 0).then(|| age(watermark))
            },
            progress_age_ms: age(self.progress_ms),
        }
    }
}

/// How often a running partition samples its consumer's lag.
pub const LAG_SAMPLE_EVERY: Duration = Duration::from_secs(5);

impl WorkerState {
    /// The running partitions' lag at `now_ms`, by partition.
    pub fn partition_status(&self, now_ms: i64) -> Vec<crate::telemetry::PartitionStatus> {
        match self.partitions.lock() {
            Ok(map) => map.iter().map(|(p, l)| l.status(*p, now_ms)).collect(),
            Err(_) => Vec::new(),
        }
    }

    /// Partitions with messages waiting whose acknowledgements have not moved for `bound`: a
    /// wedged worker.
    pub fn stalled(&self, now_ms: i64, bound: Duration) -> Vec<u16> {
        let bound_ms = i64::try_from(bound.as_millis()).unwrap_or(i64::MAX);
        match self.partitions.lock() {
            Ok(map) => map
                .iter()
                .filter(|(_, l)| l.pending > 0 && now_ms.saturating_sub(l.progress_ms) > bound_ms)
                .map(|(p, _)| *p)
                .collect(),
            Err(_) => Vec::new(),
        }
    }
}

/// Sample partition `p`'s lag every [`LAG_SAMPLE_EVERY`] until `stop`, into the worker's table
/// and the per-partition gauges; take the partition out of both when stopped.
async fn sample_lag(
    shared: Arc<WorkerContext>,
    p: u16,
    mut consumer: PullConsumer,
    stream: jetstream::stream::Stream,
    watermark_ms: Arc<AtomicI64>,
    stop: CancellationToken,
) {
    let label = p.to_string();
    let filter = shared.names.partition_filter(p);
    let started = super::now_ms();
    if let Ok(mut map) = shared.state.partitions.lock() {
        map.insert(
            p,
            PartitionLag {
                watermark_ms: watermark_ms.clone(),
                progress_ms: started,
                ..Default::default()
            },
        );
    }
    loop {
        if let Ok(info) = consumer.info().await {
            let pending = info.num_pending + u64::try_from(info.num_ack_pending).unwrap_or(0);
            let floor = info.ack_floor.stream_sequence;
            let oldest_pending_ms = if pending > 0 {
                stream
                    .raw_message_builder()
                    .next_by_subject(filter.clone())
                    .sequence(floor + 1)
                    .send()
                    .await
                    .ok()
                    .map(|m: jetstream::message::StreamMessage| m.time.timestamp_millis())
            } else {
                None
            };
            let now = super::now_ms();
            if let Ok(mut map) = shared.state.partitions.lock() {
                if let Some(lag) = map.get_mut(&p) {
                    if floor != lag.ack_floor || pending == 0 {
                        lag.ack_floor = floor;
                        lag.progress_ms = now;
                    }
                    lag.pending = pending;
                    lag.oldest_pending_ms = oldest_pending_ms;
                }
            }
            let age_s = |t: i64| now.saturating_sub(t).max(0) as f64 / 1000.0;
            metrics::gauge!(telemetry::PARTITION_PENDING, "partition" => label.clone())
                .set(pending as f64);
            metrics::gauge!(telemetry::PARTITION_OLDEST_AGE, "partition" => label.clone())
                .set(oldest_pending_ms.map_or(0.0, age_s));
            let wm = watermark_ms.load(Ordering::Relaxed);
            let wm_age = if pending == 0 || wm == 0 {
                0.0
            } else {
                age_s(wm)
            };
            metrics::gauge!(telemetry::PARTITION_WATERMARK_AGE, "partition" => label.clone())
                .set(wm_age);
        }
        tokio::select! {
            _ = tokio::time::sleep(LAG_SAMPLE_EVERY) => {}
            _ = stop.cancelled() => break,
        }
    }
    if let Ok(mut map) = shared.state.partitions.lock() {
        map.remove(&p);
    }
    for family in [
        telemetry::PARTITION_PENDING,
        telemetry::PARTITION_OLDEST_AGE,
        telemetry::PARTITION_WATERMARK_AGE,
    ] {
        metrics::gauge!(family, "partition" => label.clone()).set(0.0);
    }
}

/// The one place each counter is counted: the status counter here and its metric together, so
/// the status endpoint and `/metrics` never disagree.
impl WorkerState {
    fn count_input(&self, outcome: Outcome) {
        self.inputs.fetch_add(1, Ordering::Relaxed);
        match outcome {
            Outcome::Projected { role, class } => {
                self.inputs_projected.increment_class(role, class)
            }
            Outcome::DeadLettered(_) => metrics::counter!(
                telemetry::INPUTS,
                "outcome" => "dead_lettered", "role" => "none", "class" => "none"
            )
            .increment(1),
        }
    }

    pub(crate) fn count_output(&self, out: &Outgoing) {
        match out.kind {
            OutKind::Projection(role) => {
                self.projected.fetch_add(1, Ordering::Relaxed);
                let event_type = out
                    .headers
                    .iter()
                    .find(|(k, _)| *k == pipeline::H_TYPE)
                    .map_or("", |(_, t)| t.as_str());
                self.projections.increment(role, event_type);
            }
            OutKind::DeadLetter(reason) => {
                self.dead_lettered.fetch_add(1, Ordering::Relaxed);
                metrics::counter!(telemetry::DEAD_LETTERS, "reason" => reason.as_str())
                    .increment(1);
            }
        }
    }

    fn count_publish_retry(&self) {
        self.publish_retries.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(telemetry::PUBLISH_RETRIES).increment(1);
    }

    fn count_redelivery(&self) {
        self.redeliveries.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(telemetry::REDELIVERIES).increment(1);
    }

    pub(crate) fn count_lease_renewal(&self) {
        self.lease_renewals.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(telemetry::LEASE_RENEWALS).increment(1);
    }

    pub(crate) fn count_lease_loss(&self) {
        self.lease_losses.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(telemetry::LEASE_LOSSES).increment(1);
    }

    /// A partition taken: freed because its owner's connection closed, or free.
    pub(crate) fn count_takeover(&self, owner_gone: bool) {
        self.takeovers.fetch_add(1, Ordering::Relaxed);
        let cause = if owner_gone { "owner_gone" } else { "free" };
        metrics::counter!(telemetry::TAKEOVERS, "cause" => cause).increment(1);
    }
}

/// Everything the partition tasks share.
pub struct WorkerContext {
    pub js: jetstream::Context,
    /// A context of its own for KV reads and writes: they must never wait for a publish-ack
    /// permit held by a projection queued behind them (that would deadlock the partitions).
    pub kv_js: jetstream::Context,
    /// A context of its own for the partitions' published checkpoints: the acker writes one
    /// while the turn-record writes queued behind it hold `kv_js`'s publish-ack permits, and
    /// only the acker releases those (waiting there for a permit would stop every partition).
    pub checkpoint_js: jetstream::Context,
    /// A context of its own for publishes retried in place: the acker retries a failed
    /// projection while the projections queued behind it hold `js`'s publish-ack permits, and
    /// only the acker releases those.
    retry_js: jetstream::Context,
    /// The object store for offloaded fields, over a context of its own (a put awaits its acks
    /// inline, so it must not wait for a permit the partitions' publishes hold). Looked up once.
    blobs_js: jetstream::Context,
    blobs: tokio::sync::OnceCell<jetstream::object_store::ObjectStore>,
    /// The projection and dead-letter streams, for looking up what an input taken over from a
    /// previous owner already has stored. Looked up once.
    out_streams: tokio::sync::OnceCell<(jetstream::stream::Stream, jetstream::stream::Stream)>,
    pub settings: Settings,
    pub names: Names,
    pub ingest: ingest::Settings,
    pub state: Arc<WorkerState>,
    pub sessions: Arc<super::sessions::SessionWriter>,
    /// The thread that runs the work-session fold and its committer, and JetStream over its own
    /// connection: the fold's bursts of parsing and serialising never hold a thread the
    /// partitions run on, and its large session writes never queue in front of their publishes.
    pub sessions_rt: ThreadRuntime,
    pub sessions_js: jetstream::Context,
    /// The thread that renews the leases, and JetStream over its own connection: neither busy
    /// partitions (a large reload, a burst of publishes) nor their queued writes delay a renewal.
    pub leases_rt: ThreadRuntime,
    pub leases_js: jetstream::Context,
    /// The runtime the partitions run on (the lease loop spawns them here).
    pub partitions_rt: tokio::runtime::Handle,
    /// Test hook: fail every Nth publish attempt before it is sent (0 = never).
    pub fail_publish_every: u64,
    publish_attempts: AtomicU64,
    /// The largest output, headers included, the server and the output streams accept.
    pub out_budget: usize,
    /// How often each partition's replay started at the same sequence in a row (partition ->
    /// (sequence, attempts)): the replay path's delivery count, so `max_deliver` holds there
    /// too.
    replay_attempts: std::sync::Mutex<std::collections::HashMap<u16, (u64, i64)>>,
}

impl WorkerContext {
    pub async fn new(
        js: jetstream::Context,
        settings: Settings,
    ) -> Result<Arc<WorkerContext>, WorkerError> {
        let names = settings.names();
        let ingest = settings.ingest().map_err(|e| WorkerError::Setup {
            partition: 0,
            detail: e.to_string(),
        })?;
        let fail_publish_every = std::env::var("COLLAB_TEST_FAIL_PUBLISH_EVERY")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        // No publish-ack permit limit that matters for turn-record writes: the acker is the one
        // that awaits (and so releases) them, while a decision it awaits may itself be waiting
        // in its partition's queue for a permit. The partitions' channels and groups bound
        // what is in flight instead.
        let kv_js = jetstream::ContextBuilder::new()
            .timeout(Duration::from_secs(5))
            .max_ack_inflight(KV_WRITES_IN_FLIGHT)
            .build(js.client());
        let checkpoint_js = jetstream::ContextBuilder::new()
            .timeout(Duration::from_secs(5))
            .build(js.client());
        let retry_js = jetstream::ContextBuilder::new()
            .timeout(Duration::from_secs(5))
            .build(js.client());
        let blobs_js = jetstream::ContextBuilder::new()
            .timeout(Duration::from_secs(5))
            .build(js.client());
        let setup = |detail: String| WorkerError::Setup {
            partition: 0,
            detail,
        };
        let thread = |name: &str| {
            ThreadRuntime::start(name).map_err(|e| setup(format!("thread {name}: {e}")))
        };
        let sessions_rt = thread("collab-sessions")?;
        let sessions_js = sessions_rt
            .connect(&settings, "collab-projector-sessions")
            .await
            .map_err(|e| setup(e.to_string()))?;
        let leases_rt = thread("collab-leases")?;
        let leases_js = leases_rt
            .connect(&settings, "collab-projector-leases")
            .await
            .map_err(|e| setup(e.to_string()))?;
        let (writer_js, writer_names) = (sessions_js.clone(), names.clone());
        let sessions = sessions_rt
            .handle
            .spawn(
                async move { super::sessions::SessionWriter::new(&writer_js, &writer_names).await },
            )
            .await
            .map_err(|e| setup(format!("work-session thread: {e}")))?
            .map_err(|e| setup(e.to_string()))?;
        let out_budget = output_budget(&js, &names).await;
        Ok(Arc::new(WorkerContext {
            out_budget,
            replay_attempts: std::sync::Mutex::new(std::collections::HashMap::new()),
            sessions: Arc::new(sessions),
            sessions_rt,
            sessions_js,
            leases_rt,
            leases_js,
            partitions_rt: tokio::runtime::Handle::current(),
            kv_js,
            checkpoint_js,
            retry_js,
            blobs_js,
            blobs: tokio::sync::OnceCell::new(),
            out_streams: tokio::sync::OnceCell::new(),
            js,
            names,
            ingest,
            state: Arc::new(WorkerState::default()),
            fail_publish_every,
            publish_attempts: AtomicU64::new(0),
            settings,
        }))
    }

    /// Count one more start of partition `p`'s replay at `from` (1 for the first in a row).
    fn replay_attempt(&self, p: u16, from: u64) -> i64 {
        let Ok(mut attempts) = self.replay_attempts.lock() else {
            return 1;
        };
        let entry = attempts.entry(p).or_insert((from, 0));
        if entry.0 != from {
            *entry = (from, 0);
        }
        entry.1 += 1;
        entry.1
    }

    /// Most publishes a reader issues before it hands them to its acker (see `issue_publishes`):
    /// half of `consumer.publish_window` shared out among the partitions, at most 64, so all
    /// partitions together hold fewer unhanded publishes than `js` has permits.
    fn hand_over(&self) -> usize {
        let partitions = usize::from(self.settings.nats.partitions.max(1));
        (self.settings.consumer.publish_window / (2 * partitions)).clamp(1, 64)
    }

    /// Issue one publish on `js`, fenced by the partition's claim; the returned future
    /// resolves with the server's ack.
    async fn send(
        &self,
        js: &jetstream::Context,
        out: &Outgoing,
        fence: &Fence,
    ) -> Result<jetstream::context::PublishAckFuture, Failure> {
        if self.fail_publish_every > 0 {
            let n = self.publish_attempts.fetch_add(1, Ordering::Relaxed) + 1;
            if n % self.fail_publish_every == 0 {
                return Err(Failure::Transient {
                    subject: out.subject.clone(),
                    source: jetstream::context::PublishError::with_source(
                        jetstream::context::PublishErrorKind::Other,
                        "injected publish failure (COLLAB_TEST_FAIL_PUBLISH_EVERY)",
                    ),
                });
            }
        }
        let publish = PublishMessage::build()
            .payload(out.payload.clone())
            .headers(fence.headers(out))
            .message_id(out.msg_id.as_str());
        js.send_publish(out.subject.clone(), publish)
            .await
            .map_err(|e| publish::classify(&out.subject, e))
    }

    /// Publish until the server acknowledges, backing off between attempts while the failure
    /// is one waiting heals. Keeps `inputs` alive meanwhile so the server does not redeliver
    /// them. Gives up on cancellation, or at once on a failure waiting does not heal.
    pub(crate) async fn publish_in_place(
        &self,
        out: &Outgoing,
        fence: &Fence,
        inputs: &[&jetstream::Message],
        cancel: &CancellationToken,
    ) -> Result<(), Halt> {
        let mut patience = Patience::new();
        loop {
            let result = match self.send(&self.retry_js, out, fence).await {
                Ok(fut) => fut
                    .await
                    .map(|_| ())
                    .map_err(|e| publish::classify(&out.subject, e)),
                Err(f) => Err(f),
            };
            match result {
                Ok(()) => return Ok(()),
                Err(f @ Failure::Transient { .. }) => {
                    self.state.count_publish_retry();
                    warn!(error = %f, "publish failed; retrying in place");
                }
                Err(f) => return Err(Halt::Failed(self.count_failure(f))),
            }
            if !self.wait_keeping(inputs, cancel, &mut patience).await {
                return Err(Halt::Cancelled);
            }
        }
    }

    /// Whether `out`, an output of the raw input at `seq` (stored at `stored_ms`), is in its
    /// stream already: a previous owner (or an earlier run of this partition) stored it but did
    /// not live to acknowledge the input. Publishing it again would collapse only within the
    /// duplicate window; this look-up holds beyond it. Outputs of one subject are stored in raw
    /// order, so the subject's last message answers at once unless it is a later input's; then
    /// the subject is read from the input's store time on. Unknown (a failed look-up): `false`,
    /// the output is published (the Msg-Id still collapses it within the window).
    async fn stored_already(&self, out: &Outgoing, seq: u64, stored_ms: i64) -> bool {
        let Ok((proj, dlq)) = self
            .out_streams
            .get_or_try_init(|| async {
                let proj = self.retry_js.get_stream(&self.names.proj_stream).await?;
                let dlq = self.retry_js.get_stream(&self.names.dlq_stream).await?;
                Ok::<_, jetstream::context::GetStreamError>((proj, dlq))
            })
            .await
        else {
            return false;
        };
        let stream = match out.kind {
            OutKind::Projection(_) => proj,
            OutKind::DeadLetter(_) => dlq,
        };
        let source = |h: &async_nats::HeaderMap| {
            h.get(pipeline::H_SOURCE_SEQ)
                .and_then(|v| v.as_str().parse::<u64>().ok())
        };
        let same = |h: &async_nats::HeaderMap| {
            h.get("Nats-Msg-Id")
                .is_some_and(|id| id.as_str() == out.msg_id)
        };
        let last = match stream.get_last_raw_message_by_subject(&out.subject).await {
            Ok(last) => last,
            Err(_) => return false,
        };
        if same(&last.headers) {
            return true;
        }
        if source(&last.headers).is_none_or(|s| s <= seq) {
            return false;
        }
        // A later input's output is last: look for this one among the subject's messages since
        // the input was stored (give or take the servers' clocks).
        let since = chrono::DateTime::from_timestamp_millis(stored_ms.saturating_sub(60_000))
            .unwrap_or_default();
        let Ok(reader) = stream
            .create_consumer(jetstream::consumer::pull::OrderedConfig {
                filter_subject: out.subject.clone(),
                deliver_policy: jetstream::consumer::DeliverPolicy::ByStartTime {
                    start_time: since,
                },
                ..Default::default()
            })
            .await
        else {
            return false;
        };
        let Ok(mut messages) = reader.messages().await else {
            return false;
        };
        while let Ok(Some(Ok(m))) =
            tokio::time::timeout(Duration::from_secs(2), messages.next()).await
        {
            if m.headers.as_ref().is_some_and(same) {
                return true;
            }
            let Ok(info) = m.info() else {
                return false;
            };
            if info.stream_sequence >= last.sequence || info.pending == 0 {
                break;
            }
        }
        false
    }

    /// Count (and log) a failure waiting does not heal.
    fn count_failure(&self, f: Failure) -> Failure {
        metrics::counter!(telemetry::PUBLISH_FAILURES, "class" => f.class()).increment(1);
        match &f {
            Failure::Deposed { .. } => warn!(error = %f, "partition claimed by another owner"),
            _ => tracing::error!(error = %f, "an output cannot be stored; stopping the partition"),
        }
        f
    }

    /// `out`, made to fit [`WorkerContext::out_budget`]: a dead letter keeps an excerpt, a
    /// projection still too large (its payload is offloaded already) becomes a `too_large`
    /// dead letter.
    fn fit(&self, out: Outgoing) -> Outgoing {
        let out = match out.kind {
            OutKind::Projection(_) if publish::wire_size(&out) > self.out_budget => {
                warn!(subject = %out.subject, bytes = out.payload.len(),
                    "a projection is too large to publish; dead-lettering its input too_large");
                pipeline::too_large(&self.names, &out, self.out_budget)
            }
            _ => out,
        };
        publish::fit_dead_letter(out, &self.names.raw_stream, self.out_budget)
    }

    /// Store the fields an input's projections refer to, before those are published. Retried
    /// in place like a publish; `false` on cancellation (the input is left for redelivery, and
    /// storing the same blob again writes the same object).
    async fn store_blobs_in_place(
        &self,
        blobs: &[crate::blobs::Blob],
        inputs: &[&jetstream::Message],
        cancel: &CancellationToken,
    ) -> bool {
        for blob in blobs {
            let failed = |e: &str| {
                warn!(blob = %blob.id, bytes = blob.data.len(), error = %e,
                    "storing an offloaded field failed; retrying in place");
            };
            if !self
                .in_place(inputs, cancel, || self.put_blob(blob), failed)
                .await
            {
                return false;
            }
            metrics::counter!(telemetry::BLOBS_STORED).increment(1);
            metrics::counter!(telemetry::BLOB_BYTES).increment(blob.data.len() as u64);
        }
        true
    }

    async fn put_blob(&self, blob: &crate::blobs::Blob) -> Result<(), String> {
        use crate::blobs::{META_CONTENT_TYPE, META_ROLE, META_SHA256};
        let store = self
            .blobs
            .get_or_try_init(|| self.blobs_js.get_object_store(&self.names.blobs_store))
            .await
            .map_err(|e| format!("object store {}: {e}", self.names.blobs_store))?;
        let meta = jetstream::object_store::ObjectMetadata {
            name: blob.id.clone(),
            description: Some("offloaded field".into()),
            metadata: [
                (META_ROLE, blob.role.as_str()),
                (META_SHA256, blob.sha256.as_str()),
                (META_CONTENT_TYPE, blob.content_type),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
            ..Default::default()
        };
        store
            .put(meta, &mut blob.data.as_ref())
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    /// Run `attempt` until it succeeds, backing off between attempts and telling `failed` each
    /// failure. Keeps `inputs` alive meanwhile so the server does not redeliver them. Gives up
    /// only on cancellation, after a while (the inputs then stay unacknowledged, for
    /// redelivery).
    async fn in_place<F, Fut>(
        &self,
        inputs: &[&jetstream::Message],
        cancel: &CancellationToken,
        mut attempt: F,
        failed: impl Fn(&str),
    ) -> bool
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<(), String>>,
    {
        let mut patience = Patience::new();
        loop {
            match attempt().await {
                Ok(()) => return true,
                Err(e) => failed(&e),
            }
            if !self.wait_keeping(inputs, cancel, &mut patience).await {
                return false;
            }
        }
    }

    /// Wait before the next attempt of something retried in place, keeping `inputs` from being
    /// redelivered meanwhile. `false`: stop trying (cancelled, and given a while to succeed).
    async fn wait_keeping(
        &self,
        inputs: &[&jetstream::Message],
        cancel: &CancellationToken,
        patience: &mut Patience,
    ) -> bool {
        let delay = patience.retry.next_delay();
        if cancel.is_cancelled() {
            if patience.since_cancel >= self.settings.consumer.ack_wait.min(Duration::from_secs(10))
            {
                return false;
            }
            patience.since_cancel += delay;
        }
        tokio::time::sleep(delay).await;
        patience.since_progress += delay;
        if patience.since_progress >= self.settings.consumer.ack_wait / 3 {
            for m in inputs {
                let _ = m.ack_with(AckKind::Progress).await;
            }
            patience.since_progress = Duration::ZERO;
        }
        true
    }
}

/// The state of one thing retried in place: its backoff, and how long since the inputs it
/// holds were last marked in progress and since the worker started stopping.
struct Patience {
    retry: super::Retry,
    since_progress: Duration,
    since_cancel: Duration,
}

impl Patience {
    fn new() -> Patience {
        Patience {
            retry: super::Retry::new(Duration::from_millis(50), Duration::from_secs(2)),
            since_progress: Duration::ZERO,
            since_cancel: Duration::ZERO,
        }
    }
}

/// The largest output the server (`max_payload`) and the projection and dead-letter streams
/// (their largest message, when set) accept.
async fn output_budget(js: &jetstream::Context, names: &Names) -> usize {
    let mut budget = js.client().server_info().max_payload;
    for name in [&names.proj_stream, &names.dlq_stream] {
        if let Ok(mut stream) = js.get_stream(name).await {
            if let Ok(info) = stream.info().await {
                if let Ok(max) = usize::try_from(info.config.max_message_size) {
                    if max > 0 {
                        budget = budget.min(max);
                    }
                }
            }
        }
    }
    budget
}

/// One input processed in partition order (or deadlines decided while the partition was idle),
/// as the acker receives it.
struct Processed {
    /// The consumer delivery to acknowledge; `None` for messages re-read from the stream at
    /// takeover, and for deadlines decided while the partition was idle.
    msg: Option<jetstream::Message>,
    publishes: Publishes,
    /// Turn-record writes that must be stored before the message is acknowledged.
    writes: Vec<KvWrite>,
    /// Decided turns whose responses are among `publishes`: counted towards the published
    /// checkpoint once those are stored.
    marks: Vec<Mark>,
    /// Turns it opened whose records are deferred: neither it nor anything after it is
    /// acknowledged before they resolve.
    holds: Vec<Hold>,
    /// When its publishes and writes were issued (for their latency).
    issued: tokio::time::Instant,
    /// The raw store time of `msg` (ms since the epoch), for the end-to-end latency.
    stored_ms: Option<i64>,
}

impl Processed {
    /// What the turn rules asked for, issued, for `msg`.
    fn new(msg: Option<jetstream::Message>, publishes: Publishes, fx: Effects) -> Processed {
        let stored_ms = msg
            .as_ref()
            .and_then(|m| m.info().ok())
            .map(|i| i.published.timestamp_millis());
        Processed {
            msg,
            publishes,
            writes: fx.writes,
            marks: fx.marks,
            holds: fx.holds,
            issued: tokio::time::Instant::now(),
            stored_ms,
        }
    }
}

/// Run one partition until `cancel`: finish the batch in hand, acknowledge what was published,
/// and return.
///
/// `lease_valid_until` (ms since the epoch, 0 = no lease) is how long this worker's lease on the
/// partition is known to hold: past it (a paused process, a stalled renewal) the partition takes
/// no work, so a worker that lost its lease without noticing yet does not process next to the
/// new owner.
pub async fn run_partition(
    shared: Arc<WorkerContext>,
    p: u16,
    owner: &str,
    cancel: CancellationToken,
    lease_valid_until: Arc<AtomicI64>,
) -> Result<(), WorkerError> {
    let setup = |detail: String| WorkerError::Setup {
        partition: p,
        detail,
    };
    let stream = shared
        .js
        .get_stream(&shared.names.raw_stream)
        .await
        .map_err(|e| setup(format!("stream {}: {e}", shared.names.raw_stream)))?;
    while lease_lapsed(&lease_valid_until) && !cancel.is_cancelled() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Claimed before anything is published (a reload may republish responses): from here on a
    // previous owner's outputs, however late they arrive, are refused by the server.
    let fence = Fence::claim(&shared.js, &shared.names, p, owner)
        .await
        .map_err(|e| setup(format!("claiming the partition's fence: {e}")))?;
    let mut turns = PartitionTurns::new(&shared, p, fence.clone())
        .await
        .map_err(|e| setup(e.to_string()))?;
    let (loaded, checkpoint) = match turns.reload(&shared, &cancel).await {
        Ok(r) => r,
        Err(TurnIoError::Publish(source)) => {
            return Err(Halt::Failed(source)
                .into_error(p)
                .unwrap_or_else(|| setup("reload".into())))
        }
        Err(e) => return Err(setup(e.to_string())),
    };
    let (mut consumer, recreated) =
        open_consumer(&shared, &stream, p, checkpoint.resume_after()).await?;
    // A recreated consumer starts after the checkpoint, which can be up to a second behind what
    // was acknowledged: inputs up to the stream's end now may have their outputs stored already.
    let verify_through = if recreated {
        let mut stream = stream.clone();
        stream
            .info()
            .await
            .map(|i| i.state.last_sequence)
            .unwrap_or(u64::MAX)
    } else {
        0
    };
    shared
        .state
        .partitions_running
        .fetch_add(1, Ordering::Relaxed);
    debug!(partition = p, loaded, "partition started");
    let watermark_ms = Arc::new(AtomicI64::new(0));
    let sampler_stop = CancellationToken::new();
    let sampler = tokio::spawn(sample_lag(
        shared.clone(),
        p,
        consumer.clone(),
        stream.clone(),
        watermark_ms.clone(),
        sampler_stop.clone(),
    ));

    let (tx, rx) = mpsc::channel::<Processed>(512);
    let broken = CancellationToken::new();
    let acks = match consumer.cached_info().config.ack_policy {
        AckPolicy::All => Acks::Last,
        _ => Acks::Each,
    };
    let acker = tokio::spawn(tracing::Instrument::in_current_span(ack_stage(
        shared.clone(),
        stream.clone(),
        Stage {
            p,
            acks,
            fence: fence.clone(),
        },
        rx,
        checkpoint,
        cancel.clone(),
        broken.clone(),
    )));
    let mut part = Partition {
        shared: &shared,
        p,
        turns,
        watermark: Watermark::default(),
        watermark_ms,
        last_seq: 0,
        barrier_subject: shared
            .names
            .barrier_subject(p, shared.settings.nats.partitions),
        barrier_sent_ms: None,
        next_delivery: 0,
        verify_through,
        fence,
        tx,
        cancel: &cancel,
        broken: &broken,
    };
    let mut result = part.run(&stream, &mut consumer, &lease_valid_until).await;
    debug!(
        partition = p,
        ok = result.is_ok(),
        "partition reader stopped"
    );
    if result.is_ok() && !broken.is_cancelled() {
        // Stopping: write the open records still deferred, so everything processed can be
        // acknowledged and the next owner has nothing to take over twice.
        if let Err(e) = part.flush(Flush::All).await {
            result = Err(e);
        }
    }
    drop(part);
    debug!(partition = p, "waiting for the acker to drain");
    let acked = acker.await;
    sampler_stop.cancel();
    let _ = sampler.await;
    shared
        .state
        .partitions_running
        .fetch_sub(1, Ordering::Relaxed);
    debug!(partition = p, "partition stopped");
    if let Ok(Err(e)) = acked {
        return Err(e);
    }
    if broken.is_cancelled() {
        return Err(WorkerError::Interrupted {
            partition: p,
            why: "a turn state write was refused",
        });
    }
    result
}

/// The partition's durable consumer; recreated when missing (deleted by an operator, lost with
/// a server's store), from where the partition's outputs end (`resume_after`, the published
/// checkpoint), never from the start of the stream unless the partition never ran.
async fn open_consumer(
    shared: &WorkerContext,
    stream: &jetstream::stream::Stream,
    p: u16,
    resume_after: Option<u64>,
) -> Result<(PullConsumer, bool), WorkerError> {
    use jetstream::context::ConsumerInfoErrorKind;
    let name = shared.names.consumer_name(p);
    let setup = |detail: String| WorkerError::Setup {
        partition: p,
        detail,
    };
    match stream.consumer_info(&name).await {
        Ok(info) => {
            // Recreated by provisioning from the checkpoint and not read from yet: its first
            // inputs are looked up like those of a consumer recreated here.
            let resumed = info.delivered.consumer_sequence == 0
                && matches!(
                    info.config.deliver_policy,
                    jetstream::consumer::DeliverPolicy::ByStartSequence { .. }
                );
            stream
                .get_consumer(&name)
                .await
                .map(|c| (c, resumed))
                .map_err(|e| setup(format!("consumer {name}: {e}")))
        }
        Err(e) if e.kind() == ConsumerInfoErrorKind::NotFound => {
            let config =
                super::provision::resumed_consumer_config(&shared.settings, p, resume_after);
            warn!(consumer = %name, resume_after = ?resume_after,
                "the partition's consumer is missing; recreating it from the partition's checkpoint");
            metrics::counter!(telemetry::CONSUMERS_RECREATED).increment(1);
            shared
                .state
                .consumers_recreated
                .fetch_add(1, Ordering::Relaxed);
            stream
                .create_consumer(config)
                .await
                .map(|c| (c, true))
                .map_err(|e| setup(format!("recreating consumer {name}: {e}")))
        }
        Err(e) => Err(setup(format!("consumer {name}: {e}"))),
    }
}

/// Whether a partition goes on after a step.
enum Flow {
    Continue,
    Stop,
}

/// One running partition: its turns, its event-time watermark and the highest raw sequence it
/// processed.
struct Partition<'a> {
    shared: &'a Arc<WorkerContext>,
    p: u16,
    turns: PartitionTurns,
    watermark: Watermark,
    /// The watermark, for the lag sampler.
    watermark_ms: Arc<AtomicI64>,
    last_seq: u64,
    /// Where this partition's barriers are published, and when the last one was sent (ms since
    /// the epoch) if it has not arrived yet.
    barrier_subject: String,
    barrier_sent_ms: Option<i64>,
    /// The consumer sequence the next delivery must carry: a delivery past it means another
    /// client (a previous owner's late pull, an abandoned request) was delivered to, and what
    /// it got must not be covered by this partition's acknowledgements.
    next_delivery: u64,
    /// Inputs up to this raw sequence may have their outputs stored already (the consumer was
    /// recreated from a checkpoint): each is looked up before it is published, until the first
    /// that is not stored.
    verify_through: u64,
    /// This owner's claim, which every output it publishes expects.
    fence: Fence,
    tx: mpsc::Sender<Processed>,
    cancel: &'a CancellationToken,
    /// Cancelled by the acker when a turn-record write failed: stop and restart the partition.
    broken: &'a CancellationToken,
}

impl Partition<'_> {
    fn setup(&self, detail: String) -> WorkerError {
        WorkerError::Setup {
            partition: self.p,
            detail,
        }
    }

    async fn run(
        &mut self,
        stream: &jetstream::stream::Stream,
        consumer: &mut PullConsumer,
        lease_valid_until: &AtomicI64,
    ) -> Result<(), WorkerError> {
        // Take over what a previous owner left in flight, in order, before anything new.
        let info = consumer
            .info()
            .await
            .map_err(|e| self.setup(format!("consumer info: {e}")))?;
        self.next_delivery = info.delivered.consumer_sequence + 1;
        if info.num_ack_pending > 0 {
            let (from, to) = (
                info.ack_floor.stream_sequence + 1,
                info.delivered.stream_sequence,
            );
            if let Flow::Stop = self.replay(stream, from, to).await? {
                return Ok(());
            }
        }
        let batch = self.shared.settings.consumer.batch;
        let skew = i64::try_from(self.shared.settings.turns.clock_skew.as_millis()).unwrap_or(0);
        // When a due deadline cannot fire yet (messages are still pending), look again no sooner
        // than this (ms since the epoch): the check costs a JetStream API request.
        let mut idle_check_after = 0i64;
        let mut retry = super::Retry::new(Duration::from_millis(100), Duration::from_secs(5));
        loop {
            if self.cancel.is_cancelled() || self.broken.is_cancelled() {
                return Ok(());
            }
            if lease_lapsed(lease_valid_until) {
                // Pull nothing until the lease is renewed, or the lease loop stops the partition.
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                    _ = self.cancel.cancelled() => {}
                }
                continue;
            }
            let mut messages = match PullBatch::request(&self.shared.js, consumer, batch).await {
                Ok(m) => m,
                Err(e) => {
                    warn!(partition = self.p, error = %e, "pull failed; retrying");
                    if !retry.wait(self.cancel).await {
                        return Ok(());
                    }
                    continue;
                }
            };
            retry.reset();
            let mut in_batch = 0usize;
            // Lines logged while the batch is processed carry its first raw sequence (and each
            // input's own where it matters).
            let batch_span = tracing::info_span!("batch", from = tracing::field::Empty);
            // The batch is bounded (size and expiry): finishing it on cancel is the drain.
            loop {
                let deadline = self.turns.next_deadline().map(|d| {
                    let due = d.saturating_add(skew).max(idle_check_after);
                    let wait_ms = due.saturating_sub(super::now_ms()).max(0);
                    tokio::time::Instant::now()
                        + Duration::from_millis(u64::try_from(wait_ms).unwrap_or(0))
                });
                let flush = self.turns.next_flush();
                let timer = match (deadline, flush) {
                    (Some(d), Some(f)) => Some(d.min(f)),
                    (d, f) => d.or(f),
                };
                let next = tokio::select! {
                    biased;
                    _ = self.broken.cancelled() => return Ok(()),
                    m = messages.next() => m,
                    _ = sleep_until_opt(timer) => {
                        let now = tokio::time::Instant::now();
                        if flush.is_some_and(|f| f <= now) {
                            self.flush(Flush::Due).await?;
                        }
                        if deadline.is_some_and(|d| d <= now) {
                            self.idle_tick(consumer).await;
                            idle_check_after = super::now_ms() + IDLE_CHECK_MS;
                        }
                        continue;
                    }
                };
                let Some(next) = next else {
                    if in_batch > 0 {
                        metrics::histogram!(telemetry::BATCH_SIZE).record(in_batch as f64);
                    }
                    break;
                };
                in_batch += 1;
                let msg = match next {
                    Ok(m) => m,
                    Err(e) => {
                        // Messages of this batch may have been lost on the way: start over from
                        // what the consumer says is in flight, so nothing is processed out of
                        // order.
                        debug!(partition = self.p, error = %e, "batch ended with an error");
                        return Err(WorkerError::Interrupted {
                            partition: self.p,
                            why: "a pull batch failed",
                        });
                    }
                };
                if lease_lapsed(lease_valid_until) {
                    // The lease may have lapsed (e.g. this process was paused): take no more work
                    // from this batch; the restart takes over what was left of it, in order.
                    return Err(WorkerError::Interrupted {
                        partition: self.p,
                        why: "the lease may have lapsed",
                    });
                }
                if let Ok(info) = msg.info() {
                    if in_batch == 1 {
                        batch_span.record("from", info.stream_sequence);
                    }
                    if info.consumer_sequence != self.next_delivery {
                        // Deliveries in between went to another client: nothing after them may
                        // be acknowledged by this partition. Start over from the ack floor.
                        warn!(
                            partition = self.p,
                            expected = self.next_delivery,
                            got = info.consumer_sequence,
                            seq = info.stream_sequence,
                            "a consumer delivery went elsewhere; restarting the partition"
                        );
                        metrics::counter!(telemetry::DELIVERY_GAPS).increment(1);
                        return Err(WorkerError::Interrupted {
                            partition: self.p,
                            why: "a consumer delivery went to another client",
                        });
                    }
                    self.next_delivery = info.consumer_sequence + 1;
                }
                let step = self.process_in_order(msg, true, None);
                if let Flow::Stop =
                    tracing::Instrument::instrument(step, batch_span.clone()).await?
                {
                    return Ok(());
                }
            }
        }
    }

    /// Write deferred open records (`what`) outside of any input, and hand the writes to the
    /// acker: the holds of the inputs that opened those turns resolve with them.
    async fn flush(&mut self, what: Flush) -> Result<(), WorkerError> {
        let mut fx = Effects::default();
        self.turns
            .flush(self.shared, what, &mut fx)
            .await
            .map_err(|e| self.turn_error(e))?;
        self.issue_unprompted(fx).await
    }

    /// Issue what the turn rules asked for outside of any input (deferred open records written,
    /// deadlines decided while idle) and hand it to the acker. Cancelled meanwhile, it hands
    /// nothing over: nothing is acknowledged for it, and the next owner redoes it.
    async fn issue_unprompted(&mut self, mut fx: Effects) -> Result<(), WorkerError> {
        if fx.is_empty() {
            return Ok(());
        }
        let outs = std::mem::take(&mut fx.outs);
        match issue_publishes(self.shared, &self.fence, outs, &[], &self.tx, self.cancel).await {
            Ok(publishes) => {
                let _ = self.tx.send(Processed::new(None, publishes, fx)).await;
                Ok(())
            }
            Err(halt) => match self.halted(halt) {
                None => Ok(()),
                Some(e) => Err(e),
            },
        }
    }

    /// A due deadline with no message to move the watermark: when the consumer has nothing
    /// pending and everything delivered was processed, send the partition a barrier.
    async fn idle_tick(&mut self, consumer: &mut PullConsumer) {
        let Ok(info) = consumer.info().await else {
            return;
        };
        // Everything delivered was processed: either acknowledged already (by us or a previous
        // owner) or processed by us and awaiting its ack.
        let all_processed =
            info.num_ack_pending == 0 || info.delivered.stream_sequence <= self.last_seq;
        if info.num_pending != 0 || !all_processed {
            return;
        }
        // The consumer's view can lag what the stream has stored: after a stream leader
        // election the new leader commits the old leader's last messages with the store times
        // the old leader gave them, seconds in the past, and a consumer whose leader is on a
        // replica still catching up counts nothing pending. So the clock alone cannot move the
        // watermark. A barrier published to this partition goes through the stream's log
        // behind every message stored before it: when it is delivered, everything stored
        // before its store time (give or take the leaders' clock skew) has been, and its store
        // time moves the watermark like any message's.
        let now = super::now_ms();
        if self
            .barrier_sent_ms
            .is_some_and(|sent| now.saturating_sub(sent) < BARRIER_RETRY_MS)
        {
            return;
        }
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(crate::pipeline::H_BARRIER, "1");
        // A core publish: the stream stores it, and nothing waits for a publish-ack permit. A
        // barrier lost on the way (no stream leader) is sent again after BARRIER_RETRY_MS.
        if let Err(e) = self
            .shared
            .js
            .client()
            .publish_with_headers(self.barrier_subject.clone(), headers, bytes::Bytes::new())
            .await
        {
            debug!(partition = self.p, error = %e, "barrier not sent");
        }
        self.barrier_sent_ms = Some(now);
    }

    /// A halted publish: left for redelivery when shutting down, else the partition stops.
    fn left_or_stopped(&self, halt: Halt) -> Result<Disposition, WorkerError> {
        match self.halted(halt) {
            None => Ok(Disposition::LeftForRedelivery(Unprocessed::ShuttingDown)),
            Some(e) => Err(e),
        }
    }

    fn turn_error(&self, e: TurnIoError) -> WorkerError {
        match e {
            TurnIoError::Publish(source) => Halt::Failed(source)
                .into_error(self.p)
                .unwrap_or_else(|| self.setup("publish".into())),
            TurnIoError::Conflict { .. } => {
                debug!(partition = self.p, error = %e, "restarting the partition");
                WorkerError::Interrupted {
                    partition: self.p,
                    why: "another owner wrote a turn record",
                }
            }
            TurnIoError::WriteFailed { .. } => {
                debug!(partition = self.p, error = %e, "restarting the partition");
                WorkerError::Interrupted {
                    partition: self.p,
                    why: "a turn record write was not stored",
                }
            }
            e => self.setup(e.to_string()),
        }
    }

    /// Process the messages `from..=to` of this partition read straight from the stream (they
    /// were delivered, to a previous owner or to a batch that ended early, but not processed).
    /// Their deliveries are acknowledged when redelivered, after processing them again is a no-op.
    async fn replay(
        &mut self,
        stream: &jetstream::stream::Stream,
        from: u64,
        to: u64,
    ) -> Result<Flow, WorkerError> {
        if to < from {
            return Ok(Flow::Continue);
        }
        let reading = |e: &dyn std::fmt::Display| format!("reading in-flight messages: {e}");
        let p = self.p;
        let short = |why: &'static str| {
            warn!(
                partition = p,
                from, to, why, "replay incomplete; restarting the partition"
            );
            WorkerError::Interrupted { partition: p, why }
        };
        // The replay's delivery count: how many times in a row this partition started over at
        // `from`. Its first message is dead-lettered `max_deliver` once that reaches the limit,
        // as a consumer delivery would be.
        let attempt = self.shared.replay_attempt(self.p, from);
        let mut replay = stream
            .create_consumer(jetstream::consumer::pull::OrderedConfig {
                filter_subject: self.shared.names.partition_filter(self.p),
                deliver_policy: jetstream::consumer::DeliverPolicy::ByStartSequence {
                    start_sequence: from,
                },
                ..Default::default()
            })
            .await
            .map_err(|e| self.setup(reading(&e)))?;
        // Nothing of the partition is stored from `from` on: the range was deleted.
        let stored = replay.cached_info().num_pending;
        if stored == 0 {
            let _ = replay.info().await;
            debug!(partition = self.p, from, to, "nothing left to take over");
            return Ok(Flow::Continue);
        }
        let mut replayed = replay
            .messages()
            .await
            .map_err(|e| self.setup(reading(&e)))?;
        let mut count = 0usize;
        // Every message of the range is processed, or the partition starts over: a replay that
        // ends early (a server pause, a dropped connection) must never let the next
        // acknowledgement cover what it did not reach.
        loop {
            let msg = match tokio::time::timeout(REPLAY_SILENCE, replayed.next()).await {
                Ok(Some(Ok(msg))) => msg,
                Ok(Some(Err(_))) => return Err(short("the replay of in-flight messages failed")),
                Ok(None) | Err(_) => {
                    return Err(short("the replay of in-flight messages stopped short"))
                }
            };
            let Ok(info) = msg.info() else {
                return Err(short("a replayed message's metadata could not be read"));
            };
            let (seq, left) = (info.stream_sequence, info.pending);
            if seq > to {
                break;
            }
            let delivered = if count == 0 { attempt } else { 1 };
            count += 1;
            if let Flow::Stop = self.process_in_order(msg, false, Some(delivered)).await? {
                return Ok(Flow::Stop);
            }
            // `left == 0`: the rest of the range was deleted.
            if seq >= to || left == 0 {
                break;
            }
        }
        debug!(
            partition = self.p,
            from, to, count, "took over in-flight messages"
        );
        Ok(Flow::Continue)
    }

    /// Process one message in partition order, then act on what became of it: hand it to the
    /// acker, or leave it for redelivery. `ack`: whether it is a consumer delivery to
    /// acknowledge (false for messages re-read from the stream).
    async fn process_in_order(
        &mut self,
        msg: jetstream::Message,
        ack: bool,
        delivered: Option<i64>,
    ) -> Result<Flow, WorkerError> {
        match self.dispose(msg, ack, delivered).await? {
            Disposition::Issued { processed, outcome } => {
                self.shared.state.count_input(outcome);
                if let Outcome::DeadLettered(reason) = outcome {
                    debug!(
                        partition = self.p,
                        seq = self.last_seq,
                        reason = reason.as_str(),
                        "input dead-lettered"
                    );
                }
                if self.tx.send(processed).await.is_err() {
                    return Ok(Flow::Stop);
                }
                Ok(Flow::Continue)
            }
            Disposition::Barrier(processed) => {
                if self.tx.send(processed).await.is_err() {
                    return Ok(Flow::Stop);
                }
                Ok(Flow::Continue)
            }
            Disposition::LeftForRedelivery(Unprocessed::MetadataUnreadable) => {
                Err(WorkerError::Interrupted {
                    partition: self.p,
                    why: "a delivery's metadata could not be read",
                })
            }
            Disposition::LeftForRedelivery(Unprocessed::ShuttingDown) => Ok(Flow::Stop),
        }
    }

    /// The error a halted publish stops the partition with (`None`: shutting down).
    fn halted(&self, halt: Halt) -> Option<WorkerError> {
        halt.into_error(self.p)
    }

    /// Decide what happens to one message: project it (or dead-letter it) and issue its outputs,
    /// retrying a failed publish in place; or leave it unprocessed.
    async fn dispose(
        &mut self,
        msg: jetstream::Message,
        ack: bool,
        delivered: Option<i64>,
    ) -> Result<Disposition, WorkerError> {
        let info = match msg.info() {
            Ok(info) => info,
            Err(e) => {
                // Without its sequence the message can be neither processed in order nor
                // dead-lettered with a reference; skipping it would let the next group's
                // acknowledgement cover it. Leave it (and what follows) for redelivery.
                warn!(partition = self.p, subject = %msg.subject, reply = ?msg.reply, error = %e,
                    "a delivery's metadata cannot be read; restarting the partition");
                return Ok(Disposition::LeftForRedelivery(
                    Unprocessed::MetadataUnreadable,
                ));
            }
        };
        let seq = info.stream_sequence;
        let stored_ms = info.published.timestamp_millis();
        if info.delivered > 1 {
            self.shared.state.count_redelivery();
        }
        let mut fx = Effects::default();
        self.turns
            .before_input(self.shared, &mut fx)
            .await
            .map_err(|e| self.turn_error(e))?;
        // Every message stored before this one has been processed: deadlines before its store
        // time have passed in event time.
        self.shared
            .state
            .last_processed_ms
            .store(super::now_ms(), Ordering::Relaxed);
        if let Some(wm) = self.watermark.observe(stored_ms) {
            self.watermark_ms.store(wm, Ordering::Relaxed);
            self.turns
                .advance(self.shared, wm, &mut fx)
                .await
                .map_err(|e| self.turn_error(e))?;
        }
        self.last_seq = self.last_seq.max(seq);
        if is_barrier(&msg) {
            // Not an input: it only moved the watermark. What that decided is issued with it.
            self.barrier_sent_ms = None;
            let outs = std::mem::take(&mut fx.outs);
            let publishes = match issue_publishes(
                self.shared,
                &self.fence,
                outs,
                &[&msg],
                &self.tx,
                self.cancel,
            )
            .await
            {
                Ok(p) => p,
                Err(halt) => return self.left_or_stopped(halt),
            };
            let processed = Processed::new(ack.then_some(msg), publishes, fx);
            return Ok(Disposition::Barrier(processed));
        }
        let delivered = delivered.unwrap_or(info.delivered);
        let Some(outcome) = project_input(
            self.shared,
            &mut self.turns,
            &msg,
            &info,
            delivered,
            &mut fx,
            self.cancel,
        )
        .await
        .map_err(|e| self.turn_error(e))?
        else {
            return Ok(Disposition::LeftForRedelivery(Unprocessed::ShuttingDown));
        };
        // Cancelled while a publish kept failing: leave the message for redelivery.
        let mut outs = std::mem::take(&mut fx.outs);
        if !ack || delivered > 1 || seq <= self.verify_through {
            // Delivered before (to a previous owner, or to this partition before it started
            // over): what of it is stored already is not stored again.
            let mut kept = Vec::with_capacity(outs.len());
            for out in outs {
                if self.shared.stored_already(&out, seq, stored_ms).await {
                    debug!(partition = self.p, seq, subject = %out.subject, "output stored already");
                } else {
                    kept.push(out);
                }
            }
            if !kept.is_empty() && ack && delivered <= 1 {
                // Processed in order: nothing after the first input missing its outputs was.
                self.verify_through = 0;
            }
            outs = kept;
        }
        let publishes = match issue_publishes(
            self.shared,
            &self.fence,
            outs,
            &[&msg],
            &self.tx,
            self.cancel,
        )
        .await
        {
            Ok(p) => p,
            Err(halt) => return self.left_or_stopped(halt),
        };
        let processed = Processed::new(ack.then_some(msg), publishes, fx);
        Ok(Disposition::Issued { processed, outcome })
    }
}

/// What happens to one input. Decided once per message by [`Partition::dispose`] and matched,
/// exhaustively, where the partition decides whether it will be acknowledged.
// Returned once and matched at once, never stored: boxing the large variant would only add an
// allocation per input.
#[allow(clippy::large_enum_variant)]
enum Disposition {
    /// Its outputs are issued (a failed publish was retried in place until it was sent): the
    /// acker acknowledges it once they and its turn-record writes are stored.
    Issued {
        processed: Processed,
        outcome: Outcome,
    },
    /// A barrier: what the watermark it moved decided is issued, and it is acknowledged like an
    /// input, but it is not one (not counted, not projected).
    Barrier(Processed),
    /// Not processed, not acknowledged: the server redelivers it (to this partition's restart or
    /// its next owner), with everything after it in the partition.
    LeftForRedelivery(Unprocessed),
}

/// Why an input is left for redelivery.
enum Unprocessed {
    /// Its delivery metadata (stream sequence, store time) cannot be read: it can be neither
    /// processed in order nor dead-lettered with a reference. The partition restarts.
    MetadataUnreadable,
    /// The worker is stopping while one of its publishes keeps failing.
    ShuttingDown,
}

/// What an input became.
#[derive(Debug, Clone, Copy)]
enum Outcome {
    /// Projected (possibly into nothing new: a suppressed duplicate is projected as such), with
    /// its (first) event's role and type class.
    Projected {
        role: crate::model::Role,
        /// Its type's class, as a `telemetry::type_class_index`.
        class: usize,
    },
    /// Dead-lettered, with this reason.
    DeadLettered(crate::model::DlqReason),
}

/// One pull request's deliveries.
///
/// Unlike the client's own batch, it never ends on a client-side timer while the server still
/// has messages of the batch in flight: a partition that spends longer on a batch than the pull's
/// expiry would otherwise lose the unread rest until its ack wait, and meet it behind newer
/// messages. The batch ends when it is full, or when the server says the request expired.
struct PullBatch {
    sub: async_nats::Subscriber,
    js: jetstream::Context,
    left: usize,
    /// When silence ends the batch. Absolute, so a caller that drops `next` (a timer in a
    /// `select!`) and calls again does not restart the wait: a pull request the server lost
    /// (a restart, a leader change) must still end the batch.
    silent_until: tokio::time::Instant,
}

/// Silence after which a batch is over even without the server's expiry notice.
const PULL_SILENCE: Duration = Duration::from_secs(11);

/// How long a pull request waits on the server for messages.
pub(crate) const PULL_EXPIRES: Duration = Duration::from_millis(500);

impl PullBatch {
    async fn request(
        js: &jetstream::Context,
        consumer: &PullConsumer,
        batch: usize,
    ) -> Result<PullBatch, String> {
        let client = js.client();
        let inbox = async_nats::Subject::from(client.new_inbox());
        let sub = client
            .subscribe(inbox.clone())
            .await
            .map_err(|e| e.to_string())?;
        let config = jetstream::consumer::pull::BatchConfig {
            batch,
            expires: Some(PULL_EXPIRES),
            ..Default::default()
        };
        consumer
            .request_batch(config, inbox)
            .await
            .map_err(|e| e.to_string())?;
        Ok(PullBatch {
            sub,
            js: js.clone(),
            left: batch,
            silent_until: tokio::time::Instant::now() + PULL_SILENCE,
        })
    }

    /// The next message; `None` when the batch is over. Silence well past the expiry (a lost
    /// status message) also ends it.
    async fn next(&mut self) -> Option<Result<jetstream::Message, String>> {
        use async_nats::StatusCode;
        while self.left > 0 {
            let message = match tokio::time::timeout_at(self.silent_until, self.sub.next()).await {
                Ok(Some(m)) => m,
                Ok(None) | Err(_) => return None,
            };
            self.silent_until = tokio::time::Instant::now() + PULL_SILENCE;
            match message.status.unwrap_or(StatusCode::OK) {
                StatusCode::OK => {
                    self.left -= 1;
                    return Some(Ok(jetstream::Message {
                        message,
                        context: self.js.clone(),
                    }));
                }
                StatusCode::IDLE_HEARTBEAT => continue,
                StatusCode::TIMEOUT | StatusCode::NOT_FOUND => return None,
                status => {
                    self.left = 0;
                    return Some(Err(format!(
                        "pull request ended: {status} {}",
                        message.description.unwrap_or_default()
                    )));
                }
            }
        }
        None
    }
}

/// How long a partition waits before asking its consumer again whether a due deadline can fire.
const IDLE_CHECK_MS: i64 = 200;

/// How long a partition waits for its barrier before it sends another (ms).
const BARRIER_RETRY_MS: i64 = 1_000;

pub(crate) fn lease_lapsed(valid_until: &AtomicI64) -> bool {
    let v = valid_until.load(Ordering::Relaxed);
    v > 0 && super::now_ms() > v
}

async fn sleep_until_opt(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// An input's outputs as issued, each with the future of its publish ack (`None`: already
/// acknowledged, by a retry in place).
type Publishes = Vec<(Outgoing, Option<jetstream::context::PublishAckFuture>)>;

/// Project one message into `fx`: its outputs, and what its turn asks for. `None`: cancelled
/// while a large field could not be stored (the message is left for redelivery).
async fn project_input(
    shared: &WorkerContext,
    turns: &mut PartitionTurns,
    msg: &jetstream::Message,
    info: &jetstream::message::Info<'_>,
    delivered: i64,
    fx: &mut Effects,
    cancel: &CancellationToken,
) -> Result<Option<Outcome>, TurnIoError> {
    let raw = RawMessage {
        bytes: &msg.payload,
        stream: info.stream,
        seq: info.stream_sequence,
        stored_subject: msg.subject.as_str(),
        stored_at: info.published,
        delivered,
        headers: msg.headers.as_ref(),
    };
    let mut events = match pipeline::normalize_raw(
        &raw,
        &shared.names,
        &shared.ingest,
        shared.settings.consumer.max_deliver,
    ) {
        Err(rejection) => {
            fx.outs
                .push(pipeline::dead_letter(&shared.names, &raw, &rejection));
            return Ok(Some(Outcome::DeadLettered(rejection.reason)));
        }
        Ok(events) => events,
    };
    let blobs = pipeline::offload(
        &mut events,
        raw.bytes.len(),
        &shared.settings.limits,
        shared.out_budget.saturating_sub(ENVELOPE_HEADROOM),
    );
    if !blobs.is_empty() && !shared.store_blobs_in_place(&blobs, &[msg], cancel).await {
        return Ok(None);
    }
    let enforce = &shared.settings.turns.enforce_roles;
    for (i, n) in events.iter().enumerate() {
        // AG-UI run events follow the run contract (CONTRACT 2b) whatever their role; the turn
        // machinery carries both kinds of exchange.
        let run = if shared.settings.runs.enforce {
            pipeline::run_event(n, &raw, &shared.names.prefix).and_then(|ev| turns.run_facts(&ev))
        } else {
            None
        };
        let facts = run.or_else(|| pipeline::turn_facts(n, &raw, &shared.names.prefix, enforce));
        match facts {
            Some(f) => turns.on_event(shared, n, &f, fx).await?,
            None => fx.outs.push(pipeline::projection(
                &shared.names,
                n,
                raw.seq,
                format!("{}:{}:{i}", raw.stream, raw.seq),
            )),
        }
    }
    let (role, class) = events.first().map_or(
        (
            crate::model::Role::SystemObservability,
            telemetry::TYPE_CLASSES.len(),
        ),
        |n| {
            (
                n.role(),
                telemetry::type_class_index(&n.envelope.event_type),
            )
        },
    );
    Ok(Some(Outcome::Projected { role, class }))
}

/// Issue the publishes of `outs` in order, pipelined. A publish that cannot be sent is retried
/// before anything later is sent, so per-key order holds. `None` if cancelled meanwhile (or the
/// acker is gone).
///
/// Every `WorkerContext::hand_over` publishes, the ones issued so far go to the acker ahead of
/// the rest (as a group of their own, acknowledging nothing): a publish waits for one of the
/// context's publish-ack permits, which only the ackers release, so a reader must never wait for
/// one while holding more than its share of them. One input can have hundreds of outputs (the
/// blocked responses of every deadline a late message passes); without the hand-over, a few
/// partitions doing that at once would hold every permit and wait for each other forever.
async fn issue_publishes(
    shared: &WorkerContext,
    fence: &Fence,
    outs: Vec<Outgoing>,
    inputs: &[&jetstream::Message],
    acker: &mpsc::Sender<Processed>,
    cancel: &CancellationToken,
) -> Result<Publishes, Halt> {
    let hand_over = shared.hand_over();
    let mut pending = Vec::with_capacity(outs.len().min(hand_over));
    for out in outs {
        if pending.len() >= hand_over {
            let ahead = Processed::new(None, std::mem::take(&mut pending), Effects::default());
            acker.send(ahead).await.map_err(|_| Halt::Cancelled)?;
        }
        let out = shared.fit(out);
        shared.state.count_output(&out);
        let fut = match shared.send(&shared.js, &out, fence).await {
            Ok(f) => Some(f),
            Err(f @ Failure::Transient { .. }) => {
                warn!(error = %f, "publish failed; retrying in place");
                shared.publish_in_place(&out, fence, inputs, cancel).await?;
                None
            }
            Err(f) => return Err(Halt::Failed(shared.count_failure(f))),
        };
        pending.push((out, fut));
    }
    Ok(pending)
}

/// Room left for an envelope's projection headers: an envelope is offloaded until it fits in
/// the output budget less this.
const ENVELOPE_HEADROOM: usize = 4096;

/// How long a replay waits for the next message of its range before it gives up (and the
/// partition starts over).
const REPLAY_SILENCE: Duration = Duration::from_secs(5);

/// How a partition acknowledges a group of processed inputs.
#[derive(Debug, Clone, Copy)]
enum Acks {
    /// Its last delivery (the consumer's `AckPolicy::All` covers everything before it: the
    /// group was processed in order, after everything delivered earlier).
    Last,
    /// Every delivery (consumers created with `AckPolicy::Explicit`).
    Each,
}

/// A processed input the acker has seen stored, waiting for the holds of the turns it opened.
struct Unacked {
    msg: Option<jetstream::Message>,
    holds: Vec<Hold>,
}

/// Take from the front of `held` the inputs whose holds have all resolved, in order: their
/// deliveries may be acknowledged. Stops at the first input still held.
fn release(held: &mut VecDeque<Unacked>) -> Result<Vec<jetstream::Message>, WriteError> {
    let mut ready = Vec::new();
    while let Some(front) = held.front_mut() {
        while let Some(hold) = front.holds.last() {
            match hold.clone().now_or_never() {
                Some(Ok(_)) => {
                    front.holds.pop();
                }
                Some(Err(e)) => return Err(e),
                None => return Ok(ready),
            }
        }
        if let Some(done) = held.pop_front() {
            ready.extend(done.msg);
        }
    }
    Ok(ready)
}

/// The first unresolved hold, awaited; never resolves without one.
async fn first_hold(hold: Option<Hold>) -> Result<u64, WriteError> {
    match hold {
        Some(h) => h.await,
        None => std::future::pending().await,
    }
}

/// Await, in order, each group's publishes and turn-record writes, count its decisions towards
/// the published checkpoint, then acknowledge it, up to the first input still held by a turn
/// whose record is deferred (never past it: a crash must redeliver that input). Returns an error
/// (and cancels `broken`) when a turn-record or checkpoint write was refused: nothing more is
/// acknowledged, the partition restarts.
async fn ack_stage(
    shared: Arc<WorkerContext>,
    stream: jetstream::stream::Stream,
    stage: Stage,
    mut rx: mpsc::Receiver<Processed>,
    mut checkpoint: Checkpoint,
    cancel: CancellationToken,
    broken: CancellationToken,
) -> Result<(), WorkerError> {
    let Stage { p, acks, fence } = stage;
    let refused = |e: TurnIoError| {
        warn!(partition = p, error = %e, "turn state write refused; restarting the partition");
        broken.cancel();
        WorkerError::Interrupted {
            partition: p,
            why: "a turn state write was refused",
        }
    };
    // A hold that failed: abandoned by a stopping partition (acknowledge nothing more, quietly),
    // or its write refused.
    let hold_failed = |e: WriteError| -> Result<(), WorkerError> {
        match e {
            WriteError::Abandoned => Ok(()),
            e => Err(refused(e.for_key("(deferred open write)"))),
        }
    };
    let mut held: VecDeque<Unacked> = VecDeque::new();
    let ack_latency = metrics::histogram!(telemetry::PUBLISH_ACK);
    let end_to_end = metrics::histogram!(telemetry::END_TO_END);
    let write_latency = metrics::histogram!(telemetry::STATE_WRITE);
    loop {
        let front = held.front().and_then(|u| u.holds.last().cloned());
        let first = tokio::select! {
            next = rx.recv() => match next {
                Some(first) => Some(first),
                None => break,
            },
            resolved = first_hold(front) => {
                if let Err(e) = resolved {
                    return hold_failed(e);
                }
                None
            }
            _ = tokio::time::sleep(CHECKPOINT_EVERY) => {
                checkpoint.maybe_write(false).await.map_err(refused)?;
                None
            }
        };
        if let Some(first) = first {
            let mut items = vec![first];
            while items.len() < 1024 {
                match rx.try_recv() {
                    Ok(i) => items.push(i),
                    Err(_) => break,
                }
            }
            let mut marks = Vec::new();
            for idx in 0..items.len() {
                let publishes = std::mem::take(&mut items[idx].publishes);
                let (issued, stored_ms) = (items[idx].issued, items[idx].stored_ms);
                for (out, fut) in publishes {
                    let failed = match fut {
                        Some(fut) => match fut.await {
                            Ok(_) => false,
                            Err(e) => match publish::classify(&out.subject, e) {
                                Failure::Transient { .. } => true,
                                f => {
                                    // Nothing after it is acknowledged: the partition stops.
                                    broken.cancel();
                                    let halt = Halt::Failed(shared.count_failure(f));
                                    return Err(halt.into_error(p).unwrap_or(
                                        WorkerError::Interrupted {
                                            partition: p,
                                            why: "an output could not be stored",
                                        },
                                    ));
                                }
                            },
                        },
                        None => false,
                    };
                    if !failed {
                        ack_latency.record(issued.elapsed().as_secs_f64());
                        if let (OutKind::Projection(_), Some(stored)) = (out.kind, stored_ms) {
                            let ms = super::now_ms().saturating_sub(stored).max(0);
                            end_to_end.record(ms as f64 / 1000.0);
                        }
                    }
                    if failed {
                        let inputs: Vec<&jetstream::Message> =
                            items.iter().filter_map(|i| i.msg.as_ref()).collect();
                        match shared
                            .publish_in_place(&out, &fence, &inputs, &cancel)
                            .await
                        {
                            Ok(()) => {}
                            // Shutting down with a publish still failing: acknowledge nothing
                            // more; redelivery repairs.
                            Err(Halt::Cancelled) => return Ok(()),
                            Err(halt) => {
                                broken.cancel();
                                return Err(halt.into_error(p).unwrap_or(
                                    WorkerError::Interrupted {
                                        partition: p,
                                        why: "an output could not be stored",
                                    },
                                ));
                            }
                        }
                    }
                }
                for w in std::mem::take(&mut items[idx].writes) {
                    if let Err(e) = w.await {
                        return Err(refused(e.for_key("(pipelined write)")));
                    }
                    write_latency.record(issued.elapsed().as_secs_f64());
                }
                marks.append(&mut items[idx].marks);
            }
            if !marks.is_empty() {
                super::turns::crash_point("after_publish");
                checkpoint.stored(marks).await.map_err(refused)?;
            }
            checkpoint.maybe_write(false).await.map_err(refused)?;
            held.extend(items.into_iter().map(|i| Unacked {
                msg: i.msg,
                holds: i.holds,
            }));
        }
        let ready = match release(&mut held) {
            Ok(ready) => ready,
            Err(e) => return hold_failed(e),
        };
        let barriers = barrier_sequences(&ready);
        if let Some(last) = last_sequence(&ready) {
            checkpoint.acked(last);
        }
        acknowledge(p, acks, ready).await;
        delete_barriers(&stream, p, barriers);
    }
    // Drained: the partition wrote its deferred records before it stopped; wait for them.
    debug!(
        partition = p,
        inputs = held.len(),
        "acker waiting for the last held inputs"
    );
    for mut u in std::mem::take(&mut held) {
        for hold in u.holds.drain(..) {
            if let Err(e) = hold.await {
                return hold_failed(e);
            }
        }
        held.push_back(u);
    }
    let ready = release(&mut held).unwrap_or_default();
    let barriers = barrier_sequences(&ready);
    if let Some(last) = last_sequence(&ready) {
        checkpoint.acked(last);
    }
    acknowledge(p, acks, ready).await;
    delete_barriers(&stream, p, barriers);
    // Drained: a final checkpoint spares the next owner republishing what was stored.
    if let Err(e) = checkpoint.maybe_write(true).await {
        debug!(partition = p, error = %e, "final published checkpoint not written");
    }
    debug!(partition = p, "acker drained");
    Ok(())
}

/// What the acker of a partition needs besides its channels.
struct Stage {
    p: u16,
    acks: Acks,
    fence: Fence,
}

/// The raw sequence of the last of `ready` (inputs in partition order).
fn last_sequence(ready: &[jetstream::Message]) -> Option<u64> {
    ready
        .iter()
        .rev()
        .find_map(|m| m.info().ok().map(|i| i.stream_sequence))
}

/// The stream sequences of the barriers among `ready`.
fn barrier_sequences(ready: &[jetstream::Message]) -> Vec<u64> {
    ready
        .iter()
        .filter(|m| is_barrier(m))
        .filter_map(|m| m.info().ok().map(|i| i.stream_sequence))
        .collect()
}

/// A partition's own barrier: the header, an empty body, and the barrier subject's last token.
/// A producer's message that happens to carry the header but has a body is an input like any
/// other (nothing a producer sends is acknowledged unseen).
fn is_barrier(msg: &jetstream::Message) -> bool {
    msg.payload.is_empty()
        && msg.subject.as_str().ends_with(".barrier")
        && msg
            .headers
            .as_ref()
            .is_some_and(|h| h.get(crate::pipeline::H_BARRIER).is_some())
}

/// Remove acknowledged barriers from the raw stream, so it holds only producers' inputs. Best
/// effort: a barrier left behind is acknowledged and moves nothing but a watermark if it is
/// ever delivered again.
fn delete_barriers(stream: &jetstream::stream::Stream, p: u16, seqs: Vec<u64>) {
    if seqs.is_empty() {
        return;
    }
    let stream = stream.clone();
    tokio::spawn(async move {
        for seq in seqs {
            if let Err(e) = stream.delete_message(seq).await {
                debug!(partition = p, seq, error = %e, "barrier not deleted");
            }
        }
    });
}

/// Acknowledge `ready` (inputs in partition order, all stored and released): its last delivery,
/// or each one.
async fn acknowledge(p: u16, acks: Acks, ready: Vec<jetstream::Message>) {
    if ready.is_empty() {
        return;
    }
    super::turns::crash_point("before_ack");
    let to_ack: Vec<jetstream::Message> = match acks {
        Acks::Each => ready,
        Acks::Last => ready.into_iter().last().into_iter().collect(),
    };
    for msg in to_ack {
        if let Err(e) = msg.ack().await {
            debug!(partition = p, error = %e, "ack failed; the message will be redelivered (its outputs collapse by Msg-Id)");
        }
    }
}

#[cfg(test)]
mod lag_tests {
    use super::*;

    #[test]
    fn a_partition_is_stalled_only_with_messages_waiting_and_no_progress() {
        let state = WorkerState::default();
        let now = 1_000_000;
        let lag = |pending, progress_ms| PartitionLag {
            pending,
            progress_ms,
            ..Default::default()
        };
        if let Ok(mut map) = state.partitions.lock() {
            map.insert(0, lag(10, now - 200_000)); // waiting, no progress for 200 s
            map.insert(1, lag(0, now - 200_000)); // idle
            map.insert(2, lag(10, now - 1_000)); // moving
        }
        assert_eq!(state.stalled(now, Duration::from_secs(120)), vec![0]);
        assert!(state.stalled(now, Duration::from_secs(300)).is_empty());
    }

    #[test]
    fn lag_is_reported_as_ages() {
        let now = 1_000_000;
        let waiting = PartitionLag {
            pending: 3,
            oldest_pending_ms: Some(now - 4_000),
            watermark_ms: Arc::new(AtomicI64::new(now - 6_000)),
            progress_ms: now - 500,
            ..Default::default()
        };
        let s = waiting.status(7, now);
        assert_eq!(s.partition, 7);
        assert_eq!(s.pending, 3);
        assert_eq!(s.oldest_pending_age_ms, Some(4_000));
        assert_eq!(s.watermark_age_ms, Some(6_000));
        assert_eq!(s.progress_age_ms, 500);
        // Nothing pending: caught up, whatever the last event's time.
        let idle = PartitionLag {
            watermark_ms: Arc::new(AtomicI64::new(now - 60_000)),
            progress_ms: now,
            ..Default::default()
        };
        assert_eq!(idle.status(1, now).watermark_age_ms, Some(0));
        assert_eq!(idle.status(1, now).oldest_pending_age_ms, None);
    }
}
