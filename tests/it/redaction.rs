//! The redaction corpus (`fixtures/redaction/`) through a real nats-server and the real binary:
//! no secret of any case appears in a projection, a dead letter's headers (and, but for the cases
//! built to be dead-lettered, whose dead letters keep the original bytes by design, its body), a
//! bucket value, a blob, an API answer (`/api/events`, every work session `/api/work-sessions`
//! lists, alone and `?format=mplp`), an event stream or a log; also when the A2A and AG-UI cases
//! come through real `collab-projector relay` processes, whose logs are searched too.

use std::collections::BTreeMap;
use std::sync::Arc;

use async_nats::jetstream::Context;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::Response;
use futures::{StreamExt, TryStreamExt};
use serde_json::{json, Value};

use crate::pipeline::{
    count, publish, read_all, start_projector, wait_settled, DLQ, GUARD, MAIN_AGENTS, PROJ,
};
use crate::support::{wait_until, Projector, TestNats};

const CORPUS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/redaction");

/// One corpus file.
struct Case {
    name: String,
    subjects: Vec<String>,
    headers: Vec<(String, String)>,
    streamed: bool,
    /// Built to be dead-lettered: every message goes to the dead-letter stream.
    dead_letter: bool,
    messages: Vec<Value>,
    secrets: Vec<String>,
}

fn corpus() -> Vec<Case> {
    let mut paths: Vec<_> = std::fs::read_dir(CORPUS)
        .unwrap_or_else(|e| panic!("{CORPUS}: {e}"))
        .map(|e| e.unwrap_or_else(|e| panic!("{CORPUS}: {e}")).path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    paths.sort();
    paths
        .iter()
        .map(|p| {
            let name = p.display().to_string();
            let text = std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{name}: {e}"));
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
            let strings = |field: &str| -> Vec<String> {
                v[field]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .filter_map(Value::as_str)
                            .map(String::from)
                            .collect()
                    })
                    .unwrap_or_default()
            };
            let messages = v["messages"].as_array().cloned().unwrap_or_default();
            assert!(
                v.get("subject").is_none() || v.get("subjects").is_none(),
                "{name}: `subject` or `subjects`, not both"
            );
            let subjects = match v["subject"].as_str() {
                Some(s) => vec![s.to_string(); messages.len()],
                None => strings("subjects"),
            };
            assert_eq!(
                subjects.len(),
                messages.len(),
                "{name}: one subject per message"
            );
            let headers = v["headers"]
                .as_object()
                .map(|h| {
                    h.iter()
                        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                        .collect()
                })
                .unwrap_or_default();
            let case = Case {
                name,
                subjects,
                headers,
                streamed: v["streamed"].as_bool().unwrap_or(false),
                dead_letter: v["dead_letter"].as_bool().unwrap_or(false),
                messages,
                secrets: strings("secrets"),
            };
            assert!(
                !case.messages.is_empty() && !case.secrets.is_empty(),
                "{}: messages and secrets",
                case.name
            );
            for secret in &case.secrets {
                assert!(
                    text.contains(secret.as_str()),
                    "{}: the secret {secret:?} is not in its input",
                    case.name
                );
            }
            case
        })
        .collect()
}

async fn publish_case(js: &Context, case: &Case) {
    for (subject, body) in case.subjects.iter().zip(&case.messages) {
        let bytes = serde_json::to_vec(body).unwrap_or_else(|e| panic!("{}: {e}", case.name));
        if case.headers.is_empty() {
            publish(js, subject, bytes).await;
            continue;
        }
        let mut headers = async_nats::HeaderMap::new();
        for (k, v) in &case.headers {
            headers.insert(k.as_str(), v.as_str());
        }
        js.publish_with_headers(subject.clone(), headers, bytes.into())
            .await
            .unwrap_or_else(|e| panic!("{}: publish: {e}", case.name))
            .await
            .unwrap_or_else(|e| panic!("{}: not acknowledged: {e}", case.name));
    }
}

