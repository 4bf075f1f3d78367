// Unit and property tests of the turn contract (pure, fake clock).
//
// `Sim` plays the I/O shell over an in-memory KV map `key -> (TurnRecord, revision)` and the
// partition's `OpenTurns` (deadlines only), executing `Step`s the way `src/bus/turns.rs` does: write with the CAS
// expectation (on conflict re-read and decide again), publish the winner under its Msg-Id (the
// JetStream duplicate window collapses republishes), mark it published, then project or suppress
// the event. Time is integers of store-time milliseconds.

use super::blocked::{next_action, parse_sections, suppressed, winner_response};
use super::book::OpenTurns;
use super::*;
use crate::classify::Fields;
use crate::model::{encode_id, id_text, Envelope, RawEventRef, Role};
use chrono::SecondsFormat;
use proptest::prelude::*;
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

const PARTITION: u16 = 3;
const RAW_STREAM: &str = "collab-raw";

fn rfc3339(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms)
        .map(|t| t.to_rfc3339_opts(SecondsFormat::Millis, true))
        .expect("a representable time")
}

/// The contract's defaults: 300 s default timeout, 1 h cap.
fn contract_cfg() -> TurnConfig {
    TurnConfig {
        default_timeout: Duration::from_secs(300),
        max_timeout: Duration::from_secs(3600),
        run_timeout: Duration::from_secs(600),
        early_hold: Duration::from_secs(300),
    }
}

fn merge(into: &mut Value, extra: Value) {
    if let (Some(dst), Value::Object(src)) = (into.as_object_mut(), extra) {
        for (k, v) in src {
            dst.insert(k, v);
        }
    }
}

/// An origin-shaped event: `{"type": t, "data": {...}}` with the conversation and both agents.
fn event(event_type: &str, conv: &str, extra: Value) -> Value {
    let (from, to) = if event_type == "a2a.response" {
        ("eden", "ruda")
    } else {
        ("ruda", "eden")
    };
    let mut data = json!({"fromAgent": from, "toAgent": to, "conversationId": conv});
    merge(&mut data, extra);
    json!({"type": event_type, "data": data})
}

fn send(conv: &str, extra: Value) -> Value {
    let mut e = json!({"message": "please review PR 12", "runId": "run-1"});
    merge(&mut e, extra);
    event("a2a.send", conv, e)
}

fn reply(conv: &str, message: &str, extra: Value) -> Value {
    let mut e = json!({ "message": message });
    merge(&mut e, extra);
    event("a2a.response", conv, e)
}

fn complete(conv: &str, extra: Value) -> Value {
    event("a2a.complete", conv, extra)
}

fn obj(v: &Value) -> Map<String, Value> {
    v.as_object().cloned().expect("an event object")
}

/// Facts of a JSON event, as the pipeline would read them.
fn facts_of(ev: &Value, seq: u64, stored_ms: i64) -> TurnFacts {
    let o = obj(ev);
    let t = o["type"].as_str().expect("a type").to_string();
    let conv = Fields::new(&o)
        .get("conversationId")
        .and_then(id_text)
        .unwrap_or_else(|| "conv".to_string());
    let key = encode_id(&conv);
    let subject = format!("collab.raw.{key}.{t}");
    facts(&o, &t, &conv, &key, seq, stored_ms, &subject).expect("an a2a.* event")
}

fn reason_of(ev: Value) -> Option<Reason> {
    facts_of(&ev, 1, 0).failure
}

#[derive(Debug, Clone)]
struct Raw {
    seq: u64,
    stored_ms: i64,
    event_type: String,
    conv: String,
    value: Value,
}

impl Raw {
    fn key(&self) -> String {
        encode_id(&self.conv)
    }

    fn subject(&self) -> String {
        format!("collab.raw.{}.{}", self.key(), self.event_type)
    }

    fn facts(&self) -> TurnFacts {
        facts(
            &obj(&self.value),
            &self.event_type,
            &self.conv,
            &self.key(),
            self.seq,
            self.stored_ms,
            &self.subject(),
        )
        .expect("an a2a.* event")
    }

    /// A minimal normalised envelope: the `data` object (or the top level) as payload.
    fn envelope(&self) -> Envelope {
        let o = obj(&self.value);
        // Fields semantics: a non-null top-level value is read before `data`.
        let mut payload = match o.get("data") {
            Some(Value::Object(d)) => d.clone(),
            _ => Map::new(),
        };
        for (k, v) in &o {
            if k != "type" && k != "data" && !v.is_null() {
                payload.insert(k.clone(), v.clone());
            }
        }
        Envelope {
            event_type: self.event_type.clone(),
            event_role: Some(Role::ConversationMain),
            conversation_id: Some(json!(self.conv)),
            payload: Some(Value::Object(payload)),
            raw_event_ref: Some(RawEventRef {
                stream: RAW_STREAM.into(),
                seq: self.seq,
                subject: self.subject(),
                stored_at: rfc3339(self.stored_ms),
            }),
            ..Envelope::default()
        }
    }
}

/// Where a crash interrupts a step: right after the write, the publication or the mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CrashPoint {
    Write,
    Publish,
    Mark,
}

#[derive(Debug)]
enum Halt {
    Conflict,
    Crash,
}

/// What went out, in order.
#[derive(Debug, Clone, PartialEq)]
enum Effect {
    Published(String),
    Projected(u64),
    Suppressed(u64, SuppressReason),
}

struct Sim {
    cfg: TurnConfig,
    /// The raw stream, seq `i + 1` at index `i`.
    log: Vec<Raw>,
    /// Delivered-but-unacknowledged messages (they survive a crash).
    pending: VecDeque<u64>,
    deliveries: BTreeMap<u64, usize>,
    now: i64,
    kv: BTreeMap<String, (TurnRecord, u64)>,
    revision: u64,
    book: OpenTurns<()>,
    /// The next successful write reports a failure (its ack was lost).
    lose_next_ack: bool,
    crash_next: Option<CrashPoint>,
    /// First publication per Msg-Id (the duplicate window collapses the rest).
    responses: BTreeMap<String, Envelope>,
    /// Every publication attempt with the winner it carried.
    attempts: Vec<(String, Winner)>,
    projected: BTreeMap<u64, usize>,
    /// First suppression record per raw seq (its Msg-Id derives from the seq).
    suppressed: BTreeMap<u64, Envelope>,
    suppress_attempts: Vec<(u64, SuppressReason)>,
    effects: Vec<Effect>,
}

impl Sim {
    fn new(cfg: TurnConfig) -> Sim {
        Sim {
            cfg,
            log: Vec::new(),
            pending: VecDeque::new(),
            deliveries: BTreeMap::new(),
            now: 0,
            kv: BTreeMap::new(),
            revision: 0,
            book: OpenTurns::new(0),
            lose_next_ack: false,
            crash_next: None,
            responses: BTreeMap::new(),
            attempts: Vec::new(),
            projected: BTreeMap::new(),
            suppressed: BTreeMap::new(),
            suppress_attempts: Vec::new(),
            effects: Vec::new(),
        }
    }

    /// Append a message to the raw stream at store time `at_ms`; it is pending until delivered.
    fn store(&mut self, at_ms: i64, value: Value) -> u64 {
        let o = obj(&value);
        let event_type = o["type"].as_str().expect("a type").to_string();
        let conv = Fields::new(&o)
            .get("conversationId")
            .and_then(id_text)
            .expect("a conversation id");
        if let Some(last) = self.log.last() {
            assert!(at_ms >= last.stored_ms, "store times follow the sequence");
        }
        self.now = self.now.max(at_ms);
        let seq = self.log.len() as u64 + 1;
        self.log.push(Raw {
            seq,
            stored_ms: at_ms,
            event_type,
            conv,
            value,
        });
        self.pending.push_back(seq);
        seq
    }

    /// Store and process everything pending.
    fn run(&mut self, at_ms: i64, value: Value) -> u64 {
        let seq = self.store(at_ms, value);
        self.deliver_all();
        seq
    }

    /// Deliver the stored message `seq` again, and everything pending.
    fn redeliver(&mut self, seq: u64) {
        self.pending.push_back(seq);
        self.deliver_all();
    }

    fn raw(&self, seq: u64) -> Raw {
        self.log[usize::try_from(seq - 1).expect("small seq")].clone()
    }

    fn deliver_all(&mut self) {
        let mut guard = 0;
        while !self.pending.is_empty() {
            self.deliver_one();
            guard += 1;
            assert!(guard < 10_000, "delivery makes progress");
        }
    }

    fn deliver_one(&mut self) {
        let Some(&seq) = self.pending.front() else {
            return;
        };
        *self.deliveries.entry(seq).or_default() += 1;
        match self.process(seq) {
            Ok(()) => {
                self.pending.pop_front();
            }
            // Not acknowledged: it stays first in line and is redelivered after the restart.
            Err(()) => self.recover(),
        }
    }

    /// The wall clock reaches `now`; the watermark is the earliest pending store time, or now.
    fn tick(&mut self, now: i64) {
        self.now = self.now.max(now);
        loop {
            let watermark = self
                .pending
                .iter()
                .map(|s| self.raw(*s).stored_ms)
                .min()
                .map_or(self.now, |p| p.min(self.now));
            match self.expire(watermark) {
                Ok(()) => return,
                Err(()) => self.recover(),
            }
        }
    }

    /// Drop every in-memory state and rebuild it from the KV map.
    fn recover(&mut self) {
        self.book = OpenTurns::new(0);
        self.lose_next_ack = false;
        self.crash_next = None;
        let records: Vec<(String, (TurnRecord, u64))> = self
            .kv
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (key, (rec, rev)) in records {
            match rec.state {
                TurnState::Open => self.remember(&key, &rec),
                TurnState::Decided => self
                    .publish(&key, &rec, rev)
                    .expect("recovery runs without faults"),
                TurnState::Published => {}
            }
        }
    }

    fn process(&mut self, seq: u64) -> Result<(), ()> {
        let raw = self.raw(seq);
        self.expire(raw.stored_ms)?;
        let f = raw.facts();
        let key = f.record_key(PARTITION);
        for _ in 0..16 {
            let current = self.kv.get(&key).cloned();
            if let Some((rec, _)) = &current {
                self.remember(&key, rec);
            }
            let f = self.marked(f.clone(), current.is_none());
            let step = on_event(current.as_ref().map(|(r, v)| (r, *v)), &f, &self.cfg);
            match self.execute(&key, current, step, Some(&raw)) {
                Ok(()) => return Ok(()),
                Err(Halt::Conflict) => continue,
                Err(Halt::Crash) => return Err(()),
            }
        }
        panic!("no progress on seq {seq}");
    }

    /// The facts as the shell hands them to the rules: a response with no record yet is marked
    /// when it continues the conversation's previous turn, as src/bus/turns.rs does.
    fn marked(&self, f: TurnFacts, unrecorded: bool) -> TurnFacts {
        if !unrecorded || self.cfg.early_hold.is_zero() {
            return f;
        }
        let follows = f
            .previous_record_key(PARTITION)
            .and_then(|key| self.kv.get(&key))
            .is_some_and(|(rec, _)| continues_previous(rec, &f));
        TurnFacts {
            follows_previous: follows,
            ..f
        }
    }

    /// Run `on_deadline` for every turn whose deadline is before the watermark.
    fn expire(&mut self, watermark: i64) -> Result<(), ()> {
        for (_, key) in self.book.expire(watermark) {
            for attempt in 0.. {
                assert!(attempt < 16, "no progress on the deadline of {key}");
                let Some((rec, rev)) = self.kv.get(&key).cloned() else {
                    break;
                };
                let outcome = match on_deadline((&rec, rev)) {
                    Some(step) => self.execute(&key, Some((rec, rev)), step, None),
                    None => {
                        // Decided meanwhile (for instance by our own write whose ack was lost):
                        // the shell makes sure its response is out, as src/bus/turns.rs does.
                        self.remember(&key, &rec);
                        if rec.state == TurnState::Decided {
                            self.publish(&key, &rec, rev)
                        } else {
                            Ok(())
                        }
                    }
                };
                match outcome {
                    Ok(()) => break,
                    Err(Halt::Conflict) => continue,
                    Err(Halt::Crash) => return Err(()),
                }
            }
        }
        Ok(())
    }

    /// Keep the open turns in step with a record read or written.
    fn remember(&mut self, key: &str, rec: &TurnRecord) {
        match (rec.state, rec.deadline_ms) {
            (TurnState::Open, Some(d)) => self.book.open(key, Some(d), (), None),
            (TurnState::Open, None) => {}
            _ => {
                self.book.close(key);
            }
        }
    }

    fn crash_point(&mut self, at: CrashPoint) -> Result<(), Halt> {
        if self.crash_next == Some(at) {
            self.crash_next = None;
            return Err(Halt::Crash);
        }
        Ok(())
    }

