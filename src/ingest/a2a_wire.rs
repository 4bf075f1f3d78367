//! A2A wire traffic (docs/contract.md sections 2 format 4, and 2a): the JSON-RPC bodies of A2A v0.3 and
//! v1.0, and v1.0's HTTP+JSON bodies, as a relay publishes them (request, response, each SSE
//! frame, push-notification bodies).
//!
//! Each body is translated into the collaboration events the rest of the pipeline already
//! knows, so one turn mechanism serves both: a send request becomes the turn's `a2a.send`; an
//! agent `Message`, or a Task / status update reaching `completed`, `input-required` or
//! `auth-required`, its `a2a.response`; `failed` / `rejected` / `canceled` a response carrying
//! `outcome: "failed"` (blocked, reason `error`); a JSON-RPC error a response carrying `error`
//! (blocked `error`; `-32001` TaskNotFound also `notFound: true`, blocked `not_found`). Intermediate frames become task
//! progress (`task.updated`, `task.artifact`) in `orchestration.task`, and other methods
//! (`tasks/get`, `GetTask`, cancel, list, push configs, agent cards) are projected by rule
//! without a turn.
//!
//! Identity: the turn's conversation key is the subject key (the relay keys an exchange by the
//! request's `contextId`, else by an id of its own), and every body of the exchange takes the
//! conversation and work session that key names, whatever `contextId` its answers reveal; its
//! turn id is `Collab-Exchange`, else the JSON-RPC `id`. Bodies with neither (push notifications, HTTP+JSON bodies published without
//! the relay's headers) answer no turn: they are projected as task progress.

use super::input::RelayHeaders;
use crate::model::{decode_id, encode_id, id_text, DlqReason, Rejection};
use serde_json::{Map, Value};

/// JSON-RPC code of A2A's TaskNotFoundError.
const TASK_NOT_FOUND: i64 = -32001;

/// Which A2A wire style a body is written in, as far as it shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    /// `kind` discriminators, kebab-case states, `message/send`.
    V03,
    /// Member-name wrappers, `TASK_STATE_*` / `ROLE_*` enums, PascalCase methods.
    V10,
    /// Nothing in the body tells them apart (e.g. a bare JSON-RPC error).
    Unknown,
}

impl Version {
    fn as_str(self) -> &'static str {
        match self {
            Version::V03 => "0.3",
            Version::V10 => "1.0",
            Version::Unknown => "unknown",
        }
    }
}

/// What a method is to the turn contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MethodKind {
    /// Opens a turn.
    Send,
    /// Projected by rule, without a turn; the event type of its request.
    Other(&'static str),
}

/// The JSON-RPC methods A2A defines, v0.3 and v1.0 names.
const METHODS: [&str; 22] = [
    "message/send",
    "message/stream",
    "tasks/get",
    "tasks/list",
    "tasks/cancel",
    "tasks/resubscribe",
    "tasks/pushNotificationConfig/set",
    "tasks/pushNotificationConfig/get",
    "tasks/pushNotificationConfig/list",
    "tasks/pushNotificationConfig/delete",
    "agent/getAuthenticatedExtendedCard",
    "SendMessage",
    "SendStreamingMessage",
    "GetTask",
    "ListTasks",
    "CancelTask",
    "SubscribeToTask",
    "CreateTaskPushNotificationConfig",
    "GetTaskPushNotificationConfig",
    "ListTaskPushNotificationConfigs",
    "DeleteTaskPushNotificationConfig",
    "GetExtendedAgentCard",
];

/// An A2A JSON-RPC method by its own (static) name; `None` for a method A2A does not define.
pub fn known_method(method: &str) -> Option<&'static str> {
    METHODS.iter().find(|m| **m == method).copied()
}

/// The methods A2A defines (both styles; HTTP+JSON bodies carry the v1.0 name in
/// `Collab-A2A-Method`). Unknown methods are projected as `agent.rpc`.
fn method_kind(method: &str) -> MethodKind {
    match method {
        "message/send" | "message/stream" | "SendMessage" | "SendStreamingMessage" => {
            MethodKind::Send
        }
        "tasks/get" | "GetTask" => MethodKind::Other("task.get"),
        "tasks/list" | "ListTasks" => MethodKind::Other("task.list"),
        "tasks/cancel" | "CancelTask" => MethodKind::Other("task.cancel"),
        "tasks/resubscribe" | "SubscribeToTask" => MethodKind::Other("task.subscribe"),
        m if m.starts_with("tasks/pushNotificationConfig/")
            || m.ends_with("TaskPushNotificationConfig")
            || m.ends_with("TaskPushNotificationConfigs") =>
        {
            MethodKind::Other("task.push_config")
        }
        "agent/getAuthenticatedExtendedCard" | "GetExtendedAgentCard" | "GetAgentCard" => {
            MethodKind::Other("agent.card")
        }
        _ => MethodKind::Other("agent.rpc"),
    }
}

