//! K1-A A2A handoff adapter: turns an A2A adapter packet (`protocol == "a2a"` with an
//! `event_type`) into the canonical `assay.adapter.a2a.*` payload, byte-compatible with the
//! assay adapter (`assay-adapter-a2a`) apart from `adapter_version`.
//!
//! Rules implemented (seed 001 and docs/contract.md):
//! - limits (size, nesting depth, array length), `protocol == "a2a"`, `version` "0.N" / "0.N.M"
//!   with major 0 and minor >= 2: rejected in every mode;
//! - strict mode also rejects a missing `agent.id`, an unmapped `event_type`, a `task.*` event
//!   without `task.id` and an `artifact.shared` event without `artifact.id`;
//! - lenient mode substitutes `unknown-agent` / `unknown-task` / `unknown-artifact` /
//!   `unknown-message`, falls back to `assay.adapter.a2a.message`, and counts every
//!   substitution, the fallback and every unknown top-level key in `unmapped_fields_count`;
//! - `discovery` (G4-A) reads only `attributes.assay_g4`;
//! - `handoff` (K1-A v1) is visible only for `task.requested` with typed
//!   `task.kind == "delegation"`; the ref flags follow the *upstream* typed ids, so synthetic
//!   substitutes never count (negatives N1-N7);
//! - golden digests are SHA-256 over [`canonical_json`].
//!
//! Pure: no I/O, no clock.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

/// Kept identical to the assay adapter's id so payloads compare byte for byte.
pub const ADAPTER_ID: &str = "assay-adapter-a2a";
/// Emitted as `adapter_version`; the only field where our payload differs from assay's.
pub const ADAPTER_VERSION: &str = env!("CARGO_PKG_VERSION");
/// Both `protocol` and `protocol_name` of the payload.
pub const PROTOCOL_NAME: &str = "a2a";
/// SHA-256 of the canonical JSON of the default (invisible) handoff object.
#[cfg(test)]
pub const DEFAULT_HANDOFF_DIGEST: &str =
    "60e992b4881c03d816cd94929856d8c8cade113f62273d42a8a75412533a294a";

/// Canonical type for upstream `agent.capabilities`.
pub const EVENT_AGENT_CAPABILITIES: &str = "assay.adapter.a2a.agent.capabilities";
/// Canonical type for upstream `task.requested`, the only handoff source in K1-A v1.
pub const EVENT_TASK_REQUESTED: &str = "assay.adapter.a2a.task.requested";
/// Canonical type for upstream `task.updated` (mapped, never a handoff source in v1).
pub const EVENT_TASK_UPDATED: &str = "assay.adapter.a2a.task.updated";
/// Canonical type for upstream `artifact.shared`.
pub const EVENT_ARTIFACT_SHARED: &str = "assay.adapter.a2a.artifact.shared";
/// Lenient fallback for an unmapped or missing `event_type`.
pub const EVENT_MESSAGE: &str = "assay.adapter.a2a.message";

/// The nine top-level keys the adapter understands; any other key counts as unmapped.
const KNOWN_TOP_LEVEL_KEYS: [&str; 9] = [
    "protocol",
    "version",
    "event_type",
    "timestamp",
    "agent",
    "task",
    "artifact",
    "message",
    "attributes",
];

const UNKNOWN_AGENT: &str = "unknown-agent";
const UNKNOWN_TASK: &str = "unknown-task";
const UNKNOWN_ARTIFACT: &str = "unknown-artifact";
const UNKNOWN_MESSAGE: &str = "unknown-message";

/// How the adapter treats packets that lack required typed fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AdapterMode {
    /// Reject the packet (no event is emitted).
    Strict,
    /// Substitute placeholders, fall back to the generic message event, and count the loss.
    #[default]
    Lenient,
}

impl AdapterMode {
    /// The lowercase name used in configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            AdapterMode::Strict => "strict",
            AdapterMode::Lenient => "lenient",
        }
    }
}

impl fmt::Display for AdapterMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An adapter mode string that is neither `strict` nor `lenient`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("adapter mode must be \"strict\" or \"lenient\", not {0:?}")]
pub struct ParseModeError(pub String);

impl FromStr for AdapterMode {
    type Err = ParseModeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "strict" => Ok(AdapterMode::Strict),
            "lenient" => Ok(AdapterMode::Lenient),
            _ => Err(ParseModeError(s.to_string())),
        }
    }
}

/// Input bounds enforced before any mapping, in every mode.
///
/// The assay adapter leaves all three unset by default (`ConvertOptions::default()`), so its
/// only effective bound is serde_json's parser recursion limit. The defaults here are chosen to
/// reject nothing more than that: 1 MiB is the pipeline's `max_payload_bytes`; a depth of 128
/// (root = 1, scalars count) admits every document serde_json can parse; and no array inside a
/// 1 MiB document can hold more than 1 MiB items.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdapterLimits {
    /// Largest raw packet, in bytes; larger packets are rejected before parsing.
    pub max_bytes: usize,
    /// Deepest value, counting the root as depth 1 and scalars as a level.
    pub max_depth: usize,
    /// Longest array anywhere in the packet.
    pub max_array_len: usize,
}

impl Default for AdapterLimits {
    fn default() -> Self {
        Self {
            max_bytes: 1024 * 1024,
            max_depth: 128,
            max_array_len: 1024 * 1024,
        }
    }
}

/// A converted packet.
#[derive(Debug, Clone, PartialEq)]
pub struct Canonical {
    /// Canonical event type, e.g. `assay.adapter.a2a.task.requested`.
    pub event_type: String,
    /// The canonical payload, keys in the assay order.
    pub payload: Value,
    /// `payload.handoff.visible`.
    pub handoff_visible: bool,
    /// SHA-256 hex of the canonical JSON of `payload.handoff`.
    pub handoff_digest: String,
    /// SHA-256 hex of the canonical JSON of `payload.discovery`.
    pub discovery_digest: String,
    /// The assay adapter's event subject: task id for task events, artifact id for
    /// `artifact.shared`, message id for the generic message, else the agent id.
    pub subject: String,
}

/// Why the adapter refused a packet. Callers match on the variant (or [`AdapterError::kind`]);
/// the message names the field at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdapterError {
    /// Not UTF-8 JSON (only from [`convert_bytes`]).
    #[error("packet is not valid UTF-8 JSON ({detail}); publish one JSON object per message")]
    InvalidJson { detail: String },
    /// Raw packet larger than `max_bytes`.
    #[error(
        "packet is {size} bytes, over the adapter limit of {limit} bytes; shrink it or raise adapter.limits.max_bytes"
    )]
    TooLarge { size: usize, limit: usize },
    /// A value deeper than `max_depth`.
    #[error(
        "field `{path}` nests deeper than the adapter limit of {limit} levels; flatten it or raise adapter.limits.max_depth"
    )]
    TooDeep { path: String, limit: usize },
    /// An array longer than `max_array_len`.
    #[error(
        "array `{path}` has {len} items, over the adapter limit of {limit}; shorten it or raise adapter.limits.max_array_len"
    )]
    ArrayTooLong {
        path: String,
        len: usize,
        limit: usize,
    },
    /// `protocol` is not the string `"a2a"` (or the packet is not an object).
    #[error("field `protocol` must be the string \"a2a\" (found {found}); this is not an A2A adapter packet")]
    NotA2a { found: String },
    /// `version` absent or not a string.
    #[error("packet has no `version` string; set it to \"0.N\" or \"0.N.M\" with N >= 2")]
    MissingVersion,
    /// `version` not "0.N" / "0.N.M" with major 0 and minor >= 2.
    #[error(
        "field `version` is {version:?}, an unsupported A2A version; use \"0.N\" or \"0.N.M\" with N >= 2"
    )]
    UnsupportedVersion { version: String },
    /// Strict only: no string `agent.id`.
    #[error(
        "strict mode: packet has no agent.id (string); add it or run the adapter in lenient mode"
    )]
    MissingAgentId,
    /// Strict only: `event_type` missing, not a string, or not one of the four mapped types.
    #[error(
        "strict mode: field `event_type` is {found}, not one of agent.capabilities, task.requested, task.updated, artifact.shared; fix it or run the adapter in lenient mode"
    )]
    UnsupportedEventType { found: String },
    /// Strict only: a `task.*` event without a string `task.id`.
    #[error("strict mode: {event_type} packet has no task.id (string); add it or run the adapter in lenient mode")]
    MissingTaskId { event_type: String },
    /// Strict only: `artifact.shared` without a string `artifact.id`.
    #[error("strict mode: artifact.shared packet has no artifact.id (string); add it or run the adapter in lenient mode")]
    MissingArtifactId,
}

