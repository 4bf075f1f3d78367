//! The projection HTTP API against a real nats-server: every parameter and error in process
//! (`tower::ServiceExt::oneshot`), the event stream and the worker over a socket.
//!
//! Projections are published straight onto `collab.proj.*` where a test is about reading them,
//! and raw events through the in-process worker (`app::start`) where it is about what the
//! worker writes. Tests assert behaviour; timeouts only guard against hangs.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_nats::jetstream::Context;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use bytes::Bytes;
use collab_projector::api::{self, ApiState, SseLimits};
use collab_projector::app::{self, RunOptions};
use collab_projector::bus::provision;
use collab_projector::bus::sessions::{Identity, Position, SessionWriter, FOLD_KEY};
use collab_projector::config::{Settings, TokenGrant};
use collab_projector::model::{Envelope, Role};
use collab_projector::pipeline::{OutKind, Outgoing};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpSocket, TcpStream};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use crate::pipeline::{publish, raw_drained, GUARD};
use crate::support::{wait_until, TestNats};

const PARTITIONS: u16 = 4;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

pub(crate) fn settings(url: &str) -> Settings {
    let mut s = Settings::default();
    s.nats.url = url.to_string();
    s.nats.partitions = PARTITIONS;
    s.roles.main_agents = vec!["ruda".into(), "eden".into()];
    s.http.enabled = false;
    s
}

/// A server with the streams and buckets provisioned, and the API over it.
async fn setup() -> (TestNats, Context, Settings) {
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let s = settings(&nats.url());
    provision::provision(&js, &s)
        .await
        .expect("provisioning a fresh server");
    (nats, js, s)
}

pub(crate) fn state(js: &Context, s: &Settings) -> ApiState {
    ApiState::new(js.clone(), s.names(), &s.http)
}

/// A request through the router: status, content type and body (JSON, else its text as a
/// string).
pub(crate) async fn request(
    app: &Router,
    uri: &str,
    token: Option<&str>,
) -> (StatusCode, String, Value) {
    let mut req = Request::builder().uri(uri);
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let resp = app
        .clone()
        .oneshot(req.body(Body::empty()).expect("a request"))
        .await
        .expect("the router answers");
    let status = resp.status();
    let content_type = resp
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .expect("a body");
    let body = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (status, content_type, body)
}

async fn call(app: &Router, uri: &str, token: Option<&str>) -> (StatusCode, Value) {
    let (status, _, body) = request(app, uri, token).await;
    (status, body)
}

async fn ok(app: &Router, uri: &str) -> Value {
    let (status, body) = call(app, uri, None).await;
    assert_eq!(status, StatusCode::OK, "{uri}: {body}");
    body
}

/// An error response: status and `error.code`, and the message for further checks.
async fn err(app: &Router, uri: &str, token: Option<&str>, want: StatusCode, code: &str) -> Value {
    let (status, body) = call(app, uri, token).await;
    assert_eq!(status, want, "{uri}: {body}");
    assert_eq!(body["error"]["code"], code, "{uri}: {body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{uri}: {body}"
    );
    body["error"].clone()
}

/// Publish a projection directly; returns its COLLAB_PROJ sequence.
async fn project(js: &Context, role: &str, key: &str, t: &str, n: u64) -> u64 {
    let body = json!({"type": t, "eventRole": role, "payload": {"n": n, "conversationId": key}});
    publish(
        js,
        &format!("collab.proj.{role}.{key}.{t}"),
        Bytes::from(body.to_string()),
    )
    .await
}

/// Every event of `filter` paged backward from the newest, `limit` a page: their sequences in
/// order, the newest page and the last (oldest) one.
async fn page_back(app: &Router, filter: &str, limit: usize) -> (Vec<u64>, Value, Value) {
    let mut back = Vec::new();
    let newest = ok(app, &format!("/api/events?{filter}&limit={limit}")).await;
    let mut page = newest.clone();
    loop {
        let mut s = seqs(&page);
        assert!(s.len() <= limit, "{page}");
        s.extend(back);
        back = s;
        match cursor(&page, "prev") {
            Some(prev) => {
                page = ok(
                    app,
                    &format!("/api/events?{filter}&limit={limit}&before={prev}"),
                )
                .await
            }
            None => return (back, newest, page),
        }
    }
}

/// Every event of `filter` paged forward after the cursor `after`, `limit` a page. An empty
/// page ends it, and moves the cursor to the end of what it scanned, never back.
async fn page_forward(app: &Router, filter: &str, limit: usize, mut after: String) -> Vec<u64> {
    let mut fwd = Vec::new();
    loop {
        let page = ok(
            app,
            &format!("/api/events?{filter}&limit={limit}&after={after}"),
        )
        .await;
        let s = seqs(&page);
        if s.is_empty() {
            let next = cursor(&page, "next").expect("a next cursor on an empty page");
            let (n, a) = (
                api::query::decode_cursor(0, &next).ok(),
                api::query::decode_cursor(0, &after).ok(),
            );
            assert!(n >= a, "{n:?} < {a:?}");
            return fwd;
        }
        fwd.extend(s);
        after = cursor(&page, "next").expect("a next cursor");
    }
}

fn seqs(page: &Value) -> Vec<u64> {
    page["events"]
        .as_array()
        .map(|a| a.iter().filter_map(|e| e["seq"].as_u64()).collect())
        .unwrap_or_default()
}

fn cursor(page: &Value, field: &str) -> Option<String> {
    page[field].as_str().map(str::to_string)
}

/// A projection as the worker hands it to the session writer.
fn out(role: Role, t: &str, msg_id: &str, env: Value) -> Outgoing {
    Outgoing {
        subject: format!("collab.proj.{}.k.{t}", role.as_str()),
        payload: Bytes::from(env.to_string()),
        msg_id: msg_id.to_string(),
        headers: Vec::new(),
        kind: OutKind::Projection(role),
    }
}

fn now_iso(offset_s: i64) -> String {
    (chrono::Utc::now() + chrono::Duration::seconds(offset_s))
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

fn a2a(role: Role, t: &str, ts: &str, data: Value) -> Value {
    let mut env = json!({"type": t, "eventRole": role.as_str(), "timestamp": ts, "payload": data});
    for k in ["conversationId", "workSessionId", "turnId"] {
        if let Some(v) = data.get(k) {
            env[k] = v.clone();
        }
    }
    if let Some(a) = data.get("fromAgent") {
        env["agentId"] = a.clone();
    }
    env
}

/// Serve the API router on a loopback socket (with a small kernel send buffer when asked).
pub(crate) async fn serve(
    state: ApiState,
    send_buffer: Option<u32>,
) -> (SocketAddr, CancellationToken) {
    let socket = TcpSocket::new_v4().expect("a socket");
    if let Some(size) = send_buffer {
        socket.set_send_buffer_size(size).expect("send buffer size");
    }
    socket
        .bind(([127, 0, 0, 1], 0).into())
        .expect("bind 127.0.0.1:0");
    let listener = socket.listen(64).expect("listen");
    let addr = listener.local_addr().expect("local address");
    let cancel = CancellationToken::new();
    let app = api::router(state.with_shutdown(cancel.clone()));
    let stop = cancel.clone();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async move { stop.cancelled().await })
            .await;
    });
    (addr, cancel)
}

/// One Server-Sent Event.
#[derive(Debug, Clone, Default, PartialEq)]
struct Sse {
    id: Option<String>,
    event: Option<String>,
    data: String,
}

/// A minimal HTTP/1.1 client for event streams: chunked decoding and SSE parsing, so a test
/// controls exactly how fast it reads.
struct SseClient {
    reader: BufReader<TcpStream>,
    text: String,
    ended: bool,
}

impl SseClient {
    async fn connect(
        addr: SocketAddr,
        path: &str,
        last_event_id: Option<&str>,
        recv_buffer: Option<u32>,
    ) -> SseClient {
        let socket = TcpSocket::new_v4().expect("a socket");
        if let Some(size) = recv_buffer {
            socket
                .set_recv_buffer_size(size)
                .expect("receive buffer size");
        }
        let mut stream = socket.connect(addr).await.expect("connect to the API");
        let mut req =
            format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: text/event-stream\r\n");
        if let Some(id) = last_event_id {
            req.push_str(&format!("Last-Event-ID: {id}\r\n"));
        }
        req.push_str("\r\n");
        stream
            .write_all(req.as_bytes())
            .await
            .expect("send the request");
        let mut reader = BufReader::new(stream);
        let mut status = String::new();
        reader.read_line(&mut status).await.expect("a status line");
        assert!(status.contains(" 200 "), "event stream answered {status:?}");
        let mut chunked = false;
        loop {
            let mut line = String::new();
            reader.read_line(&mut line).await.expect("a header line");
            if line.trim().is_empty() {
                break;
            }
            if line
                .to_ascii_lowercase()
                .starts_with("transfer-encoding: chunked")
            {
                chunked = true;
            }
        }
        assert!(chunked, "an event stream is sent chunked");
        SseClient {
            reader,
            text: String::new(),
            ended: false,
        }
    }

    /// Read one chunk into `text`; `false` at the end of the body.
    async fn fill(&mut self) -> bool {
        if self.ended {
            return false;
        }
        let mut size_line = String::new();
        match self.reader.read_line(&mut size_line).await {
            Ok(0) | Err(_) => {
                self.ended = true;
                return false;
            }
            Ok(_) => {}
        }
        let size = usize::from_str_radix(size_line.trim(), 16).unwrap_or(0);
        if size == 0 {
            self.ended = true;
            return false;
        }
        let mut buf = vec![0u8; size + 2];
        if self.reader.read_exact(&mut buf).await.is_err() {
            self.ended = true;
            return false;
        }
        self.text.push_str(&String::from_utf8_lossy(&buf[..size]));
        true
    }

    /// The next event (keep-alive comments skipped); `None` when the stream ended.
    async fn next(&mut self) -> Option<Sse> {
        loop {
            while let Some(end) = self.text.find("\n\n") {
                let block: String = self.text.drain(..end + 2).collect();
                let mut ev = Sse::default();
                let mut has_field = false;
                for line in block.lines() {
                    if let Some(v) = line.strip_prefix("id:") {
                        ev.id = Some(v.trim_start().to_string());
                        has_field = true;
                    } else if let Some(v) = line.strip_prefix("event:") {
                        ev.event = Some(v.trim_start().to_string());
                        has_field = true;
                    } else if let Some(v) = line.strip_prefix("data:") {
                        if !ev.data.is_empty() {
                            ev.data.push('\n');
                        }
                        ev.data.push_str(v.trim_start());
                        has_field = true;
                    }
                }
                if has_field {
                    return Some(ev);
                }
            }
            if !self.fill().await {
                return None;
            }
        }
    }

    async fn next_guarded(&mut self) -> Option<Sse> {
        tokio::time::timeout(GUARD, self.next())
            .await
            .expect("an event (or the end of the stream) within the guard")
    }
}