/// Whether a body is A2A wire traffic: a JSON-RPC 2.0 body, or any body published on an
/// `a2a.wire` subject or with the relay's `Collab-A2A-Method` header.
pub fn is_wire(obj: &Map<String, Value>, type_suffix: Option<&str>, relay: &RelayHeaders) -> bool {
    obj.contains_key("jsonrpc")
        || relay.a2a_method.is_some()
        || type_suffix.is_some_and(|t| t == "a2a.wire" || t.starts_with("a2a.wire."))
}

/// Translate one wire body into collaboration events (seed 000 shape, fields at the top level).
/// `key` is the subject key the body was published under (the exchange's; `None` offline).
pub fn translate(
    obj: &Map<String, Value>,
    key: Option<&str>,
    relay: &RelayHeaders,
) -> Result<Map<String, Value>, Rejection> {
    refuse_legacy(obj)?;
    let ids = ExchangeIds::of(obj, relay);
    let mut out = Translation::default();
    if let Some(id) = &ids.jsonrpc_id {
        out.a2a.insert("jsonrpcId".into(), id.clone());
    }
    if let Some(m) = &ids.method {
        out.a2a.insert("method".into(), Value::String(m.clone()));
    }
    let version = if is_request(obj, relay)? {
        let version = out.request(obj, &ids);
        sides(&mut out.ev, relay, false);
        version
    } else {
        let version = out.answer(obj, &ids);
        sides(&mut out.ev, relay, true);
        version
    };
    Ok(out.finish(version, key, ids.turn))
}

/// A body in a pre-0.2 shape is dead-lettered with the shape named.
fn refuse_legacy(obj: &Map<String, Value>) -> Result<(), Rejection> {
    match legacy_shape(obj) {
        Some(shape) => Err(Rejection::new(
            DlqReason::Unrecognized,
            format!(
                "A2A body in a pre-0.2 shape ({shape}); upgrade the agent or its SDK to A2A 0.3 or 1.0, whose bodies are projected"
            ),
        )),
        None => Ok(()),
    }
}

/// What ties a body to its exchange.
struct ExchangeIds {
    /// A JSON-RPC body's `id` (a bare Task's `id` is the task's, never the request's).
    jsonrpc_id: Option<Value>,
    /// The turn: `Collab-Exchange`, else the JSON-RPC `id`.
    turn: Option<String>,
    /// The body's `method`, else the relay's `Collab-A2A-Method`.
    method: Option<String>,
}

impl ExchangeIds {
    fn of(obj: &Map<String, Value>, relay: &RelayHeaders) -> ExchangeIds {
        let jsonrpc_id = obj
            .get("id")
            .filter(|v| !v.is_null() && obj.contains_key("jsonrpc"))
            .cloned();
        let turn = relay
            .exchange
            .clone()
            .or_else(|| jsonrpc_id.as_ref().and_then(id_text));
        let method = obj
            .get("method")
            .and_then(Value::as_str)
            .map(str::to_string)
            .or_else(|| relay.a2a_method.clone());
        ExchangeIds {
            jsonrpc_id,
            turn,
            method,
        }
    }

    /// Whether an answer answers a send (an answer without a method counts as one).
    fn answers_send(&self) -> bool {
        self.method
            .as_deref()
            .is_none_or(|m| matches!(method_kind(m), MethodKind::Send))
    }

    /// Whether an answer can decide a turn: it answers a send of a known exchange.
    fn in_turn(&self) -> bool {
        self.answers_send() && self.turn.is_some()
    }
}

/// Which side spoke. A relay says so (`Collab-Direction`); the body's shape decides only without
/// it, and a body the relay marks as the caller's is never the agent's reply.
fn is_request(obj: &Map<String, Value>, relay: &RelayHeaders) -> Result<bool, Rejection> {
    let shaped_as_request = if obj.contains_key("jsonrpc") {
        obj.contains_key("method")
    } else {
        is_rest_request(obj)
    };
    match relay.direction.as_deref() {
        None => Ok(shaped_as_request),
        Some(RelayHeaders::DIRECTION_ANSWER) => Ok(false),
        Some(RelayHeaders::DIRECTION_REQUEST)
            if obj.contains_key("jsonrpc") && !shaped_as_request =>
        {
            Err(Rejection::new(
                DlqReason::Unrecognized,
                "the relay published this body as the caller's request (Collab-Direction: request), but it is a JSON-RPC body without `method`, shaped like an answer; it is not projected as the agent's reply. A JSON-RPC request names its method",
            ))
        }
        Some(RelayHeaders::DIRECTION_REQUEST) => Ok(true),
        Some(other) => Err(Rejection::new(
            DlqReason::Unrecognized,
            format!(
                "Collab-Direction is {other:?}; a relay sets \"request\" on the caller's body and \"answer\" on the agent's"
            ),
        )),
    }
}

/// The event being built (`ev`) and its `payload.a2a` section.
#[derive(Default)]
struct Translation {
    ev: Map<String, Value>,
    a2a: Map<String, Value>,
}

