use super::*;
use crate::usage::Price;
use serde_json::json;

fn env(v: Value) -> Envelope {
    serde_json::from_value(v).unwrap_or_default()
}

fn assembler() -> Assembler {
    let prices = Prices::new(&[Price {
        model: "m1".into(),
        input_per_mtok: 2.0,
        output_per_mtok: 10.0,
        cached_input_per_mtok: None,
    }])
    .unwrap_or_default();
    Assembler::new(Limits::default(), prices)
}

fn str_attr<'a>(s: &'a Span, key: &str) -> Option<&'a str> {
    match s.attr(key)? {
        Attr::Str(v) => Some(v),
        _ => None,
    }
}

fn int_attr(s: &Span, key: &str) -> Option<i64> {
    match s.attr(key)? {
        Attr::Int(v) => Some(*v),
        _ => None,
    }
}

#[test]
fn a_turn_is_one_invoke_agent_span_from_its_send_to_its_response_with_usage_and_cost() {
    let mut a = assembler();
    let send = env(json!({"type": "a2a.send", "eventRole": "conversation.main",
        "timestamp": "2026-11-26T10:00:00.000Z", "turnId": "t1", "agentId": "main",
        "conversationId": "conv-1", "payload": {"fromAgent": "main", "toAgent": "ruda"}}));
    assert!(a.observe(&send, 0).spans.is_empty());
    let reply = env(
        json!({"type": "a2a.response", "eventRole": "conversation.main",
        "timestamp": "2026-11-26T10:00:01.500Z", "turnId": "t1", "agentId": "ruda",
        "conversationId": "conv-1", "payload": {"fromAgent": "ruda", "toAgent": "main",
        "message": "done", "model": "m1",
        "usage": {"input_tokens": 1000, "output_tokens": 100}}}),
    );
    let spans = a.observe(&reply, 0).spans;
    assert_eq!(spans.len(), 1);
    let s = &spans[0];
    assert_eq!(s.name, "invoke_agent ruda");
    assert_eq!(s.end_ms - s.start_ms, 1500);
    assert_eq!(s.parent_span_id, None);
    assert_eq!(s.error, None);
    assert_eq!(str_attr(s, "gen_ai.operation.name"), Some("invoke_agent"));
    assert_eq!(str_attr(s, "gen_ai.agent.name"), Some("ruda"));
    assert_eq!(str_attr(s, "gen_ai.conversation.id"), Some("conv-1"));
    assert_eq!(str_attr(s, "collab.caller"), Some("main"));
    assert_eq!(int_attr(s, "gen_ai.usage.input_tokens"), Some(1000));
    assert_eq!(int_attr(s, "gen_ai.usage.output_tokens"), Some(100));
    assert_eq!(str_attr(s, "gen_ai.request.model"), Some("m1"));
    match s.attr("collab.usage.cost") {
        Some(Attr::F64(c)) => assert!((c - 0.003).abs() < 1e-12, "{c}"),
        other => panic!("no cost: {other:?}"),
    }
    assert_eq!(a.open(), 0);
}

#[test]
fn a_blocked_response_is_an_error_with_its_reason_starting_at_the_send_it_names() {
    let mut a = assembler();
    // The assembler started after the send: the blocked payload's evidence dates it.
    let blocked = env(
        json!({"type": "a2a.response", "eventRole": "conversation.main",
        "timestamp": "2026-11-26T10:05:00.000Z", "turnId": "t9", "conversationId": "conv-2",
        "payload": {"outcome": "blocked", "reason": "timeout", "synthesized": true,
            "fromAgent": "ruda", "toAgent": "main", "evidence": [
                {"kind": "send", "rawSeq": 4, "subject": "collab.raw.conv-2.a2a.send",
                 "storedAt": "2026-11-26T10:00:00.000Z"},
                {"kind": "deadline", "at": "2026-11-26T10:05:00.000Z", "timeoutMs": 300000}]}}),
    );
    let spans = a.observe(&blocked, 0).spans;
    assert_eq!(spans.len(), 1);
    assert_eq!(spans[0].error.as_deref(), Some("timeout"));
    assert_eq!(spans[0].end_ms - spans[0].start_ms, 300_000);
    assert_eq!(spans[0].name, "invoke_agent ruda");
}