// ---------------------------------------------------------------------------------------------
// /api/events
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn events_filter_by_role_type_key_and_presets() {
    let (_nats, js, s) = setup().await;
    let app = api::router(state(&js, &s));
    let mut expect_conv = Vec::new();
    let mut expect_debug = Vec::new();
    for i in 0..5u64 {
        let key = if i % 2 == 0 { "c1" } else { "c2" };
        let send = project(&js, "conversation.main", key, "a2a.send", i).await;
        let resp = project(&js, "conversation.main", key, "a2a.response", i).await;
        let done = project(&js, "conversation.main", key, "a2a.complete", i).await;
        project(
            &js,
            "system.observability",
            key,
            "a2a.response.suppressed",
            i,
        )
        .await;
        project(&js, "orchestration.task", "t1", "task.updated", i).await;
        let sub = project(&js, "delegation.subagent", "d1", "a2a.send", i).await;
        expect_conv.push(resp);
        expect_debug.extend([send, resp, done, sub]);
    }
    let enc = collab_projector::model::encode_id("agent:eden:main");
    let agent = project(&js, "conversation.main", &enc, "a2a.response", 9).await;
    expect_conv.push(agent);
    expect_debug.push(agent);

    // Everything, newest first cut, oldest first order.
    let all = ok(&app, "/api/events").await;
    assert_eq!(all["count"], 31);
    let all_seqs = seqs(&all);
    assert!(all_seqs.windows(2).all(|w| w[0] < w[1]), "{all_seqs:?}");
    assert_eq!(all["prev"], Value::Null);
    let item = &all["events"][0];
    assert_eq!(item["role"], "conversation.main");
    assert_eq!(item["type"], "a2a.send");
    assert_eq!(item["key"], "c1");
    assert_eq!(item["event"]["payload"]["n"], 0);
    assert!(item["cursor"].is_string());

    // Presets equal their expansion; csv and repeated forms agree.
    let conv = seqs(&ok(&app, "/api/events?view=conversations").await);
    assert_eq!(conv, expect_conv);
    let expanded = seqs(&ok(&app, "/api/events?role=conversation.main&type=a2a.response").await);
    assert_eq!(conv, expanded);
    let debug = seqs(&ok(&app, "/api/events?view=debug").await);
    assert_eq!(debug, expect_debug);
    let csv = seqs(&ok(&app, "/api/events?type=a2a.send,a2a.response,a2a.complete").await);
    let repeated = seqs(
        &ok(
            &app,
            "/api/events?type=a2a.send&type=a2a.response&type=a2a.complete",
        )
        .await,
    );
    assert_eq!(debug, csv);
    assert_eq!(csv, repeated);
    let roles_csv = seqs(
        &ok(
            &app,
            "/api/events?role=orchestration.task,delegation.subagent",
        )
        .await,
    );
    let roles_rep = seqs(
        &ok(
            &app,
            "/api/events?role=orchestration.task&role=delegation.subagent",
        )
        .await,
    );
    assert_eq!(roles_csv.len(), 10);
    assert_eq!(roles_csv, roles_rep);

    // a2a.response does not match a2a.response.suppressed, and the other way round.
    let sup = ok(&app, "/api/events?type=a2a.response.suppressed").await;
    assert_eq!(sup["count"], 5);
    assert!(sup["events"]
        .as_array()
        .is_some_and(|a| a.iter().all(|e| e["role"] == "system.observability")));

    // Keys: plain tokens, and ids encoded by the id rule.
    let c2 = ok(&app, "/api/events?key=c2&view=conversations").await;
    assert_eq!(c2["count"], 2);
    let by_id = ok(&app, "/api/events?key=agent%3Aeden%3Amain").await;
    assert_eq!(seqs(&by_id), [agent]);
    assert_eq!(by_id["events"][0]["key"], enc);

    // Limit: the newest n.
    let two = ok(&app, "/api/events?view=conversations&limit=2").await;
    assert_eq!(seqs(&two), expect_conv[expect_conv.len() - 2..]);
    assert!(two["prev"].is_string());
}

#[tokio::test]
async fn events_page_forward_and_backward_covering_each_event_once() {
    let (_nats, js, s) = setup().await;
    let app = api::router(state(&js, &s));
    // Matching events dense at the start, sparse later, none at the end: the newest-N search
    // has to reach far back.
    let mut matching = Vec::new();
    for i in 0..420u64 {
        let hit = i < 40 || (i % 50 == 0 && i < 300);
        if hit {
            matching.push(project(&js, "conversation.main", "p1", "a2a.response", i).await);
        } else {
            project(&js, "system.observability", "noise", "health.ping", i).await;
        }
    }
    let filter = "role=conversation.main&type=a2a.response";

    // Backward from the newest page.
    let (back, newest, page) = page_back(&app, filter, 7).await;
    let newest_next = cursor(&newest, "next");
    assert_eq!(
        back, matching,
        "backward paging covers each event once, in order"
    );

    // Nothing lies before the oldest cursor of a stream retention never trimmed: an empty page.
    let oldest = cursor(&page, "oldest").expect("an oldest cursor");
    let before_oldest = ok(&app, &format!("/api/events?{filter}&before={oldest}")).await;
    assert!(seqs(&before_oldest).is_empty(), "{before_oldest}");
    assert_eq!(before_oldest["prev"], Value::Null);

    // Forward from the oldest retained.
    let fwd = page_forward(&app, filter, 9, oldest).await;
    assert_eq!(
        fwd, matching,
        "forward paging covers each event once, in order"
    );

    // Polling from the newest page's `next` returns only what came later.
    let newest_next = newest_next.expect("next");
    let later = project(&js, "conversation.main", "p1", "a2a.response", 999).await;
    project(&js, "system.observability", "noise", "health.ping", 1000).await;
    let polled = ok(&app, &format!("/api/events?{filter}&after={newest_next}")).await;
    assert_eq!(seqs(&polled), [later]);
    // A page in the middle: before a cursor, the newest ones below it.
    let mid = ok(
        &app,
        &format!(
            "/api/events?{filter}&limit=3&before={}",
            api::query::encode_cursor(0, matching[20])
        ),
    )
    .await;
    assert_eq!(seqs(&mid), matching[17..20]);
    // Between two cursors: the oldest `limit` strictly between them, `next` continuing inside.
    let between = |after: u64, before: u64, limit: usize| {
        format!(
            "/api/events?{filter}&limit={limit}&after={}&before={}",
            api::query::encode_cursor(0, after),
            api::query::encode_cursor(0, before)
        )
    };
    let range = ok(&app, &between(matching[10], matching[30], 100)).await;
    assert_eq!(seqs(&range), matching[11..30]);
    let first = ok(&app, &between(matching[10], matching[30], 4)).await;
    assert_eq!(seqs(&first), matching[11..15]);
    assert_eq!(
        cursor(&first, "next"),
        Some(api::query::encode_cursor(0, matching[14]))
    );
}

/// Filters over several roles and several types (read one consumer per type, counted one
/// consumer per filter): paging both ways returns exactly the events of the roles and types
/// asked for, each once, among same-role other-type and same-type other-role events.
#[tokio::test]
async fn events_over_several_roles_and_types_page_both_ways_exactly() {
    let (_nats, js, s) = setup().await;
    let app = api::router(state(&js, &s));
    let mut matching = Vec::new();
    for i in 0..360u64 {
        let (role, key, t, hit) = match i % 6 {
            0 => ("conversation.main", "m1", "a2a.response", true),
            1 => ("orchestration.task", "t1", "task.updated", i < 200),
            2 => ("conversation.main", "m1", "a2a.send", false),
            3 => ("system.observability", "m1", "a2a.response", false),
            4 => ("delegation.subagent", "d1", "task.updated", false),
            _ => ("orchestration.task", "t1", "task.created", false),
        };
        let (role, t) = if i % 6 == 1 && !hit {
            ("orchestration.task", "task.created")
        } else {
            (role, t)
        };
        let seq = project(&js, role, key, t, i).await;
        if hit {
            matching.push(seq);
        }
    }
    let filter = "role=conversation.main,orchestration.task&type=a2a.response,task.updated";
    let (back, _, oldest_page) = page_back(&app, filter, 11).await;
    assert_eq!(
        back, matching,
        "backward paging covers each event once, in order"
    );
    let oldest = cursor(&oldest_page, "oldest").expect("an oldest cursor");
    let fwd = page_forward(&app, filter, 13, oldest).await;
    assert_eq!(
        fwd, matching,
        "forward paging covers each event once, in order"
    );
}

