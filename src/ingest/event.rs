//! The mapping of collaboration events (seed 000) and runtime events (seed 003), and of the
//! adapter's canonical payload, onto the envelope.

use super::adapter;
use super::input::{check_type, Normalized, RawInput, Settings};
use crate::classify::{self, member, Fields};
use crate::facets;
use crate::model::{encode_id, id_text, DlqReason, Envelope, Rejection, Role};
use chrono::SecondsFormat;
use serde_json::{Map, Value};

/// Top-level keys that have a slot in the envelope (or are consumed by the mapping).
const SLOTS: &[&str] = &[
    "type",
    "eventRole",
    "sequence",
    "timestamp",
    "ts",
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
    "data",
];

/// The conversation key of docs/contract.md section 4, in order of preference.
pub const CONVERSATION_KEY_FIELDS: [&str; 4] =
    ["conversationId", "sessionId", "contextId", "workSessionId"];

/// Format a producer timestamp (epoch milliseconds or RFC 3339) as RFC 3339 UTC with millis.
pub fn parse_timestamp(v: &Value) -> Option<String> {
    crate::model::timestamp(v).map(|dt| dt.to_rfc3339_opts(SecondsFormat::Millis, true))
}

/// Whether an event carries an upstream failure signal (for the phase facet): any row of the
/// contract's failure table, the same table the turn contract decides blocked outcomes with.
pub fn carries_failure(fields: &Fields<'_>, event_type: &str) -> bool {
    crate::facts::failure_signal(fields, event_type).is_some()
}

/// The conversation key of an event, if it has one.
pub fn conversation_key(fields: &Fields<'_>) -> Option<String> {
    CONVERSATION_KEY_FIELDS
        .iter()
        .find_map(|k| fields.get(k).and_then(id_text))
}

/// Map a collaboration or runtime event.
pub fn from_event(
    obj: &Map<String, Value>,
    input: &RawInput<'_>,
    settings: &Settings,
) -> Result<Normalized, Rejection> {
    let (mut n, facets) = slots_of(obj, input, settings)?;
    n.envelope.payload = body_of(obj);
    finish(n, obj, &facets, settings)
}

/// As [`from_event`], for an event whose object is not kept once it is mapped (it has no turn
/// facts to read later: not `a2a.*`): its body moves into the payload instead of being copied.
/// The other members stay where they were, so the result is the same.
pub fn from_event_taking(
    obj: &mut Map<String, Value>,
    input: &RawInput<'_>,
    settings: &Settings,
) -> Result<Normalized, Rejection> {
    let (mut n, facets) = slots_of(obj, input, settings)?;
    n.envelope.payload = take_body(obj);
    finish(n, obj, &facets, settings)
}

/// The envelope without its payload, its key and conversation, and its facets.
fn slots_of(
    obj: &Map<String, Value>,
    input: &RawInput<'_>,
    settings: &Settings,
) -> Result<(Normalized, facets::Facets), Rejection> {
    let fields = Fields::new(obj);
    let event_type = member(obj, "type")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    check_type(&event_type)?;
    let role = classify::classify(&event_type, &fields, &settings.main_agents)?;
    let (key, conversation_id) = event_key(&event_type, &fields, input)?;
    let envelope = slotted(obj, &fields, &event_type, role, input);
    let status = fields.str("status");
    let failed = carries_failure(&fields, &event_type);
    let facets = facets::derive(&event_type, status, failed);
    Ok((
        Normalized {
            envelope,
            key,
            conversation_id,
            source: None,
        },
        facets,
    ))
}

/// The members without a slot into the payload, the facets, and the depth check.
fn finish(
    mut n: Normalized,
    obj: &Map<String, Value>,
    facets: &facets::Facets,
    settings: &Settings,
) -> Result<Normalized, Rejection> {
    keep_unslotted(obj, &mut n.envelope);
    facets::apply(&mut n.envelope, facets);
    check_depth(&n.envelope, settings.shape.max_depth)?;
    Ok(n)
}

/// Whether events of this type belong to a conversation, and so to a turn whose facts are read
/// from the event's object later (`a2a.*`); any other event's object is done with once mapped.
pub fn in_conversation(event_type: &str) -> bool {
    event_type.starts_with("a2a.")
}

