//! The turn contract (docs/contract.md section 4): exactly one `a2a.response` per turn.
//!
//! This module is pure: it reads the facts of an `a2a.*` event ([`TurnFacts`]), looks at the
//! turn's persisted [`TurnRecord`], and returns a [`Step`] saying what to write (with the
//! compare-and-swap expectation), what to publish and what to project. The bus sends the record
//! write (the fence) and the publishes in order without waiting, acknowledges the input once all
//! of them are stored, and marks the record published once its response is stored.
//!
//! Time is event time: the raw stream's store time. Deadlines fire only when the partition's
//! watermark (every message stored before it has been processed) has passed them, so a reply
//! stored before the deadline wins even when a crash delays its processing.

pub mod blocked;
pub mod book;
pub mod payload;
pub mod runs;

mod record;

pub use record::*;

/// Decide what an event does to its turn. `current` is the persisted record with its revision.
pub fn on_event(current: Option<(&TurnRecord, u64)>, ev: &TurnFacts, cfg: &TurnConfig) -> Step {
    if let Some((rec, rev)) = current {
        if let Some(held) = as_held_before_its_send(rec, ev) {
            // Processed again after the send that refused the early response it came after (the
            // turn open or decided since): it does what it did then, while the response was
            // held, and decides nothing.
            return own_outputs_only(on_event(Some((&held, rev)), ev, cfg));
        }
        if !spoken_by_target(rec, ev) {
            // Only the agent the turn was sent to answers it: anyone else's response is kept
            // beside the turn, never as its response. A decision not yet published is published
            // again, as for any further response.
            return Step {
                respond: republished_at(rec, ev.seq),
                suppress: Some(SuppressReason::NotTarget),
                ..Step::default()
            };
        }
        if !spoken_by_a_side(rec, ev) {
            // A complete or an error named by an agent that is neither side of the turn is kept
            // beside it like a foreign response and decides nothing: only the asker or the
            // target can end a turn.
            return Step {
                respond: republished_at(rec, ev.seq),
                suppress: Some(SuppressReason::NotTarget),
                ..Step::default()
            };
        }
    }
    match (current, ev.kind) {
        (None, TurnEventKind::Send) => open_turn(ev, cfg),
        // The send of a turn holding an early response, before the hold's deadline: the send
        // names the target, so now the early response is taken or refused.
        (Some((rec, rev)), TurnEventKind::Send) if rec.holds_early_at(ev.stored_ms) => {
            send_after_early(rec, rev, ev, cfg)
        }
        // A send for a turn that exists already (a duplicate send, or a send that arrives after
        // its response) starts no timer. A decision not yet published is published again, as
        // for any other event after its winner (the send that took an early response, delivered
        // again, publishes it), and the redelivery of a send that refused an early response
        // publishes that response's suppression again.
        (Some((rec, _)), TurnEventKind::Send) if !rec.holds_early() => Step {
            respond: republished_at(rec, ev.seq),
            project_self: true,
            suppress_early: refused_by(rec, ev.seq),
            ..Step::default()
        },
        // A response before any send is held until a send names the turn's target (or the
        // hold's deadline passes): taking it at once would let anyone answer a turn whose
        // send has not arrived, with nothing to check its speaker against.
        // A ping-pong reply (spoken between the previous turn's two sides, which the shell
        // checked) continues an exchange those two already hold, so it is taken at once.
        (None, TurnEventKind::Response) if !cfg.early_hold.is_zero() && !ev.follows_previous => {
            hold_early(ev, cfg)
        }
        // The first complete or error (or, with no hold, response) decides an undecided turn.
        (None, kind) => decide(unopened(ev, kind), Expect::Absent, ev, kind),
        // Stored after the open turn's deadline: in event time the turn timed out first, and
        // this event comes after that decision. A partition fires deadlines before the events
        // stored after them, so this matters only when the record is read (from the store)
        // without its deadline in the partition's book, as after a takeover: a late reply can
        // never win, whatever the book holds.
        (Some((rec, rev)), kind)
            if rec.state == TurnState::Open
                && rec.deadline_ms.is_some_and(|d| d < ev.stored_ms) =>
        {
            timed_out_before(rec, rev, ev, kind)
        }
        // Before the send, an event does what it will do once the held response decides the
        // turn (a further response is suppressed, having passed the check against the held
        // speaker above; a complete or an error is projected), but publishes nothing and
        // decides nothing: only the send says whether the held response is the answer.
        (Some((rec, _)), kind) if rec.holds_early() => match decided_by_early(rec) {
            Some(decided) => own_outputs_only(after_decision(&decided, ev, kind)),
            None => Step::default(),
        },
        (Some((rec, rev)), kind) if rec.state == TurnState::Open => {
            decide(rec.clone(), Expect::Revision(rev), ev, kind)
        }
        (Some((rec, _)), kind) => after_decision(rec, ev, kind),
    }
}

