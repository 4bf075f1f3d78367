//! AG-UI events (docs/contract.md format 5, section 2b) as seed 003 runtime events.
//!
//! An AG-UI event is rewritten into the runtime-event object [`event::from_event`] reads, so it
//! gets the envelope, facets, depth check and role checks every other event gets; the redactor
//! has already run over the whole object in [`super::normalize`]. Each field of the AG-UI event
//! ends up in exactly one place, an envelope slot or the payload: nothing is dropped.
//!
//! # Where the run contract reads its facts
//!
//! For every projected AG-UI event ([`AgUiFacts::of`] reads them back):
//! - `payload.agUiType`: the AG-UI type as published (`RUN_STARTED`, `TOOL_CALL_END`, ...);
//!   it is what tells an AG-UI `run.started` from a seed 003 one. An input field that was
//!   itself named `agUiType` is kept as `payload._input.agUiType`.
//! - the envelope's `runId`, `threadId`, `messageId` (`Envelope::run_id`, `thread_id`,
//!   `message_id`): AG-UI's ids of the same names, always strings (checked here, see
//!   [`ID_FIELDS`] and [`required_ids`]).
//! - `payload.toolCallId`, `payload.parentMessageId`, `payload.parentRunId`: strings when
//!   present; there is no envelope slot for them.
//! - [`super::Normalized::key`]: the raw subject's key (producers key AG-UI events by
//!   `threadId`, else `runId`), so one thread's runs share a partition and its event order.
//!
//! `RUN_ERROR` carries no ids in AG-UI (nor do `STEP_*` and the state events): which run they
//! belong to follows from the key and the order of the partition.

use super::event;
use super::input::{check_type, json_kind, Normalized, RawInput, Settings};
pub use crate::facts::{envelope_type, is_agui_type, AgUiFacts, TYPE_FIELD};
use crate::model::{encode_id, id_text, DlqReason, Rejection, Role};
use crate::redact::{Flushed, StreamId, StreamKind, StreamRedactor};
use serde_json::{Map, Value};

/// AG-UI's id fields. The protocol defines them as strings, and runs, messages and tool calls
/// are matched by them, so a number or an object there is refused rather than projected.
pub const ID_FIELDS: [&str; 7] = [
    "threadId",
    "runId",
    "parentRunId",
    "messageId",
    "parentMessageId",
    "toolCallId",
    "entityId",
];

/// The ids AG-UI requires on an event type (its Python and TypeScript SDKs refuse the event
/// without them). Chunk events and types this version does not know require none.
pub fn required_ids(agui_type: &str) -> &'static [&'static str] {
    match agui_type {
        "RUN_STARTED" | "RUN_FINISHED" => &["threadId", "runId"],
        "TEXT_MESSAGE_START"
        | "TEXT_MESSAGE_CONTENT"
        | "TEXT_MESSAGE_END"
        | "ACTIVITY_SNAPSHOT"
        | "ACTIVITY_DELTA"
        | "REASONING_START"
        | "REASONING_MESSAGE_START"
        | "REASONING_MESSAGE_CONTENT"
        | "REASONING_MESSAGE_END"
        | "REASONING_END" => &["messageId"],
        "TOOL_CALL_START" | "TOOL_CALL_ARGS" | "TOOL_CALL_END" => &["toolCallId"],
        "TOOL_CALL_RESULT" => &["messageId", "toolCallId"],
        "REASONING_ENCRYPTED_VALUE" => &["entityId"],
        _ => &[],
    }
}

/// Ids with an envelope slot: lifted out of the payload. AG-UI defines the first three; the
/// others are seed 003 ids a producer may add, and docs/contract.md section 5 puts every id in its slot.
const ENVELOPE_IDS: [&str; 11] = [
    "threadId",
    "runId",
    "messageId",
    "sessionId",
    "turnId",
    "taskId",
    "agentId",
    "parentSessionId",
    "parentThreadId",
    "conversationId",
    "workSessionId",
];

/// Map one AG-UI event (already redacted) onto the envelope.
pub fn from_agui(
    obj: &Map<String, Value>,
    agui_type: &str,
    input: &RawInput<'_>,
    settings: &Settings,
) -> Result<Normalized, Rejection> {
    let runtime = runtime_event(obj, agui_type)?;
    let mut normalized = event::from_event(&runtime, input, settings)?;
    if input.subject.is_none() {
        // Offline there is no subject: key as producers are asked to (threadId, else runId);
        // without either, from_event's choice stands.
        if let Some(id) = ["threadId", "runId"]
            .iter()
            .find_map(|k| obj.get(*k).and_then(id_text))
        {
            normalized.key = encode_id(&id);
        }
    }
    Ok(normalized)
}

/// The seed 003 runtime event for an AG-UI event: the mapped `type`, the role, `timestamp` and
/// the ids in their slots, a phase where AG-UI states one, and every other field in `payload`
/// beside `agUiType`.
pub fn runtime_event(
    obj: &Map<String, Value>,
    agui_type: &str,
) -> Result<Map<String, Value>, Rejection> {
    let event_type = envelope_type(agui_type);
    if check_type(&event_type).is_err() {
        return Err(Rejection::new(
            DlqReason::BadType,
            format!(
                "AG-UI type `{agui_type}` maps to `{event_type}`, which cannot become subject tokens; separate the words of the type with single underscores (e.g. TOOL_CALL_START)"
            ),
        ));
    }
    if event_type.starts_with("a2a.") {
        // a2a.* types carry the turn contract and must be keyed by their conversation: an
        // observability event must not be able to open or answer a turn.
        return Err(Rejection::new(
            DlqReason::BadType,
            format!(
                "AG-UI type `{agui_type}` would be projected as `{event_type}`, a collaboration type with its own key and turn rules (docs/contract.md section 4); publish collaboration events with their dotted type, or send this as a CUSTOM event with a `name`"
            ),
        ));
    }
    check_ids(obj, agui_type)?;

    let mut out = Map::new();
    let mut payload = Map::new();
    payload.insert(TYPE_FIELD.into(), Value::String(agui_type.to_string()));
    out.insert("type".into(), Value::String(event_type));
    // Written out even when absent, so the class-based rules of section 3 (`task.*`,
    // `a2a.*`) never apply to an AG-UI event: 2b makes them observability unless they say
    // otherwise. A present value goes through the usual check (`invalid_role`).
    let role = obj
        .get("eventRole")
        .filter(|v| !v.is_null())
        .cloned()
        .unwrap_or_else(|| Value::String(Role::SystemObservability.as_str().to_string()));
    out.insert("eventRole".into(), role);
    for (name, value) in obj {
        match name.as_str() {
            "type" | "eventRole" => {}
            "timestamp" => {
                out.insert(name.clone(), value.clone());
            }
            n if ENVELOPE_IDS.contains(&n) => {
                out.insert(name.clone(), value.clone());
            }
            TYPE_FIELD => {
                let input = payload
                    .entry("_input")
                    .or_insert_with(|| Value::Object(Map::new()));
                if let Value::Object(m) = input {
                    m.insert(name.clone(), value.clone());
                }
            }
            _ => {
                payload.insert(name.clone(), value.clone());
            }
        }
    }
    if let Some(phase) = phase(agui_type, obj) {
        out.insert("phase".into(), Value::String(phase.to_string()));
    }
    out.insert("payload".into(), Value::Object(payload));
    Ok(out)
}

