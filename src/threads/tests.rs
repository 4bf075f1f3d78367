use super::*;
use serde_json::json;

fn env(v: Value) -> Envelope {
    serde_json::from_value(v).unwrap_or_default()
}

fn assemble_all(events: &[Envelope]) -> ThreadView {
    let stored: Vec<Stored<'_>> = events
        .iter()
        .map(|e| Stored {
            envelope: e,
            stored_at: "2026-11-26T10:00:00.000Z",
        })
        .collect();
    assemble("th", &stored, false, &Prices::default())
}

fn fixture(name: &str) -> Vec<Envelope> {
    let path = format!("{}/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    let cases: Vec<Value> = std::fs::read(&path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    assert!(!cases.is_empty(), "{path} is missing");
    cases.iter().map(|c| env(c["envelope"].clone())).collect()
}

#[test]
fn the_agui_fixture_messages_are_assembled_from_their_deltas_inside_the_open_run() {
    // fixtures/agui-spec: the AG-UI .NET compatibility fixtures' message events as projected,
    // which name no run: they belong to the thread's open run.
    let mut events = vec![env(json!({"type": "run.started", "runId": "r1",
        "timestamp": "2026-11-26T10:00:00.000Z", "payload": {"agUiType": "RUN_STARTED"}}))];
    events.extend(fixture(
        "agui-spec/dotnet-compat-fixture_message-events.expected.json",
    ));
    let t = assemble_all(&events);
    assert_eq!(t.runs.len(), 1);
    let run = &t.runs[0];
    assert_eq!(
        run.outcome,
        RunOutcome::Running,
        "no terminal yet: still streaming"
    );
    let msg = run
        .messages
        .iter()
        .find(|m| m.message_id == "msg-1")
        .unwrap_or_else(|| panic!("msg-1 in {:?}", run.messages));
    assert_eq!(msg.role.as_deref(), Some("assistant"));
    assert!(msg.text.starts_with("Hel"), "{}", msg.text);
    assert!(
        msg.text.contains("Special chars: \u{1f680}"),
        "{}",
        msg.text
    );
    assert!(msg.complete);
    let user = run.messages.iter().find(|m| m.message_id == "test-msg");
    assert_eq!(user.and_then(|m| m.role.as_deref()), Some("user"));
}

#[test]
fn a_run_has_its_tool_calls_steps_outcome_duration_and_usage() {
    let t = |ms: u32| format!("2026-11-26T10:00:00.{ms:03}Z");
    let events: Vec<Envelope> = [
        json!({"type": "run.started", "runId": "r1", "timestamp": t(0), "agentId": "planner",
            "payload": {"agUiType": "RUN_STARTED"}}),
        json!({"type": "run.status", "runId": "r1", "timestamp": t(5),
            "payload": {"agUiType": "STEP_STARTED", "stepName": "plan"}}),
        json!({"type": "tool.started", "runId": "r1", "timestamp": t(10),
            "payload": {"agUiType": "TOOL_CALL_START", "toolCallId": "c1", "toolCallName": "get_weather"}}),
        json!({"type": "tool.args", "runId": "r1", "timestamp": t(11),
            "payload": {"agUiType": "TOOL_CALL_ARGS", "toolCallId": "c1", "delta": "{\"city\":"}}),
        json!({"type": "tool.args", "runId": "r1", "timestamp": t(12),
            "payload": {"agUiType": "TOOL_CALL_ARGS", "toolCallId": "c1", "delta": "\"Oslo\"}"}}),
        json!({"type": "tool.args", "runId": "r1", "timestamp": t(13),
            "payload": {"agUiType": "TOOL_CALL_END", "toolCallId": "c1"}}),
        json!({"type": "tool.result", "runId": "r1", "timestamp": t(50),
            "payload": {"agUiType": "TOOL_CALL_RESULT", "toolCallId": "c1", "content": "sunny"}}),
        json!({"type": "run.status", "runId": "r1", "timestamp": t(60),
            "payload": {"agUiType": "STEP_FINISHED", "stepName": "plan"}}),
        json!({"type": "run.finished", "runId": "r1", "timestamp": t(100),
            "payload": {"agUiType": "RUN_FINISHED",
                "result": {"usage": {"inputTokens": 20, "outputTokens": 5}}}}),
        json!({"type": "run.started", "runId": "r2", "timestamp": t(110),
            "payload": {"agUiType": "RUN_STARTED", "parentRunId": "r1"}}),
        json!({"type": "run.failed", "timestamp": t(120),
            "payload": {"agUiType": "RUN_ERROR", "message": "quota exhausted", "code": "rate_limited"}}),
    ]
    .into_iter()
    .map(env)
    .collect();
    let thread = assemble_all(&events);
    let run = &thread.runs[0];
    assert_eq!(
        (run.agent.as_deref(), run.outcome, run.duration_ms),
        (Some("planner"), RunOutcome::Finished, Some(100))
    );
    let call = &run.tool_calls[0];
    assert_eq!(call.name.as_deref(), Some("get_weather"));
    assert_eq!(call.arguments, "{\"city\":\"Oslo\"}");
    assert_eq!(
        (call.result.as_deref(), call.status, call.duration_ms),
        (Some("sunny"), ToolStatus::Completed, Some(40))
    );
    assert_eq!(run.steps.len(), 1);
    assert!(run.steps[0].started_at.is_some() && run.steps[0].ended_at.is_some());
    assert_eq!(run.usage.as_ref().map(|u| u.input_tokens), Some(20));
    // A RUN_ERROR that names no run ends the thread's open one.
    let child = &thread.runs[1];
    assert_eq!(child.parent_run_id.as_deref(), Some("r1"));
    assert_eq!(
        (child.outcome, child.error.as_deref()),
        (RunOutcome::Failed, Some("quota exhausted"))
    );
}

#[test]
fn turns_show_request_and_reply_in_place_with_their_outcome() {
    let mut events: Vec<Envelope> = [
        json!({"type": "a2a.send", "conversationId": "c", "turnId": "1",
            "timestamp": "2026-11-26T10:00:00.000Z",
            "payload": {"fromAgent": "main", "toAgent": "ruda", "message": "plan the trip"}}),
        json!({"type": "a2a.response", "conversationId": "c", "turnId": "1",
            "timestamp": "2026-11-26T10:00:02.000Z",
            "payload": {"fromAgent": "ruda", "toAgent": "main", "message": "done"}}),
        json!({"type": "a2a.send", "conversationId": "c", "turnId": "2",
            "payload": {"fromAgent": "main", "toAgent": "ruda", "message": "and the budget?"}}),
        json!({"type": "a2a.response", "conversationId": "c", "turnId": "2",
            "payload": {"outcome": "blocked", "reason": "timeout", "next_action": "retry ruda"}}),
        json!({"type": "a2a.send", "conversationId": "c", "turnId": "3",
            "payload": {"fromAgent": "main", "toAgent": "eden", "message": "still there?"}}),
    ]
    .into_iter()
    .map(env)
    .collect();
    // An A2A answer that asks for input (fixtures/a2a-spec), for turn ex-1.
    events.extend(fixture(
        "a2a-spec/v030_jsonrpc_message-send_response_input-required.expected.json",
    ));
    let t = assemble_all(&events);
    let by_id = |id: &str| {
        t.turns
            .iter()
            .find(|x| x.turn_id == id)
            .unwrap_or_else(|| panic!("turn {id} in {:?}", t.turns))
    };
    let one = by_id("1");
    assert_eq!(
        (
            one.outcome,
            one.request.as_deref(),
            one.reply.as_deref(),
            one.duration_ms
        ),
        (
            TurnOutcome::Answered,
            Some("plan the trip"),
            Some("done"),
            Some(2000)
        )
    );
    assert_eq!(
        (one.from_agent.as_deref(), one.to_agent.as_deref()),
        (Some("main"), Some("ruda"))
    );
    let two = by_id("2");
    assert_eq!(
        (two.outcome, two.reason.as_deref()),
        (TurnOutcome::Blocked, Some("timeout"))
    );
    assert_eq!(
        two.to_agent.as_deref(),
        Some("ruda"),
        "the asked agent, not the blocked reply's"
    );
    assert_eq!(by_id("3").outcome, TurnOutcome::AwaitingReply);
    let waiting = by_id("ex-1");
    assert_eq!(
        (waiting.outcome, waiting.waiting_for.as_deref()),
        (TurnOutcome::Waiting, Some("input"))
    );
    assert!(waiting
        .reply
        .as_deref()
        .is_some_and(|r| r.starts_with("Sure, I can help")));
}

#[test]
fn text_is_bounded_on_a_character_boundary() {
    let mut events = vec![env(json!({"type": "run.started", "runId": "r"}))];
    let chunk = "é".repeat(1000);
    for _ in 0..(MAX_TEXT_BYTES / chunk.len() + 2) {
        events.push(env(
            json!({"type": "text.delta", "runId": "r", "messageId": "m",
            "payload": {"agUiType": "TEXT_MESSAGE_CONTENT", "delta": chunk}}),
        ));
    }
    let t = assemble_all(&events);
    let text = &t.runs[0].messages[0].text;
    assert!(text.len() <= MAX_TEXT_BYTES && text.len() > MAX_TEXT_BYTES - 4);
    assert!(text.chars().all(|c| c == 'é'));
}

#[test]
fn a_thread_totals_the_tokens_of_its_runs_and_turns_costed_by_the_price_table() {
    let events: Vec<Envelope> = [
        json!({"type": "run.started", "runId": "r1", "timestamp": "2026-11-26T10:00:00.000Z",
            "payload": {"agUiType": "RUN_STARTED"}}),
        json!({"type": "run.finished", "runId": "r1", "timestamp": "2026-11-26T10:00:01.000Z",
            "payload": {"agUiType": "RUN_FINISHED",
                "result": {"usage": {"prompt_tokens": 1000, "completion_tokens": 100, "model": "m-priced"}}}}),
        json!({"type": "a2a.send", "conversationId": "th", "timestamp": "2026-11-26T10:00:02.000Z",
            "payload": {"fromAgent": "main", "toAgent": "ruda", "message": "go"}}),
        json!({"type": "a2a.response", "conversationId": "th", "timestamp": "2026-11-26T10:00:03.000Z",
            "payload": {"message": "done",
                "usage": {"input_tokens": 500, "output_tokens": 50, "model": "m-unpriced"}}}),
    ]
    .into_iter()
    .map(env)
    .collect();
    let prices = Prices::new(&[crate::usage::Price {
        model: "m-priced".into(),
        input_per_mtok: 1.0,
        output_per_mtok: 2.0,
        cached_input_per_mtok: None,
    }])
    .unwrap_or_else(|e| panic!("{e}"));
    let stored: Vec<Stored<'_>> = events
        .iter()
        .map(|e| Stored {
            envelope: e,
            stored_at: "2026-11-26T10:00:00.000Z",
        })
        .collect();
    let t = assemble("th", &stored, false, &prices);
    assert_eq!((t.total.input_tokens, t.total.output_tokens), (1500, 150));
    // 1000 in at 1/M and 100 out at 2/M; the unpriced model's 550 tokens counted, not costed.
    assert!((t.total.cost - 0.0012).abs() < 1e-12, "{}", t.total.cost);
    assert_eq!(t.total.unpriced_tokens, 550);
}
