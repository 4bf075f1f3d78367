//! The `collab-projector` command line: flags to library calls, nothing else.

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use collab_projector::app::{self, RunOptions};
use collab_projector::config::Settings;
use collab_projector::ingest::adapter::AdapterMode;
use collab_projector::{bus, demo, ingest, relay, telemetry};
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The pipeline allocates many small, short-lived values across threads (envelopes, publishes,
/// acks, rounds of the projection stream). Measured on the mixed load, jemalloc's own share of
/// the samples is about a third of mimalloc's, and the worker spends about a fifth less CPU per
/// input; its background thread returns freed pages to the system within its decay time even
/// when the process is idle (docs/performance.md, "The allocator: jemalloc").
#[cfg(feature = "jemalloc")]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Parser)]
#[command(
    name = "collab-projector",
    version,
    about = "Projects raw multi-agent collaboration events on NATS JetStream into role-partitioned, turn-checked streams"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Where NATS is: every command that talks to it.
#[derive(Args, Clone)]
struct Conn {
    /// TOML configuration file (see config/default.toml). Environment: COLLAB_<SECTION>__<KEY>.
    #[arg(long, short = 'c', env = "COLLAB_CONFIG")]
    config: Option<PathBuf>,
    /// NATS server URL(s), comma-separated.
    #[arg(long, env = "NATS_URL")]
    nats_url: Option<String>,
}

impl Conn {
    fn settings(&self) -> anyhow::Result<Settings> {
        self.settings_with(|_| {})
    }

    /// The loaded settings with the URL flag and then `more` applied, validated once.
    fn settings_with(&self, more: impl FnOnce(&mut Settings)) -> anyhow::Result<Settings> {
        Ok(Settings::load_with(self.config.as_deref(), |s| {
            if let Some(url) = &self.nats_url {
                s.nats.url = url.clone();
            }
            more(s);
        })?)
    }
}

/// The ids of `--main-agents`, trimmed; `--main-agents ""` names none, so no blank id may
/// count as one.
fn main_agent_ids(agents: &[String]) -> Vec<String> {
    agents
        .iter()
        .map(|a| a.trim().to_string())
        .filter(|a| !a.is_empty())
        .collect()
}

/// What only a process that runs workers uses (`run`, `demo`).
#[derive(Args, Clone)]
struct WorkerFlags {
    /// Address of the HTTP endpoints (health, readiness, metrics, API, viewer); 127.0.0.1:0
    /// takes any free port. Each process on a machine needs its own (or --no-http).
    #[arg(long)]
    http_addr: Option<String>,
    /// Turn deadline when the send names none, e.g. 90s or 5m.
    #[arg(long, value_parser = humantime::parse_duration)]
    turn_timeout: Option<Duration>,
    /// Main agent ids, comma-separated (replaces roles.main_agents).
    #[arg(long, value_delimiter = ',')]
    main_agents: Option<Vec<String>>,
}

impl WorkerFlags {
    /// The flags over the loaded settings.
    fn apply(&self, s: &mut Settings) {
        if let Some(addr) = &self.http_addr {
            s.http.addr = addr.clone();
        }
        if let Some(t) = self.turn_timeout {
            s.turns.default_timeout = t;
            if s.turns.max_timeout < t {
                s.turns.max_timeout = t;
            }
        }
        if let Some(agents) = &self.main_agents {
            s.roles.main_agents = main_agent_ids(agents);
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Run the workers and the HTTP endpoints until SIGTERM / Ctrl-C (which drain).
    Run {
        #[command(flatten)]
        conn: Conn,
        #[command(flatten)]
        worker: WorkerFlags,
        /// Do not run workers (HTTP only).
        #[arg(long)]
        no_workers: bool,
        /// Do not serve HTTP.
        #[arg(long)]
        no_http: bool,
    },
    /// A local run with generated multi-agent traffic on a nats-server of its own (never one
    /// already running, unless --nats-url names it).
    Demo(DemoArgs),
    /// Offline: one JSON line in, one line out (the envelope, {"events":[...]} or {"error":...}).
    Normalize {
        /// TOML configuration file.
        #[arg(long, short = 'c', env = "COLLAB_CONFIG")]
        config: Option<PathBuf>,
        /// Main agent ids, comma-separated.
        #[arg(long, value_delimiter = ',')]
        main_agents: Option<Vec<String>>,
        /// A2A adapter mode.
        #[arg(long)]
        adapter_mode: Option<AdapterMode>,
    },
    /// Create missing streams, consumers and buckets, or report how existing ones differ.
    Provision {
        #[command(flatten)]
        conn: Conn,
    },
    /// Prove that every raw sequence in a range is projected or dead-lettered, exactly one of them.
    Audit {
        #[command(flatten)]
        conn: Conn,
        /// First raw sequence (default 1).
        #[arg(long, default_value_t = 1)]
        from: u64,
        /// Last raw sequence (default: the stream's last).
        #[arg(long, default_value_t = 0)]
        to: u64,
    },
    /// Print the nats-server subject mapping that spreads raw traffic over `nats.shards` streams
    /// (docs/operations.md, "Sharding raw traffic"): add it to the server's configuration (or
    /// the account's) and reload the server before the workers first start.
    Shards {
        #[command(flatten)]
        conn: Conn,
        /// Shard count (default: nats.shards from the configuration).
        #[arg(long)]
        count: Option<u16>,
    },
    /// A live view of the fleet: each worker's partitions, pending messages, rates, dead letters
    /// and open turns, the partitions no worker owns, and warnings. Ctrl-C quits.
    Status(StatusArgs),
    /// Measure throughput, latency and turn-book scale (starts nats-server per scenario unless
    /// --nats-url is given). See docs/performance.md.
    Bench(BenchArgs),
    /// An HTTP reverse proxy in front of one A2A or AG-UI agent that publishes the traffic it
    /// forwards to the raw stream (docs/relay.md).
    Relay {
        #[command(subcommand)]
        protocol: RelayCommand,
    },
    /// Recompute past traffic under the current settings into a projection version beside the
    /// deployment's own (blue/green), with progress, then show what differs
    /// (docs/operations.md, "Reprojection").
    Reproject(ReprojectArgs),
    /// Move raw traffic to another number of raw streams on a running deployment: create the
    /// new streams, wait until the server's mapping sends traffic there, seal the old ones and
    /// wait until every partition has read them (docs/operations.md, "Changing the shard
    /// count").
    Reshard(ReshardArgs),
    /// Dead-letter operations.
    Dlq {
        #[command(subcommand)]
        command: DlqCommand,
    },
}

/// Flags of `demo`.
#[derive(Args)]
struct DemoArgs {
    /// TOML configuration file (its [nats] section is not used unless --nats-url is given).
    #[arg(long, short = 'c', env = "COLLAB_CONFIG")]
    config: Option<PathBuf>,
    /// Use this NATS server instead of starting one, under the prefix `demo` (streams
    /// DEMO_RAW, DEMO_PROJ, DEMO_DLQ; buckets demo_*), apart from a deployment's `collab`.
    /// NATS_URL and COLLAB_NATS__URL are ignored: the demo joins a server only when told here.
    #[arg(long)]
    nats_url: Option<String>,
    #[command(flatten)]
    worker: WorkerFlags,
    /// Stop by itself after this long (e.g. 30s); default: until Ctrl-C.
    #[arg(long, value_parser = humantime::parse_duration)]
    duration: Option<Duration>,
    /// Scenarios published per second (1 to 1000).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=1000))]
    rate: u32,
    /// JetStream store for a server the demo starts (default: a temporary directory).
    #[arg(long)]
    store_dir: Option<PathBuf>,
}

/// Flags of `reshard`.
#[derive(Args)]
struct ReshardArgs {
    #[command(flatten)]
    conn: Conn,
    /// The new number of raw streams: 1, or a power of two that divides nats.partitions.
    #[arg(long, required_unless_present = "drop_sealed")]
    count: Option<u16>,
    /// How long to wait to store the reshard markers, for the server's mapping, and then for
    /// the partitions to move.
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    wait: Duration,
    /// Delete the sealed raw streams of earlier reshards, once every consumer has read them.
    #[arg(long, conflicts_with = "count")]
    drop_sealed: bool,
    /// Print the report as one JSON object.
    #[arg(long)]
    json: bool,
}

/// Flags of `reproject`.
#[derive(Args)]
struct ReprojectArgs {
    #[command(flatten)]
    conn: Conn,
    /// The version to compute (one subject token, e.g. v2): its streams, buckets and subjects
    /// are under `<prefix>_<version>`.
    #[arg(long, required_unless_present = "switch_back")]
    version: Option<String>,
    /// First raw sequence (default: the raw stream's first).
    #[arg(long)]
    from: Option<u64>,
    /// Last raw sequence (default: the raw stream's last when the run starts).
    #[arg(long)]
    to: Option<u64>,
    /// How long the version keeps running after the range, so deadlines due in event time
    /// are decided.
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    settle: Duration,
    /// Examples shown per kind of change.
    #[arg(long, default_value_t = 5)]
    examples: usize,
    /// Print the comparison as JSON.
    #[arg(long)]
    json: bool,
    /// Remove the version (its consumers, streams, buckets and object store) instead.
    #[arg(long, conflicts_with_all = ["switch", "switch_back"])]
    drop: bool,
    /// Make the deployment's API serve the version from now on instead of computing it (its
    /// workers must run: `COLLAB_NATS__VERSION=<version> collab-projector run`).
    #[arg(long, conflicts_with = "switch_back")]
    switch: bool,
    /// Make the deployment's API serve its own projections again (the way back from --switch).
    #[arg(long, conflicts_with = "version")]
    switch_back: bool,
    /// Turn deadline when the send names none, for the version (e.g. 90s).
    #[arg(long, value_parser = humantime::parse_duration)]
    turn_timeout: Option<Duration>,
    /// Main agent ids for the version, comma-separated (replaces roles.main_agents).
    #[arg(long, value_delimiter = ',')]
    main_agents: Option<Vec<String>>,
    /// Partition count for the version (repartitioning): any divisor of the raw stream's slot
    /// count. Serve the version with the same `nats.partitions`.
    #[arg(long)]
    partitions: Option<u16>,
}

/// Flags of `status`.
#[derive(Args)]
struct StatusArgs {
    #[command(flatten)]
    conn: Conn,
    /// Refresh every this long (e.g. 2s, 500ms).
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    interval: Duration,
    /// Print one snapshot and exit (for scripts).
    #[arg(long)]
    once: bool,
    /// Print the collected worker reports as a JSON array, one line per snapshot.
    #[arg(long)]
    json: bool,
    /// How long to gather the workers' replies to each request.
    #[arg(long, default_value = "500ms", value_parser = humantime::parse_duration)]
    wait: Duration,
    /// Warn about a partition whose oldest pending message is older than this.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    warn_pending_age: Duration,
}

/// Flags of `bench`.
#[derive(Args)]
struct BenchArgs {
    /// Use this server (a fresh prefix per scenario) instead of starting one per scenario.
    #[arg(long)]
    nats_url: Option<String>,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Messages preloaded for the throughput scenarios 1-3.
    #[arg(long, default_value_t = 200_000)]
    messages: usize,
    /// Messages preloaded for the naive scenario 4 (one round trip each).
    #[arg(long, default_value_t = 20_000)]
    naive_messages: usize,
    /// Publish rate of the latency runs (messages per second).
    #[arg(long, default_value_t = 5_000)]
    rate: u32,
    /// How long each latency run publishes, e.g. 60s. A shorter run's p99 rests on a few
    /// slow windows (the server's collections come every few seconds) and moves up to 2x
    /// between runs of one build.
    #[arg(long, default_value_t = collab_projector::bench::DEFAULT_LATENCY_DURATION.into())]
    latency_duration: humantime::Duration,
    /// Write every input a latency run measured (raw sequence, store time, latency in µs,
    /// subject) to PATH.1.csv (passthrough) and PATH.2.csv (pipeline), to see when its tail
    /// happened.
    #[arg(long, value_name = "PATH")]
    latency_samples: Option<std::path::PathBuf>,
    /// The deadline the generated main-main turns ask for, e.g. 60s. A tenth of them go
    /// unanswered, and their blocked outcomes are measured work only when they fall inside a
    /// run's clock: at the default, inside a run of 1,000,000 messages, past one of 200,000.
    #[arg(long, default_value = "10s")]
    turn_timeout: humantime::Duration,
    /// Open turns for the turn-book scale runs, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "100000,1000000")]
    open_turns: Vec<usize>,
    /// Probe sends per timer-lateness run.
    #[arg(long, default_value_t = 1_000)]
    probes: usize,
    /// Run only these parts: baseline, mixed, turns, naive, latency, turnbook, breakdown,
    /// ceiling, protocols.
    #[arg(long, value_delimiter = ',')]
    only: Vec<collab_projector::bench::Part>,
    /// Partitions of the raw stream (default: the configured `nats.partitions`, which
    /// `COLLAB_NATS__PARTITIONS` overrides).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=1024))]
    partitions: Option<u16>,
    /// No progress bars.
    #[arg(long)]
    quiet: bool,
    /// Run the whole bench this many times back to back, each run in a process of its own (as
    /// a shell loop would), printing each run's report, then `bench-median`: the median of every
    /// summary field over the runs.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=20))]
    rounds: u32,
}

#[derive(Subcommand)]
enum RelayCommand {
    /// Front an A2A agent (v0.3 or v1.0; JSON-RPC and HTTP+JSON, streams, the agent card).
    A2a(Box<RelayArgs>),
    /// Front an AG-UI agent (a RunAgentInput POST answered by an SSE stream of events).
    Agui(Box<RelayArgs>),
}

/// Flags of `relay a2a` and `relay agui`.
#[derive(Args, Clone)]
struct RelayArgs {
    /// TOML configuration file (its [nats] section: URL, credentials, TLS, prefix).
    #[arg(long, short = 'c', env = "COLLAB_CONFIG")]
    config: Option<PathBuf>,
    /// NATS server URL(s), comma-separated.
    #[arg(long, env = "NATS_URL")]
    nats_url: Option<String>,
    /// Address the proxy listens on, e.g. 0.0.0.0:9000; every path on it goes to the agent.
    #[arg(long)]
    listen: String,
    /// The agent's base URL, e.g. http://agent:9999; request paths are appended to its path.
    #[arg(long)]
    upstream: reqwest::Url,
    /// The caller's agent id (Collab-From-Agent): every caller's, or, with --from-agent-header,
    /// that of a request the proxy sends without the header.
    #[arg(long)]
    from_agent: Option<String>,
    /// The id of the agent behind this relay (Collab-To-Agent).
    #[arg(long)]
    to_agent: String,
    /// A request header naming the caller's agent id, set by an authenticating proxy; needs
    /// --trust-header-from.
    #[arg(long)]
    from_agent_header: Option<axum::http::HeaderName>,
    /// The addresses of the authenticating proxy (CIDR ranges or addresses, comma-separated):
    /// with --from-agent-header, only connections from them are served.
    #[arg(long, value_delimiter = ',', value_parser = relay::trust::parse_net)]
    trust_header_from: Vec<ipnet::IpNet>,
    /// A file of `AGENT_ID TOKEN` lines: each caller sends `Proxy-Authorization: Bearer TOKEN`
    /// and is named by it; without a known token, 401.
    #[arg(long)]
    caller_tokens: Option<PathBuf>,
    /// Requests each caller may make, sustained: N/s, N/min or N/h (a token bucket per caller
    /// id; 429 past it); `off` for no limit.
    #[arg(long, default_value = "20/s", value_parser = relay::trust::parse_rate_limit)]
    rate_limit: relay::trust::RateLimit,
    /// Requests a caller may make at once before --rate-limit applies.
    #[arg(long, default_value_t = 100)]
    rate_limit_burst: u32,
    /// Request body bytes each caller may send per second, sustained (a token bucket per
    /// caller id; 429 past it); 0 for no byte budget.
    #[arg(long, default_value_t = 1024 * 1024)]
    rate_limit_bytes: u32,
    /// Request body bytes a caller may send at once before --rate-limit-bytes applies; at least
    /// --max-message-bytes.
    #[arg(long, default_value_t = 16 * 1024 * 1024)]
    rate_limit_bytes_burst: u32,
    /// Messages waiting to be published; when full, new ones are dropped and counted.
    #[arg(long, default_value_t = 10_000)]
    queue_size: usize,
    /// Payload bytes queued or being published; past that new messages are dropped and counted.
    #[arg(long, default_value_t = 64 * 1024 * 1024)]
    queue_bytes: usize,
    /// Bodies and SSE frames larger than this are forwarded but not published.
    #[arg(long, default_value_t = 1024 * 1024)]
    max_message_bytes: usize,
    /// Address of /metrics, /healthz and /readyz (not served unless given).
    #[arg(long)]
    http_addr: Option<String>,
    /// How long to wait for a connection to the upstream.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    connect_timeout: Duration,
    /// On SIGTERM: how long open exchanges may finish, then how long queued messages may take
    /// to be published.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    drain_timeout: Duration,
}

#[derive(Subcommand)]
enum DlqCommand {
    /// Republish dead letters to the subject their producer used (after fixing the cause).
    Replay {
        #[command(flatten)]
        conn: Conn,
        /// Only dead letters of this reason (e.g. bad_key).
        #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(
            collab_projector::model::DlqReason::ALL.map(|r| r.as_str())
        ))]
        reason: Option<String>,
        /// Count what would be replayed, publish nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

async fn connect_for(
    settings: &Settings,
    name: &str,
) -> anyhow::Result<async_nats::jetstream::Context> {
    let (_client, js) = bus::connect_as(settings, name).await?;
    Ok(js)
}

/// Runs the command; on failure prints one `error:` line (the message and its causes, each once)
/// and exits 1. No backtrace: these errors are the user's to fix, not the program's.
fn main() -> ExitCode {
    match run_cli(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "error: {}", error_text(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes on one line, leaving out a cause whose text the line already holds
/// (most errors here quote their source).
fn error_text(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let part = cause.to_string();
        if text.contains(&part) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&part);
    }
    text
}

fn run_cli(cli: Cli) -> anyhow::Result<()> {
    if let Command::Normalize {
        config,
        main_agents,
        adapter_mode,
    } = &cli.command
    {
        return normalize(config.as_deref(), main_agents.clone(), *adapter_mode);
    }
    // Two cores is the common deployment; a current-thread runtime did as well as a
    // multi-thread one there, but workers and HTTP benefit from a second thread under load.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    // Before anything else, for the commands a signal stops with a drain: a stop signal while
    // the process starts is kept, not fatal. (The others end by the signal's default action.)
    if matches!(
        cli.command,
        Command::Run { .. } | Command::Demo(_) | Command::Relay { .. } | Command::Bench(_)
    ) {
        let _in_runtime = runtime.enter();
        app::catch_shutdown_signals();
    }
    // The demo's and the status view's own screens are the output; their logs stay quiet unless
    // asked for.
    let default_filter = if matches!(
        cli.command,
        Command::Demo { .. } | Command::Bench { .. } | Command::Status { .. }
    ) {
        "warn"
    } else {
        "info"
    };
    telemetry::init_logging(default_filter);
    runtime.block_on(async_main(cli))
}

fn shutdown_token() -> CancellationToken {
    let cancel = CancellationToken::new();
    let c = cancel.clone();
    tokio::spawn(async move {
        app::shutdown_signal().await;
        // Cancel first: nothing this task does after the signal may stand between it and the
        // drain.
        c.cancel();
        tracing::info!("shutting down: draining in-flight work");
    });
    cancel
}

fn metrics_handle() -> Option<metrics_exporter_prometheus::PrometheusHandle> {
    let handle = telemetry::prometheus_builder().install_recorder().ok()?;
    telemetry::register_metrics();
    Some(handle)
}

/// One step per command.
async fn async_main(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Run {
            conn,
            worker,
            no_workers,
            no_http,
        } => run(&conn, &worker, no_workers, no_http).await,
        Command::Demo(args) => run_demo(args).await,
        Command::Provision { conn } => provision(&conn).await,
        Command::Audit { conn, from, to } => audit(&conn, from, to).await,
        Command::Shards { conn, count } => shards(&conn, count),
        Command::Status(args) => status(args).await,
        Command::Dlq {
            command:
                DlqCommand::Replay {
                    conn,
                    reason,
                    dry_run,
                },
        } => dlq_replay(&conn, reason.as_deref(), dry_run).await,
        Command::Bench(args) => bench(args).await,
        Command::Reproject(args) => reproject(args).await,
        Command::Reshard(args) => reshard(args).await,
        Command::Relay { protocol } => {
            let (protocol, args) = match protocol {
                RelayCommand::A2a(a) => (relay::Protocol::A2a, a),
                RelayCommand::Agui(a) => (relay::Protocol::Agui, a),
            };
            run_relay(protocol, *args).await
        }
        Command::Normalize { .. } => Ok(()),
    }
}

/// `run`: the workers and the HTTP endpoints until SIGTERM / Ctrl-C, then drain.
async fn run(
    conn: &Conn,
    worker: &WorkerFlags,
    no_workers: bool,
    no_http: bool,
) -> anyhow::Result<()> {
    let settings = conn.settings_with(|s| worker.apply(s))?;
    if !no_workers && !settings.roles.require_identity {
        tracing::warn!(
            "roles.require_identity is off: inputs on <prefix>.raw.<key>.<type>, which name no publishing agent, are believed when they name a speaker; safe only when the NATS server lets no producer publish there (config/nats-server.roles.conf gives every producer its own _as.<agent> subjects); set roles.require_identity = true (COLLAB_ROLES__REQUIRE_IDENTITY=true) to dead-letter them (docs/security.md, \"Producer identity\")"
        );
    }
    let cancel = shutdown_token();
    let opts = RunOptions {
        workers: !no_workers,
        http: !no_http,
        metrics: metrics_handle(),
    };
    let running = match app::start(settings, opts, cancel.clone()).await {
        Ok(running) => running,
        // Stopped while still waiting for NATS: nothing was taken, nothing to drain.
        Err(app::AppError::Stopped) => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    if let Some(addr) = running.http_addr {
        // Tests and scripts read this line to find an ephemeral port.
        telemetry::say(&format!("http listening on {addr}"));
    }
    cancel.cancelled().await;
    let state = running.worker.as_ref().map(|w| w.state.clone());
    running.wait().await;
    let undrained = state
        .and_then(|s| s.undrained.lock().ok().map(|u| u.clone()))
        .unwrap_or_default();
    if !undrained.is_empty() {
        anyhow::bail!(
            "stopped before partitions {undrained:?} had drained (workers.drain_timeout); nothing is lost: their next owner processes what they left unacknowledged"
        );
    }
    tracing::info!("stopped");
    Ok(())
}

/// `demo`: generated traffic through a local run.
async fn run_demo(args: DemoArgs) -> anyhow::Result<()> {
    let mut settings = Settings::load_with(args.config.as_deref(), |s| args.worker.apply(s))?;
    if args.worker.turn_timeout.is_none() {
        // Short enough to watch an unanswered turn become a blocked response.
        settings.turns.default_timeout = Duration::from_secs(10);
    }
    let opts = demo::DemoOptions {
        duration: args.duration,
        rate: args.rate,
        store_dir: args.store_dir,
        nats_url: args.nats_url,
    };
    let cancel = shutdown_token();
    demo::run(settings, opts, metrics_handle(), cancel).await?;
    Ok(())
}

/// `provision`: create what is missing, report what differs.
async fn provision(conn: &Conn) -> anyhow::Result<()> {
    let settings = conn.settings()?;
    let js = connect_for(&settings, "collab-projector provision").await?;
    // Run by hand with the deployment's configuration: a lease bucket whose age was cut (or
    // that an earlier TTL made) is given `workers.lease_ttl` back.
    let report =
        bus::provision::provision_with(&js, &settings, bus::provision::LeaseAge::Restore).await?;
    for r in &report.created {
        telemetry::say(&format!("created   {r}"));
    }
    for r in &report.updated {
        telemetry::say(&format!("updated   {r}"));
    }
    telemetry::say(&format!(
        "{} created, {} updated, {} already present and matching",
        report.created.len(),
        report.updated.len(),
        report.unchanged.len()
    ));
    Ok(())
}

/// `shards`: the server configuration a shard count needs, on standard output.
fn shards(conn: &Conn, count: Option<u16>) -> anyhow::Result<()> {
    let settings = conn.settings_with(|s| {
        if let Some(k) = count {
            s.nats.shards = k;
        }
    })?;
    let names = settings.names();
    let Some(block) = names.shard_mapping_config() else {
        telemetry::say(&format!(
            "nats.shards is 1: raw traffic goes to the one stream {}, and the server needs no mapping",
            names.raw_stream
        ));
        return Ok(());
    };
    let (from, to) = names.shard_mapping().unwrap_or_default();
    println!("{block}");
    let k = names.shards();
    eprintln!(
        "add the block above to nats-server.conf (inside the account's block when the server has accounts) on every node, then `nats-server --signal reload`; with operator JWTs: nsc add mapping --account <account> --from '{from}' --to '{to}' && nsc push. Every worker then runs with nats.shards = {k}"
    );
    Ok(())
}

/// `audit`: exactly one of projected / dead-lettered per raw sequence, or a non-zero exit.
/// `reproject`: run a projection version over a range of the raw stream and compare it with the
/// deployment's projections; exit 1 when they differ, so a script can tell.
async fn reproject(args: ReprojectArgs) -> anyhow::Result<()> {
    use collab_projector::reproject;
    let rules = WorkerFlags {
        http_addr: None,
        turn_timeout: args.turn_timeout,
        main_agents: args.main_agents.clone(),
    };
    let version = args.version.clone().unwrap_or_default();
    let settings = args.conn.settings_with(|s| {
        s.nats.version.clone_from(&version);
        if let Some(p) = args.partitions {
            s.nats.partitions = p;
        }
        rules.apply(s);
    })?;
    if args.switch || args.switch_back {
        let done = reproject::switch(&settings, &version).await?;
        let name = |v: &str| {
            if v.is_empty() {
                "the deployment's own projections".to_string()
            } else {
                format!("projection version {v}")
            }
        };
        telemetry::say(&format!(
            "the API now serves {} (before: {}); API servers follow within {} s, and event streams open on the other end with `version_switched`",
            name(&done.switch.version),
            name(&done.switch.previous),
            collab_projector::served::FOLLOW_EVERY.as_secs()
        ));
        telemetry::say(&format!(
            "NATS subscribers: {} (the control bucket's key `{}` names the served version)",
            done.subjects,
            collab_projector::served::SERVED_KEY
        ));
        if done.pending > 0 {
            telemetry::say(&format!(
                "note: its partitions have {} inputs not yet acknowledged; make sure its workers run",
                done.pending
            ));
        }
        if !done.switch.version.is_empty() {
            telemetry::say("way back: collab-projector reproject --switch-back");
        }
        return Ok(());
    }
    if args.drop {
        let dropped = reproject::drop_version(&settings).await?;
        if dropped.removed.is_empty() {
            telemetry::say(&format!(
                "projection version {version:?}: nothing to remove"
            ));
        }
        for what in dropped.removed {
            telemetry::say(&format!("removed {what}"));
        }
        return Ok(());
    }
    let plan = reproject::Plan {
        from: args.from,
        to: args.to,
        settle: args.settle,
        examples: args.examples,
    };
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} reprojecting [{bar:40}] {pos}/{len} raw sequences, {per_sec}, {eta} left",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    // Without a terminal (a log collector), the bar draws nothing: a line every 5 s instead.
    let lines = !std::io::IsTerminal::is_terminal(&std::io::stderr());
    let started = std::time::Instant::now();
    let mut said = started;
    let diff = reproject::run(&settings, &plan, |p| {
        bar.set_length(p.total);
        bar.set_position(p.done);
        if lines && (said.elapsed() >= Duration::from_secs(5) || p.done >= p.total) {
            said = std::time::Instant::now();
            let secs = started.elapsed().as_secs_f64().max(0.001);
            let rate = p.done as f64 / secs;
            let left = p.total.saturating_sub(p.done) as f64 / rate.max(1.0);
            eprintln!(
                "reprojecting: {}/{} raw sequences, {rate:.0}/s, {left:.0} s left",
                p.done, p.total
            );
        }
    })
    .await;
    bar.finish_and_clear();
    let diff = diff?;
    if args.json {
        telemetry::say(&serde_json::to_string(&diff)?);
    } else {
        print!(
            "{}",
            reproject::render(&diff, &reproject::live_names(&settings), &settings.names())
        );
    }
    if diff.same() {
        Ok(())
    } else {
        std::process::exit(1)
    }
}

async fn audit(conn: &Conn, from: u64, to: u64) -> anyhow::Result<()> {
    if to != 0 && from > to {
        anyhow::bail!(
            "--from {from} is after --to {to}: give a range with --from at most --to (--to 0, the default, is the last sequence)"
        );
    }
    let settings = conn.settings()?;
    let js = connect_for(&settings, "collab-projector audit").await?;
    let a = collab_projector::ops::audit(&js, &settings.names(), from, to).await?;
    if a.raw == 0 && from > 1 {
        // Nothing in the range: an audit that checked nothing does not say it holds.
        anyhow::bail!(
            "no raw message from sequence {from}{}: nothing to audit (the raw stream may end before it, or retention removed the range); `collab-projector status` shows the streams, and --from 1 audits all that is kept",
            if to == 0 { String::new() } else { format!(" to {to}") }
        );
    }
    telemetry::say(&format!(
        "raw sequences {}..={}: {} messages, {} projected, {} dead-lettered, {} both, {} neither",
        a.from,
        a.to,
        a.raw,
        a.projected,
        a.dead_lettered,
        a.both.len(),
        a.neither.len()
    ));
    for (reason, n) in &a.dlq_by_reason {
        telemetry::say(&format!("  dead letters {reason}: {n}"));
    }
    if !a.holds() {
        let show = |v: &[String]| v.iter().take(20).cloned().collect::<Vec<_>>().join(", ");
        if !a.both.is_empty() {
            telemetry::say(&format!("projected AND dead-lettered: {}", show(&a.both)));
        }
        if !a.neither.is_empty() {
            let shown = show(&a.neither);
            telemetry::say(&format!("neither (lost, or not processed yet): {shown}"));
        }
        anyhow::bail!("audit failed");
    }
    telemetry::say("audit holds: exactly one of projected / dead-lettered for every raw sequence");
    Ok(())
}

/// `status`: the fleet view until Ctrl-C (or once).
async fn status(args: StatusArgs) -> anyhow::Result<()> {
    use collab_projector::status;
    let settings = args.conn.settings()?;
    let opts = status::WatchOptions {
        interval: args.interval,
        wait: args.wait,
        once: args.once,
        json: args.json,
        view: status::ViewOptions {
            partitions: settings.nats.partitions,
            pending_age_warn: args.warn_pending_age,
        },
    };
    let (client, _js) = bus::connect_as(&settings, "collab-projector status").await?;
    status::watch(&client, &opts, shutdown_token()).await?;
    Ok(())
}

/// `reshard`: another number of raw streams on a running deployment, or `--drop-sealed`.
async fn reshard(args: ReshardArgs) -> anyhow::Result<()> {
    use collab_projector::reshard::{self, Step};
    let settings = args.conn.settings()?;
    if args.drop_sealed {
        let dropped = reshard::drop_sealed(&settings).await?;
        if args.json {
            telemetry::say(&serde_json::to_string(&dropped)?);
        } else {
            telemetry::say(&format!("dropped {}", dropped.streams.join(", ")));
        }
        return Ok(());
    }
    let count = args.count.unwrap_or(1);
    let mut last_moving = (u16::MAX, u64::MAX);
    let done = reshard::reshard(&settings, count, args.wait, |step| match step {
        Step::Created {
            streams,
            mapping,
            resumed,
        } => {
            eprintln!(
                "{} {}",
                if resumed { "found" } else { "created" },
                streams.join(", ")
            );
            if !args.json {
                telemetry::say(&mapping);
            }
            eprintln!("now put the block above in nats-server.conf, replacing the current mapping of the raw subjects if there is one, (inside the account's block when the server has accounts) on every node and reload them (`nats-server --signal reload`); waiting until the server sends raw traffic to the new streams");
            eprintln!("(turn and run deadlines from now on are decided once the partitions read the new streams: reload every node without delay)");
        }
        Step::WaitingForMapping { elapsed } => {
            eprintln!("waiting for the mapping ({}s)", elapsed.as_secs());
        }
        Step::Sealed { streams } => eprintln!("sealed {}", streams.join(", ")),
        Step::Moving {
            moved,
            partitions,
            left,
        } => {
            if (moved, left) != last_moving {
                eprintln!("{moved}/{partitions} partitions on the new streams, {left} inputs left in the sealed ones");
                last_moving = (moved, left);
            }
        }
    })
    .await?;
    if args.json {
        telemetry::say(&serde_json::to_string(&done)?);
    } else if done.from_shards == done.to_shards {
        telemetry::say(&format!(
            "raw traffic is in {} stream(s) already: nothing to do",
            done.to_shards
        ));
    } else {
        telemetry::say(&format!(
            "resharded: {} -> {} raw streams (new sequences from {}); mapping live after {:.1}s; {} inputs were left in the sealed streams, every partition moved {:.1}s after the seal. `collab-projector reshard --drop-sealed` removes the sealed streams once nothing needs them (audits and reprojections read them)",
            done.from_shards, done.to_shards, done.base, done.mapping_wait_s, done.left_at_seal, done.move_s
        ));
    }
    Ok(())
}

/// `dlq replay`: dead letters back to their producer's subject.
async fn dlq_replay(conn: &Conn, reason: Option<&str>, dry_run: bool) -> anyhow::Result<()> {
    let settings = conn.settings()?;
    let js = connect_for(&settings, "collab-projector dlq replay").await?;
    let r = collab_projector::ops::dlq_replay(&js, &settings.names(), reason, dry_run).await?;
    telemetry::say(&format!(
        "{} {} dead letters ({} without a source subject skipped)",
        if dry_run { "would replay" } else { "replayed" },
        r.replayed,
        r.skipped,
    ));
    Ok(())
}

/// `bench`: the scenarios, then the report as a table or JSON.
async fn bench(args: BenchArgs) -> anyhow::Result<()> {
    use collab_projector::bench;
    if args.rounds > 1 {
        anyhow::ensure!(
            !args.json,
            "--rounds prints each run's table and a bench-median line; for JSON, run `bench --json` once per round"
        );
        anyhow::ensure!(
            args.latency_samples.is_none(),
            "--latency-samples writes one run's samples, which the next round would overwrite; run it without --rounds"
        );
        return bench_rounds(args.rounds).await;
    }
    if let Some(path) = &args.latency_samples {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => std::path::Path::new("."),
        };
        anyhow::ensure!(
            dir.is_dir(),
            "--latency-samples {}: the directory {} does not exist; create it or name another",
            path.display(),
            dir.display()
        );
    }
    let partitions = match args.partitions {
        Some(p) => p,
        None => Settings::load(None)?.nats.partitions,
    };
    let opts = bench::BenchOptions {
        nats_url: args.nats_url,
        messages: args.messages,
        naive_messages: args.naive_messages,
        latency_rate: args.rate,
        latency_duration: args.latency_duration.into(),
        latency_samples: args.latency_samples,
        open_turns: args.open_turns,
        lateness_probes: args.probes,
        turn_timeout: args.turn_timeout.into(),
        parts: if args.only.is_empty() {
            bench::Part::ALL.to_vec()
        } else {
            args.only
        },
        partitions,
        progress: !args.quiet,
        metrics: metrics_handle(),
        ..Default::default()
    };
    let report = bench::run(opts).await?;
    if args.json {
        telemetry::say(&serde_json::to_string_pretty(&report)?);
    } else {
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(bench::render(&report).as_bytes());
    }
    Ok(())
}

/// `bench --rounds N`: this command again without `--rounds`, N times one after the other, each
/// in a fresh process (no run inherits another's allocator state or servers), its output passed
/// through; then the median of each summary field. A stop signal is passed on to the round
/// running (which stops its servers as a single run does) and no further round starts.
async fn bench_rounds(rounds: u32) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("finding this program to run the rounds")?;
    let args = without_rounds(std::env::args_os().skip(1));
    let mut summaries = Vec::new();
    for round in 1..=rounds {
        telemetry::say(&format!("bench round {round} of {rounds}"));
        let mut child = tokio::process::Command::new(&exe)
            .args(&args)
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting bench round {round}"))?;
        let stdout = child.stdout.take().context("reading the round's output")?;
        let pid = child.id();
        let passed = tokio::select! {
            r = pass_through(stdout, &mut summaries) => r,
            _ = app::shutdown_signal() => {
                if let Some(pid) = pid {
                    let _ = collab_projector::localnats::signal(
                        pid,
                        nix::sys::signal::Signal::SIGTERM,
                    );
                }
                let _ = child.wait().await;
                anyhow::bail!("bench interrupted in round {round} of {rounds}");
            }
        };
        passed?;
        let status = child.wait().await?;
        anyhow::ensure!(
            status.success(),
            "bench round {round} of {rounds} failed ({status}); its output is above"
        );
    }
    telemetry::say(&collab_projector::bench::median_line(&summaries));
    Ok(())
}

