//! The invariants of collab-projector's hostile-input surface: every parser and normaliser that
//! reads bytes a producer, an operator or an HTTP client controls.
//!
//! Each check takes raw input, runs it through the public API, and returns `Err` with a
//! description when an invariant is broken; "it did not panic" is the least of what is checked.
//! The fuzz targets (`fuzz/fuzz_targets/*.rs`) panic on an `Err` so libFuzzer records a crash;
//! the property tests (`tests/hostile_input.rs`) include this file as a module and run the same
//! checks on generated input. docs/fuzzing.md lists what each check asserts.

use std::path::PathBuf;
use std::sync::OnceLock;

use axum::extract::Query;
use axum::http::{StatusCode, Uri};
use collab_projector::api::error::ApiError;
use collab_projector::api::query::{self, Params};
use collab_projector::config::Settings;
use collab_projector::ingest::adapter::{self, AdapterLimits, AdapterMode, Canonical};
use collab_projector::ingest::{self, Normalized, RawInput, ShapeLimits, SubjectInfo};
use collab_projector::model::{encode_id, is_key_token, DlqReason, Envelope, RawEventRef, Role};
use collab_projector::redact::Redactor;
use serde_json::Value;

/// `Err` names the invariant that broke, with enough context to reproduce it.
pub type Checked = Result<(), String>;

fn ensure(holds: bool, broken: impl FnOnce() -> String) -> Checked {
    if holds {
        Ok(())
    } else {
        Err(broken())
    }
}

/// At most `max` characters of `text`, for messages about large inputs.
fn clip(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        text.to_string()
    } else {
        let cut: String = text.chars().take(max).collect();
        format!("{cut}...")
    }
}

// ---------------------------------------------------------------------------------------------
// Settings the checks run under
// ---------------------------------------------------------------------------------------------

/// Normalisation settings: the production defaults, and a tight variant (strict adapter, small
/// shape limits and payload cap) so that short inputs reach every limit and rejection path.
pub fn normalize_settings() -> &'static [ingest::Settings; 2] {
    static SETTINGS: OnceLock<[ingest::Settings; 2]> = OnceLock::new();
    SETTINGS.get_or_init(|| {
        let defaults = Settings::default()
            .ingest()
            .unwrap_or_else(|e| unreachable!("the default settings are valid: {e}"));
        let mut tight = defaults.clone();
        tight.adapter_mode = AdapterMode::Strict;
        tight.max_payload_bytes = 4096;
        tight.shape = ShapeLimits {
            max_depth: 6,
            max_string_bytes: 96,
            max_object_keys: 12,
            max_array_items: 8,
        };
        [defaults, tight]
    })
}

/// The built-in redaction rules, as every input is redacted with them.
pub fn redactor() -> &'static Redactor {
    static REDACTOR: OnceLock<Redactor> = OnceLock::new();
    REDACTOR.get_or_init(|| {
        Redactor::new(&[], &[])
            .unwrap_or_else(|e| unreachable!("the built-in redaction rules compile: {e}"))
    })
}

// ---------------------------------------------------------------------------------------------
// JSON helpers
// ---------------------------------------------------------------------------------------------

/// Nesting depth counted as the shape limits count it: each object or array is a level, the
/// root container is level 1, scalars add none.
pub fn depth(value: &Value) -> usize {
    let mut deepest = 0;
    let mut stack = vec![(value, 1usize)];
    while let Some((v, level)) = stack.pop() {
        match v {
            Value::Array(items) => {
                deepest = deepest.max(level);
                stack.extend(items.iter().map(|i| (i, level + 1)));
            }
            Value::Object(map) => {
                deepest = deepest.max(level);
                stack.extend(map.values().map(|i| (i, level + 1)));
            }
            _ => {}
        }
    }
    deepest
}

/// Every object key and every string value of `value`.
fn strings(value: &Value) -> Vec<&str> {
    let mut out = Vec::new();
    let mut stack = vec![value];
    while let Some(v) = stack.pop() {
        match v {
            Value::String(s) => out.push(s.as_str()),
            Value::Array(items) => stack.extend(items),
            Value::Object(map) => {
                for (k, item) in map {
                    out.push(k.as_str());
                    stack.push(item);
                }
            }
            _ => {}
        }
    }
    out
}