    fn cas(&mut self, key: &str, rec: &TurnRecord, expect: Expect) -> Result<u64, Halt> {
        let ok = match (expect, self.kv.get(key)) {
            (Expect::Absent, None) => true,
            (Expect::Revision(r), Some((_, cur))) => *cur == r,
            _ => false,
        };
        if !ok {
            return Err(Halt::Conflict);
        }
        self.revision += 1;
        self.kv
            .insert(key.to_string(), (rec.clone(), self.revision));
        self.remember(key, rec);
        if std::mem::take(&mut self.lose_next_ack) {
            return Err(Halt::Conflict);
        }
        Ok(self.revision)
    }

    fn execute(
        &mut self,
        key: &str,
        current: Option<(TurnRecord, u64)>,
        step: Step,
        raw: Option<&Raw>,
    ) -> Result<(), Halt> {
        let mut after = current;
        if let Some((rec, expect)) = step.write {
            let rev = self.cas(key, &rec, expect)?;
            after = Some((rec, rev));
            self.crash_point(CrashPoint::Write)?;
        }
        if step.respond {
            let (rec, rev) = after.clone().expect("respond comes with a record");
            self.publish(key, &rec, rev)?;
        }
        if step.project_self {
            let raw = raw.expect("only events project themselves");
            let rec = &after.as_ref().expect("a turn record").0;
            // A complete or an error before the send of a turn holding an early response is
            // projected as it comes, again when processed again after a send refused that
            // response: the response waits for the send.
            let before_refusing_send = rec.early.as_ref().is_some_and(|e| e.refused)
                && rec.send.as_ref().is_some_and(|s| raw.seq < s.seq);
            if matches!(raw.event_type.as_str(), "a2a.complete" | "a2a.error")
                && !rec.holds_early()
                && !before_refusing_send
            {
                assert!(
                    self.responses.contains_key(&rec.response_msg_id()),
                    "{} seq {} projected before its turn's response",
                    raw.event_type,
                    raw.seq
                );
            }
            *self.projected.entry(raw.seq).or_default() += 1;
            self.effects.push(Effect::Projected(raw.seq));
        }
        if let Some(reason) = step.suppress {
            let raw = raw.expect("only events are suppressed");
            let (rec, _) = after.as_ref().expect("suppression refers to the record");
            let env = suppressed(&raw.envelope(), rec, reason);
            self.suppressed.entry(raw.seq).or_insert(env);
            self.suppress_attempts.push((raw.seq, reason));
            self.effects.push(Effect::Suppressed(raw.seq, reason));
        }
        if let Some(seq) = step.suppress_early {
            let (rec, _) = after.as_ref().expect("suppression refers to the record");
            let reason = SuppressReason::NotTarget;
            let env = suppressed(&self.raw(seq).envelope(), rec, reason);
            self.suppressed.entry(seq).or_insert(env);
            self.suppress_attempts.push((seq, reason));
            self.effects.push(Effect::Suppressed(seq, reason));
        }
        Ok(())
    }

    /// Publish the turn's response, then mark the record published.
    fn publish(&mut self, key: &str, rec: &TurnRecord, rev: u64) -> Result<(), Halt> {
        assert_eq!(
            rec.state,
            TurnState::Decided,
            "only a decided turn is published"
        );
        let winner = rec.winner.clone().expect("a decided record has a winner");
        let decider = winner.seq.map(|s| self.raw(s).envelope());
        let env = winner_response(rec, decider.as_ref());
        let id = rec.response_msg_id();
        self.attempts.push((id.clone(), winner));
        if !self.responses.contains_key(&id) {
            self.responses.insert(id.clone(), env);
            self.effects.push(Effect::Published(id));
        }
        self.crash_point(CrashPoint::Publish)?;
        self.cas(key, &published(rec), Expect::Revision(rev))?;
        self.crash_point(CrashPoint::Mark)?;
        Ok(())
    }

    fn record(&self, conv: &str, turn: &str) -> &TurnRecord {
        &self
            .kv
            .get(&record_key(PARTITION, &encode_id(conv), turn))
            .unwrap_or_else(|| panic!("no record for {conv}/{turn}"))
            .0
    }

    fn winner(&self, conv: &str, turn: &str) -> Winner {
        self.record(conv, turn)
            .winner
            .clone()
            .expect("a decided turn")
    }

    fn response(&self, conv: &str, turn: &str) -> &Envelope {
        let id = self.record(conv, turn).response_msg_id();
        self.responses
            .get(&id)
            .unwrap_or_else(|| panic!("no response published for {id}"))
    }

    fn payload(&self, conv: &str, turn: &str) -> Map<String, Value> {
        self.response(conv, turn)
            .payload
            .as_ref()
            .and_then(Value::as_object)
            .cloned()
            .expect("an object payload")
    }

    fn suppression(&self, seq: u64) -> Option<SuppressReason> {
        let reasons: Vec<SuppressReason> = self
            .suppress_attempts
            .iter()
            .filter(|(s, _)| *s == seq)
            .map(|(_, r)| *r)
            .collect();
        assert!(
            reasons.windows(2).all(|w| w[0] == w[1]),
            "seq {seq} suppressed with different reasons: {reasons:?}"
        );
        reasons.first().copied()
    }

    fn position(&self, effect: &Effect) -> usize {
        self.effects
            .iter()
            .position(|e| e == effect)
            .unwrap_or_else(|| panic!("{effect:?} never happened"))
    }
}

fn str_field<'a>(p: &'a Map<String, Value>, name: &str) -> &'a str {
    p.get(name)
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("no string {name} in {p:?}"))
}

// ---------------------------------------------------------------------------------------------
// 1. The rules of section 4.
// ---------------------------------------------------------------------------------------------

#[test]
fn first_real_response_wins() {
    let mut sim = Sim::new(contract_cfg());
    sim.run(1_000, send("c1", json!({})));
    let first = sim.run(2_000, reply("c1", "first reply", json!({})));
    let second = sim.run(3_000, reply("c1", "second reply", json!({})));
    let w = sim.winner("c1", "0");
    assert_eq!(w.seq, Some(first));
    assert_eq!(w.blocked, None);
    assert!(!w.synthesized);
    assert_eq!(w.by, "a2a.response");
    assert_eq!(sim.record("c1", "0").state, TurnState::Published);
    assert_eq!(sim.responses.len(), 1);
    let env = sim.response("c1", "0");
    assert_eq!(env.event_type, "a2a.response");
    assert_eq!(env.event_role, Some(Role::ConversationMain));
    assert_eq!(str_field(&sim.payload("c1", "0"), "message"), "first reply");
    assert_eq!(sim.suppression(first), None);
    assert_eq!(sim.suppression(second), Some(SuppressReason::Duplicate));
    assert!(sim.book.is_empty());
}

#[test]
fn duplicate_response_is_suppressed_as_duplicate_with_a_ref_to_the_winner() {
    let mut sim = Sim::new(contract_cfg());
    sim.run(1_000, send("c1", json!({})));
    let won = sim.run(2_000, reply("c1", "done", json!({})));
    // The same content published again (a new raw seq), and the same seq redelivered.
    let dup = sim.run(2_500, reply("c1", "done", json!({})));
    sim.pending.push_back(won);
    sim.deliver_all();
    assert_eq!(sim.responses.len(), 1);
    assert_eq!(
        sim.suppression(won),
        None,
        "a redelivered winner is not further"
    );
    assert_eq!(sim.suppression(dup), Some(SuppressReason::Duplicate));
    let env = &sim.suppressed[&dup];
    assert_eq!(env.event_type, "a2a.response.suppressed");
    assert_eq!(env.event_role, Some(Role::SystemObservability));
    let p = env.payload.as_ref().expect("a payload");
    assert_eq!(p["reason"], "duplicate");
    assert_eq!(
        p["winner"]["msgId"],
        json!(sim.record("c1", "0").response_msg_id())
    );
    assert_eq!(p["winner"]["rawSeq"], json!(won));
    assert_eq!(p["winner"]["outcome"], "response");
    assert_eq!(p["response"]["message"], "done", "nothing is dropped");
    assert_eq!(env.raw_event_ref.as_ref().map(|r| r.seq), Some(dup));
}

#[test]
fn real_response_after_a_blocked_outcome_is_late() {
    let mut sim = Sim::new(contract_cfg());
    sim.run(1_000, send("c1", json!({})));
    let failed = sim.run(
        2_000,
        reply(
            "c1",
            "[outcome] no_reply",
            json!({"outcome": "no_reply", "waitStatus": "error"}),
        ),
    );
    let real = sim.run(3_000, reply("c1", "here it is after all", json!({})));
    let w = sim.winner("c1", "0");
    assert_eq!((w.seq, w.blocked), (Some(failed), Some(Reason::Error)));
    assert_eq!(sim.suppression(real), Some(SuppressReason::Late));
    let p = sim.suppressed[&real].payload.clone().expect("a payload");
    assert_eq!(p["reason"], "late");
    assert_eq!(p["winner"]["outcome"], "blocked");
    assert_eq!(p["winner"]["reason"], "error");
    assert_eq!(p["winner"]["rawSeq"], json!(failed));
}

#[test]
fn failure_response_after_a_real_reply_is_duplicate() {
    let mut sim = Sim::new(contract_cfg());
    sim.run(1_000, send("c1", json!({})));
    let real = sim.run(2_000, reply("c1", "ok", json!({})));
    let failed = sim.run(
        3_000,
        reply(
            "c1",
            "x",
            json!({"outcome": "no_reply", "waitStatus": "timeout"}),
        ),
    );
    assert_eq!(sim.winner("c1", "0").seq, Some(real));
    assert_eq!(sim.suppression(failed), Some(SuppressReason::Duplicate));
}

#[test]
fn failure_response_after_a_blocked_outcome_is_duplicate() {
    let mut sim = Sim::new(contract_cfg());
    sim.run(1_000, send("c1", json!({"timeoutMs": 1_000})));
    sim.tick(5_000);
    let failed = sim.run(6_000, reply("c1", "x", json!({"outcome": "failed"})));
    assert_eq!(sim.winner("c1", "0").blocked, Some(Reason::Timeout));
    assert_eq!(sim.suppression(failed), Some(SuppressReason::Duplicate));
}

#[test]
fn only_the_target_decides_its_turn() {
    let mut sim = Sim::new(contract_cfg());
    sim.run(1_000, send("c1", json!({})));
    // A third agent, the asker itself, and a response naming no speaker: none is eden's.
    let third = sim.run(
        2_000,
        reply("c1", "done, wired", json!({"fromAgent": "mallory"})),
    );
    let asker = sim.run(
        2_100,
        reply("c1", "I answer myself", json!({"fromAgent": "ruda"})),
    );
    let nobody = sim.run(2_200, reply("c1", "anonymous", json!({"fromAgent": null})));
    assert_eq!(sim.record("c1", "0").state, TurnState::Open);
    assert!(sim.responses.is_empty(), "no response before the target's");
    for seq in [third, asker, nobody] {
        assert_eq!(sim.suppression(seq), Some(SuppressReason::NotTarget));
        let record = sim.suppressed[&seq]
            .payload
            .clone()
            .expect("a suppression payload");
        assert_eq!(record["reason"], "not_target");
        assert_eq!(record["winner"]["outcome"], "pending");
        assert_eq!(record["winner"]["msgId"], "turn:c1:0");
        assert_eq!(record["winner"]["rawSeq"], Value::Null);
    }
    // The target's reply, trimmed and in another case, still wins; later forgeries stay
    // not_target, never duplicate.
    let real = sim.run(
        3_000,
        reply("c1", "reviewed", json!({"fromAgent": " Eden "})),
    );
    assert_eq!(sim.winner("c1", "0").seq, Some(real));
    assert_eq!(str_field(&sim.payload("c1", "0"), "message"), "reviewed");
    let after = sim.run(4_000, reply("c1", "again", json!({"fromAgent": "mallory"})));
    assert_eq!(sim.suppression(after), Some(SuppressReason::NotTarget));
    assert_eq!(sim.responses.len(), 1);
}

#[test]
fn a_foreign_response_neither_blocks_the_turn_nor_stops_its_deadline() {
    let mut sim = Sim::new(contract_cfg());
    sim.run(1_000, send("c1", json!({"timeoutMs": 1_000})));
    let forged = sim.run(
        1_500,
        reply(
            "c1",
            "x",
            json!({"fromAgent": "mallory", "outcome": "failed"}),
        ),
    );
    assert_eq!(sim.suppression(forged), Some(SuppressReason::NotTarget));
    sim.tick(5_000);
    let w = sim.winner("c1", "0");
    assert_eq!(w.blocked, Some(Reason::Timeout));
    assert!(w.synthesized);
}

