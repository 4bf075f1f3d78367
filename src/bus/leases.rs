//! Partition ownership for N identical workers: one lease per partition in the KV bucket
//! `<prefix>_leases` (entries expire after `workers.lease_ttl` unless renewed), worker
//! heartbeats in the same bucket, and a balanced target of ceil(P / N) partitions per worker.
//!
//! A worker renews what it holds every sixth of the TTL, stops a partition at once when its
//! renewal fails and the lease, read back, is not its own any more (another owner took it, or
//! it was deleted), releases its excess gracefully (drain, then delete the
//! lease) when workers join, and takes free partitions up to its share. On shutdown it drains
//! every partition and deletes its leases so the others take over without waiting for the TTL.
//! Two owners may briefly overlap after a pause longer than the TTL; the KV fence of the turn
//! contract and the Msg-Ids keep the output exactly-once then.
//!
//! A crashed worker is not waited for until its lease expires. Every worker answers on a
//! presence subject over the connection that renews its leases, and the others ask every
//! [`PROBE_EVERY`]. When the server answers "no responders" twice in a row, that connection is
//! closed (the process died, or lost the server). Its leases are then deleted (each at the
//! revision read) as soon as the owner, were it still running elsewhere, would have stopped on
//! its own: a partition works only within a third of the TTL of its last renewal, and its last
//! pull request expires `PULL_EXPIRES` later. So a deleted lease's owner neither
//! processes nor receives anything of the partition any more, exactly as when a lease expires,
//! and the partition is taken 2-3 s after a crash instead of 6-8 s.
//!
//! A worker that does not answer at all (`SILENT_AFTER` probes in a row: a network partition
//! or stall between it and the server, a paused process) is treated the same way, under the same
//! quiet rule. The partition runtime makes that safe even when such a worker comes back with work
//! in hand: its late outputs fail against the new owner's fence, its late pull requests show as a
//! gap in the new owner's delivery sequence (which then starts over from the acknowledgement
//! floor), and its lease renewals and turn-record writes fail their compare-and-set.

use super::context::WorkerContext;
use super::error::WorkerError;
use super::worker;
use super::{LeaseAsk, LeaseValidity, HEARTBEAT_PREFIX, H_LEASE_TTL_MS};
use async_nats::jetstream::kv;
use futures::StreamExt;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::{error, info, warn};

struct Held {
    revision: u64,
    /// A partition taken over from a gone worker is not released for balance before this: it
    /// runs with the worker that took it for a lease TTL first, so a takeover is not followed at
    /// once by a handover (to a newcomer whose own faults would then delay it again).
    keep_until: Option<tokio::time::Instant>,
    /// Until when the lease is known to hold: the start of its last successful renewal plus a
    /// third of the TTL.
    valid_until: Arc<LeaseValidity>,
    /// When the earliest renewal whose outcome is not known was asked: one the server may have
    /// stored with its answer lost. A renewal found stored later counts from here, never from
    /// a later ask.
    unconfirmed_since: Option<LeaseAsk>,
    cancel: CancellationToken,
    task: JoinHandle<()>,
}

/// On a lease renewal: a token of the process that wrote it, drawn at start. Worker ids are
/// unique by default but may be configured; two processes given one id (a replacement started
/// beside a paused original) must still never take each other's renewals for their own.
const H_LEASE_INSTANCE: &str = "Collab-Lease-Instance";

/// What reading a lease back says after its renewal failed.
#[derive(Debug, PartialEq, Eq)]
enum ReadBack {
    /// A renewal of this process was stored (its answer lost): the lease holds at this revision.
    Renewed(u64),
    /// Another worker holds it, or it was deleted or expired.
    Lost,
    /// Not known: nothing newer than the revision held was read, or the read failed.
    Unknown,
}

/// Read back a lease whose renewal expected `held_revision`: `last` is the lease's last
/// message as the stream's leader has it, with whether this process wrote it (a put of its
/// worker id carrying its instance token). Every renewal this process has out expects the held
/// revision, so at most one of them can be stored, and only as the next write.
fn read_back(last: Option<(u64, bool)>, held_revision: u64) -> ReadBack {
    let Some((revision, ours)) = last else {
        return ReadBack::Lost;
    };
    match (revision.cmp(&held_revision), ours) {
        (std::cmp::Ordering::Greater, true) => ReadBack::Renewed(revision),
        // Not stored: the lease is as this process last knew it (the next round asks again).
        (std::cmp::Ordering::Equal, _) => ReadBack::Unknown,
        // Older than what this process holds: no leader answers that; ask again.
        (std::cmp::Ordering::Less, _) => ReadBack::Unknown,
        (std::cmp::Ordering::Greater, false) => ReadBack::Lost,
    }
}

/// Whether `e`, a lease as the stream's leader has it, is a put of `worker_id` by the process
/// whose instance token is `instance`.
fn written_by(e: &super::LeaderEntry, worker_id: &str, instance: &str) -> bool {
    e.put
        && e.value.as_ref() == worker_id.as_bytes()
        && e.headers.get(H_LEASE_INSTANCE).map(|v| v.as_str()) == Some(instance)
}

/// `p`'s lease as the stream's leader has it: its revision and whether this process wrote it.
/// `None` inside: no lease; an error or no answer within a probe interval: `None` outside.
async fn read_lease(
    store: &kv::Store,
    p: u16,
    worker_id: &str,
    instance: &str,
) -> Option<Option<(u64, bool)>> {
    let key = lease_key(p);
    match tokio::time::timeout(PROBE_EVERY, super::leader_entry(store, &key)).await {
        Ok(Ok(entry)) => Some(entry.map(|e| (e.revision, written_by(&e, worker_id, instance)))),
        Ok(Err(_)) | Err(_) => None,
    }
}

