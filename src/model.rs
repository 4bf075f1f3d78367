//! The data every stage shares: roles, the projected envelope, dead-letter reasons and the
//! rule that turns arbitrary ids into subject tokens and KV keys.

use base64::Engine;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use std::fmt;
use std::str::FromStr;

/// The four partitions of the collaboration event model (seed 000): `conversation.main` (the
/// main agents' conversations), `delegation.subagent` (work handed to sub-agents),
/// `orchestration.task` (task orchestration) and `system.observability` (health, metrics and the
/// processor's own records).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
pub enum Role {
    #[serde(rename = "conversation.main")]
    ConversationMain,
    #[serde(rename = "delegation.subagent")]
    DelegationSubagent,
    #[serde(rename = "orchestration.task")]
    OrchestrationTask,
    #[serde(rename = "system.observability")]
    SystemObservability,
}

impl Role {
    pub const ALL: [Role; 4] = [
        Role::ConversationMain,
        Role::DelegationSubagent,
        Role::OrchestrationTask,
        Role::SystemObservability,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::ConversationMain => "conversation.main",
            Role::DelegationSubagent => "delegation.subagent",
            Role::OrchestrationTask => "orchestration.task",
            Role::SystemObservability => "system.observability",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Role::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| {
                format!(
                    "unknown role `{s}`: expected one of conversation.main, delegation.subagent, orchestration.task, system.observability"
                )
            })
    }
}

/// Why a raw message was dead-lettered (docs/contract.md section 6). The string form is the subject token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DlqReason {
    BadJson,
    Unrecognized,
    AdapterRejected,
    InvalidRole,
    BadKey,
    BadType,
    TooLarge,
    MaxDeliver,
    /// The event claims a speaker other than the agent whose user published it.
    IdentityMismatch,
    /// Identities are required (`roles.require_identity`) and the subject names none.
    IdentityMissing,
    /// Published straight to a raw shard that does not hold the event's key (sharded
    /// deployments, see `bus::strays`): no partition would ever read it there.
    Misrouted,
}

impl DlqReason {
    pub const ALL: [DlqReason; 11] = [
        DlqReason::BadJson,
        DlqReason::Unrecognized,
        DlqReason::AdapterRejected,
        DlqReason::InvalidRole,
        DlqReason::BadKey,
        DlqReason::BadType,
        DlqReason::TooLarge,
        DlqReason::MaxDeliver,
        DlqReason::IdentityMismatch,
        DlqReason::IdentityMissing,
        DlqReason::Misrouted,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DlqReason::BadJson => "bad_json",
            DlqReason::Unrecognized => "unrecognized",
            DlqReason::AdapterRejected => "adapter_rejected",
            DlqReason::InvalidRole => "invalid_role",
            DlqReason::BadKey => "bad_key",
            DlqReason::BadType => "bad_type",
            DlqReason::TooLarge => "too_large",
            DlqReason::MaxDeliver => "max_deliver",
            DlqReason::IdentityMismatch => "identity_mismatch",
            DlqReason::IdentityMissing => "identity_missing",
            DlqReason::Misrouted => "misrouted",
        }
    }
}

impl fmt::Display for DlqReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A raw message that cannot be projected, with a sentence a person can act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub reason: DlqReason,
    pub detail: String,
}

impl Rejection {
    pub fn new(reason: DlqReason, detail: impl Into<String>) -> Self {
        Rejection {
            reason,
            detail: detail.into(),
        }
    }
}

/// Where a projected event came from in the raw stream: the order consumers can always sort by.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(deny_unknown_fields)]
pub struct RawEventRef {
    /// The raw stream's name (`COLLAB_RAW` by default).
    pub stream: String,
    /// The raw message's stream sequence.
    pub seq: u64,
    /// The subject the producer published to (`collab.raw.<key>.<type>`).
    pub subject: String,
    /// The raw stream's store time (RFC 3339): the event time of the turn contract.
    #[schemars(extend("format" = "date-time"))]
    pub stored_at: String,
}