impl Translation {
    /// A caller's request: a send opens a turn; any other method is projected by rule.
    fn request(&mut self, obj: &Map<String, Value>, ids: &ExchangeIds) -> Version {
        let params = if obj.contains_key("jsonrpc") {
            obj.get("params").and_then(Value::as_object)
        } else {
            Some(obj)
        };
        let method_name = ids.method.as_deref().unwrap_or("SendMessage");
        let kind = method_kind(method_name);
        if let Some(m) = params
            .and_then(|p| p.get("message"))
            .and_then(Value::as_object)
        {
            copy_ids(m, &mut self.ev);
            let text = text_of(m.get("parts"));
            if !text.is_empty() {
                self.ev.insert("message".into(), Value::String(text));
            }
        }
        if let Some(ctx) = params
            .and_then(|p| p.get("contextId"))
            .filter(|v| v.is_string())
        {
            self.ev.entry("contextId").or_insert_with(|| ctx.clone());
        }
        if let Some(task) = params.and_then(|p| p.get("id").or_else(|| p.get("taskId"))) {
            if task.is_string() && !matches!(kind, MethodKind::Send) {
                self.ev.insert("taskId".into(), task.clone());
            }
        }
        let event_type = match kind {
            MethodKind::Send => "a2a.send",
            MethodKind::Other(t) => t,
        };
        self.ev
            .insert("type".into(), Value::String(event_type.into()));
        if let Some(p) = params {
            self.a2a.insert("params".into(), Value::Object(p.clone()));
        }
        version_of_method(method_name)
            .or_else(|| params.map(version_in))
            .unwrap_or(Version::Unknown)
    }

    /// The agent's answer: an error, a Task / Message / update, or another method's result.
    fn answer(&mut self, obj: &Map<String, Value>, ids: &ExchangeIds) -> Version {
        let (event_type, version) = match answer_of(obj) {
            Answer::Error(err) => {
                let version = obj.get("error").map(version_of).unwrap_or(Version::Unknown);
                (self.answer_error(err, ids), version)
            }
            Answer::Item {
                kind,
                item,
                version,
            } => (self.answer_item(kind, &item, ids), version),
            Answer::Other(v) => {
                let version = version_of(&v);
                self.a2a.insert("result".into(), v);
                (other_result_type(ids.method.as_deref()), version)
            }
        };
        self.ev
            .insert("type".into(), Value::String(event_type.into()));
        version
    }

    /// An error answering a send is the agent's answer to it: a failure response, normalised
    /// into the blocked outcome (not synthesised). Answering anything else, it is task news.
    fn answer_error(&mut self, err: Map<String, Value>, ids: &ExchangeIds) -> &'static str {
        let code = err.get("code").and_then(Value::as_i64);
        let message = err
            .get("message")
            .or_else(|| err.get("title"))
            .or_else(|| err.get("detail"))
            .and_then(Value::as_str)
            .unwrap_or("error");
        let not_found = code == Some(TASK_NOT_FOUND) || rest_not_found(&err);
        self.ev.insert(
            "error".into(),
            Value::String(match code {
                Some(c) => format!("A2A error {c}: {message}"),
                None => format!("A2A error: {message}"),
            }),
        );
        if not_found {
            self.ev.insert("notFound".into(), Value::Bool(true));
        }
        self.a2a.insert("error".into(), Value::Object(err));
        if ids.in_turn() {
            "a2a.response"
        } else {
            "task.error"
        }
    }

    /// A Task, Message or update: its ids, time, text and state, then the event it stands for.
    fn answer_item(
        &mut self,
        kind: ItemKind,
        item: &Map<String, Value>,
        ids: &ExchangeIds,
    ) -> &'static str {
        copy_ids(item, &mut self.ev);
        if kind == ItemKind::Task {
            if let Some(id) = item.get("id").filter(|v| v.is_string()) {
                self.ev.insert("taskId".into(), id.clone());
            }
        }
        // The status's own `timestamp` stays in `payload.a2a`: it is the agent's clock, and a
        // relay publishes a request only once the agent accepted it, so the agent's times can
        // precede its request's. Wire events take the raw stream's time, in publishing order.
        let state = item
            .get("status")
            .and_then(|s| s.get("state"))
            .and_then(Value::as_str)
            .map(normal_state);
        let text = item_text(item);
        if let Some(t) = &text {
            self.ev.insert("message".into(), Value::String(t.clone()));
        }
        if let Some(s) = &state {
            self.ev.insert("state".into(), Value::String(s.clone()));
            self.a2a.insert("state".into(), Value::String(s.clone()));
        }
        self.a2a
            .insert("kind".into(), Value::String(kind.as_str().into()));
        self.a2a
            .insert(kind.as_str().into(), Value::Object(item.clone()));
        let role = item.get("role").and_then(Value::as_str).map(normal_role);
        self.item_event(kind, state.as_deref(), role.as_deref(), text, ids)
    }

    /// What a Task, Message or update is to the turn: the response (a reply, an interruption or
    /// a failure) when it answers a send of a known exchange, else task progress.
    fn item_event(
        &mut self,
        kind: ItemKind,
        state: Option<&str>,
        role: Option<&str>,
        text: Option<String>,
        ids: &ExchangeIds,
    ) -> &'static str {
        let in_turn = ids.in_turn();
        match (kind, state, role) {
            (ItemKind::Message, _, Some("user")) => "task.message",
            (ItemKind::Message, _, _) if in_turn => "a2a.response",
            (ItemKind::Message, _, _) => "task.message",
            (
                ItemKind::Task | ItemKind::StatusUpdate,
                Some(s @ ("completed" | "input-required" | "auth-required")),
                _,
            ) if in_turn => {
                if s != "completed" {
                    self.ev.insert("interrupted".into(), Value::Bool(true));
                }
                "a2a.response"
            }
            (
                ItemKind::Task | ItemKind::StatusUpdate,
                Some(s @ ("failed" | "rejected" | "canceled")),
                _,
            ) if in_turn => {
                self.ev
                    .insert("outcome".into(), Value::String("failed".into()));
                let why = text.unwrap_or_else(|| format!("task {s}"));
                self.ev
                    .insert("error".into(), Value::String(format!("task {s}: {why}")));
                "a2a.response"
            }
            (ItemKind::ArtifactUpdate, _, _) => "task.artifact",
            (ItemKind::Task, _, _) if !ids.answers_send() => "task.snapshot",
            _ => "task.updated",
        }
    }

    /// The ids every event of the exchange shares, then the event.
    fn finish(
        mut self,
        version: Version,
        key: Option<&str>,
        turn: Option<String>,
    ) -> Map<String, Value> {
        self.a2a
            .insert("version".into(), Value::String(version.as_str().into()));
        let conversation = conversation_of(key, &self.ev);
        // One exchange is one work session too: its request carries no context when the caller
        // starts one, and its answers carry the context the agent chose.
        self.ev
            .insert("workSessionId".into(), Value::String(conversation.clone()));
        self.ev
            .insert("conversationId".into(), Value::String(conversation));
        if let Some(t) = turn {
            self.ev.insert("turnId".into(), Value::String(t));
        }
        self.ev.insert("a2a".into(), Value::Object(self.a2a));
        self.ev
    }
}

