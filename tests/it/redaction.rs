//! The redaction corpus (`fixtures/redaction/`) through a real nats-server and the real binary:
//! no secret of any case appears in a projection, a dead letter (body or headers), a bucket
//! value, a blob, or an API answer (`/api/events`, `/api/work-sessions`, `?format=mplp`).

use async_nats::jetstream::Context;
use futures::{StreamExt, TryStreamExt};
use serde_json::Value;

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

/// Publish `cases` to a fresh server with a projector running, then look for every secret in
/// everything it wrote and answers.
async fn run_corpus(cases: &[Case]) {
    let nats = TestNats::start().await;
    let projector = start_projector(
        &nats.url(),
        &MAIN_AGENTS,
        &[
            ("RUST_LOG", "collab_projector=debug,info"),
            // A large field goes to the object store: it must be redacted there too.
            ("COLLAB_LIMITS__MAX_INLINE_BYTES", "1024"),
        ],
    )
    .await;
    let js = nats.jetstream().await;
    let mut inputs = 0u64;
    for case in cases {
        publish_case(&js, case).await;
        inputs += case.messages.len() as u64;
    }
    // Every input is projected (at least one projection each); none is dead-lettered.
    wait_settled(&js, inputs, 0).await;
    assert_eq!(count(&js, DLQ).await, 0, "no corpus input is dead-lettered");
    let sessions_expected = cases.iter().any(|c| {
        c.messages
            .iter()
            .any(|m| m.to_string().contains("ws-redaction"))
    });
    if sessions_expected {
        wait_until(GUARD, "the work session ws-redaction", || {
            let js = js.clone();
            async move {
                bucket_values(&js, "collab_work_sessions")
                    .await
                    .iter()
                    .any(|v| v.contains("ws-redaction"))
            }
        })
        .await;
    }

    let mut everywhere: Vec<(String, String)> = Vec::new();
    let projections = read_all(&js, PROJ, "collab.proj.>").await;
    assert!(projections.len() as u64 >= inputs, "{}", projections.len());
    for m in projections {
        everywhere.push((
            format!("projection {}", m.subject),
            String::from_utf8_lossy(&m.payload).into_owned(),
        ));
    }
    for m in read_all(&js, DLQ, "collab.dlq.>").await {
        everywhere.push((
            format!("dead letter {} headers", m.subject),
            format!("{:?}", m.headers),
        ));
        everywhere.push((
            format!("dead letter {}", m.subject),
            String::from_utf8_lossy(&m.payload).into_owned(),
        ));
    }
    for bucket in ["collab_work_sessions", "collab_turns"] {
        for v in bucket_values(&js, bucket).await {
            everywhere.push((format!("bucket {bucket}"), v));
        }
    }
    let stored = blobs(&js).await;
    if cases.iter().any(|c| c.name.contains("truncated_pem")) {
        assert!(
            !stored.is_empty(),
            "the large field was moved to the object store"
        );
    }
    for (name, text) in stored {
        everywhere.push((format!("blob {name}"), text));
    }
    let addr = http_addr(&projector);
    let mut paths = vec![
        "/api/events?limit=1000".to_string(),
        "/api/events?view=debug&limit=1000".to_string(),
        "/api/work-sessions".to_string(),
    ];
    if sessions_expected {
        paths.push("/api/work-sessions/ws-redaction".into());
        paths.push("/api/work-sessions/ws-redaction?format=mplp".into());
    }
    for path in &paths {
        everywhere.push((format!("GET {path}"), get(&addr, path).await));
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
        everywhere.push((format!("SSE {path}"), sse(&addr, &path).await));
    }
    everywhere.push(("the worker's log".into(), projector.log_text()));

    let mut leaks = Vec::new();
    for case in cases {
        for secret in &case.secrets {
            for (place, text) in &everywhere {
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
        .find(|(p, _)| p == "GET /api/events?limit=1000")
        .map(|(_, t)| t.clone())
        .unwrap_or_default();
    assert!(events.contains("[redacted:"), "{events:.400}");
}

#[tokio::test]
async fn no_secret_of_the_corpus_reaches_any_output() {
    let cases: Vec<Case> = corpus().into_iter().filter(|c| !c.streamed).collect();
    assert!(cases.len() >= 8, "{} cases", cases.len());
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