/// Phases AG-UI states itself, where the class table would say less. A step belongs to a run
/// that is executing; a run that finished on an interrupt is paused, not completed.
fn phase(agui_type: &str, obj: &Map<String, Value>) -> Option<&'static str> {
    match agui_type {
        "STEP_STARTED" | "STEP_FINISHED" => Some("acting"),
        "RUN_FINISHED"
            if obj
                .get("outcome")
                .and_then(|o| o.get("type"))
                .and_then(Value::as_str)
                == Some("interrupt") =>
        {
            Some("interrupted")
        }
        _ => None,
    }
}

/// Every AG-UI id present is a string, and the ids the type requires are there and not blank.
fn check_ids(obj: &Map<String, Value>, agui_type: &str) -> Result<(), Rejection> {
    for field in ID_FIELDS {
        match obj.get(field) {
            None | Some(Value::Null) | Some(Value::String(_)) => {}
            Some(other) => {
                return Err(Rejection::new(
                    DlqReason::BadKey,
                    format!(
                        "AG-UI {agui_type}: `{field}` must be a string, got {}; publish AG-UI ids as JSON strings",
                        json_kind(other)
                    ),
                ));
            }
        }
    }
    for field in required_ids(agui_type) {
        let present = obj
            .get(*field)
            .and_then(Value::as_str)
            .is_some_and(|s| !s.trim().is_empty());
        if !present {
            return Err(Rejection::new(
                DlqReason::BadKey,
                format!(
                    "AG-UI {agui_type} has no `{field}`: AG-UI requires it on this event and runs, messages and tool calls are matched by it; set it to a non-empty string"
                ),
            ));
        }
    }
    Ok(())
}

// ---- streamed deltas ---------------------------------------------------------------------

/// Marks a delta that publishes text a stream redactor held back: a `*_CONTENT` event made
/// when its message, its tool call or its run ended (or when too many were open).
pub const FLUSH_FIELD: &str = "redactionFlush";

/// The stream a delta-carrying AG-UI type belongs to, and the field holding its id.
fn stream_of(agui_type: &str) -> Option<(StreamKind, &'static str)> {
    match agui_type {
        "TEXT_MESSAGE_CONTENT" | "TEXT_MESSAGE_CHUNK" => Some((StreamKind::Text, "messageId")),
        "TOOL_CALL_ARGS" | "TOOL_CALL_CHUNK" => Some((StreamKind::ToolArgs, "toolCallId")),
        "REASONING_MESSAGE_CONTENT" | "REASONING_MESSAGE_CHUNK" => {
            Some((StreamKind::Reasoning, "messageId"))
        }
        _ => None,
    }
}

/// The stream an AG-UI type ends, and the field holding its id.
fn stream_ended_by(agui_type: &str) -> Option<(StreamKind, &'static str)> {
    match agui_type {
        "TEXT_MESSAGE_END" => Some((StreamKind::Text, "messageId")),
        "TOOL_CALL_END" => Some((StreamKind::ToolArgs, "toolCallId")),
        "REASONING_MESSAGE_END" => Some((StreamKind::Reasoning, "messageId")),
        _ => None,
    }
}

/// A delta event publishing a stream's held text, with the subject key of its stream.
pub type FlushEvent = (String, Map<String, Value>);

/// A delta event carrying a stream's held text.
pub(crate) fn flush_event(f: Flushed, current: &Map<String, Value>) -> FlushEvent {
    let (agui_type, id_field) = match f.id.kind {
        StreamKind::Text => ("TEXT_MESSAGE_CONTENT", "messageId"),
        StreamKind::ToolArgs => ("TOOL_CALL_ARGS", "toolCallId"),
        StreamKind::Reasoning => ("REASONING_MESSAGE_CONTENT", "messageId"),
    };
    let mut out = Map::new();
    out.insert("type".into(), Value::String(agui_type.into()));
    out.insert(id_field.into(), Value::String(f.id.id));
    // The ending event's thread, run and time, when it is of the same key.
    for k in ["threadId", "runId", "timestamp"] {
        if let Some(v) = current.get(k) {
            out.insert(k.into(), v.clone());
        }
    }
    out.insert("delta".into(), Value::String(f.text));
    out.insert(FLUSH_FIELD.into(), Value::Bool(true));
    (f.id.key, out)
}

/// What an AG-UI event does to the partition's streams, read before anything else touches it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamStep {
    /// Not a stream event (or one without an id or a text delta).
    None,
    /// A delta of a stream, its text taken out of the event (left as `""`).
    Delta { id: StreamId, raw: String },
    /// The end of one stream (`*_END`).
    End(StreamId),
    /// The end of every stream of the key (`RUN_FINISHED`, `RUN_ERROR`).
    EndKey(String),
}

