//! A thread's projections assembled as people read them (pure): `GET /api/threads/{key}`.
//!
//! - **Runs** (AG-UI, runtime): each run with its text messages assembled from their streamed
//!   deltas (by `messageId`), its tool calls with their arguments assembled from
//!   `TOOL_CALL_ARGS` (by `toolCallId`) and their results, its steps, start, end, duration and
//!   outcome (`running` while it streams, `finished`, `waiting` on an interrupt, `failed`,
//!   `timed_out` when the run contract ended it).
//! - **Turns** (A2A, collaboration events): each turn's request and its one response in place,
//!   with who asked whom, when, and the outcome (`awaiting_reply`, `answered`, `waiting` when the
//!   answer asks for input or credentials, `blocked` with its reason).
//!
//! Assembly follows the protocols' ids, works on runs still streaming, and is bounded: at most
//! [`MAX_TEXT_BYTES`] of any message, arguments or result, [`MAX_ITEMS`] messages, tool calls
//! and steps per run, [`MAX_RUNS`] runs and [`MAX_TURNS`] turns per thread (the newest kept).

use crate::model::Envelope;
use crate::usage::{self, Prices, Usage};
use schemars::JsonSchema;
use serde::Serialize;
use serde_json::{Map, Value};
use std::collections::HashMap;

/// Bytes kept of one message's text, one call's arguments or result.
pub const MAX_TEXT_BYTES: usize = 64 * 1024;
/// Messages, tool calls and steps kept per run, each.
pub const MAX_ITEMS: usize = 500;
/// Runs and turns kept per thread (the newest).
pub const MAX_RUNS: usize = 200;
pub const MAX_TURNS: usize = 500;

/// One projected event of the thread, in stream order.
pub struct Stored<'a> {
    pub envelope: &'a Envelope,
    /// Its store time (RFC 3339), for events without a timestamp.
    pub stored_at: &'a str,
}

/// A thread, assembled.
#[derive(Debug, Clone, Default, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(deny_unknown_fields)]
pub struct ThreadView {
    /// The ordering key read (the conversation, AG-UI thread or session).
    pub key: String,
    /// Its runs, oldest first.
    pub runs: Vec<RunView>,
    /// Its turns, oldest first.
    pub turns: Vec<TurnView>,
    /// Events read.
    pub events: usize,
    /// Whether older events of the key exist that were not read (the newest are assembled).
    pub truncated: bool,
    /// The tokens of all its runs and turns, with their cost from the price table.
    pub total: crate::usage::UsageRollup,
}

/// Where a run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
#[schemars(rename = "RunViewOutcome")]
pub enum RunOutcome {
    Running,
    Finished,
    Waiting,
    Failed,
    TimedOut,
}

/// One run as a unit.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(deny_unknown_fields)]
pub struct RunView {
    pub run_id: String,
    /// The run that started it (AG-UI `parentRunId`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent_run_id: Option<String>,
    /// Its agent: `agentId`, else the agent whose NATS user published it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    pub outcome: RunOutcome,
    /// Why it failed (a `RUN_ERROR`'s message or code, `timeout`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// What it waits for (an interrupt's reason, else `input`) when `outcome` is `waiting`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waiting_for: Option<String>,
    /// Whom it waits on, when the interrupt names them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waiting_on: Option<String>,
    /// Event times (RFC 3339).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub started_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<i64>,
    pub messages: Vec<MessageView>,
    pub tool_calls: Vec<ToolCallView>,
    pub steps: Vec<StepView>,
    /// Tokens it reported (its own events and its `RUN_FINISHED` result).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageSummary>,
}

/// A text message assembled from its deltas.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(deny_unknown_fields)]
pub struct MessageView {
    pub message_id: String,
    /// Its author (`assistant`, `user`, ...), when given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    pub text: String,
    /// Whether its end (`TEXT_MESSAGE_END`) came.
    pub complete: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub started_at: Option<String>,
}

/// Where a tool call is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ToolStatus {
    Running,
    Completed,
    Failed,
    /// Its run ended before its result came.
    Unfinished,
}

/// A tool call with its arguments and result.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(deny_unknown_fields)]
pub struct ToolCallView {
    pub tool_call_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The arguments, assembled from the streamed deltas.
    pub arguments: String,
    /// Whether the arguments are complete (`TOOL_CALL_END`).
    pub arguments_complete: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
    pub status: ToolStatus,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub started_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<i64>,
}

