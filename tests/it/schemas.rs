//! The checked-in JSON Schemas (`schemas/*.schema.json`) against what a real projector produces:
//! every projected envelope and the payloads the turn and run contracts write, every API body
//! (pages, sessions, `/api/me`, errors, the schema index) and an event-stream item (the stream's
//! final error is checked where it is produced, in `api.rs`). Then the TypeScript types:
//! regenerated from the schemas and diffed with `schemas/collab-projector.d.ts`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use async_nats::jetstream::Context;
use axum::http::StatusCode;
use axum::Router;
use bytes::Bytes;
use collab_projector::api::{self, ApiState};
use collab_projector::config::{Settings, TokenGrant};
use collab_projector::model::Role;
use futures::StreamExt;
use serde_json::{json, Value};

use crate::api::start_worker;
use crate::pipeline::{publish, raw_drained, GUARD};
use crate::support::{wait_until, TestNats};

const PARTITIONS: u16 = 2;
const UI_TOKEN: &str = "schema-ui-token";

fn schemas_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("schemas")
}

/// A checked-in schema, compiled (formats checked too).
fn validator(file: &str) -> jsonschema::Validator {
    let path = schemas_dir().join(file);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let schema: Value = serde_json::from_str(&text).expect("a schema is JSON");
    jsonschema::options()
        .should_validate_formats(true)
        .build(&schema)
        .unwrap_or_else(|e| panic!("{file} does not compile: {e}"))
}

fn assert_valid(v: &jsonschema::Validator, file: &str, doc: &Value) {
    let errors: Vec<String> = v
        .iter_errors(doc)
        .map(|e| format!("{e} at {}", e.instance_path))
        .collect();
    assert!(
        errors.is_empty(),
        "not valid against {file}:\n{doc:#}\n{errors:#?}"
    );
}

/// `doc` is valid against the checked-in schema `file`.
pub(crate) fn assert_matches(file: &str, doc: &Value) {
    assert_valid(&validator(file), file, doc);
}

fn assert_invalid(v: &jsonschema::Validator, file: &str, doc: &Value, what: &str) {
    assert!(
        !v.is_valid(doc),
        "{what}: a broken sample passes {file}:\n{doc:#}"
    );
}

fn settings(url: &str) -> Settings {
    let mut s = Settings::default();
    s.nats.url = url.to_string();
    s.nats.partitions = PARTITIONS;
    s.roles.main_agents = vec!["ruda".into(), "eden".into()];
    s.turns.default_timeout = Duration::from_secs(1);
    s.runs.timeout = Duration::from_secs(1);
    s.http.enabled = false;
    s
}

fn raw(t: &str, from: &str, to: &str, conv: &str, extra: Value) -> (String, Bytes) {
    let mut data = json!({"fromAgent": from, "toAgent": to, "conversationId": conv, "workSessionId": "ws_schema"});
    if let (Some(d), Value::Object(e)) = (data.as_object_mut(), extra) {
        d.extend(e);
    }
    let body = json!({"type": t, "agentId": from, "ts": chrono::Utc::now().timestamp_millis(), "data": data});
    (
        format!("collab.raw.{conv}.{t}"),
        Bytes::from(body.to_string()),
    )
}

async fn publish_raw(js: &Context, (subject, body): (String, Bytes)) {
    publish(js, &subject, body).await;
}

/// Every message of the projection stream, as JSON.
async fn projections(js: &Context) -> Vec<(String, Value)> {
    let mut stream = js.get_stream("COLLAB_PROJ").await.expect("COLLAB_PROJ");
    let last = stream
        .info()
        .await
        .expect("stream info")
        .state
        .last_sequence;
    let mut out = Vec::new();
    for seq in 1..=last {
        if let Ok(m) = stream.get_raw_message(seq).await {
            if collab_projector::bus::publish::is_fence_subject(m.subject.as_str()) {
                continue;
            }
            let body: Value = serde_json::from_slice(&m.payload).expect("a projection is JSON");
            out.push((m.subject.to_string(), body));
        }
    }
    out
}

async fn wait_for_projection(js: &Context, what: &str, pred: impl Fn(&str, &Value) -> bool) {
    let pred = &pred;
    wait_until(GUARD, what, || {
        let js = js.clone();
        async move {
            projections(&js)
                .await
                .iter()
                .any(|(subject, body)| pred(subject, body))
        }
    })
    .await;
}

