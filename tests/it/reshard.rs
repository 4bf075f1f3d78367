//! Changing the shard count of a running deployment (`collab-projector reshard`): new raw
//! streams beside the old ones, the server's mapping moved by a reload, the old streams sealed,
//! every partition reading its old stream to its end before the new one. Producers keep
//! publishing throughout; nothing may be lost, doubled or reordered within a key, and every
//! turn, those open across the move too, gets exactly one response.

use crate::support::{Projector, TestNats};
use async_nats::jetstream;
use bytes::Bytes;
use collab_projector::config::Names;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const RUN_ARGS: [&str; 4] = ["--main-agents", "ruda,eden", "--turn-timeout", "20s"];
const GUARD: Duration = Duration::from_secs(120);

fn names(shards: u16) -> Names {
    let mut n = Names::new("collab");
    n.set_shards(shards);
    n
}

/// What the producer published and the server acknowledged, in order.
#[derive(Default)]
struct Published {
    /// key -> the `n` of each task update, in publish order.
    tasks: BTreeMap<String, Vec<u64>>,
    /// Raw inputs acknowledged.
    inputs: usize,
    /// Publishes refused (a sealed stream, a node not reloaded yet) and sent again.
    refused: usize,
    /// The streams that stored some input.
    streams: BTreeSet<String>,
}