/// Read what `obj` does to the streams of `key`; a delta's raw text is taken out of `obj`, so
/// the redaction of the whole event never sees it alone.
pub fn stream_step(obj: &mut Map<String, Value>, key: &str) -> StreamStep {
    let Some(agui_type) = obj.get("type").and_then(Value::as_str).map(str::to_string) else {
        return StreamStep::None;
    };
    let id_of = |obj: &Map<String, Value>, kind, field: &str| {
        obj.get(field)
            .and_then(Value::as_str)
            .filter(|id| !id.trim().is_empty())
            .map(|id| StreamId {
                key: key.to_string(),
                kind,
                id: id.to_string(),
            })
    };
    if let Some((kind, field)) = stream_of(&agui_type) {
        let Some(id) = id_of(obj, kind, field) else {
            return StreamStep::None;
        };
        return match obj.get_mut("delta") {
            Some(Value::String(delta)) => StreamStep::Delta {
                id,
                raw: std::mem::take(delta),
            },
            _ => StreamStep::None,
        };
    }
    if let Some((kind, field)) = stream_ended_by(&agui_type) {
        return id_of(obj, kind, field).map_or(StreamStep::None, StreamStep::End);
    }
    if matches!(agui_type.as_str(), "RUN_FINISHED" | "RUN_ERROR") {
        return StreamStep::EndKey(key.to_string());
    }
    StreamStep::None
}

/// Apply a step to the partition's streams once its event was projected (`n`, mapped from the
/// event `obj`): a delta's `payload.delta` becomes what the stream redactor publishes for it;
/// an end gives the delta events that publish the held text, each with the key it belongs to,
/// to be projected before `n`. Also the matches replaced.
pub fn apply_stream_step(
    step: StreamStep,
    n: &mut Normalized,
    obj: &Map<String, Value>,
    seq: Option<u64>,
    streams: &mut StreamRedactor,
) -> (Vec<FlushEvent>, u64) {
    let mut flushed = Vec::new();
    let mut count = 0;
    match step {
        StreamStep::None => {}
        StreamStep::Delta { id, raw } => {
            let pushed = streams.push(&id, seq, &raw);
            count = pushed.redactions;
            // The stream's one pass, then the rules run to their fixed point like on any string.
            let text = match streams.redactor().text(&pushed.text) {
                Some((again, n)) => {
                    count += n;
                    again
                }
                None => pushed.text,
            };
            if let Some(Value::Object(p)) = n.envelope.payload.as_mut() {
                p.insert("delta".into(), Value::String(text));
            }
            flushed.extend(pushed.evicted);
        }
        StreamStep::End(id) => flushed.extend(streams.finish(&id, seq)),
        StreamStep::EndKey(key) => flushed = streams.finish_key(&key, seq),
    }
    let events = flushed.into_iter().map(|f| flush_event(f, obj)).collect();
    (events, count)
}

#[cfg(test)]
mod tests {
    use super::super::{default_settings, normalize, SubjectInfo};
    use super::*;
    use serde_json::json;
    use std::path::{Path, PathBuf};

    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/agui-spec");

    fn run(v: &Value, subject: Option<&str>) -> Result<Normalized, Rejection> {
        let bytes = serde_json::to_vec(v).expect("serialises");
        let input = RawInput {
            bytes: &bytes,
            subject: subject.map(|key| SubjectInfo {
                key: key.into(),
                type_suffix: "agui".into(),
            }),
            raw_ref: None,
            relay: Default::default(),
        };
        let mut events = normalize(&input, default_settings())?;
        assert_eq!(events.len(), 1, "one AG-UI event gives one envelope");
        Ok(events.remove(0))
    }

    fn ok(v: Value) -> Normalized {
        run(&v, None).unwrap_or_else(|r| panic!("{v} was dead-lettered {}: {}", r.reason, r.detail))
    }

    fn refused(v: Value) -> Rejection {
        match run(&v, None) {
            Err(r) => r,
            Ok(n) => panic!("{v} was projected as {:?}", n.envelope),
        }
    }

    fn payload(n: &Normalized) -> &Map<String, Value> {
        n.envelope
            .payload
            .as_ref()
            .and_then(Value::as_object)
            .expect("payload object")
    }

    #[test]
    fn envelope_types_follow_the_contract_table() {
        for (agui, class) in [
            ("RUN_STARTED", "run.started"),
            ("RUN_FINISHED", "run.finished"),
            ("RUN_ERROR", "run.failed"),
            ("STEP_STARTED", "run.status"),
            ("STEP_FINISHED", "run.status"),
            ("TEXT_MESSAGE_START", "text.delta"),
            ("TEXT_MESSAGE_CONTENT", "text.delta"),
            ("TEXT_MESSAGE_CHUNK", "text.delta"),
            ("TEXT_MESSAGE_END", "text.final"),
            ("TOOL_CALL_START", "tool.started"),
            ("TOOL_CALL_ARGS", "tool.args"),
            ("TOOL_CALL_CHUNK", "tool.args"),
            ("TOOL_CALL_END", "tool.args"),
            ("TOOL_CALL_RESULT", "tool.result"),
            ("STATE_SNAPSHOT", "state.snapshot"),
            ("STATE_DELTA", "state.delta"),
            ("MESSAGES_SNAPSHOT", "messages.snapshot"),
            ("REASONING_START", "reasoning.start"),
            ("REASONING_MESSAGE_CONTENT", "reasoning.message.content"),
            ("REASONING_MESSAGE_CHUNK", "reasoning.message.chunk"),
            ("REASONING_ENCRYPTED_VALUE", "reasoning.encrypted.value"),
            ("THINKING_START", "thinking.start"),
            (
                "THINKING_TEXT_MESSAGE_CONTENT",
                "thinking.text.message.content",
            ),
            ("ACTIVITY_SNAPSHOT", "activity.snapshot"),
            ("ACTIVITY_DELTA", "activity.delta"),
            ("RAW", "raw"),
            ("CUSTOM", "custom"),
            ("FOO_BAR", "foo.bar"),
            ("V2_THING", "v2.thing"),
        ] {
            assert!(is_agui_type(agui), "{agui}");
            assert_eq!(envelope_type(agui), class, "{agui}");
        }
        for not_agui in ["run.started", "Run_Started", "", "_", "123", "RUN STARTED"] {
            assert!(!is_agui_type(not_agui), "{not_agui:?}");
        }
    }

