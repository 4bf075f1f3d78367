//! `reproject` against a real nats-server: the demo's realistic traffic (answered, failed and
//! timed-out turns, delegations, tasks, runtime events, adapter packets, bad input) is projected
//! by the deployment, then recomputed into projection versions beside it.

use crate::support::{Projector, TestNats};
use serde_json::Value;
use std::collections::BTreeSet;
use std::time::Duration;

const DEMO_AGENTS: &str = "ruda,eden,atlas,main";

/// Run `collab-projector ARGS` to its end; its exit code and the JSON line it printed.
async fn run_to_end(args: &[&str], envs: &[(&str, &str)]) -> (i32, Value) {
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
