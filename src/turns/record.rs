//! What the turn contract reads and writes: the facts of an `a2a.*` event ([`TurnFacts`]), a
//! turn's persisted [`TurnRecord`] with its [`Winner`], and the [`Step`] a decision returns. The
//! rules over them live in the parent module; the payloads and the run contract read these types
//! from here.

use crate::classify::Fields;
pub use crate::facts::{failure_signal, Reason};
use crate::model::{encode_id, id_text, timestamp, Role};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::time::Duration;

/// `Winner::by` of a run decided by a real terminal event.
pub const TERMINAL_BY: &str = "run.terminal";

/// What an `a2a.*` event is to its turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TurnEventKind {
    Send,
    Response,
    Complete,
    Error,
}

impl TurnEventKind {
    pub fn of(event_type: &str) -> Option<TurnEventKind> {
        Some(match event_type {
            "a2a.send" => TurnEventKind::Send,
            "a2a.response" => TurnEventKind::Response,
            "a2a.complete" => TurnEventKind::Complete,
            "a2a.error" => TurnEventKind::Error,
            _ => return None,
        })
    }
}

/// Which kind of exchange a record follows. One mechanism (fence, deadlines, checkpoint, reload)
/// serves both: an A2A turn (docs/contract.md section 4) answered by one `a2a.response`, and an AG-UI run
/// (docs/contract.md section 2b) ended by one terminal event. Records written before runs existed have no kind
/// and read as turns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExchangeKind {
    #[default]
    Turn,
    Run,
}

impl ExchangeKind {
    pub fn is_turn(&self) -> bool {
        *self == ExchangeKind::Turn
    }
}

/// The facts of one `a2a.*` event that the turn contract needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TurnFacts {
    pub kind: TurnEventKind,
    /// A turn, or an AG-UI run (its `turn` is then the run id, and `kind` is `Send` for
    /// `RUN_STARTED`, `Response` for its terminals).
    #[serde(default, skip_serializing_if = "ExchangeKind::is_turn")]
    pub exchange: ExchangeKind,
    /// Conversation id as the producer wrote it.
    pub conversation_id: String,
    /// Its subject-key token.
    pub key: String,
    /// Turn id text: `turnId`, else `turn`, else `0`.
    pub turn: String,
    /// Raw stream sequence and store time (ms since the epoch).
    pub seq: u64,
    pub stored_ms: i64,
    pub subject: String,
    /// An upstream failure signal, by the contract's table (rows 1-3).
    pub failure: Option<Reason>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failure_detail: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from_agent: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub to_agent: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target_session_key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub work_session_id: Option<String>,
    /// A2A wire traffic only: the request's method, so a blocked outcome says how to retry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub a2a_method: Option<String>,
    /// Send only: what the turn attempted (`goal`, else the message text, shortened).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub goal: Option<String>,
    /// Send only: its own timeout (`timeoutMs`, or `deadline` minus its timestamp).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// Runs only: the role the run was projected with, and its AG-UI thread, so what the
    /// processor synthesises for it goes where the run's own events go.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<Role>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thread_id: Option<String>,
    /// Set by the shell, never read from an event: this response, stored before any send of
    /// its turn, is spoken between the two sides of the conversation's previous turn (a
    /// ping-pong reply, [`super::continues_previous`]), so `turns.early_hold` does not hold it.
    #[serde(skip)]
    pub follows_previous: bool,
}

impl TurnFacts {
    /// The KV key of the exchange (see [`exchange_key`]).
    pub fn record_key(&self, partition: u16) -> String {
        exchange_key(self.exchange, partition, &self.key, &self.turn)
    }

    /// The KV key of the conversation's previous turn, for a response that may be a ping-pong
    /// reply ([`super::previous_turn`]).
    pub fn previous_record_key(&self, partition: u16) -> Option<String> {
        super::previous_turn(self).map(|prev| record_key(partition, &self.key, &prev))
    }
}

/// The KV key of a turn: `p<partition>.<conversation key>.<turn token>`.
pub fn record_key(partition: u16, key: &str, turn: &str) -> String {
    format!("p{partition}.{key}.{}", encode_id(turn))
}

/// The KV key of an exchange. A run's key has one token more (`p<partition>.<key>.run.<run
/// token>`) than any turn's, so no A2A turn id, whatever its text, can name a run's record.
pub fn exchange_key(kind: ExchangeKind, partition: u16, key: &str, id: &str) -> String {
    match kind {
        ExchangeKind::Turn => record_key(partition, key, id),
        ExchangeKind::Run => format!("p{partition}.{key}.run.{}", encode_id(id)),
    }
}

const GOAL_MAX_CHARS: usize = 200;

