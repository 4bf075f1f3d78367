//! The A2A and AG-UI specification examples through the bus: every body published raw (A2A with
//! the headers a relay sets) comes out of the running projector as the golden files beside it
//! say: the same envelope (type, role, ids, payload), or a dead letter with the same reason.
//! Turn and run effects are the turn tests' business; here a response that wins its turn is
//! checked for its type and role only.

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream::Context;
use serde_json::Value;

use crate::pipeline::{read_all, start_projector, Stored, DLQ, MAIN_AGENTS, PROJ};
use crate::support::{wait_until, TestNats};

const A2A: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/a2a-spec");
const AGUI: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/agui-spec");

/// One published body and what its golden file expects of it.
struct Case {
    file: String,
    seq: u64,
    expected: Value,
}

fn inputs(dir: &str) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .expect("fixture dir")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            let n = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            (n.ends_with(".json") || n.ends_with(".txt"))
                && !n.ends_with(".expected.json")
                && !n.starts_with("a2a-schema")
                && n != "relay-headers.json"
        })
        .collect();
    v.sort();
    v
}

/// The bodies of a fixture, as the golden files number them.
fn bodies(path: &std::path::Path) -> Vec<Vec<u8>> {
    let text = std::fs::read_to_string(path).expect("fixture");
    if path.extension().is_some_and(|e| e == "txt") {
        return text
            .split("\n\n")
            .filter_map(|event| event.trim().strip_prefix("data:"))
            .map(|d| d.trim().as_bytes().to_vec())
            .collect();
    }
    match serde_json::from_str::<Value>(&text) {
        Ok(Value::Array(frames)) => frames
            .iter()
            .map(|f| serde_json::to_vec(f).expect("frame"))
            .collect(),
        _ => vec![text.into_bytes()],
    }
}

/// The relay headers the A2A golden files were made with (`relay-headers.json`), except that
/// each file is an exchange of its own (`exchange`), so each is its own turn.
fn a2a_headers(name: &str, exchange: &str) -> async_nats::HeaderMap {
    let table: Value = serde_json::from_slice(
        &std::fs::read(format!("{A2A}/relay-headers.json")).expect("relay-headers.json"),
    )
    .expect("relay-headers.json is JSON");
    let mut h = async_nats::HeaderMap::new();
    for (k, v) in table[name].as_object().into_iter().flatten() {
        let v = if k == "Collab-Exchange" {
            exchange
        } else {
            v.as_str().unwrap_or_default()
        };
        h.insert(k.as_str(), v);
    }
    h
}

async fn publish(
    js: &Context,
    subject: String,
    headers: async_nats::HeaderMap,
    body: Vec<u8>,
) -> u64 {
    js.publish_with_headers(subject, headers, body.into())
        .await
        .expect("sent")
        .await
        .expect("stored")
        .sequence
}

/// What came out for each raw sequence: projections and dead letters.
async fn outputs(js: &Context) -> BTreeMap<u64, Vec<Stored>> {
    let mut by_seq: BTreeMap<u64, Vec<Stored>> = BTreeMap::new();
    for m in read_all(js, PROJ, "collab.proj.>").await {
        by_seq.entry(m.source_seq()).or_default().push(m);
    }
    for m in read_all(js, DLQ, "collab.dlq.>").await {
        by_seq.entry(m.source_seq()).or_default().push(m);
    }
    by_seq
}

/// The envelope fields the golden files fix, without what the bus adds (`rawEventRef`) or
/// what depends on where the body was published (`turnId`, `conversationId`).
fn comparable(envelope: &Value) -> Value {
    let mut e = envelope.clone();
    if let Some(m) = e.as_object_mut() {
        for k in ["rawEventRef", "turnId", "conversationId"] {
            m.remove(k);
        }
    }
    // A streamed delta's text moves between the deltas of its message (redaction holds back
    // what could be the start of a secret until the next delta or the message's end): compared
    // per message, assembled, below.
    if let Some(p) = e.get_mut("payload").and_then(Value::as_object_mut) {
        p.remove("delta");
    }
    e
}

/// The message or tool call a streamed delta belongs to, and its text.
fn streamed_delta(envelope: &Value) -> Option<(String, String)> {
    let p = envelope.get("payload")?;
    let text = p.get("delta")?.as_str()?.to_string();
    let id = ["messageId", "toolCallId"]
        .iter()
        .find_map(|k| envelope.get(*k).or_else(|| p.get(*k)))
        .map(Value::to_string)
        .unwrap_or_default();
    Some((id, text))
}

/// The text held back by redaction and published just before its stream ends.
fn is_flush(m: &Stored) -> bool {
    serde_json::from_slice::<Value>(&m.payload)
        .is_ok_and(|e| e["payload"]["redactionFlush"] == Value::Bool(true))
}

