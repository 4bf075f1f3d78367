//! The foundation pipeline against a real server and the real binary: projections and their
//! envelope, dead letters, exactly one outcome per raw sequence, per-key order, crashes and
//! drains, provisioning, server refusal and the offline `normalize` command.
//!
//! The helpers at the top are shared with `adapter_bus`.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Stdio;
use std::time::{Duration, Instant};

use async_nats::jetstream::{consumer, stream, Context};
use bytes::Bytes;
use collab_projector::model::encode_id;
use futures::{StreamExt, TryStreamExt};
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;

use crate::support::{fill_bucket, purge_filled, wait_until, Projector, TestNats};

/// Guards against hangs only; nothing is asserted about how long anything takes.
pub(crate) const GUARD: Duration = Duration::from_secs(60);

pub(crate) const RAW: &str = "COLLAB_RAW";
pub(crate) const PROJ: &str = "COLLAB_PROJ";
pub(crate) const DLQ: &str = "COLLAB_DLQ";

/// The main agents every test runs with.
pub(crate) const MAIN_AGENTS: [&str; 2] = ["--main-agents", "ruda,eden"];

const BIN: &str = env!("CARGO_BIN_EXE_collab-projector");

/// Partitions of the raw stream in the built-in defaults.
pub(crate) fn default_partitions() -> usize {
    usize::from(
        collab_projector::config::Settings::default()
            .nats
            .partitions,
    )
}

// ---------------------------------------------------------------------------------------------
// Shared helpers
// ---------------------------------------------------------------------------------------------

/// One stored message, read back from a stream.
#[derive(Debug, Clone)]
pub(crate) struct Stored {
    pub subject: String,
    pub seq: u64,
    pub headers: Option<async_nats::HeaderMap>,
    pub payload: Bytes,
}

impl Stored {
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .as_ref()
            .and_then(|h| h.get(name))
            .map(|v| v.as_str().to_string())
    }

    /// The header, or a panic naming the message.
    pub fn must_header(&self, name: &str) -> String {
        self.header(name).unwrap_or_else(|| {
            panic!(
                "message {} on {} has no {name} header: {:?}",
                self.seq, self.subject, self.headers
            )
        })
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.payload).unwrap_or_else(|e| {
            panic!(
                "message {} on {} is not JSON ({e}): {}",
                self.seq,
                self.subject,
                String::from_utf8_lossy(&self.payload)
            )
        })
    }

    /// `Collab-Source-Seq` as a number.
    pub fn source_seq(&self) -> u64 {
        let text = self.must_header("Collab-Source-Seq");
        text.parse()
            .unwrap_or_else(|e| panic!("Collab-Source-Seq {text:?} is not a number: {e}"))
    }
}

/// Start the binary and wait until it has provisioned and listens (it prints `http listening on`).
pub(crate) async fn start_projector(url: &str, args: &[&str], envs: &[(&str, &str)]) -> Projector {
    let projector = Projector::spawn(url, args, envs);
    wait_until(GUARD, "the projector reports `http listening on`", || {
        let ready = projector.log_text().contains("http listening on");
        async move { ready }
    })
    .await;
    projector
}

/// Publish one message and wait for the stream's ack; returns the raw stream sequence.
pub(crate) async fn publish(js: &Context, subject: &str, body: impl Into<Bytes>) -> u64 {
    js.publish(subject.to_string(), body.into())
        .await
        .unwrap_or_else(|e| panic!("publish to {subject} was not sent: {e}"))
        .await
        .unwrap_or_else(|e| panic!("publish to {subject} was not acknowledged: {e}"))
        .sequence
}

/// Publish many messages, pipelined in chunks; returns their sequences in input order.
pub(crate) async fn publish_all(js: &Context, messages: &[(String, Vec<u8>)]) -> Vec<u64> {
    let mut seqs = Vec::with_capacity(messages.len());
    for chunk in messages.chunks(100) {
        let mut acks = Vec::with_capacity(chunk.len());
        for (subject, body) in chunk {
            let ack = js
                .publish(subject.clone(), Bytes::from(body.clone()))
                .await
                .unwrap_or_else(|e| panic!("publish to {subject} was not sent: {e}"));
            acks.push(ack);
        }
        for ack in acks {
            seqs.push(
                ack.await
                    .unwrap_or_else(|e| panic!("publish was not acknowledged: {e}"))
                    .sequence,
            );
        }
    }
    seqs
}

/// The number of inputs or outputs a stream holds, fence claims aside (0 if it does not exist
/// yet).
pub(crate) async fn count(js: &Context, stream: &str) -> u64 {
    crate::support::outputs_in(js, stream).await
}

/// Every message of `stream` on `filter` stored so far, in stream order. Read until the reader
/// has nothing pending, rather than to a count taken first: the work-session fold removes fence
/// claims as it reads them, possibly while this reads.
pub(crate) async fn read_all(js: &Context, stream: &str, filter: &str) -> Vec<Stored> {
    let mut reader = reader_of(js, stream, filter).await;
    let deadline = Instant::now() + GUARD;
    let mut out: Vec<Stored> = Vec::new();
    loop {
        let pending = reader
            .info()
            .await
            .unwrap_or_else(|e| panic!("reader info on {stream}: {e}"))
            .num_pending;
        if pending == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{pending} messages of {stream} ({filter}) still unread after {GUARD:?}"
        );
        let mut batch = reader
            .fetch()
            .max_messages(1000)
            .expires(Duration::from_secs(2))
            .messages()
            .await
            .unwrap_or_else(|e| panic!("fetch from {stream}: {e}"));
        while let Some(m) = batch.next().await {
            let m = m.unwrap_or_else(|e| panic!("fetch from {stream}: {e}"));
            if let Err(e) = m.info() {
                panic!("message info from {stream}: {e}");
            }
            // A partition owner's claim is read, not an output.
            out.extend(stored_of(&m));
        }
    }
    out
}

/// An unacknowledged reader of `stream`'s messages on `filter`, from its first.
async fn reader_of(
    js: &Context,
    stream: &str,
    filter: &str,
) -> consumer::Consumer<consumer::pull::Config> {
    let s = js
        .get_stream(stream)
        .await
        .unwrap_or_else(|e| panic!("stream {stream}: {e}"));
    s.create_consumer(consumer::pull::Config {
        filter_subject: filter.to_string(),
        ack_policy: consumer::AckPolicy::None,
        deliver_policy: consumer::DeliverPolicy::All,
        inactive_threshold: Duration::from_secs(60),
        ..Default::default()
    })
    .await
    .unwrap_or_else(|e| panic!("reader on {stream} ({filter}): {e}"))
}

/// A stored message as read back; `None` for a partition owner's fence claim, which is no
/// output.
pub(crate) fn stored_of(m: &async_nats::jetstream::Message) -> Option<Stored> {
    if collab_projector::bus::publish::is_fence_subject(m.subject.as_str()) {
        return None;
    }
    Some(Stored {
        subject: m.subject.to_string(),
        seq: m.info().map_or(0, |i| i.stream_sequence),
        headers: m.headers.clone(),
        payload: m.payload.clone(),
    })
}

/// Whether every partition consumer of the raw stream exists and has nothing left to deliver
/// or to acknowledge: the projector has finished everything stored so far.
pub(crate) async fn raw_drained(js: &Context, partitions: usize) -> bool {
    let Ok(s) = js.get_stream(RAW).await else {
        return false;
    };
    let Ok(infos) = s.consumers().try_collect::<Vec<consumer::Info>>().await else {
        return false;
    };
    let ours: Vec<&consumer::Info> = infos
        .iter()
        .filter(|i| i.name.starts_with("collab-proj-"))
        .collect();
    ours.len() == partitions
        && ours
            .iter()
            .all(|i| i.num_pending == 0 && i.num_ack_pending == 0)
}

/// Wait until the stream counts reach at least `proj` and `dlq` and the raw consumers are
/// drained, so what is read afterwards is everything the projector will write for the input.
pub(crate) async fn wait_settled(js: &Context, proj: u64, dlq: u64) {
    wait_until(
        GUARD,
        &format!("COLLAB_PROJ holds {proj} and COLLAB_DLQ {dlq} messages"),
        || {
            let js = js.clone();
            async move { count(&js, PROJ).await >= proj && count(&js, DLQ).await >= dlq }
        },
    )
    .await;
    wait_until(GUARD, "every raw partition consumer is drained", || {
        let js = js.clone();
        async move { raw_drained(&js, default_partitions()).await }
    })
    .await;
}

/// The single message stored on `subject` (waits for it, then asserts there is exactly one).
pub(crate) async fn the_one(js: &Context, stream: &str, subject: &str) -> Stored {
    wait_until(GUARD, &format!("a message on {subject}"), || {
        let js = js.clone();
        let subject = subject.to_string();
        let stream = stream.to_string();
        async move {
            match js.get_stream(&stream).await {
                Ok(s) => s.get_last_raw_message_by_subject(&subject).await.is_ok(),
                Err(_) => false,
            }
        }
    })
    .await;
    let mut all = read_all(js, stream, subject).await;
    assert_eq!(
        all.len(),
        1,
        "expected exactly one message on {subject}, got {:?}",
        all.iter()
            .map(|m| String::from_utf8_lossy(&m.payload).into_owned())
            .collect::<Vec<_>>()
    );
    all.remove(0)
}

/// Check the dead letter for a raw message: subject, original bytes and the four headers.
pub(crate) fn assert_dead_letter(
    dl: &Stored,
    reason: &str,
    body: &[u8],
    producer_subject: &str,
    raw_seq: u64,
) -> String {
    assert_eq!(dl.subject, format!("collab.dlq.{reason}"));
    assert_eq!(
        dl.payload.as_ref(),
        body,
        "a dead letter keeps the original bytes"
    );
    assert_eq!(dl.must_header("Collab-Dlq-Reason"), reason);
    assert_eq!(dl.must_header("Collab-Source-Subject"), producer_subject);
    assert_eq!(dl.source_seq(), raw_seq);
    let detail = dl.must_header("Collab-Dlq-Detail");
    assert!(
        detail.split_whitespace().count() >= 3,
        "the detail should be a sentence a person can act on: {detail:?}"
    );
    detail
}

/// Run the binary with arguments and stdin; returns (status, stdout, stderr).
pub(crate) async fn run_bin(
    args: &[&str],
    envs: &[(&str, &str)],
    stdin: &[u8],
) -> (bool, String, String) {
    let mut child = tokio::process::Command::new(BIN)
        .args(args)
        .envs(envs.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("could not run {BIN}: {e}"));
    let mut input = child.stdin.take().expect("stdin is piped");
    let bytes = stdin.to_vec();
    let writer = tokio::spawn(async move {
        let _ = input.write_all(&bytes).await;
        // Dropping `input` closes stdin.
    });
    let output = tokio::time::timeout(GUARD, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("{BIN} {args:?} did not exit within {GUARD:?}"))
        .unwrap_or_else(|e| panic!("waiting for {BIN}: {e}"));
    let _ = writer.await;
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn seq_counts(messages: &[Stored]) -> BTreeMap<u64, usize> {
    let mut counts = BTreeMap::new();
    for m in messages {
        *counts.entry(m.source_seq()).or_insert(0) += 1;
    }
    counts
}

/// Every projection's `rawEventRef.seq` agrees with its `Collab-Source-Seq` header.
fn assert_refs_match_headers(projections: &[Stored]) {
    for m in projections {
        let env = m.json();
        assert_eq!(
            env["rawEventRef"]["seq"].as_u64(),
            Some(m.source_seq()),
            "rawEventRef.seq and Collab-Source-Seq differ on {}",
            m.subject
        );
    }
}

/// Every sequence in `expected` appears exactly once across projections and dead letters, and
/// nothing else appears.
fn assert_exactly_once(expected: &BTreeSet<u64>, proj: &[Stored], dlq: &[Stored]) {
    let mut counts = seq_counts(proj);
    for (seq, n) in seq_counts(dlq) {
        *counts.entry(seq).or_insert(0) += n;
    }
    let duplicated: Vec<(u64, usize)> = counts
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(s, n)| (*s, *n))
        .collect();
    assert!(
        duplicated.is_empty(),
        "raw sequences with more than one outcome (seq, count): {duplicated:?}"
    );
    let missing: Vec<u64> = expected
        .iter()
        .filter(|s| !counts.contains_key(s))
        .copied()
        .collect();
    assert!(
        missing.is_empty(),
        "raw sequences with no outcome: {missing:?}"
    );
    let extra: Vec<u64> = counts
        .keys()
        .filter(|s| !expected.contains(s))
        .copied()
        .collect();
    assert!(
        extra.is_empty(),
        "outcomes for raw sequences nobody published: {extra:?}"
    );
}

pub(crate) fn task_update(key: &str, n: usize) -> (String, Vec<u8>) {
    let body = json!({"type": "task.updated", "taskId": key, "payload": {"n": n}});
    (
        format!("collab.raw.{key}.task.updated"),
        serde_json::to_vec(&body).expect("serialises"),
    )
}

// ---------------------------------------------------------------------------------------------
// 1. Projections and the envelope
// ---------------------------------------------------------------------------------------------

/// Check the parts of a projection every role shares; returns the envelope.
fn check_projection(
    m: &Stored,
    role: &str,
    event_type: &str,
    producer_subject: &str,
    raw_seq: u64,
    raw_time_ms: i64,
    facets: (&str, &str, &str, &str),
) -> Value {
    let env = m.json();
    assert_eq!(env["type"], event_type, "{env}");
    assert_eq!(env["eventRole"], role, "{env}");
    let r = &env["rawEventRef"];
    assert_eq!(r["stream"], RAW, "{env}");
    assert_eq!(r["seq"].as_u64(), Some(raw_seq), "{env}");
    assert_eq!(r["subject"], producer_subject, "{env}");
    let stored_at = r["storedAt"]
        .as_str()
        .unwrap_or_else(|| panic!("no storedAt: {env}"));
    let stored_ms = chrono::DateTime::parse_from_rfc3339(stored_at)
        .unwrap_or_else(|e| panic!("storedAt {stored_at:?} is not RFC 3339: {e}"))
        .timestamp_millis();
    assert!(
        (stored_ms - raw_time_ms).abs() <= 1,
        "storedAt {stored_at} is not the raw stream's store time ({raw_time_ms} ms)"
    );
    let (owner, scope, phase, surface) = facets;
    assert_eq!(env["owner"], owner, "{env}");
    assert_eq!(env["scope"], scope, "{env}");
    assert_eq!(env["phase"], phase, "{env}");
    assert_eq!(env["surface"], surface, "{env}");
    assert_eq!(m.must_header("Collab-Event-Role"), role);
    assert_eq!(m.must_header("Collab-Event-Type"), event_type);
    assert_eq!(m.source_seq(), raw_seq);
    assert_eq!(m.must_header("Nats-Msg-Id"), format!("{RAW}:{raw_seq}:0"));
    env
}

async fn raw_time_ms(js: &Context, seq: u64) -> i64 {
    js.get_stream(RAW)
        .await
        .expect("raw stream")
        .get_raw_message(seq)
        .await
        .unwrap_or_else(|e| panic!("raw message {seq}: {e}"))
        .time
        .timestamp_millis()
}

