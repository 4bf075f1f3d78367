//! Hostile input as property tests: the invariants the fuzz targets assert (fuzz/src/lib.rs,
//! included below; docs/fuzzing.md lists them), checked on arbitrary bytes, generated JSON,
//! TOML and query strings, and mutations of the fixture inputs, in the normal `cargo test`.
//! Case counts are bounded so the whole file runs in seconds in a debug build; `cargo fuzz`
//! runs the same checks for as long as one wants, and `PROPTEST_CASES=<n>` sets every property's
//! case count for a longer search here.

#[path = "../fuzz/src/lib.rs"]
mod checks;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use proptest::prelude::*;
use proptest::test_runner::Config;
use serde_json::{json, Map, Value};

/// `n` cases, or as many as `PROPTEST_CASES` asks for (a longer search than CI's).
fn cases(n: u32) -> Config {
    let n = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(n);
    Config {
        cases: n,
        // A failure is reported with its minimal input; no file is written next to the tests.
        failure_persistence: None,
        ..Config::default()
    }
}

/// Fail the property with the broken invariant's description.
fn hold(result: checks::Checked) -> Result<(), TestCaseError> {
    result.map_err(TestCaseError::fail)
}

// ---------------------------------------------------------------------------------------------
// Fixtures
// ---------------------------------------------------------------------------------------------

fn fixture_roots() -> Vec<PathBuf> {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    [repo.join("fixtures"), repo.join("../shared/fixtures")]
        .into_iter()
        .filter(|p| p.is_dir())
        .collect()
}

fn json_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    paths.sort();
    for path in paths {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if path.is_dir() && name != "schemas" {
            json_files(&path, out);
        } else if name.ends_with(".json")
            && !name.ends_with(".expected.json")
            && !name.contains("schema")
        {
            out.push(path);
        }
    }
}

/// Every object in the fixtures that a producer could publish (it has `type`, `protocol`,
/// `event_type` or `jsonrpc`), in a stable order.
fn fixture_events() -> &'static [Value] {
    static EVENTS: OnceLock<Vec<Value>> = OnceLock::new();
    EVENTS.get_or_init(|| {
        let mut files = Vec::new();
        for root in fixture_roots() {
            json_files(&root, &mut files);
        }
        let mut events = Vec::new();
        for file in files {
            let Some(doc) = std::fs::read(&file)
                .ok()
                .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            else {
                continue;
            };
            collect_events(&doc, &mut events);
        }
        assert!(
            !events.is_empty(),
            "no fixture events under {:?}",
            fixture_roots()
        );
        events
    })
}

fn collect_events(value: &Value, out: &mut Vec<Value>) {
    match value {
        Value::Object(map) => {
            if ["type", "protocol", "event_type", "jsonrpc"]
                .iter()
                .any(|k| map.contains_key(*k))
            {
                out.push(value.clone());
            }
            map.values().for_each(|v| collect_events(v, out));
        }
        Value::Array(items) => items.iter().for_each(|v| collect_events(v, out)),
        _ => {}
    }
}

fn fixture_event() -> impl Strategy<Value = Value> {
    prop::sample::select(fixture_events().to_vec())
}

// ---------------------------------------------------------------------------------------------
// Generators
// ---------------------------------------------------------------------------------------------

/// Fragments the secret rules look for, and the characters around which matches start and end.
const SECRET_PARTS: &[&str] = &[
    "Bearer ",
    "bearer 1",
    "Basic ",
    "0a1b2c3d4e5f6a7b",
    "eyJhbGciOiJub25lIn0",
    ".eyJzdWIiOiJmdXp6In0",
    ".c2lnbmF0dXJl",
    "-----BEGIN PRIVATE KEY-----",
    "-----END PRIVATE KEY-----",
    "AKIAABCDEFGHIJKLMNOP",
    "aws_secret_access_key=",
    "0123456789abcdefghij0123456789/BCDEFGHIJ",
    "ghp_0123456789abcdefghijABCDEFGHIJklmnop",
    "github_pat_0123456789abcdefghijkl",
    "glpat-0123456789abcdefghij",
    "xoxb-0123456789-abc",
    "https://hooks.slack.com/services/T0/B0",
    "sk-ant-0123456789abcdefghij",
    "sk-proj-0123456789abcdefghijkl",
    "AIza0123456789abcdefghijklmnopqrstuvwxy",
    "https://",
    "postgres://u:p@h",
    "u:",
    ":pw",
    "@",
    "/",
    " ",
    "=",
    "\n",
    "é",
    "x",
    "{\"password\":\"p\"}",
    "[redacted:jwt]",
];

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::collection::vec(prop::sample::select(SECRET_PARTS), 0..5).prop_map(|p| p.concat()),
        2 => "[ -~]{0,24}",
        1 => "\\PC{0,12}",
        1 => prop::sample::select(vec![
            "a2a.send", "a2a.response", "task.updated", "RUN_STARTED", "TOOL_CALL_END", "A2A_SEND",
            "FOO__BAR", "main", "ruda", "eden",
            "agent:eden:main", "delegation", "0.2", "a2a", "2026-02-17T12:00:00Z", "",
        ])
        .prop_map(str::to_string),
    ]
}

