//! The `bench` command: throughput, latency and turn-book scale of the projector, measured in one
//! run against a nats-server (one started per scenario when none is given), printed as a table
//! or as JSON.
//!
//! Method (docs/performance.md says why):
//! - **Throughput** (scenarios 1-4): N raw messages are preloaded into the raw stream while
//!   nothing consumes it; then the pipeline under test starts and the clock runs from its first
//!   input until every input is accounted for (acknowledged: its projections or dead letter are
//!   stored), so the producer's speed never limits the figure. Each scenario gets a fresh server
//!   (or, against a given server, a fresh prefix) so scenarios do not interfere.
//!   1. *baseline passthrough*: the minimal safe copy raw -> proj in this binary (pull batches of
//!      1000, up to `consumer.publish_window` publish acks in flight like the pipeline, republish
//!      with Msg-Id, ack after the publish ack);
//!   2. the full pipeline on the demo's realistic mix; 3. turn-only traffic;
//!   4. a *naive* pipeline that fetches one message per request (Redpanda Connect's input shape),
//!      projects it, awaits its publish ack and acknowledges it.
//! - **Latency** (1 and 2): messages are published at a fixed rate with the pipeline running;
//!   a message's latency is the store time of its last output minus the store time of the raw
//!   message (matched by `Collab-Source-Seq`), both stamped by the server's clock.
//! - **CPU**: utime + stime from `/proc/<pid>/stat` of the nats-server and of this process over
//!   the measured window (this process *is* the worker).
//! - **Turn book**: memory per open turn (RSS growth while building the state a partition
//!   keeps: its [`OpenTurns`], filled as live sends fill it, built on a fresh thread before
//!   anything else), the real recovery of N open turns written to the `turns` bucket (a worker's start
//!   until every partition runs; and the reload alone), and the lateness of synthesised timeouts
//!   with N turns open (probe sends with a short deadline: stored response minus deadline).

use crate::app::{self, RunOptions};
use crate::bus::turns::{PartitionTurns, Rev};
use crate::bus::{self, context::WorkerContext, provision, runtime::ThreadRuntime};
use crate::config::{Names, Settings};
use crate::localnats::{LocalNats, LocalNatsError, LocalNatsOptions};
use crate::pipeline::{self, RawMessage, H_SOURCE_SEQ};
use crate::sim::{Generator, Mix, RawEvent, MAIN_AGENTS};
use crate::turns::{self, book::OpenTurns, TurnConfig, TurnEventKind, TurnFacts, TurnRecord};
use async_nats::jetstream::{
    self, consumer, consumer::PullConsumer, context::PublishAckFuture, message::PublishMessage,
};
use futures::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use std::collections::{HashMap, VecDeque};
use std::fmt::Write as _;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Why a benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("starting a local nats-server: {0}")]
    Local(#[from] LocalNatsError),
    #[error(transparent)]
    Connect(#[from] bus::ConnectError),
    #[error(transparent)]
    Provision(#[from] provision::ProvisionError),
    #[error(transparent)]
    App(#[from] app::AppError),
    #[error("{what}: {detail}")]
    Nats { what: String, detail: String },
    #[error("{0}")]
    Stalled(String),
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error("interrupted")]
    Interrupted,
    #[error("{0}")]
    Setup(String),
}

fn nats_err(what: impl Into<String>) -> impl FnOnce(String) -> BenchError {
    let what = what.into();
    move |detail| BenchError::Nats { what, detail }
}

trait Ctx<T> {
    fn ctx(self, what: &str) -> Result<T, BenchError>;
}

impl<T, E: std::fmt::Display> Ctx<T> for Result<T, E> {
    fn ctx(self, what: &str) -> Result<T, BenchError> {
        self.map_err(|e| nats_err(what)(e.to_string()))
    }
}

/// A part of the benchmark, for `--only`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Part {
    /// 1: the baseline passthrough.
    Baseline,
    /// 2: the full pipeline on realistic mixed traffic.
    Mixed,
    /// 3: the full pipeline on turn-only traffic.
    Turns,
    /// 4: the naive one-message-per-fetch pipeline.
    Naive,
    /// Latency at a fixed rate for 1 and 2.
    Latency,
    /// Turn-book scale: memory per open turn, recovery, timer lateness.
    TurnBook,
    /// Where the time goes: 2 and 3 again with the turn contract switched off
    /// (`turns.enforce_roles = []`), then without the work-session fold.
    Breakdown,
    /// 9 and 10: the ceiling: the passthrough doing the pipeline's pure core on each input and
    /// publishing its projections, with none of its guarantees, on the mix and on turns.
    Ceiling,
    /// 11: the full pipeline on every input format the demo carries: the realistic mix plus
    /// A2A wire exchanges (JSON-RPC, answered after a working frame) and AG-UI runs.
    Protocols,
}

impl Part {
    pub const ALL: [Part; 9] = [
        Part::Baseline,
        Part::Mixed,
        Part::Turns,
        Part::Naive,
        Part::Latency,
        Part::TurnBook,
        Part::Breakdown,
        Part::Ceiling,
        Part::Protocols,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Part::Baseline => "baseline",
            Part::Mixed => "mixed",
            Part::Turns => "turns",
            Part::Naive => "naive",
            Part::Latency => "latency",
            Part::TurnBook => "turnbook",
            Part::Breakdown => "breakdown",
            Part::Ceiling => "ceiling",
            Part::Protocols => "protocols",
        }
    }
}

impl FromStr for Part {
    type Err = String;
    fn from_str(s: &str) -> Result<Part, String> {
        Part::ALL
            .into_iter()
            .find(|p| p.as_str().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| {
                format!(
                    "unknown part {s:?}; one of {}",
                    Part::ALL.map(Part::as_str).join(", ")
                )
            })
    }
}

/// What to measure and how much.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// A server to use (fresh prefix per scenario); `None` starts a nats-server per scenario.
    pub nats_url: Option<String>,
    /// Preloaded messages for scenarios 1-3.
    pub messages: usize,
    /// Preloaded messages for scenario 4 (one round trip each: keep it small).
    pub naive_messages: usize,
    /// Publish rate of the latency runs, messages per second.
    pub latency_rate: u32,
    /// How long each latency run publishes.
    pub latency_duration: Duration,
    /// Write every measured input of a latency run to `<this>.<scenario id>.csv`.
    pub latency_samples: Option<std::path::PathBuf>,
    /// Open-turn counts of the turn-book scale runs.
    pub open_turns: Vec<usize>,
    /// Probe sends per lateness run.
    pub lateness_probes: usize,
    /// The probes' own deadline (`timeoutMs`).
    pub probe_timeout: Duration,
    /// Partitions of the raw stream (by default the built-in configuration's).
    pub partitions: u16,
    /// Which parts to run.
    pub parts: Vec<Part>,
    /// Seed of the traffic generator.
    pub seed: u64,
    /// The deadline the generated main-main turns ask for (`timeoutMs`). Inside the clock of
    /// a run its unanswered turns' blocked outcomes are work the run measures; outside, not.
    pub turn_timeout: Duration,
    /// Draw progress bars on stderr (hidden anyway when stderr is not a terminal).
    pub progress: bool,
    /// A Prometheus recorder, as `run` installs one (metric updates are part of the hot path).
    pub metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
}

/// How long each latency run publishes unless told otherwise (`--latency-duration`). A 10 s
/// run's p99 rested on a few slow windows and moved up to 2x between runs of one build.
pub const DEFAULT_LATENCY_DURATION: Duration = Duration::from_secs(30);

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            nats_url: None,
            messages: 200_000,
            naive_messages: 20_000,
            latency_rate: 5_000,
            latency_duration: DEFAULT_LATENCY_DURATION,
            latency_samples: None,
            open_turns: vec![100_000, 1_000_000],
            lateness_probes: 1_000,
            probe_timeout: Duration::from_secs(2),
            partitions: Settings::default().nats.partitions,
            parts: Part::ALL.to_vec(),
            seed: 42,
            turn_timeout: Duration::from_millis(crate::sim::DEFAULT_TURN_TIMEOUT_MS),
            progress: true,
            metrics: None,
        }
    }
}

/// Everything one run measured.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BenchReport {
    pub machine: MachineInfo,
    pub throughput: Vec<ThroughputResult>,
    pub ratios: Ratios,
    pub latency: Vec<LatencyResult>,
    pub turn_book: Vec<TurnBookResult>,
    pub core_costs: Option<CoreCosts>,
    pub round_trips: Option<RoundTrips>,
    pub targets: Vec<TargetResult>,
    pub notes: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct MachineInfo {
    pub cores: usize,
    /// 1, 5 and 15 minute load averages when the run started and when it ended.
    pub load_start: [f64; 3],
    pub load_end: [f64; 3],
    pub server_version: String,
    pub server: String,
    pub partitions: u16,
    pub wall_seconds: f64,
    /// How the binary that ran was built.
    pub build: Build,
    /// `workers.fold_niceness` of the workers that ran: how far below the partitions the
    /// work-session fold's thread was scheduled.
    pub fold_niceness: u8,
}

/// How a binary was built, as the bench reports it (`debug`, `release`, `pgo`,
/// `pgo-instrumented` in its text and JSON).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Build {
    /// Unoptimised: its rates are a fraction of a release build's and say nothing about the
    /// targets.
    Debug,
    Release,
    /// The profile-guided binary `scripts/pgo-build.sh` makes.
    Pgo,
    /// The script's training build, slowed by the counting it does.
    PgoInstrumented,
}

impl Build {
    /// This binary's. `scripts/pgo-build.sh` names its two release builds through
    /// `COLLAB_BUILD_KIND` at build time; any other value reads as a plain release build.
    pub fn current() -> Build {
        if cfg!(debug_assertions) {
            return Build::Debug;
        }
        match option_env!("COLLAB_BUILD_KIND") {
            Some("pgo") => Build::Pgo,
            Some("pgo-instrumented") => Build::PgoInstrumented,
            _ => Build::Release,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Build::Debug => "debug",
            Build::Release => "release",
            Build::Pgo => "pgo",
            Build::PgoInstrumented => "pgo-instrumented",
        }
    }
}

impl std::fmt::Display for Build {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ThroughputResult {
    pub id: u8,
    pub scenario: String,
    /// Raw messages processed.
    pub inputs: u64,
    /// Messages published (projections, turn responses, dead letters).
    pub outputs: u64,
    pub dead_lettered: u64,
    pub avg_input_bytes: f64,
    pub seconds: f64,
    pub msg_per_s: f64,
    /// Cores used over the window (CPU seconds / wall seconds); `None` for an external server.
    pub server_cpu_cores: Option<f64>,
    pub worker_cpu_cores: Option<f64>,
    /// Time from starting the pipeline to its first input (not part of `seconds`).
    pub startup_s: f64,
    /// Writes to the turns bucket (every KV write is a JetStream publish).
    pub kv_turn_writes: Option<u64>,
    /// Writes to the leases bucket (renewals and handovers of partition leases).
    pub lease_writes: Option<u64>,
    /// Writes to the work-session bucket, and the average size of a stored session value.
    pub kv_session_writes: Option<u64>,
    pub session_value_avg_bytes: Option<f64>,
    /// JetStream API requests the server counted over the scenario (consumer info, stream info,
    /// ...; not pulls, publishes or KV reads).
    pub js_api_requests: Option<u64>,
    /// Deliveries beyond one per stored message (sum of the partition consumers' delivery
    /// sequences minus the raw streams' messages: the inputs and any watermark barriers):
    /// messages handed out again after their ack wait.
    pub redelivered: Option<u64>,
    /// CPU per input, in microseconds: the server's and the worker's (cores x seconds / inputs).
    pub server_us_per_input: Option<f64>,
    pub worker_us_per_input: Option<f64>,
    /// State writes per input: turn records and checkpoints, work sessions, leases.
    pub state_writes_per_input: Option<f64>,
    /// Projections stored but not yet folded into the work sessions when the clock stopped (the
    /// fold is off the projection path, so its lag is not part of `seconds`); `None` without a
    /// fold.
    pub fold_behind: Option<u64>,
    /// Seconds after the clock stopped until the fold had read every projection (at most
    /// [`FOLD_CATCH_UP_LIMIT`]); `None` without a fold, or when it did not within the limit.
    pub fold_catch_up_s: Option<f64>,
    /// CPU per input, in microseconds, from the first input until the fold had read every
    /// projection: the whole cost of an input, its work session included.
    pub folded_server_us_per_input: Option<f64>,
    pub folded_worker_us_per_input: Option<f64>,
}

/// How long a scenario waits, once its inputs are all acknowledged, for the work-session fold to
/// read the last projection.
const FOLD_CATCH_UP_LIMIT: Duration = Duration::from_secs(120);

impl ThroughputResult {
    /// Fill the per-input figures from the totals.
    fn derive_per_input(&mut self) {
        let inputs = self.inputs.max(1) as f64;
        let per_input = |cores: Option<f64>| cores.map(|c| c * self.seconds * 1e6 / inputs);
        self.server_us_per_input = per_input(self.server_cpu_cores);
        self.worker_us_per_input = per_input(self.worker_cpu_cores);
        let writes = [
            self.kv_turn_writes,
            self.kv_session_writes,
            self.lease_writes,
        ];
        self.state_writes_per_input = writes
            .iter()
            .any(Option::is_some)
            .then(|| writes.iter().flatten().sum::<u64>() as f64 / inputs);
    }
}

#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Ratios {
    pub mixed_over_baseline: Option<f64>,
    pub turns_over_baseline: Option<f64>,
    pub baseline_over_naive: Option<f64>,
    /// The ceiling's (9, 10) rates over the baseline: what the pure core alone leaves of the
    /// passthrough's rate on this machine.
    pub ceiling_mixed_over_baseline: Option<f64>,
    pub ceiling_turns_over_baseline: Option<f64>,
    /// Scenario 11's rate (every input format) over the baseline.
    pub protocols_over_baseline: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LatencyResult {
    pub id: u8,
    pub scenario: String,
    pub target_rate: u32,
    pub achieved_rate: f64,
    pub sent: usize,
    /// Inputs with at least one output found.
    pub measured: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
}

#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TurnBookResult {
    pub open_turns: usize,
    /// RSS growth per turn of the partition state (its `OpenTurns`), built alone.
    pub model_bytes_per_turn: Option<f64>,
    /// Bytes the turn bucket's stream holds per open turn record (record, key and the server's
    /// per-message overhead): what sizing `storage.turns_max_bytes` needs.
    pub stored_bytes_per_turn: Option<f64>,
    /// Turns the real reload found open.
    pub reloaded: Option<usize>,
    /// Seconds to write the records (setup, not a figure of the projector).
    pub setup_s: Option<f64>,
    /// A worker's start (connect, check resources, leases, reload) until every partition runs.
    pub worker_recovery_s: Option<f64>,
    /// The reload alone (every partition concurrently).
    pub reload_s: Option<f64>,
    pub lateness_probes: usize,
    pub lateness_answered: usize,
    pub lateness_p50_ms: Option<f64>,
    pub lateness_p99_ms: Option<f64>,
    pub lateness_max_ms: Option<f64>,
    pub note: Option<String>,
}