#[tokio::test]
async fn each_role_projects_on_its_subject_with_the_envelope() {
    let nats = TestNats::start().await;
    let _projector = start_projector(
        &nats.url(),
        &[MAIN_AGENTS[0], MAIN_AGENTS[1], "--turn-timeout", "2s"],
        &[],
    )
    .await;
    let js = nats.jetstream().await;

    let main_send = json!({"type": "a2a.send", "agentId": "ruda", "ts": 1_771_329_600_000_i64,
        "data": {"fromAgent": "ruda", "toAgent": "eden", "conversationId": "conv-main-1",
                 "runId": "run-1", "workSessionId": "ws_1", "message": "hello eden", "topicId": "t-9"}});
    let sub_send = json!({"type": "a2a.send", "agentId": "ruda", "ts": "2026-02-17T12:00:01Z",
        "data": {"fromAgent": "ruda", "toAgent": "worker-7", "targetSessionKey": "agent:ruda:subagent:abc",
                 "conversationId": "conv-sub-1", "message": "summarise the logs"}});
    let task = json!({"type": "task.created", "taskId": "task-42", "agentId": "ruda",
        "timestamp": "2026-02-17T12:00:02Z", "payload": {"title": "write docs", "priority": 2}});
    let ping = json!({"type": "health.ping", "agentId": "monitor-1", "ts": 1_771_329_603_000_i64, "latencyMs": 12});
    let run = json!({"type": "run.started", "sequence": 1, "timestamp": "2026-02-17T12:00:04.500Z",
        "sessionId": "sess-9", "threadId": "thr-1", "runId": "run-9", "turnId": "turn-1",
        "agentId": "eden", "parentSessionId": "sess-0", "payload": {"model": "m-1"}, "refs": {"traceId": "tr-1"}});

    let cases = [
        ("collab.raw.conv-main-1.a2a.send", &main_send),
        ("collab.raw.conv-sub-1.a2a.send", &sub_send),
        ("collab.raw.task-42.task.created", &task),
        ("collab.raw.monitor-1.health.ping", &ping),
        ("collab.raw.sess-9.run.started", &run),
    ];
    let mut seqs = Vec::new();
    for (subject, body) in cases {
        seqs.push(publish(&js, subject, serde_json::to_vec(body).expect("serialises")).await);
    }

    // a2a.send between two main agents: conversation.main, key = conversationId.
    let m = the_one(
        &js,
        PROJ,
        "collab.proj.conversation.main.conv-main-1.a2a.send",
    )
    .await;
    let env = check_projection(
        &m,
        "conversation.main",
        "a2a.send",
        cases[0].0,
        seqs[0],
        raw_time_ms(&js, seqs[0]).await,
        ("agent", "turn", "submitted", "conversation"),
    );
    assert_eq!(env["agentId"], "ruda");
    assert_eq!(env["runId"], "run-1");
    assert_eq!(env["conversationId"], "conv-main-1");
    assert_eq!(env["workSessionId"], "ws_1");
    assert_eq!(env["timestamp"], "2026-02-17T12:00:00.000Z");
    assert_eq!(env["payload"]["message"], "hello eden");
    assert_eq!(env["payload"]["fromAgent"], "ruda");
    assert_eq!(env["payload"]["toAgent"], "eden");
    assert_eq!(
        env["payload"]["topicId"], "t-9",
        "fields without a slot stay in the payload"
    );

    // a2a.send to a subagent: delegation.subagent.
    let m = the_one(
        &js,
        PROJ,
        "collab.proj.delegation.subagent.conv-sub-1.a2a.send",
    )
    .await;
    let env = check_projection(
        &m,
        "delegation.subagent",
        "a2a.send",
        cases[1].0,
        seqs[1],
        raw_time_ms(&js, seqs[1]).await,
        ("agent", "turn", "submitted", "conversation"),
    );
    assert_eq!(env["conversationId"], "conv-sub-1");
    assert_eq!(env["timestamp"], "2026-02-17T12:00:01.000Z");
    assert_eq!(
        env["payload"]["targetSessionKey"],
        "agent:ruda:subagent:abc"
    );
    assert_eq!(env["payload"]["message"], "summarise the logs");

    // task.created: orchestration.task, the producer's key.
    let m = the_one(
        &js,
        PROJ,
        "collab.proj.orchestration.task.task-42.task.created",
    )
    .await;
    let env = check_projection(
        &m,
        "orchestration.task",
        "task.created",
        cases[2].0,
        seqs[2],
        raw_time_ms(&js, seqs[2]).await,
        ("task", "task", "submitted", "task_capsule"),
    );
    assert_eq!(env["taskId"], "task-42");
    assert_eq!(env["agentId"], "ruda");
    assert_eq!(
        env["payload"],
        json!({"title": "write docs", "priority": 2})
    );

    // health.ping: system.observability, the diagnostics row.
    let m = the_one(
        &js,
        PROJ,
        "collab.proj.system.observability.monitor-1.health.ping",
    )
    .await;
    let env = check_projection(
        &m,
        "system.observability",
        "health.ping",
        cases[3].0,
        seqs[3],
        raw_time_ms(&js, seqs[3]).await,
        ("diagnostics", "application", "unknown", "diagnostics"),
    );
    assert_eq!(env["agentId"], "monitor-1");
    assert_eq!(env["payload"]["latencyMs"], 12, "nothing is dropped: {env}");

    // A seed 003 runtime event: ids, sequence, refs and payload kept.
    let m = the_one(
        &js,
        PROJ,
        "collab.proj.system.observability.sess-9.run.started",
    )
    .await;
    let env = check_projection(
        &m,
        "system.observability",
        "run.started",
        cases[4].0,
        seqs[4],
        raw_time_ms(&js, seqs[4]).await,
        ("runtime", "run", "submitted", "runtime_status"),
    );
    for (field, value) in [
        ("sessionId", "sess-9"),
        ("threadId", "thr-1"),
        ("runId", "run-9"),
        ("turnId", "turn-1"),
        ("agentId", "eden"),
        ("parentSessionId", "sess-0"),
    ] {
        assert_eq!(env[field], value, "{field} in {env}");
    }
    assert_eq!(env["sequence"], 1);
    assert_eq!(env["timestamp"], "2026-02-17T12:00:04.500Z");
    assert_eq!(env["payload"], json!({"model": "m-1"}));
    assert_eq!(env["refs"], json!({"traceId": "tr-1"}));

    // Nothing was dead-lettered.
    assert_eq!(count(&js, DLQ).await, 0);
}

// ---------------------------------------------------------------------------------------------
// 2. Dead letters
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn unprojectable_messages_are_dead_lettered_with_reason_and_source() {
    let nats = TestNats::start().await;
    let _projector = start_projector(&nats.url(), &MAIN_AGENTS, &[]).await;
    let js = nats.jetstream().await;

    let colon_id = "agent:eden:main";
    let encoded = encode_id(colon_id);
    assert_ne!(
        encoded, colon_id,
        "the id must need encoding for this test to mean anything"
    );
    let wrong_key = serde_json::to_vec(&json!({"type": "a2a.send",
        "data": {"fromAgent": "ruda", "toAgent": "eden", "conversationId": colon_id, "message": "hi"}}))
    .expect("serialises");
    let cases: Vec<(&str, &str, Vec<u8>)> = vec![
        (
            "bad_json",
            "collab.raw.k1.task.updated",
            b"{\"type\": \"task.updated\", ".to_vec(),
        ),
        (
            "unrecognized",
            "collab.raw.k2.something",
            br#"{"hello":"world"}"#.to_vec(),
        ),
        ("bad_key", "collab.raw.wrongkey.a2a.send", wrong_key.clone()),
        (
            "bad_type",
            "collab.raw.k3.x",
            br#"{"type":"bad type"}"#.to_vec(),
        ),
        (
            "invalid_role",
            "collab.raw.k4.task.updated",
            br#"{"type":"task.updated","eventRole":"orchestration.tsak","taskId":"t1"}"#.to_vec(),
        ),
        (
            // Nested past limits.max_depth (64): dead-lettered with the limit named.
            "too_large",
            "collab.raw.k5.task.updated",
            format!(
                r#"{{"type":"task.updated","taskId":"t5","data":{}1{}}}"#,
                "[".repeat(80),
                "]".repeat(80)
            )
            .into_bytes(),
        ),
    ];
    let mut seqs = Vec::new();
    for (_, subject, body) in &cases {
        seqs.push(publish(&js, subject, body.clone()).await);
    }
    // The same send under its encoded key projects, and keeps the original id.
    let good_subject = format!("collab.raw.{encoded}.a2a.send");
    let good_seq = publish(&js, &good_subject, wrong_key).await;

    for ((reason, subject, body), seq) in cases.iter().zip(&seqs) {
        let dl = the_one(&js, DLQ, &format!("collab.dlq.{reason}")).await;
        let detail = assert_dead_letter(&dl, reason, body, subject, *seq);
        if *reason == "too_large" {
            assert!(detail.contains("limits.max_depth"), "{detail}");
        }
        if *reason == "bad_key" {
            assert!(
                detail.contains(&encoded),
                "the bad_key detail must name the expected key {encoded}: {detail}"
            );
        }
    }

    let m = the_one(
        &js,
        PROJ,
        &format!("collab.proj.conversation.main.{encoded}.a2a.send"),
    )
    .await;
    let env = m.json();
    assert_eq!(
        env["conversationId"], colon_id,
        "the envelope keeps the original id"
    );
    assert_eq!(env["rawEventRef"]["subject"], good_subject.as_str());
    assert_eq!(m.source_seq(), good_seq);

    // Exactly one outcome each: nothing dead-lettered also projected, nothing else anywhere.
    wait_settled(&js, 1, cases.len() as u64).await;
    let proj = read_all(&js, PROJ, "collab.proj.>").await;
    let dlq = read_all(&js, DLQ, "collab.dlq.>").await;
    let mut expected: BTreeSet<u64> = seqs.iter().copied().collect();
    expected.insert(good_seq);
    assert_exactly_once(&expected, &proj, &dlq);
}

/// A publish that keeps failing for one input (the server refuses its subject) dead-letters that
/// input `max_deliver` and the partition goes on. The send ahead of it in the partition, whose
/// turn record was still deferred (so its acknowledgement waited, and every restart replayed from
/// it), is not charged for the failures: it is projected once, and its turn gets its one
/// response.
#[tokio::test]
async fn an_input_whose_publish_keeps_failing_is_dead_lettered_not_the_input_ahead_of_it() {
    let nats = TestNats::start_with_config(
        r#"
authorization {
  users = [
    { user: worker, password: w0rker-pass,
      permissions: { publish: { allow: [">"], deny: ["collab.proj.*.*.poison.>"] } } }
    { user: producer, password: pr0ducer-pass }
  ]
}
"#
        .to_string(),
    )
    .await;
    let url = nats.url();
    let _projector = start_projector(
        &url,
        &[MAIN_AGENTS[0], MAIN_AGENTS[1], "--turn-timeout", "3s"],
        &[
            ("COLLAB_NATS__USER", "worker"),
            ("COLLAB_NATS__PASSWORD", "w0rker-pass"),
            ("COLLAB_NATS__PARTITIONS", "1"),
            ("COLLAB_CONSUMER__MAX_DELIVER", "3"),
        ],
    )
    .await;
    let client = async_nats::ConnectOptions::with_user_and_password(
        "producer".into(),
        "pr0ducer-pass".into(),
    )
    .connect(url.as_str())
    .await
    .expect("the producer connects");
    let js = async_nats::jetstream::new(client);

    let send = serde_json::to_vec(&json!({"type": "a2a.send", "agentId": "ruda",
        "data": {"fromAgent": "ruda", "toAgent": "eden", "conversationId": "conv-ahead",
                 "message": "please look"}}))
    .expect("serialises");
    let poison = serde_json::to_vec(
        &json!({"type": "task.updated", "taskId": "t-poison", "payload": {"status": "running"}}),
    )
    .expect("serialises");
    let send_seq = publish(&js, "collab.raw.conv-ahead.a2a.send", send).await;
    let poison_seq = publish(&js, "collab.raw.poison.task.updated", poison.clone()).await;

    // The refused input ends as a `max_deliver` dead letter...
    let dl = the_one(&js, DLQ, "collab.dlq.max_deliver").await;
    assert_dead_letter(
        &dl,
        "max_deliver",
        &poison,
        "collab.raw.poison.task.updated",
        poison_seq,
    );
    // ...and the partition goes on: an input after it is projected.
    let probe_seq = publish(
        &js,
        "collab.raw.after.task.updated",
        serde_json::to_vec(&json!({"type": "task.updated", "taskId": "t-after"}))
            .expect("serialises"),
    )
    .await;
    let after = the_one(
        &js,
        PROJ,
        "collab.proj.orchestration.task.after.task.updated",
    )
    .await;
    assert_eq!(after.source_seq(), probe_seq);
    // The send ahead of it: projected, never dead-lettered, and its turn answered once (blocked
    // at its deadline, since nobody replies).
    let response = the_one(
        &js,
        PROJ,
        "collab.proj.conversation.main.conv-ahead.a2a.response",
    )
    .await;
    assert_eq!(
        response.json()["payload"]["outcome"],
        "blocked",
        "{}",
        response.json()
    );
    wait_until(GUARD, "the one raw partition consumer is drained", || {
        let js = js.clone();
        async move { raw_drained(&js, 1).await }
    })
    .await;
    let proj = read_all(&js, PROJ, "collab.proj.>").await;
    let dlq = read_all(&js, DLQ, "collab.dlq.>").await;
    assert_eq!(dlq.len(), 1, "one dead letter, the refused input's");
    let sends: Vec<&Stored> = proj
        .iter()
        .filter(|m| m.subject == "collab.proj.conversation.main.conv-ahead.a2a.send")
        .collect();
    assert_eq!(sends.len(), 1, "the send is projected once");
    assert_eq!(sends[0].source_seq(), send_seq);
    let responses = proj
        .iter()
        .filter(|m| m.subject.ends_with(".conv-ahead.a2a.response"))
        .count();
    assert_eq!(responses, 1, "its turn has exactly one response");
}

/// Every value of a KV bucket, as text.
async fn bucket_values(js: &Context, bucket: &str) -> Vec<String> {
    let kv = js
        .get_key_value(bucket)
        .await
        .unwrap_or_else(|e| panic!("bucket {bucket}: {e}"));
    let keys: Vec<String> = kv
        .keys()
        .await
        .unwrap_or_else(|e| panic!("keys of {bucket}: {e}"))
        .try_collect()
        .await
        .unwrap_or_else(|e| panic!("keys of {bucket}: {e}"));
    let mut values = Vec::new();
    for k in keys {
        if let Ok(Some(v)) = kv.get(&k).await {
            values.push(String::from_utf8_lossy(&v).into_owned());
        }
    }
    values
}