#[test]
fn only_the_asker_or_the_target_ends_a_turn_with_a_complete_or_an_error() {
    let mut sim = Sim::new(contract_cfg());
    sim.run(1_000, send("c1", json!({})));
    let foreign_error = sim.run(
        1_500,
        event("a2a.error", "c1", json!({"fromAgent": "mallory"})),
    );
    let foreign_complete = sim.run(1_600, complete("c1", json!({"fromAgent": "Mallory"})));
    assert_eq!(sim.record("c1", "0").state, TurnState::Open);
    assert!(sim.responses.is_empty(), "a third agent ended the turn");
    // Both are kept beside the turn, as a foreign response is.
    for seq in [foreign_error, foreign_complete] {
        assert_eq!(sim.suppression(seq), Some(SuppressReason::NotTarget));
    }
    let error = sim.run(
        2_000,
        event("a2a.error", "c1", json!({"fromAgent": " EDEN "})),
    );
    let w = sim.winner("c1", "0");
    assert_eq!((w.seq, w.blocked), (Some(error), Some(Reason::Error)));
    assert_eq!(sim.responses.len(), 1);
}

#[test]
fn events_other_than_responses_are_not_held_to_the_target_and_run_terminals_are() {
    let rec = TurnRecord {
        exchange: ExchangeKind::Turn,
        conversation_id: "c1".into(),
        key: "c1".into(),
        turn: "0".into(),
        state: TurnState::Open,
        send: None,
        deadline_ms: None,
        winner: None,
        sender: Some("ruda".into()),
        target: Some("eden".into()),
        writer: None,
        early: None,
    };
    let forged = facts_of(&reply("c1", "x", json!({"fromAgent": "mallory"})), 2, 0);
    assert!(!spoken_by_target(&rec, &forged));
    let complete = facts_of(&complete("c1", json!({})), 2, 0);
    assert!(spoken_by_target(&rec, &complete));
    // The asker may report its own turn failed (as the origin's runtime does), never answer it.
    let asker_blocked = facts_of(
        &reply(
            "c1",
            "x",
            json!({"fromAgent": "ruda", "outcome": "blocked"}),
        ),
        2,
        0,
    );
    assert!(spoken_by_target(&rec, &asker_blocked));
    let asker_reply = facts_of(&reply("c1", "x", json!({"fromAgent": "ruda"})), 2, 0);
    assert!(!spoken_by_target(&rec, &asker_reply));
    // A run's terminal is held to the run's owner (its record's target) as a reply is.
    let run = TurnFacts {
        exchange: ExchangeKind::Run,
        ..forged.clone()
    };
    assert!(!spoken_by_target(&rec, &run));
    let owners = TurnFacts {
        from_agent: Some("EDEN".into()),
        ..run.clone()
    };
    assert!(spoken_by_target(&rec, &owners));
    let unknown_target = TurnRecord {
        target: None,
        ..rec
    };
    assert!(spoken_by_target(&unknown_target, &forged));
}

#[test]
fn a_response_before_its_send_is_held_and_taken_when_the_send_names_its_speaker() {
    let cfg = contract_cfg();
    let r = reply("c1", "early words", json!({}));
    let step = on_event(None, &facts_of(&r, 1, 1_000), &cfg);
    let (rec, expect) = step
        .write
        .clone()
        .expect("the response is held in a record");
    assert_eq!(expect, Expect::Absent);
    assert_eq!(rec.state, TurnState::Open);
    assert!(rec.holds_early());
    assert_eq!(rec.send, None);
    assert_eq!(
        rec.deadline_ms,
        Some(1_000 + 300_000),
        "held a default timeout"
    );
    assert!(!step.respond && !step.project_self && step.suppress.is_none());

    let mut sim = Sim::new(cfg);
    let early = sim.run(1_000, r);
    assert!(
        sim.responses.is_empty(),
        "nothing is published before the send"
    );
    let again = sim.run(1_500, reply("c1", "early words again", json!({})));
    assert_eq!(sim.suppression(again), Some(SuppressReason::Duplicate));
    let send_seq = sim.run(2_000, send("c1", json!({"timeoutMs": 10})));
    assert_eq!(sim.responses.len(), 1, "the send takes the held response");
    assert_eq!(sim.winner("c1", "0").seq, Some(early));
    assert_eq!(sim.payload("c1", "0")["message"], "early words");
    let rec = sim.record("c1", "0");
    assert_eq!(rec.send.as_ref().map(|s| s.seq), Some(send_seq));
    assert_eq!(rec.deadline_ms, None);
    assert!(sim.book.is_empty(), "the decided turn arms nothing");
    assert_eq!(sim.projected.get(&send_seq), Some(&1));
    assert!(
        sim.position(&Effect::Published(rec.response_msg_id()))
            < sim.position(&Effect::Projected(send_seq))
    );
    sim.tick(100_000_000);
    assert_eq!(sim.responses.len(), 1);
    assert!(sim.attempts.iter().all(|(_, w)| w.seq == Some(early)));
}

#[test]
fn a_response_before_its_send_by_another_agent_is_refused_and_the_target_answers() {
    let mut sim = Sim::new(contract_cfg());
    let forged = sim.run(
        1_000,
        reply("c1", "FORGED approved", json!({"fromAgent": "mallory"})),
    );
    let send_seq = sim.run(2_000, send("c1", json!({})));
    assert_eq!(sim.suppression(forged), Some(SuppressReason::NotTarget));
    assert!(sim.responses.is_empty(), "the turn waits for eden");
    let rec = sim.record("c1", "0").clone();
    assert_eq!(rec.state, TurnState::Open);
    assert_eq!(rec.deadline_ms, Some(2_000 + 300_000), "from the send");
    let p = sim.suppressed[&forged].payload.clone().unwrap_or_default();
    assert_eq!(p["reason"], "not_target");
    assert_eq!(p["winner"]["outcome"], "pending");
    assert_eq!(p["response"]["message"], "FORGED approved");
    // The send delivered again publishes the suppression again (its Msg-Id collapses it).
    sim.redeliver(send_seq);
    assert_eq!(
        sim.suppress_attempts
            .iter()
            .filter(|(s, _)| *s == forged)
            .count(),
        2
    );
    let real = sim.run(3_000, reply("c1", "declined", json!({})));
    assert_eq!(sim.winner("c1", "0").seq, Some(real));
    assert_eq!(sim.payload("c1", "0")["message"], "declined");
    sim.tick(100_000_000);
    assert_eq!(sim.responses.len(), 1);
}

#[test]
fn the_previous_turn_of_a_reply_is_its_decimal_turn_minus_one() {
    let of = |turn: &str| {
        let mut f = facts_of(&reply("c", "x", json!({})), 1, 0);
        f.turn = turn.into();
        previous_turn(&f)
    };
    assert_eq!(of("1").as_deref(), Some("0"));
    assert_eq!(of("10").as_deref(), Some("9"));
    assert_eq!(
        of("18446744073709551615").as_deref(),
        Some("18446744073709551614")
    );
    for none in ["0", "01", "", "t1", "1.5", "-1", "18446744073709551616"] {
        assert_eq!(of(none), None, "{none:?}");
    }
    let sent = facts_of(&send("c", json!({"turn": 2})), 1, 0);
    assert_eq!(
        previous_turn(&sent),
        None,
        "only a response can be a ping-pong reply"
    );
    let mut run = facts_of(&reply("c", "x", json!({"turn": 2})), 1, 0);
    run.exchange = ExchangeKind::Run;
    assert_eq!(previous_turn(&run), None, "runs have no order");
}

#[test]
fn a_ping_pong_reply_is_taken_at_once_only_between_the_previous_turns_sides() {
    let mut sim = Sim::new(contract_cfg());
    sim.run(1_000, send("c1", json!({})));
    sim.run(2_000, reply("c1", "turn 0", json!({})));
    assert_eq!(sim.responses.len(), 1);
    let said = |turn: u32, from: &str, to: &str, message: &str| {
        reply(
            "c1",
            message,
            json!({"turn": turn, "fromAgent": from, "toAgent": to}),
        )
    };
    // ruda answers eden's reply: turn 1 continues the exchange of turn 0.
    let pong = sim.run(3_000, said(1, "ruda", "eden", "turn 1"));
    assert_eq!(sim.responses.len(), 2, "taken at once");
    assert_eq!(sim.winner("c1", "1").seq, Some(pong));
    assert_eq!(sim.record("c1", "1").target.as_deref(), Some("ruda"));
    // And eden answers that in turn: turn 1's sides are the same two agents.
    let ping = sim.run(4_000, reply("c1", "turn 2", json!({"turn": 2})));
    assert_eq!(sim.responses.len(), 3);
    assert_eq!(sim.winner("c1", "2").seq, Some(ping));

    // Not a side of turn 2: held until the send says who may answer, then refused.
    let forged = sim.run(5_000, said(3, "mallory", "ruda", "FORGED"));
    assert_eq!(sim.responses.len(), 3, "held, not taken");
    assert!(sim.record("c1", "3").holds_early());
    // A side of turn 2 addressing a third agent is no ping-pong reply either: held.
    let aside = sim.run(5_500, said(4, "eden", "atlas", "to atlas"));
    assert!(sim.record("c1", "4").holds_early());
    // No turn 6 recorded: turn 7 has nothing to continue and is held.
    sim.run(5_600, reply("c1", "gap", json!({"turn": 7})));
    assert!(sim.record("c1", "7").holds_early());
    assert_eq!(sim.responses.len(), 3);
    sim.run(6_000, send("c1", json!({"turn": 3})));
    assert_eq!(sim.suppression(forged), Some(SuppressReason::NotTarget));
    assert_eq!(sim.record("c1", "3").state, TurnState::Open);
    let real = sim.run(7_000, reply("c1", "turn 3", json!({"turn": 3})));
    assert_eq!(sim.winner("c1", "3").seq, Some(real));
    sim.tick(100_000_000);
    // The held ones decide their turns only at the hold's deadline.
    assert_eq!(sim.winner("c1", "4").seq, Some(aside));
    assert_eq!(sim.responses.len(), 6);
}

#[test]
fn a_forger_cannot_chain_onto_a_turn_it_is_not_a_side_of() {
    // mallory answers turn 1 before any turn 0 exists, then turn 0 is eden's and ruda's:
    // neither of mallory's replies is taken before a send or the hold's deadline.
    let mut sim = Sim::new(contract_cfg());
    let early = sim.run(
        1_000,
        reply("c1", "FORGED 0", json!({"fromAgent": "mallory"})),
    );
    let chained = sim.run(
        1_500,
        reply("c1", "FORGED 1", json!({"turn": 1, "fromAgent": "mallory"})),
    );
    assert!(sim.responses.is_empty());
    sim.run(2_000, send("c1", json!({})));
    assert_eq!(sim.suppression(early), Some(SuppressReason::NotTarget));
    assert!(sim.record("c1", "1").holds_early());
    assert!(sim.responses.is_empty());
    sim.run(3_000, send("c1", json!({"turn": 1})));
    assert_eq!(sim.suppression(chained), Some(SuppressReason::NotTarget));
    let real = sim.run(4_000, reply("c1", "eden's", json!({"turn": 1})));
    assert_eq!(sim.winner("c1", "1").seq, Some(real));
    assert_eq!(sim.responses.len(), 1);
}

#[test]
fn a_turn_ended_before_its_send_vouches_for_nobody() {
    // mallory ends turn 0 with a complete it addresses to ruda (no send, so its own sides),
    // then answers turn 1: the complete's sides are mallory's word, so the reply is held.
    let mut sim = Sim::new(contract_cfg());
    sim.run(
        1_000,
        complete("c1", json!({"fromAgent": "mallory", "toAgent": "ruda"})),
    );
    assert_eq!(sim.record("c1", "0").state, TurnState::Published);
    let chained = sim.run(
        1_500,
        reply(
            "c1",
            "FORGED",
            json!({"turn": 1, "fromAgent": "mallory", "toAgent": "ruda"}),
        ),
    );
    assert!(sim.record("c1", "1").holds_early());
    sim.run(2_000, send("c1", json!({"turn": 1})));
    assert_eq!(sim.suppression(chained), Some(SuppressReason::NotTarget));
}

#[test]
fn only_what_was_stored_before_a_reply_vouches_for_it() {
    let cfg = contract_cfg();
    let at = |ev: Value, seq: u64| facts_of(&ev, seq, i64::try_from(seq).unwrap_or(0) * 1_000);
    let pong = at(reply("c", "pong", json!({"turn": 1})), 10);
    // Turn 0 opened by a send stored before the reply vouches; one stored after it does not,
    // however early the reply is processed again after it.
    let opened = |send_seq: u64| {
        on_event(None, &at(send("c", json!({})), send_seq), &cfg)
            .write
            .map(|(r, _)| r)
            .expect("the send opens turn 0")
    };
    assert!(continues_previous(&opened(9), &pong));
    assert!(!continues_previous(&opened(11), &pong));
    // Turn 0 decided by a response no send opened: only when that response came first.
    let taken = |seq: u64| {
        let cfg = TurnConfig {
            early_hold: Duration::ZERO,
            ..cfg
        };
        let ping = at(
            reply("c", "ping", json!({"fromAgent": "ruda", "toAgent": "eden"})),
            seq,
        );
        on_event(None, &ping, &cfg)
            .write
            .map(|(r, _)| r)
            .expect("the reply decides turn 0")
    };
    assert!(continues_previous(&taken(9), &pong));
    assert!(!continues_previous(&taken(11), &pong));
    // Held and its hold not over when the reply was stored: vouches for nobody; over: vouches.
    let held = on_event(
        None,
        &at(
            reply("c", "ping", json!({"fromAgent": "ruda", "toAgent": "eden"})),
            9,
        ),
        &cfg,
    )
    .write
    .map(|(r, _)| r)
    .expect("the reply is held");
    assert!(held.holds_early());
    assert!(!continues_previous(&held, &pong));
    let after_hold = TurnFacts {
        stored_ms: 9_000 + 300_001,
        ..pong.clone()
    };
    assert!(continues_previous(&held, &after_hold));
}

