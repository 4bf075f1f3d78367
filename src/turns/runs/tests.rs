// Unit and property tests of the run contract (docs/contract.md section 2b), pure, fake clock.
//
// `RunSim` plays the I/O shell of src/bus/turns.rs for AG-UI runs over an in-memory KV map and
// the partition's `OpenTurns` and `OpenRuns`: write with the CAS expectation, publish the winner
// under its Msg-Id (first publication per Msg-Id is kept, as the duplicate window does), mark it
// published, then project or suppress the event. A timed-out run's ends are derived from the
// simulated raw log with `RunScan`, as the shell derives them from the raw stream.

use super::super::book::OpenTurns;
use super::super::{
    on_deadline, on_event, published, Expect, Step, SuppressReason, TurnConfig, TurnRecord,
    TurnState, Winner,
};
use super::*;
use crate::ingest::{normalize, RawInput, SubjectInfo};
use proptest::prelude::*;
use serde_json::{json, Value};
use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

const PARTITION: u16 = 5;
const TIMEOUT_MS: i64 = 2_000;

fn cfg() -> TurnConfig {
    TurnConfig {
        default_timeout: Duration::from_secs(300),
        max_timeout: Duration::from_secs(3600),
        run_timeout: Duration::from_millis(TIMEOUT_MS as u64),
        early_hold: Duration::from_millis(TIMEOUT_MS as u64),
    }
}

/// Normalise an AG-UI event as the worker does, under subject key `key`.
fn envelope(v: &Value, key: &str) -> Envelope {
    let bytes = serde_json::to_vec(v).expect("serialises");
    let input = RawInput {
        bytes: &bytes,
        subject: Some(SubjectInfo {
            key: key.into(),
            type_suffix: "agui".into(),
        }),
        raw_ref: None,
        relay: Default::default(),
    };
    let mut events =
        normalize(&input, crate::ingest::default_settings()).expect("an AG-UI event is projected");
    events.remove(0).envelope
}

fn started(thread: &str, run: &str) -> Value {
    json!({"type": "RUN_STARTED", "threadId": thread, "runId": run})
}
fn finished(thread: &str, run: &str) -> Value {
    json!({"type": "RUN_FINISHED", "threadId": thread, "runId": run})
}
/// AG-UI's RUN_ERROR has no ids; `run` adds one (a producer may).
fn error(run: Option<&str>) -> Value {
    let mut v = json!({"type": "RUN_ERROR", "message": "model overloaded", "code": "503"});
    if let (Some(r), Some(o)) = (run, v.as_object_mut()) {
        o.insert("runId".into(), json!(r));
    }
    v
}
fn text_start(m: &str) -> Value {
    json!({"type": "TEXT_MESSAGE_START", "messageId": m, "role": "assistant"})
}
fn text_content(m: &str) -> Value {
    json!({"type": "TEXT_MESSAGE_CONTENT", "messageId": m, "delta": "hel"})
}
fn text_end(m: &str) -> Value {
    json!({"type": "TEXT_MESSAGE_END", "messageId": m})
}
fn tool_start(t: &str) -> Value {
    json!({"type": "TOOL_CALL_START", "toolCallId": t, "toolCallName": "search"})
}
fn tool_end(t: &str) -> Value {
    json!({"type": "TOOL_CALL_END", "toolCallId": t})
}

#[derive(Debug, Clone)]
struct Raw {
    seq: u64,
    stored_ms: i64,
    key: String,
    env: Envelope,
    header: Option<String>,
    /// The publishing agent (`_as.<agent>` in the subject), if any.
    agent: Option<String>,
}