/// Keys the normaliser routes on or redacts by, and arbitrary ones.
fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::sample::select(vec![
            "type", "data", "payload", "eventRole", "protocol", "version", "event_type", "jsonrpc",
            "agent", "task", "id", "kind", "attributes", "conversationId", "sessionId", "contextId",
            "workSessionId", "taskId", "agentId", "fromAgent", "toAgent", "fromSessionType",
            "toSessionType", "targetSessionKey", "ts", "timestamp", "sequence", "refs", "owner",
            "status", "_input", "value", "password", "api_key", "X-Api-Key", "Authorization",
            "token", "tokens", "secret", "cookie", "credentials", "maxTokens", "threadId", "runId",
            "messageId", "toolCallId", "parentMessageId", "agUiType",
        ])
        .prop_map(str::to_string),
        1 => "[a-zA-Z_]{1,10}",
        1 => text(),
    ]
}

fn scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        (-1e300f64..1e300).prop_map(Value::from),
        text().prop_map(Value::from),
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    scalar().prop_recursive(5, 64, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((key(), inner), 0..6)
                .prop_map(|pairs| Value::Object(pairs.into_iter().collect::<Map<String, Value>>())),
        ]
    })
}

/// An object shaped like a published input: a routing field or two among arbitrary fields.
fn event_object() -> impl Strategy<Value = Value> {
    let head = prop_oneof![
        text().prop_map(|t| json!({ "type": t })),
        Just(
            json!({ "type": "a2a.send", "data": { "fromAgent": "ruda", "toAgent": "eden", "conversationId": "c-1" } })
        ),
        Just(json!({ "protocol": "a2a", "version": "0.2", "event_type": "task.requested" })),
        Just(json!({ "jsonrpc": "2.0", "method": "message/send" })),
        prop::sample::select(vec![
            "RUN_STARTED", "RUN_FINISHED", "RUN_ERROR", "STEP_STARTED", "TEXT_MESSAGE_START",
            "TEXT_MESSAGE_CHUNK", "TEXT_MESSAGE_END", "TOOL_CALL_START", "TOOL_CALL_ARGS",
            "TOOL_CALL_RESULT", "REASONING_MESSAGE_CONTENT", "THINKING_START", "STATE_DELTA",
            "MESSAGES_SNAPSHOT", "ACTIVITY_SNAPSHOT", "RAW", "CUSTOM", "SOMETHING_NEW",
        ])
        .prop_map(|t| json!({ "type": t, "threadId": "t-1", "runId": "r-1", "messageId": "m-1", "toolCallId": "c-1" })),
        json_value().prop_map(|v| json!({ "type": v })),
        Just(json!({})),
    ];
    (head, prop::collection::vec((key(), json_value()), 0..6)).prop_map(|(mut head, fields)| {
        if let Value::Object(map) = &mut head {
            for (k, v) in fields {
                map.entry(k).or_insert(v);
            }
        }
        head
    })
}

// ---------------------------------------------------------------------------------------------
// Mutations of fixture inputs
// ---------------------------------------------------------------------------------------------

/// One structural edit at a node chosen by index.
#[derive(Debug, Clone)]
enum Edit {
    Replace(usize, Value),
    Remove(usize),
    Insert(usize, String, Value),
    /// Push the node one level down (under `data`, or into an array).
    Nest(usize, bool),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<usize>(), json_value()).prop_map(|(i, v)| Edit::Replace(i, v)),
        any::<usize>().prop_map(Edit::Remove),
        (any::<usize>(), key(), json_value()).prop_map(|(i, k, v)| Edit::Insert(i, k, v)),
        (any::<usize>(), any::<bool>()).prop_map(|(i, a)| Edit::Nest(i, a)),
    ]
}

/// JSON pointers of every node under `value`, the root first.
fn pointers(value: &Value, at: String, out: &mut Vec<String>) {
    out.push(at.clone());
    match value {
        Value::Object(map) => {
            for (k, v) in map {
                pointers(
                    v,
                    format!("{at}/{}", k.replace('~', "~0").replace('/', "~1")),
                    out,
                );
            }
        }
        Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                pointers(v, format!("{at}/{i}"), out);
            }
        }
        _ => {}
    }
}