/// Nothing in `value` that the redactor would still replace: redacting it again changes no
/// value, counts nothing, and no key or string holds a secret the string rules find.
pub fn fully_redacted(value: &Value) -> Checked {
    let r = redactor();
    let mut again = value.clone();
    let count = r.value(&mut again);
    ensure(count == 0 && again == *value, || {
        format!(
            "redacting an already redacted value replaced {count} more value(s): {} -> {}",
            clip(&value.to_string(), 400),
            clip(&again.to_string(), 400)
        )
    })?;
    for s in strings(value) {
        if let Some((redacted, _)) = r.text(s) {
            return Err(format!(
                "a redacted value still holds a secret: {:?} (the string rules give {:?})",
                clip(s, 300),
                clip(&redacted, 300)
            ));
        }
    }
    Ok(())
}

/// Whether two JSON values are equal (floats exactly: serde_json's `float_roundtrip` parser is
/// on, docs/fuzzing.md finding F3); the order of object keys is not compared.
pub fn same_json(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same_json(x, y))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, vx)| y.get(k).is_some_and(|vy| same_json(vx, vy)))
        }
        _ => a == b,
    }
}

/// An envelope serialises, deserialises to the same envelope,
/// and serialises again to the same JSON.
pub fn envelope_round_trips(envelope: &Envelope) -> Checked {
    let text =
        serde_json::to_string(envelope).map_err(|e| format!("envelope does not serialise: {e}"))?;
    let back: Envelope = serde_json::from_str(&text).map_err(|e| {
        format!(
            "a serialised envelope does not deserialise ({e}): {}",
            clip(&text, 400)
        )
    })?;
    let before =
        serde_json::to_value(envelope).map_err(|e| format!("envelope does not serialise: {e}"))?;
    let after =
        serde_json::to_value(&back).map_err(|e| format!("envelope does not serialise: {e}"))?;
    ensure(same_json(&before, &after), || {
        format!(
            "envelope changed in a JSON round trip: {} -> {}",
            clip(&text, 300),
            clip(&after.to_string(), 300)
        )
    })
}

// ---------------------------------------------------------------------------------------------
// normalize: collaboration events, runtime events, adapter packets, A2A JSON-RPC, AG-UI
// ---------------------------------------------------------------------------------------------

fn raw_ref() -> RawEventRef {
    RawEventRef {
        stream: "COLLAB_RAW".into(),
        seq: 7,
        subject: "collab.raw.k.t".into(),
        stored_at: "2026-02-17T12:00:00.000Z".into(),
    }
}

/// `ingest::normalize` under every settings variant.
pub fn normalize(bytes: &[u8]) -> Checked {
    for settings in normalize_settings() {
        normalize_with(bytes, settings)?;
    }
    Ok(())
}