/// CPU cost of the pure core per input, measured in-process on the generator's traffic.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CoreCosts {
    /// Normalise + classify + serialise, realistic mix, microseconds per input.
    pub mixed_us: f64,
    /// The same plus the turn step (facts, decision), turn-only traffic.
    pub turns_us: f64,
    /// Of which: a second JSON parse per turn event. Always 0 since the turn facts are read from
    /// the normaliser's parse; kept so reports stay comparable with older ones.
    pub turn_reparse_us: f64,
}

/// Serial round trips to the server, one at a time on a quiet server (microseconds each).
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RoundTrips {
    pub kv_get_us: f64,
    pub kv_create_us: f64,
    pub kv_update_us: f64,
    pub publish_us: f64,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TargetResult {
    pub target: String,
    pub measured: String,
    /// `None`: not measured in this run.
    pub met: Option<bool>,
}

// ---------------------------------------------------------------------------------------------
// Small helpers: /proc, percentiles, progress bars.

/// utime + stime of a process, in seconds (USER_HZ is 100 on Linux).
fn cpu_seconds(pid: Option<u32>) -> Option<f64> {
    let path = match pid {
        Some(p) => format!("/proc/{p}/stat"),
        None => "/proc/self/stat".to_string(),
    };
    let text = std::fs::read_to_string(path).ok()?;
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) as f64 / 100.0)
}

/// Resident set size of this process, bytes.
fn rss_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = text.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn loadavg() -> [f64; 3] {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut it = text.split_whitespace().map(|v| v.parse().unwrap_or(0.0));
    [
        it.next().unwrap_or(0.0),
        it.next().unwrap_or(0.0),
        it.next().unwrap_or(0.0),
    ]
}

/// The q-quantile (nearest rank) of sorted values.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[derive(Clone, Copy)]
struct CpuMark {
    at: Instant,
    server: Option<f64>,
    worker: Option<f64>,
}

impl CpuMark {
    fn now(server_pid: Option<u32>) -> CpuMark {
        CpuMark {
            at: Instant::now(),
            server: server_pid.and_then(|p| cpu_seconds(Some(p))),
            worker: cpu_seconds(None),
        }
    }

    /// CPU per input since `self`, in microseconds, over `inputs`: (server, worker).
    fn us_per_input_until(&self, end: &CpuMark, inputs: usize) -> (Option<f64>, Option<f64>) {
        let n = inputs.max(1) as f64;
        let d = |a: Option<f64>, b: Option<f64>| Some((b? - a?) * 1e6 / n);
        (d(self.server, end.server), d(self.worker, end.worker))
    }

    /// Cores used since `self`: (server, worker).
    fn cores_until(&self, end: &CpuMark) -> (Option<f64>, Option<f64>) {
        let wall = (end.at - self.at).as_secs_f64().max(1e-9);
        let d = |a: Option<f64>, b: Option<f64>| Some((b? - a?) / wall);
        (d(self.server, end.server), d(self.worker, end.worker))
    }
}

fn bar(opts: &BenchOptions, len: u64, prefix: &str) -> ProgressBar {
    if !opts.progress {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len);
    let style = ProgressStyle::with_template(
        "{prefix:<28} [{bar:32}] {human_pos:>9}/{human_len:<9} {per_sec:>14} {msg}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ");
    pb.set_style(style);
    pb.set_prefix(prefix.to_string());
    pb
}

fn say(opts: &BenchOptions, line: &str) {
    if opts.progress {
        eprintln!("{line}");
    }
}

// ---------------------------------------------------------------------------------------------
// One scenario's server (or prefix on a given server).

struct Env {
    url: String,
    prefix: String,
    local: Option<LocalNats>,
    js: jetstream::Context,
    client: async_nats::Client,
    /// The pipeline's settings for this scenario, validated once.
    settings: Settings,
}

impl Env {
    async fn new(opts: &BenchOptions, tag: &str) -> Result<Env, BenchError> {
        // Raw traffic over shards (`COLLAB_NATS__SHARDS`) needs the server's subject mapping for
        // the prefix: a server the bench starts gets it; a given one must have it for the prefix
        // `COLLAB_BENCH_PREFIX` names (scenarios then run one after the other under it).
        let shards = Settings::load_with(None, |_| {})?.nats.shards;
        let (url, prefix, local) = match &opts.nats_url {
            Some(url) => {
                let prefix = match std::env::var("COLLAB_BENCH_PREFIX") {
                    Ok(p) if !p.is_empty() => p,
                    _ if shards > 1 => {
                        return Err(BenchError::Setup(format!(
                            "nats.shards is {shards}: the server at {url} needs the subject mapping of a prefix; set COLLAB_BENCH_PREFIX to the prefix its mapping was made for (`collab-projector shards` prints one)"
                        )))
                    }
                    _ => format!("bench-{}-{tag}", std::process::id()),
                };
                (url.clone(), prefix, None)
            }
            None => {
                let mut names = Names::new("collab");
                names.set_shards(shards);
                let server = LocalNats::start(LocalNatsOptions {
                    extra_config: names.shard_mapping_config(),
                    ..Default::default()
                })
                .await?;
                (server.url(), "collab".to_string(), Some(server))
            }
        };
        // The built-in defaults with `COLLAB_<SECTION>__<KEY>` overrides from the environment
        // (for experiments); the server, prefix and partitions are the bench's.
        let settings = Settings::load_with(None, |s| {
            s.nats.url = url.clone();
            s.nats.prefix = prefix.clone();
            s.nats.partitions = opts.partitions;
            s.http.enabled = false;
            for agent in MAIN_AGENTS {
                if !s.roles.main_agents.iter().any(|a| a == agent) {
                    s.roles.main_agents.push(agent.to_string());
                }
            }
        })?;
        let (client, js) =
            bus::connect(&url, Some(&settings.nats), 1024, "collab-projector bench").await?;
        Ok(Env {
            url,
            prefix,
            local,
            js,
            client,
            settings,
        })
    }

    fn settings(&self) -> Settings {
        self.settings.clone()
    }

    fn names(&self) -> Names {
        let mut n = Names::new(&self.prefix);
        n.set_shards(self.settings.nats.shards);
        n
    }

    fn server_pid(&self) -> Option<u32> {
        self.local.as_ref().map(LocalNats::pid)
    }

    async fn provision(&self) -> Result<(), BenchError> {
        provision::provision(&self.js, &self.settings()).await?;
        Ok(())
    }

    /// Stop a server we started; on a given server, delete what this scenario created.
    async fn close(mut self) {
        if let Some(mut server) = self.local.take() {
            server.stop().await;
            return;
        }
        let n = self.names();
        for s in n.raw_streams.iter().cloned().chain([
            n.proj_stream.clone(),
            n.dlq_stream.clone(),
            format!("KV_{}", n.turns_bucket),
            format!("KV_{}", n.sessions_bucket),
            format!("KV_{}", n.leases_bucket),
            format!("OBJ_{}", n.blobs_store),
        ]) {
            let _ = self.js.delete_stream(&s).await;
        }
        let _ = self.client.flush().await;
    }

    /// Deliveries by the partition consumers beyond one per message of the raw stream.
    async fn redelivered(&self, inputs: u64) -> Option<u64> {
        let infos = self.partition_consumers().await;
        let mut total = 0u64;
        for i in infos {
            total += i.ok()?.delivered.consumer_sequence;
        }
        // Every message in the raw streams is delivered once: the inputs, and the watermark
        // barriers idle partitions sent themselves (each is delivered, and none is an input).
        // Only deliveries beyond those are redeliveries.
        let mut stored = 0u64;
        for name in &self.names().raw_streams {
            stored += self.stream_last_seq(name).await?;
        }
        Some(total.saturating_sub(stored.max(inputs)))
    }

    /// The account's JetStream API request count.
    async fn api_requests(&self) -> Option<u64> {
        self.js.query_account().await.ok().map(|a| a.requests.total)
    }

    async fn stream_last_seq(&self, stream: &str) -> Option<u64> {
        let mut s = self.js.get_stream(stream).await.ok()?;
        Some(s.info().await.ok()?.state.last_sequence)
    }

    /// How many projections the work-session fold has still to read: the projection stream's
    /// last sequence past the fold's checkpoint.
    async fn fold_behind(&self) -> Option<u64> {
        let names = self.names();
        let last = self.stream_last_seq(&names.proj_stream).await?;
        let kv = self.js.get_key_value(&names.sessions_bucket).await.ok()?;
        let reconnects = crate::bus::reconnects::Reconnects::new(&self.js.client());
        use crate::bus::sessions::{read_stored, Stored, FOLD_KEY};
        let folded = match read_stored(&kv, &reconnects, FOLD_KEY).await.ok()? {
            Stored::At { last, .. } => last,
            Stored::Deleted | Stored::Never => 0,
        };
        Some(last.saturating_sub(folded))
    }

    /// Wait until the work-session fold has read every projection (at most
    /// [`FOLD_CATCH_UP_LIMIT`] after `from`): the seconds it took and the CPU mark then.
    async fn fold_caught_up(&self, from: &CpuMark) -> Option<(f64, CpuMark)> {
        while from.at.elapsed() < FOLD_CATCH_UP_LIMIT {
            if self.fold_behind().await == Some(0) {
                let end = CpuMark::now(self.server_pid());
                return Some(((end.at - from.at).as_secs_f64(), end));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    }

    /// Bytes per message the stream holds, if it holds any.
    async fn bytes_per_message(&self, stream: &str) -> Option<f64> {
        let mut st = self.js.get_stream(stream).await.ok()?;
        let info = st.info().await.ok()?;
        (info.state.messages > 0).then(|| info.state.bytes as f64 / info.state.messages as f64)
    }

    /// The outputs (or inputs) a stream holds, partition owners' fence claims aside.
    async fn stream_messages(&self, stream: &str) -> u64 {
        crate::bus::publish::outputs_in(&self.js, stream).await
    }

    /// Every partition consumer has nothing pending and nothing unacknowledged.
    async fn drained(&self) -> bool {
        self.partition_consumers()
            .await
            .into_iter()
            .all(|i| i.is_ok_and(|i| i.num_pending == 0 && i.num_ack_pending == 0))
    }

    /// Every partition consumer's info, each from the raw stream its partition reads.
    async fn partition_consumers(
        &self,
    ) -> Vec<Result<consumer::Info, async_nats::jetstream::context::ConsumerInfoError>> {
        let names = self.names();
        let mut streams = Vec::new();
        for name in &names.raw_streams {
            match self.js.get_stream(name).await {
                Ok(s) => streams.push(s),
                Err(_) => return Vec::new(),
            }
        }
        futures::future::join_all((0..self.settings.nats.partitions).map(|p| {
            let stream = &streams[usize::from(p) % streams.len()];
            stream.consumer_info(names.consumer_name(p))
        }))
        .await
    }
}

/// Publish with a window of unawaited acks; the window stays below the context's cap.
struct Publisher {
    window: VecDeque<PublishAckFuture>,
    limit: usize,
    acked_seqs: Vec<u64>,
    keep_seqs: bool,
}

impl Publisher {
    fn new(limit: usize, keep_seqs: bool) -> Publisher {
        Publisher {
            window: VecDeque::with_capacity(limit),
            limit,
            acked_seqs: Vec::new(),
            keep_seqs,
        }
    }

    /// Publish a generated event as its producer would: with its headers (an A2A relay's
    /// agents, exchange and method, an AG-UI relay's run id), which its turn or run depends on.
    async fn publish(&mut self, js: &jetstream::Context, ev: RawEvent) -> Result<(), BenchError> {
        if self.window.len() >= self.limit {
            self.pop().await?;
        }
        let fut = publish_event(js, ev).await?;
        self.window.push_back(fut);
        Ok(())
    }

    async fn pop(&mut self) -> Result<(), BenchError> {
        if let Some(f) = self.window.pop_front() {
            let ack = f.await.ctx("publish ack")?;
            if self.keep_seqs {
                self.acked_seqs.push(ack.sequence);
            }
        }
        Ok(())
    }

    async fn flush(&mut self) -> Result<(), BenchError> {
        while !self.window.is_empty() {
            self.pop().await?;
        }
        Ok(())
    }
}

/// The traffic generator of a run: the options' seed and turn deadline, the scenario's prefix.
fn generator(env: &Env, opts: &BenchOptions, mix: Mix) -> Generator {
    let mut gen = Generator::new(&env.prefix, opts.seed, mix);
    gen.turn_timeout_ms = u64::try_from(opts.turn_timeout.as_millis()).unwrap_or(u64::MAX);
    gen
}

/// Publish one generated event with its headers, if it has any.
async fn publish_event(
    js: &jetstream::Context,
    ev: RawEvent,
) -> Result<PublishAckFuture, BenchError> {
    let headers = ev.nats_headers();
    let body = bytes::Bytes::from(ev.body);
    match headers {
        Some(h) => js.publish_with_headers(ev.subject, h, body).await,
        None => js.publish(ev.subject, body).await,
    }
    .ctx("publishing")
}

/// Preload `n` raw messages of `mix`; returns the average body size.
async fn preload(
    env: &Env,
    opts: &BenchOptions,
    mix: Mix,
    n: usize,
    label: &str,
) -> Result<f64, BenchError> {
    let pb = bar(opts, n as u64, &format!("{label}: preload"));
    let mut gen = generator(env, opts, mix);
    let mut publisher = Publisher::new(1000, false);
    let mut sent = 0usize;
    let mut bytes = 0usize;
    let started = Instant::now();
    'outer: loop {
        for ev in gen.next_scenario() {
            if sent >= n {
                break 'outer;
            }
            bytes += ev.body.len();
            publisher.publish(&env.js, ev).await?;
            sent += 1;
            if sent % 1000 == 0 {
                pb.set_position(sent as u64);
            }
        }
    }
    publisher.flush().await?;
    pb.finish_and_clear();
    // What the raw stream leaders take with nothing reading: producers' side of the capacity.
    let secs = started.elapsed().as_secs_f64();
    say(
        opts,
        &format!(
            "{label}: preloaded {n} raw messages into {} raw stream(s) in {secs:.1} s ({:.0} msg/s)",
            env.names().shards(),
            n as f64 / secs.max(1e-9)
        ),
    );
    Ok(bytes as f64 / n.max(1) as f64)
}

// ---------------------------------------------------------------------------------------------
// Scenario 1: the baseline passthrough.

/// The minimal safe copy raw -> proj: pull batches of 1000, republish with a Msg-Id (up to
/// `consumer.publish_window` publish acks in flight, the pipeline's own budget), acknowledge
/// each input after its publish ack. No other logic.
struct Passthrough {
    progress: Arc<CopyProgress>,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), String>>,
}

