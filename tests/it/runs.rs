//! The run contract (docs/contract.md section 2b) end to end: AG-UI events published on `collab.raw.<thread>.agui`,
//! the real `collab-projector` binary with `runs.timeout` = 2 s, and every run's one terminal read
//! back from `COLLAB_PROJ`.
//!
//! A timeout fires through the idle partition's barrier (nothing else is published on its
//! partition), so the tests wait for what the contract promises, then for every partition
//! consumer to be drained and a further run timeout to pass, and count only then: a second
//! terminal would have had its chance to appear.

use std::time::{Duration, Instant};

use async_nats::jetstream;
use futures::StreamExt;
use serde_json::{json, Value};

use crate::pipeline::{read_all, Stored, PROJ};
use crate::support::{Projector, TestNats};

const TIMEOUT: Duration = Duration::from_secs(2);
const ENV: [(&str, &str); 3] = [
    ("COLLAB_CONSUMER__ACK_WAIT", "5s"),
    ("COLLAB_RUNS__TIMEOUT", "2s"),
    ("RUST_LOG", "info,collab_projector=debug"),
];
/// Guards against hangs only.
const WAIT: Duration = Duration::from_secs(90);

struct Bed {
    nats: TestNats,
    js: jetstream::Context,
    projector: Projector,
}

impl Bed {
    async fn start() -> Bed {
        Bed::start_with(&[]).await
    }

    /// A bed whose first projector also has `extra` in its environment.
    async fn start_with(extra: &[(&str, &str)]) -> Bed {
        let nats = TestNats::start().await;
        crate::support::provision_with_binary(&nats.url(), ENV);
        let js = nats.jetstream().await;
        let projector = Bed::spawn(&nats, extra);
        Bed {
            nats,
            js,
            projector,
        }
    }

    fn spawn(nats: &TestNats, extra: &[(&str, &str)]) -> Projector {
        let mut env = ENV.to_vec();
        env.extend_from_slice(extra);
        Projector::spawn(&nats.url(), &["--main-agents", "ruda,eden"], &env)
    }

    /// Publish an AG-UI event on `collab.raw.<thread>.agui`, with a `Collab-Run-Id` header when
    /// given; its raw sequence.
    async fn publish(&self, thread: &str, ev: Value, run_header: Option<&str>) -> u64 {
        let subject = format!("collab.raw.{thread}.agui");
        let bytes = serde_json::to_vec(&ev).expect("an event serialises");
        let ack = match run_header {
            Some(run) => {
                let mut h = async_nats::HeaderMap::new();
                h.insert("Collab-Run-Id", run);
                self.js.publish_with_headers(subject, h, bytes.into()).await
            }
            None => self.js.publish(subject, bytes.into()).await,
        };
        ack.expect("raw publish was not sent")
            .await
            .expect("raw publish was not acknowledged")
            .sequence
    }

    /// Every projection of a thread, in stream order.
    async fn thread(&self, thread: &str) -> Vec<Stored> {
        read_all(&self.js, PROJ, &format!("collab.proj.*.*.{thread}.>")).await
    }