#[test]
fn with_no_hold_a_response_before_its_send_is_the_turns_response_at_once() {
    let cfg = TurnConfig {
        early_hold: Duration::ZERO,
        ..contract_cfg()
    };
    let r = reply("c1", "unprompted", json!({}));
    let step = on_event(None, &facts_of(&r, 1, 1_000), &cfg);
    let (rec, _) = step.write.clone().expect("the response decides the turn");
    assert_eq!(rec.state, TurnState::Decided);
    assert!(step.respond && !step.project_self);
    let mut sim = Sim::new(cfg);
    let won = sim.run(1_000, r);
    assert_eq!(sim.responses.len(), 1);
    a_late_send_arms_nothing(&mut sim, 2_000, "a send after the response arms nothing");
    assert_eq!(sim.winner("c1", "0").seq, Some(won));
}

#[test]
fn a_response_no_send_came_for_decides_its_turn_at_the_holds_deadline() {
    let mut sim = Sim::new(contract_cfg());
    let early = sim.run(1_000, reply("c1", "unprompted", json!({})));
    sim.tick(1_000 + 300_000);
    assert!(
        sim.responses.is_empty(),
        "held until the deadline, inclusive"
    );
    sim.tick(1_001 + 300_000);
    assert_eq!(sim.responses.len(), 1);
    assert_eq!(sim.winner("c1", "0").seq, Some(early));
    assert_eq!(sim.record("c1", "0").send, None);
    a_late_send_arms_nothing(&mut sim, 400_000, "a send after the decision arms nothing");
}

/// A send of the decided turn `c1`/0 stored at `at_ms`: it arms nothing (`why`), is projected
/// once, and the turn keeps its one response.
fn a_late_send_arms_nothing(sim: &mut Sim, at_ms: i64, why: &str) {
    let late_send = sim.run(at_ms, send("c1", json!({"timeoutMs": 10})));
    assert!(sim.book.is_empty(), "{why}");
    assert_eq!(sim.projected.get(&late_send), Some(&1));
    sim.tick(100_000_000);
    assert_eq!(sim.responses.len(), 1);
}

#[test]
fn complete_after_a_response_is_projected_after_it() {
    let mut sim = Sim::new(contract_cfg());
    sim.run(1_000, send("c1", json!({})));
    let won = sim.run(2_000, reply("c1", "ok", json!({})));
    let done = sim.run(3_000, complete("c1", json!({"announced": false})));
    assert_eq!(sim.winner("c1", "0").seq, Some(won));
    let id = sim.record("c1", "0").response_msg_id();
    assert!(sim.position(&Effect::Published(id)) < sim.position(&Effect::Projected(done)));
    assert_eq!(sim.responses.len(), 1);
    assert_eq!(sim.suppression(done), None);

    // The step itself: no write, no publish, project.
    let rec = sim.record("c1", "0").clone();
    let step = on_event(Some((&rec, 9)), &sim.raw(done).facts(), &contract_cfg());
    assert_eq!(
        step,
        Step {
            project_self: true,
            ..Step::default()
        }
    );
}

#[test]
fn a_decision_read_back_unpublished_is_published_at_its_winner_not_before() {
    // As a reload finds it: decided by the reply at raw seq 5, its response not stored.
    let cfg = contract_cfg();
    let mut sim = Sim::new(cfg);
    sim.run(1_000, send("c1", json!({})));
    let won = sim.run(2_000, reply("c1", "ok", json!({})));
    let mut rec = sim.record("c1", "0").clone();
    rec.state = TurnState::Decided;
    let winner = rec.winner.as_ref().and_then(|w| w.seq);
    assert_eq!(winner, Some(won));

    // Processed again before the winner (a send, a foreign reply): nothing is published there.
    let again = on_event(Some((&rec, 9)), &sim.raw(won - 1).facts(), &cfg);
    assert!(!again.respond, "{again:?}");
    assert!(!republished_at(&rec, won - 1));
    let mut foreign = reply("c1", "me too", json!({}));
    foreign["data"]["fromAgent"] = json!("mallory");
    let early = on_event(Some((&rec, 9)), &facts_of(&foreign, won - 1, 1_500), &cfg);
    assert!(!early.respond, "{early:?}");

    // The winner's redelivery, and anything after it, publishes it.
    assert!(on_event(Some((&rec, 9)), &sim.raw(won).facts(), &cfg).respond);
    let dup = on_event(
        Some((&rec, 9)),
        &facts_of(&reply("c1", "again", json!({})), won + 1, 2_500),
        &cfg,
    );
    assert!(dup.respond && dup.suppress.is_some(), "{dup:?}");
    assert!(republished_at(&rec, won) && republished_at(&rec, won + 1));

    // A timeout has no winning input: any event publishes it.
    let mut timed_out = rec.clone();
    if let Some(w) = timed_out.winner.as_mut() {
        w.seq = None;
    }
    assert!(republished_at(&timed_out, 1));
    // A published decision is never published again.
    assert!(!republished_at(&published(&rec), won + 1));
}

#[test]
fn complete_without_response_or_signal_is_blocked_error_synthesized() {
    let mut sim = Sim::new(contract_cfg());
    let s = sim.run(1_000, send("c1", json!({})));
    let done = sim.run(2_000, complete("c1", json!({"announced": false})));
    let w = sim.winner("c1", "0");
    assert_eq!(w.seq, Some(done));
    assert_eq!(w.blocked, Some(Reason::Error));
    assert!(w.synthesized);
    assert_eq!(w.by, "a2a.complete");
    let p = sim.payload("c1", "0");
    assert_eq!(p["outcome"], "blocked");
    assert_eq!(p["reason"], "error");
    assert_eq!(p["synthesized"], true);
    let id = sim.record("c1", "0").response_msg_id();
    assert!(sim.position(&Effect::Published(id)) < sim.position(&Effect::Projected(done)));
    assert_eq!(sim.projected.get(&s), Some(&1));
    assert!(sim.book.is_empty(), "the decided turn is disarmed");
    sim.tick(10_000_000);
    assert_eq!(sim.responses.len(), 1);
}

#[test]
fn complete_with_no_send_opens_and_decides_the_turn() {
    let c = complete("c1", json!({}));
    let step = on_event(None, &facts_of(&c, 7, 1_000), &contract_cfg());
    let (rec, expect) = step.write.clone().expect("the complete opens the turn");
    assert_eq!(expect, Expect::Absent);
    assert_eq!(rec.state, TurnState::Decided);
    assert!(step.respond && step.project_self);

    let mut sim = Sim::new(contract_cfg());
    let done = sim.run(1_000, c);
    let w = sim.winner("c1", "0");
    assert_eq!(
        (w.seq, w.blocked, w.synthesized),
        (Some(done), Some(Reason::Error), true)
    );
    assert_eq!(sim.payload("c1", "0")["reason"], "error");
    assert_eq!(sim.projected.get(&done), Some(&1));
}

#[test]
fn a2a_error_blocks_the_turn_with_error() {
    let mut sim = Sim::new(contract_cfg());
    sim.run(1_000, send("c1", json!({})));
    let err = sim.run(2_000, event("a2a.error", "c1", json!({})));
    let w = sim.winner("c1", "0");
    assert_eq!((w.seq, w.blocked), (Some(err), Some(Reason::Error)));
    assert_eq!(w.by, "a2a.error");
    assert_eq!(sim.payload("c1", "0")["reason"], "error");
    let id = sim.record("c1", "0").response_msg_id();
    assert!(sim.position(&Effect::Published(id)) < sim.position(&Effect::Projected(err)));
}

#[test]
fn timeout_at_the_deadline_is_blocked_timeout_synthesized() {
    let mut sim = Sim::new(contract_cfg());
    let s = sim.run(1_000, send("c1", json!({})));
    let deadline = 1_000 + 300_000;
    assert_eq!(sim.record("c1", "0").deadline_ms, Some(deadline));
    assert_eq!(sim.book.next_deadline(), Some(deadline));
    sim.tick(deadline);
    assert!(
        sim.responses.is_empty(),
        "the deadline itself is still on time"
    );
    sim.tick(deadline + 1);
    let w = sim.winner("c1", "0");
    assert_eq!(w.seq, None);
    assert_eq!(w.blocked, Some(Reason::Timeout));
    assert!(w.synthesized);
    assert_eq!(w.by, "deadline");
    assert_eq!(w.at_ms, deadline);
    let p = sim.payload("c1", "0");
    assert_eq!(p["reason"], "timeout");
    assert_eq!(p["synthesized"], true);
    assert_eq!(
        sim.response("c1", "0")
            .raw_event_ref
            .as_ref()
            .map(|r| r.seq),
        Some(s)
    );
    assert!(sim.book.is_empty());
    sim.tick(deadline * 10);
    assert_eq!(sim.attempts.len(), 1);
}

#[test]
fn sends_own_timeout_ms_is_used_and_capped_by_max_timeout() {
    let cfg = contract_cfg();
    let open = |ev: Value, at: i64| {
        let step = on_event(None, &facts_of(&ev, 1, at), &cfg);
        let (rec, expect) = step.write.expect("a send opens the turn");
        assert_eq!(expect, Expect::Absent);
        assert_eq!(rec.state, TurnState::Open);
        (
            rec.deadline_ms.expect("a deadline"),
            rec.send.expect("the send").timeout_ms,
        )
    };
    assert_eq!(
        open(send("c", json!({"timeoutMs": 5_000})), 1_000),
        (6_000, 5_000)
    );
    assert_eq!(
        open(send("c", json!({"timeoutMs": 7_200_000})), 1_000),
        (3_601_000, 3_600_000)
    );
    // Top level works as well as under `data`.
    let mut top = send("c", json!({}));
    merge(&mut top, json!({"timeoutMs": 42_000}));
    assert_eq!(open(top, 0), (42_000, 42_000));
}

#[test]
fn default_timeout_otherwise() {
    let cfg = contract_cfg();
    for ev in [
        send("c", json!({})),
        send("c", json!({"timeoutMs": 0})),
        send("c", json!({"timeoutMs": null})),
        send("c", json!({"timeoutMs": "soon"})),
    ] {
        let step = on_event(None, &facts_of(&ev, 1, 500), &cfg);
        let (rec, _) = step.write.expect("a send opens the turn");
        assert_eq!(rec.deadline_ms, Some(300_500), "{ev}");
    }
}

#[test]
fn deadline_field_minus_its_timestamp_is_the_timeout() {
    let cfg = contract_cfg();
    let deadline_of = |extra: Value| {
        let f = facts_of(&send("c", extra), 1, 10_000);
        let step = on_event(None, &f, &cfg);
        (f.timeout_ms, step.write.expect("open").0.deadline_ms)
    };
    assert_eq!(
        deadline_of(
            json!({"timestamp": "2026-02-17T12:00:00.000Z", "deadline": "2026-02-17T12:02:00Z"})
        ),
        (Some(120_000), Some(130_000))
    );
    // The origin's `ts` in epoch milliseconds, and a deadline in milliseconds too.
    assert_eq!(
        deadline_of(json!({"ts": 1_771_329_600_000_i64, "deadline": 1_771_329_645_000_i64})),
        (Some(45_000), Some(55_000))
    );
    // Capped like timeoutMs.
    assert_eq!(
        deadline_of(
            json!({"timestamp": "2026-02-17T12:00:00Z", "deadline": "2026-02-17T15:00:00Z"})
        ),
        (Some(10_800_000), Some(3_610_000))
    );
    // timeoutMs beats the deadline; a deadline before the timestamp falls back to the default.
    assert_eq!(
        deadline_of(
            json!({"timeoutMs": 1_000, "timestamp": "2026-02-17T12:00:00Z", "deadline": "2026-02-17T12:02:00Z"})
        ),
        (Some(1_000), Some(11_000))
    );
    assert_eq!(
        deadline_of(
            json!({"timestamp": "2026-02-17T12:00:00Z", "deadline": "2026-02-17T11:00:00Z"})
        ),
        (None, Some(310_000))
    );
}

// ---------------------------------------------------------------------------------------------
// 2. The reason table (through `facts()`, fields at the top level or under `data`).
// ---------------------------------------------------------------------------------------------