/// Read the turn facts of a normalised `a2a.*` event. `None` for other types.
pub fn facts(
    obj: &serde_json::Map<String, Value>,
    event_type: &str,
    conversation_id: &str,
    key: &str,
    seq: u64,
    stored_ms: i64,
    subject: &str,
) -> Option<TurnFacts> {
    let kind = TurnEventKind::of(event_type)?;
    let fields = Fields::new(obj);
    let turn = crate::model::turn_id([fields.get("turnId"), fields.get("turn")]);
    let text = |name: &str| fields.get(name).and_then(id_text);
    let (failure, failure_detail) = match failure_signal(&fields, event_type) {
        Some((r, d)) => (Some(r), d),
        None => (None, None),
    };
    let mut goal = None;
    let mut timeout_ms = None;
    if kind == TurnEventKind::Send {
        goal = fields
            .str("goal")
            .filter(|g| !g.trim().is_empty())
            .or_else(|| fields.str("message"))
            .map(|g| crate::model::shorten(g, GOAL_MAX_CHARS))
            .filter(|g| !g.is_empty());
        timeout_ms = fields.get("timeoutMs").and_then(Value::as_u64).or_else(|| {
            let deadline = fields.get("deadline").and_then(timestamp)?;
            let sent = fields
                .get("timestamp")
                .or_else(|| fields.get("ts"))
                .and_then(timestamp)?;
            u64::try_from((deadline - sent).num_milliseconds()).ok()
        });
    }
    Some(TurnFacts {
        kind,
        conversation_id: conversation_id.to_string(),
        key: key.to_string(),
        turn,
        seq,
        stored_ms,
        subject: subject.to_string(),
        failure,
        failure_detail,
        from_agent: text("fromAgent"),
        to_agent: text("toAgent"),
        run_id: text("runId"),
        target_session_key: text("targetSessionKey"),
        work_session_id: text("workSessionId"),
        a2a_method: fields
            .get("a2a")
            .and_then(|a| a.get("method"))
            .and_then(Value::as_str)
            .map(str::to_string),
        goal,
        timeout_ms,
        exchange: ExchangeKind::Turn,
        role: None,
        thread_id: None,
        follows_previous: false,
    })
}

/// Where a turn is in its life. Records go Open -> Decided -> Published, or straight to Decided
/// when the first event decides the turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TurnState {
    Open,
    Decided,
    Published,
}

/// The send that opened a turn, as much as a blocked outcome needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SendRef {
    pub seq: u64,
    pub stored_ms: i64,
    pub subject: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from_agent: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub to_agent: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub goal: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target_session_key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub work_session_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub a2a_method: Option<String>,
    pub timeout_ms: u64,
    /// Runs only (see [`TurnFacts::role`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<Role>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thread_id: Option<String>,
}

/// Who won the turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Winner {
    /// The raw message that decided the turn; `None` for a timeout synthesised at the deadline.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
    /// `None` for a real reply; the reason for a blocked outcome.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub blocked: Option<Reason>,
    /// Whether the processor created the response (deadline, complete or error without a reply).
    pub synthesized: bool,
    /// The event type that decided it (`a2a.response`, `a2a.complete`, `a2a.error`, or
    /// `deadline`).
    pub by: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// Event time of the decision: the deciding message's store time, or the deadline.
    pub at_ms: i64,
}

/// One turn's persisted record (the KV value).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TurnRecord {
    /// A turn or a run; absent in records written before runs existed (turns).
    #[serde(default, skip_serializing_if = "ExchangeKind::is_turn")]
    pub exchange: ExchangeKind,
    pub conversation_id: String,
    pub key: String,
    pub turn: String,
    pub state: TurnState,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub send: Option<SendRef>,
    /// Store-time deadline (ms) of an open turn.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deadline_ms: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub winner: Option<Winner>,
    /// Who asked and who was asked, when no send opened the turn (read from the deciding event).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sender: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// The ownership term (of the partition) whose owner wrote this decision: a partition's
    /// published checkpoint vouches only for its own owner's decisions, never for a late write of
    /// a previous owner. Set by the shell when it writes a decided record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub writer: Option<u64>,
    /// A response stored before any send of the turn (a terminal before its run's
    /// `RUN_STARTED`), held until a send says who may answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub early: Option<Early>,
}

/// A response that came before its turn's send. Until the send arrives nobody knows whom the
/// turn was addressed to, so the response is held rather than taken as the answer: the send
/// then decides the turn by it when its target spoke it, or refuses it (kept beside the turn as
/// `not_target`) and opens the turn; with no send by the hold's deadline, it decides the turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Early {
    /// What it decides the turn with, if it is taken. Who spoke it is the record's `target`,
    /// as for any response no send opened.
    pub winner: Winner,
    /// The send showed it was not the target's: it decides nothing, and a redelivery of that
    /// send publishes its suppression again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub refused: bool,
}

