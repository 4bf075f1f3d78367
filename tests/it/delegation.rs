//! The delegation tree (`GET /api/tree/{key}`) and the waiting list (`GET /api/waiting`) over
//! traffic published raw to a real nats-server and projected by the worker.

use collab_projector::config::TokenGrant;
use collab_projector::model::Role;
use collab_projector::usage::{Price, Prices};
use serde_json::{json, Value};
use std::net::SocketAddr;

use crate::api::{collab_event, drained, serve, settings, start_worker, state};
use crate::pipeline::publish;
use crate::support::TestNats;

const ALL: &str = "tree-all-7d1c";
const MAIN_ONLY: &str = "tree-main-2b9e";

async fn get(addr: SocketAddr, path: &str, token: &str) -> (u16, Value) {
    let url = format!("http://{addr}{path}");
    let resp = reqwest::Client::new()
        .get(&url)
        .bearer_auth(token)
        .send()
        .await
        .unwrap_or_else(|e| panic!("{url}: {e}"));
    let status = resp.status().as_u16();
    let body = resp.json().await.unwrap_or_else(|e| panic!("{url}: {e}"));
    (status, body)
}

fn find<'a>(n: &'a Value, kind: &str, id: &str) -> Option<&'a Value> {
    if n["kind"] == kind && n["id"] == id {
        return Some(n);
    }
    n["children"]
        .as_array()?
        .iter()
        .find_map(|c| find(c, kind, id))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tree_follows_delegations_across_keys_and_the_waiting_list_names_who_waits() {
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let mut s = settings(&nats.url());
    s.http.tokens = vec![
        TokenGrant {
            name: "all".into(),
            token: ALL.into(),
            token_env: None,
            roles: vec![
                Role::ConversationMain,
                Role::DelegationSubagent,
                Role::OrchestrationTask,
                Role::SystemObservability,
            ],
        },
        TokenGrant {
            name: "main".into(),
            token: MAIN_ONLY.into(),
            token_env: None,
            roles: vec![Role::ConversationMain],
        },
    ];
    let (_running, cancel) = start_worker(&s).await;

    // main asks ruda; ruda delegates to a subagent, which delegates again (seed-000 shapes with
    // parentConversationId). Each answer reports usage.
    let usage = |i: u64, o: u64| json!({"usage": {"input_tokens": i, "output_tokens": o, "model": "gpt-4o"}});
    let mut events = vec![
        collab_event(
            1,
            "a2a.send",
            "ruda",
            "eden",
            "tree-main",
            json!({"message": "triage the nightly build"}),
        ),
        collab_event(
            2,
            "a2a.send",
            "eden",
            "eden-worker",
            "tree-sub",
            json!({"message": "collect the failing logs", "parentConversationId": "tree-main", "depth": 1}),
        ),
        collab_event(
            3,
            "a2a.send",
            "eden-worker",
            "log-reader",
            "tree-sub2",
            json!({"message": "read test 7's log", "parentConversationId": "tree-sub", "depth": 2}),
        ),
        collab_event(
            4,
            "a2a.response",
            "log-reader",
            "eden-worker",
            "tree-sub2",
            {
                let mut m = json!({"message": "timeout in test 7", "parentConversationId": "tree-sub", "depth": 2});
                m["usage"] = usage(1000, 100)["usage"].clone();
                m
            },
        ),
        collab_event(5, "a2a.response", "eden-worker", "eden", "tree-sub", {
            let mut m = json!({"message": "3 failing tests", "parentConversationId": "tree-main", "depth": 1});
            m["usage"] = usage(2000, 200)["usage"].clone();
            m
        }),
        collab_event(6, "a2a.response", "eden", "ruda", "tree-main", {
            let mut m = json!({"message": "triaged"});
            m["usage"] = usage(3000, 300)["usage"].clone();
            m
        }),
        // A turn whose answer asks for input.
        collab_event(
            7,
            "a2a.send",
            "ruda",
            "eden",
            "wait-input",
            json!({"message": "book a flight"}),
        ),
        collab_event(
            8,
            "a2a.response",
            "eden",
            "ruda",
            "wait-input",
            json!({"message": "Which date?", "state": "input-required"}),
        ),
    ];
    // An AG-UI run that ends on an approval interrupt.
    let now = chrono::Utc::now().timestamp_millis() - 30_000;
    for (i, ev) in [
        json!({"type": "RUN_STARTED", "threadId": "wait-approval", "runId": "approve-1"}),
        json!({"type": "RUN_FINISHED", "threadId": "wait-approval", "runId": "approve-1",
            "outcome": {"type": "interrupt", "interrupts": [{"id": "i1", "reason": "approval", "assignee": "ops-lead"}]}}),
    ]
    .into_iter()
    .enumerate()
    {
        let mut ev = ev;
        ev["timestamp"] = json!(now + i as i64 * 1000);
        events.push((
            "collab.raw.wait-approval.agui".to_string(),
            bytes::Bytes::from(ev.to_string()),
        ));
    }
    // The subagents' conversations are published and projected first (event times keep their
    // order): their projections are stored before the main conversation's, and the tree still
    // finds them.
    let chain: Vec<_> = [2, 3, 1, 4].iter().map(|&i| events[i].clone()).collect();
    for (subject, body) in chain {
        publish(&js, &subject, body).await;
    }
    drained(&js).await;
    for (i, (subject, body)) in events.into_iter().enumerate() {
        if ![1, 2, 3, 4].contains(&i) {
            publish(&js, &subject, body).await;
        }
    }
    drained(&js).await;

    let prices = Prices::new(&[Price {
        model: "gpt-4o".into(),
        input_per_mtok: 2.5,
        output_per_mtok: 10.0,
        cached_input_per_mtok: None,
    }])
    .unwrap_or_else(|e| panic!("{e}"));
    let (addr, stop) = serve(state(&js, &s).with_prices(prices), None).await;

    // The whole tree: two levels of delegation below the main conversation, usage rolled up.
    let (status, body) = get(addr, "/api/tree/tree-main", ALL).await;
    assert_eq!(status, 200, "{body:#}");
    crate::schemas::assert_matches("tree.schema.json", &body);
    let tree = &body["tree"];
    assert_eq!(tree["kind"], "conversation", "{body:#}");
    assert_eq!(
        body["keys"],
        json!(["tree-main", "tree-sub", "tree-sub2"]),
        "{body:#}"
    );
    let sub = find(tree, "conversation", "tree-sub").unwrap_or_else(|| panic!("{body:#}"));
    let sub2 = find(sub, "conversation", "tree-sub2").unwrap_or_else(|| panic!("{body:#}"));
    let turn = find(sub2, "turn", "0").unwrap_or_else(|| panic!("{body:#}"));
    assert_eq!(turn["outcome"], "answered", "{turn:#}");
    assert_eq!(turn["label"], "eden-worker → log-reader: read test 7's log");
    assert!(
        // One second of event time apart (each event's time is taken when it is built).
        turn["durationMs"]
            .as_i64()
            .is_some_and(|d| (1000..1100).contains(&d)),
        "{turn:#}"
    );
    assert_eq!(sub2["total"]["inputTokens"], 1000);
    assert_eq!(sub["total"]["inputTokens"], 3000);
    assert_eq!(tree["total"]["inputTokens"], 6000, "{body:#}");
    assert_eq!(tree["total"]["outputTokens"], 600);
    let cost = tree["total"]["cost"].as_f64().unwrap_or_default();
    assert!((cost - 0.021).abs() < 1e-9, "{cost}");
    // The thread's own total is the conversation's alone.
    let (_, thread) = get(addr, "/api/threads/tree-sub", ALL).await;
    assert_eq!(thread["thread"]["total"]["inputTokens"], 2000, "{thread:#}");

    // Rooted at one turn.
    let (status, body) = get(addr, "/api/tree/tree-main?item=turn:0", ALL).await;
    assert_eq!(status, 200, "{body:#}");
    assert_eq!(
        (body["tree"]["kind"].clone(), body["tree"]["id"].clone()),
        (json!("turn"), json!("0"))
    );

    // Only the caller's roles: the subagents' conversations are delegation.subagent.
    let (status, body) = get(addr, "/api/tree/tree-main", MAIN_ONLY).await;
    assert_eq!(status, 200, "{body:#}");
    assert_eq!(body["keys"], json!(["tree-main"]), "{body:#}");
    assert_eq!(body["tree"]["total"]["inputTokens"], 3000);
    let (status, body) = get(
        addr,
        "/api/tree/tree-main?role=delegation.subagent",
        MAIN_ONLY,
    )
    .await;
    assert_eq!(
        (status, body["error"]["code"].clone()),
        (403, json!("forbidden")),
        "{body:#}"
    );

    // No token: 401, as everywhere in the API.
    for path in ["/api/tree/tree-main", "/api/waiting"] {
        let url = format!("http://{addr}{path}");
        let resp = reqwest::get(&url)
            .await
            .unwrap_or_else(|e| panic!("{url}: {e}"));
        assert_eq!(resp.status().as_u16(), 401, "{path}");
    }

    // Bad input: a clear 400; an unknown item or key: 404.
    let (status, body) = get(addr, "/api/tree/tree-main?item=step:1", ALL).await;
    assert_eq!(status, 400, "{body:#}");
    assert_eq!(body["error"]["code"], "invalid_item");
    assert!(body["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("run:<run id>")));
    let (status, _) = get(addr, "/api/tree/tree-main?item=run:nope", ALL).await;
    assert_eq!(status, 404);
    let (status, _) = get(addr, "/api/tree/no-such-key", ALL).await;
    assert_eq!(status, 404);

    // Who is waited on: the approval and the input, longest first; answered turns are not.
    let (status, body) = get(addr, "/api/waiting", ALL).await;
    assert_eq!(status, 200, "{body:#}");
    crate::schemas::assert_matches("waiting.schema.json", &body);
    let waits = body["waits"].as_array().cloned().unwrap_or_default();
    let input = waits
        .iter()
        .find(|w| w["key"] == "wait-input")
        .unwrap_or_else(|| panic!("{body:#}"));
    assert_eq!(input["item"], "turn:0");
    assert_eq!(
        (
            input["who"].clone(),
            input["on"].clone(),
            input["for"].clone()
        ),
        (json!("eden"), json!("ruda"), json!("input"))
    );
    assert_eq!(input["prompt"], "Which date?");
    let approval = waits
        .iter()
        .find(|w| w["key"] == "wait-approval")
        .unwrap_or_else(|| panic!("{body:#}"));
    assert_eq!(
        (approval["kind"].clone(), approval["item"].clone()),
        (json!("run"), json!("run:approve-1"))
    );
    assert_eq!(
        (approval["on"].clone(), approval["for"].clone()),
        (json!("ops-lead"), json!("approval"))
    );
    assert!(
        !waits
            .iter()
            .any(|w| w["key"].as_str().is_some_and(|k| k.starts_with("tree-"))),
        "answered turns wait for nothing: {body:#}"
    );
    // A token without system.observability does not see the AG-UI run's wait.
    let (_, body) = get(addr, "/api/waiting", MAIN_ONLY).await;
    assert!(
        body["waits"]
            .as_array()
            .is_some_and(|w| w.iter().all(|w| w["key"] != "wait-approval")),
        "{body:#}"
    );
    let (status, body) = get(addr, "/api/waiting?limit=0", ALL).await;
    assert_eq!(
        (status, body["error"]["code"].clone()),
        (400, json!("invalid_limit"))
    );

    stop.cancel();
    cancel.cancel();
}