fn apply(mut value: Value, edits: &[Edit]) -> Value {
    for e in edits {
        let mut all = Vec::new();
        pointers(&value, String::new(), &mut all);
        let at = |i: &usize| all[i % all.len()].clone();
        match e {
            Edit::Replace(i, v) => {
                if let Some(node) = value.pointer_mut(&at(i)) {
                    *node = v.clone();
                }
            }
            Edit::Remove(i) => {
                let p = at(i);
                if let Some((parent, last)) = p.rsplit_once('/') {
                    let last = last.replace("~1", "/").replace("~0", "~");
                    match value.pointer_mut(parent) {
                        Some(Value::Object(m)) => {
                            m.shift_remove(&last);
                        }
                        Some(Value::Array(a)) => {
                            if let Ok(n) = last.parse::<usize>() {
                                if n < a.len() {
                                    a.remove(n);
                                }
                            }
                        }
                        _ => {}
                    }
                }
            }
            Edit::Insert(i, k, v) => {
                if let Some(Value::Object(m)) = value.pointer_mut(&at(i)) {
                    m.insert(k.clone(), v.clone());
                }
            }
            Edit::Nest(i, as_array) => {
                if let Some(node) = value.pointer_mut(&at(i)) {
                    let inner = node.take();
                    *node = if *as_array {
                        json!([inner])
                    } else {
                        json!({ "data": inner })
                    };
                }
            }
        }
    }
    value
}

/// A fixture input with structural edits, serialised, then with byte edits.
fn mutated_fixture() -> impl Strategy<Value = Vec<u8>> {
    (
        fixture_event(),
        prop::collection::vec(edit(), 0..4),
        prop::collection::vec((any::<usize>(), any::<u8>(), 0u8..4), 0..3),
    )
        .prop_map(|(event, edits, byte_edits)| {
            let mut bytes = serde_json::to_vec(&apply(event, &edits)).unwrap_or_default();
            for (at, byte, op) in byte_edits {
                if bytes.is_empty() {
                    break;
                }
                let at = at % bytes.len();
                match op {
                    0 => bytes[at] ^= byte | 1,
                    1 => bytes.truncate(at),
                    2 => bytes.insert(at, byte),
                    _ => bytes
                        .splice(at..at, b"\"Bearer 0a1b2c3d\"".iter().copied())
                        .for_each(drop),
                }
            }
            bytes
        })
}

// ---------------------------------------------------------------------------------------------
// normalize
// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(cases(256))]

    #[test]
    fn normalize_holds_on_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        hold(checks::normalize(&bytes))?;
    }

    #[test]
    fn normalize_holds_on_generated_events(event in event_object()) {
        let bytes = serde_json::to_vec(&event).unwrap_or_default();
        hold(checks::normalize(&bytes))?;
    }

    #[test]
    fn normalize_holds_on_mutated_fixtures(bytes in mutated_fixture()) {
        hold(checks::normalize(&bytes))?;
    }

    #[test]
    fn normalize_holds_on_arbitrary_json(value in json_value()) {
        hold(checks::normalize(value.to_string().as_bytes()))?;
    }
}

/// Found by `cargo fuzz` (normalize): an A2A Task answered without a message. Offline its key
/// was the task id while its conversation is its context; published under that key, the
/// conversation became the task id.
#[test]
fn a_wire_task_normalises_the_same_published_under_its_offline_key() {
    let body = br#"{"jsonrpc":"2.0","id":"req-005","result":{"id":"43667960-d455-4453-b0cf-1bae4955270d","contextId":"c295ea44-7543-4f78-b524-7a38915ad6e4","status":{"state":"submitted","timestamp":"2024-03-15T11:00:00Z"}}}"#;
    if let Err(broken) = checks::normalize(body) {
        panic!("{broken}");
    }
}

/// Found by `cargo fuzz` (normalize): an A2A artifact update whose context id is too long, or
/// has characters, for a subject token, so its key is a hash of it. Published under that key,
/// it gave other envelopes than offline.
#[test]
fn a_wire_artifact_update_with_a_hashed_key_normalises_the_same_published_under_it() {
    let body = br#"{"jsonrpc":"2.0","id":1,"result":{"taskId":"225d6247-06ba-4cda-a08b-33ae35c:dcfa","contextId":"05WWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWWW217e44-7e9f-473e-ab4f-2c2dd!e50a2b1","artifact":{"artifactId":"9b6934dd-37e3-4eb1-8766-962efaab63a1","parts":[{"kind":"text","text":"<section 1...>"}]},"append":false,"lastChunk":false,"kind":"artifact-update"}}"#;
    if let Err(broken) = checks::normalize(body) {
        panic!("{broken}");
    }
}

