use super::*;
use crate::ingest::{normalize, RawInput, SubjectInfo};
use crate::usage::Price;
use serde_json::json;

/// Normalise raw inputs as the worker does; each event with the key it is projected under.
fn project(raw: &[(Option<&str>, Value)]) -> Vec<(String, Envelope)> {
    let settings = crate::ingest::default_settings();
    let mut out = Vec::new();
    for (subject_key, v) in raw {
        let bytes = serde_json::to_vec(v).unwrap_or_default();
        let input = RawInput {
            bytes: &bytes,
            subject: subject_key.map(|k| SubjectInfo {
                key: k.into(),
                type_suffix: "agui".into(),
            }),
            raw_ref: None,
            relay: Default::default(),
        };
        let events =
            normalize(&input, settings).unwrap_or_else(|r| panic!("{v} is rejected: {r:?}"));
        out.extend(events.into_iter().map(|n| (n.key, n.envelope)));
    }
    out
}

/// The events grouped by key, `root` first, then the others in the order of `order`.
fn tree_of(
    events: &[(String, Envelope)],
    order: &[&str],
    item: Option<&ItemRef>,
    prices: &Prices,
) -> Option<TreeNode> {
    let keys: Vec<KeyEvents<'_>> = order
        .iter()
        .map(|k| KeyEvents {
            key: (*k).to_string(),
            events: events
                .iter()
                .filter(|(key, _)| key == k)
                .map(|(_, e)| Stored {
                    envelope: e,
                    stored_at: "2026-11-26T10:00:00.000Z",
                })
                .collect(),
        })
        .collect();
    build(&keys, item, prices).map(|b| b.root)
}

fn index(events: &[(String, Envelope)]) -> LinkIndex {
    let mut ix = LinkIndex::default();
    for (k, e) in events {
        ix.add(k, e);
    }
    ix
}

fn find<'a>(n: &'a TreeNode, kind: NodeKind, id: &str) -> Option<&'a TreeNode> {
    if n.kind == kind && n.id == id {
        return Some(n);
    }
    n.children.iter().find_map(|c| find(c, kind, id))
}

fn at(s: u32) -> String {
    format!("2026-11-26T10:00:{s:02}.000Z")
}