/// Delete partition `p`'s lease, held at `revision`, or at the revision a renewal of this
/// process stored with its answer lost (read back from the leader): a lease anyone else wrote
/// meanwhile is left alone.
async fn delete_held(store: &kv::Store, p: u16, revision: u64, worker_id: &str, instance: &str) {
    if store
        .delete_expect_revision(lease_key(p), Some(revision))
        .await
        .is_ok()
    {
        return;
    }
    if let Some(Some((stored, true))) = read_lease(store, p, worker_id, instance).await {
        if stored > revision {
            let _ = store
                .delete_expect_revision(lease_key(p), Some(stored))
                .await;
        }
    }
}

/// Renew the lease on `subject` (its message subject in the bucket's stream) expecting
/// `revision`, marked with `instance`: the new revision.
async fn publish_renewal(
    js: &async_nats::jetstream::Context,
    subject: &str,
    worker_id: &str,
    instance: &str,
    revision: u64,
) -> Result<u64, async_nats::jetstream::context::PublishError> {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(
        async_nats::header::NATS_EXPECTED_LAST_SUBJECT_SEQUENCE,
        revision.to_string(),
    );
    headers.insert(H_LEASE_INSTANCE, instance);
    let ack = js
        .publish_with_headers(subject.to_string(), headers, worker_id.to_string().into())
        .await?
        .await?;
    Ok(ack.sequence)
}

/// Which of the `held` partitions (in ascending order, each with the instant it may be released
/// from) to release so that `target` remain: the highest first, none kept past `now`'s holds,
/// so fewer than the excess when too many are still held.
fn releasable(
    held: impl DoubleEndedIterator<Item = (u16, Option<tokio::time::Instant>)> + ExactSizeIterator,
    target: usize,
    now: tokio::time::Instant,
) -> Vec<u16> {
    let excess = held.len().saturating_sub(target);
    held.rev()
        .filter(|(_, keep_until)| keep_until.is_none_or(|k| k <= now))
        .map(|(p, _)| p)
        .take(excess)
        .collect()
}

/// A partition this worker stopped, until its task has ended.
struct Leaving {
    p: u16,
    held: Held,
    /// Released for balance: its lease is deleted once the task has ended. (A lost lease is
    /// another owner's already.)
    release: bool,
}

/// The target number of partitions for each of `workers` live workers.
pub fn share(partitions: u16, workers: usize) -> usize {
    let n = workers.max(1);
    usize::from(partitions).div_ceil(n)
}

/// The order in which a worker tries free partitions: starting at a point derived from its id, so
/// workers that start together do not all race for partition 0.
pub fn probe_order(worker_id: &str, partitions: u16) -> Vec<u16> {
    let start = worker_id
        .bytes()
        .fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b)))
        % u32::from(partitions.max(1));
    (0..partitions)
        .map(|i| ((u32::from(i) + start) % u32::from(partitions)) as u16)
        .collect()
}

/// Every partition lease's key starts with this.
const LEASE_PREFIX: &str = "l.";

fn lease_key(p: u16) -> String {
    format!("{LEASE_PREFIX}{p}")
}

/// A partition's attempt that lasted this long before it failed does not count toward a streak
/// of failures: the next attempt starts from the shortest delay.
const FAILURE_STREAK_GAP: Duration = Duration::from_secs(5);

/// How often a worker asks the others whether their connections are still open.
pub const PROBE_EVERY: Duration = Duration::from_millis(400);

/// A renewal or probe this close to due is done on the pass at hand rather than on one woken
/// for it a moment later.
const RENEWAL_SLACK: Duration = Duration::from_millis(20);

/// How often the lease loop reads the lease bucket's age (see [`LeaseLoop::heed_bucket_age`]).
const BUCKET_READ_EVERY: Duration = super::storage::SAMPLE_EVERY;

/// The shortest lease TTL a bucket whose age was cut brings the workers to (the least
/// `workers.lease_ttl` allows): below it, renewals would come faster than a pass can go.
const LEASE_TTL_FLOOR: Duration = Duration::from_secs(1);

/// How long after its owner's last renewal a gone worker's lease may be taken, for leases of
/// `ttl`: once the owner, were it still running, would have stopped working the partition (a
/// third of the TTL), and its last pull request would have expired, with both clocks' skew
/// allowed for.
fn quiet_ms(settings: &crate::config::Settings, ttl: Duration) -> i64 {
    let validity_ms = i64::try_from((ttl / 3).as_millis()).unwrap_or(i64::MAX);
    let skew_ms = i64::try_from(settings.turns.clock_skew.as_millis()).unwrap_or(0);
    let pull_ms = i64::try_from(super::pull::PULL_EXPIRES.as_millis()).unwrap_or(i64::MAX);
    validity_ms
        .saturating_add(pull_ms)
        .saturating_add(2 * skew_ms)
        .saturating_add(100)
}

/// The least time between two passes of the lease loop, however late it runs.
const MIN_PASS_GAP: Duration = Duration::from_millis(20);

/// Consecutive "no responders" answers after which a worker counts as gone.
const GONE_AFTER: u32 = 2;

/// Consecutive unanswered probes (no reply in time: a partitioned network, a paused process)
/// after which a worker counts as gone too.
const SILENT_AFTER: u32 = 3;

/// The subject a worker answers on while its lease connection is open.
pub fn presence_subject(prefix: &str, worker_id: &str) -> String {
    format!(
        "{prefix}.workers.{}.alive",
        crate::model::encode_id(worker_id)
    )
}

