//! `bench` end to end with tiny sizes: every part runs against a real server and reports
//! something. No timing thresholds: figures on a shared test machine mean nothing.

use crate::support::TestNats;
use collab_projector::bench::{self, BenchOptions, Part};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_scenario_reports_a_throughput_and_the_report_is_json() {
    let nats = TestNats::start().await;
    let opts = BenchOptions {
        nats_url: Some(nats.url()),
        messages: 300,
        naive_messages: 60,
        latency_rate: 200,
        latency_duration: Duration::from_secs(1),
        open_turns: vec![200],
        lateness_probes: 10,
        probe_timeout: Duration::from_millis(500),
        partitions: 4,
        parts: Part::ALL.to_vec(),
        progress: false,
        ..Default::default()
    };
    let report = bench::run(opts).await.expect("bench runs");

    let ids: Vec<u8> = report.throughput.iter().map(|t| t.id).collect();
    assert_eq!(
        ids,
        vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
        "one row per throughput scenario"
    );
    for t in &report.throughput {
        assert!(t.msg_per_s > 0.0, "{}: {t:?}", t.scenario);
        assert!(t.inputs > 0, "{}: {t:?}", t.scenario);
    }
    // The fold's breakdown rows ran without it, and the full pipeline with it.
    let row = |id: u8| report.throughput.iter().find(|t| t.id == id);
    for id in [7, 8] {
        assert_eq!(row(id).and_then(|t| t.kv_session_writes), Some(0), "{id}");
        assert_eq!(row(id).and_then(|t| t.fold_behind), None, "{id}");
    }
    for id in [2, 3] {
        let t = row(id).expect("the row");
        assert!(t.fold_behind.is_some(), "{id}: {t:?}");
        assert!(t.fold_catch_up_s.is_some(), "the fold caught up: {t:?}");
        assert!(t.folded_worker_us_per_input.is_some(), "{t:?}");
    }
    for id in [2, 3] {
        assert!(
            row(id)
                .and_then(|t| t.kv_session_writes)
                .is_some_and(|w| w > 0),
            "{id}: {:?}",
            row(id)
        );
    }
    assert!(report.ratios.mixed_over_baseline.is_some());
    // The ceiling published the pure core's projections: an input of the mix makes at least one.
    for id in [9, 10] {
        let t = row(id).expect("the ceiling's row");
        assert!(t.outputs >= t.inputs, "{id}: {t:?}");
    }
    assert!(report.ratios.ceiling_mixed_over_baseline.is_some());
    // Every input format through the full pipeline, with the work-session fold.
    let all = row(11).expect("the all-formats row");
    assert!(all.fold_behind.is_some(), "{all:?}");
    assert!(report.ratios.protocols_over_baseline.is_some());
    assert!(report.ratios.baseline_over_naive.is_some());
    assert_eq!(report.latency.len(), 2);
    for l in &report.latency {
        assert!(l.measured > 0, "{l:?}");
    }
    assert_eq!(report.turn_book.len(), 1);
    let book = &report.turn_book[0];
    assert_eq!(book.reloaded, Some(200), "{book:?}");
    assert!(book.worker_recovery_s.is_some(), "{book:?}");
    // The turn bucket's stream holds each record with its key and the server's overhead: a few
    // hundred bytes, what sizing `storage.turns_max_bytes` is based on.
    assert!(
        book.stored_bytes_per_turn
            .is_some_and(|b| (100.0..2_000.0).contains(&b)),
        "{book:?}"
    );
    assert!(book.lateness_answered > 0, "{book:?}");

    let json = serde_json::to_string(&report).expect("serialises");
    let back: serde_json::Value = serde_json::from_str(&json).expect("the JSON parses");
    assert!(back["throughput"].as_array().is_some_and(|a| a.len() == 11));
    assert!(back["targets"].as_array().is_some_and(|a| !a.is_empty()));
    assert!(bench::render(&report).contains("baseline passthrough"));
    // The report names how the code that ran was built: this test's own profile.
    let built = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    assert_eq!(back["machine"]["build"], built, "{}", back["machine"]);
    let line = bench::summary_line(&report);
    assert!(line.contains(&format!(" build={built} ")), "{line}");
    assert!(!line.ends_with(" protocols_ratio=-"), "{line}");
}

/// Over raw shards every stream numbers its own inputs from 1: the latency runs match each
/// output to its input by stream and sequence (the pipeline's as `audit` does, a turn's
/// response by its subject's key), and leave out the barriers provisioning writes. Run as a process of its own, since the
/// shard count is read from the environment.
#[test]
fn latency_over_shards_matches_every_input_to_its_output() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_collab-projector"))
        .args([
            "bench",
            "--only",
            "latency",
            "--rate",
            "300",
            "--latency-duration",
            "3s",
            "--partitions",
            "4",
            "--quiet",
            "--json",
        ])
        .env("COLLAB_NATS__SHARDS", "4")
        .env("COLLAB_STORAGE__RAW_MAX_BYTES", "67108864")
        .output()
        .expect("the bench runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("the report is JSON");
    let runs = report["latency"].as_array().expect("latency runs");
    assert_eq!(runs.len(), 2, "{report}");
    for run in runs {
        let sent = run["sent"].as_u64().expect("sent");
        assert!(sent >= 600, "{run}");
        assert_eq!(run["measured"].as_u64(), Some(sent), "{run}");
    }
}