/// How the passthrough reads the raw stream (`COLLAB_BENCH_PARTITIONED`, for measuring consumer
/// layouts against each other; unset: one consumer over each raw stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReadLayout {
    /// One consumer over each raw stream, no partition filter: the reference.
    Whole,
    /// One consumer per partition with its filter (`1`): the pipeline's layout.
    PerPartition,
    /// `n` consumers, consumer `c` with the filters of partitions `c`, `c + n`, `c + 2n`, ...
    /// (`filters:<n>`): one consumer per worker over the partitions it owns, for `n` workers.
    Filters(u16),
    /// `n` consumers, consumer `c` reading the same partitions as `filters:<n>` through one
    /// filter, the raw layout's token of count `n` (`groups:<n>`, `n` a count the layout
    /// supports): the partitions congruent to `c` modulo `n` are exactly the keys whose
    /// `n`-token is `c`.
    Groups(u16),
}

impl ReadLayout {
    /// The layout `COLLAB_BENCH_PARTITIONED` asks for, checked against the deployment's
    /// `partitions` and raw `shards` (`filters:<n>` needs one raw stream and at most one
    /// consumer per partition).
    fn from_env(partitions: u16, shards: u16) -> Result<ReadLayout, BenchError> {
        let Ok(v) = std::env::var("COLLAB_BENCH_PARTITIONED") else {
            return Ok(ReadLayout::Whole);
        };
        let count = |prefix: &str, v: &str| {
            v.strip_prefix(prefix)
                .and_then(|n| n.trim().parse::<u16>().ok())
                .filter(|n| *n > 0)
        };
        let layout = match v.trim() {
            "" | "1" | "true" | "yes" => ReadLayout::PerPartition,
            other => count("filters:", other)
                .map(ReadLayout::Filters)
                .or_else(|| count("groups:", other).map(ReadLayout::Groups))
                .ok_or_else(|| {
                    BenchError::Setup(format!(
                        "COLLAB_BENCH_PARTITIONED={other:?}: use 1 (one consumer per partition), filters:<n> (n consumers over the partitions' filters) or groups:<n> (n consumers, one filter each)"
                    ))
                })?,
        };
        match layout {
            ReadLayout::Filters(c) | ReadLayout::Groups(c) if c > partitions || shards != 1 => Err(BenchError::Setup(format!(
                "COLLAB_BENCH_PARTITIONED={v}: needs one raw stream (there are {shards}) and at most {partitions} consumers"
            ))),
            ReadLayout::Groups(c) if c > 1 && partitions % c != 0 => Err(BenchError::Setup(format!(
                "COLLAB_BENCH_PARTITIONED=groups:{c}: {c} must divide the partition count ({partitions})"
            ))),
            layout => Ok(layout),
        }
    }
}

async fn start_passthrough(
    env: &Env,
    layout: ReadLayout,
    core: Option<Arc<CoreWork>>,
) -> Result<Passthrough, BenchError> {
    let names = env.names();
    // The pipeline's own publish window, so both sides may hold as many publish acks in flight.
    let window = env.settings.consumer.publish_window;
    let (_client, js) = bus::connect(
        &env.url,
        Some(&env.settings.nats),
        window,
        "bench passthrough",
    )
    .await?;
    let mut streams = Vec::new();
    for name in &names.raw_streams {
        streams.push(js.get_stream(name).await.ctx("raw stream")?);
    }
    // Each consumer: its raw stream (shard) and its filters.
    let partitions = env.settings.nats.partitions;
    let filters: Vec<(usize, String, Vec<String>)> = match layout {
        ReadLayout::PerPartition => (0..partitions)
            .map(|p| {
                (
                    usize::from(p) % streams.len(),
                    format!("bench-passthrough-{p}"),
                    vec![env.settings().partition_filter(p)],
                )
            })
            .collect(),
        // One raw stream and n <= partitions (`ReadLayout::from_env`): every consumer gets at
        // least one partition, shares differing by one.
        ReadLayout::Filters(n) => (0..n)
            .map(|c| {
                let owned = (0..partitions)
                    .filter(|p| p % n == c)
                    .map(|p| env.settings().partition_filter(p))
                    .collect();
                (0, format!("bench-passthrough-f{c}"), owned)
            })
            .collect(),
        ReadLayout::Groups(n) => {
            let layout = env.settings().layout();
            if !layout.supports(n) {
                return Err(BenchError::Setup(format!(
                    "COLLAB_BENCH_PARTITIONED=groups:{n}: the raw layout has no token for {n} (it supports {})",
                    layout.counts()
                )));
            }
            (0..n)
                .map(|c| {
                    (
                        0,
                        format!("bench-passthrough-g{c}"),
                        vec![layout.filter(&names.prefix, n, c)],
                    )
                })
                .collect()
        }
        ReadLayout::Whole => (0..streams.len())
            .map(|i| {
                (
                    i,
                    format!("bench-passthrough-s{i}"),
                    vec![format!("{}.in.>", names.prefix)],
                )
            })
            .collect(),
    };
    let progress = Arc::new(CopyProgress::default());
    let cancel = CancellationToken::new();
    let mut copies = Vec::new();
    for (i, durable, mut subjects) in filters {
        // One filter as `filter_subject`, several as `filter_subjects` (the server takes either).
        let (filter_subject, filter_subjects) = if subjects.len() == 1 {
            (subjects.pop().unwrap_or_default(), Vec::new())
        } else {
            (String::new(), subjects)
        };
        let consumer: PullConsumer = streams[i]
            .create_consumer(consumer::pull::Config {
                durable_name: Some(durable),
                filter_subject,
                filter_subjects,
                ack_policy: consumer::AckPolicy::Explicit,
                ack_wait: Duration::from_secs(30),
                max_ack_pending: 20_000,
                ..Default::default()
            })
            .await
            .ctx("passthrough consumer")?;
        copies.push(tokio::spawn(copy_loop(
            consumer,
            js.clone(),
            window,
            names.prefix.clone(),
            progress.clone(),
            cancel.clone(),
            core.clone(),
        )));
    }
    let task = tokio::spawn(async move {
        for r in futures::future::join_all(copies).await {
            r.map_err(|e| e.to_string())??;
        }
        Ok(())
    });
    Ok(Passthrough {
        progress,
        cancel,
        task,
    })
}

/// A copier's progress: inputs acknowledged, outputs stored, and when the first input came.
#[derive(Default)]
struct CopyProgress {
    done: AtomicU64,
    outputs: AtomicU64,
    first: OnceLock<Instant>,
}

/// What the ceiling and the naive pipeline do to each input: the pipeline's pure core (parse,
/// normalise, redact, classify, serialise; a rejected input's dead letter), none of its
/// guarantees.
struct CoreWork {
    names: Names,
    ingest: crate::ingest::Settings,
    max_deliver: i64,
}

impl CoreWork {
    fn new(env: &Env) -> Result<CoreWork, BenchError> {
        Ok(CoreWork {
            names: env.names(),
            ingest: env.settings.ingest()?,
            max_deliver: env.settings.consumer.max_deliver,
        })
    }

    /// The outputs of the delivered message `m`.
    fn project(&self, m: &jetstream::Message) -> Result<Vec<pipeline::Outgoing>, String> {
        let info = m.info().map_err(|e| e.to_string())?;
        let raw = RawMessage::from_delivery(m, &info);
        Ok(pipeline::project(
            &raw,
            &self.names,
            &self.ingest,
            self.max_deliver,
        ))
    }
}

/// An output as published without a fence: its payload, its own headers and its Msg-Id.
fn unfenced(out: &pipeline::Outgoing) -> PublishMessage {
    PublishMessage::build()
        .payload(out.payload.clone())
        .headers(bus::publish::output_headers(out))
        .message_id(out.msg_id.as_str())
}