/// The turn before `ev`'s in its conversation, for a response that may be a ping-pong reply:
/// turn `n - 1` when `ev`'s turn id is a decimal `n >= 1`. `None` for runs and for any other
/// turn id.
pub fn previous_turn(ev: &TurnFacts) -> Option<String> {
    if ev.exchange != ExchangeKind::Turn || ev.kind != TurnEventKind::Response {
        return None;
    }
    let turn = ev.turn.as_str();
    if turn.is_empty() || !turn.bytes().all(|b| b.is_ascii_digit()) || turn.starts_with('0') {
        return None;
    }
    let n: u64 = turn.parse().ok()?;
    Some((n - 1).to_string())
}

/// Whether the response `ev` continues the exchange held in `prev`, the record of the
/// conversation's previous turn ([`previous_turn`]): its speaker is one side of that turn (the
/// agent that asked, or the one asked) and the agent it answers, when it names one, is the other.
/// Such a reply, stored before any send of its own turn, is the origin's ping-pong reply (turn
/// `n`, which no send opens): only an agent already in the conversation can speak it. Only what
/// was stored before `ev` counts (see [`sides_vouched_at`]), so the answer is the same however
/// late, and however often, `ev` is processed.
pub fn continues_previous(prev: &TurnRecord, ev: &TurnFacts) -> bool {
    if !sides_vouched_at(prev, ev) {
        return false;
    }
    let (Some(asker), Some(asked)) = (named(prev.sender()), named(prev.target())) else {
        return false;
    };
    let Some(speaker) = named(ev.from_agent.as_deref()) else {
        return false;
    };
    let other = if speaker.eq_ignore_ascii_case(asker) {
        asked
    } else if speaker.eq_ignore_ascii_case(asked) {
        asker
    } else {
        return false;
    };
    named(ev.to_agent.as_deref()).is_none_or(|to| to.eq_ignore_ascii_case(other))
}

/// Whether the sides of the turn `prev` were settled by messages stored before `ev`: its send, or,
/// for a turn no send opened, the real response that decided it (taken, or held past its hold's
/// deadline in event time). A turn ended by a complete or an error before any send (its sides
/// are whatever that event named), one still holding an early response (a forgery may be
/// waiting for its send to refuse it), and anything stored after `ev` vouch for nobody.
fn sides_vouched_at(prev: &TurnRecord, ev: &TurnFacts) -> bool {
    if let Some(send) = &prev.send {
        return send.seq < ev.seq;
    }
    let Some(by) = prev
        .winner
        .as_ref()
        .or(prev.early.as_ref().map(|e| &e.winner))
    else {
        return false;
    };
    if by.synthesized || by.seq.is_none_or(|seq| seq >= ev.seq) {
        return false;
    }
    !prev.holds_early_at(ev.stored_ms)
}

/// A response with no turn yet: the turn's record holds it until `turns.early_hold` after it was
/// stored, and nothing is published yet.
fn hold_early(ev: &TurnFacts, cfg: &TurnConfig) -> Step {
    let hold_ms = u64::try_from(cfg.early_hold.as_millis()).unwrap_or(u64::MAX);
    let record = TurnRecord {
        deadline_ms: Some(
            ev.stored_ms
                .saturating_add(i64::try_from(hold_ms).unwrap_or(i64::MAX)),
        ),
        // Its speaker is the record's `target`, as for any response no send opened.
        early: Some(Early {
            winner: winner_of(ev, TurnEventKind::Response),
            refused: false,
        }),
        ..unopened(ev, TurnEventKind::Response)
    };
    Step {
        write: Some((record, Expect::Absent)),
        ..Step::default()
    }
}