/// The conversation of a wire body: the exchange's, so its request, answer, frames and any
/// outcome the processor synthesises share it. Published, that is the subject key the exchange
/// was keyed by (a relay keys it by the request's `contextId`, else by an id of its own), as the
/// id it encodes; a key too long to decode (a hash) stands for itself, since a body of the
/// exchange that carries no context (an error) can name nothing else. Offline (no subject), the
/// key is [`offline_key`], read the same way, so a body gives the same conversation either way.
fn conversation_of(key: Option<&str>, ev: &Map<String, Value>) -> String {
    let key = key.map_or_else(|| offline_key(ev), str::to_string);
    decode_id(&key).unwrap_or(key)
}

/// The key a translated wire body is given offline (no subject), as a relay keys its exchange:
/// its `contextId`, encoded as a subject token, else the placeholder `_`. Published under that
/// key, the body gives the same envelope.
pub(super) fn offline_key(ev: &Map<String, Value>) -> String {
    ev.get("contextId")
        .and_then(id_text)
        .map_or_else(|| "_".to_string(), |c| encode_id(&c))
}

/// The text of a Task, Message or update: its own parts, else its status message, else its
/// artifacts.
fn item_text(item: &Map<String, Value>) -> Option<String> {
    let own_text = text_of(item.get("parts"));
    let status_text = item
        .get("status")
        .and_then(|s| s.get("message"))
        .and_then(|m| m.get("parts"))
        .map(|p| text_of(Some(p)))
        .unwrap_or_default();
    [own_text, status_text, artifacts_text(item)]
        .into_iter()
        .find(|t| !t.is_empty())
}

/// The event type of a result that is not a Task, Message or update, by the method it answers.
fn other_result_type(method: Option<&str>) -> &'static str {
    match method.map(method_kind) {
        Some(MethodKind::Other("agent.card")) => "agent.card",
        Some(MethodKind::Other("task.list")) => "task.list.result",
        Some(MethodKind::Other("task.push_config")) => "task.push_config.result",
        _ => "agent.rpc.result",
    }
}

/// The agents of the exchange from the relay's headers. An answer speaks from the callee.
fn sides(ev: &mut Map<String, Value>, relay: &RelayHeaders, answer: bool) {
    let (from, to) = if answer {
        (&relay.to_agent, &relay.from_agent)
    } else {
        (&relay.from_agent, &relay.to_agent)
    };
    if let Some(f) = from {
        ev.insert("fromAgent".into(), Value::String(f.clone()));
        ev.insert("agentId".into(), Value::String(f.clone()));
    }
    if let Some(t) = to {
        ev.insert("toAgent".into(), Value::String(t.clone()));
    }
}

/// Message, task and context ids of a Message / Task / update object.
fn copy_ids(obj: &Map<String, Value>, ev: &mut Map<String, Value>) {
    for k in ["messageId", "taskId", "contextId"] {
        if let Some(v) = obj.get(k).filter(|v| v.is_string()) {
            ev.insert(k.into(), v.clone());
        }
    }
}

/// The text parts of a `parts` array, joined by new lines (v0.3 `{kind: "text", text}`, v1.0
/// `{text}`); file and data parts have no text.
fn text_of(parts: Option<&Value>) -> String {
    let Some(Value::Array(parts)) = parts else {
        return String::new();
    };
    parts
        .iter()
        .filter(|p| p.get("kind").is_none_or(|k| k == "text"))
        .filter_map(|p| p.get("text").and_then(Value::as_str))
        .collect::<Vec<_>>()
        .join("\n")
}

