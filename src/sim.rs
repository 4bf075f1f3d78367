//! Realistic multi-agent traffic for `demo` and `bench`: main-main turns (answered, failed,
//! unanswered), delegations to subagents, task lifecycles, runtime and tool events, health
//! signals, A2A adapter packets and a little malformed input.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

/// One raw message: the producer subject and the body.
#[derive(Debug, Clone)]
pub struct RawEvent {
    pub subject: String,
    pub body: Vec<u8>,
}

/// The mix of traffic. Weights are relative.
#[derive(Debug, Clone, Copy)]
pub struct Mix {
    pub turn: u32,
    pub delegation: u32,
    pub task: u32,
    pub runtime: u32,
    pub health: u32,
    pub adapter: u32,
    pub malformed: u32,
}

impl Mix {
    /// The demo's mix: mostly collaboration, a little bad input.
    pub const REALISTIC: Mix = Mix {
        turn: 30,
        delegation: 15,
        task: 20,
        runtime: 15,
        health: 10,
        adapter: 5,
        malformed: 5,
    };
    /// Only turn traffic (send, response, complete).
    pub const TURNS_ONLY: Mix = Mix {
        turn: 1,
        delegation: 0,
        task: 0,
        runtime: 0,
        health: 0,
        adapter: 0,
        malformed: 0,
    };
}

pub const MAIN_AGENTS: [&str; 4] = ["ruda", "eden", "atlas", "main"];

/// A deterministic generator (seeded) of scenarios.
pub struct Generator {
    rng: StdRng,
    prefix: String,
    mix: Mix,
    n: u64,
    now_ms: i64,
    /// Share of main-main turns left unanswered (they time out), in percent.
    pub unanswered_percent: u32,
}

impl Generator {
    pub fn new(prefix: &str, seed: u64, mix: Mix) -> Generator {
        Generator {
            rng: StdRng::seed_from_u64(seed),
            prefix: prefix.to_string(),
            mix,
            n: 0,
            now_ms: crate::bus::now_ms(),
            unanswered_percent: 10,
        }
    }

    fn subject(&self, key: &str, t: &str) -> String {
        format!("{}.raw.{key}.{t}", self.prefix)
    }

