//! Realistic multi-agent traffic for `demo` and `bench`: main-main turns (answered, failed,
//! unanswered), delegations to subagents, task lifecycles, runtime and tool events, health
//! signals, A2A adapter packets, A2A wire traffic as a relay publishes it (JSON-RPC v0.3 and
//! v1.0), AG-UI runs and a little malformed input.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

/// One raw message: the producer subject and the body.
#[derive(Debug, Clone)]
pub struct RawEvent {
    pub subject: String,
    pub body: Vec<u8>,
    /// NATS headers to publish with it (a relay's `Collab-*` headers); usually none.
    pub headers: Vec<(&'static str, String)>,
}

impl RawEvent {
    /// Its headers as NATS headers, when it has any.
    pub fn nats_headers(&self) -> Option<async_nats::HeaderMap> {
        if self.headers.is_empty() {
            return None;
        }
        let mut h = async_nats::HeaderMap::new();
        for (name, value) in &self.headers {
            h.insert(*name, value.as_str());
        }
        Some(h)
    }
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
    /// A2A wire exchanges (a send and its answers, v0.3 or v1.0).
    pub a2a_wire: u32,
    /// AG-UI runs (start, text, a tool call, finish).
    pub agui: u32,
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
        a2a_wire: 0,
        agui: 0,
        malformed: 5,
    };
    /// The demo's: the realistic mix plus every other input format a bus carries.
    pub const DEMO: Mix = Mix {
        a2a_wire: 12,
        agui: 8,
        ..Mix::REALISTIC
    };
    /// Only turn traffic (send, response, complete).
    pub const TURNS_ONLY: Mix = Mix {
        turn: 1,
        delegation: 0,
        task: 0,
        runtime: 0,
        health: 0,
        adapter: 0,
        a2a_wire: 0,
        agui: 0,
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
    /// The deadline a main-main turn asks for (`timeoutMs`).
    pub turn_timeout_ms: u64,
}

/// The deadline generated main-main turns ask for unless told otherwise.
pub const DEFAULT_TURN_TIMEOUT_MS: u64 = 10_000;

impl Generator {
    pub fn new(prefix: &str, seed: u64, mix: Mix) -> Generator {
        Generator {
            rng: StdRng::seed_from_u64(seed),
            prefix: prefix.to_string(),
            mix,
            n: 0,
            now_ms: crate::bus::now_ms(),
            unanswered_percent: 10,
            turn_timeout_ms: DEFAULT_TURN_TIMEOUT_MS,
        }
    }

    fn subject(&self, key: &str, t: &str) -> String {
        format!("{}.raw.{key}.{t}", self.prefix)
    }

