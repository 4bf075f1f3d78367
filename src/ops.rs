//! Operator commands over the streams: `audit` (every raw sequence is projected or
//! dead-lettered, never both, never neither) and `dlq replay` (republish dead letters to the
//! subject their producer used, after a fix).

use crate::config::Names;
use crate::pipeline::{H_SOURCE_SEQ, H_SOURCE_SUBJECT};
use async_nats::jetstream::{self, consumer, message::PublishMessage};
use futures::StreamExt;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// An operator command's failure. The client library's error is kept as the source, with its
/// kind, so a caller can tell a missing stream from a timeout without reading message text.
#[derive(Debug, thiserror::Error)]
pub enum OpsError {
    #[error("stream {stream}: {source}")]
    Stream {
        stream: String,
        #[source]
        source: crate::bus::error::Source,
    },
    #[error("publishing to {subject}: {source}")]
    Publish {
        subject: String,
        #[source]
        source: crate::bus::error::Source,
    },
}

fn stream_err(stream: &str, e: impl Into<crate::bus::error::Source>) -> OpsError {
    OpsError::Stream {
        stream: stream.to_string(),
        source: e.into(),
    }
}

/// Every message of `stream` from `start` up to its last sequence at the time of the call (see
/// [`each_message`]).
pub(crate) async fn read_stream(
    js: &jetstream::Context,
    stream: &str,
    start: u64,
    headers_only: bool,
) -> Result<Vec<jetstream::Message>, OpsError> {
    let mut out = Vec::new();
    each_message(js, stream, start, headers_only, |m| out.push(m.clone())).await?;
    Ok(out)
}

/// Call `f` with every message of `stream` from `start` up to its last sequence at the time of
/// the call, in order, holding one at a time. A read that stops before the last sequence is an
/// error, never a shorter answer.
pub(crate) async fn each_message(
    js: &jetstream::Context,
    stream: &str,
    start: u64,
    headers_only: bool,
    mut f: impl FnMut(&jetstream::Message),
) -> Result<u64, OpsError> {
    let mut s = js
        .get_stream(stream)
        .await
        .map_err(|e| stream_err(stream, e))?;
    let info = s.info().await.map_err(|e| stream_err(stream, e))?;
    let last = info.state.last_sequence;
    if info.state.messages == 0 || start > last {
        return Ok(0);
    }
    let name = format!("read-{}", uuid::Uuid::new_v4().simple());
    let consumer = s
        .create_consumer(consumer::pull::OrderedConfig {
            name: Some(name.clone()),
            deliver_policy: consumer::DeliverPolicy::ByStartSequence {
                start_sequence: start.max(1),
            },
            headers_only,
            ..Default::default()
        })
        .await
        .map_err(|e| stream_err(stream, e))?;
    let read = async {
        let mut messages = consumer
            .messages()
            .await
            .map_err(|e| stream_err(stream, e))?;
        let mut n = 0u64;
        loop {
            let m = match tokio::time::timeout(Duration::from_secs(10), messages.next()).await {
                Ok(Some(Ok(m))) => m,
                Ok(Some(Err(e))) => return Err(stream_err(stream, e)),
                Ok(None) | Err(_) => {
                    return Err(stream_err(
                        stream,
                        format!("the read stopped before sequence {last}"),
                    ))
                }
            };
            let seq = m.info().map(|i| i.stream_sequence).unwrap_or(u64::MAX);
            f(&m);
            n += 1;
            if seq >= last {
                return Ok(n);
            }
        }
    }
    .await;
    let _ = s.delete_consumer(&name).await;
    read
}

fn header_u64(m: &jetstream::Message, name: &str) -> Option<u64> {
    m.headers.as_ref()?.get(name)?.as_str().parse().ok()
}

/// The result of an audit over a range of raw sequences.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Audit {
    pub from: u64,
    pub to: u64,
    pub raw: usize,
    pub projected: usize,
    pub dead_lettered: usize,
    /// Both projected and dead-lettered: a broken promise (raw sequences, `<stream>:<seq>` over
    /// shards).
    pub both: Vec<String>,
    /// Neither (yet): lost, or not processed yet.
    pub neither: Vec<String>,
    pub dlq_by_reason: BTreeMap<String, usize>,
}