fn artifacts_text(item: &Map<String, Value>) -> String {
    let single = item.get("artifact").map(|a| vec![a.clone()]);
    let list = item.get("artifacts").and_then(Value::as_array).cloned();
    single
        .or(list)
        .unwrap_or_default()
        .iter()
        .map(|a| text_of(a.get("parts")))
        .filter(|t| !t.is_empty())
        .collect::<Vec<_>>()
        .join("\n")
}

/// `TASK_STATE_INPUT_REQUIRED` and `input-required` alike -> `input-required`.
fn normal_state(s: &str) -> String {
    let s = s.strip_prefix("TASK_STATE_").unwrap_or(s);
    let s = s.to_ascii_lowercase().replace('_', "-");
    if s == "cancelled" {
        "canceled".into()
    } else {
        s
    }
}

/// `ROLE_AGENT` and `agent` alike -> `agent`.
fn normal_role(s: &str) -> String {
    s.strip_prefix("ROLE_").unwrap_or(s).to_ascii_lowercase()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ItemKind {
    Task,
    Message,
    StatusUpdate,
    ArtifactUpdate,
}

impl ItemKind {
    fn as_str(self) -> &'static str {
        match self {
            ItemKind::Task => "task",
            ItemKind::Message => "message",
            ItemKind::StatusUpdate => "statusUpdate",
            ItemKind::ArtifactUpdate => "artifactUpdate",
        }
    }
}

/// What an answer carries.
enum Answer {
    /// A JSON-RPC error object, or an HTTP+JSON error body.
    Error(Map<String, Value>),
    /// A Task, Message or update.
    Item {
        kind: ItemKind,
        item: Map<String, Value>,
        version: Version,
    },
    /// Anything else (an agent card, a task list, a push configuration).
    Other(Value),
}

fn answer_of(obj: &Map<String, Value>) -> Answer {
    if obj.contains_key("jsonrpc") {
        if let Some(Value::Object(err)) = obj.get("error") {
            return Answer::Error(err.clone());
        }
        return match obj.get("result") {
            Some(Value::Object(r)) => item_of(r),
            Some(other) => Answer::Other(other.clone()),
            None => Answer::Other(Value::Null),
        };
    }
    // HTTP+JSON: google.rpc.Status style `{error: {...}}`, or RFC 9457 problem details.
    if let Some(Value::Object(err)) = obj.get("error") {
        return Answer::Error(err.clone());
    }
    let numeric_status = obj.get("status").is_some_and(Value::is_number);
    if numeric_status && (obj.contains_key("detail") || obj.contains_key("title")) {
        return Answer::Error(obj.clone());
    }
    item_of(obj)
}

fn item_of(r: &Map<String, Value>) -> Answer {
    // v0.3: the object itself, told apart by `kind`.
    if let Some(kind) = r.get("kind").and_then(Value::as_str) {
        let k = match kind {
            "task" => Some(ItemKind::Task),
            "message" => Some(ItemKind::Message),
            "status-update" => Some(ItemKind::StatusUpdate),
            "artifact-update" => Some(ItemKind::ArtifactUpdate),
            _ => None,
        };
        if let Some(kind) = k {
            return Answer::Item {
                kind,
                item: r.clone(),
                version: Version::V03,
            };
        }
    }
    // v1.0: a member-name wrapper.
    for (name, kind) in [
        ("task", ItemKind::Task),
        ("message", ItemKind::Message),
        ("statusUpdate", ItemKind::StatusUpdate),
        ("artifactUpdate", ItemKind::ArtifactUpdate),
    ] {
        if let Some(Value::Object(item)) = r.get(name) {
            return Answer::Item {
                kind,
                item: item.clone(),
                version: Version::V10,
            };
        }
    }
    // A bare Task (v1.0 GetTask over HTTP+JSON) or Message.
    if r.contains_key("status") && r.contains_key("id") {
        return Answer::Item {
            kind: ItemKind::Task,
            item: r.clone(),
            version: version_in(r),
        };
    }
    if r.contains_key("parts") && r.contains_key("role") {
        return Answer::Item {
            kind: ItemKind::Message,
            item: r.clone(),
            version: version_in(r),
        };
    }
    Answer::Other(Value::Object(r.clone()))
}

/// An HTTP+JSON body that is a request: a send (`message` from the user) or a task query body.
fn is_rest_request(obj: &Map<String, Value>) -> bool {
    obj.get("message")
        .and_then(|m| m.get("role"))
        .and_then(Value::as_str)
        .is_some_and(|r| normal_role(r) == "user")
}

/// Whether an HTTP+JSON error says "task not found".
fn rest_not_found(err: &Map<String, Value>) -> bool {
    let mut stack: Vec<&Value> = err.values().collect();
    while let Some(v) = stack.pop() {
        match v {
            Value::String(t) if t.contains("TASK_NOT_FOUND") || t.contains("TaskNotFound") => {
                return true
            }
            Value::Object(m) => stack.extend(m.values()),
            Value::Array(items) => stack.extend(items),
            _ => {}
        }
    }
    false
}