#[tokio::test]
async fn secrets_never_reach_projections_state_or_dead_letter_details() {
    let nats = TestNats::start().await;
    // The most verbose logs, and a low offload limit so that a large field goes to the object
    // store: neither may carry a secret.
    let projector = start_projector(
        &nats.url(),
        &MAIN_AGENTS,
        &[
            ("RUST_LOG", "collab_projector=trace,info"),
            ("COLLAB_LIMITS__MAX_INLINE_BYTES", "1024"),
        ],
    )
    .await;
    let js = nats.jetstream().await;

    let jwt = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJydWRhLWJvdCJ9.c2lnbmF0dXJlLW9mLXRoZS10b2tlbg";
    let secrets = [
        "hunter2-pw",
        "Zm9vOmJhcjEyMzQ1Njc4",
        "tok3n-abcdef-123456",
        jwt,
        "AKIAIOSFODNN7EXAMPLE",
        "ghp_0123456789abcdefghijABCDEFGHIJ012345",
        "sk-ant-api03-abcdefghijklmnopqrstuv",
        "s3cr3t-db-pass",
        "nested-key-value",
    ];
    // A turn that times out: its blocked response quotes the send's goal.
    let send = json!({"type": "a2a.send", "data": {
        "fromAgent": "ruda", "toAgent": "eden", "conversationId": "c-secret", "workSessionId": "ws-secret",
        "goal": "deploy with Authorization: Bearer tok3n-abcdef-123456",
        "message": "use AKIAIOSFODNN7EXAMPLE and the db at postgres://app:s3cr3t-db-pass@db:5432/x",
        "password": "hunter2-pw", "timeoutMs": 1000}});
    // A tool result carrying keys in text, in nested objects and in JSON inside a string.
    let tool = json!({"type": "tool.completed", "sessionId": "s-1", "runId": "r-1", "agentId": "ruda",
        "payload": {"toolCallId": "t1", "result": {
            "headers": {"Authorization": "Basic Zm9vOmJhcjEyMzQ1Njc4"},
            "stdout": format!("token={jwt}\ngh: ghp_0123456789abcdefghijABCDEFGHIJ012345"),
            "raw": json!({"config": {"api_key": "nested-key-value"}}).to_string(),
            "note": "sk-ant-api03-abcdefghijklmnopqrstuv",
            "log": format!("{}curl -H \"Authorization: Bearer tok3n-abcdef-123456\"\n", "build step ok\n".repeat(200))}}});
    // Dead-lettered (a misspelled role), with a secret in its body: the detail must not quote it.
    let bad = json!({"type": "task.updated", "eventRole": "orchestration.tsak", "taskId": "t-9",
        "api_key": "nested-key-value", "note": "Bearer tok3n-abcdef-123456"});
    let send_seq = publish(
        &js,
        "collab.raw.c-secret.a2a.send",
        serde_json::to_vec(&send).expect("serialises"),
    )
    .await;
    publish(
        &js,
        "collab.raw.s-1.tool.completed",
        serde_json::to_vec(&tool).expect("serialises"),
    )
    .await;
    publish(
        &js,
        "collab.raw.t-9.task.updated",
        serde_json::to_vec(&bad).expect("serialises"),
    )
    .await;

    // The send, its synthesised blocked response, the tool event; one dead letter.
    wait_settled(&js, 3, 1).await;
    let response = the_one(
        &js,
        PROJ,
        "collab.proj.conversation.main.c-secret.a2a.response",
    )
    .await;
    let body = response.json();
    assert_eq!(body["payload"]["outcome"], "blocked", "{body}");
    let sent = the_one(&js, PROJ, "collab.proj.conversation.main.c-secret.a2a.send").await;
    assert_eq!(sent.source_seq(), send_seq);
    let sent = sent.json();
    assert_eq!(sent["payload"]["password"], "[redacted:password]");
    assert!(sent["redactions"].as_u64().unwrap_or(0) >= 3, "{sent}");
    assert!(
        sent["payload"]["goal"]
            .as_str()
            .unwrap_or_default()
            .contains("Bearer [redacted:bearer]"),
        "{sent}"
    );

    // The work session is folded from the projections; wait for it before reading the buckets.
    wait_until(GUARD, "the work session ws-secret", || {
        let js = js.clone();
        async move {
            bucket_values(&js, "collab_work_sessions")
                .await
                .iter()
                .any(|v| v.contains("c-secret"))
        }
    })
    .await;

    let mut everything: Vec<(String, String)> = Vec::new();
    for m in read_all(&js, PROJ, "collab.proj.>").await {
        everything.push((
            format!("projection {}", m.subject),
            String::from_utf8_lossy(&m.payload).into_owned(),
        ));
    }
    for m in read_all(&js, DLQ, "collab.dlq.>").await {
        everything.push((
            format!("dead-letter detail {}", m.subject),
            m.header("Collab-Dlq-Detail").unwrap_or_default(),
        ));
    }
    for bucket in ["collab_work_sessions", "collab_turns"] {
        for v in bucket_values(&js, bucket).await {
            everything.push((format!("bucket {bucket}"), v));
        }
    }
    // The large field went to the object store, redacted.
    let blobs = js
        .get_object_store("collab_blobs")
        .await
        .expect("the object store");
    let mut listed = blobs.list().await.expect("the object list");
    let mut stored = 0;
    while let Some(info) = listed.next().await {
        let info = info.expect("an object's info");
        let mut object = blobs.get(&info.name).await.expect("the object");
        let mut data = Vec::new();
        tokio::io::AsyncReadExt::read_to_end(&mut object, &mut data)
            .await
            .expect("its content");
        let text = String::from_utf8_lossy(&data).into_owned();
        assert!(text.contains("build step ok"), "{text:.80}");
        everything.push((format!("blob {}", info.name), text));
        stored += 1;
    }
    assert_eq!(stored, 1, "one large field offloaded");
    // The API, as a UI reads it.
    let log = projector.log_text();
    let addr = projector.http_addr();
    for path in ["/api/events?limit=1000", "/api/work-sessions"] {
        let body = reqwest::get(format!("http://{addr}{path}"))
            .await
            .expect("the API answers")
            .text()
            .await
            .expect("a body");
        assert!(body.contains("c-secret"), "{path}: {body:.200}");
        everything.push((format!("API {path}"), body));
    }
    // Every line the worker logged, at the most verbose level.
    assert!(
        log.contains("input dead-lettered"),
        "debug lines are logged: {log}"
    );
    everything.push(("the worker's log".into(), projector.log_text()));
    assert!(everything.len() >= 10, "{everything:?}");
    for (place, text) in &everything {
        for secret in secrets {
            assert!(!text.contains(secret), "{place} holds {secret:?}: {text}");
        }
    }
    // The dead-letter stream keeps the original bytes (privileged; replay needs them).
    let dl = the_one(&js, DLQ, "collab.dlq.invalid_role").await;
    assert!(String::from_utf8_lossy(&dl.payload).contains("nested-key-value"));
}

/// An operator lowers the projection stream's largest message while a worker runs: an input
/// whose projection fitted the old limit is refused once, then (the worker reading the limit
/// again as the partition restarts) projected with its payload offloaded to fit. It must not
/// stall its partition, refused again on every restart.
#[tokio::test]
async fn a_projection_stream_limit_lowered_at_run_time_is_read_again_not_a_stalled_partition() {
    let nats = TestNats::start().await;
    let projector = start_projector(&nats.url(), &MAIN_AGENTS, &[]).await;
    let js = nats.jetstream().await;
    // One input first, so the worker has read the limits of a running deployment.
    publish(
        &js,
        "collab.raw.k-warm.task.updated",
        r#"{"type":"task.updated","taskId":"t0"}"#,
    )
    .await;
    the_one(
        &js,
        PROJ,
        "collab.proj.orchestration.task.k-warm.task.updated",
    )
    .await;
    let mut config = js
        .get_stream(PROJ)
        .await
        .expect("the projection stream")
        .info()
        .await
        .expect("its info")
        .config
        .clone();
    config.max_message_size = 16 * 1024;
    js.update_stream(config).await.expect("the limit lowered");
    // 40 KB of notes: under limits.max_inline_bytes (64 KiB), over the new 16 KiB limit.
    let notes = "n".repeat(40_000);
    let body = serde_json::to_vec(&json!({"type": "task.updated", "taskId": "t1",
        "payload": {"notes": notes}}))
    .expect("serialises");
    let seq = publish(&js, "collab.raw.k-big.task.updated", body).await;
    let m = the_one(
        &js,
        PROJ,
        "collab.proj.orchestration.task.k-big.task.updated",
    )
    .await;
    assert_eq!(m.source_seq(), seq);
    let env = m.json();
    assert!(
        env["payload"]["$ref"]
            .as_str()
            .is_some_and(|r| r.starts_with("blob:")),
        "the payload is offloaded to fit the new limit: {env:#}"
    );
    assert!(m.payload.len() < 16 * 1024, "{} bytes", m.payload.len());
    assert_eq!(count(&js, DLQ).await, 0, "nothing was dead-lettered");
    assert!(
        projector
            .log_text()
            .contains("the largest output the server and the output streams accept changed"),
        "the worker says the limit changed"
    );
}

// ---------------------------------------------------------------------------------------------
// 3. Exactly one outcome per raw sequence
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn every_raw_sequence_is_projected_or_dead_lettered_exactly_once() {
    let nats = TestNats::start().await;
    let _projector = start_projector(&nats.url(), &MAIN_AGENTS, &[]).await;
    let js = nats.jetstream().await;

    let mut messages = Vec::new();
    let mut bad = Vec::new();
    for i in 0..300usize {
        let (subject, body, is_bad) = match (i % 10, i % 30, i % 4) {
            (3, _, _) => (
                format!("collab.raw.k{}.task.updated", i % 9),
                b"{\"type\":\"task.up".to_vec(),
                true,
            ),
            (7, _, _) => (
                format!("collab.raw.k{}.thing", i % 9),
                format!("{{\"n\":{i}}}").into_bytes(),
                true,
            ),
            (_, 11, _) => (
                format!("collab.raw.k{}.x", i % 9),
                br#"{"type":"bad type"}"#.to_vec(),
                true,
            ),
            (_, _, 0) => {
                let (s, b) = task_update(&format!("t{}", i % 7), i);
                (s, b, false)
            }
            (_, _, 1) => (
                format!("collab.raw.mon-{}.health.ping", i % 3),
                serde_json::to_vec(
                    &json!({"type": "health.ping", "agentId": format!("mon-{}", i % 3), "n": i}),
                )
                .expect("json"),
                false,
            ),
            (_, _, 2) => {
                let conv = format!("conv-s{}", i % 5);
                (
                    format!("collab.raw.{conv}.a2a.send"),
                    serde_json::to_vec(&json!({"type": "a2a.send", "data": {"fromAgent": "ruda",
                        "toAgent": "helper", "toSessionType": "subagent", "conversationId": conv, "n": i}}))
                    .expect("json"),
                    false,
                )
            }
            _ => (
                format!("collab.raw.sess-{}.run.status", i % 4),
                serde_json::to_vec(
                    &json!({"type": "run.status", "sessionId": format!("sess-{}", i % 4),
                    "status": "running", "sequence": i}),
                )
                .expect("json"),
                false,
            ),
        };
        bad.push(is_bad);
        messages.push((subject, body));
    }
    let seqs = publish_all(&js, &messages).await;
    let bad_seqs: BTreeSet<u64> = seqs
        .iter()
        .zip(&bad)
        .filter(|(_, b)| **b)
        .map(|(s, _)| *s)
        .collect();
    let good_seqs: BTreeSet<u64> = seqs
        .iter()
        .zip(&bad)
        .filter(|(_, b)| !**b)
        .map(|(s, _)| *s)
        .collect();
    assert!(!bad_seqs.is_empty() && !good_seqs.is_empty());

    wait_settled(&js, good_seqs.len() as u64, bad_seqs.len() as u64).await;
    let proj = read_all(&js, PROJ, "collab.proj.>").await;
    let dlq = read_all(&js, DLQ, "collab.dlq.>").await;
    assert_exactly_once(&seqs.iter().copied().collect(), &proj, &dlq);
    assert_refs_match_headers(&proj);
    let projected: BTreeSet<u64> = proj.iter().map(Stored::source_seq).collect();
    let dead: BTreeSet<u64> = dlq.iter().map(Stored::source_seq).collect();
    assert_eq!(
        projected, good_seqs,
        "the good events are the projected ones"
    );
    assert_eq!(dead, bad_seqs, "the bad events are the dead-lettered ones");
}

// ---------------------------------------------------------------------------------------------
// 4. Per-key order
// ---------------------------------------------------------------------------------------------

async fn per_key_order(envs: &[(&str, &str)]) -> Projector {
    let nats = TestNats::start().await;
    let projector = start_projector(&nats.url(), &MAIN_AGENTS, envs).await;
    let js = nats.jetstream().await;

    let keys = ["order-a", "order-b", "order-c"];
    let mut messages = Vec::new();
    let mut which = Vec::new();
    for n in 0..200 {
        for key in keys {
            messages.push(task_update(key, n));
            which.push((key, n));
        }
    }
    let seqs = publish_all(&js, &messages).await;
    wait_settled(&js, messages.len() as u64, 0).await;

    for key in keys {
        // The raw stream's order for this key is the order the projections must follow.
        let mut expected: Vec<(u64, usize)> = seqs
            .iter()
            .zip(&which)
            .filter(|(_, (k, _))| *k == key)
            .map(|(s, (_, n))| (*s, *n))
            .collect();
        expected.sort_unstable();
        let expected_n: Vec<u64> = expected.iter().map(|(_, n)| *n as u64).collect();
        let proj = read_all(
            &js,
            PROJ,
            &format!("collab.proj.orchestration.task.{key}.>"),
        )
        .await;
        let got_n: Vec<u64> = proj
            .iter()
            .map(|m| m.json()["payload"]["n"].as_u64().expect("payload.n"))
            .collect();
        assert_eq!(got_n.len(), 200, "{key}: complete, no duplicates");
        assert_eq!(got_n, expected_n, "{key}: projections in raw-stream order");
        let got_seqs: Vec<u64> = proj.iter().map(Stored::source_seq).collect();
        let expected_seqs: Vec<u64> = expected.iter().map(|(s, _)| *s).collect();
        assert_eq!(got_seqs, expected_seqs, "{key}: rawEventRef order");
    }
    assert_eq!(
        count(&js, PROJ).await,
        messages.len() as u64,
        "no duplicates"
    );
    assert_eq!(count(&js, DLQ).await, 0);
    projector
}

#[tokio::test]
async fn events_of_one_key_are_projected_in_raw_order() {
    per_key_order(&[]).await;
}

/// Outputs published one at a time, pipelined (`never`).
const PIPELINED: (&str, &str) = ("COLLAB_NATS__PUBLISH_BATCHES", "never");

#[tokio::test]
async fn per_key_order_survives_transient_publish_failures() {
    let projector = per_key_order(&[PIPELINED, ("COLLAB_TEST_FAIL_PUBLISH_EVERY", "7")]).await;
    assert!(
        projector.log_text().contains("injected publish failure"),
        "the failure hook must have fired for this test to mean anything"
    );
}

/// Outputs stored as atomic batches, as on replicated streams (`auto`), here on one server.
const BATCHES: (&str, &str) = ("COLLAB_NATS__PUBLISH_BATCHES", "always");

/// `collab_publish_batches_total{outcome}` of a running projector.
async fn batches(projector: &Projector, outcome: &str) -> f64 {
    metric(
        projector,
        collab_projector::telemetry::PUBLISH_BATCHES,
        &[&format!("outcome=\"{outcome}\"")],
    )
    .await
}

/// The sum of a running projector's `family` samples carrying every one of `labels`.
async fn metric(projector: &Projector, family: &str, labels: &[&str]) -> f64 {
    let text = reqwest::get(format!("http://{}/metrics", projector.http_addr()))
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("the metrics text");
    crate::operability::sum(&crate::operability::samples(&text), family, labels)
}

#[tokio::test]
async fn per_key_order_holds_with_outputs_stored_as_atomic_batches() {
    let projector = per_key_order(&[BATCHES]).await;
    assert!(
        batches(&projector, "stored").await > 0.0,
        "the outputs must have gone as batches for this test to mean anything"
    );
    assert_eq!(batches(&projector, "fell_back").await, 0.0);
}

/// Outputs stored as fast-ingest batches (`auto` on one server), some refused by the failure
/// hook: those go one output at a time, in order, before the next batch.
#[tokio::test]
async fn per_key_order_holds_when_fast_batches_fail_and_go_one_output_at_a_time() {
    let fast = ("COLLAB_NATS__PUBLISH_BATCHES", "fast");
    let projector = per_key_order(&[fast, ("COLLAB_TEST_FAIL_PUBLISH_EVERY", "3")]).await;
    assert!(
        projector
            .log_text()
            .contains("outputs are stored as fast-ingest batches"),
        "the outputs must have gone as fast-ingest batches"
    );
    assert!(
        batches(&projector, "fell_back").await > 0.0,
        "the failure hook must have stopped batches for this test to mean anything"
    );
    assert!(batches(&projector, "stored").await > 0.0);
}

