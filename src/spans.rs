//! Projected events assembled into spans (pure): the shape docs/contract.md, section 2d, exports
//! over OpenTelemetry and docs/otel.md describes.
//!
//! [`Assembler::observe`] takes the projections in stream order and returns the spans they
//! finish:
//!
//! - a turn (`a2a.send` .. its one `a2a.response`) and an AG-UI or runtime run (`run.started` ..
//!   `run.finished` / `run.failed`) are `invoke_agent {agent}` spans; a blocked response or a
//!   failed run has an error with its reason;
//! - a tool call (`tool.started` .. `tool.result` / `tool.failed`) is an `execute_tool {tool}`
//!   child of the run it ran in, with its arguments assembled from the streamed deltas;
//! - a delegation is a child of what caused it: a run whose `RUN_STARTED` names a `parentRunId`,
//!   a send made inside a run (it carries the run's id).
//!
//! Span and trace ids are derived from the events' own ids, so assembling the same projections
//! twice (a restart from an earlier position) gives the same spans, and a child can name a
//! parent that ends later. What is open is bounded ([`Limits`]): past a bound the oldest open
//! span is given up and counted.

use crate::model::Envelope;
use crate::usage::{self, Prices, Usage};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use std::collections::{HashMap, VecDeque};

/// A finished span, ready to export.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub parent_span_id: Option<[u8; 8]>,
    pub name: String,
    /// Event times, ms since the epoch.
    pub start_ms: i64,
    pub end_ms: i64,
    pub attributes: Vec<(&'static str, Attr)>,
    /// An error status with its reason (`error.type`), or `None` for a span that did not fail.
    pub error: Option<String>,
}

impl Span {
    pub fn attr(&self, key: &str) -> Option<&Attr> {
        self.attributes
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Attr {
    Str(String),
    Int(i64),
    F64(f64),
}

/// Bounds on what the assembler holds open.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Open turns, runs and tool calls, each.
    pub max_open: usize,
    /// Bytes of a tool call's assembled arguments (and of its result) kept on its span.
    pub max_text_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_open: 10_000,
            max_text_bytes: 4096,
        }
    }
}

/// What one projection did to the assembler.
#[derive(Debug, Default)]
pub struct Observed {
    pub spans: Vec<Span>,
    /// Open spans given up to stay within [`Limits::max_open`].
    pub evicted: u64,
}

struct OpenTurn {
    ids: Ids,
    start_ms: i64,
    caller: Option<String>,
    target: Option<String>,
    role: Option<String>,
}

struct OpenRun {
    ids: Ids,
    start_ms: i64,
    agent: Option<String>,
    conversation: Option<String>,
    role: Option<String>,
    usage: Option<Usage>,
    tools: Vec<String>,
}

struct OpenTool {
    /// Its `toolCallId`.
    call: String,
    ids: Ids,
    start_ms: i64,
    /// When `TOOL_CALL_END` closed its arguments.
    args_end_ms: Option<i64>,
    name: Option<String>,
    args: String,
}

#[derive(Clone, Copy)]
struct Ids {
    trace: [u8; 16],
    span: [u8; 8],
    parent: Option<[u8; 8]>,
}

/// A map that keeps at most `cap` entries, giving up the oldest first.
struct Bounded<V> {
    map: HashMap<String, V>,
    order: VecDeque<String>,
}

