//! Normalisation: one raw message in, projected envelopes (or a dead-letter reason) out.
//!
//! Pure functions of the bytes, the subject and configuration: no I/O, no clock. The format is
//! recognised from the body (docs/contract.md section 2):
//! 1. A2A adapter packets (`protocol == "a2a"` with `event_type`) go through the K1-A adapter;
//! 2. collaboration events (seed 000: `type` + fields at the top level or under `data`) and
//! 3. runtime events (seed 003 envelope) share one mapping in [`event`];
//! 4. A2A JSON-RPC traffic is recognised and reported as not supported yet, so it is
//!    dead-lettered with a precise reason instead of being mis-projected;
//! 5. AG-UI events (a SCREAMING_SNAKE_CASE `type`) are rewritten as runtime events by [`agui`]
//!    and then take the runtime events' mapping, whatever their type.
//!
//! What every format reads and writes (the settings, the raw input, the normalised event) is in
//! [`input`], below the formats; this module only dispatches to them.

pub mod a2a_wire;
pub mod adapter;
pub mod agui;
pub mod event;
pub mod input;

pub(crate) use input::json_kind;
pub use input::{
    check_type, Normalized, RawInput, RelayHeaders, Settings, ShapeLimits, SubjectInfo,
};

use crate::model::{DlqReason, Rejection};
use crate::redact::StreamRedactor;
use serde_json::Value;

/// Normalise one raw message.
pub fn normalize(input: &RawInput<'_>, settings: &Settings) -> Result<Vec<Normalized>, Rejection> {
    normalize_with(input, settings, None)
}

/// Normalise one raw message of a partition whose streamed text is redacted over whole
/// messages: AG-UI deltas go through `streams` (the partition's [`StreamRedactor`], fed the
/// partition's messages in order), so a secret split over deltas is caught. An event that ends
/// a stream (`*_END`, `RUN_FINISHED`, `RUN_ERROR`) is preceded by the delta events that publish
/// what was held back (`payload.redactionFlush: true`).
pub fn normalize_streamed(
    input: &RawInput<'_>,
    settings: &Settings,
    streams: &mut StreamRedactor,
) -> Result<Vec<Normalized>, Rejection> {
    normalize_with(input, settings, Some(streams))
}

fn normalize_with(
    input: &RawInput<'_>,
    settings: &Settings,
    streams: Option<&mut StreamRedactor>,
) -> Result<Vec<Normalized>, Rejection> {
    normalize_unredacted(input, settings, streams).map_err(|mut rejection| {
        // A detail quotes parts of the input (a type, an id), and the words around a quote can
        // complete a secret's pattern (`aws_secret_access_key="...`): the detail is redacted as
        // a whole before it reaches a dead letter or a log line.
        if let Some((redacted, _)) = settings.redactor.text(&rejection.detail) {
            rejection.detail = redacted;
        }
        rejection
    })
}

/// `bytes` without a leading UTF-8 byte order mark.
pub fn without_bom(bytes: &[u8]) -> &[u8] {
    bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes)
}

