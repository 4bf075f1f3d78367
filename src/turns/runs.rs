//! The run contract (docs/contract.md section 2b): exactly one terminal event per AG-UI run.
//!
//! A run is an exchange of the turn machinery ([`super::ExchangeKind::Run`]): its record lives in
//! the turns bucket under its own key namespace, `RUN_STARTED` plays the send (it opens the run,
//! deadline = store time + `runs.timeout`), `RUN_FINISHED` and `RUN_ERROR` play the response (the
//! first in event time wins; a real `RUN_ERROR` is the run's real terminal, not a blocked outcome).
//! The fence, deadlines, watermark, deferred open writes, published checkpoint and reload are the
//! turns' own; this module only says which AG-UI events are run events, which run an event belongs
//! to, and what is published for a run's winner.
//!
//! What a run left open at its timeout (text messages, tool calls) is not kept as state: writing
//! state per text or tool event would put a write per event back on the hot path. It is derived
//! when the timeout is decided, from the run's raw events ([`RunScan`]), which the raw stream keeps
//! unchanged: a crash and a republish derive the same ends with the same Msg-Ids.

use super::payload::rfc3339;
use super::payload::{
    DeadlineEvidence, DeadlineKind, Evidence, MessageEvidence, RunErrorType, RunFailedPayload,
    RunOutcome, RunWinnerRef, WinnerRef,
};
use super::record::{
    ExchangeKind, Reason, SuppressReason, TurnEventKind, TurnFacts, TurnRecord, Winner,
};
use crate::facets;
use crate::facts::{AgUiFacts, TYPE_FIELD};
use crate::model::{encode_id, Envelope, RawEventRef, Role};
use serde_json::{json, Map, Value};
use std::collections::HashMap;

pub use super::record::TERMINAL_BY;
/// The type of a further terminal, projected on `system.observability`.
pub const SUPPRESSED_TYPE: &str = "run.terminal.suppressed";

/// What an AG-UI event is to its run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunSignal {
    Start,
    Terminal,
}

impl RunSignal {
    pub fn of(agui_type: &str) -> Option<RunSignal> {
        match agui_type {
            "RUN_STARTED" => Some(RunSignal::Start),
            "RUN_FINISHED" | "RUN_ERROR" => Some(RunSignal::Terminal),
            _ => None,
        }
    }
}

/// The facts of an AG-UI run event before its run is resolved: `RUN_ERROR` carries no run id, so
/// which run it ends may depend on the partition's open runs ([`OpenRuns`]).
#[derive(Debug, Clone, PartialEq)]
pub struct RunEvent {
    pub signal: RunSignal,
    /// The event's own `runId`, else the relay's `Collab-Run-Id` header.
    pub run_id: Option<String>,
    pub thread_id: Option<String>,
    pub role: Role,
    /// The subject key token.
    pub key: String,
    pub seq: u64,
    pub stored_ms: i64,
    pub subject: String,
    /// The agent whose user published the event (the subject's `_as.<agent>`), if it names one.
    /// The agent that published a run's `RUN_STARTED` owns the run: only it may end it.
    pub agent: Option<String>,
}

impl RunEvent {
    /// The run facts of a projected envelope, published on `subject` by `agent` (its
    /// `_as.<agent>`, if it names one); `None` unless it is an AG-UI `RUN_STARTED`,
    /// `RUN_FINISHED` or `RUN_ERROR`.
    pub fn of(
        env: &Envelope,
        key: &str,
        header_run_id: Option<&str>,
        seq: u64,
        stored_ms: i64,
        subject: &str,
        agent: Option<&str>,
    ) -> Option<RunEvent> {
        let agui = AgUiFacts::of(env)?;
        let signal = RunSignal::of(agui.agui_type)?;
        Some(RunEvent {
            signal,
            run_id: run_of(&agui, header_run_id).map(str::to_string),
            thread_id: agui.thread_id.map(str::to_string),
            role: env.event_role.unwrap_or(Role::SystemObservability),
            key: key.to_string(),
            seq,
            stored_ms,
            subject: subject.to_string(),
            agent: agent.map(str::to_string),
        })
    }

