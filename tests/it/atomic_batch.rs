//! What nats-server answers to an atomic batch (ADR-50, `allow_atomic`, 2.12+) whose messages
//! carry the pipeline's headers: a `Nats-Msg-Id` on each and the partition fence
//! (`Nats-Expected-Last-Subject-Sequence` with `-Subject`). Partitions store their outputs as
//! such batches on replicated streams (`nats.publish_batches`) and rely on each answer pinned
//! here: a server that answers otherwise fails here rather than in production.

use crate::fast_batch::{output_headers, stored_subjects};
use crate::support::{cluster3, cluster_client, local_nats};
use async_nats::jetstream;
use serde_json::Value;
use std::time::Duration;

/// One atomic batch of `count` messages on `ab.out.<tag>.<n>`, each with a Msg-Id
/// (`<tag>m<n>`, or the one before it for message `dup`) and the fence expectation (message
/// `fenced` expects a sequence the fence does not have). Returns the commit's answer.
async fn atomic_batch(
    client: &async_nats::Client,
    tag: &str,
    count: u64,
    fence_seq: u64,
    dup: u64,
    fenced: Option<u64>,
) -> Value {
    let id = format!("batch-{tag}");
    for seq in 1..=count {
        let mut headers = output_headers(tag, seq, dup, (fence_seq, fenced), "ab.fence");
        headers.insert("Nats-Batch-Id", id.as_str());
        headers.insert("Nats-Batch-Sequence", seq.to_string().as_str());
        let subject = format!("ab.out.{tag}.{seq}");
        let body = format!("body {seq}").into();
        if seq < count {
            client
                .publish_with_headers(subject, headers, body)
                .await
                .unwrap();
        } else {
            headers.insert("Nats-Batch-Commit", "1");
            let answer = client
                .request_with_headers(subject, headers, body)
                .await
                .unwrap();
            return serde_json::from_slice(&answer.payload).unwrap();
        }
    }
    Value::Null
}

async fn stream(js: &jetstream::Context, replicas: usize) -> jetstream::stream::Stream {
    js.create_stream(jetstream::stream::Config {
        allow_atomic_publish: true,
        num_replicas: replicas,
        ..crate::fast_batch::config("AB", "ab.>")
    })
    .await
    .unwrap()
}

fn err_code(answer: &Value) -> Option<u64> {
    answer["error"]["err_code"].as_u64()
}

#[tokio::test]
async fn an_atomic_batch_is_refused_whole_for_a_stored_msg_id_or_a_lost_fence() {
    let nats = local_nats().await;
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = jetstream::new(client.clone());
    let stream = stream(&js, 1).await;
    let fence = js.publish("ab.fence", "claim".into()).await.unwrap();
    let fence = fence.await.unwrap().sequence;

    // Every message fenced with the claim: stored whole, the ack naming the batch and its count.
    let answer = atomic_batch(&client, "a", 4, fence, 0, None).await;
    assert_eq!(answer["count"], 4, "{answer}");
    assert_eq!(answer["batch"], "batch-a", "{answer}");
    let mut want = vec![
        "ab.fence",
        "ab.out.a.1",
        "ab.out.a.2",
        "ab.out.a.3",
        "ab.out.a.4",
    ];
    assert_eq!(stored_subjects(&stream).await, want);

    // A Msg-Id stored before (the batch's first output, as after a takeover): nothing of the
    // batch is stored (10201); a publisher must send its outputs one at a time instead.
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "bm1");
    js.publish_with_headers("ab.out.b.1", headers, "earlier".into())
        .await
        .unwrap()
        .await
        .unwrap();
    want.push("ab.out.b.1");
    let answer = atomic_batch(&client, "b", 4, fence, 0, None).await;
    assert_eq!(err_code(&answer), Some(10201), "{answer}");
    assert_eq!(stored_subjects(&stream).await, want);

    // Two messages of one batch with the same Msg-Id: refused the same way.
    let answer = atomic_batch(&client, "c", 4, fence, 3, None).await;
    assert_eq!(err_code(&answer), Some(10201), "{answer}");
    assert_eq!(stored_subjects(&stream).await, want);

    // A lost fence on any message (here the third): wrong last sequence (10071), nothing stored.
    let answer = atomic_batch(&client, "d", 4, fence, 0, Some(3)).await;
    assert_eq!(err_code(&answer), Some(10071), "{answer}");
    assert_eq!(stored_subjects(&stream).await, want);
}

#[tokio::test]
async fn on_a_replicated_stream_one_fenced_batch_at_a_time_is_stored_and_a_second_is_refused_busy()
{
    let nodes = cluster3().await;
    let client = cluster_client(&nodes).await;
    let js = jetstream::new(client.clone());
    let stream = stream(&js, 3).await;
    // A new R3 stream answers once its leader is elected: claim the fence when it does.
    let mut fence = None;
    for _ in 0..100 {
        if let Ok(ack) = js.publish("ab.fence", "claim".into()).await {
            if let Ok(ack) = ack.await {
                fence = Some(ack.sequence);
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let fence = fence.expect("the R3 stream stores the fence within 10 s");

    // One after another: every batch stored, each as one proposal.
    for b in 0..3 {
        let answer = atomic_batch(&client, &format!("s{b}"), 20, fence, 0, None).await;
        assert_eq!(answer["count"], 20, "{answer}");
    }
    assert_eq!(stored_subjects(&stream).await.len(), 61);

    // Several at once on the same fence subject: the leader takes one expectation on a subject
    // at a time and refuses the others whole (10164), so a partition sends one batch at a time.
    let mut tasks = Vec::new();
    for b in 0..6 {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            atomic_batch(&client, &format!("p{b}"), 50, fence, 0, None).await
        }));
    }
    let mut stored = 0;
    for t in tasks {
        let answer = t.await.unwrap();
        match err_code(&answer) {
            None => {
                assert_eq!(answer["count"], 50, "{answer}");
                stored += 50;
            }
            Some(code) => assert_eq!(code, 10164, "{answer}"),
        }
    }
    assert!(stored >= 50, "no batch stored");
    assert_eq!(stored_subjects(&stream).await.len(), 61 + stored);
}

#[tokio::test]
async fn provision_allows_atomic_and_fast_batches_on_the_output_streams_even_existing_ones() {
    let nats = crate::support::TestNats::start().await;
    let url = nats.url();
    let js = nats.jetstream().await;
    let provision = || async {
        let (ok, out, err) =
            crate::pipeline::run_bin(&["provision", "--nats-url", &url], &[], b"").await;
        assert!(ok, "provision failed: {out}{err}");
    };
    provision().await;
    for name in [crate::pipeline::PROJ, crate::pipeline::DLQ] {
        let mut stream = js.get_stream(name).await.unwrap();
        let mut config = stream.info().await.unwrap().config.clone();
        assert!(
            config.allow_atomic_publish,
            "{name} created without atomic batches"
        );
        assert!(
            config.allow_batch_publish,
            "{name} created without fast batches"
        );
        // As a deployment made before batches has it.
        config.allow_atomic_publish = false;
        config.allow_batch_publish = false;
        js.update_stream(&config).await.unwrap();
        let now = stream.info().await.unwrap().config.clone();
        assert!(!now.allow_atomic_publish && !now.allow_batch_publish);
    }
    provision().await;
    for name in [crate::pipeline::PROJ, crate::pipeline::DLQ] {
        let mut stream = js.get_stream(name).await.unwrap();
        let config = stream.info().await.unwrap().config.clone();
        assert!(
            config.allow_atomic_publish && config.allow_batch_publish,
            "{name}: provision must allow both kinds of batch on an existing stream"
        );
    }
}
