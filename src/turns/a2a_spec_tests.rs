//! The A2A specification's examples through the normaliser and the turn facts, diffed against
//! `fixtures/a2a-spec/<name>.expected.json`: what each wire body becomes, and what the turn
//! contract reads from it.

use crate::ingest::{normalize, RawInput, RelayHeaders, Settings, SubjectInfo};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/a2a-spec");

fn settings() -> Settings {
    let mut s = crate::config::Settings::default();
    s.roles.main_agents = vec!["ruda".into(), "eden".into()];
    s.ingest()
        .unwrap_or_else(|e| panic!("default settings: {e}"))
}

/// The headers a relay would have set on a fixture (`relay-headers.json`: the agents, the
/// exchange, and the method of the exchange the file belongs to; none for
/// push-notification bodies, which answer no request).
fn relay_for(name: &str) -> RelayHeaders {
    let table: Value = std::fs::read(Path::new(FIXTURES).join("relay-headers.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    let h = &table[name];
    let get = |k: &str| h[k].as_str().map(str::to_string);
    RelayHeaders {
        from_agent: get(RelayHeaders::FROM_AGENT),
        to_agent: get(RelayHeaders::TO_AGENT),
        exchange: get(RelayHeaders::EXCHANGE),
        a2a_method: get(RelayHeaders::A2A_METHOD),
        run_id: None,
        direction: None,
    }
}

/// The bodies of a fixture: one object, an array of stream frames, or raw SSE text.
fn bodies(path: &Path) -> Vec<Vec<u8>> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    if path.extension().is_some_and(|e| e == "txt") {
        // The spec prints each event's JSON over several indented lines after `data:`;
        // events are separated by a blank line.
        return text
            .split("\n\n")
            .filter_map(|event| event.trim().strip_prefix("data:"))
            .map(|d| d.trim().as_bytes().to_vec())
            .collect();
    }
    match serde_json::from_str::<Value>(&text) {
        Ok(Value::Array(frames)) => frames
            .iter()
            .map(|f| serde_json::to_vec(f).unwrap_or_default())
            .collect(),
        _ => vec![text.into_bytes()],
    }
}

fn render(path: &Path, s: &Settings) -> String {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    let relay = relay_for(name);
    let outputs: Vec<Value> = bodies(path)
        .iter()
        .map(|b| {
            let input = RawInput {
                bytes: b,
                subject: Some(SubjectInfo {
                    key: "ctx-key".into(),
                    type_suffix: "a2a.wire".into(),
                }),
                raw_ref: None,
                relay: relay.clone(),
            };
            match normalize(&input, s) {
                Ok(events) => {
                    let n = &events[0];
                    let turn = n.source.as_ref().and_then(|src| {
                        super::facts(
                            src,
                            &n.envelope.event_type,
                            n.conversation_id.as_deref().unwrap_or_default(),
                            &n.key,
                            1,
                            0,
                            "collab.raw.ctx-key.a2a.wire",
                        )
                    });
                    json!({
                        "envelope": n.envelope,
                        "turn": turn.map(|t| json!({
                            "kind": t.kind,
                            "turn": t.turn,
                            "failure": t.failure,
                        })),
                    })
                }
                Err(r) => json!({"deadLetter": {"reason": r.reason, "detail": r.detail}}),
            }
        })
        .collect();
    let mut text = serde_json::to_string_pretty(&outputs).unwrap_or_default();
    text.push('\n');
    text
}

fn inputs() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(FIXTURES)
        .map(|d| d.filter_map(Result::ok).map(|e| e.path()).collect())
        .unwrap_or_default();
    v.retain(|p| {
        let n = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        (n.ends_with(".json") || n.ends_with(".txt"))
            && !n.ends_with(".expected.json")
            && !n.starts_with("a2a-schema")
            && n != "relay-headers.json"
    });
    v.sort();
    v
}

/// Every A2A spec example through `normalize`, diffed against `<name>.expected.json`;
/// `UPDATE_GOLDEN=1` rewrites them (review the diff before committing).
#[test]
fn spec_examples_match_their_golden_outputs() {
    let s = settings();
    let files = inputs();
    assert!(files.len() >= 40, "A2A examples missing from {FIXTURES}");
    let mut failures = Vec::new();
    for path in &files {
        let stem = path
            .file_stem()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        let golden = Path::new(FIXTURES).join(format!("{stem}.expected.json"));
        failures.extend(crate::golden::check(&golden, &render(path, &s)));
    }
    assert!(
        failures.is_empty(),
        "golden mismatch:\n{}",
        failures.join("\n")
    );
}