impl AdapterError {
    /// Stable snake_case name of the variant, for golden files, logs and metric labels.
    pub fn kind(&self) -> &'static str {
        match self {
            AdapterError::InvalidJson { .. } => "invalid_json",
            AdapterError::TooLarge { .. } => "too_large",
            AdapterError::TooDeep { .. } => "too_deep",
            AdapterError::ArrayTooLong { .. } => "array_too_long",
            AdapterError::NotA2a { .. } => "not_a2a",
            AdapterError::MissingVersion => "missing_version",
            AdapterError::UnsupportedVersion { .. } => "unsupported_version",
            AdapterError::MissingAgentId => "missing_agent_id",
            AdapterError::UnsupportedEventType { .. } => "unsupported_event_type",
            AdapterError::MissingTaskId { .. } => "missing_task_id",
            AdapterError::MissingArtifactId => "missing_artifact_id",
        }
    }
}

/// True for an object with `"protocol": "a2a"` and an `event_type` key (of any type: a bad
/// `event_type` is the adapter's to judge, not the router's).
pub fn looks_like_adapter_packet(v: &Value) -> bool {
    v.as_object().is_some_and(|obj| {
        obj.get("protocol").and_then(Value::as_str) == Some(PROTOCOL_NAME)
            && obj.contains_key("event_type")
    })
}

/// Size check, parse, then [`convert`]; the order the assay adapter uses.
pub fn convert_bytes(
    raw: &[u8],
    mode: AdapterMode,
    limits: &AdapterLimits,
) -> Result<Canonical, AdapterError> {
    check_size(raw.len(), limits)?;
    let value: Value = serde_json::from_slice(raw).map_err(|err| AdapterError::InvalidJson {
        detail: err.to_string(),
    })?;
    convert(&value, raw.len(), mode, limits)
}

/// Convert a parsed packet whose raw form was `raw_len` bytes.
pub fn convert(
    v: &Value,
    raw_len: usize,
    mode: AdapterMode,
    limits: &AdapterLimits,
) -> Result<Canonical, AdapterError> {
    let version = check_packet(v, raw_len, limits)?;
    let ids = TypedIds::of(v);
    let mapped = map_event_type(ids.upstream_event_type);
    if mode == AdapterMode::Strict {
        check_strict(v, &ids, mapped)?;
    }
    let refs = Refs::resolve(v, &ids, mapped);
    let attributes = v.get("attributes");
    let discovery = discovery_object(attributes);
    // The ref flags read the upstream typed ids, never the substitutes (freeze §4.3/§4.4).
    let handoff = handoff_object(
        refs.event_type,
        ids.task_kind,
        ids.task_id.is_some(),
        ids.message_id.is_some(),
    );
    let handoff_visible = handoff.get("visible") == Some(&Value::Bool(true));
    let handoff_digest = digest(&handoff);
    let discovery_digest = digest(&discovery);
    let mut payload = Map::new();
    insert_str(&mut payload, "adapter_id", ADAPTER_ID);
    insert_str(&mut payload, "adapter_version", ADAPTER_VERSION);
    insert_str(&mut payload, "protocol", PROTOCOL_NAME);
    insert_str(&mut payload, "protocol_name", PROTOCOL_NAME);
    insert_str(&mut payload, "protocol_version", version);
    if let Some(upstream) = ids.upstream_event_type {
        insert_str(&mut payload, "upstream_event_type", upstream);
    }
    insert_sections(&mut payload, v, &ids, &refs);
    if let Some(attrs) = attributes {
        payload.insert("attributes".to_string(), normalize_attributes(attrs));
    }
    payload.insert("discovery".to_string(), discovery);
    payload.insert("handoff".to_string(), handoff);
    payload.insert(
        "unmapped_fields_count".to_string(),
        Value::from(refs.unmapped),
    );
    Ok(Canonical {
        event_type: refs.event_type.to_string(),
        payload: Value::Object(payload),
        handoff_visible,
        handoff_digest,
        discovery_digest,
        subject: refs.subject,
    })
}

/// The bounds, `protocol` and `version` every mode checks; the packet's version.
fn check_packet<'a>(
    v: &'a Value,
    raw_len: usize,
    limits: &AdapterLimits,
) -> Result<&'a str, AdapterError> {
    check_size(raw_len, limits)?;
    check_shape(v, limits)?;
    let protocol = v.get("protocol");
    if protocol.and_then(Value::as_str) != Some(PROTOCOL_NAME) {
        return Err(AdapterError::NotA2a {
            found: preview(protocol),
        });
    }
    let version = v
        .get("version")
        .and_then(Value::as_str)
        .ok_or(AdapterError::MissingVersion)?;
    if !version_supported(version) {
        return Err(AdapterError::UnsupportedVersion {
            version: version.to_string(),
        });
    }
    Ok(version)
}

/// The typed fields of a packet. Only JSON strings count; any other type reads as absent, as in
/// assay.
struct TypedIds<'a> {
    upstream_event_type: Option<&'a str>,
    agent_id: Option<&'a str>,
    task_id: Option<&'a str>,
    task_kind: Option<&'a str>,
    artifact_id: Option<&'a str>,
    message_id: Option<&'a str>,
}

impl<'a> TypedIds<'a> {
    fn of(v: &'a Value) -> TypedIds<'a> {
        TypedIds {
            upstream_event_type: str_at(v, &["event_type"]),
            agent_id: str_at(v, &["agent", "id"]),
            task_id: str_at(v, &["task", "id"]),
            task_kind: str_at(v, &["task", "kind"]),
            artifact_id: str_at(v, &["artifact", "id"]),
            message_id: str_at(v, &["message", "id"]),
        }
    }
}

/// Strict mode: the agent id, a mapped event type, and the id that type needs.
fn check_strict(
    v: &Value,
    ids: &TypedIds<'_>,
    mapped: Option<&'static str>,
) -> Result<(), AdapterError> {
    if ids.agent_id.is_none() {
        return Err(AdapterError::MissingAgentId);
    }
    let Some(event_type) = mapped else {
        return Err(AdapterError::UnsupportedEventType {
            found: preview(v.get("event_type")),
        });
    };
    if is_task_event(event_type) && ids.task_id.is_none() {
        return Err(AdapterError::MissingTaskId {
            event_type: ids.upstream_event_type.unwrap_or_default().to_string(),
        });
    }
    if event_type == EVENT_ARTIFACT_SHARED && ids.artifact_id.is_none() {
        return Err(AdapterError::MissingArtifactId);
    }
    Ok(())
}

/// The canonical event type and the ids it refers to, a placeholder standing in for each id
/// the type needs and the packet lacks (lenient mode); each placeholder, the unknown keys and
/// an unmapped type count as unmapped fields.
struct Refs {
    event_type: &'static str,
    agent_id: String,
    task_ref: Option<String>,
    artifact_ref: Option<String>,
    message_ref: Option<String>,
    unmapped: u64,
    subject: String,
}

impl Refs {
    fn resolve(v: &Value, ids: &TypedIds<'_>, mapped: Option<&'static str>) -> Refs {
        let mut unmapped = v.as_object().map_or(0, |obj| {
            obj.keys()
                .filter(|k| !KNOWN_TOP_LEVEL_KEYS.contains(&k.as_str()))
                .count() as u64
        });
        let mut substitute =
            |typed: Option<&str>, needed: bool, placeholder: &'static str| match typed {
                Some(id) => Some(id.to_string()),
                None if needed => {
                    unmapped += 1;
                    Some(placeholder.to_string())
                }
                None => None,
            };
        let event_type = mapped.unwrap_or(EVENT_MESSAGE);
        let agent_id = substitute(ids.agent_id, true, UNKNOWN_AGENT).unwrap_or_default();
        let task_ref = substitute(ids.task_id, is_task_event(event_type), UNKNOWN_TASK);
        let artifact_ref = substitute(
            ids.artifact_id,
            event_type == EVENT_ARTIFACT_SHARED,
            UNKNOWN_ARTIFACT,
        );
        let message_ref = substitute(ids.message_id, event_type == EVENT_MESSAGE, UNKNOWN_MESSAGE);
        if mapped.is_none() {
            unmapped += 1;
        }
        let subject = match event_type {
            EVENT_TASK_REQUESTED | EVENT_TASK_UPDATED => task_ref.clone(),
            EVENT_ARTIFACT_SHARED => artifact_ref.clone(),
            EVENT_MESSAGE => message_ref.clone(),
            _ => None,
        }
        .unwrap_or_else(|| agent_id.clone());
        Refs {
            event_type,
            agent_id,
            task_ref,
            artifact_ref,
            message_ref,
            unmapped,
            subject,
        }
    }
}

