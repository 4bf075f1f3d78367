//! Trust boundaries, against a real nats-server (and the real worker where it matters): what a
//! token holder may read of work sessions, how many event streams one token may hold, the
//! headers every API response carries, bounded storage that refuses input instead of dropping
//! it, and producers bound to their own identity and inbox by the shipped server configuration.

use std::time::Duration;

use async_nats::jetstream::{self, stream};
use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::Router;
use bytes::Bytes;
use collab_projector::api::{self, ApiState, SseLimits};
use collab_projector::bus::{self, provision};
use collab_projector::config::{Secret, Settings, TokenGrant};
use collab_projector::identity;
use collab_projector::ingest::{self, RawInput};
use collab_projector::model::Role;
use serde_json::{json, Value};
use tower::ServiceExt;

use crate::api::{drained, serve, settings, start_worker};
use crate::auth::{roles_sample, Login, AGENT_USERS, WORKERS};
use crate::pipeline::{publish, GUARD};
use crate::support::{wait_until, TestNats};

const TASK_TOKEN: &str = "task-only-token";
const MAIN_TOKEN: &str = "main-only-token";
const ALL_TOKEN: &str = "every-role-token";

fn grant(name: &str, token: &str, roles: &[Role]) -> TokenGrant {
    TokenGrant {
        name: name.into(),
        token: token.into(),
        token_env: None,
        roles: roles.to_vec(),
    }
}

fn with_tokens(mut s: Settings) -> Settings {
    s.http.tokens = vec![
        grant("tasks", TASK_TOKEN, &[Role::OrchestrationTask]),
        grant("main", MAIN_TOKEN, &[Role::ConversationMain]),
        grant("all", ALL_TOKEN, &Role::ALL),
    ];
    s
}

/// A server, the settings with the three tokens changed by `tweak`, and their resources
/// provisioned.
async fn provisioned_with_tokens(
    tweak: impl FnOnce(&mut Settings),
) -> (TestNats, jetstream::Context, Settings) {
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let mut s = with_tokens(settings(&nats.url()));
    tweak(&mut s);
    provision::provision(&js, &s)
        .await
        .unwrap_or_else(|e| panic!("provision: {e}"));
    (nats, js, s)
}

/// A request through the router: status, headers and body (JSON, else its text).
async fn get(app: &Router, uri: &str, token: Option<&str>) -> (StatusCode, HeaderMap, Value) {
    let mut req = Request::builder().uri(uri);
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let resp = app
        .clone()
        .oneshot(req.body(Body::empty()).unwrap_or_else(|e| panic!("{e}")))
        .await
        .unwrap_or_else(|e| panic!("the router answers: {e}"));
    let status = resp.status();
    let headers = resp.headers().clone();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap_or_else(|e| panic!("a body: {e}"));
    let body = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (status, headers, body)
}

fn assert_private(uri: &str, status: StatusCode, headers: &HeaderMap) {
    assert_eq!(
        headers
            .get("x-content-type-options")
            .and_then(|v| v.to_str().ok()),
        Some("nosniff"),
        "{uri} ({status})"
    );
    assert_eq!(
        headers.get("cache-control").and_then(|v| v.to_str().ok()),
        Some("no-store"),
        "{uri} ({status})"
    );
}

/// A raw collaboration event of work session `ws_trust`.
fn raw(t: &str, from: &str, conv: &str, data: Value) -> (String, Bytes) {
    let mut d = json!({"fromAgent": from, "conversationId": conv, "workSessionId": "ws_trust"});
    if let (Some(m), Value::Object(e)) = (d.as_object_mut(), data) {
        m.extend(e);
    }
    let body = json!({"type": t, "agentId": from, "ts": chrono::Utc::now().timestamp_millis() - 30_000, "data": d});
    (
        format!("collab.raw.{conv}.{t}"),
        Bytes::from(body.to_string()),
    )
}

#[tokio::test]
async fn work_sessions_show_a_token_no_text_of_roles_outside_its_grant() {
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let s = with_tokens(settings(&nats.url()));
    let (_running, _cancel) = start_worker(&s).await;
    let events = [
        raw(
            "a2a.send",
            "ruda",
            "conv-main",
            json!({"toAgent": "eden", "message": "MAINSECRET message", "conversationName": "MAINSECRET name",
                   "goal": "MAINSECRET goal", "fromName": "MAINSECRET Ruda", "toDisplayName": "MAINSECRET Eden"}),
        ),
        raw(
            "a2a.send",
            "ruda",
            "conv-sub",
            json!({"toAgent": "worker-7", "targetSessionKey": "agent:ruda:subagent:abc",
                   "message": "SUBSECRET message", "conversationName": "SUBSECRET name",
                   "goal": "SUBSECRET goal", "fromName": "SUBSECRET Ruda", "toDisplayName": "SUBSECRET Worker"}),
        ),
        raw(
            "task.created",
            "ruda",
            "task-1",
            json!({"taskId": "task-1", "text": "the task's own text"}),
        ),
    ];
    for (subject, body) in &events {
        publish(&js, subject, body.clone()).await;
    }
    drained(&js).await;
    let app = api::router(ApiState::new(js.clone(), s.names(), &s.http));
    let one = "/api/work-sessions/ws_trust";
    wait_until(GUARD, "the session holds events of three roles", || {
        let app = app.clone();
        async move {
            let (status, _, body) = get(&app, one, Some(ALL_TOKEN)).await;
            status == StatusCode::OK
                && body["session"]["countsByRole"]
                    .as_object()
                    .is_some_and(|m| m.len() == 3)
        }
    })
    .await;

    // Every role's text is there for a token granted every role (so the checks below can fail).
    let (_, _, all) = get(&app, &format!("{one}?format=mplp"), Some(ALL_TOKEN)).await;
    let (_, _, all_view) = get(&app, one, Some(ALL_TOKEN)).await;
    let seen = format!("{all}{all_view}");
    assert!(
        seen.contains("MAINSECRET") && seen.contains("SUBSECRET"),
        "{seen}"
    );

    // A token granted orchestration.task only sees none of it, in any view or format.
    for uri in [
        "/api/work-sessions".to_string(),
        one.to_string(),
        format!("{one}?format=mplp"),
        format!("{one}?format=json"),
    ] {
        let (status, headers, body) = get(&app, &uri, Some(TASK_TOKEN)).await;
        assert_eq!(status, StatusCode::OK, "{uri}: {body}");
        assert_private(&uri, status, &headers);
        let text = body.to_string();
        assert!(
            !text.contains("SECRET"),
            "{uri} shows another role's text: {text}"
        );
        assert!(text.contains("ws_trust"), "{uri}: {text}");
    }
    let (_, _, task) = get(&app, one, Some(TASK_TOKEN)).await;
    assert_eq!(task["session"]["title"], "Work session ws_trust");
    assert_eq!(task["session"]["lastMessagePreview"], "the task's own text");
    let (_, _, mplp) = get(&app, &format!("{one}?format=mplp"), Some(TASK_TOKEN)).await;
    assert_eq!(mplp["purpose"], "Collaboration in work session ws_trust");

    // A conversation.main token sees its own role's text and nothing of the subagent's.
    let (_, _, main) = get(&app, &format!("{one}?format=mplp"), Some(MAIN_TOKEN)).await;
    let (_, _, main_view) = get(&app, one, Some(MAIN_TOKEN)).await;
    let text = format!("{main}{main_view}");
    assert!(!text.contains("SUBSECRET"), "{text}");
    assert_eq!(main["purpose"], "MAINSECRET goal");
    assert_eq!(main_view["session"]["name"], "MAINSECRET name");
}