fn spawn_partition(
    shared: Arc<WorkerContext>,
    worker_id: &str,
    p: u16,
    cancel: CancellationToken,
    valid_until: Arc<LeaseValidity>,
) -> JoinHandle<()> {
    use tracing::Instrument;
    let rt = shared.partitions_rt.clone();
    // Every line the partition logs names the worker and the partition.
    let span = tracing::info_span!("partition", worker = %worker_id, partition = p);
    let owner = worker_id.to_string();
    rt.spawn(
        async move {
            // The owner of partition 0 also folds the projections into the work sessions.
            // Both end with the partition's task, even one aborted at a drain's timeout.
            let fold = (p == 0 && !shared.settings.workers.without_session_fold).then(|| {
                AbortOnDropHandle::new(shared.sessions_side.rt.handle.spawn(
                    super::sessions::run_fold(
                        shared.sessions.clone(),
                        shared.sessions_side.js.clone(),
                        shared.names.proj_stream.clone(),
                        cancel.clone(),
                        valid_until.clone(),
                        shared.state.clone(),
                    ),
                ))
            });
            // ... and exports spans, when an OpenTelemetry endpoint is configured.
            let export = (p == 0)
                .then(|| shared.otel.clone())
                .flatten()
                .map(|export| {
                    let job = super::otel::ExportJob {
                        export,
                        prices: shared.prices.clone(),
                        js: shared.sessions_side.js.clone(),
                        kv: shared.sessions.store().clone(),
                        proj_stream: shared.names.proj_stream.clone(),
                    };
                    AbortOnDropHandle::new(shared.sessions_side.rt.handle.spawn(
                        super::otel::run_export(job, cancel.clone(), valid_until.clone()),
                    ))
                });
            let mut retry = super::Retry::new(Duration::from_millis(200), Duration::from_secs(5));
            // Interruptions in quick succession (a read of the in-flight range that keeps coming
            // up short while the stream leader holds it) back off, so a partition that cannot
            // make progress yet waits for the cluster instead of hammering it.
            let mut again = super::Retry::new(Duration::from_millis(50), Duration::from_secs(2));
            let mut last_interrupt: Option<std::time::Instant> = None;
            while !cancel.is_cancelled() {
                let attempt = std::time::Instant::now();
                match worker::run_partition(
                    shared.clone(),
                    p,
                    &owner,
                    cancel.clone(),
                    valid_until.clone(),
                )
                .await
                {
                    Ok(()) if cancel.is_cancelled() => break,
                    Ok(()) => {
                        // Still owned, not asked to stop: nothing may leave the partition
                        // unread while this worker holds its lease.
                        warn!("the partition stopped without being asked to; restarting it");
                        if !retry.wait(&cancel).await {
                            break;
                        }
                    }
                    Err(e @ WorkerError::Interrupted { .. }) => {
                        info!(error = %e, "restarting the partition");
                        if last_interrupt.is_some_and(|at| at.elapsed() < Duration::from_secs(5)) {
                            if !again.wait(&cancel).await {
                                break;
                            }
                        } else {
                            again.reset();
                        }
                        last_interrupt = Some(std::time::Instant::now());
                        continue;
                    }
                    Err(e) => {
                        error!(error = %e, "partition failed; restarting");
                        // The delay grows over failures in quick succession only: a partition
                        // that ran (or waited on the server) for a while before this failure
                        // starts again from the shortest delay, so failures an incident apart do
                        // not add up to a long pause.
                        if attempt.elapsed() >= FAILURE_STREAK_GAP {
                            retry.reset();
                        }
                        if !retry.wait(&cancel).await {
                            break;
                        }
                    }
                }
            }
            if let Some(fold) = fold {
                let _ = fold.await;
            }
            if let Some(export) = export {
                let _ = export.await;
            }
        }
        .instrument(span),
    )
}

/// The ids of the workers whose heartbeats are in the bucket; `None` if it cannot be listed.
async fn live_workers(store: &kv::Store) -> Option<Vec<String>> {
    let mut keys = store.keys().await.ok()?;
    let mut ids = Vec::new();
    while let Some(k) = keys.next().await {
        if let Some(id) = k
            .ok()
            .and_then(|k| k.strip_prefix(HEARTBEAT_PREFIX).map(String::from))
        {
            ids.push(id);
        }
    }
    Some(ids)
}

/// Whether any worker holds a partition lease in the bucket; `None` if it cannot be listed.
pub async fn any_held(store: &kv::Store) -> Option<bool> {
    let mut keys = store.keys().await.ok()?;
    while let Some(k) = keys.next().await {
        if k.ok()?.starts_with(LEASE_PREFIX) {
            return Some(true);
        }
    }
    Some(false)
}

/// Answer presence probes until `stop`. Subscribed (and flushed) before it returns, so nobody
/// can find this worker's leases without its presence.
async fn answer_presence(
    client: &async_nats::Client,
    subject: String,
    stop: CancellationToken,
) -> Option<JoinHandle<()>> {
    let mut sub = match client.subscribe(subject).await {
        Ok(sub) => sub,
        Err(e) => {
            warn!(error = %e, "cannot answer presence probes; a crash of this worker will be noticed only when its leases expire");
            return None;
        }
    };
    let _ = client.flush().await;
    let client = client.clone();
    Some(tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                m = sub.next() => {
                    let Some(m) = m else { break };
                    if let Some(reply) = m.reply {
                        let _ = client.publish(reply, bytes::Bytes::new()).await;
                    }
                }
            }
        }
        let _ = sub.unsubscribe().await;
    }))
}