/// The key an event is projected under, and for `a2a.*` its conversation. For `a2a.*` the key
/// must be the conversation key; otherwise it is the producer's choice (offline: the first id
/// the event has).
fn event_key(
    event_type: &str,
    fields: &Fields<'_>,
    input: &RawInput<'_>,
) -> Result<(String, Option<String>), Rejection> {
    if !in_conversation(event_type) {
        let key = match &input.subject {
            Some(subject) => subject.key.clone(),
            None => [
                "sessionId",
                "taskId",
                "agentId",
                "conversationId",
                "workSessionId",
            ]
            .iter()
            .find_map(|k| fields.get(k).and_then(id_text))
            .map(|id| encode_id(&id))
            .unwrap_or_else(|| "_".to_string()),
        };
        return Ok((key, None));
    }
    let Some(conv) = conversation_key(fields) else {
        return Err(Rejection::new(
            DlqReason::BadKey,
            format!(
                "{event_type} has no conversation key: set conversationId (or sessionId, contextId, workSessionId) at the top level or under data"
            ),
        ));
    };
    let expected = encode_id(&conv);
    if let Some(subject) = input.subject.as_ref().filter(|s| s.key != expected) {
        return Err(Rejection::new(
            DlqReason::BadKey,
            format!(
                "{event_type} for conversation {conv:?} was published under key `{}`; publish it on collab.raw.{expected}.{event_type} so every event of the conversation stays in one partition",
                subject.key
            ),
        ));
    }
    Ok((expected, Some(conv)))
}

/// The envelope with its slots filled from the event (no payload yet).
fn slotted(
    obj: &Map<String, Value>,
    fields: &Fields<'_>,
    event_type: &str,
    role: Role,
    input: &RawInput<'_>,
) -> Envelope {
    let id = |name: &str| fields.get(name).cloned();
    let str_slot = |name: &str| {
        member(obj, name)
            .and_then(Value::as_str)
            .map(str::to_string)
    };
    let timestamp_src = fields.get("timestamp").or_else(|| fields.get("ts"));
    Envelope {
        event_type: event_type.to_string(),
        event_role: Some(role),
        sequence: member(obj, "sequence").filter(|v| !v.is_null()).cloned(),
        timestamp: timestamp_src.and_then(parse_timestamp),
        session_id: id("sessionId"),
        thread_id: id("threadId"),
        run_id: id("runId"),
        turn_id: id("turnId"),
        message_id: id("messageId"),
        task_id: id("taskId"),
        agent_id: id("agentId"),
        parent_session_id: id("parentSessionId"),
        parent_thread_id: id("parentThreadId"),
        conversation_id: id("conversationId"),
        work_session_id: id("workSessionId"),
        owner: str_slot("owner"),
        scope: str_slot("scope"),
        phase: str_slot("phase"),
        surface: str_slot("surface"),
        persistence: str_slot("persistence"),
        topology: str_slot("topology"),
        payload: None,
        refs: member(obj, "refs").filter(|v| !v.is_null()).cloned(),
        raw_event_ref: input.raw_ref.clone(),
        redactions: None,
    }
}

/// The payload: the producer's body (`data`, `payload`, or both), nothing dropped.
fn body_of(obj: &Map<String, Value>) -> Option<Value> {
    body(obj.get("data").cloned(), obj.get("payload").cloned())
}

/// [`body_of`], moving the body out of `obj`: `data` and `payload` are slots, so what stays in
/// their place (`null`) is never read again.
fn take_body(obj: &mut Map<String, Value>) -> Option<Value> {
    let mut take = |name: &str| obj.get_mut(name).map(Value::take);
    body(take("data"), take("payload"))
}

/// The payload of an event with these `data` and `payload` members. A member that is `null`
/// counts as absent: an envelope's payload is an object, array or scalar, never `null`, so that a
/// projection reads back as the envelope that was published.
fn body(data: Option<Value>, payload: Option<Value>) -> Option<Value> {
    let data = data.filter(|v| !v.is_null());
    let payload = payload.filter(|v| !v.is_null());
    match (data, payload) {
        (Some(data), None) => Some(data),
        (None, Some(p)) => Some(p),
        (Some(data), Some(p)) => {
            let mut m = Map::new();
            m.insert("data".into(), data);
            m.insert("payload".into(), p);
            Some(Value::Object(m))
        }
        (None, None) => None,
    }
}

/// Top-level members without a slot, and a timestamp that could not be read, go to the payload
/// (under `_input` where the body has a member of that name), so nothing is lost.
fn keep_unslotted(obj: &Map<String, Value>, envelope: &mut Envelope) {
    let unknown: Vec<(&String, &Value)> = obj
        .iter()
        .filter(|(k, _)| !SLOTS.contains(&k.as_str()))
        .collect();
    let unread_ts: Vec<(&str, &Value)> = ["timestamp", "ts"]
        .iter()
        .filter_map(|k| obj.get_key_value(*k))
        .filter(|(_, v)| parse_timestamp(v).is_none() && !v.is_null())
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    if unknown.is_empty() && unread_ts.is_empty() {
        return;
    }
    let map = envelope.payload_object();
    let extra = unknown
        .into_iter()
        .map(|(k, v)| (k.as_str(), v))
        .chain(unread_ts);
    for (k, v) in extra {
        if map.contains_key(k) {
            let input_map = map
                .entry("_input")
                .or_insert_with(|| Value::Object(Map::new()));
            if let Value::Object(m) = input_map {
                m.insert(k.to_string(), v.clone());
            }
        } else {
            map.insert(k.to_string(), v.clone());
        }
    }
}

