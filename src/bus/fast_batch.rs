//! Fast-ingest batches (ADR-50; nats-server 2.14 and later, `allow_batched` on the stream): a
//! partition's group of outputs sent as one batch whose messages the server stores as they
//! arrive, in batch order, with gap detection. With gap mode `fail` the server stores no
//! message of a batch after one it did not receive: a publish lost with a dropped connection
//! stops its batch there, so the outputs queued behind it, which the client sends on the new
//! connection, are refused rather than stored ahead of it. What a batch stored is always a
//! prefix of it, and the server says how long (`count` in its final answer).
//!
//! The batch and its place in it travel in each message's reply subject
//! (`<inbox>.<batch id>.<flow>.<gap mode>.<batch seq>.<op>.$FI`); the server answers there:
//! flow acknowledgements (`{"type":"ack"}`), a gap (`{"type":"gap"}`), a message refused
//! (`{"type":"err","seq":N,"error":{...}}`), and one final answer without a `type`: a publish
//! ack naming the batch and its count, or an error (its first message refused; a message of a
//! batch the server no longer knows, 10208; a message refused before it reached the batch).
//! An error answer leaves what the batch stored unknown but still a prefix of it.
//! `tests/it/fast_batch.rs` pins those answers against the server.

use async_nats::jetstream;
use bytes::Bytes;
use futures::StreamExt;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;

/// The flow acknowledgement interval asked for (the server sends fewer when it is alone, more
/// when several batches share a stream); the publisher does not wait on them.
const FLOW: usize = 500;

/// The senders of the batches a connection has open, by batch id.
type Waiters = Arc<Mutex<HashMap<String, mpsc::UnboundedSender<Bytes>>>>;

/// Where the server's answers to every fast batch of one connection arrive: one subscription
/// on `<inbox>.>`, made on first use (and again if it ever ends), each answer handed to the
/// open batch its subject names.
pub(crate) struct FastReplies {
    client: async_nats::Client,
    prefix: String,
    waiters: Waiters,
    router: tokio::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl FastReplies {
    pub(crate) fn new(client: async_nats::Client) -> FastReplies {
        FastReplies {
            prefix: client.new_inbox(),
            client,
            waiters: Arc::default(),
            router: tokio::sync::Mutex::new(None),
        }
    }

    /// Subscribe to the answers unless subscribed. Should the subscription end, the batches
    /// open then are told at once (their answers' channels close) and the next batch
    /// subscribes again.
    async fn route(&self) -> Result<(), String> {
        let mut router = self.router.lock().await;
        if router.as_ref().is_some_and(|task| !task.is_finished()) {
            return Ok(());
        }
        let mut answers = self
            .client
            .subscribe(format!("{}.>", self.prefix))
            .await
            .map_err(|e| format!("subscribing to fast-batch answers: {e}"))?;
        let waiters = self.waiters.clone();
        let skip = self.prefix.len() + 1;
        *router = Some(tokio::spawn(async move {
            while let Some(m) = answers.next().await {
                let Some(id) = m.subject.get(skip..).and_then(|s| s.split('.').next()) else {
                    continue;
                };
                if let Some(tx) = lock(&waiters).get(id) {
                    let _ = tx.send(m.payload);
                }
            }
            tracing::warn!("the fast-batch answers' subscription ended; subscribing again");
            lock(&waiters).clear();
        }));
        Ok(())
    }

    /// A new batch, registered for its answers until it is dropped.
    pub(crate) async fn open(&self) -> Result<OpenBatch<'_>, String> {
        self.route().await?;
        let id = uuid::Uuid::new_v4().simple().to_string();
        let (tx, answers) = mpsc::unbounded_channel();
        lock(&self.waiters).insert(id.clone(), tx);
        Ok(OpenBatch {
            replies: self,
            id,
            answers,
        })
    }
}

/// The open batches' table (never held across an await, and no code holding it panics: a
/// poisoned lock is taken as it is).
fn lock(
    waiters: &Waiters,
) -> std::sync::MutexGuard<'_, HashMap<String, mpsc::UnboundedSender<Bytes>>> {
    waiters
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Drop for FastReplies {
    fn drop(&mut self) {
        if let Some(router) = self.router.get_mut() {
            router.abort();
        }
    }
}