impl Audit {
    pub fn holds(&self) -> bool {
        self.both.is_empty() && self.neither.is_empty()
    }
}

/// Check "exactly one of projected and dead-lettered" for raw sequences `from..=to` (`to` 0 = the
/// last) of every raw stream (over shards, the range applies to each one's own sequences; an
/// input is then named `<stream>:<seq>`).
pub async fn audit(
    js: &jetstream::Context,
    names: &Names,
    from: u64,
    to: u64,
) -> Result<Audit, OpsError> {
    // Every set of raw streams on the server, the sealed ones of earlier reshards too.
    let found = crate::bus::generations::discover(js, names)
        .await
        .map_err(|e| stream_err(&names.raw_stream, e))?;
    let names = &crate::bus::generations::with_generations(names, &found);
    let all = names.all_raw_streams();
    let sharded = all.len() > 1;
    let index_of = |stream: &str| all.iter().position(|r| *r == stream);
    let mut raw_seqs: BTreeSet<(usize, u64)> = BTreeSet::new();
    for (i, stream) in all.iter().enumerate() {
        for m in read_stream(js, stream, from, true).await? {
            // A barrier is not an input (see `bus::reader`): nothing projects it.
            if crate::bus::acker::is_barrier(&m) {
                continue;
            }
            if let Ok(info) = m.info() {
                if to == 0 || info.stream_sequence <= to {
                    raw_seqs.insert((i, info.stream_sequence));
                }
            }
        }
    }
    // An output's input: its sequence header, in the raw stream `projection_input_stream` or
    // `dead_letter_stream` names.
    let mut projected = BTreeSet::new();
    for m in read_stream(js, &names.proj_stream, 1, true).await? {
        if let Some(seq) = header_u64(&m, H_SOURCE_SEQ) {
            let shard = projection_input_stream(names, m.subject.as_str(), seq)
                .and_then(index_of)
                .unwrap_or(0);
            projected.insert((shard, seq));
        }
    }
    let mut dead = BTreeSet::new();
    let mut by_reason: BTreeMap<String, usize> = BTreeMap::new();
    for m in read_stream(js, &names.dlq_stream, 1, true).await? {
        if let Some(seq) = header_u64(&m, H_SOURCE_SEQ) {
            let shard = dead_letter_stream(names, m.headers.as_ref())
                .and_then(|s| index_of(&s))
                .unwrap_or(0);
            if raw_seqs.contains(&(shard, seq)) {
                let reason = m
                    .subject
                    .as_str()
                    .rsplit('.')
                    .next()
                    .unwrap_or("?")
                    .to_string();
                *by_reason.entry(reason).or_default() += 1;
            }
            dead.insert((shard, seq));
        }
    }
    let name = |(i, seq): (usize, u64)| {
        if sharded {
            format!("{}:{seq}", all.get(i).copied().unwrap_or("?"))
        } else {
            seq.to_string()
        }
    };
    let mut a = Audit {
        from,
        to: raw_seqs.iter().map(|(_, s)| *s).max().unwrap_or(to),
        raw: raw_seqs.len(),
        dlq_by_reason: by_reason,
        ..Default::default()
    };
    for input in &raw_seqs {
        match (projected.contains(input), dead.contains(input)) {
            (true, true) => a.both.push(name(*input)),
            (false, false) => a.neither.push(name(*input)),
            (true, false) => a.projected += 1,
            (false, true) => a.dead_lettered += 1,
        }
    }
    Ok(a)
}

/// The raw stream that held the input of the projection on `subject` whose source sequence is
/// `seq`: the one its subject's key was in at that sequence.
pub(crate) fn projection_input_stream<'a>(
    names: &'a Names,
    subject: &str,
    seq: u64,
) -> Option<&'a str> {
    let after = subject.strip_prefix(&format!("{}.proj.", names.prefix))?;
    let (_, key, _) = crate::config::proj_subject_parts(after)?;
    Some(names.raw_stream_of_key_at(key, seq))
}

