//! The K1-A adapter on the bus: A2A adapter packets published raw come out as canonical
//! `assay.adapter.a2a.*` projections (byte-compatible payloads), or as dead letters.

use serde_json::Value;

use crate::pipeline::{
    assert_dead_letter, publish, start_projector, the_one, Stored, DLQ, MAIN_AGENTS, PROJ,
};
use crate::support::TestNats;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/assay-adr026");

fn fixture_bytes(name: &str) -> Vec<u8> {
    let path = format!("{FIXTURES}/{name}");
    std::fs::read(&path).unwrap_or_else(|e| panic!("could not read {path}: {e}"))
}

/// A golden payload with this crate's version in place of the placeholder.
fn golden(name: &str) -> String {
    let text = String::from_utf8(fixture_bytes(name)).expect("golden files are UTF-8");
    assert!(
        text.contains("\"<version>\""),
        "{name} has no version placeholder"
    );
    text.replace(
        "\"<version>\"",
        &format!("\"{}\"", env!("CARGO_PKG_VERSION")),
    )
}

/// The projection's payload equals the golden file: as a value, and byte for byte when
/// pretty-printed (so the assay key order is kept too).
fn assert_payload_is_golden(m: &Stored, golden_name: &str) -> Value {
    let env = m.json();
    let expected_text = golden(golden_name);
    let expected: Value = serde_json::from_str(&expected_text).expect("golden is JSON");
    assert_eq!(
        env["payload"], expected,
        "payload differs from {golden_name}"
    );
    let pretty = serde_json::to_string_pretty(&env["payload"]).expect("serialises") + "\n";
    assert_eq!(
        pretty, expected_text,
        "payload key order differs from {golden_name}"
    );
    env
}

async fn publish_fixture(js: &async_nats::jetstream::Context, name: &str) -> (u64, Vec<u8>) {
    let body = fixture_bytes(name);
    let seq = publish(js, "collab.raw.k1.anything", body.clone()).await;
    (seq, body)
}

#[tokio::test]
async fn happy_packets_project_with_canonical_payloads_by_role() {
    let nats = TestNats::start().await;
    let _projector = start_projector(&nats.url(), &MAIN_AGENTS, &[]).await;
    let js = nats.jetstream().await;

    let (task_seq, _) = publish_fixture(&js, "a2a_happy_task_requested.json").await;
    let (caps_seq, _) = publish_fixture(&js, "a2a_happy_agent_capabilities.json").await;
    let (art_seq, _) = publish_fixture(&js, "a2a_happy_artifact_shared.json").await;

    // A delegation request is a visible handoff: delegation.subagent, under the producer's key.
    let m = the_one(
        &js,
        PROJ,
        "collab.proj.delegation.subagent.k1.assay.adapter.a2a.task.requested",
    )
    .await;
    let env = assert_payload_is_golden(&m, "a2a_happy_task_requested.lenient.expected.json");
    assert_eq!(env["type"], "assay.adapter.a2a.task.requested");
    assert_eq!(env["eventRole"], "delegation.subagent");
    assert_eq!(env["taskId"], "task-123");
    assert_eq!(env["agentId"], "agent://coordinator");
    assert_eq!(env["rawEventRef"]["subject"], "collab.raw.k1.anything");
    assert_eq!(env["rawEventRef"]["seq"].as_u64(), Some(task_seq));
    assert_eq!(m.must_header("Collab-Event-Role"), "delegation.subagent");
    assert_eq!(
        m.must_header("Collab-Event-Type"),
        "assay.adapter.a2a.task.requested"
    );
    assert_eq!(m.source_seq(), task_seq);

    let m = the_one(
        &js,
        PROJ,
        "collab.proj.system.observability.k1.assay.adapter.a2a.agent.capabilities",
    )
    .await;
    let env = assert_payload_is_golden(&m, "a2a_happy_agent_capabilities.lenient.expected.json");
    assert_eq!(env["eventRole"], "system.observability");
    assert_eq!(m.source_seq(), caps_seq);

    let m = the_one(
        &js,
        PROJ,
        "collab.proj.orchestration.task.k1.assay.adapter.a2a.artifact.shared",
    )
    .await;
    let env = assert_payload_is_golden(&m, "a2a_happy_artifact_shared.lenient.expected.json");
    assert_eq!(env["eventRole"], "orchestration.task");
    assert_eq!(m.source_seq(), art_seq);

    assert_eq!(crate::pipeline::count(&js, DLQ).await, 0);
}

/// The malformed packet is not JSON: `bad_json` whatever the adapter mode.
async fn malformed_is_bad_json(js: &async_nats::jetstream::Context) {
    let (seq, body) = publish_fixture(js, "a2a_negative_malformed.json").await;
    let dl = the_one(js, DLQ, "collab.dlq.bad_json").await;
    assert_dead_letter(&dl, "bad_json", &body, "collab.raw.k1.anything", seq);
}

#[tokio::test]
async fn strict_mode_dead_letters_a_missing_task_id() {
    let nats = TestNats::start().await;
    let _projector = start_projector(
        &nats.url(),
        &MAIN_AGENTS,
        &[("COLLAB_ADAPTER__MODE", "strict")],
    )
    .await;
    let js = nats.jetstream().await;

    let (seq, body) = publish_fixture(&js, "a2a_negative_missing_task_id.json").await;
    let dl = the_one(&js, DLQ, "collab.dlq.adapter_rejected").await;
    let detail = assert_dead_letter(
        &dl,
        "adapter_rejected",
        &body,
        "collab.raw.k1.anything",
        seq,
    );
    assert!(
        detail.contains("task.id"),
        "the detail must name task.id: {detail}"
    );

    // The happy packet still projects in strict mode.
    publish_fixture(&js, "a2a_happy_task_requested.json").await;
    let m = the_one(
        &js,
        PROJ,
        "collab.proj.delegation.subagent.k1.assay.adapter.a2a.task.requested",
    )
    .await;
    assert_payload_is_golden(&m, "a2a_happy_task_requested.strict.expected.json");

    malformed_is_bad_json(&js).await;
}

#[tokio::test]
async fn lenient_mode_projects_a_missing_task_id_without_a_visible_task_ref() {
    let nats = TestNats::start().await;
    let _projector = start_projector(
        &nats.url(),
        &MAIN_AGENTS,
        &[("COLLAB_ADAPTER__MODE", "lenient")],
    )
    .await;
    let js = nats.jetstream().await;

    let (seq, _) = publish_fixture(&js, "a2a_negative_missing_task_id.json").await;
    let m = the_one(
        &js,
        PROJ,
        "collab.proj.delegation.subagent.k1.assay.adapter.a2a.task.requested",
    )
    .await;
    let env = assert_payload_is_golden(&m, "a2a_negative_missing_task_id.lenient.expected.json");
    assert_eq!(env["payload"]["handoff"]["task_ref_visible"], false);
    assert_eq!(env["payload"]["handoff"]["visible"], true);
    assert_eq!(m.source_seq(), seq);

    malformed_is_bad_json(&js).await;
    assert_eq!(
        crate::pipeline::count(&js, DLQ).await,
        1,
        "only the malformed packet is dead-lettered in lenient mode"
    );
}