fn normalize_unredacted(
    input: &RawInput<'_>,
    settings: &Settings,
    streams: Option<&mut StreamRedactor>,
) -> Result<Vec<Normalized>, Rejection> {
    if settings.max_payload_bytes > 0 && input.bytes.len() > settings.max_payload_bytes {
        return Err(Rejection::new(
            DlqReason::TooLarge,
            format!(
                "message is {} bytes, over max_payload_bytes ({}); split it, or offload large fields and publish a reference",
                input.bytes.len(),
                settings.max_payload_bytes
            ),
        ));
    }
    // A UTF-8 byte order mark before the JSON is ignored, as RFC 8259 (section 8.1) lets a
    // parser do and as the agents' own JSON libraries do.
    let body = without_bom(input.bytes);
    let mut value: Value = serde_json::from_slice(body).map_err(|e| {
        Rejection::new(
            DlqReason::BadJson,
            format!("body is not valid UTF-8 JSON ({e}); publish one JSON object per message"),
        )
    })?;
    settings
        .shape
        .check(&value)
        .map_err(|detail| Rejection::new(DlqReason::TooLarge, detail))?;
    // A streamed delta's raw text is taken out here and redacted over its whole message below,
    // once the event is known to be projected (a dead-lettered delta never reaches a stream).
    let step = match (&streams, &mut value) {
        (Some(_), Value::Object(obj)) if is_agui(obj) => {
            let key = stream_key(obj, input);
            agui::stream_step(obj, &key)
        }
        _ => agui::StreamStep::None,
    };
    let redactions = settings.redactor.value(&mut value);
    let obj = object(&value)?;

    let type_suffix = input.subject.as_ref().map(|s| s.type_suffix.as_str());
    let wire = a2a_wire::is_wire(obj, type_suffix, &input.relay);
    // A body a relay published as one side of an A2A exchange is read as wire traffic whatever
    // else it looks like: an adapter packet's agent ids would otherwise speak for the relay's.
    let relayed = wire && input.relay.direction.is_some();
    if !relayed && adapter::looks_like_adapter_packet(&value) {
        return event::from_adapter_packet(&value, input, settings)
            .map(|n| counted(vec![n], redactions));
    }
    if wire {
        return from_wire(obj, input, settings).map(|n| counted(vec![n], redactions));
    }
    // An event outside a conversation has no turn facts to read from its object later: its body
    // moves into the envelope.
    let done_once_mapped = matches!(obj.get("type"),
        Some(Value::String(t)) if !event::in_conversation(t) && !agui::is_agui_type(t));
    if done_once_mapped {
        if let Value::Object(obj) = &mut value {
            return event::from_event_taking(obj, input, settings)
                .map(|n| counted(vec![n], redactions));
        }
    }
    let obj = object(&value)?;
    let events = match obj.get("type") {
        Some(Value::String(t)) if agui::is_agui_type(t) => {
            let mut n = agui::from_agui(obj, t, input, settings)?;
            // The relay names the run of every AG-UI event it publishes (`Collab-Run-Id`): an
            // event that names none itself (a tool call, a text message, a `RUN_ERROR`) takes
            // it, so every event of a relayed run says which run it belongs to.
            if n.envelope.run_id.is_none() {
                if let Some(run) = input.relay.run_id.as_deref().filter(|r| !r.trim().is_empty()) {
                    n.envelope.run_id = Some(Value::String(run.to_string()));
                }
            }
            let (flushes, streamed) = match streams {
                Some(streams) => {
                    let seq = input.raw_ref.as_ref().map(|r| r.seq);
                    agui::apply_stream_step(step, &mut n, obj, seq, streams)
                }
                None => (Vec::new(), 0),
            };
            let mut events = flushed_events(flushes, input, settings);
            events.extend(counted(vec![n], redactions + streamed));
            return Ok(with_source(events, value));
        }
        Some(Value::String(_)) => event::from_event(obj, input, settings).map(|n| vec![n]),
        Some(other) => Err(Rejection::new(
            DlqReason::BadType,
            format!("`type` must be a string such as \"a2a.send\", got {}", json_kind(other)),
        )),
        None => Err(Rejection::new(
            DlqReason::Unrecognized,
            "object has no `type` and is not an A2A adapter packet (`protocol: \"a2a\"` with `event_type`); add a `type` such as \"a2a.send\" or \"task.updated\"",
        )),
    }?;
    Ok(with_source(counted(events, redactions), value))
}

/// The body's object, or why a body that is not one cannot be projected.
fn object(value: &Value) -> Result<&serde_json::Map<String, Value>, Rejection> {
    match value {
        Value::Object(obj) => Ok(obj),
        other => Err(Rejection::new(
            DlqReason::Unrecognized,
            format!(
                "body is a JSON {}, not an object; publish one JSON object per message",
                json_kind(other)
            ),
        )),
    }
}