#[tokio::test]
async fn every_api_response_is_nosniff_and_no_store() {
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let s = with_tokens(settings(&nats.url()));
    provision::provision(&js, &s)
        .await
        .unwrap_or_else(|e| panic!("provision: {e}"));
    let app = api::router(ApiState::new(js.clone(), s.names(), &s.http));
    for (uri, token, want) in [
        ("/api/events", Some(ALL_TOKEN), StatusCode::OK),
        ("/api/work-sessions", Some(ALL_TOKEN), StatusCode::OK),
        ("/api/me", Some(TASK_TOKEN), StatusCode::OK),
        ("/api/openapi.json", None, StatusCode::OK),
        ("/api/schemas", None, StatusCode::OK),
        ("/api/events", None, StatusCode::UNAUTHORIZED),
        (
            "/api/events?role=conversation.main",
            Some(TASK_TOKEN),
            StatusCode::FORBIDDEN,
        ),
        (
            "/api/events?limit=x",
            Some(ALL_TOKEN),
            StatusCode::BAD_REQUEST,
        ),
        (
            "/api/work-sessions/none",
            Some(ALL_TOKEN),
            StatusCode::NOT_FOUND,
        ),
        ("/api/nothing-here", None, StatusCode::NOT_FOUND),
    ] {
        let (status, headers, body) = get(&app, uri, token).await;
        assert_eq!(status, want, "{uri}: {body}");
        assert_private(uri, status, &headers);
    }
}

/// A work-session list reads the whole bucket, so how many are read at once is capped per token
/// (429) and in all (503), each refusal naming its setting; a finished list frees its place. The
/// places are taken here the way a list in flight holds one, so the test does not depend on how
/// long a read takes.
#[tokio::test]
async fn work_session_lists_are_capped_per_token_and_in_total() {
    let (_nats, js, s) = provisioned_with_tokens(|s| {
        s.http.session_lists = 2;
        s.http.session_lists_per_token = 1;
    })
    .await;
    let state = ApiState::new(js.clone(), s.names(), &s.http);
    let slots = state.list_slots().clone();
    let app = api::router(state);
    let list = "/api/work-sessions";
    let (status, _, body) = get(&app, list, Some(ALL_TOKEN)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(slots.open(), 0, "a finished list frees its place");

    let held = slots
        .acquire(Some("all"))
        .unwrap_or_else(|e| panic!("a place for all: {e:?}"));
    let (status, _, body) = get(&app, list, Some(ALL_TOKEN)).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    assert_eq!(body["error"]["code"], "too_many_lists", "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("http.session_lists_per_token = 1"),
        "{body}"
    );
    let (status, _, body) = get(&app, list, Some(MAIN_TOKEN)).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "another token has its own place: {body}"
    );

    let _other = slots
        .acquire(Some("tasks"))
        .unwrap_or_else(|e| panic!("a place for tasks: {e:?}"));
    let (status, _, body) = get(&app, list, Some(MAIN_TOKEN)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["error"]["code"], "too_many_lists", "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("http.session_lists = 2"), "{body}");
    // One session, read on its own, is no list and is never refused.
    let (status, _, _) = get(&app, "/api/work-sessions/ws-none", Some(MAIN_TOKEN)).await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    drop(held);
    let (status, _, body) = get(&app, list, Some(ALL_TOKEN)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
}

/// The scanning routes (event pages, search, tree, waiting, threads) take a place among
/// `http.scans`, per token and in total, through the real router and access control; other
/// routes do not.
#[tokio::test]
async fn scans_are_capped_per_token_and_in_total() {
    let (_nats, js, s) = provisioned_with_tokens(|s| {
        s.http.scans = 2;
        s.http.scans_per_token = 1;
    })
    .await;
    let state = ApiState::new(js.clone(), s.names(), &s.http);
    let slots = state.scan_slots().clone();
    let app = api::router(state);
    let scans = [
        "/api/events?limit=1",
        "/api/search?q=x",
        "/api/tree/k1",
        "/api/waiting",
        "/api/threads/k1",
    ];
    for path in scans {
        let (status, _, body) = get(&app, path, Some(ALL_TOKEN)).await;
        assert!(
            status == StatusCode::OK || status == StatusCode::NOT_FOUND,
            "{path}: {status} {body}"
        );
        assert_eq!(slots.open(), 0, "{path}: a finished scan frees its place");
    }
    let held = slots
        .acquire(Some("all"))
        .unwrap_or_else(|e| panic!("a place for all: {e:?}"));
    for path in scans {
        let (status, _, body) = get(&app, path, Some(ALL_TOKEN)).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{path}: {body}");
        assert_eq!(body["error"]["code"], "too_many_scans", "{body}");
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("http.scans_per_token = 1"), "{body}");
    }
    // What is not a scan is not refused: the caller's grant, the session list (capped apart).
    for path in ["/api/me", "/api/work-sessions"] {
        let (status, _, body) = get(&app, path, Some(ALL_TOKEN)).await;
        assert_eq!(status, StatusCode::OK, "{path}: {body}");
    }
    let (status, _, body) = get(&app, "/api/waiting", Some(MAIN_TOKEN)).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "another token has its own place: {body}"
    );
    let _other = slots
        .acquire(Some("tasks"))
        .unwrap_or_else(|e| panic!("a place for tasks: {e:?}"));
    let (status, _, body) = get(&app, "/api/waiting", Some(MAIN_TOKEN)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["error"]["code"], "too_many_scans", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("http.scans = 2")),
        "{body}"
    );
    drop(held);
    let (status, _, body) = get(&app, "/api/waiting", Some(ALL_TOKEN)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
}