/// An output of a fast-ingest group of one is published on its own, never sent before: with a
/// duplicate window shorter than the look-up margin plus an ack timeout it used to be looked up
/// first all the same, by a consumer of its own on its subject, for every input of a group of
/// one (a latency run at 5,000 msg/s with a 20 s window read p50 15 ms, p99 120 ms, against
/// 1 / 8 ms at 2 min). Inputs sent one at a time, each waited for, make every group one input;
/// the server's consumer-create requests on the projection stream are counted.
#[tokio::test]
async fn outputs_of_groups_of_one_are_not_looked_up_before_their_first_send_under_a_short_duplicate_window(
) {
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let client = async_nats::connect(nats.url())
        .await
        .expect("a watcher connects");
    let mut creates = client
        .subscribe(format!("$JS.API.CONSUMER.CREATE.{PROJ}.>"))
        .await
        .expect("subscribe to the projection stream's consumer creations");
    client.flush().await.expect("the subscription is in place");
    let projector = start_projector(
        &nats.url(),
        &MAIN_AGENTS,
        &[
            ("COLLAB_NATS__PUBLISH_BATCHES", "fast"),
            ("COLLAB_PROJECTION__DUPLICATE_WINDOW", "2s"),
        ],
    )
    .await;
    let inputs = 30;
    for n in 0..inputs {
        let (subject, body) = task_update(&format!("single-{}", n % 5), n);
        publish(&js, &subject, body).await;
        wait_proj_at_least(&js, n as u64 + 1).await;
    }
    wait_settled(&js, inputs as u64, 0).await;
    let mut look_ups = Vec::new();
    while let Ok(Some(m)) = tokio::time::timeout(Duration::from_millis(500), creates.next()).await {
        if m.subject.contains(".lookup-") {
            look_ups.push(m.subject.to_string());
        }
    }
    assert!(
        look_ups.is_empty(),
        "{} of {inputs} outputs were looked up before their first send (first: {:?}); the worker's log:\n{}",
        look_ups.len(),
        look_ups.first(),
        projector.log_text()
    );
    let proj = read_all(&js, PROJ, "collab.proj.>").await;
    assert_eq!(proj.len(), inputs, "each input projected once");
    assert!(
        batches(&projector, "stored").await == 0.0,
        "every group must have held one input for this test to mean anything"
    );
}

#[tokio::test]
async fn per_key_order_holds_when_atomic_batches_fail_and_go_one_output_at_a_time() {
    let projector = per_key_order(&[BATCHES, ("COLLAB_TEST_FAIL_PUBLISH_EVERY", "3")]).await;
    assert!(
        batches(&projector, "fell_back").await > 0.0,
        "the failure hook must have refused batches for this test to mean anything"
    );
}

// ---------------------------------------------------------------------------------------------
// 5. SIGKILL mid-stream, and a crash right before the acknowledgement
// ---------------------------------------------------------------------------------------------

/// Short, so messages delivered to a killed worker come back soon; both processes use it.
const ACK_WAIT: (&str, &str) = ("COLLAB_CONSUMER__ACK_WAIT", "5s");

/// Task updates over 40 keys, each in one of 7 work sessions (so a session gathers events of
/// many partitions).
/// `count` task updates over 40 keys, each key a conversation that names a work session in one
/// update of three and only itself in the others, moving between seven sessions as it goes, so
/// the work-session fold routes most events through conversation aliases that change.
fn load(count: usize) -> Vec<(String, Vec<u8>)> {
    load_named("load", count)
}

/// [`load`], with its conversations and work sessions named after `name`.
fn load_named(name: &str, count: usize) -> Vec<(String, Vec<u8>)> {
    (0..count)
        .map(|i| {
            let key = format!("{name}-{}", i % 40);
            let mut body = json!({"type": "task.updated", "taskId": key, "conversationId": key, "payload": {"n": i}});
            if i % 3 == 0 {
                body["workSessionId"] = json!(format!("ws-{name}-{}", (i / 120 + i % 7) % 7));
            }
            (
                format!("collab.raw.{key}.task.updated"),
                serde_json::to_vec(&body).expect("serialises"),
            )
        })
        .collect()
}