    #[test]
    fn run_events_keep_their_ids_in_slots_and_are_keyed_by_thread() {
        let n = ok(json!({
            "type": "RUN_STARTED", "timestamp": 1771329600000_i64,
            "threadId": "thread-1", "runId": "run-1", "parentRunId": "run-0",
            "input": {"messages": []}
        }));
        let env = &n.envelope;
        assert_eq!(env.event_type, "run.started");
        assert_eq!(env.event_role, Some(Role::SystemObservability));
        assert_eq!(env.thread_id, Some(json!("thread-1")));
        assert_eq!(env.run_id, Some(json!("run-1")));
        assert_eq!(env.timestamp.as_deref(), Some("2026-02-17T12:00:00.000Z"));
        assert_eq!(
            (
                env.owner.as_deref(),
                env.phase.as_deref(),
                env.surface.as_deref()
            ),
            (Some("runtime"), Some("submitted"), Some("runtime_status"))
        );
        assert_eq!(
            payload(&n),
            json!({"agUiType": "RUN_STARTED", "parentRunId": "run-0", "input": {"messages": []}})
                .as_object()
                .expect("object")
        );
        assert_eq!(n.key, "thread-1");
        assert_eq!(n.conversation_id, None);
        assert_eq!(n.source, None, "no turn facts for AG-UI events");

        let finished = ok(json!({"type": "RUN_FINISHED", "threadId": "t:1", "runId": "r1"}));
        assert_eq!(finished.envelope.event_type, "run.finished");
        assert_eq!(finished.envelope.phase.as_deref(), Some("completed"));
        assert_eq!(
            finished.key,
            encode_id("t:1"),
            "ids that are not tokens are encoded"
        );

        let error = ok(json!({"type": "RUN_ERROR", "message": "boom", "code": "E1"}));
        assert_eq!(error.envelope.event_type, "run.failed");
        assert_eq!(error.envelope.phase.as_deref(), Some("failed"));
        assert_eq!(error.key, "_", "no id at all: from_event's fallback");
        assert_eq!(payload(&error)["message"], "boom");
    }

    #[test]
    fn offline_keys_fall_back_from_thread_to_run_to_the_runtime_rule() {
        let only_run = ok(json!({"type": "RUN_ERROR", "runId": "r-9", "message": "x"}));
        assert_eq!(only_run.key, "r-9");
        let session = ok(json!({"type": "CUSTOM", "name": "n", "sessionId": "s-1"}));
        assert_eq!(session.key, "s-1");
        assert_eq!(session.envelope.session_id, Some(json!("s-1")));
        assert!(!payload(&session).contains_key("sessionId"));
    }

    #[test]
    fn the_subject_key_wins_when_there_is_a_subject() {
        let v = json!({"type": "RUN_STARTED", "threadId": "thread-1", "runId": "run-1"});
        let n = run(&v, Some("other-key")).expect("projected");
        assert_eq!(n.key, "other-key");
        assert_eq!(n.envelope.thread_id, Some(json!("thread-1")));
    }

    #[test]
    fn step_events_are_run_status_of_an_acting_run() {
        for t in ["STEP_STARTED", "STEP_FINISHED"] {
            let n = ok(json!({"type": t, "stepName": "plan"}));
            assert_eq!(n.envelope.event_type, "run.status");
            assert_eq!(n.envelope.phase.as_deref(), Some("acting"), "{t}");
            assert_eq!(payload(&n)["stepName"], "plan");
            assert_eq!(payload(&n)["agUiType"], t);
        }
    }

    #[test]
    fn a_run_that_finished_on_an_interrupt_is_interrupted() {
        let n = ok(json!({
            "type": "RUN_FINISHED", "threadId": "t", "runId": "r",
            "outcome": {"type": "interrupt", "interrupts": [{"id": "i1"}]}
        }));
        assert_eq!(n.envelope.phase.as_deref(), Some("interrupted"));
        let n = ok(
            json!({"type": "RUN_FINISHED", "threadId": "t", "runId": "r", "outcome": {"type": "success"}}),
        );
        assert_eq!(n.envelope.phase.as_deref(), Some("completed"));
    }

    #[test]
    fn text_messages_including_chunks_are_text_delta_until_the_end() {
        let start =
            ok(json!({"type": "TEXT_MESSAGE_START", "messageId": "m1", "role": "assistant"}));
        let content = ok(json!({"type": "TEXT_MESSAGE_CONTENT", "messageId": "m1", "delta": "hi"}));
        let chunk = ok(json!({"type": "TEXT_MESSAGE_CHUNK", "messageId": "m1", "delta": "!"}));
        let end = ok(json!({"type": "TEXT_MESSAGE_END", "messageId": "m1"}));
        for n in [&start, &content, &chunk] {
            assert_eq!(n.envelope.event_type, "text.delta");
        }
        assert_eq!(end.envelope.event_type, "text.final");
        for n in [&start, &content, &chunk, &end] {
            assert_eq!(n.envelope.message_id, Some(json!("m1")));
            assert_eq!(n.envelope.surface.as_deref(), Some("conversation"));
            assert_eq!(n.envelope.event_role, Some(Role::SystemObservability));
        }
        assert_eq!(
            payload(&start)["role"],
            "assistant",
            "the message role stays"
        );
        assert_eq!(payload(&content)["delta"], "hi");
        // A chunk may leave out every id: AG-UI fills it from the chunk before it.
        let bare = ok(json!({"type": "TEXT_MESSAGE_CHUNK", "delta": "x"}));
        assert_eq!(bare.envelope.message_id, None);
    }

    #[test]
    fn reasoning_and_thinking_are_the_model_reasoning() {
        for (v, class) in [
            (
                json!({"type": "REASONING_MESSAGE_CONTENT", "messageId": "m", "delta": "why"}),
                "reasoning.message.content",
            ),
            (
                json!({"type": "REASONING_MESSAGE_CHUNK", "delta": "so"}),
                "reasoning.message.chunk",
            ),
            (
                json!({"type": "REASONING_ENCRYPTED_VALUE", "subtype": "message", "entityId": "m", "encryptedValue": "opaque"}),
                "reasoning.encrypted.value",
            ),
            (
                json!({"type": "THINKING_TEXT_MESSAGE_CONTENT", "delta": "hmm"}),
                "thinking.text.message.content",
            ),
            (
                json!({"type": "THINKING_START", "title": "t"}),
                "thinking.start",
            ),
        ] {
            let n = ok(v);
            assert_eq!(n.envelope.event_type, class);
            assert_eq!(n.envelope.phase.as_deref(), Some("reasoning"), "{class}");
            assert_eq!(
                n.envelope.surface.as_deref(),
                Some("inline_process"),
                "{class}"
            );
        }
    }

