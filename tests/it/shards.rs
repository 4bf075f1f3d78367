//! Raw traffic sharded over several streams (`nats.shards`): the server's subject mapping sends a
//! key's events to stream `h % shards`, partition `p` reads stream `p % shards`, and everything
//! that reads raw traffic (the workers, `audit`, `reproject`) reads every shard.

use crate::support::{wait_until, Projector, TestNats};
use async_nats::jetstream;
use bytes::Bytes;
use collab_projector::config::Names;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use std::time::Duration;

const SHARDS: u16 = 4;
const ENV: [(&str, &str); 1] = [("COLLAB_NATS__SHARDS", "4")];
const RUN_ARGS: [&str; 4] = ["--main-agents", "ruda,eden", "--turn-timeout", "2s"];
const GUARD: Duration = Duration::from_secs(90);

fn names() -> Names {
    let mut n = Names::new("collab");
    n.set_shards(SHARDS);
    n
}

/// The first `Some` of `probe`, polled every 200 ms; panics after [`GUARD`] (a hang guard).
async fn wait_for<T, F, Fut>(what: &str, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = std::time::Instant::now() + GUARD;
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The audit of every shard once it holds and counts `inputs` raw inputs.
async fn audited(
    js: &jetstream::Context,
    names: &Names,
    inputs: usize,
    what: &str,
) -> collab_projector::ops::Audit {
    wait_for(what, || {
        let js = js.clone();
        let names = names.clone();
        async move {
            collab_projector::ops::audit(&js, &names, 1, 0)
                .await
                .ok()
                .filter(|a| a.holds() && a.raw == inputs)
        }
    })
    .await
}

/// Each of `turns` conversations' one `a2a.response` (conversation -> its body), once every turn
/// has one; panics when a conversation has none or more than one.
pub(crate) async fn one_response_per_turn(
    js: &jetstream::Context,
    turns: usize,
) -> BTreeMap<String, Value> {
    let responses = wait_for("every turn has its response", || {
        let js = js.clone();
        async move {
            let r = crate::pipeline::read_all(
                &js,
                "COLLAB_PROJ",
                "collab.proj.conversation.main.*.a2a.response",
            )
            .await;
            (r.len() >= turns).then_some(r)
        }
    })
    .await;
    let mut per_conv: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    for m in &responses {
        let conv = m.subject.split('.').nth(4).unwrap_or_default().to_string();
        let body: Value = serde_json::from_slice(&m.payload).unwrap_or(Value::Null);
        per_conv.entry(conv).or_default().push(body);
    }
    assert_eq!(per_conv.len(), turns, "{per_conv:#?}");
    per_conv
        .into_iter()
        .map(|(conv, mut rs)| {
            assert_eq!(rs.len(), 1, "{conv}: {rs:#?}");
            (conv, rs.remove(0))
        })
        .collect()
}

/// `collab-projector ARGS` to its end with `envs`: (success, stdout, stderr).
fn run(args: &[&str], envs: &[(&str, &str)]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_collab-projector"))
        .args(args)
        .envs(envs.iter().copied())
        .output()
        .expect("could not run collab-projector");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn task_update(key: &str, n: usize) -> (String, Bytes) {
    let body = json!({"type": "task.updated", "agentId": "ruda", "data": {"taskId": key, "status": "working", "n": n}});
    (
        format!("collab.raw.{key}.task.updated"),
        Bytes::from(body.to_string()),
    )
}

/// Publish and wait for the server's acknowledgement.
async fn publish_acked(
    js: &jetstream::Context,
    subject: String,
    body: Bytes,
) -> jetstream::publish::PublishAck {
    js.publish(subject.clone(), body)
        .await
        .unwrap_or_else(|e| panic!("publish {subject}: {e}"))
        .await
        .unwrap_or_else(|e| panic!("publish ack {subject}: {e}"))
}

/// The raw stream that stored each publish, by key.
async fn publish(
    js: &jetstream::Context,
    subject: String,
    body: Bytes,
    stored: &mut BTreeMap<String, BTreeSet<String>>,
) {
    let key = subject.split('.').nth(2).unwrap_or_default().to_string();
    let ack = publish_acked(js, subject, body).await;
    stored.entry(key).or_default().insert(ack.stream);
}

#[tokio::test]
async fn sharded_raw_traffic_is_projected_from_every_shard_with_one_response_per_turn() {
    let names = names();
    let mapping = names
        .shard_mapping_config()
        .expect("four shards need a mapping");
    // The command prints the block the server is configured with here.
    let (ok, printed, _) = run(&["shards", "--count", "4"], &[]);
    assert!(ok, "`shards --count 4` failed");
    assert_eq!(printed.trim_end(), mapping.trim_end());

    let nats = TestNats::start_with_config(mapping).await;
    let url = nats.url();
    let js = nats.jetstream().await;
    let mut workers: Vec<Projector> = (0..2)
        .map(|_| Projector::spawn(&url, &RUN_ARGS, &ENV))
        .collect();
    wait_until(GUARD, "the raw streams of every shard exist", || {
        let js = js.clone();
        let streams = names.raw_streams.clone();
        async move {
            for s in &streams {
                if js.get_stream(s).await.is_err() {
                    return false;
                }
            }
            true
        }
    })
    .await;

    let mut stored: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut inputs = 0usize;
    for k in 0..40 {
        for n in 0..5 {
            let (subject, body) = task_update(&format!("task-{k}"), n);
            publish(&js, subject, body, &mut stored).await;
            inputs += 1;
        }
    }
    // Every fourth turn gets no reply: it is decided by its deadline, a blocked response.
    let turns = 24;
    for i in 0..turns {
        let conv = format!("conv-{i}");
        let (subject, body) = crate::api::collab_event(
            1,
            "a2a.send",
            "ruda",
            "eden",
            &conv,
            json!({"turnId": "t1"}),
        );
        publish(&js, subject, body, &mut stored).await;
        inputs += 1;
        if i % 4 != 0 {
            let (subject, body) = crate::api::collab_event(
                2,
                "a2a.response",
                "eden",
                "ruda",
                &conv,
                json!({"turnId": "t1"}),
            );
            publish(&js, subject, body, &mut stored).await;
            inputs += 1;
        }
    }
    for i in 0..3 {
        publish(
            &js,
            format!("collab.raw.bad-{i}.task.updated"),
            Bytes::from_static(b"{broken"),
            &mut stored,
        )
        .await;
        inputs += 1;
    }
    // Two producers publish on a shard's subjects themselves, naming a shard that does not
    // hold the key: no partition reads it there; the shard's first partition dead-letters it
    // `misrouted`.
    let mut strays = BTreeMap::new();
    for i in 0..2 {
        let key = format!("stray-{i}");
        let wrong = (names.shard_of_key(&key) + 1 + i) % usize::from(SHARDS);
        let (_, body) = task_update(&key, 0);
        let subject = format!("collab.shard.{SHARDS}.{wrong}.{key}.task.updated");
        let ack = publish_acked(&js, subject.clone(), body).await;
        assert_eq!(ack.stream, names.raw_streams[wrong], "{subject}");
        strays.insert((ack.stream, ack.sequence), key);
        inputs += 1;
    }
    // A key's events all went to the one stream the workers read it from, and every shard
    // holds some.
    for (key, streams) in &stored {
        let want = &names.raw_streams[names.shard_of_key(key)];
        assert_eq!(
            streams,
            &BTreeSet::from([want.clone()]),
            "key {key} stored in {streams:?}"
        );
    }
    let used: BTreeSet<&String> = stored.values().flatten().collect();
    assert_eq!(used.len(), usize::from(SHARDS), "shards used: {used:?}");

    // Every input of every shard is projected or dead-lettered, exactly once.
    let audit = audited(&js, &names, inputs, "every raw input is accounted for").await;
    assert_eq!(audit.dead_lettered, 3 + strays.len(), "{audit:?}");
    assert_eq!(audit.projected, inputs - 3 - strays.len(), "{audit:?}");
    let misrouted = crate::pipeline::read_all(&js, "COLLAB_DLQ", "collab.dlq.misrouted").await;
    let found: BTreeMap<(String, u64), String> = misrouted
        .iter()
        .map(|m| {
            let header = |h: &str| {
                m.headers
                    .as_ref()
                    .and_then(|hs| hs.get(h))
                    .map(|v| v.as_str().to_string())
                    .unwrap_or_default()
            };
            let detail = header("Collab-Dlq-Detail");
            assert!(
                detail.contains("collab.raw.<key>.<type>"),
                "the dead letter does not say how to publish: {detail}"
            );
            (
                (
                    header("Collab-Source-Stream"),
                    header("Collab-Source-Seq").parse().unwrap_or(0),
                ),
                header("Collab-Source-Subject"),
            )
        })
        .collect();
    let want: BTreeMap<(String, u64), String> = strays
        .iter()
        .map(|(at, key)| (at.clone(), format!("collab.raw.{key}.task.updated")))
        .collect();
    assert_eq!(found, want, "one misrouted dead letter per stray");
    // Replayed, each goes through the mapping to its key's shard and is projected there.
    let (ok, stdout, stderr) = run(
        &["dlq", "replay", "--reason", "misrouted", "--nats-url", &url],
        &ENV,
    );
    assert!(ok, "dlq replay failed: {stdout}{stderr}");
    let inputs = inputs + strays.len();
    let audit = audited(&js, &names, inputs, "the replayed strays are projected").await;
    assert_eq!(audit.projected, inputs - 3 - strays.len(), "{audit:?}");
    for key in strays.values() {
        let projected =
            crate::pipeline::read_all(&js, "COLLAB_PROJ", &format!("collab.proj.*.*.{key}.>"))
                .await;
        assert_eq!(projected.len(), 1, "{key}: {projected:?}");
        let id = projected[0].header("Nats-Msg-Id").unwrap_or_default();
        let home = &names.raw_streams[names.shard_of_key(key)];
        assert!(
            id.starts_with(&format!("{home}:")),
            "{key} projected from {id}, not {home}"
        );
    }

    // Exactly one response per turn: the reply, or a blocked outcome for the unanswered ones.
    for (conv, response) in one_response_per_turn(&js, turns).await {
        let i: usize = conv.trim_start_matches("conv-").parse().unwrap_or(0);
        let blocked = response["payload"]["outcome"] == "blocked";
        assert_eq!(blocked, i % 4 == 0, "{conv}: {response:#}");
    }

    // Reprojection reads every shard and reproduces the projections byte for byte.
    for w in workers.iter_mut() {
        w.sigterm();
    }
    for w in workers.iter_mut() {
        w.wait_exit(Duration::from_secs(30)).await;
    }
    let (code, report) = crate::reproject::run_to_end(
        &[
            "reproject",
            "--nats-url",
            &url,
            "--json",
            "--version",
            "v2",
            "--main-agents",
            "ruda,eden",
            "--turn-timeout",
            "2s",
        ],
        &ENV,
    )
    .await;
    assert_eq!(report["liveDigest"], report["versionDigest"], "{report:#}");
    assert_eq!(report["changed"], json!({}), "{report:#}");
    assert_eq!(code, 0, "{report:#}");
    assert_eq!(
        report["versionOutputs"], report["liveOutputs"],
        "{report:#}"
    );
}

#[tokio::test]
async fn a_shard_count_the_server_is_not_set_up_for_is_refused_with_the_fix() {
    // No mapping: no stream takes raw traffic, so provisioning stops and says what to add.
    let plain = TestNats::start().await;
    let (ok, stdout, stderr) = run(&["provision", "--nats-url", &plain.url()], &ENV);
    let said = format!("{stdout}{stderr}");
    assert!(!ok, "provisioned four shards without a mapping: {said}");
    assert!(
        said.contains("collab-projector shards --count 4"),
        "the error does not say how to fix it: {said}"
    );

    // Four shards made, then another count: refused, naming the setting and what exists.
    let mapped =
        TestNats::start_with_config(names().shard_mapping_config().unwrap_or_default()).await;
    let (ok, stdout, stderr) = run(&["provision", "--nats-url", &mapped.url()], &ENV);
    assert!(ok, "provisioning four shards failed: {stdout}{stderr}");
    let (ok, stdout, stderr) = run(
        &["provision", "--nats-url", &mapped.url()],
        &[("COLLAB_NATS__SHARDS", "2")],
    );
    let said = format!("{stdout}{stderr}");
    assert!(!ok, "two shards accepted over four: {said}");
    assert!(
        said.contains("nats.shards") && said.contains("COLLAB_RAW_0OF4"),
        "{said}"
    );
    let (ok, stdout, stderr) = run(&["provision", "--nats-url", &mapped.url()], &[]);
    let said = format!("{stdout}{stderr}");
    assert!(!ok, "one raw stream accepted over four shards: {said}");
    assert!(said.contains("nats.shards"), "{said}");
    // An invalid count is refused before anything is touched.
    let (ok, stdout, stderr) = run(
        &["provision", "--nats-url", &mapped.url()],
        &[("COLLAB_NATS__SHARDS", "3")],
    );
    let said = format!("{stdout}{stderr}");
    assert!(!ok && said.contains("nats.shards (3)"), "{said}");
}