async fn bucket_values(js: &Context, bucket: &str) -> Vec<String> {
    let Ok(kv) = js.get_key_value(bucket).await else {
        return Vec::new();
    };
    let keys: Vec<String> = match kv.keys().await {
        Ok(keys) => keys.try_collect().await.unwrap_or_default(),
        Err(_) => Vec::new(),
    };
    let mut values = Vec::new();
    for k in keys {
        if let Ok(Some(v)) = kv.get(&k).await {
            values.push(String::from_utf8_lossy(&v).into_owned());
        }
    }
    values.sort();
    values
}

async fn blobs(js: &Context) -> Vec<(String, String)> {
    let Ok(store) = js.get_object_store("collab_blobs").await else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let mut listed = store
        .list()
        .await
        .unwrap_or_else(|e| panic!("the blob list: {e}"));
    while let Some(info) = listed.next().await {
        let info = info.unwrap_or_else(|e| panic!("a blob's info: {e}"));
        let mut object = store
            .get(&info.name)
            .await
            .unwrap_or_else(|e| panic!("blob {}: {e}", info.name));
        let mut data = Vec::new();
        tokio::io::AsyncReadExt::read_to_end(&mut object, &mut data)
            .await
            .unwrap_or_else(|e| panic!("blob {}: {e}", info.name));
        out.push((info.name, String::from_utf8_lossy(&data).into_owned()));
    }
    out
}

async fn get(addr: &str, path: &str) -> String {
    let resp = reqwest::get(format!("http://{addr}{path}"))
        .await
        .unwrap_or_else(|e| panic!("GET {path}: {e}"));
    assert!(resp.status().is_success(), "GET {path}: {}", resp.status());
    resp.text().await.unwrap_or_default()
}

