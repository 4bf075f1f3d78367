//! The payloads the turn and run contracts write themselves: a blocked `a2a.response`, the
//! record of a suppressed further response or terminal, and the synthesised `run.failed` of a
//! run that timed out. Their JSON Schemas (`/api/schemas/...`) are derived from these types.

use super::record::{Reason, SuppressReason};
use crate::facets;
use crate::model::{Envelope, Role};
use chrono::{SecondsFormat, TimeZone, Utc};
use schemars::JsonSchema;
use serde::Serialize;
use serde_json::{Map, Value};

/// A piece of evidence of a blocked outcome or a run's timeout: a raw message, or the deadline.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(untagged)]
pub enum Evidence {
    Message(MessageEvidence),
    Deadline(DeadlineEvidence),
}

impl Evidence {
    /// The evidence as one line of text (`send raw#12, a2a.error raw#14, deadline <time>`).
    pub fn render(items: &[Evidence]) -> String {
        items
            .iter()
            .map(|e| match e {
                Evidence::Message(m) => format!("{} raw#{}", m.kind, m.raw_seq),
                Evidence::Deadline(d) => format!("deadline {}", d.at),
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// A raw message that is evidence: the send (or `RUN_STARTED`) that opened the exchange, or the
/// signal that decided it.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(deny_unknown_fields)]
pub struct MessageEvidence {
    /// What the message was to the exchange: `send`, `run.started`, or the event type that
    /// decided it (`a2a.response`, `a2a.complete`, `a2a.error`).
    #[schemars(extend("minLength" = 1))]
    pub kind: String,
    /// Its raw stream sequence.
    pub raw_seq: u64,
    /// Its raw subject.
    pub subject: String,
    /// Its store time (RFC 3339).
    #[schemars(extend("format" = "date-time"))]
    pub stored_at: String,
}

/// The deadline that passed, as evidence.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(deny_unknown_fields)]
pub struct DeadlineEvidence {
    pub kind: DeadlineKind,
    /// When the deadline was (RFC 3339): the send's store time plus its timeout.
    #[schemars(extend("format" = "date-time"))]
    pub at: String,
    /// The exchange's timeout in milliseconds.
    pub timeout_ms: u64,
}

/// Always `deadline`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum DeadlineKind {
    Deadline,
}

/// Always `blocked`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum BlockedOutcome {
    Blocked,
}

/// The payload of a blocked `a2a.response`: the turn's one response when no real reply came (a
/// deadline, an upstream failure, or `a2a.complete`/`a2a.error` without a reply). It follows the
/// seed's handoff sections (`goal`, `outcome`, `evidence`, `next_action`).
///
/// When an upstream response decided the turn, its own payload fields are kept beside these
/// (its `message` moves to `upstreamMessage`); otherwise the payload holds only these fields.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BlockedPayload {
    /// The upstream response's own `message`, when it had one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream_message: Option<Value>,
    /// Always `blocked`.
    pub outcome: BlockedOutcome,
    /// Why the turn is blocked.
    pub reason: Reason,
    /// What the turn attempted: the send's `goal`, else its message (shortened), else
    /// `turn <turn> of conversation <id>`.
    pub goal: String,
    /// The messages and the deadline that decided the outcome, in order.
    pub evidence: Vec<Evidence>,
    /// Whom to retry, with what, what to check first.
    #[serde(rename = "next_action")]
    pub next_action: String,
    /// Whether the processor wrote the response (no upstream response decided the turn).
    pub synthesized: bool,
    /// The four sections as text: `goal: ...\noutcome: ...\nevidence: ...\nnext_action: ...`.
    pub message: String,
    /// Synthesised only: the agent the reply would have come from (the send's target).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from_agent: Option<String>,
    /// Synthesised only: the agent the reply would have gone to (the send's sender).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub to_agent: Option<String>,
    /// Synthesised only: the conversation id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conversation_id: Option<String>,
    /// Synthesised only: the turn id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub turn: Option<String>,
    /// What the failure signal said, when it said something (an upstream `detail` is kept).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

impl BlockedPayload {
    /// Write the fields into `p` in order: a key already there keeps its place and takes the new
    /// value, except `detail`, which an upstream payload's own `detail` wins.
    pub fn write_into(&self, p: &mut Map<String, Value>) {
        let Ok(Value::Object(fields)) = serde_json::to_value(self) else {
            return;
        };
        for (k, v) in fields {
            if k == "detail" {
                p.entry(k).or_insert(v);
            } else {
                p.insert(k, v);
            }
        }
    }
}

/// The payload of `a2a.response.suppressed` and `run.terminal.suppressed`: a further response
/// (or run terminal), or a response from someone other than the turn's target, that is not
/// published as the exchange's one response, kept on `system.observability` with a pointer to
/// what won (or will win).
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(deny_unknown_fields)]
pub struct SuppressedPayload {
    /// `late`: a real reply after a blocked outcome; `duplicate`: any other further response;
    /// `not_target`: a response whose speaker is not the agent the turn was sent to.
    pub reason: SuppressReason,
    /// The exchange's one response.
    pub winner: WinnerRef,
    /// `a2a.response.suppressed`: the further response's own payload.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub response: Option<Value>,
    /// `run.terminal.suppressed`: the further terminal's own payload.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub terminal: Option<Value>,
}

impl SuppressedPayload {
    /// The record of a further event whose own payload was `original`.
    pub fn new(reason: SuppressReason, winner: WinnerRef, original: Option<Value>) -> Self {
        let (response, terminal) = match winner {
            WinnerRef::Turn(_) => (original, None),
            WinnerRef::Run(_) => (None, original),
        };
        SuppressedPayload {
            reason,
            winner,
            response,
            terminal,
        }
    }
}

/// What won the exchange: a turn's `a2a.response`, or a run's terminal.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(untagged)]
pub enum WinnerRef {
    Turn(TurnWinnerRef),
    Run(RunWinnerRef),
}

/// The `a2a.response` that won a turn.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(deny_unknown_fields)]
pub struct TurnWinnerRef {
    /// Its Msg-Id on the projection stream (`turn:<key>:<turn token>`).
    #[schemars(extend("pattern" = "^turn:"))]
    pub msg_id: String,
    /// The raw message that decided the turn; `null` for a deadline, and while it is pending.
    pub raw_seq: Option<u64>,
    /// `response` for a real reply, `blocked` for a blocked outcome, `pending` for a turn not
    /// decided yet.
    pub outcome: TurnOutcome,
    /// Why it is blocked; `null` for a real reply.
    pub reason: Option<Reason>,
    /// The conversation id.
    pub conversation_id: String,
    /// The turn id.
    pub turn: String,
}

/// How a turn was decided; `pending` while it is not (a `not_target` response to an open turn:
/// the turn's one response will carry `msgId` when it comes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum TurnOutcome {
    Blocked,
    Response,
    Pending,
}