#[tokio::test]
async fn event_streams_are_capped_per_token_and_in_total_and_a_closed_one_frees_its_place() {
    let (_nats, js, s) = provisioned_with_tokens(|s| {
        s.http.sse_max_streams = 3;
        s.http.sse_max_streams_per_token = 2;
    })
    .await;
    let state = ApiState::new(js.clone(), s.names(), &s.http).with_sse_limits(SseLimits {
        // Frequent keep-alives: the server notices a client that went at its next write.
        keep_alive: Duration::from_millis(100),
        ..SseLimits::from_settings(&s.http)
    });
    let slots = state.stream_slots().clone();
    let (addr, _stop) = serve(state, None).await;
    let http = reqwest::Client::new();
    let open = |token: &'static str| {
        let http = http.clone();
        async move {
            http.get(format!("http://{addr}/api/events/stream"))
                .bearer_auth(token)
                .send()
                .await
                .unwrap_or_else(|e| panic!("the API answers: {e}"))
        }
    };
    let refused = |resp: reqwest::Response, want: StatusCode, setting: &'static str| async move {
        assert_eq!(resp.status().as_u16(), want.as_u16());
        assert_eq!(
            resp.headers()
                .get("x-content-type-options")
                .and_then(|v| v.to_str().ok()),
            Some("nosniff")
        );
        let body: Value = resp.json().await.unwrap_or_else(|e| panic!("JSON: {e}"));
        assert_eq!(body["error"]["code"], "too_many_streams", "{body}");
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(setting), "{body}");
    };

    let first = open(ALL_TOKEN).await;
    assert_eq!(first.status().as_u16(), 200);
    assert_eq!(
        first
            .headers()
            .get("cache-control")
            .and_then(|v| v.to_str().ok()),
        Some("no-store")
    );
    let second = open(ALL_TOKEN).await;
    assert_eq!(second.status().as_u16(), 200);
    refused(
        open(ALL_TOKEN).await,
        StatusCode::TOO_MANY_REQUESTS,
        "http.sse_max_streams_per_token = 2",
    )
    .await;
    let other = open(TASK_TOKEN).await;
    assert_eq!(other.status().as_u16(), 200);
    assert_eq!(slots.open(), 3);
    refused(
        open(MAIN_TOKEN).await,
        StatusCode::SERVICE_UNAVAILABLE,
        "http.sse_max_streams = 3",
    )
    .await;

    // A client that goes frees its place.
    drop(first);
    wait_until(GUARD, "the closed stream frees its place", || {
        let n = slots.open();
        async move { n == 2 }
    })
    .await;
    let again = open(ALL_TOKEN).await;
    assert_eq!(again.status().as_u16(), 200);
    drop((second, other, again));
    wait_until(GUARD, "every stream's place is free", || {
        let n = slots.open();
        async move { n == 0 }
    })
    .await;
}

/// A client that opened a quiet event stream and never reads it holds its place no longer than
/// `http.sse_max_stream_lifetime`: the stream then ends with `lifetime_reached` and the cursor
/// to resume from, and a client that reconnects with it gets what came after, nothing twice.
#[tokio::test]
async fn a_quiet_event_stream_nobody_reads_frees_its_place_at_its_lifetime() {
    let (_nats, js, s) = provisioned_with_tokens(|s| {
        s.http.sse_max_streams_per_token = 1;
        s.http.sse_max_stream_lifetime = Duration::from_secs(2);
    })
    .await;
    let state = ApiState::new(js.clone(), s.names(), &s.http);
    let slots = state.stream_slots().clone();
    let (addr, _stop) = serve(state, None).await;
    let http = reqwest::Client::new();
    let open = |last_event_id: Option<String>| {
        let http = http.clone();
        async move {
            let mut req = http
                .get(format!("http://{addr}/api/events/stream"))
                .bearer_auth(ALL_TOKEN);
            if let Some(id) = last_event_id {
                req = req.header("Last-Event-ID", id);
            }
            req.send()
                .await
                .unwrap_or_else(|e| panic!("the API answers: {e}"))
        }
    };
    let ping = |n: u64| {
        let js = js.clone();
        async move {
            let body = json!({"type": "health.ping", "eventRole": "system.observability", "payload": {"n": n}});
            publish(
                &js,
                &format!("collab.proj.system.observability.w{n}.health.ping"),
                Bytes::from(body.to_string()),
            )
            .await
        }
    };
    let quiet = open(None).await;
    assert_eq!(quiet.status().as_u16(), 200);
    let first = ping(1).await;
    assert_eq!(
        open(None).await.status().as_u16(),
        429,
        "the token's one place is held"
    );
    // Nobody reads `quiet`; its place comes free once its lifetime is over.
    wait_until(GUARD, "the unread stream frees its place", || {
        let n = slots.open();
        async move { n == 0 }
    })
    .await;
    let text = quiet
        .text()
        .await
        .unwrap_or_else(|e| panic!("its body: {e}"));
    let end = text
        .split("\n\n")
        .find(|frame| frame.contains("event: error"))
        .and_then(|frame| frame.lines().find_map(|l| l.strip_prefix("data: ")))
        .map(|data| serde_json::from_str::<Value>(data).unwrap_or_else(|e| panic!("{e}: {data}")))
        .unwrap_or_else(|| panic!("a final error event: {text}"));
    assert_eq!(end["error"]["code"], "lifetime_reached", "{end}");
    let resume = end["error"]["resumeFrom"].as_str().map(str::to_string);
    assert_eq!(
        resume,
        Some(api::query::encode_cursor(0, first)),
        "resume after the one event sent: {text}"
    );
    // Reconnecting with it: the events after it, and not the one already sent.
    let second = ping(2).await;
    let again = open(resume).await;
    assert_eq!(again.status().as_u16(), 200, "the place is free again");
    let text = again
        .text()
        .await
        .unwrap_or_else(|e| panic!("its body: {e}"));
    let ids: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("id: "))
        .collect();
    assert_eq!(ids, [api::query::encode_cursor(0, second)], "{text}");

    // A stream whose filter matches nothing stored meanwhile resumes past what it skipped, so
    // its next stream does not read the same quiet stretch again.
    let main_only = http
        .get(format!(
            "http://{addr}/api/events/stream?role=conversation.main"
        ))
        .bearer_auth(ALL_TOKEN)
        .send()
        .await
        .unwrap_or_else(|e| panic!("the API answers: {e}"));
    assert_eq!(main_only.status().as_u16(), 200);
    let other_role = ping(3).await;
    let text = main_only
        .text()
        .await
        .unwrap_or_else(|e| panic!("its body: {e}"));
    assert!(!text.contains("\nid: "), "nothing of its role: {text}");
    assert!(text.contains("lifetime_reached"), "{text}");
    assert!(
        text.contains(&api::query::encode_cursor(0, other_role)),
        "resumes past the event of another role: {text}"
    );
}

/// Settings whose raw stream holds `raw_max_bytes` at most (below the configurable minimum, which
/// provisioning does not check).
fn tiny_raw(url: &str, raw_max_bytes: i64) -> Settings {
    let mut s = settings(url);
    s.storage.raw_max_bytes = raw_max_bytes;
    s
}

#[tokio::test]
async fn a_full_raw_stream_refuses_publishes_and_loses_no_accepted_input() {
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let s = tiny_raw(&nats.url(), 64 * 1024);
    let (_running, _cancel) = start_worker(&s).await;
    let filler = "x".repeat(2000);
    let mut accepted = Vec::new();
    let mut refusal = None;
    for n in 0..1000u32 {
        let (subject, body) = crate::api::collab_event(
            i64::from(n % 50),
            "a2a.send",
            "ruda",
            "eden",
            &format!("conv-{}", n % 7),
            json!({"turn": n, "message": filler}),
        );
        let ack = js
            .publish(subject, body)
            .await
            .unwrap_or_else(|e| panic!("the publish is sent: {e}"))
            .await;
        match ack {
            Ok(a) => accepted.push(a.sequence),
            Err(e) => {
                refusal = Some(e.to_string());
                break;
            }
        }
    }
    let refusal = refusal.unwrap_or_else(|| panic!("1000 publishes of 2 KB fit in 64 KiB"));
    eprintln!("a publish to a full raw stream fails with: {refusal}");
    assert!(
        refusal.to_lowercase().contains("maximum bytes exceeded"),
        "the producer is told why: {refusal}"
    );
    assert!(!accepted.is_empty());
    let mut raw = js
        .get_stream("COLLAB_RAW")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let info = raw.info().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(info.config.discard, stream::DiscardPolicy::New);
    assert_eq!(info.state.messages, accepted.len() as u64);
    assert_eq!(info.state.first_sequence, accepted[0]);
    // Every accepted input is still in the raw stream and was processed exactly once.
    drained(&js).await;
    let audit = collab_projector::ops::audit(&js, &s.names(), 1, 0)
        .await
        .unwrap_or_else(|e| panic!("audit: {e}"));
    assert_eq!(audit.raw, accepted.len(), "{audit:?}");
    assert!(audit.holds(), "{audit:?}");
    // `status` names the full stream and what a full raw stream does, from the worker's sample
    // (every 15 s).
    let client = nats.client().await;
    let warned = |workers: &[collab_projector::telemetry::WorkerStatus]| {
        collab_projector::status::warnings(workers, &Default::default())
            .into_iter()
            .find(|w| w.starts_with("stream COLLAB_RAW holds"))
    };
    wait_until(GUARD, "status warns that the raw stream is full", || {
        let client = client.clone();
        async move {
            let workers = collab_projector::status::collect(&client, Duration::from_millis(500))
                .await
                .unwrap_or_default();
            warned(&workers).is_some()
        }
    })
    .await;
    let workers = collab_projector::status::collect(&client, Duration::from_millis(500))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let warning = warned(&workers).unwrap_or_default();
    assert!(
        warning.contains("of 64 KiB): when full, producers' publishes are refused"),
        "{warning}"
    );
}