    /// The exchange facts, with the run resolved: its own id, else the key's open run. `None`:
    /// the event belongs to no run it can name (a `RUN_ERROR` with no id while no run of the key
    /// is open) and is projected as it is.
    pub fn facts(&self, open: &OpenRuns) -> Option<TurnFacts> {
        let run = self
            .run_id
            .clone()
            .or_else(|| open.current(&self.key).map(str::to_string))?;
        Some(TurnFacts {
            kind: match self.signal {
                RunSignal::Start => TurnEventKind::Send,
                RunSignal::Terminal => TurnEventKind::Response,
            },
            exchange: ExchangeKind::Run,
            conversation_id: self.thread_id.clone().unwrap_or_else(|| self.key.clone()),
            key: self.key.clone(),
            turn: run,
            seq: self.seq,
            stored_ms: self.stored_ms,
            subject: self.subject.clone(),
            // A RUN_ERROR is the run's real terminal, never a blocked outcome.
            failure: None,
            failure_detail: None,
            // The run's agent both opens and ends it: a `RUN_STARTED` records its publisher as
            // the run's target, and a terminal is spoken by its publisher, so a terminal another
            // agent published is kept beside the run, never as its terminal
            // (`turns::spoken_by_target`).
            from_agent: self.agent.clone(),
            to_agent: match self.signal {
                RunSignal::Start => self.agent.clone(),
                RunSignal::Terminal => None,
            },
            run_id: None,
            target_session_key: None,
            work_session_id: None,
            a2a_method: None,
            goal: None,
            timeout_ms: None,
            role: Some(self.role),
            thread_id: self.thread_id.clone(),
            follows_previous: false,
        })
    }
}

/// The run an AG-UI event names: its `runId`, else the relay's header.
fn run_of<'a>(agui: &AgUiFacts<'a>, header_run_id: Option<&'a str>) -> Option<&'a str> {
    agui.run_id
        .filter(|r| !r.trim().is_empty())
        .or(header_run_id)
}

/// The open runs of a partition by key, for events that name no run: the key's current run is
/// the one opened last that is still open. Kept in memory; a partition rebuilds it from its open
/// run records when it starts.
#[derive(Debug, Clone, Default)]
pub struct OpenRuns {
    by_key: HashMap<String, Vec<(u64, String)>>,
}

impl OpenRuns {
    /// A run of `key` opened by the message at `seq`.
    pub fn open(&mut self, key: &str, seq: u64, run: &str) {
        let runs = self.by_key.entry(key.to_string()).or_default();
        if runs.iter().any(|(_, r)| r == run) {
            return;
        }
        let at = runs.partition_point(|(s, _)| *s <= seq);
        runs.insert(at, (seq, run.to_string()));
    }

    pub fn close(&mut self, key: &str, run: &str) {
        if let Some(runs) = self.by_key.get_mut(key) {
            runs.retain(|(_, r)| r != run);
            if runs.is_empty() {
                self.by_key.remove(key);
            }
        }
    }

    /// The key's run opened last among those still open.
    pub fn current(&self, key: &str) -> Option<&str> {
        self.by_key
            .get(key)
            .and_then(|runs| runs.last())
            .map(|(_, r)| r.as_str())
    }

    /// Keep up with a record read or written: an open run with a start is open, anything else
    /// is not. Turn records are ignored.
    pub fn note(&mut self, rec: &TurnRecord) {
        if rec.exchange != ExchangeKind::Run {
            return;
        }
        match (&rec.state, &rec.send) {
            (super::TurnState::Open, Some(start)) => self.open(&rec.key, start.seq, &rec.turn),
            _ => self.close(&rec.key, &rec.turn),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }
}

/// A text message or tool call a run started and did not end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpenItem {
    Message(String),
    ToolCall(String),
}

/// Reads a key's raw events from a run's start, in stream order, and collects what that run
/// left open. Events that name no run are attributed as the live partition attributes a
/// `RUN_ERROR`: to the key's run opened last and still open.
#[derive(Debug, Clone)]
pub struct RunScan {
    key: String,
    run: String,
    runs: OpenRuns,
    /// The agent that published each run's `RUN_STARTED`, when its subject named one: only
    /// that agent's terminal ends the run, as in the live partition.
    owners: HashMap<String, String>,
    open: Vec<OpenItem>,
}