/// A request through the router: status, content type and JSON body (every API body is a JSON
/// object).
async fn call(app: &Router, uri: &str, token: Option<&str>) -> (StatusCode, String, Value) {
    let (status, content_type, body) = crate::api::request(app, uri, token).await;
    assert!(!body.is_string(), "{uri}: not JSON: {body}");
    (status, content_type, body)
}

/// A body with the expected status, valid against `file`.
async fn checked(
    app: &Router,
    uri: &str,
    token: Option<&str>,
    want: StatusCode,
    file: &str,
) -> Value {
    let (status, _, body) = call(app, uri, token).await;
    assert_eq!(status, want, "{uri}: {body}");
    assert_valid(&validator(file), file, &body);
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_projector_produces_matches_the_checked_in_schemas() {
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let s = settings(&nats.url());
    let (_running, cancel) = start_worker(&s).await;

    // A real reply, then a duplicate of it.
    publish_raw(
        &js,
        raw(
            "a2a.send",
            "ruda",
            "eden",
            "c-ok",
            json!({"message": "Review the plan", "timeoutMs": 60000}),
        ),
    )
    .await;
    let answer =
        json!({"message": "goal: review\noutcome: success\nevidence: plan.md\nnext_action: ship"});
    publish_raw(
        &js,
        raw("a2a.response", "eden", "ruda", "c-ok", answer.clone()),
    )
    .await;
    publish_raw(&js, raw("a2a.response", "eden", "ruda", "c-ok", answer)).await;
    // An upstream failure: blocked, with the upstream payload kept.
    publish_raw(
        &js,
        raw(
            "a2a.send",
            "ruda",
            "eden",
            "c-err",
            json!({"goal": "Roll back", "timeoutMs": 60000}),
        ),
    )
    .await;
    publish_raw(
        &js,
        raw(
            "a2a.response",
            "eden",
            "ruda",
            "c-err",
            json!({"waitStatus": "error", "waitError": "tool crashed", "message": "[outcome] no_reply"}),
        ),
    )
    .await;
    // No reply by the deadline: a synthesised blocked response; the reply after it is late.
    publish_raw(
        &js,
        raw(
            "a2a.send",
            "ruda",
            "eden",
            "c-slow",
            json!({"message": "Are you there?", "timeoutMs": 1000}),
        ),
    )
    .await;
    // An AG-UI run with no terminal: a synthesised run.failed; its late terminal is suppressed.
    let agui = |body: Value| {
        (
            "collab.raw.th-schema.agui".to_string(),
            Bytes::from(body.to_string()),
        )
    };
    publish_raw(
        &js,
        agui(
            json!({"type": "RUN_STARTED", "threadId": "th-schema", "runId": "r1", "timestamp": 1}),
        ),
    )
    .await;

    let blocked_timeout = |subject: &str, body: &Value| {
        subject.ends_with(".c-slow.a2a.response") && body["payload"]["reason"] == "timeout"
    };
    wait_for_projection(&js, "the blocked timeout of c-slow", blocked_timeout).await;
    wait_for_projection(&js, "the run.failed of r1", |subject, _| {
        subject.ends_with(".run.failed")
    })
    .await;
    publish_raw(
        &js,
        raw(
            "a2a.response",
            "eden",
            "ruda",
            "c-slow",
            json!({"message": "sorry, here now"}),
        ),
    )
    .await;
    publish_raw(
        &js,
        agui(json!({"type": "RUN_FINISHED", "threadId": "th-schema", "runId": "r1"})),
    )
    .await;
    wait_for_projection(
        &js,
        "the late reply of c-slow is suppressed",
        |subject, body| {
            subject.ends_with(".a2a.response.suppressed") && body["payload"]["reason"] == "late"
        },
    )
    .await;
    wait_for_projection(
        &js,
        "the late terminal of r1 is suppressed",
        |subject, _| subject.ends_with(".run.terminal.suppressed"),
    )
    .await;
    wait_until(GUARD, "every raw partition consumer is drained", || {
        let js = js.clone();
        async move { raw_drained(&js, usize::from(PARTITIONS)).await }
    })
    .await;

    // Every projection is an envelope; the payloads the contracts write match theirs.
    let envelope = validator("envelope.schema.json");
    let blocked = validator("blocked-payload.schema.json");
    let suppressed = validator("suppressed-payload.schema.json");
    let run_failed = validator("run-failed-payload.schema.json");
    let mut seen = (0, 0, 0, 0, 0);
    let all = projections(&js).await;
    for (subject, body) in &all {
        assert_valid(&envelope, "envelope.schema.json", body);
        let payload = &body["payload"];
        match body["type"].as_str() {
            Some("a2a.response") if payload["outcome"] == "blocked" => {
                assert_valid(&blocked, "blocked-payload.schema.json", payload);
                if payload["synthesized"] == true {
                    seen.0 += 1;
                } else {
                    seen.1 += 1;
                }
            }
            Some("a2a.response") => seen.2 += 1,
            Some("a2a.response.suppressed" | "run.terminal.suppressed") => {
                assert_valid(&suppressed, "suppressed-payload.schema.json", payload);
                seen.3 += 1;
            }
            Some("run.failed") => {
                assert_valid(&run_failed, "run-failed-payload.schema.json", payload);
                seen.4 += 1;
            }
            _ => {}
        }
        assert!(!subject.is_empty());
    }
    assert_eq!(
        seen,
        (1, 1, 1, 3, 1),
        "(synthesised blocked, upstream blocked, real replies, suppressed, run.failed)"
    );

    // Drift is caught: broken copies of what was produced fail.
    let (_, reply) = all
        .iter()
        .find(|(s, b)| s.ends_with(".c-ok.a2a.response") && b["payload"]["outcome"] != "blocked")
        .expect("the real reply");
    let mut extra = reply.clone();
    extra["surprise"] = json!(true);
    assert_invalid(&envelope, "envelope", &extra, "an unknown envelope field");
    let mut role = reply.clone();
    role["eventRole"] = json!("conversation");
    assert_invalid(&envelope, "envelope", &role, "an unknown role");
    let mut raw_ref = reply.clone();
    raw_ref["rawEventRef"]["seq"] = json!("12");
    assert_invalid(&envelope, "envelope", &raw_ref, "a sequence as text");
    let (_, timeout) = all
        .iter()
        .find(|(s, b)| blocked_timeout(s, b))
        .expect("the blocked timeout");
    let mut no_next = timeout["payload"].clone();
    if let Some(m) = no_next.as_object_mut() {
        m.remove("next_action");
    }
    assert_invalid(&blocked, "blocked", &no_next, "no next_action");
    let mut reason = timeout["payload"].clone();
    reason["reason"] = json!("slow");
    assert_invalid(&blocked, "blocked", &reason, "an unknown reason");
    let mut evidence = timeout["payload"].clone();
    evidence["evidence"][0]["rawSeq"] = json!(-1);
    assert_invalid(&blocked, "blocked", &evidence, "a negative sequence");
    let (_, dup) = all
        .iter()
        .find(|(s, _)| s.ends_with(".a2a.response.suppressed"))
        .expect("a suppressed response");
    let mut winner = dup["payload"].clone();
    winner["winner"]["outcome"] = json!("won");
    assert_invalid(&suppressed, "suppressed", &winner, "an unknown outcome");
    let mut nulled = dup["payload"].clone();
    nulled["response"] = Value::Null;
    nulled["terminal"] = json!({});
    assert!(
        suppressed.is_valid(&nulled),
        "the kept payload is the producer's own"
    );
    nulled["extra"] = json!(1);
    assert_invalid(&suppressed, "suppressed", &nulled, "an unknown field");

    // The API, access control off.
    let open = api::router(ApiState::new(js.clone(), s.names(), &s.http));
    let page = checked(
        &open,
        "/api/events?limit=1000",
        None,
        StatusCode::OK,
        "event-page.schema.json",
    )
    .await;
    assert_eq!(page["count"], json!(all.len()));
    let item = validator("event-item.schema.json");
    let mut broken = page["events"][0].clone();
    broken["role"] = json!("nobody");
    assert_invalid(&item, "event-item", &broken, "an unknown role");
    let mut broken_page = page.clone();
    broken_page["prev"] = json!(7);
    assert_invalid(
        &validator("event-page.schema.json"),
        "event-page",
        &broken_page,
        "a numeric cursor",
    );
    let list = checked(
        &open,
        "/api/work-sessions",
        None,
        StatusCode::OK,
        "work-session-list.schema.json",
    )
    .await;
    assert!(list["count"].as_u64().is_some_and(|n| n >= 1), "{list}");
    let mut broken_list = list.clone();
    broken_list["sessions"][0]["status"] = json!("SLEEPING");
    assert_invalid(
        &validator("work-session-list.schema.json"),
        "work-session-list",
        &broken_list,
        "an unknown status",
    );
    let one = checked(
        &open,
        "/api/work-sessions/ws_schema",
        None,
        StatusCode::OK,
        "work-session.schema.json",
    )
    .await;
    assert_eq!(one["session"]["workSessionId"], "ws_schema", "{one}");
    let me = checked(&open, "/api/me", None, StatusCode::OK, "me.schema.json").await;
    assert_eq!(
        me,
        json!({"accessControl": false, "grant": null, "roles": Role::ALL})
    );
    let index = checked(
        &open,
        "/api/schemas",
        None,
        StatusCode::OK,
        "schema-index.schema.json",
    )
    .await;
    for link in index["schemas"].as_array().expect("a list") {
        let name = link["name"].as_str().expect("a name");
        let url = link["url"].as_str().expect("a URL");
        assert_eq!(url, format!("/api/schemas/{name}"));
        let (status, content_type, served) = call(&open, url, None).await;
        assert_eq!(status, StatusCode::OK, "{url}");
        assert_eq!(content_type, "application/schema+json", "{url}");
        let file = std::fs::read_to_string(schemas_dir().join(name)).expect("the file");
        assert_eq!(
            served,
            serde_json::from_str::<Value>(&file).expect("JSON"),
            "{url}"
        );
        assert_eq!(served["$id"], json!(url));
    }
    let error = "error.schema.json";
    checked(
        &open,
        "/api/schemas/nope.json",
        None,
        StatusCode::NOT_FOUND,
        error,
    )
    .await;
    checked(
        &open,
        "/api/work-sessions/nope",
        None,
        StatusCode::NOT_FOUND,
        error,
    )
    .await;
    checked(&open, "/api/nope", None, StatusCode::NOT_FOUND, error).await;
    checked(
        &open,
        "/api/events?role=bogus",
        None,
        StatusCode::BAD_REQUEST,
        error,
    )
    .await;
    checked(
        &open,
        "/api/events?type=a%20b",
        None,
        StatusCode::BAD_REQUEST,
        error,
    )
    .await;
    checked(
        &open,
        "/api/events?colour=red",
        None,
        StatusCode::BAD_REQUEST,
        error,
    )
    .await;
    checked(
        &open,
        "/api/work-sessions?status=x",
        None,
        StatusCode::BAD_REQUEST,
        error,
    )
    .await;

    // One item of the event stream, from the start.
    let (addr, stop) = serve(ApiState::new(js.clone(), s.names(), &s.http)).await;
    let oldest = page["oldest"].as_str().expect("the oldest cursor");
    let resp = reqwest::Client::new()
        .get(format!("http://{addr}/api/events/stream?after={oldest}"))
        .send()
        .await
        .expect("the event stream answers");
    assert_eq!(resp.status(), StatusCode::OK.as_u16());
    let mut body = resp.bytes_stream();
    let mut text = String::new();
    let data = tokio::time::timeout(GUARD, async {
        loop {
            while let Some(end) = text.find("\n\n") {
                let block: String = text.drain(..end + 2).collect();
                if let Some(data) = block.lines().find_map(|l| l.strip_prefix("data:")) {
                    return data.trim().to_string();
                }
            }
            match body.next().await {
                Some(Ok(chunk)) => text.push_str(&String::from_utf8_lossy(&chunk)),
                other => panic!("the stream ended before an event: {other:?}"),
            }
        }
    })
    .await
    .expect("an event within the guard");
    let streamed: Value = serde_json::from_str(&data).expect("SSE data is JSON");
    assert_valid(&item, "event-item.schema.json", &streamed);
    assert_eq!(streamed, page["events"][0]);
    stop.cancel();

    // Access control on: 401 and 403 bodies, and /api/me naming the grant.
    let mut guarded = s.clone();
    guarded.http.tokens = vec![TokenGrant {
        name: "ui".into(),
        token: UI_TOKEN.into(),
        token_env: None,
        roles: vec![Role::ConversationMain],
    }];
    let app = api::router(ApiState::new(js.clone(), s.names(), &guarded.http));
    checked(&app, "/api/me", None, StatusCode::UNAUTHORIZED, error).await;
    checked(
        &app,
        "/api/events",
        Some("wrong"),
        StatusCode::UNAUTHORIZED,
        error,
    )
    .await;
    let forbidden = checked(
        &app,
        "/api/events?role=system.observability",
        Some(UI_TOKEN),
        StatusCode::FORBIDDEN,
        error,
    )
    .await;
    assert_eq!(forbidden["error"]["granted"], json!(["conversation.main"]));
    let me = checked(
        &app,
        "/api/me",
        Some(UI_TOKEN),
        StatusCode::OK,
        "me.schema.json",
    )
    .await;
    assert_eq!(
        me,
        json!({"accessControl": true, "grant": "ui", "roles": ["conversation.main"]})
    );
    // The schemas need no token.
    checked(
        &app,
        "/api/schemas",
        None,
        StatusCode::OK,
        "schema-index.schema.json",
    )
    .await;

    // 410: a cursor older than what the stream retains.
    let mut proj = js.get_stream("COLLAB_PROJ").await.expect("COLLAB_PROJ");
    let last = proj.info().await.expect("info").state.last_sequence;
    proj.purge().sequence(last).await.expect("purge");
    let stale = api::query::encode_cursor(0, 1);
    let gone = checked(
        &open,
        &format!("/api/events?after={stale}"),
        None,
        StatusCode::GONE,
        error,
    )
    .await;
    assert!(gone["error"]["oldestCursor"].is_string(), "{gone}");
    let mut broken_error = gone.clone();
    broken_error["error"]["oldestCursor"] = Value::Null;
    assert_invalid(&validator(error), "error", &broken_error, "a null cursor");

    cancel.cancel();
}

/// Serve the API router on a loopback socket.
async fn serve(state: ApiState) -> (std::net::SocketAddr, tokio_util::sync::CancellationToken) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind 127.0.0.1:0");
    let addr = listener.local_addr().expect("local address");
    let cancel = tokio_util::sync::CancellationToken::new();
    let app = api::router(state.with_shutdown(cancel.clone()));
    let stop = cancel.clone();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async move { stop.cancelled().await })
            .await;
    });
    (addr, cancel)
}