#[tokio::test]
async fn provision_bounds_existing_streams_and_buckets_and_stays_idempotent() {
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let s = settings(&nats.url());
    // A deployment provisioned before streams had size limits.
    for (mut c, _) in provision::stream_configs(&s) {
        c.max_bytes = -1;
        c.discard = stream::DiscardPolicy::Old;
        js.create_stream(c).await.unwrap_or_else(|e| panic!("{e}"));
    }
    for mut c in provision::kv_configs(&s) {
        c.max_bytes = -1;
        js.create_key_value(c)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    publish(&js, "collab.raw.k1.a2a.send", Bytes::from(vec![b'x'; 4096])).await;

    // A limit below what the raw stream holds is refused, naming the setting.
    let err = provision::provision(&js, &tiny_raw(&nats.url(), 1024))
        .await
        .err()
        .unwrap_or_else(|| panic!("a limit below the stream's bytes must be refused"));
    assert!(err.to_string().contains("storage.raw_max_bytes"), "{err}");

    // A limit the server cannot reserve is refused with the server's reason and the fix.
    let err = provision::provision(&js, &tiny_raw(&nats.url(), 1 << 50))
        .await
        .err()
        .unwrap_or_else(|| panic!("a petabyte cannot be reserved"));
    let text = err.to_string();
    assert!(text.to_lowercase().contains("insufficient"), "{text}");
    assert!(
        text.contains("storage.raw_max_bytes (1048576 GiB)"),
        "{text}"
    );
    assert!(text.contains("max_file_store"), "{text}");

    let report = provision::provision(&js, &s)
        .await
        .unwrap_or_else(|e| panic!("provision: {e}"));
    assert_eq!(report.updated.len(), 6, "{:?}", report.updated);
    for (name, max_bytes, discard) in [
        (
            "COLLAB_RAW",
            s.storage.raw_max_bytes,
            stream::DiscardPolicy::New,
        ),
        (
            "COLLAB_PROJ",
            s.storage.proj_max_bytes,
            stream::DiscardPolicy::New,
        ),
        (
            "COLLAB_DLQ",
            s.storage.dlq_max_bytes,
            stream::DiscardPolicy::New,
        ),
        (
            "KV_collab_turns",
            s.storage.turns_max_bytes,
            stream::DiscardPolicy::New,
        ),
        (
            "KV_collab_work_sessions",
            s.storage.sessions_max_bytes,
            stream::DiscardPolicy::New,
        ),
        (
            "KV_collab_leases",
            s.storage.leases_max_bytes,
            stream::DiscardPolicy::New,
        ),
        (
            "OBJ_collab_blobs",
            s.storage.blobs_max_bytes,
            stream::DiscardPolicy::New,
        ),
    ] {
        let mut st = js.get_stream(name).await.unwrap_or_else(|e| panic!("{e}"));
        let info = st.info().await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (info.config.max_bytes, info.config.discard),
            (max_bytes, discard),
            "{name}"
        );
    }
    assert_eq!(
        crate::pipeline::count(&js, "COLLAB_RAW").await,
        1,
        "nothing was dropped"
    );
    let again = provision::provision(&js, &s)
        .await
        .unwrap_or_else(|e| panic!("provision again: {e}"));
    assert!(again.updated.is_empty(), "{:?}", again.updated);
    assert!(again.created.is_empty(), "{:?}", again.created);
}

#[tokio::test]
async fn agents_publish_only_as_themselves_and_read_only_their_own_inbox() {
    let sample = roles_sample().await;
    let url = sample.url();
    let mut worker = Settings::default();
    worker.nats.url = url.clone();
    worker.nats.user = Some(WORKERS.into());
    worker.nats.password = Some(Secret::new(sample.password(WORKERS)));
    let (_client, worker_js) = bus::connect_as(&worker, "trust-test worker")
        .await
        .unwrap_or_else(|e| panic!("the workers' user connects: {e}"));
    provision::provision(&worker_js, &worker)
        .await
        .unwrap_or_else(|e| panic!("provision as the workers' user: {e}"));

    let [ruda_user, eden_user] = AGENT_USERS;
    let ruda = Login::new(
        &url,
        ruda_user,
        &sample.password(ruda_user),
        Some("_INBOX_ruda"),
    )
    .await;
    let eden = Login::new(
        &url,
        eden_user,
        &sample.password(eden_user),
        Some("_INBOX_eden"),
    )
    .await;

    // Each agent publishes as itself, and gets its acknowledgement on its own inbox.
    let own = identity::subject("collab", "conv-1", "eden", "a2a.response")
        .unwrap_or_else(|| panic!("eden is a valid agent token"));
    let forged_body = json!({"type": "a2a.response", "agentId": "eden", "ts": 1_771_329_600_000_i64,
        "data": {"fromAgent": "ruda", "toAgent": "eden", "conversationId": "conv-1", "message": "done"}});
    let eden_js = jetstream::new(eden.client.clone());
    let seq = publish(&eden_js, &own, Bytes::from(forged_body.to_string())).await;
    let ruda_js = jetstream::new(ruda.client.clone());
    let ruda_subject = identity::subject("collab", "conv-1", "ruda", "a2a.send")
        .unwrap_or_else(|| panic!("ruda is a valid agent token"));
    publish(&ruda_js, &ruda_subject, Bytes::from_static(b"{}")).await;

    // eden cannot publish as ruda, nor unidentified, nor read ruda's (or anyone's) inbox.
    eden.assert_cannot_publish("collab.raw.conv-1._as.ruda.a2a.response")
        .await;
    eden.assert_cannot_publish("collab.raw.conv-1.a2a.response")
        .await;
    eden.assert_cannot_subscribe("_INBOX_ruda.>").await;
    eden.assert_cannot_subscribe("_INBOX_relay_eden.>").await;
    eden.assert_cannot_subscribe("_INBOX.>").await;
    eden.assert_cannot_subscribe("collab.raw.>").await;
    ruda.assert_cannot_subscribe("_INBOX_eden.>").await;

    // What eden published carries its identity, which the worker's check holds the event to:
    // claiming to speak as ruda from eden's subject is a mismatch.
    let stored = worker_js
        .get_stream("COLLAB_RAW")
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .get_raw_message(seq)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let producer = collab_projector::pipeline::producer_subject(
        &collab_projector::config::Names::new("collab"),
        stored.subject.as_str(),
    );
    let parsed =
        identity::parse("collab", &producer).unwrap_or_else(|| panic!("a raw subject: {producer}"));
    assert_eq!(parsed.agent.as_deref(), Some("eden"));
    let normalized = ingest::normalize(
        &RawInput {
            bytes: &stored.payload,
            subject: None,
            raw_ref: None,
            relay: Default::default(),
        },
        &worker
            .ingest()
            .unwrap_or_else(|e| panic!("ingest settings: {e}")),
    )
    .unwrap_or_else(|e| panic!("normalises: {e:?}"));
    let verdict = identity::check(
        &parsed,
        &normalized[0].envelope,
        normalized[0].source.as_deref(),
        true,
    );
    assert_eq!(verdict.err().map(|e| e.reason()), Some("identity_mismatch"));

    // And a running worker (as the workers' user) dead-letters it so, naming its sequence.
    let (_running, cancel) = start_worker(&worker).await;
    let dlq = worker_js
        .get_stream("COLLAB_DLQ")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    wait_until(GUARD, "eden's forged reply is dead-lettered", || {
        let dlq = dlq.clone();
        async move {
            dlq.get_last_raw_message_by_subject("collab.dlq.identity_mismatch")
                .await
                .is_ok_and(|m| {
                    m.headers
                        .get("Collab-Source-Seq")
                        .is_some_and(|v| v.as_str() == seq.to_string())
                })
        }
    })
    .await;
    cancel.cancel();
}