impl<V> Bounded<V> {
    fn new() -> Self {
        Bounded {
            map: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    /// Insert; returns how many entries were given up.
    fn insert(&mut self, key: String, v: V, cap: usize) -> u64 {
        if self.map.insert(key.clone(), v).is_none() {
            self.order.push_back(key);
        }
        let mut evicted = 0;
        while self.map.len() > cap.max(1) {
            match self.order.pop_front() {
                Some(old) => {
                    if self.map.remove(&old).is_some() {
                        evicted += 1;
                    }
                }
                None => break,
            }
        }
        // Keys removed by `remove` stay in the order queue until they reach its front; keep
        // the queue from growing past twice the live entries.
        if self.order.len() > 2 * self.map.len() + 64 {
            let map = &self.map;
            self.order.retain(|k| map.contains_key(k));
        }
        evicted
    }

    fn remove(&mut self, key: &str) -> Option<V> {
        self.map.remove(key)
    }

    fn get_mut(&mut self, key: &str) -> Option<&mut V> {
        self.map.get_mut(key)
    }

    fn get(&self, key: &str) -> Option<&V> {
        self.map.get(key)
    }

    /// The keys held, oldest first.
    fn oldest_first(&self) -> impl Iterator<Item = &String> {
        self.order
            .iter()
            .filter(|k| self.map.contains_key(k.as_str()))
    }
}

/// Turns, runs and tool calls being assembled from the projections.
pub struct Assembler {
    limits: Limits,
    prices: Prices,
    turns: Bounded<OpenTurn>,
    runs: Bounded<OpenRun>,
    tools: Bounded<OpenTool>,
}

impl Assembler {
    pub fn new(limits: Limits, prices: Prices) -> Self {
        Assembler {
            limits,
            prices,
            turns: Bounded::new(),
            runs: Bounded::new(),
            tools: Bounded::new(),
        }
    }

    /// Open spans held now (turns, runs, tool calls).
    pub fn open(&self) -> usize {
        self.turns.map.len() + self.runs.map.len() + self.tools.map.len()
    }

    /// Take one projection, stored at `stored_ms` (the time used when the event has none).
    pub fn observe(&mut self, env: &Envelope, stored_ms: i64) -> Observed {
        let at = event_ms(env).unwrap_or(stored_ms);
        let mut out = Observed::default();
        match env.event_type.as_str() {
            "a2a.send" => self.send(env, at, &mut out),
            "a2a.response" => self.response(env, at, &mut out),
            "run.started" => self.run_started(env, at, &mut out),
            "run.finished" | "run.failed" => self.run_ended(env, at, &mut out),
            "tool.started" => self.tool_started(env, at, &mut out),
            "tool.args" => self.tool_args(env, at),
            "tool.result" | "tool.failed" => self.tool_ended(env, at, &mut out),
            _ => self.usage_of_run(env),
        }
        out
    }

    fn send(&mut self, env: &Envelope, at: i64, out: &mut Observed) {
        let Some(key) = turn_key(env) else { return };
        let p = payload(env);
        let ids = ids_under(self.parent_run(env), &["turn", &key]);
        let turn = OpenTurn {
            ids,
            start_ms: at,
            caller: text(p, "fromAgent").or_else(|| id_text(env.agent_id.as_ref())),
            target: text(p, "toAgent"),
            role: role(env),
        };
        out.evicted += self.turns.insert(key, turn, self.limits.max_open);
    }

    fn response(&mut self, env: &Envelope, at: i64, out: &mut Observed) {
        let Some(key) = turn_key(env) else { return };
        let p = payload(env);
        let open = self.turns.remove(&key);
        let ids = open
            .as_ref()
            .map_or_else(|| root_ids(&["turn", &key]), |t| t.ids);
        // A response whose send this assembler never saw starts at the send's store time when
        // the response names it as evidence (a blocked outcome), else at itself.
        let start_ms = open
            .as_ref()
            .map(|t| t.start_ms)
            .or_else(|| evidence_ms(p, "send"))
            .unwrap_or(at);
        let agent = open
            .as_ref()
            .and_then(|t| t.target.clone())
            .or_else(|| text(p, "fromAgent"))
            .or_else(|| id_text(env.agent_id.as_ref()));
        let blocked = crate::facts::is_blocked(p);
        let error = blocked.then(|| text(p, "reason").unwrap_or_else(|| "blocked".into()));
        let waiting = (!blocked)
            .then(|| crate::facts::answer_waits_for(p))
            .flatten()
            .map(str::to_string);
        let mut attributes = agent_attrs(agent.as_deref(), id_text(env.conversation_id.as_ref()));
        attributes.push(("collab.turn.id", Attr::Str(key_turn(env))));
        if let Some(caller) = open
            .as_ref()
            .and_then(|t| t.caller.clone())
            .or_else(|| text(p, "toAgent"))
        {
            attributes.push(("collab.caller", Attr::Str(caller)));
        }
        if let Some(role) = open.as_ref().and_then(|t| t.role.clone()).or(role(env)) {
            attributes.push(("collab.event_role", Attr::Str(role)));
        }
        let outcome = match (&error, &waiting) {
            (Some(_), _) => "blocked",
            (None, Some(_)) => "waiting",
            (None, None) => "answered",
        };
        attributes.push(("collab.outcome", Attr::Str(outcome.into())));
        if let Some(wait) = waiting {
            // The answer asks its caller for input (or credentials): the caller is waited on.
            let on = open
                .as_ref()
                .and_then(|t| t.caller.clone())
                .or_else(|| text(p, "toAgent"));
            push_wait(&mut attributes, wait, on);
        }
        self.push_usage(usage::read(env).as_ref(), &mut attributes);
        out.spans.push(invoke_agent(
            ids,
            agent.as_deref(),
            (start_ms, at),
            attributes,
            error,
        ));
    }

    fn run_started(&mut self, env: &Envelope, at: i64, out: &mut Observed) {
        let Some(run) = id_text(env.run_id.as_ref()) else {
            return;
        };
        let p = payload(env);
        let parent = text(p, "parentRunId").and_then(|id| self.runs.get(&id).map(|r| r.ids));
        let ids = ids_under(parent, &["run", &run]);
        let open = OpenRun {
            ids,
            start_ms: at,
            agent: id_text(env.agent_id.as_ref()).or_else(|| env.publishing_agent()),
            conversation: conversation_of_run(env),
            role: role(env),
            usage: usage::read(env),
            tools: Vec::new(),
        };
        out.evicted += self.runs.insert(run, open, self.limits.max_open);
    }

    fn run_ended(&mut self, env: &Envelope, at: i64, out: &mut Observed) {
        let Some(run_id) = id_text(env.run_id.as_ref()) else {
            return;
        };
        let p = payload(env);
        let open = self.runs.remove(&run_id);
        let ids = open
            .as_ref()
            .map_or_else(|| root_ids(&["run", &run_id]), |r| r.ids);
        let start_ms = open
            .as_ref()
            .map(|r| r.start_ms)
            .or_else(|| evidence_ms(p, "run.started"))
            .unwrap_or(at);
        // Tool calls the run left open end with it.
        for key in open.iter().flat_map(|r| r.tools.iter()) {
            if let Some(t) = self.tools.remove(key) {
                out.spans
                    .push(self.tool_span(t, at, None, Some("unfinished".into())));
            }
        }
        let mut total = open.as_ref().and_then(|r| r.usage.clone());
        if let Some(u) = usage::read(env) {
            total.get_or_insert_with(Usage::default).add(&u);
        }
        let agent = open
            .as_ref()
            .and_then(|r| r.agent.clone())
            .or_else(|| id_text(env.agent_id.as_ref()))
            .or_else(|| env.publishing_agent());
        let conversation = open
            .as_ref()
            .and_then(|r| r.conversation.clone())
            .or_else(|| conversation_of_run(env));
        let mut attributes = agent_attrs(agent.as_deref(), conversation);
        attributes.push(("collab.run.id", Attr::Str(run_id)));
        if let Some(role) = open.as_ref().and_then(|r| r.role.clone()).or(role(env)) {
            attributes.push(("collab.event_role", Attr::Str(role)));
        }
        self.push_usage(total.as_ref(), &mut attributes);
        let error = (env.event_type == "run.failed").then(|| {
            text(p, "reason")
                .or_else(|| text(p, "code"))
                .unwrap_or_else(|| "error".into())
        });
        let waiting = error
            .is_none()
            .then(|| crate::facts::run_wait(env))
            .flatten();
        let outcome = match (&error, &waiting) {
            (Some(_), _) => "failed",
            (None, Some(_)) => "waiting",
            (None, None) => "finished",
        };
        attributes.push(("collab.outcome", Attr::Str(outcome.into())));
        if let Some((wait, on)) = waiting {
            push_wait(&mut attributes, wait, on);
        }
        out.spans.push(invoke_agent(
            ids,
            agent.as_deref(),
            (start_ms, at),
            attributes,
            error,
        ));
    }

    fn tool_started(&mut self, env: &Envelope, at: i64, out: &mut Observed) {
        let p = payload(env);
        let Some(call) = text(p, "toolCallId") else {
            return;
        };
        let run_id = id_text(env.run_id.as_ref());
        let run = run_id
            .as_deref()
            .and_then(|r| self.runs.get(r))
            .map(|r| r.ids);
        // The run's id is part of the name even when the run is not open here (it started
        // before this worker's restart): a reused `call-1` is then still a different root span
        // in each run.
        let ids = ids_under(run, &["tool", run_id.as_deref().unwrap_or_default(), &call]);
        let key = tool_key(run_id.as_deref(), &call);
        if let Some(run) = run_id.as_deref().and_then(|r| self.runs.get_mut(r)) {
            run.tools.push(key.clone());
        }
        let tool = OpenTool {
            call,
            ids,
            start_ms: at,
            args_end_ms: None,
            name: text(p, "toolCallName")
                .or_else(|| text(p, "name"))
                .or_else(|| text(p, "toolName")),
            args: text(p, "arguments").unwrap_or_default(),
        };
        out.evicted += self.tools.insert(key, tool, self.limits.max_open);
    }

    /// The open tool call an event of call `call` belongs to: the one its run started, else
    /// one started without a run, else (an event that names no run, of a call started in one)
    /// the oldest open call of that id.
    fn open_tool_key(&self, env: &Envelope, call: &str) -> Option<String> {
        let run = id_text(env.run_id.as_ref());
        if let Some(run) = run.as_deref() {
            let key = tool_key(Some(run), call);
            if self.tools.get(&key).is_some() {
                return Some(key);
            }
        }
        // Started without a run; its key is also the tail of every run's key for this call.
        let unrun = tool_key(None, call);
        if self.tools.get(&unrun).is_some() {
            return Some(unrun);
        }
        if run.is_some() {
            return None;
        }
        self.tools
            .oldest_first()
            .find(|k| k.ends_with(unrun.as_str()))
            .cloned()
    }

    fn tool_args(&mut self, env: &Envelope, at: i64) {
        let p = payload(env);
        let Some(call) = text(p, "toolCallId") else {
            return;
        };
        let max = self.limits.max_text_bytes;
        let Some(key) = self.open_tool_key(env, &call) else {
            return;
        };
        let Some(tool) = self.tools.get_mut(&key) else {
            return;
        };
        if p.and_then(|p| p.get("agUiType")).and_then(Value::as_str) == Some("TOOL_CALL_END") {
            tool.args_end_ms = Some(at);
        }
        if let Some(delta) = p.and_then(|p| p.get("delta")).and_then(Value::as_str) {
            push_capped(&mut tool.args, delta, max);
        }
    }

    fn tool_ended(&mut self, env: &Envelope, at: i64, out: &mut Observed) {
        let p = payload(env);
        let Some(call) = text(p, "toolCallId") else {
            return;
        };
        let Some(tool) = self
            .open_tool_key(env, &call)
            .and_then(|k| self.tools.remove(&k))
        else {
            return;
        };
        let result = p.and_then(|p| {
            ["content", "outputPreview", "result", "output"]
                .iter()
                .find_map(|k| p.get(*k))
        });
        let result = result.map(|v| match v {
            Value::String(s) => capped(s, self.limits.max_text_bytes),
            other => capped(&other.to_string(), self.limits.max_text_bytes),
        });
        let error = (env.event_type == "tool.failed").then(|| {
            text(p, "reason")
                .or_else(|| text(p, "error"))
                .unwrap_or_else(|| "error".into())
        });
        out.spans.push(self.tool_span(tool, at, result, error));
    }

    fn tool_span(
        &self,
        tool: OpenTool,
        at: i64,
        result: Option<String>,
        error: Option<String>,
    ) -> Span {
        let end_ms = if result.is_none() && error.as_deref() == Some("unfinished") {
            tool.args_end_ms.unwrap_or(at)
        } else {
            at
        };
        let mut attributes = vec![
            ("gen_ai.operation.name", Attr::Str("execute_tool".into())),
            ("gen_ai.tool.call.id", Attr::Str(tool.call.clone())),
        ];
        if let Some(name) = &tool.name {
            attributes.push(("gen_ai.tool.name", Attr::Str(name.clone())));
        }
        if !tool.args.is_empty() {
            attributes.push(("gen_ai.tool.call.arguments", Attr::Str(tool.args.clone())));
        }
        if let Some(result) = result {
            attributes.push(("gen_ai.tool.call.result", Attr::Str(result)));
        }
        Span {
            trace_id: tool.ids.trace,
            span_id: tool.ids.span,
            parent_span_id: tool.ids.parent,
            name: format!("execute_tool {}", tool.name.as_deref().unwrap_or("tool")),
            start_ms: tool.start_ms.min(end_ms),
            end_ms,
            attributes,
            error,
        }
    }

    /// Usage an event of an open run reports (an AG-UI `CUSTOM` usage event, a worker
    /// notification) is added to the run's.
    fn usage_of_run(&mut self, env: &Envelope) {
        let Some(run) = id_text(env.run_id.as_ref()) else {
            return;
        };
        let Some(open) = self.runs.get_mut(&run) else {
            return;
        };
        if let Some(u) = usage::read(env) {
            open.usage.get_or_insert_with(Usage::default).add(&u);
        }
    }

    fn parent_run(&self, env: &Envelope) -> Option<Ids> {
        let run = id_text(env.run_id.as_ref())?;
        self.runs.get(&run).map(|r| r.ids)
    }

    fn push_usage(&self, u: Option<&Usage>, attributes: &mut Vec<(&'static str, Attr)>) {
        let Some(u) = u else { return };
        let int = |n: u64| Attr::Int(i64::try_from(n).unwrap_or(i64::MAX));
        attributes.push(("gen_ai.usage.input_tokens", int(u.input_tokens)));
        attributes.push(("gen_ai.usage.output_tokens", int(u.output_tokens)));
        if let Some(c) = u.cached_input_tokens {
            attributes.push(("gen_ai.usage.cache_read.input_tokens", int(c)));
        }
        if let Some(r) = u.reasoning_tokens {
            attributes.push(("collab.usage.reasoning_tokens", int(r)));
        }
        if let Some(model) = &u.model {
            attributes.push(("gen_ai.request.model", Attr::Str(model.clone())));
        }
        if let Some(cost) = self.prices.cost(u) {
            attributes.push(("collab.usage.cost", Attr::F64(cost)));
        }
    }
}

fn push_wait(attributes: &mut Vec<(&'static str, Attr)>, wait: String, on: Option<String>) {
    attributes.push(("collab.waiting.for", Attr::Str(wait)));
    if let Some(on) = on {
        attributes.push(("collab.waiting.on", Attr::Str(on)));
    }
}

/// An `invoke_agent {agent}` span (a turn or a run) from `start_ms` to `end_ms`.
fn invoke_agent(
    ids: Ids,
    agent: Option<&str>,
    (start_ms, end_ms): (i64, i64),
    attributes: Vec<(&'static str, Attr)>,
    error: Option<String>,
) -> Span {
    Span {
        trace_id: ids.trace,
        span_id: ids.span,
        parent_span_id: ids.parent,
        name: format!("invoke_agent {}", agent.unwrap_or("agent")),
        start_ms: start_ms.min(end_ms),
        end_ms,
        attributes,
        error,
    }
}

fn agent_attrs(agent: Option<&str>, conversation: Option<String>) -> Vec<(&'static str, Attr)> {
    let mut a = vec![("gen_ai.operation.name", Attr::Str("invoke_agent".into()))];
    if let Some(agent) = agent {
        a.push(("gen_ai.agent.name", Attr::Str(agent.to_string())));
    }
    if let Some(c) = conversation {
        a.push(("gen_ai.conversation.id", Attr::Str(c)));
    }
    a
}

fn payload(env: &Envelope) -> Option<&Map<String, Value>> {
    env.payload.as_ref().and_then(Value::as_object)
}

fn role(env: &Envelope) -> Option<String> {
    env.event_role.map(|r| r.as_str().to_string())
}

fn id_text(v: Option<&Value>) -> Option<String> {
    v.and_then(crate::model::id_text)
}

fn text(p: Option<&Map<String, Value>>, key: &str) -> Option<String> {
    crate::model::field_text(p, key)
}

/// An open tool call's key: the run that started it (none: empty) and its `toolCallId`. Tool
/// call ids are the producer's, and producers reuse them from run to run (`call-1`), so two runs
/// in flight with the same id are two calls.
fn tool_key(run: Option<&str>, call: &str) -> String {
    format!("{}\u{1f}{call}", run.unwrap_or_default())
}

/// A turn's key: its conversation and turn ids.
fn turn_key(env: &Envelope) -> Option<String> {
    let conv = id_text(env.conversation_id.as_ref())?;
    Some(format!("{conv}\u{1f}{}", key_turn(env)))
}

/// docs/contract.md section 4: `turnId`, else `turn`, else `0`.
fn key_turn(env: &Envelope) -> String {
    let p = payload(env);
    crate::model::turn_id([
        env.turn_id.as_ref(),
        p.and_then(|p| p.get("turnId")),
        p.and_then(|p| p.get("turn")),
    ])
}

fn conversation_of_run(env: &Envelope) -> Option<String> {
    id_text(env.thread_id.as_ref())
        .or_else(|| id_text(env.conversation_id.as_ref()))
        .or_else(|| id_text(env.session_id.as_ref()))
}

/// The store time of a blocked outcome's evidence of `kind`.
fn evidence_ms(p: Option<&Map<String, Value>>, kind: &str) -> Option<i64> {
    p?.get("evidence")?
        .as_array()?
        .iter()
        .find(|e| e.get("kind").and_then(Value::as_str) == Some(kind))
        .and_then(|e| e.get("storedAt")?.as_str())
        .and_then(rfc3339_ms)
}

fn event_ms(env: &Envelope) -> Option<i64> {
    rfc3339_ms(env.timestamp.as_deref()?)
}

fn rfc3339_ms(s: &str) -> Option<i64> {
    chrono::DateTime::parse_from_rfc3339(s)
        .ok()
        .map(|t| t.timestamp_millis())
}

fn digest(parts: &[&str]) -> [u8; 32] {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p.as_bytes());
        h.update([0x1f]);
    }
    h.finalize().into()
}

fn span_id(parts: &[&str]) -> [u8; 8] {
    let d = digest(parts);
    let mut id = [0u8; 8];
    id.copy_from_slice(&d[..8]);
    // An all-zero id is invalid in OpenTelemetry.
    if id == [0; 8] {
        id[7] = 1;
    }
    id
}

/// The ids of the span named by `parts`: a child of `parent` in its trace, else a root. A
/// child's span id is derived under its parent's: ids that producers reuse from one run to the
/// next (a tool call `call-1` in every run) name a different span in each, as OpenTelemetry
/// requires and backends that key spans by id (Phoenix) need.
fn ids_under(parent: Option<Ids>, parts: &[&str]) -> Ids {
    match parent {
        Some(parent) => Ids {
            trace: parent.trace,
            span: span_id(&[&[hex::encode(parent.span).as_str()], parts].concat()),
            parent: Some(parent.span),
        },
        None => root_ids(parts),
    }
}

fn root_ids(parts: &[&str]) -> Ids {
    let d = digest(parts);
    let mut trace = [0u8; 16];
    trace.copy_from_slice(&d[8..24]);
    if trace == [0; 16] {
        trace[15] = 1;
    }
    Ids {
        trace,
        span: span_id(parts),
        parent: None,
    }
}

fn push_capped(buf: &mut String, s: &str, max: usize) {
    if buf.len() >= max {
        return;
    }
    let room = max - buf.len();
    buf.push_str(&capped(s, room));
}

/// `s` cut to at most `max` bytes on a character boundary.
fn capped(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

#[cfg(test)]
mod tests;