/// The projected event: the seed 003 envelope, extended with the seed 000 ids.
///
/// Facts that are not known are left out (`None`), never guessed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(deny_unknown_fields)]
pub struct Envelope {
    /// The normalised event type (`a2a.send`, `a2a.response`, `run.failed`, ...).
    #[serde(rename = "type")]
    pub event_type: String,
    /// The role partition the event was projected to.
    pub event_role: Option<Role>,
    /// The producer's own sequence number, as it wrote it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sequence: Option<Value>,
    /// The event time: the producer's timestamp, or the processor's decision time for an event it
    /// synthesised.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timestamp: Option<String>,
    /// The producer's session id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session_id: Option<Value>,
    /// The thread id (AG-UI `threadId`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub thread_id: Option<Value>,
    /// The run id (AG-UI `runId`, or the agent run a turn belongs to).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run_id: Option<Value>,
    /// The turn id within the conversation.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub turn_id: Option<Value>,
    /// The message id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message_id: Option<Value>,
    /// The task id (A2A task, orchestration task).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub task_id: Option<Value>,
    /// The agent that produced the event.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent_id: Option<Value>,
    /// The session this one was spawned from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent_session_id: Option<Value>,
    /// The thread this one was spawned from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent_thread_id: Option<Value>,
    /// The conversation (A2A context) id: the ordering key of `a2a.*` events.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conversation_id: Option<Value>,
    /// The work session the event belongs to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub work_session_id: Option<Value>,
    /// Facet: who the event is about (`agent`, `runtime`, ...).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// Facet: the unit the event belongs to (`turn`, `run`, `agent`, ...).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scope: Option<String>,
    /// Facet: where its unit is (`submitted`, `acting`, `completed`, `failed`, ...).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// Facet: where a UI shows the event (`conversation`, `diagnostics`, `runtime_status`, ...).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub surface: Option<String>,
    /// Facet: how long the event matters (`transcript`, `archive`, `ephemeral_live`, ...).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub persistence: Option<String>,
    /// Facet: the shape of the collaboration the event is part of, when the producer gave it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub topology: Option<String>,
    /// The event's own data, redacted. A blocked `a2a.response` carries a blocked payload, an
    /// `a2a.response.suppressed` or `run.terminal.suppressed` a suppressed payload, a synthesised
    /// `run.failed` a run-failed payload (see the other schemas). A field over the inline limit is
    /// replaced by `{"$ref": "blob:<id>", ...}` (read it at `/api/blobs/<id>`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payload: Option<Value>,
    /// References to other events or resources, as the producer gave them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refs: Option<Value>,
    /// The raw message the event was projected from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub raw_event_ref: Option<RawEventRef>,
    /// How many values of the input were redacted (secrets never reach a projection).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redactions: Option<u64>,
}

impl Envelope {
    /// The agent whose NATS user published the raw message, when its subject names one
    /// (`<prefix>.raw.<key>._as.<agent>.<type>`, as the relays publish).
    pub fn publishing_agent(&self) -> Option<String> {
        publishing_agent_of(&self.raw_event_ref.as_ref()?.subject)
    }

    /// The payload as an object, creating one if the payload is absent.
    pub fn payload_object(&mut self) -> &mut Map<String, Value> {
        if !matches!(self.payload, Some(Value::Object(_))) {
            let previous = self.payload.take();
            let mut map = Map::new();
            if let Some(v) = previous {
                map.insert("value".into(), v);
            }
            self.payload = Some(Value::Object(map));
        }
        match self.payload.as_mut() {
            Some(Value::Object(m)) => m,
            _ => unreachable!("payload was just made an object"),
        }
    }
}

/// The longest key (and agent) subject token, in bytes.
pub const MAX_TOKEN_LEN: usize = 128;

/// The `<key>` subject token an id is published under: the id itself when it is a key token,
/// else its encoding (as producers' subjects and the relays key it).
pub fn key_token(id: &str) -> String {
    if is_key_token(id) {
        id.to_string()
    } else {
        encode_id(id)
    }
}