/// Why the TypeScript types cannot be checked here, if they cannot.
fn generator_missing(ts_dir: &Path) -> Option<String> {
    match Command::new("node").arg("--version").output() {
        Ok(out) if out.status.success() => {}
        _ => return Some("node is not installed".into()),
    }
    let installed = ts_dir.join("node_modules/json-schema-to-typescript/package.json");
    (!installed.exists()).then(|| {
        format!(
            "the generator is not installed ({} is missing; run `npm ci --prefix schemas/ts`)",
            installed.display()
        )
    })
}

#[test]
fn typescript_types_are_generated_from_the_schemas() {
    let ts_dir = schemas_dir().join("ts");
    if let Some(reason) = generator_missing(&ts_dir) {
        let ci = std::env::var("CI").unwrap_or_default();
        assert!(
            ci.is_empty(),
            "schemas/collab-projector.d.ts cannot be checked: {reason}"
        );
        eprintln!("skipped: schemas/collab-projector.d.ts not checked: {reason}");
        return;
    }
    let out = tempfile::tempdir().expect("a temporary directory");
    let generated = out.path().join("collab-projector.d.ts");
    let run = Command::new("node")
        .arg(ts_dir.join("generate.mjs"))
        .arg("--out")
        .arg(&generated)
        .output()
        .expect("node runs");
    assert!(
        run.status.success(),
        "generate.mjs failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    let fresh = std::fs::read_to_string(&generated).expect("the generated types");
    let checked_in = std::fs::read_to_string(schemas_dir().join("collab-projector.d.ts"))
        .expect("schemas/collab-projector.d.ts");
    if fresh != checked_in {
        let line = fresh
            .lines()
            .zip(checked_in.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| fresh.lines().count().min(checked_in.lines().count()));
        panic!(
            "schemas/collab-projector.d.ts is not what the schemas generate (first difference at line {}); regenerate with `node schemas/ts/generate.mjs`\n--- generated\n{fresh}",
            line + 1
        );
    }
}