#[test]
fn every_fixture_input_normalises_within_the_invariants() {
    for event in fixture_events() {
        let bytes = serde_json::to_vec(event).unwrap_or_default();
        if let Err(broken) = checks::normalize(&bytes) {
            panic!("{broken}\ninput: {event}");
        }
    }
}

#[test]
fn a2a_json_rpc_fixtures_are_projected() {
    let settings = &checks::normalize_settings()[0];
    let mut seen = 0;
    for event in fixture_events() {
        if event.get("jsonrpc").is_none() || event.get("protocol").is_some() {
            continue;
        }
        seen += 1;
        let bytes = serde_json::to_vec(event).unwrap_or_default();
        let input = collab_projector::ingest::RawInput {
            bytes: &bytes,
            subject: None,
            raw_ref: None,
            relay: Default::default(),
        };
        // Format 4 (docs/contract.md section 2a): every A2A 0.3 / 1.0 body of the spec is projected; only
        // pre-0.2 shapes are refused.
        if let Err(r) = collab_projector::ingest::normalize(&input, settings) {
            let legacy = r.reason.as_str() == "unrecognized" && r.detail.contains("pre-0.2");
            assert!(
                legacy,
                "{event} was dead-lettered {}: {}",
                r.reason, r.detail
            );
        }
    }
    assert!(seen > 0, "no A2A JSON-RPC fixture found");
}

/// Format 5 is mapped (docs/contract.md section 2b): every AG-UI event in the fixtures is projected, with its
/// type kept, under either settings variant that does not make it too large.
#[test]
fn ag_ui_fixtures_are_projected_never_dead_lettered() {
    let mut seen = 0;
    for event in fixture_events() {
        let Some(t) = event.get("type").and_then(Value::as_str) else {
            continue;
        };
        let agui = !t.is_empty() && t.chars().all(|c| c.is_ascii_uppercase() || c == '_');
        if !agui || event.get("protocol").is_some() || event.get("jsonrpc").is_some() {
            continue;
        }
        seen += 1;
        let bytes = serde_json::to_vec(event).unwrap_or_default();
        let input = collab_projector::ingest::RawInput {
            bytes: &bytes,
            subject: None,
            raw_ref: None,
            relay: Default::default(),
        };
        for settings in checks::normalize_settings() {
            match collab_projector::ingest::normalize(&input, settings) {
                Ok(events) => {
                    for n in events {
                        let kept = n.envelope.payload.as_ref().and_then(|p| p.get("agUiType"));
                        assert_eq!(kept, Some(&json!(t)), "{event}");
                    }
                }
                Err(r) => assert_eq!(
                    r.reason.as_str(),
                    "too_large",
                    "{event} was dead-lettered: {}",
                    r.detail
                ),
            }
        }
    }
    assert!(seen > 0, "no AG-UI fixture found");
}