/// Whether `s` is usable as it is as the `<key>` subject token: `[A-Za-z0-9_-]{1,128}`.
pub fn is_key_token(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_TOKEN_LEN
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Whether `s` is dot-separated key tokens (`host.eu-1`): usable as the end of a KV key or a
/// subject as it is.
pub fn is_key_path(s: &str) -> bool {
    s.split('.').all(is_key_token)
}

/// Encode an id as a subject token and KV key segment.
///
/// The rule (documented in the README's producers' guide):
/// - an id that is already a key token and does not start with `_` is used as it is;
/// - otherwise `_b` + unpadded base64url of its UTF-8 bytes, when that fits in 128 characters
///   (reversible);
/// - otherwise `_h` + the SHA-256 hex of its bytes (one-way).
///
/// Ids starting with `_` are always encoded, so an encoded id can never collide with a plain one.
pub fn encode_id(id: &str) -> String {
    if is_key_token(id) && !id.starts_with('_') {
        return id.to_string();
    }
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(id.as_bytes());
    if b64.len() + 2 <= MAX_TOKEN_LEN {
        format!("_b{b64}")
    } else {
        format!("_h{}", hex::encode(Sha256::digest(id.as_bytes())))
    }
}

/// Reverse [`encode_id`] where it is reversible. Hashed ids give `None`.
pub fn decode_id(token: &str) -> Option<String> {
    if let Some(b64) = token.strip_prefix("_b") {
        let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(b64)
            .ok()?;
        return String::from_utf8(bytes).ok();
    }
    if token.starts_with("_h") {
        return None;
    }
    Some(token.to_string())
}

/// A producer timestamp: epoch milliseconds, or RFC 3339 text.
pub fn timestamp(v: &Value) -> Option<chrono::DateTime<chrono::Utc>> {
    use chrono::TimeZone;
    match v {
        Value::Number(n) => {
            let ms = n.as_i64().or_else(|| n.as_f64().map(|f| f as i64))?;
            chrono::Utc.timestamp_millis_opt(ms).single()
        }
        Value::String(s) => chrono::DateTime::parse_from_rfc3339(s.trim())
            .ok()
            .map(|d| d.with_timezone(&chrono::Utc)),
        _ => None,
    }
}

/// The turn id of docs/contract.md section 4 from the candidates in order (`turnId`, then `turn`): the
/// first that is an id, else `"0"`.
pub fn turn_id<'a>(candidates: impl IntoIterator<Item = Option<&'a Value>>) -> String {
    candidates
        .into_iter()
        .flatten()
        .find_map(id_text)
        .unwrap_or_else(|| "0".to_string())
}

/// At most `max` characters (trimmed), cut on a character boundary and marked with an ellipsis.
pub fn shorten(text: &str, max: usize) -> String {
    let t = text.trim();
    if t.chars().count() <= max {
        return t.to_string();
    }
    let mut s: String = t.chars().take(max.saturating_sub(1)).collect();
    s.push('…');
    s
}

/// The agent a raw subject says published the message (`<prefix>.raw.<key>._as.<agent>.<type>`).
pub fn publishing_agent_of(subject: &str) -> Option<String> {
    let mut tokens = subject.split('.').skip_while(|t| *t != "_as");
    tokens.next()?;
    tokens.next().filter(|a| !a.is_empty()).map(str::to_string)
}

/// `map[key]` as an id ([`id_text`]); `None` without a map.
pub fn field_text(map: Option<&Map<String, Value>>, key: &str) -> Option<String> {
    map?.get(key).and_then(id_text)
}

/// The text form of an id value (string as is, numbers in JSON form); `None` for null/empty.
pub fn id_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) if !s.trim().is_empty() => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_ids_stay_as_they_are() {
        assert_eq!(encode_id("conv-1"), "conv-1");
        assert_eq!(encode_id("ws_1"), "ws_1");
        assert_eq!(decode_id("conv-1").as_deref(), Some("conv-1"));
    }

    #[test]
    fn ids_with_colons_dots_spaces_are_encoded_reversibly() {
        for id in [
            "agent:eden:main",
            "a.b.c",
            "with space",
            "_leading",
            "ünïcode",
            "*",
            ">",
        ] {
            let t = encode_id(id);
            assert!(is_key_token(&t), "{t} must be a token");
            assert!(t.starts_with("_b"), "{id} -> {t}");
            assert_eq!(decode_id(&t).as_deref(), Some(id));
        }
    }

    #[test]
    fn long_ids_are_hashed_into_a_token() {
        let id = "x".repeat(200);
        let t = encode_id(&id);
        assert!(is_key_token(&t));
        assert!(t.starts_with("_h"));
        assert_eq!(t.len(), 66);
        assert_eq!(decode_id(&t), None);
        let long_token = "y".repeat(129);
        assert!(encode_id(&long_token).starts_with("_h"));
    }

    #[test]
    fn encoded_and_plain_ids_never_collide() {
        // An id that looks like an encoding is itself encoded.
        let tricky = encode_id("agent:x");
        assert_ne!(encode_id(&tricky), tricky);
    }

    #[test]
    fn roles_round_trip() {
        for r in Role::ALL {
            assert_eq!(r.as_str().parse::<Role>(), Ok(r));
        }
        assert!("conversation.mian".parse::<Role>().is_err());
    }
}