/// Ask every other worker whether its connection is open; count strikes of "no responders" and
/// return the workers that reached [`GONE_AFTER`] "no responders" answers or [`SILENT_AFTER`]
/// unanswered probes in a row. A reply clears the strikes.
async fn gone_workers(
    client: &async_nats::Client,
    prefix: &str,
    me: &str,
    others: &[String],
    strikes: &mut BTreeMap<String, u32>,
) -> Vec<String> {
    use async_nats::RequestErrorKind;
    let probes = others.iter().filter(|id| id.as_str() != me).map(|id| {
        let subject = presence_subject(prefix, id);
        async move {
            // Short, so one slow worker never holds up the verdict on a gone one.
            let request = async_nats::Request::new().timeout(Some(PROBE_EVERY / 2));
            let answer = client.send_request(subject, request).await;
            let strike = match &answer {
                Err(e) if e.kind() == RequestErrorKind::NoResponders => Some(GONE_AFTER),
                Err(e) if e.kind() == RequestErrorKind::TimedOut => Some(SILENT_AFTER),
                _ => None,
            };
            (id.clone(), strike)
        }
    });
    let mut gone = Vec::new();
    strikes.retain(|id, _| others.contains(id));
    for (id, strike) in futures::future::join_all(probes).await {
        let Some(after) = strike else {
            strikes.remove(&id);
            continue;
        };
        let n = strikes.entry(id.clone()).or_insert(0);
        *n = n.saturating_add(1);
        if *n >= after {
            gone.push(id);
        }
    }
    gone
}

/// Free the leases of a gone worker that were last renewed at least `quiet_ms` ago (server
/// time against this worker's clock), each deleted at the revision read (a lease renewed or
/// taken meanwhile is left alone). The partitions freed, and how many of its leases are left
/// for a later round.
async fn evict(
    store: &kv::Store,
    worker_id: &str,
    partitions: u16,
    quiet_ms: i64,
) -> (Vec<u16>, usize) {
    let mut freed = Vec::new();
    let mut left = 0;
    for p in 0..partitions {
        let Ok(Some(entry)) = store.entry(lease_key(p)).await else {
            continue;
        };
        if entry.operation != kv::Operation::Put || entry.value.as_ref() != worker_id.as_bytes() {
            continue;
        }
        let renewed_ms = entry.created.timestamp_millis();
        if super::now_ms().saturating_sub(renewed_ms) < quiet_ms {
            left += 1;
            continue;
        }
        if store
            .delete_expect_revision(lease_key(p), Some(entry.revision))
            .await
            .is_ok()
        {
            freed.push(p);
        }
    }
    (freed, left)
}

/// Own a fair share of the partitions until `cancel`; then drain them and give them back.
pub async fn run(
    shared: Arc<WorkerContext>,
    store: kv::Store,
    worker_id: String,
    cancel: CancellationToken,
) {
    let mut leases = LeaseLoop::new(shared, store, worker_id);
    let presence_stop = CancellationToken::new();
    let presence = answer_presence(
        &leases.client,
        presence_subject(&leases.prefix, &leases.worker_id),
        presence_stop.clone(),
    )
    .await;
    while !cancel.is_cancelled() {
        let renewal_due = leases.check_connection();
        // Owners whose connections closed: free their partitions now rather than at their
        // lease expiry (asked every `PROBE_EVERY`, however often the renewals wake the loop:
        // the strikes that make a worker gone count probes at that pace).
        let before = leases.workers;
        let evicted = if leases.probe_due() {
            leases.evict_gone().await
        } else {
            Vec::new()
        };
        // A worker left (evicted by this worker or another, or gone for good): its partitions
        // are free now, so look for them at once rather than at the next renewal.
        let someone_left = leases.workers < before;
        leases.finish_leaving().await;
        if renewal_due || !evicted.is_empty() || someone_left {
            if renewal_due {
                leases.renew(&cancel).await;
            }
            let target = share(leases.partitions, leases.workers);
            leases.release_excess(target);
            leases.take(&evicted, target, &cancel).await;
            leases.report_owned();
        }
        // After the pass's renewal, which it never holds up.
        leases.heed_bucket_age().await;
        tokio::select! {
            _ = tokio::time::sleep_until(leases.next_wake()) => {}
            _ = cancel.cancelled() => {}
        }
    }
    let released = leases.hand_back().await;
    // Only now, with nothing left to take over, stop answering presence probes.
    presence_stop.cancel();
    if let Some(task) = presence {
        let _ = task.await;
    }
    match released {
        Released {
            leases: true,
            kept: 0,
        } => info!("leases released"),
        Released { leases: true, kept } => info!(
            left_to_lapse = kept,
            "leases of the drained partitions released; those still draining are left to lapse"
        ),
        Released { leases: false, .. } => {
            warn!("could not hand the leases back in time; they lapse after the lease TTL")
        }
    }
}

/// How long handing the leases back may take at least, even after a drain used all its time.
const RELEASE_AT_LEAST: Duration = Duration::from_secs(2);

/// What a shutdown handed back: whether the drained partitions' leases (and the heartbeat) were
/// deleted in time, and how many leases were kept because their partitions had not drained.
struct Released {
    leases: bool,
    kept: usize,
}