/// Fields outside the envelope's slots move under `payload`, a level deeper than in the input;
/// at the depth limit that must not make the projection deeper than the limit.
#[test]
fn a_projection_is_never_deeper_than_the_depth_limit() {
    for settings in checks::normalize_settings() {
        let max = settings.shape.max_depth;
        let nested = |levels: usize| (1..levels).fold(json!({}), |inner, _| json!({ "n": inner }));
        for input in [
            // An unknown top-level field holding max - 1 levels: the input is max deep.
            json!({ "type": "tool.result", "sessionId": "s", "extra": nested(max - 1) }),
            // The same field also under `data`: kept under payload._input, two levels deeper.
            json!({ "type": "tool.result", "sessionId": "s", "extra": nested(max - 1), "data": { "extra": 1 } }),
            // Both `data` and `payload`.
            json!({ "type": "tool.result", "sessionId": "s", "data": nested(max - 1), "payload": 1 }),
            // A scalar `data` wrapped in an object with an unknown field beside it.
            json!({ "type": "run.started", "sessionId": "s", "data": [nested(max - 2)], "x": 1 }),
            // Adapter attributes.
            json!({ "protocol": "a2a", "version": "0.2", "event_type": "task.updated",
                    "agent": { "id": "a" }, "task": { "id": "t" }, "attributes": nested(max - 1) }),
        ] {
            let bytes = serde_json::to_vec(&input).unwrap_or_default();
            if let Err(broken) = checks::normalize_with(&bytes, settings) {
                panic!("max_depth {max}: {broken}");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// adapter
// ---------------------------------------------------------------------------------------------

fn packet() -> impl Strategy<Value = Value> {
    let id = prop_oneof![text().prop_map(Value::from), json_value()];
    (
        prop::sample::select(vec![
            "0.2",
            "0.3.1",
            "0.10",
            "1.0",
            "0.1",
            "0.",
            "00.2",
            "0.99999999999999999999999",
        ]),
        prop::sample::select(vec![
            "task.requested",
            "task.updated",
            "artifact.shared",
            "agent.capabilities",
            "task.cancelled",
            "",
        ]),
        id.clone(),
        id,
        prop::option::of(prop::sample::select(vec!["delegation", "review", ""])),
        prop::option::of(json_value()),
        prop::collection::vec((key(), json_value()), 0..3),
    )
        .prop_map(
            |(version, event_type, agent_id, task_id, kind, attributes, extra)| {
                let mut p = json!({
                    "protocol": "a2a", "version": version, "event_type": event_type,
                    "agent": { "id": agent_id, "capabilities": ["b", "a", 1] },
                    "task": { "id": task_id },
                });
                if let Some(kind) = kind {
                    p["task"]["kind"] = json!(kind);
                }
                if let Some(a) = attributes {
                    p["attributes"] = a;
                }
                if let Value::Object(m) = &mut p {
                    for (k, v) in extra {
                        m.entry(k).or_insert(v);
                    }
                }
                p
            },
        )
}

proptest! {
    #![proptest_config(cases(256))]

    #[test]
    fn adapter_holds_on_generated_packets(p in packet()) {
        let bytes = serde_json::to_vec(&p).unwrap_or_default();
        hold(checks::adapter(&bytes))?;
        hold(checks::normalize(&bytes))?;
    }

    #[test]
    fn adapter_holds_on_mutated_fixtures_and_bytes(
        bytes in prop_oneof![mutated_fixture(), prop::collection::vec(any::<u8>(), 0..120)]
    ) {
        hold(checks::adapter(&bytes))?;
    }
}

// ---------------------------------------------------------------------------------------------
// redact
// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(cases(512))]

    #[test]
    fn redaction_is_idempotent_on_text(t in text()) {
        hold(checks::redact(t.as_bytes()))?;
    }

    #[test]
    fn redaction_is_idempotent_on_json(value in json_value()) {
        hold(checks::redact(value.to_string().as_bytes()))?;
    }

    #[test]
    fn redaction_is_idempotent_on_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..120)) {
        hold(checks::redact(&bytes))?;
    }
}

/// Inputs where one rule's replacement exposes a match for another rule (a word boundary after
/// a fixed-length match, or a `/` or whitespace removed from a URL's password), and a URL whose
/// marker matches the URL rule again.
#[test]
fn redaction_reaches_a_fixed_point_in_one_pass() {
    let aws_secret = "aws_secret_access_key=0123456789abcdefghij0123456789abcdefghij";
    let google = "AIza0123456789abcdefghijklmnopqrstuvwxy";
    for text in [
        format!("{aws_secret}AKIAABCDEFGHIJKLMNOP"),
        format!("{google}AKIAABCDEFGHIJKLMNOP"),
        format!("{google}ghp_0123456789abcdefghijABCDEFGHIJklmnop"),
        "http://u:aws_secret_access_key=0123456789abcdefghij0123456789/bcdefghij@host".to_string(),
        "http://u:https://hooks.slack.com/services/T0/B0@host".to_string(),
        "http://u:-----BEGIN PRIVATE KEY-----\n/\n-----END PRIVATE KEY-----@host".to_string(),
        "postgres://admin:pw@db.internal:5432/app".to_string(),
    ] {
        if let Err(broken) = checks::redact(text.as_bytes()) {
            panic!("{broken}");
        }
        let wrapped = json!({ "type": "tool.result", "sessionId": "s", "data": { "out": text } });
        if let Err(broken) = checks::normalize(wrapped.to_string().as_bytes()) {
            panic!("{broken}");
        }
    }
}

#[test]
fn secrets_in_object_keys_are_redacted_too() {
    let input = json!({
        "type": "tool.result",
        "sessionId": "s",
        "data": { "Bearer abcdefgh12345678": 1, "Bearer 0a1b2c3d4e5f": 2, "plain": 3 },
    });
    if let Err(broken) = checks::redact(input.to_string().as_bytes()) {
        panic!("{broken}");
    }
    if let Err(broken) = checks::normalize(input.to_string().as_bytes()) {
        panic!("{broken}");
    }
}

// ---------------------------------------------------------------------------------------------
// envelope
// ---------------------------------------------------------------------------------------------

fn envelope_json() -> impl Strategy<Value = Value> {
    let role = prop_oneof![
        Just(Value::Null),
        prop::sample::select(vec![
            "conversation.main",
            "delegation.subagent",
            "orchestration.task",
            "system.observability"
        ])
        .prop_map(Value::from),
        text().prop_map(Value::from),
    ];
    (
        text(),
        role,
        prop::collection::vec(
            (
                prop::sample::select(vec![
                    "sequence",
                    "timestamp",
                    "sessionId",
                    "threadId",
                    "runId",
                    "turnId",
                    "messageId",
                    "taskId",
                    "agentId",
                    "parentSessionId",
                    "parentThreadId",
                    "conversationId",
                    "workSessionId",
                    "owner",
                    "scope",
                    "phase",
                    "surface",
                    "persistence",
                    "topology",
                    "payload",
                    "refs",
                    "redactions",
                    "rawEventRef",
                    "unknownField",
                ]),
                json_value(),
            ),
            0..8,
        ),
    )
        .prop_map(|(t, role, fields)| {
            let mut m = Map::new();
            m.insert("type".into(), Value::from(t));
            m.insert("eventRole".into(), role);
            for (k, v) in fields {
                m.insert(k.to_string(), v);
            }
            Value::Object(m)
        })
}

proptest! {
    #![proptest_config(cases(256))]

    #[test]
    fn envelopes_round_trip(value in envelope_json()) {
        hold(checks::envelope(value.to_string().as_bytes()))?;
    }

    #[test]
    fn envelope_parsing_holds_on_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..160)) {
        hold(checks::envelope(&bytes))?;
    }

    #[test]
    fn projected_fixture_envelopes_round_trip(bytes in mutated_fixture()) {
        let input = collab_projector::ingest::RawInput { bytes: &bytes, subject: None, raw_ref: None, relay: Default::default() };
        if let Ok(events) = collab_projector::ingest::normalize(&input, &checks::normalize_settings()[0]) {
            for n in events {
                let text = serde_json::to_vec(&n.envelope).unwrap_or_default();
                hold(checks::envelope(&text))?;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// config
// ---------------------------------------------------------------------------------------------

const SECTION_KEYS: &[(&str, &[&str])] = &[
    (
        "nats",
        &[
            "url",
            "prefix",
            "partitions",
            "replicas",
            "raw_max_age",
            "dlq_max_age",
            "creds_file",
        ],
    ),
    ("roles", &["main_agents"]),
    ("adapter", &["mode"]),
    (
        "limits",
        &[
            "max_payload_bytes",
            "max_inline_bytes",
            "max_depth",
            "max_string_bytes",
            "max_object_keys",
            "max_array_items",
        ],
    ),
    ("redaction", &["keys", "patterns"]),
    (
        "consumer",
        &[
            "batch",
            "ack_wait",
            "max_deliver",
            "max_ack_pending",
            "publish_window",
        ],
    ),
    (
        "turns",
        &[
            "default_timeout",
            "max_timeout",
            "retention",
            "enforce_roles",
            "clock_skew",
            "open_write_delay",
        ],
    ),
    ("projection", &["duplicate_window", "max_age"]),
    (
        "http",
        &["enabled", "addr", "api", "quiet_after", "archive_after"],
    ),
    ("workers", &["id", "lease_ttl"]),
];

fn toml_value() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<i64>().prop_map(|n| n.to_string()),
        prop::sample::select(vec![
            "0", "1", "128", "129", "5000", "65536", "-1", "1.5", "true", "inf"
        ])
        .prop_map(str::to_string),
        prop::sample::select(vec![
            "\"30s\"",
            "\"0s\"",
            "\"500ms\"",
            "\"7days\"",
            "\"99999999999999999999h\"",
            "\"1\"",
            "\"\""
        ])
        .prop_map(str::to_string),
        prop::sample::select(vec![
            "\"strict\"",
            "\"lenient\"",
            "\"collab\"",
            "\"a.b\"",
            "\"nats://x:4222\""
        ])
        .prop_map(str::to_string),
        prop::sample::select(vec![
            "[\"conversation.main\"]",
            "[\"conversation.mian\"]",
            "[]",
            "[1, \"a\"]",
            "[{ name = \"t\", pattern = \"T-[0-9]+\" }]",
            "[{ name = \"b\", pattern = \"(\" }]",
            "{ a = 1 }",
        ])
        .prop_map(str::to_string),
        "[ -~]{0,12}".prop_map(|s| format!("{s:?}")),
    ]
}

fn toml_document() -> impl Strategy<Value = String> {
    let line = (
        0..SECTION_KEYS.len(),
        any::<usize>(),
        any::<bool>(),
        toml_value(),
    )
        .prop_map(|(s, k, known, v)| {
            let (section, keys) = SECTION_KEYS[s];
            let key = if known {
                keys[k % keys.len()].to_string()
            } else {
                format!("unknown_{}", k % 7)
            };
            (section, format!("{key} = {v}\n"))
        });
    prop::collection::vec(line, 0..8).prop_map(|lines| {
        let mut doc = String::new();
        let mut current = "";
        for (section, line) in lines {
            if section != current {
                doc.push_str(&format!("[{section}]\n"));
                current = section;
            }
            doc.push_str(&line);
        }
        doc
    })
}

fn mutated_default_toml() -> impl Strategy<Value = Vec<u8>> {
    let text = include_str!("../config/default.toml").as_bytes().to_vec();
    prop::collection::vec((any::<usize>(), any::<u8>(), 0u8..3), 1..4).prop_map(move |edits| {
        let mut bytes = text.clone();
        for (at, byte, op) in edits {
            let at = at % bytes.len().max(1);
            match op {
                0 if at < bytes.len() => bytes[at] = byte,
                1 if at < bytes.len() => {
                    bytes.remove(at);
                }
                _ => bytes.insert(at.min(bytes.len()), byte),
            }
        }
        bytes
    })
}

proptest! {
    #![proptest_config(cases(128))]

    #[test]
    fn config_loading_holds_on_generated_toml(doc in toml_document()) {
        hold(checks::config(doc.as_bytes()))?;
    }

    #[test]
    fn config_loading_holds_on_mutated_defaults(bytes in mutated_default_toml()) {
        hold(checks::config(&bytes))?;
    }

    #[test]
    fn config_loading_holds_on_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..80)) {
        hold(checks::config(&bytes))?;
    }
}