#[tokio::test]
async fn events_reject_bad_parameters_with_json_errors() {
    let (_nats, js, s) = setup().await;
    let app = api::router(state(&js, &s));
    let e = err(
        &app,
        "/api/events?role=conversation.mian",
        None,
        StatusCode::BAD_REQUEST,
        "invalid_role",
    )
    .await;
    assert_eq!(e["valid"].as_array().map(Vec::len), Some(4));
    assert!(e["message"]
        .as_str()
        .is_some_and(|m| m.contains("conversation.main")));
    for t in ["a%20b", "a.*", "a.%3E", "a..b"] {
        let e = err(
            &app,
            &format!("/api/events?type={t}"),
            None,
            StatusCode::BAD_REQUEST,
            "invalid_type",
        )
        .await;
        assert!(e["valid"]["examples"].is_array());
    }
    // Any well-formed type is fine, known or not.
    ok(&app, "/api/events?type=custom.thing.v2").await;
    for l in ["0", "1001", "x", "-3", "%2B5", "%205"] {
        err(
            &app,
            &format!("/api/events?limit={l}"),
            None,
            StatusCode::BAD_REQUEST,
            "invalid_limit",
        )
        .await;
    }
    ok(&app, "/api/events?limit=1000").await;
    err(
        &app,
        "/api/events?after=nonsense",
        None,
        StatusCode::BAD_REQUEST,
        "bad_cursor",
    )
    .await;
    // `after` and `before` together: the events between them, none between a cursor and itself.
    let c = api::query::encode_cursor(0, 1);
    let page = ok(&app, &format!("/api/events?after={c}&before={c}")).await;
    assert_eq!(page["count"], 0, "{page}");
    for junk in [
        format!("%20{c}"),
        format!("{c}%20"),
        api::query::encode_cursor(0, 1) + "A",
    ] {
        err(
            &app,
            &format!("/api/events?after={junk}"),
            None,
            StatusCode::BAD_REQUEST,
            "bad_cursor",
        )
        .await;
    }
    err(
        &app,
        "/api/events?view=everything",
        None,
        StatusCode::BAD_REQUEST,
        "invalid_view",
    )
    .await;
    let e = err(
        &app,
        "/api/events?roles=conversation.main",
        None,
        StatusCode::BAD_REQUEST,
        "unknown_parameter",
    )
    .await;
    assert!(e["message"].as_str().is_some_and(|m| m.contains("role")));
    err(
        &app,
        "/api/events?view=a&view=b",
        None,
        StatusCode::BAD_REQUEST,
        "bad_parameter",
    )
    .await;
    err(
        &app,
        "/api/nothing-here",
        None,
        StatusCode::NOT_FOUND,
        "not_found",
    )
    .await;
    err(
        &app,
        "/api/events/stream?limit=5",
        None,
        StatusCode::BAD_REQUEST,
        "unknown_parameter",
    )
    .await;
    err(
        &app,
        "/api/work-sessions?status=IDLE",
        None,
        StatusCode::BAD_REQUEST,
        "invalid_status",
    )
    .await;
    err(
        &app,
        "/api/work-sessions/x?format=xml",
        None,
        StatusCode::BAD_REQUEST,
        "invalid_format",
    )
    .await;
    err(
        &app,
        "/api/work-sessions/nope",
        None,
        StatusCode::NOT_FOUND,
        "not_found",
    )
    .await;
    // A path segment that is no UTF-8: the same JSON error body as every other 400.
    for uri in [
        "/api/threads/%FF",
        "/api/tree/%C3",
        "/api/work-sessions/%FF",
        "/api/blobs/%FF",
        "/api/schemas/%FF",
    ] {
        let (status, content_type, body) = request(&app, uri, None).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{uri}: {body}");
        assert!(
            content_type.starts_with("application/json"),
            "{uri}: {content_type}"
        );
        assert_eq!(body["error"]["code"], "bad_path", "{uri}: {body}");
    }
    // Another method than GET: 405 with a JSON body and the methods served.
    for uri in ["/api/events", "/api/work-sessions/x", "/api/nothing-here"] {
        let resp = app
            .clone()
            .oneshot(
                Request::builder()
                    .method("POST")
                    .uri(uri)
                    .body(Body::empty())
                    .expect("a request"),
            )
            .await
            .expect("the router answers");
        assert_eq!(resp.status(), StatusCode::METHOD_NOT_ALLOWED, "{uri}");
        assert_eq!(
            resp.headers()
                .get(axum::http::header::ALLOW)
                .and_then(|v| v.to_str().ok()),
            Some("GET, HEAD"),
            "{uri}"
        );
        let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
            .await
            .expect("a body");
        let body: Value = serde_json::from_slice(&bytes).expect("a JSON error body");
        assert_eq!(body["error"]["code"], "method_not_allowed", "{uri}: {body}");
    }

    // A cursor older than retention: 410 with the oldest valid cursor, which works.
    for i in 0..10 {
        project(&js, "conversation.main", "r1", "a2a.send", i).await;
    }
    let stream = js
        .get_stream("COLLAB_PROJ")
        .await
        .expect("the projection stream");
    stream.purge().sequence(6).await.expect("purge below 6");
    let stale = api::query::encode_cursor(0, 2);
    let e = err(
        &app,
        &format!("/api/events?after={stale}"),
        None,
        StatusCode::GONE,
        "cursor_expired",
    )
    .await;
    let oldest = e["oldestCursor"]
        .as_str()
        .expect("oldestCursor")
        .to_string();
    assert_eq!(api::query::decode_cursor(0, &oldest).ok(), Some(5));
    let from_oldest = ok(&app, &format!("/api/events?after={oldest}")).await;
    assert_eq!(seqs(&from_oldest), [6, 7, 8, 9, 10]);
    err(
        &app,
        &format!("/api/events?before={stale}"),
        None,
        StatusCode::GONE,
        "cursor_expired",
    )
    .await;
    err(
        &app,
        &format!("/api/events/stream?after={stale}"),
        None,
        StatusCode::GONE,
        "cursor_expired",
    )
    .await;
    // A cursor past the newest event (10) was never issued for this stream (one made again
    // since, say): 410 with the oldest valid cursor, never a page or a stream that waits for
    // a sequence that may never come. One past the newest is a `prev` the API hands out.
    let ahead = api::query::encode_cursor(0, 1_000_000);
    for uri in [
        format!("/api/events?after={ahead}"),
        format!("/api/events?before={ahead}"),
        format!("/api/events?after={oldest}&before={ahead}"),
        format!("/api/events/stream?after={ahead}"),
    ] {
        let e = err(&app, &uri, None, StatusCode::GONE, "cursor_ahead").await;
        assert_eq!(e["oldestCursor"].as_str(), Some(oldest.as_str()), "{uri}");
    }
    let just_past = api::query::encode_cursor(0, 11);
    ok(&app, &format!("/api/events?before={just_past}")).await;
    let newest = ok(&app, "/api/events").await;
    let next = cursor(&newest, "next").expect("next");
    assert_eq!(
        seqs(&ok(&app, &format!("/api/events?after={next}")).await),
        Vec::<u64>::new()
    );
    // Endpoints without parameters refuse one rather than ignore it; `/api/` is no endpoint.
    for uri in [
        "/api/me?foo=1",
        "/api/schemas?foo=1",
        "/api/schemas/envelope.schema.json?x=1",
        "/api/openapi.json?foo=1",
    ] {
        let e = err(
            &app,
            uri,
            None,
            StatusCode::BAD_REQUEST,
            "unknown_parameter",
        )
        .await;
        assert!(
            e["message"]
                .as_str()
                .is_some_and(|m| m.contains("takes no query parameters")),
            "{uri}: {e}"
        );
    }
    err(&app, "/api/", None, StatusCode::NOT_FOUND, "not_found").await;

    // The OpenAPI document describes every route and parameter.
    let doc = ok(&app, "/api/openapi.json").await;
    assert_eq!(doc["openapi"], "3.1.0");
    assert!(doc["paths"]["/api/events/stream"]["get"].is_object());

    // The earliest time the relaxed date parser reads: refused, no overflow in the search.
    // (the stream holds events, so the search compares store times with its floor)
    err(
        &app,
        "/api/search?since=-262143-01-01T00:00:00Z",
        None,
        StatusCode::BAD_REQUEST,
        "invalid_time",
    )
    .await;
    let found = ok(&app, "/api/search?since=0000-01-01T00:00:00Z&limit=1").await;
    assert_eq!(found["count"], 1, "{found}");
}

#[tokio::test]
async fn tokens_confine_roles() {
    let (_nats, js, mut s) = setup().await;
    s.http.tokens = vec![
        TokenGrant {
            name: "ui".into(),
            token: "ui-token-1".into(),
            token_env: None,
            roles: vec![Role::ConversationMain],
        },
        TokenGrant {
            name: "ops".into(),
            token: "ops-token-2".into(),
            token_env: None,
            roles: vec![Role::SystemObservability, Role::OrchestrationTask],
        },
    ];
    let app = api::router(state(&js, &s));
    let conv = project(&js, "conversation.main", "c1", "a2a.response", 1).await;
    let obs = project(&js, "system.observability", "c1", "health.ping", 2).await;
    project(&js, "delegation.subagent", "d1", "a2a.send", 3).await;

    err(
        &app,
        "/api/events",
        None,
        StatusCode::UNAUTHORIZED,
        "unauthorized",
    )
    .await;
    err(
        &app,
        "/api/events",
        Some("wrong"),
        StatusCode::UNAUTHORIZED,
        "unauthorized",
    )
    .await;
    err(
        &app,
        "/api/work-sessions",
        None,
        StatusCode::UNAUTHORIZED,
        "unauthorized",
    )
    .await;
    err(
        &app,
        "/api/events/stream",
        None,
        StatusCode::UNAUTHORIZED,
        "unauthorized",
    )
    .await;
    // Naming no role: only the grant.
    let (st, ui) = call(&app, "/api/events", Some("ui-token-1")).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(seqs(&ui), [conv]);
    let (_, ops) = call(&app, "/api/events", Some("ops-token-2")).await;
    assert_eq!(seqs(&ops), [obs]);
    // A scan over a grant of several roles asks the server for every role at once and keeps
    // only the grant's own: the other roles' events never come back.
    let (st, found) = call(&app, "/api/search?limit=10", Some("ops-token-2")).await;
    assert_eq!(st, StatusCode::OK, "{found}");
    assert_eq!(seqs(&found), [obs], "{found}");
    let (_, after) = call(
        &app,
        &format!("/api/events?after={}", api::query::encode_cursor(0, 0)),
        Some("ops-token-2"),
    )
    .await;
    assert_eq!(seqs(&after), [obs], "{after}");
    // Naming a role outside the grant: 403, also through a preset.
    err(
        &app,
        "/api/events?role=system.observability",
        Some("ui-token-1"),
        StatusCode::FORBIDDEN,
        "forbidden",
    )
    .await;
    err(
        &app,
        "/api/events?role=conversation.main,delegation.subagent",
        Some("ui-token-1"),
        StatusCode::FORBIDDEN,
        "forbidden",
    )
    .await;
    err(
        &app,
        "/api/events?view=conversations",
        Some("ops-token-2"),
        StatusCode::FORBIDDEN,
        "forbidden",
    )
    .await;
    err(
        &app,
        "/api/work-sessions?role=delegation.subagent",
        Some("ops-token-2"),
        StatusCode::FORBIDDEN,
        "forbidden",
    )
    .await;
    let (st, _) = call(&app, "/api/events?view=conversations", Some("ui-token-1")).await;
    assert_eq!(st, StatusCode::OK);
    // The OpenAPI document stays open.
    let (st, _) = call(&app, "/api/openapi.json", None).await;
    assert_eq!(st, StatusCode::OK);

    // Work sessions are seen through the grant too.
    let writer = SessionWriter::new(&js, &s.names()).await.expect("writer");
    let ts = now_iso(0);
    let send = out(
        Role::ConversationMain,
        "a2a.send",
        "COLLAB_RAW:1:0",
        a2a(
            Role::ConversationMain,
            "a2a.send",
            &ts,
            json!({"fromAgent": "ruda", "toAgent": "eden", "conversationId": "c1", "workSessionId": "ws_t", "message": "hi"}),
        ),
    );
    let ping = out(
        Role::SystemObservability,
        "health.ping",
        "COLLAB_RAW:2:0",
        a2a(
            Role::SystemObservability,
            "health.ping",
            &ts,
            json!({"workSessionId": "ws_t", "message": "cpu 93%"}),
        ),
    );
    fold(&writer, 0, &[(1, &send), (2, &ping)]).await;
    let (_, ui) = call(&app, "/api/work-sessions/ws_t", Some("ui-token-1")).await;
    assert_eq!(ui["session"]["eventCount"], 1);
    assert_eq!(ui["session"]["lastMessagePreview"], "hi");
    assert!(ui["session"]["countsByRole"]
        .get("system.observability")
        .is_none());
    let (_, ops) = call(&app, "/api/work-sessions/ws_t", Some("ops-token-2")).await;
    assert_eq!(ops["session"]["eventCount"], 1);
    assert_eq!(ops["session"]["lastMessagePreview"], "cpu 93%");
    let (_, listed) = call(&app, "/api/work-sessions", Some("ui-token-1")).await;
    assert_eq!(listed["count"], 1);
}