/// One worker's lease loop: the leases it holds and what it knows of the other workers.
struct LeaseLoop {
    shared: Arc<WorkerContext>,
    store: kv::Store,
    worker_id: String,
    client: async_nats::Client,
    prefix: String,
    partitions: u16,
    /// The lease TTL in force: `workers.lease_ttl`, or the lease bucket's `max_age` when that is
    /// shorter (see [`LeaseLoop::heed_bucket_age`]).
    ttl: Duration,
    /// When the lease bucket's `max_age` was last read; `None`: read it on the next pass.
    bucket_read: Option<tokio::time::Instant>,
    /// Renewed every sixth of the TTL; a partition works only within a third of the TTL of its
    /// last renewal's start, so a worker cut off from the server stops well before its lease
    /// can be taken.
    every: Duration,
    validity_ms: i64,
    /// A gone worker's lease is taken early only once its owner, were it still running, would
    /// have stopped working the partition (validity) and its last pull request would have
    /// expired, with both clocks' skew allowed for.
    quiet_ms: i64,
    heartbeat: String,
    order: Vec<u16>,
    held: BTreeMap<u16, Held>,
    /// Partitions stopped and not yet finished: released for balance (their lease is deleted
    /// once they have drained) or lost (nothing more to do than wait). The loop never waits for
    /// them, so a slow drain cannot hold up the renewal of the partitions it keeps.
    leaving: Vec<Leaving>,
    workers: usize,
    strikes: BTreeMap<String, u32>,
    last_renewal: Option<tokio::time::Instant>,
    /// When the last renewal round's answers were all in.
    last_renewal_end: Option<tokio::time::Instant>,
    /// When the other workers were last probed (see [`LeaseLoop::probe_due`]).
    last_probe: Option<tokio::time::Instant>,
    disconnected: bool,
    /// This process's token on its renewals (see [`H_LEASE_INSTANCE`]).
    instance: String,
    /// The leases connection's JetStream context (renewals are published with a header).
    js: async_nats::jetstream::Context,
    /// Test hook: every Nth stored renewal is taken as unanswered
    /// (`COLLAB_TEST_LOSE_LEASE_RENEWAL_ANSWER_EVERY`, 0 = never).
    lose_answer_every: u64,
    renewal_answers: std::sync::atomic::AtomicU64,
    /// Test hook: a failed renewal's read-back fails too (`COLLAB_TEST_LEASE_READ_BACK_FAILS`).
    fail_read_back: bool,
    /// Test hook: every renewal's answer is taken this much later than it came
    /// (`COLLAB_TEST_LEASE_RENEWAL_ANSWER_LATE_MS`, 0 = on time), as on a slow server.
    late_answer: Duration,
}

impl LeaseLoop {
    fn new(shared: Arc<WorkerContext>, store: kv::Store, worker_id: String) -> LeaseLoop {
        let partitions = shared.settings.nats.partitions;
        let ttl = shared.settings.workers.lease_ttl;
        let validity_ms = i64::try_from((ttl / 3).as_millis()).unwrap_or(i64::MAX);
        LeaseLoop {
            client: shared.leases_side.js.client(),
            prefix: shared.names.prefix.clone(),
            partitions,
            ttl,
            bucket_read: None,
            every: ttl / 6,
            validity_ms,
            quiet_ms: quiet_ms(&shared.settings, ttl),
            heartbeat: format!("{HEARTBEAT_PREFIX}{worker_id}"),
            order: probe_order(&worker_id, partitions),
            held: BTreeMap::new(),
            leaving: Vec::new(),
            workers: 1,
            strikes: BTreeMap::new(),
            last_renewal: None,
            last_renewal_end: None,
            last_probe: None,
            disconnected: false,
            instance: format!("{:016x}", rand::random::<u64>()),
            js: shared.leases_side.js.clone(),
            lose_answer_every: super::test_hook_every(
                "COLLAB_TEST_LOSE_LEASE_RENEWAL_ANSWER_EVERY",
            ),
            renewal_answers: std::sync::atomic::AtomicU64::new(0),
            fail_read_back: super::test_hook_every("COLLAB_TEST_LEASE_READ_BACK_FAILS") > 0,
            late_answer: Duration::from_millis(super::test_hook_every(
                "COLLAB_TEST_LEASE_RENEWAL_ANSWER_LATE_MS",
            )),
            shared,
            store,
            worker_id,
        }
    }

    /// Whether a renewal is due. Without its lease connection this worker cannot renew, and the
    /// others may take its partitions as soon as the server has dropped that connection: its
    /// partitions stop working now (a renewal after the reconnection restores them, if they
    /// are still its own), and a reconnection renews at once.
    fn check_connection(&mut self) -> bool {
        let connected = self.client.connection_state() == async_nats::connection::State::Connected;
        if !connected {
            for h in self
                .held
                .values()
                .chain(self.leaving.iter().map(|l| &l.held))
            {
                h.valid_until.lose();
            }
        }
        let reconnected = connected && self.disconnected;
        self.disconnected = !connected;
        reconnected || tokio::time::Instant::now() + RENEWAL_SLACK >= self.renewal_at()
    }

    /// Read the lease bucket's `max_age` (every [`BUCKET_READ_EVERY`], again [`PROBE_EVERY`]
    /// after a read that failed, and at the next pass after a lease was lost) and renew as often
    /// as the shorter of it and `workers.lease_ttl` needs (never below [`LEASE_TTL_FLOOR`]). A
    /// bucket whose age was cut on the live server (`nats kv edit`, `nats stream edit`) would
    /// otherwise drop leases between two renewals, and partitions would change hands without a
    /// fault; `collab-projector provision` gives the bucket its age back. The wait before a gone
    /// worker's leases are taken (`quiet_ms`) follows the longer of the two instead: the
    /// longest any worker may still count on.
    async fn heed_bucket_age(&mut self) {
        let now = tokio::time::Instant::now();
        if self.bucket_read.is_some_and(|at| now < at) {
            return;
        }
        let configured = self.shared.settings.workers.lease_ttl;
        let stream = format!("KV_{}", self.shared.names.leases_bucket);
        // Bounded by the configured TTL's pace, not a shortened one's.
        let read = tokio::time::timeout(configured / 24, self.js.get_stream(&stream)).await;
        let Ok(Ok(st)) = read else {
            self.bucket_read = Some(now + PROBE_EVERY);
            return;
        };
        self.bucket_read = Some(now + BUCKET_READ_EVERY);
        let max_age = st.cached_info().config.max_age;
        let (ttl, longest) = if max_age.is_zero() {
            (configured, configured)
        } else {
            (
                configured.min(max_age).max(LEASE_TTL_FLOOR.min(configured)),
                configured.max(max_age),
            )
        };
        self.quiet_ms = quiet_ms(&self.shared.settings, longest);
        if ttl == self.ttl {
            return;
        }
        if ttl < configured {
            warn!(
                bucket_max_age = ?max_age,
                lease_ttl = ?configured,
                renewing_every = ?(ttl / 6),
                "the lease bucket keeps entries for less than workers.lease_ttl: leases are renewed within its age until it is given back; run `collab-projector provision` with this configuration to restore it"
            );
        } else {
            info!(lease_ttl = ?ttl, "the lease bucket keeps entries for workers.lease_ttl again");
        }
        self.ttl = ttl;
        self.every = ttl / 6;
        self.validity_ms = i64::try_from((ttl / 3).as_millis()).unwrap_or(i64::MAX);
    }