impl RunScan {
    pub fn new(key: &str, run: &str) -> RunScan {
        RunScan {
            key: key.to_string(),
            run: run.to_string(),
            runs: OpenRuns::default(),
            owners: HashMap::new(),
            open: Vec::new(),
        }
    }

    /// One event of the key, in stream order (its envelope, its `Collab-Run-Id` header and the
    /// agent whose user published it).
    pub fn observe(&mut self, env: &Envelope, header_run_id: Option<&str>, agent: Option<&str>) {
        let Some(agui) = AgUiFacts::of(env) else {
            return;
        };
        let named = run_of(&agui, header_run_id);
        let run = named
            .map(str::to_string)
            .or_else(|| self.runs.current(&self.key).map(str::to_string));
        match RunSignal::of(agui.agui_type) {
            Some(RunSignal::Start) => {
                if let Some(r) = named {
                    self.runs.open(&self.key, u64::MAX, r);
                    if let Some(a) = agent {
                        self.owners
                            .entry(r.to_string())
                            .or_insert_with(|| a.to_string());
                    }
                }
                return;
            }
            Some(RunSignal::Terminal) => {
                if let Some(r) = &run {
                    // Another agent's terminal ends nothing (it was suppressed `not_target`).
                    let owner = self.owners.get(r).map(String::as_str);
                    if super::answers(owner, None, agent, false) {
                        self.runs.close(&self.key, r);
                    }
                }
                return;
            }
            None => {}
        }
        if run.as_deref() != Some(self.run.as_str()) {
            return;
        }
        let item = match agui.agui_type {
            "TEXT_MESSAGE_START" | "TEXT_MESSAGE_END" => {
                agui.message_id.map(|m| OpenItem::Message(m.to_string()))
            }
            "TOOL_CALL_START" | "TOOL_CALL_END" => {
                agui.tool_call_id.map(|t| OpenItem::ToolCall(t.to_string()))
            }
            _ => None,
        };
        let Some(item) = item else { return };
        if agui.agui_type.ends_with("_START") {
            if !self.open.contains(&item) {
                self.open.push(item);
            }
        } else {
            self.open.retain(|i| *i != item);
        }
    }

    /// What the run left open, in the order it was started.
    pub fn open_items(&self) -> &[OpenItem] {
        &self.open
    }
}

/// The run's own deadline, as stored at its start.
fn deadline_of(rec: &TurnRecord) -> Option<(i64, u64)> {
    let start = rec.send.as_ref()?;
    Some((
        start
            .stored_ms
            .saturating_add(i64::try_from(start.timeout_ms).unwrap_or(i64::MAX)),
        start.timeout_ms,
    ))
}

/// An envelope the processor writes for the run: its ids, role, time and the start's raw ref.
fn synthesised(
    rec: &TurnRecord,
    event_type: &str,
    at_ms: i64,
    payload: Map<String, Value>,
) -> Envelope {
    let start = rec.send.as_ref();
    let mut env = Envelope {
        event_type: event_type.to_string(),
        event_role: Some(
            start
                .and_then(|s| s.role)
                .unwrap_or(Role::SystemObservability),
        ),
        timestamp: Some(rfc3339(at_ms)),
        thread_id: start.and_then(|s| s.thread_id.clone()).map(Value::String),
        run_id: Some(Value::String(rec.turn.clone())),
        payload: Some(Value::Object(payload)),
        raw_event_ref: start.map(|s| RawEventRef {
            stream: String::new(),
            seq: s.seq,
            subject: s.subject.clone(),
            stored_at: rfc3339(s.stored_ms),
        }),
        ..Envelope::default()
    };
    facets::apply(
        &mut env,
        &facets::derive(event_type, None, event_type == "run.failed"),
    );
    env
}