#[test]
fn wait_status_gives_its_reason_with_any_outcome() {
    for (ws, reason) in [
        ("timeout", Reason::Timeout),
        ("error", Reason::Error),
        ("not_found", Reason::NotFound),
    ] {
        for outcome in [
            json!("no_reply"),
            json!("blocked"),
            json!("success"),
            Value::Null,
        ] {
            let ev = reply("c", "x", json!({"waitStatus": ws, "outcome": outcome}));
            assert_eq!(reason_of(ev), Some(reason), "{ws}/{outcome}");
        }
        let mut top = reply("c", "x", json!({}));
        merge(&mut top, json!({ "waitStatus": ws }));
        assert_eq!(reason_of(top), Some(reason), "top-level {ws}");
        for t in ["a2a.complete", "a2a.error"] {
            assert_eq!(
                reason_of(event(t, "c", json!({"waitStatus": ws}))),
                Some(reason)
            );
        }
    }
}

#[test]
fn explicit_not_found_signals_give_not_found() {
    for extra in [
        json!({"notFound": true}),
        json!({"error": {"code": "not_found", "message": "no such session"}}),
        json!({"errorCode": "NOT_FOUND"}),
        json!({"status": "not_found"}),
    ] {
        assert_eq!(
            reason_of(reply("c", "x", extra.clone())),
            Some(Reason::NotFound),
            "{extra}"
        );
        let mut top = complete("c", json!({}));
        merge(&mut top, extra.clone());
        assert_eq!(reason_of(top), Some(Reason::NotFound), "top-level {extra}");
    }
    assert_eq!(reason_of(reply("c", "x", json!({"notFound": false}))), None);
    assert_eq!(reason_of(reply("c", "x", json!({"status": "ok"}))), None);
}

#[test]
fn failed_outcomes_error_fields_and_a2a_error_give_error() {
    for extra in [
        json!({"outcome": "no_reply"}),
        json!({"outcome": "blocked"}),
        json!({"outcome": "failed"}),
        json!({"error": "boom"}),
        json!({"error": {"code": "E_CRASH"}}),
        json!({"waitStatus": "ok", "outcome": "failed"}),
    ] {
        assert_eq!(
            reason_of(reply("c", "x", extra.clone())),
            Some(Reason::Error),
            "{extra}"
        );
    }
    assert_eq!(
        reason_of(event("a2a.error", "c", json!({}))),
        Some(Reason::Error)
    );
    let f = facts_of(&reply("c", "x", json!({"error": "boom"})), 1, 0);
    assert_eq!(f.failure_detail.as_deref(), Some("boom"));
}

#[test]
fn no_signal_for_a_plain_reply() {
    for extra in [
        json!({}),
        json!({"outcome": "success"}),
        json!({"error": null, "waitError": null}),
        json!({"waitStatus": "ok"}),
    ] {
        assert_eq!(reason_of(reply("c", "x", extra.clone())), None, "{extra}");
    }
    assert_eq!(reason_of(complete("c", json!({"announced": false}))), None);
}

#[test]
fn first_matching_row_wins() {
    let cases = [
        (
            json!({"outcome": "no_reply", "waitStatus": "not_found"}),
            Reason::NotFound,
        ),
        (
            json!({"outcome": "failed", "waitStatus": "timeout"}),
            Reason::Timeout,
        ),
        (
            json!({"notFound": true, "waitStatus": "error"}),
            Reason::Error,
        ),
        (
            json!({"notFound": true, "waitStatus": "timeout"}),
            Reason::Timeout,
        ),
        (
            json!({"notFound": true, "outcome": "failed"}),
            Reason::NotFound,
        ),
        (json!({"error": {"code": "not_found"}}), Reason::NotFound),
        (
            json!({"status": "not_found", "error": "x"}),
            Reason::NotFound,
        ),
    ];
    for (extra, reason) in cases {
        assert_eq!(
            reason_of(reply("c", "x", extra.clone())),
            Some(reason),
            "{extra}"
        );
    }
    // A top-level value is read before `data` (Fields semantics).
    let mut ev = reply("c", "x", json!({"waitStatus": "timeout"}));
    merge(&mut ev, json!({"waitStatus": "not_found"}));
    assert_eq!(reason_of(ev), Some(Reason::NotFound));
    // A top-level null falls through to `data`.
    let mut ev = reply("c", "x", json!({"waitStatus": "error"}));
    merge(&mut ev, json!({"waitStatus": null}));
    assert_eq!(reason_of(ev), Some(Reason::Error));
}

#[test]
fn a_failure_response_decides_the_turn_with_its_reason_not_synthesized() {
    let cfg = contract_cfg();
    for (extra, reason) in [
        (
            json!({"outcome": "no_reply", "waitStatus": "not_found"}),
            Reason::NotFound,
        ),
        (
            json!({"outcome": "no_reply", "waitStatus": "timeout"}),
            Reason::Timeout,
        ),
        (json!({"outcome": "blocked"}), Reason::Error),
    ] {
        let mut sim = Sim::new(cfg);
        sim.run(1_000, send("c", json!({})));
        let r = sim.run(2_000, reply("c", "upstream said no", extra));
        let w = sim.winner("c", "0");
        assert_eq!(
            (w.seq, w.blocked, w.synthesized),
            (Some(r), Some(reason), false)
        );
        assert_eq!(sim.payload("c", "0")["reason"], reason.as_str());
    }
}

// ---------------------------------------------------------------------------------------------
// 3. Event time.
// ---------------------------------------------------------------------------------------------

#[test]
fn reply_stored_before_the_deadline_wins_even_when_processed_after_the_clock_passed_it() {
    let mut sim = Sim::new(contract_cfg());
    sim.run(0, send("c1", json!({"timeoutMs": 1_000})));
    let r = sim.store(999, reply("c1", "just in time", json!({})));
    // The wall clock is far past the deadline, but the reply is still pending: the watermark
    // stays at its store time.
    sim.tick(60_000);
    assert!(sim.responses.is_empty());
    sim.deliver_all();
    sim.tick(120_000);
    let w = sim.winner("c1", "0");
    assert_eq!((w.seq, w.blocked), (Some(r), None));
    assert_eq!(sim.attempts.len(), 1);
}

#[test]
fn reply_stored_exactly_at_the_deadline_wins() {
    let mut sim = Sim::new(contract_cfg());
    sim.run(0, send("c1", json!({"timeoutMs": 1_000})));
    sim.tick(1_000);
    let r = sim.run(1_000, reply("c1", "on the dot", json!({})));
    sim.tick(50_000);
    assert_eq!(sim.winner("c1", "0").seq, Some(r));
    assert_eq!(sim.suppression(r), None);
}

#[test]
fn reply_stored_one_ms_after_the_deadline_is_late() {
    let mut sim = Sim::new(contract_cfg());
    sim.run(0, send("c1", json!({"timeoutMs": 1_000})));
    // No tick in between: processing the reply itself advances the watermark to its store time.
    let r = sim.run(1_001, reply("c1", "too late", json!({})));
    let w = sim.winner("c1", "0");
    assert_eq!(
        (w.seq, w.blocked, w.at_ms),
        (None, Some(Reason::Timeout), 1_000)
    );
    assert_eq!(sim.suppression(r), Some(SuppressReason::Late));
    let id = sim.record("c1", "0").response_msg_id();
    assert!(
        sim.position(&Effect::Published(id))
            < sim.position(&Effect::Suppressed(r, SuppressReason::Late))
    );
}

#[test]
fn an_event_stored_after_the_deadline_times_the_turn_out_even_when_no_deadline_fired() {
    // A new owner may read an open record whose deadline its book does not hold yet: the event
    // itself shows the deadline has passed in event time.
    let cfg = contract_cfg();
    let s = facts_of(&send("c1", json!({"timeoutMs": 1_000})), 1, 0);
    let open = on_event(None, &s, &cfg)
        .write
        .expect("the send opens the turn")
        .0;
    let timed_out = |step: &Step| {
        let (rec, expect) = step.write.clone().expect("a decision");
        let w = rec.winner.expect("a winner");
        (rec.state, expect, w.seq, w.blocked, w.by, w.at_ms)
    };
    let late = facts_of(&reply("c1", "too late", json!({})), 2, 1_001);
    let step = on_event(Some((&open, 7)), &late, &cfg);
    assert_eq!(
        timed_out(&step),
        (
            TurnState::Decided,
            Expect::Revision(7),
            None,
            Some(Reason::Timeout),
            "deadline".to_string(),
            1_000
        )
    );
    assert!(step.respond, "the timeout's response is issued");
    assert_eq!(step.suppress, Some(SuppressReason::Late));
    assert!(!step.project_self);

    let done = facts_of(&complete("c1", json!({})), 3, 5_000);
    let step = on_event(Some((&open, 7)), &done, &cfg);
    assert_eq!(timed_out(&step).3, Some(Reason::Timeout));
    assert!(step.respond && step.project_self && step.suppress.is_none());

    // At the deadline itself the reply is on time and wins.
    let on_time = facts_of(&reply("c1", "on the dot", json!({})), 2, 1_000);
    let step = on_event(Some((&open, 7)), &on_time, &cfg);
    let w = step.write.expect("a decision").0.winner.expect("a winner");
    assert_eq!((w.seq, w.blocked), (Some(2), None));
}

// ---------------------------------------------------------------------------------------------
// 4. Turn identity.
// ---------------------------------------------------------------------------------------------

#[test]
fn turn_id_beats_turn_beats_zero() {
    let turn = |extra: Value| facts_of(&reply("c", "x", extra), 1, 0).turn;
    assert_eq!(turn(json!({"turnId": "t-7", "turn": 3})), "t-7");
    assert_eq!(turn(json!({"turnId": 2, "turn": 3})), "2");
    assert_eq!(turn(json!({"turn": 3})), "3");
    assert_eq!(turn(json!({"turnId": null, "turn": 3})), "3");
    assert_eq!(turn(json!({"turnId": "", "turn": 3})), "3");
    assert_eq!(turn(json!({})), "0");
    assert_eq!(turn(json!({"turn": 0})), "0");
    assert_eq!(turn(json!({"turn": "0"})), "0");
    let mut top = reply("c", "x", json!({"turn": 3}));
    merge(&mut top, json!({"turnId": "top"}));
    assert_eq!(facts_of(&top, 1, 0).turn, "top");
    // Turn ids that are not key tokens are encoded in the record key.
    let f = facts_of(&reply("c", "x", json!({"turnId": "a.b c"})), 1, 0);
    assert_eq!(
        f.record_key(PARTITION),
        format!("p3.c.{}", encode_id("a.b c"))
    );
    assert_ne!(f.record_key(PARTITION), "p3.c.a.b c");
}

#[test]
fn ping_pong_reply_with_turn_1_is_its_own_turn() {
    let mut sim = Sim::new(contract_cfg());
    sim.run(1_000, send("c1", json!({})));
    let r0 = sim.run(2_000, reply("c1", "reply", json!({})));
    let r1 = sim.run(
        3_000,
        reply("c1", "ping-pong reply", json!({"turn": 1, "maxTurns": 3})),
    );
    // No send opened turn 1, but eden and ruda hold turn 0 between them: eden's reply to ruda
    // continues their exchange and is turn 1's response at once, not after the hold.
    assert_eq!(sim.responses.len(), 2);
    sim.tick(1_000_000);
    assert_eq!(sim.winner("c1", "0").seq, Some(r0));
    assert_eq!(sim.winner("c1", "1").seq, Some(r1));
    assert_eq!(sim.record("c1", "1").send, None);
    assert_eq!(sim.responses.len(), 2);
    assert!(sim.suppress_attempts.is_empty());
    assert_ne!(
        sim.record("c1", "0").response_msg_id(),
        sim.record("c1", "1").response_msg_id()
    );
}

#[test]
fn run_and_message_ids_do_not_matter() {
    let s = send(
        "c1",
        json!({"runId": "run-1", "messageId": "m-1", "agentId": "ruda"}),
    );
    let r = reply(
        "c1",
        "ok",
        json!({"runId": "run-2", "messageId": "m-2", "agentId": "eden"}),
    );
    assert_eq!(
        facts_of(&s, 1, 0).record_key(PARTITION),
        facts_of(&r, 2, 0).record_key(PARTITION)
    );
    let mut sim = Sim::new(contract_cfg());
    sim.run(1_000, s);
    let won = sim.run(2_000, r);
    let dup = sim.run(
        3_000,
        reply("c1", "ok", json!({"runId": "run-3", "messageId": "m-3"})),
    );
    assert_eq!(sim.winner("c1", "0").seq, Some(won));
    assert_eq!(sim.suppression(dup), Some(SuppressReason::Duplicate));
    assert_eq!(sim.kv.len(), 1);
}

#[test]
fn conversations_are_separate_turns() {
    let mut sim = Sim::new(contract_cfg());
    sim.run(1_000, send("a", json!({})));
    sim.run(1_000, send("b", json!({})));
    let ra = sim.run(2_000, reply("a", "for a", json!({})));
    let rb = sim.run(2_000, reply("b", "for b", json!({})));
    assert_eq!(sim.winner("a", "0").seq, Some(ra));
    assert_eq!(sim.winner("b", "0").seq, Some(rb));
    assert_eq!(sim.responses.len(), 2);
}

// ---------------------------------------------------------------------------------------------
// 5. The origin's sequences (fixtures/collab-events/a2a-emitted-events-examples.json).
// ---------------------------------------------------------------------------------------------