/// The `agent`, `task`, `artifact` and `message` sections of the canonical payload, in the
/// assay order.
fn insert_sections(payload: &mut Map<String, Value>, v: &Value, ids: &TypedIds<'_>, refs: &Refs) {
    let mut agent = Map::new();
    insert_str(&mut agent, "id", &refs.agent_id);
    insert_opt(&mut agent, "name", str_at(v, &["agent", "name"]));
    insert_opt(&mut agent, "role", str_at(v, &["agent", "role"]));
    if let Some(caps) = v
        .get("agent")
        .and_then(|a| a.get("capabilities"))
        .and_then(Value::as_array)
    {
        // Non-string entries are dropped and the rest sorted, so producers' order is not evidence.
        let mut caps: Vec<&str> = caps.iter().filter_map(Value::as_str).collect();
        caps.sort_unstable();
        agent.insert(
            "capabilities".to_string(),
            Value::Array(caps.into_iter().map(Value::from).collect()),
        );
    }
    payload.insert("agent".to_string(), Value::Object(agent));
    if let Some(id) = &refs.task_ref {
        let mut task = Map::new();
        insert_str(&mut task, "id", id);
        insert_opt(&mut task, "status", str_at(v, &["task", "status"]));
        insert_opt(&mut task, "kind", ids.task_kind);
        payload.insert("task".to_string(), Value::Object(task));
    }
    if let Some(id) = &refs.artifact_ref {
        let mut artifact = Map::new();
        insert_str(&mut artifact, "id", id);
        insert_opt(&mut artifact, "name", str_at(v, &["artifact", "name"]));
        insert_opt(
            &mut artifact,
            "media_type",
            str_at(v, &["artifact", "media_type"]),
        );
        payload.insert("artifact".to_string(), Value::Object(artifact));
    }
    if let Some(id) = &refs.message_ref {
        let mut message = Map::new();
        insert_str(&mut message, "id", id);
        insert_opt(&mut message, "role", str_at(v, &["message", "role"]));
        payload.insert("message".to_string(), Value::Object(message));
    }
}

/// Canonical JSON: object keys sorted by bytes at every level, no whitespace, strings escaped
/// as serde_json does (non-ASCII kept as is).
pub fn canonical_json(v: &Value) -> String {
    // Rebuilding with sorted keys lets serde_json's own writer do the escaping and number
    // formatting, which is what makes the bytes match assay's.
    sort_keys(v).to_string()
}

/// SHA-256 hex of [`canonical_json`].
pub fn digest(v: &Value) -> String {
    hex::encode(Sha256::digest(canonical_json(v).as_bytes()))
}

fn sort_keys(v: &Value) -> Value {
    sorted(v, false)
}

/// Sorted keys at every level, and arrays made only of strings sorted too, so attribute
/// order chosen by a producer never changes the payload.
fn normalize_attributes(v: &Value) -> Value {
    sorted(v, true)
}

/// `v` with its object keys sorted at every level; with `string_sets`, arrays made only of
/// strings are sorted too.
fn sorted(v: &Value, string_sets: bool) -> Value {
    match v {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            Value::Object(
                entries
                    .into_iter()
                    .map(|(k, v)| (k.clone(), sorted(v, string_sets)))
                    .collect(),
            )
        }
        Value::Array(items) => {
            let strings: Option<Vec<&str>> = if string_sets {
                items.iter().map(Value::as_str).collect()
            } else {
                None
            };
            match strings {
                Some(mut strings) => {
                    strings.sort_unstable();
                    Value::Array(strings.into_iter().map(Value::from).collect())
                }
                None => Value::Array(items.iter().map(|i| sorted(i, string_sets)).collect()),
            }
        }
        other => other.clone(),
    }
}

/// G4-A discovery: only `attributes.assay_g4.{agent_card,extended_card_access}.visible == true`
/// count; any other shape gives the defaults.
fn discovery_object(attributes: Option<&Value>) -> Value {
    let g4 = attributes
        .and_then(|a| a.get("assay_g4"))
        .and_then(Value::as_object);
    let flag = |name: &str| {
        g4.and_then(|g| g.get(name))
            .and_then(Value::as_object)
            .and_then(|o| o.get("visible"))
            == Some(&Value::Bool(true))
    };
    let agent_card_visible = flag("agent_card");
    let mut m = Map::new();
    m.insert(
        "agent_card_visible".to_string(),
        Value::Bool(agent_card_visible),
    );
    insert_str(
        &mut m,
        "agent_card_source_kind",
        if agent_card_visible {
            "attributes"
        } else {
            "unknown"
        },
    );
    m.insert(
        "extended_card_access_visible".to_string(),
        Value::Bool(flag("extended_card_access")),
    );
    // v1 has no signature source at all.
    m.insert("signature_material_visible".to_string(), Value::Bool(false));
    Value::Object(m)
}

/// K1-A v1 handoff: the one positive rule is canonical `task.requested` plus typed
/// `task.kind == "delegation"`; everything else (task.updated included) keeps the defaults.
fn handoff_object(
    event_type: &str,
    task_kind: Option<&str>,
    typed_task_id: bool,
    typed_message_id: bool,
) -> Value {
    let visible = event_type == EVENT_TASK_REQUESTED && task_kind == Some("delegation");
    let mut m = Map::new();
    m.insert("visible".to_string(), Value::Bool(visible));
    insert_str(
        &mut m,
        "source_kind",
        if visible { "typed_payload" } else { "unknown" },
    );
    m.insert(
        "task_ref_visible".to_string(),
        Value::Bool(visible && typed_task_id),
    );
    m.insert(
        "message_ref_visible".to_string(),
        Value::Bool(visible && typed_message_id),
    );
    Value::Object(m)
}

fn map_event_type(upstream: Option<&str>) -> Option<&'static str> {
    match upstream? {
        "agent.capabilities" => Some(EVENT_AGENT_CAPABILITIES),
        "task.requested" => Some(EVENT_TASK_REQUESTED),
        "task.updated" => Some(EVENT_TASK_UPDATED),
        "artifact.shared" => Some(EVENT_ARTIFACT_SHARED),
        _ => None,
    }
}

fn is_task_event(event_type: &str) -> bool {
    event_type == EVENT_TASK_REQUESTED || event_type == EVENT_TASK_UPDATED
}

/// "0.N" or "0.N.M" (decimal digits only), major 0, minor at least 2.
fn version_supported(version: &str) -> bool {
    let parts: Vec<&str> = version.split('.').collect();
    if !(2..=3).contains(&parts.len())
        || parts
            .iter()
            .any(|p| p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()))
    {
        return false;
    }
    // A minor too big for u64 is rejected, as the assay adapter's integer parse does.
    matches!(
        (parts[0].parse::<u64>(), parts[1].parse::<u64>()),
        (Ok(0), Ok(minor)) if minor >= 2
    )
}

fn check_size(len: usize, limits: &AdapterLimits) -> Result<(), AdapterError> {
    if len > limits.max_bytes {
        return Err(AdapterError::TooLarge {
            size: len,
            limit: limits.max_bytes,
        });
    }
    Ok(())
}

enum Segment<'a> {
    Key(&'a str),
    Index(usize),
}

enum ShapeFault {
    Depth,
    Array(usize),
}

fn check_shape(v: &Value, limits: &AdapterLimits) -> Result<(), AdapterError> {
    let mut path = Vec::new();
    match visit_shape(v, 1, limits, &mut path) {
        Ok(()) => Ok(()),
        Err(fault) => {
            // Segments were pushed while unwinding, innermost first.
            path.reverse();
            let path = render_path(&path);
            Err(match fault {
                ShapeFault::Depth => AdapterError::TooDeep {
                    path,
                    limit: limits.max_depth,
                },
                ShapeFault::Array(len) => AdapterError::ArrayTooLong {
                    path,
                    len,
                    limit: limits.max_array_len,
                },
            })
        }
    }
}

/// Same counting as the assay adapter: the root is depth 1 and every value, scalars included,
/// is one level below its container.
fn visit_shape<'a>(
    v: &'a Value,
    depth: usize,
    limits: &AdapterLimits,
    path: &mut Vec<Segment<'a>>,
) -> Result<(), ShapeFault> {
    if depth > limits.max_depth {
        return Err(ShapeFault::Depth);
    }
    match v {
        Value::Array(items) => {
            if items.len() > limits.max_array_len {
                return Err(ShapeFault::Array(items.len()));
            }
            for (i, item) in items.iter().enumerate() {
                visit_shape(item, depth + 1, limits, path).inspect_err(|_| {
                    path.push(Segment::Index(i));
                })?;
            }
        }
        Value::Object(map) => {
            for (key, item) in map {
                visit_shape(item, depth + 1, limits, path).inspect_err(|_| {
                    path.push(Segment::Key(key));
                })?;
            }
        }
        _ => {}
    }
    Ok(())
}

fn render_path(path: &[Segment<'_>]) -> String {
    if path.is_empty() {
        return "(root)".to_string();
    }
    let mut out = String::new();
    for seg in path {
        match seg {
            Segment::Key(k) => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(k);
            }
            Segment::Index(i) => out.push_str(&format!("[{i}]")),
        }
    }
    out
}