#[test]
fn a_run_with_a_tool_call_and_a_child_run_forms_one_trace() {
    let mut a = assembler();
    let ev = |v: Value| env(v);
    let t = |ms: u32| format!("2026-11-26T10:00:00.{ms:03}Z");
    let mut spans = Vec::new();
    for e in [
        ev(
            json!({"type": "run.started", "timestamp": t(0), "threadId": "th", "runId": "r1",
            "agentId": "planner", "payload": {"agUiType": "RUN_STARTED"}}),
        ),
        ev(
            json!({"type": "tool.started", "timestamp": t(10), "threadId": "th", "runId": "r1",
            "payload": {"agUiType": "TOOL_CALL_START", "toolCallId": "c1",
                "toolCallName": "get_weather"}}),
        ),
        ev(
            json!({"type": "tool.args", "timestamp": t(11), "runId": "r1",
            "payload": {"agUiType": "TOOL_CALL_ARGS", "toolCallId": "c1", "delta": "{\"city\":"}}),
        ),
        ev(
            json!({"type": "tool.args", "timestamp": t(12), "runId": "r1",
            "payload": {"agUiType": "TOOL_CALL_ARGS", "toolCallId": "c1", "delta": "\"Oslo\"}"}}),
        ),
        ev(
            json!({"type": "tool.args", "timestamp": t(13), "runId": "r1",
            "payload": {"agUiType": "TOOL_CALL_END", "toolCallId": "c1"}}),
        ),
        ev(
            json!({"type": "tool.result", "timestamp": t(50), "runId": "r1",
            "payload": {"agUiType": "TOOL_CALL_RESULT", "toolCallId": "c1", "content": "sunny"}}),
        ),
        ev(
            json!({"type": "run.started", "timestamp": t(60), "threadId": "th", "runId": "r2",
            "agentId": "researcher", "payload": {"agUiType": "RUN_STARTED", "parentRunId": "r1"}}),
        ),
        ev(json!({"type": "custom", "timestamp": t(70), "runId": "r2",
            "payload": {"agUiType": "CUSTOM", "name": "usage",
                "value": {"inputTokens": 7, "outputTokens": 3, "model": "m1"}}})),
        ev(
            json!({"type": "run.failed", "timestamp": t(90), "threadId": "th", "runId": "r2",
            "payload": {"agUiType": "RUN_ERROR", "code": "rate_limited"}}),
        ),
        ev(
            json!({"type": "run.finished", "timestamp": t(100), "threadId": "th", "runId": "r1",
            "payload": {"agUiType": "RUN_FINISHED",
                "result": {"usage": {"input_tokens": 20, "output_tokens": 5}}}}),
        ),
    ] {
        spans.extend(a.observe(&e, 0).spans);
    }
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "execute_tool get_weather",
            "invoke_agent researcher",
            "invoke_agent planner"
        ]
    );
    let (tool, child, run) = (&spans[0], &spans[1], &spans[2]);
    assert!(spans.iter().all(|s| s.trace_id == run.trace_id));
    assert_eq!(tool.parent_span_id, Some(run.span_id));
    assert_eq!(child.parent_span_id, Some(run.span_id));
    assert_eq!(run.parent_span_id, None);
    assert_eq!(
        str_attr(tool, "gen_ai.tool.call.arguments"),
        Some("{\"city\":\"Oslo\"}")
    );
    assert_eq!(str_attr(tool, "gen_ai.tool.call.result"), Some("sunny"));
    assert_eq!(tool.end_ms - tool.start_ms, 40);
    assert_eq!(child.error.as_deref(), Some("rate_limited"));
    assert_eq!(int_attr(child, "gen_ai.usage.input_tokens"), Some(7));
    assert_eq!(str_attr(run, "gen_ai.conversation.id"), Some("th"));
    assert_eq!(int_attr(run, "gen_ai.usage.input_tokens"), Some(20));
    assert_eq!(run.end_ms - run.start_ms, 100);
    assert_eq!(a.open(), 0);
}

#[test]
fn a_send_made_inside_a_run_is_a_child_of_the_run() {
    let mut a = assembler();
    a.observe(
        &env(
            json!({"type": "run.started", "runId": "r1", "agentId": "main",
            "timestamp": "2026-11-26T10:00:00Z"}),
        ),
        0,
    );
    a.observe(
        &env(json!({"type": "a2a.send", "runId": "r1", "conversationId": "c", "turnId": "1",
            "timestamp": "2026-11-26T10:00:01Z", "payload": {"fromAgent": "main", "toAgent": "eden"}})),
        0,
    );
    let turn = a
        .observe(
            &env(
                json!({"type": "a2a.response", "conversationId": "c", "turnId": "1",
                "timestamp": "2026-11-26T10:00:02Z", "payload": {"fromAgent": "eden"}}),
            ),
            0,
        )
        .spans;
    let run = a
        .observe(
            &env(json!({"type": "run.finished", "runId": "r1",
                "timestamp": "2026-11-26T10:00:03Z"})),
            0,
        )
        .spans;
    assert_eq!(turn[0].parent_span_id, Some(run[0].span_id));
    assert_eq!(turn[0].trace_id, run[0].trace_id);
}

