//! What normalisation reads and writes, below every input format: the configuration it needs,
//! the raw input (body, subject, relay headers), the normalised event, and the checks every
//! format shares.

use super::adapter::{AdapterLimits, AdapterMode};
use crate::classify::MainAgents;
use crate::model::{DlqReason, Envelope, RawEventRef, Rejection, Role};
use serde_json::Value;

/// What normalisation needs from configuration.
#[derive(Debug, Clone)]
pub struct Settings {
    pub main_agents: MainAgents,
    pub adapter_mode: AdapterMode,
    pub adapter_limits: AdapterLimits,
    /// Largest raw message accepted, in bytes (`too_large` beyond it).
    pub max_payload_bytes: usize,
    /// Bounds on the parsed input's shape.
    pub shape: ShapeLimits,
    /// Applied to every parsed input before anything is derived from it.
    pub redactor: std::sync::Arc<crate::redact::Redactor>,
    /// Inputs must name their publishing agent in their subject (`roles.require_identity`).
    pub require_identity: bool,
}

/// Bounds on a parsed input's shape beyond its size (`limits.*` in the configuration).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShapeLimits {
    pub max_depth: usize,
    pub max_string_bytes: usize,
    pub max_object_keys: usize,
    pub max_array_items: usize,
}

impl ShapeLimits {
    /// The first bound `value` breaks, as a dead-letter detail a producer can act on.
    pub(super) fn check(&self, value: &Value) -> Result<(), String> {
        // Iterative, so no input can exhaust the stack.
        let mut stack = vec![(value, 1usize)];
        while let Some((v, depth)) = stack.pop() {
            match v {
                Value::String(s) if s.len() > self.max_string_bytes => {
                    return Err(format!(
                        "a string of {} bytes is over limits.max_string_bytes ({}); offload it and publish a reference",
                        s.len(),
                        self.max_string_bytes
                    ));
                }
                Value::Array(_) | Value::Object(_) if depth > self.max_depth => {
                    return Err(format!(
                        "JSON is nested more than limits.max_depth ({}) levels deep; flatten it",
                        self.max_depth
                    ));
                }
                Value::Array(items) => {
                    over(
                        items.len(),
                        self.max_array_items,
                        "an array of",
                        "items",
                        "max_array_items",
                    )?;
                    stack.extend(items.iter().map(|i| (i, depth + 1)));
                }
                Value::Object(map) => {
                    over(
                        map.len(),
                        self.max_object_keys,
                        "an object with",
                        "keys",
                        "max_object_keys",
                    )?;
                    stack.extend(map.values().map(|i| (i, depth + 1)));
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// A container with more members than its limit, as a dead-letter detail.
fn over(n: usize, max: usize, what: &str, members: &str, setting: &str) -> Result<(), String> {
    if n > max {
        return Err(format!(
            "{what} {n} {members} is over limits.{setting} ({max}); split the message"
        ));
    }
    Ok(())
}

/// The raw subject's facts: `collab.raw.<key>.<type...>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubjectInfo {
    /// The ordering key token.
    pub key: String,
    /// The producer's type tokens after the key (informational; the body's type wins).
    pub type_suffix: String,
}

impl SubjectInfo {
    /// Parse the producer's subject `<prefix>.raw.<key>.<type...>`.
    pub fn parse_raw(prefix: &str, subject: &str) -> Option<SubjectInfo> {
        let rest = subject.strip_prefix(prefix)?.strip_prefix(".raw.")?;
        let (key, type_suffix) = rest.split_once('.')?;
        Some(SubjectInfo {
            key: key.to_string(),
            type_suffix: type_suffix.to_string(),
        })
    }
}

/// One raw message to normalise.
#[derive(Debug, Clone)]
pub struct RawInput<'a> {
    pub bytes: &'a [u8],
    /// Absent when normalising offline (`collab-projector normalize`).
    pub subject: Option<SubjectInfo>,
    pub raw_ref: Option<RawEventRef>,
    /// What a relay said about the exchange in its headers (docs/contract.md section 2a).
    pub relay: RelayHeaders,
}

/// The headers a relay sets on the traffic it publishes (docs/contract.md section 2a): the caller's and the
/// callee's agent ids, an id for the request shared by everything answering it, and the A2A
/// method of an HTTP+JSON body.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RelayHeaders {
    pub from_agent: Option<String>,
    pub to_agent: Option<String>,
    pub exchange: Option<String>,
    pub a2a_method: Option<String>,
    /// The AG-UI run an event belongs to (docs/contract.md section 2b), for events that carry no `runId`
    /// (`RUN_ERROR`, steps, state events).
    pub run_id: Option<String>,
    /// Which side of the exchange the body is: `request` (the caller's words) or `answer` (the
    /// callee's). When present it decides, never the body's shape.
    pub direction: Option<String>,
}

impl RelayHeaders {
    pub const FROM_AGENT: &'static str = "Collab-From-Agent";
    pub const TO_AGENT: &'static str = "Collab-To-Agent";
    pub const EXCHANGE: &'static str = "Collab-Exchange";
    pub const A2A_METHOD: &'static str = "Collab-A2A-Method";
    pub const RUN_ID: &'static str = "Collab-Run-Id";
    pub const DIRECTION: &'static str = "Collab-Direction";
    pub const DIRECTION_REQUEST: &'static str = "request";
    pub const DIRECTION_ANSWER: &'static str = "answer";

    /// Read them from a message's NATS headers (empty values count as absent).
    pub fn from_nats(h: &async_nats::HeaderMap) -> RelayHeaders {
        let get = |name: &str| {
            h.get(name)
                .map(|v| v.as_str().trim().to_string())
                .filter(|v| !v.is_empty())
        };
        RelayHeaders {
            from_agent: get(Self::FROM_AGENT),
            to_agent: get(Self::TO_AGENT),
            exchange: get(Self::EXCHANGE),
            a2a_method: get(Self::A2A_METHOD),
            run_id: get(Self::RUN_ID),
            direction: get(Self::DIRECTION),
        }
    }
}

/// A normalised event ready to project.
#[derive(Debug, Clone, PartialEq)]
pub struct Normalized {
    pub envelope: Envelope,
    /// The subject key token it is projected under.
    pub key: String,
    /// For `a2a.*` events: the conversation key (original id) the turn contract uses.
    pub conversation_id: Option<String>,
    /// For `a2a.*` events: the producer's object as parsed here, so the turn contract reads its
    /// facts without parsing the message again.
    pub source: Option<std::sync::Arc<serde_json::Map<String, Value>>>,
}

impl Normalized {
    pub fn role(&self) -> Role {
        self.envelope
            .event_role
            .unwrap_or(Role::SystemObservability)
    }
}

/// The JSON kind of a value, as a dead-letter detail names it.
pub(crate) fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// Check that an event type can become subject tokens.
pub fn check_type(t: &str) -> Result<(), Rejection> {
    let bad = t.is_empty()
        || t.len() > 256
        || t.split('.').any(str::is_empty)
        || t.chars()
            .any(|c| c.is_whitespace() || c.is_control() || c == '*' || c == '>');
    if bad {
        return Err(Rejection::new(
            DlqReason::BadType,
            format!(
                "type {t:?} cannot become subject tokens: use dot-separated tokens without spaces, `*` or `>` (e.g. \"task.updated\")"
            ),
        ));
    }
    Ok(())
}