    async fn wait_for(&self, thread: &str, what: &str, done: impl Fn(&[Stored]) -> bool) {
        let deadline = Instant::now() + WAIT;
        loop {
            let msgs = self.thread(thread).await;
            if done(&msgs) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting until {what}; thread {thread} holds {:#?}",
                msgs.iter().map(summary).collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Wait until every partition consumer has delivered and had acknowledged everything, then
    /// one more run timeout, so nothing the contract would still publish is missing.
    async fn settle(&self) {
        let deadline = Instant::now() + WAIT;
        loop {
            if self.drained().await {
                break;
            }
            assert!(Instant::now() < deadline, "the consumers never drained");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        tokio::time::sleep(TIMEOUT + Duration::from_secs(1)).await;
    }

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
}

/// (subject, agUiType, Msg-Id) of a projection, for assertions and failure messages.
fn summary(m: &Stored) -> (String, String, String) {
    let body = m.json();
    (
        m.subject.clone(),
        body["payload"]["agUiType"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        m.header("Nats-Msg-Id").unwrap_or_default(),
    )
}

fn is_terminal(m: &Stored) -> bool {
    m.subject.ends_with(".run.finished") || m.subject.ends_with(".run.failed")
}

fn terminals(msgs: &[Stored]) -> Vec<&Stored> {
    msgs.iter().filter(|m| is_terminal(m)).collect()
}

fn suppressed(msgs: &[Stored]) -> Vec<&Stored> {
    msgs.iter()
        .filter(|m| m.subject.ends_with(".run.terminal.suppressed"))
        .collect()
}

fn started(thread: &str, run: &str) -> Value {
    json!({"type": "RUN_STARTED", "threadId": thread, "runId": run, "timestamp": 1})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_a_finished_run_has_its_run_finished_exactly_once() {
    let bed = Bed::start().await;
    let t = "th-finished";
    bed.publish(t, started(t, "r1"), None).await;
    bed.publish(
        t,
        json!({"type": "TEXT_MESSAGE_START", "messageId": "m1", "role": "assistant"}),
        None,
    )
    .await;
    bed.publish(
        t,
        json!({"type": "TEXT_MESSAGE_CONTENT", "messageId": "m1", "delta": "hi"}),
        None,
    )
    .await;
    bed.publish(
        t,
        json!({"type": "TEXT_MESSAGE_END", "messageId": "m1"}),
        None,
    )
    .await;
    let fin = bed
        .publish(
            t,
            json!({"type": "RUN_FINISHED", "threadId": t, "runId": "r1"}),
            None,
        )
        .await;
    bed.wait_for(t, "the run finished", |m| !terminals(m).is_empty())
        .await;
    bed.settle().await;
    let msgs = bed.thread(t).await;
    let ts = terminals(&msgs);
    assert_eq!(
        ts.len(),
        1,
        "{:#?}",
        msgs.iter().map(summary).collect::<Vec<_>>()
    );
    let f = ts[0];
    assert_eq!(
        f.subject,
        format!("collab.proj.system.observability.{t}.run.finished")
    );
    assert_eq!(
        f.header("Nats-Msg-Id").as_deref(),
        Some(format!("run:{t}:r1").as_str())
    );
    assert_eq!(f.json()["rawEventRef"]["seq"], fin);
    assert_eq!(f.json()["payload"]["agUiType"], "RUN_FINISHED");
    assert!(suppressed(&msgs).is_empty());
    // Every event once, and before the message's end the text its redaction held back (the
    // last word of a stream is held until the stream ends, so a secret split over deltas is
    // caught whole): the deltas still assemble the message as sent.
    let flushes: Vec<&Stored> = msgs
        .iter()
        .filter(|m| m.json()["payload"]["redactionFlush"] == json!(true))
        .collect();
    assert_eq!(
        msgs.len() - flushes.len(),
        5,
        "every event once: {:#?}",
        msgs.iter().map(summary).collect::<Vec<_>>()
    );
    let text: String = msgs
        .iter()
        .filter(|m| m.subject.ends_with(".text.delta"))
        .filter_map(|m| m.json()["payload"]["delta"].as_str().map(String::from))
        .collect();
    assert_eq!(
        text,
        "hi",
        "{:#?}",
        msgs.iter().map(summary).collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_a_failed_run_has_its_own_run_error_and_it_ties_to_the_open_run() {
    let bed = Bed::start().await;
    let t = "th-failed";
    bed.publish(t, started(t, "r1"), None).await;
    // AG-UI's RUN_ERROR names no run: the thread's open run is the one it ends.
    let err = bed
        .publish(
            t,
            json!({"type": "RUN_ERROR", "message": "model overloaded", "code": "503"}),
            None,
        )
        .await;
    bed.wait_for(t, "the run failed", |m| !terminals(m).is_empty())
        .await;
    // A second run whose RUN_ERROR is tied to it by the relay's header.
    bed.publish(t, started(t, "r2"), None).await;
    let err2 = bed
        .publish(
            t,
            json!({"type": "RUN_ERROR", "message": "tool crashed"}),
            Some("r2"),
        )
        .await;
    bed.wait_for(t, "the second run failed", |m| terminals(m).len() >= 2)
        .await;
    bed.settle().await;
    let msgs = bed.thread(t).await;
    let ts = terminals(&msgs);
    assert_eq!(
        ts.len(),
        2,
        "{:#?}",
        msgs.iter().map(summary).collect::<Vec<_>>()
    );
    for (f, run, seq, text) in [
        (ts[0], "r1", err, "model overloaded"),
        (ts[1], "r2", err2, "tool crashed"),
    ] {
        assert_eq!(
            f.subject,
            format!("collab.proj.system.observability.{t}.run.failed")
        );
        assert_eq!(f.header("Nats-Msg-Id"), Some(format!("run:{t}:{run}")));
        let body = f.json();
        assert_eq!(body["rawEventRef"]["seq"], seq);
        assert_eq!(body["payload"]["agUiType"], "RUN_ERROR");
        assert_eq!(body["payload"]["message"], text);
        assert!(
            body["payload"].get("synthesized").is_none(),
            "a real RUN_ERROR"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_an_abandoned_run_gets_ends_then_run_failed_timeout() {
    let bed = Bed::start().await;
    let t = "th-abandoned";
    let start = bed.publish(t, started(t, "r1"), None).await;
    bed.publish(
        t,
        json!({"type": "TEXT_MESSAGE_START", "messageId": "m1", "role": "assistant"}),
        None,
    )
    .await;
    bed.publish(
        t,
        json!({"type": "TEXT_MESSAGE_CONTENT", "messageId": "m1", "delta": "half a"}),
        None,
    )
    .await;
    bed.publish(
        t,
        json!({"type": "TOOL_CALL_START", "toolCallId": "c1", "toolCallName": "search"}),
        None,
    )
    .await;
    bed.publish(
        t,
        json!({"type": "TOOL_CALL_START", "toolCallId": "c2", "toolCallName": "fetch"}),
        None,
    )
    .await;
    bed.publish(
        t,
        json!({"type": "TOOL_CALL_END", "toolCallId": "c2"}),
        None,
    )
    .await;
    bed.wait_for(t, "the run timed out", |m| !terminals(m).is_empty())
        .await;
    bed.settle().await;
    let msgs = bed.thread(t).await;
    let ts = terminals(&msgs);
    assert_eq!(
        ts.len(),
        1,
        "{:#?}",
        msgs.iter().map(summary).collect::<Vec<_>>()
    );
    let f = ts[0].json();
    assert_eq!(
        ts[0].subject,
        format!("collab.proj.system.observability.{t}.run.failed")
    );
    assert_eq!(f["payload"]["agUiType"], "RUN_ERROR");
    assert_eq!(f["payload"]["reason"], "timeout");
    assert_eq!(f["payload"]["synthesized"], true);
    assert_eq!(f["runId"], "r1");
    assert_eq!(f["threadId"], t);
    assert_eq!(f["payload"]["evidence"][0]["rawSeq"], start);
    assert_eq!(f["payload"]["evidence"][1]["kind"], "deadline");
    // The ends come right before the run.failed, one per open message and tool call.
    let synthesised: Vec<(String, String, String)> = msgs
        .iter()
        .filter(|m| m.json()["payload"]["synthesized"] == true)
        .map(summary)
        .collect();
    assert_eq!(
        synthesised,
        vec![
            (
                format!("collab.proj.system.observability.{t}.text.final"),
                "TEXT_MESSAGE_END".to_string(),
                format!("run:{t}:r1:end:message:m1")
            ),
            (
                format!("collab.proj.system.observability.{t}.tool.args"),
                "TOOL_CALL_END".to_string(),
                format!("run:{t}:r1:end:tool:c1")
            ),
            (
                format!("collab.proj.system.observability.{t}.run.failed"),
                "RUN_ERROR".to_string(),
                format!("run:{t}:r1")
            ),
        ]
    );
    let end = msgs
        .iter()
        .find(|m| m.subject.ends_with(".text.final"))
        .map(Stored::json)
        .unwrap_or_default();
    assert_eq!(end["messageId"], "m1");
    // The message's text arrives whole: what the stream redactor held back (its last word) is
    // published by one more delta, marked as a flush, right before the synthesised end.
    let deltas: Vec<Value> = msgs
        .iter()
        .map(Stored::json)
        .filter(|e| e["messageId"] == "m1" && e["payload"]["agUiType"] == "TEXT_MESSAGE_CONTENT")
        .collect();
    let text: String = deltas
        .iter()
        .filter_map(|e| e["payload"]["delta"].as_str())
        .collect();
    assert_eq!(text, "half a", "{deltas:#?}");
    let held = deltas.last().cloned().unwrap_or_default();
    assert_eq!(held["payload"]["redactionFlush"], true, "{deltas:#?}");
    let order: Vec<String> = msgs.iter().map(summary).map(|(_, _, id)| id).collect();
    let at = |id: &str| order.iter().position(|o| o == id);
    assert_eq!(
        at(&format!("run:{t}:r1:end:message:m1:held")).map(|i| i + 1),
        at(&format!("run:{t}:r1:end:message:m1")),
        "the held text comes right before the end: {order:#?}"
    );
    // A RUN_FINISHED after the timeout is late.
    let late = bed
        .publish(
            t,
            json!({"type": "RUN_FINISHED", "threadId": t, "runId": "r1"}),
            None,
        )
        .await;
    bed.wait_for(t, "the late terminal is suppressed", |m| {
        !suppressed(m).is_empty()
    })
    .await;
    bed.settle().await;
    let msgs = bed.thread(t).await;
    assert_eq!(terminals(&msgs).len(), 1);
    let s = suppressed(&msgs);
    assert_eq!(s.len(), 1);
    let body = s[0].json();
    assert_eq!(body["payload"]["reason"], "late");
    assert_eq!(body["payload"]["winner"]["msgId"], format!("run:{t}:r1"));
    assert_eq!(body["rawEventRef"]["seq"], late);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_a_run_finished_twice_publishes_one_and_suppresses_the_other() {
    let bed = Bed::start().await;
    let t = "th-twice";
    bed.publish(t, started(t, "r1"), None).await;
    let first = bed
        .publish(
            t,
            json!({"type": "RUN_FINISHED", "threadId": t, "runId": "r1"}),
            None,
        )
        .await;
    let second = bed
        .publish(
            t,
            json!({"type": "RUN_FINISHED", "threadId": t, "runId": "r1", "result": "again"}),
            None,
        )
        .await;
    bed.wait_for(t, "one terminal and one suppression", |m| {
        !terminals(m).is_empty() && !suppressed(m).is_empty()
    })
    .await;
    bed.settle().await;
    let msgs = bed.thread(t).await;
    let ts = terminals(&msgs);
    assert_eq!(
        ts.len(),
        1,
        "{:#?}",
        msgs.iter().map(summary).collect::<Vec<_>>()
    );
    assert_eq!(ts[0].json()["rawEventRef"]["seq"], first);
    let s = suppressed(&msgs);
    assert_eq!(s.len(), 1);
    assert_eq!(
        s[0].subject,
        format!("collab.proj.system.observability.{t}.run.terminal.suppressed")
    );
    let body = s[0].json();
    assert_eq!(body["payload"]["reason"], "duplicate");
    assert_eq!(body["payload"]["winner"]["rawSeq"], first);
    assert_eq!(body["payload"]["terminal"]["result"], "again");
    assert_eq!(body["rawEventRef"]["seq"], second);
}

/// A projector that aborts right after writing a run's timeout decision, before the ends and
/// the `run.failed` are published: the next owner's reload republishes them, derived again from
/// the raw stream, exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_a_crash_after_the_timeout_decision_still_ends_the_run_once() {
    let mut bed = Bed::start_with(&[("COLLAB_TEST_CRASH_AT", "after_decide")]).await;
    let t = "th-crash";
    bed.publish(t, started(t, "r1"), None).await;
    bed.publish(
        t,
        json!({"type": "TEXT_MESSAGE_START", "messageId": "m1", "role": "assistant"}),
        None,
    )
    .await;
    let Some(status) = bed.projector.wait_exit(WAIT).await else {
        panic!(
            "the projector did not abort; log:\n{}",
            bed.projector.log_text()
        );
    };
    assert!(!status.success());
    assert!(bed
        .projector
        .log_text()
        .contains("test hook: crashing at after_decide"));
    bed.projector = Bed::spawn(&bed.nats, &[]);
    bed.wait_for(t, "the run timed out", |m| !terminals(m).is_empty())
        .await;
    bed.settle().await;
    let msgs = bed.thread(t).await;
    assert_eq!(terminals(&msgs).len(), 1);
    let ends: Vec<_> = msgs
        .iter()
        .filter(|m| m.subject.ends_with(".text.final"))
        .collect();
    assert_eq!(
        ends.len(),
        1,
        "{:#?}",
        msgs.iter().map(summary).collect::<Vec<_>>()
    );
    assert_eq!(
        ends[0].header("Nats-Msg-Id"),
        Some(format!("run:{t}:r1:end:message:m1"))
    );
    assert_eq!(terminals(&msgs)[0].json()["payload"]["reason"], "timeout");
}
