//! The turn contract (docs/contract.md section 4) end to end: collab events published on `collab.raw.*`,
//! the real `collab-projector` binary, and every turn's one `a2a.response` read back from
//! `COLLAB_PROJ`.
//!
//! Counting is done only after the system has settled: a barrier send on every conversation of
//! the test is projected (so the partition's watermark has passed every earlier deadline) and
//! every partition consumer has nothing pending or unacknowledged (so redeliveries after a crash
//! are done). Timeouts only guard against hangs; the assertions are about what was published.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use futures::StreamExt;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use crate::support::{collab_event, wait_until, Projector, TestNats};

const RUN_ARGS: [&str; 4] = ["--main-agents", "ruda,eden", "--turn-timeout", "2s"];
/// Shared by every process of a test (provision and run must agree on the consumers). A short
/// ack wait makes the redelivery of a killed worker's in-flight messages quick.
const ENV: [(&str, &str); 2] = [
    ("COLLAB_CONSUMER__ACK_WAIT", "5s"),
    ("RUST_LOG", "info,collab_projector=debug"),
];
/// Guards against hangs only.
const WAIT: Duration = Duration::from_secs(120);

const RESPONSES: &str = "collab.proj.conversation.main.*.a2a.response";
const SENDS: &str = "collab.proj.conversation.main.*.a2a.send";
const SUPPRESSED: &str = "collab.proj.system.observability.*.a2a.response.suppressed";

type TurnKey = (String, String);