/// One raw message, offline and then published under the key the normaliser chose:
/// - never panics; the `normalize` command's line is always a JSON object;
/// - a rejection has a non-empty detail with no secret in it, and a reason the router can give
///   for that input (A2A JSON-RPC inputs only `unrecognized`, for a pre-0.2 shape; AG-UI inputs
///   never are: only their type, role, ids or size can refuse them);
/// - an acceptance is at least one event, each with a role, a valid type and key token, an
///   envelope no deeper than `limits.max_depth`, nothing left to redact, and a lossless JSON
///   round trip;
/// - published on `collab.raw.<key>.<type>`, the same message gives the same envelopes.
pub fn normalize_with(bytes: &[u8], settings: &ingest::Settings) -> Checked {
    let line = ingest::normalize_line(bytes, settings);
    ensure(
        matches!(serde_json::from_str::<Value>(&line), Ok(Value::Object(_))),
        || {
            format!(
                "the normalize command printed a line that is not a JSON object: {}",
                clip(&line, 300)
            )
        },
    )?;

    let offline = RawInput {
        bytes,
        subject: None,
        raw_ref: Some(raw_ref()),
        relay: Default::default(),
    };
    let route = expected_route(bytes, settings);
    match ingest::normalize(&offline, settings) {
        Err(rejection) => {
            ensure(!rejection.detail.trim().is_empty(), || {
                format!("rejection {} has an empty detail", rejection.reason)
            })?;
            ensure(rejection.reason != DlqReason::MaxDeliver, || {
                "normalisation gave max_deliver, which only the worker may give".to_string()
            })?;
            if let Some((redacted, _)) = settings.redactor.text(&rejection.detail) {
                return Err(format!(
                    "dead-letter detail holds a secret: {:?} (redacted: {:?})",
                    clip(&rejection.detail, 300),
                    clip(&redacted, 300)
                ));
            }
            ensure(route.allows_rejection(rejection.reason), || {
                format!(
                    "input routed as {route:?} was rejected {}: {}",
                    rejection.reason, rejection.detail
                )
            })
        }
        Ok(events) => {
            ensure(!events.is_empty(), || {
                "normalize accepted the input but produced no event".to_string()
            })?;
            for n in &events {
                ensure(route.allows_event(&n.envelope.event_type), || {
                    format!(
                        "input routed as {route:?} was projected as {}",
                        n.envelope.event_type
                    )
                })?;
                normalized(n, settings)?;
                agui_kept(n, &route)?;
            }
            for n in &events {
                let online = RawInput {
                    bytes,
                    subject: Some(SubjectInfo {
                        key: n.key.clone(),
                        type_suffix: n.envelope.event_type.clone(),
                    }),
                    raw_ref: Some(raw_ref()),
                    relay: Default::default(),
                };
                match ingest::normalize(&online, settings) {
                    Ok(again) => {
                        let first: Vec<&Envelope> = events.iter().map(|e| &e.envelope).collect();
                        let second: Vec<&Envelope> = again.iter().map(|e| &e.envelope).collect();
                        ensure(first == second, || {
                            format!("published under its own key `{}` the input gives other envelopes", n.key)
                        })?;
                    }
                    Err(r) => {
                        return Err(format!(
                            "accepted offline with key `{}`, but rejected when published under that key: {} {}",
                            n.key, r.reason, r.detail
                        ))
                    }
                }
            }
            Ok(())
        }
    }
}

/// A projected AG-UI event keeps its type in `payload.agUiType` and is observability unless it
/// named its role.
fn agui_kept(n: &Normalized, route: &Route) -> Checked {
    let Route::AgUi {
        agui_type, role, ..
    } = route
    else {
        return Ok(());
    };
    let kept = n
        .envelope
        .payload
        .as_ref()
        .and_then(|p| p.get("agUiType"))
        .and_then(Value::as_str);
    ensure(kept == Some(agui_type.as_str()), || {
        format!("AG-UI {agui_type} was projected with payload.agUiType {kept:?}")
    })?;
    let want = role.as_deref().unwrap_or("system.observability");
    let got = n.envelope.event_role.map(|r| r.as_str());
    ensure(got == Some(want), || {
        format!("AG-UI {agui_type} was projected as {got:?}, not {want}")
    })
}

fn normalized(n: &Normalized, settings: &ingest::Settings) -> Checked {
    let env = &n.envelope;
    ensure(ingest::check_type(&env.event_type).is_ok(), || {
        format!(
            "projected type {:?} cannot become subject tokens",
            env.event_type
        )
    })?;
    ensure(env.event_role.is_some(), || {
        format!("{} was projected without a role", env.event_type)
    })?;
    ensure(is_key_token(&n.key), || {
        format!("projection key {:?} is not a subject token", n.key)
    })?;
    ensure(
        n.conversation_id.is_some() == env.event_type.starts_with("a2a."),
        || {
            format!(
                "{} has conversation id {:?}",
                env.event_type, n.conversation_id
            )
        },
    )?;
    ensure(n.source.is_some() == n.conversation_id.is_some(), || {
        "the producer object is attached exactly to the events the turn contract reads".to_string()
    })?;
    if let Some(conv) = &n.conversation_id {
        // A2A wire traffic's conversation is the key token the relay chose, as it is.
        ensure(encode_id(conv) == n.key || conv == &n.key, || {
            format!(
                "{} is keyed `{}`, not by its conversation {conv:?}",
                env.event_type, n.key
            )
        })?;
    }
    ensure(env.redactions != Some(0), || {
        "an envelope reports zero redactions instead of none".to_string()
    })?;

    let value =
        serde_json::to_value(env).map_err(|e| format!("envelope does not serialise: {e}"))?;
    let deep = depth(&value);
    let limit = settings
        .shape
        .max_depth
        .max(ingest::event::ENVELOPE_OWN_DEPTH);
    ensure(deep <= limit, || {
        format!(
            "projected envelope is {deep} levels deep, over limits.max_depth ({}): {}",
            settings.shape.max_depth,
            clip(&value.to_string(), 300)
        )
    })?;
    fully_redacted(&value)?;
    envelope_round_trips(env)
}