// ---------------------------------------------------------------------------------------------
// /api/events/stream
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn event_stream_delivers_live_and_resumes_without_loss_or_repeats() {
    let (_nats, js, s) = setup().await;
    let (addr, stop) = serve(state(&js, &s), None).await;
    let filter = "/api/events/stream?view=conversations";
    let before = project(&js, "conversation.main", "s1", "a2a.response", 0).await;

    // Without a cursor the stream starts after what is stored.
    let mut client = SseClient::connect(addr, filter, None, None).await;
    let mut expected = Vec::new();
    for i in 1..=6u64 {
        expected.push(project(&js, "conversation.main", "s1", "a2a.response", i).await);
        project(&js, "conversation.main", "s1", "a2a.send", i).await;
    }
    let mut got = Vec::new();
    let mut last_id = None;
    for _ in 0..3 {
        let ev = client.next_guarded().await.expect("a live event");
        let item: Value = serde_json::from_str(&ev.data).expect("JSON data");
        assert_eq!(
            Some(item["cursor"].as_str().unwrap_or_default()),
            ev.id.as_deref()
        );
        assert_eq!(item["type"], "a2a.response");
        got.push(item["seq"].as_u64().unwrap_or(0));
        last_id = ev.id;
    }
    drop(client);
    // Published while disconnected.
    for i in 7..=9u64 {
        expected.push(project(&js, "conversation.main", "s1", "a2a.response", i).await);
    }
    let mut client = SseClient::connect(addr, filter, last_id.as_deref(), None).await;
    while got.len() < expected.len() {
        let ev = client.next_guarded().await.expect("a resumed event");
        let item: Value = serde_json::from_str(&ev.data).expect("JSON data");
        got.push(item["seq"].as_u64().unwrap_or(0));
    }
    assert_eq!(got, expected, "no loss, no repeats");
    assert!(!got.contains(&before));

    // `after` resumes the same way as Last-Event-ID.
    let mut from_after = SseClient::connect(
        addr,
        &format!(
            "{filter}&after={}",
            api::query::encode_cursor(0, expected[4])
        ),
        None,
        None,
    )
    .await;
    let ev = from_after.next_guarded().await.expect("an event");
    assert_eq!(ev.id, Some(api::query::encode_cursor(0, expected[5])));

    // Shutting down ends open streams.
    stop.cancel();
    while client.next_guarded().await.is_some() {}
}