/// The terminal that won a run.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(deny_unknown_fields)]
pub struct RunWinnerRef {
    /// Its Msg-Id on the projection stream (`run:<key>:<run token>`).
    #[schemars(extend("pattern" = "^run:"))]
    pub msg_id: String,
    /// The raw message of the winning terminal; `null` for a timeout.
    pub raw_seq: Option<u64>,
    /// `terminal` for a real `RUN_FINISHED`/`RUN_ERROR`, `timeout` for a synthesised
    /// `run.failed`.
    pub outcome: RunOutcome,
    /// The run id.
    pub run_id: String,
    /// The run's AG-UI thread, when it named one.
    pub thread_id: Option<String>,
}

/// How a run was decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum RunOutcome {
    /// Not decided yet: the suppressed terminal was another agent's, the run is still open.
    Pending,
    Timeout,
    Terminal,
}

/// Always `RUN_ERROR`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
pub enum RunErrorType {
    #[serde(rename = "RUN_ERROR")]
    RunError,
}

/// The payload of the `run.failed` the processor writes for a run that stored no `RUN_FINISHED`
/// or `RUN_ERROR` by its deadline (docs/contract.md section 2b).
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(deny_unknown_fields)]
pub struct RunFailedPayload {
    /// The AG-UI event type it stands for: `RUN_ERROR`.
    pub ag_ui_type: RunErrorType,
    /// Always `timeout`.
    pub reason: Reason,
    /// Always `true`: the processor wrote it.
    pub synthesized: bool,
    /// What happened, for a person.
    pub message: String,
    /// The run's `RUN_STARTED` and its deadline.
    pub evidence: Vec<Evidence>,
}

impl RunFailedPayload {
    pub fn into_map(self) -> Map<String, Value> {
        match serde_json::to_value(self) {
            Ok(Value::Object(m)) => m,
            _ => Map::new(),
        }
    }
}

/// Milliseconds since the epoch as RFC 3339 UTC with milliseconds.
pub(crate) fn rfc3339(ms: i64) -> String {
    Utc.timestamp_millis_opt(ms)
        .single()
        .map(|t| t.to_rfc3339_opts(SecondsFormat::Millis, true))
        .unwrap_or_default()
}

/// A further response or terminal, kept on `system.observability` as `event_type`: the reason,
/// `winner_ref` pointing at what won, and the event's own payload (under `response` for a turn,
/// `terminal` for a run).
pub(crate) fn suppression(
    env: &Envelope,
    event_type: &str,
    reason: SuppressReason,
    winner_ref: WinnerRef,
) -> Envelope {
    let mut out = env.clone();
    out.event_type = event_type.into();
    out.event_role = Some(Role::SystemObservability);
    out.owner = None;
    out.scope = None;
    out.phase = None;
    out.surface = None;
    out.persistence = None;
    let original = out.payload.take();
    let record = SuppressedPayload::new(reason, winner_ref, original);
    out.payload = serde_json::to_value(record).ok();
    facets::apply(&mut out, &facets::derive(event_type, None, false));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::facts::TYPE_FIELD;
    use serde_json::json;

    #[test]
    fn the_run_failed_type_field_is_the_agui_type_field() {
        let p = RunFailedPayload {
            ag_ui_type: RunErrorType::RunError,
            reason: Reason::Timeout,
            synthesized: true,
            message: String::new(),
            evidence: Vec::new(),
        };
        assert_eq!(p.into_map()[TYPE_FIELD], json!("RUN_ERROR"));
    }

    #[test]
    fn blocked_fields_keep_an_upstream_payloads_order_and_detail() {
        let mut p = json!({"message": "upstream", "detail": "theirs", "x": 1});
        let fields = BlockedPayload {
            upstream_message: Some(json!("upstream")),
            outcome: BlockedOutcome::Blocked,
            reason: Reason::Error,
            goal: "g".into(),
            evidence: Vec::new(),
            next_action: "n".into(),
            synthesized: false,
            message: "m".into(),
            from_agent: None,
            to_agent: None,
            conversation_id: None,
            turn: None,
            detail: Some("ours".into()),
        };
        if let Some(m) = p.as_object_mut() {
            fields.write_into(m);
        }
        assert_eq!(
            p.to_string(),
            r#"{"message":"m","detail":"theirs","x":1,"upstreamMessage":"upstream","outcome":"blocked","reason":"error","goal":"g","evidence":[],"next_action":"n","synthesized":false}"#
        );
    }
}