/// The raw stream a dead letter's input is in: its source-stream header, else its Msg-Id.
pub(crate) fn dead_letter_stream(
    names: &Names,
    headers: Option<&async_nats::HeaderMap>,
) -> Option<String> {
    let headers = headers?;
    if let Some(s) = headers.get(crate::bus::publish::H_SOURCE_STREAM) {
        return Some(s.as_str().to_string());
    }
    let id = headers.get("Nats-Msg-Id")?;
    names
        .input_of_msg_id(id.as_str())
        .map(|(stream, _)| stream.to_string())
}

/// The whole input a shortened dead letter stands for, from the raw stream (`None` once the
/// stream no longer keeps it, or when its digest differs).
async fn original_input(
    js: &jetstream::Context,
    names: &Names,
    dead_letter: &jetstream::Message,
) -> Option<bytes::Bytes> {
    use sha2::Digest;
    let seq = header_u64(dead_letter, H_SOURCE_SEQ)?;
    let source = dead_letter_stream(names, dead_letter.headers.as_ref())
        .unwrap_or_else(|| names.raw_stream.clone());
    let stream = js.get_stream(&source).await.ok()?;
    let raw = stream.get_raw_message(seq).await.ok()?;
    let want = dead_letter
        .headers
        .as_ref()?
        .get(crate::bus::publish::H_SOURCE_SHA256)?
        .as_str()
        .to_string();
    (hex::encode(sha2::Sha256::digest(&raw.payload)) == want).then_some(raw.payload)
}

/// What a replay did.
#[derive(Debug, Default, Clone)]
pub struct Replay {
    pub replayed: usize,
    pub skipped: usize,
}

/// Republish dead letters (optionally of one reason) to their producer subject.
///
/// Dead letters stay in the DLQ stream (its retention removes them): they are the evidence
/// `audit` needs for the original raw sequences. A replay republishes with a Msg-Id derived from
/// the dead letter, so running it twice within the duplicate window publishes once.
pub async fn dlq_replay(
    js: &jetstream::Context,
    names: &Names,
    reason: Option<&str>,
    dry_run: bool,
) -> Result<Replay, OpsError> {
    let mut report = Replay::default();
    for m in read_stream(js, &names.dlq_stream, 1, false).await? {
        if crate::bus::publish::is_fence_subject(m.subject.as_str()) {
            continue;
        }
        let this_reason = m.subject.as_str().rsplit('.').next().unwrap_or("");
        if reason.is_some_and(|r| r != this_reason) {
            continue;
        }
        let Some(subject) = m
            .headers
            .as_ref()
            .and_then(|h| h.get(H_SOURCE_SUBJECT))
            .map(|v| v.as_str().to_string())
        else {
            report.skipped += 1;
            continue;
        };
        let dlq_seq = m.info().map(|i| i.stream_sequence).unwrap_or(0);
        if dry_run {
            report.replayed += 1;
            continue;
        }
        // A dead letter too large to carry its input keeps an excerpt: the input is read back
        // from the raw stream while it is retained there.
        let payload = match m
            .headers
            .as_ref()
            .filter(|h| h.get(crate::bus::publish::H_DLQ_TRUNCATED).is_some())
        {
            None => m.payload.clone(),
            Some(_) => match original_input(js, names, &m).await {
                Some(bytes) => bytes,
                None => {
                    report.skipped += 1;
                    continue;
                }
            },
        };
        let publish = PublishMessage::build()
            .payload(payload)
            .message_id(format!("replay:{}:{dlq_seq}", names.dlq_stream));
        let ack = js
            .send_publish(subject.clone(), publish)
            .await
            .map_err(|e| OpsError::Publish {
                subject: subject.clone(),
                source: e.into(),
            })?;
        ack.await.map_err(|e| OpsError::Publish {
            subject: subject.clone(),
            source: e.into(),
        })?;
        report.replayed += 1;
    }
    Ok(report)
}
