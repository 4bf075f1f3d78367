//! Who is waited on, and since when (pure): the turns and runs of assembled threads that are
//! waiting now. `GET /api/waiting` serves the list.
//!
//! - A turn whose answer asks for input or credentials (A2A `input-required`, `auth-required`):
//!   the answering agent waits on the asker, since the answer.
//! - A run that ended on an interrupt (AG-UI `RUN_FINISHED` with an interrupt outcome): its agent
//!   waits on the interrupt's assignee (else nobody named), for the interrupt's reason, since the
//!   run ended.
//! - A turn still awaiting its reply: the asker waits on the asked, for a reply, since the send.
//!   (Past its deadline the turn contract answers it with a blocked timeout, which ends the wait.)
//!
//! A wait ends when its turn or run resumes or ends: a later turn sent in the same conversation
//! ends the waits of its earlier turns; a later run started in the same thread ends the waits of
//! its earlier runs.

use crate::threads::{RunOutcome, ThreadView, TurnOutcome};
use schemars::JsonSchema;
use serde::Serialize;

/// What waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum WaitKind {
    Turn,
    Run,
}

/// One wait.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(deny_unknown_fields)]
pub struct Wait {
    pub kind: WaitKind,
    /// The key of its thread (`GET /api/threads/{key}`).
    pub key: String,
    /// The run or turn in the thread (`run:<id>`, `turn:<id>`); the viewer's link is
    /// `#thread=<key>&item=<item>`.
    pub item: String,
    /// Who waits (an agent), when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub who: Option<String>,
    /// On whom, when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub on: Option<String>,
    /// For what: `input` or `auth` (an answer asking for them), `reply` (a turn not yet
    /// answered), or an interrupt's reason (`approval`, ...).
    #[serde(rename = "for")]
    pub waiting_for: String,
    /// The question or prompt, when there is one (the answer asking for input, the request
    /// awaiting a reply, the run's last message).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    /// Since when (RFC 3339, event time).
    pub since: String,
}

/// Characters of a prompt kept.
const PROMPT_CHARS: usize = 300;

fn clip(s: &str) -> String {
    if s.chars().count() <= PROMPT_CHARS {
        return s.to_string();
    }
    let mut out: String = s.chars().take(PROMPT_CHARS - 1).collect();
    out.push('…');
    out
}

fn ms(at: Option<&str>) -> Option<i64> {
    at.and_then(|a| chrono::DateTime::parse_from_rfc3339(a).ok())
        .map(|t| t.timestamp_millis())
}