fn prices() -> Prices {
    Prices::new(&[Price {
        model: "gpt-4o".into(),
        input_per_mtok: 2.5,
        output_per_mtok: 10.0,
        cached_input_per_mtok: None,
    }])
    .unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn a_subagent_of_the_agentui_fixture_is_a_task_under_its_parent_session() {
    // fixtures/agentui: a subagent (task child-1) of session root-1 going running -> completed,
    // as the Agent UI projection emits it (parentSessionId, taskId).
    let path = format!(
        "{}/fixtures/agentui/example-events.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let doc: Value = std::fs::read(&path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_else(|| panic!("{path} is missing"));
    let raw: Vec<(Option<&str>, Value)> = doc["events"]
        .as_array()
        .unwrap_or_else(|| panic!("no events in {path}"))
        .iter()
        .map(|e| (None, e.clone()))
        .collect();
    let events = project(&raw);
    let tree = tree_of(&events, &["root-1"], None, &Prices::EMPTY)
        .unwrap_or_else(|| panic!("a tree for root-1 from {events:?}"));
    assert_eq!(tree.kind, NodeKind::Conversation);
    let task = find(&tree, NodeKind::Task, "child-1")
        .unwrap_or_else(|| panic!("task child-1 under root-1: {tree:#?}"));
    assert_eq!(task.outcome, NodeOutcome::Completed, "{task:#?}");
    assert_eq!(task.agent.as_deref(), Some("child-1"));
    assert!(task.started_at.is_some() && task.ended_at.is_some());
    // The lead session's own subagent (task-research) is not part of root-1.
    assert!(find(&tree, NodeKind::Task, "task-research").is_none());
}

/// A collaboration delegation chain two levels deep, in the shapes the seed-000 origin emits
/// (fixtures/collab-events): main asks ruda; ruda delegates to a subagent
/// (`parentConversationId`), which delegates again. Each answer reports usage.
fn chain() -> Vec<(String, Envelope)> {
    let send = |conv: &str, parent: Option<&str>, from: &str, to: &str, s: u32, text: &str| {
        let mut data = json!({"fromAgent": from, "toAgent": to, "conversationId": conv,
            "message": text, "fromSessionType": "main"});
        if let Some(p) = parent {
            data["parentConversationId"] = json!(p);
            data["depth"] = json!(1);
            data["toSessionType"] = json!("subagent");
        }
        (
            None,
            json!({"type": "a2a.send", "agentId": from, "ts": at(s), "data": data}),
        )
    };
    let answer = |conv: &str, from: &str, to: &str, s: u32, tokens: (u64, u64)| {
        (
            None,
            json!({"type": "a2a.response", "agentId": from, "ts": at(s), "data": {
            "fromAgent": from, "toAgent": to, "conversationId": conv, "message": "done",
            "usage": {"input_tokens": tokens.0, "output_tokens": tokens.1, "model": "gpt-4o"}}}),
        )
    };
    project(&[
        send(
            "conv-main",
            None,
            "main",
            "ruda",
            1,
            "triage the nightly build",
        ),
        send(
            "conv-sub",
            Some("conv-main"),
            "ruda",
            "ruda-worker",
            2,
            "collect the failing test logs",
        ),
        send(
            "conv-sub2",
            Some("conv-sub"),
            "ruda-worker",
            "log-reader",
            3,
            "read the log of test 7",
        ),
        answer("conv-sub2", "log-reader", "ruda-worker", 4, (1000, 100)),
        answer("conv-sub", "ruda-worker", "ruda", 5, (2000, 200)),
        answer("conv-main", "ruda", "main", 6, (3000, 300)),
    ])
}

#[test]
fn delegated_conversations_hang_under_their_parent_two_levels_deep_with_usage_rolled_up() {
    let events = chain();
    let ix = index(&events);
    assert_eq!(ix.children("conv-main"), vec!["conv-sub".to_string()]);
    assert_eq!(ix.children("conv-sub"), vec!["conv-sub2".to_string()]);
    assert!(ix.children("conv-sub2").is_empty());
    let p = prices();
    let tree = tree_of(&events, &["conv-main", "conv-sub", "conv-sub2"], None, &p)
        .unwrap_or_else(|| panic!("a tree"));
    assert_eq!(tree.id, "conv-main");
    let sub = find(&tree, NodeKind::Conversation, "conv-sub")
        .unwrap_or_else(|| panic!("conv-sub in {tree:#?}"));
    let sub2 = find(sub, NodeKind::Conversation, "conv-sub2")
        .unwrap_or_else(|| panic!("conv-sub2 under conv-sub: {tree:#?}"));
    let turn = sub2
        .children
        .iter()
        .find(|c| c.kind == NodeKind::Turn)
        .unwrap_or_else(|| panic!("the turn of conv-sub2: {sub2:#?}"));
    assert_eq!(turn.outcome, NodeOutcome::Answered);
    assert_eq!(
        turn.label,
        "ruda-worker → log-reader: read the log of test 7"
    );
    assert_eq!(turn.duration_ms, Some(1000));
    assert_eq!(turn.item.as_deref(), Some("turn:0"));
    // Tokens roll up: each level adds its own.
    assert_eq!(
        (sub2.total.input_tokens, sub2.total.output_tokens),
        (1000, 100)
    );
    assert_eq!(
        (sub.total.input_tokens, sub.total.output_tokens),
        (3000, 300)
    );
    assert_eq!(
        (tree.total.input_tokens, tree.total.output_tokens),
        (6000, 600)
    );
    // Cost from the price table: 6000 in at 2.5/M and 600 out at 10/M.
    assert!(
        (tree.total.cost - 0.021).abs() < 1e-9,
        "{}",
        tree.total.cost
    );
    assert_eq!(tree.total.unpriced_tokens, 0);
    // Without a price the tokens are counted, not costed.
    let bare = tree_of(
        &events,
        &["conv-main", "conv-sub", "conv-sub2"],
        None,
        &Prices::EMPTY,
    )
    .unwrap_or_else(|| panic!("a tree"));
    assert_eq!(bare.total.cost, 0.0);
    assert_eq!(bare.total.unpriced_tokens, 6600);
    // The conversation spans its items: from the first send to the last answer.
    assert_eq!(tree.outcome, NodeOutcome::Finished);
    assert_eq!(sub.started_at.as_deref(), Some(at(2).as_str()));
}

#[test]
fn a_tree_rooted_at_a_turn_holds_what_it_caused_and_an_unknown_item_has_none() {
    // The subagent names the turn's run as its parent.
    let events = project(&[
        (
            None,
            json!({"type": "a2a.send", "agentId": "main", "ts": at(1), "data": {
            "fromAgent": "main", "toAgent": "ruda", "conversationId": "c1", "turn": 1,
            "message": "plan"}}),
        ),
        (
            None,
            json!({"type": "run.started", "timestamp": at(2), "sessionId": "s-worker",
            "runId": "w1", "agentId": "ruda-worker", "parentSessionId": "c1"}),
        ),
        (
            None,
            json!({"type": "run.finished", "timestamp": at(4), "sessionId": "s-worker",
            "runId": "w1", "agentId": "ruda-worker",
            "payload": {"usage": {"inputTokens": 10, "outputTokens": 5}}}),
        ),
    ]);
    let tree = tree_of(&events, &["c1", "s-worker"], None, &Prices::EMPTY)
        .unwrap_or_else(|| panic!("a tree"));
    let worker = find(&tree, NodeKind::Conversation, "s-worker")
        .unwrap_or_else(|| panic!("s-worker under c1: {tree:#?}"));
    let run = find(worker, NodeKind::Run, "w1").unwrap_or_else(|| panic!("{worker:#?}"));
    assert_eq!(run.outcome, NodeOutcome::Finished);
    assert_eq!(run.duration_ms, Some(2000));
    assert_eq!(tree.total.input_tokens, 10);
    let turn = ItemRef::Turn("1".into());
    let rooted = tree_of(&events, &["c1", "s-worker"], Some(&turn), &Prices::EMPTY)
        .unwrap_or_else(|| panic!("a tree at turn 1"));
    assert_eq!((rooted.kind, rooted.id.as_str()), (NodeKind::Turn, "1"));
    assert!(
        rooted.children.is_empty(),
        "the link names the conversation, not the turn: {rooted:#?}"
    );
    assert!(tree_of(
        &events,
        &["c1"],
        Some(&ItemRef::Run("nope".into())),
        &Prices::EMPTY
    )
    .is_none());
}

#[test]
fn an_agui_run_in_another_thread_hangs_under_the_run_its_parent_run_id_names() {
    let ev = |thread: &str, v: Value| (Some(thread.to_string()), v);
    let raw = [
        ev(
            "t-lead",
            json!({"type": "RUN_STARTED", "threadId": "t-lead", "runId": "r1", "timestamp": 1_764_151_201_000_i64}),
        ),
        ev(
            "t-lead",
            json!({"type": "TOOL_CALL_START", "threadId": "t-lead", "runId": "r1", "toolCallId": "c1", "toolCallName": "delegate", "timestamp": 1_764_151_202_000_i64}),
        ),
        ev(
            "t-sub",
            json!({"type": "RUN_STARTED", "threadId": "t-sub", "runId": "r2", "parentRunId": "r1", "timestamp": 1_764_151_203_000_i64}),
        ),
        ev(
            "t-sub",
            json!({"type": "RUN_FINISHED", "threadId": "t-sub", "runId": "r2", "timestamp": 1_764_151_205_000_i64,
                "result": {"usage": {"prompt_tokens": 40, "completion_tokens": 4, "model": "gpt-4o"}}}),
        ),
        ev(
            "t-lead",
            json!({"type": "TOOL_CALL_RESULT", "threadId": "t-lead", "runId": "r1", "toolCallId": "c1", "messageId": "m", "content": "ok", "timestamp": 1_764_151_206_000_i64}),
        ),
        ev(
            "t-lead",
            json!({"type": "RUN_FINISHED", "threadId": "t-lead", "runId": "r1", "timestamp": 1_764_151_207_000_i64}),
        ),
    ];
    let raw: Vec<(Option<&str>, Value)> =
        raw.iter().map(|(k, v)| (k.as_deref(), v.clone())).collect();
    let events = project(&raw);
    assert_eq!(index(&events).children("t-lead"), vec!["t-sub".to_string()]);
    let p = prices();
    let item = ItemRef::Run("r1".into());
    let tree = tree_of(&events, &["t-lead", "t-sub"], Some(&item), &p)
        .unwrap_or_else(|| panic!("a tree at run r1"));
    assert_eq!((tree.kind, tree.id.as_str()), (NodeKind::Run, "r1"));
    let tool = find(&tree, NodeKind::Tool, "c1").unwrap_or_else(|| panic!("{tree:#?}"));
    assert_eq!(
        (tool.label.as_str(), tool.outcome),
        ("delegate", NodeOutcome::Completed)
    );
    let sub = find(&tree, NodeKind::Conversation, "t-sub").unwrap_or_else(|| panic!("{tree:#?}"));
    let r2 = find(sub, NodeKind::Run, "r2").unwrap_or_else(|| panic!("{sub:#?}"));
    assert_eq!(r2.duration_ms, Some(2000));
    assert_eq!(r2.usage.as_ref().map(|u| u.input_tokens), Some(40));
    assert_eq!(tree.total.input_tokens, 40, "the sub-run's tokens roll up");
    assert!(tree.total.cost > 0.0);
}

#[test]
fn spawns_reference_task_ids_and_task_ids_link_keys_and_cycles_are_cut() {
    // A spawn names the subagent's session key; the subagent's session events are keyed by it.
    let sub_key = "agent:main:subagent:7";
    let mut events = project(&[
        (
            None,
            json!({"type": "a2a.spawn", "agentId": "main", "ts": at(1), "data": {
            "fromAgent": "main", "toAgent": "main-worker", "conversationId": "del-7",
            "targetSessionKey": sub_key}}),
        ),
        (
            None,
            json!({"type": "run.started", "timestamp": at(2), "sessionId": sub_key,
            "runId": "sr", "agentId": "main-worker"}),
        ),
        // A turn whose task runs under its own key (orchestration events keyed by the task).
        (
            None,
            json!({"type": "run.started", "timestamp": at(3), "sessionId": "ops", "runId": "o1",
            "taskId": "task-9", "agentId": "ops"}),
        ),
        (
            None,
            json!({"type": "task.created", "timestamp": at(4), "taskId": "task-9",
            "agentId": "ops", "payload": {"title": "Nightly build triage", "status": "queued"}}),
        ),
        (
            None,
            json!({"type": "task.completed", "timestamp": at(6), "taskId": "task-9",
            "agentId": "ops", "payload": {"status": "done"}}),
        ),
    ]);
    let sub_token = key_token(sub_key);
    // A2A: a follow-up in another context refers to a task of the first (referenceTaskIds),
    // as the wire normaliser keeps the request.
    let followup: Envelope = serde_json::from_value(json!({
        "type": "a2a.send", "conversationId": "ctx-b", "turnId": "ex-2", "timestamp": at(7),
        "payload": {"fromAgent": "main", "toAgent": "travel", "message": "and a hotel",
            "a2a": {"params": {"message": {"role": "user", "referenceTaskIds": ["task-9"],
                "parts": [{"kind": "text", "text": "and a hotel"}]}}}}}))
    .unwrap_or_else(|e| panic!("{e}"));
    events.push(("ctx-b".into(), followup));
    // A cycle: the subagent names the spawning conversation's child as its parent too.
    let back: Envelope = serde_json::from_value(json!({"type": "run.status", "timestamp": at(8),
        "sessionId": sub_key, "runId": "sr", "parentSessionId": "del-7"}))
    .unwrap_or_else(|e| panic!("{e}"));
    events.push((sub_token.clone(), back));
    let ix = index(&events);
    assert_eq!(ix.children("del-7"), vec![sub_token.clone()]);
    assert_eq!(ix.children("ops"), vec!["task-9".to_string()]);
    assert_eq!(ix.children("task-9"), vec!["ctx-b".to_string()]);
    let tree = tree_of(
        &events,
        &["del-7", sub_token.as_str()],
        None,
        &Prices::EMPTY,
    )
    .unwrap_or_else(|| panic!("a tree"));
    let sub =
        find(&tree, NodeKind::Conversation, &sub_token).unwrap_or_else(|| panic!("{tree:#?}"));
    assert!(find(sub, NodeKind::Run, "sr").is_some());
    assert!(
        find(sub, NodeKind::Conversation, "del-7").is_none(),
        "no cycle"
    );
    // The run's task key is shown as the task, under the run; the follow-up under the task.
    let ops = tree_of(&events, &["ops", "task-9", "ctx-b"], None, &Prices::EMPTY)
        .unwrap_or_else(|| panic!("a tree"));
    let run = find(&ops, NodeKind::Run, "o1").unwrap_or_else(|| panic!("{ops:#?}"));
    let task = find(run, NodeKind::Task, "task-9").unwrap_or_else(|| panic!("{ops:#?}"));
    assert_eq!(task.label, "Nightly build triage");
    assert_eq!(task.outcome, NodeOutcome::Completed);
    assert_eq!(task.duration_ms, Some(2000));
    assert!(
        find(task, NodeKind::Conversation, "ctx-b").is_some(),
        "{ops:#?}"
    );
}

fn fixture(name: &str) -> Vec<(String, Envelope)> {
    let path = format!("{}/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    let cases: Vec<Value> = std::fs::read(&path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_else(|| panic!("{path} is missing"));
    cases
        .iter()
        .map(|c| {
            let env: Envelope = serde_json::from_value(c["envelope"].clone())
                .unwrap_or_else(|e| panic!("{path}: {e}"));
            ("ctx-key".to_string(), env)
        })
        .collect()
}

#[test]
fn an_a2a_stream_from_the_spec_is_a_turn_whose_task_its_answer_completes() {
    // fixtures/a2a-spec: the v0.3 specification's message/stream request and its SSE frames as
    // projected: status and artifact frames are the task's (orchestration.task), the final frame
    // the turn's response.
    let mut events =
        fixture("a2a-spec/v030_jsonrpc_message-stream_request_with-filepart.expected.json");
    events.extend(fixture(
        "a2a-spec/v030_jsonrpc_message-stream_sse-events.expected.json",
    ));
    let tree =
        tree_of(&events, &["ctx-key"], None, &Prices::EMPTY).unwrap_or_else(|| panic!("a tree"));
    let turn = find(&tree, NodeKind::Turn, "ex-1").unwrap_or_else(|| panic!("{tree:#?}"));
    assert_eq!(turn.outcome, NodeOutcome::Answered);
    let task = find(turn, NodeKind::Task, "225d6247-06ba-4cda-a08b-33ae35c8dcfa")
        .unwrap_or_else(|| panic!("the task under its turn: {tree:#?}"));
    assert_eq!(task.outcome, NodeOutcome::Completed, "{task:#?}");
    assert!(task.ended_at.is_some());
    assert_eq!(tree.outcome, NodeOutcome::Finished);
}

#[test]
fn a_spawn_outside_any_turn_hangs_its_child_under_the_conversation() {
    // The seed-000 origin's spawn names the subagent's session; no turn of its own.
    let sub_key = "agent:ruda:subagent:3";
    let events = project(&[
        (
            None,
            json!({"type": "a2a.spawn", "agentId": "ruda", "ts": at(1), "data": {
            "fromAgent": "ruda", "toAgent": "ruda-worker", "conversationId": "spawner",
            "targetSessionKey": sub_key}}),
        ),
        (
            None,
            json!({"type": "run.started", "timestamp": at(2), "sessionId": sub_key,
            "runId": "w3", "agentId": "ruda-worker"}),
        ),
    ]);
    let sub_token = key_token(sub_key);
    let tree = tree_of(
        &events,
        &["spawner", sub_token.as_str()],
        None,
        &Prices::EMPTY,
    )
    .unwrap_or_else(|| panic!("a tree"));
    let sub = tree
        .children
        .iter()
        .find(|c| c.kind == NodeKind::Conversation && c.id == sub_token)
        .unwrap_or_else(|| {
            panic!("the subagent's session right under the conversation: {tree:#?}")
        });
    assert!(find(sub, NodeKind::Run, "w3").is_some(), "{sub:#?}");
}

#[test]
fn items_are_named_run_or_turn_with_an_id() {
    assert_eq!(ItemRef::parse("run:r1"), Some(ItemRef::Run("r1".into())));
    assert_eq!(ItemRef::parse("turn:0"), Some(ItemRef::Turn("0".into())));
    assert_eq!(
        ItemRef::parse("turn:a:b"),
        Some(ItemRef::Turn("a:b".into())),
        "ids may hold colons"
    );
    for bad in ["run:", "step:1", "run", "", "Run:r1"] {
        assert_eq!(ItemRef::parse(bad), None, "{bad:?}");
    }
}

fn count(n: &TreeNode) -> usize {
    1 + n.children.iter().map(count).sum::<usize>()
}

#[test]
fn a_tree_holds_at_most_max_nodes_and_says_it_was_cut() {
    let mut events: Vec<(String, Envelope)> = Vec::new();
    for r in 0..11 {
        let run = format!("r{r}");
        let mut push = |v: Value| {
            let env: Envelope = serde_json::from_value(v).unwrap_or_else(|e| panic!("{e}"));
            events.push(("busy".to_string(), env));
        };
        push(json!({"type": "run.started", "runId": run, "timestamp": at(1)}));
        for c in 0..500 {
            push(
                json!({"type": "tool.started", "runId": run, "timestamp": at(2),
                "payload": {"toolCallId": format!("{run}-c{c}"), "name": "lookup"}}),
            );
        }
    }
    let keys = vec![KeyEvents {
        key: "busy".into(),
        events: events
            .iter()
            .map(|(_, e)| Stored {
                envelope: e,
                stored_at: "2026-11-26T10:00:00.000Z",
            })
            .collect(),
    }];
    let built = build(&keys, None, &Prices::EMPTY).unwrap_or_else(|| panic!("a tree"));
    assert!(built.cut);
    assert_eq!(count(&built.root), MAX_NODES);
    // Under the bound nothing is cut.
    let small = KeyEvents {
        key: "busy".into(),
        events: keys[0].events[..600]
            .iter()
            .map(|s| Stored {
                envelope: s.envelope,
                stored_at: s.stored_at,
            })
            .collect(),
    };
    let built = build(&[small], None, &Prices::EMPTY).unwrap_or_else(|| panic!("a tree"));
    assert!(!built.cut);
    assert_eq!(
        count(&built.root),
        1 + 2 + 500 + 98,
        "the conversation, two runs (501 and 99 events), their calls"
    );
}

#[test]
fn a_run_named_by_a_send_puts_what_names_it_as_parent_under_that_turn() {
    // The seed-000 origin's send names the run that handles the turn (`runId`); a subagent's
    // runtime events name it as their parent run.
    let events = project(&[
        (
            None,
            json!({"type": "a2a.send", "agentId": "ruda", "ts": at(1), "data": {
            "fromAgent": "ruda", "toAgent": "eden", "conversationId": "c-main", "turn": 2,
            "runId": "run-77", "message": "plan the release"}}),
        ),
        (
            None,
            json!({"type": "run.started", "timestamp": at(2), "sessionId": "s-helper",
            "runId": "h1", "agentId": "eden-helper", "payload": {"parentRunId": "run-77"}}),
        ),
        (
            None,
            json!({"type": "run.finished", "timestamp": at(5), "sessionId": "s-helper",
            "runId": "h1", "agentId": "eden-helper"}),
        ),
    ]);
    assert_eq!(
        index(&events).children("c-main"),
        vec!["s-helper".to_string()]
    );
    let turn = ItemRef::Turn("2".into());
    let tree = tree_of(
        &events,
        &["c-main", "s-helper"],
        Some(&turn),
        &Prices::EMPTY,
    )
    .unwrap_or_else(|| panic!("a tree at turn 2"));
    assert_eq!((tree.kind, tree.id.as_str()), (NodeKind::Turn, "2"));
    let helper = find(&tree, NodeKind::Conversation, "s-helper")
        .unwrap_or_else(|| panic!("the helper under the turn: {tree:#?}"));
    let run = find(helper, NodeKind::Run, "h1").unwrap_or_else(|| panic!("{helper:#?}"));
    assert_eq!(run.outcome, NodeOutcome::Finished);
    assert_eq!(run.duration_ms, Some(3000));
}
