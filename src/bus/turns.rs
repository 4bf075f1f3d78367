//! The I/O shell of the turn contract for one partition: executes the pure [`crate::turns`]
//! steps against the KV fence, issues the turn's one response, keeps the partition's deadlines,
//! and reloads open and unpublished turns when the partition starts.
//!
//! Nothing here waits for a round trip on the way of a message. Turn-record writes are sent
//! pipelined, each a compare-and-set on the revision the partition owner last wrote; decisions go
//! through the partition's `DecisionWriter`, which keeps them in decision order and waits there
//! for an open write still in flight. The acker awaits the writes (with the message's publishes)
//! before it acknowledges the message. A write that fails means another owner wrote the record:
//! the partition restarts, reloads and re-reads its in-flight messages. Which decisions have their
//! response stored is the partition's published [`Checkpoint`], raised by the acker. The partition
//! keeps its open turns, the turns it decided lately, and the hashes of all its record keys, so a
//! message needs no KV read unless it names an old turn.

use super::context::WorkerContext;
use super::error::{NoAnswer, Source};
use super::publisher::Publisher;
use crate::ingest::Normalized;
use crate::model::Role;
use crate::pipeline::{self, OutKind, Outgoing, RawMessage};
use crate::telemetry;
use crate::turns::runs::{self, OpenRuns, RunEvent, RunScan};
use crate::turns::{
    self, blocked, book::OpenTurns, ExchangeKind, Expect, SuppressReason, TurnConfig, TurnFacts,
    TurnRecord, TurnState,
};
use async_nats::jetstream::{self, kv};
use bytes::Bytes;
use futures::future::{BoxFuture, FutureExt, Shared as SharedFuture};
use futures::StreamExt;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

#[derive(Debug, thiserror::Error)]
pub enum TurnIoError {
    /// A read or write of the turn state (or of the raw events it refers to) failed.
    #[error("turn record {key}: {source}")]
    Kv {
        key: String,
        #[source]
        source: Source,
    },
    /// A compare-and-set write was refused: another owner wrote the record.
    #[error("turn record {key}: another owner wrote it")]
    Conflict { key: String },
    /// A pipelined write was not stored for another reason (no answer, a broken connection):
    /// its outcome is unknown.
    #[error("turn record {key}: write not stored: {source}")]
    WriteFailed {
        key: String,
        #[source]
        source: Arc<dyn std::error::Error + Send + Sync + 'static>,
    },
    /// A record this version cannot parse (one written by a newer version, read after a
    /// rollback): the turn's next step cannot be worked out without it.
    #[error(
        "turn record {key} (revision {revision}) is not one this version reads ({source}); \
         it was likely written by a newer version: run that version again (the partition \
         takes no further input until then)"
    )]
    Unreadable {
        key: String,
        revision: u64,
        #[source]
        source: Arc<serde_json::Error>,
    },
    #[error("shutting down with turn {0} undecided on the bus")]
    Cancelled(String),
    /// A response could not be published and waiting will not change that.
    #[error(transparent)]
    Publish(super::publish::Failure),
}

impl TurnIoError {
    fn kv(key: impl Into<String>, source: impl Into<Source>) -> TurnIoError {
        TurnIoError::Kv {
            key: key.into(),
            source: source.into(),
        }
    }
}

/// A turn-record write in flight; resolves to the record's new revision.
pub type KvWrite = SharedFuture<BoxFuture<'static, Result<u64, WriteError>>>;

/// Why a turn-record write was not stored, by the kind the server or the client gave.
#[derive(Debug, Clone, thiserror::Error)]
pub enum WriteError {
    /// The key was not at the expected revision (`WrongLastSequence`): another owner wrote it.
    #[error("compare-and-set refused: the record is not at the expected revision")]
    Conflict,
    /// Anything else: no answer in time, a broken connection, the partition's writer stopped.
    #[error(transparent)]
    Failed(Arc<dyn std::error::Error + Send + Sync + 'static>),
    /// Its answer went with a reconnect: the connection came back and no answer followed within
    /// the grace ([`Publisher::ack_unless_lost`]). Whether it was stored is unknown.
    #[error("its answer went with a reconnect: whether it was stored is unknown")]
    LostWithReconnect,
    /// Never sent: the partition stopped with the turn's open record still deferred. Its input
    /// stays unacknowledged and is processed again by the next owner.
    #[error("the partition stopped before the turn's record was written")]
    Abandoned,
}

/// The revision a record write sent when the connection had connected `connects` times was
/// stored at, or why not: an answer that went with a reconnect is given up after the grace
/// rather than waited for until the context's timeout, and the partition starts over (as after
/// any write whose outcome is unknown) at once rather than 5 s later.
async fn written(
    publisher: &Publisher,
    ack: jetstream::context::PublishAckFuture,
    connects: u64,
) -> Result<u64, WriteError> {
    match publisher.ack_unless_lost(ack, connects).await {
        Some(answer) => answer.map(|a| a.sequence).map_err(WriteError::of_publish),
        None => Err(WriteError::LostWithReconnect),
    }
}

/// Like [`written`], for a write that expected its key absent: refused because the key's last
/// entry is a delete or purge marker (a record deleted from the bucket by hand), it is sent again
/// expecting that marker's revision. A key with a value is another owner's write: the refusal
/// stands.
async fn written_or_over(
    publisher: &Publisher,
    ack: jetstream::context::PublishAckFuture,
    connects: u64,
    again: Option<Again>,
) -> Result<u64, WriteError> {
    match (written(publisher, ack, connects).await, again) {
        (Err(WriteError::Conflict), Some(again)) => again.over_marker(publisher).await,
        (answer, _) => answer,
    }
}

/// The turns bucket as a partition's record writes use it: the context they are sent on, and
/// the store a write refused over a delete marker reads the marker from.
struct RecordWrites {
    kv_js: jetstream::Context,
    store: kv::Store,
}

impl RecordWrites {
    /// Send `rec` to `subject` on the condition that the key is at revision `expected` (0:
    /// absent), without waiting for the ack; with it, for a write that expects the key absent,
    /// what sends it again over a delete marker ([`written_or_over`]).
    async fn send(
        self: &Arc<Self>,
        subject: String,
        rec: &TurnRecord,
        expected: u64,
    ) -> Result<(jetstream::context::PublishAckFuture, Option<Again>), Source> {
        let value = Bytes::from(serde_json::to_vec(rec)?);
        let again = (expected == 0).then(|| Again {
            over: self.clone(),
            subject: subject.clone(),
            value: value.clone(),
        });
        let ack = send_cas(&self.kv_js, subject, value, expected).await?;
        Ok((ack, again))
    }
}

/// A write that expected its key absent, kept to be sent again over a delete marker.
struct Again {
    over: Arc<RecordWrites>,
    subject: String,
    value: Bytes,
}

impl Again {
    async fn over_marker(self, publisher: &Publisher) -> Result<u64, WriteError> {
        let failed = |e: Source| WriteError::Failed(Arc::from(e));
        let key = self
            .subject
            .strip_prefix(
                self.over
                    .store
                    .put_prefix
                    .as_deref()
                    .unwrap_or(&self.over.store.prefix),
            )
            .unwrap_or(&self.subject);
        let entry = super::leader_entry(&self.over.store, key)
            .await
            .map_err(failed)?;
        let Some(marker) = entry.filter(|e| !e.put) else {
            return Err(WriteError::Conflict);
        };
        tracing::warn!(
            key,
            marker = marker.revision,
            "turn record deleted from the turns bucket; written again over its delete marker"
        );
        let connects = publisher.connects();
        let ack = send_cas(&self.over.kv_js, self.subject, self.value, marker.revision)
            .await
            .map_err(failed)?;
        written(publisher, ack, connects).await
    }
}

impl WriteError {
    fn of_publish(e: jetstream::context::PublishError) -> WriteError {
        match e.kind() {
            jetstream::context::PublishErrorKind::WrongLastSequence => WriteError::Conflict,
            _ => WriteError::Failed(Arc::new(e)),
        }
    }

    /// The shell's error for the write of `key`.
    pub fn for_key(self, key: &str) -> TurnIoError {
        let key = key.to_string();
        match self {
            WriteError::Conflict => TurnIoError::Conflict { key },
            WriteError::Failed(source) => TurnIoError::WriteFailed { key, source },
            other @ (WriteError::Abandoned | WriteError::LostWithReconnect) => {
                TurnIoError::WriteFailed {
                    key,
                    source: Arc::new(other),
                }
            }
        }
    }
}

/// The revision of a record this owner wrote.
#[derive(Clone)]
pub enum Rev {
    Known(u64),
    Pending(KvWrite),
    /// An open turn whose record is not written yet (its write is deferred, see
    /// [`PartitionTurns`]): the next write of the key creates it.
    Unwritten,
}

impl Rev {
    /// The revision, waiting for the write's ack if need be (0: the key is absent).
    async fn revision(self) -> Result<u64, WriteError> {
        match self {
            Rev::Known(v) => Ok(v),
            Rev::Pending(w) => w.await,
            Rev::Unwritten => Ok(0),
        }
    }
}

/// What stands between an input that opened a turn and its acknowledgement: resolves once the
/// turn has a stored record, its open record or its decision, whichever is written first.
pub type Hold = KvWrite;

/// A turn opened without writing its record yet, and the hold that its input waits on.
struct Deferred {
    record: TurnRecord,
    hold: oneshot::Sender<KvWrite>,
}

/// A hold and the sender that resolves it with the write that makes the turn durable. Dropping
/// the sender (the partition stops) resolves it as [`WriteError::Abandoned`].
fn hold() -> (oneshot::Sender<KvWrite>, Hold) {
    let (tx, rx) = oneshot::channel::<KvWrite>();
    let hold = async move {
        match rx.await {
            Ok(write) => write.await,
            Err(_) => Err(WriteError::Abandoned),
        }
    }
    .boxed()
    .shared();
    (tx, hold)
}

/// Which deferred open records to write now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flush {
    /// Those deferred for `turns.open_write_delay`, or behind too many inputs.
    Due,
    /// All of them (the partition stops).
    All,
}

/// A decided turn whose response is in this group, counted towards the partition's published
/// checkpoint once the response is stored.
pub enum Mark {
    /// This owner's decision: its revision (once its write is acknowledged) raises `through`.
    Decided { key: String, after: Rev },
    /// A decision the reload found unpublished (see [`Checkpoint::claim`]): once every such one
    /// is stored, `base` covers all the reload read.
    Found { key: String },
}

/// Records a reload could not parse: written by a newer version, read after a rollback.
#[derive(Default)]
struct UnreadableRecords {
    count: u64,
    /// The lowest revision among them, with its key and why it could not be read.
    lowest: Option<(u64, String, serde_json::Error)>,
}

impl UnreadableRecords {
    fn note(&mut self, key: &str, revision: u64, e: serde_json::Error) {
        self.count += 1;
        if self.lowest.as_ref().is_none_or(|(r, _, _)| revision < *r) {
            self.lowest = Some((revision, key.to_string(), e));
        }
    }