#[test]
fn config_errors_name_the_key_at_fault() {
    for doc in [
        "[nats]\nurll = \"x\"\n",
        "[natz]\n",
        "[nats]\npartitions = \"many\"\n",
        "[limits]\nmax_depth = 0\n",
        "[turns]\nenforce_roles = [\"conversation.mian\"]\n",
        "[nats\n",
        // Sections added after the first ten: their errors name them too.
        "[otel]\nmax_open = 0\n",
        "[runs]\ntimeout = \"0s\"\n",
    ] {
        if let Err(broken) = checks::config(doc.as_bytes()) {
            panic!("{broken}");
        }
        // Each of these is refused.
        let path = std::env::temp_dir().join(format!(
            "collab-projector-hostile-key-{}.toml",
            std::process::id()
        ));
        std::fs::write(&path, doc).unwrap_or_else(|e| panic!("{e}"));
        let loaded = collab_projector::config::Settings::load(Some(&path));
        let _ = std::fs::remove_file(&path);
        assert!(loaded.is_err(), "{doc:?} loaded");
    }
}

// ---------------------------------------------------------------------------------------------
// query
// ---------------------------------------------------------------------------------------------

fn cursor() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<u64>().prop_map(|seq| collab_projector::api::query::encode_cursor(0, seq)),
        prop::sample::select(vec![0, 1, u64::MAX - 1, u64::MAX])
            .prop_map(|seq| collab_projector::api::query::encode_cursor(0, seq)),
        // A cursor another projection version issued (docs/operations.md, "Serving a version").
        (1..=676_u16, any::<u64>())
            .prop_map(|(tag, seq)| collab_projector::api::query::encode_cursor(tag, seq)),
        "[A-Za-z0-9_-]{0,12}",
    ]
}