    /// When the next renewal is due: `every` after the start of the last one, and no sooner
    /// than half of `every` after it ended, which holds the next one back only once a round
    /// takes more than half of `every` (a slow server): the loop never keeps a slow server busy
    /// with renewals back to back.
    fn renewal_at(&self) -> tokio::time::Instant {
        match (self.last_renewal, self.last_renewal_end) {
            (Some(start), Some(end)) => (start + self.every).max(end + self.every / 2),
            (Some(start), None) => start + self.every,
            (None, _) => tokio::time::Instant::now(),
        }
    }

    /// Whether the other workers are to be probed on this pass (every `PROBE_EVERY`).
    fn probe_due(&mut self) -> bool {
        let now = tokio::time::Instant::now();
        let due = self
            .last_probe
            .is_none_or(|at| now + RENEWAL_SLACK >= at + PROBE_EVERY);
        if due {
            self.last_probe = Some(now);
        }
        due
    }

    /// When the loop next has work: the next probe of the other workers, or the next renewal
    /// if that comes first. The loop wakes for a renewal when it is due (see
    /// [`LeaseLoop::renewal_at`]), not at the next probe, which could come later than a lease's
    /// validity allows (with a short TTL, `every` is shorter than `PROBE_EVERY`); the pass's
    /// probe and clean-up come before the renewal's request.
    fn next_wake(&self) -> tokio::time::Instant {
        let now = tokio::time::Instant::now();
        let probe = self.last_probe.map_or(now, |at| at + PROBE_EVERY);
        probe.min(self.renewal_at()).max(now + MIN_PASS_GAP)
    }

    /// Count the live workers and evict the leases of the gone ones (bounded, so a slow server
    /// never pushes a renewal past the TTL); the partitions freed here.
    async fn evict_gone(&mut self) -> Vec<u16> {
        let mut evicted = Vec::new();
        let Ok(Some(ids)) = tokio::time::timeout(self.every / 4, live_workers(&self.store)).await
        else {
            return evicted;
        };
        self.workers = ids.len().max(1);
        let gone = tokio::time::timeout(
            self.every / 4,
            gone_workers(
                &self.client,
                &self.prefix,
                &self.worker_id,
                &ids,
                &mut self.strikes,
            ),
        )
        .await
        .unwrap_or_default();
        for id in gone {
            let (freed, left) = evict(&self.store, &id, self.partitions, self.quiet_ms).await;
            if !freed.is_empty() {
                info!(worker = %id, partitions = ?freed, "a worker is gone (connection closed, or silent); taking over its partitions without waiting for its leases to expire");
            }
            if left == 0 {
                let _ = self.store.delete(format!("{HEARTBEAT_PREFIX}{id}")).await;
                self.strikes.remove(&id);
                self.workers = self.workers.saturating_sub(1).max(1);
            }
            evicted.extend(freed);
        }
        evicted
    }

    /// Write the heartbeat: this worker's id, with the lease TTL it runs with.
    async fn beat(&self) -> Result<(), async_nats::jetstream::context::PublishError> {
        let mut headers = async_nats::HeaderMap::new();
        let ttl_ms = self.shared.settings.workers.lease_ttl.as_millis();
        headers.insert(H_LEASE_TTL_MS, ttl_ms.to_string());
        let subject = format!("{}{}", self.store.prefix, self.heartbeat);
        self.js
            .publish_with_headers(subject, headers, self.worker_id.clone().into())
            .await?
            .await?;
        Ok(())
    }