/// Publish until acknowledged, counting refusals: a producer's retry.
async fn publish(js: &jetstream::Context, subject: String, body: Bytes, log: &Mutex<Published>) {
    let deadline = Instant::now() + GUARD;
    loop {
        let acked = match js.publish(subject.clone(), body.clone()).await {
            Ok(ack) => ack.await,
            Err(e) => Err(e),
        };
        match acked {
            Ok(ack) => {
                if let Ok(mut l) = log.lock() {
                    l.inputs += 1;
                    l.streams.insert(ack.stream);
                }
                return;
            }
            Err(e) => {
                assert!(Instant::now() < deadline, "publish {subject}: {e}");
                if let Ok(mut l) = log.lock() {
                    l.refused += 1;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

fn task_update(key: &str, n: u64) -> (String, Bytes) {
    let body = json!({"type": "task.updated", "agentId": "ruda", "data": {"taskId": key, "status": "working", "n": n}});
    (
        format!("collab.raw.{key}.task.updated"),
        Bytes::from(body.to_string()),
    )
}

fn send(conv: &str) -> (String, Bytes) {
    crate::api::collab_event(1, "a2a.send", "ruda", "eden", conv, json!({"turnId": "t1"}))
}

fn reply(conv: &str) -> (String, Bytes) {
    crate::api::collab_event(
        2,
        "a2a.response",
        "eden",
        "ruda",
        conv,
        json!({"turnId": "t1"}),
    )
}

/// Task updates on 24 keys, 40 a second, until `stop`.
async fn produce(js: jetstream::Context, log: Arc<Mutex<Published>>, stop: Arc<AtomicBool>) {
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let key = format!("task-{}", n % 24);
        let (subject, body) = task_update(&key, n / 24);
        publish(&js, subject, body, &log).await;
        if let Ok(mut l) = log.lock() {
            l.tasks.entry(key).or_default().push(n / 24);
        }
        n += 1;
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// `collab-projector reshard --drop-sealed` with `envs`: (success, what it said).
fn drop_sealed(url: &str, envs: &[(&str, &str)]) -> (bool, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_collab-projector"))
        .args(["reshard", "--drop-sealed", "--nats-url", url])
        .envs(envs.iter().copied())
        .output()
        .expect("reshard --drop-sealed");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

async fn wait_for<T, F, Fut>(what: &str, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + GUARD;
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn a_running_deployment_moves_from_two_raw_streams_to_four_losing_doubling_and_reordering_nothing(
) {
    let (two, four) = (names(2), names(4));
    let mut nats =
        TestNats::start_with_config(two.shard_mapping_config().unwrap_or_default()).await;
    let url = nats.url();
    let js = nats.jetstream().await;
    let env = [("COLLAB_NATS__SHARDS", "2")];
    let mut workers: Vec<Projector> = (0..2)
        .map(|_| Projector::spawn(&url, &RUN_ARGS, &env))
        .collect();
    streams_exist(&js, &two.raw_streams).await;

    let log = Arc::new(Mutex::new(Published::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let producer = tokio::spawn(produce(js.clone(), log.clone(), stop.clone()));
    // Turns before the move: half answered now, half left open to be answered after it; every
    // fourth of the first half never answered (a blocked response once its deadline passes).
    let turns = 16;
    for i in 0..turns {
        let (s, b) = send(&format!("conv-{i}"));
        publish(&js, s, b, &log).await;
    }
    for i in (0..turns / 2).filter(|i| i % 4 != 0) {
        let (s, b) = reply(&format!("conv-{i}"));
        publish(&js, s, b, &log).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;

    // The reshard: it creates the four streams, waits for the mapping the operator reloads,
    // seals the old streams and waits for the partitions.
    let report = reshard_with_reload(&mut nats, 4, four.shard_mapping_config()).await;
    assert_eq!(report["fromShards"], 2, "{report:#}");
    assert_eq!(report["toShards"], 4, "{report:#}");
    assert_eq!(report["sealed"], json!(two.raw_streams), "{report:#}");
    for s in &two.raw_streams {
        let info = js
            .get_stream(s)
            .await
            .expect("old stream")
            .cached_info()
            .clone();
        assert!(info.config.sealed, "{s} is not sealed");
    }
    // Turns opened there are still open: the sealed streams cannot go yet.
    let (ok, said) = drop_sealed(&url, &[]);
    assert!(
        !ok && said.contains("Drop the sealed streams in"),
        "dropped with turns open: {said}"
    );

    // The open turns are answered after the move (their sends are in the sealed streams).
    for i in turns / 2..turns {
        let (s, b) = reply(&format!("conv-{i}"));
        publish(&js, s, b, &log).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    producer.await.expect("producer");
    let (inputs, tasks, used, refused) = {
        let l = log.lock().expect("log");
        (l.inputs, l.tasks.clone(), l.streams.clone(), l.refused)
    };
    // Traffic landed in both sets.
    for s in two.raw_streams.iter().chain(&four.raw_streams) {
        assert!(used.contains(s), "nothing was stored in {s}: {used:?}");
    }

    // Every input of every stream, sealed or new, is projected or dead-lettered, exactly once.
    let audit = wait_for("every input is accounted for", || {
        let js = js.clone();
        let four = four.clone();
        async move {
            collab_projector::ops::audit(&js, &four, 1, 0)
                .await
                .ok()
                .filter(|a| a.holds() && a.raw == inputs)
        }
    })
    .await;
    assert_eq!(audit.projected, inputs, "{audit:?}");

    // No input projected twice, and each key's updates in the order they were published.
    let projected = crate::pipeline::read_all(&js, "COLLAB_PROJ", "collab.proj.>").await;
    let mut ids = BTreeSet::new();
    let mut seen: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for m in &projected {
        let id = m.header("Nats-Msg-Id").unwrap_or_default();
        assert!(ids.insert(id.clone()), "two projections with Msg-Id {id}");
        if m.subject.ends_with(".task.updated") {
            let body: Value = serde_json::from_slice(&m.payload).unwrap_or(Value::Null);
            let key = m.subject.split('.').nth(4).unwrap_or_default().to_string();
            let n = body["payload"]["n"]
                .as_u64()
                .or_else(|| body["payload"]["data"]["n"].as_u64());
            seen.entry(key).or_default().extend(n);
        }
    }
    assert_eq!(seen, tasks, "task updates lost, doubled or out of order");

    // One response per turn, the ones open across the move answered by their real reply.
    for (conv, response) in crate::shards::one_response_per_turn(&js, turns).await {
        let i: usize = conv.trim_start_matches("conv-").parse().unwrap_or(0);
        let blocked = response["payload"]["outcome"] == "blocked";
        assert_eq!(blocked, i < turns / 2 && i % 4 == 0, "{conv}: {response:#}");
    }

    // The workers said why their partitions restarted.
    let logs: String = workers.iter().map(Projector::log_text).collect();
    assert!(
        logs.contains("read its sealed raw stream to its end"),
        "no partition moved: {logs}"
    );
    eprintln!(
        "reshard 2 -> 4: mapping live after {}s, {} inputs left at the seal, moved {}s after it; {refused} publishes refused and sent again",
        report["mappingWaitS"], report["leftAtSeal"], report["moveS"]
    );

    // The sealed streams go once every consumer has read them and every deadline a request
    // there set has passed (5 s here); the deployment keeps working.
    let short = [
        ("COLLAB_TURNS__MAX_TIMEOUT", "5s"),
        ("COLLAB_TURNS__DEFAULT_TIMEOUT", "5s"),
        ("COLLAB_RUNS__TIMEOUT", "5s"),
    ];
    wait_for("the sealed streams are dropped", || {
        let url = url.clone();
        async move {
            let (ok, said) = drop_sealed(&url, &short);
            assert!(ok || said.contains("Drop the sealed streams in"), "{said}");
            ok.then_some(())
        }
    })
    .await;
    for s in &two.raw_streams {
        assert!(js.get_stream(s).await.is_err(), "{s} is still there");
    }
    let (s, b) = task_update("after-drop", 0);
    publish(&js, s, b, &log).await;
    wait_for("an input after the drop is projected", || {
        let js = js.clone();
        async move {
            let r =
                crate::pipeline::read_all(&js, "COLLAB_PROJ", "collab.proj.*.*.after-drop.>").await;
            (r.len() == 1).then_some(())
        }
    })
    .await;
    for w in workers.iter_mut() {
        w.sigterm();
    }
    for w in workers.iter_mut() {
        w.wait_exit(Duration::from_secs(30)).await;
    }
}

/// A running `collab-projector reshard --count <count> --json`, its stderr read as it comes.
pub(crate) struct ReshardRun {
    child: tokio::process::Child,
    said: Arc<Mutex<String>>,
    asked: tokio::sync::watch::Receiver<bool>,
}

impl ReshardRun {
    pub(crate) fn start(url: &str, count: u16, envs: &[(String, String)]) -> ReshardRun {
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_collab-projector"));
        cmd.args([
            "reshard",
            "--count",
            &count.to_string(),
            "--wait",
            "90s",
            "--json",
            "--nats-url",
            url,
        ])
        .envs(envs.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
        let mut child = cmd.spawn().expect("could not run collab-projector reshard");
        let said = Arc::new(Mutex::new(String::new()));
        let (told, asked) = tokio::sync::watch::channel(false);
        if let Some(stderr) = child.stderr.take() {
            let said = said.clone();
            tokio::spawn(async move {
                use tokio::io::AsyncBufReadExt;
                let mut lines = tokio::io::BufReader::new(stderr).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    if line.starts_with("now put the block above") {
                        let _ = told.send(true);
                    }
                    if let Ok(mut s) = said.lock() {
                        s.push_str(&line);
                        s.push('\n');
                    }
                }
            });
        }
        ReshardRun { child, said, asked }
    }

    /// Wait until the command asks for the new mapping (its streams and markers are stored):
    /// `false` if it ended or `within` passed first.
    pub(crate) async fn asked_for_mapping(&mut self, within: Duration) -> bool {
        matches!(
            tokio::time::timeout(within, self.asked.wait_for(|t| *t)).await,
            Ok(Ok(_))
        )
    }

    /// What it wrote to stderr so far.
    pub(crate) fn said(&self) -> String {
        self.said.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Wait for it to end within `within`: whether it succeeded and its stdout, or why not.
    pub(crate) async fn finish(self, within: Duration) -> Result<(bool, Vec<u8>), String> {
        let said = self.said.clone();
        match tokio::time::timeout(within, self.child.wait_with_output()).await {
            Ok(Ok(out)) => Ok((out.status.success(), out.stdout)),
            Ok(Err(e)) => Err(format!("reshard: {e}")),
            Err(_) => Err(format!(
                "reshard did not finish within {within:?}: {}",
                said.lock().map(|s| s.clone()).unwrap_or_default()
            )),
        }
    }
}

/// Run `collab-projector reshard --count <count>` to its end while `reload` puts the server's
/// new mapping in place once the new streams exist; the command's JSON report.
async fn reshard_with_reload(nats: &mut TestNats, count: u16, mapping: Option<String>) -> Value {
    let mut running = ReshardRun::start(&nats.url(), count, &[]);
    assert!(
        running.asked_for_mapping(GUARD).await,
        "the reshard never asked for the mapping: {}",
        running.said()
    );
    reload_and_finish(nats, running, count, mapping).await
}

/// Put `mapping` in place on the server and let the `reshard --count <count>` in `running`
/// finish; its JSON report.
async fn reload_and_finish(
    nats: &mut TestNats,
    running: ReshardRun,
    count: u16,
    mapping: Option<String>,
) -> Value {
    nats.local()
        .expect("a local nats-server")
        .reconfigure(mapping)
        .await
        .expect("reloading the server");
    let said = running.said();
    let (ok, stdout) = running
        .finish(GUARD)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let stdout_text = String::from_utf8_lossy(&stdout).to_string();
    assert!(ok, "reshard to {count} failed: {stdout_text}{said}");
    json_report(&stdout).unwrap_or_else(|| panic!("no JSON report: {stdout_text}{said}"))
}

/// Phase `n` of the task updates: one on each of 12 keys, recorded in `wanted` (key -> its
/// `n`s, in publish order).
fn phase(n: u64, wanted: &mut BTreeMap<String, Vec<u64>>) -> Vec<(String, Bytes)> {
    (0..12)
        .map(|k| {
            let key = format!("task-{k}");
            wanted.entry(key.clone()).or_default().push(n);
            task_update(&key, n)
        })
        .collect()
}

/// Every task update in the projection stream, in stream order.
async fn projected_updates(js: &jetstream::Context) -> Vec<crate::pipeline::Stored> {
    crate::pipeline::read_all(js, "COLLAB_PROJ", "collab.proj.*.*.*.task.updated").await
}

/// Whether at least `n` task updates are projected (a `wait_for` probe; `None` while the
/// projection stream does not exist yet, as before a freshly started worker has created it).
async fn updates_projected(js: jetstream::Context, n: usize) -> Option<()> {
    js.get_stream("COLLAB_PROJ").await.ok()?;
    (projected_updates(&js).await.len() >= n).then_some(())
}

/// The `n` of each projected task update, per key, in stream order.
fn updates_by_key(projected: &[crate::pipeline::Stored]) -> BTreeMap<String, Vec<u64>> {
    let mut seen: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for m in projected {
        let body: Value = serde_json::from_slice(&m.payload).unwrap_or(Value::Null);
        let key = m.subject.split('.').nth(4).unwrap_or_default().to_string();
        seen.entry(key).or_default().extend(
            body["payload"]["n"]
                .as_u64()
                .or_else(|| body["payload"]["data"]["n"].as_u64()),
        );
    }
    seen
}

/// The last line of a command's standard output that is a JSON object (its `--json` report).
pub(crate) fn json_report(stdout: &[u8]) -> Option<Value> {
    let line = stdout
        .split(|b| *b == b'\n')
        .rfind(|l| l.starts_with(b"{"))?;
    serde_json::from_slice(line).ok()
}

#[tokio::test]
async fn one_raw_stream_becomes_two_and_one_again_and_every_input_is_projected_once() {
    let mut nats = TestNats::start().await;
    let url = nats.url();
    let js = nats.jetstream().await;
    let mut worker = Projector::spawn(&url, &RUN_ARGS, &[]);
    let log = Mutex::new(Published::default());
    let mut wanted: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for (s, b) in phase(0, &mut wanted) {
        publish(&js, s, b, &log).await;
    }

    // 1 -> 2: the server gets the mapping.
    let report = reshard_with_reload(&mut nats, 2, names(2).shard_mapping_config()).await;
    assert_eq!(report["fromShards"], 1, "{report:#}");
    assert_eq!(report["sealed"], json!(["COLLAB_RAW"]), "{report:#}");
    for (s, b) in phase(1, &mut wanted) {
        publish(&js, s, b, &log).await;
    }
    // Back to 1 needs the sealed COLLAB_RAW gone first; the command says so.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_collab-projector"))
        .args(["reshard", "--count", "1", "--nats-url", &url])
        .output()
        .expect("reshard");
    let said = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success() && said.contains("--drop-sealed"),
        "{said}"
    );
    let short = [
        ("COLLAB_TURNS__MAX_TIMEOUT", "1s"),
        ("COLLAB_TURNS__DEFAULT_TIMEOUT", "1s"),
        ("COLLAB_RUNS__TIMEOUT", "1s"),
    ];
    wait_for("COLLAB_RAW is dropped", || {
        let url = url.clone();
        async move { drop_sealed(&url, &short).0.then_some(()) }
    })
    .await;

    // 2 -> 1: the mapping goes; a new COLLAB_RAW starts after both earlier sets.
    // A reload keeps a mapping removed from the file: the command's block maps the raw
    // subjects onto themselves instead.
    let report = reshard_with_reload(&mut nats, 1, Some(names(1).unsharded_mapping_config())).await;
    assert_eq!(report["toShards"], 1, "{report:#}");
    assert_eq!(report["sealed"], json!(names(2).raw_streams), "{report:#}");
    let base = report["base"].as_u64().unwrap_or(0);
    assert_eq!(
        base,
        2 * collab_projector::config::GENERATION_SPAN,
        "{report:#}"
    );
    for (s, b) in phase(2, &mut wanted) {
        publish(&js, s, b, &log).await;
    }
    let raw = js
        .get_stream("COLLAB_RAW")
        .await
        .expect("COLLAB_RAW")
        .cached_info()
        .clone();
    assert!(raw.state.first_sequence >= base, "{:?}", raw.state);

    // Every update of every phase projected once, in order, from the stream that held it.
    let inputs = log.lock().map(|l| l.inputs).unwrap_or(0);
    wait_for("every update is projected", || {
        updates_projected(js.clone(), inputs)
    })
    .await;
    let projected = projected_updates(&js).await;
    let from: BTreeSet<String> = projected
        .iter()
        .map(|m| {
            let id = m.header("Nats-Msg-Id").unwrap_or_default();
            id.split(':').next().unwrap_or_default().to_string()
        })
        .collect();
    assert_eq!(
        updates_by_key(&projected),
        wanted,
        "updates lost, doubled or out of order"
    );
    assert!(
        from.contains("COLLAB_RAW_0OF2") && from.contains("COLLAB_RAW"),
        "{from:?}"
    );
    worker.sigterm();
    worker.wait_exit(Duration::from_secs(30)).await;
}

/// A worker that dies holding deliveries of a raw stream about to be sealed: its successor
/// reads them from the stream, and once their outputs are stored acknowledges them itself, so
/// the partitions leave the sealed stream (and the reshard ends) without waiting for the
/// consumer's `ack_wait` to return the dead worker's deliveries. None of them is delivered
/// again, and every update is projected once, in order.
#[tokio::test]
async fn a_dead_owners_deliveries_do_not_hold_a_sealed_stream_for_ack_wait() {
    const ACK_WAIT: Duration = Duration::from_secs(60);
    let mut nats = TestNats::start().await;
    let url = nats.url();
    let js = nats.jetstream().await;
    let env = [("COLLAB_CONSUMER__ACK_WAIT", "60s")];
    let log = Mutex::new(Published::default());
    let mut wanted: BTreeMap<String, Vec<u64>> = BTreeMap::new();

    let mut first = Projector::spawn(&url, &RUN_ARGS, &env);
    for (s, b) in phase(0, &mut wanted) {
        publish(&js, s, b, &log).await;
    }
    wait_for("phase 0 is projected", || updates_projected(js.clone(), 12)).await;
    first.sigterm();
    first.wait_exit(Duration::from_secs(30)).await;

    // Inputs delivered to a client that never acknowledges them: a worker killed mid-batch.
    for (s, b) in phase(1, &mut wanted) {
        publish(&js, s, b, &log).await;
    }
    let raw = js.get_stream("COLLAB_RAW").await.expect("COLLAB_RAW");
    let consumers: Vec<String> = {
        use futures::TryStreamExt;
        raw.consumer_names()
            .try_collect()
            .await
            .expect("consumer names")
    };
    let mut held = 0usize;
    for name in &consumers {
        let consumer: jetstream::consumer::PullConsumer =
            raw.get_consumer(name).await.expect("consumer");
        let mut batch = consumer
            .fetch()
            .max_messages(100)
            .expires(Duration::from_millis(500))
            .messages()
            .await
            .expect("fetch");
        use futures::StreamExt;
        while let Some(Ok(_)) = batch.next().await {
            held += 1;
        }
    }
    assert_eq!(held, 12, "the dead worker's deliveries");

    let mut worker = Projector::spawn(&url, &RUN_ARGS, &env);
    let started = Instant::now();
    let report = reshard_with_reload(&mut nats, 2, names(2).shard_mapping_config()).await;
    let took = started.elapsed();
    assert_eq!(report["sealed"], json!(["COLLAB_RAW"]), "{report:#}");
    assert!(
        took < ACK_WAIT,
        "the partitions left the sealed stream only after {took:?}, as the dead worker's deliveries came back (ack_wait {ACK_WAIT:?})"
    );
    let mut redelivered = 0usize;
    for name in &consumers {
        let info = raw
            .clone()
            .consumer_info(name)
            .await
            .expect("consumer info");
        assert_eq!(info.num_ack_pending, 0, "{name}: {info:?}");
        redelivered += info.num_redelivered;
    }
    assert_eq!(redelivered, 0, "deliveries of the dead worker came back");

    for (s, b) in phase(2, &mut wanted) {
        publish(&js, s, b, &log).await;
    }
    wait_for("every update is projected", || {
        updates_projected(js.clone(), 36)
    })
    .await;
    assert_eq!(
        updates_by_key(&projected_updates(&js).await),
        wanted,
        "updates lost, doubled or out of order"
    );
    worker.sigterm();
    worker.wait_exit(Duration::from_secs(30)).await;
}

/// `reshard` creates a new set's streams one after another: a worker starting, or a running one
/// looking, in between finds part of a set, which is whole a moment later. The look-up waits
/// for it instead of failing (a worker used to exit at start, naming the stream not created
/// yet); a set that stays incomplete is still an error naming what is missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_of_raw_streams_found_half_created_is_read_once_whole() {
    use collab_projector::bus::generations;
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let stream = |name: &str, subject: &str| jetstream::stream::Config {
        name: name.to_string(),
        subjects: vec![subject.to_string()],
        ..Default::default()
    };
    let n = names(1);
    let first = n.shard_stream_names(2);
    js.create_stream(stream(&first[0], "half.0"))
        .await
        .expect("the set's first stream");
    let creator = {
        let js = js.clone();
        let second = stream(&first[1], "half.1");
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            js.create_stream(second).await.map(|_| ())
        })
    };
    let found = generations::discover(&js, &n)
        .await
        .expect("the set is found once whole");
    creator
        .await
        .expect("the creator")
        .expect("the set's second stream");
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].shards, 2, "{found:?}");
    assert_eq!(found[0].streams, first, "{found:?}");

    // One stream of three, and no reshard to create the others.
    let third = n.shard_stream_names(3);
    js.create_stream(stream(&third[0], "stuck.0"))
        .await
        .expect("a lone stream");
    let err = generations::discover(&js, &n)
        .await
        .expect_err("a set that stays incomplete")
        .to_string();
    assert!(
        err.contains(&third[1]) && err.contains(&third[2]) && err.contains("incomplete"),
        "{err}"
    );
}

/// Store `body` on `subject` (no mapping applies to a stream's own subjects): its stream,
/// sequence and store time (ms since the epoch).
async fn store(js: &jetstream::Context, subject: String, body: Bytes) -> (String, u64, i64) {
    let ack = js
        .publish(subject.clone(), body)
        .await
        .unwrap_or_else(|e| panic!("publish {subject}: {e}"))
        .await
        .unwrap_or_else(|e| panic!("publish {subject}: {e}"));
    let stored = js
        .get_stream(&ack.stream)
        .await
        .expect("the stream that stored it")
        .get_raw_message(ack.sequence)
        .await
        .expect("the message stored");
    (ack.stream, ack.sequence, stored.time.timestamp_millis())
}

/// Wait until every one of `streams` exists.
async fn streams_exist(js: &jetstream::Context, streams: &[String]) {
    wait_for("the streams exist", || {
        let js = js.clone();
        async move {
            for s in streams {
                js.get_stream(s).await.ok()?;
            }
            Some(())
        }
    })
    .await;
}

/// The turn of `conv` timed out, once, as any unanswered turn does, and `worker` said it
/// passed over a reshard marker whose set of raw streams does not exist; `worker` is stopped.
async fn timed_out_past_a_dead_marker(js: &jetstream::Context, conv: &str, worker: Projector) {
    timed_out_once(js, conv).await;
    stop_having_said(
        worker,
        "a reshard marker for a set of raw streams that no longer exists; ignored",
    )
    .await;
}

/// `reshard --count 4` run until it asks for the mapping, then stopped there (abandoned).
async fn stopped_at_the_mapping(url: &str) {
    let mut running = ReshardRun::start(url, 4, &[]);
    assert!(
        running.asked_for_mapping(GUARD).await,
        "the reshard never asked for the mapping: {}",
        running.said()
    );
}

/// Delete `streams` (an abandoned reshard's new set).
async fn delete_streams(js: &jetstream::Context, streams: &[String]) {
    for s in streams {
        js.delete_stream(s)
            .await
            .unwrap_or_else(|e| panic!("deleting {s}: {e}"));
    }
}

/// The turn of `conv` was answered once, with a blocked timeout.
async fn timed_out_once(js: &jetstream::Context, conv: &str) {
    let decided = decided_turn(js, conv).await;
    assert_eq!(decided.len(), 1, "{conv}: {decided:?}");
    let body: Value = serde_json::from_slice(&decided[0].payload).unwrap_or(Value::Null);
    assert_eq!(body["payload"]["outcome"], "blocked", "{conv}: {body:#}");
    assert_eq!(body["payload"]["reason"], "timeout", "{conv}: {body:#}");
}

/// `worker`'s log holds `said`; `worker` is stopped.
async fn stop_having_said(mut worker: Projector, said: &str) {
    assert!(worker.log_text().contains(said), "{}", worker.log_text());
    worker.sigterm();
    worker.wait_exit(Duration::from_secs(30)).await;
}

/// The environment of workers over two raw streams.
const TWO_SHARDS: [(&str, &str); 1] = [("COLLAB_NATS__SHARDS", "2")];

/// A nats-server that maps raw traffic over two raw streams, and a worker started with `args`
/// on it, once both streams exist.
async fn two_streams_and_a_worker(args: &[&str]) -> (TestNats, jetstream::Context, Projector) {
    let two = names(2);
    let nats = TestNats::start_with_config(two.shard_mapping_config().unwrap_or_default()).await;
    let js = nats.jetstream().await;
    let worker = Projector::spawn(&nats.url(), args, &TWO_SHARDS);
    // The worker creates the raw streams before the projection stream, which the tests read.
    let mut streams = two.raw_streams.clone();
    streams.push(two.proj_stream.clone());
    streams_exist(&js, &streams).await;
    (nats, js, worker)
}

/// The `a2a.response` projections of conversation `conv`, once there is one.
async fn decided_turn(js: &jetstream::Context, conv: &str) -> Vec<crate::pipeline::Stored> {
    wait_for("the turn is decided", || {
        let js = js.clone();
        async move {
            let r = responses_of(&js, conv).await;
            (!r.is_empty()).then_some(r)
        }
    })
    .await
}

/// The `a2a.response` projections of conversation `conv`.
async fn responses_of(js: &jetstream::Context, conv: &str) -> Vec<crate::pipeline::Stored> {
    crate::pipeline::read_all(
        js,
        "COLLAB_PROJ",
        &format!("collab.proj.conversation.main.{conv}.a2a.response"),
    )
    .await
}

/// A task update on key `key` stored in the old raw streams (as a server whose mapping was not
/// reloaded yet stores it), waited for until projected: its raw sequence.
async fn late_update_in_old_streams(js: &jetstream::Context, key: &str, n: u64) -> u64 {
    let h = collab_projector::config::transform_partition(key.as_bytes(), 2);
    let (_, body) = task_update(key, n);
    let (_, seq, _) = store(js, format!("collab.shard.2.{h}.{key}.task.updated"), body).await;
    wait_for("the late update is projected", || {
        let js = js.clone();
        let filter = format!("collab.proj.*.*.{key}.task.updated");
        async move {
            let r = crate::pipeline::read_all(&js, "COLLAB_PROJ", &filter).await;
            (r.len() as u64 > n).then_some(())
        }
    })
    .await;
    seq
}

/// While servers are reloaded one after another with the new mapping, some store a key's inputs
/// in the new raw streams and others still in the old ones. A reply stored in the new streams
/// before its turn's deadline must win, though inputs stored in the old streams after the
/// deadline are read first (the partition reads its old stream to its end before the new one):
/// `reshard` stores a marker in every partition of the old streams before it prints the
/// mapping, and a partition's watermark stops there until it reads the new streams. A worker
/// started after the marker was acknowledged finds it in the stream.
#[tokio::test]
async fn a_reply_in_the_new_streams_before_its_deadline_wins_over_later_inputs_in_the_old_ones() {
    let (two, four) = (names(2), names(4));
    let args = ["--main-agents", "ruda,eden", "--turn-timeout", "5s"];
    let (mut nats, js, mut worker) = two_streams_and_a_worker(&args).await;
    let url = nats.url();
    let conv = "conv-split";
    // Another conversation of the same partition (of 16, so of the same shard of 2 and of 4).
    let partition_of =
        |key: &str| collab_projector::config::transform_partition(key.as_bytes(), 16);
    let other = (0..)
        .map(|n| format!("conv-other-{n}"))
        .find(|c| partition_of(c) == partition_of(conv))
        .unwrap_or_default();
    // The partitions run: an input on the turn's key is projected.
    late_update_in_old_streams(&js, conv, 0).await;

    let (s, b) = send(conv);
    let (send_stream, _, send_ms) = store(&js, s, b).await;
    assert!(two.raw_streams.contains(&send_stream), "{send_stream}");
    let (s, b) = send(&other);
    store(&js, s, b).await;
    let deadline_ms = send_ms + 5_000;

    // The reshard prints the mapping once its markers are stored.
    let mut running = ReshardRun::start(&url, 4, &[]);
    assert!(
        running.asked_for_mapping(GUARD).await,
        "the reshard never asked for the mapping: {}",
        running.said()
    );

    // A server already reloaded stores the reply in the new streams before the deadline.
    let h = collab_projector::config::transform_partition(conv.as_bytes(), 4);
    let (_, b) = reply(conv);
    let (reply_stream, reply_seq, reply_ms) =
        store(&js, format!("collab.shard.4.{h}.{conv}.a2a.response"), b).await;
    assert!(four.raw_streams.contains(&reply_stream), "{reply_stream}");
    assert!(
        reply_ms < deadline_ms,
        "the reshard took too long to ask for the mapping: the reply was stored {} ms after the deadline",
        reply_ms - deadline_ms
    );
    // One not reloaded yet stores later inputs of the partition in the old streams, past the
    // deadline: a task update, and the late reply of the other turn (an event of a turn past
    // its deadline, which decides the partition's turns due before it).
    let past =
        u64::try_from(deadline_ms + 300 - chrono::Utc::now().timestamp_millis()).unwrap_or(0);
    tokio::time::sleep(Duration::from_millis(past)).await;
    late_update_in_old_streams(&js, conv, 1).await;
    let (_, b) = reply(&other);
    store(
        &js,
        format!("collab.shard.2.{}.{other}.a2a.response", h % 2),
        b,
    )
    .await;
    // Its own turn times out (its reply is late by its own store time).
    wait_for("the other turn is decided", || {
        let js = js.clone();
        let other = other.clone();
        async move { (!responses_of(&js, &other).await.is_empty()).then_some(()) }
    })
    .await;
    let late = late_update_in_old_streams(&js, conv, 2).await;
    let decided = responses_of(&js, conv).await;
    assert!(
        decided.is_empty(),
        "the turn was decided from the old streams alone: {:?}",
        decided.iter().map(|m| &m.payload).collect::<Vec<_>>()
    );

    // A worker started once that input is acknowledged reads on from after the marker.
    let consumer = format!(
        "collab-proj-{}",
        collab_projector::config::transform_partition(conv.as_bytes(), 16)
    );
    wait_for("the late input is acknowledged", || {
        let js = js.clone();
        let (stream, consumer) = (send_stream.clone(), consumer.clone());
        async move {
            let mut c: jetstream::consumer::PullConsumer = js
                .get_stream(&stream)
                .await
                .ok()?
                .get_consumer(&consumer)
                .await
                .ok()?;
            let info = c.info().await.ok()?;
            (info.ack_floor.stream_sequence >= late).then_some(())
        }
    })
    .await;
    worker.kill9();
    worker.wait_exit(Duration::from_secs(10)).await;
    let mut worker = Projector::spawn(&url, &args, &TWO_SHARDS);
    late_update_in_old_streams(&js, conv, 3).await;
    let decided = responses_of(&js, conv).await;
    assert!(
        decided.is_empty(),
        "a restarted worker decided the turn from the old streams alone: {:?}",
        decided.iter().map(|m| &m.payload).collect::<Vec<_>>()
    );
    assert!(
        worker
            .log_text()
            .contains("a reshard marker: deadlines after it are decided on the new raw streams"),
        "the restarted worker did not find the marker: {}",
        worker.log_text()
    );

    // Every server reloaded: the old streams are sealed and read, the reply wins.
    reload_and_finish(&mut nats, running, 4, four.shard_mapping_config()).await;
    // The other turn was answered late: it times out, once.
    let responses = crate::shards::one_response_per_turn(&js, 2).await;
    assert_eq!(
        responses[&other]["payload"]["reason"], "timeout",
        "{:#}",
        responses[&other]
    );
    let decided = decided_turn(&js, conv).await;
    assert_eq!(decided.len(), 1, "{decided:?}");
    assert_eq!(
        decided[0].header("Collab-Source-Seq"),
        Some(reply_seq.to_string()),
        "the response is not the reply stored before the deadline: {:#}",
        responses[conv]
    );
    worker.sigterm();
    worker.wait_exit(Duration::from_secs(30)).await;
}

/// A reshard abandoned after its markers were stored (the command stopped, the streams it made
/// deleted by hand) holds no deadline back once the workers restart: the markers name a set of
/// raw streams that no longer exists.
#[tokio::test]
async fn markers_of_an_abandoned_reshard_hold_no_deadline_back_after_a_restart() {
    let (two, four) = (names(2), names(4));
    let args = ["--main-agents", "ruda,eden", "--turn-timeout", "3s"];
    let (nats, js, mut worker) = two_streams_and_a_worker(&args).await;
    let url = nats.url();
    let conv = "conv-abandoned";
    late_update_in_old_streams(&js, conv, 0).await;

    stopped_at_the_mapping(&url).await;
    delete_streams(&js, &four.raw_streams).await;
    worker.kill9();
    worker.wait_exit(Duration::from_secs(10)).await;
    let worker = Projector::spawn(&url, &args, &TWO_SHARDS);

    // A turn opened after the markers times out as any unanswered turn does.
    let (s, b) = send(conv);
    let (stream, _, _) = store(&js, s, b).await;
    assert!(two.raw_streams.contains(&stream), "{stream}");
    timed_out_past_a_dead_marker(&js, conv, worker).await;
}

/// A reshard abandoned while the workers run on (the old mapping kept, the new streams deleted)
/// stops holding deadlines back once the partitions find its streams gone, without a restart:
/// a turn due while the marker held it is decided, and so is one opened after.
#[tokio::test]
async fn a_running_partition_lets_go_of_its_marker_once_the_reshard_is_abandoned() {
    let (two, four) = (names(2), names(4));
    let args = ["--main-agents", "ruda,eden", "--turn-timeout", "3s"];
    let (nats, js, worker) = two_streams_and_a_worker(&args).await;
    let url = nats.url();
    let (held, after) = ("conv-held-then-let-go", "conv-after-the-let-go");
    late_update_in_old_streams(&js, held, 0).await;
    late_update_in_old_streams(&js, after, 0).await;

    stopped_at_the_mapping(&url).await;
    // A turn opened behind the markers, due while they hold it.
    let (s, b) = send(held);
    let (stream, _, _) = store(&js, s, b).await;
    assert!(two.raw_streams.contains(&stream), "{stream}");
    // Its deadline passes in the old streams: later inputs there are stored past it.
    tokio::time::sleep(Duration::from_secs(4)).await;
    late_update_in_old_streams(&js, held, 1).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        responses_of(&js, held).await.is_empty(),
        "the turn was decided while the reshard's streams still existed"
    );

    delete_streams(&js, &four.raw_streams).await;
    // The same worker, never restarted, decides the held turn and a new one.
    let (s, b) = send(after);
    store(&js, s, b).await;
    for conv in [held, after] {
        timed_out_once(&js, conv).await;
    }
    stop_having_said(
        worker,
        "reshard marker names were deleted (the reshard was abandoned)",
    )
    .await;
}

/// A reshard marker naming a set of raw streams that does not exist (published by hand, or
/// left by a reshard abandoned while the workers ran on) holds no deadline back.
#[tokio::test]
async fn a_marker_naming_no_set_of_raw_streams_holds_no_deadline_back() {
    let nats = TestNats::start().await;
    let url = nats.url();
    let js = nats.jetstream().await;
    let args = ["--main-agents", "ruda,eden", "--turn-timeout", "2s"];
    let worker = Projector::spawn(&url, &args, &[]);
    let conv = "conv-forged";
    let one = names(1);
    wait_for("the raw stream exists", || {
        let js = js.clone();
        let stream = one.raw_stream.clone();
        async move { js.get_stream(&stream).await.ok().map(|_| ()) }
    })
    .await;
    let (s, b) = task_update(conv, 0);
    store(&js, s, b).await;
    // The marker for the turn's partition, before its send.
    let partitions = collab_projector::config::Settings::default()
        .nats
        .partitions;
    let p = u16::try_from(collab_projector::config::transform_partition(
        conv.as_bytes(),
        u32::from(partitions),
    ))
    .unwrap_or(0);
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Collab-Barrier", "collab");
    headers.insert("Collab-Reshard", (5u64 << 48).to_string().as_str());
    js.publish_with_headers(
        one.reshard_marker_subject(p, partitions),
        headers,
        Bytes::new(),
    )
    .await
    .expect("publish the marker")
    .await
    .expect("the marker stored");
    let (s, b) = send(conv);
    store(&js, s, b).await;
    timed_out_past_a_dead_marker(&js, conv, worker).await;
}