/// One copier: pull batches of 1000, republish with a Msg-Id, acknowledge after the publish ack.
/// With `core`, each input's projections (the pure core's outputs) are published instead of the
/// input itself, and the input is acknowledged after the last one's publish ack.
async fn copy_loop(
    consumer: PullConsumer,
    js: jetstream::Context,
    window: usize,
    prefix: String,
    progress: Arc<CopyProgress>,
    c: CancellationToken,
    core: Option<Arc<CoreWork>>,
) -> Result<(), String> {
    let in_prefix = format!("{prefix}.in.");
    let out_prefix = format!("{prefix}.proj.passthrough.");
    let mut messages = consumer
        .stream()
        .max_messages_per_batch(1000)
        .messages()
        .await
        .map_err(|e| e.to_string())?;
    // Publish acks in order; an input rides with the ack of its last output.
    let (tx, mut rx) =
        mpsc::channel::<(Option<jetstream::Message>, PublishAckFuture)>(window.max(1));
    let acked = progress.clone();
    let acker = tokio::spawn(async move {
        while let Some((m, fut)) = rx.recv().await {
            fut.await.map_err(|e| e.to_string())?;
            acked.outputs.fetch_add(1, Ordering::Relaxed);
            if let Some(m) = m {
                m.ack().await.map_err(|e| e.to_string())?;
                acked.done.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok::<(), String>(())
    });
    loop {
        let next = tokio::select! {
            _ = c.cancelled() => break,
            m = messages.next() => m,
        };
        let Some(m) = next else { break };
        let m = m.map_err(|e| e.to_string())?;
        progress.first.get_or_init(Instant::now);
        if let Some(core) = &core {
            let outs = core.project(&m)?;
            let mut input = Some(m);
            let last = outs.len().saturating_sub(1);
            for (i, out) in outs.into_iter().enumerate() {
                let publish = unfenced(&out);
                let fut = js
                    .send_publish(out.subject, publish)
                    .await
                    .map_err(|e| e.to_string())?;
                let with = if i == last { input.take() } else { None };
                if tx.send((with, fut)).await.is_err() {
                    break;
                }
            }
            // An input with no output at all is done as it is.
            if let Some(m) = input {
                m.ack().await.map_err(|e| e.to_string())?;
                progress.done.fetch_add(1, Ordering::Relaxed);
            }
            continue;
        }
        let (stream, seq) = match m.info() {
            Ok(i) => (i.stream.to_string(), i.stream_sequence),
            Err(e) => return Err(e.to_string()),
        };
        let tail = m.subject.as_str().strip_prefix(&in_prefix).unwrap_or("x");
        let publish = PublishMessage::build()
            .payload(m.payload.clone())
            .header(H_SOURCE_SEQ, seq.to_string().as_str())
            .message_id(format!("{stream}:{seq}"));
        let fut = js
            .send_publish(format!("{out_prefix}{tail}"), publish)
            .await
            .map_err(|e| e.to_string())?;
        if tx.send((Some(m), fut)).await.is_err() {
            break;
        }
    }
    drop(tx);
    acker.await.map_err(|e| e.to_string())?
}

impl Passthrough {
    async fn stop(self) -> Result<(), BenchError> {
        self.cancel.cancel();
        match self.task.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(BenchError::Nats {
                what: "passthrough".into(),
                detail: e,
            }),
            Err(e) => Err(BenchError::Nats {
                what: "passthrough".into(),
                detail: e.to_string(),
            }),
        }
    }
}

async fn throughput_baseline(
    env: &Env,
    opts: &BenchOptions,
) -> Result<ThroughputResult, BenchError> {
    throughput_copy(env, opts, 1, Mix::REALISTIC, "baseline passthrough", false).await
}

/// A copier's run: the passthrough (scenario 1), or with `core` the ceiling (9 and 10): the
/// passthrough's single consumer and publish, doing the pipeline's pure core on each input and
/// publishing its projections, with none of the pipeline's guarantees (no partitions, leases,
/// fence, turn contract or work-session fold).
async fn throughput_copy(
    env: &Env,
    opts: &BenchOptions,
    id: u8,
    mix: Mix,
    name: &str,
    core: bool,
) -> Result<ThroughputResult, BenchError> {
    // A layout the run cannot use fails before anything is preloaded. The ceiling reads as the
    // reference passthrough does (`COLLAB_BENCH_PARTITIONED` is for the baseline).
    let (layout, work) = if core {
        (ReadLayout::Whole, Some(Arc::new(CoreWork::new(env)?)))
    } else {
        let layout = ReadLayout::from_env(env.settings.nats.partitions, env.names().shards())?;
        (layout, None)
    };
    env.provision().await?;
    let n = opts.messages;
    let label = format!("{id} {name}");
    let avg = preload(env, opts, mix, n, &label).await?;
    let pb = bar(opts, n as u64, &format!("{label}: run"));
    let started = Instant::now();
    let copy = start_passthrough(env, layout, work).await?;
    let (t0, mark0) = wait_first(
        || copy.progress.first.get().copied(),
        env,
        Duration::from_secs(30),
    )
    .await?;
    let mut watch = StallWatch::new();
    loop {
        let done = copy.progress.done.load(Ordering::Relaxed);
        pb.set_position(done);
        if done >= n as u64 {
            break;
        }
        if watch.stalled(done) {
            let _ = copy.stop().await;
            return Err(BenchError::Stalled(format!(
                "{done} of {n} copied, no progress for {} s",
                STALL.as_secs()
            )));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mark1 = CpuMark::now(env.server_pid());
    pb.finish_and_clear();
    let copy_outputs = copy.progress.outputs.load(Ordering::Relaxed);
    copy.stop().await?;
    let seconds = (mark1.at - t0).as_secs_f64();
    let (server, worker) = mark0.cores_until(&mark1);
    Ok(ThroughputResult {
        id,
        scenario: name.into(),
        inputs: n as u64,
        outputs: copy_outputs,
        dead_lettered: 0,
        avg_input_bytes: avg,
        seconds,
        msg_per_s: n as f64 / seconds,
        server_cpu_cores: server,
        worker_cpu_cores: worker,
        startup_s: (t0 - started).as_secs_f64(),
        // No pipeline state to count.
        ..ThroughputResult::default()
    })
}

/// How long a scenario may make no progress before it is reported as stalled.
const STALL: Duration = Duration::from_secs(60);

/// Notices when a progress counter stops moving.
struct StallWatch {
    last: u64,
    since: Instant,
}

impl StallWatch {
    fn new() -> StallWatch {
        StallWatch {
            last: 0,
            since: Instant::now(),
        }
    }

    fn stalled(&mut self, progress: u64) -> bool {
        if progress != self.last {
            self.last = progress;
            self.since = Instant::now();
        }
        self.since.elapsed() > STALL
    }
}

/// Generous: only guards against a hang.
fn stall_limit(n: usize) -> Duration {
    Duration::from_secs(120) + Duration::from_millis(n as u64 * 2)
}

/// Wait for the first input; returns its instant and a CPU mark taken then.
async fn wait_first(
    first: impl Fn() -> Option<Instant>,
    env: &Env,
    limit: Duration,
) -> Result<(Instant, CpuMark), BenchError> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(t) = first() {
            return Ok((t, CpuMark::now(env.server_pid())));
        }
        if Instant::now() > deadline {
            return Err(BenchError::Stalled(
                "the pipeline took no input within the time limit".into(),
            ));
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Scenarios 2 and 3: the full pipeline.

async fn start_app(
    opts: &BenchOptions,
    settings: Settings,
) -> Result<(app::Running, Arc<WorkerContext>, CancellationToken), BenchError> {
    let cancel = CancellationToken::new();
    let running = app::start(
        settings,
        RunOptions {
            workers: true,
            http: false,
            metrics: opts.metrics.clone(),
        },
        cancel.clone(),
    )
    .await?;
    let Some(shared) = running.worker.clone() else {
        return Err(BenchError::Stalled("the app started no worker".into()));
    };
    Ok((running, shared, cancel))
}

/// Cancel and wait for the drain, at most a minute: a pipeline that does not drain is reported,
/// not waited for forever (its tasks are left behind until the process exits).
async fn stop_app(running: app::Running, cancel: CancellationToken) {
    cancel.cancel();
    if tokio::time::timeout(Duration::from_secs(60), running.wait())
        .await
        .is_err()
    {
        tracing::warn!("the pipeline did not drain within 60 s of cancellation");
    }
}

/// What of the pipeline a throughput scenario runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    /// Everything, as `run` does.
    Full,
    /// No turn contract (`turns.enforce_roles = []`): its cost is the difference.
    WithoutContract,
    /// No work-session fold: its cost is the difference.
    WithoutFold,
}

impl Variant {
    /// The latency run's pipeline variant, `COLLAB_BENCH_LATENCY_VARIANT` (`full`, the default;
    /// `without-contract`; `without-fold`), for finding which layer a latency tail comes from.
    fn latency_from_env() -> Result<Variant, BenchError> {
        match std::env::var("COLLAB_BENCH_LATENCY_VARIANT") {
            Err(_) => Ok(Variant::Full),
            Ok(v) => match v.trim() {
                "" | "full" => Ok(Variant::Full),
                "without-contract" => Ok(Variant::WithoutContract),
                "without-fold" => Ok(Variant::WithoutFold),
                other => Err(BenchError::Setup(format!(
                    "COLLAB_BENCH_LATENCY_VARIANT={other:?}: use full, without-contract or without-fold"
                ))),
            },
        }
    }

    /// `settings` with this variant's layer switched off.
    fn apply(self, settings: &mut Settings) {
        match self {
            Variant::Full => {}
            Variant::WithoutContract => settings.turns.enforce_roles.clear(),
            Variant::WithoutFold => settings.workers.without_session_fold = true,
        }
    }
}

async fn throughput_pipeline(
    env: &Env,
    opts: &BenchOptions,
    id: u8,
    mix: Mix,
    name: &str,
    variant: Variant,
) -> Result<ThroughputResult, BenchError> {
    env.provision().await?;
    let n = opts.messages;
    let label = format!("{id} {name}");
    let avg = preload(env, opts, mix, n, &label).await?;
    let names = env.names();
    let kv0 = env
        .stream_last_seq(&format!("KV_{}", names.turns_bucket))
        .await;
    let pr0 = env
        .stream_last_seq(&format!("KV_{}", names.leases_bucket))
        .await;
    let ws0 = env
        .stream_last_seq(&format!("KV_{}", names.sessions_bucket))
        .await;
    let api0 = env.api_requests().await;
    let pb = bar(opts, n as u64, &format!("{label}: run"));
    let started = Instant::now();
    let mut settings = env.settings();
    variant.apply(&mut settings);
    let (running, shared, cancel) = start_app(opts, settings).await?;
    let state = shared.state.clone();
    let first: OnceLock<Instant> = OnceLock::new();
    let (t0, mark0) = wait_first(
        || {
            if state.inputs.load(Ordering::Relaxed) > 0 {
                Some(*first.get_or_init(Instant::now))
            } else {
                None
            }
        },
        env,
        Duration::from_secs(60),
    )
    .await?;
    let mut watch = StallWatch::new();
    let mark1 = loop {
        let inputs = state.inputs.load(Ordering::Relaxed);
        pb.set_position(inputs.min(n as u64));
        if inputs >= n as u64 && env.drained().await {
            break CpuMark::now(env.server_pid());
        }
        let outputs =
            state.projected.load(Ordering::Relaxed) + state.dead_lettered.load(Ordering::Relaxed);
        if watch.stalled(inputs + outputs) {
            let detail = format!(
                "{inputs} of {n} inputs taken, {outputs} outputs, {} of {} partitions running; no progress for {} s",
                state.partitions_running.load(Ordering::Relaxed),
                env.settings.nats.partitions,
                STALL.as_secs()
            );
            pb.finish_and_clear();
            stop_app(running, cancel).await;
            return Err(BenchError::Stalled(detail));
        }
        tokio::time::sleep(Duration::from_millis(if inputs >= n as u64 {
            2
        } else {
            5
        }))
        .await;
    };
    pb.finish_and_clear();
    let outputs =
        state.projected.load(Ordering::Relaxed) + state.dead_lettered.load(Ordering::Relaxed);
    let dead = state.dead_lettered.load(Ordering::Relaxed);
    // What the inputs cost up to the clock's stop; what the fold still does comes after.
    let kv1 = env
        .stream_last_seq(&format!("KV_{}", names.turns_bucket))
        .await;
    let pr1 = env
        .stream_last_seq(&format!("KV_{}", names.leases_bucket))
        .await;
    let api1 = env.api_requests().await;
    let redelivered = env.redelivered(n as u64).await;
    let ws1 = env
        .stream_last_seq(&format!("KV_{}", names.sessions_bucket))
        .await;
    let fold_behind = if variant == Variant::WithoutFold {
        None
    } else {
        env.fold_behind().await
    };
    let folded = match fold_behind {
        Some(0) => Some((0.0, mark1)),
        Some(_) => env.fold_caught_up(&mark1).await,
        None => None,
    };
    stop_app(running, cancel).await;
    let session_value_avg_bytes = env
        .bytes_per_message(&format!("KV_{}", names.sessions_bucket))
        .await;
    let seconds = (mark1.at - t0).as_secs_f64();
    let (server, worker) = mark0.cores_until(&mark1);
    let (folded_server, folded_worker) = folded
        .as_ref()
        .map_or((None, None), |(_, end)| mark0.us_per_input_until(end, n));
    Ok(ThroughputResult {
        id,
        scenario: name.to_string(),
        inputs: n as u64,
        outputs,
        dead_lettered: dead,
        avg_input_bytes: avg,
        seconds,
        msg_per_s: n as f64 / seconds,
        server_cpu_cores: server,
        worker_cpu_cores: worker,
        startup_s: (t0 - started).as_secs_f64(),
        kv_turn_writes: kv0.zip(kv1).map(|(a, b)| b - a),
        lease_writes: pr0.zip(pr1).map(|(a, b)| b - a),
        kv_session_writes: ws0.zip(ws1).map(|(a, b)| b - a),
        session_value_avg_bytes,
        js_api_requests: api0.zip(api1).map(|(a, b)| b.saturating_sub(a)),
        redelivered,
        server_us_per_input: None,
        worker_us_per_input: None,
        state_writes_per_input: None,
        fold_behind,
        fold_catch_up_s: folded.as_ref().map(|(s, _)| *s),
        folded_server_us_per_input: folded_server,
        folded_worker_us_per_input: folded_worker,
    })
}

// ---------------------------------------------------------------------------------------------
// Scenario 4: one message per fetch.

async fn throughput_naive(env: &Env, opts: &BenchOptions) -> Result<ThroughputResult, BenchError> {
    env.provision().await?;
    let n = opts.naive_messages;
    let avg = preload(env, opts, Mix::REALISTIC, n, "4 naive").await?;
    let settings = env.settings();
    let names = env.names();
    let core = CoreWork::new(env)?;
    let (_client, js) = bus::connect(&env.url, Some(&settings.nats), 1024, "bench naive").await?;
    let stream = js.get_stream(&names.raw_stream).await.ctx("raw stream")?;
    let consumer: PullConsumer = stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some("bench-naive".into()),
            filter_subject: format!("{}.in.>", names.prefix),
            ack_policy: consumer::AckPolicy::Explicit,
            ack_wait: Duration::from_secs(30),
            ..Default::default()
        })
        .await
        .ctx("naive consumer")?;
    let pb = bar(opts, n as u64, "4 naive: run");
    let mut done = 0u64;
    let mut outputs = 0u64;
    let mut dead = 0u64;
    let mut t0 = None;
    let mut mark0 = None;
    let started = Instant::now();
    let deadline = Instant::now() + stall_limit(n) * 5;
    while done < n as u64 {
        if Instant::now() > deadline {
            return Err(BenchError::Stalled(format!(
                "naive: {done} of {n} before the time limit"
            )));
        }
        // With an expiry, so the client times out a request the server never answers (lost
        // with a dropped connection) instead of waiting for it forever.
        let mut batch = consumer
            .fetch()
            .max_messages(1)
            .expires(Duration::from_secs(1))
            .messages()
            .await
            .ctx("fetch")?;
        let Some(m) = batch.next().await else {
            continue;
        };
        let m = m.ctx("fetch")?;
        if t0.is_none() {
            t0 = Some(Instant::now());
            mark0 = Some(CpuMark::now(env.server_pid()));
        }
        let outs = core.project(&m).map_err(nats_err("message info"))?;
        for out in outs {
            js.send_publish(out.subject.clone(), unfenced(&out))
                .await
                .ctx("publish")?
                .await
                .ctx("publish ack")?;
            outputs += 1;
            if matches!(out.kind, pipeline::OutKind::DeadLetter(_)) {
                dead += 1;
            }
        }
        m.ack().await.ctx("ack")?;
        done += 1;
        if done % 100 == 0 {
            pb.set_position(done);
        }
    }
    let mark1 = CpuMark::now(env.server_pid());
    pb.finish_and_clear();
    let t0 = t0.unwrap_or(started);
    let mark0 = mark0.unwrap_or(mark1);
    let seconds = (mark1.at - t0).as_secs_f64();
    let (server, worker) = mark0.cores_until(&mark1);
    Ok(ThroughputResult {
        id: 4,
        scenario: "naive: 1 message per fetch".into(),
        inputs: done,
        outputs,
        dead_lettered: dead,
        avg_input_bytes: avg,
        seconds,
        msg_per_s: done as f64 / seconds,
        server_cpu_cores: server,
        worker_cpu_cores: worker,
        startup_s: (t0 - started).as_secs_f64(),
        // No pipeline state to count.
        ..ThroughputResult::default()
    })
}

// ---------------------------------------------------------------------------------------------
// Latency at a fixed rate.

/// One stored message as [`read_all`] reads it (headers only).
struct Stored {
    seq: u64,
    subject: String,
    /// The server's store time, µs since the epoch.
    at: i64,
    /// The sequence of the raw input an output names (`Collab-Source-Seq`).
    source_seq: Option<u64>,
    headers: Option<async_nats::HeaderMap>,
    /// A partition barrier, which provisioning writes, not the load.
    barrier: bool,
}

/// Every message of a stream (headers only).
async fn read_all(
    js: &jetstream::Context,
    stream: &str,
    filter: Option<String>,
) -> Result<Vec<Stored>, BenchError> {
    let mut s = js.get_stream(stream).await.ctx(stream)?;
    let info = s.info().await.ctx(stream)?;
    if info.state.messages == 0 {
        return Ok(Vec::new());
    }
    let last = info.state.last_sequence;
    let consumer = s
        .create_consumer(consumer::pull::OrderedConfig {
            headers_only: true,
            filter_subject: filter.unwrap_or_default(),
            ..Default::default()
        })
        .await
        .ctx(stream)?;
    let mut messages = consumer.messages().await.ctx(stream)?;
    let mut out = Vec::new();
    loop {
        let next = tokio::time::timeout(Duration::from_secs(3), messages.next()).await;
        let Ok(Some(Ok(m))) = next else { break };
        let Ok(info) = m.info() else { continue };
        let (seq, at, drained) = (
            info.stream_sequence,
            info.published.timestamp_micros(),
            info.pending == 0,
        );
        let source_seq = m
            .headers
            .as_ref()
            .and_then(|h| h.get(H_SOURCE_SEQ))
            .and_then(|v| v.as_str().parse().ok());
        let barrier = crate::bus::acker::is_barrier(&m);
        let subject = m.subject.to_string();
        out.push(Stored {
            seq,
            subject,
            at,
            source_seq,
            barrier,
            // Taken, not copied: the message is not used past here.
            headers: m.message.headers,
        });
        if seq >= last || drained {
            break;
        }
    }
    Ok(out)
}

enum UnderTest {
    Baseline(Passthrough),
    Pipeline(Box<app::Running>, Arc<WorkerContext>, CancellationToken),
}

async fn latency_run(env: &Env, opts: &BenchOptions, id: u8) -> Result<LatencyResult, BenchError> {
    // Checked before anything starts; the passthrough reads as the throughput baseline does
    // (`COLLAB_BENCH_PARTITIONED`).
    let layout = ReadLayout::from_env(env.settings.nats.partitions, env.names().shards())?;
    let variant = Variant::latency_from_env()?;
    env.provision().await?;
    let name = match (id, variant) {
        (1, _) => "baseline passthrough",
        (_, Variant::Full) => "full pipeline, mixed",
        (_, Variant::WithoutContract) => "pipeline, mixed, no contract",
        (_, Variant::WithoutFold) => "pipeline, mixed, no fold",
    };
    let under = if id == 1 {
        UnderTest::Baseline(start_passthrough(env, layout, None).await?)
    } else {
        let mut settings = env.settings();
        variant.apply(&mut settings);
        let (running, shared, cancel) = start_app(opts, settings).await?;
        let ready = Instant::now() + Duration::from_secs(60);
        while shared.state.partitions_running.load(Ordering::Relaxed)
            < usize::from(env.settings.nats.partitions)
        {
            if Instant::now() > ready {
                stop_app(running, cancel).await;
                return Err(BenchError::Stalled("partitions did not start".into()));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        UnderTest::Pipeline(Box::new(running), shared, cancel)
    };
    let rate = f64::from(opts.latency_rate.max(1));
    let total = (rate * opts.latency_duration.as_secs_f64()).round() as usize;
    let pb = bar(
        opts,
        total as u64,
        &format!("{id} latency @{}/s", opts.latency_rate),
    );
    // Acks are awaited by another task so a slow ack never delays the schedule.
    let (tx, mut rx) = mpsc::channel::<PublishAckFuture>(4096);
    let acks = tokio::spawn(async move {
        let mut failed = 0u64;
        while let Some(f) = rx.recv().await {
            if f.await.is_err() {
                failed += 1;
            }
        }
        failed
    });
    // What the raw streams held before the load (over shards, provisioning's barriers): the
    // passthrough copies those too.
    let mut stored_before = 0;
    for stream in &env.names().raw_streams {
        stored_before += env.stream_messages(stream).await;
    }
    let mut gen = generator(env, opts, Mix::REALISTIC);
    let mut queue: VecDeque<RawEvent> = VecDeque::new();
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let start = Instant::now();
    let mut sent = 0usize;
    while sent < total {
        tick.tick().await;
        let due = ((start.elapsed().as_secs_f64() * rate) as usize).min(total);
        while sent < due {
            if queue.is_empty() {
                queue.extend(gen.next_scenario());
            }
            let Some(ev) = queue.pop_front() else { break };
            let fut = publish_event(&env.js, ev).await?;
            let _ = tx.send(fut).await;
            sent += 1;
        }
        pb.set_position(sent as u64);
    }
    let publish_s = start.elapsed().as_secs_f64();
    drop(tx);
    let failed = acks.await.unwrap_or(0);
    pb.finish_and_clear();
    // Let the pipeline finish what was published.
    let wait_until = Instant::now() + Duration::from_secs(60);
    loop {
        let finished = match &under {
            UnderTest::Baseline(c) => {
                c.progress.done.load(Ordering::Relaxed) >= sent as u64 + stored_before
            }
            UnderTest::Pipeline(_, shared, _) => {
                shared.state.inputs.load(Ordering::Relaxed) >= sent as u64 && env.drained().await
            }
        };
        if finished || Instant::now() > wait_until {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    match under {
        UnderTest::Baseline(c) => c.stop().await?,
        UnderTest::Pipeline(running, _, cancel) => stop_app(*running, cancel).await,
    }
    let (raw_read, last_out) = inputs_and_outputs(env, id == 1).await?;
    if let Some(path) = &opts.latency_samples {
        write_latency_samples(path, id, &raw_read, &last_out)?;
    }
    let mut lat: Vec<f64> = raw_read
        .iter()
        .filter_map(|(i, m)| {
            let done = last_out.get(&(*i, m.seq))?;
            Some((done - m.at) as f64 / 1000.0)
        })
        .collect();
    lat.sort_by(f64::total_cmp);
    if failed > 0 {
        say(opts, &format!("  latency {id}: {failed} publishes failed"));
    }
    Ok(LatencyResult {
        id,
        scenario: name.into(),
        target_rate: opts.latency_rate,
        achieved_rate: sent as f64 / publish_s,
        sent,
        measured: lat.len(),
        p50_ms: quantile(&lat, 0.50),
        p99_ms: quantile(&lat, 0.99),
        p999_ms: quantile(&lat, 0.999),
        max_ms: lat.last().copied().unwrap_or(0.0),
    })
}

/// Every input of a latency run in store order (its raw stream's index and its sequence there;
/// barriers left out), and the store time of each one's last output. Over shards every raw
/// stream numbers its own inputs, so an output names its input by its source sequence and a raw
/// stream: the passthrough's by its Msg-Id (`<stream>:<seq>`), the pipeline's as `audit` finds
/// it (a projection's by its subject's key, a dead letter's by its headers).
async fn inputs_and_outputs(env: &Env, passthrough: bool) -> Result<InputsAndOutputs, BenchError> {
    let names = env.names();
    let mut raw_read: Vec<(usize, Stored)> = Vec::new();
    for (i, stream) in names.raw_streams.iter().enumerate() {
        raw_read.extend(
            read_all(&env.js, stream, None)
                .await?
                .into_iter()
                .filter(|m| !m.barrier)
                .map(|m| (i, m)),
        );
    }
    raw_read.sort_by_key(|(_, m)| m.at);
    let raw: HashMap<(usize, u64), i64> =
        raw_read.iter().map(|(i, m)| ((*i, m.seq), m.at)).collect();
    let mut last_out: HashMap<(usize, u64), i64> = HashMap::new();
    for (stream, dead_letters) in [(&names.proj_stream, false), (&names.dlq_stream, true)] {
        for out in read_all(&env.js, stream, None).await? {
            let Some(seq) = out.source_seq else { continue };
            let shard = if names.raw_streams.len() == 1 {
                Some(0)
            } else {
                let input_stream = if passthrough {
                    out.headers
                        .as_ref()
                        .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
                        .and_then(|id| id.as_str().split_once(':'))
                        .map(|(stream, _)| stream.to_string())
                } else if dead_letters {
                    crate::ops::dead_letter_stream(&names, out.headers.as_ref())
                } else {
                    crate::ops::projection_input_stream(&names, &out.subject, seq)
                        .map(str::to_string)
                };
                input_stream.and_then(|s| names.raw_streams.iter().position(|n| *n == s))
            };
            let Some(input) = shard.map(|i| (i, seq)).filter(|k| raw.contains_key(k)) else {
                continue;
            };
            let e = last_out.entry(input).or_insert(out.at);
            *e = (*e).max(out.at);
        }
    }
    Ok((raw_read, last_out))
}

/// See [`inputs_and_outputs`].
type InputsAndOutputs = (Vec<(usize, Stored)>, HashMap<(usize, u64), i64>);

/// One line per measured input of latency run `id`, in store order: its raw sequence (in its own
/// raw stream, over shards), its raw store time and its latency (µs), its subject. Read against
/// the server's own events (a garbage collection, a block written out) it shows when a tail
/// happened and to what.
fn write_latency_samples(
    path: &std::path::Path,
    id: u8,
    raw: &[(usize, Stored)],
    last_out: &HashMap<(usize, u64), i64>,
) -> Result<(), BenchError> {
    use std::fmt::Write as _;
    let mut out = String::from("raw_seq,stored_us,latency_us,subject\n");
    for (shard, m) in raw {
        if let Some(done) = last_out.get(&(*shard, m.seq)) {
            let _ = writeln!(out, "{},{},{},{}", m.seq, m.at, done - m.at, m.subject);
        }
    }
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".{id}.csv"));
    std::fs::write(&name, out).map_err(|e| {
        BenchError::Setup(format!(
            "writing the latency samples to {}: {e}",
            std::path::Path::new(&name).display()
        ))
    })
}

// ---------------------------------------------------------------------------------------------
// Turn-book scale.

/// The facts of a realistic main-main send, as the worker reads them.
fn send_facts(i: usize, prefix: &str, stored_ms: i64, timeout_ms: u64) -> TurnFacts {
    let key = format!("open-{i}");
    let agents = ["ruda", "eden", "atlas", "main"];
    TurnFacts {
        kind: TurnEventKind::Send,
        conversation_id: key.clone(),
        subject: format!("{prefix}.raw.{key}.a2a.send"),
        key,
        turn: "0".into(),
        seq: i as u64 + 1,
        stored_ms,
        failure: None,
        failure_detail: None,
        from_agent: Some(agents[i % 4].into()),
        to_agent: Some(agents[(i + 1) % 4].into()),
        run_id: Some(format!("run-{i}")),
        target_session_key: None,
        work_session_id: None,
        a2a_method: None,
        goal: Some("review the deploy plan".into()),
        timeout_ms: Some(timeout_ms),
        exchange: turns::ExchangeKind::Turn,
        role: None,
        thread_id: None,
        follows_previous: false,
    }
}

fn open_record(
    i: usize,
    prefix: &str,
    partitions: u16,
    stored_ms: i64,
    timeout_ms: u64,
) -> (String, TurnRecord) {
    let cfg = TurnConfig {
        default_timeout: Duration::from_secs(300),
        max_timeout: Duration::from_secs(3600),
        run_timeout: Duration::from_secs(600),
        early_hold: Duration::from_secs(300),
    };
    let facts = send_facts(i, prefix, stored_ms, timeout_ms);
    let step = turns::on_event(None, &facts, &cfg);
    let rec = step.write.map(|(r, _)| r).unwrap_or_else(|| TurnRecord {
        exchange: turns::ExchangeKind::Turn,
        conversation_id: facts.conversation_id.clone(),
        key: facts.key.clone(),
        turn: facts.turn.clone(),
        state: turns::TurnState::Open,
        send: None,
        deadline_ms: None,
        winner: None,
        sender: None,
        target: None,
        writer: None,
        early: None,
    });
    let p = (i % usize::from(partitions.max(1))) as u16;
    (facts.record_key(p), rec)
}

/// RSS growth per open turn of the partition state, for each size in `sizes` (ascending),
/// built incrementally on a fresh thread (its own allocator arena) before anything else ran.
fn memory_model(sizes: &[usize], partitions: u16, kept: usize) -> Vec<(usize, Option<f64>)> {
    let mut sorted: Vec<usize> = sizes.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let parts = usize::from(partitions.max(1));
    let handle = std::thread::spawn(move || {
        let now = bus::now_ms();
        let mut model: Vec<OpenTurns<Rev>> = (0..parts).map(|_| OpenTurns::new(kept)).collect();
        let base = rss_bytes();
        let mut out = Vec::new();
        let mut built = 0usize;
        for n in sorted {
            while built < n {
                // As a partition owner does for a send: the record opened, its write's revision,
                // its deadline armed; the full record kept for the last sends only.
                let (key, rec) = open_record(built, "collab", partitions, now, 3_600_000);
                let p = &mut model[built % parts];
                p.open(
                    &key,
                    rec.deadline_ms,
                    Rev::Known(built as u64 + 1),
                    Some(rec),
                );
                built += 1;
            }
            let per = base
                .zip(rss_bytes())
                .map(|(b, a)| a.saturating_sub(b) as f64 / n as f64);
            out.push((n, per));
        }
        // Keep the model alive until the last measurement.
        let held: usize = model.iter().map(|p| p.len()).sum();
        drop(model);
        let _ = held;
        out
    });
    handle.join().unwrap_or_default()
}

/// Write `n` open turn records straight into the turns bucket (pipelined KV puts).
async fn write_open_turns(env: &Env, opts: &BenchOptions, n: usize) -> Result<(), BenchError> {
    let names = env.names();
    let pb = bar(opts, n as u64, &format!("turnbook {n}: write records"));
    let now = bus::now_ms();
    let mut publisher = Publisher::new(1000, false);
    for i in 0..n {
        let (key, rec) = open_record(i, &env.prefix, env.settings.nats.partitions, now, 3_600_000);
        let body = serde_json::to_vec(&rec).unwrap_or_default();
        let ev = RawEvent {
            subject: format!("$KV.{}.{key}", names.turns_bucket),
            body,
            headers: Vec::new(),
        };
        publisher.publish(&env.js, ev).await?;
        if i % 1000 == 0 {
            pb.set_position(i as u64);
        }
    }
    publisher.flush().await?;
    pb.finish_and_clear();
    Ok(())
}

/// Reload every partition's open turns the way a starting worker does (all partitions
/// concurrently), on a thread of its own. Returns (turns loaded, seconds).
async fn direct_reload(env: &Env) -> Result<(usize, f64), BenchError> {
    let js = env.js.clone();
    let settings = env.settings();
    let partitions = env.settings.nats.partitions;
    let failed = |detail: String| BenchError::Nats {
        what: "reload".into(),
        detail,
    };
    let thread = ThreadRuntime::start("collab-bench-reload").map_err(|e| failed(e.to_string()))?;
    let reload = thread
        .handle
        .spawn(async move {
            let shared = WorkerContext::new(js, settings)
                .await
                .map_err(|e| e.to_string())?;
            let cancel = CancellationToken::new();
            let t0 = Instant::now();
            let loaded = futures::future::join_all((0..partitions).map(|p| {
                let shared = shared.clone();
                let cancel = cancel.clone();
                async move {
                    let fence = reload_fence(&shared, p).await?;
                    let mut t = PartitionTurns::new(&shared, p, fence, shared.raw_names())
                        .await
                        .map_err(|e| e.to_string())?;
                    t.reload(&shared, &cancel)
                        .await
                        .map_err(|e| e.to_string())?;
                    Ok::<PartitionTurns, String>(t)
                }
            }))
            .await;
            let seconds = t0.elapsed().as_secs_f64();
            let mut open = 0;
            for t in &loaded {
                match t {
                    Ok(t) => open += t.open_turns(),
                    Err(e) => return Err(e.clone()),
                }
            }
            drop(loaded);
            Ok((open, seconds))
        })
        .await;
    match reload {
        Ok(Ok(r)) => Ok(r),
        Ok(Err(e)) => Err(failed(e)),
        Err(_) => Err(BenchError::Stalled("the reload thread died".into())),
    }
}

async fn turn_book(
    env: &Env,
    opts: &BenchOptions,
    n: usize,
    model: Option<f64>,
) -> Result<TurnBookResult, BenchError> {
    let mut r = TurnBookResult {
        open_turns: n,
        model_bytes_per_turn: model,
        lateness_probes: opts.lateness_probes,
        ..Default::default()
    };
    env.provision().await?;
    let t = Instant::now();
    write_open_turns(env, opts, n).await?;
    r.setup_s = Some(t.elapsed().as_secs_f64());
    r.stored_bytes_per_turn = env
        .bytes_per_message(&format!("KV_{}", env.names().turns_bucket))
        .await;

    // A worker's recovery: start until every partition runs (reload included).
    let pb = bar(
        opts,
        u64::from(env.settings.nats.partitions),
        &format!("turnbook {n}: recover"),
    );
    let t = Instant::now();
    let (running, shared, cancel) = start_app(opts, env.settings()).await?;
    let limit = Instant::now() + Duration::from_secs(600);
    loop {
        let up = shared.state.partitions_running.load(Ordering::Relaxed);
        pb.set_position(up as u64);
        if up >= usize::from(env.settings.nats.partitions) {
            r.worker_recovery_s = Some(t.elapsed().as_secs_f64());
            break;
        }
        if Instant::now() > limit {
            r.note = Some("the worker did not start every partition within 600 s".into());
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    pb.finish_and_clear();

    // Timer lateness with n turns open: probes with a short deadline, spread over ~5 s.
    if r.worker_recovery_s.is_some() && opts.lateness_probes > 0 {
        let probes = opts.lateness_probes;
        let timeout_ms = u64::try_from(opts.probe_timeout.as_millis()).unwrap_or(2000);
        let pb = bar(opts, probes as u64, &format!("turnbook {n}: probes"));
        let spacing = Duration::from_secs_f64(5.0 / probes as f64);
        let mut publisher = Publisher::new(500, true);
        let start = Instant::now();
        for i in 0..probes {
            let due = start + spacing * i as u32;
            tokio::time::sleep_until(due.into()).await;
            let conv = format!("late-{i}");
            let body = serde_json::json!({"type":"a2a.send","agentId":"ruda","ts":bus::now_ms(),"data":{
                "fromAgent":"ruda","toAgent":"eden","conversationId":conv,"runId":format!("run-late-{i}"),
                "message":"Please check the flaky integration test.","goal":"check the flaky integration test",
                "timeoutMs": timeout_ms,"fromSessionType":"main","toSessionType":"main"}});
            let ev = RawEvent {
                subject: format!("{}.raw.{conv}.a2a.send", env.prefix),
                body: serde_json::to_vec(&body).unwrap_or_default(),
                headers: Vec::new(),
            };
            publisher.publish(&env.js, ev).await?;
            pb.set_position(i as u64 + 1);
        }
        publisher.flush().await?;
        pb.finish_and_clear();
        // Each probe yields its send's projection and, after the deadline, its blocked response.
        let names = env.names();
        let wait_until = Instant::now() + opts.probe_timeout + Duration::from_secs(20);
        while env.stream_messages(&names.proj_stream).await < 2 * probes as u64
            && Instant::now() < wait_until
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let sends: HashMap<String, i64> = read_all(&env.js, &names.raw_stream, None)
            .await?
            .into_iter()
            .filter_map(|m| {
                let published = crate::pipeline::producer_subject(&names, &m.subject);
                let key = published.split('.').nth(2)?.to_string();
                key.starts_with("late-").then_some((key, m.at))
            })
            .collect();
        let responses = read_all(
            &env.js,
            &names.proj_stream,
            Some(format!(
                "{}.proj.conversation.main.*.a2a.response",
                env.prefix
            )),
        )
        .await?;
        let mut late: Vec<f64> = responses
            .into_iter()
            .filter_map(|m| {
                let key = m.subject.split('.').nth(4)?;
                let sent = sends.get(key)?;
                let deadline_us = sent + i64::try_from(timeout_ms).unwrap_or(0) * 1000;
                Some((m.at - deadline_us) as f64 / 1000.0)
            })
            .collect();
        late.sort_by(f64::total_cmp);
        r.lateness_answered = late.len();
        if !late.is_empty() {
            r.lateness_p50_ms = Some(quantile(&late, 0.5));
            r.lateness_p99_ms = Some(quantile(&late, 0.99));
            r.lateness_max_ms = late.last().copied();
        }
    }
    stop_app(running, cancel).await;
    drop(shared);

    // The reload alone, and the memory it holds.
    let (loaded, seconds) = direct_reload(env).await?;
    r.reloaded = Some(loaded);
    r.reload_s = Some(seconds);
    if loaded < n {
        let msg = format!("the reload found {loaded} of {n} open turns");
        r.note = Some(match r.note.take() {
            Some(prev) => format!("{prev}; {msg}"),
            None => msg,
        });
    }
    Ok(r)
}

// ---------------------------------------------------------------------------------------------
// Where the time goes: the pure core per input, and serial round trips.

fn core_costs(seed: u64) -> Result<CoreCosts, BenchError> {
    let settings = {
        let mut s = Settings::default();
        for agent in MAIN_AGENTS {
            s.roles.main_agents.push(agent.to_string());
        }
        s
    };
    let names = settings.names();
    let ing = settings.ingest()?;
    let corpus = |mix: Mix| -> Vec<(String, Vec<u8>)> {
        let mut gen = Generator::new("collab", seed, mix);
        let mut out = Vec::new();
        while out.len() < 20_000 {
            for ev in gen.next_scenario() {
                let stored = names.stored_subject(&ev.subject);
                out.push((stored, ev.body));
            }
        }
        out
    };
    let stored_at = chrono::Utc::now();
    let mixed = corpus(Mix::REALISTIC);
    let t = Instant::now();
    for (i, (subject, body)) in mixed.iter().enumerate() {
        let r = RawMessage {
            bytes: body,
            stream: "COLLAB_RAW",
            seq: i as u64 + 1,
            stored_subject: subject,
            stored_at,
            delivered: 1,
            headers: None,
            producer: Default::default(),
        };
        std::hint::black_box(pipeline::project(&r, &names, &ing, 10));
    }
    let mixed_us = t.elapsed().as_secs_f64() * 1e6 / mixed.len() as f64;

    let turn_corpus = corpus(Mix::TURNS_ONLY);
    let cfg = TurnConfig {
        default_timeout: settings.turns.default_timeout,
        max_timeout: settings.turns.max_timeout,
        run_timeout: settings.runs.timeout,
        early_hold: settings.turns.early_hold,
    };
    let t = Instant::now();
    for (i, (subject, body)) in turn_corpus.iter().enumerate() {
        let r = RawMessage {
            bytes: body,
            stream: "COLLAB_RAW",
            seq: i as u64 + 1,
            stored_subject: subject,
            stored_at,
            delivered: 1,
            headers: None,
            producer: Default::default(),
        };
        let Ok(events) = pipeline::normalize_raw(&r, &names, &ing, 10) else {
            continue;
        };
        for n in &events {
            // The worker's own rule and facts (read from the object the normaliser parsed).
            let enforce = &settings.turns.enforce_roles;
            let Some(f) = pipeline::turn_facts(n, &r, &names, enforce) else {
                std::hint::black_box(pipeline::projection(&names, n, r.seq, String::new()));
                continue;
            };
            let step = turns::on_event(None, &f, &cfg);
            std::hint::black_box(step.write.map(|(rec, _)| serde_json::to_vec(&rec)));
            std::hint::black_box(pipeline::projection(
                &names,
                n,
                r.seq,
                format!("COLLAB_RAW:{}:0", r.seq),
            ));
        }
    }
    let turns_us = t.elapsed().as_secs_f64() * 1e6 / turn_corpus.len() as f64;
    Ok(CoreCosts {
        mixed_us,
        turns_us,
        turn_reparse_us: 0.0,
    })
}

async fn round_trips(env: &Env) -> Result<RoundTrips, BenchError> {
    env.provision().await?;
    let names = env.names();
    let kv = env
        .js
        .get_key_value(&names.turns_bucket)
        .await
        .ctx("turns bucket")?;
    const N: usize = 500;
    let mut revs = Vec::with_capacity(N);
    let t = Instant::now();
    for i in 0..N {
        revs.push(
            kv.create(format!("rt.{i}"), bytes::Bytes::from_static(b"{}"))
                .await
                .ctx("kv create")?,
        );
    }
    let create = t.elapsed();
    let t = Instant::now();
    for (i, rev) in revs.iter().enumerate() {
        kv.update(
            format!("rt.{i}"),
            bytes::Bytes::from_static(b"{\"a\":1}"),
            *rev,
        )
        .await
        .ctx("kv update")?;
    }
    let update = t.elapsed();
    let t = Instant::now();
    for i in 0..N {
        std::hint::black_box(kv.entry(format!("rt.{i}")).await.ctx("kv get")?);
    }
    let get = t.elapsed();
    let t = Instant::now();
    for i in 0..N {
        env.js
            .publish(
                format!("{}.proj.rt.{i}", env.prefix),
                bytes::Bytes::from_static(b"{}"),
            )
            .await
            .ctx("publish")?
            .await
            .ctx("publish ack")?;
    }
    let publish = t.elapsed();
    let us = |d: Duration| d.as_secs_f64() * 1e6 / N as f64;
    Ok(RoundTrips {
        kv_get_us: us(get),
        kv_create_us: us(create),
        kv_update_us: us(update),
        publish_us: us(publish),
    })
}

// ---------------------------------------------------------------------------------------------
// The run.

/// Run the selected parts and return everything measured. Ctrl-C or SIGTERM stops the run and the
/// servers it started.
pub async fn run(opts: BenchOptions) -> Result<BenchReport, BenchError> {
    // Dropping the run on a signal drops its servers, which stops them.
    tokio::select! {
        r = run_parts(opts) => r,
        _ = app::shutdown_signal() => Err(BenchError::Interrupted),
    }
}

/// A scenario that stalled is reported in the notes and the run goes on; other errors stop it.
fn stalled<T>(
    r: Result<T, BenchError>,
    what: &str,
    notes: &mut Vec<String>,
) -> Result<Option<T>, BenchError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(BenchError::Stalled(detail)) => {
            notes.push(format!("{what} stalled: {detail}"));
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

async fn run_parts(opts: BenchOptions) -> Result<BenchReport, BenchError> {
    let configured = Settings::load_with(None, |_| {})?;
    let shards = configured.nats.shards;
    let sharded_parts = [
        Part::Baseline,
        Part::Mixed,
        Part::Turns,
        Part::Breakdown,
        Part::Latency,
        Part::Protocols,
    ];
    if shards > 1 && opts.parts.iter().any(|p| !sharded_parts.contains(p)) {
        return Err(BenchError::Setup(format!(
            "over {shards} raw streams the bench measures throughput and latency only: run it with --only baseline,mixed,turns,latency (and breakdown)"
        )));
    }
    let wall = Instant::now();
    let mut report = empty_report(&opts, loadavg(), configured.workers.fold_niceness);
    // Memory first: a fresh process has no freed memory that would hide the growth.
    let model = measure_in_process(&opts, configured.turns.kept_records, &mut report).await;
    let mut version = None;
    run_throughput(&opts, &mut report, &mut version).await?;
    run_latency(&opts, &mut report, &mut version).await?;
    run_turn_books(&opts, &model, &mut report, &mut version).await?;
    run_comparisons(&opts, &mut report, &mut version).await?;
    report.machine.server_version = version.unwrap_or_default();
    report.machine.load_end = loadavg();
    report.machine.wall_seconds = wall.elapsed().as_secs_f64();
    finish(&mut report);
    Ok(report)
}

/// A report with the machine described and nothing measured yet.
fn empty_report(opts: &BenchOptions, load_start: [f64; 3], fold_niceness: u8) -> BenchReport {
    BenchReport {
        machine: MachineInfo {
            cores: std::thread::available_parallelism().map_or(1, usize::from),
            load_start,
            load_end: [0.0; 3],
            server_version: String::new(),
            server: match &opts.nats_url {
                Some(url) => format!("external {url} (a fresh prefix per scenario; no server CPU)"),
                None => "nats-server started by bench, a fresh one per scenario".into(),
            },
            partitions: opts.partitions,
            wall_seconds: 0.0,
            build: Build::current(),
            fold_niceness,
        },
        throughput: Vec::new(),
        ratios: Ratios::default(),
        latency: Vec::new(),
        turn_book: Vec::new(),
        core_costs: None,
        round_trips: None,
        targets: Vec::new(),
        notes: Vec::new(),
    }
}

/// The in-process measurements: memory per open turn (returned, by turn-book size), each
/// partition keeping `kept_records` whole records as configured (`turns.kept_records`), and the
/// pure core's cost per input (into the report).
async fn measure_in_process(
    opts: &BenchOptions,
    kept_records: usize,
    report: &mut BenchReport,
) -> HashMap<usize, Option<f64>> {
    let mut model: HashMap<usize, Option<f64>> = HashMap::new();
    if opts.parts.contains(&Part::TurnBook) && !opts.open_turns.is_empty() {
        say(opts, "turn book: measuring memory per open turn");
        let sizes = opts.open_turns.clone();
        let parts = opts.partitions;
        let m = tokio::task::spawn_blocking(move || memory_model(&sizes, parts, kept_records))
            .await
            .unwrap_or_default();
        model.extend(m);
    }
    if opts.parts.contains(&Part::Mixed) || opts.parts.contains(&Part::Turns) {
        let seed = opts.seed;
        report.core_costs = tokio::task::spawn_blocking(move || core_costs(seed))
            .await
            .ok()
            .and_then(Result::ok);
    }
    model
}

/// A scenario's environment; the first one opened names the server's version.
async fn open_env(
    opts: &BenchOptions,
    tag: &str,
    version: &mut Option<String>,
) -> Result<Env, BenchError> {
    let env = Env::new(opts, tag).await?;
    if version.is_none() {
        *version = Some(env.client.server_info().version);
    }
    Ok(env)
}

/// Scenarios 1 to 4: the baseline, the full pipeline (mixed, turns only) and the naive one.
async fn run_throughput(
    opts: &BenchOptions,
    report: &mut BenchReport,
    version: &mut Option<String>,
) -> Result<(), BenchError> {
    if opts.parts.contains(&Part::Baseline) {
        let env = open_env(opts, "base", version).await?;
        let r = throughput_baseline(&env, opts).await;
        env.close().await;
        keep_throughput(opts, report, "1 baseline passthrough", r)?;
    }
    let pipelines = [
        (
            Part::Mixed,
            2u8,
            Mix::REALISTIC,
            "full pipeline, mixed",
            Variant::Full,
        ),
        (
            Part::Turns,
            3,
            Mix::TURNS_ONLY,
            "full pipeline, turns only",
            Variant::Full,
        ),
    ];
    for (part, id, mix, name, variant) in pipelines {
        if !opts.parts.contains(&part) {
            continue;
        }
        let env = open_env(opts, part.as_str(), version).await?;
        let r = throughput_pipeline(&env, opts, id, mix, name, variant).await;
        if part == Part::Turns && r.is_ok() {
            report.round_trips = Some(round_trips(&env).await?);
        }
        env.close().await;
        keep_throughput(opts, report, &format!("{id} {name}"), r)?;
    }
    if opts.parts.contains(&Part::Naive) {
        let env = open_env(opts, "naive", version).await?;
        let r = throughput_naive(&env, opts).await;
        env.close().await;
        keep_throughput(opts, report, "4 naive", r)?;
    }
    Ok(())
}

/// The latency runs of scenarios 1 and 2.
async fn run_latency(
    opts: &BenchOptions,
    report: &mut BenchReport,
    version: &mut Option<String>,
) -> Result<(), BenchError> {
    if !opts.parts.contains(&Part::Latency) {
        return Ok(());
    }
    for id in [1u8, 2] {
        let env = open_env(opts, &format!("lat{id}"), version).await?;
        let r = latency_run(&env, opts, id).await;
        env.close().await;
        if let Some(r) = stalled(r, &format!("{id} latency"), &mut report.notes)? {
            say(
                opts,
                &format!(
                    "{id} latency @{}/s: p50 {:.1} ms, p99 {:.1} ms",
                    r.target_rate, r.p50_ms, r.p99_ms
                ),
            );
            report.latency.push(r);
        }
    }
    Ok(())
}

/// One turn-book run per size asked for, smallest first; `model` holds the memory per open turn
/// measured in process.
async fn run_turn_books(
    opts: &BenchOptions,
    model: &HashMap<usize, Option<f64>>,
    report: &mut BenchReport,
    version: &mut Option<String>,
) -> Result<(), BenchError> {
    if !opts.parts.contains(&Part::TurnBook) {
        return Ok(());
    }
    let mut sizes = opts.open_turns.clone();
    sizes.sort_unstable();
    sizes.dedup();
    for n in sizes {
        let mut env = open_env(opts, &format!("book{n}"), version).await?;
        // The turn book measures the worker's state at scale, not the configured storage limit:
        // its bucket gets room for the records it writes (1 KiB each, about three times what
        // one takes).
        let room = i64::try_from(n).unwrap_or(i64::MAX).saturating_mul(1024);
        let limit = &mut env.settings.storage.turns_max_bytes;
        *limit = (*limit).max(room);
        let r = turn_book(&env, opts, n, model.get(&n).copied().flatten()).await;
        env.close().await;
        if let Some(r) = stalled(r, &format!("turn book {n}"), &mut report.notes)? {
            say(
                opts,
                &format!(
                    "turn book {n}: recovery {} s, lateness p99 {} ms",
                    opt(r.worker_recovery_s, 2),
                    opt(r.lateness_p99_ms, 0)
                ),
            );
            report.turn_book.push(r);
        }
    }
    Ok(())
}

/// Scenarios 5 to 8 (`breakdown`: 2 and 3 without the turn contract, then without the
/// work-session fold), 9 and 10 (`ceiling`: the passthrough doing the pure core) and 11
/// (`protocols`: the full pipeline on every input format).
async fn run_comparisons(
    opts: &BenchOptions,
    report: &mut BenchReport,
    version: &mut Option<String>,
) -> Result<(), BenchError> {
    use Variant::{WithoutContract, WithoutFold};
    let runs = [
        (
            Part::Breakdown,
            5u8,
            Mix::REALISTIC,
            "2 without the turn contract",
            Some(WithoutContract),
        ),
        (
            Part::Breakdown,
            6,
            Mix::TURNS_ONLY,
            "3 without the turn contract",
            Some(WithoutContract),
        ),
        (
            Part::Breakdown,
            7,
            Mix::REALISTIC,
            "2 without the session fold",
            Some(WithoutFold),
        ),
        (
            Part::Breakdown,
            8,
            Mix::TURNS_ONLY,
            "3 without the session fold",
            Some(WithoutFold),
        ),
        (
            Part::Ceiling,
            9,
            Mix::REALISTIC,
            "ceiling: core only, mixed",
            None,
        ),
        (
            Part::Ceiling,
            10,
            Mix::TURNS_ONLY,
            "ceiling: core only, turns",
            None,
        ),
        (
            Part::Protocols,
            11,
            Mix::DEMO,
            "full pipeline, all formats",
            Some(Variant::Full),
        ),
    ];
    for (part, id, mix, name, variant) in runs {
        if !opts.parts.contains(&part) {
            continue;
        }
        let env = open_env(opts, &format!("{}{id}", part.as_str()), version).await?;
        let r = match variant {
            Some(variant) => throughput_pipeline(&env, opts, id, mix, name, variant).await,
            None => throughput_copy(&env, opts, id, mix, name, true).await,
        };
        env.close().await;
        keep_throughput(opts, report, &format!("{id} {name}"), r)?;
    }
    Ok(())
}

/// Keeps a throughput scenario's result and says its rate; a stalled one becomes a note.
fn keep_throughput(
    opts: &BenchOptions,
    report: &mut BenchReport,
    label: &str,
    r: Result<ThroughputResult, BenchError>,
) -> Result<(), BenchError> {
    if let Some(r) = stalled(r, label, &mut report.notes)? {
        say(opts, &format!("{label}: {:.0} msg/s", r.msg_per_s));
        report.throughput.push(r);
    }
    Ok(())
}

/// Ratios, targets and notes from the measurements.
fn finish(report: &mut BenchReport) {
    report
        .throughput
        .iter_mut()
        .for_each(ThroughputResult::derive_per_input);
    let rate = |id: u8| {
        report
            .throughput
            .iter()
            .find(|t| t.id == id)
            .map(|t| t.msg_per_s)
    };
    let (base, mixed, turns_only, naive) = (rate(1), rate(2), rate(3), rate(4));
    report.ratios = Ratios {
        mixed_over_baseline: mixed.zip(base).map(|(a, b)| a / b),
        turns_over_baseline: turns_only.zip(base).map(|(a, b)| a / b),
        baseline_over_naive: base.zip(naive).map(|(a, b)| a / b),
        ceiling_mixed_over_baseline: rate(9).zip(base).map(|(a, b)| a / b),
        ceiling_turns_over_baseline: rate(10).zip(base).map(|(a, b)| a / b),
        protocols_over_baseline: rate(11).zip(base).map(|(a, b)| a / b),
    };
    let mut targets = Vec::new();
    let mut ratio_target = |name: &str, v: Option<f64>, min: f64| {
        targets.push(TargetResult {
            target: format!("{name} >= {min}x"),
            measured: v.map_or("not measured".into(), |v| format!("{v:.2}x")),
            met: v.map(|v| v >= min),
        });
    };
    ratio_target("mixed / baseline", report.ratios.mixed_over_baseline, 0.8);
    ratio_target(
        "turn-only / baseline",
        report.ratios.turns_over_baseline,
        0.7,
    );
    ratio_target("baseline / naive", report.ratios.baseline_over_naive, 20.0);
    let p99 = |id: u8| report.latency.iter().find(|l| l.id == id).map(|l| l.p99_ms);
    let lat = p99(2).zip(p99(1));
    targets.push(TargetResult {
        target: "p99 latency, mixed <= 2x baseline's at the same rate".into(),
        measured: lat.map_or("not measured".into(), |(m, b)| {
            format!("{m:.1} ms vs {b:.1} ms ({:.2}x)", m / b.max(1e-9))
        }),
        met: lat.map(|(m, b)| m <= 2.0 * b),
    });
    let book = |n: usize| report.turn_book.iter().find(|t| t.open_turns == n);
    let b100 = book(100_000);
    // Recovery and lateness "with N open" hold only if the worker really had N turns open.
    let partial = b100.and_then(|b| {
        b.reloaded
            .filter(|r| *r < b.open_turns)
            .map(|r| format!(" (invalid: only {r} of {} reloaded)", b.open_turns))
    });
    let judged = |v: Option<f64>, ok: fn(f64) -> bool| match (&partial, v) {
        (Some(_), Some(_)) => None,
        (None, Some(v)) => Some(ok(v)),
        (_, None) => None,
    };
    let late = b100.and_then(|b| b.lateness_p99_ms);
    targets.push(TargetResult {
        target: "timer lateness p99 <= 250 ms with 100k open".into(),
        measured: late.map_or("not measured".into(), |v| {
            format!("{v:.0} ms{}", partial.clone().unwrap_or_default())
        }),
        met: judged(late, |v| v <= 250.0),
    });
    let mem = b100.and_then(|b| b.model_bytes_per_turn);
    targets.push(TargetResult {
        target: "<= 300 bytes per open turn (100k open)".into(),
        measured: mem.map_or("not measured".into(), |v| format!("{v:.0} B")),
        met: mem.map(|v| v <= 300.0),
    });
    let rec = b100.and_then(|b| b.worker_recovery_s);
    targets.push(TargetResult {
        target: "100k open turns recovered <= 3 s".into(),
        measured: rec.map_or("not measured".into(), |v| {
            format!("{v:.2} s{}", partial.clone().unwrap_or_default())
        }),
        met: judged(rec, |v| v <= 3.0),
    });
    let rec_1m = book(1_000_000).and_then(|b| {
        b.worker_recovery_s
            .filter(|_| b.reloaded.is_none_or(|r| r >= b.open_turns))
    });
    targets.push(TargetResult {
        target: "1M open turns recovered <= 10 s".into(),
        measured: rec_1m.map_or("not measured".into(), |v| format!("{v:.2} s")),
        met: rec_1m.map(|v| v <= 10.0),
    });
    report.targets = targets;
    if report.machine.build == Build::Debug {
        report.notes.push(
            "a debug build: unoptimised, so its rates are a fraction of a release build's; run \
             `cargo run --release -- bench` (or target/release/collab-projector bench)"
                .into(),
        );
    }
    if report.machine.load_start[0] > 1.5 {
        report.notes.push(format!(
            "load average was {:.2} at the start: other work on the machine affects these figures",
            report.machine.load_start[0]
        ));
    }
    for t in &report.turn_book {
        if let Some(n) = &t.note {
            report
                .notes
                .push(format!("turn book {}: {n}", t.open_turns));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Output.

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or("-".into(), |v| format!("{v:.digits$}"))
}

/// The report as a plain-text table.
pub fn render(report: &BenchReport) -> String {
    let mut s = String::new();
    render_machine(&mut s, &report.machine);
    if !report.throughput.is_empty() {
        render_throughput(&mut s, &report.throughput, &report.ratios);
    }
    if !report.latency.is_empty() {
        render_latency(&mut s, &report.latency);
    }
    if !report.turn_book.is_empty() {
        render_turn_book(&mut s, &report.turn_book);
    }
    render_costs(
        &mut s,
        report.core_costs.as_ref(),
        report.round_trips.as_ref(),
    );
    render_targets(&mut s, &report.targets, &report.notes);
    let _ = writeln!(s, "{}", summary_line(report));
    s
}

/// The first lines: the machine and the server.
fn render_machine(s: &mut String, m: &MachineInfo) {
    let _ = writeln!(
        s,
        "collab-projector bench: {} cores, nats-server {}, {} partitions, {} build, fold niceness {}, load {:.2} at start ({:.2} at end), {:.0} s",
        m.cores,
        m.server_version,
        m.partitions,
        m.build,
        m.fold_niceness,
        m.load_start[0],
        m.load_end[0],
        m.wall_seconds
    );
    let _ = writeln!(s, "server: {}", m.server);
}

/// The throughput table and the ratios between its scenarios.
fn render_throughput(s: &mut String, throughput: &[ThroughputResult], r: &Ratios) {
    let _ = writeln!(
        s,
        "\nThroughput (preloaded, clock from first input to all acknowledged)"
    );
    let _ = writeln!(
        s,
        "{:<3} {:<28} {:>8} {:>8} {:>7} {:>9} {:>7} {:>7} {:>8} {:>8} {:>8} {:>9} {:>8} {:>7} {:>7} {:>7} {:>7} {:>9}",
        "#",
        "scenario",
        "inputs",
        "outputs",
        "secs",
        "msg/s",
        "srv cpu",
        "wkr cpu",
        "turn kv",
        "lease kv",
        "session",
        "session B",
        "JS API",
        "redeliv",
        "srv µs",
        "wkr µs",
        "st/in",
        "fold lag"
    );
    for t in throughput {
        let _ = writeln!(
            s,
            "{:<3} {:<28} {:>8} {:>8} {:>7.2} {:>9.0} {:>7} {:>7} {:>8} {:>8} {:>8} {:>9} {:>8} {:>7} {:>7} {:>7} {:>7} {:>9}",
            t.id,
            t.scenario,
            t.inputs,
            t.outputs,
            t.seconds,
            t.msg_per_s,
            opt(t.server_cpu_cores, 2),
            opt(t.worker_cpu_cores, 2),
            t.kv_turn_writes.map_or("-".into(), |v| v.to_string()),
            t.lease_writes.map_or("-".into(), |v| v.to_string()),
            t.kv_session_writes.map_or("-".into(), |v| v.to_string()),
            opt(t.session_value_avg_bytes, 0),
            t.js_api_requests.map_or("-".into(), |v| v.to_string()),
            t.redelivered.map_or("-".into(), |v| v.to_string()),
            opt(t.server_us_per_input, 1),
            opt(t.worker_us_per_input, 1),
            opt(t.state_writes_per_input, 2),
            t.fold_behind.map_or("-".into(), |v| v.to_string()),
        );
    }
    for t in throughput
        .iter()
        .filter(|t| t.fold_behind.is_some_and(|b| b > 0))
    {
        let _ = writeln!(
            s,
            "{}: the work-session fold was {} projections behind when the clock stopped; {}",
            t.id,
            t.fold_behind.unwrap_or(0),
            match t.fold_catch_up_s {
                Some(secs) => format!(
                    "it read the last {secs:.1} s later; up to then, srv / wkr µs per input {} / {}",
                    opt(t.folded_server_us_per_input, 1),
                    opt(t.folded_worker_us_per_input, 1)
                ),
                None => format!(
                    "it had not read the last {} s later",
                    FOLD_CATCH_UP_LIMIT.as_secs()
                ),
            }
        );
    }
    let _ = writeln!(
        s,
        "ratios: 2/1 {}   3/1 {}   1/4 {}   9/1 {}   10/1 {}   11/1 {}",
        opt(r.mixed_over_baseline, 2),
        opt(r.turns_over_baseline, 2),
        opt(r.baseline_over_naive, 1),
        opt(r.ceiling_mixed_over_baseline, 2),
        opt(r.ceiling_turns_over_baseline, 2),
        opt(r.protocols_over_baseline, 2)
    );
}

/// The latency table.
fn render_latency(s: &mut String, latency: &[LatencyResult]) {
    let _ = writeln!(
        s,
        "\nEnd-to-end latency (raw store time -> last output store time)"
    );
    let _ = writeln!(
        s,
        "{:<3} {:<28} {:>7} {:>9} {:>8} {:>8} {:>8} {:>8} {:>8}",
        "#", "scenario", "rate", "achieved", "measured", "p50 ms", "p99 ms", "p999 ms", "max ms"
    );
    for l in latency {
        let _ = writeln!(
            s,
            "{:<3} {:<28} {:>7} {:>9.0} {:>8} {:>8.1} {:>8.1} {:>8.1} {:>8.1}",
            l.id,
            l.scenario,
            l.target_rate,
            l.achieved_rate,
            l.measured,
            l.p50_ms,
            l.p99_ms,
            l.p999_ms,
            l.max_ms
        );
    }
}

/// The turn-book table.
fn render_turn_book(s: &mut String, books: &[TurnBookResult]) {
    let _ = writeln!(s, "\nTurn book scale");
    let _ = writeln!(
        s,
        "{:>9} {:>10} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "open",
        "bytes per",
        "stored B",
        "worker",
        "reload",
        "reloaded",
        "late p50",
        "late p99",
        "late max"
    );
    let _ = writeln!(
        s,
        "{:>9} {:>10} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "turns", "open turn", "per turn", "recovery", "alone", "", "ms", "ms", "ms"
    );
    for t in books {
        let _ = writeln!(
            s,
            "{:>9} {:>10} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
            t.open_turns,
            opt(t.model_bytes_per_turn, 0),
            opt(t.stored_bytes_per_turn, 0),
            opt(t.worker_recovery_s, 2),
            opt(t.reload_s, 2),
            t.reloaded.map_or("-".into(), |v| v.to_string()),
            opt(t.lateness_p50_ms, 0),
            opt(t.lateness_p99_ms, 0),
            opt(t.lateness_max_ms, 0),
        );
    }
    if let Some(t) = books.first() {
        let _ = writeln!(
            s,
            "recovery and reload in seconds; lateness of synthesised timeouts: {} of {} probes answered (first run)",
            t.lateness_answered, t.lateness_probes
        );
    }
}

/// The in-process core cost and the serial round trips, when measured.
fn render_costs(s: &mut String, core: Option<&CoreCosts>, round_trips: Option<&RoundTrips>) {
    if let Some(c) = core {
        let _ = writeln!(
            s,
            "\nPure core per input (in-process): mixed {:.1} µs, turn-only {:.1} µs (turn facts read from the one parse)",
            c.mixed_us, c.turns_us
        );
    }
    if let Some(r) = round_trips {
        let _ = writeln!(
            s,
            "Serial round trips on a quiet server: KV get {:.0} µs, KV create {:.0} µs, KV update {:.0} µs, publish+ack {:.0} µs",
            r.kv_get_us, r.kv_create_us, r.kv_update_us, r.publish_us
        );
    }
}

/// The targets with their verdicts, then the notes.
fn render_targets(s: &mut String, targets: &[TargetResult], notes: &[String]) {
    let _ = writeln!(s, "\nTargets");
    for t in targets {
        let verdict = match t.met {
            Some(true) => "met",
            Some(false) => "NOT met",
            None if t.measured.contains("invalid") => "not valid",
            None => "not measured",
        };
        let _ = writeln!(s, "  {:<56} {:<28} {}", t.target, t.measured, verdict);
    }
    for n in notes {
        let _ = writeln!(s, "note: {n}");
    }
}

/// The run in one line a script can read: `bench-summary` then `key=value` pairs, a value `-`
/// when its scenario did not run. The keys are stable (docs/performance.md lists them):
/// `load` (1-minute load average at the start), `baseline`, `mixed`, `turns` (msg/s),
/// `mixed_ratio`, `turns_ratio` (over the baseline), `p99_ms`, `p99_base_ms`, `p99_ratio` (at the
/// latency runs' rate), `mixed_wkr_us`, `mixed_srv_us`, `turns_wkr_us`, `turns_srv_us` (CPU per
/// input), `ceiling_mixed`, `ceiling_turns` (msg/s of scenarios 9 and 10), `ceiling_mixed_ratio`,
/// `ceiling_turns_ratio` (over the baseline), `build` ([`Build`]: `debug`, `release`, `pgo`,
/// `pgo-instrumented`), `protocols`, `protocols_ratio` (scenario 11's msg/s and its ratio over
/// the baseline).
pub fn summary_line(report: &BenchReport) -> String {
    let num = |v: Option<f64>, digits: usize| {
        v.map_or_else(|| "-".to_string(), |v| format!("{v:.digits$}"))
    };
    let run = |id: u8| report.throughput.iter().find(|t| t.id == id);
    let lat = |id: u8| report.latency.iter().find(|l| l.id == id);
    let rate = |id: u8| num(run(id).map(|t| t.msg_per_s), 0);
    let p99 = |id: u8| lat(id).map(|l| l.p99_ms);
    let p99_ratio = match (p99(2), p99(1)) {
        (Some(p), Some(b)) if b > 0.0 => Some(p / b),
        _ => None,
    };
    let r = &report.ratios;
    [
        format!("load={:.2}", report.machine.load_start[0]),
        format!("baseline={}", rate(1)),
        format!("mixed={}", rate(2)),
        format!("turns={}", rate(3)),
        format!("mixed_ratio={}", num(r.mixed_over_baseline, 2)),
        format!("turns_ratio={}", num(r.turns_over_baseline, 2)),
        format!("p99_ms={}", num(p99(2), 1)),
        format!("p99_base_ms={}", num(p99(1), 1)),
        format!("p99_ratio={}", num(p99_ratio, 2)),
        format!(
            "mixed_wkr_us={}",
            num(run(2).and_then(|t| t.worker_us_per_input), 1)
        ),
        format!(
            "mixed_srv_us={}",
            num(run(2).and_then(|t| t.server_us_per_input), 1)
        ),
        format!(
            "turns_wkr_us={}",
            num(run(3).and_then(|t| t.worker_us_per_input), 1)
        ),
        format!(
            "turns_srv_us={}",
            num(run(3).and_then(|t| t.server_us_per_input), 1)
        ),
        format!("ceiling_mixed={}", rate(9)),
        format!("ceiling_turns={}", rate(10)),
        format!(
            "ceiling_mixed_ratio={}",
            num(r.ceiling_mixed_over_baseline, 2)
        ),
        format!(
            "ceiling_turns_ratio={}",
            num(r.ceiling_turns_over_baseline, 2)
        ),
        format!("build={}", report.machine.build),
        format!("protocols={}", rate(11)),
        format!("protocols_ratio={}", num(r.protocols_over_baseline, 2)),
    ]
    .into_iter()
    .fold("bench-summary".to_string(), |line, field| {
        line + " " + &field
    })
}

/// Several runs' summary lines (see [`summary_line`]) as one: `bench-median runs=<n>`, then each
/// key of the first line in its order with the median of its values over the runs that have one
/// (`-` where none has), printed with as many decimals as the first run gave it. Ratios are the
/// medians of each run's own ratio, not ratios of medians: each is taken between scenarios run
/// minutes apart, which is what keeps a slow phase of the host out of it. A field that some run
/// gives as text rather than a number or `-` (`build`) keeps its value when every run that has it
/// agrees, and reads `varied` otherwise. Lines that are not summary lines are ignored.
pub fn median_line(lines: &[String]) -> String {
    let runs: Vec<Vec<(&str, &str)>> = lines
        .iter()
        .filter_map(|l| l.strip_prefix("bench-summary "))
        .map(|l| {
            l.split_whitespace()
                .filter_map(|f| f.split_once('='))
                .collect()
        })
        .collect();
    let Some(first) = runs.first() else {
        return "bench-median runs=0".to_string();
    };
    let mut line = format!("bench-median runs={}", runs.len());
    for (key, shown) in first {
        let given: Vec<&str> = runs
            .iter()
            .filter_map(|r| r.iter().find(|(k, _)| k == key))
            .map(|(_, v)| *v)
            .collect();
        if given.iter().any(|v| *v != "-" && v.parse::<f64>().is_err()) {
            let shown = if given.iter().all(|v| v == shown) {
                shown
            } else {
                "varied"
            };
            line.push_str(&format!(" {key}={shown}"));
            continue;
        }
        let decimals = shown.split_once('.').map_or(0, |(_, d)| d.len());
        let mut values: Vec<f64> = given
            .iter()
            .filter_map(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite())
            .collect();
        values.sort_by(f64::total_cmp);
        let median = match values.len() {
            0 => None,
            n if n % 2 == 1 => Some(values[n / 2]),
            n => Some((values[n / 2 - 1] + values[n / 2]) / 2.0),
        };
        let shown = median.map_or_else(|| "-".to_string(), |m| format!("{m:.decimals$}"));
        line.push_str(&format!(" {key}={shown}"));
    }
    line
}

/// A claim on partition `p` for the reload measurement, as a worker makes when it takes the
/// partition.
async fn reload_fence(
    shared: &WorkerContext,
    p: u16,
) -> Result<crate::bus::publish::Fence, String> {
    crate::bus::publish::Fence::claim(&shared.js, &shared.names, p, "bench", false)
        .await
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_use_the_nearest_rank() {
        let v: Vec<f64> = (1..=1000).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), 500.0);
        assert_eq!(quantile(&v, 0.99), 990.0);
        assert_eq!(quantile(&v, 0.999), 999.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
        assert_eq!(quantile(&[7.0], 0.999), 7.0);
    }

    #[test]
    fn parts_parse_by_name() {
        assert_eq!("Mixed".parse::<Part>(), Ok(Part::Mixed));
        assert_eq!("turnbook".parse::<Part>(), Ok(Part::TurnBook));
        assert!("nope".parse::<Part>().is_err());
    }

    #[test]
    fn proc_readers_work_here() {
        assert!(cpu_seconds(None).is_some());
        assert!(rss_bytes().is_some_and(|b| b > 0));
    }

    #[test]
    fn open_records_are_open_with_a_deadline() {
        let (key, rec) = open_record(5, "collab", 64, 1_000, 60_000);
        assert_eq!(key, "p5.open-5.0");
        assert_eq!(rec.state, turns::TurnState::Open);
        assert_eq!(rec.deadline_ms, Some(61_000));
    }

    /// A report with every section filled.
    fn full_report() -> BenchReport {
        let mut r = BenchReport {
            machine: MachineInfo {
                cores: 2,
                load_start: [2.5, 1.0, 0.5],
                load_end: [1.25, 1.0, 0.5],
                server_version: "2.11.0".into(),
                server: "local".into(),
                partitions: 64,
                wall_seconds: 42.0,
                build: Build::Release,
                fold_niceness: 19,
            },
            throughput: [(1u8, 80_000.0), (2, 32_000.0), (3, 30_000.0), (4, 900.0)]
                .into_iter()
                .map(|(id, msg_per_s)| ThroughputResult {
                    id,
                    scenario: format!("scenario {id}"),
                    inputs: 10_000,
                    outputs: 12_000,
                    seconds: 1.5,
                    msg_per_s,
                    server_cpu_cores: Some(0.5),
                    worker_cpu_cores: Some(1.25),
                    kv_turn_writes: Some(100),
                    lease_writes: (id == 2).then_some(7),
                    js_api_requests: Some(3),
                    redelivered: Some(0),
                    ..ThroughputResult::default()
                })
                .collect(),
            ratios: Ratios::default(),
            latency: [1u8, 2]
                .into_iter()
                .map(|id| LatencyResult {
                    id,
                    scenario: format!("latency {id}"),
                    target_rate: 2_000,
                    achieved_rate: 1_999.4,
                    sent: 4_000,
                    measured: 3_999,
                    p50_ms: 1.5,
                    p99_ms: f64::from(id) * 4.0,
                    p999_ms: 12.0,
                    max_ms: 20.0,
                })
                .collect(),
            turn_book: [100_000usize, 1_000_000]
                .into_iter()
                .map(|open_turns| TurnBookResult {
                    open_turns,
                    model_bytes_per_turn: Some(210.0),
                    stored_bytes_per_turn: Some(362.4),
                    reloaded: Some(open_turns - 1),
                    worker_recovery_s: Some(2.5),
                    reload_s: Some(1.0),
                    lateness_probes: 20,
                    lateness_answered: 19,
                    lateness_p99_ms: Some(120.0),
                    note: Some("a note".into()),
                    ..TurnBookResult::default()
                })
                .collect(),
            core_costs: Some(CoreCosts {
                mixed_us: 3.25,
                turns_us: 4.5,
                turn_reparse_us: 0.0,
            }),
            round_trips: Some(RoundTrips {
                kv_get_us: 100.0,
                kv_create_us: 200.0,
                kv_update_us: 210.0,
                publish_us: 150.0,
            }),
            targets: Vec::new(),
            notes: Vec::new(),
        };
        finish(&mut r);
        r
    }

    #[test]
    fn render_prints_every_section_a_report_has_in_order() {
        let text = render(&full_report());
        let mut at = 0;
        for heading in [
            "collab-projector bench: 2 cores, nats-server 2.11.0, 64 partitions, release build, fold niceness 19, load 2.50 at start (1.25 at end), 42 s",
            "server: local",
            "Throughput (preloaded",
            "2   scenario 2",
            "ratios: 2/1 0.40   3/1 0.38   1/4 88.9",
            "End-to-end latency",
            "2   latency 2",
            "Turn book scale",
            "   100000        210        362      2.50      1.00     99999",
            "19 of 20 probes answered",
            "Pure core per input (in-process): mixed 3.2 µs, turn-only 4.5 µs",
            "Serial round trips on a quiet server: KV get 100 µs",
            "Targets",
            "NOT met",
            "note: load average was 2.50 at the start",
            "note: turn book 100000: a note",
            "bench-summary load=2.50 baseline=80000",
        ] {
            let found = text[at..].find(heading);
            assert!(found.is_some(), "{heading:?} after byte {at} in\n{text}");
            at += found.unwrap_or_default();
        }
        // A release build's report says so in its summary and carries no debug-build note.
        assert!(text.contains(" build=release "), "{text}");
        assert!(!text.contains("a debug build"), "{text}");
    }

    #[test]
    fn rounds_are_summed_up_by_the_median_of_each_field() {
        let lines = [
            "bench-summary load=2.44 baseline=93234 mixed=42391 mixed_ratio=0.45 p99_ratio=6.24 ceiling_mixed=-",
            "progress and table lines are passed over",
            "bench-summary load=2.84 baseline=68583 mixed=28577 mixed_ratio=0.42 p99_ratio=3.86 ceiling_mixed=-",
            "bench-summary load=2.66 baseline=54480 mixed=28470 mixed_ratio=0.52 p99_ratio=- ceiling_mixed=-",
        ]
        .map(String::from);
        assert_eq!(
            median_line(&lines),
            "bench-median runs=3 load=2.66 baseline=68583 mixed=28577 mixed_ratio=0.45 p99_ratio=5.05 ceiling_mixed=-"
        );
        // Each ratio is the median of the runs' own ratios (0.45), not the median mixed rate over
        // the median baseline (28577 / 68583 = 0.42).
        assert_eq!(median_line(&[]), "bench-median runs=0");

        // A field given as text: kept when the runs agree, `varied` when they do not (a run that
        // gives it as `-` among them).
        let built = |kinds: [&str; 2]| {
            kinds.map(|k| format!("bench-summary load=1.00 mixed_ratio=0.40 build={k}"))
        };
        assert_eq!(
            median_line(&built(["pgo", "pgo"])),
            "bench-median runs=2 load=1.00 mixed_ratio=0.40 build=pgo"
        );
        assert_eq!(
            median_line(&built(["pgo", "release"])),
            "bench-median runs=2 load=1.00 mixed_ratio=0.40 build=varied"
        );
        assert_eq!(
            median_line(&built(["-", "pgo"])),
            "bench-median runs=2 load=1.00 mixed_ratio=0.40 build=varied"
        );
    }

    #[test]
    fn targets_are_judged_only_when_measured() {
        let mut r = BenchReport {
            machine: MachineInfo {
                cores: 2,
                load_start: [0.0; 3],
                load_end: [0.0; 3],
                server_version: String::new(),
                server: String::new(),
                partitions: 64,
                wall_seconds: 0.0,
                build: Build::Debug,
                fold_niceness: 0,
            },
            throughput: Vec::new(),
            ratios: Ratios::default(),
            latency: Vec::new(),
            turn_book: Vec::new(),
            core_costs: None,
            round_trips: None,
            targets: Vec::new(),
            notes: Vec::new(),
        };
        finish(&mut r);
        assert!(r.targets.iter().all(|t| t.met.is_none()));
        assert!(render(&r).contains("not measured"));
        // Nothing ran: every measured field of the summary says so.
        let line = summary_line(&r);
        assert!(
            line.starts_with("bench-summary load=0.00 baseline=- mixed=- turns=-"),
            "{line}"
        );
        // A debug build is named in the summary, and a note says what to run instead.
        assert!(line.contains(" build=debug "), "{line}");
        assert!(line.ends_with(" protocols=- protocols_ratio=-"), "{line}");
        assert!(
            render(&r).contains("note: a debug build: unoptimised"),
            "{}",
            render(&r)
        );

        r.throughput = [(1u8, 80_000.0), (2, 32_000.0)]
            .into_iter()
            .map(|(id, msg_per_s)| ThroughputResult {
                id,
                msg_per_s,
                worker_us_per_input: Some(31.34),
                ..ThroughputResult::default()
            })
            .collect();
        r.ratios.mixed_over_baseline = Some(0.4);
        let line = render(&r).lines().last().unwrap_or_default().to_string();
        let fields: std::collections::HashMap<&str, &str> = line
            .split(' ')
            .skip(1)
            .filter_map(|kv| kv.split_once('='))
            .collect();
        assert_eq!(fields.get("baseline"), Some(&"80000"), "{line}");
        assert_eq!(fields.get("mixed_ratio"), Some(&"0.40"), "{line}");
        assert_eq!(fields.get("mixed_wkr_us"), Some(&"31.3"), "{line}");
        assert_eq!(fields.get("turns"), Some(&"-"), "{line}");
        assert_eq!(fields.get("ceiling_mixed_ratio"), Some(&"-"), "{line}");
        assert_eq!(fields.get("build"), Some(&"debug"), "{line}");
        assert_eq!(fields.get("protocols_ratio"), Some(&"-"), "{line}");
        assert_eq!(fields.len(), 20, "{line}");
    }
}