#[tokio::test]
async fn a_slow_event_stream_client_gets_an_error_and_the_stream_closes() {
    let (_nats, js, s) = setup().await;
    let st = state(&js, &s).with_sse_limits(SseLimits {
        buffer_events: 8,
        buffer_bytes: 64 * 1024,
        keep_alive: Duration::from_secs(15),
        lifetime: Duration::from_secs(3600),
    });
    let stats_state = st.clone();
    let (addr, _stop) = serve(st, Some(4096)).await;
    let mut client = SseClient::connect(addr, "/api/events/stream", None, Some(4096)).await;
    // Far more than the kernel buffers and the client's buffer hold, without reading.
    let filler = "x".repeat(4000);
    let mut published = 0u64;
    while stats_state.stats().sse_overflows.load(Ordering::Relaxed) == 0 {
        for _ in 0..50 {
            let body = json!({"type": "health.ping", "payload": {"filler": filler}});
            publish(
                &js,
                "collab.proj.system.observability.k.health.ping",
                Bytes::from(body.to_string()),
            )
            .await;
            published += 1;
        }
        assert!(
            published < 20_000,
            "the server never gave up on a client that does not read"
        );
    }
    // Now read: what was buffered, then a final error, then the end.
    let mut events = 0u64;
    let mut last = None;
    while let Some(ev) = client.next_guarded().await {
        if ev.event.is_none() {
            events += 1;
        }
        last = Some(ev);
    }
    let last = last.expect("at least the error event");
    assert_eq!(last.event.as_deref(), Some("error"));
    let body: Value = serde_json::from_str(&last.data).expect("JSON error");
    assert_eq!(body["error"]["code"], "slow_consumer");
    crate::schemas::assert_matches("stream-error.schema.json", &body);
    assert!(events < published, "the stream was cut short");
    wait_until(GUARD, "the stream's reader stops", || {
        let n = stats_state.stats().sse_clients.load(Ordering::Relaxed);
        async move { n == 0 }
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// /api/work-sessions
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn the_work_session_list_says_how_far_its_sessions_are_folded() {
    let (_nats, js, s) = setup().await;
    let app = api::router(state(&js, &s));
    let writer = SessionWriter::new(&js, &s.names()).await.expect("writer");
    let main = Role::ConversationMain;
    let send = out(
        main,
        "a2a.send",
        "COLLAB_RAW:1:0",
        a2a(
            main,
            "a2a.send",
            &now_iso(-10),
            json!({"fromAgent": "ruda", "toAgent": "eden", "conversationId": "c1", "workSessionId": "ws_f", "message": "Check the build"}),
        ),
    );
    fold(&writer, 1, &[(1, &send)]).await;
    // Before any fold has run there is no checkpoint, and neither the list nor a session says
    // anything of one.
    let before = ok(&app, "/api/work-sessions").await;
    assert_eq!(before["count"], 1, "{before}");
    assert!(before.get("foldedTo").is_none(), "{before}");
    assert!(before.get("behind").is_none(), "{before}");
    let one = ok(&app, "/api/work-sessions/ws_f").await;
    assert!(one.get("foldedTo").is_none(), "{one}");
    let mut last = 0;
    for n in 0..5 {
        last = project(
            &js,
            "system.observability",
            &format!("k{n}"),
            "health.ping",
            n,
        )
        .await;
    }
    assert!(last >= 5, "{last}");
    // A fold's checkpoint two projections before the end.
    let kv = js
        .get_key_value(&s.names().sessions_bucket)
        .await
        .expect("the work-session bucket");
    kv.put(FOLD_KEY, (last - 2).to_string().into())
        .await
        .expect("checkpoint written");
    let behind = ok(&app, "/api/work-sessions").await;
    assert_eq!(behind["foldedTo"], last - 2, "{behind}");
    assert_eq!(behind["behind"], 2, "{behind}");
    let one = ok(&app, "/api/work-sessions/ws_f").await;
    assert_eq!(one["foldedTo"], last - 2, "{one}");
    assert_eq!(one["behind"], 2, "{one}");
    // Caught up.
    kv.put(FOLD_KEY, last.to_string().into())
        .await
        .expect("checkpoint written");
    let caught_up = ok(&app, "/api/work-sessions").await;
    assert_eq!(caught_up["foldedTo"], last, "{caught_up}");
    assert_eq!(caught_up["behind"], 0, "{caught_up}");
}

#[tokio::test]
async fn work_sessions_aggregate_idempotently_and_filter() {
    let (_nats, js, s) = setup().await;
    let app = api::router(state(&js, &s));
    let writer = SessionWriter::new(&js, &s.names()).await.expect("writer");
    let t0 = now_iso(-60);
    let t1 = now_iso(-30);
    let main = Role::ConversationMain;
    let send0 = out(
        main,
        "a2a.send",
        "COLLAB_RAW:10:0",
        a2a(
            main,
            "a2a.send",
            &t0,
            json!({"fromAgent": "ruda", "toAgent": "eden", "conversationId": "c1", "workSessionId": "ws_a", "message": "Review the deploy plan", "conversationName": "Deploy review"}),
        ),
    );
    let send1 = out(
        main,
        "a2a.send",
        "COLLAB_RAW:11:0",
        a2a(
            main,
            "a2a.send",
            &t0,
            json!({"fromAgent": "ruda", "toAgent": "eden", "conversationId": "c1", "workSessionId": "ws_a", "turn": 1, "message": "and the rollback"}),
        ),
    );
    let send2 = out(
        main,
        "a2a.send",
        "COLLAB_RAW:12:0",
        a2a(
            main,
            "a2a.send",
            &t0,
            json!({"fromAgent": "ruda", "toAgent": "eden", "conversationId": "c1", "workSessionId": "ws_a", "turn": 2, "message": "and the alerts"}),
        ),
    );
    let resp0 = out(
        main,
        "a2a.response",
        "turn:c1:0",
        a2a(
            main,
            "a2a.response",
            &t1,
            json!({"fromAgent": "eden", "toAgent": "ruda", "conversationId": "c1", "workSessionId": "ws_a", "message": "looks good"}),
        ),
    );
    // A synthesised blocked response names no work session: found through the conversation.
    let blocked = out(
        main,
        "a2a.response",
        "turn:c1:2",
        a2a(
            main,
            "a2a.response",
            &t1,
            json!({"fromAgent": "eden", "toAgent": "ruda", "conversationId": "c1", "turn": 2, "outcome": "blocked", "reason": "timeout", "message": "goal: alerts\noutcome: blocked (timeout)"}),
        ),
    );
    let items: Vec<(u64, &Outgoing)> = vec![
        (10, &send0),
        (11, &send1),
        (12, &send2),
        (12, &resp0),
        (13, &blocked),
    ];
    fold(&writer, 1, &items).await;
    // Redelivery, and a retried round: nothing counts twice.
    fold(&writer, 1, &items).await;
    fold(&writer, 1, &items[2..]).await;

    let one = ok(&app, "/api/work-sessions/ws_a").await;
    let v = &one["session"];
    assert_eq!(v["id"], "ws_a");
    assert_eq!(v["eventCount"], 5, "{v}");
    assert_eq!(v["countsByType"]["a2a.send"], 3);
    assert_eq!(v["countsByType"]["a2a.response"], 2);
    assert_eq!(v["countsByRole"]["conversation.main"], 5);
    assert_eq!(v["openTurns"], 1);
    assert_eq!(v["blockedTurns"], 1);
    assert_eq!(v["answeredTurns"], 1);
    assert_eq!(v["title"], "Deploy review");
    assert_eq!(v["status"], "ACTIVE");
    assert_eq!(v["threadCount"], 1);
    assert_eq!(v["threads"][0]["id"], "conv:c1");
    let ids: Vec<&str> = v["participants"]
        .as_array()
        .map(|a| a.iter().filter_map(|p| p["id"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(ids, ["eden", "ruda"]);
    assert_eq!(v["participants"][0]["kind"], "agent");
    assert_eq!(v["participants"][0]["role"], "conversation.main");
    assert!(v["lastMessagePreview"]
        .as_str()
        .is_some_and(|p| p.starts_with("goal: alerts")));

    // Concurrent writers from different partitions on one session: every event counts once.
    let other = |n: u64| {
        out(
            main,
            "a2a.send",
            &format!("COLLAB_RAW:{n}:0"),
            a2a(
                main,
                "a2a.send",
                &t1,
                json!({"fromAgent": "ruda", "toAgent": "eden", "conversationId": format!("c{n}"), "workSessionId": "ws_a", "message": "more"}),
            ),
        )
    };
    let outs: Vec<Outgoing> = (100..110).map(other).collect();
    let mut tasks = Vec::new();
    for (i, o) in outs.into_iter().enumerate() {
        let w = SessionWriter::new(&js, &s.names()).await.expect("writer");
        tasks.push(tokio::spawn(async move {
            // One partition each: a partition is processed in order, partitions concurrently.
            let p = 10 + u16::try_from(i).unwrap_or(0);
            fold(&w, p, &[(100 + i as u64, &o)]).await;
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    let v = ok(&app, "/api/work-sessions/ws_a").await;
    assert_eq!(v["session"]["eventCount"], 15);
    assert_eq!(v["session"]["threadCount"], 11);

    // Other sessions: an archived one, a quiet one, one with only tasks.
    let old = now_iso(-3 * 24 * 3600);
    let quiet = now_iso(-3600);
    let e_old = out(
        main,
        "a2a.send",
        "COLLAB_RAW:200:0",
        a2a(
            main,
            "a2a.send",
            &old,
            json!({"fromAgent": "ruda", "toAgent": "eden", "conversationId": "o1", "workSessionId": "ws_old"}),
        ),
    );
    let e_quiet = out(
        main,
        "a2a.send",
        "COLLAB_RAW:201:0",
        a2a(
            main,
            "a2a.send",
            &quiet,
            json!({"fromAgent": "ruda", "toAgent": "eden", "conversationId": "q1", "workSessionId": "ws_quiet"}),
        ),
    );
    let e_task = out(
        Role::OrchestrationTask,
        "task.updated",
        "COLLAB_RAW:202:0",
        a2a(
            Role::OrchestrationTask,
            "task.updated",
            &t1,
            json!({"workSessionId": "ws_task", "status": "working"}),
        ),
    );
    fold(
        &writer,
        2,
        &[(200, &e_old), (201, &e_quiet), (202, &e_task)],
    )
    .await;

    let list = ok(&app, "/api/work-sessions").await;
    assert_eq!(list["count"], 4);
    let order: Vec<&str> = list["sessions"]
        .as_array()
        .map(|a| a.iter().filter_map(|s| s["id"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(
        order,
        ["ws_a", "ws_task", "ws_quiet", "ws_old"],
        "most recently updated first"
    );
    let ids = |v: &Value| -> BTreeSet<String> {
        v["sessions"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s["id"].as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    };
    let archived = ok(&app, "/api/work-sessions?status=ARCHIVED").await;
    assert_eq!(ids(&archived), BTreeSet::from(["ws_old".to_string()]));
    let csv = ok(&app, "/api/work-sessions?status=QUIET,ARCHIVED").await;
    let rep = ok(&app, "/api/work-sessions?status=QUIET&status=ARCHIVED").await;
    assert_eq!(ids(&csv), ids(&rep));
    assert_eq!(ids(&csv).len(), 2);
    let tasks = ok(&app, "/api/work-sessions?role=orchestration.task").await;
    assert_eq!(ids(&tasks), BTreeSet::from(["ws_task".to_string()]));
    // Counted through the roles too: the sessions without a task event are not counted.
    assert_eq!(list["totalSessions"], 4, "{list}");
    assert_eq!(tasks["totalSessions"], 1, "{tasks}");
    assert_eq!(tasks["sessions"][0]["eventCount"], 1);
    let typed = ok(&app, "/api/work-sessions?type=a2a.response").await;
    assert_eq!(ids(&typed), BTreeSet::from(["ws_a".to_string()]));
    let limited = ok(&app, "/api/work-sessions?limit=1").await;
    assert_eq!(limited["count"], 1);
    assert_eq!(limited["totalMatched"], 4);
    assert_eq!(limited["sessions"][0]["id"], "ws_a", "the newest is kept");
    let two = ok(&app, "/api/work-sessions?limit=2&status=QUIET,ARCHIVED").await;
    let kept: Vec<&str> = two["sessions"]
        .as_array()
        .map(|a| a.iter().filter_map(|s| s["id"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(
        kept,
        ["ws_quiet", "ws_old"],
        "the newest two matches, in order"
    );
    assert_eq!(two["totalMatched"], 2);
    err(
        &app,
        "/api/work-sessions?role=bogus",
        None,
        StatusCode::BAD_REQUEST,
        "invalid_role",
    )
    .await;
    err(
        &app,
        "/api/work-sessions?type=a%20b",
        None,
        StatusCode::BAD_REQUEST,
        "invalid_type",
    )
    .await;
    err(
        &app,
        "/api/work-sessions?limit=0",
        None,
        StatusCode::BAD_REQUEST,
        "invalid_limit",
    )
    .await;
    // A role the session has nothing in: not found through that role.
    err(
        &app,
        "/api/work-sessions/ws_task?role=conversation.main",
        None,
        StatusCode::NOT_FOUND,
        "not_found",
    )
    .await;
}

/// The MPLP Collab schema, with the common schemas it references, offline.
fn mplp_validator() -> jsonschema::Validator {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/mplp/schemas/v2");
    let load = |p: &str| -> Value {
        let text = std::fs::read_to_string(format!("{dir}/{p}"))
            .unwrap_or_else(|e| panic!("reading {p}: {e}"));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("parsing {p}: {e}"))
    };
    let mut opts = jsonschema::options().should_validate_formats(true);
    for common in [
        "metadata",
        "identifiers",
        "common-types",
        "trace-base",
        "events",
    ] {
        let schema = load(&format!("common/{common}.schema.json"));
        let id = schema["$id"].as_str().expect("an $id").to_string();
        let resource = jsonschema::Resource::from_contents(schema).expect("a schema resource");
        opts = opts.with_resource(id, resource);
    }
    opts.build(&load("mplp-collab.schema.json"))
        .expect("the collab schema compiles")
}

fn assert_valid(v: &jsonschema::Validator, doc: &Value) {
    let errors: Vec<String> = v
        .iter_errors(doc)
        .map(|e| format!("{} at {}", e, e.instance_path))
        .collect();
    assert!(errors.is_empty(), "{doc}\n{errors:#?}");
}

#[tokio::test]
async fn mplp_export_validates_against_the_schema() {
    let (_nats, js, s) = setup().await;
    let app = api::router(state(&js, &s));
    let writer = SessionWriter::new(&js, &s.names()).await.expect("writer");
    let validator = mplp_validator();
    // The seed's own example does not validate (see docs/contract.md); the schema is strict.
    assert!(!validator
        .is_valid(&json!({"meta": {"protocolVersion": "1.0.0"}, "collab_id": "collab-1"})));

    let ts = now_iso(0);
    let main = Role::ConversationMain;
    let sub = Role::DelegationSubagent;
    // A pair of main agents, one of them human per the facts.
    let pair = out(
        main,
        "a2a.send",
        "COLLAB_RAW:1:0",
        a2a(
            main,
            "a2a.send",
            &ts,
            json!({"fromAgent": "ruda", "toAgent": "eden", "fromKind": "human", "fromName": "Ruda Kim", "conversationId": "c1", "workSessionId": "ws_pair", "message": "Review the deploy plan please"}),
        ),
    );
    // A coordinator delegating to two workers.
    let d1 = out(
        sub,
        "a2a.send",
        "COLLAB_RAW:2:0",
        a2a(
            sub,
            "a2a.send",
            &ts,
            json!({"fromAgent": "ruda", "toAgent": "worker-1", "conversationId": "d1", "workSessionId": "ws_orch", "message": "build"}),
        ),
    );
    let d2 = out(
        sub,
        "a2a.spawn",
        "COLLAB_RAW:3:0",
        a2a(
            sub,
            "a2a.spawn",
            &ts,
            json!({"fromAgent": "ruda", "toAgent": "worker-2", "conversationId": "d2", "workSessionId": "ws_orch"}),
        ),
    );
    // Three agents talking, nobody delegating.
    let b1 = out(
        main,
        "a2a.send",
        "COLLAB_RAW:4:0",
        a2a(
            main,
            "a2a.send",
            &ts,
            json!({"fromAgent": "ruda", "toAgent": "eden", "conversationId": "b1", "workSessionId": "ws_b"}),
        ),
    );
    let b2 = out(
        main,
        "a2a.send",
        "COLLAB_RAW:5:0",
        a2a(
            main,
            "a2a.send",
            &ts,
            json!({"fromAgent": "eden", "toAgent": "main", "conversationId": "b2", "workSessionId": "ws_b"}),
        ),
    );
    fold(
        &writer,
        0,
        &[(1, &pair), (2, &d1), (3, &d2), (4, &b1), (5, &b2)],
    )
    .await;

    let doc = ok(&app, "/api/work-sessions/ws_pair?format=mplp").await;
    assert_valid(&validator, &doc);
    assert_eq!(doc["mode"], "pair");
    assert_eq!(doc["status"], "active");
    assert_eq!(doc["title"], "Review the deploy plan please");
    assert_eq!(doc["meta"]["protocol_version"], "1.0.0");
    let ruda = doc["participants"]
        .as_array()
        .and_then(|a| a.iter().find(|p| p["participant_id"] == "ruda"))
        .cloned()
        .expect("ruda takes part");
    assert_eq!(ruda["kind"], "human");
    assert_eq!(ruda["display_name"], "Ruda Kim");
    // Stable ids.
    let again = ok(&app, "/api/work-sessions/ws_pair?format=mplp").await;
    assert_eq!(again["collab_id"], doc["collab_id"]);
    assert_ne!(doc["collab_id"], doc["context_id"]);

    let orch = ok(&app, "/api/work-sessions/ws_orch?format=mplp").await;
    assert_valid(&validator, &orch);
    assert_eq!(orch["mode"], "orchestrated");
    let roles: BTreeSet<String> = orch["participants"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|p| p["role_id"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(
        roles,
        BTreeSet::from(["orchestrator".to_string(), "worker".to_string()])
    );

    let b = ok(&app, "/api/work-sessions/ws_b?format=mplp").await;
    assert_valid(&validator, &b);
    assert_eq!(b["mode"], "broadcast");
    assert_eq!(b["participants"].as_array().map(Vec::len), Some(3));
}

// ---------------------------------------------------------------------------------------------
// Through the worker
// ---------------------------------------------------------------------------------------------

/// The worker and nothing else (no HTTP), in this process.
pub(crate) async fn start_worker(s: &Settings) -> (app::Running, CancellationToken) {
    let cancel = CancellationToken::new();
    let running = app::start(
        s.clone(),
        RunOptions {
            workers: true,
            http: false,
            metrics: None,
        },
        cancel.clone(),
    )
    .await
    .expect("the worker starts");
    (running, cancel)
}

pub(crate) async fn drained(js: &Context) {
    wait_until(GUARD, "every raw partition consumer is drained", || {
        let js = js.clone();
        async move { raw_drained(&js, usize::from(PARTITIONS)).await }
    })
    .await;
}

/// A collaboration event, `step` seconds after a base time a minute ago (event time orders the
/// session's first and last message whatever order partitions are processed in).
pub(crate) fn collab_event(
    step: i64,
    t: &str,
    from: &str,
    to: &str,
    conv: &str,
    extra: Value,
) -> (String, Bytes) {
    let mut data = json!({"fromAgent": from, "toAgent": to, "conversationId": conv, "workSessionId": "ws_live"});
    if let (Some(d), Value::Object(e)) = (data.as_object_mut(), extra) {
        d.extend(e);
    }
    let ts = chrono::Utc::now().timestamp_millis() - 60_000 + step * 1000;
    let body = json!({"type": t, "agentId": from, "ts": ts, "data": data});
    (
        format!("collab.raw.{conv}.{t}"),
        Bytes::from(body.to_string()),
    )
}

#[tokio::test]
async fn raw_events_come_back_through_the_api_and_sessions_survive_a_restart() {
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let s = settings(&nats.url());
    let (running, cancel) = start_worker(&s).await;
    let (addr, _stop) = serve(state(&js, &s), None).await;
    let base = format!("http://{addr}");
    let http = reqwest::Client::new();
    let get = |path: String| {
        let http = http.clone();
        let url = format!("{base}{path}");
        async move {
            let resp = http.get(&url).send().await.expect("the API answers");
            let status = resp.status();
            let body: Value = resp.json().await.expect("JSON");
            assert!(status.is_success(), "{url}: {status} {body}");
            body
        }
    };

    let raws = [
        // Turn 0: answered.
        collab_event(
            1,
            "a2a.send",
            "ruda",
            "eden",
            "conv-1",
            json!({"message": "Review the deploy plan"}),
        ),
        collab_event(
            2,
            "a2a.response",
            "eden",
            "ruda",
            "conv-1",
            json!({"message": "goal: review\noutcome: success\nevidence: plan.md\nnext_action: deploy"}),
        ),
        collab_event(3, "a2a.complete", "ruda", "eden", "conv-1", json!({})),
        // Turn 1: upstream failure, blocked.
        collab_event(
            4,
            "a2a.send",
            "ruda",
            "eden",
            "conv-1",
            json!({"turn": 1, "message": "and the rollback"}),
        ),
        collab_event(
            5,
            "a2a.response",
            "eden",
            "ruda",
            "conv-1",
            json!({"turn": 1, "outcome": "no_reply", "waitStatus": "error", "message": "[outcome] no_reply"}),
        ),
        // Turn 2: still open.
        collab_event(
            6,
            "a2a.send",
            "ruda",
            "eden",
            "conv-1",
            json!({"turn": 2, "message": "and the alerts"}),
        ),
        // Delegation to a subagent in another conversation of the same work session.
        collab_event(
            7,
            "a2a.send",
            "ruda",
            "coder",
            "conv-2",
            json!({"toSessionType": "subagent", "message": "write the script"}),
        ),
    ];
    for (subject, body) in &raws {
        publish(&js, subject, body.clone()).await;
    }
    publish(
        &js,
        "collab.raw.task-7.task.updated",
        Bytes::from(
            json!({"type": "task.updated", "data": {"taskId": "task-7", "status": "working"}})
                .to_string(),
        ),
    )
    .await;
    drained(&js).await;

    // Filters over what the worker projected.
    let conv = get("/api/events?view=conversations".into()).await;
    assert_eq!(conv["count"], 2, "{conv}");
    assert_eq!(conv["events"][1]["event"]["payload"]["outcome"], "blocked");
    let expanded = get("/api/events?role=conversation.main&type=a2a.response".into()).await;
    assert_eq!(seqs(&conv), seqs(&expanded));
    let debug = get("/api/events?view=debug".into()).await;
    let csv = get("/api/events?type=a2a.send,a2a.response,a2a.complete".into()).await;
    let rep = get("/api/events?type=a2a.send&type=a2a.response&type=a2a.complete".into()).await;
    assert_eq!(seqs(&debug), seqs(&csv));
    assert_eq!(seqs(&csv), seqs(&rep));
    assert_eq!(debug["count"], 7, "{debug}");
    let tasks = get("/api/events?role=orchestration.task".into()).await;
    assert_eq!(tasks["count"], 1);
    let sub = get("/api/events?role=delegation.subagent&key=conv-2".into()).await;
    assert_eq!(sub["count"], 1);

    // The work session (folded by the worker from the projection stream).
    let check = |v: &Value| {
        let s = &v["session"];
        assert_eq!(s["openTurns"], 1, "{s}");
        assert_eq!(s["blockedTurns"], 1, "{s}");
        assert_eq!(s["answeredTurns"], 1, "{s}");
        assert_eq!(s["countsByType"]["a2a.send"], 4, "{s}");
        assert_eq!(s["countsByType"]["a2a.response"], 2, "{s}");
        assert_eq!(s["countsByType"]["a2a.complete"], 1, "{s}");
        assert_eq!(s["countsByRole"]["delegation.subagent"], 1, "{s}");
        assert_eq!(s["threadCount"], 2, "{s}");
        let ids: BTreeSet<&str> = s["participants"]
            .as_array()
            .map(|a| a.iter().filter_map(|p| p["id"].as_str()).collect())
            .unwrap_or_default();
        assert_eq!(ids, BTreeSet::from(["coder", "eden", "ruda"]), "{s}");
        assert_eq!(s["title"], "Review the deploy plan", "{s}");
        assert_eq!(s["lastMessagePreview"], "write the script", "{s}");
    };
    let http2 = http.clone();
    let url = format!("{base}/api/work-sessions/ws_live");
    wait_until(GUARD, "the work session holds every event", || {
        let http = http2.clone();
        let url = url.clone();
        async move {
            match http.get(&url).send().await {
                Ok(r) if r.status().is_success() => r
                    .json::<Value>()
                    .await
                    .is_ok_and(|v| v["session"]["eventCount"] == 7),
                _ => false,
            }
        }
    })
    .await;
    let first = get("/api/work-sessions/ws_live".into()).await;
    check(&first);

    // Restart with everything redelivered: progress marks and partition consumers gone.
    cancel.cancel();
    running.wait().await;
    let raw = js.get_stream("COLLAB_RAW").await.expect("raw stream");
    for p in 0..PARTITIONS {
        raw.delete_consumer(&format!("collab-proj-{p}"))
            .await
            .expect("delete a partition consumer");
    }
    let (running, cancel) = start_worker(&s).await;
    drained(&js).await;
    let second = get("/api/work-sessions/ws_live".into()).await;
    check(&second);
    assert_eq!(
        second["session"]["eventCount"], first["session"]["eventCount"],
        "no double count after a restart"
    );
    let conv_again = get("/api/events?view=conversations".into()).await;
    assert_eq!(conv_again["count"], 2, "still one response per turn");
    cancel.cancel();
    running.wait().await;
}

#[tokio::test]
async fn open_turns_are_counted_from_state_and_leave_with_their_partitions() {
    use std::sync::atomic::Ordering::Relaxed;
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let s = settings(&nats.url());
    let (running, cancel) = start_worker(&s).await;
    let state = running.worker.as_ref().expect("a worker").state.clone();
    for (i, conv) in ["conv-a", "conv-b", "conv-c"].into_iter().enumerate() {
        let (subject, body) = collab_event(
            i64::try_from(i).unwrap_or(0),
            "a2a.send",
            "ruda",
            "eden",
            conv,
            json!({"message": "still thinking", "timeoutMs": 3_600_000}),
        );
        publish(&js, &subject, body).await;
    }
    drained(&js).await;
    wait_until(GUARD, "the worker counts three open turns", || {
        let n = state.open_turns.load(Relaxed);
        async move { n == 3 }
    })
    .await;
    cancel.cancel();
    running.wait().await;
    assert_eq!(
        state.open_turns.load(Relaxed),
        0,
        "stopped partitions take their open turns with them"
    );
}

/// Fold stored outputs of `partition` into their work sessions, each identified by its raw
/// sequence and its index among that input's outputs (the way a replayed round repeats them).
/// A conversation whose events name no work session is its own session until one of its events
/// names one; from then on its events go to that session, also on a writer that looked the alias
/// up and found none before (it asks once, not once per event), and on a new writer (the alias
/// is stored).
#[tokio::test]
async fn a_conversation_without_a_session_joins_the_one_it_names_later() {
    let (_nats, js, s) = setup().await;
    let app = api::router(state(&js, &s));
    let writer = SessionWriter::new(&js, &s.names()).await.expect("writer");
    let ts = now_iso(-10);
    let sub = Role::DelegationSubagent;
    let bare = |seq: u64, message: &str| delegation_send(seq, "del-7", message, &ts);
    let (first, second) = (bare(1, "collect the logs"), bare(2, "and the traces"));
    fold(&writer, 0, &[(1, &first), (2, &second)]).await;
    let own = ok(&app, "/api/work-sessions/del-7").await;
    assert_eq!(own["session"]["eventCount"], 2, "{own}");

    let named = out(
        sub,
        "a2a.response",
        "COLLAB_RAW:3:0",
        a2a(
            sub,
            "a2a.response",
            &ts,
            json!({"fromAgent": "ruda-worker", "toAgent": "ruda", "conversationId": "del-7", "workSessionId": "ws_d", "message": "3 failing tests"}),
        ),
    );
    let after = bare(4, "thanks");
    fold(&writer, 0, &[(3, &named), (4, &after)]).await;
    let joined = ok(&app, "/api/work-sessions/ws_d").await;
    assert_eq!(joined["session"]["eventCount"], 2, "{joined}");
    let own = ok(&app, "/api/work-sessions/del-7").await;
    assert_eq!(own["session"]["eventCount"], 2, "unchanged: {own}");

    // A writer that starts afresh reads the stored alias.
    let fresh = SessionWriter::new(&js, &s.names()).await.expect("writer");
    let later = bare(5, "one more");
    fold(&fresh, 0, &[(5, &later)]).await;
    let joined = ok(&app, "/api/work-sessions/ws_d").await;
    assert_eq!(joined["session"]["eventCount"], 3, "{joined}");
}

/// The reads of the work-session bucket that reach the server (every request on its direct-get
/// and leader-get subjects, which a core subscription sees too), subscribed before anything is
/// folded.
struct BucketReads {
    client: async_nats::Client,
    reads: futures::stream::Select<async_nats::Subscriber, async_nats::Subscriber>,
    bucket_subject: String,
}

impl BucketReads {
    async fn watch(nats: &TestNats, names: &collab_projector::config::Names) -> BucketReads {
        let client = nats.client().await;
        let direct_reads = client
            .subscribe(format!("$JS.API.DIRECT.GET.KV_{}.>", names.sessions_bucket))
            .await
            .expect("subscribe");
        let leader_reads = client
            .subscribe(format!(
                "$JS.API.STREAM.MSG.GET.KV_{}",
                names.sessions_bucket
            ))
            .await
            .expect("subscribe");
        client
            .flush()
            .await
            .expect("the subscriptions are in place");
        BucketReads {
            client,
            reads: futures::stream::select(direct_reads, leader_reads),
            bucket_subject: format!("$KV.{}.", names.sessions_bucket),
        }
    }

    /// The keys read since the last call, in the order asked. Flushed first, so every request
    /// sent before is counted.
    async fn keys(&mut self) -> Vec<String> {
        use futures::StreamExt;
        self.client.flush().await.expect("flush");
        let mut keys = Vec::new();
        while let Ok(Some(m)) =
            tokio::time::timeout(Duration::from_millis(200), self.reads.next()).await
        {
            let asked = if m.subject.as_str().contains(".DIRECT.GET.") {
                m.subject.as_str().to_string()
            } else {
                let body: Value = serde_json::from_slice(&m.payload).unwrap_or(Value::Null);
                body["last_by_subj"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string()
            };
            if let Some((_, key)) = asked.split_once(self.bucket_subject.as_str()) {
                keys.push(key.to_string());
            }
        }
        keys
    }
}

/// A work session the fold's writer has never met is written as new without a read first (the
/// bucket refuses a write as new where the key has any entry), and a session stored already by
/// an earlier writer, as after a restart, keeps its events: the refused write is followed by a
/// read and the events go on top of what is stored.
#[tokio::test]
async fn a_new_work_session_is_written_without_a_read_and_a_stored_one_keeps_its_events() {
    let (nats, js, s) = setup().await;
    let app = api::router(state(&js, &s));
    let names = s.names();
    let mut reads = BucketReads::watch(&nats, &names).await;
    let ts = now_iso(-10);
    let event = |seq: u64, conv: &str| delegation_send(seq, conv, "collect the logs", &ts);
    let first: Vec<Outgoing> = (0..20u64)
        .map(|i| event(10 + i, &format!("del-{}", 100 + i)))
        .collect();
    let items: Vec<(u64, &Outgoing)> = first
        .iter()
        .enumerate()
        .map(|(i, o)| (10 + i as u64, o))
        .collect();
    let writer = SessionWriter::new(&js, &names).await.expect("writer");
    fold(&writer, 0, &items).await;
    let read = reads.keys().await;
    assert!(
        !read.iter().any(|k| k.starts_with("del-")),
        "new sessions were read before their first write: {read:?}"
    );
    for i in 0..20 {
        assert_eq!(event_count(&app, &format!("del-{}", 100 + i)).await, 1);
    }

    // A writer that starts afresh has met none of them: its write as new is refused, it reads
    // the stored session and adds the event to it.
    let fresh = SessionWriter::new(&js, &names).await.expect("writer");
    let again = event(40, "del-100");
    fold(&fresh, 0, &[(40, &again)]).await;
    let read = reads.keys().await;
    assert!(
        read.iter().any(|k| k == "del-100"),
        "a stored session was not read after its write as new was refused: {read:?}"
    );
    assert_eq!(event_count(&app, "del-100").await, 2);
    assert_eq!(event_count(&app, "del-101").await, 1);
}

/// The fold's writer remembers a conversation's alias past many other conversations (a turn's
/// blocked outcome comes its timeout after the send, while as many new conversations start): an
/// event restating the conversation's work session is routed without a read of the alias or a
/// write. A writer that starts afresh has forgotten it and reads it (what the count would show
/// had the first one forgotten it too).
#[tokio::test]
async fn a_conversation_alias_is_remembered_past_twelve_thousand_other_conversations() {
    let (nats, js, s) = setup().await;
    let app = api::router(state(&js, &s));
    let names = s.names();
    let mut reads = BucketReads::watch(&nats, &names).await;
    let ts = now_iso(-10);
    let send = |seq: u64, conv: &str, ws: &str| main_send(seq, conv, ws, &ts);
    let writer = SessionWriter::new(&js, &names).await.expect("writer");
    let first = send(1, "conv-kept", "ws_kept");
    fold(&writer, 0, &[(1, &first)]).await;
    let others: Vec<Outgoing> = (0..12_000u64)
        .map(|i| send(2 + i, &format!("conv-{i}"), &format!("ws_{}", i % 100)))
        .collect();
    let items: Vec<(u64, &Outgoing)> = others
        .iter()
        .enumerate()
        .map(|(i, o)| (2 + i as u64, o))
        .collect();
    fold(&writer, 0, &items).await;
    let _ = reads.keys().await;

    let again = send(20_000, "conv-kept", "ws_kept");
    fold(&writer, 0, &[(20_000, &again)]).await;
    let read = reads.keys().await;
    assert!(
        !read.iter().any(|k| k == "alias.conv-kept"),
        "the alias was read again after 12,000 other conversations: {read:?}"
    );
    assert_eq!(event_count(&app, "ws_kept").await, 2);

    let fresh = SessionWriter::new(&js, &names).await.expect("writer");
    let third = send(20_001, "conv-kept", "ws_kept");
    fold(&fresh, 0, &[(20_001, &third)]).await;
    let read = reads.keys().await;
    assert!(
        read.iter().any(|k| k == "alias.conv-kept"),
        "a writer that never met the conversation did not read its alias: {read:?}"
    );
    assert_eq!(event_count(&app, "ws_kept").await, 3);
}

/// The fold's writer keeps the work sessions it wrote last: a session written again every
/// thousand other sessions is never read back, however many sessions pass (here 5,000, more than
/// the 4,096 it keeps decoded), and every one of its events is kept.
#[tokio::test]
async fn a_work_session_in_use_is_not_read_again_after_five_thousand_other_sessions() {
    let (nats, js, s) = setup().await;
    let app = api::router(state(&js, &s));
    let names = s.names();
    let mut reads = BucketReads::watch(&nats, &names).await;
    let ts = now_iso(-10);
    let send = |seq: u64, n: u64, ws: &str| main_send(seq, &format!("conv-{n}"), ws, &ts);
    let writer = SessionWriter::new(&js, &names).await.expect("writer");
    let mut seq = 1u64;
    fold(&writer, 0, &[(seq, &send(seq, 0, "ws_hot"))]).await;
    for block in 0..5u64 {
        let others: Vec<Outgoing> = (0..1_000u64)
            .map(|i| {
                let n = block * 1_000 + i;
                send(seq + 1 + i, 1 + n, &format!("ws_other_{n}"))
            })
            .collect();
        let items: Vec<(u64, &Outgoing)> = others
            .iter()
            .enumerate()
            .map(|(i, o)| (seq + 1 + i as u64, o))
            .collect();
        fold(&writer, 0, &items).await;
        seq += 1_001;
        fold(&writer, 0, &[(seq, &send(seq, 0, "ws_hot"))]).await;
    }
    let read = reads.keys().await;
    assert!(
        !read.iter().any(|k| k == "ws_hot"),
        "the session in use was read again among 5,000 other sessions: {:?}",
        read.iter()
            .filter(|k| k.starts_with("ws_"))
            .collect::<Vec<_>>()
    );
    assert_eq!(event_count(&app, "ws_hot").await, 6);
    assert_eq!(event_count(&app, "ws_other_4999").await, 1);
}

/// A main-main `a2a.send` in conversation `conv` of work session `ws` at `ts`, from raw input `seq`.
fn main_send(seq: u64, conv: &str, ws: &str, ts: &str) -> Outgoing {
    send_of(
        Role::ConversationMain,
        seq,
        ts,
        json!({"fromAgent": "ruda", "toAgent": "eden", "conversationId": conv,
            "workSessionId": ws, "message": "check the canary"}),
    )
}

/// An `a2a.send` of `role` at `ts` with `data`, from raw input `seq`.
fn send_of(role: Role, seq: u64, ts: &str, data: Value) -> Outgoing {
    out(
        role,
        "a2a.send",
        &format!("COLLAB_RAW:{seq}:0"),
        a2a(role, "a2a.send", ts, data),
    )
}

/// A delegation's send of `message` in conversation `conv` at `ts`, naming no work session.
fn delegation_send(seq: u64, conv: &str, message: &str, ts: &str) -> Outgoing {
    send_of(
        Role::DelegationSubagent,
        seq,
        ts,
        json!({"fromAgent": "ruda", "toAgent": "ruda-worker", "conversationId": conv, "message": message}),
    )
}

/// A delegation event of conversation `del-9`, naming work session `ws` when given.
fn moving(seq: u64, ws: Option<&str>, message: &str) -> Outgoing {
    let mut payload = json!({"fromAgent": "ruda", "toAgent": "ruda-worker", "conversationId": "del-9", "message": message});
    if let Some(ws) = ws {
        payload["workSessionId"] = json!(ws);
    }
    send_of(Role::DelegationSubagent, seq, &now_iso(-10), payload)
}

/// How many events work session `id` holds, as the API shows it (0 when it does not exist).
async fn event_count(app: &Router, id: &str) -> u64 {
    let (status, body) = call(app, &format!("/api/work-sessions/{id}"), None).await;
    if status == StatusCode::NOT_FOUND {
        return 0;
    }
    assert_eq!(status, StatusCode::OK, "{body}");
    body["session"]["eventCount"].as_u64().unwrap_or(0)
}

/// A round folded again after its first attempt failed between writing its aliases and its
/// sessions (the fold starts again from its checkpoint, here with a fresh writer as after a
/// restart) routes every event as the first attempt would have: an event that names only its
/// conversation goes to the session the conversation was in at that event, not to where the
/// failed attempt left its alias. A retry that reads fewer projections, and the round after it,
/// route the same way.
#[tokio::test]
async fn a_round_folded_again_routes_each_event_as_the_first_attempt_did() {
    let (_nats, js, s) = setup().await;
    let app = api::router(state(&js, &s));
    let round = [
        moving(1, Some("ws_a"), "start"),
        moving(2, None, "first step"),
        moving(3, Some("ws_b"), "moved on"),
        moving(4, None, "second step"),
    ];
    let items: Vec<(u64, &Outgoing)> = round.iter().zip(1..).map(|(o, seq)| (seq, o)).collect();
    let expect = |a: u64, b: u64| [("ws_a", a), ("ws_b", b), ("del-9", 0)];
    // A first round names the session.
    let first = SessionWriter::new(&js, &s.names()).await.expect("writer");
    fold(&first, 0, &items[..1]).await;
    // The second starts with an event naming only the conversation, then moves it; its
    // sessions cannot be stored (the bucket takes the small alias values, not sessions).
    let bucket = "KV_collab_work_sessions";
    let limit = |max: i32| {
        let js = js.clone();
        async move {
            let mut config = js
                .get_stream(bucket)
                .await
                .expect("the sessions bucket")
                .cached_info()
                .config
                .clone();
            config.max_message_size = max;
            js.update_stream(config).await.expect("the bucket's limit");
        }
    };
    limit(256).await;
    let failed = first.commit(events(0, &items[1..])).await;
    assert!(failed.is_err(), "the sessions were refused: {failed:?}");
    let alias = js
        .get_key_value("collab_work_sessions")
        .await
        .expect("the bucket")
        .get(collab_projector::bus::sessions::alias_key("del-9"))
        .await
        .expect("an alias read");
    assert!(
        alias.is_some_and(|v| String::from_utf8_lossy(&v).contains("ws_b")),
        "the failed attempt wrote the alias it moved"
    );
    limit(-1).await;
    let again = SessionWriter::new(&js, &s.names()).await.expect("writer");
    fold(&again, 0, &items[1..]).await;
    for (id, n) in expect(2, 2) {
        assert_eq!(
            event_count(&app, id).await,
            n,
            "{id} after the round folded again"
        );
    }
    let shorter = SessionWriter::new(&js, &s.names()).await.expect("writer");
    fold(&shorter, 0, &items[1..2]).await;
    fold(&shorter, 0, &items[2..]).await;
    for (id, n) in expect(2, 2) {
        assert_eq!(
            event_count(&app, id).await,
            n,
            "{id} after a shorter retry and the rest"
        );
    }
    let later = moving(5, None, "third step");
    fold(
        &SessionWriter::new(&js, &s.names()).await.expect("writer"),
        0,
        &[(5, &later)],
    )
    .await;
    for (id, n) in expect(2, 3) {
        assert_eq!(event_count(&app, id).await, n, "{id} after a later round");
    }
}

/// A fold that another has overtaken (a deposed owner of partition 0 that wakes up after the
/// next owner folded on) cannot set a conversation's alias back: its round fails, and events
/// after it still go to the session the later round moved the conversation to.
#[tokio::test]
async fn a_fold_overtaken_by_another_cannot_set_an_alias_back() {
    let (_nats, js, s) = setup().await;
    let app = api::router(state(&js, &s));
    let stream = [
        moving(1, Some("ws_a"), "start"),
        moving(2, None, "first step"),
        moving(3, Some("ws_c"), "aside"),
        moving(5, Some("ws_b"), "moved on"),
        moving(9, None, "next step"),
    ];
    let at = |seqs: &[u64]| -> Vec<(u64, &Outgoing)> {
        seqs.iter()
            .map(|seq| {
                let i = [1, 2, 3, 5, 9].iter().position(|s| s == seq).unwrap_or(0);
                (*seq, &stream[i])
            })
            .collect()
    };
    // The owner folds its first round, then is paused with the next one in hand.
    let deposed = SessionWriter::new(&js, &s.names()).await.expect("writer");
    fold(&deposed, 0, &at(&[1])).await;
    // The next owner folds from the same checkpoint on, and moves the conversation twice.
    let next_owner = SessionWriter::new(&js, &s.names()).await.expect("writer");
    fold(&next_owner, 0, &at(&[1, 2, 3])).await;
    fold(&next_owner, 0, &at(&[5])).await;
    // The deposed owner wakes up and writes the round it had read, from what it knew, and a
    // fresh fold from its old checkpoint reads the same round.
    for (who, writer) in [
        ("the deposed owner", deposed),
        (
            "a fresh writer",
            SessionWriter::new(&js, &s.names()).await.expect("writer"),
        ),
    ] {
        let late = writer.commit(events(0, &at(&[2, 3]))).await;
        let err = late.expect_err("an overtaken fold writes no alias");
        assert!(err.to_string().contains("later round"), "{who}: {err}");
    }
    fold(&next_owner, 0, &at(&[9])).await;
    assert_eq!(
        event_count(&app, "ws_b").await,
        2,
        "the move and the event after it"
    );
    assert_eq!(event_count(&app, "ws_c").await, 1);
    assert_eq!(
        event_count(&app, "ws_a").await,
        2,
        "the start and the first step"
    );
}

/// A deposed owner whose round started where the next owner's did, but read less of the
/// stream, keeps the moves the other read further when it writes the alias: events after both
/// go where the later move put the conversation.
#[tokio::test]
async fn a_shorter_round_from_the_same_start_keeps_the_moves_read_further() {
    let (_nats, js, s) = setup().await;
    let app = api::router(state(&js, &s));
    let (start, moved, after) = (
        moving(1, Some("ws_a"), "start"),
        moving(2, Some("ws_b"), "moved on"),
        moving(3, None, "next step"),
    );
    let next_owner = SessionWriter::new(&js, &s.names()).await.expect("writer");
    fold(&next_owner, 0, &[(1, &start), (2, &moved)]).await;
    // The deposed owner had read only the first projection of the same round.
    let deposed = SessionWriter::new(&js, &s.names()).await.expect("writer");
    fold(&deposed, 0, &[(1, &start)]).await;
    let fresh = SessionWriter::new(&js, &s.names()).await.expect("writer");
    fold(&fresh, 0, &[(3, &after)]).await;
    assert_eq!(
        event_count(&app, "ws_b").await,
        2,
        "the move and the event after it"
    );
    assert_eq!(event_count(&app, "ws_a").await, 1);
}

/// Aliases an earlier version stored (`conv.<conversation>`, the bare session id) are read for a
/// conversation that has no alias of this version yet, and, stored after this version's (that
/// version folded meanwhile, in a rolling upgrade or a rollback), are the newer of the two.
#[tokio::test]
async fn an_earlier_versions_alias_is_read_and_when_stored_later_is_the_newer() {
    let (_nats, js, s) = setup().await;
    let app = api::router(state(&js, &s));
    let bucket = js
        .get_key_value("collab_work_sessions")
        .await
        .expect("the bucket");
    let legacy = collab_projector::bus::sessions::legacy_alias_key("del-9");
    let writer = || async { SessionWriter::new(&js, &s.names()).await.expect("writer") };
    bucket
        .put(&legacy, "ws_old".into())
        .await
        .expect("an earlier version's alias");
    fold(&writer().await, 0, &[(2, &moving(2, None, "first step"))]).await;
    assert_eq!(
        event_count(&app, "ws_old").await,
        1,
        "the earlier version's alias"
    );
    fold(
        &writer().await,
        0,
        &[(3, &moving(3, Some("ws_a"), "named"))],
    )
    .await;
    fold(&writer().await, 0, &[(4, &moving(4, None, "second step"))]).await;
    assert_eq!(
        event_count(&app, "ws_a").await,
        2,
        "this version's alias, stored later"
    );
    bucket
        .put(&legacy, "ws_b".into())
        .await
        .expect("the earlier version folded meanwhile");
    fold(&writer().await, 0, &[(6, &moving(6, None, "third step"))]).await;
    assert_eq!(
        event_count(&app, "ws_b").await,
        1,
        "the earlier version's, stored later"
    );
    assert_eq!(event_count(&app, "ws_a").await, 2);
}

fn events(partition: u16, items: &[(u64, &Outgoing)]) -> Vec<(Envelope, Identity)> {
    let mut events = Vec::new();
    let mut last = None;
    let mut index = 0u32;
    for (seq, out) in items {
        index = if last == Some(*seq) { index + 1 } else { 0 };
        last = Some(*seq);
        let env: Envelope = serde_json::from_slice(&out.payload).expect("an envelope");
        let position = Position(*seq, index);
        events.push((
            env,
            Identity {
                partition,
                position,
            },
        ));
    }
    events
}

async fn fold(writer: &SessionWriter, partition: u16, items: &[(u64, &Outgoing)]) {
    writer
        .commit(events(partition, items))
        .await
        .expect("sessions written");
}

// ---------------------------------------------------------------------------------------------
// Large fields
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn large_fields_go_to_the_object_store_and_only_their_role_reads_them() {
    let (_nats, js, mut s) = setup().await;
    s.limits.max_inline_bytes = 4096;
    let (running, cancel) = start_worker(&s).await;

    // A 30 KB tool output (with a secret inside) and an 8 KB message in a main-main turn.
    let key = "sk-ant-api03-abcdefghijklmnopqrstuv";
    let stdout = format!(
        "{}\nauth: {key}\n{}",
        "line of output\n".repeat(2000),
        "end"
    );
    let tool = json!({"type": "tool.completed", "sessionId": "s-big", "runId": "r-1", "agentId": "ruda",
        "payload": {"toolCallId": "t1", "result": {"stdout": stdout, "exitCode": 0}}});
    publish(
        &js,
        "collab.raw.s-big.tool.completed",
        Bytes::from(tool.to_string()),
    )
    .await;
    let answer = "a long answer. ".repeat(550);
    let (subject, body) = collab_event(
        1,
        "a2a.send",
        "ruda",
        "eden",
        "conv-big",
        json!({"message": answer}),
    );
    publish(&js, &subject, body).await;
    drained(&js).await;

    let app = api::router(state(&js, &s));
    let page = ok(&app, "/api/events?key=s-big").await;
    let event = page["events"][0]["event"].clone();
    let reference = event["payload"]["result"]["stdout"].clone();
    let id = reference["$ref"]
        .as_str()
        .and_then(|r| r.strip_prefix("blob:"))
        .unwrap_or_else(|| panic!("the output was replaced by a reference: {event}"))
        .to_string();
    // Small fields stay where they were.
    assert_eq!(event["payload"]["result"]["exitCode"], 0, "{event}");
    assert_eq!(event["payload"]["toolCallId"], "t1", "{event}");
    assert!(
        !event.to_string().contains(key),
        "a secret in the projection: {event}"
    );
    let role: Role = serde_json::from_value(event["eventRole"].clone()).expect("a role");

    // Served whole, redacted, with the digest the reference announced.
    let (status, content) = call(&app, &format!("/api/blobs/{id}"), None).await;
    assert_eq!(status, StatusCode::OK, "{content}");
    let text = content.as_str().unwrap_or_default().to_string();
    assert!(text.starts_with("line of output"), "{text:.80}");
    assert!(!text.contains(key), "the blob holds the secret");
    assert!(text.contains("[redacted:"), "the secret's marker is kept");
    assert_eq!(reference["bytes"], json!(text.len()));
    use sha2::Digest;
    assert_eq!(
        reference["sha256"],
        json!(hex::encode(sha2::Sha256::digest(text.as_bytes())))
    );
    assert!(text.starts_with(reference["preview"].as_str().unwrap_or("-")));

    // The turn's send: same mechanism on the turn path.
    let sends = ok(&app, "/api/events?key=conv-big&type=a2a.send").await;
    let message = &sends["events"][0]["event"]["payload"]["message"];
    assert_eq!(message["bytes"], json!(answer.len()), "{sends}");

    // With access control on: the event's role reads it, another role gets 403.
    let other = Role::ALL
        .into_iter()
        .find(|r| *r != role)
        .expect("four roles");
    s.http.tokens = vec![
        TokenGrant {
            name: "owner".into(),
            token: "owner-token-1".into(),
            token_env: None,
            roles: vec![role],
        },
        TokenGrant {
            name: "other".into(),
            token: "other-token-2".into(),
            token_env: None,
            roles: vec![other],
        },
    ];
    let app = api::router(state(&js, &s));
    let path = format!("/api/blobs/{id}");
    let (status, served) = call(&app, &path, Some("owner-token-1")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(served, content);
    // Another role's blob is not there for this token, answered exactly as an unknown id is
    // (nothing says which role holds it, or that any does).
    let denied = err(
        &app,
        &path,
        Some("other-token-2"),
        StatusCode::NOT_FOUND,
        "not_found",
    )
    .await;
    let absent = err(
        &app,
        &path.replace(&id, &"0".repeat(64)),
        Some("other-token-2"),
        StatusCode::NOT_FOUND,
        "not_found",
    )
    .await;
    assert_eq!(
        denied["message"].as_str().map(|m| m.replace(&id, "<id>")),
        absent["message"]
            .as_str()
            .map(|m| m.replace(&"0".repeat(64), "<id>")),
        "{denied} / {absent}"
    );
    assert!(!denied.to_string().contains(role.as_str()), "{denied}");
    err(&app, &path, None, StatusCode::UNAUTHORIZED, "unauthorized").await;
    let unknown = format!("/api/blobs/{}", "0".repeat(64));
    err(
        &app,
        &unknown,
        Some("owner-token-1"),
        StatusCode::NOT_FOUND,
        "not_found",
    )
    .await;
    err(
        &app,
        "/api/blobs/..%2F..%2Fetc",
        Some("owner-token-1"),
        StatusCode::NOT_FOUND,
        "not_found",
    )
    .await;

    // The blobs live as long as the projections.
    let mut store = js
        .get_stream(format!("OBJ_{}", s.names().blobs_store))
        .await
        .expect("the object store's stream");
    let info = store.info().await.expect("its info");
    assert_eq!(info.config.max_age, s.projection.max_age);

    cancel.cancel();
    running.wait().await;
}