fn fixture() -> Value {
    serde_json::from_str(include_str!(
        "../../fixtures/collab-events/a2a-emitted-events-examples.json"
    ))
    .expect("the fixture parses")
}

/// Play one of the origin's sequences with its own conversation id; returns the raw seqs.
fn play(sim: &mut Sim, events: &[Value], conv: &str) -> Vec<u64> {
    let mut at = 1_771_329_600_000_i64;
    let mut seqs = Vec::new();
    for ev in events {
        let mut ev = ev.clone();
        assert_eq!(ev["data"]["conversationId"], "uuid");
        ev["data"]["conversationId"] = json!(conv);
        at = ev["ts"].as_i64().unwrap_or(at + 1_000).max(at);
        seqs.push(sim.run(at, ev));
    }
    // Past every deadline.
    sim.tick(at + 10 * 3_600_000);
    seqs
}

#[test]
fn origin_success_with_a_ping_pong_reply() {
    let fx = fixture();
    let events = fx["sequence_success"]
        .as_array()
        .expect("a sequence")
        .clone();
    let conv = "6f1c2b9e-4d3a-4e8b-9c1d-2a3b4c5d6e7f";
    let mut sim = Sim::new(contract_cfg());
    let seqs = play(&mut sim, &events, conv);
    let w0 = sim.winner(conv, "0");
    assert_eq!((w0.seq, w0.blocked), (Some(seqs[1]), None));
    assert_eq!(str_field(&sim.payload(conv, "0"), "message"), "reply");
    let w1 = sim.winner(conv, "1");
    assert_eq!((w1.seq, w1.blocked), (Some(seqs[2]), None));
    assert_eq!(
        str_field(&sim.payload(conv, "1"), "message"),
        "ping-pong reply"
    );
    assert_eq!(sim.responses.len(), 2);
    assert!(sim.suppress_attempts.is_empty());
    assert_eq!(sim.projected.get(&seqs[0]), Some(&1));
    assert_eq!(sim.projected.get(&seqs[3]), Some(&1));
    let id = sim.record(conv, "0").response_msg_id();
    assert!(sim.position(&Effect::Published(id)) < sim.position(&Effect::Projected(seqs[3])));
    assert!(sim
        .kv
        .values()
        .all(|(r, _)| r.state == TurnState::Published));
    let send = sim
        .record(conv, "0")
        .send
        .clone()
        .expect("turn 0 has its send");
    assert_eq!(send.to_agent.as_deref(), Some("eden"));
    assert_eq!(send.target_session_key.as_deref(), Some("agent:eden:main"));
}

#[test]
fn origin_no_reply_with_wait_status_timeout_is_blocked_timeout_not_synthesized() {
    let fx = fixture();
    let events = fx["sequence_no_reply (timeout|error|not_found)"]
        .as_array()
        .expect("a sequence")
        .clone();
    let conv = "0b7e3c1a-5f2d-4a6b-8c9d-1e2f3a4b5c6d";
    let mut sim = Sim::new(contract_cfg());
    let seqs = play(&mut sim, &events, conv);
    let w = sim.winner(conv, "0");
    assert_eq!(
        (w.seq, w.blocked, w.synthesized),
        (Some(seqs[1]), Some(Reason::Timeout), false)
    );
    let p = sim.payload(conv, "0");
    assert_eq!(p["outcome"], "blocked");
    assert_eq!(p["reason"], "timeout");
    assert_eq!(p["synthesized"], false);
    assert!(str_field(&p, "upstreamMessage").starts_with("[outcome] no_reply"));
    assert_eq!(sim.responses.len(), 1);
    assert_eq!(sim.projected.get(&seqs[2]), Some(&1));
    assert!(sim.suppress_attempts.is_empty());
}

#[test]
fn origin_blocked_by_concurrency_limit_is_blocked_error_not_synthesized() {
    let fx = fixture();
    let events = fx["sequence_blocked (concurrency limit)"]
        .as_array()
        .expect("a sequence")
        .clone();
    let conv = "9a8b7c6d-5e4f-4a3b-9c2d-1e0f9a8b7c6d";
    let mut sim = Sim::new(contract_cfg());
    let seqs = play(&mut sim, &events, conv);
    let w = sim.winner(conv, "0");
    assert_eq!(
        (w.seq, w.blocked, w.synthesized),
        (Some(seqs[1]), Some(Reason::Error), false)
    );
    let p = sim.payload(conv, "0");
    assert_eq!(p["reason"], "error");
    assert_eq!(p["synthesized"], false);
    assert!(str_field(&p, "upstreamMessage").contains("blocked"));
    assert_eq!(sim.responses.len(), 1);
    assert_eq!(sim.projected.get(&seqs[2]), Some(&1));
}

#[test]
fn origin_job_failure_complete_is_blocked_error_synthesized() {
    let fx = fixture();
    let ev = fx["job_failure"].clone();
    let conv = "3c4d5e6f-7a8b-4c9d-8e0f-1a2b3c4d5e6f";
    let mut sim = Sim::new(contract_cfg());
    let seqs = play(&mut sim, &[ev], conv);
    let w = sim.winner(conv, "0");
    assert_eq!(
        (w.seq, w.blocked, w.synthesized),
        (Some(seqs[0]), Some(Reason::Error), true)
    );
    assert_eq!(w.detail.as_deref(), Some("<message>"));
    let p = sim.payload(conv, "0");
    assert_eq!(p["outcome"], "blocked");
    assert_eq!(p["reason"], "error");
    assert_eq!(p["synthesized"], true);
    assert_eq!(sim.projected.get(&seqs[0]), Some(&1));
}

// ---------------------------------------------------------------------------------------------
// 6. `winner_response` payloads.
// ---------------------------------------------------------------------------------------------

#[test]
fn blocked_timeout_payload_has_the_four_sections() {
    let mut sim = Sim::new(contract_cfg());
    let s = sim.run(
        1_000,
        send(
            "c1",
            json!({"goal": "ship the release notes", "timeoutMs": 60_000, "runId": "run-9"}),
        ),
    );
    sim.tick(200_000);
    let env = sim.response("c1", "0").clone();
    assert_eq!(env.event_type, "a2a.response");
    assert_eq!(env.event_role, Some(Role::ConversationMain));
    let p = sim.payload("c1", "0");
    assert_eq!(p["outcome"], "blocked");
    assert_eq!(p["reason"], "timeout");
    assert_eq!(p["goal"], "ship the release notes");
    assert_eq!(p["synthesized"], true);
    assert_eq!(p["fromAgent"], "eden", "the reply that did not come");
    assert_eq!(p["toAgent"], "ruda");
    assert_eq!(p["conversationId"], "c1");
    assert_eq!(p["turn"], "0");
    let evidence = p["evidence"].as_array().expect("evidence");
    assert_eq!(
        evidence.len(),
        2,
        "send and deadline, no signal: {evidence:?}"
    );
    assert_eq!(evidence[0]["kind"], "send");
    assert_eq!(evidence[0]["rawSeq"], json!(s));
    assert_eq!(evidence[1]["kind"], "deadline");
    assert_eq!(evidence[1]["at"], rfc3339(61_000));
    assert_eq!(evidence[1]["timeoutMs"], 60_000);
    let next = str_field(&p, "next_action");
    assert!(
        next.contains("eden") && next.contains("turn 0") && next.contains("c1"),
        "{next}"
    );
    let sections = parse_sections(str_field(&p, "message")).expect("the message has the sections");
    assert_eq!(sections["goal"], "ship the release notes");
    assert!(str_field(&sections, "outcome").starts_with("blocked (timeout)"));
    assert!(str_field(&sections, "evidence").contains(&format!("send raw#{s}")));
    assert!(str_field(&sections, "evidence").contains(&rfc3339(61_000)));
    assert_eq!(sections["next_action"], p["next_action"]);
}

#[test]
fn blocked_goal_falls_back_to_the_send_message_shortened() {
    let long = "review ".repeat(60);
    let mut sim = Sim::new(contract_cfg());
    sim.run(1_000, send("c1", json!({ "message": long })));
    sim.run(2_000, complete("c1", json!({})));
    let p = sim.payload("c1", "0");
    let goal = str_field(&p, "goal");
    assert_eq!(goal.chars().count(), 200);
    assert!(goal.ends_with('…'));
    assert!(long.starts_with(goal.trim_end_matches('…')));

    let mut sim = Sim::new(contract_cfg());
    sim.run(1_000, send("c2", json!({"message": "short ask"})));
    sim.run(2_000, complete("c2", json!({})));
    assert_eq!(sim.payload("c2", "0")["goal"], "short ask");
}

#[test]
fn next_action_names_the_target_and_differs_by_reason_and_turn() {
    let rec = |turn: &str| TurnRecord {
        exchange: ExchangeKind::Turn,
        conversation_id: "c1".into(),
        key: "c1".into(),
        turn: turn.into(),
        state: TurnState::Decided,
        send: Some(SendRef {
            seq: 1,
            stored_ms: 0,
            subject: "collab.raw.c1.a2a.send".into(),
            from_agent: Some("ruda".into()),
            to_agent: Some("eden".into()),
            goal: None,
            run_id: None,
            target_session_key: Some("agent:eden:main".into()),
            work_session_id: None,
            a2a_method: None,
            timeout_ms: 300_000,
            role: None,
            thread_id: None,
        }),
        deadline_ms: None,
        winner: None,
        sender: None,
        target: None,
        writer: None,
        early: None,
    };
    let mut seen = Vec::new();
    for turn in ["0", "1"] {
        for reason in [Reason::Timeout, Reason::Error, Reason::NotFound] {
            let text = next_action(&rec(turn), reason, Some("boom"));
            assert!(text.contains("eden"), "{text}");
            assert!(text.contains(&format!("turn {turn}")), "{text}");
            assert!(!seen.contains(&text), "not one fixed sentence: {text}");
            seen.push(text);
        }
    }
    assert!(next_action(&rec("0"), Reason::Timeout, None).contains("timeoutMs"));
    assert!(next_action(&rec("0"), Reason::NotFound, None).contains("agent:eden:main"));
    assert!(next_action(&rec("0"), Reason::Error, Some("disk full")).contains("disk full"));
}

#[test]
fn upstream_failure_keeps_the_upstream_text() {
    let mut sim = Sim::new(contract_cfg());
    let s = sim.run(1_000, send("c1", json!({"goal": "summarise the logs"})));
    let text = "[outcome] no_reply: not found";
    let r = sim.run(
        2_000,
        reply(
            "c1",
            text,
            json!({"outcome": "no_reply", "waitStatus": "not_found", "waitError": "no run"}),
        ),
    );
    let p = sim.payload("c1", "0");
    assert_eq!(p["upstreamMessage"], text);
    assert_ne!(p["message"], text);
    assert_eq!(p["outcome"], "blocked");
    assert_eq!(p["reason"], "not_found");
    assert_eq!(p["synthesized"], false);
    assert_eq!(p["waitStatus"], "not_found", "the upstream fields are kept");
    assert_eq!(p["goal"], "summarise the logs");
    let evidence = p["evidence"].as_array().expect("evidence");
    let kinds: Vec<&str> = evidence.iter().filter_map(|e| e["kind"].as_str()).collect();
    assert_eq!(kinds, ["send", "a2a.response", "deadline"]);
    assert_eq!(evidence[0]["rawSeq"], json!(s));
    assert_eq!(evidence[1]["rawSeq"], json!(r));
    assert!(str_field(&p, "next_action").contains("eden"));
    assert!(
        str_field(&p, "message").contains("no run"),
        "the detail is rendered"
    );
    let sections = parse_sections(str_field(&p, "message")).expect("sections");
    assert!(str_field(&sections, "outcome").starts_with("blocked (not_found)"));
    assert_eq!(
        sim.response("c1", "0")
            .raw_event_ref
            .as_ref()
            .map(|x| x.seq),
        Some(r)
    );
}

#[test]
fn normal_reply_with_the_four_sections_exposes_them() {
    let text = "goal: review PR 12\noutcome: success - approved\nevidence: CI run 88 green\nnext_action: merge it";
    let mut sim = Sim::new(contract_cfg());
    sim.run(1_000, send("c1", json!({})));
    sim.run(2_000, reply("c1", text, json!({})));
    let p = sim.payload("c1", "0");
    assert_eq!(p["message"], text);
    assert_eq!(p["goal"], "review PR 12");
    assert_eq!(p["outcome"], "success - approved");
    assert_eq!(p["evidence"], "CI run 88 green");
    assert_eq!(p["next_action"], "merge it");
    assert!(p.get("reason").is_none() && p.get("synthesized").is_none());

    let mut sim = Sim::new(contract_cfg());
    sim.run(1_000, reply("c2", "plain words", json!({})));
    sim.tick(1_000_000);
    let p = sim.payload("c2", "0");
    assert_eq!(p["message"], "plain words");
    assert!(p.get("goal").is_none() && p.get("outcome").is_none());
}