/// The waits of one assembled thread, oldest first.
pub fn of_thread(t: &ThreadView) -> Vec<Wait> {
    let mut out = Vec::new();
    for turn in &t.turns {
        let (who, on, waiting_for, prompt, since) = match turn.outcome {
            TurnOutcome::Waiting => (
                turn.to_agent.clone(),
                turn.from_agent.clone(),
                turn.waiting_for.clone().unwrap_or_else(|| "input".into()),
                turn.reply.clone(),
                turn.answered_at.clone(),
            ),
            TurnOutcome::AwaitingReply => (
                turn.from_agent.clone(),
                turn.to_agent.clone(),
                "reply".to_string(),
                turn.request.clone(),
                turn.sent_at.clone(),
            ),
            TurnOutcome::Answered | TurnOutcome::Blocked => continue,
        };
        let Some(since) = since else { continue };
        // An answer asking for input is resumed by another send at or after it; a turn
        // awaiting its reply waits until the reply (or the deadline's blocked answer) comes.
        let resumed = turn.outcome == TurnOutcome::Waiting
            && ms(Some(&since)).is_some_and(|s| {
                t.turns.iter().any(|other| {
                    other.turn_id != turn.turn_id
                        && ms(other.sent_at.as_deref()).is_some_and(|sent| sent >= s)
                })
            });
        if resumed {
            continue;
        }
        out.push(Wait {
            kind: WaitKind::Turn,
            key: t.key.clone(),
            item: format!("turn:{}", turn.turn_id),
            who,
            on,
            waiting_for,
            prompt: prompt.map(|p| clip(&p)),
            since,
        });
    }
    for run in &t.runs {
        if run.outcome != RunOutcome::Waiting {
            continue;
        }
        let Some(since) = run.ended_at.clone() else {
            continue;
        };
        // Resumed by another run of the thread started at or after it ended.
        let resumed = ms(Some(&since)).is_some_and(|s| {
            t.runs.iter().any(|other| {
                other.run_id != run.run_id
                    && ms(other.started_at.as_deref()).is_some_and(|start| start >= s)
            })
        });
        if resumed {
            continue;
        }
        let prompt = run
            .messages
            .iter()
            .rev()
            .find(|m| m.role.as_deref() != Some("user"))
            .map(|m| clip(&m.text));
        out.push(Wait {
            kind: WaitKind::Run,
            key: t.key.clone(),
            item: format!("run:{}", run.run_id),
            who: run.agent.clone(),
            on: run.waiting_on.clone(),
            waiting_for: run.waiting_for.clone().unwrap_or_else(|| "input".into()),
            prompt,
            since,
        });
    }
    out.sort_by_key(|w| ms(Some(&w.since)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Envelope;
    use crate::threads::{assemble, Stored};
    use crate::usage::Prices;
    use serde_json::{json, Value};

    fn thread(events: &[Value]) -> ThreadView {
        let envs: Vec<Envelope> = events
            .iter()
            .map(|v| serde_json::from_value(v.clone()).unwrap_or_default())
            .collect();
        let stored: Vec<Stored<'_>> = envs
            .iter()
            .map(|e| Stored {
                envelope: e,
                stored_at: "2026-11-26T10:00:00.000Z",
            })
            .collect();
        assemble("k", &stored, false, &Prices::default())
    }

    fn at(s: u32) -> String {
        format!("2026-11-26T10:00:{s:02}.000Z")
    }

    #[test]
    fn an_answer_asking_for_input_waits_on_the_asker_until_the_next_send() {
        let send = |turn: &str, s: u32| {
            json!({"type": "a2a.send", "conversationId": "c", "turnId": turn, "timestamp": at(s),
                "payload": {"fromAgent": "main", "toAgent": "travel", "message": "book a flight"}})
        };
        let ask = json!({"type": "a2a.response", "conversationId": "c", "turnId": "1",
            "timestamp": at(2), "payload": {"fromAgent": "travel", "toAgent": "main",
            "state": "input-required", "message": "Which date?"}});
        let waits = of_thread(&thread(&[send("1", 1), ask.clone()]));
        assert_eq!(waits.len(), 1, "{waits:?}");
        let w = &waits[0];
        assert_eq!(w.kind, WaitKind::Turn);
        assert_eq!(w.item, "turn:1");
        assert_eq!(w.who.as_deref(), Some("travel"));
        assert_eq!(w.on.as_deref(), Some("main"));
        assert_eq!(w.waiting_for, "input");
        assert_eq!(w.prompt.as_deref(), Some("Which date?"));
        assert_eq!(w.since, at(2));
        // The asker answers with a new send: the wait is over, and the new turn awaits its reply.
        let waits = of_thread(&thread(&[send("1", 1), ask, send("2", 5)]));
        assert_eq!(waits.len(), 1, "{waits:?}");
        assert_eq!(waits[0].item, "turn:2");
        assert_eq!(waits[0].waiting_for, "reply");
        assert_eq!(waits[0].who.as_deref(), Some("main"));
        assert_eq!(waits[0].on.as_deref(), Some("travel"));
        assert_eq!(waits[0].since, at(5));
    }

    #[test]
    fn answered_and_blocked_turns_wait_for_nothing() {
        let waits = of_thread(&thread(&[
            json!({"type": "a2a.send", "conversationId": "c", "turnId": "1", "timestamp": at(1),
                "payload": {"fromAgent": "main", "toAgent": "travel"}}),
            json!({"type": "a2a.response", "conversationId": "c", "turnId": "1", "timestamp": at(2),
                "payload": {"outcome": "blocked", "reason": "timeout"}}),
            json!({"type": "a2a.send", "conversationId": "c", "turnId": "2", "timestamp": at(3),
                "payload": {"fromAgent": "main", "toAgent": "travel"}}),
            json!({"type": "a2a.response", "conversationId": "c", "turnId": "2", "timestamp": at(4),
                "payload": {"message": "done"}}),
        ]));
        assert!(waits.is_empty(), "{waits:?}");
    }

    #[test]
    fn a_run_ended_on_an_interrupt_waits_on_its_assignee_until_a_run_resumes_it() {
        let started = |id: &str, s: u32| {
            json!({"type": "run.started", "runId": id, "timestamp": at(s), "agentId": "planner",
                "payload": {"agUiType": "RUN_STARTED"}})
        };
        let msg = json!({"type": "text.delta", "runId": "r1", "messageId": "m1", "timestamp": at(2),
            "payload": {"agUiType": "TEXT_MESSAGE_CONTENT", "role": "assistant", "delta": "May I book it?"}});
        let interrupted = json!({"type": "run.finished", "runId": "r1", "timestamp": at(3),
            "payload": {"agUiType": "RUN_FINISHED", "outcome": {"type": "interrupt",
                "interrupts": [{"reason": "approval", "assignee": "ops-lead"}]}}});
        let waits = of_thread(&thread(&[
            started("r1", 1),
            msg.clone(),
            interrupted.clone(),
        ]));
        assert_eq!(waits.len(), 1, "{waits:?}");
        let w = &waits[0];
        assert_eq!((w.kind, w.item.as_str()), (WaitKind::Run, "run:r1"));
        assert_eq!(w.who.as_deref(), Some("planner"));
        assert_eq!(w.on.as_deref(), Some("ops-lead"));
        assert_eq!(w.waiting_for, "approval");
        assert_eq!(w.prompt.as_deref(), Some("May I book it?"));
        assert_eq!(w.since, at(3));
        let waits = of_thread(&thread(&[
            started("r1", 1),
            msg,
            interrupted,
            started("r2", 9),
        ]));
        assert!(waits.is_empty(), "a resumed run waits no more: {waits:?}");
    }
}