fn query_value() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "conversation.main",
            "system.observability,delegation.subagent",
            "orchestration.task",
            "a2a.send",
            "a2a.response,a2a.complete",
            "a.*",
            "a.>",
            "a b",
            "a..b",
            ".a",
            "*",
            ">",
            "conversations",
            "debug",
            "nope",
            "1",
            "0",
            "1000",
            "1001",
            "-1",
            "agent:eden:main",
            "",
            ",",
        ])
        .prop_map(str::to_string),
        cursor(),
        "\\PC{0,10}",
    ]
}

fn query_pairs() -> impl Strategy<Value = Vec<(String, String)>> {
    let name = prop_oneof![
        5 => prop::sample::select(checks::EVENTS_PARAMS.to_vec()).prop_map(str::to_string),
        1 => "[a-z]{1,6}",
    ];
    prop::collection::vec((name, query_value()), 0..6)
}

proptest! {
    #![proptest_config(cases(512))]

    #[test]
    fn events_query_holds_on_generated_parameters(pairs in query_pairs()) {
        hold(checks::events_query(pairs))?;
    }

    #[test]
    fn events_query_holds_on_raw_query_strings(q in "[a-z=&%,.*>0-9A-F+_ -]{0,40}") {
        hold(checks::query(q.as_bytes()))?;
    }

    #[test]
    fn events_query_holds_on_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..60)) {
        hold(checks::query(&bytes))?;
    }
}