#[test]
fn ids_are_the_same_when_the_same_projections_are_assembled_again() {
    let events = [
        json!({"type": "a2a.send", "conversationId": "c", "turnId": "1", "payload": {}}),
        json!({"type": "a2a.response", "conversationId": "c", "turnId": "1", "payload": {}}),
    ];
    let run = || {
        let mut a = assembler();
        events
            .iter()
            .flat_map(|e| a.observe(&env(e.clone()), 5).spans)
            .collect::<Vec<_>>()
    };
    assert_eq!(run(), run());
    assert_eq!(
        run()[0].start_ms,
        5,
        "the store time stands in for a missing timestamp"
    );
}

#[test]
fn open_spans_are_bounded_and_what_is_given_up_is_counted() {
    let mut a = Assembler::new(
        Limits {
            max_open: 3,
            max_text_bytes: 8,
        },
        Prices::default(),
    );
    let mut evicted = 0;
    for i in 0..10 {
        evicted += a
            .observe(
                &env(json!({"type": "a2a.send", "conversationId": "c", "turnId": i})),
                0,
            )
            .evicted;
    }
    assert_eq!((a.open(), evicted), (3, 7));
    // A reply to a turn given up still gives a span (it starts at itself).
    let spans = a
        .observe(
            &env(json!({"type": "a2a.response", "conversationId": "c", "turnId": 0})),
            9,
        )
        .spans;
    assert_eq!((spans.len(), spans[0].start_ms), (1, 9));
    // Arguments are cut at the byte bound, on a character boundary.
    a.observe(
        &env(json!({"type": "tool.started", "payload": {"toolCallId": "x", "name": "t"}})),
        0,
    );
    a.observe(
        &env(json!({"type": "tool.args", "payload": {"toolCallId": "x", "delta": "ééééé"}})),
        0,
    );
    let tool = a
        .observe(
            &env(json!({"type": "tool.result", "payload": {"toolCallId": "x"}})),
            0,
        )
        .spans;
    assert_eq!(
        str_attr(&tool[0], "gen_ai.tool.call.arguments"),
        Some("éééé")
    );
}

#[test]
fn the_agui_fixture_envelopes_assemble_their_tool_call() {
    // fixtures/agui-spec: the AG-UI .NET compatibility fixtures as the normaliser projects them.
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/fixtures/agui-spec/dotnet-compat-fixture_tool-call-events.expected.json"
    );
    let cases: Vec<Value> = std::fs::read(path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    assert!(!cases.is_empty(), "{path} is missing");
    let mut a = assembler();
    let mut spans = Vec::new();
    for c in &cases {
        spans.extend(a.observe(&env(c["envelope"].clone()), 0).spans);
    }
    // tool-1 starts twice (two fixture cases share the id); its arguments and its END come in,
    // but its result names another call (tc-1): nothing ends it, so nothing is exported yet.
    assert!(spans.is_empty(), "{spans:?}");
    assert_eq!(a.open(), 1);
}

#[test]
fn a_run_published_by_an_agents_user_is_named_after_that_agent() {
    let mut a = assembler();
    let raw = |seq: u64| {
        json!({"stream": "COLLAB_RAW", "seq": seq,
        "subject": "collab.raw.th._as.researcher.agui", "storedAt": "2026-11-26T10:00:00Z"})
    };
    a.observe(
        &env(json!({"type": "run.started", "runId": "r", "rawEventRef": raw(1)})),
        0,
    );
    let spans = a
        .observe(
            &env(json!({"type": "run.finished", "runId": "r", "rawEventRef": raw(2)})),
            0,
        )
        .spans;
    assert_eq!(spans[0].name, "invoke_agent researcher");
    assert_eq!(str_attr(&spans[0], "gen_ai.agent.name"), Some("researcher"));
}