/// The send of a turn that holds an early response: the turn is decided by that response when
/// the send's target spoke it (or the asker reported its own turn failed), published now;
/// else the response is refused (suppressed `not_target`) and the send opens the turn.
fn send_after_early(rec: &TurnRecord, rev: u64, ev: &TurnFacts, cfg: &TurnConfig) -> Step {
    let Some(early) = rec.early.as_ref() else {
        return Step {
            project_self: true,
            ..Step::default()
        };
    };
    let opened = opened_record(ev, cfg);
    let taken = answers(
        opened.target(),
        opened.sender(),
        rec.target.as_deref(),
        early.winner.blocked.is_some(),
    );
    if taken {
        let decided = TurnRecord {
            state: TurnState::Decided,
            deadline_ms: None,
            winner: Some(early.winner.clone()),
            ..opened
        };
        return Step {
            write: Some((decided, Expect::Revision(rev))),
            respond: true,
            project_self: true,
            ..Step::default()
        };
    }
    // The held record's sides stay beside the send's (which take precedence), so an event
    // stored before the send and processed again is judged as it was while the response was held.
    let refused = TurnRecord {
        early: Some(Early {
            refused: true,
            ..early.clone()
        }),
        sender: rec.sender.clone(),
        target: rec.target.clone(),
        ..opened
    };
    Step {
        write: Some((refused, Expect::Revision(rev))),
        project_self: true,
        suppress_early: early.winner.seq,
        ..Step::default()
    }
}

/// The record as it stood while it held the early response its send then refused, for an
/// event (not a send) stored before that send: `None` for any other record or event.
fn as_held_before_its_send(rec: &TurnRecord, ev: &TurnFacts) -> Option<TurnRecord> {
    let early = rec.early.as_ref().filter(|e| e.refused)?;
    let send = rec.send.as_ref()?;
    if ev.kind == TurnEventKind::Send || ev.seq >= send.seq {
        return None;
    }
    Some(TurnRecord {
        state: TurnState::Open,
        send: None,
        deadline_ms: None,
        winner: None,
        early: Some(Early {
            refused: false,
            ..early.clone()
        }),
        ..rec.clone()
    })
}

/// The early response the send at `seq` refused, when `rec` was opened by that send.
fn refused_by(rec: &TurnRecord, seq: u64) -> Option<u64> {
    let early = rec.early.as_ref().filter(|e| e.refused)?;
    (rec.send.as_ref().map(|s| s.seq) == Some(seq))
        .then_some(early.winner.seq)
        .flatten()
}

/// What an event publishes of its own (its projection or suppression) in `step`, without the
/// record write or the turn's response.
fn own_outputs_only(step: Step) -> Step {
    Step {
        project_self: step.project_self,
        suppress: step.suppress,
        ..Step::default()
    }
}

/// The record holding an early response, decided by it (as when no send comes by the hold's
/// deadline); `None` for any other record.
fn decided_by_early(rec: &TurnRecord) -> Option<TurnRecord> {
    let early = rec.early.as_ref().filter(|_| rec.holds_early())?;
    Some(TurnRecord {
        state: TurnState::Decided,
        deadline_ms: None,
        winner: Some(early.winner.clone()),
        ..rec.clone()
    })
}

/// Whether a response may answer the turn `rec`: true for every other event, and for exchanges
/// whose target is unknown. Else the response's speaker ([`TurnFacts::from_agent`]) must be the
/// target, or, for a response that reports a failure (a blocked outcome, as the asker's runtime
/// reports one when its send could not be delivered), the asker itself, which can end its own
/// turn as blocked with `a2a.error` anyway. Agent ids are compared trimmed and
/// case-insensitively. A response that names no speaker is nobody's. A run's target is the agent
/// that published its `RUN_STARTED`: only that agent's terminal ends it.
pub fn spoken_by_target(rec: &TurnRecord, ev: &TurnFacts) -> bool {
    if ev.kind != TurnEventKind::Response {
        return true;
    }
    answers(
        rec.target(),
        rec.sender(),
        ev.from_agent.as_deref(),
        ev.failure.is_some(),
    )
}

/// Whether a response by `speaker` answers a turn from `sender` to `target` (see
/// [`spoken_by_target`]); `failure`: it reports a failure.
fn answers(
    target: Option<&str>,
    sender: Option<&str>,
    speaker: Option<&str>,
    failure: bool,
) -> bool {
    let Some(target) = named(target) else {
        return true;
    };
    let Some(speaker) = speaker.map(str::trim) else {
        return false;
    };
    let is = |agent: Option<&str>| agent.is_some_and(|a| a.trim().eq_ignore_ascii_case(speaker));
    is(Some(target)) || (failure && is(sender))
}