fn version_of_method(method: &str) -> Option<Version> {
    if method.contains('/') {
        Some(Version::V03)
    } else if method
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_uppercase())
    {
        Some(Version::V10)
    } else {
        None
    }
}

/// The wire style a value shows: `kind` discriminators (v0.3), or `TASK_STATE_` / `ROLE_`
/// enums and member-name wrappers (v1.0).
fn version_of(v: &Value) -> Version {
    version_scan(vec![(None, v)])
}

/// [`version_of`] an object, without copying it into a value.
fn version_in(m: &Map<String, Value>) -> Version {
    version_scan(m.iter().map(|(k, v)| (Some(k.as_str()), v)).collect())
}

/// A walk over member names and values (no copy, no printing): any `kind` member is v0.3;
/// otherwise a `TASK_STATE_` / `ROLE_` text or a `statusUpdate` / `artifactUpdate` name or
/// value is v1.0.
fn version_scan<'a>(mut stack: Vec<(Option<&'a str>, &'a Value)>) -> Version {
    let v10_text = |t: &str| {
        t.contains("TASK_STATE_")
            || t.contains("ROLE_")
            || t == "statusUpdate"
            || t == "artifactUpdate"
    };
    let mut v10 = false;
    while let Some((key, v)) = stack.pop() {
        if let Some(k) = key {
            if k == "kind" {
                return Version::V03;
            }
            v10 |= v10_text(k);
        }
        match v {
            Value::Object(m) => stack.extend(m.iter().map(|(k, c)| (Some(k.as_str()), c))),
            Value::Array(items) => stack.extend(items.iter().map(|c| (None, c))),
            Value::String(t) => v10 |= v10_text(t),
            _ => {}
        }
    }
    if v10 {
        Version::V10
    } else {
        Version::Unknown
    }
}