#[test]
fn an_answer_that_asks_for_input_and_an_interrupted_run_are_waiting_not_errors() {
    // fixtures/a2a-spec: an A2A v0.3 task stopped at input-required, as the normaliser projects it.
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/fixtures/a2a-spec/v030_jsonrpc_message-send_response_input-required.expected.json"
    );
    let cases: Vec<Value> = std::fs::read(path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    let mut a = assembler();
    a.observe(
        &env(
            json!({"type": "a2a.send", "conversationId": "ctx-key", "turnId": "ex-1",
            "payload": {"fromAgent": "ruda", "toAgent": "eden"}}),
        ),
        0,
    );
    let reply = env(cases[0]["envelope"].clone());
    let spans = a.observe(&reply, 0).spans;
    let s = &spans[0];
    assert_eq!(s.error, None);
    assert_eq!(str_attr(s, "collab.outcome"), Some("waiting"));
    assert_eq!(str_attr(s, "collab.waiting.for"), Some("input"));
    assert_eq!(str_attr(s, "collab.waiting.on"), Some("ruda"));

    a.observe(&env(json!({"type": "run.started", "runId": "r"})), 0);
    let run = a
        .observe(
            &env(
                json!({"type": "run.finished", "runId": "r", "phase": "interrupted", "payload": {
                "agUiType": "RUN_FINISHED", "outcome": {"type": "interrupt", "interrupts": [
                    {"id": "i-1", "reason": "approval", "assignee": "alice"}]}}}),
            ),
            0,
        )
        .spans;
    assert_eq!(run[0].error, None);
    assert_eq!(str_attr(&run[0], "collab.outcome"), Some("waiting"));
    assert_eq!(str_attr(&run[0], "collab.waiting.for"), Some("approval"));
    assert_eq!(str_attr(&run[0], "collab.waiting.on"), Some("alice"));
}

/// Producers reuse tool call ids from run to run (`call-1` in every run of an SDK's example
/// agent). Each run's tool call is a span of its own: same traffic, same ids, but never the id
/// of another run's call.
#[test]
fn the_same_tool_call_id_in_two_runs_gives_two_spans_with_different_ids() {
    let mut a = assembler();
    let t = |ms: u32| format!("2026-11-26T10:00:00.{ms:03}Z");
    let run = |run: &str, at: u32| {
        vec![
            env(
                json!({"type": "run.started", "timestamp": t(at), "threadId": "th", "runId": run,
                "agentId": "planner", "payload": {"agUiType": "RUN_STARTED"}}),
            ),
            env(
                json!({"type": "tool.started", "timestamp": t(at + 1), "runId": run,
                "payload": {"agUiType": "TOOL_CALL_START", "toolCallId": "call-1",
                    "toolCallName": "get_weather"}}),
            ),
            env(
                json!({"type": "tool.result", "timestamp": t(at + 2), "runId": run,
                "payload": {"agUiType": "TOOL_CALL_RESULT", "toolCallId": "call-1",
                    "content": "sunny"}}),
            ),
            env(
                json!({"type": "run.finished", "timestamp": t(at + 3), "threadId": "th",
                "runId": run, "payload": {"agUiType": "RUN_FINISHED"}}),
            ),
        ]
    };
    let spans_of = |a: &mut Assembler, events: Vec<Envelope>| -> Vec<Span> {
        events.iter().flat_map(|e| a.observe(e, 0).spans).collect()
    };
    let first = spans_of(&mut a, run("r1", 0));
    let second = spans_of(&mut a, run("r2", 10));
    let tool = |spans: &[Span]| -> Span {
        spans
            .iter()
            .find(|s| s.name == "execute_tool get_weather")
            .cloned()
            .unwrap_or_else(|| panic!("no tool span in {spans:?}"))
    };
    let (t1, t2) = (tool(&first), tool(&second));
    assert_ne!(t1.span_id, t2.span_id);
    assert_ne!(t1.trace_id, t2.trace_id);
    assert_eq!(t1.parent_span_id, Some(first[1].span_id));
    // Deterministic: the same run again gives the same ids (a round exported twice is the
    // same spans).
    let again = spans_of(&mut assembler(), run("r1", 0));
    assert_eq!(tool(&again).span_id, t1.span_id);
}