/// Whether a complete or an error may end the turn `rec`: true for every other event, for runs,
/// for turns whose sides are unknown, and for one that names no speaker (an upstream failure
/// reported by a runtime). Else its speaker must be the asker or the target, compared as in
/// [`spoken_by_target`].
pub fn spoken_by_a_side(rec: &TurnRecord, ev: &TurnFacts) -> bool {
    if !matches!(ev.kind, TurnEventKind::Complete | TurnEventKind::Error)
        || ev.exchange != ExchangeKind::Turn
    {
        return true;
    }
    let Some(speaker) = named(ev.from_agent.as_deref()) else {
        return true;
    };
    let sides: Vec<&str> = [rec.sender(), rec.target()]
        .into_iter()
        .filter_map(named)
        .collect();
    sides.is_empty() || sides.iter().any(|a| a.eq_ignore_ascii_case(speaker))
}

/// An agent id as the rules compare it: trimmed; `None` when absent or blank.
fn named(agent: Option<&str>) -> Option<&str> {
    agent.map(str::trim).filter(|a| !a.is_empty())
}

/// A send opens the turn, with its deadline.
fn open_turn(ev: &TurnFacts, cfg: &TurnConfig) -> Step {
    Step {
        write: Some((opened_record(ev, cfg), Expect::Absent)),
        project_self: true,
        ..Step::default()
    }
}

/// The record of the turn the send `ev` opens, with its deadline.
fn opened_record(ev: &TurnFacts, cfg: &TurnConfig) -> TurnRecord {
    let timeout_ms = cfg.exchange_timeout_ms(ev);
    TurnRecord {
        exchange: ev.exchange,
        conversation_id: ev.conversation_id.clone(),
        key: ev.key.clone(),
        turn: ev.turn.clone(),
        state: TurnState::Open,
        send: Some(send_ref(ev, timeout_ms)),
        deadline_ms: Some(
            ev.stored_ms
                .saturating_add(i64::try_from(timeout_ms).unwrap_or(i64::MAX)),
        ),
        winner: None,
        sender: None,
        target: None,
        writer: None,
        early: None,
    }
}

/// The record of a turn no send opened: a reply comes from the target, a complete or error
/// from the sender's side.
fn unopened(ev: &TurnFacts, kind: TurnEventKind) -> TurnRecord {
    let (sender, target) = if kind == TurnEventKind::Response {
        (ev.to_agent.clone(), ev.from_agent.clone())
    } else {
        (ev.from_agent.clone(), ev.to_agent.clone())
    };
    TurnRecord {
        exchange: ev.exchange,
        conversation_id: ev.conversation_id.clone(),
        key: ev.key.clone(),
        turn: ev.turn.clone(),
        state: TurnState::Open,
        send: None,
        deadline_ms: None,
        winner: None,
        sender,
        target,
        writer: None,
        early: None,
    }
}

/// Who wins an undecided turn: a response as it is (blocked when it carries a failure signal);
/// a complete or an error as a synthesised blocked outcome.
fn winner_of(ev: &TurnFacts, kind: TurnEventKind) -> Winner {
    if kind == TurnEventKind::Response {
        return Winner {
            seq: Some(ev.seq),
            blocked: ev.failure,
            synthesized: false,
            by: match ev.exchange {
                ExchangeKind::Turn => "a2a.response".into(),
                ExchangeKind::Run => TERMINAL_BY.into(),
            },
            detail: ev.failure_detail.clone(),
            at_ms: ev.stored_ms,
        };
    }
    let complete = kind == TurnEventKind::Complete;
    Winner {
        seq: Some(ev.seq),
        blocked: Some(ev.failure.unwrap_or(Reason::Error)),
        synthesized: true,
        by: if complete {
            "a2a.complete".into()
        } else {
            "a2a.error".into()
        },
        detail: ev.failure_detail.clone().or_else(|| {
            (ev.failure.is_none() && complete)
                .then(|| "the exchange completed without a response".to_string())
        }),
        at_ms: ev.stored_ms,
    }
}

/// Decide an undecided turn (`record`, written if `expect` still holds) by `ev`.
fn decide(record: TurnRecord, expect: Expect, ev: &TurnFacts, kind: TurnEventKind) -> Step {
    let decided = TurnRecord {
        state: TurnState::Decided,
        deadline_ms: None,
        winner: Some(winner_of(ev, kind)),
        ..record
    };
    Step {
        write: Some((decided, expect)),
        respond: true,
        // A response is itself the published winner; a complete or error is projected as what
        // it is, after the response it caused.
        project_self: kind != TurnEventKind::Response,
        ..Step::default()
    }
}