/// A round's output, line by line, to this process's; its summary lines kept in `summaries`.
async fn pass_through(
    stdout: tokio::process::ChildStdout,
    summaries: &mut Vec<String>,
) -> std::io::Result<()> {
    use tokio::io::AsyncBufReadExt;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    while let Some(line) = lines.next_line().await? {
        telemetry::say(&line);
        if line.starts_with("bench-summary ") {
            summaries.push(line);
        }
    }
    Ok(())
}

/// Command-line arguments without `--rounds N` / `--rounds=N`.
fn without_rounds(args: impl Iterator<Item = std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    let mut out = Vec::new();
    let mut skip_value = false;
    for a in args {
        if std::mem::take(&mut skip_value) {
            continue;
        }
        if a == "--rounds" {
            skip_value = true;
        } else if !a.to_string_lossy().starts_with("--rounds=") {
            out.push(a);
        }
    }
    out
}

/// `relay a2a|agui`: the proxy until SIGTERM / Ctrl-C, then drain.
async fn run_relay(protocol: relay::Protocol, args: RelayArgs) -> anyhow::Result<()> {
    let settings = Settings::load_with(args.config.as_deref(), |s| {
        if let Some(url) = &args.nats_url {
            s.nats.url = url.clone();
        }
    })?;
    let cancel = shutdown_token();
    // The relay's families only (the workers' would read as a worker that is not ready).
    let metrics = args
        .http_addr
        .as_ref()
        .and_then(|_| telemetry::prometheus_builder().install_recorder().ok());
    let opts = relay::RelayOptions {
        protocol,
        listen: args.listen,
        upstream: args.upstream,
        from_agent: args.from_agent,
        to_agent: args.to_agent,
        from_agent_header: args.from_agent_header,
        trust_header_from: args.trust_header_from,
        caller_tokens: args.caller_tokens,
        rate_limit: args.rate_limit.0,
        rate_burst: args.rate_limit_burst,
        rate_limit_bytes: args.rate_limit_bytes,
        rate_limit_bytes_burst: args.rate_limit_bytes_burst,
        queue_size: args.queue_size,
        queue_bytes: args.queue_bytes,
        max_message_bytes: args.max_message_bytes,
        http_addr: args.http_addr,
        connect_timeout: args.connect_timeout,
        drain_timeout: args.drain_timeout,
    };
    let running = relay::start(settings, opts, metrics, cancel).await?;
    // Tests and scripts read these lines to find ephemeral ports.
    telemetry::say(&format!("relay listening on {}", running.addr));
    if let Some(addr) = running.http_addr {
        telemetry::say(&format!("http listening on {addr}"));
    }
    running.wait().await;
    tracing::info!("stopped");
    Ok(())
}