/// A step of a run (`STEP_STARTED` .. `STEP_FINISHED`).
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(deny_unknown_fields)]
pub struct StepView {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub started_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<String>,
}

/// Where a turn is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
#[schemars(rename = "TurnViewOutcome")]
pub enum TurnOutcome {
    AwaitingReply,
    Answered,
    Waiting,
    Blocked,
}

/// A turn: its request and its one response, in place.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(deny_unknown_fields)]
pub struct TurnView {
    pub turn_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conversation_id: Option<String>,
    /// Who asked.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from_agent: Option<String>,
    /// Who was asked (and answers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub to_agent: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reply: Option<String>,
    pub outcome: TurnOutcome,
    /// A blocked turn's reason (`timeout`, `error`, `not_found`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// What a waiting answer asks for (`input`, `auth`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waiting_for: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sent_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub answered_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageSummary>,
}

/// Tokens, and their cost when the model has a price.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(deny_unknown_fields)]
pub struct UsageSummary {
    pub input_tokens: u64,
    pub output_tokens: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost: Option<f64>,
}

impl From<&UsageSummary> for usage::UsageRollup {
    fn from(s: &UsageSummary) -> usage::UsageRollup {
        usage::UsageRollup {
            input_tokens: s.input_tokens,
            output_tokens: s.output_tokens,
            cost: s.cost.unwrap_or(0.0),
            unpriced_tokens: if s.cost.is_some() {
                0
            } else {
                s.input_tokens.saturating_add(s.output_tokens)
            },
        }
    }
}

/// The usage of a whole thread: its runs' and turns' summed.
pub fn thread_total(t: &ThreadView) -> usage::UsageRollup {
    let mut total = usage::UsageRollup::default();
    for s in t
        .runs
        .iter()
        .filter_map(|r| r.usage.as_ref())
        .chain(t.turns.iter().filter_map(|t| t.usage.as_ref()))
    {
        total.add(&usage::UsageRollup::from(s));
    }
    total
}

fn summary(u: &Usage, prices: &Prices) -> UsageSummary {
    UsageSummary {
        input_tokens: u.input_tokens,
        output_tokens: u.output_tokens,
        model: u.model.clone(),
        cost: prices.cost(u),
    }
}