    fn ev(&self, key: &str, t: &str, v: Value) -> RawEvent {
        RawEvent {
            subject: self.subject(key, t),
            body: serde_json::to_vec(&v).unwrap_or_default(),
        }
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.rng.random_range(0..items.len())]
    }

    /// The next scenario's events, in the order a producer would publish them.
    pub fn next_scenario(&mut self) -> Vec<RawEvent> {
        self.n += 1;
        self.now_ms += 250;
        let m = self.mix;
        let total = m.turn + m.delegation + m.task + m.runtime + m.health + m.adapter + m.malformed;
        let mut roll = self.rng.random_range(0..total.max(1));
        let mut take = |w: u32| {
            if roll < w {
                true
            } else {
                roll -= w;
                false
            }
        };
        if take(m.turn) {
            self.turn()
        } else if take(m.delegation) {
            self.delegation()
        } else if take(m.task) {
            self.task()
        } else if take(m.runtime) {
            self.runtime()
        } else if take(m.health) {
            self.health()
        } else if take(m.adapter) {
            self.adapter()
        } else {
            self.malformed()
        }
    }

    fn turn(&mut self) -> Vec<RawEvent> {
        let from = self.pick(&MAIN_AGENTS);
        let mut to = self.pick(&MAIN_AGENTS);
        while to == from {
            to = self.pick(&MAIN_AGENTS);
        }
        let conv = format!("conv-{}", self.n);
        let ws = format!("ws_{}", self.n % 7);
        let ts = self.now_ms;
        let topic = self.pick(&[
            "review the deploy plan",
            "summarise yesterday's incidents",
            "draft the release notes",
            "check the flaky integration test",
            "estimate the migration effort",
        ]);
        let mut out = vec![self.ev(
            &conv,
            "a2a.send",
            json!({"type":"a2a.send","agentId":from,"ts":ts,"data":{
                "fromAgent":from,"toAgent":to,"conversationId":conv,"workSessionId":ws,
                "runId":format!("run-{}", self.n),"message":format!("Please {topic}."),
                "goal": topic, "timeoutMs": 10_000,
                "fromSessionType":"main","toSessionType":"main"}}),
        )];
        let roll = self.rng.random_range(0..100);
        if roll < self.unanswered_percent {
            return out; // no reply: the turn contract times it out
        }
        if roll < self.unanswered_percent + 8 {
            out.push(self.ev(
                &conv,
                "a2a.response",
                json!({"type":"a2a.response","agentId":to,"ts":ts+900,"data":{
                "fromAgent":to,"toAgent":from,"conversationId":conv,"workSessionId":ws,
                "message":"[outcome] no_reply: the target run did not answer in time",
                "outcome":"no_reply","waitStatus":"timeout",
                "fromSessionType":"main","toSessionType":"main"}}),
            ));
        } else {
            out.push(self.ev(&conv, "a2a.response", json!({"type":"a2a.response","agentId":to,"ts":ts+700,"data":{
                "fromAgent":to,"toAgent":from,"conversationId":conv,"workSessionId":ws,
                "message":format!("goal: {topic}\noutcome: success - done\nevidence: see run-{}\nnext_action: none", self.n),
                "fromSessionType":"main","toSessionType":"main"}})));
            if self.rng.random_range(0..100) < 5 {
                // A duplicate publish of the same reply.
                if let Some(dup) = out.last().cloned() {
                    out.push(dup);
                }
            }
        }
        out.push(self.ev(&conv, "a2a.complete", json!({"type":"a2a.complete","agentId":from,"ts":ts+1000,"data":{
            "fromAgent":from,"toAgent":to,"conversationId":conv,"workSessionId":ws,"announced":false,
            "fromSessionType":"main","toSessionType":"main"}})));
        out
    }

    fn delegation(&mut self) -> Vec<RawEvent> {
        let parent = self.pick(&MAIN_AGENTS);
        let conv = format!("del-{}", self.n);
        let sub = format!("agent:{parent}:subagent:{}", self.n);
        let ts = self.now_ms;
        vec![
            self.ev(&conv, "a2a.spawn", json!({"type":"a2a.spawn","agentId":parent,"ts":ts,"data":{
                "fromAgent":parent,"toAgent":format!("{parent}-worker"),"conversationId":conv,"targetSessionKey":sub}})),
            self.ev(&conv, "a2a.send", json!({"type":"a2a.send","agentId":parent,"ts":ts+10,"data":{
                "fromAgent":parent,"toAgent":format!("{parent}-worker"),"conversationId":conv,"targetSessionKey":sub,
                "message":"collect the failing test logs","depth":1}})),
            self.ev(&conv, "a2a.response", json!({"type":"a2a.response","agentId":format!("{parent}-worker"),"ts":ts+400,"data":{
                "fromAgent":format!("{parent}-worker"),"toAgent":parent,"conversationId":conv,"fromSessionType":"subagent",
                "message":"3 failing tests, logs attached"}})),
        ]
    }

    fn task(&mut self) -> Vec<RawEvent> {
        let task = format!("task-{}", self.n);
        let owner = self.pick(&MAIN_AGENTS);
        let ts = self.now_ms;
        let mut out = vec![
            self.ev(&task, "task.created", json!({"type":"task.created","timestamp":ts,"taskId":task,"agentId":owner,"payload":{"title":"Nightly build triage","status":"queued"}})),
            self.ev(&task, "task.updated", json!({"type":"task.updated","timestamp":ts+50,"taskId":task,"agentId":owner,"payload":{"status":"running","progress":0.5}})),
        ];
        let done = if self.rng.random_range(0..10) == 0 {
            "task.failed"
        } else {
            "task.completed"
        };
        out.push(self.ev(&task, done, json!({"type":done,"timestamp":ts+90,"taskId":task,"agentId":owner,"payload":{"status": if done == "task.failed" {"failed"} else {"done"}}})));
        out
    }

    fn runtime(&mut self) -> Vec<RawEvent> {
        let session = format!("session-{}", self.n % 11);
        let run = format!("run-{}", self.n);
        let agent = self.pick(&MAIN_AGENTS);
        let ts = self.now_ms;
        let tool = format!("call-{}", self.n);
        vec![
            self.ev(&session, "run.started", json!({"type":"run.started","sequence":1,"timestamp":ts,"sessionId":session,"runId":run,"agentId":agent})),
            self.ev(&session, "tool.started", json!({"type":"tool.started","sequence":2,"timestamp":ts+5,"sessionId":session,"runId":run,"agentId":agent,"payload":{"toolCallId":tool,"name":"search"}})),
            self.ev(&session, "tool.result", json!({"type":"tool.result","sequence":3,"timestamp":ts+80,"sessionId":session,"runId":run,"agentId":agent,"payload":{"toolCallId":tool,"outputPreview":"4 results"}})),
            self.ev(&session, "run.finished", json!({"type":"run.finished","sequence":4,"timestamp":ts+120,"sessionId":session,"runId":run,"agentId":agent})),
        ]
    }

    fn health(&mut self) -> Vec<RawEvent> {
        let agent = self.pick(&MAIN_AGENTS);
        let ts = self.now_ms;
        vec![self.ev(agent, "health.ping", json!({"type":"health.ping","timestamp":ts,"agentId":agent,"payload":{"queueDepth": self.n % 5, "status":"ok"}}))]
    }

    fn adapter(&mut self) -> Vec<RawEvent> {
        let task = format!("a2a-task-{}", self.n);
        let kind = if self.rng.random_range(0..2) == 0 {
            "delegation"
        } else {
            "review"
        };
        vec![self.ev(&task, "a2a.packet", json!({
            "protocol":"a2a","version":"0.2","event_type":"task.requested","timestamp":"2026-02-27T10:05:00Z",
            "agent":{"id":"agent://coordinator","role":"orchestrator"},
            "task":{"id":task,"status":"requested","kind":kind},
            "message":{"id":format!("msg-{}", self.n),"role":"assistant"}}))]
    }

    fn malformed(&mut self) -> Vec<RawEvent> {
        let key = format!("bad-{}", self.n);
        match self.rng.random_range(0..4) {
            0 => vec![RawEvent {
                subject: self.subject(&key, "a2a.send"),
                body: b"{\"type\":\"a2a.send\",".to_vec(),
            }],
            1 => vec![self.ev(&key, "mystery", json!({"hello":"world"}))],
            2 => {
                let conv = "agent:eden:main";
                vec![self.ev("wrong-key", "a2a.send", json!({"type":"a2a.send","data":{"conversationId":conv,"fromAgent":"ruda","toAgent":"eden"}}))]
            }
            _ => vec![self.ev(&key, "x", json!({"type":"bad type with spaces"}))],
        }
    }
}
