//! Operator commands against a real server: `audit`, `dlq replay`, and discovery through the NATS
//! service API.

use crate::pipeline::{count, default_partitions, publish, run_bin, start_projector, wait_settled};
use crate::support::{wait_until, TestNats};
use std::time::Duration;

const GUARD: Duration = Duration::from_secs(60);

#[tokio::test]
async fn audit_holds_after_a_mixed_run_and_replay_reprojects_fixed_dead_letters() {
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let projector = start_projector(&nats.url(), &["--main-agents", "ruda,eden"], &[]).await;

    // Two good events, one bad_key (conversation c1 published under key "wrong").
    publish(
        &js,
        "collab.raw.t1.task.created",
        r#"{"type":"task.created","taskId":"t1"}"#,
    )
    .await;
    publish(
        &js,
        "collab.raw.ruda.health.ping",
        r#"{"type":"health.ping"}"#,
    )
    .await;
    let misrouted = r#"{"type":"task.updated","eventRole":"orchestration.tsak","taskId":"t1"}"#;
    publish(&js, "collab.raw.t1.task.updated", misrouted).await;
    wait_settled(&js, 2, 1).await;

    let url = nats.url();
    let (ok, out, err) = run_bin(&["audit", "--nats-url", &url], &[], b"").await;
    assert!(ok, "audit should hold: {out}\n{err}");
    assert!(
        out.contains("3 messages, 2 projected, 1 dead-lettered, 0 both, 0 neither"),
        "{out}"
    );
    assert!(out.contains("dead letters invalid_role: 1"), "{out}");

    // A dry run publishes nothing; a real replay republishes to the producer's subject, where the
    // (unchanged) message is dead-lettered again: replay is a no-loss loop, not a silent drop.
    let (ok, out, _) = run_bin(
        &["dlq", "replay", "--nats-url", &url, "--dry-run"],
        &[],
        b"",
    )
    .await;
    assert!(ok && out.contains("would replay 1 dead letters"), "{out}");
    let raw_before = count(&js, "COLLAB_RAW").await;
    assert_eq!(raw_before, 3);
    let (ok, out, err) = run_bin(
        &[
            "dlq",
            "replay",
            "--nats-url",
            &url,
            "--reason",
            "invalid_role",
        ],
        &[],
        b"",
    )
    .await;
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("replayed 1 dead letters"), "{out}");
    assert_eq!(
        count(&js, "COLLAB_RAW").await,
        4,
        "the dead letter went back to the raw stream"
    );
    wait_until(GUARD, "the replayed message is dead-lettered again", || {
        let js = js.clone();
        async move { count(&js, "COLLAB_DLQ").await == 2 }
    })
    .await;
    let (ok, out, err) = run_bin(&["audit", "--nats-url", &url], &[], b"").await;
    assert!(ok, "{out}\n{err}");
    assert!(
        out.contains("4 messages, 2 projected, 2 dead-lettered, 0 both, 0 neither"),
        "{out}"
    );
    // Replaying again within the duplicate window publishes nothing new.
    let (ok, _, _) = run_bin(
        &[
            "dlq",
            "replay",
            "--nats-url",
            &url,
            "--reason",
            "invalid_role",
        ],
        &[],
        b"",
    )
    .await;
    assert!(ok);
    assert_eq!(
        count(&js, "COLLAB_RAW").await,
        5,
        "the second dead letter is new, the first collapses"
    );
    drop(projector);
}

#[tokio::test]
async fn audit_fails_when_a_raw_message_was_never_processed() {
    let nats = TestNats::start().await;
    let js = nats.jetstream().await;
    let url = nats.url();
    // Provision only: nothing consumes, so the message is neither projected nor dead-lettered.
    let (ok, _, err) = run_bin(&["provision", "--nats-url", &url], &[], b"").await;
    assert!(ok, "{err}");
    publish(
        &js,
        "collab.raw.t1.task.created",
        r#"{"type":"task.created"}"#,
    )
    .await;
    let (ok, out, _) = run_bin(&["audit", "--nats-url", &url], &[], b"").await;
    assert!(!ok, "audit must fail: {out}");
    assert!(
        out.contains("neither (lost, or not processed yet): 1"),
        "{out}"
    );
}

#[tokio::test]
async fn workers_answer_the_nats_service_api() {
    let nats = TestNats::start().await;
    let client = nats.client().await;
    let projector = start_projector(&nats.url(), &[], &[]).await;
    let reply = client
        .request("$SRV.PING.collab-projector", "".into())
        .await
        .expect("a worker answers $SRV.PING");
    let ping: serde_json::Value = serde_json::from_slice(&reply.payload).expect("JSON");
    assert_eq!(ping["name"], "collab-projector");
    assert_eq!(ping["version"], env!("CARGO_PKG_VERSION"));
    let partitions = default_partitions();
    wait_until(GUARD, "the worker owns every partition", || {
        let client = client.clone();
        async move {
            match client.request("collab-projector.status", "".into()).await {
                Ok(m) => serde_json::from_slice::<serde_json::Value>(&m.payload)
                    .map(|v| {
                        v["partitionsOwned"] == partitions && v["partitionsRunning"] == partitions
                    })
                    .unwrap_or(false),
                Err(_) => false,
            }
        }
    })
    .await;
    drop(projector);
}