#[test]
fn next_action_names_the_target_when_no_send_opened_the_turn() {
    let fx = fixture();
    let mut ev = fx["job_failure"].clone();
    ev["data"]["conversationId"] = json!("c1");
    let mut sim = Sim::new(contract_cfg());
    sim.run(1_000, ev);
    let p = sim.payload("c1", "0");
    let next = str_field(&p, "next_action");
    assert!(next.contains("eden"), "{next}");
}

// ---------------------------------------------------------------------------------------------
// Fault handling of the shell's steps (deterministic cases of what the property explores).
// ---------------------------------------------------------------------------------------------

#[test]
fn lost_ack_on_the_deciding_write_is_recognised_as_our_own_win() {
    let mut sim = Sim::new(contract_cfg());
    sim.run(1_000, send("c1", json!({})));
    sim.lose_next_ack = true;
    let r = sim.run(2_000, reply("c1", "ok", json!({})));
    assert_eq!(sim.winner("c1", "0").seq, Some(r));
    assert_eq!(sim.record("c1", "0").state, TurnState::Published);
    assert_eq!(sim.suppression(r), None, "our own win is not a duplicate");
    assert_eq!(sim.responses.len(), 1);
}

#[test]
fn lost_ack_on_the_send_write_still_arms_the_deadline() {
    let mut sim = Sim::new(contract_cfg());
    sim.lose_next_ack = true;
    let s = sim.run(0, send("c1", json!({"timeoutMs": 1_000})));
    // The re-run step has no write: the shell arms from the Open record it re-read.
    let rec = sim.record("c1", "0").clone();
    let step = on_event(Some((&rec, 1)), &sim.raw(s).facts(), &contract_cfg());
    assert_eq!(step.write, None);
    assert_eq!(sim.book.next_deadline(), Some(1_000));
    sim.tick(1_001);
    assert_eq!(sim.winner("c1", "0").blocked, Some(Reason::Timeout));
}

#[test]
fn lost_ack_on_the_deadline_write_still_publishes() {
    let mut sim = Sim::new(contract_cfg());
    sim.run(0, send("c1", json!({"timeoutMs": 1_000})));
    sim.lose_next_ack = true;
    sim.tick(1_001);
    // The pure decision for the re-read record is None; the shell publishes the Decided record.
    let rec = sim.record("c1", "0").clone();
    assert_eq!(on_deadline((&rec, 1)), None);
    assert_eq!(rec.state, TurnState::Published);
    assert_eq!(sim.responses.len(), 1);
}

#[test]
fn crash_after_the_decision_is_published_on_recovery_exactly_once() {
    for point in [CrashPoint::Write, CrashPoint::Publish, CrashPoint::Mark] {
        let mut sim = Sim::new(contract_cfg());
        sim.run(1_000, send("c1", json!({})));
        sim.crash_next = Some(point);
        let done = sim.run(2_000, complete("c1", json!({})));
        assert_eq!(
            sim.deliveries[&done], 2,
            "{point:?}: redelivered after the crash"
        );
        assert_eq!(sim.responses.len(), 1);
        assert!(sim.attempts.iter().all(|(_, w)| w.seq == Some(done)));
        assert_eq!(sim.record("c1", "0").state, TurnState::Published);
        assert!(sim.projected.contains_key(&done));
    }
}

#[test]
fn on_deadline_only_decides_open_turns() {
    let cfg = contract_cfg();
    let step = on_event(None, &facts_of(&send("c", json!({})), 1, 0), &cfg);
    let (open, _) = step.write.expect("open");
    let step = on_deadline((&open, 4)).expect("an open turn times out");
    let (rec, expect) = step.write.clone().expect("a decision");
    assert_eq!(expect, Expect::Revision(4));
    assert!(step.respond && !step.project_self && step.suppress.is_none());
    assert_eq!(rec.state, TurnState::Decided);
    assert_eq!(rec.deadline_ms, None);
    assert_eq!(on_deadline((&rec, 5)), None);
    assert_eq!(on_deadline((&published(&rec), 6)), None);
    assert_eq!(published(&rec).winner, rec.winner);
}

// ---------------------------------------------------------------------------------------------
// 7. Property: random interleavings with faults.
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Signal {
    None,
    WaitTimeout,
    WaitError,
    WaitNotFound,
    NotFoundFlag,
    ErrorCodeNotFound,
    StatusNotFound,
    OutcomeBlocked,
    OutcomeFailed,
    ErrorField,
}

impl Signal {
    fn reason(self) -> Option<Reason> {
        match self {
            Signal::None => None,
            Signal::WaitTimeout => Some(Reason::Timeout),
            Signal::WaitError
            | Signal::OutcomeBlocked
            | Signal::OutcomeFailed
            | Signal::ErrorField => Some(Reason::Error),
            Signal::WaitNotFound
            | Signal::NotFoundFlag
            | Signal::ErrorCodeNotFound
            | Signal::StatusNotFound => Some(Reason::NotFound),
        }
    }