/// The synthesised end of an open item, with its Msg-Id: derived from the run and the item, so a
/// republish after a crash collapses.
pub fn end_of(rec: &TurnRecord, item: &OpenItem, at_ms: i64) -> (String, Envelope) {
    let mut p = Map::new();
    let (agui_type, event_type, id) = match item {
        OpenItem::Message(m) => ("TEXT_MESSAGE_END", "text.final", m),
        OpenItem::ToolCall(t) => ("TOOL_CALL_END", "tool.args", t),
    };
    p.insert(TYPE_FIELD.into(), json!(agui_type));
    p.insert("synthesized".into(), json!(true));
    p.insert("reason".into(), json!("timeout"));
    let mut env = match item {
        OpenItem::Message(m) => {
            let mut e = synthesised(rec, event_type, at_ms, p);
            e.message_id = Some(Value::String(m.clone()));
            e
        }
        OpenItem::ToolCall(t) => {
            p.insert("toolCallId".into(), json!(t));
            synthesised(rec, event_type, at_ms, p)
        }
    };
    env.phase = Some("completed".into());
    let kind = match item {
        OpenItem::Message(_) => "message",
        OpenItem::ToolCall(_) => "tool",
    };
    (
        format!("{}:end:{kind}:{}", rec.response_msg_id(), encode_id(id)),
        env,
    )
}

/// The synthesised `run.failed` of a run that stored no terminal by its deadline.
pub fn timeout_failure(rec: &TurnRecord, winner: &Winner, open: &[OpenItem]) -> Envelope {
    let start = rec.send.as_ref();
    let mut evidence = Vec::new();
    if let Some(s) = start {
        evidence.push(Evidence::Message(MessageEvidence {
            kind: "run.started".into(),
            raw_seq: s.seq,
            subject: s.subject.clone(),
            stored_at: rfc3339(s.stored_ms),
        }));
    }
    let deadline = deadline_of(rec);
    if let Some((at, timeout_ms)) = deadline {
        evidence.push(Evidence::Deadline(DeadlineEvidence {
            kind: DeadlineKind::Deadline,
            at: rfc3339(at),
            timeout_ms,
        }));
    }
    let within = deadline
        .map(|(_, ms)| {
            if ms >= 1000 && ms % 1000 == 0 {
                format!("{}s", ms / 1000)
            } else {
                format!("{ms} ms")
            }
        })
        .unwrap_or_else(|| "its deadline".into());
    let thread = start
        .and_then(|s| s.thread_id.as_deref())
        .map(|t| format!(" of thread {t}"))
        .unwrap_or_default();
    let closed = if open.is_empty() {
        String::new()
    } else {
        format!(
            "; the processor ended what it left open ({} text message(s), {} tool call(s))",
            open.iter()
                .filter(|i| matches!(i, OpenItem::Message(_)))
                .count(),
            open.iter()
                .filter(|i| matches!(i, OpenItem::ToolCall(_)))
                .count()
        )
    };
    let message = format!(
        "run {}{thread} stored no RUN_FINISHED or RUN_ERROR within {within} of its RUN_STARTED{closed}",
        rec.turn
    );
    let p = RunFailedPayload {
        ag_ui_type: RunErrorType::RunError,
        reason: Reason::Timeout,
        synthesized: true,
        message,
        evidence,
    }
    .into_map();
    synthesised(rec, "run.failed", winner.at_ms, p)
}

/// The envelope of a run's one terminal: the real terminal as it was projected (its own type and
/// role), or the synthesised `run.failed` of a timeout (without the ends: see [`end_of`]).
pub fn terminal(rec: &TurnRecord, decider: Option<&Envelope>) -> Envelope {
    match (rec.winner.as_ref(), decider) {
        (Some(w), _) if w.seq.is_none() => timeout_failure(rec, w, &[]),
        (_, Some(env)) => env.clone(),
        (Some(w), None) => timeout_failure(rec, w, &[]),
        (None, None) => Envelope::default(),
    }
}

/// The record of a further terminal of a run: on `system.observability`, with a ref to the
/// terminal that won.
pub fn suppressed(env: &Envelope, rec: &TurnRecord, reason: SuppressReason) -> Envelope {
    let winner = rec.winner.as_ref();
    let timed_out = winner.is_some_and(|w| w.seq.is_none());
    let winner_ref = WinnerRef::Run(RunWinnerRef {
        msg_id: rec.response_msg_id(),
        raw_seq: winner.and_then(|w| w.seq),
        outcome: match winner {
            None => RunOutcome::Pending,
            Some(_) if timed_out => RunOutcome::Timeout,
            Some(_) => RunOutcome::Terminal,
        },
        run_id: rec.turn.clone(),
        thread_id: rec.send.as_ref().and_then(|s| s.thread_id.clone()),
    });
    super::payload::suppression(env, SUPPRESSED_TYPE, reason, winner_ref)
}

#[cfg(test)]
mod tests;
