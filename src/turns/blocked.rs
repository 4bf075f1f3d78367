//! The messages the turn contract publishes: the turn's one `a2a.response` (a real reply, an
//! upstream failure normalised into a blocked outcome, or a synthesised blocked outcome) and the
//! `a2a.response.suppressed` record of any further response.

use super::payload::{rfc3339, suppression};
use super::payload::{
    BlockedOutcome, BlockedPayload, DeadlineEvidence, DeadlineKind, Evidence, MessageEvidence,
    TurnOutcome, TurnWinnerRef, WinnerRef,
};
use super::{ExchangeKind, Reason, SuppressReason, TurnRecord, Winner};
use crate::facets;
use crate::model::{Envelope, RawEventRef, Role};
use serde_json::{Map, Value};

const SECTIONS: [&str; 4] = ["goal", "outcome", "evidence", "next_action"];

/// Read the seed's handoff sections (`goal:`, `outcome:`, `evidence:`, `next_action:`) from a
/// message text. All four must be present; a section runs until the next one.
pub fn parse_sections(text: &str) -> Option<Map<String, Value>> {
    let mut found: Map<String, Value> = Map::new();
    let mut current: Option<&str> = None;
    let mut buf = String::new();
    let flush = |found: &mut Map<String, Value>, current: Option<&str>, buf: &mut String| {
        if let Some(name) = current {
            found.insert(name.to_string(), Value::String(buf.trim().to_string()));
        }
        buf.clear();
    };
    for line in text.lines() {
        let trimmed = line.trim_start().trim_start_matches(|c: char| {
            c == '-' || c == '*' || c == '#' || c.is_ascii_digit() || c == '.' || c == ' '
        });
        let lower = trimmed.to_ascii_lowercase();
        let hit = SECTIONS.iter().find(|s| {
            lower.starts_with(*s) && lower[s.len()..].trim_start().starts_with([':', '='])
        });
        if let Some(name) = hit {
            flush(&mut found, current, &mut buf);
            current = Some(name);
            let rest = trimmed[name.len()..].trim_start();
            buf.push_str(rest[1..].trim());
        } else if current.is_some() {
            buf.push('\n');
            buf.push_str(line);
        }
    }
    flush(&mut found, current, &mut buf);
    SECTIONS
        .iter()
        .all(|s| found.contains_key(*s))
        .then_some(found)
}

/// The next action for a blocked turn: whom to retry, with what, what to check.
pub fn next_action(rec: &TurnRecord, reason: Reason, detail: Option<&str>) -> String {
    let send = rec.send.as_ref();
    if let Some(method) = send.and_then(|s| s.a2a_method.as_deref()) {
        return a2a_next_action(rec, method, reason, detail);
    }
    let to = rec.target().unwrap_or("the target agent");
    let from = rec.sender().unwrap_or("the sender");
    let turn = &rec.turn;
    let conv = &rec.conversation_id;
    match reason {
        Reason::Timeout => {
            let waited = send.map(|s| s.timeout_ms).unwrap_or(0);
            let within = if waited >= 1000 && waited % 1000 == 0 {
                format!("{}s", waited / 1000)
            } else {
                format!("{waited} ms")
            };
            format!(
                "{to} did not answer turn {turn} of conversation {conv} within {within}. Check that {to} is running and consuming its inbox{}; then {from} should resend the goal to {to} with timeoutMs {} or hand it to another main agent.",
                send.and_then(|s| s.run_id.as_deref())
                    .map(|r| format!(" (run {r})"))
                    .unwrap_or_default(),
                (waited * 2).max(60_000)
            )
        }
        Reason::NotFound => format!(
            "{to}'s session for turn {turn} of conversation {conv} was not found{}. Verify that agent {to} exists and its main session is started, then {from} should resend turn {turn}.",
            send.and_then(|s| s.target_session_key.as_deref())
                .map(|k| format!(" (target session {k})"))
                .unwrap_or_default()
        ),
        Reason::Error => format!(
            "{to} failed turn {turn} of conversation {conv}{}. Inspect {to}'s logs{}, fix the cause, then {from} should resend turn {turn} to {to}.",
            detail.map(|d| format!(": {d}")).unwrap_or_default(),
            send.and_then(|s| s.run_id.as_deref())
                .map(|r| format!(" for run {r}"))
                .unwrap_or_default()
        ),
    }
}

/// Give an A2A response the artifacts its exchange streamed before it: `payload.artifacts`
/// (the artifact objects, in order, before any the answer carries itself), and their text as the
/// `message` when the answer has no text of its own.
pub fn attach_artifacts(env: &mut Envelope, streamed: Vec<Value>) {
    if streamed.is_empty() {
        return;
    }
    let text: Vec<String> = streamed
        .iter()
        .filter_map(|a| a.get("parts").and_then(Value::as_array))
        .flat_map(|parts| parts.iter())
        .filter(|p| p.get("kind").is_none_or(|k| k == "text"))
        .filter_map(|p| p.get("text").and_then(Value::as_str).map(str::to_string))
        .collect();
    let p = env.payload_object();
    let mut all = streamed;
    if let Some(Value::Array(own)) = p.get("artifacts") {
        all.extend(own.iter().cloned());
    }
    p.insert("artifacts".into(), Value::Array(all));
    let has_text = p
        .get("message")
        .and_then(Value::as_str)
        .is_some_and(|m| !m.trim().is_empty());
    if !has_text && !text.is_empty() {
        p.insert("message".into(), Value::String(text.concat()));
    }
}