fn key(conv: &str, turn: &str) -> TurnKey {
    (conv.to_string(), turn.to_string())
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// A projected message as a subscriber sees it.
#[derive(Debug, Clone)]
struct Proj {
    subject: String,
    seq: u64,
    msg_id: Option<String>,
    body: Value,
}

impl Proj {
    fn payload(&self) -> &Value {
        &self.body["payload"]
    }

    fn str(&self, field: &str) -> Option<&str> {
        self.payload()[field].as_str()
    }

    /// (conversation, turn) of a response: `conversationId` and `turnId`, else `turn`, else 0,
    /// from the payload or the envelope.
    fn turn_key(&self) -> TurnKey {
        let p = self.payload();
        let b = &self.body;
        let conv = text(&p["conversationId"])
            .or_else(|| text(&b["conversationId"]))
            .unwrap_or_default();
        let turn = [&p["turnId"], &b["turnId"], &p["turn"], &b["turn"]]
            .into_iter()
            .find_map(text)
            .unwrap_or_else(|| "0".to_string());
        (conv, turn)
    }

    /// (conversation, turn) of a suppressed response: the turn of the response that won.
    fn winner_key(&self) -> TurnKey {
        let w = &self.payload()["winner"];
        (
            text(&w["conversationId"]).unwrap_or_default(),
            text(&w["turn"]).unwrap_or_default(),
        )
    }

    fn is_blocked(&self) -> bool {
        self.str("outcome") == Some("blocked")
    }
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

fn send(conv: &str, extra: Value) -> Value {
    collab_event("a2a.send", "ruda", "eden", conv, extra)
}

fn reply(conv: &str, extra: Value) -> Value {
    collab_event("a2a.response", "eden", "ruda", conv, extra)
}

/// One nats-server with the projector's resources provisioned, and a client on it.
struct Bed {
    nats: TestNats,
    js: jetstream::Context,
    barriers: AtomicU32,
    /// Settings of this bed beyond `ENV`, for provisioning and every projector.
    env: Vec<(&'static str, &'static str)>,
}

impl Bed {
    async fn start() -> Bed {
        Bed::start_with(&[]).await
    }

    async fn start_with(env: &[(&'static str, &'static str)]) -> Bed {
        let nats = TestNats::start().await;
        crate::support::provision_with_binary(
            &nats.url(),
            ENV.iter().copied().chain(env.iter().copied()),
        );
        let js = nats.jetstream().await;
        Bed {
            nats,
            js,
            barriers: AtomicU32::new(0),
            env: env.to_vec(),
        }
    }

    fn projector(&self, extra_env: &[(&str, &str)]) -> Projector {
        let mut envs = ENV.to_vec();
        envs.extend_from_slice(&self.env);
        envs.extend_from_slice(extra_env);
        Projector::spawn(&self.nats.url(), &RUN_ARGS, &envs)
    }

    /// Publish a collab event on `collab.raw.<conversationId>.<type>`; its raw sequence.
    async fn publish(&self, ev: &Value) -> u64 {
        self.send_raw(ev)
            .await
            .await
            .expect("raw publish was not acknowledged")
            .sequence
    }

    /// Send a collab event as [`Bed::publish`] does, without waiting for its acknowledgement.
    async fn send_raw(&self, ev: &Value) -> jetstream::context::PublishAckFuture {
        let conv = ev["data"]["conversationId"]
            .as_str()
            .expect("test events carry data.conversationId");
        let kind = ev["type"].as_str().expect("test events carry a type");
        let subject = format!("collab.raw.{conv}.{kind}");
        let bytes = serde_json::to_vec(ev).expect("an event serialises");
        self.js
            .publish(subject, bytes.into())
            .await
            .expect("raw publish was not sent")
    }

    /// Publish a send on `conv` and wait until it is projected (its turn is open); its raw
    /// sequence.
    async fn publish_projected_send(&self, conv: &str, extra: Value) -> u64 {
        let seq = self.publish(&send(conv, extra)).await;
        self.wait_read(SENDS, "the send is projected (its turn is open)", |m| {
            m.iter().any(|s| s.body["rawEventRef"]["seq"] == seq)
        })
        .await;
        seq
    }

    /// The raw stream's store time of a message (the turn contract's event time), in ms.
    async fn stored_ms(&self, seq: u64) -> i64 {
        let stream = self
            .js
            .get_stream("COLLAB_RAW")
            .await
            .expect("the raw stream exists");
        stream
            .get_raw_message(seq)
            .await
            .unwrap_or_else(|e| panic!("raw message {seq}: {e}"))
            .time
            .timestamp_millis()
    }

    /// Every message of COLLAB_PROJ matching `filter`, in stream order.
    async fn read(&self, filter: &str) -> Vec<Proj> {
        crate::pipeline::read_all(&self.js, "COLLAB_PROJ", filter)
            .await
            .into_iter()
            .map(|m| Proj {
                msg_id: m.header("Nats-Msg-Id"),
                body: serde_json::from_slice(&m.payload)
                    .unwrap_or_else(|e| panic!("projection on {} is not JSON: {e}", m.subject)),
                subject: m.subject,
                seq: m.seq,
            })
            .collect()
    }

    /// Read `filter` until `done` holds.
    async fn wait_read(
        &self,
        filter: &str,
        what: &str,
        done: impl Fn(&[Proj]) -> bool,
    ) -> Vec<Proj> {
        let deadline = Instant::now() + WAIT;
        loop {
            let msgs = self.read(filter).await;
            if done(&msgs) {
                return msgs;
            }
            assert!(
                Instant::now() < deadline,
                "timed out after {WAIT:?} waiting until {what}; {filter} holds {msgs:#?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Wait until at least one response exists for each of `turns`.
    async fn wait_responses(&self, turns: &[TurnKey]) -> Vec<Proj> {
        let want: BTreeSet<TurnKey> = turns.iter().cloned().collect();
        self.wait_read(RESPONSES, &format!("responses exist for {want:?}"), |m| {
            let have: BTreeSet<TurnKey> = m.iter().map(Proj::turn_key).collect();
            want.is_subset(&have)
        })
        .await
    }

    /// True when every partition consumer has delivered and had acknowledged everything.
    async fn drained(&self) -> bool {
        let Ok(stream) = self.js.get_stream("COLLAB_RAW").await else {
            return false;
        };
        let mut consumers = stream.consumers();
        let mut seen = 0;
        while let Some(info) = consumers.next().await {
            let Ok(info) = info else { return false };
            if !info.name.starts_with("collab-proj-") {
                continue;
            }
            seen += 1;
            if info.num_pending > 0 || info.num_ack_pending > 0 {
                return false;
            }
        }
        seen > 0
    }

    /// Publish a barrier send on each conversation and wait until every barrier is projected and
    /// every raw message is acknowledged: each deadline before the barriers has been decided and
    /// published, and every redelivery is done. Barrier turns (`barrier-<n>`, 1 h timeout) never
    /// get a response within a test.
    async fn settle(&self, convs: &[&str]) {
        let n = self.barriers.fetch_add(1, Ordering::Relaxed);
        let turn = format!("barrier-{n}");
        for conv in convs {
            self.publish(&send(
                conv,
                json!({"turn": turn, "message": "barrier", "timeoutMs": 3_600_000}),
            ))
            .await;
        }
        let deadline = Instant::now() + WAIT;
        loop {
            let sends = self.read(SENDS).await;
            let projected: BTreeSet<TurnKey> = sends.iter().map(Proj::turn_key).collect();
            let all_barriers = convs.iter().all(|c| projected.contains(&key(c, &turn)));
            if all_barriers && self.drained().await {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "timed out after {WAIT:?} settling {convs:?} (barriers projected: {all_barriers})"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn responses(&self) -> Vec<Proj> {
        self.read(RESPONSES).await
    }

    async fn suppressed_of(&self, conv: &str) -> Vec<Proj> {
        self.read(&format!(
            "collab.proj.system.observability.{conv}.a2a.response.suppressed"
        ))
        .await
    }
}

fn group(msgs: &[Proj], key_of: fn(&Proj) -> TurnKey) -> BTreeMap<TurnKey, Vec<Proj>> {
    let mut map: BTreeMap<TurnKey, Vec<Proj>> = BTreeMap::new();
    for m in msgs {
        map.entry(key_of(m)).or_default().push(m.clone());
    }
    map
}

/// Exactly one response for each expected turn and none for any other; each published on its
/// conversation's subject with the turn's Msg-Id. Returns the response of each turn.
fn one_per_turn(responses: &[Proj], expected: &[TurnKey]) -> BTreeMap<TurnKey, Proj> {
    let grouped = group(responses, Proj::turn_key);
    let want: BTreeSet<&TurnKey> = expected.iter().collect();
    let have: BTreeSet<&TurnKey> = grouped.keys().collect();
    assert_eq!(
        have, want,
        "turns with a response differ from the turns opened"
    );
    let mut out = BTreeMap::new();
    for (k, list) in grouped {
        assert_eq!(
            list.len(),
            1,
            "turn {k:?} has {} responses, not exactly one: {list:#?}",
            list.len()
        );
        let r = list.into_iter().next().expect("one response");
        let (conv, turn) = &k;
        assert_eq!(
            r.subject,
            format!("collab.proj.conversation.main.{conv}.a2a.response")
        );
        assert_eq!(
            r.msg_id.as_deref(),
            Some(format!("turn:{conv}:{turn}").as_str())
        );
        assert_eq!(r.body["type"], "a2a.response");
        assert_eq!(r.body["eventRole"], "conversation.main");
        out.insert(k, r);
    }
    out
}

/// A blocked message renders the four handoff sections, in order, each on its own line.
fn assert_four_sections(message: &str) {
    let starts: Vec<&str> = message
        .lines()
        .filter_map(|l| {
            ["goal:", "outcome:", "evidence:", "next_action:"]
                .into_iter()
                .find(|s| l.starts_with(s))
        })
        .collect();
    assert_eq!(
        starts,
        ["goal:", "outcome:", "evidence:", "next_action:"],
        "message does not render the four sections: {message:?}"
    );
}

fn evidence_of<'a>(r: &'a Proj, kind: &str) -> &'a Value {
    r.payload()["evidence"]
        .as_array()
        .and_then(|items| items.iter().find(|i| i["kind"] == kind))
        .unwrap_or_else(|| panic!("no {kind} evidence in {:#}", r.body))
}

/// A synthesised blocked timeout of a ruda -> eden send.
fn assert_synthesized_timeout(r: &Proj, send_seq: u64, timeout_ms: u64) {
    assert!(r.is_blocked(), "not blocked: {:#}", r.body);
    assert_eq!(r.str("reason"), Some("timeout"), "{:#}", r.body);
    assert_eq!(r.payload()["synthesized"], true, "{:#}", r.body);
    assert_eq!(r.str("fromAgent"), Some("eden"), "{:#}", r.body);
    assert_eq!(r.str("toAgent"), Some("ruda"), "{:#}", r.body);
    assert_eq!(evidence_of(r, "send")["rawSeq"], send_seq);
    assert_eq!(evidence_of(r, "deadline")["timeoutMs"], timeout_ms);
    let next = r.str("next_action").unwrap_or_default();
    assert!(
        next.contains("eden"),
        "next_action names no target: {next:?}"
    );
    assert_four_sections(r.str("message").unwrap_or_default());
}

async fn expect_abort(p: &mut Projector, point: &str) {
    let Some(status) = p.wait_exit(WAIT).await else {
        panic!(
            "the projector did not abort at {point}; log:\n{}",
            p.log_text()
        );
    };
    assert!(!status.success(), "the projector exited cleanly: {status}");
    let log = p.log_text();
    assert!(
        log.contains(&format!("test hook: crashing at {point}")),
        "the projector exited ({status}) without reaching {point}; log:\n{log}"
    );
}

async fn sleep_until_ms(at_ms: i64) {
    let wait = at_ms.saturating_sub(now_ms()).max(0);
    tokio::time::sleep(Duration::from_millis(u64::try_from(wait).unwrap_or(0))).await;
}

// ---------------------------------------------------------------------------------------------
// Scenarios.

#[tokio::test]
async fn a_reply_wins_and_keeps_its_message_with_sections_as_fields() {
    let bed = Bed::start().await;
    let _p = bed.projector(&[]);
    let sectioned =
        "goal: summarise the design\noutcome: done\nevidence: DESIGN.md read\nnext_action: none";
    bed.publish(&send(
        "c-sections",
        json!({"message": "summarise the design", "timeoutMs": 60_000}),
    ))
    .await;
    let reply_seq = bed
        .publish(&reply("c-sections", json!({"message": sectioned})))
        .await;
    bed.publish(&send(
        "c-plain",
        json!({"message": "say hi", "timeoutMs": 60_000}),
    ))
    .await;
    bed.publish(&reply("c-plain", json!({"message": "hi"})))
        .await;
    bed.wait_responses(&[key("c-sections", "0"), key("c-plain", "0")])
        .await;
    bed.settle(&["c-sections", "c-plain"]).await;

    let one = one_per_turn(
        &bed.responses().await,
        &[key("c-sections", "0"), key("c-plain", "0")],
    );
    let r = &one[&key("c-sections", "0")];
    assert_eq!(r.str("message"), Some(sectioned));
    assert_eq!(r.str("goal"), Some("summarise the design"));
    assert_eq!(r.str("outcome"), Some("done"));
    assert_eq!(r.str("evidence"), Some("DESIGN.md read"));
    assert_eq!(r.str("next_action"), Some("none"));
    assert_eq!(r.str("fromAgent"), Some("eden"));
    assert!(r.payload().get("synthesized").is_none(), "{:#}", r.body);
    assert_eq!(r.body["rawEventRef"]["seq"], reply_seq);

    let plain = &one[&key("c-plain", "0")];
    assert_eq!(plain.str("message"), Some("hi"));
    for field in ["goal", "outcome", "evidence", "next_action", "reason"] {
        assert!(
            plain.payload().get(field).is_none(),
            "{field} in {:#}",
            plain.body
        );
    }
    assert!(bed.read(SUPPRESSED).await.is_empty());
}

#[tokio::test]
async fn a_failure_reply_gives_a_blocked_timeout_that_is_not_synthesized() {
    let bed = Bed::start().await;
    let _p = bed.projector(&[]);
    bed.publish(&send(
        "c-fail",
        json!({"message": "check the build", "timeoutMs": 60_000}),
    ))
    .await;
    let fail_seq = bed
        .publish(&reply(
            "c-fail",
            json!({"outcome": "no_reply", "waitStatus": "timeout", "message": "no answer in time"}),
        ))
        .await;
    bed.wait_responses(&[key("c-fail", "0")]).await;
    bed.settle(&["c-fail"]).await;

    let one = one_per_turn(&bed.responses().await, &[key("c-fail", "0")]);
    let r = &one[&key("c-fail", "0")];
    assert!(r.is_blocked(), "{:#}", r.body);
    assert_eq!(r.str("reason"), Some("timeout"));
    assert_eq!(r.payload()["synthesized"], false);
    assert_eq!(r.str("goal"), Some("check the build"));
    // The upstream response is kept, not replaced.
    assert_eq!(r.str("waitStatus"), Some("timeout"));
    assert_eq!(r.str("upstreamMessage"), Some("no answer in time"));
    assert_eq!(evidence_of(r, "a2a.response")["rawSeq"], fail_seq);
    assert!(!r.str("next_action").unwrap_or_default().is_empty());
    assert_four_sections(r.str("message").unwrap_or_default());
    assert!(bed.read(SUPPRESSED).await.is_empty());
}

#[tokio::test]
async fn silence_past_the_send_timeout_gives_a_synthesized_blocked_timeout() {
    let bed = Bed::start().await;
    let _p = bed.projector(&[]);
    let goal = "ask eden for the release checklist";
    let send_seq = bed
        .publish(&send(
            "c-silent",
            json!({"message": goal, "timeoutMs": 1500}),
        ))
        .await;
    bed.wait_responses(&[key("c-silent", "0")]).await;
    bed.settle(&["c-silent"]).await;

    let one = one_per_turn(&bed.responses().await, &[key("c-silent", "0")]);
    let r = &one[&key("c-silent", "0")];
    assert_synthesized_timeout(r, send_seq, 1500);
    assert_eq!(r.str("goal"), Some(goal));
    assert_eq!(r.body["agentId"], "eden");
    let message = r.str("message").unwrap_or_default();
    assert!(message.contains(&format!("goal: {goal}")), "{message:?}");
    assert!(
        message.contains("outcome: blocked (timeout)"),
        "{message:?}"
    );
}

/// Send turn 0 of `c-quiet` (800 ms deadline) with nothing after it, and wait for its response
/// (the timeout, decided through the partition's barrier); the send's raw sequence.
async fn quiet_turn_answered(bed: &Bed) -> u64 {
    let send_seq = bed
        .publish(&send(
            "c-quiet",
            json!({"message": "ping", "timeoutMs": 800}),
        ))
        .await;
    bed.wait_responses(&[key("c-quiet", "0")]).await;
    send_seq
}

#[tokio::test]
async fn a_silent_timeout_is_decided_through_a_barrier_that_stays_in_the_raw_stream() {
    // An idle partition decides a deadline only once a barrier it publishes to itself comes
    // back through the raw stream. The barrier is acknowledged, never projected, and never
    // deleted: a delete would count as an acknowledgement, for every other consumer of the raw
    // stream, of everything delivered before it.
    let bed = Bed::start().await;
    let _p = bed.projector(&[]);
    let send_seq = quiet_turn_answered(&bed).await;
    let one = one_per_turn(&bed.responses().await, &[key("c-quiet", "0")]);
    assert_synthesized_timeout(&one[&key("c-quiet", "0")], send_seq, 800);
    let raw = crate::pipeline::read_all(&bed.js, "COLLAB_RAW", "collab.in.>").await;
    let barriers: Vec<_> = raw
        .iter()
        .filter(|m| m.header("Collab-Barrier").as_deref() == Some("collab"))
        .collect();
    assert!(
        !barriers.is_empty() && barriers.iter().all(|b| b.seq > send_seq),
        "the deadline was decided through a barrier stored after the send: {:?}",
        raw.iter()
            .map(|m| (m.seq, m.subject.clone()))
            .collect::<Vec<_>>()
    );
    let projected = crate::pipeline::read_all(&bed.js, "COLLAB_PROJ", ">").await;
    let from_barriers: Vec<_> = projected
        .iter()
        .filter(|m| {
            m.header("Collab-Source-Subject")
                .is_some_and(|s| s.ends_with(".barrier"))
        })
        .map(|m| m.subject.clone())
        .collect();
    assert!(
        from_barriers.is_empty(),
        "a barrier is never projected: {from_barriers:?}"
    );
}

#[tokio::test]
async fn a_barrier_leaves_the_acknowledgements_of_other_consumers_of_the_raw_stream_alone() {
    // Another consumer of the raw stream (a projection version's partition, a reprojection, an
    // operator's audit reader) with `AckPolicy::All` holds what it was delivered
    // unacknowledged. The deployment's barrier reaches it too; were the barrier deleted once the
    // deployment acknowledged it, the server would count the delete as that consumer's
    // acknowledgement of everything up to the barrier, the inputs it holds included.
    let bed = Bed::start().await;
    let _p = bed.projector(&[]);
    let raw = bed
        .js
        .get_stream("COLLAB_RAW")
        .await
        .expect("the raw stream exists");
    let observer = raw
        .create_consumer(jetstream::consumer::pull::Config {
            durable_name: Some("observer".into()),
            filter_subject: "collab.in.>".into(),
            ack_policy: jetstream::consumer::AckPolicy::All,
            ack_wait: Duration::from_secs(300),
            ..Default::default()
        })
        .await
        .expect("observer consumer");
    let mut held = observer.messages().await.expect("observer pull");
    let send_seq = quiet_turn_answered(&bed).await;
    // The observer receives the send and the barrier, and acknowledges neither. (A barrier
    // deleted before it reached the observer never does: that fails here too.)
    let mut kept = Vec::new();
    while kept.len() < 2 {
        let msg = tokio::time::timeout(Duration::from_secs(20), held.next())
            .await
            .expect("the observer is delivered the send and the barrier")
            .expect("observer stream open")
            .expect("observer delivery");
        kept.push(msg);
    }
    let barrier_seq = kept[1].info().expect("barrier metadata").stream_sequence;
    assert_eq!(
        kept[0].info().expect("send metadata").stream_sequence,
        send_seq
    );
    assert!(
        kept[1]
            .headers
            .as_ref()
            .and_then(|h| h.get("Collab-Barrier"))
            .is_some(),
        "the second delivery is the deployment's barrier: {}",
        kept[1].subject
    );
    // The deployment has acknowledged its barrier: whatever it does with one afterwards is done.
    wait_until(WAIT, "the deployment acknowledged the barrier", || async {
        bed.drained().await
    })
    .await;
    for _ in 0..20 {
        let info = bed
            .js
            .get_stream("COLLAB_RAW")
            .await
            .expect("the raw stream exists")
            .consumer_info("observer")
            .await
            .expect("observer info");
        assert_eq!(
            (info.ack_floor.stream_sequence, info.num_ack_pending),
            (0, 2),
            "the observer acknowledged nothing, and holds the send and the barrier {barrier_seq}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(kept);
}

#[tokio::test]
async fn a_producers_message_with_the_barrier_header_is_still_an_input() {
    // Only a worker's own barrier (empty body on a barrier subject) is acknowledged unprojected;
    // a producer's event that carries the header by mistake is projected like any other.
    let bed = Bed::start().await;
    let _p = bed.projector(&[]);
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Collab-Barrier", "1");
    let body = serde_json::to_vec(&json!({"type": "task.updated", "taskId": "t-hdr"}))
        .expect("serialises");
    bed.js
        .publish_with_headers("collab.raw.t-hdr.task.updated", headers, body.into())
        .await
        .expect("sent")
        .await
        .expect("stored");
    bed.wait_read(
        "collab.proj.orchestration.task.t-hdr.task.updated",
        "the event is projected",
        |m| m.len() == 1,
    )
    .await;
}

#[tokio::test]
async fn each_partitions_barrier_subject_is_stored_in_that_partition() {
    // The worker computes the raw subject that the stream's partition transform sends to a
    // partition; the server's own transform must agree for every partition.
    let partitions: u16 = 16;
    let bed = Bed::start_with(&[("COLLAB_NATS__PARTITIONS", "16")]).await;
    let names = collab_projector::config::Settings::default().names();
    for p in 0..partitions {
        let subject = names.barrier_subject(p, partitions);
        crate::pipeline::publish(&bed.js, &subject, "").await;
    }
    let raw = crate::pipeline::read_all(&bed.js, "COLLAB_RAW", "collab.in.>").await;
    assert_eq!(raw.len(), usize::from(partitions));
    // Stored under partition p's token, and read by partition p's filter.
    let settings = collab_projector::config::Settings::default();
    let at = settings
        .layout()
        .levels
        .iter()
        .position(|l| *l == partitions);
    for (p, m) in raw.iter().enumerate() {
        let token: Option<usize> = m
            .subject
            .strip_prefix("collab.in.")
            .and_then(|r| r.split('.').nth(at?))
            .and_then(|t| t.parse().ok());
        assert_eq!(
            token,
            Some(p),
            "barrier for partition {p} stored as {}",
            m.subject
        );
        let filter = settings.partition_filter(p as u16);
        let prefix = filter.trim_end_matches('>');
        let matches = m
            .subject
            .split('.')
            .zip(prefix.split('.'))
            .all(|(have, want)| want.is_empty() || want == "*" || have == want);
        assert!(matches, "{} is not read by {filter}", m.subject);
    }
}

#[tokio::test]
async fn deadlines_passing_together_are_all_answered_past_the_publish_window() {
    // One partition and a publish window of 4: the 24 deadlines below pass together, so one
    // step of the partition issues 24 blocked responses, six times the permits there are. The
    // reader hands its publishes to the acker as it goes; holding them all, it would wait
    // forever for a permit only its own acker could release.
    let bed = Bed::start_with(&[
        ("COLLAB_NATS__PARTITIONS", "1"),
        ("COLLAB_CONSUMER__PUBLISH_WINDOW", "4"),
    ])
    .await;
    let convs: Vec<String> = (0..24).map(|i| format!("c-burst-{i}")).collect();
    for c in &convs {
        bed.publish(&send(
            c,
            json!({"message": "check the canary", "timeoutMs": 1000}),
        ))
        .await;
    }
    let _p = bed.projector(&[]);
    let keys: Vec<TurnKey> = convs.iter().map(|c| key(c, "0")).collect();
    bed.wait_responses(&keys).await;
    let conv_refs: Vec<&str> = convs.iter().map(String::as_str).collect();
    bed.settle(&conv_refs).await;
    let one = one_per_turn(&bed.responses().await, &keys);
    assert_eq!(one.len(), convs.len());
    assert!(one.values().all(Proj::is_blocked), "{one:?}");
}

#[tokio::test]
async fn a_complete_without_a_response_gives_a_blocked_error_before_the_complete() {
    let bed = Bed::start().await;
    let _p = bed.projector(&[]);
    bed.publish(&send(
        "c-complete",
        json!({"message": "tidy up", "timeoutMs": 60_000}),
    ))
    .await;
    let complete_seq = bed
        .publish(&collab_event(
            "a2a.complete",
            "eden",
            "ruda",
            "c-complete",
            json!({}),
        ))
        .await;
    bed.wait_responses(&[key("c-complete", "0")]).await;
    bed.settle(&["c-complete"]).await;

    let one = one_per_turn(&bed.responses().await, &[key("c-complete", "0")]);
    let r = &one[&key("c-complete", "0")];
    assert!(r.is_blocked(), "{:#}", r.body);
    assert_eq!(r.str("reason"), Some("error"));
    assert_eq!(r.payload()["synthesized"], true);
    assert_eq!(evidence_of(r, "a2a.complete")["rawSeq"], complete_seq);
    assert_four_sections(r.str("message").unwrap_or_default());

    let conversation = bed.read("collab.proj.conversation.main.c-complete.>").await;
    // Stream order: the sequence in COLLAB_PROJ.
    let stored_at = |t: &str| {
        conversation
            .iter()
            .find(|m| m.body["type"] == t)
            .map(|m| m.seq)
            .unwrap_or_else(|| panic!("no {t} projected: {conversation:#?}"))
    };
    assert!(
        stored_at("a2a.response") < stored_at("a2a.complete"),
        "the complete is projected before its turn's response: {conversation:#?}"
    );
}

#[tokio::test]
async fn a_duplicate_reply_is_suppressed_with_a_ref_to_the_winner() {
    let bed = Bed::start().await;
    let _p = bed.projector(&[]);
    bed.publish(&send(
        "c-dup",
        json!({"message": "status?", "timeoutMs": 60_000}),
    ))
    .await;
    let first = bed
        .publish(&reply("c-dup", json!({"message": "first answer"})))
        .await;
    bed.publish(&reply("c-dup", json!({"message": "second answer"})))
        .await;
    bed.wait_read(SUPPRESSED, "the duplicate is suppressed", |m| !m.is_empty())
        .await;
    bed.settle(&["c-dup"]).await;

    let one = one_per_turn(&bed.responses().await, &[key("c-dup", "0")]);
    assert_eq!(one[&key("c-dup", "0")].str("message"), Some("first answer"));
    let suppressed = bed.suppressed_of("c-dup").await;
    assert_eq!(suppressed.len(), 1, "{suppressed:#?}");
    let s = &suppressed[0];
    assert_eq!(s.body["type"], "a2a.response.suppressed");
    assert_eq!(s.body["eventRole"], "system.observability");
    assert_eq!(s.str("reason"), Some("duplicate"));
    let winner = &s.payload()["winner"];
    assert_eq!(winner["rawSeq"], first);
    assert_eq!(winner["msgId"], "turn:c-dup:0");
    assert_eq!(winner["outcome"], "response");
    assert_eq!(s.payload()["response"]["message"], "second answer");
}

#[tokio::test]
async fn a_reply_after_a_blocked_timeout_is_suppressed_as_late() {
    let bed = Bed::start().await;
    let _p = bed.projector(&[]);
    let send_seq = bed
        .publish(&send(
            "c-late",
            json!({"message": "anyone?", "timeoutMs": 1500}),
        ))
        .await;
    bed.wait_responses(&[key("c-late", "0")]).await;
    bed.publish(&reply("c-late", json!({"message": "sorry, late"})))
        .await;
    bed.wait_read(SUPPRESSED, "the late reply is suppressed", |m| {
        !m.is_empty()
    })
    .await;
    bed.settle(&["c-late"]).await;

    let one = one_per_turn(&bed.responses().await, &[key("c-late", "0")]);
    assert_synthesized_timeout(&one[&key("c-late", "0")], send_seq, 1500);
    let suppressed = bed.suppressed_of("c-late").await;
    assert_eq!(suppressed.len(), 1, "{suppressed:#?}");
    let s = &suppressed[0];
    assert_eq!(s.str("reason"), Some("late"));
    assert_eq!(s.payload()["winner"]["outcome"], "blocked");
    assert_eq!(s.payload()["winner"]["reason"], "timeout");
    assert_eq!(s.payload()["winner"]["msgId"], "turn:c-late:0");
    assert_eq!(s.payload()["response"]["message"], "sorry, late");
}

#[tokio::test]
async fn a_response_without_a_send_is_held_then_is_the_response_and_a_later_send_starts_no_timer() {
    let bed = Bed::start().await;
    // Held for the early hold waiting for its send; none comes, so it decides its turn.
    let _p = bed.projector(&[("COLLAB_TURNS__EARLY_HOLD", "2s")]);
    bed.publish(&reply("c-nosend", json!({"message": "unprompted answer"})))
        .await;
    bed.wait_responses(&[key("c-nosend", "0")]).await;
    let send_seq = bed
        .publish_projected_send(
            "c-nosend",
            json!({"message": "too late to ask", "timeoutMs": 1000}),
        )
        .await;
    // Past the send's own deadline: a timer, had it started, would fire before the barrier.
    let deadline = bed.stored_ms(send_seq).await + 1000;
    sleep_until_ms(deadline + 1000).await;
    bed.settle(&["c-nosend"]).await;

    let one = one_per_turn(&bed.responses().await, &[key("c-nosend", "0")]);
    let r = &one[&key("c-nosend", "0")];
    assert_eq!(r.str("message"), Some("unprompted answer"));
    assert!(!r.is_blocked(), "{:#}", r.body);
    assert!(bed.read(SUPPRESSED).await.is_empty());
}

#[tokio::test]
async fn ping_pong_turns_get_one_response_each() {
    let bed = Bed::start().await;
    let _p = bed.projector(&[]);
    let conv = "c-pingpong";
    for n in 1..=4u32 {
        let (a, b) = if n % 2 == 1 {
            ("ruda", "eden")
        } else {
            ("eden", "ruda")
        };
        bed.publish(&collab_event(
            "a2a.send",
            a,
            b,
            conv,
            json!({"turn": n, "message": format!("ping {n}"), "timeoutMs": 60_000}),
        ))
        .await;
        bed.publish(&collab_event(
            "a2a.response",
            b,
            a,
            conv,
            json!({"turn": n, "message": format!("pong {n}")}),
        ))
        .await;
    }
    let unanswered = bed
        .publish(&send(
            conv,
            json!({"turn": 5, "message": "ping 5", "timeoutMs": 1500}),
        ))
        .await;
    let turns: Vec<TurnKey> = (1..=5).map(|n| key(conv, &n.to_string())).collect();
    bed.wait_responses(&turns).await;
    bed.settle(&[conv]).await;

    let one = one_per_turn(&bed.responses().await, &turns);
    for n in 1..=4u32 {
        let r = &one[&key(conv, &n.to_string())];
        assert_eq!(r.str("message"), Some(format!("pong {n}").as_str()));
        assert!(!r.is_blocked(), "{:#}", r.body);
        let replier = if n % 2 == 1 { "eden" } else { "ruda" };
        assert_eq!(r.str("fromAgent"), Some(replier));
    }
    assert_synthesized_timeout(&one[&key(conv, "5")], unanswered, 1500);
    assert!(bed.read(SUPPRESSED).await.is_empty());
}

// ---------------------------------------------------------------------------------------------
// Crash safety at exact instants of the turn protocol.

/// A send answered by a reply, processed by a projector that aborts at `point`; a normal
/// projector then finishes the job.
async fn crash_on_the_reply_path(point: &str) {
    crash_then_restart_on_the_reply_path(point, &[], Duration::ZERO).await;
}

/// [`crash_on_the_reply_path`] on a bed with `env`, the normal projector starting `pause` after
/// the crash.
async fn crash_then_restart_on_the_reply_path(
    point: &str,
    env: &[(&'static str, &'static str)],
    pause: Duration,
) {
    let bed = Bed::start_with(env).await;
    let mut crashing = bed.projector(&[("COLLAB_TEST_CRASH_AT", point)]);
    bed.publish(&send(
        "c-crash",
        json!({"message": "build it", "timeoutMs": 60_000}),
    ))
    .await;
    bed.publish(&reply("c-crash", json!({"message": "built"})))
        .await;
    expect_abort(&mut crashing, point).await;
    tokio::time::sleep(pause).await;

    let _p = bed.projector(&[]);
    bed.wait_responses(&[key("c-crash", "0")]).await;
    bed.settle(&["c-crash"]).await;
    let one = one_per_turn(&bed.responses().await, &[key("c-crash", "0")]);
    let r = &one[&key("c-crash", "0")];
    assert_eq!(r.str("message"), Some("built"), "{:#}", r.body);
    assert!(!r.is_blocked(), "{:#}", r.body);
    // The winning reply, redelivered after the crash, is not a duplicate of itself.
    assert!(
        bed.read(SUPPRESSED).await.is_empty(),
        "{:#?}",
        bed.read(SUPPRESSED).await
    );
}

/// An unanswered send whose deadline a projector that aborts at `point` handles; a normal
/// projector then finishes the job.
async fn crash_on_the_timeout_path(point: &str) {
    let bed = Bed::start().await;
    let mut crashing = bed.projector(&[("COLLAB_TEST_CRASH_AT", point)]);
    let send_seq = bed
        .publish(&send(
            "c-crash-t",
            json!({"message": "build it", "timeoutMs": 1000}),
        ))
        .await;
    expect_abort(&mut crashing, point).await;

    let _p = bed.projector(&[]);
    bed.wait_responses(&[key("c-crash-t", "0")]).await;
    bed.settle(&["c-crash-t"]).await;
    let one = one_per_turn(&bed.responses().await, &[key("c-crash-t", "0")]);
    assert_synthesized_timeout(&one[&key("c-crash-t", "0")], send_seq, 1000);
}

/// Like [`crash_on_the_reply_path`], but the next projector starts only after the projection
/// stream's duplicate window has passed, so a republish would no longer collapse by Msg-Id: the
/// reload must find out from the stream whether the response was stored.
async fn crash_on_the_reply_path_past_the_duplicate_window(point: &str) {
    crash_then_restart_on_the_reply_path(
        point,
        &[("COLLAB_PROJECTION__DUPLICATE_WINDOW", "2s")],
        Duration::from_secs(3),
    )
    .await;
}

#[tokio::test]
async fn crash_after_publish_then_a_restart_past_the_duplicate_window_publishes_once() {
    crash_on_the_reply_path_past_the_duplicate_window("after_publish").await;
}

#[tokio::test]
async fn crash_after_decide_then_a_restart_past_the_duplicate_window_publishes_once() {
    crash_on_the_reply_path_past_the_duplicate_window("after_decide").await;
}

#[tokio::test]
async fn crash_after_decide_on_a_reply_still_publishes_it_once() {
    crash_on_the_reply_path("after_decide").await;
}

#[tokio::test]
async fn crash_after_publish_on_a_reply_still_publishes_it_once() {
    crash_on_the_reply_path("after_publish").await;
}

#[tokio::test]
async fn crash_before_ack_on_a_reply_still_publishes_it_once() {
    crash_on_the_reply_path("before_ack").await;
}

#[tokio::test]
async fn crash_after_decide_at_a_deadline_still_blocks_once() {
    crash_on_the_timeout_path("after_decide").await;
}

#[tokio::test]
async fn crash_after_publish_at_a_deadline_still_blocks_once() {
    crash_on_the_timeout_path("after_publish").await;
}

#[tokio::test]
async fn crash_before_ack_of_a_send_still_blocks_once() {
    crash_on_the_timeout_path("before_ack").await;
}

#[tokio::test]
async fn a_deadline_that_passes_while_the_worker_is_down_blocks_after_restart() {
    let bed = Bed::start().await;
    let mut first = bed.projector(&[]);
    let timeout_ms: u32 = 4000;
    let send_seq = bed
        .publish_projected_send(
            "c-down",
            json!({"message": "are you there?", "timeoutMs": timeout_ms}),
        )
        .await;
    first.kill9();
    first.wait_exit(WAIT).await;
    let deadline = bed.stored_ms(send_seq).await + i64::from(timeout_ms);
    sleep_until_ms(deadline + 1000).await;

    let _second = bed.projector(&[]);
    bed.wait_responses(&[key("c-down", "0")]).await;
    bed.publish(&reply("c-down", json!({"message": "here now"})))
        .await;
    bed.wait_read(SUPPRESSED, "the late reply is suppressed", |m| {
        !m.is_empty()
    })
    .await;
    bed.settle(&["c-down"]).await;

    let one = one_per_turn(&bed.responses().await, &[key("c-down", "0")]);
    assert_synthesized_timeout(&one[&key("c-down", "0")], send_seq, u64::from(timeout_ms));
    let suppressed = bed.suppressed_of("c-down").await;
    assert_eq!(suppressed.len(), 1, "{suppressed:#?}");
    assert_eq!(suppressed[0].str("reason"), Some("late"));
    assert_eq!(suppressed[0].payload()["response"]["message"], "here now");
}

/// A worker killed while its turns' open records are still deferred (`turns.open_write_delay`)
/// has acknowledged none of their sends: the next worker processes them again, so one turn
/// gets its real reply and the other its timeout, exactly once each, both opened by their sends.
#[tokio::test]
async fn a_worker_killed_before_its_open_records_are_written_loses_no_turn() {
    // A delay far longer than the test needs to kill the worker (at most a third of ack_wait).
    let bed = Bed::start_with(&[("COLLAB_CONSUMER__ACK_WAIT", "30s")]).await;
    let mut first = bed.projector(&[("COLLAB_TURNS__OPEN_WRITE_DELAY", "10s")]);
    let timeout_ms: u32 = 3000;
    let reply_send_seq = bed
        .publish(&send(
            "c-deferred-reply",
            json!({"message": "plan the release", "timeoutMs": 60_000}),
        ))
        .await;
    let send_seq = bed
        .publish(&send(
            "c-deferred-silent",
            json!({"message": "are you there?", "timeoutMs": timeout_ms}),
        ))
        .await;
    bed.wait_read(SENDS, "both sends are projected", |m| m.len() == 2)
        .await;
    // The scenario under test: the turns are open, their records not written yet.
    assert!(turn_record(&bed.js, "c-deferred-reply").await.is_none());
    assert!(turn_record(&bed.js, "c-deferred-silent").await.is_none());
    first.kill9();
    first.wait_exit(WAIT).await;

    let _second = bed.projector(&[]);
    bed.publish(&reply(
        "c-deferred-reply",
        json!({"message": "release planned"}),
    ))
    .await;
    let turns = [key("c-deferred-reply", "0"), key("c-deferred-silent", "0")];
    bed.wait_responses(&turns).await;
    bed.settle(&["c-deferred-reply", "c-deferred-silent"]).await;

    let one = one_per_turn(&bed.responses().await, &turns);
    let replied = &one[&key("c-deferred-reply", "0")];
    assert!(!replied.is_blocked(), "{:#}", replied.body);
    assert_eq!(replied.str("message"), Some("release planned"));
    assert_synthesized_timeout(
        &one[&key("c-deferred-silent", "0")],
        send_seq,
        u64::from(timeout_ms),
    );
    let (_, record, _) = turn_record(&bed.js, "c-deferred-reply")
        .await
        .expect("the decided turn has a record");
    assert_eq!(record["state"], "decided", "{record:#}");
    // Opened by the send, processed again by the second worker before the reply.
    assert_eq!(record["send"]["seq"], reply_send_seq, "{record:#}");
    assert_eq!(record["send"]["goal"], "plan the release", "{record:#}");
}

/// The turn record of `conv`'s first turn in the turns bucket: its key, value and revision.
async fn turn_record(js: &jetstream::Context, conv: &str) -> Option<(String, Value, u64)> {
    turn_records(js)
        .await
        .into_iter()
        .find(|(_, v, _)| v["conversationId"] == conv)
}

/// Every turn record readable in the turns bucket: its key, value and revision.
async fn turn_records(js: &jetstream::Context) -> Vec<(String, Value, u64)> {
    let mut records = Vec::new();
    let Ok(kv) = js.get_key_value("collab_turns").await else {
        return records;
    };
    let Ok(mut keys) = kv.keys().await else {
        return records;
    };
    while let Some(Ok(k)) = keys.next().await {
        if !k.starts_with('p') {
            continue;
        }
        let Ok(Some(e)) = kv.entry(&k).await else {
            continue;
        };
        if let Ok(v) = serde_json::from_slice::<Value>(&e.value) {
            records.push((k, v, e.revision));
        }
    }
    records
}

/// Send turn 0 of `conv` (`ask`: its message and timeout in ms), reply with `answer`, and wait
/// for its response.
async fn answer_turn(bed: &Bed, conv: &str, ask: (&str, u64), answer: &str) {
    bed.publish(&send(conv, json!({"message": ask.0, "timeoutMs": ask.1})))
        .await;
    bed.publish(&reply(conv, json!({"message": answer}))).await;
    bed.wait_responses(&[key(conv, "0")]).await;
}

/// The open record of `conv`'s turn once it is written (within `turns.open_write_delay` of the
/// send): its key, value and revision.
async fn open_record(bed: &Bed, conv: &str) -> (String, Value, u64) {
    wait_until(WAIT, "the open turn has a record", || async {
        turn_record(&bed.js, conv).await.is_some()
    })
    .await;
    let (key, open, rev) = turn_record(&bed.js, conv)
        .await
        .expect("the open turn has a record");
    assert_eq!(open["state"], "open", "{open:#}");
    (key, open, rev)
}

/// Decide the open turn `open` (record `key` at `open_rev`) with `winner` as an owner of another
/// term (writer 7) would: a compare-and-set write of the decided record. Its revision.
async fn decide_as_another_owner(
    bed: &Bed,
    key: &str,
    open: &Value,
    open_rev: u64,
    winner: Value,
) -> u64 {
    let mut decided = open.clone();
    decided["state"] = json!("decided");
    decided["winner"] = winner;
    decided["writer"] = json!(7);
    let kv = bed.js.get_key_value("collab_turns").await.expect("bucket");
    kv.update(
        key,
        serde_json::to_vec(&decided).expect("JSON").into(),
        open_rev,
    )
    .await
    .expect("the decision is written")
}

/// Wait until partition 0's published checkpoint has `field` (`through` or `base`) at
/// `at_least` or above.
async fn wait_checkpoint(bed: &Bed, field: &'static str, at_least: u64) {
    let kv = bed.js.get_key_value("collab_turns").await.expect("bucket");
    let what = format!("the checkpoint's {field} reaches {at_least}");
    wait_until(WAIT, &what, || {
        let kv = kv.clone();
        async move {
            let Ok(Some(v)) = kv.get("ck.p0").await else {
                return false;
            };
            serde_json::from_slice::<Value>(&v)
                .ok()
                .and_then(|c| c[field].as_u64())
                .is_some_and(|v| v >= at_least)
        }
    })
    .await;
}

/// A decision whose record is stored while none of the outputs before it are (an atomic batch
/// refused whole holds the inputs before the reply as well as the response): after a restart
/// the response is published where its reply stands, after the send's projection, not ahead of
/// the inputs the new owner processes again.
#[tokio::test]
async fn a_decision_stored_without_its_outputs_is_published_after_the_inputs_before_it() {
    let bed = Bed::start_with(&[("COLLAB_NATS__PUBLISH_BATCHES", "always")]).await;
    // Every publish of this worker fails (and is retried in place): its turn-record writes,
    // which do not go through the publisher, are stored; no projection is.
    let mut held = bed.projector(&[("COLLAB_TEST_FAIL_PUBLISH_EVERY", "1")]);
    let send_seq = bed
        .publish(&send(
            "c-order",
            json!({"message": "order it", "timeoutMs": 600_000}),
        ))
        .await;
    let reply_seq = bed
        .publish(&reply("c-order", json!({"message": "ordered"})))
        .await;
    wait_until(WAIT, "the turn's decision is stored", || async {
        turn_record(&bed.js, "c-order")
            .await
            .is_some_and(|(_, v, _)| v["state"] == "decided")
    })
    .await;
    assert!(
        bed.read("collab.proj.>").await.is_empty(),
        "precondition: the first worker stored no projection"
    );
    held.kill9();
    held.wait_exit(WAIT).await;

    let _next = bed.projector(&[]);
    bed.wait_responses(&[key("c-order", "0")]).await;
    bed.settle(&["c-order"]).await;
    let stored: Vec<(u64, String, Value)> = bed
        .read("collab.proj.conversation.main.c-order.>")
        .await
        .into_iter()
        .map(|p| (p.seq, p.subject, p.body))
        .collect();
    let at = |raw: u64| {
        stored
            .iter()
            .position(|(_, _, b)| b["rawEventRef"]["seq"] == raw)
            .unwrap_or_else(|| panic!("nothing projected from raw seq {raw}: {stored:#?}"))
    };
    assert!(
        at(send_seq) < at(reply_seq),
        "the response (from raw seq {reply_seq}) was stored before the send's projection (raw seq {send_seq}): {stored:#?}"
    );
    one_per_turn(&bed.responses().await, &[key("c-order", "0")]);
}

/// A previous owner paused right before a decide write, whose write lands once another owner
/// holds the partition, and which dies before its response is stored: the current owner's
/// checkpoint later moves past that write with decisions of its own. The next owner must not
/// take the stale decision as published: it publishes its response, once.
#[tokio::test]
async fn a_previous_owners_late_decision_is_published_even_below_the_checkpoint() {
    // One partition: the stale write and the owner's own decisions share its checkpoint.
    let bed = Bed::start_with(&[("COLLAB_NATS__PARTITIONS", "1")]).await;
    let mut owner = bed.projector(&[]);
    bed.publish_projected_send(
        "c-stale",
        json!({"message": "plan it", "timeoutMs": 600_000}),
    )
    .await;
    let (key_of_stale, open, open_rev) = open_record(&bed, "c-stale").await;

    // The late write: a decision by another ownership term, compare-and-set on the open record
    // as the paused owner would have sent it.
    let winner = json!({
        "blocked": "timeout", "synthesized": true, "by": "deadline",
        "atMs": open["deadlineMs"],
    });
    let stale_rev = decide_as_another_owner(&bed, &key_of_stale, &open, open_rev, winner).await;

    // The owner decides a turn of its own after it, and its checkpoint moves past the late write.
    answer_turn(&bed, "c-own", ("ship it", 60_000), "shipped").await;
    wait_checkpoint(&bed, "through", stale_rev + 1).await;
    assert!(
        bed.responses()
            .await
            .iter()
            .all(|r| r.turn_key() != key("c-stale", "0")),
        "the running owner does not know of the late decision"
    );
    owner.kill9();
    owner.wait_exit(WAIT).await;

    let _next = bed.projector(&[]);
    bed.wait_responses(&[key("c-stale", "0")]).await;
    bed.settle(&["c-stale", "c-own"]).await;
    let one = one_per_turn(
        &bed.responses().await,
        &[key("c-stale", "0"), key("c-own", "0")],
    );
    assert!(one[&key("c-stale", "0")].is_blocked());
    assert_eq!(one[&key("c-own", "0")].str("message"), Some("shipped"));
}

/// A turn record deleted from the bucket by hand (`nats kv del`) leaves a delete marker as its
/// key's last entry, so a write that expects the key absent is refused. The partition writes the
/// record again over the marker and goes on, instead of taking the refusal for another owner's
/// write and restarting on the same input until the marker ages out.
#[tokio::test]
async fn a_turn_record_deleted_by_hand_is_written_again_and_the_partition_goes_on() {
    // One partition: a stuck partition would hold up every conversation after it.
    let bed = Bed::start_with(&[("COLLAB_NATS__PARTITIONS", "1")]).await;
    let mut first = bed.projector(&[]);
    answer_turn(&bed, "c-asked-again", ("status?", 60_000), "fine").await;
    answer_turn(&bed, "c-answered-again", ("ready?", 60_000), "ready").await;
    let kv = bed.js.get_key_value("collab_turns").await.expect("bucket");
    let mut markers = BTreeMap::new();
    for conv in ["c-asked-again", "c-answered-again"] {
        wait_until(WAIT, "the turn's decision is stored", || async {
            turn_record(&bed.js, conv)
                .await
                .is_some_and(|(_, v, _)| v["state"] != "open")
        })
        .await;
        let (k, _, _) = turn_record(&bed.js, conv).await.expect("the turn's record");
        kv.delete(&k).await.expect("the record is deleted");
        let marker = kv
            .entry(&k)
            .await
            .expect("the key is read")
            .expect("the key has its delete marker");
        assert_eq!(
            marker.operation,
            async_nats::jetstream::kv::Operation::Delete
        );
        markers.insert(conv, (k, marker.revision));
    }

    // A new owner, which keeps no decided turn in memory: it reads the keys from the bucket.
    first.stop_cleanly(WAIT).await;
    let p = bed.projector(&[]);

    // The same turn asked again: a new open record (written once `turns.open_write_delay` is
    // up), and asked and answered again: a decision on a turn whose open record is unwritten.
    bed.publish(&send(
        "c-asked-again",
        json!({"message": "status?", "timeoutMs": 600_000}),
    ))
    .await;
    bed.publish(&send(
        "c-answered-again",
        json!({"message": "ready?", "timeoutMs": 600_000}),
    ))
    .await;
    bed.publish(&reply("c-answered-again", json!({"message": "ready now"})))
        .await;
    // Later input of the partition is processed.
    answer_turn(&bed, "c-after", ("next?", 60_000), "next").await;

    for (conv, state) in [("c-asked-again", "open"), ("c-answered-again", "decided")] {
        let (k, marker_rev) = &markers[conv];
        wait_until(WAIT, "the record is written again", || async {
            kv.entry(k)
                .await
                .ok()
                .flatten()
                .is_some_and(|e| e.revision > *marker_rev && !e.value.is_empty())
        })
        .await;
        let entry = kv.entry(k).await.expect("read").expect("the record");
        assert_eq!(entry.operation, async_nats::jetstream::kv::Operation::Put);
        let v: Value = serde_json::from_slice(&entry.value).expect("a record");
        let written = v["state"].as_str().unwrap_or_default();
        let expected: &[&str] = if state == "open" {
            &["open"]
        } else {
            &["decided", "published"]
        };
        assert!(expected.contains(&written), "{conv}: {v:#}");
    }
    let log = p.log_text();
    assert!(
        log.contains("written again over its delete marker"),
        "the rewrite is logged:\n{log}"
    );
    assert!(
        !log.contains("turn state write refused"),
        "no write was taken for another owner's:\n{log}"
    );
}

/// A decided turn whose checkpoint was deleted by hand (`nats kv del collab_turns ck.p<N>`),
/// and whose response has since aged out of the projection stream (here a 12 s `max_age`): the
/// next owner's reload no longer knows the decision's response was stored, and its look-up
/// cannot find it. It takes the response as published, with a warning, rather than publishing
/// the turn's second response long after the first was read; the deleted checkpoint is named
/// in the log too.
#[tokio::test]
async fn a_decision_older_than_the_projection_stream_keeps_is_not_published_again() {
    let bed = Bed::start_with(&[
        ("COLLAB_NATS__PARTITIONS", "1"),
        ("COLLAB_PROJECTION__MAX_AGE", "12s"),
        ("COLLAB_PROJECTION__DUPLICATE_WINDOW", "2s"),
    ])
    .await;
    let mut first = bed.projector(&[]);
    bed.publish(&send(
        "c-aged",
        json!({"message": "anyone?", "timeoutMs": 1000}),
    ))
    .await;
    bed.wait_responses(&[key("c-aged", "0")]).await;
    bed.settle(&["c-aged"]).await;
    first.stop_cleanly(WAIT).await;
    let kv = bed.js.get_key_value("collab_turns").await.expect("bucket");
    kv.delete("ck.p0").await.expect("the checkpoint is deleted");
    wait_until(
        Duration::from_secs(60),
        "the response ages out of the projection stream",
        || async { bed.responses().await.is_empty() },
    )
    .await;

    let second = bed.projector(&[]);
    // Another turn of the (only) partition, answered once the reload is done.
    answer_turn(&bed, "c-after", ("next?", 60_000), "next").await;
    let log = second.log_text();
    let again: Vec<Proj> = bed
        .responses()
        .await
        .into_iter()
        .filter(|r| r.turn_key() == key("c-aged", "0"))
        .collect();
    assert!(
        again.is_empty(),
        "the aged-out response was published again: {again:?}\n{log}"
    );
    assert!(
        log.contains("checkpoint was deleted from the turns bucket"),
        "the deleted checkpoint is named:\n{log}"
    );
    assert!(
        log.contains("taken as published (it may have aged out)"),
        "the decision taken as published is logged:\n{log}"
    );
}

/// A decided record this version cannot parse (written by a newer version, read after a
/// rollback) is not vouched for by the reload's checkpoint: a version that reads it looks its
/// response up, rather than every later owner taking it for published. An input of its turn
/// stops the partition with an error that names the record, not a refusal taken for another
/// owner's write.
#[tokio::test]
async fn a_turn_record_this_version_cannot_read_is_not_vouched_for_and_is_named() {
    let bed = Bed::start_with(&[("COLLAB_NATS__PARTITIONS", "1")]).await;
    let mut first = bed.projector(&[]);
    answer_turn(&bed, "c-newer", ("status?", 60_000), "fine").await;
    wait_until(WAIT, "the turn's decision is stored", || async {
        turn_record(&bed.js, "c-newer")
            .await
            .is_some_and(|(_, v, _)| v["state"] != "open")
    })
    .await;
    first.stop_cleanly(WAIT).await;

    // As a newer version would write it: a decision by another owner, with an outcome reason
    // this version does not know.
    let (k, mut rec, _) = turn_record(&bed.js, "c-newer").await.expect("the record");
    rec["state"] = json!("decided");
    rec["writer"] = json!(7);
    rec["winner"] = json!({
        "blocked": "reason-from-a-newer-version", "synthesized": true, "by": "deadline",
        "atMs": now_ms(),
    });
    let kv = bed.js.get_key_value("collab_turns").await.expect("bucket");
    let newer = kv
        .put(&k, serde_json::to_vec(&rec).expect("JSON").into())
        .await
        .expect("the record is written");

    let second = bed.projector(&[]);
    answer_turn(&bed, "c-other", ("next?", 60_000), "next").await;
    let checkpoint: Value = serde_json::from_slice(
        &kv.get("ck.p0")
            .await
            .expect("read")
            .expect("the partition's checkpoint"),
    )
    .expect("a checkpoint");
    let base = checkpoint["base"].as_u64().expect("a base");
    assert!(
        base < newer,
        "the checkpoint vouches only below the unreadable record (revision {newer}): {checkpoint:#}"
    );
    let log = second.log_text();
    assert!(
        log.contains("turn records this version cannot read") && log.contains(&k),
        "the reload names the record:\n{log}"
    );

    bed.publish(&reply("c-newer", json!({"message": "again"})))
        .await;
    wait_until(WAIT, "the partition stops on the record", || async {
        second.log_text().contains(&format!(
            "turn record {k} (revision {newer}) is not one this version reads"
        ))
    })
    .await;
    assert!(
        !second.log_text().contains("another owner wrote it"),
        "the error is not taken for another owner's write"
    );
}

/// An operator shortens the projection stream's duplicate window on the live stream (`nats
/// stream edit --dupe-window`) while the workers run configured with the longer default. The
/// owner crashes after storing a timeout's response, before its checkpoint says so; the worker
/// that takes over sends that response again. Its Msg-Id no longer collapses a copy past the
/// stream's own window, so the new owner must look it up by that window, not the one it was
/// configured with.
#[tokio::test]
async fn a_duplicate_window_shortened_on_the_live_stream_is_heeded_at_a_takeover() {
    let bed = Bed::start_with(&[("COLLAB_NATS__PARTITIONS", "1")]).await;
    let mut crashing = bed.projector(&[("COLLAB_TEST_CRASH_AT", "after_publish")]);
    wait_until(WAIT, "the first worker owns the partition", || async {
        crashing.log_text().contains("partition started")
    })
    .await;
    let standby = bed.projector(&[]);
    wait_until(WAIT, "the second worker is up", || async {
        standby.log_text().contains("worker started")
    })
    .await;
    let mut stream = bed.js.get_stream("COLLAB_PROJ").await.expect("stream");
    let mut config = stream.info().await.expect("stream info").config.clone();
    assert!(
        config.duplicate_window > Duration::from_secs(60),
        "{config:?}"
    );
    config.duplicate_window = Duration::from_secs(1);
    bed.js
        .update_stream(config)
        .await
        .expect("the window is shortened");

    let send_seq = bed
        .publish(&send(
            "c-window",
            json!({"message": "anyone?", "timeoutMs": 1000}),
        ))
        .await;
    expect_abort(&mut crashing, "after_publish").await;
    bed.wait_responses(&[key("c-window", "0")]).await;
    bed.settle(&["c-window"]).await;
    let one = one_per_turn(&bed.responses().await, &[key("c-window", "0")]);
    assert_synthesized_timeout(&one[&key("c-window", "0")], send_seq, 1000);
    assert!(
        standby
            .log_text()
            .contains("an output stream's duplicate window changed"),
        "the new window is logged:\n{}",
        standby.log_text()
    );
}

/// A previous owner's decision that lands after the current owner's reload read the turn open
/// (a paused owner that resumes with a decide write still on its way): at the turn's deadline
/// the current owner finds the turn decided by another ownership term. That owner's publishes
/// are fenced off, so its response may never be stored: the current owner publishes it, once,
/// without waiting for a reload.
/// A turn of `conv` opened by a first owner (timeout `timeout_ms`), that owner killed, a second
/// owner started (its reload done: it has answered `c-alive`), then the turn decided as a
/// timeout by another ownership term, as a paused owner's late write lands. The send's raw
/// sequence, and the second owner.
async fn late_decision_after_a_takeover(
    bed: &Bed,
    conv: &str,
    timeout_ms: u32,
) -> (u64, Projector) {
    let mut first = bed.projector(&[]);
    let send_seq = bed
        .publish(&send(
            conv,
            json!({"message": "check the build", "timeoutMs": timeout_ms}),
        ))
        .await;
    let (turn_key, open, open_rev) = open_record(bed, conv).await;
    first.kill9();
    first.wait_exit(WAIT).await;

    // The next owner reloads the turn as open: it answers another turn of the partition only
    // after its reload.
    let second = bed.projector(&[]);
    answer_turn(bed, "c-alive", ("ping", 600_000), "pong").await;
    let deadline = bed.stored_ms(send_seq).await + i64::from(timeout_ms);
    assert!(
        now_ms() < deadline,
        "precondition: the takeover took longer than the turn's timeout"
    );

    // The late write: a timeout decided by another term, compare-and-set on the open record.
    let winner = json!({
        "blocked": "timeout", "synthesized": true, "by": "deadline",
        "atMs": open["deadlineMs"],
    });
    decide_as_another_owner(bed, &turn_key, &open, open_rev, winner).await;
    (send_seq, second)
}

#[tokio::test]
async fn a_late_decision_found_at_the_deadline_is_published_by_the_current_owner() {
    let bed = Bed::start_with(&[("COLLAB_NATS__PARTITIONS", "1")]).await;
    // Long enough for the takeover to happen before the deadline.
    let timeout_ms: u32 = 20_000;
    let (send_seq, _second) =
        late_decision_after_a_takeover(&bed, "c-late-decided", timeout_ms).await;
    bed.wait_responses(&[key("c-late-decided", "0")]).await;
    bed.settle(&["c-late-decided", "c-alive"]).await;
    let one = one_per_turn(
        &bed.responses().await,
        &[key("c-late-decided", "0"), key("c-alive", "0")],
    );
    assert_synthesized_timeout(
        &one[&key("c-late-decided", "0")],
        send_seq,
        u64::from(timeout_ms),
    );
    assert_eq!(one[&key("c-alive", "0")].str("message"), Some("pong"));
}

/// The late decision of the test above, adopted and published by the current owner, then
/// forgotten from its memory of recent decisions (512 later ones): a reply for that turn coming
/// past the projection stream's duplicate window (2 s here) reads the decision back from KV,
/// where no checkpoint vouches for it (another owner wrote it). It must look the response up,
/// as when it adopted it, rather than publish a second one the duplicate window no longer stops.
#[tokio::test]
async fn an_adopted_late_decision_read_back_later_is_not_published_twice() {
    let bed = Bed::start_with(&[
        ("COLLAB_NATS__PARTITIONS", "1"),
        ("COLLAB_PROJECTION__DUPLICATE_WINDOW", "2s"),
    ])
    .await;
    let (_, _second) = late_decision_after_a_takeover(&bed, "c-adopted", 15_000).await;
    bed.wait_responses(&[key("c-adopted", "0")]).await;

    // 600 decisions of the owner's own push the adopted one out of its memory.
    let convs: Vec<String> = (0..600).map(|i| format!("c-many-{i}")).collect();
    for c in &convs {
        bed.publish(&send(c, json!({"message": "go", "timeoutMs": 600_000})))
            .await;
        bed.publish(&reply(c, json!({"message": "done"}))).await;
    }
    let many: Vec<TurnKey> = convs.iter().map(|c| key(c, "0")).collect();
    bed.wait_responses(&many).await;
    // Past the duplicate window, a reply for the adopted turn.
    tokio::time::sleep(Duration::from_secs(3)).await;
    bed.publish(&reply("c-adopted", json!({"message": "done at last"})))
        .await;
    bed.settle(&["c-adopted", "c-alive"]).await;
    let mut expected = many;
    expected.push(key("c-adopted", "0"));
    expected.push(key("c-alive", "0"));
    let one = one_per_turn(&bed.responses().await, &expected);
    assert!(one[&key("c-adopted", "0")].is_blocked());
    let late = bed.suppressed_of("c-adopted").await;
    assert_eq!(
        late.len(),
        1,
        "the late reply is kept, suppressed: {late:#?}"
    );
}

/// A decision a previous owner wrote and died before publishing is found by the next owner's
/// reload and published where its winner (the reply) stands. Once it is stored, that owner's
/// checkpoint vouches for it (its base reaches the decision's revision), so no later owner's
/// reload finds it and publishes it again: takeovers do not grow slower with every crash behind
/// them.
#[tokio::test]
async fn a_decision_found_at_reload_is_vouched_for_once_its_response_is_stored() {
    let bed = Bed::start_with(&[("COLLAB_NATS__PARTITIONS", "1")]).await;
    let mut first = bed.projector(&[]);
    bed.publish(&send(
        "c-found",
        json!({"message": "index it", "timeoutMs": 600_000}),
    ))
    .await;
    let (turn_key, open, open_rev) = open_record(&bed, "c-found").await;
    first.kill9();
    first.wait_exit(WAIT).await;

    // The reply is stored, and a previous owner's decision on it (another ownership term) is
    // written, as one that died before publishing the response would have left it.
    let reply_seq = bed
        .publish(&reply("c-found", json!({"message": "indexed"})))
        .await;
    let winner = json!({
        "seq": reply_seq, "synthesized": false, "by": "a2a.response", "atMs": now_ms(),
    });
    let decided_rev = decide_as_another_owner(&bed, &turn_key, &open, open_rev, winner).await;

    let mut second = bed.projector(&[]);
    bed.wait_responses(&[key("c-found", "0")]).await;
    wait_checkpoint(&bed, "base", decided_rev).await;

    // The next owner has nothing to publish again, and the turn keeps its one response.
    second.kill9();
    second.wait_exit(WAIT).await;
    let _third = bed.projector(&[]);
    answer_turn(&bed, "c-after", ("next", 600_000), "done").await;
    bed.settle(&["c-found", "c-after"]).await;
    let one = one_per_turn(
        &bed.responses().await,
        &[key("c-found", "0"), key("c-after", "0")],
    );
    assert_eq!(one[&key("c-found", "0")].str("message"), Some("indexed"));
    assert!(bed.read(SUPPRESSED).await.is_empty());
}

#[tokio::test]
async fn a_nats_restart_between_decision_and_publish_keeps_exactly_one_response() {
    let mut bed = Bed::start().await;
    let mut crashing = bed.projector(&[("COLLAB_TEST_CRASH_AT", "after_decide")]);
    bed.publish(&send(
        "c-restart",
        json!({"message": "deploy", "timeoutMs": 60_000}),
    ))
    .await;
    bed.publish(&reply("c-restart", json!({"message": "deployed"})))
        .await;
    expect_abort(&mut crashing, "after_decide").await;

    bed.nats.restart().await;
    bed.js = bed.nats.jetstream().await;
    let _p = bed.projector(&[]);
    bed.wait_responses(&[key("c-restart", "0")]).await;
    bed.settle(&["c-restart"]).await;
    let one = one_per_turn(&bed.responses().await, &[key("c-restart", "0")]);
    assert_eq!(one[&key("c-restart", "0")].str("message"), Some("deployed"));
    assert!(bed.read(SUPPRESSED).await.is_empty());
}

/// Decisions reach the turns bucket in the order the partition makes them, so the published
/// checkpoint (the highest revision whose response is stored) never covers a decision made later
/// whose response is not stored yet. Two kinds of decision alternate here: one whose open record
/// was written before its reply (its write waits on the partition's writer for that record's
/// revision) and, right behind it in the same burst, one for a turn answered at once (sent without
/// the writer's hop when the writer has nothing queued). Their revisions must follow the raw order
/// of the replies that decided them.
#[tokio::test]
async fn decisions_are_stored_in_the_order_they_are_made() {
    let bed = Bed::start_with(&[
        ("COLLAB_NATS__PARTITIONS", "1"),
        ("COLLAB_TURNS__OPEN_WRITE_DELAY", "2ms"),
    ])
    .await;
    let _worker = bed.projector(&[]);
    let ask = json!({"message": "look it up", "timeoutMs": 600_000});
    let answer = json!({"message": "found it"});
    let mut turns = Vec::new();
    for i in 0..80 {
        let (waits, quick) = (format!("c-waits-{i}"), format!("c-quick-{i}"));
        bed.publish(&send(&waits, ask.clone())).await;
        // Long enough for the open record to be written before the reply comes.
        tokio::time::sleep(Duration::from_millis(8)).await;
        // The reply and the next whole turn in one burst: the partition takes them back to back.
        let mut acks = Vec::new();
        for ev in [
            reply(&waits, answer.clone()),
            send(&quick, ask.clone()),
            reply(&quick, answer.clone()),
        ] {
            acks.push(bed.send_raw(&ev).await);
        }
        for ack in acks {
            ack.await.expect("raw publish was not acknowledged");
        }
        turns.push(key(&waits, "0"));
        turns.push(key(&quick, "0"));
    }
    bed.wait_responses(&turns).await;

    let mut decided: Vec<(u64, u64, String)> = turn_records(&bed.js)
        .await
        .into_iter()
        .filter(|(_, v, _)| v["state"] == "decided")
        .map(|(k, v, revision)| {
            let winner = v["winner"]["seq"]
                .as_u64()
                .unwrap_or_else(|| panic!("decided record {k} names no winner: {v}"));
            (winner, revision, k)
        })
        .collect();
    assert_eq!(decided.len(), turns.len(), "one decided record per turn");
    decided.sort();
    for pair in decided.windows(2) {
        assert!(
            pair[0].1 < pair[1].1,
            "the decision by raw seq {} ({}) was stored at revision {}, after the one by raw seq {} ({}) at revision {}",
            pair[0].0,
            pair[0].2,
            pair[0].1,
            pair[1].0,
            pair[1].2,
            pair[1].1
        );
    }
    one_per_turn(&bed.responses().await, &turns);
}

#[tokio::test]
async fn a_reply_stored_before_the_deadline_wins_when_processed_after_it() {
    let bed = Bed::start().await;
    // No projector yet: both are stored, nothing is processed.
    let send_seq = bed
        .publish(&send(
            "c-event",
            json!({"message": "quick one", "timeoutMs": 1000}),
        ))
        .await;
    let reply_seq = bed
        .publish(&reply("c-event", json!({"message": "in time"})))
        .await;
    let deadline = bed.stored_ms(send_seq).await + 1000;
    let reply_stored = bed.stored_ms(reply_seq).await;
    assert!(
        reply_stored < deadline,
        "precondition: the reply was stored {}ms after the send",
        reply_stored - (deadline - 1000)
    );
    sleep_until_ms(deadline + 1000).await;

    let _p = bed.projector(&[]);
    bed.wait_responses(&[key("c-event", "0")]).await;
    bed.settle(&["c-event"]).await;
    let one = one_per_turn(&bed.responses().await, &[key("c-event", "0")]);
    let r = &one[&key("c-event", "0")];
    assert!(
        !r.is_blocked(),
        "the in-time reply lost to the deadline: {:#}",
        r.body
    );
    assert_eq!(r.str("message"), Some("in time"));
    assert!(bed.read(SUPPRESSED).await.is_empty());
}

// ---------------------------------------------------------------------------------------------
// Many turns, with a worker killed in the middle.

struct Planned {
    send_seq: u64,
    replies: Vec<(u64, String)>,
}

#[tokio::test]
async fn many_turns_with_a_worker_killed_midway_get_exactly_one_response_each() {
    const CONVS: usize = 20;
    const TURNS: u32 = 10;
    const TIMEOUT_MS: i64 = 5000;
    let seed: u64 = std::env::var("TURNS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("many_turns seed: {seed} (rerun with TURNS_SEED={seed})");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);

    let bed = Bed::start().await;
    let convs: Vec<String> = (0..CONVS).map(|i| format!("c-many-{i:02}")).collect();
    let mut plan: BTreeMap<TurnKey, Planned> = BTreeMap::new();
    let mut first = bed.projector(&[]);
    for t in 1..=TURNS {
        for conv in &convs {
            let send_seq = bed
                .publish(&send(
                    conv,
                    json!({"turn": t, "message": format!("task {t}"), "timeoutMs": TIMEOUT_MS}),
                ))
                .await;
            let mut replies = Vec::new();
            if rng.random_bool(0.6) {
                let copies = if rng.random_bool(0.3) { 2 } else { 1 };
                for copy in 0..copies {
                    let text = format!("answer {conv} {t} #{copy}");
                    let seq = bed
                        .publish(&reply(conv, json!({"turn": t, "message": text})))
                        .await;
                    replies.push((seq, text));
                }
            }
            plan.insert(key(conv, &t.to_string()), Planned { send_seq, replies });
        }
        if t == TURNS / 2 {
            // Kill the worker once it is busy, then publish the rest while it is down.
            bed.wait_read(RESPONSES, "the first worker has published responses", |m| {
                m.len() >= 20
            })
            .await;
            first.kill9();
            first.wait_exit(WAIT).await;
        }
    }
    let _second = bed.projector(&[]);
    let expected: Vec<TurnKey> = plan.keys().cloned().collect();
    bed.wait_responses(&expected).await;
    let conv_refs: Vec<&str> = convs.iter().map(String::as_str).collect();
    bed.settle(&conv_refs).await;

    let responses = bed.read(RESPONSES).await;
    let one = one_per_turn(&responses, &expected);
    let suppressed = group(&bed.read(SUPPRESSED).await, Proj::winner_key);
    for (k, planned) in &plan {
        let r = &one[k];
        let deadline = bed.stored_ms(planned.send_seq).await + TIMEOUT_MS;
        let first_reply = match planned.replies.first() {
            Some((seq, text)) if bed.stored_ms(*seq).await < deadline => Some(text),
            _ => None,
        };
        let got = suppressed.get(k).map(Vec::as_slice).unwrap_or_default();
        let reasons: Vec<Option<&str>> = got.iter().map(|s| s.str("reason")).collect();
        match first_reply {
            Some(text) => {
                assert_eq!(
                    r.str("message"),
                    Some(text.as_str()),
                    "turn {k:?}: {:#}",
                    r.body
                );
                assert!(!r.is_blocked(), "turn {k:?}: {:#}", r.body);
                let want = vec![Some("duplicate"); planned.replies.len() - 1];
                assert_eq!(reasons, want, "suppressed of answered turn {k:?}");
            }
            None => {
                assert_synthesized_timeout(r, planned.send_seq, 5000);
                let want = vec![Some("late"); planned.replies.len()];
                assert_eq!(reasons, want, "suppressed of blocked turn {k:?}");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// A2A wire traffic (docs/contract.md section 2a): JSON-RPC v0.3 / v1.0 and HTTP+JSON bodies as a relay publishes
// them, one request one turn.
// ---------------------------------------------------------------------------------------------

/// A2A v0.3 or v1.0 bodies for one exchange.
#[derive(Clone, Copy, Debug)]
enum Wire {
    V03,
    V10,
}

impl Wire {
    fn send(self, ctx: &str, text: &str) -> Value {
        match self {
            Wire::V03 => json!({"jsonrpc": "2.0", "id": 1, "method": "message/send", "params": {
                "message": {"kind": "message", "role": "user", "messageId": format!("m-{ctx}"),
                    "contextId": ctx, "parts": [{"kind": "text", "text": text}]}}}),
            Wire::V10 => json!({"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": {
                "message": {"role": "ROLE_USER", "messageId": format!("m-{ctx}"),
                    "contextId": ctx, "parts": [{"text": text}]}}}),
        }
    }

    /// A status frame (or final task) in `state` (kebab-case; v1.0 spells it as its enum).
    fn status(self, ctx: &str, state: &str, text: &str) -> Value {
        match self {
            Wire::V03 => json!({"jsonrpc": "2.0", "id": 1, "result": {"kind": "status-update",
                "taskId": "t1", "contextId": ctx, "final": state != "working",
                "status": {"state": state, "message": {"kind": "message", "role": "agent",
                    "messageId": "a1", "parts": [{"kind": "text", "text": text}]}}}}),
            Wire::V10 => json!({"jsonrpc": "2.0", "id": 1, "result": {"statusUpdate": {
                "taskId": "t1", "contextId": ctx,
                "status": {"state": format!("TASK_STATE_{}", state.to_uppercase().replace('-', "_")),
                    "message": {"role": "ROLE_AGENT", "messageId": "a1", "parts": [{"text": text}]}}}}}),
        }
    }

    fn error(self, code: i64) -> Value {
        json!({"jsonrpc": "2.0", "id": 1, "error": {"code": code, "message": "no such task"}})
    }
}

impl Bed {
    /// Publish an A2A wire body of exchange `exchange` under `key` with the relay's headers.
    async fn publish_wire(&self, key: &str, exchange: &str, method: &str, body: &Value) -> u64 {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Collab-From-Agent", "ruda");
        headers.insert("Collab-To-Agent", "eden");
        headers.insert("Collab-Exchange", exchange);
        headers.insert("Collab-A2A-Method", method);
        let bytes = serde_json::to_vec(body).expect("a body serialises");
        self.js
            .publish_with_headers(format!("collab.raw.{key}.a2a.wire"), headers, bytes.into())
            .await
            .expect("raw publish was not sent")
            .await
            .expect("raw publish was not acknowledged")
            .sequence
    }
}

#[tokio::test]
async fn a2a_wire_exchanges_get_exactly_one_response_each_in_both_versions() {
    let bed = Bed::start().await;
    let _p = bed.projector(&[]);
    let mut expected = Vec::new();
    let mut outcomes: Vec<(TurnKey, &str, &str)> = Vec::new();
    for (v, tag) in [(Wire::V03, "v03"), (Wire::V10, "v10")] {
        let method = match v {
            Wire::V03 => "message/send",
            Wire::V10 => "SendMessage",
        };
        // completed after a working frame; input-required; failed; unknown task; silence.
        let cases: [(&str, Vec<Value>, &str); 5] = [
            (
                "done",
                vec![
                    v.status("x", "working", "on it"),
                    v.status("x", "completed", "here is the checklist"),
                    v.status("x", "completed", "a duplicate final frame"),
                ],
                "completed",
            ),
            (
                "ask",
                vec![v.status("x", "input-required", "which release?")],
                "input-required",
            ),
            ("fail", vec![v.status("x", "failed", "disk full")], "error"),
            ("gone", vec![v.error(-32001)], "not_found"),
            ("mute", vec![], "timeout"),
        ];
        for (case, answers, outcome) in cases {
            let ctx = format!("ctx-{tag}-{case}");
            let exchange = format!("ex-{tag}-{case}");
            bed.publish_wire(
                &ctx,
                &exchange,
                method,
                &v.send(&ctx, "prepare the release"),
            )
            .await;
            for a in answers {
                let body = serde_json::to_string(&a)
                    .expect("serialises")
                    .replace("\"x\"", &format!("\"{ctx}\""));
                let body: Value = serde_json::from_str(&body).expect("parses");
                bed.publish_wire(&ctx, &exchange, method, &body).await;
            }
            expected.push(key(&ctx, &exchange));
            outcomes.push((key(&ctx, &exchange), outcome, method));
        }
    }
    bed.wait_responses(&expected).await;
    let convs: Vec<String> = expected.iter().map(|(c, _)| c.clone()).collect();
    let conv_refs: Vec<&str> = convs.iter().map(String::as_str).collect();
    bed.settle(&conv_refs).await;
    let all = bed.responses().await;
    let wire: Vec<Proj> = all
        .into_iter()
        .filter(|r| r.turn_key().1.starts_with("ex-"))
        .collect();
    let one = one_per_turn(&wire, &expected);
    for (k, outcome, method) in outcomes {
        let r = &one[&k];
        match outcome {
            "completed" | "input-required" => {
                assert!(!r.is_blocked(), "{k:?}: {r:#?}");
                assert_eq!(r.str("state"), Some(outcome), "{k:?}");
            }
            reason => {
                assert!(r.is_blocked(), "{k:?} must be blocked: {r:#?}");
                assert_eq!(r.str("reason"), Some(reason), "{k:?}");
                assert_eq!(
                    r.payload()["synthesized"],
                    reason == "timeout",
                    "{k:?}: only the timeout is synthesised"
                );
                // The next action speaks A2A: the agent, the context, the method to retry with.
                let next = r.str("next_action").unwrap_or_default();
                assert!(next.contains("eden"), "{k:?}: {next}");
                assert!(next.contains(&k.0), "{k:?}: {next}");
                assert!(next.contains(method), "{k:?}: {next}");
            }
        }
    }
    // The duplicate final frame of each completed exchange is kept, suppressed.
    for tag in ["v03", "v10"] {
        let ctx = format!("ctx-{tag}-done");
        let suppressed = bed.suppressed_of(&ctx).await;
        assert_eq!(suppressed.len(), 1, "{ctx}: {suppressed:#?}");
        assert_eq!(suppressed[0].str("reason"), Some("duplicate"));
    }
    // The working frames are task progress, never a response.
    let progress = bed
        .read("collab.proj.orchestration.task.*.task.updated")
        .await;
    assert_eq!(progress.len(), 2, "{progress:#?}");
    // The work session of an A2A context groups its turns (its id is the contextId).
    let sessions = bed
        .js
        .get_key_value("collab_work_sessions")
        .await
        .expect("the sessions bucket exists");
    let key = collab_projector::bus::sessions::session_key("ctx-v10-done");
    let mut session = None;
    let deadline = Instant::now() + WAIT;
    while session.is_none() && Instant::now() < deadline {
        session = sessions.get(&key).await.ok().flatten();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let session: Value =
        serde_json::from_slice(&session.expect("a work session for the context")).expect("JSON");
    assert!(session.to_string().contains("ctx-v10-done"), "{session:#}");
}

#[tokio::test]
async fn a2a_stream_frames_before_between_and_after_the_deadline() {
    // Turn timeout 2 s (RUN_ARGS). One exchange per version: a working frame before the
    // deadline, the final frame after it. The working frame is progress, the deadline gives a
    // blocked timeout, and the late final frame is kept, suppressed `late`.
    let bed = Bed::start().await;
    let _p = bed.projector(&[]);
    let mut keys = Vec::new();
    for (v, tag, method) in [
        (Wire::V03, "v03", "message/stream"),
        (Wire::V10, "v10", "SendStreamingMessage"),
    ] {
        let ctx = format!("ctx-late-{tag}");
        let exchange = format!("ex-late-{tag}");
        let send_seq = bed
            .publish_wire(
                &ctx,
                &exchange,
                method,
                &v.send(&ctx, "summarise the incident"),
            )
            .await;
        let working = v.status(&ctx, "working", "reading the logs");
        bed.publish_wire(&ctx, &exchange, method, &working).await;
        let sent = bed.stored_ms(send_seq).await;
        sleep_until_ms(sent + 2_600).await;
        bed.publish_wire(
            &ctx,
            &exchange,
            method,
            &v.status(&ctx, "completed", "too late"),
        )
        .await;
        keys.push(key(&ctx, &exchange));
    }
    bed.wait_responses(&keys).await;
    let convs: Vec<String> = keys.iter().map(|(c, _)| c.clone()).collect();
    let conv_refs: Vec<&str> = convs.iter().map(String::as_str).collect();
    bed.settle(&conv_refs).await;
    let wire: Vec<Proj> = bed
        .responses()
        .await
        .into_iter()
        .filter(|r| r.turn_key().1.starts_with("ex-late-"))
        .collect();
    let one = one_per_turn(&wire, &keys);
    for k in &keys {
        let r = &one[k];
        assert!(r.is_blocked(), "{k:?}: {r:#?}");
        assert_eq!(r.str("reason"), Some("timeout"));
        let late = bed.suppressed_of(&k.0).await;
        assert_eq!(late.len(), 1, "{k:?}: {late:#?}");
        assert_eq!(late[0].str("reason"), Some("late"));
    }
    let progress = bed
        .read("collab.proj.orchestration.task.*.task.updated")
        .await;
    assert_eq!(
        progress.len(),
        2,
        "one working frame per exchange: {progress:#?}"
    );
}

/// A streamed answer's artifacts are read back from the raw stream only when the exchange
/// streamed some: the partition that processed the send saw every frame after it, so an answer
/// after a `working` frame alone is published without a read, and one after an artifact carries
/// it. The reads are counted where they go, on the raw stream's `STREAM.MSG.GET` subject.
#[tokio::test]
async fn a_streamed_answer_reads_the_raw_stream_only_when_artifacts_were_streamed() {
    let bed = Bed::start().await;
    let client = bed.js.client();
    let mut gets = client
        .subscribe("$JS.API.STREAM.MSG.GET.COLLAB_RAW")
        .await
        .expect("subscribed to the raw stream's message gets");
    client.flush().await.expect("the subscription is in place");
    let _p = bed.projector(&[]);
    let method = "message/stream";
    let (plain, with_artifact) = ("ctx-frames-only", "ctx-frames-artifact");
    for ctx in [plain, with_artifact] {
        let exchange = format!("ex-{ctx}");
        let mut frames = vec![
            Wire::V03.send(ctx, "write the report"),
            Wire::V03.status(ctx, "working", "on it"),
        ];
        if ctx == with_artifact {
            frames.push(json!({"jsonrpc": "2.0", "id": 1, "result": {"kind": "artifact-update",
                "taskId": "t1", "contextId": ctx, "lastChunk": true,
                "artifact": {"artifactId": "report", "parts": [{"kind": "text", "text": "the report"}]}}}));
        }
        frames.push(Wire::V03.status(ctx, "completed", "done"));
        for frame in &frames {
            bed.publish_wire(ctx, &exchange, method, frame).await;
        }
    }
    let keys = [
        key(plain, &format!("ex-{plain}")),
        key(with_artifact, &format!("ex-{with_artifact}")),
    ];
    bed.wait_responses(&keys).await;
    bed.settle(&[plain, with_artifact]).await;

    let one = one_per_turn(&bed.responses().await, &keys);
    let artifacts = |k: &TurnKey| one[k].payload()["artifacts"].as_array().map(Vec::len);
    assert_eq!(artifacts(&keys[0]), None, "{:#}", one[&keys[0]].body);
    assert_eq!(artifacts(&keys[1]), Some(1), "{:#}", one[&keys[1]].body);
    for k in &keys {
        assert_eq!(one[k].str("state"), Some("completed"), "{:#}", one[k].body);
    }
    let mut requests = Vec::new();
    while let Ok(Some(m)) = tokio::time::timeout(Duration::from_millis(200), gets.next()).await {
        requests.push(String::from_utf8_lossy(&m.payload).into_owned());
    }
    let naming = |ctx: &str| {
        requests
            .iter()
            .filter(|r| r.contains(&format!(".{ctx}.")))
            .count()
    };
    assert_eq!(naming(plain), 0, "{requests:#?}");
    assert!(naming(with_artifact) > 0, "{requests:#?}");
}

/// A streamed answer whose artifacts together are larger than NATS takes in one message (each
/// frame well under it): its one response carries them, moved to the object store, instead of
/// becoming a `too_large` dead letter that leaves the turn without a response.
#[tokio::test]
async fn a_streamed_answer_larger_than_a_message_is_still_the_turns_one_response() {
    let bed = Bed::start().await;
    let _p = bed.projector(&[]);
    let (ctx, exchange, method) = ("ctx-big-stream", "ex-big-stream", "message/stream");
    bed.publish_wire(
        ctx,
        exchange,
        method,
        &Wire::V03.send(ctx, "write the report"),
    )
    .await;
    // Six chunks of 200 KB: 1.2 MB of artifacts, and the same text again as the answer's message.
    let chunks: Vec<String> = (0..6)
        .map(|i| format!("chunk {i}: ") + &char::from(b'a' + i).to_string().repeat(200_000))
        .collect();
    for (i, text) in chunks.iter().enumerate() {
        let frame = json!({"jsonrpc": "2.0", "id": 1, "result": {"kind": "artifact-update",
            "taskId": "t1", "contextId": ctx, "append": i > 0, "lastChunk": i == 5,
            "artifact": {"artifactId": "report", "parts": [{"kind": "text", "text": text}]}}});
        bed.publish_wire(ctx, exchange, method, &frame).await;
    }
    let done = json!({"jsonrpc": "2.0", "id": 1, "result": {"kind": "status-update",
        "taskId": "t1", "contextId": ctx, "final": true, "status": {"state": "completed"}}});
    bed.publish_wire(ctx, exchange, method, &done).await;
    let k = key(ctx, exchange);
    bed.wait_responses(std::slice::from_ref(&k)).await;
    bed.settle(&[ctx]).await;

    let one = one_per_turn(&bed.responses().await, std::slice::from_ref(&k));
    let r = &one[&k];
    assert!(!r.is_blocked(), "{:#}", r.body);
    assert_eq!(r.str("state"), Some("completed"), "{:#}", r.body);
    let dead: Vec<String> = crate::pipeline::read_all(&bed.js, "COLLAB_DLQ", "collab.dlq.>")
        .await
        .into_iter()
        .map(|m| m.subject)
        .collect();
    assert!(dead.is_empty(), "dead letters: {dead:?}");

    // The message and each artifact's text are references to stored objects: every chunk, in
    // order, is there.
    let blobs = bed
        .js
        .get_object_store("collab_blobs")
        .await
        .expect("the blob store exists");
    let fetch = async |reference: &Value| -> String {
        let id = reference["$ref"]
            .as_str()
            .and_then(|s| s.strip_prefix("blob:"))
            .unwrap_or_else(|| panic!("not a blob reference: {reference:#} in {:#}", r.body))
            .to_string();
        let mut object = blobs
            .get(&id)
            .await
            .unwrap_or_else(|e| panic!("blob {id}: {e}"));
        let mut bytes = Vec::new();
        tokio::io::AsyncReadExt::read_to_end(&mut object, &mut bytes)
            .await
            .expect("the blob reads back");
        String::from_utf8(bytes).expect("UTF-8")
    };
    assert_eq!(fetch(&r.payload()["message"]).await, chunks.concat());
    let artifacts = r.payload()["artifacts"]
        .as_array()
        .unwrap_or_else(|| panic!("no artifacts: {:#}", r.body));
    let mut texts = Vec::new();
    for a in artifacts {
        texts.push(fetch(&a["parts"][0]["text"]).await);
    }
    assert_eq!(texts, chunks);
}

/// A worker paused past its lease wakes with an open record still deferred (its write waits
/// `turns.open_write_delay`) and its timers due. Its partition has another owner meanwhile,
/// which may have loaded the partition's records already; turn records carry no fence, so a
/// write from the paused worker would land unseen by that owner (who then lets a late reply win).
/// It must write nothing, and leave the send unacknowledged for the partition's next owner.
#[tokio::test]
async fn a_worker_paused_past_its_lease_writes_no_turn_record_when_it_wakes() {
    let settings = [
        ("COLLAB_NATS__PARTITIONS", "1"),
        ("COLLAB_WORKERS__LEASE_TTL", "2s"),
        ("COLLAB_TURNS__OPEN_WRITE_DELAY", "1600ms"),
    ];
    let bed = Bed::start_with(&settings).await;
    let mut paused = bed.projector(&[]);
    bed.publish_projected_send(
        "c-paused",
        json!({"message": "asked before the pause", "timeoutMs": 3_600_000}),
    )
    .await;
    paused.sigstop();
    assert!(
        turn_record(&bed.js, "c-paused").await.is_none(),
        "the open record was written before the pause (open_write_delay too short for this machine)"
    );

    // Past the lease's expiry, another owner holds the partition's lease: the test holds it,
    // renewing it, so the paused worker cannot take it back.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let leases = bed
        .js
        .get_key_value("collab_leases")
        .await
        .expect("the lease bucket exists");
    let mut revision = leases
        .create("l.0", "another-owner".into())
        .await
        .expect("the expired lease can be taken");
    paused.sigcont();
    let until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(400)).await;
        revision = leases
            .update("l.0", "another-owner".into(), revision)
            .await
            .expect("the test keeps its lease");
    }
    assert_eq!(
        turn_record(&bed.js, "c-paused").await,
        None,
        "the paused worker wrote a turn record after its lease was taken; its log:\n{}",
        paused.log_text()
    );
    assert!(
        paused
            .log_text()
            .contains("lease lost; stopping the partition")
            || paused.log_text().contains("the lease may have lapsed"),
        "the paused worker did not notice its lease was gone; its log:\n{}",
        paused.log_text()
    );

    // Given the lease back, the worker takes the send over again and writes its record then.
    leases
        .delete_expect_revision("l.0", Some(revision))
        .await
        .expect("the test hands its lease back");
    wait_until(WAIT, "the worker writes the open record itself", || async {
        turn_record(&bed.js, "c-paused").await.is_some()
    })
    .await;
    bed.settle(&["c-paused"]).await;
}