    #[test]
    fn tool_calls_including_chunks_and_the_end_of_the_arguments() {
        let start = ok(json!({
            "type": "TOOL_CALL_START", "toolCallId": "tc1", "toolCallName": "search",
            "parentMessageId": "m1"
        }));
        assert_eq!(start.envelope.event_type, "tool.started");
        assert_eq!(payload(&start)["toolCallId"], "tc1");
        assert_eq!(payload(&start)["parentMessageId"], "m1");
        assert_eq!(
            start.envelope.message_id, None,
            "the parent is not the event's message"
        );
        assert_eq!(start.envelope.phase.as_deref(), Some("acting"));

        for (v, agui) in [
            (
                json!({"type": "TOOL_CALL_ARGS", "toolCallId": "tc1", "delta": "{\"q\":"}),
                "TOOL_CALL_ARGS",
            ),
            (
                json!({"type": "TOOL_CALL_CHUNK", "toolCallId": "tc1", "delta": "1}"}),
                "TOOL_CALL_CHUNK",
            ),
            (json!({"type": "TOOL_CALL_CHUNK"}), "TOOL_CALL_CHUNK"),
            (
                json!({"type": "TOOL_CALL_END", "toolCallId": "tc1"}),
                "TOOL_CALL_END",
            ),
        ] {
            let n = ok(v);
            assert_eq!(n.envelope.event_type, "tool.args");
            assert_eq!(payload(&n)["agUiType"], agui);
        }

        let result = ok(json!({
            "type": "TOOL_CALL_RESULT", "toolCallId": "tc1", "messageId": "m2",
            "content": "{\"ok\":true}", "role": "tool"
        }));
        assert_eq!(result.envelope.event_type, "tool.result");
        assert_eq!(result.envelope.message_id, Some(json!("m2")));
        assert_eq!(result.envelope.phase.as_deref(), Some("completed"));
        assert_eq!(payload(&result)["content"], "{\"ok\":true}");
    }

    #[test]
    fn state_and_message_snapshots() {
        let snap = ok(json!({"type": "STATE_SNAPSHOT", "snapshot": {"n": 1}}));
        assert_eq!(snap.envelope.event_type, "state.snapshot");
        assert_eq!(payload(&snap)["snapshot"], json!({"n": 1}));
        let delta =
            ok(json!({"type": "STATE_DELTA", "delta": [{"op": "add", "path": "/n", "value": 2}]}));
        assert_eq!(delta.envelope.event_type, "state.delta");
        assert_eq!(delta.envelope.persistence.as_deref(), Some("snapshot"));
        let msgs = ok(
            json!({"type": "MESSAGES_SNAPSHOT", "messages": [{"id": "m1", "role": "user", "content": "hi"}]}),
        );
        assert_eq!(msgs.envelope.event_type, "messages.snapshot");
        assert_eq!(msgs.envelope.phase.as_deref(), Some("hydrating"));
    }

    #[test]
    fn activity_raw_custom_and_future_types_keep_their_own_names() {
        for (v, class) in [
            (
                json!({"type": "ACTIVITY_SNAPSHOT", "messageId": "m", "activityType": "PLAN", "content": {}}),
                "activity.snapshot",
            ),
            (
                json!({"type": "ACTIVITY_DELTA", "messageId": "m", "activityType": "PLAN", "patch": []}),
                "activity.delta",
            ),
            (
                json!({"type": "RAW", "event": {"x": 1}, "source": "s"}),
                "raw",
            ),
            (json!({"type": "CUSTOM", "name": "n", "value": 1}), "custom"),
            (json!({"type": "FOO_BAR", "anything": [1, 2]}), "foo.bar"),
            // A future type in a namespace the role rules know still gets 2b's role.
            (
                json!({"type": "TASK_UPDATED", "taskId": "t1"}),
                "task.updated",
            ),
        ] {
            let agui = v["type"].as_str().unwrap_or_default().to_string();
            let n = ok(v);
            assert_eq!(n.envelope.event_type, class);
            assert_eq!(
                n.envelope.event_role,
                Some(Role::SystemObservability),
                "{class}"
            );
            assert_eq!(payload(&n)["agUiType"], agui.as_str());
        }
        let future = ok(json!({"type": "FOO_BAR", "anything": [1, 2]}));
        assert_eq!(
            future.envelope.owner, None,
            "an unknown class gets no facets"
        );
        assert_eq!(payload(&future)["anything"], json!([1, 2]));
    }

    #[test]
    fn an_explicit_event_role_wins_and_an_invalid_one_is_dead_lettered() {
        let n = ok(
            json!({"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": "hi", "eventRole": "conversation.main"}),
        );
        assert_eq!(n.envelope.event_role, Some(Role::ConversationMain));
        assert!(!payload(&n).contains_key("eventRole"));
        let n = ok(json!({"type": "CUSTOM", "name": "x", "eventRole": null}));
        assert_eq!(n.envelope.event_role, Some(Role::SystemObservability));

        let r = refused(json!({"type": "CUSTOM", "name": "x", "eventRole": "conversation.mian"}));
        assert_eq!(r.reason, DlqReason::InvalidRole);
        assert!(r.detail.contains("conversation.mian"), "{}", r.detail);
        let r = refused(json!({"type": "CUSTOM", "name": "x", "eventRole": 3}));
        assert_eq!(r.reason, DlqReason::InvalidRole);
    }

    #[test]
    fn ids_that_are_not_strings_are_dead_lettered_naming_the_field() {
        let r = refused(json!({"type": "RUN_STARTED", "threadId": 7, "runId": "r"}));
        assert_eq!(r.reason, DlqReason::BadKey);
        assert!(
            r.detail.contains("RUN_STARTED")
                && r.detail.contains("`threadId` must be a string, got number"),
            "{}",
            r.detail
        );
        for v in [
            json!({"type": "TOOL_CALL_CHUNK", "toolCallId": {"id": 1}}),
            json!({"type": "TOOL_CALL_START", "toolCallId": "t", "parentMessageId": true}),
            json!({"type": "FOO_BAR", "runId": [1]}),
        ] {
            assert_eq!(refused(v).reason, DlqReason::BadKey);
        }
    }

    #[test]
    fn missing_required_ids_are_dead_lettered_naming_the_field() {
        for (v, field) in [
            (json!({"type": "RUN_STARTED", "threadId": "t"}), "runId"),
            (
                json!({"type": "RUN_FINISHED", "runId": "r", "threadId": " "}),
                "threadId",
            ),
            (
                json!({"type": "TEXT_MESSAGE_CONTENT", "delta": "x"}),
                "messageId",
            ),
            (
                json!({"type": "TOOL_CALL_END", "toolCallId": null}),
                "toolCallId",
            ),
            (
                json!({"type": "TOOL_CALL_RESULT", "toolCallId": "t", "content": ""}),
                "messageId",
            ),
            (
                json!({"type": "REASONING_ENCRYPTED_VALUE", "subtype": "message"}),
                "entityId",
            ),
        ] {
            let r = refused(v);
            assert_eq!(r.reason, DlqReason::BadKey);
            assert!(r.detail.contains(&format!("`{field}`")), "{}", r.detail);
        }
    }

