//! `reproject` against a real nats-server: the demo's realistic traffic (answered, failed and
//! timed-out turns, delegations, tasks, runtime events, adapter packets, bad input) is projected
//! by the deployment, then recomputed into projection versions beside it.

use crate::support::{Projector, TestNats};
use serde_json::Value;
use std::collections::BTreeSet;
use std::time::Duration;

const DEMO_AGENTS: &str = "ruda,eden,atlas,main";

/// Run `collab-projector ARGS` to its end; its exit code and the JSON line it printed.
pub(crate) async fn run_to_end(args: &[&str], envs: &[(&str, &str)]) -> (i32, Value) {
    let mut p = Projector::spawn_command(args, envs);
    let status = p
        .wait_exit(Duration::from_secs(120))
        .await
        .unwrap_or_else(|| panic!("{args:?} did not finish in 120 s: {}", p.log_text()));
    let log = p.log_text();
    let json = log
        .lines()
        .find(|l| l.starts_with('{'))
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("{args:?} printed no JSON report: {log}"));
    (status.code().unwrap_or(-1), json)
}

/// Every `conversation.main` send of the deployment as (key, turn id, from, to).
async fn main_sends(js: &async_nats::jetstream::Context) -> Vec<(String, String, String, String)> {
    let msgs =
        crate::pipeline::read_all(js, "DEMO_PROJ", "demo.proj.conversation.main.*.a2a.send").await;
    msgs.iter()
        .filter_map(|m| {
            let env: Value = serde_json::from_slice(&m.payload).ok()?;
            let key = m.subject.split('.').nth(4)?.to_string();
            let turn = match env.get("turnId")? {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            let p = env.get("payload")?;
            let from = env.get("agentId")?.as_str()?.to_string();
            let to = ["toAgent", "targetAgentId", "to"]
                .iter()
                .find_map(|k| p.get(*k).and_then(Value::as_str))
                .unwrap_or_default()
                .to_string();
            Some((key, turn, from, to))
        })
        .collect()
}

#[tokio::test]
async fn reprojection_reproduces_the_projections_and_names_what_a_rule_change_changes() {
    let nats = TestNats::start().await;
    let url = nats.url();
    // The deployment: the demo's workers and generator for a few seconds, with 1 s deadlines so
    // unanswered turns are decided while it runs.
    let mut demo = Projector::spawn_command(
        &[
            "demo",
            "--nats-url",
            &url,
            "--duration",
            "8s",
            "--rate",
            "40",
            "--turn-timeout",
            "1s",
            "--http-addr",
            "127.0.0.1:0",
        ],
        &[],
    );
    let status = demo.wait_exit(Duration::from_secs(60)).await;
    assert!(
        status.is_some_and(|s| s.success()),
        "the demo did not stop cleanly: {}",
        demo.log_text()
    );
    // Reads of an exchange's raw events (timed-out runs, streamed A2A answers) leave no reader
    // behind on the raw stream: only the partitions' own consumers remain.
    let js = nats.jetstream().await;
    let mut raw = js
        .get_stream("DEMO_RAW")
        .await
        .expect("the demo made its raw stream");
    let consumers = raw
        .info()
        .await
        .expect("raw stream info")
        .state
        .consumer_count;
    assert_eq!(consumers, 16, "readers left on the raw stream");
    let env = [("COLLAB_NATS__PREFIX", "demo")];
    let base = [
        "reproject",
        "--nats-url",
        url.as_str(),
        "--json",
        "--turn-timeout",
        "1s",
    ];

    // Unchanged rules: the same outputs, byte for byte.
    let mut same = base.to_vec();
    same.extend(["--version", "v2", "--main-agents", DEMO_AGENTS]);
    let (code, report) = run_to_end(&same, &env).await;
    assert_eq!(report["liveDigest"], report["versionDigest"], "{report:#}");
    assert_eq!(code, 0, "{report:#}");
    assert_eq!(report["changed"], serde_json::json!({}), "{report:#}");
    assert_eq!(report["liveBehind"], false, "{report:#}");
    let outputs = report["liveOutputs"].as_u64().unwrap_or(0);
    assert!(outputs > 200, "too little traffic to compare: {report:#}");
    assert_eq!(report["versionOutputs"].as_u64(), Some(outputs));
    // The comparison covered decided timeouts and dead letters, not only plain events.
    let responses = crate::pipeline::read_all(
        &js,
        "DEMO_PROJ",
        "demo.proj.conversation.main.*.a2a.response",
    )
    .await;
    assert!(
        responses
            .iter()
            .any(|m| String::from_utf8_lossy(&m.payload).contains("\"timeout\"")),
        "the demo decided no turn by timeout"
    );
    assert!(crate::support::outputs_in(&js, "DEMO_DLQ").await > 0);

    // One main agent less: exactly the turns it took part in change, and the exit code says so.
    let mut changed = base.to_vec();
    changed.extend(["--version", "v3", "--main-agents", "ruda,atlas,main"]);
    let (code, report) = run_to_end(&changed, &env).await;
    assert_eq!(code, 1, "{report:#}");
    let named: BTreeSet<(String, String)> = report["turns"]
        .as_array()
        .map(|ts| {
            ts.iter()
                .map(|t| {
                    (
                        t["key"].as_str().unwrap_or_default().to_string(),
                        t["turn"].as_str().unwrap_or_default().to_string(),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    let answered: BTreeSet<(String, String)> = responses
        .iter()
        .filter_map(|m| {
            let env: Value = serde_json::from_slice(&m.payload).ok()?;
            let turn = match env.get("turnId")? {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            Some((m.subject.split('.').nth(4)?.to_string(), turn))
        })
        .collect();
    let expected: BTreeSet<(String, String)> = main_sends(&js)
        .await
        .into_iter()
        .filter(|(_, _, from, to)| from == "eden" || to == "eden")
        .map(|(k, t, _, _)| (k, t))
        .filter(|kt| answered.contains(kt))
        .collect();
    assert!(
        !expected.is_empty(),
        "the demo had no answered turn with eden"
    );
    assert_eq!(named, expected, "{report:#}");
    for t in report["turns"].as_array().into_iter().flatten() {
        assert_eq!(t["version"], "none", "{t}");
    }
    assert!(
        report["changed"]["role"].as_u64().unwrap_or(0) > 0,
        "{report:#}"
    );

    // A version that exists is never overwritten; --drop removes it, and it can be computed again.
    let (code, _) = (
        Projector::spawn_command(&same, &env)
            .wait_exit(Duration::from_secs(60))
            .await
            .and_then(|s| s.code()),
        (),
    );
    assert_eq!(
        code,
        Some(1),
        "a second run over an existing version must be refused"
    );
    let mut dropped = Projector::spawn_command(
        &["reproject", "--nats-url", &url, "--version", "v2", "--drop"],
        &env,
    );
    assert!(dropped
        .wait_exit(Duration::from_secs(60))
        .await
        .is_some_and(|s| s.success()));
    assert!(
        dropped.log_text().contains("removed stream DEMO_V2_PROJ"),
        "{}",
        dropped.log_text()
    );
    assert!(js.get_stream("DEMO_V2_PROJ").await.is_err());
    assert!(js.get_stream("DEMO_RAW").await.is_ok() && js.get_stream("DEMO_PROJ").await.is_ok());
    let (code, report) = run_to_end(&same, &env).await;
    assert_eq!((code, &report["liveDigest"]), (0, &report["versionDigest"]));
}

/// `GET http://ADDR/PATH`: status, the served version's header, and the JSON body.
async fn api_get(addr: &str, path: &str) -> (u16, Option<String>, Value) {
    let url = format!("http://{addr}{path}");
    let resp = reqwest::get(&url)
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    let status = resp.status().as_u16();
    let version = resp
        .headers()
        .get("collab-projection-version")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body = resp.json().await.unwrap_or(Value::Null);
    (status, version, body)
}

/// Wait for a process to print its HTTP address.
async fn http_addr_of(p: &Projector) -> String {
    crate::support::wait_until(Duration::from_secs(60), "the HTTP address", || async {
        p.log_text().contains("http listening on ")
    })
    .await;
    p.http_addr()
}

/// Run `collab-projector ARGS`: its exit status and what it printed.
async fn command(args: &[&str]) -> (bool, String) {
    let mut p = Projector::spawn_command(args, &[]);
    let status = p
        .wait_exit(Duration::from_secs(120))
        .await
        .unwrap_or_else(|| panic!("{args:?} did not finish in 120 s: {}", p.log_text()));
    (status.success(), p.log_text())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_switch_moves_the_api_and_its_event_streams_to_a_version_and_back() {
    use futures::StreamExt;
    let nats = TestNats::start().await;
    let url = nats.url();
    let js = nats.jetstream().await;
    let agents = ["--main-agents", "ruda,eden"];
    let deployment = Projector::spawn(&url, &agents, &[]);
    let addr = http_addr_of(&deployment).await;
    for (i, conv) in ["sw-1", "sw-2", "sw-3"].iter().enumerate() {
        let (subject, body) = crate::api::collab_event(
            i64::try_from(i).unwrap_or(0),
            "a2a.send",
            "ruda",
            "eden",
            conv,
            serde_json::json!({"message": "status?", "timeoutMs": 3_600_000}),
        );
        crate::pipeline::publish(&js, &subject, body).await;
    }
    let count = |v: &Value| v["events"].as_array().map_or(0, Vec::len);
    crate::support::wait_until(
        Duration::from_secs(60),
        "the deployment projected the sends",
        || {
            let addr = addr.clone();
            async move { count(&api_get(&addr, "/api/events?limit=100").await.2) == 3 }
        },
    )
    .await;
    let (status, served, page) = api_get(&addr, "/api/events?limit=100").await;
    assert_eq!((status, served.as_deref()), (200, Some("")), "{page}");
    let own_cursor = page["next"].as_str().unwrap_or_default().to_string();

    // The version: computed, then kept current by its own worker.
    let (ok, log) = command(&[
        "reproject",
        "--nats-url",
        &url,
        "--json",
        "--version",
        "v2",
        "--main-agents",
        "ruda,eden",
    ])
    .await;
    assert!(ok, "reproject: {log}");
    let _version = Projector::spawn(&url, &agents, &[("COLLAB_NATS__VERSION", "v2")]);

    // An event stream open on the deployment's projections.
    let stream = reqwest::get(format!("http://{addr}/api/events/stream"))
        .await
        .expect("the event stream opens");
    assert_eq!(stream.status().as_u16(), 200);
    let mut stream = stream.bytes_stream();

    let (ok, log) = command(&[
        "reproject",
        "--nats-url",
        &url,
        "--version",
        "v2",
        "--switch",
    ])
    .await;
    assert!(
        ok && log.contains("the API now serves projection version v2"),
        "{log}"
    );
    crate::support::wait_until(Duration::from_secs(30), "the API serves v2", || {
        let addr = addr.clone();
        async move { api_get(&addr, "/api/events").await.1.as_deref() == Some("v2") }
    })
    .await;
    // The open stream ends, saying why.
    let mut text = String::new();
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    while !text.contains("version_switched") {
        match tokio::time::timeout_at(until, stream.next()).await {
            Ok(Some(Ok(chunk))) => text.push_str(&String::from_utf8_lossy(&chunk)),
            _ => break,
        }
    }
    assert!(
        text.contains("event: error") && text.contains("version_switched"),
        "the deployment's event stream did not end on the switch: {text:.500}"
    );
    // The version's projections, with cursors of its own; the deployment's cursor is gone.
    let (status, _, page) = api_get(&addr, "/api/events?limit=100").await;
    assert_eq!((status, count(&page)), (200, 3), "{page}");
    assert!(
        page["events"]
            .as_array()
            .into_iter()
            .flatten()
            .all(|e| e["subject"]
                .as_str()
                .is_some_and(|s| s.starts_with("collab_v2.proj."))),
        "{page}"
    );
    let version_cursor = page["next"].as_str().unwrap_or_default().to_string();
    assert_ne!(version_cursor, own_cursor);
    let (status, _, err) = api_get(&addr, &format!("/api/events?after={own_cursor}")).await;
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (410, Some("version_switched")),
        "{err}"
    );
    let (status, _, _) = api_get(&addr, &format!("/api/events?after={version_cursor}")).await;
    assert_eq!(status, 200);

    // A served version cannot be dropped.
    let (ok, log) = command(&["reproject", "--nats-url", &url, "--version", "v2", "--drop"]).await;
    assert!(!ok && log.contains("switch back first"), "{log}");
    assert!(js.get_stream("COLLAB_V2_PROJ").await.is_ok());

    // The way back.
    let (ok, log) = command(&["reproject", "--nats-url", &url, "--switch-back"]).await;
    assert!(
        ok && log.contains("the API now serves the deployment's own projections"),
        "{log}"
    );
    crate::support::wait_until(
        Duration::from_secs(30),
        "the API serves the deployment",
        || {
            let addr = addr.clone();
            async move { api_get(&addr, "/api/events").await.1.as_deref() == Some("") }
        },
    )
    .await;
    let (status, _, _) = api_get(&addr, &format!("/api/events?after={own_cursor}")).await;
    assert_eq!(status, 200);
    let (status, _, err) = api_get(&addr, &format!("/api/events?after={version_cursor}")).await;
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (410, Some("version_switched")),
        "{err}"
    );
    let (ok, log) = command(&["reproject", "--nats-url", &url, "--version", "v2", "--drop"]).await;
    assert!(ok, "{log}");
}