/// Publish `messages` in small pipelined chunks, as a steady producer would.
fn spawn_producer(
    js: &Context,
    messages: Vec<(String, Vec<u8>)>,
) -> tokio::task::JoinHandle<Vec<u64>> {
    let js = js.clone();
    tokio::spawn(async move {
        let mut seqs = Vec::with_capacity(messages.len());
        for chunk in messages.chunks(10) {
            seqs.extend(publish_all(&js, chunk).await);
            // Paced, so the stop or crash lands while the producer is still publishing (the
            // outcome checks hold either way).
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        seqs
    })
}

async fn wait_proj_at_least(js: &Context, n: u64) {
    wait_until(GUARD, &format!("COLLAB_PROJ holds {n} messages"), || {
        let js = js.clone();
        async move { count(&js, PROJ).await >= n }
    })
    .await;
}

/// After the producer and a fresh projector finish: every raw sequence projected exactly once.
async fn finish_and_check(
    nats: &TestNats,
    js: &Context,
    producer: tokio::task::JoinHandle<Vec<u64>>,
) {
    finish_and_check_with(nats, js, producer, &[ACK_WAIT]).await;
}

/// [`finish_and_check`] with the fresh projector's environment.
async fn finish_and_check_with(
    nats: &TestNats,
    js: &Context,
    producer: tokio::task::JoinHandle<Vec<u64>>,
    envs: &[(&str, &str)],
) {
    let seqs = tokio::time::timeout(GUARD, producer)
        .await
        .expect("the producer finished")
        .expect("the producer did not panic");
    let _second = start_projector(&nats.url(), &MAIN_AGENTS, envs).await;
    wait_settled(js, seqs.len() as u64, 0).await;
    let proj = read_all(js, PROJ, "collab.proj.>").await;
    let dlq = read_all(js, DLQ, "collab.dlq.>").await;
    assert!(
        dlq.is_empty(),
        "nothing should be dead-lettered: {:?}",
        dlq.iter()
            .map(|d| d.header("Collab-Dlq-Detail"))
            .collect::<Vec<_>>()
    );
    assert_refs_match_headers(&proj);
    assert_exactly_once(&seqs.iter().copied().collect(), &proj, &dlq);
    assert_sessions_count_every_projection(js, &proj).await;
}

/// Every stored projection is counted exactly once in the work sessions, after a crash as
/// without one: each session's counts equal those of a fold of the projection stream done here,
/// in stream order, with the library's own fold (the worker folds in partition order, and
/// counts do not depend on the order).
async fn assert_sessions_count_every_projection(js: &Context, proj: &[Stored]) {
    use collab_projector::sessions::{self, Identity, Position, WorkSession};
    let mut expected: BTreeMap<String, WorkSession> = BTreeMap::new();
    let mut aliases: std::collections::HashMap<String, String> = Default::default();
    let mut moved = false;
    for m in proj {
        let env = sessions::envelope_for_fold(&m.payload).expect("a stored envelope");
        let keys = sessions::keys(&env);
        let id = match (&keys.work_session_id, &keys.conversation_id) {
            (Some(ws), Some(conv)) => {
                if let Some(before) = aliases.insert(conv.clone(), ws.clone()) {
                    moved |= before != *ws;
                }
                ws.clone()
            }
            (Some(ws), None) => ws.clone(),
            (None, Some(conv)) => aliases.get(conv).cloned().unwrap_or_else(|| conv.clone()),
            (None, None) => continue,
        };
        let s = expected.entry(id.clone()).or_insert_with(|| WorkSession {
            id,
            ..WorkSession::default()
        });
        let at = Identity {
            partition: u16::MAX,
            position: Position(m.seq, 0),
        };
        sessions::fold_into(s, &env, &keys, at);
    }
    assert!(!expected.is_empty(), "the load has work sessions");
    assert!(
        moved,
        "the load moves a conversation from one work session to another"
    );
    let kv = js
        .get_key_value("collab_work_sessions")
        .await
        .expect("the sessions bucket");
    // The fold runs behind the projections: wait until it has read the whole stream.
    wait_folded(js, &kv).await;
    for (id, want) in &expected {
        let key = collab_projector::bus::sessions::session_key(id);
        let stored = kv
            .get(&key)
            .await
            .expect("a session read")
            .unwrap_or_else(|| panic!("no work session {id}"));
        let got: WorkSession = serde_json::from_slice(&stored).expect("a stored session");
        assert_eq!(got.counts, want.counts, "the counts of work session {id}");
    }
    // And no other session: every one-token key of the bucket is a session the stream makes.
    let stored: BTreeSet<String> = bucket_keys(&kv)
        .await
        .into_iter()
        .filter(|k| !k.contains('.'))
        .collect();
    let made: BTreeSet<String> = expected
        .keys()
        .map(|id| collab_projector::bus::sessions::session_key(id))
        .collect();
    assert_eq!(
        stored, made,
        "the bucket holds exactly the sessions the stream makes"
    );
    eprintln!(
        "{} work sessions count every projection once",
        expected.len()
    );
}

#[tokio::test]
async fn sigkill_mid_stream_loses_nothing_and_duplicates_nothing() {
    let nats = TestNats::start().await;
    let mut first = start_projector(&nats.url(), &MAIN_AGENTS, &[ACK_WAIT]).await;
    let js = nats.jetstream().await;
    let producer = spawn_producer(&js, load(2000));
    wait_proj_at_least(&js, 300).await;
    first.kill9();
    let raw_at_kill = count(&js, RAW).await;
    let status = first
        .wait_exit(GUARD)
        .await
        .expect("SIGKILL ends the process");
    assert!(!status.success());
    eprintln!(
        "killed with {raw_at_kill} raw messages stored and {} projected",
        count(&js, PROJ).await
    );
    finish_and_check(&nats, &js, producer).await;
}

#[tokio::test]
async fn sigkill_mid_stream_with_atomic_batches_loses_nothing_and_duplicates_nothing() {
    let nats = TestNats::start().await;
    let mut first = start_projector(&nats.url(), &MAIN_AGENTS, &[ACK_WAIT, BATCHES]).await;
    let js = nats.jetstream().await;
    let producer = spawn_producer(&js, load(2000));
    wait_proj_at_least(&js, 300).await;
    first.kill9();
    first
        .wait_exit(GUARD)
        .await
        .expect("SIGKILL ends the process");
    finish_and_check_with(&nats, &js, producer, &[ACK_WAIT, BATCHES]).await;
}

#[tokio::test]
async fn crash_before_ack_is_repaired_without_duplicates() {
    let nats = TestNats::start().await;
    let url = nats.url();
    let (ok, out, err) = run_bin(&["provision", "--nats-url", &url], &[ACK_WAIT], b"").await;
    assert!(ok, "provision failed: {out}{err}");
    let js = nats.jetstream().await;
    let messages = load(600);
    let producer = tokio::spawn({
        let js = js.clone();
        async move { publish_all(&js, &messages).await }
    });
    let mut first = Projector::spawn(
        &url,
        &MAIN_AGENTS,
        &[ACK_WAIT, ("COLLAB_TEST_CRASH_AT", "before_ack")],
    );
    let status = first
        .wait_exit(GUARD)
        .await
        .expect("the crash hook aborts the process");
    assert!(!status.success(), "an abort is not a clean exit");
    assert!(
        first.log_text().contains("crashing at before_ack"),
        "the hook must have fired: {}",
        first.log_text()
    );
    let written = count(&js, PROJ).await;
    assert!(written > 0, "the first process published before it crashed");
    eprintln!("crashed before its first ack after {written} projections");
    finish_and_check(&nats, &js, producer).await;
}

/// A takeover's replay reader deleted after the server made it and before the worker's first
/// pull: its create answer is held on the way back while the reader is deleted. The client
/// library makes such a reader again from the stream's first message, so what it reads first
/// lies below the range the partition took over. The partition starts over with a reader of
/// its own range instead of processing its acknowledged history again: no replay reads more
/// than the inputs it took over, and every input is projected once.
#[tokio::test]
async fn a_replay_reader_deleted_before_its_first_delivery_reads_only_its_range() {
    let (nats, proxy, js) = provisioned_behind_a_proxy().await;
    let url = nats.url();
    let inputs = load(800);
    // A history, processed and acknowledged.
    let mut seqs = publish_all(&js, &inputs[..400]).await;
    let mut first = start_projector(&url, &MAIN_AGENTS, &[ACK_WAIT]).await;
    wait_settled(&js, seqs.len() as u64, 0).await;
    first.stop_cleanly(GUARD).await;
    // Then inputs processed and never acknowledged: the worker crashes before its first ack.
    seqs.extend(publish_all(&js, &inputs[400..]).await);
    let mut crashed = Projector::spawn(
        &url,
        &MAIN_AGENTS,
        &[ACK_WAIT, ("COLLAB_TEST_CRASH_AT", "before_ack")],
    );
    crashed
        .wait_exit(GUARD)
        .await
        .expect("the crash hook aborts the process");
    // What each partition has in flight: all a complete replay of it reads.
    let raw = js.get_stream(RAW).await.expect("the raw stream");
    let in_flight: BTreeMap<u64, u64> = raw
        .consumers()
        .try_collect::<Vec<consumer::Info>>()
        .await
        .expect("the raw stream's consumers")
        .into_iter()
        .filter_map(|i| {
            let p = i.name.strip_prefix("collab-proj-")?.parse().ok()?;
            Some((p, i.num_ack_pending as u64))
        })
        .collect();
    assert!(
        in_flight.values().any(|n| *n > 0),
        "the crash left inputs in flight: {in_flight:?}"
    );
    // The next worker takes them over; the first replay reader it makes is deleted before the
    // worker hears it was made.
    let created = proxy.hold_answers_once_sent("CONSUMER.CREATE.COLLAB_RAW.replay-");
    let worker = Projector::spawn(
        &proxy.url(),
        &MAIN_AGENTS,
        &[
            ACK_WAIT,
            ("RUST_LOG", "info,collab_projector::bus::reader=debug"),
        ],
    );
    sent_within_30s(created, "replay reader").await;
    // The create reached the server; once it is made, delete what replay readers there are.
    let replay_readers = || async {
        raw.consumer_names()
            .try_collect::<Vec<String>>()
            .await
            .unwrap_or_default()
            .into_iter()
            .filter(|n| n.starts_with("replay-"))
            .collect::<Vec<String>>()
    };
    wait_until(GUARD, "the held create made a replay reader", || async {
        !replay_readers().await.is_empty()
    })
    .await;
    let readers = replay_readers().await;
    for name in &readers {
        raw.delete_consumer(name).await.expect("delete the reader");
    }
    proxy.hold_down(false);
    wait_settled(&js, seqs.len() as u64, 0).await;
    let log = worker.log_text();
    let proj = read_all(&js, PROJ, "collab.proj.>").await;
    assert_each_projected_once(&proj, seqs, &log);
    let replays: Vec<(u64, u64)> = log
        .lines()
        .filter(|l| l.contains("took over in-flight messages"))
        .map(|l| {
            let field = |name: &str| -> u64 {
                // The event's own field: the last one of that name (the span names the
                // partition too).
                l.split_whitespace()
                    .rev()
                    .find_map(|w| w.strip_prefix(name)?.parse().ok())
                    .unwrap_or_else(|| panic!("no {name} in {l}"))
            };
            (field("partition="), field("count="))
        })
        .collect();
    assert!(!replays.is_empty(), "no replay completed: {log}");
    assert!(
        log.contains("the replay reader was made again from the stream's start"),
        "the remade reader was not noticed: {log}"
    );
    for (p, count) in replays {
        let held = in_flight.get(&p).copied().unwrap_or_default();
        assert!(
            count <= held,
            "partition {p}'s replay processed {count} inputs, {held} of them in flight: {log}"
        );
    }
}

/// A work-session bucket emptied while the workers are stopped is rebuilt from the projection
/// stream at the next start, each projection counted once, with new input arriving meanwhile.
#[tokio::test]
async fn an_emptied_work_session_bucket_is_rebuilt_from_the_projection_stream() {
    rebuilt_after_emptying(None).await;
}

/// The same with another key left in the bucket, as the OpenTelemetry export keeps its
/// position there: only sessions say the fold ran before, so the whole stream is folded again.
#[tokio::test]
async fn a_work_session_bucket_holding_only_the_exports_position_is_rebuilt_whole() {
    rebuilt_after_emptying(Some(("otel.position", "1"))).await;
}

async fn rebuilt_after_emptying(left: Option<(&str, &str)>) {
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let mut first = start_projector(&nats.url(), &MAIN_AGENTS, &[ACK_WAIT]).await;
    let seqs = publish_all(&js, &load(300)).await;
    wait_settled(&js, seqs.len() as u64, 0).await;
    first.sigterm();
    first
        .wait_exit(GUARD)
        .await
        .expect("SIGTERM ends the process");
    let sessions = js
        .get_stream("KV_collab_work_sessions")
        .await
        .expect("the sessions bucket's stream");
    sessions.purge().await.expect("the bucket is emptied");
    if let Some((key, value)) = left {
        let bucket = js
            .get_key_value("collab_work_sessions")
            .await
            .expect("the sessions bucket");
        bucket
            .put(key, value.to_string().into())
            .await
            .expect("a key left in the bucket");
    }
    // Restarted with more input arriving while the drain runs.
    let _second = start_projector(&nats.url(), &MAIN_AGENTS, &[ACK_WAIT]).await;
    let more = publish_all(&js, &load(300)).await;
    wait_settled(&js, (seqs.len() + more.len()) as u64, 0).await;
    let proj = read_all(&js, PROJ, "collab.proj.>").await;
    assert_eq!(proj.len(), 600);
    assert_sessions_count_every_projection(&js, &proj).await;
}

/// A fold many rounds behind reads each round while the one before is written (rounds of 25
/// projections here, `COLLAB_TEST_FOLD_ROUND`, so 300 inputs make a backlog of a dozen). A
/// round whose writes the bucket refuses (full) fails with the round read ahead of it, and the
/// fold starts again from its checkpoint; once there is room, every projection is counted once
/// in the work sessions, and the bucket holds no session the stream does not make.
#[tokio::test]
async fn a_fold_rounds_behind_reads_ahead_and_after_refused_writes_counts_every_projection_once() {
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let worker = start_projector(
        &nats.url(),
        &MAIN_AGENTS,
        &[
            ACK_WAIT,
            ("COLLAB_TEST_FOLD_ROUND", "25"),
            ("COLLAB_STORAGE__SESSIONS_MAX_BYTES", "1048576"),
        ],
    )
    .await;
    let kv = js
        .get_key_value("collab_work_sessions")
        .await
        .expect("the sessions bucket");
    wait_until(GUARD, "the fold has written where it starts", || {
        let kv = kv.clone();
        async move { matches!(kv.get("fold.position").await, Ok(Some(_))) }
    })
    .await;
    // No round can be written.
    let junk = fill_bucket(&kv).await;
    let published = publish_all(&js, &load(300)).await.len();
    wait_settled(&js, published as u64, 0).await;
    // A round's writes are refused.
    worker
        .wait_logged(
            "work-session fold failed; restarting from its checkpoint",
            GUARD,
        )
        .await;
    purge_filled(&kv, &junk).await;
    let proj = read_all(&js, PROJ, "collab.proj.>").await;
    assert_eq!(proj.len(), published);
    assert_sessions_count_every_projection(&js, &proj).await;
}

/// A fold checkpoint set back by hand (the aliases in the bucket were written by rounds after
/// it, and no other fold is ahead) does not stop the fold for good: it takes the aliases as
/// they stand, says so, and folds to the stream's end again.
#[tokio::test]
async fn a_fold_whose_checkpoint_was_set_back_folds_on() {
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let mut first = start_projector(&nats.url(), &MAIN_AGENTS, &[ACK_WAIT]).await;
    // In two halves, so the fold writes the aliases in more than one round.
    let kv = js
        .get_key_value("collab_work_sessions")
        .await
        .expect("the sessions bucket");
    let mut published = 0;
    for half in load(300).chunks(150) {
        published += publish_all(&js, half).await.len();
        wait_settled(&js, published as u64, 0).await;
        wait_folded(&js, &kv).await;
    }
    let moved_later = bucket_keys(&kv)
        .await
        .iter()
        .filter(|k| k.starts_with("alias."))
        .count();
    assert!(
        moved_later > 0,
        "the load moves conversations into sessions"
    );
    first.sigterm();
    first
        .wait_exit(GUARD)
        .await
        .expect("SIGTERM ends the process");
    kv.put("fold.position", "0".into())
        .await
        .expect("the checkpoint set back");
    let second = start_projector(&nats.url(), &MAIN_AGENTS, &[ACK_WAIT]).await;
    wait_folded(&js, &kv).await;
    assert!(
        second.log_text().contains("the checkpoint went back"),
        "{}",
        second.log_text()
    );
}

/// The fold's checkpoint deleted by hand (`nats kv del collab_work_sessions fold.position`)
/// while a worker folds a backlog: the fold, refused its next checkpoint write, starts again,
/// and finds sessions in the bucket but no checkpoint. It folds the projection stream again
/// from its first message (each session passes over what it applied), instead of starting at
/// the stream's end and leaving out of every session what was projected in between.
#[tokio::test]
async fn a_deleted_fold_checkpoint_is_folded_again_from_the_stream_start() {
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let worker = start_projector(&nats.url(), &MAIN_AGENTS, &[ACK_WAIT]).await;
    let kv = js
        .get_key_value("collab_work_sessions")
        .await
        .expect("the sessions bucket");
    let published = publish_all(&js, &load(300)).await.len();
    wait_settled(&js, published as u64, 0).await;
    wait_folded(&js, &kv).await;
    delete_the_fold_checkpoint_under_a_backlog(&js, &kv, &worker, published).await;
    let proj = read_all(&js, PROJ, "collab.proj.>").await;
    assert_sessions_count_every_projection(&js, &proj).await;
}

/// Publish a backlog of 3,000 inputs on top of the `published` ones, delete the fold's
/// checkpoint while it is projected and folded, and wait until the fold has read it all; the
/// worker must name the deleted checkpoint.
async fn delete_the_fold_checkpoint_under_a_backlog(
    js: &Context,
    kv: &async_nats::jetstream::kv::Store,
    worker: &Projector,
    published: usize,
) {
    let producer = spawn_producer(js, load(3000));
    wait_proj_at_least(js, published as u64 + 300).await;
    kv.delete("fold.position")
        .await
        .expect("the checkpoint is deleted");
    let backlog = tokio::time::timeout(GUARD, producer)
        .await
        .expect("the producer finished")
        .expect("the producer did not panic")
        .len();
    wait_settled(js, (published + backlog) as u64, 0).await;
    wait_folded(js, kv).await;
    let log = worker.log_text();
    assert!(
        log.contains("the fold's checkpoint was deleted"),
        "the deleted checkpoint is named:\n{log}"
    );
}

/// A bucket whose work sessions an older version wrote (from the partitions, counting each
/// event by its partition's position) and that has no `fold.position`: the fold starts at the
/// projection stream's end and keeps that start as `fold.origin`. Its checkpoint deleted by hand
/// later, it folds again from that origin, never from the stream's first message, whose
/// projections the older version's sessions count already and would count twice.
#[tokio::test]
async fn a_deleted_fold_checkpoint_is_folded_again_from_the_fold_origin_not_before() {
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let mut first = start_projector(&nats.url(), &MAIN_AGENTS, &[ACK_WAIT]).await;
    let kv = js
        .get_key_value("collab_work_sessions")
        .await
        .expect("the sessions bucket");
    // Conversations and sessions of their own, which the fold after the older version never
    // touches: nothing but the origin keeps it from counting their events again.
    let published = publish_all(&js, &load_named("old", 300)).await.len();
    wait_settled(&js, published as u64, 0).await;
    wait_folded(&js, &kv).await;
    first.stop_cleanly(GUARD).await;
    let older = as_written_by_an_older_version(&js, &kv).await;
    assert!(older > 0, "the load has work sessions");

    // The fold starts after what the older version counted (and after the partitions' first
    // fence claims, which are no events) and keeps that start.
    let counted = proj_last_sequence(&js).await;
    let worker = start_projector(&nats.url(), &MAIN_AGENTS, &[ACK_WAIT]).await;
    wait_until(GUARD, "the fold keeps where it started", || {
        let kv = kv.clone();
        async move {
            kv.get("fold.origin")
                .await
                .ok()
                .flatten()
                .and_then(|v| String::from_utf8_lossy(&v).trim().parse::<u64>().ok())
                .is_some_and(|origin| origin >= counted)
        }
    })
    .await;
    delete_the_fold_checkpoint_under_a_backlog(&js, &kv, &worker, published).await;
    // Every projection counted once: the first 300 by the older version, the rest by the fold.
    let proj = read_all(&js, PROJ, "collab.proj.>").await;
    assert_sessions_count_every_projection(&js, &proj).await;
}

/// Make the sessions bucket look as an older version left it: each session's events counted
/// by partition position (what the fold applied moved from its own partition to partition 0's),
/// and no trace of the fold (`fold.position` and `fold.origin` removed with their history, as
/// never written). The sessions rewritten.
async fn as_written_by_an_older_version(
    js: &Context,
    kv: &async_nats::jetstream::kv::Store,
) -> usize {
    let mut rewritten = 0;
    for key in bucket_keys(kv).await {
        if key.contains('.') {
            continue;
        }
        let value = kv
            .get(&key)
            .await
            .expect("a session read")
            .expect("a session");
        let mut session: Value = serde_json::from_slice(&value).expect("a stored session");
        let applied = session["applied"]
            .as_object_mut()
            .expect("a session says what it applied");
        let folded = applied
            .remove(&u16::MAX.to_string())
            .expect("the fold applied it");
        applied.insert("0".to_string(), folded);
        kv.put(
            &key,
            serde_json::to_vec(&session).expect("serialises").into(),
        )
        .await
        .expect("the session rewritten");
        rewritten += 1;
    }
    let stream = js
        .get_stream("KV_collab_work_sessions")
        .await
        .expect("the bucket's stream");
    stream
        .purge()
        .filter("$KV.collab_work_sessions.fold.>")
        .await
        .expect("the fold's keys removed");
    rewritten
}

/// Every key the bucket holds now.
async fn bucket_keys(kv: &async_nats::jetstream::kv::Store) -> Vec<String> {
    kv.keys()
        .await
        .expect("the bucket's keys")
        .try_collect()
        .await
        .expect("the keys")
}

/// The projection stream's last sequence.
async fn proj_last_sequence(js: &Context) -> u64 {
    js.get_stream(PROJ)
        .await
        .expect("the projection stream")
        .info()
        .await
        .expect("its state")
        .state
        .last_sequence
}

/// Wait until the work-session fold has read the projection stream to its end as it is now.
async fn wait_folded(js: &Context, kv: &async_nats::jetstream::kv::Store) {
    let last = proj_last_sequence(js).await;
    wait_until(
        GUARD,
        "the work-session fold reaches the stream's end",
        || {
            let kv = kv.clone();
            async move {
                kv.get("fold.position")
                    .await
                    .ok()
                    .flatten()
                    .and_then(|v| String::from_utf8_lossy(&v).trim().parse::<u64>().ok())
                    .is_some_and(|p| p >= last)
            }
        },
    )
    .await;
}

/// The partition consumers' storage as the server reports it: `true` for each kept in memory.
async fn partition_consumers_in_memory(js: &Context) -> Vec<bool> {
    let raw = js.get_stream(RAW).await.expect("raw stream");
    raw.consumers()
        .try_collect::<Vec<consumer::Info>>()
        .await
        .expect("consumer list")
        .into_iter()
        .filter(|i| i.name.starts_with("collab-proj-"))
        .map(|i| i.config.memory_storage)
        .collect()
}

/// A partition idle for longer than `turns.retention` (the life of the turns bucket's entries,
/// its checkpoint among them), then a server restart that loses its consumer (kept in the
/// server's memory): the consumer is made again from the checkpoint, which the idle partition
/// kept alive, not from the raw stream's first message. Here the raw stream keeps inputs longer
/// than the projection stream keeps their projections (5 s), so a consumer made from the first
/// message would project the old inputs again.
#[tokio::test]
async fn an_idle_partition_keeps_its_checkpoint_past_the_turns_retention() {
    let mut nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let projector = start_projector(
        &nats.url(),
        &MAIN_AGENTS,
        &[
            ACK_WAIT,
            ("COLLAB_TURNS__RETENTION", "3s"),
            // The early hold and the deadlines may not outlast the retention.
            ("COLLAB_TURNS__EARLY_HOLD", "1s"),
            ("COLLAB_TURNS__DEFAULT_TIMEOUT", "2s"),
            ("COLLAB_TURNS__MAX_TIMEOUT", "2s"),
            ("COLLAB_RUNS__TIMEOUT", "2s"),
            ("COLLAB_PROJECTION__MAX_AGE", "5s"),
            ("COLLAB_PROJECTION__DUPLICATE_WINDOW", "1s"),
        ],
    )
    .await;
    let old = publish_all(&js, &load(100)).await;
    wait_settled(&js, old.len() as u64, 0).await;
    let last_old = old.iter().copied().max().unwrap_or(0);
    // Idle for three retention periods; the old projections expire meanwhile.
    tokio::time::sleep(Duration::from_secs(9)).await;
    nats.restart().await;
    let js = nats.jetstream().await;
    // Every projection stored from here on, read as it is stored: the stream's own copies expire
    // after 5 s, which a loaded machine can outrun between the first new projection and the
    // last. The old projections expired before the restart, so all it holds now was stored
    // after it (a re-projection of an old input as soon as the worker was back included).
    let mut feed = projections_from_now(&js).await;
    let more = publish_all(&js, &load(100)).await;
    let mut proj: Vec<Stored> = Vec::new();
    let deadline = Instant::now() + GUARD;
    while proj.len() < more.len() {
        assert!(
            Instant::now() < deadline,
            "only {} of {} new inputs projected; the worker's log:\n{}",
            proj.len(),
            more.len(),
            projector.log_text()
        );
        if let Some(m) = next_stored(&mut feed, Duration::from_secs(1)).await {
            proj.push(m);
        }
    }
    // Time for a consumer made from the first raw message to have projected the old inputs
    // again (they are few and the worker is idle otherwise).
    let quiet = Instant::now() + Duration::from_secs(3);
    while Instant::now() < quiet {
        if let Some(m) = next_stored(&mut feed, quiet - Instant::now()).await {
            proj.push(m);
        }
    }
    let again: Vec<u64> = proj
        .iter()
        .map(Stored::source_seq)
        .filter(|s| *s <= last_old)
        .collect();
    assert!(
        again.is_empty(),
        "{} old inputs projected again after the restart (first: {:?}); the worker's log:\n{}",
        again.len(),
        again.first(),
        projector.log_text()
    );
    assert_eq!(proj.len(), more.len(), "each new input projected once");
}

/// A reader of `COLLAB_PROJ`'s projections from what it holds now on, each delivered as it is
/// stored.
async fn projections_from_now(js: &Context) -> async_nats::jetstream::consumer::pull::Stream {
    reader_of(js, PROJ, "collab.proj.>")
        .await
        .messages()
        .await
        .expect("projection reader's messages")
}

/// The next projection from `feed` within `wait`, if any (partition owners' fence claims are
/// skipped).
async fn next_stored(
    feed: &mut async_nats::jetstream::consumer::pull::Stream,
    wait: Duration,
) -> Option<Stored> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let Some(item) = tokio::time::timeout_at(deadline, feed.next()).await.ok()? else {
            // The reader ended: wait out the time given rather than spin.
            tokio::time::sleep_until(deadline).await;
            return None;
        };
        if let Some(stored) = stored_of(&item.ok()?) {
            return Some(stored);
        }
    }
}