    fn ev(&self, key: &str, t: &str, v: Value) -> RawEvent {
        RawEvent {
            subject: self.subject(key, t),
            body: serde_json::to_vec(&v).unwrap_or_default(),
            headers: Vec::new(),
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
        let total = m.turn
            + m.delegation
            + m.task
            + m.runtime
            + m.health
            + m.adapter
            + m.a2a_wire
            + m.agui
            + m.malformed;
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
        } else if take(m.a2a_wire) {
            self.a2a_wire()
        } else if take(m.agui) {
            self.agui()
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
                "goal": topic, "timeoutMs": self.turn_timeout_ms,
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

    /// One A2A exchange between two main agents as a relay in front of the callee publishes it:
    /// the send, then (mostly) a working frame and a final state, in v0.3 or v1.0 wire style.
    /// Some end in input-required, a failure or TaskNotFound; some get no answer (the turn
    /// contract answers them with a blocked timeout).
    fn a2a_wire(&mut self) -> Vec<RawEvent> {
        let from = self.pick(&MAIN_AGENTS);
        let mut to = self.pick(&MAIN_AGENTS);
        while to == from {
            to = self.pick(&MAIN_AGENTS);
        }
        let v1 = self.rng.random_range(0..2) == 0;
        let ctx = format!("ctx-{}", self.n);
        let exchange = format!("ex-{}", self.n);
        let method = if v1 { "SendMessage" } else { "message/send" };
        let headers = vec![
            ("Collab-From-Agent", from.to_string()),
            ("Collab-To-Agent", to.to_string()),
            ("Collab-Exchange", exchange),
            ("Collab-A2A-Method", method.to_string()),
        ];
        let topic = self.pick(&[
            "rotate the staging certificates",
            "find the owner of the failing canary",
            "compare last week's latency with this week's",
        ]);
        let text_part = |t: &str| {
            if v1 {
                json!({"text": t})
            } else {
                json!({"kind": "text", "text": t})
            }
        };
        let state = |s: &str| {
            if v1 {
                format!("TASK_STATE_{}", s.to_uppercase().replace('-', "_"))
            } else {
                s.to_string()
            }
        };
        let frame = |s: &str, text: &str| {
            let status = json!({"state": state(s), "message": {
                "role": if v1 { "ROLE_AGENT" } else { "agent" }, "messageId": format!("{ctx}-{s}"),
                "parts": [text_part(text)]}});
            let update =
                json!({"taskId": format!("task-{ctx}"), "contextId": ctx, "status": status});
            if v1 {
                json!({"jsonrpc": "2.0", "id": 1, "result": {"statusUpdate": update}})
            } else {
                let mut u = update;
                u["kind"] = json!("status-update");
                u["final"] = json!(s != "working");
                json!({"jsonrpc": "2.0", "id": 1, "result": u})
            }
        };
        let send = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": {"message": {
            "role": if v1 { "ROLE_USER" } else { "user" }, "messageId": format!("{ctx}-ask"),
            "contextId": ctx, "parts": [text_part(&format!("Please {topic}."))]}}});
        let wire = |body: Value| RawEvent {
            subject: format!("{}.raw.{ctx}.a2a.wire", self.prefix),
            body: serde_json::to_vec(&body).unwrap_or_default(),
            headers: headers.clone(),
        };
        let mut out = vec![wire(send)];
        let roll = self.rng.random_range(0..100);
        if roll < self.unanswered_percent {
            return out;
        }
        out.push(wire(frame("working", "on it")));
        out.push(wire(match roll % 10 {
            0 => json!({"jsonrpc": "2.0", "id": 1, "error": {"code": -32001, "message": "Task not found"}}),
            1 => frame("failed", "the staging cluster refused the change"),
            2 => frame("input-required", "which environment?"),
            _ => frame("completed", &format!("done: {topic}")),
        }));
        out
    }

    /// One AG-UI run as an agent UI's relay publishes it: start, a streamed text message, a
    /// tool call with its result, finish (a few stop mid-message and never finish).
    fn agui(&mut self) -> Vec<RawEvent> {
        let thread = format!("thread-{}", self.n % 13);
        let run = format!("agui-run-{}", self.n);
        let msg = format!("msg-{}", self.n);
        let call = format!("tool-{}", self.n);
        let ts = self.now_ms;
        let mut events = vec![
            json!({"type": "RUN_STARTED", "threadId": thread, "runId": run, "timestamp": ts}),
            json!({"type": "TEXT_MESSAGE_START", "messageId": msg, "role": "assistant", "timestamp": ts + 5}),
            json!({"type": "TEXT_MESSAGE_CONTENT", "messageId": msg, "delta": "Looking at the dashboards", "timestamp": ts + 9}),
        ];
        if self.rng.random_range(0..10) > 0 {
            events.extend([
                json!({"type": "TEXT_MESSAGE_END", "messageId": msg, "timestamp": ts + 12}),
                json!({"type": "TOOL_CALL_START", "toolCallId": call, "toolCallName": "query_metrics", "parentMessageId": msg, "timestamp": ts + 15}),
                json!({"type": "TOOL_CALL_ARGS", "toolCallId": call, "delta": "{\"service\":\"checkout\"}", "timestamp": ts + 16}),
                json!({"type": "TOOL_CALL_END", "toolCallId": call, "timestamp": ts + 17}),
                json!({"type": "TOOL_CALL_RESULT", "messageId": format!("{msg}-r"), "toolCallId": call, "content": "p99 410 ms", "timestamp": ts + 60}),
                json!({"type": "RUN_FINISHED", "threadId": thread, "runId": run, "timestamp": ts + 70}),
            ]);
        }
        let headers = vec![("Collab-Run-Id", run.clone())];
        events
            .into_iter()
            .map(|body| RawEvent {
                subject: format!("{}.raw.{thread}.agui", self.prefix),
                body: serde_json::to_vec(&body).unwrap_or_default(),
                headers: headers.clone(),
            })
            .collect()
    }

    fn malformed(&mut self) -> Vec<RawEvent> {
        let key = format!("bad-{}", self.n);
        match self.rng.random_range(0..4) {
            0 => vec![RawEvent {
                subject: self.subject(&key, "a2a.send"),
                body: b"{\"type\":\"a2a.send\",".to_vec(),
                headers: Vec::new(),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The deadline of every generated main-main turn's send, in order.
    fn send_deadlines(gen: &mut Generator, scenarios: usize) -> Vec<u64> {
        (0..scenarios)
            .flat_map(|_| gen.next_scenario())
            .filter(|ev| ev.subject.ends_with(".a2a.send"))
            .filter_map(|ev| {
                let v: Value = serde_json::from_slice(&ev.body).ok()?;
                v["data"]["timeoutMs"].as_u64()
            })
            .collect()
    }

    #[test]
    fn turns_ask_for_the_deadline_they_are_given() {
        let mut gen = Generator::new("collab", 1, Mix::TURNS_ONLY);
        let default = send_deadlines(&mut gen, 20);
        assert_eq!(default.len(), 20);
        assert!(default.iter().all(|&t| t == DEFAULT_TURN_TIMEOUT_MS));

        let mut gen = Generator::new("collab", 1, Mix::TURNS_ONLY);
        gen.turn_timeout_ms = 60_000;
        let longer = send_deadlines(&mut gen, 20);
        assert_eq!(longer.len(), 20);
        assert!(longer.iter().all(|&t| t == 60_000));
    }
}
