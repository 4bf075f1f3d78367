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
    wait_for("the two raw streams exist", || {
        let js = js.clone();
        let streams = two.raw_streams.clone();
        async move {
            for s in &streams {
                js.get_stream(s).await.ok()?;
            }
            Some(())
        }
    })
    .await;

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
    let report = reshard_with_reload(&mut nats, &js, 4, four.shard_mapping_config()).await;
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

/// Run `collab-projector reshard --count <count>` to its end while `reload` puts the server's
/// new mapping in place once the new streams exist; the command's JSON report.
async fn reshard_with_reload(
    nats: &mut TestNats,
    js: &jetstream::Context,
    count: u16,
    mapping: Option<String>,
) -> Value {
    let url = nats.url();
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_collab-projector"));
    cmd.args([
        "reshard",
        "--count",
        &count.to_string(),
        "--wait",
        "90s",
        "--json",
        "--nats-url",
        &url,
    ])
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped())
    .kill_on_drop(true);
    let running = cmd.spawn().expect("could not run collab-projector reshard");
    let newest = names(count).raw_streams.last().cloned().unwrap_or_default();
    wait_for("the reshard created its streams", || {
        let js = js.clone();
        let newest = newest.clone();
        async move {
            let s = js.get_stream(&newest).await.ok()?;
            (!s.cached_info().config.sealed).then_some(())
        }
    })
    .await;
    nats.local()
        .expect("a local nats-server")
        .reconfigure(mapping)
        .await
        .expect("reloading the server");
    let out = tokio::time::timeout(GUARD, running.wait_with_output())
        .await
        .expect("the reshard did not finish")
        .expect("the reshard's output");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "reshard to {count} failed: {said}");
    json_report(&out.stdout).unwrap_or_else(|| panic!("no JSON report: {said}"))
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
    let report = reshard_with_reload(&mut nats, &js, 2, names(2).shard_mapping_config()).await;
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
    let report =
        reshard_with_reload(&mut nats, &js, 1, Some(names(1).unsharded_mapping_config())).await;
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
    let report = reshard_with_reload(&mut nats, &js, 2, names(2).shard_mapping_config()).await;
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