/// A server restart with every consumer of the worker in the server's memory (the fold's, and
/// the partitions' by default, `consumer.memory_state`): all of them are gone afterwards. The
/// partitions recreate theirs from their checkpoints, the fold goes on from its own, and each
/// input is projected once and each projection counted once in the sessions, those stored
/// after the restart included.
async fn across_a_server_restart(memory_state: &str) {
    let mut nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let projector = start_projector(
        &nats.url(),
        &MAIN_AGENTS,
        &[ACK_WAIT, ("COLLAB_CONSUMER__MEMORY_STATE", memory_state)],
    )
    .await;
    let seqs = publish_all(&js, &load(300)).await;
    wait_settled(&js, seqs.len() as u64, 0).await;
    let in_memory = memory_state == "true";
    assert_eq!(
        partition_consumers_in_memory(&js).await,
        vec![in_memory; default_partitions()],
        "consumer.memory_state = {memory_state}"
    );
    let before = read_all(&js, PROJ, "collab.proj.>").await;
    assert_sessions_count_every_projection(&js, &before).await;
    nats.restart().await;
    let js = nats.jetstream().await;
    let more = publish_all(&js, &load(300)).await;
    wait_settled(&js, (seqs.len() + more.len()) as u64, 0).await;
    let proj = read_all(&js, PROJ, "collab.proj.>").await;
    assert_eq!(proj.len(), 600);
    assert_sessions_count_every_projection(&js, &proj).await;
    let recreated = projector
        .log_text()
        .matches("recreating it from the partition's checkpoint")
        .count();
    if in_memory {
        assert_eq!(recreated, default_partitions(), "{}", projector.log_text());
    } else {
        assert_eq!(recreated, 0, "{}", projector.log_text());
    }
}

/// `consumer.memory_state` changed on a deployment that ran: the worker started with the new
/// setting makes each partition's consumer again with that storage, from the partition's
/// checkpoint, and every input is still projected once.
#[tokio::test]
async fn a_changed_memory_state_remakes_existing_consumers_and_nothing_is_projected_twice() {
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let mut first = start_projector(
        &nats.url(),
        &MAIN_AGENTS,
        &[ACK_WAIT, ("COLLAB_CONSUMER__MEMORY_STATE", "false")],
    )
    .await;
    let seqs = publish_all(&js, &load(300)).await;
    wait_settled(&js, seqs.len() as u64, 0).await;
    assert_eq!(
        partition_consumers_in_memory(&js).await,
        vec![false; default_partitions()]
    );
    first.sigterm();
    first
        .wait_exit(GUARD)
        .await
        .expect("SIGTERM ends the process");
    let second = start_projector(
        &nats.url(),
        &MAIN_AGENTS,
        &[ACK_WAIT, ("COLLAB_CONSUMER__MEMORY_STATE", "true")],
    )
    .await;
    let more = publish_all(&js, &load(300)).await;
    wait_settled(&js, (seqs.len() + more.len()) as u64, 0).await;
    assert_eq!(
        partition_consumers_in_memory(&js).await,
        vec![true; default_partitions()]
    );
    let switched = second
        .log_text()
        .matches("switching the partition's consumer")
        .count();
    assert_eq!(switched, default_partitions(), "{}", second.log_text());
    let proj = read_all(&js, PROJ, "collab.proj.>").await;
    assert_eq!(proj.len(), 600);
    assert_sessions_count_every_projection(&js, &proj).await;
}

#[tokio::test]
async fn memory_consumers_are_recreated_after_a_server_restart_and_nothing_is_projected_twice() {
    across_a_server_restart("true").await;
}

#[tokio::test]
async fn file_consumers_outlive_a_server_restart_and_nothing_is_projected_twice() {
    across_a_server_restart("false").await;
}

// ---------------------------------------------------------------------------------------------
// 6. SIGTERM drains
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn sigterm_drains_and_everything_acknowledged_is_projected() {
    let nats = TestNats::start().await;
    let mut first = start_projector(&nats.url(), &MAIN_AGENTS, &[ACK_WAIT]).await;
    let js = nats.jetstream().await;
    let producer = spawn_producer(&js, load(2000));
    wait_proj_at_least(&js, 300).await;
    first.sigterm();
    let raw_at_term = count(&js, RAW).await;
    let status = first
        .wait_exit(GUARD)
        .await
        .expect("SIGTERM ends the process within the guard");
    assert!(
        status.success(),
        "a drain exits 0, got {status}: {}",
        first.log_text()
    );

    // What it acknowledged (every raw message of partition p up to p's ack floor) is stored.
    let outputs: BTreeSet<u64> = read_all(&js, PROJ, "collab.proj.>")
        .await
        .iter()
        .chain(read_all(&js, DLQ, "collab.dlq.>").await.iter())
        .map(Stored::source_seq)
        .collect();
    let raw = js.get_stream(RAW).await.expect("raw stream");
    let infos: Vec<consumer::Info> = raw
        .consumers()
        .try_collect::<Vec<consumer::Info>>()
        .await
        .expect("consumer list")
        .into_iter()
        .filter(|i| i.name.starts_with("collab-proj-"))
        .collect();
    // Draining means finishing what was in flight: nothing is left delivered but unacknowledged.
    let unacked: Vec<(&str, usize)> = infos
        .iter()
        .filter(|i| i.num_ack_pending > 0)
        .map(|i| (i.name.as_str(), i.num_ack_pending))
        .collect();
    assert!(
        unacked.is_empty(),
        "messages left unacknowledged after the drain: {unacked:?}"
    );
    // Partition of each consumer, by the filter the settings give it.
    let settings = collab_projector::config::Settings::default();
    let floors: BTreeMap<u16, u64> = infos
        .iter()
        .map(|i| {
            let p = (0..settings.nats.partitions)
                .find(|p| settings.partition_filter(*p) == i.config.filter_subject)
                .unwrap_or_else(|| panic!("unexpected filter {}", i.config.filter_subject));
            (p, i.ack_floor.stream_sequence)
        })
        .collect();
    assert_eq!(floors.len(), default_partitions());
    let names = settings.names();
    let mut acknowledged = 0;
    for m in read_all(&js, RAW, "collab.in.>").await {
        let published = collab_projector::pipeline::producer_subject(&names, &m.subject);
        let key = published.split('.').nth(2).unwrap_or_default();
        let partition = collab_projector::config::transform_partition(
            key.as_bytes(),
            u32::from(settings.nats.partitions),
        );
        let floor = u16::try_from(partition)
            .ok()
            .and_then(|p| floors.get(&p))
            .unwrap_or_else(|| panic!("no consumer for {}", m.subject));
        if m.seq <= *floor {
            acknowledged += 1;
            assert!(
                outputs.contains(&m.seq),
                "raw {} was acknowledged but has no projection or dead letter",
                m.seq
            );
        }
    }
    assert!(
        acknowledged > 0,
        "the drained process acknowledged something"
    );
    eprintln!(
        "drained after acknowledging {acknowledged}; {raw_at_term} raw messages stored at SIGTERM"
    );
    finish_and_check(&nats, &js, producer).await;
}

/// An output stored whose publish ack is lost is retried in place; once the duplicate window
/// (1 s here) has passed, the retry looks the output up rather than store it a second time.
/// (`COLLAB_TEST_LOSE_PUBLISH_ACK_EVERY` takes every 40th ack as lost after the window.)
#[tokio::test]
async fn publishes_retried_past_the_duplicate_window_are_not_stored_twice() {
    let nats = TestNats::start().await;
    // The pipelined path's retries in place (a fast batch's lost answers are the reconnect
    // tests' concern).
    let envs = [
        ("COLLAB_PROJECTION__DUPLICATE_WINDOW", "1s"),
        ("COLLAB_TEST_LOSE_PUBLISH_ACK_EVERY", "40"),
        PIPELINED,
    ];
    let worker = start_projector(&nats.url(), &MAIN_AGENTS, &envs).await;
    let js = nats.jetstream().await;
    let producer = spawn_producer(&js, load(200));
    wait_until(GUARD, "a retry found its output stored", || {
        let log = worker.log_text();
        async move { log.contains("found stored past the duplicate window") }
    })
    .await;
    finish_and_check_with(&nats, &js, producer, &envs).await;
    drop(worker);
}

#[tokio::test]
async fn a_drain_cut_short_by_its_timeout_exits_non_zero_and_loses_nothing() {
    let nats = TestNats::start().await;
    // The worker reaches the server through a proxy, so its drain can be kept from finishing.
    let proxy = crate::support::proxy::Proxy::start(nats.port()).await;
    // Turns left open, their records deferred to the drain, and no blocked response while the
    // test runs: the drain has records to write. A lease long enough that it stays valid through
    // the drain (the lease bucket's age is the TTL, so both workers use it).
    let both = [
        ("COLLAB_CONSUMER__ACK_WAIT", "30s"),
        ("COLLAB_TURNS__DEFAULT_TIMEOUT", "600s"),
        ("COLLAB_TURNS__OPEN_WRITE_DELAY", "10s"),
        ("COLLAB_WORKERS__LEASE_TTL", "30s"),
    ];
    let mut envs = both.to_vec();
    envs.push(("COLLAB_WORKERS__DRAIN_TIMEOUT", "1s"));
    let mut first = start_projector(&proxy.url(), &MAIN_AGENTS, &envs).await;
    let js = nats.jetstream().await;
    let mut messages: Vec<(String, Vec<u8>)> = (0..20)
        .map(|i| {
            let conv = format!("conv-drain-{i}");
            let body = json!({"type": "a2a.send", "agentId": "ruda",
                "data": {"fromAgent": "ruda", "toAgent": "eden", "conversationId": conv,
                         "message": "are you there?"}});
            (
                format!("collab.raw.{conv}.a2a.send"),
                serde_json::to_vec(&body).expect("serialises"),
            )
        })
        .collect();
    messages.extend(load(2000));
    let producer = spawn_producer(&js, messages);
    wait_proj_at_least(&js, 300).await;
    // Nothing the server says reaches the worker any more: the turn records its drain writes are
    // never acknowledged.
    proxy.hold_down(true);
    first.sigterm();
    let status = first
        .wait_exit(GUARD)
        .await
        .expect("a drain that cannot finish is cut short at workers.drain_timeout");
    let log = first.log_text();
    assert!(
        !status.success(),
        "a drain cut short exits non-zero, got {status}: {log}"
    );
    assert!(
        log.contains("partitions still draining at workers.drain_timeout")
            && log.contains("had drained (workers.drain_timeout)"),
        "the log names the cut-short drain: {log}"
    );
    proxy.hold_down(false);
    drop(proxy);
    // The next owner processes what was left unacknowledged: every input once, none lost.
    finish_and_check_with(&nats, &js, producer, &both).await;
}

/// The link between an idle worker and its server drops and comes back. Each partition had a
/// pull request waiting on the server; the request's expiry notice, sent while the link was
/// down, never arrives. The partitions notice the reconnect and ask again within a second or
/// two, rather than waiting out the silence that ends a batch whose notice was lost (11 s from
/// its request): inputs published once the worker is back are projected within 9 s of the cut,
/// each once.
#[tokio::test]
async fn partitions_ask_again_soon_after_a_reconnect_that_lost_their_pull_requests() {
    let nats = TestNats::start().await;
    let proxy = crate::support::proxy::Proxy::start(nats.port()).await;
    // The client library's connection events are logged at `info`.
    let envs = [ACK_WAIT, ("RUST_LOG", "info")];
    let worker = start_projector(&proxy.url(), &MAIN_AGENTS, &envs).await;
    let js = nats.jetstream().await;
    let first = publish_all(&js, &load(40)).await;
    wait_settled(&js, first.len() as u64, 0).await;
    let connected = |log: &str| log.matches("event: connected").count();
    let before = connected(&worker.log_text());
    // Down for three pull expiries (500 ms each): every request waiting when the link dropped
    // expires on the server meanwhile, and its notice is lost with the link.
    let cut_at = Instant::now();
    proxy.cut();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    proxy.heal();
    // The worker's three connections (partitions, leases, work sessions) are back.
    wait_until(GUARD, "the worker reconnects", || {
        let n = connected(&worker.log_text());
        async move { n >= before + 3 }
    })
    .await;
    let back = Instant::now();
    let more = publish_all(&js, &load(80)).await;
    let total = (first.len() + more.len()) as u64;
    // A request sent just before the cut would be waited on until about 11 s after it: require
    // the inputs projected within 9 s of the cut, however long the client took to reconnect.
    let bound = Duration::from_secs(9).saturating_sub(cut_at.elapsed());
    wait_until(
        bound,
        "the inputs published after the reconnect are projected",
        || {
            let js = js.clone();
            async move { count(&js, PROJ).await >= total }
        },
    )
    .await;
    let took = back.elapsed();
    wait_settled(&js, total, 0).await;
    let proj = read_all(&js, PROJ, "collab.proj.>").await;
    let mut seqs: Vec<u64> = proj.iter().map(Stored::source_seq).collect();
    seqs.sort_unstable();
    let mut published: Vec<u64> = first.iter().chain(&more).copied().collect();
    published.sort_unstable();
    assert_eq!(
        seqs,
        published,
        "every input projected once (the last {took:?} after the reconnect); the worker's log:\n{}",
        worker.log_text()
    );
}

/// A busy worker (a backlog of 6,000 task updates) cut from its server while the server's
/// answers to its publishes are on their way back: what the server sends is held for 200 ms and
/// then the link dropped, and healed 300 ms later. `batches`: `nats.publish_batches`. Returns
/// the projections once settled, the inputs' raw sequences, and the worker's log.
async fn cut_a_busy_worker(batches: &str) -> (Vec<Stored>, Vec<u64>, String) {
    cut_a_worker_busy_with(batches, &load(6000), 500, None, &[]).await
}

/// [`cut_a_busy_worker`] with `backlog` as the worker's backlog, cut once `cut_after`
/// projections are stored; with `cut_at`, once the worker has then sent those bytes (a request
/// of a chosen kind, caught on its way: see [`Proxy::hold_answers_once_sent`]); `settings`, more
/// of the worker's environment.
///
/// [`Proxy::hold_answers_once_sent`]: crate::support::proxy::Proxy::hold_answers_once_sent
async fn cut_a_worker_busy_with(
    batches: &str,
    backlog: &[(String, Vec<u8>)],
    cut_after: u64,
    cut_at: Option<&str>,
    settings: &[(&str, &str)],
) -> (Vec<Stored>, Vec<u64>, String) {
    let (_nats, proxy, js) = provisioned_behind_a_proxy().await;
    // A backlog, so the worker is busy when the link drops: its publishes are pipelined, and
    // at any moment many of their acks are on their way.
    let seqs = publish_all(&js, backlog).await;
    let mut envs = vec![
        ACK_WAIT,
        ("RUST_LOG", "info"),
        ("COLLAB_NATS__PUBLISH_BATCHES", batches),
    ];
    envs.extend_from_slice(settings);
    let worker = start_projector(&proxy.url(), &MAIN_AGENTS, &envs).await;
    wait_proj_at_least(&js, cut_after).await;
    // Nothing the server sends reaches the worker any more: the acks of what it published
    // last are held on the way, and the cut drops them.
    match cut_at {
        None => cut_with_answers_held(&proxy).await,
        Some(request) => {
            sent_within_30s(
                proxy.hold_answers_once_sent(request),
                &format!("{request:?}"),
            )
            .await;
            cut_held(&proxy).await;
        }
    }
    wait_settled(&js, seqs.len() as u64, 0).await;
    let proj = read_all(&js, PROJ, "collab.proj.>").await;
    (proj, seqs, worker.log_text())
}

/// A server with the deployment provisioned, a proxy in front of it for the worker, and a
/// JetStream context on the server itself.
async fn provisioned_behind_a_proxy() -> (TestNats, crate::support::proxy::Proxy, Context) {
    let nats = TestNats::start().await;
    let proxy = crate::support::proxy::Proxy::start(nats.port()).await;
    let url = nats.url();
    let (ok, _, err) = run_bin(&["provision", "--nats-url", &url], &[ACK_WAIT], b"").await;
    assert!(ok, "provision: {err}");
    let js = nats.jetstream().await;
    (nats, proxy, js)
}

/// Cut the worker's link with answers on their way: what the server sends is held for 200 ms,
/// then dropped with the connection; the link comes back 300 ms later.
async fn cut_with_answers_held(proxy: &crate::support::proxy::Proxy) {
    proxy.hold_down(true);
    cut_held(proxy).await;
}

