//! What a worker tells health checks, `/metrics` and the demo: its counters (each counted in one
//! place, the status figure and its metric together) and each running partition's lag, sampled
//! from its consumer.

use crate::pipeline::{self, OutKind, Outgoing};
use crate::telemetry;
use async_nats::jetstream::{self, consumer::PullConsumer};
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

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
    /// When this worker last processed a raw message (ms since the epoch; 0: never).
    pub last_processed_ms: AtomicI64,
    /// The running partitions' lag, as last sampled.
    pub partitions: std::sync::Mutex<std::collections::BTreeMap<u16, PartitionLag>>,
    /// Each bounded stream's size, as last sampled (`bus::storage`).
    pub storage: std::sync::Mutex<std::collections::BTreeMap<String, telemetry::StreamFill>>,
    /// The partitions a shutdown abandoned still draining (`workers.drain_timeout`).
    pub undrained: std::sync::Mutex<Vec<u16>>,
    /// Where the work-session fold stands while this worker runs it (as the owner of partition
    /// 0), with the run that reports it; `None` otherwise.
    fold: std::sync::Mutex<Option<(u64, telemetry::FoldStatus)>>,
    /// Runs of the work-session fold started on this worker.
    fold_runs: AtomicU64,
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
            last_processed_ms: AtomicI64::new(0),
            partitions: std::sync::Mutex::new(std::collections::BTreeMap::new()),
            storage: std::sync::Mutex::new(std::collections::BTreeMap::new()),
            undrained: std::sync::Mutex::new(Vec::new()),
            fold: std::sync::Mutex::new(None),
            fold_runs: AtomicU64::new(0),
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