impl TurnRecord {
    /// Whether the record holds an early response and no send has come yet.
    pub fn holds_early(&self) -> bool {
        self.state == TurnState::Open
            && self.send.is_none()
            && self.early.as_ref().is_some_and(|e| !e.refused)
    }

    /// Whether the record still held its early response at event time `stored_ms`: its hold's
    /// deadline had not passed then (after it, the held response is the turn's).
    pub fn holds_early_at(&self, stored_ms: i64) -> bool {
        self.holds_early() && self.deadline_ms.is_none_or(|d| d >= stored_ms)
    }
}

impl TurnRecord {
    /// The agent the turn was addressed to.
    pub fn target(&self) -> Option<&str> {
        self.send
            .as_ref()
            .and_then(|s| s.to_agent.as_deref())
            .or(self.target.as_deref())
    }

    /// The agent that opened the turn.
    pub fn sender(&self) -> Option<&str> {
        self.send
            .as_ref()
            .and_then(|s| s.from_agent.as_deref())
            .or(self.sender.as_deref())
    }

    /// The Msg-Id of the turn's one response (a run's one terminal): derived from the exchange,
    /// so any republish collapses.
    pub fn response_msg_id(&self) -> String {
        match self.exchange {
            ExchangeKind::Turn => format!("turn:{}:{}", self.key, encode_id(&self.turn)),
            ExchangeKind::Run => format!("run:{}:{}", self.key, encode_id(&self.turn)),
        }
    }

    /// The KV key of this record in `partition`.
    pub fn record_key(&self, partition: u16) -> String {
        exchange_key(self.exchange, partition, &self.key, &self.turn)
    }
}

/// Turn-contract settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TurnConfig {
    pub default_timeout: Duration,
    pub max_timeout: Duration,
    /// `runs.timeout`: the deadline of every AG-UI run, counted from its `RUN_STARTED`.
    pub run_timeout: Duration,
    /// `turns.early_hold`: how long a response stored before its turn's send (a terminal before
    /// its run's `RUN_STARTED`) waits for it before it decides the turn alone; zero takes it at
    /// once.
    pub early_hold: Duration,
}

impl TurnConfig {
    pub(crate) fn exchange_timeout_ms(&self, ev: &TurnFacts) -> u64 {
        match ev.exchange {
            ExchangeKind::Turn => self.timeout_ms(ev.timeout_ms),
            ExchangeKind::Run => u64::try_from(self.run_timeout.as_millis()).unwrap_or(u64::MAX),
        }
    }

    pub(crate) fn timeout_ms(&self, requested: Option<u64>) -> u64 {
        let max = u64::try_from(self.max_timeout.as_millis()).unwrap_or(u64::MAX);
        match requested {
            Some(ms) if ms > 0 => ms.min(max),
            _ => u64::try_from(self.default_timeout.as_millis()).unwrap_or(max),
        }
    }
}

/// The compare-and-swap expectation of a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// The key must not exist.
    Absent,
    /// The key must still be at this revision.
    Revision(u64),
}

/// Why a response is not published as `a2a.response`: `late` (a real reply after a blocked
/// outcome), `duplicate` (any other further response), or `not_target` (a response whose speaker
/// is not the agent the turn was sent to: it never decides the turn).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SuppressReason {
    /// A real reply after a blocked outcome.
    Late,
    /// Any other further response.
    Duplicate,
    /// A response spoken by someone other than the turn's target (another agent, the asker's
    /// own reply, or a response that names no speaker), or a complete or an error named by an
    /// agent that is neither side of the turn.
    NotTarget,
}

impl SuppressReason {
    pub const ALL: [SuppressReason; 3] = [
        SuppressReason::Late,
        SuppressReason::Duplicate,
        SuppressReason::NotTarget,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SuppressReason::Late => "late",
            SuppressReason::Duplicate => "duplicate",
            SuppressReason::NotTarget => "not_target",
        }
    }
}

/// What to do for one event (or deadline), in this order: write, publish the winner, mark it
/// published, then project the event itself (or its suppression).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Step {
    /// Record to write first, with its CAS expectation.
    pub write: Option<(TurnRecord, Expect)>,
    /// The turn's response is due: the shell issues it once the write succeeded.
    pub respond: bool,
    /// Project the event itself on its role subject (after the winner when both).
    pub project_self: bool,
    /// Route the event to `a2a.response.suppressed` instead.
    pub suppress: Option<SuppressReason>,
    /// The raw sequence of an early response the send refused: published as suppressed
    /// `not_target` (read back from the raw stream), after the event's own projection.
    pub suppress_early: Option<u64>,
}