/// Wait until the worker has sent `what`, the request `sent` was armed for
/// ([`Proxy::hold_answers_once_sent`]); the server's answers are held from then on.
///
/// [`Proxy::hold_answers_once_sent`]: crate::support::proxy::Proxy::hold_answers_once_sent
async fn sent_within_30s(sent: tokio::sync::oneshot::Receiver<()>, what: &str) {
    tokio::time::timeout(Duration::from_secs(30), sent)
        .await
        .unwrap_or_else(|_| panic!("the worker sent no {what} within 30 s"))
        .expect("the proxy");
}

/// With what the server sends held already: 200 ms on, drop the connections; heal 300 ms later.
async fn cut_held(proxy: &crate::support::proxy::Proxy) {
    tokio::time::sleep(Duration::from_millis(200)).await;
    proxy.cut();
    proxy.hold_down(false);
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.heal();
}

/// Wait for `producer`, add what it published to `published`, and wait until the worker has
/// settled it and the fold has read to the end.
async fn settled_and_folded(
    js: &Context,
    kv: &async_nats::jetstream::kv::Store,
    producer: tokio::task::JoinHandle<Vec<u64>>,
    published: &mut u64,
) {
    *published += producer.await.expect("the producer").len() as u64;
    wait_settled(js, *published, 0).await;
    wait_folded(js, kv).await;
}

/// Every input of `seqs` has exactly one projection among `proj` (`log`: the worker's, shown
/// when not).
fn assert_each_projected_once(proj: &[Stored], mut seqs: Vec<u64>, log: &str) {
    let mut got: Vec<u64> = proj.iter().map(Stored::source_seq).collect();
    got.sort_unstable();
    seqs.sort_unstable();
    assert_eq!(got, seqs, "every input projected once: {log}");
}

/// The acks lost with the cut (see [`cut_a_busy_worker`]) of pipelined publishes
/// (`publish_batches = "never"`) are given up together after one short grace for the whole
/// reconnect, and those outputs sent again (each collapses by its Msg-Id), instead of each ack's
/// 5 s timeout being waited out in turn: every input is projected once. (Before, while the lost
/// acks were waited out one after another, the server delivered the unacknowledged inputs again
/// and again: the backlog took over a minute to settle.)
#[tokio::test]
async fn outputs_whose_acks_went_with_a_reconnect_are_sent_again_without_waiting_out_the_timeout() {
    let (proj, seqs, log) = cut_a_busy_worker("never").await;
    assert!(
        log.contains("publish acks lost with a reconnect; their outputs are sent again"),
        "the lost acks were not noticed with the reconnect: {log}"
    );
    assert_each_projected_once(&proj, seqs, &log);
}

/// Turn-record writes whose answers went with the cut (see [`cut_a_busy_worker`], here with a
/// backlog of 3,000 answered main-main turns) are given up once the connection is back and its
/// grace has passed, as publish acks are, instead of each being waited for until the 5 s
/// timeout: the partition starts over at once, as after any write whose outcome is unknown.
/// Every input is projected once and every turn has exactly one response. The cut comes
/// while a record write (`$KV.collab_turns.p<N>.<turn>`, not a checkpoint) is on its way.
#[tokio::test]
async fn turn_writes_whose_answers_went_with_a_reconnect_are_given_up_without_waiting_out_the_timeout(
) {
    let turns = 3000;
    let backlog = answered_turns("cut", turns, false);
    let record_write = Some("PUB $KV.collab_turns.p");
    let (proj, seqs, log) = cut_a_worker_busy_with("auto", &backlog, 500, record_write, &[]).await;
    assert!(
        log.contains("(pipelined write): write not stored: its answer went with a reconnect"),
        "no turn-record write was given up with the reconnect: {log}"
    );
    assert_each_projected_once(&proj, seqs, &log);
    assert_one_response_per_turn(&proj, turns);
}

/// Turn-record reads whose answers went with the cut are asked again once the connection is
/// back and its grace has passed, instead of each being waited for until the request's timeout
/// stops its partition. The backlog holds 3,000 main-main sends and then their 3,000 responses,
/// and the cut comes while the responses are being read: with every open record written at once
/// (`turns.open_write_delay` 0), a partition keeping only the records of the 64 turns it opened
/// last in memory (`turns.kept_records`), most responses read their turn's record from the bucket, and the cut comes while
/// one of those reads is on its way. Every input is projected once
/// and every turn has exactly one response. (Here the writes lost with the same cut restart the
/// partitions too, so without the read's own check the run ends the same, only without the
/// log line: what the check saves is a partition whose only request in flight is a read, one
/// starting and reading its checkpoint, waiting out the request's timeout.)
#[tokio::test]
async fn turn_record_reads_whose_answers_went_with_a_reconnect_are_asked_again() {
    let turns = 3000;
    let backlog = answered_turns("read", turns, true);
    // Cut a few hundred responses in, with most of them still to read, while a record read
    // (from the bucket stream's leader, `$KV.collab_turns.p<N>.<turn>`) is on its way.
    let record_read = Some("\"last_by_subj\":\"$KV.collab_turns.p");
    // Every open record is written at once: a record still held back (`turns.open_write_delay`)
    // is decided from memory, and on a fast host a partition meets the responses of all its
    // turns within the default 500 ms. And each partition keeps the records of only its last 64
    // open turns (`turns.kept_records`; about 190 of its turns are open at once here), so most
    // responses read theirs.
    let write_at_once = [
        ("COLLAB_TURNS__OPEN_WRITE_DELAY", "0s"),
        ("COLLAB_TURNS__KEPT_RECORDS", "64"),
    ];
    let (proj, seqs, log) = cut_a_worker_busy_with(
        "auto",
        &backlog,
        turns as u64 + 400,
        record_read,
        &write_at_once,
    )
    .await;
    assert!(
        log.contains("a turn-record read's answer went with a reconnect; reading it again"),
        "no turn-record read was asked again after the reconnect: {log}"
    );
    assert!(
        !log.contains("reading the record: no answer"),
        "a turn-record read was waited out: {log}"
    );
    assert_each_projected_once(&proj, seqs, &log);
    assert_one_response_per_turn(&proj, turns);
}

/// The work-session fold waits out none of its requests whose answers went with a cut of the
/// link: a fetch of stored projections fails at once and the fold starts again from its
/// checkpoint; a read of a session, an alias or the checkpoint is asked again; a write is read
/// back. A steady producer keeps the fold busy; the link is cut (the server's answers held for
/// 200 ms, then dropped with the connection) up to six times, until the worker says a fold
/// request went with a reconnect. Then every projection is counted in its session once, no
/// fold request waited out its timeout, and the fold reported no projection gone: the
/// partitions, started over after each cut, claimed their fence subjects again, and no claim
/// was removed ahead of the fold (which would read, to it, as a projection gone unread).
#[tokio::test]
async fn the_work_session_fold_waits_out_no_request_whose_answer_went_with_a_reconnect() {
    let (_nats, proxy, js, kv, worker) = folding_behind_a_proxy().await;
    let fold_lines = [
        "a request for stored messages went with a reconnect",
        "a work-session read's answer went with a reconnect",
        "a work-session write's answer went with a reconnect",
        "a conversation-alias read's answer went with a reconnect",
        "a conversation-alias write's answer went with a reconnect",
        "a checkpoint read's answer went with a reconnect",
        "the fold's checkpoint write's answer went with a reconnect",
    ];
    let seen = |log: &str| fold_lines.iter().any(|l| log.contains(l));
    let mut published = 0u64;
    let mut cuts = 0;
    while cuts < 6 && !seen(&worker.log_text()) {
        cuts += 1;
        let producer = spawn_producer(&js, load(1200));
        tokio::time::sleep(Duration::from_millis(400)).await;
        cut_with_answers_held(&proxy).await;
        settled_and_folded(&js, &kv, producer, &mut published).await;
    }
    let log = worker.log_text();
    assert!(
        seen(&log),
        "no fold request went with any of {cuts} cuts: {log}"
    );
    assert_fold_waited_out_nothing(&log, &[]);
    let proj = read_all(&js, PROJ, "collab.proj.>").await;
    assert_eq!(proj.len() as u64, published, "every input projected once");
    assert_sessions_count_every_projection(&js, &proj).await;
}

/// A projection delivered to the work-session fold's wait for its next round, and lost with a
/// drop of the fold's own connection, is still folded though nothing is stored after it: the
/// fold sees that its consumer delivered more than it took, and starts again from its
/// checkpoint. (A lost delivery used to show only as a gap once the next one arrived; on a
/// quiet stream that could be never, and the projection stayed out of its session.) What the
/// server sends on the fold's connection alone is held while one more event is projected (the
/// partitions' connection is not held), until the server has delivered its projection to the
/// fold; then that connection alone is dropped and nothing more is published.
#[tokio::test]
async fn a_delivery_to_the_fold_lost_with_its_connection_is_read_again_on_a_quiet_stream() {
    let (_nats, proxy, js, kv, worker) = folding_behind_a_proxy().await;
    let fold_connection = "collab-projector-sessions";
    let mut published = 0u64;
    // Something folded first, so the fold sits waiting for its next round's first message.
    let producer = spawn_producer(&js, fresh_sessions_load(0, 300));
    settled_and_folded(&js, &kv, producer, &mut published).await;
    proxy.hold_down_on(Some(fold_connection));
    let seqs = publish_all(&js, &fresh_sessions_load(1, 1)).await;
    published += seqs.len() as u64;
    wait_settled(&js, published, 0).await;
    let last = proj_last_sequence(&js).await;
    wait_until(
        GUARD,
        "the server has delivered the last projection to the fold (held on its way)",
        || {
            let js = js.clone();
            async move { fold_delivered_through(&js).await >= last }
        },
    )
    .await;
    proxy.cut_on(fold_connection);
    proxy.hold_down_on(None);
    wait_folded(&js, &kv).await;
    let log = worker.log_text();
    assert!(
        log.contains("a delivery went astray"),
        "the fold did not notice the delivery lost with its connection: {log}"
    );
    let proj = read_all(&js, PROJ, "collab.proj.>").await;
    assert_sessions_count_every_projection(&js, &proj).await;
}

/// The highest projection-stream sequence any unacknowledged reader of it (the work-session
/// fold's consumer) has been sent.
async fn fold_delivered_through(js: &Context) -> u64 {
    let Ok(proj) = js.get_stream(PROJ).await else {
        return 0;
    };
    let Ok(consumers) = proj.consumers().try_collect::<Vec<consumer::Info>>().await else {
        return 0;
    };
    consumers
        .iter()
        .filter(|i| i.config.ack_policy == consumer::AckPolicy::None)
        .map(|i| i.delivered.stream_sequence)
        .max()
        .unwrap_or(0)
}

/// A message in the projection stream that is no envelope this version reads (here one with
/// a role it does not know, as a newer version's might be) is passed over by the work-session
/// fold, which goes on past it, and counted and logged rather than dropped silently.
#[tokio::test]
async fn a_projection_the_fold_cannot_read_is_counted_and_logged() {
    let (_nats, _proxy, js, kv, worker) = folding_behind_a_proxy().await;
    let mut published = 0u64;
    let producer = spawn_producer(&js, fresh_sessions_load(0, 20));
    settled_and_folded(&js, &kv, producer, &mut published).await;
    let foreign =
        json!({"type": "a2a.send", "eventRole": "conversation.future", "conversationId": "cut0-1"});
    js.publish(
        "collab.proj.conversation.future.cut0-1.a2a.send",
        serde_json::to_vec(&foreign).expect("serialises").into(),
    )
    .await
    .expect("publish")
    .await
    .expect("stored");
    let producer = spawn_producer(&js, fresh_sessions_load(1, 20));
    published += producer.await.expect("the producer").len() as u64;
    wait_settled(&js, published + 1, 0).await;
    wait_folded(&js, &kv).await;
    let unreadable = metric(
        &worker,
        collab_projector::telemetry::SESSION_FOLD_UNREADABLE,
        &[],
    )
    .await;
    assert_eq!(unreadable, 1.0, "the foreign message counted once");
    let log = worker.log_text();
    assert!(
        log.contains("projections the work-session fold cannot read") && log.contains("count=1"),
        "the foreign message logged: {log}"
    );
}