/// What the router must do with an input, judged from the input alone (after redaction, which
/// runs before routing).
#[derive(Debug, Clone, PartialEq)]
enum Route {
    /// Not a JSON document (or over the payload cap).
    NotJson,
    /// JSON, but not an object.
    NotObject,
    AdapterPacket,
    JsonRpc,
    /// An AG-UI event: the envelope type docs/contract.md section 2b gives its type, the type as published,
    /// and its explicit `eventRole` when it is a string.
    AgUi {
        class: String,
        agui_type: String,
        role: Option<String>,
    },
    /// `type` is a string: projected with that type, or refused for its type, role or key.
    Event(String),
    /// `type` is present but not a string.
    BadType,
    /// No `type` and not an adapter packet.
    Untyped,
}

impl Route {
    fn allows_rejection(&self, reason: DlqReason) -> bool {
        // Any input may break a size or shape limit.
        reason == DlqReason::TooLarge
            || match self {
                Route::NotJson => reason == DlqReason::BadJson,
                Route::NotObject | Route::JsonRpc | Route::Untyped => {
                    // JSON-RPC: A2A bodies in a pre-0.2 shape.
                    reason == DlqReason::Unrecognized
                }
                // Never for its type being unknown: AG-UI types added later are projected.
                Route::AgUi { .. } => matches!(
                    reason,
                    DlqReason::BadType | DlqReason::InvalidRole | DlqReason::BadKey
                ),
                Route::AdapterPacket => {
                    matches!(reason, DlqReason::AdapterRejected | DlqReason::BadType)
                }
                Route::Event(_) => matches!(
                    reason,
                    DlqReason::BadType | DlqReason::InvalidRole | DlqReason::BadKey
                ),
                Route::BadType => reason == DlqReason::BadType,
            }
    }

    fn allows_event(&self, event_type: &str) -> bool {
        match self {
            Route::AdapterPacket => event_type.starts_with("assay.adapter.a2a."),
            // A2A wire bodies: a turn's send or response, or task / agent information.
            Route::JsonRpc => {
                matches!(event_type, "a2a.send" | "a2a.response")
                    || event_type.starts_with("task.")
                    || event_type.starts_with("agent.")
            }
            Route::Event(t) | Route::AgUi { class: t, .. } => t == event_type,
            _ => false,
        }
    }
}

fn is_agui_type(t: &str) -> bool {
    !t.is_empty()
        && t.bytes()
            .all(|b| b.is_ascii_uppercase() || b == b'_' || b.is_ascii_digit())
        && t.bytes().any(|b| b.is_ascii_uppercase())
}

/// docs/contract.md section 2b's table, written out again here so the check does not trust the code it checks.
fn agui_class(t: &str) -> String {
    match t {
        "RUN_STARTED" => "run.started".into(),
        "RUN_FINISHED" => "run.finished".into(),
        "RUN_ERROR" => "run.failed".into(),
        "STEP_STARTED" | "STEP_FINISHED" => "run.status".into(),
        "TEXT_MESSAGE_START" | "TEXT_MESSAGE_CONTENT" | "TEXT_MESSAGE_CHUNK" => "text.delta".into(),
        "TEXT_MESSAGE_END" => "text.final".into(),
        "TOOL_CALL_START" => "tool.started".into(),
        "TOOL_CALL_ARGS" | "TOOL_CALL_CHUNK" | "TOOL_CALL_END" => "tool.args".into(),
        "TOOL_CALL_RESULT" => "tool.result".into(),
        other => other
            .split('_')
            .map(str::to_ascii_lowercase)
            .collect::<Vec<_>>()
            .join("."),
    }
}

