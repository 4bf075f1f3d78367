//! Micro-benchmarks of the pure core: normalise, classify, the K1-A adapter, the turn book.
//!
//! `cargo bench --bench core` (add `-- --quick` for a fast pass). No I/O: what these cost per
//! message is the CPU floor of a worker; `collab-projector bench` measures the whole path
//! against nats-server (docs/performance.md).

// A micro-benchmark whose sample data does not behave as expected must stop, not measure.
#![allow(clippy::panic, clippy::expect_used, clippy::unwrap_used)]

use collab_projector::classify::{self, Fields, MainAgents};
use collab_projector::config::Names;
use collab_projector::ingest::{self, adapter, RawInput, SubjectInfo};
use collab_projector::model::{Envelope, RawEventRef};
use collab_projector::pipeline::{self, RawMessage};
use collab_projector::sessions;
use collab_projector::turns::{self, book::OpenTurns, TurnConfig};
use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use serde_json::Value;
use std::hint::black_box;
use std::time::Duration;

const SEND: &[u8] = br#"{"type":"a2a.send","agentId":"ruda","ts":1771329600000,"data":{"fromAgent":"ruda","toAgent":"eden","conversationId":"conv-42","workSessionId":"ws_1","runId":"run-42","message":"Please review the deploy plan.","goal":"review the deploy plan","timeoutMs":10000,"fromSessionType":"main","toSessionType":"main"}}"#;

const RESPONSE: &[u8] = br#"{"type":"a2a.response","agentId":"eden","ts":1771329600700,"data":{"fromAgent":"eden","toAgent":"ruda","conversationId":"conv-42","workSessionId":"ws_1","message":"goal: review the deploy plan\noutcome: success - done\nevidence: see run-42\nnext_action: none","fromSessionType":"main","toSessionType":"main"}}"#;

const RUNTIME: &[u8] = br#"{"type":"tool.started","sequence":2,"timestamp":1771329600005,"sessionId":"session-3","runId":"run-9","agentId":"ruda","payload":{"toolCallId":"call-9","name":"search"}}"#;

const PACKET: &[u8] = br#"{"protocol":"a2a","version":"0.2","event_type":"task.requested","timestamp":"2026-02-27T10:05:00Z","agent":{"id":"agent://coordinator","role":"orchestrator"},"task":{"id":"task-123","status":"requested","kind":"delegation"},"message":{"id":"msg-1","role":"assistant"}}"#;

fn settings() -> ingest::Settings {
    ingest::Settings {
        main_agents: MainAgents::new(["main", "ruda", "eden", "atlas"]),
        adapter_mode: adapter::AdapterMode::Lenient,
        adapter_limits: adapter::AdapterLimits::default(),
        max_payload_bytes: 1024 * 1024,
        shape: ingest::ShapeLimits {
            max_depth: 64,
            max_string_bytes: 1024 * 1024,
            max_object_keys: 10_000,
            max_array_items: 100_000,
        },
        redactor: std::sync::Arc::new(
            collab_projector::redact::Redactor::new(&[], &[]).expect("built-in redaction rules"),
        ),
        require_identity: false,
    }
}

fn input<'a>(bytes: &'a [u8], key: &str, event_type: &str) -> RawInput<'a> {
    RawInput {
        bytes,
        subject: Some(SubjectInfo {
            key: key.to_string(),
            type_suffix: event_type.to_string(),
        }),
        raw_ref: Some(RawEventRef {
            stream: "COLLAB_RAW".into(),
            seq: 17,
            subject: format!("collab.raw.{key}.{event_type}"),
            stored_at: "2026-02-17T12:00:00.120Z".into(),
        }),
        relay: Default::default(),
    }
}

fn normalize(c: &mut Criterion) {
    let s = settings();
    let mut g = c.benchmark_group("normalize");
    let send = input(SEND, "conv-42", "a2a.send");
    g.bench_function("collab a2a.send", |b| {
        b.iter(|| ingest::normalize(black_box(&send), &s))
    });
    let response = input(RESPONSE, "conv-42", "a2a.response");
    g.bench_function("collab a2a.response", |b| {
        b.iter(|| ingest::normalize(black_box(&response), &s))
    });
    let runtime = input(RUNTIME, "session-3", "tool.started");
    g.bench_function("runtime tool.started", |b| {
        b.iter(|| ingest::normalize(black_box(&runtime), &s))
    });
    let packet = input(PACKET, "task-123", "a2a.packet");
    g.bench_function("adapter packet", |b| {
        b.iter(|| ingest::normalize(black_box(&packet), &s))
    });
    g.finish();

    // The whole pure path of a worker for one message: normalise, classify, serialise.
    let names = Names::new("collab");
    let raw = RawMessage {
        bytes: SEND,
        stream: "COLLAB_RAW",
        seq: 17,
        stored_subject: "collab.in.1.1.5.5.21.21.85.213.conv-42.a2a.send",
        stored_at: chrono::Utc::now(),
        delivered: 1,
        headers: None,
        producer: Default::default(),
    };
    c.bench_function("pipeline::project a2a.send", |b| {
        b.iter(|| pipeline::project(black_box(&raw), &names, &s, 10))
    });

    // What the work-session fold parses of each stored projection: the whole envelope, or only
    // what it folds.
    let mut g = c.benchmark_group("fold parse");
    for (name, bytes, subject) in [
        (
            "a2a.send",
            SEND,
            "collab.in.1.1.5.5.21.21.85.213.conv-42.a2a.send",
        ),
        (
            "tool.started",
            RUNTIME,
            "collab.in.1.1.5.5.21.21.85.213.session-3.tool.started",
        ),
    ] {
        let raw = RawMessage {
            bytes,
            stored_subject: subject,
            producer: Default::default(),
            ..raw
        };
        let stored = pipeline::project(&raw, &names, &s, 10)
            .pop()
            .expect("a projection")
            .payload;
        g.bench_function(format!("whole envelope {name}"), |b| {
            b.iter(|| serde_json::from_slice::<Envelope>(black_box(&stored)))
        });
        g.bench_function(format!("fold fields {name}"), |b| {
            b.iter(|| sessions::envelope_for_fold(black_box(&stored)))
        });
    }
    g.finish();
}