/// The one place each counter is counted: the status counter here and its metric together, so
/// the status endpoint and `/metrics` never disagree.
impl WorkerState {
    pub(crate) fn count_input(&self, outcome: Outcome) {
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

    pub(crate) fn count_publish_retry(&self) {
        self.publish_retries.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(telemetry::PUBLISH_RETRIES).increment(1);
    }

    pub(crate) fn count_redelivery(&self) {
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

    /// A partition consumer found missing (deleted, or cleared by a server restart) and made
    /// again from the partition's checkpoint.
    pub(crate) fn count_consumer_recreated(&self) {
        metrics::counter!(telemetry::CONSUMERS_RECREATED).increment(1);
    }

    /// A partition taken: freed because its owner's connection closed, or free.
    pub(crate) fn count_takeover(&self, owner_gone: bool) {
        self.takeovers.fetch_add(1, Ordering::Relaxed);
        let cause = if owner_gone { "owner_gone" } else { "free" };
        metrics::counter!(telemetry::TAKEOVERS, "cause" => cause).increment(1);
    }

    /// A run of the work-session fold starting on this worker: what it reports, until dropped.
    pub(crate) fn fold_report(self: &Arc<Self>) -> FoldReport {
        FoldReport {
            run: self.fold_runs.fetch_add(1, Ordering::Relaxed) + 1,
            state: self.clone(),
        }
    }

    /// Where the work-session fold stands, as the run that reports it last saw it.
    pub fn fold_status(&self) -> Option<telemetry::FoldStatus> {
        self.fold
            .lock()
            .ok()
            .and_then(|f| f.map(|(_, status)| status))
    }
}

/// One run of the work-session fold, reporting where it stands (the metric gauges and the
/// worker's status together). Dropped when the run ends, however it ends (cancelled, or its task
/// aborted with partition 0's): the worker stops reporting it, unless a later run already
/// reports (a partition 0 lost and taken again, the old run ending after the new one started).
pub(crate) struct FoldReport {
    run: u64,
    state: Arc<WorkerState>,
}

impl FoldReport {
    /// Sessions are written up to projection `position`, and `behind` projections are stored
    /// after it. A run never takes the report from a newer one.
    /// The gauges follow the same rule as the status: an older run still ending beside a newer
    /// one changes neither.
    pub(crate) fn at(&self, position: u64, behind: u64) {
        if let Ok(mut f) = self.state.fold.lock() {
            if f.is_none_or(|(run, _)| run <= self.run) {
                *f = Some((self.run, telemetry::FoldStatus { position, behind }));
                metrics::gauge!(telemetry::SESSION_FOLD_POSITION).set(position as f64);
                metrics::gauge!(telemetry::SESSION_FOLD_BEHIND).set(behind as f64);
            }
        }
    }

    /// `behind` projections are left to fold (a round read but not yet written counts), the
    /// position unchanged.
    pub(crate) fn behind(&self, behind: u64) {
        if let Ok(mut f) = self.state.fold.lock() {
            if let Some((run, status)) = f.as_mut() {
                if *run == self.run {
                    status.behind = behind;
                    metrics::gauge!(telemetry::SESSION_FOLD_BEHIND).set(behind as f64);
                }
            }
        }
    }
}

impl Drop for FoldReport {
    fn drop(&mut self) {
        if let Ok(mut f) = self.state.fold.lock() {
            if f.is_some_and(|(run, _)| run == self.run) {
                *f = None;
                metrics::gauge!(telemetry::SESSION_FOLD_BEHIND).set(0.0);
            }
        }
    }
}

/// Sample partition `p`'s lag every [`LAG_SAMPLE_EVERY`] until `stop`, into the worker's table
/// and the per-partition gauges; take the partition out of both when stopped.
pub(crate) async fn sample_lag(
    state: Arc<WorkerState>,
    p: u16,
    filter: String,
    mut consumer: PullConsumer,
    stream: jetstream::stream::Stream,
    watermark_ms: Arc<AtomicI64>,
    stop: CancellationToken,
) {
    let label = p.to_string();
    let started = super::now_ms();
    if let Ok(mut map) = state.partitions.lock() {
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
            if let Ok(mut map) = state.partitions.lock() {
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
    if let Ok(mut map) = state.partitions.lock() {
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

/// What an input became.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Outcome {
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

#[cfg(test)]
mod lag_tests {
    use super::*;

    /// The fold gauges' values as the Prometheus text shows them ("absent" before any is set).
    fn fold_gauges(handle: &metrics_exporter_prometheus::PrometheusHandle) -> (String, String) {
        let text = handle.render();
        let value =
            |name: &str| telemetry::rendered_value(&text, name).unwrap_or_else(|| "absent".into());
        (
            value(telemetry::SESSION_FOLD_POSITION),
            value(telemetry::SESSION_FOLD_BEHIND),
        )
    }

    #[test]
    fn a_fold_run_reports_until_it_ends_and_an_older_run_ending_late_leaves_a_newer_one() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let gauges = |position: &str, behind: &str| (position.to_string(), behind.to_string());
        let state = Arc::new(WorkerState::default());
        let status = |position, behind| Some(telemetry::FoldStatus { position, behind });
        metrics::with_local_recorder(&recorder, || {
            assert_eq!(state.fold_status(), None);
            let first = state.fold_report();
            first.at(10, 5);
            first.behind(7);
            assert_eq!(state.fold_status(), status(10, 7));
            assert_eq!(fold_gauges(&handle), gauges("10", "7"));
            // Partition 0 lost and taken again: the new run reports before the old one has
            // ended, and the old one's last reports change neither the status nor the gauges.
            let second = state.fold_report();
            second.at(12, 3);
            first.behind(99);
            first.at(11, 1);
            assert_eq!(state.fold_status(), status(12, 3));
            assert_eq!(fold_gauges(&handle), gauges("12", "3"));
            drop(first);
            assert_eq!(state.fold_status(), status(12, 3));
            assert_eq!(fold_gauges(&handle), gauges("12", "3"));
            drop(second);
            assert_eq!(state.fold_status(), None);
            assert_eq!(fold_gauges(&handle).1, "0");
        });
    }

    #[test]
    pub(crate) fn a_partition_is_stalled_only_with_messages_waiting_and_no_progress() {
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
    pub(crate) fn lag_is_reported_as_ages() {
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