/// Resident memory of process `pid`, in MiB (VmRSS of /proc/<pid>/status).
fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// Sample RSS every half second until it moved less than 1 MiB over three samples.
async fn settled_rss(pid: u32) -> f64 {
    let mut last = rss_mib(pid);
    let mut still = 0;
    for _ in 0..120 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = rss_mib(pid);
        if (now - last).abs() < 1.0 {
            still += 1;
            if still >= 3 {
                return now;
            }
        } else {
            still = 0;
        }
        last = now;
    }
    last
}

/// Memory of a `run` process under event-stream clients that never read, and after they close.
/// A measurement, not a check: run it on purpose and read its output
/// (`cargo test --test it trust::sse_memory -- --ignored --nocapture`; COLLAB_MEASURE_STREAMS and
/// COLLAB_HTTP__SSE_BUFFER_BYTES change the client count and the per-stream buffer; the process
/// inherits the environment, so `_RJEM_MALLOC_CONF` sets the allocator's options).
#[tokio::test]
#[ignore = "a measurement; prints figures"]
async fn sse_memory_under_slow_readers() {
    let streams: usize = std::env::var("COLLAB_MEASURE_STREAMS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40);
    let buffer =
        std::env::var("COLLAB_HTTP__SSE_BUFFER_BYTES").unwrap_or_else(|_| "1048576".into());
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let projector = crate::pipeline::start_projector(
        &nats.url(),
        &crate::pipeline::MAIN_AGENTS,
        &[
            ("COLLAB_HTTP__SSE_MAX_STREAMS", "1000"),
            ("COLLAB_HTTP__SSE_MAX_STREAMS_PER_TOKEN", "1000"),
            ("COLLAB_HTTP__SSE_BUFFER_BYTES", buffer.as_str()),
            ("RUST_LOG", "info,collab_projector::api=debug"),
        ],
    )
    .await;
    let log = projector.log_text();
    let addr = log
        .lines()
        .find_map(|l| l.split("http listening on ").nth(1))
        .map(|a| a.trim().to_string())
        .unwrap_or_else(|| panic!("no address in {log}"));
    let pid = projector.pid();
    let idle = settled_rss(pid).await;
    let clients = slow_readers(&addr, streams).await;
    let opened = settled_rss(pid).await;
    // Projections of 16 KiB (1,500 by default: 24 MiB), which every stream would have to hold.
    let events: u32 = std::env::var("COLLAB_MEASURE_EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1500);
    publish_pings(&js, events).await;
    let loaded = settled_rss(pid).await;
    println!("sse memory: closing the clients at {}", chrono::Utc::now());
    drop(clients);
    if std::env::var("COLLAB_MEASURE_POKE").is_ok() {
        // Activity on every thread, before a keep-alive is due: requests and events.
        let http = reqwest::Client::new();
        for n in 0..300u32 {
            let _ = http.get(format!("http://{addr}/api/me")).send().await;
            if n % 10 == 0 {
                publish(
                    &js,
                    "collab.proj.system.observability.k.health.ping",
                    Bytes::from(json!({"type": "health.ping", "payload": {}}).to_string()),
                )
                .await;
            }
        }
    }
    let closed = settled_rss(pid).await;
    // Past a keep-alive interval (15 s), so every server-side stream has written since its
    // client went.
    tokio::time::sleep(Duration::from_secs(20)).await;
    let later = settled_rss(pid).await;
    println!("sse memory: after a keep-alive interval {later:.0} MiB");
    let closes: Vec<String> = projector
        .log_text()
        .lines()
        .filter(|l| l.contains("event stream closed"))
        .map(str::to_string)
        .collect();
    for line in projector
        .log_text()
        .lines()
        .filter(|l| l.contains("reader stopped"))
        .take(3)
    {
        println!("sse memory: {line}");
    }
    if let (Some(first), Some(last)) = (closes.first(), closes.last()) {
        println!(
            "sse memory: {} streams closed, first: {first}\nlast: {last}",
            closes.len()
        );
    }
    println!(
        "sse memory: {streams} streams, buffer {buffer} B: idle {idle:.0} MiB, streams open {opened:.0} MiB, loaded {loaded:.0} MiB ({:.1} MiB per stream), closed {closed:.0} MiB",
        (loaded - opened) / streams as f64
    );
}

#[tokio::test]
async fn a_full_dead_letter_stream_loses_no_dead_letter() {
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let mut s = settings(&nats.url());
    s.storage.dlq_max_bytes = 16 * 1024;
    let (_running, _cancel) = start_worker(&s).await;
    // Malformed inputs of about 1 KB each: more dead letters than the stream can hold.
    let bad = format!("not json {}", "x".repeat(1000));
    let inputs = 40u64;
    for n in 0..inputs {
        publish(&js, &format!("collab.raw.bad-{n}.a2a.send"), bad.clone()).await;
    }
    wait_until(GUARD, "the dead-letter stream is full", || {
        let js = js.clone();
        async move {
            let mut st = js
                .get_stream("COLLAB_DLQ")
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let info = st.info().await.unwrap_or_else(|e| panic!("{e}"));
            info.state.bytes + 2048 > 16 * 1024
        }
    })
    .await;
    let held = crate::pipeline::count(&js, "COLLAB_DLQ").await;
    assert!(held < inputs, "{held} dead letters fit in 16 KiB");
    // Room is made (the operator raises the limit): every dead letter arrives, none was lost.
    let mut roomier = s.clone();
    roomier.storage.dlq_max_bytes = 1024 * 1024;
    provision::provision(&js, &roomier)
        .await
        .unwrap_or_else(|e| panic!("provision: {e}"));
    wait_until(GUARD, "every bad input is dead-lettered", || {
        let js = js.clone();
        async move { crate::pipeline::count(&js, "COLLAB_DLQ").await == inputs }
    })
    .await;
    drained(&js).await;
    let audit = collab_projector::ops::audit(&js, &s.names(), 1, 0)
        .await
        .unwrap_or_else(|e| panic!("audit: {e}"));
    assert!(audit.holds(), "{audit:?}");
    assert_eq!(audit.dead_lettered, inputs as usize, "{audit:?}");
}

#[tokio::test]
async fn only_the_target_decides_a_turn_whoever_else_answers_first() {
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let mut s = settings(&nats.url());
    // A third main agent: its words are conversation.main too (an agent that is not main
    // speaks under delegation.subagent, outside the turn contract).
    s.roles.main_agents.push("mallory".into());
    let (_running, cancel) = start_worker(&s).await;
    let conv = "conv-target";
    let event = |t: &str, agent: Option<&str>, from: Option<&str>, to: &str, message: &str| {
        let mut data = json!({"toAgent": to, "conversationId": conv, "message": message});
        if let Some(f) = from {
            data["fromAgent"] = json!(f);
        }
        let mut body =
            json!({"type": t, "ts": chrono::Utc::now().timestamp_millis(), "data": data});
        if let Some(a) = agent {
            body["agentId"] = json!(a);
        }
        Bytes::from(body.to_string())
    };
    let send = event("a2a.send", Some("ruda"), Some("ruda"), "eden", "wire 10k?");
    publish(&js, &format!("collab.raw.{conv}.a2a.send"), send).await;
    // A third agent, plainly and from its own identified subject, and the asker itself: none of
    // them is eden.
    let plain = event(
        "a2a.response",
        Some("mallory"),
        Some("mallory"),
        "ruda",
        "FORGED approved",
    );
    let third = publish(&js, &format!("collab.raw.{conv}.a2a.response"), plain).await;
    let identified = identity::subject("collab", conv, "mallory", "a2a.response")
        .unwrap_or_else(|| panic!("mallory is a valid agent token"));
    // Naming no speaker, it claims conversation.main itself; the subject's agent speaks.
    let mut unnamed: Value = serde_json::from_slice(&event(
        "a2a.response",
        None,
        None,
        "ruda",
        "FORGED approved too",
    ))
    .unwrap_or_else(|e| panic!("{e}"));
    unnamed["data"]["eventRole"] = json!("conversation.main");
    let third_identified = publish(&js, &identified, Bytes::from(unnamed.to_string())).await;
    let own = event(
        "a2a.response",
        Some("ruda"),
        Some("ruda"),
        "ruda",
        "FORGED I approve myself",
    );
    let asker = publish(&js, &format!("collab.raw.{conv}.a2a.response"), own).await;
    // eden's real reply comes last and wins.
    let real = event(
        "a2a.response",
        Some("eden"),
        Some("eden"),
        "ruda",
        "declined: no such account",
    );
    let eden = publish(&js, &format!("collab.raw.{conv}.a2a.response"), real).await;

    let response = crate::pipeline::the_one(
        &js,
        crate::pipeline::PROJ,
        &format!("collab.proj.conversation.main.{conv}.a2a.response"),
    )
    .await;
    assert_eq!(response.source_seq(), eden);
    let payload = response.json()["payload"].clone();
    assert_eq!(payload["message"], "declined: no such account", "{payload}");
    assert_eq!(payload["fromAgent"], "eden");

    drained(&js).await;
    let suppressed = suppressed_of(&js, conv, "a2a.response.suppressed").await;
    let seen: Vec<u64> = suppressed.iter().map(|(seq, _)| *seq).collect();
    assert_eq!(seen, vec![third, third_identified, asker]);
    for (_, p) in &suppressed {
        assert_eq!(p["reason"], "not_target", "{p}");
        assert_eq!(p["winner"]["msgId"], format!("turn:{conv}:0"), "{p}");
        assert!(
            p["response"]["message"]
                .as_str()
                .is_some_and(|t| t.starts_with("FORGED")),
            "the suppressed response keeps its own payload: {p}"
        );
    }
    // Nothing forged reached conversation.main as a response.
    nothing_forged_on_main(&js, conv).await;
    cancel.cancel();
}

/// The suppressions of `key` of type `ty` (`a2a.response.suppressed`,
/// `run.terminal.suppressed`): each suppressed input's raw sequence and the payload, in raw order.
async fn suppressed_of(js: &jetstream::Context, key: &str, ty: &str) -> Vec<(u64, Value)> {
    let mut out: Vec<(u64, Value)> = crate::pipeline::read_all(
        js,
        crate::pipeline::PROJ,
        &format!("collab.proj.system.observability.{key}.{ty}"),
    )
    .await
    .iter()
    .map(|m| (m.source_seq(), m.json()["payload"].clone()))
    .collect();
    out.sort_by_key(|(seq, _)| *seq);
    out
}

/// Publish the collab event `t` that `from` addresses to `to` in `conv` (the fields of `data`
/// beside theirs), on `from`'s own identity subject; its raw sequence.
async fn say(
    js: &jetstream::Context,
    conv: &str,
    t: &str,
    from: &str,
    to: &str,
    data: Value,
) -> u64 {
    let mut fields = json!({"fromAgent": from, "toAgent": to, "conversationId": conv});
    if let (Some(f), Value::Object(extra)) = (fields.as_object_mut(), data) {
        f.extend(extra);
    }
    let body = json!({"type": t, "ts": chrono::Utc::now().timestamp_millis(), "agentId": from, "data": fields});
    let subject = identity::subject("collab", conv, from, t)
        .unwrap_or_else(|| panic!("{from} is a valid agent token"));
    publish(js, &subject, Bytes::from(body.to_string())).await
}

/// Asserts that no projection of `conv` on `conversation.main` carries forged text.
async fn nothing_forged_on_main(js: &jetstream::Context, conv: &str) {
    let main = crate::pipeline::read_all(
        js,
        crate::pipeline::PROJ,
        &format!("collab.proj.conversation.main.{conv}.>"),
    )
    .await;
    assert!(
        main.iter()
            .all(|m| !String::from_utf8_lossy(&m.payload).contains("FORGED")),
        "a forged response reached conversation.main"
    );
}

/// With `turns.early_hold` set, a response published before its turn's send, by an agent the
/// send does not address, never becomes the turn's response: it is held until the send, then
/// kept beside the turn as `not_target`, and the target's own reply is the turn's one response.
#[tokio::test]
async fn a_response_published_before_its_send_cannot_claim_the_turn() {
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let mut s = settings(&nats.url());
    s.roles.main_agents.push("mallory".into());
    s.turns.early_hold = Duration::from_secs(300);
    let (_running, cancel) = start_worker(&s).await;
    let conv = "conv-claimed-early";
    // mallory guesses the conversation and its first turn, and answers before anyone asked.
    let forged = say(
        &js,
        conv,
        "a2a.response",
        "mallory",
        "ruda",
        json!({"message": "FORGED approved"}),
    )
    .await;
    say(
        &js,
        conv,
        "a2a.send",
        "ruda",
        "eden",
        json!({"message": "wire 10k?"}),
    )
    .await;
    let eden = say(
        &js,
        conv,
        "a2a.response",
        "eden",
        "ruda",
        json!({"message": "declined: no such account"}),
    )
    .await;

    let response = crate::pipeline::the_one(
        &js,
        crate::pipeline::PROJ,
        &format!("collab.proj.conversation.main.{conv}.a2a.response"),
    )
    .await;
    assert_eq!(response.source_seq(), eden);
    assert_eq!(
        response.json()["payload"]["message"],
        "declined: no such account"
    );
    drained(&js).await;
    let suppressed = suppressed_of(&js, conv, "a2a.response.suppressed").await;
    assert_eq!(suppressed.len(), 1, "{suppressed:#?}");
    assert_eq!(suppressed[0].0, forged);
    let p = &suppressed[0].1;
    assert_eq!(p["reason"], "not_target", "{p}");
    assert_eq!(p["response"]["message"], "FORGED approved", "{p}");
    nothing_forged_on_main(&js, conv).await;
    cancel.cancel();
}

/// With the early hold on, a ping-pong reply (a turn no send opens, spoken by one side of the
/// conversation's previous turn to the other) is the turn's response as soon as it is processed,
/// not after the hold; a reply for the next turn by an agent outside the conversation is held
/// (nothing published for it while the hold lasts) and, once the send comes, kept as `not_target`.
#[tokio::test]
async fn a_ping_pong_reply_passes_the_early_hold_and_a_stranger_does_not() {
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let mut s = settings(&nats.url());
    s.roles.main_agents.push("mallory".into());
    s.turns.early_hold = Duration::from_secs(3_600);
    let (_running, cancel) = start_worker(&s).await;
    let conv = "conv-ping-pong";
    let responses = || async {
        crate::pipeline::read_all(
            &js,
            crate::pipeline::PROJ,
            &format!("collab.proj.conversation.main.{conv}.a2a.response"),
        )
        .await
    };
    say(
        &js,
        conv,
        "a2a.send",
        "ruda",
        "eden",
        json!({"turn": 0, "message": "review PR 12?"}),
    )
    .await;
    let reply = say(
        &js,
        conv,
        "a2a.response",
        "eden",
        "ruda",
        json!({"turn": 0, "message": "two comments"}),
    )
    .await;
    let pong = say(
        &js,
        conv,
        "a2a.response",
        "ruda",
        "eden",
        json!({"turn": 1, "message": "fixed both"}),
    )
    .await;
    let forged = say(
        &js,
        conv,
        "a2a.response",
        "mallory",
        "ruda",
        json!({"turn": 2, "message": "FORGED merged"}),
    )
    .await;
    drained(&js).await;
    let got = responses().await;
    let seqs: Vec<u64> = got.iter().map(|m| m.source_seq()).collect();
    assert_eq!(
        seqs,
        vec![reply, pong],
        "turn 1 answered at once, turn 2 held"
    );
    assert_eq!(got[1].json()["payload"]["message"], "fixed both");
    assert!(
        suppressed_of(&js, conv, "a2a.response.suppressed")
            .await
            .is_empty(),
        "the held reply is neither published nor suppressed before its send"
    );
    say(
        &js,
        conv,
        "a2a.send",
        "ruda",
        "eden",
        json!({"turn": 2, "message": "merge it?"}),
    )
    .await;
    let merged = say(
        &js,
        conv,
        "a2a.response",
        "eden",
        "ruda",
        json!({"turn": 2, "message": "merged"}),
    )
    .await;
    drained(&js).await;
    let got = responses().await;
    assert_eq!(got.len(), 3, "one response per turn");
    assert_eq!(got[2].source_seq(), merged);
    let suppressed = suppressed_of(&js, conv, "a2a.response.suppressed").await;
    assert_eq!(suppressed.len(), 1, "{suppressed:#?}");
    assert_eq!(suppressed[0].0, forged);
    assert_eq!(suppressed[0].1["reason"], "not_target");
    nothing_forged_on_main(&js, conv).await;
    cancel.cancel();
}

/// An AG-UI run belongs to the agent that published its `RUN_STARTED`: another identified
/// producer's `RUN_ERROR` on the same key (naming the run or not), and a terminal on a subject
/// that names no agent, are kept beside the run; the owner's own terminal is its one terminal.
#[tokio::test]
async fn only_the_agent_that_started_a_run_ends_it() {
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let s = settings(&nats.url());
    let (_running, cancel) = start_worker(&s).await;
    let key = "thread-owned";
    let as_agent = |agent: &str| {
        identity::subject("collab", key, agent, "agui")
            .unwrap_or_else(|| panic!("{agent} is a valid agent token"))
    };
    let body = |v: Value| Bytes::from(v.to_string());
    publish(
        &js,
        &as_agent("eden"),
        body(json!({"type": "RUN_STARTED", "threadId": key, "runId": "r1"})),
    )
    .await;
    let named = publish(
        &js,
        &as_agent("mallory"),
        body(json!({"type": "RUN_ERROR", "runId": "r1", "message": "FORGED abort"})),
    )
    .await;
    let unnamed = publish(
        &js,
        &as_agent("mallory"),
        body(json!({"type": "RUN_ERROR", "message": "FORGED abort, no run named"})),
    )
    .await;
    let anonymous = publish(
        &js,
        &format!("collab.raw.{key}.agui"),
        body(json!({"type": "RUN_FINISHED", "threadId": key, "runId": "r1"})),
    )
    .await;
    let own = publish(
        &js,
        &as_agent("eden"),
        body(json!({"type": "RUN_FINISHED", "threadId": key, "runId": "r1", "result": "done"})),
    )
    .await;

    drained(&js).await;
    let terminals: Vec<_> = crate::pipeline::read_all(
        &js,
        crate::pipeline::PROJ,
        &format!("collab.proj.*.*.{key}.>"),
    )
    .await
    .into_iter()
    .filter(|m| m.header("Nats-Msg-Id").as_deref() == Some(&format!("run:{key}:r1")))
    .collect();
    assert_eq!(terminals.len(), 1, "{terminals:#?}");
    assert_eq!(terminals[0].source_seq(), own);
    assert_eq!(terminals[0].json()["type"], "run.finished");
    let suppressed = suppressed_of(&js, key, "run.terminal.suppressed").await;
    let seen: Vec<u64> = suppressed.iter().map(|(seq, _)| *seq).collect();
    assert_eq!(seen, vec![named, unnamed, anonymous]);
    for (_, p) in &suppressed {
        assert_eq!(p["reason"], "not_target", "{p}");
        assert_eq!(p["winner"]["outcome"], "pending", "{p}");
    }
    cancel.cancel();
}

/// `streams` event-stream clients of the API at `addr` that never read (a 4 KiB receive buffer),
/// each past its `200`.
/// Publish `n` health pings of 16 KiB each straight onto the projection stream.
async fn publish_pings(js: &jetstream::Context, n: u32) {
    let filler = "x".repeat(16 * 1024);
    for i in 0..n {
        let body = json!({"type": "health.ping", "eventRole": "system.observability", "payload": {"n": i, "filler": filler}});
        publish(
            js,
            "collab.proj.system.observability.k.health.ping",
            Bytes::from(body.to_string()),
        )
        .await;
    }
}

async fn slow_readers(
    addr: &str,
    streams: usize,
) -> Vec<tokio::io::BufReader<tokio::net::TcpStream>> {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let mut clients = Vec::new();
    for _ in 0..streams {
        let socket = tokio::net::TcpSocket::new_v4().unwrap_or_else(|e| panic!("{e}"));
        socket
            .set_recv_buffer_size(4096)
            .unwrap_or_else(|e| panic!("{e}"));
        let mut conn = socket
            .connect(addr.parse().unwrap_or_else(|e| panic!("{e}")))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        conn.write_all(
            format!("GET /api/events/stream HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        let mut reader = tokio::io::BufReader::new(conn);
        let mut status = String::new();
        reader
            .read_line(&mut status)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(status.contains(" 200 "), "{status}");
        clients.push(reader);
    }
    clients
}

/// An event stream whose client stopped reading (its receive window at zero, the socket left
/// open) is closed once `http.client_stall_timeout` passes, which frees its place: with room
/// for one stream, a second client is served while the first still holds its socket. Without
/// the timeout the place stays taken for as long as the stalled client keeps the socket.
#[tokio::test]
async fn a_stream_whose_client_stopped_reading_frees_its_place_after_the_stall_timeout() {
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let projector = crate::pipeline::start_projector(
        &nats.url(),
        &crate::pipeline::MAIN_AGENTS,
        &[
            ("COLLAB_HTTP__SSE_MAX_STREAMS", "1"),
            ("COLLAB_HTTP__SSE_MAX_STREAMS_PER_TOKEN", "1"),
            ("COLLAB_HTTP__CLIENT_STALL_TIMEOUT", "2s"),
            ("RUST_LOG", "info,collab_projector::api=debug"),
        ],
    )
    .await;
    let addr = projector.http_addr();
    let stalled = slow_readers(&addr, 1).await;
    let http = reqwest::Client::new();
    let second = || {
        let (http, addr) = (http.clone(), addr.clone());
        async move {
            http.get(format!("http://{addr}/api/events/stream"))
                .send()
                .await
                .map(|r| r.status().as_u16())
                .unwrap_or_default()
        }
    };
    assert_eq!(second().await, 503, "the one place is taken");
    // More than the stalled client's receive window takes: the rest waits in the server's
    // socket behind a window at zero.
    publish_pings(&js, 64).await;
    wait_until(
        GUARD,
        "a second stream is served while the stalled client keeps its socket",
        || async { second().await == 200 },
    )
    .await;
    drop(stalled);
}

/// Event streams whose clients never read cost the process at most their buffer each (plus
/// slack), and give their places and their memory back once they end. 20 streams with an 8 MiB
/// buffer (more than a socket's kernel buffer takes, so the process holds it) are sent 24 MiB of
/// projections each; resident memory is sampled throughout.
#[tokio::test]
async fn event_streams_of_slow_readers_stay_within_their_buffers_and_give_memory_back() {
    if std::fs::read_to_string("/proc/self/status").is_err() {
        eprintln!("skipped: no /proc/self/status to read resident memory from on this system");
        return;
    }
    const STREAMS: usize = 20;
    const BUFFER_MIB: f64 = 8.0;
    // Allocator pages, the stream's own state, the HTTP connection, a consumer's pulled batch.
    const SLACK_MIB: f64 = 8.0;
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let buffer = format!("{}", (BUFFER_MIB as usize) * 1024 * 1024);
    let cap = STREAMS.to_string();
    let projector = crate::pipeline::start_projector(
        &nats.url(),
        &crate::pipeline::MAIN_AGENTS,
        &[
            ("COLLAB_HTTP__SSE_MAX_STREAMS", cap.as_str()),
            ("COLLAB_HTTP__SSE_MAX_STREAMS_PER_TOKEN", cap.as_str()),
            ("COLLAB_HTTP__SSE_BUFFER_BYTES", buffer.as_str()),
            ("COLLAB_HTTP__SSE_BUFFER_EVENTS", "100000"),
            ("RUST_LOG", "info,collab_projector::api=debug"),
            // Freed pages go back to the system at once rather than after the allocator's decay
            // time (docs/operations.md, "Event streams and memory").
            ("_RJEM_MALLOC_CONF", "dirty_decay_ms:0,muzzy_decay_ms:0"),
        ],
    )
    .await;
    let log = projector.log_text();
    let addr = log
        .lines()
        .find_map(|l| l.split("http listening on ").nth(1))
        .map(|a| a.trim().to_string())
        .unwrap_or_else(|| panic!("no address in {log}"));
    let pid = projector.pid();
    let clients = slow_readers(&addr, STREAMS).await;
    let opened = settled_rss(pid).await;

    // Sample resident memory while the projections arrive and the streams fill.
    let sampling = tokio_util::sync::CancellationToken::new();
    let sampler = {
        let stop = sampling.clone();
        tokio::spawn(async move {
            let mut peak = 0.0f64;
            while !stop.is_cancelled() {
                peak = peak.max(rss_mib(pid));
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            peak.max(rss_mib(pid))
        })
    };
    publish_pings(&js, 1536).await;
    // Every stream overflows its buffer: its reader stops (slow_consumer), holding the buffer
    // until the client takes it or goes.
    let count_lines = |needle: &str| {
        projector
            .log_text()
            .lines()
            .filter(|l| l.contains(needle))
            .count()
    };
    wait_until(GUARD, "every slow stream overflows its buffer", || {
        let n = count_lines("reason=\"slow_consumer\"");
        async move { n >= STREAMS }
    })
    .await;
    sampling.cancel();
    let peak = sampler.await.unwrap_or_else(|e| panic!("{e}"));
    let bound = STREAMS as f64 * (BUFFER_MIB + SLACK_MIB);
    println!(
        "sse memory: {STREAMS} streams, buffer {BUFFER_MIB} MiB: open {opened:.0} MiB, peak {peak:.0} MiB (+{:.0} MiB, bound +{bound:.0} MiB)",
        peak - opened
    );
    assert!(
        peak - opened < bound,
        "{STREAMS} slow streams grew the process by {:.0} MiB, more than {STREAMS} x ({BUFFER_MIB} + {SLACK_MIB}) MiB",
        peak - opened
    );

    // The clients go: every place is freed, memory is given back and never grows past the peak
    // again.
    drop(clients);
    wait_until(GUARD, "every stream's place is freed", || {
        let n = count_lines("event stream closed");
        async move { n >= STREAMS }
    })
    .await;
    let closed = settled_rss(pid).await;
    println!("sse memory: after the clients closed {closed:.0} MiB");
    assert!(
        closed <= peak + 2.0,
        "{closed:.0} MiB after close, peak {peak:.0} MiB"
    );
    assert!(
        closed - opened < (peak - opened) / 2.0 + SLACK_MIB,
        "the streams' memory is not given back: open {opened:.0}, peak {peak:.0}, closed {closed:.0} MiB"
    );
    // Every place is free again: as many new streams as the cap allows are served.
    let again = slow_readers(&addr, STREAMS).await;
    assert_eq!(again.len(), STREAMS);
}