    /// Write the heartbeat and renew every lease at once (one round trip, however many are
    /// held). A failed renewal is read back: another owner's value (or none) stops the
    /// partition at once; a renewal of this worker's found stored keeps it (see [`read_back`]).
    async fn renew(&mut self, cancel: &CancellationToken) {
        self.last_renewal = Some(tokio::time::Instant::now());
        if let Err(e) = self.beat().await {
            warn!(error = %e, "worker heartbeat failed");
        }
        if cancel.is_cancelled() {
            return;
        }
        let (lose_answer_every, fail_read_back, late_answer) = (
            self.lose_answer_every,
            self.fail_read_back,
            self.late_answer,
        );
        let renewals = self.held.iter().map(|(p, h)| {
            let (p, revision) = (*p, h.revision);
            let (js, store, id, instance) =
                (&self.js, &self.store, &self.worker_id, &self.instance);
            let answers = &self.renewal_answers;
            async move {
                let subject = format!("{}{}", store.prefix, lease_key(p));
                let asked_at = LeaseAsk::now();
                let mut result = publish_renewal(js, &subject, id, instance, revision)
                    .await
                    .map_err(|e| e.to_string());
                if !late_answer.is_zero() {
                    tokio::time::sleep(late_answer).await;
                }
                if result.is_ok() && super::nth(answers, lose_answer_every) {
                    // Test hook: stored, and the answer taken as lost.
                    result = Err("test hook: the renewal's answer taken as lost".into());
                }
                let (back, error) = match result {
                    Ok(rev) => (ReadBack::Renewed(rev), None),
                    // Someone else wrote it, or a renewal of ours whose answer was lost did.
                    Err(e) if fail_read_back => (ReadBack::Unknown, Some(e)),
                    Err(e) => {
                        let back = match read_lease(store, p, id, instance).await {
                            Some(last) => read_back(last, revision),
                            None => ReadBack::Unknown,
                        };
                        (back, Some(e))
                    }
                };
                (p, asked_at, back, error)
            }
        });
        let answers = futures::future::join_all(renewals).await;
        self.last_renewal_end = Some(tokio::time::Instant::now());
        let mut lost = Vec::new();
        for (p, asked_at, back, error) in answers {
            let Some(h) = self.held.get_mut(&p) else {
                continue;
            };
            let since = h
                .unconfirmed_since
                .map_or(asked_at, |s| s.earlier(asked_at));
            match back {
                ReadBack::Renewed(rev) => {
                    // This round's renewal, answered: none of the earlier ones was stored (they
                    // expected the same revision). Found stored by a read-back: it may be an
                    // earlier round's, asked no earlier than `since`.
                    let from = match error {
                        None => asked_at,
                        Some(e) => {
                            info!(partition = p, error = %e, "a lease renewal whose answer was lost was stored; the lease holds");
                            since
                        }
                    };
                    h.revision = rev;
                    h.unconfirmed_since = None;
                    h.valid_until.renew(from, self.validity_ms);
                    self.shared.state.count_lease_renewal();
                }
                ReadBack::Unknown => {
                    // Its validity runs on from the last known renewal (the partition idles once
                    // it ends); the next round asks again.
                    h.unconfirmed_since = Some(since);
                    warn!(partition = p, error = ?error, "lease renewal not confirmed; asking again at the next renewal");
                }
                ReadBack::Lost => {
                    // Lapsed at once: the partition stops without writing anything more.
                    h.valid_until.lose();
                    warn!(partition = p, error = ?error, "lease lost; stopping the partition");
                    self.shared.state.count_lease_loss();
                    lost.push(p);
                    // Lost to an age cut short on the live bucket? Read it on the next pass.
                    self.bucket_read = None;
                }
            }
        }
        for p in lost {
            if let Some(h) = self.held.remove(&p) {
                self.set_aside(p, h, false);
            }
        }
    }

    /// Stop partition `p` and keep it on the leaving list until its task has ended; `release`:
    /// its lease is then deleted (released for balance, or handed back on shutdown).
    fn set_aside(&mut self, p: u16, held: Held, release: bool) {
        held.cancel.cancel();
        self.leaving.push(Leaving { p, held, release });
    }

    /// Release what is held past `target` gracefully, highest partitions first, leaving those
    /// taken over from a gone worker for a lease TTL (see [`Held::keep_until`]; they go at a
    /// later renewal): each excess partition drains, and its lease is deleted once it has (see
    /// [`LeaseLoop::finish_leaving`]). The loop goes on
    /// meanwhile: the kept leases are renewed on time however long a drain takes. A releasing
    /// lease is not renewed, so its partition works at most until its validity ends, as any
    /// partition whose renewals stop.
    fn release_excess(&mut self, target: usize) {
        let held = self.held.iter().map(|(p, h)| (*p, h.keep_until));
        for p in releasable(held, target, tokio::time::Instant::now()) {
            if let Some(h) = self.held.remove(&p) {
                self.set_aside(p, h, true);
            }
        }
    }

    /// Collect the stopped partitions whose tasks have ended, and delete the leases of those
    /// released for balance (at the revision held, or one of this process's renewals found
    /// stored: a lease that lapsed and was taken meanwhile is left alone).
    async fn finish_leaving(&mut self) {
        let (done, still): (Vec<Leaving>, Vec<Leaving>) = std::mem::take(&mut self.leaving)
            .into_iter()
            .partition(|l| l.held.task.is_finished());
        self.leaving = still;
        for l in done {
            let _ = l.held.task.await;
            if l.release {
                delete_held(
                    &self.store,
                    l.p,
                    l.held.revision,
                    &self.worker_id,
                    &self.instance,
                )
                .await;
                info!(partition = l.p, "partition released for balance");
            }
        }
    }

    /// Take what this worker freed from a gone one, even past its share (a replacement may
    /// already count as live; the next renewal hands the excess over gracefully), then free
    /// partitions up to the share; each lease taken starts its partition.
    async fn take(&mut self, evicted: &[u16], target: usize, cancel: &CancellationToken) {
        if self.held.len() >= target && evicted.is_empty() {
            return;
        }
        let candidates: Vec<(u16, bool)> = evicted
            .iter()
            .map(|p| (*p, true))
            .chain(self.order.iter().map(|p| (*p, false)))
            .collect();
        for (p, freed_here) in candidates {
            if cancel.is_cancelled() {
                break;
            }
            if self.held.contains_key(&p)
                || self.leaving.iter().any(|l| l.p == p)
                || (!freed_here && self.held.len() >= target)
            {
                continue;
            }
            let asked_at = LeaseAsk::now();
            let Ok(revision) = self
                .store
                .create(lease_key(p), self.worker_id.clone().into())
                .await
            else {
                continue;
            };
            self.shared.state.count_takeover(evicted.contains(&p));
            let c = cancel.child_token();
            let valid_until = Arc::new(LeaseValidity::from_ask(asked_at, self.validity_ms));
            let task = spawn_partition(
                self.shared.clone(),
                &self.worker_id,
                p,
                c.clone(),
                valid_until.clone(),
            );
            self.held.insert(
                p,
                Held {
                    revision,
                    keep_until: freed_here.then(|| tokio::time::Instant::now() + self.ttl),
                    valid_until,
                    unconfirmed_since: None,
                    cancel: c,
                    task,
                },
            );
        }
    }

    fn report_owned(&self) {
        self.shared
            .state
            .partitions_owned
            .store(self.held.len(), Ordering::Relaxed);
        metrics::gauge!(crate::telemetry::PARTITIONS_OWNED).set(self.held.len() as f64);
    }