fn str_at<'a>(v: &'a Value, path: &[&str]) -> Option<&'a str> {
    path.iter()
        .try_fold(v, |cur, key| cur.get(*key))
        .and_then(Value::as_str)
}

/// Short rendering of an offending value for error messages.
fn preview(v: Option<&Value>) -> String {
    const MAX_CHARS: usize = 60;
    match v {
        None => "missing".to_string(),
        Some(v) => {
            let text = v.to_string();
            if text.chars().count() <= MAX_CHARS {
                text
            } else {
                let cut: String = text.chars().take(MAX_CHARS).collect();
                format!("{cut}…")
            }
        }
    }
}

fn insert_str(map: &mut Map<String, Value>, key: &str, value: &str) {
    map.insert(key.to_string(), Value::String(value.to_string()));
}

fn insert_opt(map: &mut Map<String, Value>, key: &str, value: Option<&str>) {
    if let Some(value) = value {
        insert_str(map, key, value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;
    use std::path::{Path, PathBuf};

    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/assay-adr026");
    /// Digests of the two positive handoff shapes and of the G4 discovery shapes, as pinned by
    /// the assay adapter's own tests; they cross-check our canonical JSON against theirs.
    const HANDOFF_DIGEST_TYPED_POSITIVE: &str =
        "e478af7359a254678c90b5eb2737d63f79c6d667a2b5c4bc323442f07d09d33b";
    const HANDOFF_DIGEST_LENIENT_PARTIAL: &str =
        "0be260743587b9594018a4ab7809560157be088be0372a8ae7c7faa6a744effe";
    const DISCOVERY_DIGEST_DEFAULT: &str =
        "26b4d9c0105f4cc26d4b413e7b6b27effe5829f9f319a60b91ca490fd7776a13";
    const DISCOVERY_DIGEST_AGENT_CARD: &str =
        "93f5c26d149e7400d38104c4479f332df4df23df0d1f4d25aef252aac87b9769";
    const DISCOVERY_DIGEST_BOTH: &str =
        "9d0f24e430e00ee3ec1bc595cb59e6e7d7d5b12c0c90e102ea4d26ad3890e665";
    const DISCOVERY_DIGEST_EXTENDED_ONLY: &str =
        "13e23c6783de838b52ca92d787569bccd3cadc0f8900f1bf76b42262959f77ba";

    fn fixture_bytes(name: &str) -> Vec<u8> {
        std::fs::read(Path::new(FIXTURES).join(name)).expect("fixture readable")
    }

    fn fixture(name: &str) -> Value {
        serde_json::from_slice(&fixture_bytes(name)).expect("fixture is JSON")
    }

    fn run(v: &Value, mode: AdapterMode) -> Result<Canonical, AdapterError> {
        let len = v.to_string().len();
        convert(v, len, mode, &AdapterLimits::default())
    }

    fn ok(v: &Value, mode: AdapterMode) -> Canonical {
        run(v, mode).expect("packet converts")
    }

    fn err(v: &Value, mode: AdapterMode) -> AdapterError {
        run(v, mode).expect_err("packet is rejected")
    }

    fn default_handoff() -> Value {
        json!({"visible": false, "source_kind": "unknown", "task_ref_visible": false, "message_ref_visible": false})
    }

    fn assert_default_handoff(c: &Canonical) {
        assert_eq!(c.payload["handoff"], default_handoff());
        assert!(!c.handoff_visible);
        assert_eq!(c.handoff_digest, DEFAULT_HANDOFF_DIGEST);
    }

    fn with_version(mut payload: Value, version: &str) -> Value {
        payload["adapter_version"] = Value::from(version);
        payload
    }

    fn packet(event_type: &str) -> Value {
        json!({
            "protocol": "a2a",
            "version": "0.2.0",
            "event_type": event_type,
            "agent": {"id": "agent://worker"},
        })
    }

    // ---- the freeze's test list -------------------------------------------------------

    #[test]
    fn typed_positive_from_happy_task_requested_fixture() {
        for mode in [AdapterMode::Strict, AdapterMode::Lenient] {
            let c = ok(&fixture("a2a_happy_task_requested.json"), mode);
            assert_eq!(c.event_type, EVENT_TASK_REQUESTED);
            assert!(c.handoff_visible);
            assert_eq!(
                c.payload["handoff"],
                json!({"visible": true, "source_kind": "typed_payload", "task_ref_visible": true, "message_ref_visible": true})
            );
            assert_eq!(c.handoff_digest, HANDOFF_DIGEST_TYPED_POSITIVE);
            assert_eq!(c.subject, "task-123");
        }
    }

    #[test]
    fn strict_failure_on_missing_task_id() {
        let e = err(
            &fixture("a2a_negative_missing_task_id.json"),
            AdapterMode::Strict,
        );
        assert_eq!(
            e,
            AdapterError::MissingTaskId {
                event_type: "task.requested".into()
            }
        );
        assert_eq!(e.kind(), "missing_task_id");
        assert!(e.to_string().contains("task.id"), "{e}");
    }

    #[test]
    fn lenient_partial_visibility_on_missing_task_id() {
        let c = ok(
            &fixture("a2a_negative_missing_task_id.json"),
            AdapterMode::Lenient,
        );
        assert_eq!(c.payload["task"]["id"], "unknown-task");
        assert_eq!(
            c.payload["handoff"],
            json!({"visible": true, "source_kind": "typed_payload", "task_ref_visible": false, "message_ref_visible": true})
        );
        assert_eq!(c.handoff_digest, HANDOFF_DIGEST_LENIENT_PARTIAL);
        assert_eq!(c.payload["unmapped_fields_count"], 1);
        assert_eq!(c.subject, "unknown-task");
    }

    #[test]
    fn no_promotion_from_artifact_shared_fixture() {
        for mode in [AdapterMode::Strict, AdapterMode::Lenient] {
            let c = ok(&fixture("a2a_happy_artifact_shared.json"), mode);
            assert_eq!(c.event_type, EVENT_ARTIFACT_SHARED);
            assert_eq!(c.payload["task"]["id"], "task-123");
            assert_default_handoff(&c);
            assert_eq!(c.subject, "artifact-7");
        }
    }

    #[test]
    fn no_promotion_from_message_fallback_fixture() {
        let c = ok(
            &fixture("a2a_negative_invalid_event_type.json"),
            AdapterMode::Lenient,
        );
        assert_eq!(c.event_type, EVENT_MESSAGE);
        assert_eq!(c.payload["message"]["id"], "msg-unknown");
        assert_default_handoff(&c);
        assert_eq!(c.payload["unmapped_fields_count"], 1);
    }

    #[test]
    fn explicit_non_promotion_of_task_updated() {
        let mut p = fixture("a2a_happy_task_requested.json");
        p["event_type"] = json!("task.updated");
        for mode in [AdapterMode::Strict, AdapterMode::Lenient] {
            let c = ok(&p, mode);
            assert_eq!(c.event_type, EVENT_TASK_UPDATED);
            assert_eq!(c.payload["task"]["kind"], "delegation");
            assert_default_handoff(&c);
        }
    }

    // ---- N1..N7 -------------------------------------------------------------------------

    #[test]
    fn n1_artifact_shared_with_task_id_does_not_promote() {
        let mut p = packet("artifact.shared");
        p["task"] = json!({"id": "task-9", "kind": "delegation"});
        p["artifact"] = json!({"id": "artifact-1"});
        p["message"] = json!({"id": "msg-9"});
        for mode in [AdapterMode::Strict, AdapterMode::Lenient] {
            let c = ok(&p, mode);
            assert_eq!(c.payload["task"]["id"], "task-9");
            assert_default_handoff(&c);
        }
    }

    #[test]
    fn n2_lenient_message_fallback_keeps_default_handoff() {
        // With a typed message.id, with the synthetic unknown-message, and with task fields
        // that would promote on task.requested: the fallback never promotes.
        let mut typed = packet("session.unknown");
        typed["message"] = json!({"id": "msg-1"});
        typed["task"] = json!({"id": "task-1", "kind": "delegation"});
        let synthetic = packet("no.such.type");
        let mut missing_type = packet("x");
        missing_type
            .as_object_mut()
            .expect("object")
            .remove("event_type");
        for p in [typed, synthetic, missing_type] {
            let c = ok(&p, AdapterMode::Lenient);
            assert_eq!(c.event_type, EVENT_MESSAGE);
            assert!(c.payload["message"]["id"].is_string());
            assert_default_handoff(&c);
        }
        let c = ok(&packet("no.such.type"), AdapterMode::Lenient);
        assert_eq!(c.payload["message"], json!({"id": "unknown-message"}));
        // fallback + unknown-message substitution
        assert_eq!(c.payload["unmapped_fields_count"], 2);
    }

    #[test]
    fn n3_strict_task_requested_without_task_id_is_rejected() {
        let mut p = packet("task.requested");
        p["task"] = json!({"kind": "delegation", "id": 7});
        p["message"] = json!({"id": "msg-1"});
        assert_eq!(
            err(&p, AdapterMode::Strict),
            AdapterError::MissingTaskId {
                event_type: "task.requested".into()
            }
        );
    }

    #[test]
    fn n4_lenient_delegation_without_task_id_is_partially_visible() {
        let mut p = packet("task.requested");
        p["task"] = json!({"kind": "delegation"});
        let c = ok(&p, AdapterMode::Lenient);
        assert_eq!(
            c.payload["handoff"],
            json!({"visible": true, "source_kind": "typed_payload", "task_ref_visible": false, "message_ref_visible": false})
        );
        assert_eq!(
            c.payload["task"],
            json!({"id": "unknown-task", "kind": "delegation"})
        );
        p["message"] = json!({"id": "msg-4"});
        let c = ok(&p, AdapterMode::Lenient);
        assert_eq!(c.payload["handoff"]["task_ref_visible"], false);
        assert_eq!(c.payload["handoff"]["message_ref_visible"], true);
    }

    #[test]
    fn n5_missing_or_non_delegation_task_kind_does_not_promote() {
        let kinds = [
            None,
            Some(json!("analysis")),
            Some(json!("Delegation")),
            Some(json!(" delegation")),
            Some(json!(["delegation"])),
            Some(json!({"kind": "delegation"})),
            Some(json!(null)),
        ];
        for kind in kinds {
            let mut p = packet("task.requested");
            p["task"] = json!({"id": "task-5"});
            p["message"] = json!({"id": "msg-5"});
            if let Some(kind) = kind {
                p["task"]["kind"] = kind;
            }
            for mode in [AdapterMode::Strict, AdapterMode::Lenient] {
                assert_default_handoff(&ok(&p, mode));
            }
        }
        // task itself not an object: nothing typed to read
        let mut p = packet("task.requested");
        p["task"] = json!("delegation");
        assert_default_handoff(&ok(&p, AdapterMode::Lenient));
    }

    #[test]
    fn n6_role_attributes_discovery_or_unmapped_alone_do_not_promote() {
        let mut p = packet("task.requested");
        p["agent"] =
            json!({"id": "agent://a", "role": "delegation", "capabilities": ["delegation"]});
        p["task"] = json!({"id": "task-6", "status": "delegation"});
        p["attributes"] = json!({
            "kind": "delegation",
            "task": {"kind": "delegation"},
            "handoff": {"visible": true},
            "assay_g4": {"agent_card": {"visible": true}, "extended_card_access": {"visible": true}}
        });
        p["handoff"] = json!({"visible": true, "source_kind": "typed_payload"});
        p["kind"] = json!("delegation");
        for mode in [AdapterMode::Strict, AdapterMode::Lenient] {
            let c = ok(&p, mode);
            assert_eq!(c.payload["discovery"]["agent_card_visible"], true);
            assert_eq!(c.payload["unmapped_fields_count"], 2);
            assert_default_handoff(&c);
        }
        // agent.capabilities with the same decorations is still not a source
        let mut caps = p.clone();
        caps["event_type"] = json!("agent.capabilities");
        assert_default_handoff(&ok(&caps, AdapterMode::Strict));
    }

    #[test]
    fn n7_task_updated_does_not_promote_in_v1() {
        let mut p = packet("task.updated");
        p["task"] = json!({"id": "task-999", "status": "running", "kind": "delegation"});
        p["message"] = json!({"id": "msg-update", "role": "assistant"});
        for mode in [AdapterMode::Strict, AdapterMode::Lenient] {
            let c = ok(&p, mode);
            assert_eq!(c.event_type, EVENT_TASK_UPDATED);
            assert_default_handoff(&c);
        }
    }

    // ---- the three payloads printed in seed 001 --------------------------------------

    const SEED_PAYLOAD_TASK_REQUESTED: &str = r#"{
  "adapter_id": "assay-adapter-a2a",
  "adapter_version": "3.4.0",
  "protocol": "a2a",
  "protocol_name": "a2a",
  "protocol_version": "0.2",
  "upstream_event_type": "task.requested",
  "agent": {
    "id": "agent://coordinator",
    "role": "orchestrator"
  },
  "task": {
    "id": "task-123",
    "status": "requested",
    "kind": "delegation"
  },
  "message": {
    "id": "msg-1",
    "role": "assistant"
  },
  "attributes": {
    "channel": "web",
    "priority": "urgent"
  },
  "discovery": {
    "agent_card_visible": false,
    "agent_card_source_kind": "unknown",
    "extended_card_access_visible": false,
    "signature_material_visible": false
  },
  "handoff": {
    "visible": true,
    "source_kind": "typed_payload",
    "task_ref_visible": true,
    "message_ref_visible": true
  },
  "unmapped_fields_count": 0
}"#;

    const SEED_PAYLOAD_MISSING_TASK_ID: &str = r#"{
  "adapter_id": "assay-adapter-a2a",
  "adapter_version": "3.4.0",
  "protocol": "a2a",
  "protocol_name": "a2a",
  "protocol_version": "0.2",
  "upstream_event_type": "task.requested",
  "agent": {
    "id": "agent://coordinator"
  },
  "task": {
    "id": "unknown-task",
    "status": "requested",
    "kind": "delegation"
  },
  "message": {
    "id": "msg-2"
  },
  "discovery": {
    "agent_card_visible": false,
    "agent_card_source_kind": "unknown",
    "extended_card_access_visible": false,
    "signature_material_visible": false
  },
  "handoff": {
    "visible": true,
    "source_kind": "typed_payload",
    "task_ref_visible": false,
    "message_ref_visible": true
  },
  "unmapped_fields_count": 1
}"#;

    const SEED_PAYLOAD_ARTIFACT_SHARED: &str = r#"{
  "adapter_id": "assay-adapter-a2a",
  "adapter_version": "3.4.0",
  "protocol": "a2a",
  "protocol_name": "a2a",
  "protocol_version": "0.3.1",
  "upstream_event_type": "artifact.shared",
  "agent": {
    "id": "agent://worker"
  },
  "task": {
    "id": "task-123"
  },
  "artifact": {
    "id": "artifact-7",
    "name": "plan.md",
    "media_type": "text/markdown"
  },
  "discovery": {
    "agent_card_visible": false,
    "agent_card_source_kind": "unknown",
    "extended_card_access_visible": false,
    "signature_material_visible": false
  },
  "handoff": {
    "visible": false,
    "source_kind": "unknown",
    "task_ref_visible": false,
    "message_ref_visible": false
  },
  "unmapped_fields_count": 0
}"#;

    fn assert_seed_payload(fixture_name: &str, mode: AdapterMode, seed: &str) {
        let c = ok(&fixture(fixture_name), mode);
        assert_eq!(c.payload["adapter_version"], ADAPTER_VERSION);
        let ours = serde_json::to_string_pretty(&with_version(c.payload, "3.4.0"))
            .expect("payload serializes");
        assert_eq!(
            ours, seed,
            "payload of {fixture_name} ({mode}) differs from seed 001"
        );
    }

    #[test]
    fn seed_payload_task_requested_is_reproduced_exactly() {
        for mode in [AdapterMode::Strict, AdapterMode::Lenient] {
            assert_seed_payload(
                "a2a_happy_task_requested.json",
                mode,
                SEED_PAYLOAD_TASK_REQUESTED,
            );
        }
    }

    #[test]
    fn seed_payload_lenient_missing_task_id_is_reproduced_exactly() {
        assert_seed_payload(
            "a2a_negative_missing_task_id.json",
            AdapterMode::Lenient,
            SEED_PAYLOAD_MISSING_TASK_ID,
        );
    }

    #[test]
    fn seed_payload_artifact_shared_is_reproduced_exactly() {
        for mode in [AdapterMode::Strict, AdapterMode::Lenient] {
            assert_seed_payload(
                "a2a_happy_artifact_shared.json",
                mode,
                SEED_PAYLOAD_ARTIFACT_SHARED,
            );
        }
    }

    // ---- determinism and digests --------------------------------------------------------

    #[test]
    fn repeated_conversion_gives_identical_bytes_and_digests() {
        for name in fixture_inputs() {
            let raw = std::fs::read(&name).expect("fixture readable");
            for mode in [AdapterMode::Strict, AdapterMode::Lenient] {
                let limits = AdapterLimits::default();
                let (Ok(a), Ok(b)) = (
                    convert_bytes(&raw, mode, &limits),
                    convert_bytes(&raw, mode, &limits),
                ) else {
                    continue;
                };
                assert_eq!(a.payload.to_string(), b.payload.to_string());
                assert_eq!(canonical_json(&a.payload), canonical_json(&b.payload));
                assert_eq!(digest(&a.payload), digest(&b.payload));
                assert_eq!(a.handoff_digest, b.handoff_digest);
                assert_eq!(a.discovery_digest, b.discovery_digest);
                assert_eq!(a.handoff_digest, digest(&a.payload["handoff"]));
                assert_eq!(a.discovery_digest, digest(&a.payload["discovery"]));
            }
        }
    }

    #[test]
    fn producer_key_order_does_not_change_the_payload() {
        let a: Value = serde_json::from_str(
            r#"{"protocol":"a2a","version":"0.2.0","event_type":"task.requested",
            "agent":{"id":"a","name":"N","role":"r","capabilities":["z","a"]},
            "task":{"id":"t","status":"s","kind":"k"},"attributes":{"b":1,"a":{"y":2,"x":["q","p"]}}}"#,
        )
        .expect("json");
        let b: Value = serde_json::from_str(
            r#"{"attributes":{"a":{"x":["p","q"],"y":2},"b":1},"task":{"kind":"k","id":"t","status":"s"},
            "agent":{"capabilities":["a","z"],"role":"r","id":"a","name":"N"},
            "event_type":"task.requested","version":"0.2.0","protocol":"a2a"}"#,
        )
        .expect("json");
        let (a, b) = (ok(&a, AdapterMode::Strict), ok(&b, AdapterMode::Strict));
        assert_eq!(a.payload.to_string(), b.payload.to_string());
    }

    #[test]
    fn default_handoff_digest_equals_the_constant() {
        assert_eq!(digest(&default_handoff()), DEFAULT_HANDOFF_DIGEST);
        assert_eq!(
            digest(&handoff_object(EVENT_MESSAGE, None, false, false)),
            DEFAULT_HANDOFF_DIGEST
        );
        assert_eq!(
            canonical_json(&default_handoff()),
            r#"{"message_ref_visible":false,"source_kind":"unknown","task_ref_visible":false,"visible":false}"#
        );
    }

    #[test]
    fn discovery_digests_match_the_assay_golden_values() {
        let cases = [
            (
                "a2a_happy_agent_capabilities.json",
                DISCOVERY_DIGEST_DEFAULT,
            ),
            (
                "a2a_happy_agent_capabilities_g4_agent_card.json",
                DISCOVERY_DIGEST_AGENT_CARD,
            ),
            (
                "a2a_happy_agent_capabilities_g4_both_visible.json",
                DISCOVERY_DIGEST_BOTH,
            ),
            (
                "a2a_happy_agent_capabilities_g4_extended.json",
                DISCOVERY_DIGEST_EXTENDED_ONLY,
            ),
        ];
        for (name, expected) in cases {
            let c = ok(&fixture(name), AdapterMode::Strict);
            assert_eq!(c.discovery_digest, expected, "{name}");
            assert_default_handoff(&c);
        }
    }

    #[test]
    fn discovery_ignores_other_shapes_of_assay_g4() {
        for attrs in [
            json!({"assay_g4": "bad"}),
            json!({"assay_g4": {"agent_card": true}}),
            json!({"assay_g4": {"agent_card": {"visible": "true"}}}),
            json!({"assay_g4": {"agent_card": {"visible": false}}}),
            json!({"agent_card": {"visible": true}}),
            json!(["assay_g4"]),
        ] {
            let mut p = packet("agent.capabilities");
            p["attributes"] = attrs;
            assert_eq!(
                ok(&p, AdapterMode::Strict).discovery_digest,
                DISCOVERY_DIGEST_DEFAULT
            );
        }
    }

    #[test]
    fn canonical_json_sorts_keys_by_bytes_and_keeps_non_ascii() {
        let v = json!({"b": [3, {"z": 1, "a": null}], "a": "é\"\n\u{1}", "B": 1.5, "é": true});
        assert_eq!(
            canonical_json(&v),
            "{\"B\":1.5,\"a\":\"é\\\"\\n\\u0001\",\"b\":[3,{\"a\":null,\"z\":1}],\"é\":true}"
        );
        assert_eq!(
            digest(&json!({})),
            "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"
        );
    }

    // ---- rejections in every mode -------------------------------------------------------

    #[test]
    fn oversize_packets_are_rejected_before_parsing() {
        let limits = AdapterLimits {
            max_bytes: 32,
            ..AdapterLimits::default()
        };
        let raw = fixture_bytes("a2a_happy_task_requested.json");
        for mode in [AdapterMode::Strict, AdapterMode::Lenient] {
            let e = convert_bytes(&raw, mode, &limits).expect_err("too large");
            assert_eq!(e.kind(), "too_large");
            let e = convert(&fixture("a2a_happy_task_requested.json"), 33, mode, &limits)
                .expect_err("too large");
            assert_eq!(
                e,
                AdapterError::TooLarge {
                    size: 33,
                    limit: 32
                }
            );
        }
        // not JSON at all, but too big: size wins, as in assay
        assert_eq!(
            convert_bytes(&[b'{'; 40], AdapterMode::Lenient, &limits)
                .expect_err("too large")
                .kind(),
            "too_large"
        );
    }

    #[test]
    fn invalid_json_and_utf8_are_rejected_in_every_mode() {
        for raw in [
            fixture_bytes("a2a_negative_malformed.json"),
            vec![0xff, 0xfe, 0xfd],
        ] {
            for mode in [AdapterMode::Strict, AdapterMode::Lenient] {
                let e = convert_bytes(&raw, mode, &AdapterLimits::default()).expect_err("not JSON");
                assert_eq!(e.kind(), "invalid_json");
            }
        }
    }

    #[test]
    fn depth_limit_counts_root_as_one_and_names_the_path() {
        let p = fixture("a2a_happy_task_requested.json");
        let limits = |max_depth| AdapterLimits {
            max_depth,
            ..AdapterLimits::default()
        };
        // deepest value is a scalar inside agent/task/...: root(1) -> agent(2) -> id(3)
        assert!(convert(&p, 10, AdapterMode::Lenient, &limits(3)).is_ok());
        let e = convert(&p, 10, AdapterMode::Lenient, &limits(2)).expect_err("too deep");
        assert_eq!(
            e,
            AdapterError::TooDeep {
                path: "agent.id".into(),
                limit: 2
            }
        );
        let mut deep = packet("agent.capabilities");
        deep["attributes"] = json!({"nested": {"deeper": [{"value": "x"}]}});
        let e = convert(&deep, 10, AdapterMode::Strict, &limits(4)).expect_err("too deep");
        assert_eq!(
            e.to_string().split('`').nth(1),
            Some("attributes.nested.deeper[0]")
        );
        assert_eq!(e.kind(), "too_deep");
    }

    #[test]
    fn default_depth_limit_admits_everything_serde_json_parses() {
        let nested = |n: usize| format!("{}1{}", "[".repeat(n), "]".repeat(n));
        let deepest = (1..512)
            .take_while(|n| serde_json::from_str::<Value>(&nested(*n)).is_ok())
            .last()
            .expect("some depth parses");
        let parsed: Value = serde_json::from_str(&nested(deepest)).expect("parses");
        assert!(check_shape(&parsed, &AdapterLimits::default()).is_ok());
        // ...and the limit is tight: one more level (built by hand) is refused
        let deeper = Value::Array(vec![parsed]);
        assert_eq!(
            check_shape(&deeper, &AdapterLimits::default()).map_err(|e| e.kind()),
            Err("too_deep")
        );
    }

    #[test]
    fn array_length_limit_names_the_array() {
        let mut p = packet("agent.capabilities");
        p["attributes"] = json!({"items": [1, 2, 3, 4]});
        let limits = AdapterLimits {
            max_array_len: 3,
            ..AdapterLimits::default()
        };
        let e = convert(&p, 10, AdapterMode::Lenient, &limits).expect_err("too long");
        assert_eq!(
            e,
            AdapterError::ArrayTooLong {
                path: "attributes.items".into(),
                len: 4,
                limit: 3
            }
        );
        p["attributes"] = json!({"items": [1, 2, 3]});
        assert!(convert(&p, 10, AdapterMode::Lenient, &limits).is_ok());
    }

    #[test]
    fn protocol_must_be_the_string_a2a() {
        for bad in [json!("A2A"), json!(null), json!(1), json!(["a2a"])] {
            let mut p = packet("task.requested");
            p["protocol"] = bad;
            for mode in [AdapterMode::Strict, AdapterMode::Lenient] {
                let e = err(&p, mode);
                assert_eq!(e.kind(), "not_a2a");
                assert!(e.to_string().contains("`protocol`"), "{e}");
            }
        }
        let mut p = packet("task.requested");
        p.as_object_mut().expect("object").remove("protocol");
        assert_eq!(
            err(&p, AdapterMode::Lenient),
            AdapterError::NotA2a {
                found: "missing".into()
            }
        );
        for root in [json!([]), json!("a2a"), json!(null)] {
            assert_eq!(err(&root, AdapterMode::Lenient).kind(), "not_a2a");
        }
    }

    #[test]
    fn version_must_be_0_n_or_0_n_m_with_minor_at_least_2() {
        for good in ["0.2", "0.2.0", "0.3.1", "0.4", "0.10.7", "00.02"] {
            let mut p = packet("agent.capabilities");
            p["version"] = json!(good);
            let c = ok(&p, AdapterMode::Strict);
            assert_eq!(c.payload["protocol_version"], good);
        }
        for bad in [
            "0.1",
            "0.0",
            "1.0",
            "1.2.0",
            "0.2.0.1",
            "0.2.x",
            "0.2.",
            ".2",
            "0",
            "",
            "v0.2",
            "+0.2",
            "0.+2",
            " 0.2",
            "0.2-rc1",
            "0.99999999999999999999999",
        ] {
            let mut p = packet("agent.capabilities");
            p["version"] = json!(bad);
            for mode in [AdapterMode::Strict, AdapterMode::Lenient] {
                assert_eq!(
                    err(&p, mode),
                    AdapterError::UnsupportedVersion {
                        version: bad.into()
                    },
                    "{bad:?}"
                );
            }
        }
        for missing in [
            None,
            Some(json!(0.2)),
            Some(json!(null)),
            Some(json!(["0.2"])),
        ] {
            let mut p = packet("agent.capabilities");
            match missing {
                Some(v) => p["version"] = v,
                None => {
                    p.as_object_mut().expect("object").remove("version");
                }
            }
            assert_eq!(err(&p, AdapterMode::Lenient), AdapterError::MissingVersion);
        }
    }

    // ---- strict-only rejections and lenient substitutions ---------------------------

    #[test]
    fn strict_rejects_missing_agent_id_first_and_lenient_substitutes() {
        for agent in [
            None,
            Some(json!("agent://x")),
            Some(json!({"id": 5})),
            Some(json!([])),
        ] {
            let mut p = packet("bogus");
            match agent {
                Some(a) => p["agent"] = a,
                None => {
                    p.as_object_mut().expect("object").remove("agent");
                }
            }
            let e = err(&p, AdapterMode::Strict);
            assert_eq!(e, AdapterError::MissingAgentId);
            assert!(e.to_string().contains("agent.id"), "{e}");
            let c = ok(&p, AdapterMode::Lenient);
            assert_eq!(c.payload["agent"], json!({"id": "unknown-agent"}));
            // unknown-agent + fallback + unknown-message
            assert_eq!(c.payload["unmapped_fields_count"], 3);
        }
    }

    #[test]
    fn non_string_event_type_is_unmapped() {
        for et in [
            json!(1),
            json!(null),
            json!({"t": "task.requested"}),
            json!("TASK.REQUESTED"),
        ] {
            let mut p = packet("x");
            p["event_type"] = et.clone();
            let e = err(&p, AdapterMode::Strict);
            assert_eq!(e.kind(), "unsupported_event_type");
            assert!(e.to_string().contains("`event_type`"), "{e}");
            let c = ok(&p, AdapterMode::Lenient);
            assert_eq!(c.event_type, EVENT_MESSAGE);
            // upstream_event_type only when event_type is a string
            assert_eq!(
                c.payload.get("upstream_event_type"),
                et.as_str().map(Value::from).as_ref()
            );
        }
    }

    #[test]
    fn strict_artifact_shared_needs_artifact_id_and_lenient_substitutes() {
        let mut p = packet("artifact.shared");
        p["artifact"] = json!({"id": ["a"], "name": "n.md"});
        assert_eq!(
            err(&p, AdapterMode::Strict),
            AdapterError::MissingArtifactId
        );
        let c = ok(&p, AdapterMode::Lenient);
        assert_eq!(
            c.payload["artifact"],
            json!({"id": "unknown-artifact", "name": "n.md"})
        );
        assert_eq!(c.payload["unmapped_fields_count"], 1);
        assert_eq!(c.subject, "unknown-artifact");
    }

    #[test]
    fn task_updated_without_task_id_follows_the_same_rules() {
        let p = packet("task.updated");
        assert_eq!(
            err(&p, AdapterMode::Strict),
            AdapterError::MissingTaskId {
                event_type: "task.updated".into()
            }
        );
        let c = ok(&p, AdapterMode::Lenient);
        assert_eq!(c.payload["task"], json!({"id": "unknown-task"}));
    }

    #[test]
    fn substitutes_only_where_the_event_needs_them() {
        // agent.capabilities needs no task, artifact or message: nothing is invented
        let c = ok(&packet("agent.capabilities"), AdapterMode::Lenient);
        let keys: Vec<&str> = c
            .payload
            .as_object()
            .expect("object")
            .keys()
            .map(String::as_str)
            .collect();
        assert_eq!(
            keys,
            [
                "adapter_id",
                "adapter_version",
                "protocol",
                "protocol_name",
                "protocol_version",
                "upstream_event_type",
                "agent",
                "discovery",
                "handoff",
                "unmapped_fields_count"
            ]
        );
        assert_eq!(c.subject, "agent://worker");
    }

    #[test]
    fn unmapped_fields_count_counts_unknown_top_level_keys_only() {
        let mut p = fixture("a2a_happy_task_requested.json");
        p["extra_one"] = json!(1);
        p["extra_two"] = json!({"x": 1});
        p["task"]["nested_unknown"] = json!(true);
        p["agent"]["nested_unknown"] = json!(true);
        for mode in [AdapterMode::Strict, AdapterMode::Lenient] {
            let c = ok(&p, mode);
            assert_eq!(c.payload["unmapped_fields_count"], 2);
            assert_eq!(c.payload.get("extra_one"), None);
            assert!(c.handoff_visible);
        }
    }

    #[test]
    fn attributes_are_normalized_and_any_value_is_kept() {
        let mut p = packet("agent.capabilities");
        p["attributes"] = json!({
            "z": ["b", "a", "C"],
            "m": [2, 1, "x"],
            "a": {"y": [{"k": 1, "b": 2}], "e": []}
        });
        let c = ok(&p, AdapterMode::Strict);
        assert_eq!(
            c.payload["attributes"].to_string(),
            r#"{"a":{"e":[],"y":[{"b":2,"k":1}]},"m":[2,1,"x"],"z":["C","a","b"]}"#
        );
        p["attributes"] = json!(null);
        let c = ok(&p, AdapterMode::Strict);
        assert_eq!(c.payload.get("attributes"), Some(&Value::Null));
    }

    #[test]
    fn typed_fields_of_other_types_are_left_out() {
        let mut p = packet("task.requested");
        p["agent"] = json!({"id": "a", "name": 3, "role": null, "capabilities": ["x", 1, "a"]});
        p["task"] = json!({"id": "t", "status": {"s": 1}, "kind": "delegation"});
        p["message"] = json!({"id": "m", "role": ["assistant"]});
        let c = ok(&p, AdapterMode::Strict);
        assert_eq!(
            c.payload["agent"],
            json!({"id": "a", "capabilities": ["a", "x"]})
        );
        assert_eq!(c.payload["task"], json!({"id": "t", "kind": "delegation"}));
        assert_eq!(c.payload["message"], json!({"id": "m"}));
        p["agent"]["capabilities"] = json!("x");
        assert_eq!(
            ok(&p, AdapterMode::Strict).payload["agent"],
            json!({"id": "a"})
        );
    }

    // ---- small API surface ------------------------------------------------------------

    #[test]
    fn looks_like_adapter_packet_needs_protocol_a2a_and_event_type() {
        assert!(looks_like_adapter_packet(
            &json!({"protocol": "a2a", "event_type": null})
        ));
        assert!(looks_like_adapter_packet(&fixture(
            "a2a_happy_task_requested.json"
        )));
        assert!(!looks_like_adapter_packet(&json!({"protocol": "a2a"})));
        assert!(!looks_like_adapter_packet(
            &json!({"protocol": "acp", "event_type": "x"})
        ));
        assert!(!looks_like_adapter_packet(&json!({"type": "a2a.send"})));
        assert!(!looks_like_adapter_packet(&json!(["protocol", "a2a"])));
    }

    #[test]
    fn mode_parses_displays_and_serializes_lowercase() {
        assert_eq!(AdapterMode::default(), AdapterMode::Lenient);
        assert_eq!("strict".parse::<AdapterMode>(), Ok(AdapterMode::Strict));
        assert_eq!(" Lenient ".parse::<AdapterMode>(), Ok(AdapterMode::Lenient));
        let e = "loose".parse::<AdapterMode>().expect_err("invalid mode");
        assert!(e.to_string().contains("\"loose\""), "{e}");
        assert_eq!(AdapterMode::Strict.to_string(), "strict");
        assert_eq!(
            serde_json::to_string(&AdapterMode::Lenient).expect("serializes"),
            "\"lenient\""
        );
        assert_eq!(
            serde_json::from_str::<AdapterMode>("\"strict\"").expect("deserializes"),
            AdapterMode::Strict
        );
        assert!(serde_json::from_str::<AdapterMode>("\"Strict\"").is_err());
    }

    #[test]
    fn limits_default_and_deserialize_with_defaults() {
        let d = AdapterLimits::default();
        assert_eq!(
            (d.max_bytes, d.max_depth, d.max_array_len),
            (1 << 20, 128, 1 << 20)
        );
        let l: AdapterLimits = serde_json::from_str(r#"{"max_depth": 8}"#).expect("limits");
        assert_eq!(l, AdapterLimits { max_depth: 8, ..d });
        assert!(serde_json::from_str::<AdapterLimits>(r#"{"max_dept": 8}"#).is_err());
    }

    #[test]
    fn every_error_message_names_its_field() {
        let cases = [
            (
                AdapterError::InvalidJson {
                    detail: "EOF".into(),
                },
                "JSON",
            ),
            (AdapterError::TooLarge { size: 2, limit: 1 }, "bytes"),
            (
                AdapterError::TooDeep {
                    path: "attributes.a".into(),
                    limit: 1,
                },
                "`attributes.a`",
            ),
            (
                AdapterError::ArrayTooLong {
                    path: "x[0]".into(),
                    len: 2,
                    limit: 1,
                },
                "`x[0]`",
            ),
            (
                AdapterError::NotA2a {
                    found: "missing".into(),
                },
                "`protocol`",
            ),
            (AdapterError::MissingVersion, "`version`"),
            (
                AdapterError::UnsupportedVersion {
                    version: "1.0".into(),
                },
                "`version`",
            ),
            (AdapterError::MissingAgentId, "agent.id"),
            (
                AdapterError::UnsupportedEventType {
                    found: "\"x\"".into(),
                },
                "`event_type`",
            ),
            (
                AdapterError::MissingTaskId {
                    event_type: "task.updated".into(),
                },
                "task.updated packet has no task.id",
            ),
            (AdapterError::MissingArtifactId, "artifact.id"),
        ];
        let mut kinds = std::collections::BTreeSet::new();
        for (e, needle) in cases {
            assert!(e.to_string().contains(needle), "{e}");
            assert!(kinds.insert(e.kind()), "duplicate kind {}", e.kind());
        }
    }

    // ---- property: never panics, visibility only from the typed rule ----------------

    fn arb_key() -> impl Strategy<Value = String> {
        prop_oneof![
            prop::sample::select(vec![
                "id",
                "kind",
                "role",
                "name",
                "status",
                "visible",
                "assay_g4",
                "agent_card",
                "capabilities",
                "protocol",
                "event_type",
                "task",
                "message",
            ])
            .prop_map(str::to_string),
            "[a-z_é]{0,6}",
        ]
    }

    fn arb_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            prop::sample::select(vec!["delegation", "task.requested", "a2a", "0.2", ""])
                .prop_map(Value::from),
            "\\PC{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(5, 48, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::vec((arb_key(), inner), 0..6)
                    .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    fn arb_maybe(inner: BoxedStrategy<Value>) -> impl Strategy<Value = Option<Value>> {
        prop_oneof![Just(None), inner.prop_map(Some)]
    }

    fn arb_id_object(extra_key: &'static str) -> BoxedStrategy<Value> {
        let id = prop_oneof!["[a-z0-9-]{0,6}".prop_map(Value::String), arb_json(),];
        let extra = prop_oneof![
            Just(Value::from("delegation")),
            Just(Value::from("analysis")),
            arb_json(),
        ];
        prop_oneof![
            3 => (arb_maybe(id.boxed()), arb_maybe(extra.boxed())).prop_map(move |(id, extra)| {
                let mut m = Map::new();
                if let Some(id) = id {
                    m.insert("id".into(), id);
                }
                if let Some(extra) = extra {
                    m.insert(extra_key.into(), extra);
                }
                Value::Object(m)
            }),
            1 => arb_json(),
        ]
        .boxed()
    }

    fn arb_packet() -> impl Strategy<Value = Value> {
        let event_type = prop_oneof![
            prop::sample::select(vec![
                "task.requested",
                "task.updated",
                "artifact.shared",
                "agent.capabilities",
                "message",
            ])
            .prop_map(Value::from),
            arb_json(),
        ];
        let version = prop_oneof![
            prop::sample::select(vec!["0.2", "0.2.0", "0.3.1", "0.1", "1.0"]).prop_map(Value::from),
            arb_json(),
        ];
        (
            arb_maybe(event_type.boxed()),
            arb_maybe(version.boxed()),
            arb_maybe(arb_id_object("role")),
            arb_maybe(arb_id_object("kind")),
            arb_maybe(arb_id_object("role")),
            arb_maybe(arb_id_object("name")),
            arb_maybe(arb_json().boxed()),
            prop::collection::vec((arb_key(), arb_json()), 0..3),
        )
            .prop_map(
                |(event_type, version, agent, task, message, artifact, attributes, extra)| {
                    let mut m: Map<String, Value> = extra.into_iter().collect();
                    m.insert("protocol".into(), Value::from("a2a"));
                    for (k, v) in [
                        ("event_type", event_type),
                        ("version", version),
                        ("agent", agent),
                        ("task", task),
                        ("message", message),
                        ("artifact", artifact),
                        ("attributes", attributes),
                    ] {
                        if let Some(v) = v {
                            m.insert(k.into(), v);
                        }
                    }
                    Value::Object(m)
                },
            )
    }

    fn check_invariants(v: &Value) -> Result<(), TestCaseError> {
        let limits = AdapterLimits::default();
        let strict = convert(v, 0, AdapterMode::Strict, &limits);
        let lenient = convert(v, 0, AdapterMode::Lenient, &limits);
        for c in [&strict, &lenient].into_iter().flatten() {
            let handoff = &c.payload["handoff"];
            prop_assert_eq!(c.handoff_visible, handoff["visible"] == Value::Bool(true));
            prop_assert_eq!(&c.handoff_digest, &digest(handoff));
            prop_assert_eq!(&c.discovery_digest, &digest(&c.payload["discovery"]));
            if c.handoff_visible {
                prop_assert_eq!(c.event_type.as_str(), EVENT_TASK_REQUESTED);
                prop_assert_eq!(&c.payload["task"]["kind"], &Value::from("delegation"));
                prop_assert_eq!(&handoff["source_kind"], &Value::from("typed_payload"));
                if handoff["task_ref_visible"] == Value::Bool(true) {
                    prop_assert!(v["task"]["id"].is_string());
                }
            } else {
                prop_assert_eq!(c.handoff_digest.as_str(), DEFAULT_HANDOFF_DIGEST);
            }
        }
        // strict success means nothing was substituted, so lenient emits the same bytes
        if let Ok(s) = &strict {
            match &lenient {
                Ok(l) => prop_assert_eq!(s.payload.to_string(), l.payload.to_string()),
                Err(e) => prop_assert!(false, "strict ok but lenient failed: {}", e),
            }
        }
        // the checks shared by both modes fail the same way in both
        if let Err(e) = &lenient {
            prop_assert_eq!(
                strict.as_ref().err().map(AdapterError::kind),
                Some(e.kind())
            );
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn convert_never_panics_and_visibility_needs_the_typed_rule(v in arb_json()) {
            check_invariants(&v)?;
        }

        #[test]
        fn a2a_shaped_packets_keep_the_handoff_invariants(v in arb_packet()) {
            check_invariants(&v)?;
        }
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

    fn render_golden(raw: &[u8], mode: AdapterMode) -> String {
        let value = match convert_bytes(raw, mode, &AdapterLimits::default()) {
            Ok(c) => with_version(c.payload, "<version>"),
            Err(e) => json!({ "error": e.kind() }),
        };
        let mut text = serde_json::to_string_pretty(&value).expect("serializes");
        text.push('\n');
        text
    }

    /// Diffs every input against its hand-written `X.<mode>.expected.json`; with
    /// `UPDATE_GOLDEN=1` rewrites them instead (review the diff before committing).
    #[test]
    fn golden_files_match_byte_for_byte() {
        let inputs = fixture_inputs();
        assert_eq!(
            inputs.len(),
            9,
            "expected the 9 ADR-026 packets in {FIXTURES}"
        );
        let mut failures = Vec::new();
        for input in &inputs {
            let raw = std::fs::read(input).expect("input readable");
            let stem = input
                .file_stem()
                .and_then(|s| s.to_str())
                .expect("utf-8 name");
            for mode in [AdapterMode::Lenient, AdapterMode::Strict] {
                let expected_path =
                    Path::new(FIXTURES).join(format!("{stem}.{mode}.expected.json"));
                failures.extend(crate::golden::check(
                    &expected_path,
                    &render_golden(&raw, mode),
                ));
            }
        }
        assert!(
            failures.is_empty(),
            "golden mismatch (UPDATE_GOLDEN=1 regenerates; check the rules first):\n{}",
            failures.join("\n")
        );
    }
}