/// Map an A2A wire body: translate it into the collaboration event it stands for, then map
/// that like any other. The turn contract reads its facts from the translated event; the
/// conversation is the exchange's (the subject key the relay chose for it), whatever `contextId`
/// the answers reveal (the payload's `contextId` shows the context).
fn from_wire(
    obj: &serde_json::Map<String, Value>,
    input: &RawInput<'_>,
    settings: &Settings,
) -> Result<Normalized, Rejection> {
    let key = input.subject.as_ref().map(|s| s.key.clone());
    let relay = subject_side(input)?;
    let translated = a2a_wire::translate(obj, key.as_deref(), &relay)?;
    let offline = RawInput {
        bytes: input.bytes,
        subject: None,
        raw_ref: input.raw_ref.clone(),
        relay: RelayHeaders::default(),
    };
    let mut n = event::from_event(&translated, &offline, settings)?;
    n.key = key.unwrap_or_else(|| a2a_wire::offline_key(&translated));
    if n.conversation_id.is_some() {
        n.source = Some(std::sync::Arc::new(translated));
    }
    Ok(n)
}

/// The relay's headers, with the side the subject names: `a2a.wire.request` is the caller's
/// words, `a2a.wire.response` and `a2a.wire.stream` the agent's (as a relay publishes them, each
/// under its speaker's identity). A `Collab-Direction` that says otherwise is refused: the
/// subject is what the server's permissions checked.
fn subject_side(input: &RawInput<'_>) -> Result<RelayHeaders, Rejection> {
    let named = match input.subject.as_ref().map(|s| s.type_suffix.as_str()) {
        Some("a2a.wire.request") => RelayHeaders::DIRECTION_REQUEST,
        Some("a2a.wire.response" | "a2a.wire.stream") => RelayHeaders::DIRECTION_ANSWER,
        _ => return Ok(input.relay.clone()),
    };
    match input.relay.direction.as_deref() {
        None => Ok(RelayHeaders {
            direction: Some(named.to_string()),
            ..input.relay.clone()
        }),
        Some(d) if d == named => Ok(input.relay.clone()),
        Some(other) => Err(Rejection::new(
            DlqReason::Unrecognized,
            format!(
                "published on a subject for the {} side (a2a.wire.request is the caller's, a2a.wire.response and a2a.wire.stream the agent's) with Collab-Direction {other:?}; the subject and the header must name the same side",
                if named == RelayHeaders::DIRECTION_REQUEST { "caller's" } else { "agent's" }
            ),
        )),
    }
}

/// Whether a parsed object is an AG-UI event.
fn is_agui(obj: &serde_json::Map<String, Value>) -> bool {
    matches!(obj.get("type"), Some(Value::String(t)) if agui::is_agui_type(t))
}

/// The key streams are told apart by: the raw subject's key, or offline the key the event
/// would be projected under (its thread, else its run).
fn stream_key(obj: &serde_json::Map<String, Value>, input: &RawInput<'_>) -> String {
    match &input.subject {
        Some(s) => s.key.clone(),
        None => ["threadId", "runId"]
            .iter()
            .find_map(|k| obj.get(*k).and_then(crate::model::id_text))
            .map_or_else(|| "_".to_string(), |id| crate::model::encode_id(&id)),
    }
}

/// The delta event that publishes what a stream redactor still held of a stream the run
/// contract ended (a run's timeout): the `*_CONTENT` event a real end would have been preceded
/// by, with `context`'s `threadId` and `runId`, marked `payload.redactionFlush`. `None` when the
/// event cannot be mapped (it is made from ids already checked, so that does not happen).
pub fn held_text_event(
    held: crate::redact::Flushed,
    context: &serde_json::Map<String, Value>,
    settings: &Settings,
) -> Option<Normalized> {
    let (key, obj) = agui::flush_event(held, context);
    let input = RawInput {
        bytes: &[],
        subject: Some(SubjectInfo {
            key: key.clone(),
            type_suffix: String::new(),
        }),
        raw_ref: None,
        relay: RelayHeaders::default(),
    };
    flushed_events(vec![(key, obj)], &input, settings)
        .into_iter()
        .next()
}