/// The pre-0.2 shape a body is in, if any: `sessionId` where A2A now has `contextId`, or
/// parts typed with `type` where 0.2+ has `kind` (0.3) or member names (1.0).
fn legacy_shape(obj: &Map<String, Value>) -> Option<&'static str> {
    let mut stack: Vec<(&Value, usize)> = obj.values().map(|v| (v, 1)).collect();
    while let Some((v, depth)) = stack.pop() {
        if depth > 8 {
            continue;
        }
        match v {
            Value::Object(m) => {
                let looks_like_task_or_message = m.contains_key("parts")
                    || m.contains_key("status")
                    || m.contains_key("message");
                if looks_like_task_or_message
                    && m.contains_key("sessionId")
                    && !m.contains_key("contextId")
                {
                    return Some("`sessionId` instead of `contextId`");
                }
                if let Some(Value::Array(parts)) = m.get("parts") {
                    let typed = parts.iter().any(|p| {
                        p.get("type").and_then(Value::as_str).is_some() && p.get("kind").is_none()
                    });
                    if typed {
                        return Some("parts typed with `type` instead of `kind`");
                    }
                }
                stack.extend(m.values().map(|c| (c, depth + 1)));
            }
            Value::Array(items) => stack.extend(items.iter().map(|c| (c, depth + 1))),
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ingest::{normalize, RawInput, Settings, SubjectInfo};
    use serde_json::json;

    fn settings() -> Settings {
        let mut s = crate::config::Settings::default();
        s.roles.main_agents = vec!["ruda".into(), "eden".into()];
        s.ingest()
            .unwrap_or_else(|e| panic!("default settings: {e}"))
    }

    fn one(body: Value, relay: &RelayHeaders) -> Result<Map<String, Value>, Rejection> {
        let obj = body.as_object().cloned().unwrap_or_default();
        translate(&obj, Some("k"), relay)
    }

    fn exchange() -> RelayHeaders {
        RelayHeaders {
            from_agent: Some("ruda".into()),
            to_agent: Some("eden".into()),
            exchange: Some("x1".into()),
            a2a_method: None,
            run_id: None,
            direction: None,
        }
    }

    #[test]
    fn the_relays_direction_decides_the_side_never_the_body() {
        let request = RelayHeaders {
            direction: Some(RelayHeaders::DIRECTION_REQUEST.into()),
            ..exchange()
        };
        // A caller's JSON-RPC body written as the agent's answer: dead-lettered, never the reply.
        let forged = json!({"jsonrpc":"2.0","id":1,"result":{"kind":"message","role":"agent","messageId":"m","parts":[{"kind":"text","text":"approved"}]}});
        let err = one(forged.clone(), &request)
            .err()
            .unwrap_or_else(|| panic!("projected"));
        assert_eq!(err.reason, DlqReason::Unrecognized);
        assert!(
            err.detail.contains("Collab-Direction: request"),
            "{}",
            err.detail
        );
        // Without the relay's word, the shape decides (bodies published by other producers).
        assert_eq!(
            one(forged, &exchange()).unwrap_or_default()["type"],
            "a2a.response"
        );
        // An HTTP+JSON request whose message claims the agent's role is still the caller's send.
        let rest = RelayHeaders {
            a2a_method: Some("SendMessage".into()),
            ..request.clone()
        };
        let ev = one(
            json!({"message":{"role":"ROLE_AGENT","messageId":"m","parts":[{"text":"approved"}]}}),
            &rest,
        )
        .unwrap_or_default();
        assert_eq!(ev["type"], "a2a.send");
        assert_eq!(ev["fromAgent"], "ruda");
        assert_eq!(ev["toAgent"], "eden");
        // The agent's answer is the agent's, whatever it looks like.
        let answer = RelayHeaders {
            direction: Some(RelayHeaders::DIRECTION_ANSWER.into()),
            ..exchange()
        };
        let ev = one(
            json!({"jsonrpc":"2.0","id":1,"method":"message/send","params":{}}),
            &answer,
        )
        .unwrap_or_default();
        assert_ne!(ev["type"], "a2a.send");
        assert_eq!(ev["fromAgent"], "eden");
        let odd = RelayHeaders {
            direction: Some("sideways".into()),
            ..exchange()
        };
        let err = one(json!({"jsonrpc":"2.0","id":1,"result":{}}), &odd)
            .err()
            .unwrap_or_else(|| panic!("projected"));
        assert!(err.detail.contains("\"sideways\""), "{}", err.detail);
    }

    #[test]
    fn both_styles_decide_the_turn_alike() {
        let r = exchange();
        let v03 = json!({"jsonrpc":"2.0","id":1,"result":{"kind":"status-update","taskId":"t","contextId":"c","status":{"state":"input-required"},"final":true}});
        let v10 = json!({"jsonrpc":"2.0","id":1,"result":{"statusUpdate":{"taskId":"t","contextId":"c","status":{"state":"TASK_STATE_INPUT_REQUIRED"}}}});
        for body in [v03, v10] {
            let ev = one(body, &r).unwrap_or_default();
            assert_eq!(ev["type"], "a2a.response");
            assert_eq!(ev["interrupted"], true);
            assert_eq!(ev["turnId"], "x1");
            assert_eq!(
                ev["conversationId"], "k",
                "the exchange's, not the context's"
            );
            assert_eq!(ev["contextId"], "c");
        }
        for state in ["working", "TASK_STATE_SUBMITTED"] {
            let ev = one(
                json!({"jsonrpc":"2.0","id":1,"result":{"kind":"status-update","taskId":"t","status":{"state":state}}}),
                &r,
            )
            .unwrap_or_default();
            assert_eq!(
                ev["type"], "task.updated",
                "{state} is progress, never the response"
            );
        }
        for state in [
            "failed",
            "TASK_STATE_REJECTED",
            "canceled",
            "TASK_STATE_CANCELLED",
        ] {
            let ev = one(
                json!({"jsonrpc":"2.0","id":1,"result":{"task":{"id":"t","status":{"state":state}}}}),
                &r,
            )
            .unwrap_or_default();
            assert_eq!(ev["type"], "a2a.response");
            assert_eq!(ev["outcome"], "failed", "{state}");
        }
    }

    #[test]
    fn errors_are_blocked_and_task_not_found_is_not_found() {
        let r = exchange();
        let nf = one(
            json!({"jsonrpc":"2.0","id":1,"error":{"code":-32001,"message":"Task not found"}}),
            &r,
        )
        .unwrap_or_default();
        assert_eq!(nf["type"], "a2a.response");
        assert_eq!(nf["notFound"], true);
        let other = one(
            json!({"jsonrpc":"2.0","id":1,"error":{"code":-32603,"message":"boom"}}),
            &r,
        )
        .unwrap_or_default();
        assert_eq!(other["type"], "a2a.response");
        assert!(other.get("error").is_some());
        assert!(other.get("notFound").is_none());
    }

    #[test]
    fn answers_of_other_methods_open_no_turn() {
        let mut r = exchange();
        r.a2a_method = Some("tasks/get".into());
        let ev = one(
            json!({"jsonrpc":"2.0","id":1,"result":{"kind":"task","id":"t","status":{"state":"completed"}}}),
            &r,
        )
        .unwrap_or_default();
        assert_eq!(ev["type"], "task.snapshot");
        let req = one(
            json!({"jsonrpc":"2.0","id":2,"method":"tasks/get","params":{"id":"t"}}),
            &exchange(),
        )
        .unwrap_or_default();
        assert_eq!(req["type"], "task.get");
        assert_eq!(req["taskId"], "t");
    }

    #[test]
    fn a_body_without_an_exchange_or_id_answers_no_turn() {
        let ev = one(
            json!({"statusUpdate":{"taskId":"t","contextId":"c","status":{"state":"TASK_STATE_COMPLETED"}}}),
            &RelayHeaders::default(),
        )
        .unwrap_or_default();
        assert_eq!(ev["type"], "task.updated");
    }

    /// The envelope of a body published by a relay under `key`.
    fn projected(body: Value, key: &str, relay: &RelayHeaders) -> crate::model::Envelope {
        let bytes = serde_json::to_vec(&body).unwrap_or_default();
        let input = RawInput {
            bytes: &bytes,
            subject: Some(SubjectInfo {
                key: key.into(),
                type_suffix: "a2a.wire".into(),
            }),
            raw_ref: None,
            relay: relay.clone(),
        };
        let mut events = normalize(&input, &settings()).unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(events.len(), 1);
        events.remove(0).envelope
    }

    /// A caller that starts a conversation sends no `contextId`; the agent's answer and frames
    /// carry the one it chose. All of them are one conversation and one work session: the
    /// exchange's, which the relay keyed by its own id.
    #[test]
    fn an_exchange_is_one_conversation_whatever_context_its_answers_reveal() {
        let relay = |direction: &str| RelayHeaders {
            direction: Some(direction.into()),
            a2a_method: Some("message/stream".into()),
            ..exchange()
        };
        let key = "3f0c9a7e-5d1b-4c2a-9e8f-1a2b3c4d5e6f";
        let send = projected(
            json!({"jsonrpc":"2.0","id":1,"method":"message/stream","params":{"message":{"role":"user","messageId":"m1","parts":[{"kind":"text","text":"plan a trip"}]}}}),
            key,
            &relay(RelayHeaders::DIRECTION_REQUEST),
        );
        let frame = projected(
            json!({"jsonrpc":"2.0","id":1,"result":{"kind":"status-update","taskId":"t","contextId":"agent-ctx","status":{"state":"working"},"final":false}}),
            key,
            &relay(RelayHeaders::DIRECTION_ANSWER),
        );
        let answer = projected(
            json!({"jsonrpc":"2.0","id":1,"result":{"kind":"status-update","taskId":"t","contextId":"agent-ctx","status":{"state":"completed","message":{"role":"agent","messageId":"m2","parts":[{"kind":"text","text":"done"}]}},"final":true}}),
            key,
            &relay(RelayHeaders::DIRECTION_ANSWER),
        );
        assert_eq!(send.event_type, "a2a.send");
        assert_eq!(frame.event_type, "task.updated");
        assert_eq!(answer.event_type, "a2a.response");
        for env in [&send, &frame, &answer] {
            let keys = crate::sessions::keys(env);
            assert_eq!(keys.conversation_id.as_deref(), Some(key), "{env:?}");
            assert_eq!(keys.session_id(), Some(key), "{env:?}");
        }
        // The context the agent chose is still shown.
        let ctx = answer.payload.as_ref().and_then(|p| p.get("contextId"));
        assert_eq!(ctx, Some(&json!("agent-ctx")));
        // A context id that is not a subject token is keyed encoded; its conversation is the id.
        let odd = "ctx with spaces";
        let env = projected(
            json!({"jsonrpc":"2.0","id":1,"error":{"code":-32603,"message":"boom"}}),
            &crate::model::encode_id(odd),
            &relay(RelayHeaders::DIRECTION_ANSWER),
        );
        assert_eq!(
            crate::sessions::keys(&env).conversation_id.as_deref(),
            Some(odd)
        );
    }

    /// A context id too long to encode reversibly is keyed by its hash, and the hash is the
    /// conversation of every body of the exchange, offline as when published: a body that
    /// carries no context (an error) can name nothing else. Whatever the context id (one that
    /// looks encoded among them), a body offline is the conversation it is published as under
    /// the key it is given offline.
    #[test]
    fn a_context_keyed_by_its_hash_is_one_conversation_offline_and_published() {
        let relay = RelayHeaders {
            direction: Some(RelayHeaders::DIRECTION_ANSWER.into()),
            a2a_method: Some("message/stream".into()),
            ..exchange()
        };
        let update = |context: &str| json!({"jsonrpc":"2.0","id":1,"result":{"kind":"status-update","taskId":"t","contextId":context,"status":{"state":"working"},"final":false}});
        let offline = |body: &Value| {
            let obj = body.as_object().cloned().unwrap_or_default();
            let ev = translate(&obj, None, &relay).unwrap_or_else(|e| panic!("{e:?}"));
            ev.get("conversationId")
                .and_then(Value::as_str)
                .map(str::to_string)
        };
        let published = |body: Value, key: &str| {
            crate::sessions::keys(&projected(body, key, &relay)).conversation_id
        };
        let long = format!("ctx!{}", "w".repeat(120));
        let key = crate::model::encode_id(&long);
        assert!(key.starts_with("_h"), "{key}");
        assert_eq!(offline(&update(&long)).as_deref(), Some(key.as_str()));
        let error = json!({"jsonrpc":"2.0","id":1,"error":{"code":-32603,"message":"boom"}});
        assert_eq!(published(error, &key).as_deref(), Some(key.as_str()));
        for context in [
            long.as_str(),
            "ctx-9",
            "ctx with spaces",
            "_bYWJj",
            "_b",
            "_h00",
            "_x",
        ] {
            let body = update(context);
            let key = crate::model::encode_id(context);
            assert_eq!(offline(&body), published(body.clone(), &key), "{context:?}");
        }
    }

    #[test]
    fn legacy_shapes_are_named() {
        let e = one(
            json!({"jsonrpc":"2.0","id":1,"method":"tasks/send","params":{"id":"t","sessionId":"s","message":{"role":"user","parts":[{"type":"text","text":"hi"}]}}}),
            &exchange(),
        );
        let detail = e.err().map(|r| r.detail).unwrap_or_default();
        assert!(detail.contains("pre-0.2"), "{detail}");
    }
}