    /// Shutdown: drain every partition, then hand the leases back at once (bounded: with the
    /// server unreachable they lapse by themselves after the TTL). Whether they were handed back.
    async fn hand_back(mut self) -> Released {
        // Every partition stops at once; each held lease is deleted once its partition drained.
        for (p, h) in std::mem::take(&mut self.held) {
            self.set_aside(p, h, true);
        }
        let mut revisions = Vec::new();
        // Bounded: a partition stuck on the server (or on a bug) must not keep the process from
        // exiting. What it did not acknowledge is its next owner's, as after a crash.
        let drain = self.shared.settings.workers.drain_timeout;
        let deadline = tokio::time::Instant::now() + drain;
        let mut undrained = Vec::new();
        for mut l in std::mem::take(&mut self.leaving) {
            let drained = tokio::time::timeout_at(deadline, &mut l.held.task)
                .await
                .is_ok()
                || l.held.task.is_finished();
            if !drained {
                // With everything it started (see `worker::run_partition`).
                l.held.task.abort();
                undrained.push(l.p);
            } else if l.release {
                revisions.push((l.p, l.held.revision));
            }
        }
        if !undrained.is_empty() {
            error!(
                partitions = ?undrained,
                drain_timeout = ?drain,
                "partitions still draining at workers.drain_timeout: stopped where they were; \
                 their leases are left to lapse (the other workers take them within \
                 workers.lease_ttl) and the next owner processes their unacknowledged inputs again"
            );
            if let Ok(mut u) = self.shared.state.undrained.lock() {
                u.extend(&undrained);
            }
        }
        self.shared
            .state
            .partitions_owned
            .store(0, Ordering::Relaxed);
        let release = async {
            for (p, rev) in revisions {
                delete_held(&self.store, p, rev, &self.worker_id, &self.instance).await;
            }
            let _ = self.store.delete(&self.heartbeat).await;
        };
        // Within what is left of the drain's time, and a little more for a drain that used it
        // all (the server is likely unreachable then): the process exits within
        // `workers.drain_timeout` and a few seconds whatever happens.
        let until = deadline.max(tokio::time::Instant::now() + RELEASE_AT_LEAST);
        let released = tokio::time::timeout_at(until, release).await.is_ok();
        Released {
            leases: released,
            kept: undrained.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_read_back_is_renewed_only_past_the_held_revision_and_by_this_process() {
        // Stored by this process's renewal, its answer lost.
        assert_eq!(read_back(Some((12, true)), 10), ReadBack::Renewed(12));
        // Not stored (yet), or older than what is held: ask again later.
        assert_eq!(read_back(Some((10, true)), 10), ReadBack::Unknown);
        assert_eq!(read_back(Some((7, false)), 10), ReadBack::Unknown);
        // Someone else's write (or a delete), or no lease at all.
        assert_eq!(read_back(Some((12, false)), 10), ReadBack::Lost);
        assert_eq!(read_back(None, 10), ReadBack::Lost);
    }

    #[test]
    fn only_a_put_of_this_worker_id_with_this_process_token_is_its_own_renewal() {
        let message = |value: &str, headers: &[(&str, &str)]| {
            let mut h = async_nats::HeaderMap::new();
            for (k, v) in headers {
                h.insert(*k, *v);
            }
            super::super::LeaderEntry {
                put: h.get("KV-Operation").is_none(),
                value: value.to_string().into(),
                revision: 12,
                written_at: Default::default(),
                headers: h,
            }
        };
        let ours = message("w1", &[(H_LEASE_INSTANCE, "a1")]);
        assert!(written_by(&ours, "w1", "a1"));
        // Another process given the same worker id (a replacement beside a paused original).
        assert!(!written_by(
            &message("w1", &[(H_LEASE_INSTANCE, "b2")]),
            "w1",
            "a1"
        ));
        // Taken by `create`, which carries no token; another worker; a delete marker.
        assert!(!written_by(&message("w1", &[]), "w1", "a1"));
        assert!(!written_by(
            &message("w2", &[(H_LEASE_INSTANCE, "a1")]),
            "w1",
            "a1"
        ));
        let deleted = message("", &[(H_LEASE_INSTANCE, "a1"), ("KV-Operation", "DEL")]);
        assert!(!written_by(&deleted, "w1", "a1"));
    }

    #[test]
    fn a_partition_taken_over_is_not_released_for_balance_until_its_hold_ends() {
        let now = tokio::time::Instant::now();
        let later = now + Duration::from_secs(6);
        // Free to go: the highest partitions go first, down to the share.
        assert_eq!(
            releasable(vec![(1, None), (4, None), (9, None)].into_iter(), 1, now),
            vec![9, 4]
        );
        // 9 was just taken over from a gone worker: 4 goes instead, and only one of the two.
        assert_eq!(
            releasable(
                vec![(1, Some(later)), (4, None), (9, Some(later))].into_iter(),
                1,
                now
            ),
            vec![4]
        );
        // Once the hold has passed, it goes like any other.
        assert_eq!(
            releasable(
                vec![(1, None), (4, None), (9, Some(later))].into_iter(),
                1,
                later
            ),
            vec![9, 4]
        );
        // Within the share nothing goes.
        assert!(releasable(vec![(1, None), (4, None)].into_iter(), 2, now).is_empty());
    }

    #[test]
    fn shares_cover_every_partition() {
        assert_eq!(share(64, 1), 64);
        assert_eq!(share(64, 2), 32);
        assert_eq!(share(64, 3), 22);
        assert_eq!(share(64, 4), 16);
        assert_eq!(share(64, 0), 64);
        for n in 1..10 {
            assert!(share(64, n) * n >= 64);
        }
    }

    #[test]
    fn probe_order_is_a_permutation() {
        let mut o = probe_order("worker-a", 64);
        assert_eq!(o.len(), 64);
        o.sort_unstable();
        assert_eq!(o, (0..64).collect::<Vec<u16>>());
    }
}