fn expected_route(bytes: &[u8], settings: &ingest::Settings) -> Route {
    // A leading UTF-8 byte order mark is ignored (docs/contract.md); anywhere else it is not JSON.
    let bytes = ingest::without_bom(bytes);
    let Ok(mut value) = serde_json::from_slice::<Value>(bytes) else {
        return Route::NotJson;
    };
    settings.redactor.value(&mut value);
    let Value::Object(obj) = &value else {
        return Route::NotObject;
    };
    if adapter::looks_like_adapter_packet(&value) {
        return Route::AdapterPacket;
    }
    if obj.contains_key("jsonrpc") {
        return Route::JsonRpc;
    }
    match obj.get("type") {
        Some(Value::String(t)) if is_agui_type(t) => Route::AgUi {
            class: agui_class(t),
            agui_type: t.clone(),
            role: obj
                .get("eventRole")
                .and_then(Value::as_str)
                .map(str::to_string),
        },
        Some(Value::String(t)) => Route::Event(t.clone()),
        Some(_) => Route::BadType,
        None => Route::Untyped,
    }
}

// ---------------------------------------------------------------------------------------------
// adapter: the K1-A handoff adapter on raw bytes
// ---------------------------------------------------------------------------------------------

const CANONICAL_TYPES: [&str; 5] = [
    adapter::EVENT_AGENT_CAPABILITIES,
    adapter::EVENT_TASK_REQUESTED,
    adapter::EVENT_TASK_UPDATED,
    adapter::EVENT_ARTIFACT_SHARED,
    adapter::EVENT_MESSAGE,
];

/// Errors lenient mode may give: only limits, malformed input and the protocol and version
/// checks; missing ids and unmapped types are substituted, never refused.
const LENIENT_ERRORS: [&str; 7] = [
    "invalid_json",
    "too_large",
    "too_deep",
    "array_too_long",
    "not_a2a",
    "missing_version",
    "unsupported_version",
];

/// `adapter::convert_bytes` in both modes, with the default limits and with small ones:
/// - never panics; the same input converts to the same bytes every time;
/// - strict is only stricter: what strict accepts, lenient converts identically, and lenient
///   refuses only for limits, malformed JSON, protocol or version;
/// - a converted packet has a canonical type, the payload's fixed keys, digests that are the
///   SHA-256 of the canonical JSON of `handoff` and `discovery`, and a handoff that is visible
///   only for `task.requested`;
/// - every error has a message and a stable kind.
pub fn adapter(bytes: &[u8]) -> Checked {
    let small = AdapterLimits {
        max_bytes: 64 * 1024,
        max_depth: 6,
        max_array_len: 8,
    };
    for limits in [AdapterLimits::default(), small] {
        let strict = adapter::convert_bytes(bytes, AdapterMode::Strict, &limits);
        let lenient = adapter::convert_bytes(bytes, AdapterMode::Lenient, &limits);
        for result in [&strict, &lenient] {
            match result {
                Ok(c) => canonical(c)?,
                Err(e) => {
                    ensure(
                        !e.to_string().trim().is_empty() && !e.kind().is_empty(),
                        || format!("adapter error {e:?} has no message or kind"),
                    )?;
                }
            }
        }
        if let (Ok(_), Err(e)) = (&strict, &lenient) {
            return Err(format!("strict accepted what lenient refused: {e}"));
        }
        if let (Ok(s), Ok(l)) = (&strict, &lenient) {
            ensure(s == l, || {
                format!(
                    "strict and lenient convert an input both accept differently: {:?} vs {:?}",
                    s.payload, l.payload
                )
            })?;
        }
        if let Err(e) = &lenient {
            ensure(LENIENT_ERRORS.contains(&e.kind()), || {
                format!("lenient mode refused with {}: {e}", e.kind())
            })?;
        }
        let again = adapter::convert_bytes(bytes, AdapterMode::Lenient, &limits);
        ensure(again == lenient, || {
            "the same packet converted differently twice".to_string()
        })?;
    }
    Ok(())
}