/// The next action for a blocked A2A request, in A2A's terms: which agent, which context,
/// which method to retry with.
fn a2a_next_action(rec: &TurnRecord, method: &str, reason: Reason, detail: Option<&str>) -> String {
    let to = rec.target().unwrap_or("the agent");
    let from = rec.sender().unwrap_or("the caller");
    let ctx = &rec.conversation_id;
    let v1 = !method.contains('/');
    let (get, send) = if v1 {
        ("GetTask", "SendMessage")
    } else {
        ("tasks/get", "message/send")
    };
    match reason {
        Reason::Timeout => {
            let waited = rec.send.as_ref().map(|s| s.timeout_ms).unwrap_or(0);
            format!(
                "{to} did not answer {method} request {} in context {ctx} within {} ms. Check that {to}'s A2A endpoint is up; if it created a task, {from} can poll it with {get}, else retry with {send} in context {ctx}.",
                rec.turn, waited
            )
        }
        Reason::NotFound => format!(
            "{to} has no such task for {method} request {} in context {ctx}{}. {from} should start a new task: {send} without a taskId, in context {ctx}.",
            rec.turn,
            detail.map(|d| format!(" ({d})")).unwrap_or_default()
        ),
        Reason::Error => format!(
            "{to} failed {method} request {} in context {ctx}{}. Inspect the task with {get}, fix the cause, then {from} should retry with {send} in context {ctx}.",
            rec.turn,
            detail.map(|d| format!(": {d}")).unwrap_or_default()
        ),
    }
}

fn evidence(rec: &TurnRecord, winner: &Winner, signal: Option<&RawEventRef>) -> Vec<Evidence> {
    let mut items = Vec::new();
    if let Some(s) = &rec.send {
        items.push(Evidence::Message(MessageEvidence {
            kind: "send".into(),
            raw_seq: s.seq,
            subject: s.subject.clone(),
            stored_at: rfc3339(s.stored_ms),
        }));
    }
    if let Some(sig) = signal {
        items.push(Evidence::Message(MessageEvidence {
            kind: winner.by.clone(),
            raw_seq: sig.seq,
            subject: sig.subject.clone(),
            stored_at: sig.stored_at.clone(),
        }));
    }
    if let Some(s) = &rec.send {
        let deadline = s
            .stored_ms
            .saturating_add(i64::try_from(s.timeout_ms).unwrap_or(0));
        items.push(Evidence::Deadline(DeadlineEvidence {
            kind: DeadlineKind::Deadline,
            at: rfc3339(deadline),
            timeout_ms: s.timeout_ms,
        }));
    }
    items
}

/// Build the turn's one `a2a.response`.
///
/// `decider` is the normalised event that decided the turn (the reply, or the failure signal),
/// absent for a deadline.
///
/// For a run (docs/contract.md section 2b) the exchange kind chooses: its one terminal event instead (see
/// [`super::runs::terminal`]).
pub fn winner_response(rec: &TurnRecord, decider: Option<&Envelope>) -> Envelope {
    if rec.exchange == ExchangeKind::Run {
        return super::runs::terminal(rec, decider);
    }
    let Some(winner) = rec.winner.as_ref() else {
        return decider.cloned().unwrap_or_default();
    };
    match (winner.blocked, decider) {
        (None, Some(env)) => real_reply(env),
        (blocked, decider) => {
            blocked_response(rec, winner, blocked.unwrap_or(Reason::Error), decider)
        }
    }
}

/// A real reply: its content as it is, with the handoff sections exposed when present.
fn real_reply(env: &Envelope) -> Envelope {
    let mut env = env.clone();
    env.event_type = "a2a.response".into();
    env.event_role = Some(Role::ConversationMain);
    let text = env
        .payload
        .as_ref()
        .and_then(|p| p.get("message"))
        .and_then(Value::as_str)
        .map(str::to_string);
    if let Some(sections) = text.as_deref().and_then(parse_sections) {
        let p = env.payload_object();
        for (k, v) in sections {
            p.entry(k).or_insert(v);
        }
    }
    env
}