    fn fields(self) -> Value {
        match self {
            Signal::None => json!({}),
            Signal::WaitTimeout => json!({"outcome": "no_reply", "waitStatus": "timeout"}),
            Signal::WaitError => json!({"outcome": "no_reply", "waitStatus": "error"}),
            Signal::WaitNotFound => json!({"outcome": "no_reply", "waitStatus": "not_found"}),
            Signal::NotFoundFlag => json!({"notFound": true, "outcome": "failed"}),
            Signal::ErrorCodeNotFound => json!({"error": {"code": "not_found"}}),
            Signal::StatusNotFound => json!({"status": "not_found"}),
            Signal::OutcomeBlocked => json!({"outcome": "blocked"}),
            Signal::OutcomeFailed => json!({"outcome": "failed", "error": "job failed"}),
            Signal::ErrorField => json!({"error": "boom"}),
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Timeout {
    Default,
    Ms(u64),
    /// Above the cap.
    Huge,
    /// A `deadline` this far after the send's own `timestamp`.
    Deadline(u64),
}

#[derive(Debug, Clone, Copy)]
struct Sel {
    conv: u8,
    turn: u8,
    /// How the turn and the fields are written.
    style: u8,
}

#[derive(Debug, Clone)]
enum Op {
    Send(Sel, Timeout, i64),
    Response(Sel, Signal, i64),
    /// A response by an agent no send addresses.
    Foreign(Sel, i64),
    Complete(Sel, Signal, i64),
    Error(Sel, Signal, i64),
    /// The same content again under a new seq.
    Copy(prop::sample::Index, i64),
    /// The same seq delivered again.
    Redeliver(prop::sample::Index),
    Deliver(usize),
    Advance(i64),
    LoseAck,
    Crash,
    CrashAt(CrashPoint),
}

const PROP_DEFAULT_MS: u64 = 3_000;
const PROP_MAX_MS: u64 = 6_000;

fn prop_cfg() -> TurnConfig {
    TurnConfig {
        default_timeout: Duration::from_millis(PROP_DEFAULT_MS),
        max_timeout: Duration::from_millis(PROP_MAX_MS),
        run_timeout: Duration::from_millis(PROP_DEFAULT_MS),
        early_hold: Duration::from_millis(PROP_DEFAULT_MS),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Send,
    Response,
    Complete,
    Error,
}

/// What the oracle knows of a stored message (independently of `facts()`).
#[derive(Debug, Clone)]
struct Spec {
    kind: Kind,
    turn: (u8, u8),
    /// A response spoken by `mallory`, whom no send addresses.
    foreign: bool,
    failure: Option<Reason>,
    timeout_ms: u64,
    message: String,
    seq: u64,
    at: i64,
}

fn conv_name(c: u8) -> String {
    format!("conv-{c}")
}

/// Build an event in one of several equivalent shapes.
fn build(kind: Kind, sel: Sel, signal: Signal, timeout: Timeout, message: &str) -> Value {
    let event_type = match kind {
        Kind::Send => "a2a.send",
        Kind::Response => "a2a.response",
        Kind::Complete => "a2a.complete",
        Kind::Error => "a2a.error",
    };
    let mut fields = json!({"message": message, "runId": format!("run-{}", sel.style)});
    let turn_fields = match (sel.style % 4, sel.turn) {
        (0, 0) => json!({}),
        (0 | 1, t) => json!({ "turn": t }),
        (2, t) => json!({"turnId": t.to_string(), "turn": 99}),
        (_, t) => json!({ "turnId": t }),
    };
    merge(&mut fields, turn_fields);
    merge(&mut fields, signal.fields());
    if kind == Kind::Send {
        let base = 1_771_329_600_000_i64;
        merge(
            &mut fields,
            match timeout {
                Timeout::Default => json!({}),
                Timeout::Ms(ms) => json!({ "timeoutMs": ms }),
                Timeout::Huge => json!({"timeoutMs": PROP_MAX_MS * 10}),
                Timeout::Deadline(ms) => json!({
                    "timestamp": rfc3339(base),
                    "deadline": rfc3339(base + i64::try_from(ms).expect("small")),
                }),
            },
        );
    }
    let mut ev = event(event_type, &conv_name(sel.conv), json!({}));
    if sel.style >= 4 {
        merge(&mut ev, fields);
    } else {
        merge(&mut ev["data"], fields);
    }
    ev
}

fn effective_timeout(t: Timeout) -> u64 {
    match t {
        Timeout::Default => PROP_DEFAULT_MS,
        Timeout::Ms(ms) | Timeout::Deadline(ms) => ms.min(PROP_MAX_MS),
        Timeout::Huge => PROP_MAX_MS,
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Oracle {
    Open(i64),
    /// A response before any send, held: the hold's deadline, its seq, failure and whether
    /// its speaker is the foreign agent.
    Held(i64, u64, Option<Reason>, bool),
    /// The winner's seq, blocked reason, whether synthesised, and whether the turn's target
    /// (who may answer it) is the foreign agent.
    Decided(Option<u64>, Option<Reason>, bool, bool),
}

type Expected = BTreeMap<(u8, u8), (Oracle, BTreeMap<u64, SuppressReason>)>;

/// Whether the response `s` is spoken between the two sides of its conversation's previous turn
/// (turn `n - 1`, as far as the contract has seen it): every generated exchange is between
/// `ruda` and whoever its target is (`eden`, or `mallory` for a turn a foreign response
/// decided), and every response is addressed to `ruda`, so it is when its speaker is that target.
/// `sent`: the turns a send has come for so far.
fn follows_previous(turns: &Expected, sent: &BTreeSet<(u8, u8)>, s: &Spec) -> bool {
    let (conv, turn) = s.turn;
    let Some(prev) = turn.checked_sub(1) else {
        return false;
    };
    // A previous turn still holding an early response, or ended by a complete or an error
    // before any send, vouches for nobody.
    let prev_target_foreign = match turns.get(&(conv, prev)).map(|(st, _)| *st) {
        None | Some(Oracle::Held(..)) => return false,
        Some(Oracle::Decided(_, _, true, _)) if !sent.contains(&(conv, prev)) => return false,
        Some(Oracle::Open(_)) => false,
        Some(Oracle::Decided(_, _, _, foreign)) => foreign,
    };
    prev_target_foreign == s.foreign
}

/// The contract, walked in stream (store-time) order, with or without an early hold. Every
/// generated send is from `ruda` to `eden`, every complete and error from `ruda`, every response
/// to `ruda` from `eden` or, when `foreign`, from `mallory`.
fn oracle(specs: &[Spec], hold: bool) -> Expected {
    let mut turns: Expected = BTreeMap::new();
    let mut sent: BTreeSet<(u8, u8)> = BTreeSet::new();
    let expire = |turns: &mut Expected, before: i64| {
        for (st, _) in turns.values_mut() {
            match *st {
                Oracle::Open(d) if d < before => {
                    *st = Oracle::Decided(None, Some(Reason::Timeout), true, false);
                }
                Oracle::Held(d, seq, failure, foreign) if d < before => {
                    *st = Oracle::Decided(Some(seq), failure, false, foreign);
                }
                _ => {}
            }
        }
    };
    let further = |held_blocked: bool, s: &Spec| {
        if held_blocked && s.failure.is_none() {
            SuppressReason::Late
        } else {
            SuppressReason::Duplicate
        }
    };
    for s in specs {
        expire(&mut turns, s.at);
        let entry = turns.get(&s.turn).map(|(st, _)| *st);
        let mut suppress: Option<(u64, SuppressReason)> = None;
        let decided = match (entry, s.kind) {
            (None, Kind::Send) => Some(Oracle::Open(
                s.at + i64::try_from(s.timeout_ms).expect("small"),
            )),
            // The send takes the held response if eden spoke it, else refuses it and opens.
            (Some(Oracle::Held(_, seq, failure, false)), Kind::Send) => {
                Some(Oracle::Decided(Some(seq), failure, false, false))
            }
            (Some(Oracle::Held(_, seq, _, true)), Kind::Send) => {
                suppress = Some((seq, SuppressReason::NotTarget));
                Some(Oracle::Open(
                    s.at + i64::try_from(s.timeout_ms).expect("small"),
                ))
            }
            (_, Kind::Send) => None,
            // With no hold, the response is the turn's at once, and its speaker its target; so
            // is a ping-pong reply, spoken by a side of the previous turn to its other side.
            (None, Kind::Response) if !hold || follows_previous(&turns, &sent, s) => {
                Some(Oracle::Decided(Some(s.seq), s.failure, false, s.foreign))
            }
            (None, Kind::Response) => Some(Oracle::Held(
                s.at + i64::try_from(PROP_DEFAULT_MS).expect("small"),
                s.seq,
                s.failure,
                s.foreign,
            )),
            // A further response: the held one's (or the winner's) speaker's is suppressed as
            // a further response, anyone else's as not the target's.
            (
                Some(Oracle::Held(_, _, earlier, target) | Oracle::Decided(_, earlier, _, target)),
                Kind::Response,
            ) => {
                suppress = Some((
                    s.seq,
                    if s.foreign == target {
                        further(earlier.is_some(), s)
                    } else {
                        SuppressReason::NotTarget
                    },
                ));
                None
            }
            (Some(Oracle::Held(..)), Kind::Complete | Kind::Error) => None,
            (Some(Oracle::Open(_)), Kind::Response) if s.foreign => {
                suppress = Some((s.seq, SuppressReason::NotTarget));
                None
            }
            (Some(Oracle::Open(_)), Kind::Response) => {
                Some(Oracle::Decided(Some(s.seq), s.failure, false, false))
            }
            (None | Some(Oracle::Open(_)), Kind::Complete | Kind::Error) => Some(Oracle::Decided(
                Some(s.seq),
                Some(s.failure.unwrap_or(Reason::Error)),
                true,
                false,
            )),
            (Some(Oracle::Decided(..)), _) => None,
        };
        let slot = turns
            .entry(s.turn)
            .or_insert((decided.unwrap_or(Oracle::Open(i64::MAX)), BTreeMap::new()));
        if let Some(st) = decided {
            slot.0 = st;
        }
        if let Some((seq, reason)) = suppress {
            slot.1.insert(seq, reason);
        }
        if s.kind == Kind::Send {
            sent.insert(s.turn);
        }
    }
    expire(&mut turns, i64::MAX);
    turns
}

/// `hold`: with `turns.early_hold` (as long as the default timeout), else without.
fn check_case(convs: u8, nturns: u8, ops: &[Op], hold: bool) -> Result<(), TestCaseError> {
    let cfg = TurnConfig {
        early_hold: if hold {
            prop_cfg().early_hold
        } else {
            Duration::ZERO
        },
        ..prop_cfg()
    };
    let mut sim = Sim::new(cfg);
    let mut specs: Vec<Spec> = Vec::new();
    let mut now = 0_i64;
    let store = |sim: &mut Sim,
                 specs: &mut Vec<Spec>,
                 now: i64,
                 kind: Kind,
                 sel: Sel,
                 signal: Signal,
                 timeout: Timeout,
                 foreign: bool| {
        let sel = Sel {
            conv: sel.conv % convs,
            turn: sel.turn % nturns,
            style: sel.style,
        };
        let message = format!("{kind:?} #{}", specs.len() + 1);
        let mut value = build(kind, sel, signal, timeout, &message);
        if foreign {
            value["data"]["fromAgent"] = json!("mallory");
        }
        let seq = sim.store(now, value);
        let failure = match kind {
            Kind::Send => None,
            _ => signal.reason(),
        };
        specs.push(Spec {
            kind,
            turn: (sel.conv, sel.turn),
            foreign,
            failure,
            timeout_ms: effective_timeout(timeout),
            message,
            seq,
            at: now,
        });
    };
    for op in ops {
        match op {
            Op::Send(sel, t, gap) => {
                now += gap;
                store(
                    &mut sim,
                    &mut specs,
                    now,
                    Kind::Send,
                    *sel,
                    Signal::None,
                    *t,
                    false,
                );
            }
            Op::Response(sel, sig, gap) => {
                now += gap;
                store(
                    &mut sim,
                    &mut specs,
                    now,
                    Kind::Response,
                    *sel,
                    *sig,
                    Timeout::Default,
                    false,
                );
            }
            Op::Foreign(sel, gap) => {
                now += gap;
                store(
                    &mut sim,
                    &mut specs,
                    now,
                    Kind::Response,
                    *sel,
                    Signal::None,
                    Timeout::Default,
                    true,
                );
            }
            Op::Complete(sel, sig, gap) => {
                now += gap;
                store(
                    &mut sim,
                    &mut specs,
                    now,
                    Kind::Complete,
                    *sel,
                    *sig,
                    Timeout::Default,
                    false,
                );
            }
            Op::Error(sel, sig, gap) => {
                now += gap;
                store(
                    &mut sim,
                    &mut specs,
                    now,
                    Kind::Error,
                    *sel,
                    *sig,
                    Timeout::Default,
                    false,
                );
            }
            Op::Copy(pick, gap) => {
                if specs.is_empty() {
                    continue;
                }
                now += gap;
                let orig = specs[pick.index(specs.len())].clone();
                let value = sim.raw(orig.seq).value;
                let seq = sim.store(now, value);
                specs.push(Spec {
                    seq,
                    at: now,
                    ..orig
                });
            }
            Op::Redeliver(pick) => {
                if !sim.log.is_empty() {
                    let seq = pick.index(sim.log.len()) as u64 + 1;
                    sim.pending.push_back(seq);
                }
            }
            Op::Deliver(n) => {
                for _ in 0..*n {
                    sim.deliver_one();
                }
            }
            Op::Advance(ms) => {
                now += ms;
                sim.tick(now);
            }
            Op::LoseAck => sim.lose_next_ack = true,
            Op::Crash => sim.recover(),
            Op::CrashAt(p) => sim.crash_next = Some(*p),
        }
    }
    sim.deliver_all();
    sim.tick(now + i64::try_from(PROP_MAX_MS).expect("small") + 1);

    let expected = oracle(&specs, hold);
    prop_assert_eq!(sim.responses.len(), expected.len(), "one response per turn");
    prop_assert!(sim.book.is_empty(), "every deadline fired");
    let mut winners = Vec::new();
    let mut all_suppressed = BTreeMap::new();
    for ((c, t), (st, sup)) in &expected {
        let (conv, turn) = (conv_name(*c), t.to_string());
        let rec = sim.record(&conv, &turn).clone();
        prop_assert_eq!(rec.state, TurnState::Published, "{}/{}", conv, turn);
        let w = rec.winner.clone().expect("a winner");
        let Oracle::Decided(seq, blocked, synthesized, _) = *st else {
            return Err(TestCaseError::fail("the oracle left a turn open"));
        };
        prop_assert_eq!(
            (w.seq, w.blocked, w.synthesized),
            (seq, blocked, synthesized),
            "winner of {}/{}",
            conv,
            turn
        );
        let id = rec.response_msg_id();
        for (aid, aw) in &sim.attempts {
            if *aid == id {
                prop_assert_eq!(
                    aw,
                    &w,
                    "every publication of {} carries the same winner",
                    id
                );
            }
        }
        let p = sim.payload(&conv, &turn);
        match (blocked, seq) {
            (None, Some(s)) => {
                let spec = &specs[usize::try_from(s - 1).expect("small")];
                prop_assert_eq!(str_field(&p, "message"), spec.message.as_str());
                prop_assert!(p.get("reason").is_none());
            }
            (Some(r), _) => {
                prop_assert_eq!(str_field(&p, "outcome"), "blocked");
                prop_assert_eq!(str_field(&p, "reason"), r.as_str());
                prop_assert_eq!(p.get("synthesized"), Some(&json!(synthesized)));
                prop_assert!(parse_sections(str_field(&p, "message")).is_some());
            }
            (None, None) => return Err(TestCaseError::fail("a real reply without a seq")),
        }
        if let Some(s) = seq {
            winners.push(s);
        }
        all_suppressed.extend(sup.iter().map(|(k, v)| (*k, *v)));
    }
    // Every further response is suppressed once (per delivery) with the right reason; no
    // response is both published and suppressed; nothing is dropped.
    let got: BTreeMap<u64, SuppressReason> = sim
        .suppressed
        .keys()
        .map(|s| (*s, sim.suppression(*s).expect("attempted")))
        .collect();
    prop_assert_eq!(&got, &all_suppressed);
    // A refused early response is suppressed by each delivery of the send that refused it too.
    let send_deliveries: usize = specs
        .iter()
        .filter(|s| s.kind == Kind::Send)
        .map(|s| sim.deliveries.get(&s.seq).copied().unwrap_or(0))
        .sum();
    for (seq, reason) in &sim.suppress_attempts {
        let n = sim
            .suppress_attempts
            .iter()
            .filter(|(s, _)| s == seq)
            .count();
        let own = sim.deliveries.get(seq).copied().unwrap_or(0);
        let bound = if *reason == SuppressReason::NotTarget {
            own + send_deliveries
        } else {
            own
        };
        prop_assert!(n <= bound, "seq {} suppressed {} times", seq, n);
    }
    for w in &winners {
        prop_assert!(
            !sim.suppressed.contains_key(w),
            "seq {} published and suppressed",
            w
        );
    }
    for s in &specs {
        let handled = match s.kind {
            Kind::Response => winners.contains(&s.seq) || sim.suppressed.contains_key(&s.seq),
            _ => sim.projected.contains_key(&s.seq),
        };
        prop_assert!(handled, "seq {} ({:?}) was dropped", s.seq, s.kind);
    }
    Ok(())
}

fn sel() -> impl Strategy<Value = Sel> {
    (0u8..2, 0u8..2, 0u8..8).prop_map(|(conv, turn, style)| Sel { conv, turn, style })
}

fn signal() -> impl Strategy<Value = Signal> {
    prop_oneof![
        10 => Just(Signal::None),
        1 => Just(Signal::WaitTimeout),
        1 => Just(Signal::WaitError),
        1 => Just(Signal::WaitNotFound),
        1 => Just(Signal::NotFoundFlag),
        1 => Just(Signal::ErrorCodeNotFound),
        1 => Just(Signal::StatusNotFound),
        1 => Just(Signal::OutcomeBlocked),
        1 => Just(Signal::OutcomeFailed),
        1 => Just(Signal::ErrorField),
    ]
}

fn timeout() -> impl Strategy<Value = Timeout> {
    prop_oneof![
        2 => Just(Timeout::Default),
        3 => (1u64..20).prop_map(|n| Timeout::Ms(n * 250)),
        1 => Just(Timeout::Huge),
        1 => (1u64..32).prop_map(|n| Timeout::Deadline(n * 250)),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    // Coarse times (quarter seconds) so that messages land exactly on deadlines often.
    let gap = (0i64..6).prop_map(|n| n * 250);
    prop_oneof![
        4 => (sel(), timeout(), gap.clone()).prop_map(|(s, t, g)| Op::Send(s, t, g)),
        5 => (sel(), signal(), gap.clone()).prop_map(|(s, x, g)| Op::Response(s, x, g)),
        2 => (sel(), gap.clone()).prop_map(|(s, g)| Op::Foreign(s, g)),
        2 => (sel(), signal(), gap.clone()).prop_map(|(s, x, g)| Op::Complete(s, x, g)),
        1 => (sel(), signal(), gap.clone()).prop_map(|(s, x, g)| Op::Error(s, x, g)),
        2 => (any::<prop::sample::Index>(), gap).prop_map(|(i, g)| Op::Copy(i, g)),
        2 => any::<prop::sample::Index>().prop_map(Op::Redeliver),
        5 => (1usize..4).prop_map(Op::Deliver),
        2 => (0i64..32).prop_map(|n| Op::Advance(n * 250)),
        3 => Just(Op::LoseAck),
        2 => Just(Op::Crash),
        1 => prop_oneof![
            Just(CrashPoint::Write),
            Just(CrashPoint::Publish),
            Just(CrashPoint::Mark),
        ]
        .prop_map(Op::CrashAt),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 4096,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn exactly_one_response_per_turn_under_interleavings_and_faults(
        convs in 1u8..=2,
        nturns in 1u8..=3,
        ops in prop::collection::vec(op(), 1..48),
        hold in any::<bool>(),
    ) {
        check_case(convs, nturns, &ops, hold)?;
    }

    /// The same walk narrowed to where a response may come before its send as a ping-pong
    /// reply: one conversation of two or three turns, the hold always on. With the rule broken
    /// so that a previous turn still holding its early response vouches for the next, this
    /// failed in 8 runs of 8, the walk above in 7 of 8.
    #[test]
    fn exactly_one_response_per_turn_with_ping_pong_replies(
        nturns in 2u8..=3,
        ops in prop::collection::vec(op(), 1..48),
    ) {
        check_case(1, nturns, &ops, true)?;
    }
}

#[test]
fn blank_goal_falls_back_to_the_message() {
    let f = facts_of(
        &send("c", json!({"goal": "  ", "message": "do the thing"})),
        1,
        0,
    );
    assert_eq!(f.goal.as_deref(), Some("do the thing"));
}
