//! What the partitions of one worker share: the partitions' JetStream context, the publisher
//! (which owns the contexts outputs go through), the settings, the counters, and the two threads
//! of their own (lease loop, work-session fold), each with its own connection. The turn state's
//! contexts belong to each partition's turns.

use super::error::WorkerError;
use super::publisher::Publisher;
use super::runtime::Side;
use super::sessions::SessionWriter;
use super::stats::WorkerState;
use crate::config::{Names, Settings};
use crate::ingest;
use async_nats::jetstream;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Everything the partition tasks share.
pub struct WorkerContext {
    /// The partitions' own requests: the raw stream, their consumers and pulls, fence claims,
    /// look-ups of stored outputs.
    pub js: jetstream::Context,
    /// Every output of the partitions goes through it.
    pub publisher: Arc<Publisher>,
    pub settings: Settings,
    pub names: Names,
    pub ingest: ingest::Settings,
    pub state: Arc<WorkerState>,
    pub sessions: Arc<SessionWriter>,
    /// The thread that runs the work-session fold and its committer: the fold's bursts of
    /// parsing and serialising never hold a thread the partitions run on, and its large session
    /// writes never queue in front of their publishes.
    pub sessions_side: Side,
    /// The thread that renews the leases: neither busy partitions (a large reload, a burst of
    /// publishes) nor their queued writes delay a renewal.
    pub leases_side: Side,
    /// The OpenTelemetry export, when an endpoint is configured (run with the fold, by the
    /// owner of partition 0).
    pub otel: Option<crate::otel::Export>,
    /// The price table usage is costed with.
    pub prices: crate::usage::Prices,
    /// Counts the usage producers report (tokens and cost by agent and model).
    pub usage_meter: crate::telemetry::UsageMeter,
    /// The runtime the partitions run on (the lease loop spawns them here).
    pub partitions_rt: tokio::runtime::Handle,
    /// Per partition: the input it last failed on, and how many times in a row it failed there.
    failures: Mutex<HashMap<u16, (u64, i64)>>,
    /// The sets of raw streams as this process last found them (`bus::generations`): `names`
    /// at the start, looked up again when a partition has read every set it knows to its end.
    raw: std::sync::RwLock<Arc<Names>>,
}

impl WorkerContext {
    pub async fn new(
        js: jetstream::Context,
        settings: Settings,
    ) -> Result<Arc<WorkerContext>, WorkerError> {
        let names = settings.names();
        let ingest = settings
            .ingest()
            .map_err(|e| WorkerError::setup(0, "settings", e))?;
        let otel = crate::otel::resolve(&settings.otel, |k| std::env::var(k).ok())
            .map_err(|e| WorkerError::setup(0, "the OpenTelemetry export settings", e))?;
        let prices = settings
            .prices()
            .map_err(|e| WorkerError::setup(0, "settings", e))?;
        let sessions_side = Side::start(
            &settings,
            "collab-sessions",
            "collab-projector-sessions",
            settings.workers.fold_niceness,
        )
        .await?;
        let leases_side =
            Side::start(&settings, "collab-leases", "collab-projector-leases", 0).await?;
        let (writer_js, writer_names) = (sessions_side.js.clone(), names.clone());
        let sessions = sessions_side
            .rt
            .handle
            .spawn(async move { SessionWriter::new(&writer_js, &writer_names).await })
            .await
            .map_err(|e| WorkerError::setup(0, "the work-session thread", e))?
            .map_err(|e| WorkerError::setup(0, "the work-session writer", e))?;
        let state = Arc::new(WorkerState::default());
        let publisher = Publisher::new(js.clone(), names.clone(), state.clone(), &settings)
            .await
            .map_err(|e| WorkerError::setup(0, "the output streams", e))?;
        Ok(Arc::new(WorkerContext {
            publisher: Arc::new(publisher),
            failures: Mutex::new(HashMap::new()),
            raw: std::sync::RwLock::new(Arc::new(names.clone())),
            sessions: Arc::new(sessions),
            sessions_side,
            leases_side,
            partitions_rt: tokio::runtime::Handle::current(),
            otel,
            usage_meter: crate::telemetry::UsageMeter::new(prices.clone()),
            prices,
            js,
            names,
            ingest,
            state,
            settings,
        }))
    }

    /// The sets of raw streams as last found (see [`WorkerContext::refresh_raw`]).
    pub fn raw_names(&self) -> Arc<Names> {
        match self.raw.read() {
            Ok(n) => n.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Look the sets of raw streams up on the server again (a reshard since this process
    /// started made a new one).
    pub async fn refresh_raw(&self) -> Result<Arc<Names>, super::generations::SetsError> {
        let found = super::generations::discover(&self.js, &self.names).await?;
        let fresh = Arc::new(super::generations::with_generations(&self.names, &found));
        match self.raw.write() {
            Ok(mut n) => *n = fresh.clone(),
            Err(poisoned) => *poisoned.into_inner() = fresh.clone(),
        }
        Ok(fresh)
    }

    /// Partition `p` stopped on a failure processing its input `seq`: count it (1 for the first
    /// in a row on that input).
    pub(crate) fn note_failure(&self, p: u16, seq: u64) -> i64 {
        let Ok(mut failures) = self.failures.lock() else {
            return 1;
        };
        let entry = failures.entry(p).or_insert((seq, 0));
        if entry.0 != seq {
            *entry = (seq, 0);
        }
        entry.1 += 1;
        entry.1
    }

    /// [`Self::note_failure`] for partition `p`, as its acker calls it.
    pub(crate) fn failures_of(self: &Arc<Self>, p: u16) -> Box<dyn Fn(u64) + Send + Sync> {
        let shared = self.clone();
        Box::new(move |seq| {
            shared.note_failure(p, seq);
        })
    }

    /// How many times in a row partition `p` stopped on a failure processing its input `seq`.
    pub(crate) fn failures_at(&self, p: u16, seq: u64) -> i64 {
        self.failures
            .lock()
            .ok()
            .and_then(|f| f.get(&p).copied())
            .filter(|(at, _)| *at == seq)
            .map_or(0, |(_, n)| n)
    }
}