/// The blocked outcome: the upstream failure normalised (starting from its envelope, so nothing
/// it said is lost), or one synthesised for the turn.
fn blocked_response(
    rec: &TurnRecord,
    winner: &Winner,
    reason: Reason,
    decider: Option<&Envelope>,
) -> Envelope {
    let send = rec.send.as_ref();
    let signal_ref = decider.and_then(|d| d.raw_event_ref.clone());
    let ev = evidence(rec, winner, signal_ref.as_ref());
    let goal = send
        .and_then(|s| s.goal.clone())
        .unwrap_or_else(|| format!("turn {} of conversation {}", rec.turn, rec.conversation_id));
    let next = next_action(rec, reason, winner.detail.as_deref());
    let outcome_line = format!(
        "blocked ({reason}){}",
        winner
            .detail
            .as_deref()
            .map(|d| format!(": {d}"))
            .unwrap_or_default()
    );
    let message = format!(
        "goal: {goal}\noutcome: {outcome_line}\nevidence: {}\nnext_action: {next}",
        Evidence::render(&ev)
    );
    let mut env = match (decider, winner.synthesized) {
        (Some(d), false) => d.clone(),
        _ => Envelope::default(),
    };
    let upstream_message = env.payload.as_ref().and_then(|p| p.get("message")).cloned();
    env.event_type = "a2a.response".into();
    env.event_role = Some(Role::ConversationMain);
    env.phase = None;
    if winner.synthesized {
        synthesised_slots(&mut env, rec, winner, decider, signal_ref);
    }
    // The reply that did not come would have gone from the target to the sender.
    let synthesized_only = |v: Option<&str>| v.filter(|_| winner.synthesized).map(str::to_string);
    let fields = BlockedPayload {
        upstream_message,
        outcome: BlockedOutcome::Blocked,
        reason,
        goal,
        evidence: ev,
        next_action: next,
        synthesized: winner.synthesized,
        message,
        from_agent: synthesized_only(rec.target()),
        to_agent: synthesized_only(rec.sender()),
        conversation_id: synthesized_only(Some(&rec.conversation_id)),
        turn: synthesized_only(Some(&rec.turn)),
        detail: winner.detail.clone(),
    };
    fields.write_into(env.payload_object());
    facets::apply(&mut env, &facets::derive("a2a.response", None, true));
    env
}

/// The envelope slots of a synthesised outcome: its time, the turn's conversation and work
/// session, the target as the agent, and where it came from (the signal, else the send).
fn synthesised_slots(
    env: &mut Envelope,
    rec: &TurnRecord,
    winner: &Winner,
    decider: Option<&Envelope>,
    signal_ref: Option<RawEventRef>,
) {
    let send = rec.send.as_ref();
    env.timestamp = Some(rfc3339(winner.at_ms));
    env.conversation_id = Some(Value::String(rec.conversation_id.clone()));
    env.agent_id = rec.target().map(|t| Value::String(t.to_string()));
    if env.work_session_id.is_none() {
        env.work_session_id = send
            .and_then(|s| s.work_session_id.clone())
            .map(Value::String);
    }
    env.raw_event_ref = signal_ref.or_else(|| {
        send.map(|s| RawEventRef {
            stream: String::new(),
            seq: s.seq,
            subject: s.subject.clone(),
            stored_at: rfc3339(s.stored_ms),
        })
    });
    if let (Some(r), Some(d)) = (env.raw_event_ref.as_mut(), decider) {
        if let Some(dr) = &d.raw_event_ref {
            r.stream = dr.stream.clone();
        }
    }
}

/// The record of a response that is not published as `a2a.response`: a further one, or one
/// whose speaker is not the turn's target (the turn may still be open: its winner is then
/// `pending`).
/// A further terminal of a run goes to `run.terminal.suppressed` instead.
pub fn suppressed(env: &Envelope, rec: &TurnRecord, reason: SuppressReason) -> Envelope {
    if rec.exchange == ExchangeKind::Run {
        return super::runs::suppressed(env, rec, reason);
    }
    let winner = rec.winner.as_ref();
    let winner_ref = WinnerRef::Turn(TurnWinnerRef {
        msg_id: rec.response_msg_id(),
        raw_seq: winner.and_then(|w| w.seq),
        outcome: match winner {
            None => TurnOutcome::Pending,
            Some(w) if w.blocked.is_some() => TurnOutcome::Blocked,
            Some(_) => TurnOutcome::Response,
        },
        reason: winner.and_then(|w| w.blocked),
        conversation_id: rec.conversation_id.clone(),
        turn: rec.turn.clone(),
    });
    suppression(env, "a2a.response.suppressed", reason, winner_ref)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sections_are_parsed_only_when_all_four_are_present() {
        let text = "goal: ship it\noutcome: success - merged\nevidence: PR #12\n  tests green\nnext_action: deploy";
        let s = parse_sections(text).unwrap_or_default();
        assert_eq!(s["goal"], "ship it");
        assert_eq!(s["evidence"], "PR #12\n  tests green");
        assert_eq!(s["next_action"], "deploy");
        assert!(parse_sections("goal: x\noutcome: y").is_none());
        assert!(
            parse_sections("1. Goal: a\n2. Outcome: b\n3. Evidence: c\n4. Next_action: d")
                .is_some()
        );
    }
}