    /// The highest revision the reload may vouch for: `highest`, or below the lowest record it
    /// could not read (logged).
    fn vouch_below(self, partition: u16, highest: u64) -> u64 {
        let Some((revision, key, error)) = self.lowest else {
            return highest;
        };
        tracing::warn!(
            partition,
            count = self.count,
            key,
            revision,
            %error,
            "turn records this version cannot read (written by a newer version?) are left \
             as they are: the checkpoint vouches only below the first, so a version that \
             reads them publishes any response they decided; an input of one of their turns \
             stops the partition until such a version runs"
        );
        highest.min(revision.saturating_sub(1))
    }
}

/// What a reload reads of most records: a [`TurnRecord`]'s state, deadline and writer.
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct RecordHead {
    #[serde(default)]
    exchange: ExchangeKind,
    state: TurnState,
    #[serde(default)]
    deadline_ms: Option<i64>,
    #[serde(default)]
    writer: Option<u64>,
}

/// The KV key of a partition's published checkpoint. Outside the `p<N>.` records, so a reload
/// never takes it for a turn.
pub fn checkpoint_key(partition: u16) -> String {
    format!("ck.p{partition}")
}

/// A partition's published checkpoint (the KV value). It replaces a "published" write per turn
/// with one write per partition per [`CHECKPOINT_EVERY`].
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
struct CheckpointValue {
    /// The owner's decided records at or below this revision have their responses stored.
    through: u64,
    /// Every decided record at or below this revision, whoever wrote it, has its response stored:
    /// the owner verified them when it took the partition. Absent in checkpoints written before
    /// decisions carried their writer: `through` then stands for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    base: Option<u64>,
    /// The ownership term of the owner that wrote the checkpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    owner: Option<u64>,
    /// The raw stream sequence through which the partition's inputs have every output stored
    /// (and are acknowledged): where a consumer recreated for the partition starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    acked: Option<u64>,
}