/// Two runs in flight at once, both calling `call-1`, their events interleaved: each call keeps
/// its own arguments and result and becomes its own span under its own run. An event that names
/// no run goes to the oldest open call of its id.
#[test]
fn two_runs_in_flight_with_the_same_tool_call_id_keep_their_calls_apart() {
    let mut a = assembler();
    let t = |ms: u32| format!("2026-11-26T10:00:00.{ms:03}Z");
    let ev = |v: Value| env(v);
    let start = |run: &str, at: u32| {
        ev(
            json!({"type": "run.started", "timestamp": t(at), "threadId": format!("th-{run}"),
            "runId": run, "agentId": "planner", "payload": {"agUiType": "RUN_STARTED"}}),
        )
    };
    let tool_start = |run: &str, at: u32| {
        ev(
            json!({"type": "tool.started", "timestamp": t(at), "runId": run,
            "payload": {"agUiType": "TOOL_CALL_START", "toolCallId": "call-1",
                "toolCallName": "get_weather"}}),
        )
    };
    let args = |run: &str, at: u32, delta: &str| {
        ev(
            json!({"type": "tool.args", "timestamp": t(at), "runId": run,
            "payload": {"agUiType": "TOOL_CALL_ARGS", "toolCallId": "call-1", "delta": delta}}),
        )
    };
    // Both runs started, each with its `call-1` open.
    let opening = || {
        [
            start("r1", 0),
            start("r2", 1),
            tool_start("r1", 2),
            tool_start("r2", 3),
        ]
    };
    let mut spans = Vec::new();
    for e in opening().into_iter().chain([
        args("r2", 4, "{\"city\":\"Bergen\"}"),
        args("r1", 5, "{\"city\":\"Oslo\"}"),
        ev(
            json!({"type": "tool.result", "timestamp": t(20), "runId": "r2",
            "payload": {"agUiType": "TOOL_CALL_RESULT", "toolCallId": "call-1", "content": "rain"}}),
        ),
        // Names no run: the oldest open `call-1`, r1's.
        ev(json!({"type": "tool.result", "timestamp": t(30),
            "payload": {"agUiType": "TOOL_CALL_RESULT", "toolCallId": "call-1", "content": "sunny"}})),
    ]) {
        spans.extend(a.observe(&e, 0).spans);
    }
    assert_eq!(spans.len(), 2, "{spans:?}");
    let (bergen, oslo) = (&spans[0], &spans[1]);
    assert_eq!(
        str_attr(bergen, "gen_ai.tool.call.arguments"),
        Some("{\"city\":\"Bergen\"}")
    );
    assert_eq!(str_attr(bergen, "gen_ai.tool.call.result"), Some("rain"));
    assert_eq!(bergen.end_ms - bergen.start_ms, 17);
    assert_eq!(
        str_attr(oslo, "gen_ai.tool.call.arguments"),
        Some("{\"city\":\"Oslo\"}")
    );
    assert_eq!(str_attr(oslo, "gen_ai.tool.call.result"), Some("sunny"));
    assert_eq!(oslo.end_ms - oslo.start_ms, 28);
    assert_eq!(str_attr(oslo, "gen_ai.tool.call.id"), Some("call-1"));
    assert_ne!(bergen.trace_id, oslo.trace_id);
    assert_ne!(bergen.span_id, oslo.span_id);
    assert_eq!(a.open(), 2, "the two runs are still open");
    // A run that ends with its call still open ends the call too.
    let mut b = assembler();
    let mut left = Vec::new();
    for e in opening().into_iter().chain([ev(
        json!({"type": "run.finished", "timestamp": t(40), "threadId": "th-r1", "runId": "r1",
            "payload": {"agUiType": "RUN_FINISHED"}}),
    )]) {
        left.extend(b.observe(&e, 0).spans);
    }
    let names: Vec<&str> = left.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["execute_tool get_weather", "invoke_agent planner"]);
    assert_eq!(left[0].error.as_deref(), Some("unfinished"));
    assert_eq!(left[0].parent_span_id, Some(left[1].span_id));
    assert_eq!(b.open(), 2, "r2 and its call are still open");
}

/// A tool call of a run that is not open here (it started before a restart) is a root span;
/// `call-1` in two such runs still gives two span ids.
#[test]
fn the_same_tool_call_id_in_two_runs_not_seen_starting_gives_two_span_ids() {
    let mut a = assembler();
    let mut spans = Vec::new();
    for (run, at) in [("r1", 0), ("r2", 10)] {
        for e in [
            json!({"type": "tool.started", "timestamp": format!("2026-11-26T10:00:00.{at:03}Z"),
                "runId": run, "payload": {"agUiType": "TOOL_CALL_START", "toolCallId": "call-1",
                "toolCallName": "get_weather"}}),
            json!({"type": "tool.result", "timestamp": format!("2026-11-26T10:00:00.{:03}Z", at + 1),
                "runId": run, "payload": {"agUiType": "TOOL_CALL_RESULT", "toolCallId": "call-1",
                "content": "sunny"}}),
        ] {
            spans.extend(a.observe(&env(e), 0).spans);
        }
    }
    assert_eq!(spans.len(), 2, "{spans:?}");
    assert!(spans.iter().all(|s| s.parent_span_id.is_none()));
    assert_ne!(spans[0].span_id, spans[1].span_id);
    assert_ne!(spans[0].trace_id, spans[1].trace_id);
}