fn canonical(c: &Canonical) -> Checked {
    ensure(CANONICAL_TYPES.contains(&c.event_type.as_str()), || {
        format!("converted to unknown type {:?}", c.event_type)
    })?;
    let Value::Object(payload) = &c.payload else {
        return Err("canonical payload is not an object".to_string());
    };
    for key in [
        "adapter_id",
        "adapter_version",
        "protocol",
        "protocol_name",
        "protocol_version",
        "agent",
        "discovery",
        "handoff",
        "unmapped_fields_count",
    ] {
        ensure(payload.contains_key(key), || {
            format!("canonical payload has no `{key}`")
        })?;
    }
    ensure(
        payload
            .get("unmapped_fields_count")
            .is_some_and(Value::is_u64),
        || "unmapped_fields_count is not a count".to_string(),
    )?;
    let handoff = payload.get("handoff").cloned().unwrap_or_default();
    let discovery = payload.get("discovery").cloned().unwrap_or_default();
    ensure(c.handoff_digest == adapter::digest(&handoff), || {
        "handoff digest is not the digest of payload.handoff".to_string()
    })?;
    ensure(c.discovery_digest == adapter::digest(&discovery), || {
        "discovery digest is not the digest of payload.discovery".to_string()
    })?;
    ensure(
        handoff.get("visible") == Some(&Value::Bool(c.handoff_visible)),
        || "handoff_visible disagrees with payload.handoff.visible".to_string(),
    )?;
    ensure(
        !c.handoff_visible || c.event_type == adapter::EVENT_TASK_REQUESTED,
        || format!("a {} event made the handoff visible", c.event_type),
    )?;
    let text = adapter::canonical_json(&c.payload);
    let reparsed: Value = serde_json::from_str(&text)
        .map_err(|e| format!("canonical JSON does not parse ({e}): {}", clip(&text, 300)))?;
    ensure(same_json(&reparsed, &c.payload), || {
        format!(
            "canonical JSON does not parse back to the payload: {}",
            clip(&text, 300)
        )
    })
}

// ---------------------------------------------------------------------------------------------
// redact: the redactor on JSON values and on text
// ---------------------------------------------------------------------------------------------

/// The redactor on the input as JSON (when it parses) and as text (when it is UTF-8):
/// - never panics; it counts a replacement exactly when it changed something;
/// - idempotent: redacting the result again changes nothing and counts nothing;
/// - nothing is left that the string rules would redact, in values or keys;
/// - every value under a sensitive key is a marker (or null or a boolean, which are kept).
pub fn redact(bytes: &[u8]) -> Checked {
    let r = redactor();
    if let Ok(original) = serde_json::from_slice::<Value>(bytes) {
        let mut value = original.clone();
        let count = r.value(&mut value);
        ensure((count > 0) == (value != original), || {
            format!(
                "redaction counted {count} but the value {} changed",
                if value != original { "was" } else { "was not" }
            )
        })?;
        fully_redacted(&value)?;
        sensitive_values_are_markers(&value)?;
    }
    if let Ok(text) = std::str::from_utf8(bytes) {
        if let Some((redacted, count)) = r.text(text) {
            ensure(count > 0 && redacted != text, || {
                format!(
                    "text redaction returned {count} replacement(s) for {:?} -> {:?}",
                    clip(text, 200),
                    clip(&redacted, 200)
                )
            })?;
            ensure(r.text(&redacted).is_none(), || {
                format!(
                    "redacting text twice changed it again: {:?} -> {:?}",
                    clip(text, 200),
                    clip(&redacted, 200)
                )
            })?;
        }
    }
    Ok(())
}