/// One fast batch being sent: its id and the answers the server sends it.
pub(crate) struct OpenBatch<'a> {
    replies: &'a FastReplies,
    id: String,
    pub(crate) answers: mpsc::UnboundedReceiver<Bytes>,
}

impl OpenBatch<'_> {
    /// The reply subject of the batch's message `seq` (from 1) of `len`: the first starts the
    /// batch, the last commits it (a batch of one both).
    pub(crate) fn reply(&self, seq: usize, len: usize) -> String {
        reply_subject(&self.replies.prefix, &self.id, seq, len)
    }
}

impl Drop for OpenBatch<'_> {
    fn drop(&mut self) {
        lock(&self.replies.waiters).remove(&self.id);
    }
}

/// `<prefix>.<id>.<flow>.fail.<seq>.<op>.$FI`; op 0 starts a batch, 1 appends, 2 commits.
fn reply_subject(prefix: &str, id: &str, seq: usize, len: usize) -> String {
    let op = if seq == len {
        2
    } else if seq == 1 {
        0
    } else {
        1
    };
    format!("{prefix}.{id}.{FLOW}.fail.{seq}.{op}.$FI")
}

/// One answer of the server to a fast batch.
#[derive(Debug)]
pub(crate) enum Answer {
    /// A flow acknowledgement or a gap report: the final answer follows.
    Progress,
    /// A message refused; the batch ends before it.
    Refused(jetstream::Error),
    /// The final answer: how many of the batch's messages it took in order (stored, or
    /// collapsed with a stored copy by Msg-Id), `None` for a plain publish ack (a server that
    /// does not know fast batches stored the message as a single publish); or an error.
    Done(Result<Option<u64>, jetstream::Error>),
}

#[derive(serde::Deserialize)]
struct Wire {
    #[serde(rename = "type")]
    kind: Option<String>,
    error: Option<jetstream::Error>,
    batch: Option<String>,
    count: Option<u64>,
}

/// Read one answer.
pub(crate) fn answer(payload: &[u8]) -> Result<Answer, String> {
    let wire: Wire = serde_json::from_slice(payload).map_err(|e| {
        format!(
            "unreadable fast-batch answer ({e}): {}",
            String::from_utf8_lossy(payload)
        )
    })?;
    Ok(match (wire.kind.as_deref(), wire.error) {
        (Some("err"), Some(error)) => Answer::Refused(error),
        (Some(_), _) => Answer::Progress,
        (None, Some(error)) => Answer::Done(Err(error)),
        (None, None) => Answer::Done(Ok(wire.batch.and(wire.count))),
    })
}

#[cfg(test)]
mod tests {
    use super::{answer, reply_subject, Answer};

    #[test]
    fn reply_subjects_start_append_and_commit() {
        let r = |seq, len| reply_subject("_INBOX.a", "b1", seq, len);
        assert_eq!(r(1, 3), "_INBOX.a.b1.500.fail.1.0.$FI");
        assert_eq!(r(2, 3), "_INBOX.a.b1.500.fail.2.1.$FI");
        assert_eq!(r(3, 3), "_INBOX.a.b1.500.fail.3.2.$FI");
        assert_eq!(
            r(1, 1),
            "_INBOX.a.b1.500.fail.1.2.$FI",
            "one message commits at once"
        );
    }

    #[test]
    fn answers_are_progress_refusals_or_the_final_count() {
        let read = |json: &str| answer(json.as_bytes()).unwrap();
        assert!(matches!(
            read(r#"{"type":"ack","seq":0,"msgs":1}"#),
            Answer::Progress
        ));
        assert!(matches!(
            read(r#"{"type":"gap","last_seq":3,"seq":5}"#),
            Answer::Progress
        ));
        match read(
            r#"{"type":"err","seq":4,"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 2"}}"#,
        ) {
            Answer::Refused(e) => assert_eq!(e.error_code().0, 10071),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            read(r#"{"stream":"P","seq":9,"batch":"b1","count":3}"#),
            Answer::Done(Ok(Some(3)))
        ));
        assert!(
            matches!(read(r#"{"stream":"P","seq":9}"#), Answer::Done(Ok(None))),
            "a plain publish ack: the server stored it as a single publish"
        );
        assert!(matches!(
            read(r#"{"error":{"code":400,"err_code":10208,"description":"batch unknown"}}"#),
            Answer::Done(Err(_))
        ));
        assert!(answer(b"not json").is_err());
    }
}
