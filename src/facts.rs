//! Facts about an event that both the normaliser (`ingest`) and the turn and run rules (`turns`)
//! read: how a failure is signalled, why a turn is blocked, and what an AG-UI event is. They live
//! below both, so neither layer reaches into the other.

use crate::classify::Fields;
use crate::model::Envelope;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::fmt;

/// Why a turn is blocked: `timeout` (no response by the deadline), `error` (an upstream
/// failure, or the exchange ended without a reply), `not_found` (the target agent, session or
/// task does not exist).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    Timeout,
    Error,
    NotFound,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Timeout => "timeout",
            Reason::Error => "error",
            Reason::NotFound => "not_found",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The upstream failure signal of an event, first matching row of the contract's table.
pub fn failure_signal(fields: &Fields<'_>, event_type: &str) -> Option<(Reason, Option<String>)> {
    let detail = fields
        .get("waitError")
        .or_else(|| fields.get("error"))
        .and_then(|v| match v {
            Value::String(s) => Some(s.clone()),
            Value::Null => None,
            other => Some(other.to_string()),
        });
    match fields.str("waitStatus") {
        Some("timeout") => return Some((Reason::Timeout, detail)),
        Some("error") => return Some((Reason::Error, detail)),
        Some("not_found") => return Some((Reason::NotFound, detail)),
        _ => {}
    }
    let nf_code = |v: Option<&Value>| {
        v.and_then(Value::as_str)
            .is_some_and(|s| s.eq_ignore_ascii_case("not_found"))
    };
    let error_code = fields
        .get("error")
        .and_then(|e| e.get("code"))
        .or_else(|| fields.get("errorCode"));
    if fields.get("notFound").and_then(Value::as_bool) == Some(true)
        || nf_code(error_code)
        || nf_code(fields.get("status"))
    {
        return Some((Reason::NotFound, detail));
    }
    if matches!(
        fields.str("outcome"),
        Some("no_reply" | "blocked" | "failed")
    ) || fields.get("error").is_some()
        || event_type == "a2a.error"
    {
        return Some((Reason::Error, detail));
    }
    None
}

/// AG-UI event types are SCREAMING_SNAKE_CASE (`RUN_STARTED`, `TEXT_MESSAGE_CONTENT`); any such
/// type is taken as AG-UI, so types the protocol adds later are mapped too.
pub fn is_agui_type(t: &str) -> bool {
    !t.is_empty()
        && t.bytes()
            .all(|b| b.is_ascii_uppercase() || b == b'_' || b.is_ascii_digit())
        && t.bytes().any(|b| b.is_ascii_uppercase())
}

/// The envelope type of an AG-UI type (docs/contract.md section 2b). Types with a seed 003 class get it;
/// every other type, known or not yet invented, keeps its own name, lower-cased with `_` as
/// `.` (`REASONING_MESSAGE_CONTENT` -> `reasoning.message.content`, `FOO_BAR` -> `foo.bar`).
pub fn envelope_type(agui_type: &str) -> String {
    let class = match agui_type {
        "RUN_STARTED" => "run.started",
        "RUN_FINISHED" => "run.finished",
        "RUN_ERROR" => "run.failed",
        "STEP_STARTED" | "STEP_FINISHED" => "run.status",
        "TEXT_MESSAGE_START" | "TEXT_MESSAGE_CONTENT" | "TEXT_MESSAGE_CHUNK" => "text.delta",
        "TEXT_MESSAGE_END" => "text.final",
        "TOOL_CALL_START" => "tool.started",
        // END says the arguments are complete (seed 003's input-available); `agUiType` keeps
        // that distinction for readers who need it.
        "TOOL_CALL_ARGS" | "TOOL_CALL_CHUNK" | "TOOL_CALL_END" => "tool.args",
        "TOOL_CALL_RESULT" => "tool.result",
        other => return other.to_ascii_lowercase().replace('_', "."),
    };
    class.to_string()
}

/// Where AG-UI's type is kept in the payload.
pub const TYPE_FIELD: &str = "agUiType";

/// The AG-UI facts of a projected envelope, for rules that follow runs, messages and tool
/// calls (the run contract of docs/contract.md section 2b).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AgUiFacts<'a> {
    /// The AG-UI type as published (`payload.agUiType`).
    pub agui_type: &'a str,
    pub thread_id: Option<&'a str>,
    pub run_id: Option<&'a str>,
    pub message_id: Option<&'a str>,
    /// `payload.toolCallId`.
    pub tool_call_id: Option<&'a str>,
}

impl<'a> AgUiFacts<'a> {
    /// `None` for an envelope that did not come from an AG-UI event: one without
    /// `payload.agUiType`, or whose type is not that AG-UI type's mapping. (A runtime event
    /// written to look exactly like a mapped one is read as one: the envelope is all there is.)
    pub fn of(envelope: &'a Envelope) -> Option<AgUiFacts<'a>> {
        let payload = envelope.payload.as_ref()?.as_object()?;
        let agui_type = payload.get(TYPE_FIELD)?.as_str()?;
        if !is_agui_type(agui_type) || envelope_type(agui_type) != envelope.event_type {
            return None;
        }
        let slot = |v: &'a Option<Value>| v.as_ref().and_then(Value::as_str);
        Some(AgUiFacts {
            agui_type,
            thread_id: slot(&envelope.thread_id),
            run_id: slot(&envelope.run_id),
            message_id: slot(&envelope.message_id),
            tool_call_id: payload.get("toolCallId").and_then(Value::as_str),
        })
    }
}

/// Whether a response's payload is a blocked outcome (`outcome: "blocked"`).
pub fn is_blocked(payload: Option<&Map<String, Value>>) -> bool {
    payload
        .and_then(|p| p.get("outcome"))
        .and_then(Value::as_str)
        == Some("blocked")
}

/// What an answer waits for: `input` or `auth` when it is an A2A task that stopped at
/// `input-required` / `auth-required` (the wire normaliser keeps the state as `payload.state`).
pub fn answer_waits_for(payload: Option<&Map<String, Value>>) -> Option<&'static str> {
    match payload?.get("state").and_then(Value::as_str)? {
        "input-required" => Some("input"),
        "auth-required" => Some("auth"),
        _ => None,
    }
}

/// What an ended run waits for, and on whom: an AG-UI `RUN_FINISHED` whose `outcome` is an
/// interrupt (`{"type": "interrupt", "interrupts": [...]}`, or the string `interrupt` beside an
/// `interrupt` object), or any run the normaliser marked `interrupted`. What is awaited is the
/// first interrupt's `reason`, else `input`; whom, its `assignee` (or `user`) when it names one.
pub fn run_wait(env: &Envelope) -> Option<(String, Option<String>)> {
    let p = env.payload.as_ref().and_then(Value::as_object);
    let outcome = p.and_then(|p| p.get("outcome"));
    let typed = match outcome {
        Some(Value::String(s)) => s == "interrupt",
        Some(Value::Object(o)) => o.get("type").and_then(Value::as_str) == Some("interrupt"),
        _ => false,
    };
    if !typed && env.phase.as_deref() != Some("interrupted") {
        return None;
    }
    let first = outcome
        .and_then(|o| o.get("interrupts"))
        .and_then(Value::as_array)
        .and_then(|a| a.first())
        .or_else(|| p.and_then(|p| p.get("interrupt")))
        .and_then(Value::as_object);
    let text = |k: &str| crate::model::field_text(first, k);
    let on = text("assignee").or_else(|| text("user"));
    Some((text("reason").unwrap_or_else(|| "input".into()), on))
}