fn check(cases: &[Case], out: &BTreeMap<u64, Vec<Stored>>) -> Vec<String> {
    let mut problems = Vec::new();
    for c in cases {
        let got = out.get(&c.seq).map(Vec::as_slice).unwrap_or_default();
        if let Some(dl) = c.expected.get("deadLetter") {
            let reason = got.first().and_then(|m| m.header("Collab-Dlq-Reason"));
            if got.len() != 1 || reason.as_deref() != dl["reason"].as_str() {
                problems.push(format!(
                    "{} (seq {}): want dead letter {dl}, got {got:?}",
                    c.file, c.seq
                ));
            }
            continue;
        }
        let want = &c.expected["envelope"];
        let t = want["type"].as_str().unwrap_or_default();
        let turn_or_run = t.starts_with("a2a.") || t.starts_with("run.");
        let Some(m) = got.iter().find(|m| !is_flush(m)) else {
            problems.push(format!("{} (seq {}): nothing projected", c.file, c.seq));
            continue;
        };
        let env = m.json();
        if turn_or_run {
            // Turn and run contracts may decide what is published for it; it is still there.
            let seen = got.iter().any(|m| {
                let e = m.json();
                e["type"] == want["type"] || m.subject.ends_with(".suppressed")
            });
            if !seen {
                problems.push(format!(
                    "{} (seq {}): no {t} and no suppression",
                    c.file, c.seq
                ));
            }
        } else if comparable(&env) != comparable(want) {
            problems.push(format!(
                "{} (seq {}): projected\n{env:#}\nwant\n{want:#}",
                c.file, c.seq
            ));
        }
    }
    // Each message's (and tool call's) deltas assemble the same text as the golden deltas.
    let mut want: BTreeMap<(String, String), String> = BTreeMap::new();
    let mut have: BTreeMap<(String, String), String> = BTreeMap::new();
    for c in cases {
        if let Some((id, text)) = streamed_delta(&c.expected["envelope"]) {
            want.entry((c.file.clone(), id))
                .or_default()
                .push_str(&text);
        }
        for m in out.get(&c.seq).map(Vec::as_slice).unwrap_or_default() {
            let Ok(envelope) = serde_json::from_slice::<Value>(&m.payload) else {
                continue;
            };
            if let Some((id, text)) = streamed_delta(&envelope) {
                have.entry((c.file.clone(), id))
                    .or_default()
                    .push_str(&text);
            }
        }
    }
    // A stream that ends in its file is published whole; one left open (no `*_END`) may still
    // hold its last word back.
    let ended: std::collections::BTreeSet<(String, String)> = cases
        .iter()
        .filter(|c| {
            c.expected["envelope"]["payload"]["agUiType"]
                .as_str()
                .is_some_and(|t| t.ends_with("_END"))
        })
        .filter_map(|c| {
            let e = &c.expected["envelope"];
            let id = ["messageId", "toolCallId"]
                .iter()
                .find_map(|k| e.get(*k).or_else(|| e["payload"].get(*k)))?;
            Some((c.file.clone(), id.to_string()))
        })
        .collect();
    for (stream, text) in &want {
        let got = have.get(stream).map(String::as_str).unwrap_or_default();
        let fine = if ended.contains(stream) {
            got == text
        } else {
            text.starts_with(got)
        };
        if !fine {
            problems.push(format!(
                "{stream:?}: streamed text assembled as {got:?}, want {text:?}"
            ));
        }
    }
    problems
}

#[tokio::test]
async fn every_a2a_and_ag_ui_spec_example_projects_as_its_golden_file_says() {
    let nats = TestNats::start().await;
    // Each example is published on its own, most answers without their request: with the early
    // hold off each is taken at once, so every body has its output without waiting the hold
    // (what a held answer becomes is tested in tests/it/turns.rs and tests/it/trust.rs).
    let _p = start_projector(
        &nats.url(),
        &MAIN_AGENTS,
        &[("COLLAB_TURNS__EARLY_HOLD", "0s")],
    )
    .await;
    let js = nats.jetstream().await;
    let mut cases = Vec::new();
    for (i, path) in inputs(A2A).into_iter().enumerate() {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_string();
        let stem = path
            .file_stem()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        let golden: Vec<Value> = serde_json::from_str(
            &std::fs::read_to_string(format!("{A2A}/{stem}.expected.json")).expect("golden"),
        )
        .expect("golden JSON");
        for (body, expected) in bodies(&path).into_iter().zip(golden) {
            let seq = publish(
                &js,
                "collab.raw.ctx-key.a2a.wire".into(),
                a2a_headers(&name, &format!("ex-{i}")),
                body,
            )
            .await;
            cases.push(Case {
                file: name.clone(),
                seq,
                expected,
            });
        }
    }
    for path in inputs(AGUI) {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_string();
        let stem = path
            .file_stem()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        let golden: Vec<Value> = serde_json::from_str(
            &std::fs::read_to_string(format!("{AGUI}/{stem}.expected.json")).expect("golden"),
        )
        .expect("golden JSON");
        for (body, expected) in bodies(&path).into_iter().zip(golden) {
            let key = expected["key"].as_str().unwrap_or("agui").to_string();
            let seq = publish(
                &js,
                format!("collab.raw.{key}.agui"),
                async_nats::HeaderMap::new(),
                body,
            )
            .await;
            cases.push(Case {
                file: name.clone(),
                seq,
                expected,
            });
        }
    }
    assert!(cases.len() > 60, "only {} bodies published", cases.len());
    let last = cases.iter().map(|c| c.seq).max().unwrap_or(0);
    wait_until(
        Duration::from_secs(60),
        "every body has an output",
        || async {
            let out = outputs(&js).await;
            cases.iter().all(|c| out.contains_key(&c.seq)) && out.keys().max() >= Some(&last)
        },
    )
    .await;
    let problems = check(&cases, &outputs(&js).await);
    assert!(
        problems.is_empty(),
        "{} problems:\n{}",
        problems.len(),
        problems.join("\n")
    );
}