/// Assemble `events` (stream order) of the thread `key`.
pub fn assemble(key: &str, events: &[Stored<'_>], truncated: bool, prices: &Prices) -> ThreadView {
    let mut b = Builder::default();
    for e in events {
        b.observe(e);
    }
    let mut runs: Vec<RunView> = b.runs.into_iter().map(|(_, r)| r.finish(prices)).collect();
    runs.sort_by(|a, b| a.started_at.cmp(&b.started_at));
    let skip = runs.len().saturating_sub(MAX_RUNS);
    runs.drain(..skip);
    let mut turns: Vec<TurnView> = b.turns.into_iter().map(|t| t.finish(prices)).collect();
    let skip = turns.len().saturating_sub(MAX_TURNS);
    turns.drain(..skip);
    let mut view = ThreadView {
        key: key.to_string(),
        runs,
        turns,
        events: events.len(),
        truncated,
        total: Default::default(),
    };
    view.total = thread_total(&view);
    view
}

#[derive(Default)]
struct Builder {
    /// Runs in the order they were first seen, by id.
    runs: Vec<(String, RunBuild)>,
    run_index: HashMap<String, usize>,
    /// The runs opened and not ended, newest last: an event that names no run belongs to the
    /// newest.
    open: Vec<String>,
    turns: Vec<TurnBuild>,
    turn_index: HashMap<String, usize>,
}

struct RunBuild {
    view: RunView,
    usage: Option<Usage>,
    message_index: HashMap<String, usize>,
    tool_index: HashMap<String, usize>,
    start_ms: Option<i64>,
}

struct TurnBuild {
    view: TurnView,
    usage: Option<Usage>,
    sent_ms: Option<i64>,
}

impl Builder {
    fn observe(&mut self, e: &Stored<'_>) {
        let env = e.envelope;
        let at = env
            .timestamp
            .clone()
            .unwrap_or_else(|| e.stored_at.to_string());
        match env.event_type.as_str() {
            "a2a.send" => self.send(env, &at),
            "a2a.response" => self.response(env, &at),
            "run.started" => {
                if let Some(id) = id_text(env.run_id.as_ref()) {
                    let run = self.run(&id);
                    run.view.parent_run_id = text(payload(env), "parentRunId");
                    run.view.agent =
                        id_text(env.agent_id.as_ref()).or_else(|| env.publishing_agent());
                    run.view.started_at = Some(at.clone());
                    run.start_ms = ms(&at);
                    run.note_usage(env);
                    self.open.retain(|r| r != &id);
                    self.open.push(id);
                }
            }
            _ => {
                let Some(id) = id_text(env.run_id.as_ref()).or_else(|| self.open.last().cloned())
                else {
                    return;
                };
                let ended = matches!(env.event_type.as_str(), "run.finished" | "run.failed");
                self.run(&id).apply(env, &at);
                if ended {
                    self.open.retain(|r| r != &id);
                }
            }
        }
    }

    fn run(&mut self, id: &str) -> &mut RunBuild {
        let i = match self.run_index.get(id) {
            Some(i) => *i,
            None => {
                self.runs.push((id.to_string(), RunBuild::new(id)));
                self.run_index.insert(id.to_string(), self.runs.len() - 1);
                self.runs.len() - 1
            }
        };
        &mut self.runs[i].1
    }

    fn turn(&mut self, env: &Envelope) -> Option<&mut TurnBuild> {
        // docs/contract.md section 4: `turnId`, else `turn`, else `0`.
        let p = payload(env);
        let turn = crate::model::turn_id([
            env.turn_id.as_ref(),
            p.and_then(|p| p.get("turnId")),
            p.and_then(|p| p.get("turn")),
        ]);
        let conv = id_text(env.conversation_id.as_ref());
        let key = format!("{}\u{1f}{turn}", conv.as_deref().unwrap_or(""));
        let i = match self.turn_index.get(&key) {
            Some(i) => *i,
            None => {
                self.turns.push(TurnBuild {
                    view: TurnView {
                        turn_id: turn,
                        conversation_id: conv,
                        from_agent: None,
                        to_agent: None,
                        request: None,
                        reply: None,
                        outcome: TurnOutcome::AwaitingReply,
                        reason: None,
                        waiting_for: None,
                        sent_at: None,
                        answered_at: None,
                        duration_ms: None,
                        usage: None,
                    },
                    usage: None,
                    sent_ms: None,
                });
                self.turn_index.insert(key, self.turns.len() - 1);
                self.turns.len() - 1
            }
        };
        self.turns.get_mut(i)
    }

    fn send(&mut self, env: &Envelope, at: &str) {
        let p = payload(env);
        let Some(t) = self.turn(env) else { return };
        t.view.from_agent = text(p, "fromAgent").or_else(|| id_text(env.agent_id.as_ref()));
        t.view.to_agent = text(p, "toAgent");
        t.view.request = message(p);
        t.view.sent_at = Some(at.to_string());
        t.sent_ms = ms(at);
    }

    fn response(&mut self, env: &Envelope, at: &str) {
        let p = payload(env);
        let Some(t) = self.turn(env) else { return };
        if t.view.answered_at.is_some() {
            return;
        }
        let blocked = crate::facts::is_blocked(p);
        let waiting = crate::facts::answer_waits_for(p);
        t.view.outcome = match (blocked, waiting) {
            (true, _) => TurnOutcome::Blocked,
            (false, Some(_)) => TurnOutcome::Waiting,
            (false, None) => TurnOutcome::Answered,
        };
        t.view.reason = blocked.then(|| text(p, "reason")).flatten();
        t.view.waiting_for = waiting.map(str::to_string);
        if t.view.to_agent.is_none() {
            t.view.to_agent = text(p, "fromAgent").or_else(|| id_text(env.agent_id.as_ref()));
        }
        if t.view.from_agent.is_none() {
            t.view.from_agent = text(p, "toAgent");
        }
        t.view.reply = if blocked {
            text(p, "upstreamMessage").or_else(|| text(p, "next_action"))
        } else {
            message(p)
        };
        t.view.answered_at = Some(at.to_string());
        t.view.duration_ms = t.sent_ms.zip(ms(at)).map(|(s, e)| e - s);
        t.usage = usage::read(env);
    }
}

impl TurnBuild {
    fn finish(mut self, prices: &Prices) -> TurnView {
        self.view.usage = self.usage.as_ref().map(|u| summary(u, prices));
        self.view
    }
}

impl RunBuild {
    fn new(id: &str) -> RunBuild {
        RunBuild {
            view: RunView {
                run_id: id.to_string(),
                parent_run_id: None,
                agent: None,
                outcome: RunOutcome::Running,
                error: None,
                waiting_for: None,
                waiting_on: None,
                started_at: None,
                ended_at: None,
                duration_ms: None,
                messages: Vec::new(),
                tool_calls: Vec::new(),
                steps: Vec::new(),
                usage: None,
            },
            usage: None,
            message_index: HashMap::new(),
            tool_index: HashMap::new(),
            start_ms: None,
        }
    }

    fn note_usage(&mut self, env: &Envelope) {
        if let Some(u) = usage::read(env) {
            self.usage.get_or_insert_with(Usage::default).add(&u);
        }
    }

    fn apply(&mut self, env: &Envelope, at: &str) {
        let p = payload(env);
        let ag_ui = text(p, "agUiType");
        self.note_usage(env);
        if self.view.agent.is_none() {
            self.view.agent = id_text(env.agent_id.as_ref()).or_else(|| env.publishing_agent());
        }
        match env.event_type.as_str() {
            "text.delta" | "text.final" => self.text(env, at, ag_ui.as_deref()),
            "tool.started" | "tool.args" | "tool.result" | "tool.failed" => {
                self.tool(env, at, ag_ui.as_deref());
            }
            "run.status" => self.step(p, at, ag_ui.as_deref()),
            "run.finished" | "run.failed" => self.end(env, at),
            _ => {}
        }
    }

    fn text(&mut self, env: &Envelope, at: &str, ag_ui: Option<&str>) {
        let p = payload(env);
        let Some(id) = id_text(env.message_id.as_ref()).or_else(|| text(p, "messageId")) else {
            return;
        };
        let i = match self.message_index.get(&id) {
            Some(i) => *i,
            None if self.view.messages.len() < MAX_ITEMS => {
                self.view.messages.push(MessageView {
                    message_id: id.clone(),
                    role: None,
                    text: String::new(),
                    complete: false,
                    started_at: Some(at.to_string()),
                });
                self.message_index.insert(id, self.view.messages.len() - 1);
                self.view.messages.len() - 1
            }
            None => return,
        };
        let m = &mut self.view.messages[i];
        if m.role.is_none() {
            m.role = text(p, "role");
        }
        if let Some(delta) = p.and_then(|p| p.get("delta")).and_then(Value::as_str) {
            push_capped(&mut m.text, delta);
        }
        if ag_ui == Some("TEXT_MESSAGE_END") || env.event_type == "text.final" {
            m.complete = true;
        }
    }

    fn tool(&mut self, env: &Envelope, at: &str, ag_ui: Option<&str>) {
        let p = payload(env);
        let Some(id) = text(p, "toolCallId") else {
            return;
        };
        let i = match self.tool_index.get(&id) {
            Some(i) => *i,
            None if self.view.tool_calls.len() < MAX_ITEMS => {
                self.view.tool_calls.push(ToolCallView {
                    tool_call_id: id.clone(),
                    name: None,
                    arguments: String::new(),
                    arguments_complete: false,
                    result: None,
                    status: ToolStatus::Running,
                    started_at: Some(at.to_string()),
                    ended_at: None,
                    duration_ms: None,
                });
                self.tool_index.insert(id, self.view.tool_calls.len() - 1);
                self.view.tool_calls.len() - 1
            }
            None => return,
        };
        let call = &mut self.view.tool_calls[i];
        if call.name.is_none() {
            call.name = text(p, "toolCallName")
                .or_else(|| text(p, "name"))
                .or_else(|| text(p, "toolName"));
        }
        match env.event_type.as_str() {
            "tool.args" => {
                if let Some(delta) = p.and_then(|p| p.get("delta")).and_then(Value::as_str) {
                    push_capped(&mut call.arguments, delta);
                }
                if ag_ui == Some("TOOL_CALL_END") {
                    call.arguments_complete = true;
                }
            }
            "tool.result" | "tool.failed" => {
                let result = p.and_then(|p| {
                    ["content", "outputPreview", "result", "output", "error"]
                        .iter()
                        .find_map(|k| p.get(*k))
                });
                call.result = result.map(|v| match v {
                    Value::String(s) => capped(s),
                    other => capped(&other.to_string()),
                });
                call.status = if env.event_type == "tool.failed" {
                    ToolStatus::Failed
                } else {
                    ToolStatus::Completed
                };
                call.arguments_complete = true;
                call.ended_at = Some(at.to_string());
                call.duration_ms = call
                    .started_at
                    .as_deref()
                    .and_then(ms)
                    .zip(ms(at))
                    .map(|(s, e)| e - s);
            }
            _ => {}
        }
    }

    fn step(&mut self, p: Option<&Map<String, Value>>, at: &str, ag_ui: Option<&str>) {
        let Some(name) = text(p, "stepName").or_else(|| text(p, "name")) else {
            return;
        };
        match ag_ui {
            Some("STEP_FINISHED") => {
                if let Some(s) = self
                    .view
                    .steps
                    .iter_mut()
                    .rev()
                    .find(|s| s.name == name && s.ended_at.is_none())
                {
                    s.ended_at = Some(at.to_string());
                    return;
                }
            }
            _ if self.view.steps.len() >= MAX_ITEMS => return,
            _ => {}
        }
        self.view.steps.push(StepView {
            name,
            started_at: (ag_ui != Some("STEP_FINISHED")).then(|| at.to_string()),
            ended_at: (ag_ui == Some("STEP_FINISHED")).then(|| at.to_string()),
        });
    }

    fn end(&mut self, env: &Envelope, at: &str) {
        let p = payload(env);
        for call in &mut self.view.tool_calls {
            if call.status == ToolStatus::Running {
                call.status = ToolStatus::Unfinished;
            }
        }
        self.view.ended_at = Some(at.to_string());
        self.view.duration_ms = self.start_ms.zip(ms(at)).map(|(s, e)| e - s);
        if env.event_type == "run.failed" {
            let timeout = text(p, "reason").as_deref() == Some("timeout");
            self.view.outcome = if timeout {
                RunOutcome::TimedOut
            } else {
                RunOutcome::Failed
            };
            self.view.error = text(p, "message")
                .or_else(|| text(p, "code"))
                .or_else(|| text(p, "reason"));
        } else if let Some((reason, on)) = crate::facts::run_wait(env) {
            self.view.outcome = RunOutcome::Waiting;
            self.view.waiting_for = Some(reason);
            self.view.waiting_on = on;
        } else {
            self.view.outcome = RunOutcome::Finished;
        }
    }

    fn finish(mut self, prices: &Prices) -> RunView {
        self.view.usage = self.usage.as_ref().map(|u| summary(u, prices));
        self.view
    }
}

fn payload(env: &Envelope) -> Option<&Map<String, Value>> {
    env.payload.as_ref().and_then(Value::as_object)
}

fn id_text(v: Option<&Value>) -> Option<String> {
    v.and_then(crate::model::id_text)
}

fn text(p: Option<&Map<String, Value>>, key: &str) -> Option<String> {
    crate::model::field_text(p, key)
}

/// A request's or reply's text: `message` when it is text, else the first text part of an A2A
/// message.
fn message(p: Option<&Map<String, Value>>) -> Option<String> {
    let m = p?.get("message")?;
    let s = match m {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("parts").and_then(Value::as_array).and_then(|parts| {
            parts
                .iter()
                .find_map(|part| part.get("text").and_then(Value::as_str).map(str::to_string))
        }),
        _ => None,
    }?;
    Some(capped(&s))
}

fn ms(at: &str) -> Option<i64> {
    chrono::DateTime::parse_from_rfc3339(at)
        .ok()
        .map(|t| t.timestamp_millis())
}

fn push_capped(buf: &mut String, s: &str) {
    if buf.len() >= MAX_TEXT_BYTES {
        return;
    }
    let mut end = (MAX_TEXT_BYTES - buf.len()).min(s.len());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    buf.push_str(&s[..end]);
}

fn capped(s: &str) -> String {
    let mut out = String::new();
    push_capped(&mut out, s);
    out
}

#[cfg(test)]
mod tests;