    #[test]
    fn types_that_cannot_be_projected_are_bad_type_naming_the_ag_ui_type() {
        for t in ["RUN__STARTED", "_RUN", "RUN_"] {
            let r = refused(json!({ "type": t }));
            assert_eq!(r.reason, DlqReason::BadType, "{t}");
            assert!(r.detail.contains(&format!("`{t}`")), "{}", r.detail);
        }
        let r = refused(json!({"type": "A2A_SEND", "conversationId": "c1"}));
        assert_eq!(r.reason, DlqReason::BadType);
        assert!(r.detail.contains("a2a.send"), "{}", r.detail);
    }

    #[test]
    fn secrets_are_redacted_before_the_mapping_sees_them() {
        let n = ok(json!({
            "type": "CUSTOM", "threadId": "t1", "name": "login",
            "value": {"password": "hunter2", "header": "Bearer abc123def456"}
        }));
        let text = serde_json::to_string(&n.envelope).expect("serialises");
        assert!(
            !text.contains("hunter2") && !text.contains("abc123def456"),
            "{text}"
        );
        assert_eq!(payload(&n)["value"]["password"], "[redacted:password]");
        assert_eq!(n.envelope.redactions, Some(2));
        assert_eq!(payload(&n)["agUiType"], "CUSTOM");

        let n = ok(json!({
            "type": "TOOL_CALL_ARGS", "toolCallId": "tc1",
            "delta": "{\"apiKey\":\"k-1\",\"url\":\"https://u:pw@example.com\"}"
        }));
        let delta = payload(&n)["delta"].as_str().unwrap_or_default();
        assert!(!delta.contains("k-1") && !delta.contains(":pw@"), "{delta}");

        // A dead-letter detail never repeats a secret either.
        let r =
            refused(json!({"type": "RUN_STARTED", "threadId": "t", "runId": 5, "token": "s3cr3t"}));
        assert!(!r.detail.contains("s3cr3t"));
    }

    /// Normalise `events` in order as one partition does, with a stream redactor; the
    /// projected envelopes.
    fn streamed(events: &[Value], limits: crate::redact::StreamLimits) -> Vec<Normalized> {
        let s = default_settings();
        let mut streams = StreamRedactor::new(s.redactor.clone(), limits);
        let mut out = Vec::new();
        for (i, v) in events.iter().enumerate() {
            let bytes = serde_json::to_vec(v).expect("serialises");
            let key = v["threadId"].as_str().unwrap_or("thread-1").to_string();
            let input = RawInput {
                bytes: &bytes,
                subject: Some(SubjectInfo {
                    key,
                    type_suffix: "agui".into(),
                }),
                raw_ref: Some(crate::model::RawEventRef {
                    stream: "COLLAB_RAW".into(),
                    seq: i as u64 + 1,
                    subject: "collab.raw.thread-1.agui".into(),
                    stored_at: "2026-02-17T12:00:00.000Z".into(),
                }),
                relay: Default::default(),
            };
            out.extend(
                super::super::normalize_streamed(&input, s, &mut streams)
                    .unwrap_or_else(|r| panic!("{v}: {} {}", r.reason, r.detail)),
            );
        }
        out
    }

    /// The text of the projected deltas of `agui_type` with `id_field == id`, concatenated.
    fn assembled(out: &[Normalized], agui_type: &str, id_field: &str, id: &str) -> String {
        out.iter()
            .filter(|n| payload(n)["agUiType"] == agui_type)
            .filter(|n| {
                payload(n).get(id_field).and_then(Value::as_str) == Some(id)
                    || n.envelope.message_id.as_ref().and_then(Value::as_str) == Some(id)
            })
            .filter_map(|n| payload(n).get("delta").and_then(Value::as_str))
            .collect()
    }