/// `/api/events` reads from the cursor's next sequence. A cursor holds at most 19 digits (every
/// sequence a stream reaches is below 10^19), so the last possible sequence, which has no next
/// one, is refused like any cursor this server never issued.
#[test]
fn a_cursor_at_the_last_sequence_is_refused() {
    use collab_projector::api::query::{decode_cursor, encode_cursor};
    for name in ["after", "before"] {
        let pairs = vec![(name.to_string(), encode_cursor(0, u64::MAX))];
        if let Err(broken) = checks::events_query(pairs) {
            panic!("{broken}");
        }
    }
    assert!(decode_cursor(0, &encode_cursor(0, u64::MAX)).is_err());
    let largest = 9_999_999_999_999_999_999_u64;
    assert_eq!(
        decode_cursor(0, &encode_cursor(0, largest)).ok(),
        Some(largest)
    );
    assert!(decode_cursor(0, &encode_cursor(0, largest + 1)).is_err());
}

/// A cursor that another projection version issued is refused with 410 `version_switched`,
/// which tells a client to reload from the start rather than to fix its request.
#[test]
fn a_cursor_of_another_version_is_gone_not_malformed() {
    use collab_projector::api::query::{decode_cursor, encode_cursor};
    let other = encode_cursor(3, 42);
    let refused = decode_cursor(0, &other)
        .err()
        .map(|e| (e.status.as_u16(), e.code));
    assert_eq!(refused, Some((410, "version_switched")));
    assert_eq!(decode_cursor(3, &other).ok(), Some(42));
    if let Err(broken) = checks::events_query(vec![("after".to_string(), other)]) {
        panic!("{broken}");
    }
}

// ---------------------------------------------------------------------------------------------
// Known finding outside the files this suite may change (docs/fuzzing.md, F3)
// ---------------------------------------------------------------------------------------------

/// A producer's float must reach readers of the projection unchanged. serde_json's default
/// float parser is not correctly rounded, so a float can move by an ulp each time a projection
/// is serialised and parsed again (raw message -> projection -> API or session fold). The fix
/// is serde_json's `float_roundtrip` feature in Cargo.toml.
#[test]

fn floats_survive_a_projection_round_trip_exactly() {
    let raw = br#"{"type":"tool.result","sessionId":"s","data":{"u":1844674407.1854775808}}"#;
    let input = collab_projector::ingest::RawInput {
        bytes: raw,
        subject: None,
        raw_ref: None,
        relay: Default::default(),
    };
    let events = collab_projector::ingest::normalize(&input, &checks::normalize_settings()[0])
        .unwrap_or_else(|r| panic!("{}", r.detail));
    let projected = &events[0].envelope;
    let text = serde_json::to_string(projected).unwrap_or_default();
    let read: collab_projector::model::Envelope =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        &read, projected,
        "the float changed between projection and reader"
    );
}

/// A UTF-8 byte order mark before an event is ignored by the projector (docs/contract.md); the
/// checks' own reading of the input must ignore it too (fuzzing finding F8: the check expected a
/// `bad_json` rejection and found the event projected).
#[test]
fn a_byte_order_mark_before_an_event_is_ignored_by_the_checks_too() {
    let mut bytes = b"\xEF\xBB\xBF".to_vec();
    bytes.extend_from_slice(
        br#"{"type":"a2a.complete","data":{"fromAgent":"ruda","toAgent":"eden","announced":false,"waitStatus":"timeout","conversationId":"uuid"}}"#,
    );
    if let Err(broken) = checks::normalize(&bytes) {
        panic!("{broken}");
    }
}

/// A malformed or out-of-range number in the configuration file must name its key or its
/// position, as every other configuration error does. The `config` crate's TOML reader reports
/// `invalid digit found in string` or `number too large to fit in target type` alone. The fix
/// belongs in `config::Settings::read`: parse the file with the `toml` crate first (its errors
/// give the line, the column and the text at fault) and report that error.
#[test]

fn a_malformed_number_in_the_configuration_names_its_key_or_position() {
    for doc in [
        "[nats]\npartitions = 1_6x\n",
        "[nats]\nreplicas = 99999999999999999999\n",
    ] {
        let path = std::env::temp_dir().join(format!(
            "collab-projector-hostile-number-{}.toml",
            std::process::id()
        ));
        std::fs::write(&path, doc).unwrap_or_else(|e| panic!("{e}"));
        let loaded = collab_projector::config::Settings::load(Some(&path));
        let _ = std::fs::remove_file(&path);
        let message = loaded.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            message.contains("partitions")
                || message.contains("replicas")
                || message.contains("line 2"),
            "{doc:?}: {message}"
        );
    }
}