/// Where partition `partition`'s inputs are known to be done, from its published checkpoint in
/// `store` (the turns bucket): the raw sequence to resume after, if the partition ever ran.
pub async fn resume_after(store: &kv::Store, partition: u16) -> Result<Option<u64>, String> {
    match super::leader_entry(store, &checkpoint_key(partition)).await {
        Ok(Some(e)) if e.put => Ok(serde_json::from_slice::<CheckpointValue>(&e.value)
            .ok()
            .and_then(|v| v.acked)),
        Ok(_) => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

impl CheckpointValue {
    /// Whether the response of a decided record (its revision and writer) is known to be stored.
    /// Between `base` and `through`, only the checkpoint owner's own decisions are: a late write of
    /// a previous owner (a paused process) landing there may never have had its response stored.
    fn vouches_for(&self, revision: u64, writer: Option<u64>) -> bool {
        revision <= self.base.unwrap_or(self.through)
            || (revision <= self.through && writer.is_some() && writer == self.owner)
    }
}

/// How often, at most, a partition writes its published checkpoint while it advances.
pub const CHECKPOINT_EVERY: Duration = Duration::from_secs(1);

/// The owner's side of a partition's published checkpoint: the acker raises `through` as
/// responses are stored and writes it (compare-and-set on the revision it last wrote, so a
/// second owner's write stops this one).
pub struct Checkpoint {
    store: kv::Store,
    /// The partitions' publisher: a write whose answer went with a reconnect is given up after
    /// its grace ([`Publisher::ack_unless_lost`]).
    publisher: Arc<Publisher>,
    key: String,
    /// KV revision of the checkpoint key as this owner last wrote or read it (0: absent).
    revision: u64,
    /// The value as read at the start (the previous owner's), then as last written.
    value: CheckpointValue,
    /// This owner's term, and the revision below which it verified every decision at its start.
    owner: u64,
    base: u64,
    /// Shared with the partition's turn state, which reads decided records against it.
    through: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// The raw sequence through which this owner acknowledged the partition's inputs.
    acked: u64,
    last_write: tokio::time::Instant,
    /// Written again this often even when nothing moved (see [`checkpoint_refresh`]).
    refresh_every: Option<Duration>,
    /// The partition had an owner before this one (a checkpoint was there to read).
    inherited: bool,
    /// Decisions the reload found unpublished whose responses are not yet known stored; once
    /// none is left, `base` rises to `reloaded`.
    found: std::collections::BTreeSet<String>,
    /// The highest revision the reload read.
    reloaded: u64,
}

impl Checkpoint {
    /// Count the decisions of a group whose responses are now stored.
    pub async fn stored(&mut self, marks: Vec<Mark>) -> Result<(), TurnIoError> {
        for m in marks {
            match m {
                Mark::Decided { key, after } => {
                    let rev = resolve(&key, &after).await?;
                    self.through
                        .fetch_max(rev, std::sync::atomic::Ordering::Relaxed);
                }
                Mark::Found { key } => {
                    if self.found.remove(&key) && self.found.is_empty() {
                        // Every decided record the reload read is stored now, the previous
                        // owners' ones it found unpublished included: no later reload looks them
                        // up again.
                        self.base = self.base.max(self.reloaded);
                        self.through
                            .fetch_max(self.reloaded, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            }
        }
        Ok(())
    }

    /// Record that the partition's inputs through raw sequence `seq` are acknowledged.
    pub fn acked(&mut self, seq: u64) {
        self.acked = self.acked.max(seq);
    }

    /// Whether the partition had an owner before this one, whose processing may have gone
    /// further than its consumer's state says.
    pub fn inherited(&self) -> bool {
        self.inherited
    }

    /// The raw sequence a recreated consumer resumes after, as this owner knows it.
    pub fn resume_after(&self) -> Option<u64> {
        Some(self.acked.max(self.value.acked.unwrap_or(0))).filter(|s| *s > 0)
    }

    /// Write the checkpoint if it moved (or is due for a refresh) and `force` or
    /// [`CHECKPOINT_EVERY`] has passed.
    pub async fn maybe_write(&mut self, force: bool) -> Result<(), TurnIoError> {
        let through = self.through.load(std::sync::atomic::Ordering::Relaxed);
        let moved = through > self.value.through
            || self.base > self.value.base.unwrap_or(0)
            || self.acked > self.value.acked.unwrap_or(0);
        let refresh = self.revision > 0
            && self
                .refresh_every
                .is_some_and(|every| self.last_write.elapsed() >= every);
        if !(moved || refresh) || (!force && self.last_write.elapsed() < CHECKPOINT_EVERY) {
            return Ok(());
        }
        self.write(through).await
    }

    /// Write the checkpoint whether or not it moved: a new owner claims it before deciding
    /// anything, so a previous owner's late write (a paused process whose lease lapsed) fails its
    /// compare-and-set instead of vouching for this owner's decisions. `verified`: every decision
    /// at or below this revision has its response stored (the reload saw to it). `found`: the
    /// decisions the reload found unpublished and left to be published where their winners stand;
    /// once each is stored (its [`Mark::Found`]), `base` rises to `highest`, the highest revision
    /// the reload read. Without that, a decision a previous owner left unpublished would stay
    /// above every later checkpoint's base, and every later reload would publish it again.
    async fn claim(
        &mut self,
        verified: u64,
        found: std::collections::BTreeSet<String>,
        highest: u64,
    ) -> Result<(), TurnIoError> {
        self.found = found;
        self.reloaded = highest;
        self.base = verified;
        self.through
            .store(verified, std::sync::atomic::Ordering::Relaxed);
        self.write(verified).await
    }

    async fn write(&mut self, through: u64) -> Result<(), TurnIoError> {
        let next = CheckpointValue {
            through,
            base: Some(self.base),
            owner: Some(self.owner),
            acked: self.resume_after(),
        };
        let value = serde_json::to_vec(&next).map_err(|e| TurnIoError::kv(&self.key, e))?;
        // Revision 0 asks for an absent key; a deleted one answers with its delete's revision.
        let connects = self.publisher.connects();
        let update = self
            .store
            .update(&self.key, Bytes::from(value), self.revision);
        let Some(answer) = self.publisher.ack_unless_lost(update, connects).await else {
            return Err(WriteError::LostWithReconnect.for_key(&self.key));
        };
        match answer {
            Ok(rev) => {
                self.revision = rev;
                self.value = next;
                self.last_write = tokio::time::Instant::now();
                Ok(())
            }
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                Err(TurnIoError::Conflict {
                    key: self.key.clone(),
                })
            }
            Err(e) => Err(TurnIoError::WriteFailed {
                key: self.key.clone(),
                source: Arc::new(e),
            }),
        }
    }
}

/// What the turn contract asks for one message (or one move of the watermark): publishes in
/// order, record writes to await, and the decisions (marks) that count towards the published
/// checkpoint once the publishes are stored.
#[derive(Default)]
pub struct Effects {
    pub outs: Vec<Outgoing>,
    pub writes: Vec<KvWrite>,
    pub marks: Vec<Mark>,
    /// Turns this input opened whose records are deferred: it may be acknowledged only once
    /// each of them has a stored record.
    pub holds: Vec<Hold>,
}

impl Effects {
    pub fn is_empty(&self) -> bool {
        self.outs.is_empty()
            && self.writes.is_empty()
            && self.marks.is_empty()
            && self.holds.is_empty()
    }
}

/// The publish-ack permits of a partition's turn-record context: far above what the partition
/// can have in flight (its channel and acker groups bound it), so a write never waits for one.
const KV_WRITES_IN_FLIGHT: usize = 1 << 20;

/// Decided turns kept in memory per partition, for the events that follow a decision (a
/// complete, a duplicate, a late reply).
const RECENT_DECIDED: usize = 512;

/// The turn state a partition owner keeps: open turns (deadline and KV revision, see
/// [`OpenTurns`]) and recently decided turns.
pub struct PartitionTurns {
    pub partition: u16,
    store: kv::Store,
    /// The same bucket over a context of its own, for the published checkpoint.
    checkpoint_store: kv::Store,
    /// How often the checkpoint is written again while nothing moves.
    checkpoint_refresh: Option<Duration>,
    /// What record writes are sent on (compare-and-set publishes to the bucket).
    records: Arc<RecordWrites>,
    /// The partitions' publisher, on the same connection: its count of connects tells a record
    /// write's answer that went with a reconnect from one still on its way.
    publisher: Arc<Publisher>,
    put_prefix: String,
    cfg: TurnConfig,
    open: OpenTurns<Rev>,
    /// The open AG-UI runs by key, for run events that name no run (a `RUN_ERROR`): kept with
    /// every run record this owner reads or writes, rebuilt from the open run records at reload.
    runs: OpenRuns,
    recent: HashMap<String, TurnRecord>,
    recent_order: VecDeque<String>,
    /// This owner's decided records at or below this revision have their responses stored: the
    /// published checkpoint's `through`, shared with the [`Checkpoint`] the acker raises.
    published_through: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Every decided record at or below this revision has its response stored (verified by the
    /// reload).
    verified_through: u64,
    /// This owner's term: random, stamped on every decision it writes (`TurnRecord::writer`).
    term: u64,
    writer: DecisionWriter,
    /// The worker's open turns over all its partitions, and this partition's share of it as last
    /// reported: the gauge is set from these, so a stopped partition takes its turns with it.
    open_total: std::sync::Arc<super::stats::WorkerState>,
    reported_open: usize,
    /// Open turns whose record is not written yet, and the order they were deferred in (when,
    /// and after how many inputs of the partition).
    deferred: HashMap<String, Deferred>,
    deferred_order: VecDeque<(tokio::time::Instant, u64, String)>,
    /// Decisions the reload found without a stored response whose winner the partition has
    /// not reached again: each response is issued where its winner stands in raw order (see
    /// [`PartitionTurns::reached`]).
    awaiting: Vec<Awaiting>,
    /// `turns.open_write_delay`; zero writes every open record at once.
    open_write_delay: Duration,
    /// Inputs after which a deferred record is written whatever its age, so the inputs held
    /// unacknowledged behind it stay well under the consumer's `max_ack_pending`.
    defer_inputs: u64,
    /// Inputs this partition has processed.
    inputs: u64,
    /// This owner's claim on the partition, which every output it publishes expects.
    fence: super::publish::Fence,
    /// The sets of raw streams the partition reads, for the stream of a raw sequence.
    raw: std::sync::Arc<crate::config::Names>,
    /// No deadline after this (ms since the epoch) is decided, whatever the store time of an
    /// event read: the partition read a reshard marker (see `Partition::heed_reshard_marker`).
    deadline_cap: Option<i64>,
    /// The A2A exchanges this owner opened from their send, by record key, and whether it has
    /// processed a `task.artifact` of the exchange since. The partition reads its key's
    /// events in stream order, so `false` means no artifact was streamed between the send and
    /// any later frame: a streamed answer needs no read of the raw stream for its artifacts.
    /// An exchange not here (opened by an earlier owner, or before a reload) is read as before.
    streamed: HashMap<String, bool>,
}

/// Exchanges remembered in [`PartitionTurns::streamed`] at most; past it the map starts over,
/// and the exchanges forgotten have their artifacts read from the raw stream.
const STREAMED_EXCHANGES: usize = 1 << 16;

impl Drop for PartitionTurns {
    fn drop(&mut self) {
        self.report_open_as(0);
    }
}

impl PartitionTurns {
    pub async fn new(
        shared: &WorkerContext,
        partition: u16,
        fence: super::publish::Fence,
        raw: std::sync::Arc<crate::config::Names>,
    ) -> Result<PartitionTurns, TurnIoError> {
        let bucket = &shared.names.turns_bucket;
        let open = |js: &jetstream::Context| {
            let js = js.clone();
            async move {
                js.get_key_value(bucket)
                    .await
                    .map_err(|e| TurnIoError::kv(bucket, e))
            }
        };
        // Contexts of the partition's own. No publish-ack permit limit that matters for record
        // writes: the acker is the one that awaits (and so releases) them, while a decision it
        // awaits may itself be waiting in the partition's queue for a permit; the partition's
        // channel and groups bound what is in flight instead. The checkpoint has a context of
        // its own: the acker writes it while the record writes queued behind it hold the
        // record context's permits, and only the acker releases those.
        let client = shared.js.client();
        let kv_js = jetstream::ContextBuilder::new()
            .timeout(Duration::from_secs(5))
            .max_ack_inflight(KV_WRITES_IN_FLIGHT)
            .build(client.clone());
        let checkpoint_js = jetstream::ContextBuilder::new()
            .timeout(Duration::from_secs(5))
            .build(client);
        let store = open(&kv_js).await?;
        let checkpoint_store = open(&checkpoint_js).await?;
        let put_prefix = store.put_prefix.clone().unwrap_or(store.prefix.clone());
        let records = Arc::new(RecordWrites {
            kv_js,
            store: store.clone(),
        });
        Ok(PartitionTurns {
            partition,
            store,
            checkpoint_store,
            checkpoint_refresh: checkpoint_refresh(shared.settings.turns.retention),
            put_prefix,
            cfg: TurnConfig {
                default_timeout: shared.settings.turns.default_timeout,
                max_timeout: shared.settings.turns.max_timeout,
                run_timeout: shared.settings.runs.timeout,
                early_hold: shared.settings.turns.early_hold,
            },
            open: OpenTurns::new(shared.settings.turns.kept_records)
                .forgetting_after(forget_keys_after(shared.settings.turns.retention)),
            runs: OpenRuns::default(),
            recent: HashMap::new(),
            recent_order: VecDeque::new(),
            published_through: Default::default(),
            verified_through: 0,
            term: rand::random(),
            writer: DecisionWriter::start(records.clone(), shared.publisher.clone()),
            records,
            publisher: shared.publisher.clone(),
            open_total: shared.state.clone(),
            reported_open: 0,
            deferred: HashMap::new(),
            deferred_order: VecDeque::new(),
            awaiting: Vec::new(),
            open_write_delay: shared.settings.turns.open_write_delay,
            defer_inputs: defer_inputs(shared.settings.consumer.max_ack_pending),
            inputs: 0,
            fence,
            raw,
            deadline_cap: None,
            streamed: HashMap::new(),
        })
    }

    pub fn open_turns(&self) -> usize {
        self.open.len()
    }

    /// Set the open-turns gauge from state: this partition's count replaces what it reported.
    fn report_open(&mut self) {
        self.report_open_as(self.open.len());
    }

    fn report_open_as(&mut self, now: usize) {
        if now == self.reported_open {
            return;
        }
        let delta = i64::try_from(now).unwrap_or(i64::MAX)
            - i64::try_from(self.reported_open).unwrap_or(i64::MAX);
        let total = self
            .open_total
            .open_turns
            .fetch_add(delta, std::sync::atomic::Ordering::Relaxed)
            + delta;
        self.reported_open = now;
        metrics::gauge!(telemetry::OPEN_TURNS).set(total as f64);
    }

    /// The latest entry of `key` as the leader holds it, waiting at most 10 s. A read whose
    /// answer went with a reconnect is asked again once the reconnect's grace is over
    /// ([`super::reconnects::Reconnects::read`]; a read changes nothing), rather than waited for until
    /// the request's own timeout stops the partition.
    async fn entry(&self, key: &str) -> Result<Option<super::LeaderEntry>, TurnIoError> {
        let after = Duration::from_secs(10);
        let read = self
            .publisher
            .reconnects()
            .read("a turn-record read", key, || {
                super::leader_entry(&self.store, key)
            });
        tokio::time::timeout(after, read)
            .await
            .map_err(|_| TurnIoError::kv(key, NoAnswer::new("reading the record", after)))?
            .map_err(|e| TurnIoError::kv(key, e))
    }

    /// The partition's published checkpoint as stored, ready for this owner to claim.
    async fn read_checkpoint(&self) -> Result<Checkpoint, TurnIoError> {
        let key = checkpoint_key(self.partition);
        let (value, revision) = match self.entry(&key).await? {
            Some(e) if e.put => (
                serde_json::from_slice::<CheckpointValue>(&e.value).unwrap_or_default(),
                e.revision,
            ),
            Some(e) => {
                tracing::warn!(
                    partition = self.partition,
                    key = %key,
                    revision = e.revision,
                    "the partition's published checkpoint was deleted from the turns bucket: \
                     every decided turn record in the bucket is looked up again, which can hold \
                     the partition for a while; do not delete or purge checkpoint keys"
                );
                (CheckpointValue::default(), e.revision)
            }
            None => (CheckpointValue::default(), 0),
        };
        Ok(Checkpoint {
            store: self.checkpoint_store.clone(),
            publisher: self.publisher.clone(),
            key,
            revision,
            value,
            owner: self.term,
            base: 0,
            through: self.published_through.clone(),
            acked: 0,
            last_write: tokio::time::Instant::now(),
            refresh_every: self.checkpoint_refresh,
            inherited: revision > 0,
            found: std::collections::BTreeSet::new(),
            reloaded: 0,
        })
    }

    /// The earliest deadline of an open turn, or store time of the winner of a decision the
    /// reload found unpublished: an idle partition then moves its watermark past it (a barrier)
    /// and the decision's response is published (see [`PartitionTurns::reached`]).
    pub fn next_deadline(&self) -> Option<i64> {
        let awaiting = self.awaiting.iter().map(|a| a.winner().1).min();
        match (self.open.next_deadline(), awaiting) {
            (Some(d), Some(a)) => Some(d.min(a)),
            (d, a) => d.or(a),
        }
    }

    /// Load this partition's records: arm open deadlines, and publish any decided response whose
    /// publication a crash interrupted. Returns the records loaded and the published checkpoint,
    /// claimed by this owner, for the acker to raise.
    pub async fn reload(
        &mut self,
        shared: &WorkerContext,
        cancel: &CancellationToken,
    ) -> Result<(usize, Checkpoint), TurnIoError> {
        // What this owner saw of exchanges before the reload may not be what follows it.
        self.streamed.clear();
        // An ordered consumer over the partition's keys, last value of each: its pending count
        // says exactly how many records to expect, so a slow server delays the reload instead of
        // cutting it short, and a stall is an error (the partition restarts).
        let filter = format!("{}p{}.>", self.store.prefix, self.partition);
        let kv_err = |source: Source| TurnIoError::Kv {
            key: filter.clone(),
            source,
        };
        // A named reader, deleted once read, so partitions that start over and over leave no
        // readers behind on the bucket's stream (nats-server caps its consumers).
        let name = format!(
            "reload-{}-{}",
            self.partition,
            uuid::Uuid::new_v4().simple()
        );
        let mut consumer = self
            .store
            .stream
            .create_consumer(jetstream::consumer::pull::OrderedConfig {
                name: Some(name.clone()),
                filter_subject: filter.clone(),
                deliver_policy: jetstream::consumer::DeliverPolicy::LastPerSubject,
                ..Default::default()
            })
            .await
            .map_err(|e| kv_err(Box::new(e)))?;
        let read = async {
            let expected = consumer
                .info()
                .await
                .map_err(|e| kv_err(Box::new(e)))?
                .num_pending;
            // The consumer reads the replica it was placed on, which may lag behind the leader
            // (a node catching up after a partition): the reload reads on until it has seen the
            // leader's last record of the partition, so nothing committed before now is missed.
            let leader_last = super::publish::last_from_leader(&self.store.stream, &filter)
                .await
                .map_err(|e| kv_err(Box::new(e)))?
                .map_or(0, |m| m.sequence);
            let checkpoint = self.read_checkpoint().await?;
            let previous = checkpoint.value;
            let mut unpublished = Vec::new();
            let mut unreadable = UnreadableRecords::default();
            let mut loaded = 0;
            let mut highest = previous.through;
            if expected > 0 || leader_last > 0 {
                let mut records = consumer.messages().await.map_err(|e| kv_err(Box::new(e)))?;
                let mut read = 0u64;
                let mut seen = 0u64;
                while read < expected || seen < leader_last {
                    let next = tokio::time::timeout(Duration::from_secs(30), records.next()).await;
                    let msg = match next {
                        Ok(Some(Ok(m))) => m,
                        Ok(Some(Err(e))) => return Err(kv_err(Box::new(e))),
                        Ok(None) | Err(_) => {
                            return Err(kv_err(Box::new(NoAnswer::new(
                                format!(
                                    "the records stopped after {read} of {expected} \
                                     (through revision {seen} of the leader's {leader_last})"
                                ),
                                Duration::from_secs(30),
                            ))))
                        }
                    };
                    read += 1;
                    let Ok(info) = msg.info() else { continue };
                    let revision = info.stream_sequence;
                    let written_at = info.published;
                    highest = highest.max(revision);
                    seen = seen.max(revision);
                    let Some(key) = msg.subject.as_str().strip_prefix(&self.store.prefix) else {
                        continue;
                    };
                    self.open.note(key);
                    let deleted = msg
                        .headers
                        .as_ref()
                        .and_then(|h| h.get("KV-Operation"))
                        .is_some_and(|op| op.as_str() != "PUT");
                    if deleted {
                        continue;
                    }
                    // Most records are open or vouched for: state, deadline and writer are enough.
                    let head = match serde_json::from_slice::<RecordHead>(&msg.payload) {
                        Ok(head) => head,
                        Err(e) => {
                            unreadable.note(key, revision, e);
                            continue;
                        }
                    };
                    loaded += 1;
                    match head.state {
                        TurnState::Open => {
                            if head.exchange == ExchangeKind::Run {
                                // The key's open runs, for events that name no run.
                                if let Ok(rec) = serde_json::from_slice::<TurnRecord>(&msg.payload)
                                {
                                    self.runs.note(&rec);
                                }
                            }
                            self.open
                                .open(key, head.deadline_ms, Rev::Known(revision), None)
                        }
                        // Not covered by the last checkpoint: its response may not be stored.
                        TurnState::Decided if !previous.vouches_for(revision, head.writer) => {
                            match serde_json::from_slice::<TurnRecord>(&msg.payload) {
                                Ok(rec) => {
                                    unpublished.push((key.to_string(), rec, written_at, revision))
                                }
                                Err(e) => unreadable.note(key, revision, e),
                            }
                        }
                        TurnState::Decided | TurnState::Published => {}
                    }
                }
            }
            Ok::<_, TurnIoError>((checkpoint, unpublished, unreadable, loaded, highest))
        }
        .await;
        if let Err(e) = self.store.stream.delete_consumer(&name).await {
            tracing::debug!(consumer = %name, error = %e, "reload reader not deleted; it expires by itself");
        }
        let (mut checkpoint, unpublished, unreadable, loaded, highest) = read?;
        // A decision won by an input (a reply, a complete, an error, a run's terminal) is
        // published where that input stands in raw order, not now: the inputs before it that
        // the previous owner processed but did not store (one atomic batch refused whole holds
        // both them and the response) are processed again first, and a key's projections stay
        // in raw order. A timeout's response has no such place: it is published now.
        // A record this version cannot read may be a decision whose response is not stored:
        // the checkpoint vouches only below it, so an owner that reads it looks it up.
        let mut verified = unreadable.vouch_below(self.partition, highest);
        for (key, rec, written_at, revision) in unpublished {
            match rec.winner.as_ref().and_then(|w| w.seq) {
                Some(_) => {
                    self.remember(&key, &rec, Rev::Known(0));
                    self.awaiting.push(Awaiting {
                        key,
                        record: rec,
                        written_at,
                    });
                    verified = verified.min(revision.saturating_sub(1));
                }
                None => {
                    self.republish(shared, &key, &rec, written_at, cancel)
                        .await?
                }
            }
        }
        // Every decided record read is now published, or waits for its winner in `awaiting`:
        // to this owner every other one is published. The checkpoint it claims vouches only
        // below the first waiting one, so a crash before that one is stored leaves the
        // decisions from there on to the next owner's reload, which looks each one up before
        // publishing it. A previous owner's write landing later has a higher revision and is
        // not vouched for.
        self.verified_through = highest;
        let found = self.awaiting.iter().map(|a| a.key.clone()).collect();
        checkpoint.claim(verified, found, highest).await?;
        self.report_open();
        Ok((loaded, checkpoint))
    }

    /// The record of `key` as this owner knows it, with its revision resolved when it is open
    /// (decided records are never written again by the turn rules, so their revision is moot).
    async fn current(&self, key: &str) -> Result<Option<(TurnRecord, u64)>, TurnIoError> {
        if self.open.contains(key) {
            return self.open_record(key).await;
        }
        if let Some(rec) = self.recent.get(key) {
            return Ok(Some((rec.clone(), 0)));
        }
        if let Some(a) = self.awaiting.iter().find(|a| a.key == key) {
            return Ok(Some((a.record.clone(), 0)));
        }
        if !self.open.maybe_known(key) {
            return Ok(None);
        }
        self.read(key).await
    }

    /// Like [`Self::current`], but an open turn whose full record is kept in memory comes with its
    /// revision as it stands, possibly a write still in flight: deciding it then never waits for
    /// the write that opened it.
    async fn current_rev(&self, key: &str) -> Result<Option<(TurnRecord, Rev)>, TurnIoError> {
        if let Some(d) = self.deferred.get(key) {
            return Ok(Some((d.record.clone(), Rev::Unwritten)));
        }
        if let Some((Some(rec), rev, _)) = self.open.get(key) {
            return Ok(Some((rec.clone(), rev.clone())));
        }
        // Boxed: a read from KV is the rare case, and its state would otherwise be part of
        // every input's processing future.
        Ok(Box::pin(self.current(key))
            .await?
            .map(|(r, v)| (r, Rev::Known(v))))
    }

    /// An open turn's record and revision: kept in memory, or read from KV once this owner's
    /// last write of it is acknowledged.
    async fn open_record(&self, key: &str) -> Result<Option<(TurnRecord, u64)>, TurnIoError> {
        if let Some(d) = self.deferred.get(key) {
            return Ok(Some((d.record.clone(), 0)));
        }
        let Some((rec, rev, _)) = self.open.get(key) else {
            return Ok(None);
        };
        let (rec, rev) = (rec.cloned(), rev.clone());
        let rev = resolve(key, &rev).await?;
        match rec {
            Some(r) => Ok(Some((r, rev))),
            None => self.read(key).await,
        }
    }

    /// A record and its revision, read from KV.
    async fn read(&self, key: &str) -> Result<Option<(TurnRecord, u64)>, TurnIoError> {
        let entry = self.entry(key).await?;
        let vouched = CheckpointValue {
            through: self
                .published_through
                .load(std::sync::atomic::Ordering::Relaxed),
            base: Some(self.verified_through),
            owner: Some(self.term),
            acked: None,
        };
        let Some(e) = entry.filter(|e| e.put) else {
            return Ok(None);
        };
        let rec = serde_json::from_slice::<TurnRecord>(&e.value).map_err(|source| {
            TurnIoError::Unreadable {
                key: key.to_string(),
                revision: e.revision,
                source: Arc::new(source),
            }
        })?;
        let rec = if rec.state == TurnState::Decided && vouched.vouches_for(e.revision, rec.writer)
        {
            turns::published(&rec)
        } else {
            rec
        };
        Ok(Some((rec, e.revision)))
    }

    /// Send a compare-and-set write without waiting for its ack. Decisions, and writes that must
    /// follow one of this owner's writes still in flight, are queued on the [`DecisionWriter`].
    async fn send_write(
        &mut self,
        key: &str,
        rec: &TurnRecord,
        after: Option<Rev>,
    ) -> Result<KvWrite, TurnIoError> {
        let subject = format!("{}{key}", self.put_prefix);
        self.open.note(key);
        let decision = rec.state == TurnState::Decided;
        let stamped;
        let rec = if decision {
            stamped = TurnRecord {
                writer: Some(self.term),
                ..rec.clone()
            };
            &stamped
        } else {
            rec
        };
        // Writes after one of this owner's writes still in flight, and decisions, go through the
        // partition's writer (see `DecisionWriter`): sent in the order made, without the partition
        // waiting for an open write's revision. A decision whose revision is known is sent from
        // here when the writer has nothing queued or being sent: every decision made before it
        // is on its way already, so the order holds without the writer's hop.
        let known = match &after {
            None => Some(0),
            Some(Rev::Known(rev)) => Some(*rev),
            // A deferred open never written: its decision expects the key absent.
            Some(Rev::Unwritten) if decision => Some(0),
            _ => None,
        };
        let Some(expected) = known.filter(|_| !decision || self.writer.is_idle()) else {
            return Ok(self.writer.write(subject, rec.clone(), after));
        };
        let connects = self.publisher.connects();
        let (ack, again) = self
            .records
            .send(subject, rec, expected)
            .await
            .map_err(|source| TurnIoError::Kv {
                key: key.to_string(),
                source,
            })?;
        let publisher = self.publisher.clone();
        let write: KvWrite = async move { written_or_over(&publisher, ack, connects, again).await }
            .boxed()
            .shared();
        Ok(write)
    }

    /// Send a write of `key` (see [`Self::send_write`]); a deferred open record of the key is
    /// written by it, so the hold of the input that opened the turn resolves with it.
    async fn write_record(
        &mut self,
        key: &str,
        rec: &TurnRecord,
        after: Option<Rev>,
    ) -> Result<KvWrite, TurnIoError> {
        let write = self.send_write(key, rec, after).await?;
        if let Some(d) = self.deferred.remove(key) {
            tracing::trace!(partition = self.partition, key, state = ?rec.state, "deferred record written");
            // The receiver is gone only if the acker stopped: nothing left to hold then.
            let _ = d.hold.send(write.clone());
        }
        Ok(write)
    }

    /// Open a turn without writing its record yet: the input that opened it is held
    /// unacknowledged until the turn's decision or, after `turns.open_write_delay`, its open
    /// record is stored. A turn decided within the delay costs one write instead of two, and
    /// a crash before either leaves the input for redelivery, which opens the turn again.
    fn defer_open(&mut self, key: &str, rec: &TurnRecord, fx: &mut Effects) {
        let (tx, held) = hold();
        fx.holds.push(held);
        self.deferred.insert(
            key.to_string(),
            Deferred {
                record: rec.clone(),
                hold: tx,
            },
        );
        self.deferred_order.push_back((
            tokio::time::Instant::now() + self.open_write_delay,
            self.inputs + self.defer_inputs,
            key.to_string(),
        ));
        self.remember(key, rec, Rev::Unwritten);
    }

    /// Count one input of the partition, then write the deferred open records that are due.
    pub async fn before_input(&mut self, fx: &mut Effects) -> Result<(), TurnIoError> {
        self.inputs += 1;
        self.flush(Flush::Due, fx).await
    }

    /// When the oldest deferred open record is due by age.
    pub fn next_flush(&self) -> Option<tokio::time::Instant> {
        self.deferred_order.front().map(|(at, _, _)| *at)
    }

    /// Write deferred open records (the ones due, or all), into `fx`: the acker awaits them
    /// with the input in hand, and the holds of the inputs that opened them resolve with them.
    pub async fn flush(&mut self, what: Flush, fx: &mut Effects) -> Result<(), TurnIoError> {
        let now = tokio::time::Instant::now();
        while let Some((at, after_inputs, _)) = self.deferred_order.front() {
            if what == Flush::Due && *at > now && *after_inputs > self.inputs {
                break;
            }
            let Some((_, _, key)) = self.deferred_order.pop_front() else {
                break;
            };
            // Decided meanwhile: its decision made it durable.
            let Some(record) = self.deferred.get(&key).map(|d| d.record.clone()) else {
                continue;
            };
            let write = self.write_record(&key, &record, None).await?;
            self.open.set_rev(&key, Rev::Pending(write.clone()));
            fx.writes.push(write);
        }
        Ok(())
    }

    /// An event the partition processed that answers no turn: a `task.artifact` of an open A2A
    /// exchange this owner opened marks the exchange as streamed, so its answer reads them.
    pub fn saw(&mut self, n: &Normalized) {
        if self.streamed.is_empty() || n.envelope.event_type != "task.artifact" {
            return;
        }
        let Some(turn) = n.envelope.turn_id.as_ref().and_then(crate::model::id_text) else {
            return;
        };
        if let Some(seen) = self
            .streamed
            .get_mut(&turns::record_key(self.partition, &n.key, &turn))
        {
            *seen = true;
        }
    }

    /// Forget which exchanges streamed artifacts: their answers read the raw stream for them.
    pub fn forget_streamed(&mut self) {
        self.streamed.clear();
    }

    /// The exchange facts of an AG-UI run event, its run resolved against this partition's open
    /// runs. `None`: it names no run and none of its key is open (projected as it is).
    pub fn run_facts(&self, ev: &RunEvent) -> Option<TurnFacts> {
        ev.facts(&self.runs)
    }

    fn remember(&mut self, key: &str, rec: &TurnRecord, rev: Rev) {
        self.runs.note(rec);
        if rec.state == TurnState::Open {
            self.open.open(key, rec.deadline_ms, rev, Some(rec.clone()));
            self.report_open();
            return;
        }
        if self.open.close(key) {
            self.report_open();
        }
        if self.recent.insert(key.to_string(), rec.clone()).is_none() {
            self.recent_order.push_back(key.to_string());
            while self.recent_order.len() > RECENT_DECIDED {
                if let Some(old) = self.recent_order.pop_front() {
                    self.recent.remove(&old);
                }
            }
        }
    }

    /// Apply a turn event: its record write, the turn's response when it decides the turn, and
    /// its own projection (or suppression), in that order, into `fx`.
    pub async fn on_event(
        &mut self,
        shared: &WorkerContext,
        n: &Normalized,
        facts: &TurnFacts,
        fx: &mut Effects,
    ) -> Result<(), TurnIoError> {
        let key = facts.record_key(self.partition);
        // Messages are processed in stream order, so one stored after an open turn's deadline
        // means the deadline has passed in event time: decide it first (no further than the
        // cap a reshard marker set).
        let passed = self
            .deadline_cap
            .map_or(facts.stored_ms, |cap| cap.min(facts.stored_ms));
        if let Some((_, _, Some(deadline))) = self.open.get(&key) {
            if deadline < passed {
                self.advance(shared, passed, fx).await?;
            }
        }
        let current = self.current_rev(&key).await?;
        // Only a response with no record yet may be a ping-pong reply the hold lets through; the
        // key is worked out first, so every other input (a new turn's send among them) skips the
        // boxed read.
        let ping_pong;
        let prev_key = (current.is_none() && !self.cfg.early_hold.is_zero())
            .then(|| facts.previous_record_key(self.partition))
            .flatten();
        let facts = match prev_key {
            Some(prev_key) => {
                ping_pong = Box::pin(self.follows_previous(facts, &prev_key)).await?;
                ping_pong.as_ref().unwrap_or(facts)
            }
            None => facts,
        };
        // The rules only echo the revision back in `Expect::Revision`; the shell writes after
        // the revision it holds, which may still be in flight.
        let step = turns::on_event(current.as_ref().map(|(r, _)| (r, 0)), facts, &self.cfg);
        if let Some((rec, Expect::Absent)) = &step.write {
            if rec.state == TurnState::Open
                && rec.send.as_ref().is_some_and(|s| s.a2a_method.is_some())
            {
                if self.streamed.len() >= STREAMED_EXCHANGES {
                    self.streamed.clear();
                }
                self.streamed.insert(key.clone(), false);
            }
        }
        let after = match &step.write {
            Some((rec, Expect::Absent))
                if rec.state == TurnState::Open && !self.open_write_delay.is_zero() =>
            {
                tracing::trace!(
                    partition = self.partition,
                    key,
                    seq = facts.seq,
                    "open record deferred"
                );
                self.defer_open(&key, rec, fx);
                Some((rec.clone(), Rev::Unwritten))
            }
            Some((rec, expect)) => {
                let prior = match expect {
                    Expect::Absent => None,
                    Expect::Revision(_) => current.as_ref().map(|(_, rev)| rev.clone()),
                };
                let w = self.write_record(&key, rec, prior).await?;
                fx.writes.push(w.clone());
                self.remember(&key, rec, Rev::Pending(w.clone()));
                Some((rec.clone(), Rev::Pending(w)))
            }
            None => current,
        };
        if let Some((rec, rev)) = &after {
            if step.respond || turns::republished_at(rec, facts.seq) {
                // A decision another owner wrote, read back from KV with no checkpoint vouching
                // for it (a deposed owner's late write, adopted here once and since forgotten
                // by `recent`): its response may be stored already, past the duplicate window,
                // so it is looked up before it is issued, as when it was adopted.
                let foreign = step.write.is_none()
                    && rec.state == TurnState::Decided
                    && rec.writer != Some(self.term)
                    && !self.awaiting.iter().any(|a| a.key == key);
                if foreign {
                    Box::pin(self.adopt_decision(shared, &key, rec, fx)).await?;
                } else {
                    self.issue_response(shared, &key, rec, rev.clone(), Some((facts.seq, n)), fx)
                        .await?;
                }
            }
        }
        if step.project_self {
            fx.outs.push(pipeline::projection(
                &shared.names,
                n,
                facts.seq,
                pipeline::input_msg_id(
                    self.raw.raw_stream_at(self.partition, facts.seq),
                    facts.seq,
                    0,
                ),
            ));
        }
        if let (Some(reason), Some((rec, _))) = (step.suppress, &after) {
            fx.outs
                .push(self.suppression(shared, n, &n.envelope, rec, reason, facts.seq));
        }
        if let (Some(early), Some((rec, _))) = (step.suppress_early, &after) {
            // The early response this send refused, read back: it was held, never published,
            // so its suppression is its only output and must not be skipped (an error: the
            // send is processed again).
            let Some(env) = Box::pin(self.fetch_envelope(shared, &key, early)).await? else {
                return Err(TurnIoError::kv(
                    &key,
                    format!(
                        "the early response (raw sequence {early}) the send refused could not be read back from the raw stream"
                    ),
                ));
            };
            fx.outs
                .push(self.suppression(shared, n, &env, rec, SuppressReason::NotTarget, early));
        }
        Ok(())
    }

    /// The facts of a response stored before any send of its turn, marked as continuing the
    /// conversation's previous turn (its record at `prev_key`) when it does
    /// ([`turns::continues_previous`]: a ping-pong reply, which the early hold does not hold);
    /// `None` when it does not.
    /// The previous turn's record is read as it stands now, possibly changed by messages stored
    /// after the response (processed again after a takeover); the rules count only what was
    /// stored before it, so the answer does not depend on when the response is processed.
    async fn follows_previous(
        &self,
        facts: &TurnFacts,
        prev_key: &str,
    ) -> Result<Option<TurnFacts>, TurnIoError> {
        let Some((rec, _)) = self.current_rev(prev_key).await? else {
            return Ok(None);
        };
        Ok(turns::continues_previous(&rec, facts).then(|| TurnFacts {
            follows_previous: true,
            ..facts.clone()
        }))
    }

    /// The suppression of the event `env` (stored at raw `seq`, of the turn `rec`, its key and
    /// conversation those of `n`): on `system.observability`, with a Msg-Id of its own input.
    fn suppression(
        &self,
        shared: &WorkerContext,
        n: &Normalized,
        env: &crate::model::Envelope,
        rec: &TurnRecord,
        reason: SuppressReason,
        seq: u64,
    ) -> Outgoing {
        let sn = Normalized {
            envelope: blocked::suppressed(env, rec, reason),
            key: n.key.clone(),
            conversation_id: n.conversation_id.clone(),
            source: None,
        };
        let mut out = pipeline::projection(
            &shared.names,
            &sn,
            seq,
            pipeline::input_msg_id(
                self.raw.raw_stream_at(self.partition, seq),
                seq,
                "suppressed",
            ),
        );
        out.kind = OutKind::Projection(Role::SystemObservability);
        metrics::counter!(telemetry::SUPPRESSED, "reason" => reason.as_str()).increment(1);
        out
    }

    /// From now on decide no deadline after `at_ms` (the lowest of the caps given).
    pub fn cap_deadlines_at(&mut self, at_ms: i64) {
        self.deadline_cap = Some(self.deadline_cap.map_or(at_ms, |c| c.min(at_ms)));
    }

    /// Decide deadlines as the store times say again (the reshard that set the cap was
    /// abandoned).
    pub fn lift_deadline_cap(&mut self) {
        self.deadline_cap = None;
    }

    /// Decide every open turn whose deadline is before the watermark, into `fx`.
    pub async fn advance(
        &mut self,
        shared: &WorkerContext,
        watermark_ms: i64,
        fx: &mut Effects,
    ) -> Result<usize, TurnIoError> {
        let expired = self.open.expire(watermark_ms);
        let mut decided = 0;
        for (deadline_ms, key) in expired {
            let Some((rec, rev)) = self.open_record(&key).await? else {
                // The record is gone (expired from the bucket): nothing left to decide.
                if self.open.close(&key) {
                    self.report_open();
                }
                continue;
            };
            if rec.deadline_ms.is_some_and(|d| d >= watermark_ms) {
                // The record's deadline moved past the one this book held (a send refused the
                // early response the record held, and this owner read it from the store): it
                // is armed again at its own deadline.
                self.remember(&key, &rec, Rev::Known(rev));
                continue;
            }
            let Some(step) = turns::on_deadline((&rec, rev)) else {
                // Decided meanwhile by another owner, or no deadline after all.
                if rec.state == TurnState::Decided && rec.writer != Some(self.term) {
                    Box::pin(self.adopt_decision(shared, &key, &rec, fx)).await?;
                } else {
                    self.remember(&key, &rec, Rev::Known(rev));
                }
                continue;
            };
            let Some((new, expect)) = step.write else {
                continue;
            };
            let prior = match expect {
                Expect::Absent => None,
                Expect::Revision(v) => Some(Rev::Known(v)),
            };
            let w = self.write_record(&key, &new, prior).await?;
            fx.writes.push(w.clone());
            self.remember(&key, &new, Rev::Pending(w.clone()));
            self.issue_response(shared, &key, &new, Rev::Pending(w), None, fx)
                .await?;
            let late_ms = super::now_ms().saturating_sub(deadline_ms).max(0);
            metrics::histogram!(telemetry::TIMEOUT_LATENESS).record(late_ms as f64 / 1000.0);
            decided += 1;
        }
        Ok(decided)
    }

    /// A decision of an open turn that another owner wrote after this owner's reload read the
    /// turn open, and that no checkpoint vouches for: a deposed owner's write that landed late
    /// (sent when it resumed from a pause, or held up on the way). Its response may never have
    /// been stored, since the deposed owner's publishes are fenced off, and no input of this
    /// owner will issue it (a timeout has no winner to process again). So it is issued here,
    /// as a reload issues the unpublished decisions it finds: within the projection stream's
    /// duplicate window its Msg-Id collapses a copy that was stored; past it the stream is
    /// searched first. No mark: the published checkpoint vouches only for this owner's own
    /// decisions, and a later reload that finds this one looks it up again.
    async fn adopt_decision(
        &mut self,
        shared: &WorkerContext,
        key: &str,
        rec: &TurnRecord,
        fx: &mut Effects,
    ) -> Result<(), TurnIoError> {
        let written_at = match self.entry(key).await? {
            Some(e) => e.written_at,
            None => chrono::Utc::now(),
        };
        let outs = self.unstored_response(shared, key, rec, written_at).await?;
        let stored = outs.is_empty();
        tracing::info!(
            partition = self.partition,
            key,
            writer = ?rec.writer,
            stored,
            "an open turn was decided by a previous owner after this one took the partition; its response is issued unless found stored"
        );
        fx.outs.extend(outs);
        self.remember(key, &turns::published(rec), Rev::Known(0));
        Ok(())
    }

    /// The response of a decided turn that may never have been stored (written at
    /// `written_at`), or nothing when it is known stored: within the projection stream's
    /// duplicate window its Msg-Id collapses a stored copy, so it is returned without a look;
    /// past it the stream is searched for it first.
    async fn unstored_response(
        &self,
        shared: &WorkerContext,
        key: &str,
        rec: &TurnRecord,
        written_at: chrono::DateTime<chrono::Utc>,
    ) -> Result<Vec<Outgoing>, TurnIoError> {
        let outs = self.response(shared, key, rec, None).await?;
        // The exchange's own response is last: the ends of a timed-out run are published before it,
        // so with it stored they are too.
        let stored = match outs.last() {
            Some(out) => stored_past_window(shared, key, out, written_at).await?,
            None => true,
        };
        Ok(if stored { Vec::new() } else { outs })
    }

    /// Put the turn's one response into `fx`, with its mark: once the response is stored, the
    /// decision counts towards the published checkpoint.
    ///
    /// `current` is the event being processed (its sequence and envelope); when it is not the
    /// winner, the winner's raw message is read back from the raw stream.
    async fn issue_response(
        &mut self,
        shared: &WorkerContext,
        key: &str,
        rec: &TurnRecord,
        rev: Rev,
        current: Option<(u64, &Normalized)>,
        fx: &mut Effects,
    ) -> Result<(), TurnIoError> {
        if rec.state != TurnState::Decided {
            return Ok(());
        }
        if let Some(i) = self.awaiting.iter().position(|a| a.key == key) {
            // Found at reload: published once, where its winner stands, unless stored already.
            let a = self.awaiting.swap_remove(i);
            return Box::pin(self.issue_found(shared, a, current, fx)).await;
        }
        let outs = self.response(shared, key, rec, current).await?;
        self.streamed.remove(key);
        crash_point("after_decide");
        fx.outs.extend(outs);
        fx.marks.push(Mark::Decided {
            key: key.to_string(),
            after: rev,
        });
        // This owner wrote the decision and issued its response: to the turn rules the turn is
        // published (a crash before the mark leaves it decided in KV, and the reload republishes).
        self.remember(key, &turns::published(rec), Rev::Known(0));
        Ok(())
    }

    /// The response of a decided turn, or what a decided run publishes: its one terminal, after
    /// the synthesised ends of what it left open when it timed out. The exchange's one response
    /// (with the Msg-Id derived from the exchange) is always last.
    async fn response(
        &self,
        shared: &WorkerContext,
        key: &str,
        rec: &TurnRecord,
        current: Option<(u64, &Normalized)>,
    ) -> Result<Vec<Outgoing>, TurnIoError> {
        let winner_seq = rec.winner.as_ref().and_then(|w| w.seq);
        let fetched;
        let decider = match (winner_seq, current) {
            (Some(ws), Some((seq, n))) if ws == seq => Some(&n.envelope),
            (Some(ws), _) => {
                // Boxed, as are the other rare paths below: their state would otherwise be carried
                // by every input's processing future, which is moved whole for each input.
                fetched = Box::pin(self.fetch_envelope(shared, key, ws)).await?;
                fetched.as_ref()
            }
            (None, _) => None,
        };
        if decider.is_none() && rec.winner.as_ref().is_some_and(|w| w.blocked.is_none()) {
            // A real reply must be published as it was written; never substitute a guess.
            return Err(TurnIoError::kv(
                key,
                format!(
                    "the winning reply (raw sequence {}) could not be read back from the raw stream",
                    winner_seq.unwrap_or(0)
                ),
            ));
        }
        if rec.exchange == ExchangeKind::Run {
            return Box::pin(self.run_terminal(shared, key, rec, decider)).await;
        }
        let mut env = blocked::winner_response(rec, decider);
        // An A2A answer at the end of a stream: the artifacts streamed before it are its content.
        let a2a_real_reply = rec.winner.as_ref().is_some_and(|w| w.blocked.is_none())
            && rec.send.as_ref().is_some_and(|s| s.a2a_method.is_some());
        if let (true, Some(ws), Some(send)) = (a2a_real_reply, winner_seq, rec.send.as_ref()) {
            // Read only when the exchange may have streamed artifacts (`false`: none did).
            if ws > send.seq + 1 && self.streamed.get(key) != Some(&false) {
                let artifacts = Box::pin(self.exchange_artifacts(shared, key, rec, ws)).await?;
                blocked::attach_artifacts(&mut env, artifacts);
            }
        }
        if let Some(r) = env.raw_event_ref.as_mut() {
            if r.stream.is_empty() {
                r.stream = self
                    .raw
                    .raw_stream_at(self.partition, winner_seq.unwrap_or(0))
                    .to_string();
            }
        }
        let blocked_reason = rec.winner.as_ref().and_then(|w| w.blocked);
        let wn = Normalized {
            envelope: env,
            key: rec.key.clone(),
            conversation_id: Some(rec.conversation_id.clone()),
            source: None,
        };
        let mut out = project_issued(
            shared,
            key,
            wn,
            winner_seq.unwrap_or(0),
            rec.response_msg_id(),
        )
        .await?;
        out.subject = shared
            .names
            .proj_subject(Role::ConversationMain, &rec.key, "a2a.response");
        metrics::counter!(
            telemetry::TURN_OUTCOMES,
            "outcome" => if blocked_reason.is_some() { "blocked" } else { "response" },
            "reason" => blocked_reason.map(|r| r.as_str()).unwrap_or("none")
        )
        .increment(1);
        Ok(vec![out])
    }

    /// What a decided run publishes. A real terminal is projected once, as itself (its own type
    /// and role), under the run's Msg-Id. A timeout publishes a synthesised end for each text
    /// message and tool call the run left open, derived from the run's raw events (see
    /// [`Self::open_items`]), then the synthesised `run.failed`.
    async fn run_terminal(
        &self,
        shared: &WorkerContext,
        key: &str,
        rec: &TurnRecord,
        decider: Option<&crate::model::Envelope>,
    ) -> Result<Vec<Outgoing>, TurnIoError> {
        let winner_seq = rec.winner.as_ref().and_then(|w| w.seq);
        let envelope = |env: crate::model::Envelope| {
            let mut env = env;
            if let Some(r) = env.raw_event_ref.as_mut() {
                if r.stream.is_empty() {
                    r.stream = self
                        .raw
                        .raw_stream_at(self.partition, winner_seq.unwrap_or(0))
                        .to_string();
                }
            }
            Normalized {
                envelope: env,
                key: rec.key.clone(),
                conversation_id: None,
                source: None,
            }
        };
        let mut issued: Vec<(Normalized, String)> = Vec::new();
        let Some(winner) = rec.winner.as_ref().filter(|w| w.seq.is_none()) else {
            metrics::counter!(telemetry::RUN_TERMINALS, "outcome" => "terminal").increment(1);
            issued.push((
                envelope(runs::terminal(rec, decider)),
                rec.response_msg_id(),
            ));
            return project_all(shared, key, rec, issued).await;
        };
        let open = self.open_items(shared, key, rec).await?;
        for item in &open {
            let (id, env) = runs::end_of(rec, item, winner.at_ms);
            issued.push((envelope(env), id));
        }
        issued.push((
            envelope(runs::timeout_failure(rec, winner, &open)),
            rec.response_msg_id(),
        ));
        metrics::counter!(telemetry::RUN_TERMINALS, "outcome" => "timeout").increment(1);
        project_all(shared, key, rec, issued).await
    }

    /// The text messages and tool calls a timed-out run left open, read from the raw stream: the
    /// key's events in this partition from the run's `RUN_STARTED` to its deadline (inclusive:
    /// an event stored at the deadline is on time), normalised as the worker did. Only timeouts
    /// pay for this read; no state is written per text or tool event. The raw stream keeps those
    /// events unchanged, so a republish after a crash derives the same ends.
    async fn open_items(
        &self,
        shared: &WorkerContext,
        key: &str,
        rec: &TurnRecord,
    ) -> Result<Vec<runs::OpenItem>, TurnIoError> {
        let Some(start) = rec.send.as_ref() else {
            return Ok(Vec::new());
        };
        let deadline = start
            .stored_ms
            .saturating_add(i64::try_from(start.timeout_ms).unwrap_or(i64::MAX));
        let mut scan = RunScan::new(&rec.key, &rec.turn);
        self.scan_raw(shared, key, rec, start.seq, |n, raw, header, agent| {
            if raw.stored_at.timestamp_millis() > deadline {
                return false;
            }
            scan.observe(&n.envelope, header, agent);
            true
        })
        .await?;
        Ok(scan.open_items().to_vec())
    }

    /// The artifacts an A2A exchange streamed before the frame that answered it: the
    /// `task.artifact` events of the same exchange between its send and `until` (the winning
    /// frame's raw sequence), read from the raw stream like a run's open items. Only A2A
    /// responses with frames before them pay for the read; nothing is written per frame, and a
    /// republish derives the same content.
    async fn exchange_artifacts(
        &self,
        shared: &WorkerContext,
        key: &str,
        rec: &TurnRecord,
        until: u64,
    ) -> Result<Vec<serde_json::Value>, TurnIoError> {
        let Some(send) = rec.send.as_ref() else {
            return Ok(Vec::new());
        };
        let mut artifacts = Vec::new();
        self.scan_raw(shared, key, rec, send.seq, |n, raw, _, _| {
            if raw.seq >= until {
                return false;
            }
            let env = &n.envelope;
            let same_exchange = env
                .turn_id
                .as_ref()
                .and_then(crate::model::id_text)
                .is_some_and(|t| t == rec.turn);
            if env.event_type == "task.artifact" && same_exchange {
                if let Some(a) = env
                    .payload
                    .as_ref()
                    .and_then(|p| p.get("a2a"))
                    .and_then(|a| a.get("artifactUpdate"))
                    .and_then(|u| u.get("artifact"))
                {
                    artifacts.push(a.clone());
                }
            }
            true
        })
        .await?;
        Ok(artifacts)
    }

    /// Read the exchange's key's raw events in this partition from `from` on, normalised as the
    /// worker did, until `visit` returns false or no later event of the key is stored. `visit`
    /// gets each event with the raw message it came from and the relay's run header.
    ///
    /// Each event is one `STREAM.MSG.GET` with `next_by_subj`, answered by the stream's leader
    /// (never a direct get, which a lagging replica may answer), from the sequence after the last
    /// one read. No reader is created: a consumer made for the read would have the server count
    /// every message of the key's filter from `from` to the stream's end before its first
    /// delivery, which behind a backlog cost the server milliseconds per read.
    async fn scan_raw(
        &self,
        shared: &WorkerContext,
        key: &str,
        rec: &TurnRecord,
        from: u64,
        mut visit: impl FnMut(&Normalized, &RawMessage<'_>, Option<&str>, Option<&str>) -> bool,
    ) -> Result<(), TurnIoError> {
        let kv_err = |source: Source| TurnIoError::Kv {
            key: format!("{key} (reading the exchange's raw events)"),
            source,
        };
        let filter = shared.names.key_filter(&rec.key);
        // The exchange may span sets of raw streams (a reshard while it was open): each is read
        // from where `from` falls in it, oldest first.
        for (stream_name, start) in self.raw.raw_streams_from(self.partition, from) {
            let stream = shared
                .js
                .get_stream_no_info(stream_name)
                .await
                .map_err(|e| kv_err(Box::new(e)))?;
            let mut next = start.max(1);
            loop {
                let msg = match stream
                    .raw_message_builder()
                    .sequence(next)
                    .next_by_subject(filter.clone())
                    .send()
                    .await
                {
                    Ok(msg) => msg,
                    Err(e) => match e.kind() {
                        // Past the key's last event in this stream: on to the next one.
                        jetstream::stream::RawMessageErrorKind::NoMessageFound => break,
                        // Sealed streams dropped since (`reshard --drop-sealed`): what they held is gone.
                        jetstream::stream::RawMessageErrorKind::JetStream(j)
                            if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND =>
                        {
                            break
                        }
                        _ => return Err(kv_err(Box::new(e))),
                    },
                };
                next = msg.sequence.saturating_add(1);
                let raw = RawMessage {
                    bytes: &msg.payload,
                    stream: stream_name,
                    seq: msg.sequence,
                    stored_subject: msg.subject.as_str(),
                    stored_at: msg.time,
                    delivered: 1,
                    headers: Some(&msg.headers),
                    producer: Default::default(),
                };
                let header = crate::ingest::RelayHeaders::from_nats(&msg.headers).run_id;
                let agent = raw.publishing_agent(&shared.names);
                let events = pipeline::normalize_raw(&raw, &shared.names, &shared.ingest, 0)
                    .unwrap_or_default();
                for n in &events {
                    if !visit(n, &raw, header.as_deref(), agent.as_deref()) {
                        return Ok(());
                    }
                }
            }
        }
        Ok(())
    }

    /// Publish a decided turn's response found at reload (decided after the last checkpoint, so
    /// perhaps never stored). Within the projection stream's duplicate window the Msg-Id collapses
    /// a response that was stored; past it, the stream is searched for the response first.
    async fn republish(
        &mut self,
        shared: &WorkerContext,
        key: &str,
        rec: &TurnRecord,
        written_at: chrono::DateTime<chrono::Utc>,
        cancel: &CancellationToken,
    ) -> Result<(), TurnIoError> {
        let outs = self.unstored_response(shared, key, rec, written_at).await?;
        for out in &outs {
            match shared
                .publisher
                .publish_in_place(out, &self.fence, &[], cancel)
                .await
            {
                Ok(()) => {}
                Err(super::publisher::Halt::Cancelled) => {
                    return Err(TurnIoError::Cancelled(key.to_string()))
                }
                Err(super::publisher::Halt::Failed(f)) => return Err(TurnIoError::Publish(f)),
            }
            shared.state.count_output(out);
        }
        self.remember(key, &turns::published(rec), Rev::Known(0));
        Ok(())
    }

    /// Issue, into `fx`, the responses of the decisions found at reload whose winner the
    /// partition has now passed: the input about to be processed is `seq`, stored at
    /// `stored_ms`, so every input before it has been processed (or was acknowledged before the
    /// reload, with its outputs stored). A winner read again is published with it by the turn
    /// rules; these are the ones whose winner was not delivered again. The store time covers a
    /// winner in an earlier set of raw streams, whose sequences do not compare with this one's.
    pub async fn reached(
        &mut self,
        shared: &WorkerContext,
        seq: u64,
        stored_ms: i64,
        fx: &mut Effects,
    ) -> Result<(), TurnIoError> {
        if self.awaiting.is_empty() {
            return Ok(());
        }
        let (due, waiting): (Vec<Awaiting>, Vec<Awaiting>) = std::mem::take(&mut self.awaiting)
            .into_iter()
            .partition(|a| {
                let (winner_seq, at_ms) = a.winner();
                winner_seq < seq || at_ms < stored_ms
            });
        self.awaiting = waiting;
        for a in due {
            Box::pin(self.issue_found(shared, a, None, fx)).await?;
        }
        Ok(())
    }

    /// The response of a decision found at reload, into `fx` with its mark, unless the
    /// projection stream holds it where its Msg-Id no longer collapses a second copy (a previous
    /// owner stored it and did not live to vouch for it). `current`: the winner's redelivery,
    /// when that is what publishes it.
    async fn issue_found(
        &mut self,
        shared: &WorkerContext,
        a: Awaiting,
        current: Option<(u64, &Normalized)>,
        fx: &mut Effects,
    ) -> Result<(), TurnIoError> {
        let outs = self.response(shared, &a.key, &a.record, current).await?;
        let stored = match outs.last() {
            Some(out) => stored_past_window(shared, &a.key, out, a.written_at).await?,
            None => true,
        };
        self.remember(&a.key, &turns::published(&a.record), Rev::Known(0));
        if !stored {
            tracing::debug!(partition = self.partition, key = %a.key, winner = a.winner().0,
                "publishing a decision found at reload, in its winner's place");
            fx.outs.extend(outs);
        }
        // Counted once this input's outputs are stored (none when the response was already).
        fx.marks.push(Mark::Found { key: a.key });
        Ok(())
    }

    async fn fetch_envelope(
        &self,
        shared: &WorkerContext,
        key: &str,
        seq: u64,
    ) -> Result<Option<crate::model::Envelope>, TurnIoError> {
        let stream_name = self.raw.raw_stream_at(self.partition, seq);
        // Only the server's word that the stream or the message is gone counts as gone: a read
        // that failed otherwise (no answer in time, a leader change) is an error, and the
        // partition starts over, rather than deciding the turn without the event's content.
        let stream = match shared.js.get_stream(stream_name).await {
            Ok(stream) => stream,
            Err(e) if super::error::stream_not_found(&e) => return Ok(None),
            Err(e) => return Err(TurnIoError::kv(key, e)),
        };
        let msg = match stream.get_raw_message(seq).await {
            Ok(msg) => msg,
            Err(e)
                if e.kind()
                    == async_nats::jetstream::stream::RawMessageErrorKind::NoMessageFound =>
            {
                return Ok(None)
            }
            Err(e) => return Err(TurnIoError::kv(key, e)),
        };
        let raw = RawMessage {
            bytes: &msg.payload,
            stream: stream_name,
            seq,
            stored_subject: msg.subject.as_str(),
            stored_at: msg.time,
            delivered: 1,
            headers: Some(&msg.headers),
            producer: Default::default(),
        };
        let Ok(mut events) = pipeline::normalize_raw(&raw, &shared.names, &shared.ingest, 0) else {
            return Ok(None);
        };
        // The reader moved the same fields out when it first processed this input, before its
        // turn rules ran: the response derived from the envelope read back is then the one
        // derived from the envelope the reader held, whichever of the two issues it. The blobs
        // are stored again (the same objects, named by their content) because the output budget
        // may have changed since, and with it whether an envelope too large is offloaded whole.
        let blobs = pipeline::offload(
            &mut events,
            raw.bytes.len(),
            &shared.settings.limits,
            shared.publisher.envelope_budget(),
        );
        store_blobs(shared, key, &blobs).await?;
        Ok(events.into_iter().next().map(|n| n.envelope))
    }
}

/// How often an idle partition writes its checkpoint again, unchanged: the checkpoint lives in
/// the turns bucket, whose entries expire `turns.retention` after their last write (and whose
/// oldest entries go first when it is full). A checkpoint left to expire would make a consumer
/// recreated later (the server restarted with the consumers in its memory) start from the raw
/// stream's first message, which holds inputs older than the turn records whenever
/// `nats.raw_max_age` is the longer. `None`: records never expire (0).
fn checkpoint_refresh(retention: Duration) -> Option<Duration> {
    (!retention.is_zero()).then(|| (retention / 4).max(CHECKPOINT_EVERY))
}

/// How long the partition remembers the hash of a record key it last noted: longer than a
/// record lives in KV (`turns.retention`, counted by the server from the record's last write,
/// which may land a little after the key is noted here). `None`: records never expire (0).
fn forget_keys_after(retention: Duration) -> Option<Duration> {
    (!retention.is_zero()).then(|| retention + Duration::from_secs(60))
}

/// The projection of an envelope the turn contract issues, its large fields moved to the object
/// store as the reader moves an input's own. A response is assembled here, from a reply read
/// back from the raw stream or from the artifacts its exchange streamed, and can be larger than
/// any one input: it must stay the turn's response, never become a `too_large` dead letter. The
/// blob ids are content hashes, so a response issued again refers to the same objects.
async fn project_issued(
    shared: &WorkerContext,
    key: &str,
    n: Normalized,
    source_seq: u64,
    msg_id: String,
) -> Result<Outgoing, TurnIoError> {
    let out = pipeline::projection(&shared.names, &n, source_seq, msg_id);
    let limits = &shared.settings.limits;
    // No field is larger than the whole envelope: one that fits inline needs no look (the
    // usual case, with no further work).
    let budget = shared.publisher.envelope_budget();
    let inline = match limits.max_inline_bytes {
        0 => budget,
        max => max.min(budget),
    };
    if out.payload.len() <= inline {
        return Ok(out);
    }
    Box::pin(project_offloaded(shared, key, n, source_seq, out)).await
}

/// [`project_issued`] for an envelope whose projection `out` may hold fields to offload.
async fn project_offloaded(
    shared: &WorkerContext,
    key: &str,
    mut n: Normalized,
    source_seq: u64,
    out: Outgoing,
) -> Result<Outgoing, TurnIoError> {
    let blobs = pipeline::offload(
        std::slice::from_mut(&mut n),
        out.payload.len(),
        &shared.settings.limits,
        shared.publisher.envelope_budget(),
    );
    if blobs.is_empty() {
        return Ok(out);
    }
    store_blobs(shared, key, &blobs).await?;
    Ok(pipeline::projection(
        &shared.names,
        &n,
        source_seq,
        out.msg_id,
    ))
}

/// [`project_issued`] for each of what a run's decision issues.
async fn project_all(
    shared: &WorkerContext,
    key: &str,
    rec: &TurnRecord,
    issued: Vec<(Normalized, String)>,
) -> Result<Vec<Outgoing>, TurnIoError> {
    let winner_seq = rec.winner.as_ref().and_then(|w| w.seq);
    let source_seq = winner_seq.or(rec.send.as_ref().map(|s| s.seq)).unwrap_or(0);
    let mut outs = Vec::with_capacity(issued.len());
    for (n, msg_id) in issued {
        outs.push(project_issued(shared, key, n, source_seq, msg_id).await?);
    }
    Ok(outs)
}

/// Store `blobs` before the projection that refers to them is published; a failure is the
/// turn's I/O failure (the partition restarts and issues the response again). Unlike an
/// input's blobs (`Publisher::store_blobs_in_place`) they are not retried in place: no input is
/// held for them.
async fn store_blobs(
    shared: &WorkerContext,
    key: &str,
    blobs: &[crate::blobs::Blob],
) -> Result<(), TurnIoError> {
    for blob in blobs {
        shared.publisher.put_blob(blob).await.map_err(|e| {
            TurnIoError::kv(
                key,
                format!(
                    "storing the offloaded field {} of its response: {e}",
                    blob.id
                ),
            )
        })?;
    }
    Ok(())
}

/// The partition's queue of decision writes (and of writes after a write still in flight).
///
/// Decisions reach the server in the order the partition makes them, so their revisions follow
/// that order too: the published checkpoint (the highest revision whose response is stored) then
/// never covers a later decision whose response is not stored yet. A decision on a turn whose open
/// write is unacknowledged waits here for its revision, in order, while the partition goes on.
struct DecisionWriter {
    queue: mpsc::UnboundedSender<QueuedWrite>,
    publisher: Arc<Publisher>,
    /// Writes queued and not yet handed to the connection. Only the partition queues, and only
    /// the writer's task takes one off once it is sent, so a zero read by the partition means
    /// every decision it made is on its way.
    pending: Arc<AtomicUsize>,
}

struct QueuedWrite {
    subject: String,
    rec: TurnRecord,
    after: Option<Rev>,
    /// The write's ack, the connection's count of connects when it was sent, and, when it
    /// expected its key absent, what sends it again over a delete marker.
    sent: oneshot::Sender<Result<Sent, WriteError>>,
}

type Sent = (jetstream::context::PublishAckFuture, u64, Option<Again>);

impl DecisionWriter {
    /// Start the writer task; it ends when the writer is dropped (with the partition's turns).
    fn start(records: Arc<RecordWrites>, publisher: Arc<Publisher>) -> DecisionWriter {
        let sender = publisher.clone();
        let (queue, mut rx) = mpsc::unbounded_channel::<QueuedWrite>();
        let pending = Arc::new(AtomicUsize::new(0));
        let sent_off = pending.clone();
        tokio::spawn(async move {
            while let Some(w) = rx.recv().await {
                let expected = match w.after {
                    None => Ok(0),
                    Some(rev) => rev.revision().await,
                };
                let sent = async {
                    let rev = expected?;
                    let at = sender.connects();
                    let (ack, again) = records
                        .send(w.subject, &w.rec, rev)
                        .await
                        .map_err(|e| WriteError::Failed(e.into()))?;
                    Ok((ack, at, again))
                };
                let sent = sent.await;
                // Handed to the connection (or failed): a decision the partition sends itself
                // from now on follows this one.
                sent_off.fetch_sub(1, Ordering::Release);
                let _ = w.sent.send(sent);
            }
        });
        DecisionWriter {
            queue,
            publisher,
            pending,
        }
    }

    /// Whether nothing queued here is still to be sent.
    fn is_idle(&self) -> bool {
        self.pending.load(Ordering::Acquire) == 0
    }

    /// Queue a compare-and-set write of `rec` after `after` (absent: the key must be absent).
    fn write(&self, subject: String, rec: TurnRecord, after: Option<Rev>) -> KvWrite {
        let (sent, ack) = oneshot::channel();
        // Counted up and read by the partition alone: what `is_idle` (Acquire) must see is the
        // task's count-down (Release) once its send has reached the connection.
        self.pending.fetch_add(1, Ordering::Relaxed);
        let queued = self.queue.send(QueuedWrite {
            subject,
            rec,
            after,
            sent,
        });
        let publisher = self.publisher.clone();
        async move {
            let stopped =
                || WriteError::Failed(Arc::from(Source::from("the partition's writer stopped")));
            queued.map_err(|_| stopped())?;
            let (ack, connects, again) = ack.await.map_err(|_| stopped())??;
            written_or_over(&publisher, ack, connects, again).await
        }
        .boxed()
        .shared()
    }
}

/// Send a record's bytes to `subject` (a key of the turns bucket) on the condition that the
/// key is still at revision `expected` (0: absent), without waiting for the ack.
async fn send_cas(
    kv_js: &jetstream::Context,
    subject: String,
    value: Bytes,
    expected: u64,
) -> Result<jetstream::context::PublishAckFuture, Source> {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(
        async_nats::header::NATS_EXPECTED_LAST_SUBJECT_SEQUENCE,
        expected.to_string().as_str(),
    );
    let publish = jetstream::message::PublishMessage::build()
        .payload(value)
        .headers(headers);
    Ok(kv_js.send_publish(subject, publish).await?)
}

/// The revision a write of this owner resulted in, waiting for its ack if need be.
async fn resolve(key: &str, rev: &Rev) -> Result<u64, TurnIoError> {
    rev.clone().revision().await.map_err(|e| e.for_key(key))
}

/// How many inputs a deferred open record may hold unacknowledged behind it: half the
/// consumer's `max_ack_pending` (a non-positive value means no limit on the server).
fn defer_inputs(max_ack_pending: i64) -> u64 {
    match u64::try_from(max_ack_pending) {
        Ok(n) if n > 0 => (n / 2).max(1),
        _ => 10_000,
    }
}

/// A decided turn whose response the reload found unpublished, waiting for the partition to
/// pass its winner (the input that decided it) in raw order.
struct Awaiting {
    key: String,
    /// The decided record, as the reload read it (its winner has a raw sequence).
    record: TurnRecord,
    /// When the decision was written.
    written_at: chrono::DateTime<chrono::Utc>,
}

impl Awaiting {
    /// The winner's raw sequence and store time.
    fn winner(&self) -> (u64, i64) {
        self.record
            .winner
            .as_ref()
            .map_or((0, 0), |w| (w.seq.unwrap_or(0), w.at_ms))
    }
}

/// Whether `out`, the response of the decision of `key` written at `written_at`, is stored
/// where its Msg-Id no longer collapses a second copy (see `Publisher::stored_past_window`).
///
/// A decision at least the response stream's `max_age` old is taken as stored, without a
/// look-up: its response may have been stored and aged out since, which the stream can no
/// longer tell from "never stored", and publishing it then would be the turn's second
/// response, long after the first was read. (A decision that old not vouched for by a
/// checkpoint is one whose checkpoint was deleted by hand, or whose partition stayed without
/// an owner for all of the stream's retention.)
async fn stored_past_window(
    shared: &WorkerContext,
    key: &str,
    out: &Outgoing,
    written_at: chrono::DateTime<chrono::Utc>,
) -> Result<bool, TurnIoError> {
    let looked_up = |e| TurnIoError::kv(key, e);
    let publisher = &shared.publisher;
    // Asked first: a search for a response that old would read the subject from before the
    // stream's first message, and could not tell anything either way.
    if !publisher.may_have_aged_out(out, written_at) {
        return publisher
            .stored_past_window(out, written_at)
            .await
            .map_err(looked_up);
    }
    tracing::warn!(
        key,
        subject = %out.subject,
        decided_at = %written_at,
        "a decided turn is older than its response's stream keeps anything: taken as \
         published (it may have aged out), not looked up or published again"
    );
    Ok(true)
}

/// Test hook: `COLLAB_TEST_CRASH_AT=<point>` aborts the process at that point of the turn
/// protocol (`after_decide`, `after_publish`, `before_ack`), as a SIGKILL would, so crash
/// recovery can be tested at exact instants.
pub(crate) fn crash_point(point: &str) {
    if std::env::var("COLLAB_TEST_CRASH_AT").is_ok_and(|v| v == point) {
        eprintln!("test hook: crashing at {point}");
        std::process::abort();
    }
}

#[cfg(test)]
mod tests {
    use super::CheckpointValue;

    #[test]
    fn a_checkpoint_vouches_below_its_base_for_anyone_and_above_it_for_its_owner_only() {
        let c = CheckpointValue {
            through: 100,
            base: Some(40),
            owner: Some(7),
            acked: None,
        };
        assert!(c.vouches_for(40, None));
        assert!(c.vouches_for(30, Some(9)));
        assert!(c.vouches_for(100, Some(7)));
        assert!(!c.vouches_for(50, Some(9)), "a previous owner's late write");
        assert!(!c.vouches_for(50, None), "a decision without a writer");
        assert!(!c.vouches_for(101, Some(7)), "above the checkpoint");
    }

    #[test]
    fn a_checkpoint_without_base_or_owner_vouches_up_to_through() {
        let old: CheckpointValue = serde_json::from_str(r#"{"through":100}"#).unwrap_or_default();
        assert!(old.vouches_for(100, None));
        assert!(old.vouches_for(100, Some(3)));
        assert!(!old.vouches_for(101, None));
    }
}