    #[test]
    fn a_secret_split_over_streamed_deltas_is_redacted_in_the_assembled_text() {
        let token = "ghp_R2d2C3poBb8Yoda4Luke5Leia6Han7Solo9x";
        let (a, b) = token.split_at(17);
        let events = [
            json!({"type": "RUN_STARTED", "threadId": "thread-1", "runId": "r1"}),
            json!({"type": "TEXT_MESSAGE_START", "messageId": "m1", "role": "assistant"}),
            json!({"type": "TEXT_MESSAGE_CONTENT", "messageId": "m1", "delta": format!("Your token is {a}")}),
            json!({"type": "TEXT_MESSAGE_CONTENT", "messageId": "m1", "delta": format!("{b} and it works.")}),
            json!({"type": "TEXT_MESSAGE_END", "messageId": "m1"}),
            json!({"type": "TOOL_CALL_START", "toolCallId": "tc1", "toolCallName": "deploy"}),
            json!({"type": "TOOL_CALL_ARGS", "toolCallId": "tc1", "delta": "{\"token\":\"hf_FakeTokenFor"}),
            json!({"type": "TOOL_CALL_ARGS", "toolCallId": "tc1", "delta": "TestsOnly0123456789abcdef\"}"}),
            json!({"type": "TOOL_CALL_END", "toolCallId": "tc1"}),
            json!({"type": "TEXT_MESSAGE_CONTENT", "messageId": "m2", "delta": "left open sk_live_4eC39HqLy"}),
            json!({"type": "TEXT_MESSAGE_CONTENT", "messageId": "m2", "delta": "jWDarjtT1zdp7dcFAKE"}),
            json!({"type": "RUN_FINISHED", "threadId": "thread-1", "runId": "r1"}),
        ];
        let out = streamed(&events, Default::default());
        assert!(
            out.len() > events.len(),
            "held text was published by more deltas"
        );
        let all = serde_json::to_string(&out.iter().map(|n| &n.envelope).collect::<Vec<_>>())
            .expect("serialises");
        for secret in [
            "R2d2C3poBb8Yoda4Luke5",
            "TestsOnly0123456789",
            "jWDarjtT1zdp7dcFAKE",
        ] {
            assert!(!all.contains(secret), "{secret} in {all}");
        }
        assert_eq!(
            assembled(&out, "TEXT_MESSAGE_CONTENT", "messageId", "m1"),
            "Your token is [redacted:github] and it works."
        );
        assert_eq!(
            assembled(&out, "TOOL_CALL_ARGS", "toolCallId", "tc1"),
            "{\"token\":\"[redacted:secret]\"}"
        );
        assert_eq!(
            assembled(&out, "TEXT_MESSAGE_CONTENT", "messageId", "m2"),
            "left open [redacted:stripe]"
        );
        // The held text is published by delta events just before the event that ended it.
        let types: Vec<String> = out
            .iter()
            .map(|n| {
                payload(n)["agUiType"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string()
            })
            .collect();
        let end = types
            .iter()
            .position(|t| t == "TEXT_MESSAGE_END")
            .expect("END");
        assert_eq!(types[end - 1], "TEXT_MESSAGE_CONTENT");
        assert_eq!(payload(&out[end - 1])[FLUSH_FIELD], true);
        let last = out.len() - 1;
        assert_eq!(types[last], "RUN_FINISHED");
        assert_eq!(out[last - 1].envelope.message_id, Some(json!("m2")));
        assert_eq!(payload(&out[last - 1])[FLUSH_FIELD], true);
        assert!(out.iter().all(|n| n.key == "thread-1"));
    }

    #[test]
    fn a_stream_evicted_to_make_room_is_published_under_its_own_key() {
        let limits = crate::redact::StreamLimits {
            hold: 64,
            max_hold: 256,
            max_open: 1,
        };
        let events = [
            json!({"type": "TEXT_MESSAGE_CONTENT", "threadId": "ta", "messageId": "ma", "delta": "first thread text"}),
            // A chunk without an id is redacted on its own and opens no stream.
            json!({"type": "TEXT_MESSAGE_CHUNK", "threadId": "tb", "delta": "loose chunk"}),
            json!({"type": "TOOL_CALL_ARGS", "threadId": "tb", "toolCallId": "tc", "delta": "{\"a\":1}"}),
            json!({"type": "TOOL_CALL_END", "threadId": "tb", "toolCallId": "tc"}),
        ];
        let out = streamed(&events, limits);
        let summary: Vec<(String, String, String)> = out
            .iter()
            .map(|n| {
                (
                    n.key.clone(),
                    payload(n)["agUiType"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string(),
                    payload(n)
                        .get("delta")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_string(),
                )
            })
            .collect();
        let row = |k: &str, t: &str, d: &str| (k.to_string(), t.to_string(), d.to_string());
        assert_eq!(
            summary,
            [
                // The last word waits.
                row("ta", "TEXT_MESSAGE_CONTENT", "first thread "),
                row("tb", "TEXT_MESSAGE_CHUNK", "loose chunk"),
                // Opening the tool call's stream closed the oldest, on its own key.
                row("ta", "TEXT_MESSAGE_CONTENT", "text"),
                row("tb", "TOOL_CALL_ARGS", "{\"a\":1}"),
                row("tb", "TOOL_CALL_END", ""),
            ]
        );
        assert_eq!(payload(&out[2])[FLUSH_FIELD], true);
        assert_eq!(out[2].envelope.message_id, Some(json!("ma")));
        assert_eq!(payload(&out[0]).get(FLUSH_FIELD), None);
    }

    #[test]
    fn a_dead_lettered_delta_never_reaches_the_stream() {
        let s = default_settings();
        let mut streams = StreamRedactor::new(s.redactor.clone(), Default::default());
        let mut publish = |v: Value, seq: u64| {
            let bytes = serde_json::to_vec(&v).expect("serialises");
            let input = RawInput {
                bytes: &bytes,
                subject: Some(SubjectInfo {
                    key: "t".into(),
                    type_suffix: "agui".into(),
                }),
                raw_ref: Some(crate::model::RawEventRef {
                    stream: "COLLAB_RAW".into(),
                    seq,
                    subject: "collab.raw.t.agui".into(),
                    stored_at: "2026-02-17T12:00:00.000Z".into(),
                }),
                relay: Default::default(),
            };
            super::super::normalize_streamed(&input, s, &mut streams)
        };
        let bad = publish(
            json!({"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": "refused words", "eventRole": "nope"}),
            1,
        );
        assert!(bad.is_err());
        let ok = publish(
            json!({"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": "kept words "}),
            2,
        )
        .unwrap_or_else(|r| panic!("{}", r.detail));
        assert_eq!(payload(&ok[0])["delta"], "kept words ");
        let end = publish(json!({"type": "TEXT_MESSAGE_END", "messageId": "m"}), 3)
            .unwrap_or_else(|r| panic!("{}", r.detail));
        assert_eq!(end.len(), 1, "nothing was held");
    }

    /// The streamed cases of the redaction corpus, normalised as a worker with a stream
    /// redactor would: none of their secrets is projected (`tests/it/redaction.rs` does the same
    /// through the bus once the worker normalises that way).
    #[test]
    fn the_streamed_redaction_corpus_projects_no_secret() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/redaction");
        let mut seen = 0;
        for entry in std::fs::read_dir(dir).expect("corpus") {
            let path = entry.expect("entry").path();
            if path.extension().is_none_or(|x| x != "json") {
                continue;
            }
            let case: Value =
                serde_json::from_slice(&std::fs::read(&path).expect("readable")).expect("JSON");
            if case["streamed"] != true {
                continue;
            }
            seen += 1;
            let messages = case["messages"].as_array().cloned().unwrap_or_default();
            let out = streamed(&messages, Default::default());
            let text = serde_json::to_string(&out.iter().map(|n| &n.envelope).collect::<Vec<_>>())
                .expect("serialises");
            for secret in case["secrets"].as_array().into_iter().flatten() {
                let secret = secret.as_str().unwrap_or_default();
                assert!(
                    !text.contains(secret),
                    "{}: {secret} in {text}",
                    path.display()
                );
            }
            assert!(text.contains("[redacted:"), "{}", path.display());
        }
        assert!(seen >= 2, "{seen} streamed cases");
    }

    #[test]
    fn without_a_stream_redactor_each_delta_is_redacted_alone() {
        let n = ok(
            json!({"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": "hi sk_live_4eC39HqLyjWDarjtT1zdp7dcFAKE"}),
        );
        assert_eq!(payload(&n)["delta"], "hi [redacted:stripe]");
    }

    #[test]
    fn every_field_lands_in_a_slot_or_the_payload() {
        let v = json!({
            "type": "TEXT_MESSAGE_START", "messageId": "m1", "threadId": "t1", "runId": "r1",
            "timestamp": 1771329600000_i64, "role": "assistant", "name": "Agent",
            "metadata": {"k": "v"}, "rawEvent": {"x": 1}, "agUiType": "spoof",
            "data": {"a": 1}, "payload": {"b": 2}, "phase": "theirs", "sequence": 4
        });
        let n = ok(v.clone());
        let p = payload(&n);
        assert_eq!(p["agUiType"], "TEXT_MESSAGE_START");
        assert_eq!(p["_input"]["agUiType"], "spoof");
        for k in [
            "role", "name", "metadata", "rawEvent", "data", "payload", "phase", "sequence",
        ] {
            assert_eq!(p[k], v[k], "{k}");
        }
        assert_eq!(
            n.envelope.sequence, None,
            "AG-UI fields are not seed 003 slots"
        );
        assert_eq!(n.envelope.phase.as_deref(), Some("producing"));
        assert_eq!(p.len(), 10);

        // A timestamp that cannot be read stays in the payload, as for runtime events.
        let n = ok(json!({"type": "CUSTOM", "name": "n", "timestamp": "yesterday"}));
        assert_eq!(n.envelope.timestamp, None);
        assert_eq!(payload(&n)["timestamp"], "yesterday");
    }

    #[test]
    fn the_run_contract_reads_its_facts_back_from_the_envelope() {
        let n = ok(
            json!({"type": "TOOL_CALL_END", "toolCallId": "tc1", "threadId": "t", "runId": "r"}),
        );
        let facts = AgUiFacts::of(&n.envelope).expect("AG-UI facts");
        assert_eq!(
            facts,
            AgUiFacts {
                agui_type: "TOOL_CALL_END",
                thread_id: Some("t"),
                run_id: Some("r"),
                message_id: None,
                tool_call_id: Some("tc1"),
            }
        );
        let runtime = run(&json!({"type": "run.started", "runId": "r"}), Some("k")).expect("ok");
        assert_eq!(AgUiFacts::of(&runtime.envelope), None);
        let mislabelled = run(
            &json!({"type": "run.finished", "payload": {"agUiType": "RUN_STARTED"}}),
            Some("k"),
        )
        .expect("ok");
        assert_eq!(AgUiFacts::of(&mislabelled.envelope), None);
    }

    // ---- golden files -----------------------------------------------------------------

    fn fixture_inputs() -> Vec<PathBuf> {
        let mut inputs: Vec<PathBuf> = std::fs::read_dir(FIXTURES)
            .expect("fixture dir readable")
            .map(|e| e.expect("dir entry").path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.ends_with(".json") && !n.ends_with(".expected.json"))
            })
            .collect();
        inputs.sort();
        inputs
    }

    /// One entry per event of the input array: `{"key", "envelope"}` or `{"error": {...}}`,
    /// normalised offline with the default settings.
    fn render_golden(raw: &[u8]) -> String {
        let events: Vec<Value> = serde_json::from_slice(raw).expect("fixture is a JSON array");
        let out: Vec<Value> = events
            .iter()
            .map(|event| {
                let bytes = serde_json::to_vec(event).expect("serialises");
                let input = RawInput {
                    bytes: &bytes,
                    subject: None,
                    raw_ref: None,
                    relay: Default::default(),
                };
                match normalize(&input, default_settings()) {
                    Ok(ns) => Value::Array(
                        ns.into_iter()
                            .map(|n| json!({"key": n.key, "envelope": n.envelope}))
                            .collect(),
                    ),
                    Err(r) => json!({"error": {"reason": r.reason.as_str(), "detail": r.detail}}),
                }
            })
            .map(|v| match v {
                // One AG-UI event is one envelope: unwrap the one-element list.
                Value::Array(mut one) if one.len() == 1 => one.remove(0),
                other => other,
            })
            .collect();
        let mut text = serde_json::to_string_pretty(&out).expect("serializes");
        text.push('\n');
        text
    }

    /// Diffs every input against `X.expected.json`; with `UPDATE_GOLDEN=1` rewrites them
    /// instead (review the diff before committing).
    #[test]
    fn golden_files_match_byte_for_byte() {
        let inputs = fixture_inputs();
        assert_eq!(
            inputs.len(),
            7,
            "expected the 7 AG-UI compat fixtures in {FIXTURES}"
        );
        let mut failures = Vec::new();
        for input in &inputs {
            let raw = std::fs::read(input).expect("input readable");
            let stem = input
                .file_stem()
                .and_then(|s| s.to_str())
                .expect("utf-8 name");
            let expected_path = Path::new(FIXTURES).join(format!("{stem}.expected.json"));
            failures.extend(crate::golden::check(&expected_path, &render_golden(&raw)));
        }
        assert!(
            failures.is_empty(),
            "golden mismatch (UPDATE_GOLDEN=1 regenerates; check the mapping first):\n{}",
            failures.join("\n")
        );
    }

    #[test]
    fn no_ag_ui_fixture_event_is_dead_lettered() {
        let mut seen = 0;
        for input in fixture_inputs() {
            let raw = std::fs::read(&input).expect("input readable");
            let events: Vec<Value> = serde_json::from_slice(&raw).expect("array");
            for event in events {
                seen += 1;
                let n = ok(event.clone());
                assert_eq!(
                    payload(&n)["agUiType"],
                    event["type"],
                    "{}",
                    input.display()
                );
            }
        }
        assert!(seen >= 40, "only {seen} fixture events");
    }

    #[test]
    fn nothing_ag_ui_is_dead_lettered_unrecognized() {
        let odd = [
            json!({"type": "RUN_STARTED"}),
            json!({"type": "NEW_EVENT_FROM_2027", "x": {"y": [1]}}),
            json!({"type": "X"}),
            json!({"type": "RUN_STARTED", "threadId": 1}),
            json!({"type": "A2A_SEND"}),
            json!({"type": "RUN__X"}),
            json!({"type": "CUSTOM", "eventRole": "nope"}),
        ];
        for v in odd {
            if let Err(r) = run(&v, None) {
                assert_ne!(r.reason, DlqReason::Unrecognized, "{v}: {}", r.detail);
            }
        }
    }
}