/// `worker` says within 10 s (`said`, on its log) that `what`, caught at a cut, was given up.
async fn assert_given_up_soon(worker: &Projector, what: &str, said: impl Fn(&str) -> bool) {
    let within = tokio::time::timeout(Duration::from_secs(10), async {
        while !said(&worker.log_text()) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(
        within.is_ok(),
        "{what} caught at the cut was not given up with the reconnect: {}",
        worker.log_text()
    );
}

/// A provisioned server, a proxy in front of it, and a worker connected through the proxy
/// (logging at info) that folds work sessions; with the sessions bucket.
async fn folding_behind_a_proxy() -> (
    TestNats,
    crate::support::proxy::Proxy,
    Context,
    async_nats::jetstream::kv::Store,
    Projector,
) {
    let (nats, proxy, js) = provisioned_behind_a_proxy().await;
    let kv = js
        .get_key_value("collab_work_sessions")
        .await
        .expect("the sessions bucket");
    let envs = [ACK_WAIT, ("RUST_LOG", "info")];
    let worker = start_projector(&proxy.url(), &MAIN_AGENTS, &envs).await;
    (nats, proxy, js, kv, worker)
}

/// No request of the fold was waited out (`log`, the worker's), no projection was reported
/// gone, and none of `also` was said.
fn assert_fold_waited_out_nothing(log: &str, also: &[&str]) {
    let waited_out = [
        "the server sent nothing for",
        "no answer within",
        "work session write took too long",
        "work session write failed",
        "work session read failed",
        "conversation alias write failed",
        "conversation alias read failed",
        "projections were gone from the stream",
    ];
    for line in waited_out.iter().chain(also) {
        assert!(
            !log.contains(line),
            "a fold request was waited out, or a projection reported gone ({line}): {log}"
        );
    }
}

/// Each kind of request the work-session fold makes per round, caught in flight at a cut: a
/// conversation-alias read and write, a work-session read and write, and the fold's checkpoint
/// write; then its checkpoint read, made as it starts over (after a cut that catches it in a
/// fetch, up to six cuts). For each, a producer sends events of conversations and
/// sessions never seen before (so their aliases and sessions are read and written; for the
/// session read, the sessions are stored empty beforehand, since the fold writes a session it
/// has never met as new without reading it, and reads it when that write is refused), and the
/// proxy holds what the server sends from the moment the worker sends that request: the request
/// reaches the server, its answer is held for 200 ms and then dropped with the connection. Each
/// such request is then given up after the reconnect's grace (asked again, or read back) rather
/// than waited out, and in the end every projection is counted in its session once.
#[tokio::test]
async fn each_kind_of_fold_request_caught_at_a_cut_is_given_up_without_waiting_out_its_timeout() {
    let (_nats, proxy, js, kv, worker) = folding_behind_a_proxy().await;
    let bucket = "$KV.collab_work_sessions.";
    // What the worker sends for each request (async-nats 0.51): a read of an alias from the
    // stream's leader names its subject in the payload; a session read is a direct get with
    // the subject in its own; a write is a publish to the key's subject.
    let steps = [
        (
            "a conversation-alias read",
            format!("\"last_by_subj\":\"{bucket}alias.cut0-"),
        ),
        (
            "a conversation-alias write",
            format!("PUB {bucket}alias.cut1-"),
        ),
        (
            "a work-session read",
            format!("DIRECT.GET.KV_collab_work_sessions.{bucket}ws-cut2-"),
        ),
        ("a work-session write", format!("PUB {bucket}ws-cut3-")),
        (
            "the fold's checkpoint write",
            format!("PUB {bucket}fold.position"),
        ),
    ];
    let mut published = 0u64;
    // Step `k` sends conversations `cut<k>-*` and sessions `ws-cut<k>-*`, never seen before.
    for (k, (what, pattern)) in steps.iter().enumerate() {
        if *what == "a work-session read" {
            for n in 0..5 {
                let id = format!("ws-cut{k}-{n}");
                let empty = serde_json::to_vec(&json!({ "id": id })).expect("serialises");
                kv.put(
                    collab_projector::bus::sessions::session_key(&id),
                    empty.into(),
                )
                .await
                .expect("an empty session stored");
            }
        }
        let sent = proxy.hold_answers_once_sent(pattern);
        let producer = spawn_producer(&js, fresh_sessions_load(k, 600));
        sent_within_30s(sent, what).await;
        // Held since the request went out; cut with its answer held.
        cut_held(&proxy).await;
        settled_and_folded(&js, &kv, producer, &mut published).await;
        // Given up once the link is back and the grace has passed: within seconds, where a
        // request waited out would take its whole timeout and say so (checked below).
        let given_up = format!("{what}'s answer went with a reconnect");
        assert_given_up_soon(&worker, what, |log| log.contains(&given_up)).await;
    }
    // The fold's checkpoint read, made as it starts over (a partition's claim reads the same
    // key on another connection): cut until a cut makes the fold start over, six at most.
    let mut sent = proxy.hold_answers_once_sent_on(
        Some("collab-projector-sessions"),
        &format!("DIRECT.GET.KV_collab_work_sessions.{bucket}fold.position"),
    );
    let mut caught = false;
    for k in 5..11 {
        let producer = spawn_producer(&js, fresh_sessions_load(k, 600));
        tokio::time::sleep(Duration::from_millis(400)).await;
        cut_with_answers_held(&proxy).await;
        if tokio::time::timeout(Duration::from_secs(5), &mut sent)
            .await
            .is_ok()
        {
            caught = true;
            cut_held(&proxy).await;
        }
        settled_and_folded(&js, &kv, producer, &mut published).await;
        if caught {
            break;
        }
    }
    assert!(
        caught,
        "no cut of six made the fold start over and read its checkpoint: {}",
        worker.log_text()
    );
    let fold_read_given_up = |log: &str| {
        log.lines().any(|l| {
            l.contains("a checkpoint read's answer went with a reconnect")
                && !l.contains("partition{")
        })
    };
    assert_given_up_soon(&worker, "the fold's checkpoint read", fold_read_given_up).await;
    // The checkpoint write caught reached the server: read back, it is found stored.
    assert_fold_waited_out_nothing(&worker.log_text(), &["error=checkpoint fold.position"]);
    let proj = read_all(&js, PROJ, "collab.proj.>").await;
    assert_eq!(proj.len() as u64, published, "every input projected once");
    assert_sessions_count_every_projection(&js, &proj).await;
}

/// `count` task events over 20 conversations and 5 work sessions of step `step`'s own
/// (`cut<step>-<n>`, `ws-cut<step>-<n>`): every third event names its conversation's session
/// (each conversation moves to another session every 150 events), the others only the
/// conversation.
fn fresh_sessions_load(step: usize, count: usize) -> Vec<(String, Vec<u8>)> {
    (0..count)
        .map(|i| {
            let conv = format!("cut{step}-{}", i % 20);
            let mut body = json!({"type": "task.updated", "taskId": conv, "conversationId": conv, "payload": {"n": i}});
            if i % 3 == 0 {
                body["workSessionId"] = json!(format!("ws-cut{step}-{}", (i / 150 + i) % 5));
            }
            (
                format!("collab.raw.{conv}.task.updated"),
                serde_json::to_vec(&body).expect("serialises"),
            )
        })
        .collect()
}

/// `turns` answered main-main turns as raw messages, conversation `<prefix>-<i>`, ruda asking
/// eden: each send followed by its response, or (`sends_first`) every send, then every response.
fn answered_turns(prefix: &str, turns: usize, sends_first: bool) -> Vec<(String, Vec<u8>)> {
    let event = |i: usize, response: bool| {
        let conv = format!("{prefix}-{i}");
        let (kind, from, to) = if response {
            ("a2a.response", "eden", "ruda")
        } else {
            ("a2a.send", "ruda", "eden")
        };
        let body = crate::support::collab_event(kind, from, to, &conv, json!({"turnId": "t1"}));
        (
            format!("collab.raw.{conv}.{kind}"),
            serde_json::to_vec(&body).expect("serialises"),
        )
    };
    if sends_first {
        (0..turns)
            .map(|i| event(i, false))
            .chain((0..turns).map(|i| event(i, true)))
            .collect()
    } else {
        (0..turns)
            .flat_map(|i| [event(i, false), event(i, true)])
            .collect()
    }
}

/// Every one of `turns` turns has exactly one `a2a.response` among `proj`.
fn assert_one_response_per_turn(proj: &[Stored], turns: usize) {
    let mut per_turn: BTreeMap<&str, usize> = BTreeMap::new();
    for m in proj.iter().filter(|m| m.subject.ends_with(".a2a.response")) {
        *per_turn
            .entry(m.subject.split('.').nth(4).unwrap_or_default())
            .or_default() += 1;
    }
    assert_eq!(per_turn.len(), turns, "every turn has a response");
    assert!(
        per_turn.values().all(|n| *n == 1),
        "exactly one response per turn: {:?}",
        per_turn
            .iter()
            .filter(|(_, n)| **n != 1)
            .collect::<Vec<_>>()
    );
}

/// A publish written to the connection that drops is lost, while the client sends the ones
/// still queued behind it on the new connection. Pipelined, the lost one, sent again, would be
/// stored behind later inputs' outputs of its key (with `publish_batches = "never"` this failed
/// 4 runs of 5). Stored as fast-ingest batches (`publish_batches = "fast"`), the server stores
/// nothing of a batch past a message it did not receive, and the partition sends the rest
/// again in order: every key keeps raw order, and every input is projected once.
#[tokio::test]
async fn outputs_keep_their_key_order_across_a_reconnect_of_a_busy_worker() {
    let (proj, seqs, log) = cut_a_busy_worker("fast").await;
    assert!(
        log.contains("outputs are stored as fast-ingest batches"),
        "batching as asked: {log}"
    );
    assert_each_projected_once(&proj, seqs, &log);
    eprintln!(
        "fast-ingest batches stopped by the cut: {}",
        log.matches("a fast-ingest batch stopped").count()
    );
    let mut last: std::collections::HashMap<&str, u64> = std::collections::HashMap::new();
    for m in &proj {
        let seq = m.source_seq();
        if let Some(before) = last.insert(m.subject.as_str(), seq) {
            assert!(
                before < seq,
                "{} holds input {seq} after input {before}",
                m.subject
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 7. provision
// ---------------------------------------------------------------------------------------------

fn created_count(stdout: &str) -> usize {
    let line = stdout
        .lines()
        .find(|l| l.contains(" created,"))
        .unwrap_or_else(|| panic!("no summary line in {stdout:?}"));
    line.split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count in {line:?}"))
}

#[tokio::test]
async fn provision_is_idempotent() {
    let nats = TestNats::start().await;
    let url = nats.url();
    let (ok, out, err) = run_bin(&["provision", "--nats-url", &url], &[], b"").await;
    assert!(ok, "first provision failed: {out}{err}");
    assert!(created_count(&out) > 0, "{out}");
    let js = nats.jetstream().await;
    for stream in [
        RAW,
        PROJ,
        DLQ,
        "KV_collab_turns",
        "KV_collab_work_sessions",
        "KV_collab_leases",
    ] {
        js.get_stream(stream)
            .await
            .unwrap_or_else(|e| panic!("provision should have created {stream}: {e}"));
    }
    let (ok, out, err) = run_bin(&["provision", "--nats-url", &url], &[], b"").await;
    assert!(ok, "second provision failed: {out}{err}");
    assert_eq!(created_count(&out), 0, "{out}");
}

#[tokio::test]
async fn a_differing_existing_stream_is_reported_and_left_alone() {
    let nats = TestNats::start().await;
    let url = nats.url();
    let js = nats.jetstream().await;
    js.create_stream(stream::Config {
        name: PROJ.to_string(),
        subjects: vec!["collab.proj.>".to_string()],
        max_age: Duration::from_secs(7 * 24 * 3600),
        duplicate_window: Duration::from_secs(30),
        ..Default::default()
    })
    .await
    .expect("create COLLAB_PROJ");

    let (ok, out, err) = run_bin(&["provision", "--nats-url", &url], &[], b"").await;
    assert!(!ok, "provision must fail on a differing stream: {out}");
    assert!(
        err.contains(PROJ) && err.contains("duplicate_window"),
        "stderr: {err}"
    );

    let mut run = Projector::spawn(&url, &MAIN_AGENTS, &[]);
    let status = run
        .wait_exit(GUARD)
        .await
        .expect("run stops on a differing stream");
    assert!(!status.success());
    let log = run.log_text();
    assert!(
        log.contains(PROJ) && log.contains("duplicate_window"),
        "log: {log}"
    );

    let mut s = js.get_stream(PROJ).await.expect("COLLAB_PROJ still exists");
    let info = s.info().await.expect("info");
    assert_eq!(
        info.config.duplicate_window,
        Duration::from_secs(30),
        "unchanged"
    );
    assert_eq!(info.config.subjects, vec!["collab.proj.>".to_string()]);
}

// ---------------------------------------------------------------------------------------------
// 8. A server without JetStream is refused
// ---------------------------------------------------------------------------------------------

struct PlainServer(std::process::Child);

impl Drop for PlainServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn a_server_without_jetstream_is_refused() {
    let binary = collab_projector::localnats::LocalNats::find_binary()
        .expect("this test needs the nats-server binary");
    // Held while the server runs on it (it binds with SO_REUSEADDR), so no other test's server is
    // given the port.
    let held = crate::support::ReservedPort::for_server();
    let port = held.port();
    let _server = PlainServer(
        std::process::Command::new(binary)
            .args(["-a", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start nats-server without JetStream"),
    );
    let url = format!("nats://127.0.0.1:{port}");
    wait_until(GUARD, "the plain server answers", || {
        let url = url.clone();
        async move { async_nats::connect(url).await.is_ok() }
    })
    .await;

    let mut run = Projector::spawn(&url, &MAIN_AGENTS, &[]);
    let status = run
        .wait_exit(GUARD)
        .await
        .expect("run refuses the server and exits");
    assert!(!status.success());
    let log = run.log_text();
    assert!(
        log.contains("JetStream"),
        "the refusal should mention JetStream: {log}"
    );
}

// ---------------------------------------------------------------------------------------------
// 9. normalize (offline)
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn normalize_answers_one_line_per_line_in_order() {
    let send = r#"{"type":"a2a.send","agentId":"ruda","ts":1771329600000,"data":{"fromAgent":"ruda","toAgent":"eden","conversationId":"c-1","message":"hi"}}"#;
    let run = r#"{"type":"run.started","sequence":3,"timestamp":"2026-02-17T12:00:00Z","sessionId":"s-1","runId":"r-1","payload":{"x":1}}"#;
    let input = format!("{send}\n\n{{not json\n{run}\n{{\"hello\":1}}\n");

    let (ok, out, err) = run_bin(
        &["normalize", "--main-agents", "ruda,eden"],
        &[],
        input.as_bytes(),
    )
    .await;
    assert!(ok, "normalize failed: {err}");
    let lines: Vec<Value> = out
        .lines()
        .map(|l| {
            serde_json::from_str(l).unwrap_or_else(|e| panic!("output line {l:?} is not JSON: {e}"))
        })
        .collect();
    assert_eq!(lines.len(), 5, "one line out per line in: {out}");
    assert_eq!(lines[0]["type"], "a2a.send");
    assert_eq!(lines[0]["eventRole"], "conversation.main");
    assert_eq!(lines[0]["conversationId"], "c-1");
    assert_eq!(lines[0]["payload"]["message"], "hi");
    for (i, reason) in [(1, "bad_json"), (2, "bad_json"), (4, "unrecognized")] {
        assert_eq!(
            lines[i]["error"]["reason"], reason,
            "line {i}: {}",
            lines[i]
        );
        assert!(
            lines[i]["error"]["detail"]
                .as_str()
                .is_some_and(|d| !d.is_empty()),
            "line {i} needs a detail: {}",
            lines[i]
        );
    }
    assert_eq!(lines[3]["type"], "run.started");
    assert_eq!(lines[3]["sessionId"], "s-1");
    assert_eq!(lines[3]["sequence"], 3);
    assert_eq!(lines[3]["payload"], json!({"x": 1}));

    // With eden no longer a main agent, the same send is a delegation.
    let (ok, out, err) = run_bin(
        &["normalize", "--main-agents", "ruda"],
        &[],
        format!("{send}\n").as_bytes(),
    )
    .await;
    assert!(ok, "normalize failed: {err}");
    let line: Value = serde_json::from_str(out.trim_end()).expect("one JSON line");
    assert_eq!(out.lines().count(), 1);
    assert_eq!(line["eventRole"], "delegation.subagent");
}

/// Each start of a partition claims its fence in the projection and dead-letter streams; only
/// the newest claim counts, so the earlier ones are removed (in the projection stream only once
/// the work-session fold has read them, see
/// `the_work_session_fold_waits_out_no_request_whose_answer_went_with_a_reconnect`: by the
/// next start when the fold had read them by then, by the fold when it reads them later). A
/// deployment restarted again and again (or a partition that keeps failing and starting over)
/// must not fill its output streams with claims: after three workers in turn, started one
/// after the other without waiting for the fold, each fence subject holds one message, the
/// last worker's, once the fold has read to the end.
#[tokio::test]
async fn restarts_leave_one_fence_claim_per_partition_not_one_per_start() {
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let fences = |stream: &'static str| {
        let js = js.clone();
        async move {
            let s = js.get_stream(stream).await.expect("output stream");
            let mut per_subject = BTreeMap::new();
            let mut subjects = s
                .info_with_subjects("*.*._fence.*")
                .await
                .expect("subjects");
            while let Some((subject, n)) = subjects.try_next().await.expect("subject counts") {
                per_subject.insert(subject, n);
            }
            per_subject
        }
    };
    let partitions = default_partitions();
    for run in ["first", "second", "third"] {
        let mut worker =
            start_projector(&nats.url(), &MAIN_AGENTS, &[("COLLAB_WORKERS__ID", run)]).await;
        wait_until(GUARD, "every fence claimed by this worker", || {
            let js = js.clone();
            async move {
                let mut claimed = 0;
                for stream in [PROJ, DLQ] {
                    let s = js.get_stream(stream).await.expect("output stream");
                    for p in 0..partitions {
                        let subject = format!(
                            "collab.{}._fence.{p}",
                            if stream == PROJ { "proj" } else { "dlq" }
                        );
                        if let Ok(m) = s.get_last_raw_message_by_subject(&subject).await {
                            let owner = m
                                .headers
                                .get(collab_projector::bus::publish::H_FENCE)
                                .map(|v| v.as_str().to_string());
                            claimed += usize::from(owner.as_deref() == Some(run));
                        }
                    }
                }
                claimed == 2 * partitions
            }
        })
        .await;
        if run != "third" {
            worker.stop_cleanly(GUARD).await;
            continue;
        }
        let kv = js
            .get_key_value("collab_work_sessions")
            .await
            .expect("the sessions bucket");
        wait_folded(&js, &kv).await;
        // The fold removes what it read after moving its checkpoint, off its path.
        let one_each = || async {
            let mut all = Vec::new();
            for stream in [PROJ, DLQ] {
                all.push((stream, fences(stream).await));
            }
            all
        };
        let settled = tokio::time::timeout(GUARD, async {
            loop {
                let all = one_each().await;
                if all.iter().all(|(_, per_subject)| {
                    per_subject.len() == partitions && per_subject.values().all(|n| *n == 1)
                }) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .await;
        let all = one_each().await;
        assert!(
            settled.is_ok(),
            "earlier claims kept after the fold read them: {all:?}"
        );
        worker.stop_cleanly(GUARD).await;
    }
}