/// An event for a decided turn: the winner's redelivery, a further response (suppressed), or
/// a complete or error projected as it is. A decision not yet published is published again.
///
/// An event stored before the winner (processed again after a restart, the decision read from
/// the store) publishes nothing: the decision's response belongs where its winner stands in raw
/// order, and the winner, or the partition passing it, publishes it there.
fn after_decision(rec: &TurnRecord, ev: &TurnFacts, kind: TurnEventKind) -> Step {
    let unpublished = republished_at(rec, ev.seq);
    let is_winner = rec.winner.as_ref().and_then(|w| w.seq) == Some(ev.seq);
    match kind {
        TurnEventKind::Response if is_winner => Step {
            // Redelivery of the winning reply: publish again if the mark is missing (the
            // Msg-Id collapses a republish in the duplicate window).
            respond: unpublished,
            ..Step::default()
        },
        TurnEventKind::Response => {
            let winner_blocked = rec.winner.as_ref().is_some_and(|w| w.blocked.is_some());
            let reason = if winner_blocked && ev.failure.is_none() {
                SuppressReason::Late
            } else {
                SuppressReason::Duplicate
            };
            Step {
                respond: unpublished,
                suppress: Some(reason),
                ..Step::default()
            }
        }
        _ => Step {
            respond: unpublished,
            project_self: true,
            ..Step::default()
        },
    }
}

/// Whether an event at raw sequence `seq` publishes the decision `rec` again: the decision is
/// not yet published, and `seq` is not before its winner (a decision by the deadline has none).
/// The winner's own redelivery, or anything after it, publishes it in raw order; an event before
/// it is one processed again after a restart, ahead of the winner.
pub fn republished_at(rec: &TurnRecord, seq: u64) -> bool {
    rec.state == TurnState::Decided
        && rec
            .winner
            .as_ref()
            .and_then(|w| w.seq)
            .is_none_or(|w| seq >= w)
}

/// An event stored after the deadline of the open turn `rec`: the turn's timeout decision, then
/// the event as it stands after it (a reply is late, a complete or an error is projected).
fn timed_out_before(rec: &TurnRecord, rev: u64, ev: &TurnFacts, kind: TurnEventKind) -> Step {
    let Some(decided) = timed_out(rec) else {
        return after_decision(rec, ev, kind);
    };
    let then = after_decision(&decided, ev, kind);
    Step {
        write: Some((decided, Expect::Revision(rev))),
        respond: true,
        project_self: then.project_self,
        suppress: then.suppress,
        suppress_early: None,
    }
}

/// Decide a turn whose deadline the watermark has passed.
pub fn on_deadline(current: (&TurnRecord, u64)) -> Option<Step> {
    let (rec, rev) = current;
    Some(Step {
        write: Some((timed_out(rec)?, Expect::Revision(rev))),
        respond: true,
        ..Step::default()
    })
}

/// The open turn `rec` decided by its deadline: blocked `timeout`, synthesised, or, for a turn
/// holding an early response that no send came for, that response. `None` for a turn that is
/// not open or has no deadline.
fn timed_out(rec: &TurnRecord) -> Option<TurnRecord> {
    if rec.state != TurnState::Open {
        return None;
    }
    let deadline = rec.deadline_ms?;
    if rec.holds_early() {
        // No send came while the early response was held: it is the turn's response.
        return decided_by_early(rec);
    }
    Some(TurnRecord {
        state: TurnState::Decided,
        deadline_ms: None,
        winner: Some(Winner {
            seq: None,
            blocked: Some(Reason::Timeout),
            synthesized: true,
            by: "deadline".into(),
            detail: None,
            at_ms: deadline,
        }),
        ..rec.clone()
    })
}

/// The record after its response is stored.
pub fn published(rec: &TurnRecord) -> TurnRecord {
    TurnRecord {
        state: TurnState::Published,
        ..rec.clone()
    }
}

fn send_ref(ev: &TurnFacts, timeout_ms: u64) -> SendRef {
    SendRef {
        seq: ev.seq,
        stored_ms: ev.stored_ms,
        subject: ev.subject.clone(),
        from_agent: ev.from_agent.clone(),
        to_agent: ev.to_agent.clone(),
        goal: ev.goal.clone(),
        run_id: ev.run_id.clone(),
        target_session_key: ev.target_session_key.clone(),
        work_session_id: ev.work_session_id.clone(),
        a2a_method: ev.a2a_method.clone(),
        timeout_ms,
        role: ev.role,
        thread_id: ev.thread_id.clone(),
    }
}

#[cfg(test)]
mod a2a_spec_tests;
#[cfg(test)]
mod tests;