/// What an event stream sends within two seconds of opening (from the start of the stream).
async fn sse(addr: &str, path: &str) -> String {
    let resp = reqwest::get(format!("http://{addr}{path}"))
        .await
        .unwrap_or_else(|e| panic!("GET {path}: {e}"));
    let status = resp.status();
    if !status.is_success() {
        panic!(
            "GET {path}: {status} {}",
            resp.text().await.unwrap_or_default()
        );
    }
    let mut body = resp.bytes_stream();
    let mut text = String::new();
    let until = tokio::time::Instant::now() + std::time::Duration::from_secs(2);
    while let Ok(Some(Ok(chunk))) = tokio::time::timeout_at(until, body.next()).await {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(
        text.contains("data:"),
        "GET {path} sent no event: {text:.300}"
    );
    text
}

fn http_addr(p: &Projector) -> String {
    p.log_text()
        .lines()
        .find_map(|l| l.split("http listening on ").nth(1))
        .map(|a| a.trim().to_string())
        .unwrap_or_else(|| panic!("the projector printed no HTTP address: {}", p.log_text()))
}

/// A projector on a fresh server, redacting large fields into the object store too.
async fn projector_on(nats: &TestNats) -> Projector {
    start_projector(
        &nats.url(),
        &MAIN_AGENTS,
        &[
            ("RUST_LOG", "collab_projector=debug,info"),
            // A large field goes to the object store: it must be redacted there too.
            ("COLLAB_LIMITS__MAX_INLINE_BYTES", "1024"),
        ],
    )
    .await
}

/// Publish `cases` to a fresh server with a projector running, then look for every secret in
/// everything it wrote and answers.
async fn run_corpus(cases: &[Case]) {
    let nats = TestNats::start().await;
    let projector = projector_on(&nats).await;
    let js = nats.jetstream().await;
    let mut inputs = 0u64;
    let mut dead = 0u64;
    for case in cases {
        publish_case(&js, case).await;
        let n = case.messages.len() as u64;
        if case.dead_letter {
            dead += n;
        } else {
            inputs += n;
        }
    }
    // Every input is projected (at least one projection each); only the cases built for it are
    // dead-lettered.
    wait_settled(&js, inputs, dead).await;
    assert_eq!(
        count(&js, DLQ).await,
        dead,
        "only the dead-letter cases are dead-lettered"
    );
    if dead > 0 {
        check_dead_letters(&js, cases).await;
    }
    search(&js, &projector, cases, inputs, Vec::new()).await;
}

/// The dead letters of the cases built for them: their bodies are the original bytes (by
/// design: `dlq replay` resends them), their reason and detail headers are there, and every
/// detail that quotes the input quotes it redacted.
async fn check_dead_letters(js: &Context, cases: &[Case]) {
    let letters = read_all(js, DLQ, "collab.dlq.>").await;
    let originals: Vec<Vec<u8>> = cases
        .iter()
        .filter(|c| c.dead_letter)
        .flat_map(|c| c.messages.iter())
        .map(|m| serde_json::to_vec(m).unwrap_or_else(|e| panic!("{e}")))
        .collect();
    assert_eq!(letters.len(), originals.len());
    let mut reasons = Vec::new();
    for m in &letters {
        assert!(
            originals.iter().any(|o| o.as_slice() == m.payload.as_ref()),
            "a dead letter keeps its input's bytes: {}",
            String::from_utf8_lossy(&m.payload)
        );
        reasons.push(m.must_header("Collab-Dlq-Reason"));
        let detail = m.must_header("Collab-Dlq-Detail");
        assert!(
            detail.contains("[redacted:"),
            "the detail quotes the input redacted: {detail}"
        );
        m.must_header("Collab-Source-Subject");
        m.must_header("Collab-Source-Seq");
    }
    reasons.sort();
    assert_eq!(reasons, ["bad_type", "invalid_role"]);
}

/// Every place the projector (and `logs`: other processes' logs) wrote to or answers from, and
/// no secret of `cases` in any of them. `inputs` raw messages were projected.
async fn search(
    js: &Context,
    projector: &Projector,
    cases: &[Case],
    inputs: u64,
    logs: Vec<(String, String)>,
) {
    // Work sessions come from collaboration events (a conversation, a work session id); wait
    // until the fold has written them.
    let sessions = cases.iter().any(|c| {
        c.messages.iter().any(|m| {
            let text = m.to_string();
            text.contains("conversationId") || text.contains("contextId")
        })
    });
    if sessions {
        // Folded when the bucket holds sessions and stays the same for a second.
        wait_until(GUARD, "the corpus's work sessions are folded", || {
            let js = js.clone();
            async move {
                let before = bucket_values(&js, "collab_work_sessions").await;
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                !before.is_empty() && bucket_values(&js, "collab_work_sessions").await == before
            }
        })
        .await;
    }
    // (place, text, whether it is a dead letter's body)
    let mut everywhere: Vec<(String, String, bool)> = Vec::new();
    let projections = read_all(js, PROJ, "collab.proj.>").await;
    assert!(projections.len() as u64 >= inputs, "{}", projections.len());
    for m in projections {
        everywhere.push((
            format!("projection {}", m.subject),
            String::from_utf8_lossy(&m.payload).into_owned(),
            false,
        ));
    }
    for m in read_all(js, DLQ, "collab.dlq.>").await {
        everywhere.push((
            format!("dead letter {} headers", m.subject),
            format!("{:?}", m.headers),
            false,
        ));
        everywhere.push((
            format!("dead letter {}", m.subject),
            String::from_utf8_lossy(&m.payload).into_owned(),
            true,
        ));
    }
    for bucket in ["collab_work_sessions", "collab_turns"] {
        for v in bucket_values(js, bucket).await {
            everywhere.push((format!("bucket {bucket}"), v, false));
        }
    }
    let stored = blobs(js).await;
    if cases.iter().any(|c| c.name.contains("truncated_pem")) {
        assert!(
            !stored.is_empty(),
            "the large field was moved to the object store"
        );
    }
    for (name, text) in stored {
        everywhere.push((format!("blob {name}"), text, false));
    }
    let addr = http_addr(projector);
    let mut paths = vec![
        "/api/events?limit=1000".to_string(),
        "/api/events?view=debug&limit=1000".to_string(),
        "/api/work-sessions?limit=1000".to_string(),
    ];
    // Every work session the list shows, alone and as MPLP.
    let list: Value = serde_json::from_str(&get(&addr, "/api/work-sessions?limit=1000").await)
        .unwrap_or_else(|e| panic!("a session list: {e}"));
    let ids: Vec<String> = list["sessions"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s["id"].as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default();
    if sessions {
        assert!(!ids.is_empty(), "the corpus makes work sessions: {list}");
    }
    for id in &ids {
        let mut url = reqwest::Url::parse("http://placeholder/api/work-sessions")
            .unwrap_or_else(|e| panic!("{e}"));
        url.path_segments_mut()
            .unwrap_or_else(|()| panic!("an http URL has segments"))
            .push(id);
        paths.push(url.path().to_string());
        paths.push(format!("{}?format=mplp", url.path()));
    }
    for path in &paths {
        everywhere.push((format!("GET {path}"), get(&addr, path).await, false));
    }
    {
        // Every event, from the oldest on: the page's `oldest` cursor is just before it.
        let page: Value = serde_json::from_str(&get(&addr, "/api/events?limit=1").await)
            .unwrap_or_else(|e| panic!("an events page: {e}"));
        let oldest = page["oldest"]
            .as_str()
            .map(String::from)
            .unwrap_or_else(|| page["oldest"].to_string());
        let path = format!("/api/events/stream?after={oldest}");
        everywhere.push((format!("SSE {path}"), sse(&addr, &path).await, false));
    }
    everywhere.push(("the worker's log".into(), projector.log_text(), false));
    for (place, text) in logs {
        everywhere.push((place, text, false));
    }

    let mut leaks = Vec::new();
    for case in cases {
        for secret in &case.secrets {
            for (place, text, dead_letter_body) in &everywhere {
                // A dead letter's body is its input's bytes, on purpose.
                if *dead_letter_body && case.dead_letter {
                    continue;
                }
                if text.contains(secret.as_str()) {
                    leaks.push(format!("{}: {secret:?} in {place}", case.name));
                }
            }
        }
    }
    assert!(leaks.is_empty(), "secrets leaked:\n{}", leaks.join("\n"));
    // The markers are there: the inputs were projected, redacted, not dropped.
    let events = everywhere
        .iter()
        .find(|(p, _, _)| p == "GET /api/events?limit=1000")
        .map(|(_, t, _)| t.clone())
        .unwrap_or_default();
    assert!(events.contains("[redacted:"), "{events:.400}");
}

#[tokio::test]
async fn no_secret_of_the_corpus_reaches_any_output() {
    let cases: Vec<Case> = corpus().into_iter().filter(|c| !c.streamed).collect();
    assert!(cases.len() >= 8, "{} cases", cases.len());
    assert!(
        cases.iter().any(|c| c.dead_letter),
        "a case is built to be dead-lettered"
    );
    run_corpus(&cases).await;
}

/// Secrets split over AG-UI deltas are caught only where the worker feeds each partition's
/// deltas through a `StreamRedactor` (`ingest::normalize_streamed`).
#[tokio::test]
async fn no_secret_split_over_streamed_deltas_reaches_any_output() {
    let cases: Vec<Case> = corpus().into_iter().filter(|c| c.streamed).collect();
    assert!(cases.len() >= 2, "{} cases", cases.len());
    run_corpus(&cases).await;
}

/// The agent behind the relays: an A2A agent (under `/a2a`) that answers every send with a
/// message, and an AG-UI agent (under `/agui`) that streams the events of the corpus case whose
/// thread the run input names.
async fn corpus_agent(agui: BTreeMap<String, Vec<Value>>) -> String {
    async fn handle(
        State(agui): State<Arc<BTreeMap<String, Vec<Value>>>>,
        req: Request,
    ) -> Response {
        let path = req.uri().path().to_string();
        let body = axum::body::to_bytes(req.into_body(), usize::MAX)
            .await
            .unwrap_or_else(|e| panic!("a request body: {e}"));
        let input: Value = serde_json::from_slice(&body).unwrap_or_default();
        let (content_type, text) = if path.starts_with("/agui") {
            let thread = input["threadId"].as_str().unwrap_or_default();
            let frames: String = agui
                .get(thread)
                .unwrap_or_else(|| panic!("no AG-UI case for thread {thread:?}"))
                .iter()
                .map(|e| format!("data: {e}\n\n"))
                .collect();
            ("text/event-stream", frames)
        } else {
            let context = input["params"]["message"]["contextId"].clone();
            let answer = json!({"jsonrpc": "2.0", "id": input["id"], "result": {
                "kind": "message", "role": "agent", "messageId": "answer-1", "contextId": context,
                "parts": [{"kind": "text", "text": "configured"}]}});
            ("application/json", answer.to_string())
        };
        Response::builder()
            .header("content-type", content_type)
            .body(Body::from(text))
            .unwrap_or_else(|e| panic!("{e}"))
    }
    let router = axum::Router::new()
        .fallback(handle)
        .with_state(Arc::new(agui));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    format!("http://{addr}")
}

/// The A2A wire case and the AG-UI cases as real traffic: each A2A request body is sent by a
/// caller through `relay a2a` (the agent's answer is published beside it), each AG-UI case is
/// the event stream of a run through `relay agui`. The relays publish what the agent accepted;
/// nothing of it may leak anywhere, the relays' logs (at debug level) included.
#[tokio::test]
async fn no_secret_of_the_corpus_relayed_by_real_relays_reaches_any_output() {
    let cases: Vec<Case> = corpus()
        .into_iter()
        .filter(|c| {
            c.subjects
                .iter()
                .all(|s| s.ends_with(".a2a.wire") || s.ends_with(".agui"))
        })
        .collect();
    let a2a: Vec<&Case> = cases
        .iter()
        .filter(|c| c.subjects.iter().all(|s| s.ends_with(".a2a.wire")))
        .collect();
    let agui: BTreeMap<String, Vec<Value>> = cases
        .iter()
        .filter(|c| c.subjects.iter().all(|s| s.ends_with(".agui")))
        .map(|c| {
            let thread = c.messages[0]["threadId"]
                .as_str()
                .unwrap_or_else(|| panic!("{}: the run names its thread", c.name))
                .to_string();
            (thread, c.messages.clone())
        })
        .collect();
    assert!(!a2a.is_empty(), "the A2A data-part case");
    assert!(
        cases.iter().any(|c| c.streamed && c.name.contains("agui")),
        "an AG-UI streamed case"
    );

    let nats = TestNats::start().await;
    let projector = projector_on(&nats).await;
    let js = nats.jetstream().await;
    let agent = corpus_agent(agui.clone()).await;
    let a2a_relay = crate::relay::start_relay(
        "a2a",
        &nats.url(),
        &format!("{agent}/a2a"),
        &["--from-agent", "ruda", "--to-agent", "eden"],
    )
    .await;
    let agui_relay = crate::relay::start_relay(
        "agui",
        &nats.url(),
        &format!("{agent}/agui"),
        &["--from-agent", "webui", "--to-agent", "researcher"],
    )
    .await;
    let http = reqwest::Client::new();
    let mut published = 0u64;
    for case in &a2a {
        for request in &case.messages {
            let answer = http
                .post(a2a_relay.url("/"))
                .header("content-type", "application/json")
                .body(request.to_string())
                .send()
                .await
                .unwrap_or_else(|e| panic!("{}: {e}", case.name));
            assert!(answer.status().is_success(), "{}", case.name);
            answer.bytes().await.unwrap_or_else(|e| panic!("{e}"));
            // The request and the agent's answer.
            published += 2;
        }
    }
    for (thread, events) in &agui {
        let input = json!({"threadId": thread, "runId": events[0]["runId"], "state": {},
            "tools": [], "context": [], "forwardedProps": {}, "messages": []});
        let answer = http
            .post(agui_relay.url("/"))
            .header("content-type", "application/json")
            .header("accept", "text/event-stream")
            .body(input.to_string())
            .send()
            .await
            .unwrap_or_else(|e| panic!("{thread}: {e}"));
        assert!(answer.status().is_success(), "{thread}");
        answer.bytes().await.unwrap_or_else(|e| panic!("{e}"));
        published += events.len() as u64;
    }
    wait_until(GUARD, "the relays published every message", || {
        let js = js.clone();
        async move {
            let mut raw = js
                .get_stream("COLLAB_RAW")
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            raw.info()
                .await
                .is_ok_and(|i| i.state.messages >= published)
        }
    })
    .await;
    wait_settled(&js, published, 0).await;
    assert_eq!(count(&js, DLQ).await, 0, "nothing relayed is dead-lettered");
    let logs = vec![
        (
            "the A2A relay's log".to_string(),
            a2a_relay.process.log_text(),
        ),
        (
            "the AG-UI relay's log".to_string(),
            agui_relay.process.log_text(),
        ),
    ];
    search(&js, &projector, &cases, published, logs).await;
}