impl Raw {
    fn subject(&self) -> String {
        match &self.agent {
            Some(a) => format!("collab.raw.{}._as.{a}.agui", self.key),
            None => format!("collab.raw.{}.agui", self.key),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CrashPoint {
    Write,
    Publish,
}

#[derive(Debug)]
enum Halt {
    Conflict,
    Crash,
}

#[derive(Debug, Clone, PartialEq)]
enum Out {
    /// A publication by Msg-Id (the first per Msg-Id is stored).
    Published(String),
    Projected(u64),
    Suppressed(u64, SuppressReason),
}

#[derive(Default)]
struct RunSim {
    log: Vec<Raw>,
    pending: VecDeque<u64>,
    now: i64,
    kv: BTreeMap<String, (TurnRecord, u64)>,
    revision: u64,
    book: Option<OpenTurns<()>>,
    runs: OpenRuns,
    crash_next: Option<CrashPoint>,
    /// First publication per Msg-Id.
    stored: BTreeMap<String, Envelope>,
    /// Every publication attempt of a run's own terminal, with the winner it carried.
    attempts: Vec<(String, Winner)>,
    outs: Vec<Out>,
}

impl RunSim {
    fn new() -> RunSim {
        RunSim {
            book: Some(OpenTurns::new(0)),
            ..RunSim::default()
        }
    }

    fn book(&mut self) -> &mut OpenTurns<()> {
        self.book.get_or_insert_with(|| OpenTurns::new(0))
    }

    fn store_with(&mut self, at_ms: i64, key: &str, v: Value, header: Option<&str>) -> u64 {
        if let Some(last) = self.log.last() {
            assert!(at_ms >= last.stored_ms, "store times follow the sequence");
        }
        self.now = self.now.max(at_ms);
        let seq = self.log.len() as u64 + 1;
        self.log.push(Raw {
            seq,
            stored_ms: at_ms,
            key: key.into(),
            env: envelope(&v, key),
            header: header.map(str::to_string),
            agent: None,
        });
        self.pending.push_back(seq);
        seq
    }

    /// Store and process everything pending, published by `agent`'s user.
    fn run_as(&mut self, at_ms: i64, key: &str, agent: Option<&str>, v: Value) -> u64 {
        let seq = self.store_with(at_ms, key, v, None);
        if let Some(last) = self.log.last_mut() {
            last.agent = agent.map(str::to_string);
        }
        self.deliver_all();
        seq
    }

    /// Store and process everything pending.
    fn run(&mut self, at_ms: i64, key: &str, v: Value) -> u64 {
        let seq = self.store_with(at_ms, key, v, None);
        self.deliver_all();
        seq
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
        match self.process(seq) {
            Ok(()) => {
                self.pending.pop_front();
            }
            Err(()) => self.recover(),
        }
    }

    /// The clock reaches `now`; the watermark is the earliest pending store time, or now.
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

    /// Drop the memory of the partition and rebuild it from KV, republishing decided runs.
    fn recover(&mut self) {
        self.book = Some(OpenTurns::new(0));
        self.runs = OpenRuns::default();
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

    fn remember(&mut self, key: &str, rec: &TurnRecord) {
        self.runs.note(rec);
        match (rec.state, rec.deadline_ms) {
            (TurnState::Open, Some(d)) => self.book().open(key, Some(d), (), None),
            (TurnState::Open, None) => {}
            _ => {
                self.book().close(key);
            }
        }
    }

    fn process(&mut self, seq: u64) -> Result<(), ()> {
        let raw = self.raw(seq);
        self.expire(raw.stored_ms)?;
        let ev = RunEvent::of(
            &raw.env,
            &raw.key,
            raw.header.as_deref(),
            raw.seq,
            raw.stored_ms,
            &raw.subject(),
            raw.agent.as_deref(),
        );
        let Some(f) = ev.and_then(|e| e.facts(&self.runs)) else {
            self.outs.push(Out::Projected(seq));
            return Ok(());
        };
        let key = f.record_key(PARTITION);
        for _ in 0..16 {
            let current = self.kv.get(&key).cloned();
            if let Some((rec, _)) = &current {
                self.remember(&key, rec);
            }
            let step = on_event(current.as_ref().map(|(r, v)| (r, *v)), &f, &cfg());
            match self.execute(&key, current, step, Some(&raw)) {
                Ok(()) => return Ok(()),
                Err(Halt::Conflict) => continue,
                Err(Halt::Crash) => return Err(()),
            }
        }
        panic!("no progress on seq {seq}");
    }

    fn expire(&mut self, watermark: i64) -> Result<(), ()> {
        let expired = self.book().expire(watermark);
        for (_, key) in expired {
            let Some((rec, rev)) = self.kv.get(&key).cloned() else {
                continue;
            };
            let outcome = match on_deadline((&rec, rev)) {
                Some(step) => self.execute(&key, Some((rec, rev)), step, None),
                None => {
                    self.remember(&key, &rec);
                    Ok(())
                }
            };
            match outcome {
                Ok(()) | Err(Halt::Conflict) => {}
                Err(Halt::Crash) => return Err(()),
            }
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
        Ok(self.revision)
    }

    fn crash_point(&mut self, at: CrashPoint) -> Result<(), Halt> {
        if self.crash_next == Some(at) {
            self.crash_next = None;
            return Err(Halt::Crash);
        }
        Ok(())
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
            self.outs.push(Out::Projected(raw.seq));
        }
        if let Some(reason) = step.suppress {
            let raw = raw.expect("only events are suppressed");
            let (rec, _) = after.as_ref().expect("suppression refers to the record");
            let env = suppressed(&raw.env, rec, reason);
            assert_eq!(env.event_type, SUPPRESSED_TYPE);
            self.outs.push(Out::Suppressed(raw.seq, reason));
        }
        if let Some(seq) = step.suppress_early {
            let (rec, _) = after.as_ref().expect("suppression refers to the record");
            let env = suppressed(&self.raw(seq).env, rec, SuppressReason::NotTarget);
            assert_eq!(env.event_type, SUPPRESSED_TYPE);
            self.outs
                .push(Out::Suppressed(seq, SuppressReason::NotTarget));
        }
        Ok(())
    }

    /// What the shell publishes for a decided run: the terminal, or the ends then `run.failed`.
    fn publish(&mut self, key: &str, rec: &TurnRecord, rev: u64) -> Result<(), Halt> {
        assert_eq!(rec.state, TurnState::Decided);
        let winner = rec.winner.clone().expect("a decided run has a winner");
        let mut msgs = Vec::new();
        match winner.seq {
            Some(s) => msgs.push((rec.response_msg_id(), terminal(rec, Some(&self.raw(s).env)))),
            None => {
                let open = self.scan(rec);
                for item in &open {
                    msgs.push(end_of(rec, item, winner.at_ms));
                }
                msgs.push((rec.response_msg_id(), timeout_failure(rec, &winner, &open)));
            }
        }
        self.attempts.push((rec.response_msg_id(), winner));
        for (id, env) in msgs {
            if !self.stored.contains_key(&id) {
                self.stored.insert(id.clone(), env);
                self.outs.push(Out::Published(id));
            }
        }
        self.crash_point(CrashPoint::Publish)?;
        self.cas(key, &published(rec), Expect::Revision(rev))?;
        Ok(())
    }

    /// The shell's raw-stream read: the key's events from the run's start to its deadline.
    fn scan(&self, rec: &TurnRecord) -> Vec<OpenItem> {
        let start = rec.send.as_ref().expect("a timed-out run has a start");
        let deadline = start.stored_ms + start.timeout_ms as i64;
        let mut scan = RunScan::new(&rec.key, &rec.turn);
        for raw in self.log.iter().filter(|r| r.seq >= start.seq) {
            if raw.stored_ms > deadline {
                break;
            }
            if raw.key == rec.key {
                scan.observe(&raw.env, raw.header.as_deref(), raw.agent.as_deref());
            }
        }
        scan.open_items().to_vec()
    }

    fn record(&self, key: &str, run: &str) -> &TurnRecord {
        let k = super::super::exchange_key(ExchangeKind::Run, PARTITION, key, run);
        &self
            .kv
            .get(&k)
            .unwrap_or_else(|| panic!("no record for run {key}/{run}"))
            .0
    }

    fn terminal_of(&self, key: &str, run: &str) -> &Envelope {
        let id = self.record(key, run).response_msg_id();
        self.stored
            .get(&id)
            .unwrap_or_else(|| panic!("no terminal published for {id}"))
    }

    /// Every publication, in order, as (type, agUiType).
    fn published_types(&self) -> Vec<(String, String)> {
        self.outs
            .iter()
            .filter_map(|o| match o {
                Out::Published(id) => self.stored.get(id),
                _ => None,
            })
            .map(|e| {
                (
                    e.event_type.clone(),
                    e.payload
                        .as_ref()
                        .and_then(|p| p.get(TYPE_FIELD))
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_string(),
                )
            })
            .collect()
    }

    fn suppression(&self, seq: u64) -> Option<SuppressReason> {
        self.outs.iter().find_map(|o| match o {
            Out::Suppressed(s, r) if *s == seq => Some(*r),
            _ => None,
        })
    }

    fn projected(&self, seq: u64) -> bool {
        self.outs.contains(&Out::Projected(seq))
    }
}

fn payload_str<'a>(env: &'a Envelope, field: &str) -> Option<&'a str> {
    env.payload.as_ref()?.get(field)?.as_str()
}

// ---------------------------------------------------------------------------------------------
// The rules of docs/contract.md section 2b.
// ---------------------------------------------------------------------------------------------

#[test]
fn a_finished_run_publishes_its_run_finished_once_as_itself() {
    let mut sim = RunSim::new();
    let start = sim.run(1_000, "t1", started("t1", "r1"));
    sim.run(1_100, "t1", text_start("m1"));
    sim.run(1_200, "t1", text_end("m1"));
    let fin = sim.run(1_500, "t1", finished("t1", "r1"));
    sim.tick(60_000);
    assert!(sim.projected(start), "RUN_STARTED is projected as it is");
    assert!(
        !sim.projected(fin),
        "the terminal is published once, as the run's winner"
    );
    let t = sim.terminal_of("t1", "r1");
    assert_eq!(t.event_type, "run.finished");
    assert_eq!(t.event_role, Some(Role::SystemObservability));
    assert_eq!(payload_str(t, TYPE_FIELD), Some("RUN_FINISHED"));
    let w = sim.record("t1", "r1").winner.clone().expect("decided");
    assert_eq!((w.seq, w.blocked, w.synthesized), (Some(fin), None, false));
    assert_eq!(sim.record("t1", "r1").state, TurnState::Published);
    assert_eq!(sim.record("t1", "r1").response_msg_id(), "run:t1:r1");
    assert_eq!(
        sim.published_types(),
        vec![("run.finished".to_string(), "RUN_FINISHED".to_string())]
    );
}

#[test]
fn a_failed_run_publishes_its_real_run_error_not_a_blocked_outcome() {
    let mut sim = RunSim::new();
    sim.run(1_000, "t1", started("t1", "r1"));
    let err = sim.run(1_500, "t1", error(Some("r1")));
    sim.tick(60_000);
    let t = sim.terminal_of("t1", "r1");
    assert_eq!(t.event_type, "run.failed");
    assert_eq!(payload_str(t, "message"), Some("model overloaded"));
    assert!(t.payload.as_ref().and_then(|p| p.get("reason")).is_none());
    let w = sim.record("t1", "r1").winner.clone().expect("decided");
    assert_eq!((w.seq, w.blocked), (Some(err), None));
}

#[test]
fn an_abandoned_run_gets_ends_for_what_it_left_open_then_run_failed_timeout() {
    let mut sim = RunSim::new();
    let start = sim.run(1_000, "t1", started("t1", "r1"));
    sim.run(1_100, "t1", text_start("m1"));
    sim.run(1_150, "t1", text_content("m1"));
    sim.run(1_200, "t1", text_start("m2"));
    sim.run(1_250, "t1", text_end("m2"));
    sim.run(1_300, "t1", tool_start("c1"));
    sim.run(1_400, "t1", tool_start("c2"));
    sim.run(1_450, "t1", tool_end("c2"));
    sim.tick(1_000 + TIMEOUT_MS);
    assert!(
        sim.stored.is_empty(),
        "a run ending exactly at its deadline is still on time"
    );
    sim.tick(1_001 + TIMEOUT_MS);
    assert_eq!(
        sim.published_types(),
        vec![
            ("text.final".to_string(), "TEXT_MESSAGE_END".to_string()),
            ("tool.args".to_string(), "TOOL_CALL_END".to_string()),
            ("run.failed".to_string(), "RUN_ERROR".to_string()),
        ],
        "one end per open message and tool call, before run.failed"
    );
    let end = sim
        .stored
        .get("run:t1:r1:end:message:m1")
        .expect("m1 ended");
    assert_eq!(end.message_id, Some(json!("m1")));
    assert_eq!(end.run_id, Some(json!("r1")));
    assert_eq!(end.thread_id, Some(json!("t1")));
    assert_eq!(
        end.payload.as_ref().and_then(|p| p.get("synthesized")),
        Some(&json!(true))
    );
    let tool = sim.stored.get("run:t1:r1:end:tool:c1").expect("c1 ended");
    assert_eq!(payload_str(tool, "toolCallId"), Some("c1"));
    assert!(
        crate::facts::AgUiFacts::of(end).is_some() && crate::facts::AgUiFacts::of(tool).is_some(),
        "the ends read back as AG-UI events"
    );
    let f = sim.terminal_of("t1", "r1");
    assert_eq!(f.event_type, "run.failed");
    assert_eq!(payload_str(f, "reason"), Some("timeout"));
    assert_eq!(
        f.payload.as_ref().and_then(|p| p.get("synthesized")),
        Some(&json!(true))
    );
    assert!(payload_str(f, "message").is_some_and(|m| m.contains("r1")));
    let evidence = f
        .payload
        .as_ref()
        .and_then(|p| p.get("evidence"))
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    assert_eq!(evidence[0]["kind"], "run.started");
    assert_eq!(evidence[0]["rawSeq"], start);
    assert_eq!(evidence[1]["kind"], "deadline");
    assert_eq!(evidence[1]["timeoutMs"], TIMEOUT_MS);
    assert_eq!(f.timestamp.as_deref(), Some("1970-01-01T00:00:03.000Z"));
}

#[test]
fn a_run_finished_twice_suppresses_the_second_as_duplicate() {
    let mut sim = RunSim::new();
    sim.run(1_000, "t1", started("t1", "r1"));
    let first = sim.run(1_500, "t1", finished("t1", "r1"));
    let second = sim.run(1_600, "t1", finished("t1", "r1"));
    let err = sim.run(1_700, "t1", error(None));
    sim.tick(60_000);
    assert_eq!(sim.suppression(second), Some(SuppressReason::Duplicate));
    assert_eq!(
        sim.record("t1", "r1").winner.as_ref().and_then(|w| w.seq),
        Some(first)
    );
    assert!(
        sim.projected(err),
        "a RUN_ERROR naming no run, with no run of the key open, is projected as it is"
    );
    let env = suppressed(
        &sim.raw(second).env,
        sim.record("t1", "r1"),
        SuppressReason::Duplicate,
    );
    assert_eq!(env.event_role, Some(Role::SystemObservability));
    let p = env.payload.clone().unwrap_or_default();
    assert_eq!(p["reason"], "duplicate");
    assert_eq!(p["winner"]["msgId"], "run:t1:r1");
    assert_eq!(p["winner"]["rawSeq"], first);
    assert_eq!(p["terminal"]["agUiType"], "RUN_FINISHED");
}

#[test]
fn a_terminal_after_a_synthesised_timeout_is_suppressed_late() {
    let mut sim = RunSim::new();
    sim.run(1_000, "t1", started("t1", "r1"));
    let late = sim.run(1_000 + TIMEOUT_MS + 1, "t1", finished("t1", "r1"));
    let late_err = sim.store_with(1_000 + TIMEOUT_MS + 5, "t1", error(None), Some("r1"));
    sim.deliver_all();
    assert_eq!(sim.suppression(late), Some(SuppressReason::Late));
    assert_eq!(
        sim.suppression(late_err),
        Some(SuppressReason::Late),
        "a RUN_ERROR tied to the run by Collab-Run-Id"
    );
    assert_eq!(sim.terminal_of("t1", "r1").event_type, "run.failed");
    let p = suppressed(
        &sim.raw(late).env,
        sim.record("t1", "r1"),
        SuppressReason::Late,
    )
    .payload
    .unwrap_or_default();
    assert_eq!(p["winner"]["outcome"], "timeout");
}

#[test]
fn only_the_agent_that_started_a_run_ends_it() {
    let mut sim = RunSim::new();
    sim.run_as(1_000, "t1", Some("eden"), started("t1", "r1"));
    // Another producer's RUN_ERROR, naming the run or not, and one on a subject that names no
    // agent: kept beside the run, which stays open.
    let foreign = sim.run_as(1_100, "t1", Some("mallory"), error(Some("r1")));
    let foreign_unnamed = sim.run_as(1_150, "t1", Some("mallory"), error(None));
    let anonymous = sim.run_as(1_200, "t1", None, finished("t1", "r1"));
    for seq in [foreign, foreign_unnamed, anonymous] {
        assert_eq!(sim.suppression(seq), Some(SuppressReason::NotTarget));
    }
    assert_eq!(sim.record("t1", "r1").state, TurnState::Open);
    assert!(sim.stored.is_empty(), "no terminal yet");
    let p = suppressed(
        &sim.raw(foreign).env,
        sim.record("t1", "r1"),
        SuppressReason::NotTarget,
    )
    .payload
    .unwrap_or_default();
    assert_eq!(p["reason"], "not_target");
    assert_eq!(p["winner"]["outcome"], "pending");
    // The owner's terminal, its id compared as agent ids are, is the run's one terminal.
    let own = sim.run_as(1_300, "t1", Some("Eden"), finished("t1", "r1"));
    sim.tick(60_000);
    let w = sim.record("t1", "r1").winner.clone().expect("decided");
    assert_eq!(w.seq, Some(own));
    assert_eq!(sim.terminal_of("t1", "r1").event_type, "run.finished");
    assert_eq!(sim.published_types().len(), 1);
}

#[test]
fn a_terminal_before_its_start_holds_the_run_to_its_publisher() {
    let mut sim = RunSim::new();
    let early = sim.run_as(1_000, "t1", Some("eden"), finished("t1", "r1"));
    let foreign = sim.run_as(1_100, "t1", Some("mallory"), finished("t1", "r1"));
    sim.tick(60_000);
    assert_eq!(
        sim.record("t1", "r1").winner.as_ref().and_then(|w| w.seq),
        Some(early)
    );
    assert_eq!(sim.suppression(foreign), Some(SuppressReason::NotTarget));
}

#[test]
fn a_terminal_before_its_start_by_another_agent_is_refused_when_the_start_comes() {
    let mut sim = RunSim::new();
    let forged = sim.run_as(1_000, "t1", Some("mallory"), error(Some("r1")));
    assert!(sim.stored.is_empty(), "held until the run starts");
    sim.run_as(1_100, "t1", Some("eden"), started("t1", "r1"));
    assert_eq!(sim.suppression(forged), Some(SuppressReason::NotTarget));
    assert_eq!(sim.record("t1", "r1").state, TurnState::Open);
    let own = sim.run_as(1_200, "t1", Some("eden"), finished("t1", "r1"));
    sim.tick(60_000);
    assert_eq!(
        sim.record("t1", "r1").winner.as_ref().and_then(|w| w.seq),
        Some(own)
    );
    assert_eq!(sim.published_types().len(), 1);
}

#[test]
fn a_foreign_terminal_ends_the_run_for_its_timeout_ends_neither() {
    let mut sim = RunSim::new();
    sim.run_as(1_000, "t1", Some("eden"), started("t1", "r1"));
    sim.run_as(1_100, "t1", Some("eden"), text_start("m1"));
    let forged = sim.run_as(1_200, "t1", Some("mallory"), error(None));
    sim.run_as(1_300, "t1", Some("eden"), text_end("m1"));
    sim.run_as(1_400, "t1", Some("eden"), text_start("m2"));
    sim.tick(60_000);
    assert_eq!(sim.suppression(forged), Some(SuppressReason::NotTarget));
    assert_eq!(
        sim.published_types(),
        vec![
            ("text.final".to_string(), "TEXT_MESSAGE_END".to_string()),
            ("run.failed".to_string(), "RUN_ERROR".to_string()),
        ],
        "one end, for the message still open at the timeout"
    );
    assert!(sim.stored.contains_key("run:t1:r1:end:message:m2"));
    assert!(!sim.stored.contains_key("run:t1:r1:end:message:m1"));
}

#[test]
fn runs_on_subjects_that_name_no_agent_are_ended_by_any_terminal() {
    let mut sim = RunSim::new();
    sim.run_as(1_000, "t1", None, started("t1", "r1"));
    let err = sim.run_as(1_100, "t1", Some("mallory"), error(None));
    sim.tick(60_000);
    assert_eq!(
        sim.record("t1", "r1").winner.as_ref().and_then(|w| w.seq),
        Some(err),
        "a run whose opener is unknown has no owner to hold its terminal to"
    );
}

#[test]
fn a_run_error_without_run_id_ends_the_keys_open_run() {
    let mut sim = RunSim::new();
    sim.run(1_000, "t1", started("t1", "r1"));
    sim.run(1_100, "t2", started("t2", "other"));
    sim.run(1_200, "t1", finished("t1", "r1"));
    sim.run(1_300, "t1", started("t1", "r2"));
    let err = sim.run(1_400, "t1", error(None));
    sim.tick(60_000);
    assert_eq!(
        sim.record("t1", "r2").winner.as_ref().and_then(|w| w.seq),
        Some(err),
        "the key's open run, not the other key's"
    );
    assert_eq!(sim.terminal_of("t1", "r2").event_type, "run.failed");
    assert_eq!(
        sim.terminal_of("t2", "other").event_type,
        "run.failed",
        "the other run timed out"
    );
    assert_eq!(
        payload_str(sim.terminal_of("t2", "other"), "reason"),
        Some("timeout")
    );
}

#[test]
fn the_keys_open_run_is_the_one_opened_last_and_is_rebuilt_after_a_crash() {
    let mut sim = RunSim::new();
    sim.run(1_000, "t1", started("t1", "r1"));
    sim.run(1_100, "t1", started("t1", "r2"));
    sim.recover();
    let err = sim.run(1_200, "t1", error(None));
    assert_eq!(
        sim.record("t1", "r2").winner.as_ref().and_then(|w| w.seq),
        Some(err)
    );
    let err2 = sim.run(1_300, "t1", error(None));
    assert_eq!(
        sim.record("t1", "r1").winner.as_ref().and_then(|w| w.seq),
        Some(err2),
        "then the one opened before it"
    );
}

#[test]
fn a_terminal_with_no_run_started_is_the_runs_terminal_and_a_later_start_arms_nothing() {
    let mut sim = RunSim::new();
    let fin = sim.run(1_000, "t1", finished("t1", "r1"));
    let start = sim.run(1_100, "t1", started("t1", "r1"));
    sim.tick(60_000);
    assert_eq!(
        sim.record("t1", "r1").winner.as_ref().and_then(|w| w.seq),
        Some(fin)
    );
    assert!(sim.projected(start));
    assert_eq!(
        sim.published_types(),
        vec![("run.finished".to_string(), "RUN_FINISHED".to_string())],
        "no timeout for a run that already ended"
    );
}

#[test]
fn a_run_and_a_turn_with_the_same_id_on_the_same_key_never_share_a_record() {
    let run = super::super::exchange_key(ExchangeKind::Run, 1, "k", "7");
    let turn = super::super::record_key(1, "k", "7");
    let sneaky = super::super::record_key(1, "k", "run.7");
    assert_ne!(run, turn);
    assert_ne!(run, sneaky, "a turn id cannot reach into the run namespace");
}

#[test]
fn records_written_before_runs_existed_read_as_turns() {
    let old = r#"{"conversationId":"c","key":"c","turn":"0","state":"open","deadlineMs":5}"#;
    let rec: TurnRecord = serde_json::from_str(old).expect("an old record reads");
    assert_eq!(rec.exchange, ExchangeKind::Turn);
    assert_eq!(rec.response_msg_id(), "turn:c:0");
    let back = serde_json::to_value(&rec).expect("serialises");
    assert!(
        back.get("exchange").is_none(),
        "a turn record is written as before"
    );
}

#[test]
fn a_crash_between_the_timeout_and_its_publication_republishes_the_same_ends() {
    let mut sim = RunSim::new();
    sim.run(1_000, "t1", started("t1", "r1"));
    sim.run(1_100, "t1", text_start("m1"));
    sim.crash_next = Some(CrashPoint::Write);
    sim.tick(10_000);
    assert_eq!(
        sim.published_types(),
        vec![
            ("text.final".to_string(), "TEXT_MESSAGE_END".to_string()),
            ("run.failed".to_string(), "RUN_ERROR".to_string()),
        ]
    );
    assert_eq!(sim.record("t1", "r1").state, TurnState::Published);
}

// ---------------------------------------------------------------------------------------------
// Property: exactly one terminal per run under interleavings, duplicates and crashes.
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
enum Op {
    /// (thread, run) and a store-time gap.
    Start(u8, u8, i64),
    Finish(u8, u8, i64),
    /// Error naming its run in the body (true) or by the relay header (false).
    Error(u8, u8, bool, i64),
    /// Text (true) or tool (false) start / end of item `n` of a run.
    ItemStart(u8, u8, bool, u8, i64),
    ItemEnd(u8, u8, bool, u8, i64),
    /// Store a copy of an earlier message.
    Copy(prop::sample::Index, i64),
    Deliver(usize),
    Advance(i64),
    Crash(CrashPoint),
}

fn thread(t: u8) -> String {
    format!("t{t}")
}
fn run_name(t: u8, r: u8) -> String {
    format!("run-{t}-{r}")
}

fn op() -> impl Strategy<Value = Op> {
    let gap = (0i64..4).prop_map(|n| n * 250);
    let tr = (0u8..2, 0u8..2);
    prop_oneof![
        3 => (tr.clone(), gap.clone()).prop_map(|((t, r), g)| Op::Start(t, r, g)),
        2 => (tr.clone(), gap.clone()).prop_map(|((t, r), g)| Op::Finish(t, r, g)),
        1 => (tr.clone(), any::<bool>(), gap.clone()).prop_map(|((t, r), b, g)| Op::Error(t, r, b, g)),
        3 => (tr.clone(), any::<bool>(), 0u8..2, gap.clone())
            .prop_map(|((t, r), k, n, g)| Op::ItemStart(t, r, k, n, g)),
        2 => (tr, any::<bool>(), 0u8..2, gap.clone())
            .prop_map(|((t, r), k, n, g)| Op::ItemEnd(t, r, k, n, g)),
        2 => (any::<prop::sample::Index>(), gap).prop_map(|(i, g)| Op::Copy(i, g)),
        4 => (1usize..4).prop_map(Op::Deliver),
        2 => (0i64..12).prop_map(|n| Op::Advance(n * 250)),
        1 => prop_oneof![Just(CrashPoint::Write), Just(CrashPoint::Publish)].prop_map(Op::Crash),
    ]
}

/// A stored message as the oracle reads it: its run (all generated events name theirs) and
/// what it is.
#[derive(Debug, Clone)]
struct Spec {
    seq: u64,
    stored_ms: i64,
    key: String,
    run: String,
    agui: String,
    item: Option<OpenItem>,
}

#[allow(clippy::too_many_arguments)]
fn store_spec(
    sim: &mut RunSim,
    specs: &mut Vec<Spec>,
    t: &mut i64,
    gap: i64,
    tt: u8,
    rr: u8,
    v: Value,
    header: bool,
) {
    *t += gap;
    let run = run_name(tt, rr);
    let mut v = v;
    if !header {
        if let Some(o) = v.as_object_mut() {
            o.insert("runId".into(), json!(run));
        }
    }
    let agui = v["type"].as_str().unwrap_or_default().to_string();
    let item = match agui.as_str() {
        "TEXT_MESSAGE_START" | "TEXT_MESSAGE_END" => {
            v["messageId"].as_str().map(|m| OpenItem::Message(m.into()))
        }
        "TOOL_CALL_START" | "TOOL_CALL_END" => v["toolCallId"]
            .as_str()
            .map(|c| OpenItem::ToolCall(c.into())),
        _ => None,
    };
    let seq = sim.store_with(*t, &thread(tt), v, header.then_some(run.as_str()));
    specs.push(Spec {
        seq,
        stored_ms: *t,
        key: thread(tt),
        run,
        agui,
        item,
    });
}

fn check(ops: &[Op]) -> Result<(), TestCaseError> {
    let mut sim = RunSim::new();
    let mut specs: Vec<Spec> = Vec::new();
    let mut t = 1_000i64;
    for op in ops {
        match op.clone() {
            Op::Start(tt, r, g) => store_spec(
                &mut sim,
                &mut specs,
                &mut t,
                g,
                tt,
                r,
                started(&thread(tt), &run_name(tt, r)),
                false,
            ),
            Op::Finish(tt, r, g) => store_spec(
                &mut sim,
                &mut specs,
                &mut t,
                g,
                tt,
                r,
                finished(&thread(tt), &run_name(tt, r)),
                false,
            ),
            Op::Error(tt, r, in_body, g) => store_spec(
                &mut sim,
                &mut specs,
                &mut t,
                g,
                tt,
                r,
                error(None),
                !in_body,
            ),
            Op::ItemStart(tt, r, text, n, g) => {
                let id = format!("{}-{n}", run_name(tt, r));
                let v = if text {
                    text_start(&id)
                } else {
                    tool_start(&id)
                };
                store_spec(&mut sim, &mut specs, &mut t, g, tt, r, v, false)
            }
            Op::ItemEnd(tt, r, text, n, g) => {
                let id = format!("{}-{n}", run_name(tt, r));
                let v = if text { text_end(&id) } else { tool_end(&id) };
                store_spec(&mut sim, &mut specs, &mut t, g, tt, r, v, false)
            }
            Op::Copy(i, g) => {
                if !specs.is_empty() {
                    let s = specs[i.index(specs.len())].clone();
                    let raw = sim.raw(s.seq);
                    t += g;
                    let seq = sim.log.len() as u64 + 1;
                    sim.log.push(Raw {
                        seq,
                        stored_ms: t,
                        ..raw
                    });
                    sim.now = sim.now.max(t);
                    sim.pending.push_back(seq);
                    specs.push(Spec {
                        seq,
                        stored_ms: t,
                        ..s
                    });
                }
            }
            Op::Deliver(n) => {
                for _ in 0..n {
                    sim.deliver_one();
                }
            }
            Op::Advance(ms) => {
                t += ms;
                sim.tick(t);
            }
            Op::Crash(at) => sim.crash_next = Some(at),
        }
    }
    sim.crash_next = None;
    sim.deliver_all();
    sim.tick(t + 100 * TIMEOUT_MS);

    // The oracle, run by run, from the raw log alone.
    let mut runs: BTreeMap<(String, String), Vec<&Spec>> = BTreeMap::new();
    for s in &specs {
        runs.entry((s.key.clone(), s.run.clone()))
            .or_default()
            .push(s);
    }
    let is_terminal = |s: &Spec| s.agui == "RUN_FINISHED" || s.agui == "RUN_ERROR";
    let mut handled: BTreeMap<u64, &str> = BTreeMap::new();
    for ((key, run), msgs) in &runs {
        let start = msgs.iter().find(|s| s.agui == "RUN_STARTED");
        let first_term = msgs.iter().find(|s| is_terminal(s));
        let exists = start.is_some() || first_term.is_some();
        let k = super::super::exchange_key(ExchangeKind::Run, PARTITION, key, run);
        if !exists {
            prop_assert!(
                !sim.kv.contains_key(&k),
                "{key}/{run}: a record without a run event"
            );
            for s in msgs {
                prop_assert!(sim.projected(s.seq), "seq {} dropped", s.seq);
            }
            continue;
        }
        let rec = &sim.kv.get(&k).expect("a record for every run").0;
        prop_assert_eq!(rec.state, TurnState::Published, "{}/{}", key, run);
        let winner = rec.winner.clone().expect("decided");
        // Expected winner: a terminal before any start, else the first terminal stored by the
        // deadline, else the timeout.
        let expected: Option<u64> = match (start, first_term) {
            (_, Some(t)) if start.is_none_or(|s| t.seq < s.seq) => Some(t.seq),
            (Some(s), Some(t)) if t.stored_ms <= s.stored_ms + TIMEOUT_MS => Some(t.seq),
            _ => None,
        };
        prop_assert_eq!(winner.seq, expected, "{}/{} winner", key, run);
        // Every attempt to publish the run's terminal carried the same winner.
        for (id, w) in sim
            .attempts
            .iter()
            .filter(|(id, _)| *id == rec.response_msg_id())
        {
            prop_assert_eq!(w, &winner, "{} republished with another winner", id);
        }
        // Exactly one terminal, of a terminal type.
        let terminal = sim.stored.get(&rec.response_msg_id()).expect("published");
        prop_assert!(matches!(
            terminal.event_type.as_str(),
            "run.finished" | "run.failed"
        ));
        let ends: Vec<&String> = sim
            .stored
            .keys()
            .filter(|id| id.starts_with(&format!("{}:end:", rec.response_msg_id())))
            .collect();
        match expected {
            Some(seq) => {
                prop_assert_eq!(ends.len(), 0, "{}/{}: ends for a run that ended", key, run);
                handled.insert(seq, "won");
            }
            None => {
                // What the run left open by its deadline, from the log.
                let s = start.expect("a timeout has a start");
                let mut open: Vec<OpenItem> = Vec::new();
                for m in msgs
                    .iter()
                    .filter(|m| m.seq > s.seq && m.stored_ms <= s.stored_ms + TIMEOUT_MS)
                {
                    if let Some(item) = &m.item {
                        if m.agui.ends_with("_START") {
                            if !open.contains(item) {
                                open.push(item.clone());
                            }
                        } else {
                            open.retain(|i| i != item);
                        }
                    }
                }
                prop_assert_eq!(
                    ends.len(),
                    open.len(),
                    "{}/{}: ends {:?} open {:?}",
                    key,
                    run,
                    ends,
                    open
                );
                prop_assert_eq!(payload_str(terminal, "reason"), Some("timeout"));
                // The ends come before the run.failed.
                let pos = |id: &str| {
                    sim.outs
                        .iter()
                        .position(|o| *o == Out::Published(id.to_string()))
                };
                for e in &ends {
                    prop_assert!(pos(e) < pos(&rec.response_msg_id()));
                }
            }
        }
        for m in msgs {
            if handled.contains_key(&m.seq) {
                continue;
            }
            if is_terminal(m) {
                let want = if expected.is_none() {
                    SuppressReason::Late
                } else {
                    SuppressReason::Duplicate
                };
                // A terminal stored before the run's start is handled like any terminal; with a
                // start first, one stored after the timeout is late.
                prop_assert_eq!(
                    sim.suppression(m.seq),
                    Some(want),
                    "seq {} of {}/{}",
                    m.seq,
                    key,
                    run
                );
                prop_assert!(!sim.projected(m.seq));
            } else {
                prop_assert!(
                    sim.projected(m.seq),
                    "seq {} ({}) was dropped",
                    m.seq,
                    m.agui
                );
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 256,
        ..ProptestConfig::default()
    })]

    #[test]
    fn exactly_one_terminal_per_run_under_interleavings_duplicates_and_crashes(
        ops in prop::collection::vec(op(), 1..60)
    ) {
        check(&ops)?;
    }
}