/// The delta events that publish text a stream redactor held back, each projected under the
/// key of its stream. (They are made from ids already checked, so none is refused; one that
/// were would be left out rather than dead-letter the event that ended its stream.)
fn flushed_events(
    flushes: Vec<agui::FlushEvent>,
    input: &RawInput<'_>,
    settings: &Settings,
) -> Vec<Normalized> {
    let mut out = Vec::with_capacity(flushes.len());
    for (key, obj) in flushes {
        let mut value = Value::Object(obj);
        let redactions = settings.redactor.value(&mut value);
        let Value::Object(obj) = &value else { continue };
        let Some(Value::String(t)) = obj.get("type") else {
            continue;
        };
        let keyed = RawInput {
            bytes: input.bytes,
            subject: Some(SubjectInfo {
                key,
                type_suffix: input
                    .subject
                    .as_ref()
                    .map(|s| s.type_suffix.clone())
                    .unwrap_or_default(),
            }),
            raw_ref: input.raw_ref.clone(),
            relay: input.relay.clone(),
        };
        if let Ok(n) = agui::from_agui(obj, t, &keyed, settings) {
            out.extend(counted(vec![n], redactions));
        }
    }
    out
}

/// Report on each event how many values redaction replaced in its input.
fn counted(mut events: Vec<Normalized>, redactions: u64) -> Vec<Normalized> {
    if redactions > 0 {
        for n in &mut events {
            n.envelope.redactions = Some(redactions);
        }
    }
    events
}

/// Attach the parsed producer object to the events that carry a conversation (the `a2a.*` ones
/// the turn contract reads facts from). Moving the object costs nothing when none does.
fn with_source(mut events: Vec<Normalized>, value: Value) -> Vec<Normalized> {
    if let Value::Object(map) = value {
        let shared = std::sync::Arc::new(map);
        for n in events.iter_mut().filter(|n| n.conversation_id.is_some()) {
            n.source = Some(shared.clone());
        }
    }
    events
}

/// The `normalize` command's answer for one input line: the envelope, `{"events":[...]}` when
/// the line yields several, or `{"error":{"reason","detail"}}`.
pub fn normalize_line(line: &[u8], settings: &Settings) -> String {
    let input = RawInput {
        bytes: line,
        subject: None,
        raw_ref: None,
        relay: RelayHeaders::default(),
    };
    let value = match normalize(&input, settings) {
        Ok(mut events) if events.len() == 1 => {
            serde_json::to_value(events.remove(0).envelope).unwrap_or(Value::Null)
        }
        Ok(events) => serde_json::json!({
            "events": events.into_iter().map(|n| n.envelope).collect::<Vec<_>>()
        }),
        Err(r) => serde_json::json!({"error": {"reason": r.reason.as_str(), "detail": r.detail}}),
    };
    value.to_string()
}