fn normalize(
    config: Option<&std::path::Path>,
    main_agents: Option<Vec<String>>,
    adapter_mode: Option<AdapterMode>,
) -> anyhow::Result<()> {
    let settings = Settings::load_with(config, |s| {
        if let Some(agents) = main_agents {
            s.roles.main_agents = main_agent_ids(&agents);
        }
        if let Some(mode) = adapter_mode {
            s.adapter.mode = mode;
        }
    })?;
    let ingest_settings = settings.ingest()?;
    let stdin = std::io::stdin().lock();
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let written = (|| -> std::io::Result<()> {
        for line in stdin.split(b'\n') {
            let mut line = line?;
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            let answer = ingest::normalize_line(&line, &ingest_settings);
            out.write_all(answer.as_bytes())?;
            out.write_all(b"\n")?;
        }
        out.flush()
    })();
    match written {
        Ok(()) => Ok(()),
        // The reader went away (`normalize < events | head -1`): what it took was written.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        Err(e) => Err(anyhow::anyhow!(
            "normalize: reading standard input or writing standard output: {e}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_is_well_formed() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn each_round_is_the_same_command_without_rounds() {
        let args = |v: &[&str]| v.iter().map(std::ffi::OsString::from).collect::<Vec<_>>();
        assert_eq!(
            without_rounds(
                args(&[
                    "bench",
                    "--rounds",
                    "3",
                    "--only",
                    "mixed",
                    "--rounds=2",
                    "--quiet"
                ])
                .into_iter()
            ),
            args(&["bench", "--only", "mixed", "--quiet"])
        );
    }

    #[test]
    fn an_error_names_each_cause_once() {
        #[derive(Debug, thiserror::Error)]
        #[error("configuration: {0}")]
        struct Quoting(#[source] std::io::Error);
        let inner = std::io::Error::other("unknown field `bogus`");
        let e = anyhow::Error::new(Quoting(inner));
        assert_eq!(error_text(&e), "configuration: unknown field `bogus`");
        let e = anyhow::Error::new(std::io::Error::other("disk full")).context("writing");
        assert_eq!(error_text(&e), "writing: disk full");
    }
}
