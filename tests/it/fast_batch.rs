//! What nats-server does with a fast-ingest batch (ADR-50, `allow_batched`, 2.14+) whose
//! messages carry the pipeline's headers: a `Nats-Msg-Id` seen before, and the partition fence
//! (`Nats-Expected-Last-Subject-Sequence` with `-Subject`). The publisher can batch its outputs
//! only if the server keeps both guarantees inside a batch; this pins what it answers, so a
//! server that answers otherwise fails here rather than in production (docs/performance.md).

use crate::support::local_nats;
use async_nats::jetstream;
use futures::StreamExt;
use serde_json::Value;
use std::time::Duration;

/// Publish `count` messages as one fast batch (gap mode `fail`, a flow ack every 10); message
/// `dup` repeats the Msg-Id of the one before it and message `fenced` expects a fence sequence
/// that is not the fence's. Returns everything the server answered on the batch's inbox.
async fn fast_batch(
    client: &async_nats::Client,
    fence_seq: u64,
    count: u64,
    dup: u64,
    fenced: Option<u64>,
) -> Vec<Value> {
    let inbox = client.new_inbox();
    let mut answers = client.subscribe(format!("{inbox}.>")).await.unwrap();
    for seq in 1..=count {
        let op = match seq {
            1 => 0,
            s if s == count => 2,
            _ => 1,
        };
        let headers = output_headers("", seq, dup, (fence_seq, fenced), "fb.fence");
        client
            .publish_with_reply_and_headers(
                format!("fb.out.{seq}"),
                format!("{inbox}.10.fail.{seq}.{op}.$FI"),
                headers,
                format!("body {seq}").into(),
            )
            .await
            .unwrap();
    }
    client.flush().await.unwrap();
    let mut out = Vec::new();
    // Every answer the server gives comes within a second on loopback; the terminal one (a
    // publish ack, or an error) has no `type`.
    while let Ok(Some(m)) = tokio::time::timeout(Duration::from_secs(2), answers.next()).await {
        out.push(serde_json::from_slice(&m.payload).unwrap());
    }
    out
}

/// The headers of message `seq` as the pipeline sends an output: a Msg-Id (`<tag>m<seq>`, the
/// one before it for message `dup`) and the fence on `fence_subject`, expecting `fence_seq`
/// (a sequence the fence does not have for message `fenced`).
pub(crate) fn output_headers(
    tag: &str,
    seq: u64,
    dup: u64,
    (fence_seq, fenced): (u64, Option<u64>),
    fence_subject: &str,
) -> async_nats::HeaderMap {
    let mut headers = async_nats::HeaderMap::new();
    let id = if seq == dup { seq - 1 } else { seq };
    headers.insert("Nats-Msg-Id", format!("{tag}m{id}").as_str());
    let expected = if Some(seq) == fenced {
        fence_seq + 100
    } else {
        fence_seq
    };
    headers.insert(
        "Nats-Expected-Last-Subject-Sequence",
        expected.to_string().as_str(),
    );
    headers.insert("Nats-Expected-Last-Subject-Sequence-Subject", fence_subject);
    headers
}

/// A stream `name` over `subjects` keeping Msg-Ids for two minutes.
pub(crate) fn config(name: &str, subjects: &str) -> jetstream::stream::Config {
    jetstream::stream::Config {
        name: name.into(),
        subjects: vec![subjects.into()],
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    }
}

async fn stream(js: &jetstream::Context) -> jetstream::stream::Stream {
    js.create_stream(jetstream::stream::Config {
        allow_batch_publish: true,
        ..config("FB", "fb.>")
    })
    .await
    .unwrap()
}

/// The subjects of every message `stream` holds, in stream order.
pub(crate) async fn stored_subjects(stream: &jetstream::stream::Stream) -> Vec<String> {
    let last = stream.get_info().await.unwrap().state.last_sequence;
    let mut subjects = Vec::new();
    for seq in 1..=last {
        if let Ok(m) = stream.get_raw_message(seq).await {
            subjects.push(m.subject.to_string());
        }
    }
    subjects
}

#[tokio::test]
async fn a_fast_batch_drops_a_duplicate_msg_id_silently_and_stops_at_a_lost_fence() {
    let nats = local_nats().await;
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = jetstream::new(client.clone());
    let stream = stream(&js).await;
    let fence = js.publish("fb.fence", "claim".into()).await.unwrap();
    let fence = fence.await.unwrap().sequence;

    // A duplicate alone: not stored, not reported; the batch commits.
    let answers = fast_batch(&client, fence, 6, 4, None).await;
    let last = answers.last().unwrap();
    assert!(
        last.get("type").is_none() && last.get("error").is_none(),
        "{answers:?}"
    );
    assert!(
        answers
            .iter()
            .all(|a| a.get("type").and_then(Value::as_str) != Some("err")),
        "a duplicate was reported: {answers:?}"
    );
    let subjects = stored_subjects(&stream).await;
    assert_eq!(
        subjects,
        ["fb.fence", "fb.out.1", "fb.out.2", "fb.out.3", "fb.out.5", "fb.out.6"],
        "the duplicate (message 4) must be the one left out"
    );

    // A lost fence at message 4: an `err` naming it (wrong last sequence, 10071), a terminal
    // ack for what was stored before it, and nothing of the batch stored after it.
    js.delete_stream("FB").await.unwrap();
    let stream = self::stream(&js).await;
    let fence = js.publish("fb.fence", "claim".into()).await.unwrap();
    let fence = fence.await.unwrap().sequence;
    let answers = fast_batch(&client, fence, 8, 0, Some(4)).await;
    let err = answers
        .iter()
        .find(|a| a.get("type").and_then(Value::as_str) == Some("err"))
        .unwrap_or_else(|| panic!("no err for the fenced message: {answers:?}"));
    assert_eq!(err["seq"], 4, "{answers:?}");
    assert_eq!(err["error"]["err_code"], 10071, "{answers:?}");
    assert_eq!(
        stored_subjects(&stream).await,
        ["fb.fence", "fb.out.1", "fb.out.2", "fb.out.3"],
        "{answers:?}"
    );
}