/// The built-in defaults' normalisation settings, built once per test process: compiling their
/// redaction rules costs far more than normalising an event, and property and fixture tests
/// normalise thousands.
#[cfg(test)]
pub(crate) fn default_settings() -> &'static Settings {
    static DEFAULTS: std::sync::LazyLock<Settings> = std::sync::LazyLock::new(|| {
        crate::config::Settings::default()
            .ingest()
            .unwrap_or_else(|e| panic!("default settings: {e}"))
    });
    &DEFAULTS
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn limits() -> ShapeLimits {
        ShapeLimits {
            max_depth: 4,
            max_string_bytes: 8,
            max_object_keys: 3,
            max_array_items: 3,
        }
    }

    fn nested(levels: usize) -> Value {
        (1..levels).fold(json!({}), |inner, _| json!({ "a": inner }))
    }

    /// `[adapter.limits]` reaches the adapter: a packet the defaults accept is dead-lettered
    /// once a bound is lowered below it, the detail naming the setting.
    #[test]
    fn adapter_limits_come_from_the_configuration() {
        let packet = serde_json::json!({
            "protocol": "a2a",
            "version": "0.2.0",
            "event_type": "task.requested",
            "agent": {"id": "agent://worker"},
            "task": {"id": "task-1", "status": "requested", "metadata": {"labels": ["a", "b"]}},
        });
        let bytes = serde_json::to_vec(&packet).unwrap_or_default();
        let input = RawInput {
            bytes: &bytes,
            subject: Some(SubjectInfo {
                key: "task-1".into(),
                type_suffix: "adapter".into(),
            }),
            raw_ref: None,
            relay: RelayHeaders::default(),
        };
        let settings = |toml: &str| {
            crate::config::Settings::from_toml(toml)
                .and_then(|s| s.ingest())
                .unwrap_or_else(|e| panic!("{toml}: {e}"))
        };
        assert!(normalize(&input, &settings("")).is_ok());
        for (toml, setting) in [
            (
                "[adapter.limits]\nmax_depth = 3\n",
                "adapter.limits.max_depth",
            ),
            (
                "[adapter.limits]\nmax_array_len = 1\n",
                "adapter.limits.max_array_len",
            ),
            (
                "[adapter.limits]\nmax_bytes = 64\n",
                "adapter.limits.max_bytes",
            ),
        ] {
            let err = normalize(&input, &settings(toml))
                .err()
                .unwrap_or_else(|| panic!("{toml} accepted the packet"));
            assert_eq!(err.reason, DlqReason::AdapterRejected, "{toml}");
            assert!(err.detail.contains(setting), "{toml}: {}", err.detail);
        }
        let zero = crate::config::Settings::from_toml("[adapter.limits]\nmax_depth = 0\n")
            .and_then(|s| s.validate().map(|()| s));
        assert!(
            zero.is_err_and(|e| e.to_string().contains("adapter.limits")),
            "a zero bound is refused by name"
        );
    }

    #[test]
    fn shape_limits_pass_at_the_bound_and_refuse_past_it_naming_the_setting() {
        let l = limits();
        assert_eq!(l.check(&nested(4)), Ok(()));
        let deep = l.check(&nested(5)).err().unwrap_or_default();
        assert!(deep.contains("limits.max_depth (4)"), "{deep}");
        // Arrays count as levels too.
        let deep_array = l.check(&json!([[[[[]]]]])).err().unwrap_or_default();
        assert!(deep_array.contains("limits.max_depth"), "{deep_array}");

        assert_eq!(l.check(&json!({"s": "12345678"})), Ok(()));
        let long = l
            .check(&json!({"s": "123456789"}))
            .err()
            .unwrap_or_default();
        assert!(
            long.contains("9 bytes") && long.contains("limits.max_string_bytes"),
            "{long}"
        );

        assert_eq!(l.check(&json!({"a": 1, "b": 2, "c": 3})), Ok(()));
        let wide = l
            .check(&json!({"a": 1, "b": 2, "c": 3, "d": 4}))
            .err()
            .unwrap_or_default();
        assert!(
            wide.contains("4 keys") && wide.contains("limits.max_object_keys"),
            "{wide}"
        );

        assert_eq!(l.check(&json!([1, 2, 3])), Ok(()));
        let long_list = l
            .check(&json!({"x": [1, 2, 3, 4]}))
            .err()
            .unwrap_or_default();
        assert!(
            long_list.contains("4 items") && long_list.contains("limits.max_array_items"),
            "{long_list}"
        );
    }

    /// `body` as a relay publishes it for caller -> agent (exchange x1) on `k.<suffix>`.
    fn relayed<'a>(body: &'a [u8], suffix: &str, direction: Option<&str>) -> RawInput<'a> {
        RawInput {
            bytes: body,
            subject: Some(SubjectInfo {
                key: "k".into(),
                type_suffix: suffix.into(),
            }),
            raw_ref: None,
            relay: RelayHeaders {
                from_agent: Some("caller".into()),
                to_agent: Some("agent".into()),
                exchange: Some("x1".into()),
                direction: direction.map(str::to_string),
                ..RelayHeaders::default()
            },
        }
    }

    #[test]
    fn a_relayed_body_is_wire_traffic_whatever_else_it_looks_like() {
        let settings = default_settings();
        // A caller's request written as an adapter packet that speaks for another agent.
        let body = serde_json::to_vec(&json!({
            "protocol": "a2a", "event_type": "task_completed", "jsonrpc": "2.0", "id": 1,
            "from_agent": "boss", "result": {"kind": "message", "role": "agent", "parts": []}
        }))
        .unwrap_or_default();
        let input = |direction: Option<&str>| relayed(&body, "a2a.wire.request", direction);
        match normalize(&input(Some(RelayHeaders::DIRECTION_REQUEST)), settings) {
            Err(r) => assert!(
                r.detail.contains("Collab-Direction: request"),
                "{}",
                r.detail
            ),
            Ok(events) => panic!("projected: {events:?}"),
        }
        // Without the relay's word the adapter reading applies, as before.
        let unrelayed = normalize(&input(None), settings);
        assert!(
            !matches!(&unrelayed, Err(r) if r.detail.contains("Collab-Direction")),
            "{unrelayed:?}"
        );
    }

    #[test]
    fn the_wire_subject_names_the_side_and_a_header_cannot_contradict_it() {
        let settings = default_settings();
        // The agent's answer, shaped as such.
        let body = br#"{"jsonrpc":"2.0","id":1,"result":{"kind":"message","role":"agent","messageId":"a-1","contextId":"k","parts":[{"kind":"text","text":"approved"}]}}"#;
        let input = |suffix: &str, direction: Option<&str>| relayed(body, suffix, direction);
        // On the caller's subject it is never the agent's reply, with or without a header.
        for direction in [None, Some(RelayHeaders::DIRECTION_ANSWER)] {
            match normalize(&input("a2a.wire.request", direction), settings) {
                Err(r) => assert_eq!(r.reason, DlqReason::Unrecognized, "{}", r.detail),
                Ok(events) => panic!("{direction:?}: projected {events:?}"),
            }
        }
        // On the agent's subject it is the agent's answer.
        for (suffix, direction) in [
            ("a2a.wire.response", None),
            ("a2a.wire.response", Some(RelayHeaders::DIRECTION_ANSWER)),
            ("a2a.wire.stream", None),
        ] {
            let events = normalize(&input(suffix, direction), settings)
                .unwrap_or_else(|e| panic!("{suffix} {direction:?}: {e:?}"));
            let payload = events[0].envelope.payload.clone().unwrap_or_default();
            assert_eq!(payload["fromAgent"], "agent", "{suffix}: {payload}");
        }
        let contradicted = normalize(
            &input("a2a.wire.response", Some(RelayHeaders::DIRECTION_REQUEST)),
            settings,
        );
        assert!(
            matches!(&contradicted, Err(r) if r.detail.contains("must name the same side")),
            "{contradicted:?}"
        );
    }

    #[test]
    fn a_rejection_detail_that_completes_a_secret_pattern_is_redacted() {
        let settings = default_settings();
        // The type alone holds no secret; quoted in the detail, the words after the `=` would
        // read as one.
        let body = br#"{"type":"Bearer aws_secret_access_key="}"#;
        let input = RawInput {
            bytes: body,
            subject: None,
            raw_ref: None,
            relay: RelayHeaders::default(),
        };
        match normalize(&input, settings) {
            Err(r) => {
                assert_eq!(r.reason, DlqReason::BadType);
                assert!(
                    settings.redactor.text(&r.detail).is_none(),
                    "detail still holds a secret: {}",
                    r.detail
                );
            }
            Ok(events) => panic!("projected: {events:?}"),
        }
    }

    #[test]
    fn an_input_past_a_shape_limit_is_dead_lettered_too_large() {
        let mut settings = crate::config::Settings::default()
            .ingest()
            .unwrap_or_else(|e| panic!("default settings: {e}"));
        settings.shape = limits();
        let body =
            serde_json::to_vec(&json!({"type": "task.updated", "taskId": "t1", "data": nested(6)}))
                .unwrap_or_default();
        let input = RawInput {
            bytes: &body,
            subject: Some(SubjectInfo {
                key: "t1".into(),
                type_suffix: "task.updated".into(),
            }),
            raw_ref: None,
            relay: RelayHeaders::default(),
        };
        match normalize(&input, &settings) {
            Err(r) => {
                assert_eq!(r.reason, DlqReason::TooLarge);
                assert!(r.detail.contains("limits.max_depth"), "{}", r.detail);
            }
            Ok(_) => panic!("a too deep input was projected"),
        }
    }

    #[test]
    fn a_byte_order_mark_before_the_json_is_ignored() {
        let settings = crate::config::Settings::default()
            .ingest()
            .unwrap_or_else(|e| panic!("default settings: {e}"));
        let mut body = b"\xEF\xBB\xBF".to_vec();
        body.extend_from_slice(br#"{"type": "task.updated", "taskId": "t1"}"#);
        let input = |bytes| RawInput {
            bytes,
            subject: Some(SubjectInfo {
                key: "t1".into(),
                type_suffix: "task.updated".into(),
            }),
            raw_ref: None,
            relay: RelayHeaders::default(),
        };
        let projected = normalize(&input(&body), &settings);
        assert!(projected.is_ok_and(|n| n.len() == 1));
        // Only at the start: anywhere else it is not JSON.
        let mut inside = br#"{"type": "task.updated", "taskId": "t1"}"#.to_vec();
        inside.extend_from_slice(b"\xEF\xBB\xBF");
        assert!(
            normalize(&input(&inside), &settings).is_err_and(|r| r.reason == DlqReason::BadJson)
        );
    }

    #[test]
    fn a_null_body_member_counts_as_absent_so_the_envelope_reads_back_the_same() {
        let settings = crate::config::Settings::default()
            .ingest()
            .unwrap_or_else(|e| panic!("default settings: {e}"));
        let cases = [
            (
                json!({"type": "task.updated", "taskId": "t1", "data": null}),
                None,
            ),
            (
                json!({"type": "task.updated", "taskId": "t1", "payload": null}),
                None,
            ),
            (
                json!({"type": "task.updated", "taskId": "t1", "data": null, "payload": {"a": 1}}),
                Some(json!({"a": 1})),
            ),
            (
                json!({"type": "task.updated", "taskId": "t1", "data": [1], "payload": null}),
                Some(json!([1])),
            ),
        ];
        for (event, want) in cases {
            let body = serde_json::to_vec(&event).unwrap_or_default();
            let input = RawInput {
                bytes: &body,
                subject: None,
                raw_ref: None,
                relay: RelayHeaders::default(),
            };
            let projected = normalize(&input, &settings)
                .unwrap_or_else(|r| panic!("{event} was refused: {}", r.detail));
            let envelope = &projected[0].envelope;
            assert_eq!(envelope.payload, want, "{event}");
            let text = serde_json::to_string(envelope).unwrap_or_default();
            let back: crate::model::Envelope = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("{text} does not read back: {e}"));
            assert_eq!(&back, envelope, "{event}");
        }
    }
}