/// Map an A2A adapter packet through the K1-A adapter.
pub fn from_adapter_packet(
    value: &Value,
    input: &RawInput<'_>,
    settings: &Settings,
) -> Result<Normalized, Rejection> {
    let canonical = adapter::convert(
        value,
        input.bytes.len(),
        settings.adapter_mode,
        &settings.adapter_limits,
    )
    .map_err(|e| Rejection::new(DlqReason::AdapterRejected, e.to_string()))?;
    check_type(&canonical.event_type)?;
    let upstream = value
        .get("event_type")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let role = if canonical.handoff_visible {
        Role::DelegationSubagent
    } else if canonical.event_type.starts_with("assay.adapter.a2a.task.")
        || canonical
            .event_type
            .starts_with("assay.adapter.a2a.artifact.")
    {
        Role::OrchestrationTask
    } else {
        Role::SystemObservability
    };
    let typed_id = |obj: &str| {
        value
            .get(obj)
            .and_then(|o| o.get("id"))
            .filter(|v| v.is_string())
            .cloned()
    };
    let key = match &input.subject {
        Some(s) => s.key.clone(),
        None => typed_id("task")
            .or_else(|| typed_id("agent"))
            .and_then(|v| id_text(&v))
            .map(|id| encode_id(&id))
            .unwrap_or_else(|| "_".to_string()),
    };
    let mut refs = Map::new();
    refs.insert(
        "handoffDigest".into(),
        Value::String(canonical.handoff_digest.clone()),
    );
    refs.insert(
        "discoveryDigest".into(),
        Value::String(canonical.discovery_digest.clone()),
    );
    let mut envelope = Envelope {
        event_type: canonical.event_type.clone(),
        event_role: Some(role),
        timestamp: value.get("timestamp").and_then(parse_timestamp),
        agent_id: typed_id("agent"),
        task_id: typed_id("task"),
        message_id: typed_id("message"),
        payload: Some(canonical.payload),
        refs: Some(Value::Object(refs)),
        raw_event_ref: input.raw_ref.clone(),
        ..Default::default()
    };
    if canonical.event_type != "assay.adapter.a2a.message" {
        let status = value
            .get("task")
            .and_then(|t| t.get("status"))
            .and_then(Value::as_str);
        facets::apply(&mut envelope, &facets::derive(upstream, status, false));
    }
    if canonical.handoff_visible {
        envelope.surface = Some("delegation_graph".into());
    }
    check_depth(&envelope, settings.shape.max_depth)?;
    Ok(Normalized {
        envelope,
        key,
        conversation_id: None,
        source: None,
    })
}

/// Levels of structure every envelope may have whatever the limit: the envelope, its payload or
/// references, and the adapter payload's `agent`, `discovery` and `handoff` objects.
pub const ENVELOPE_OWN_DEPTH: usize = 3;

/// Refuse an envelope nested deeper than `limits.max_depth`. The input was checked against the
/// same limit, but fields kept beside the envelope's slots move under `payload` (and under
/// `payload._input` on a name clash, or beside `data`), and the adapter's attributes under its
/// payload: one or two levels deeper than in the input. Projections are read back by the API,
/// the session fold and UIs, which must be able to rely on the limit.
fn check_depth(envelope: &Envelope, max_depth: usize) -> Result<(), Rejection> {
    let values = [
        &envelope.sequence,
        &envelope.session_id,
        &envelope.thread_id,
        &envelope.run_id,
        &envelope.turn_id,
        &envelope.message_id,
        &envelope.task_id,
        &envelope.agent_id,
        &envelope.parent_session_id,
        &envelope.parent_thread_id,
        &envelope.conversation_id,
        &envelope.work_session_id,
        &envelope.payload,
        &envelope.refs,
    ];
    // The envelope is level 1; its fields' containers start at level 2. Its own structure
    // (`rawEventRef`, `refs`, the adapter's `payload.agent`) is at most three levels deep, so
    // a limit below three applies from there.
    let limit = max_depth.max(ENVELOPE_OWN_DEPTH);
    let mut stack: Vec<(&Value, usize)> = values
        .iter()
        .filter_map(|v| v.as_ref())
        .map(|v| (v, 2))
        .collect();
    while let Some((v, level)) = stack.pop() {
        let is_container = matches!(v, Value::Array(_) | Value::Object(_));
        if is_container && level > limit {
            return Err(Rejection::new(
                DlqReason::TooLarge,
                format!(
                    "the projected envelope would nest more than limits.max_depth ({max_depth}) levels: fields beside the envelope's slots are kept under `payload`, a level or two deeper than in the input; flatten the deepest field"
                ),
            ));
        }
        match v {
            Value::Array(items) => stack.extend(items.iter().map(|c| (c, level + 1))),
            Value::Object(map) => stack.extend(map.values().map(|c| (c, level + 1))),
            _ => {}
        }
    }
    Ok(())
}