/// Every value under a key the redactor treats as sensitive is a `[redacted:..]` marker, null
/// or a boolean.
fn sensitive_values_are_markers(value: &Value) -> Checked {
    let r = redactor();
    let mut stack = vec![value];
    while let Some(v) = stack.pop() {
        match v {
            Value::Array(items) => stack.extend(items),
            Value::Object(map) => {
                for (k, item) in map {
                    // A key is sensitive when a value under it alone is replaced.
                    let mut probe = serde_json::Map::new();
                    probe.insert(k.clone(), Value::from(1));
                    let mut probe = Value::Object(probe);
                    let sensitive = r.value(&mut probe) > 0;
                    if !sensitive {
                        stack.push(item);
                        continue;
                    }
                    let ok = match item {
                        Value::Null | Value::Bool(_) => true,
                        Value::String(s) => s.starts_with("[redacted:") && s.ends_with(']'),
                        _ => false,
                    };
                    ensure(ok, || {
                        format!(
                            "the value under sensitive key {k:?} was kept: {}",
                            clip(&item.to_string(), 200)
                        )
                    })?;
                }
            }
            _ => {}
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// envelope: deserialising `model::Envelope` and round-tripping it
// ---------------------------------------------------------------------------------------------

/// Deserialising an envelope (as the API and the session fold read projections): never panics,
/// and whatever deserialises round-trips losslessly through JSON, as bytes and as a value.
pub fn envelope(bytes: &[u8]) -> Checked {
    let Ok(env) = serde_json::from_slice::<Envelope>(bytes) else {
        return Ok(());
    };
    envelope_round_trips(&env)?;
    let value =
        serde_json::to_value(&env).map_err(|e| format!("envelope does not serialise: {e}"))?;
    let back: Envelope = serde_json::from_value(value.clone())
        .map_err(|e| format!("an envelope's JSON value does not deserialise: {e}"))?;
    ensure(back == env, || {
        format!(
            "envelope changed in a value round trip: {}",
            clip(&value.to_string(), 300)
        )
    })?;
    ensure(value.get("type").is_some_and(Value::is_string), || {
        "a serialised envelope has no string `type`".to_string()
    })
}

// ---------------------------------------------------------------------------------------------
// config: loading a TOML file into Settings and validating it
// ---------------------------------------------------------------------------------------------

/// The settings' section names, as the default settings serialise them (so a section added to
/// `Settings` is known here too), read once: an error that names a key names one of these or a
/// key in one.
static SECTIONS: std::sync::LazyLock<Vec<String>> = std::sync::LazyLock::new(|| {
    serde_json::to_value(Settings::default())
        .ok()
        .and_then(|v| v.as_object().map(|o| o.keys().cloned().collect()))
        .unwrap_or_default()
});

fn scratch_file() -> PathBuf {
    let thread = format!("{:?}", std::thread::current().id());
    let thread: String = thread.chars().filter(char::is_ascii_digit).collect();
    std::env::temp_dir().join(format!(
        "collab-projector-hostile-{}-{thread}.toml",
        std::process::id()
    ))
}

/// `Settings::load` on the bytes as a TOML configuration file:
/// - never panics;
/// - loaded settings validate, give normalisation settings, and load the same a second time;
/// - an error says what is wrong where: it names a key or a section, or the line and column
///   of the syntax error.
pub fn config(bytes: &[u8]) -> Checked {
    let path = scratch_file();
    std::fs::write(&path, bytes).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    let first = Settings::load(Some(&path));
    let second = Settings::load(Some(&path));
    let _ = std::fs::remove_file(&path);
    match first {
        Ok(settings) => {
            ensure(settings.validate().is_ok(), || {
                "loaded settings do not validate".to_string()
            })?;
            settings
                .ingest()
                .map_err(|e| format!("loaded settings give no normalisation settings: {e}"))?;
            ensure(second.as_ref().is_ok_and(|s| *s == settings), || {
                "the same file loaded twice gave different settings".to_string()
            })
        }
        Err(e) => {
            ensure(second.is_err(), || {
                "the same file loaded once failed and once succeeded".to_string()
            })?;
            config_error(&e.to_string())
        }
    }
}

/// A configuration error names what is wrong: a key or section, or a position in the file.
pub fn config_error(message: &str) -> Checked {
    let detail = message.trim_start_matches("configuration:").trim();
    ensure(!detail.is_empty(), || {
        format!("configuration error without a detail: {message:?}")
    })?;
    let names_key = SECTIONS.iter().any(|s| detail.contains(s.as_str()))
        || detail.contains("key")
        || detail.contains("field")
        || detail.contains('`');
    let names_position = detail.contains("line") && detail.contains("column");
    ensure(names_key || names_position, || {
        format!("configuration error names neither a key nor a position: {message:?}")
    })
}

// ---------------------------------------------------------------------------------------------
// query: the query string of GET /api/events
// ---------------------------------------------------------------------------------------------

/// The parameters `GET /api/events` accepts.
pub const EVENTS_PARAMS: [&str; 7] = ["role", "type", "key", "view", "limit", "after", "before"];
const DEFAULT_LIMIT: usize = 100;
const MAX_LIMIT: usize = 1000;

/// The bytes as the query string of `GET /api/events`, decoded as the API's extractor decodes
/// it (a string that is not a URI is refused before the API sees it).
pub fn query(bytes: &[u8]) -> Checked {
    let Ok(text) = std::str::from_utf8(bytes) else {
        return Ok(());
    };
    let Ok(uri) = format!("/api/events?{text}").parse::<Uri>() else {
        return Ok(());
    };
    match Query::<Vec<(String, String)>>::try_from_uri(&uri) {
        Ok(Query(pairs)) => events_query(pairs),
        // The extractor's refusal is the API's `bad_query` answer.
        Err(_) => Ok(()),
    }
}

/// What `GET /api/events` derives from its parameters before it reads the store:
/// - never panics; a refusal is a 400 with a code and a message;
/// - an acceptance has a limit in 1..=1000, cursors that can be stepped past without
///   overflowing, valid types, key tokens, and subject filters that are well-formed NATS
///   subjects whose only wildcards are a whole `*` key token or a final `>`.
pub fn events_query(pairs: Vec<(String, String)>) -> Checked {
    match parse_events_query(pairs) {
        Err(e) => {
            // 400 for a malformed query; 410 `version_switched` for a well-formed cursor that
            // another projection version issued (docs/contract.md, "Serving a version").
            let gone = e.status == StatusCode::GONE && e.code == "version_switched";
            ensure(e.status == StatusCode::BAD_REQUEST || gone, || {
                format!("a query was refused with {} ({})", e.status, e.code)
            })?;
            ensure(!e.code.is_empty() && !e.message.trim().is_empty(), || {
                format!("a query refusal has no code or message: {e:?}")
            })
        }
        Ok(parsed) => {
            ensure((1..=MAX_LIMIT).contains(&parsed.limit), || {
                format!("limit {} accepted", parsed.limit)
            })?;
            for cursor in [parsed.after, parsed.before].into_iter().flatten() {
                ensure(cursor.checked_add(1).is_some(), || {
                    format!("cursor {cursor} accepted; the page after it starts at {cursor} + 1, which overflows")
                })?;
            }
            let sel = &parsed.selection;
            for t in &sel.types {
                ensure(query::valid_type(t), || format!("type {t:?} accepted"))?;
            }
            for k in &sel.keys {
                ensure(is_key_token(k), || {
                    format!("key {k:?} accepted as a subject token")
                })?;
            }
            let roles: Vec<Role> = sel.roles.clone().unwrap_or_else(|| Role::ALL.to_vec());
            for filter in query::subject_filters("collab", &roles, &sel.keys, &sel.types) {
                subject_filter(&filter)?;
            }
            Ok(())
        }
    }
}

struct EventsQuery {
    limit: usize,
    after: Option<u64>,
    before: Option<u64>,
    selection: query::Selection,
}

fn parse_events_query(pairs: Vec<(String, String)>) -> Result<EventsQuery, ApiError> {
    let params = Params::new(pairs, &EVENTS_PARAMS)?;
    let limit = query::limit(&params, DEFAULT_LIMIT, MAX_LIMIT)?;
    let cursor = |name: &str| -> Result<Option<u64>, ApiError> {
        params
            .one(name)?
            .filter(|c| !c.is_empty())
            .map(|c| query::decode_cursor(0, &c))
            .transpose()
    };
    let after = cursor("after")?;
    let before = cursor("before")?;
    let selection = query::selection(&params)?;
    Ok(EventsQuery {
        limit,
        after,
        before,
        selection,
    })
}

/// `collab.proj.<role>.<key>.<type>`: non-empty tokens without whitespace or control
/// characters; `*` only as the whole key token, `>` only as the whole last token.
fn subject_filter(filter: &str) -> Checked {
    let tokens: Vec<&str> = filter.split('.').collect();
    let last = tokens.len().saturating_sub(1);
    for (i, token) in tokens.iter().enumerate() {
        let wildcard = (*token == "*") || (*token == ">" && i == last);
        let plain = !token.is_empty()
            && !token
                .chars()
                .any(|c| c.is_whitespace() || c.is_control() || c == '*' || c == '>');
        ensure(wildcard || plain, || {
            format!("malformed subject filter {filter:?} (token {token:?})")
        })?;
    }
    ensure(filter.starts_with("collab.proj."), || {
        format!("subject filter {filter:?} outside the projections")
    })
}