fn classify_bench(c: &mut Criterion) {
    let main = MainAgents::new(["main", "ruda", "eden", "atlas"]);
    let send: Value = serde_json::from_slice(SEND).unwrap_or_default();
    let runtime: Value = serde_json::from_slice(RUNTIME).unwrap_or_default();
    let empty = serde_json::Map::new();
    let send_obj = send.as_object().unwrap_or(&empty);
    let runtime_obj = runtime.as_object().unwrap_or(&empty);
    let mut g = c.benchmark_group("classify");
    g.bench_function("a2a.send main-main", |b| {
        b.iter(|| classify::classify("a2a.send", &Fields::new(black_box(send_obj)), &main))
    });
    g.bench_function("tool.started", |b| {
        b.iter(|| classify::classify("tool.started", &Fields::new(black_box(runtime_obj)), &main))
    });
    g.finish();
}

fn adapter_bench(c: &mut Criterion) {
    let limits = adapter::AdapterLimits::default();
    let packet: Value = serde_json::from_slice(PACKET).unwrap_or_default();
    let mut g = c.benchmark_group("adapter");
    g.bench_function("convert task.requested", |b| {
        b.iter(|| {
            adapter::convert(
                black_box(&packet),
                PACKET.len(),
                adapter::AdapterMode::Lenient,
                &limits,
            )
        })
    });
    g.bench_function("convert_bytes task.requested", |b| {
        b.iter(|| adapter::convert_bytes(black_box(PACKET), adapter::AdapterMode::Strict, &limits))
    });
    g.finish();
}

fn turn_book(c: &mut Criterion) {
    let cfg = TurnConfig {
        default_timeout: Duration::from_secs(300),
        max_timeout: Duration::from_secs(3600),
        run_timeout: Duration::from_secs(600),
        early_hold: Duration::from_secs(300),
    };
    let send: Value = serde_json::from_slice(SEND).unwrap_or_default();
    let response: Value = serde_json::from_slice(RESPONSE).unwrap_or_default();
    let empty = serde_json::Map::new();
    let facts = |v: &Value, t: &str, seq: u64| {
        turns::facts(
            v.as_object().unwrap_or(&empty),
            t,
            "conv-42",
            "conv-42",
            seq,
            1_771_329_600_120,
            &format!("collab.raw.conv-42.{t}"),
        )
    };
    let (Some(send_facts), Some(response_facts)) = (
        facts(&send, "a2a.send", 17),
        facts(&response, "a2a.response", 18),
    ) else {
        panic!("the sample events must yield turn facts");
    };
    let open = turns::on_event(None, &send_facts, &cfg)
        .write
        .map(|(r, _)| r)
        .unwrap_or_else(|| panic!("a send must open the turn"));

    let mut g = c.benchmark_group("turns");
    g.bench_function("facts a2a.send", |b| {
        b.iter(|| facts(black_box(&send), "a2a.send", 17))
    });
    g.bench_function("on_event send (opens)", |b| {
        b.iter(|| turns::on_event(None, black_box(&send_facts), &cfg))
    });
    g.bench_function("on_event response (decides)", |b| {
        b.iter(|| turns::on_event(Some((&open, 1)), black_box(&response_facts), &cfg))
    });
    g.bench_function("on_deadline", |b| {
        b.iter(|| turns::on_deadline((black_box(&open), 1)))
    });
    g.bench_function("record to KV json", |b| {
        b.iter(|| serde_json::to_vec(black_box(&open)))
    });
    g.finish();

    // The deadline set at the scale of one partition with 100k turns open in 64 partitions.
    // The open turns a partition keeps (as `bus::turns::PartitionTurns` does, 64 full records).
    let mut g = c.benchmark_group("open turns");
    let mut open: OpenTurns<u64> = OpenTurns::new(64);
    for i in 0..1_600i64 {
        open.open(&format!("p5.conv-{i}.0"), Some(1_000_000 + i * 10), 1, None);
    }
    let mut next = 0i64;
    g.bench_function("open + close (1600 open)", |b| {
        b.iter(|| {
            next += 1;
            let key = format!("p5.new-{next}.0");
            open.open(&key, Some(2_000_000 + next), 2, None);
            open.close(&key);
        })
    });
    g.bench_function("expire 100 of 1600", |b| {
        b.iter_batched_ref(
            || open.clone(),
            |o| o.expire(1_000_000 + 100 * 10),
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

criterion_group!(benches, normalize, classify_bench, adapter_bench, turn_book);
criterion_main!(benches);
