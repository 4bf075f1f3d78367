//! The I/O shell of the turn contract for one partition: executes the pure [`crate::turns`]
//! steps against the KV fence, publishes the turn's one response, keeps the partition's
//! deadlines, and reloads open and unpublished turns when the partition starts.

use super::worker::Shared;
use crate::ingest::Normalized;
use crate::model::Role;
use crate::pipeline::{self, OutKind, Outgoing, RawMessage};
use crate::telemetry;
use crate::turns::{
    self, blocked, book::DeadlineBook, Expect, TurnConfig, TurnFacts, TurnRecord, TurnState,
};
use async_nats::jetstream::kv;
use bytes::Bytes;
use futures::StreamExt;
use std::collections::HashMap;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

#[derive(Debug, thiserror::Error)]
pub enum TurnIoError {
    #[error("turn record {key}: {detail}")]
    Kv { key: String, detail: String },
    #[error("shutting down with turn {0} undecided on the bus")]
    Cancelled(String),
}

enum WriteError {
    Conflict,
    Other(String),
}

/// The turn state a partition owner keeps: open turns (with their KV revision) and deadlines.
pub struct PartitionTurns {
    pub partition: u16,
    store: kv::Store,
    cfg: TurnConfig,
    open: HashMap<String, (TurnRecord, u64)>,
    pub book: DeadlineBook,
}

impl PartitionTurns {
    pub async fn new(shared: &Shared, partition: u16) -> Result<PartitionTurns, TurnIoError> {
        let bucket = shared.names.turns_bucket.clone();
        let store = shared
            .kv_js
            .get_key_value(&bucket)
            .await
            .map_err(|e| TurnIoError::Kv {
                key: bucket.clone(),
                detail: e.to_string(),
            })?;
        Ok(PartitionTurns {
            partition,
            store,
            cfg: TurnConfig {
                default_timeout: shared.settings.turns.default_timeout,
                max_timeout: shared.settings.turns.max_timeout,
            },
            open: HashMap::new(),
            book: DeadlineBook::new(),
        })
    }

    pub fn open_turns(&self) -> usize {
        self.open.len()
    }

    /// Load this partition's records: arm open deadlines, and publish any decided response whose
    /// publication a crash interrupted.
    pub async fn reload(
        &mut self,
        shared: &Shared,
        cancel: &CancellationToken,
    ) -> Result<usize, TurnIoError> {
        let filter = format!("p{}.>", self.partition);
        let mut watch =
            self.store
                .watch_with_history(&filter)
                .await
                .map_err(|e| TurnIoError::Kv {
                    key: filter.clone(),
                    detail: e.to_string(),
                })?;
        let mut unpublished = Vec::new();
        let mut loaded = 0;
        let mut first = true;
        loop {
            // A partition with no records sends nothing: the first entry either comes at once or
            // not at all. After it, the history runs until `delta` reaches 0, and a stall is an
            // error (the partition restarts) rather than a silently partial reload.
            let wait = if first {
                Duration::from_secs(1)
            } else {
                Duration::from_secs(30)
            };
            let next = tokio::time::timeout(wait, watch.next()).await;
            let entry = match next {
                Ok(Some(Ok(e))) => e,
                Ok(Some(Err(e))) => {
                    return Err(TurnIoError::Kv {
                        key: filter,
                        detail: e.to_string(),
                    })
                }
                Err(_) if first => break,
                Ok(None) | Err(_) => {
                    return Err(TurnIoError::Kv {
                        key: filter,
                        detail: format!("the record history stopped after {loaded} records"),
                    })
                }
            };
            first = false;
            if entry.operation == kv::Operation::Put {
                if let Ok(rec) = serde_json::from_slice::<TurnRecord>(&entry.value) {
                    loaded += 1;
                    match rec.state {
                        TurnState::Open => {
                            if let Some(d) = rec.deadline_ms {
                                self.book.arm(&entry.key, d);
                            }
                            self.open.insert(entry.key.clone(), (rec, entry.revision));
                        }
                        TurnState::Decided => {
                            unpublished.push((entry.key.clone(), rec, entry.revision))
                        }
                        TurnState::Published => {}
                    }
                }
            }
            if entry.delta == 0 {
                break;
            }
        }
        for (key, rec, rev) in unpublished {
            self.publish_winner(shared, &key, &rec, rev, None, cancel)
                .await?;
        }
        metrics::gauge!(telemetry::OPEN_TURNS).increment(self.open.len() as f64);
        Ok(loaded)
    }

    async fn read(&self, key: &str) -> Result<Option<(TurnRecord, u64)>, TurnIoError> {
        if let Some(hit) = self.open.get(key) {
            return Ok(Some(hit.clone()));
        }
        let entry = self.store.entry(key).await.map_err(|e| TurnIoError::Kv {
            key: key.to_string(),
            detail: e.to_string(),
        })?;
        Ok(entry.and_then(|e| {
            if e.operation != kv::Operation::Put {
                return None;
            }
            serde_json::from_slice::<TurnRecord>(&e.value)
                .ok()
                .map(|r| (r, e.revision))
        }))
    }

    async fn write(&self, key: &str, rec: &TurnRecord, expect: Expect) -> Result<u64, WriteError> {
        let value = Bytes::from(serde_json::to_vec(rec).unwrap_or_default());
        match expect {
            Expect::Absent => self.store.create(key, value).await.map_err(|e| {
                if e.kind() == kv::CreateErrorKind::AlreadyExists {
                    WriteError::Conflict
                } else {
                    WriteError::Other(e.to_string())
                }
            }),
            Expect::Revision(rev) => self.store.update(key, value, rev).await.map_err(|e| {
                if e.kind() == kv::UpdateErrorKind::WrongLastRevision {
                    WriteError::Conflict
                } else {
                    WriteError::Other(e.to_string())
                }
            }),
        }
    }

    fn remember(&mut self, key: &str, rec: &TurnRecord, rev: u64) {
        if rec.state == TurnState::Open {
            if let Some(d) = rec.deadline_ms {
                self.book.arm(key, d);
            }
            if self
                .open
                .insert(key.to_string(), (rec.clone(), rev))
                .is_none()
            {
                metrics::gauge!(telemetry::OPEN_TURNS).increment(1.0);
            }
        } else {
            self.book.disarm(key);
            if self.open.remove(key).is_some() {
                metrics::gauge!(telemetry::OPEN_TURNS).decrement(1.0);
            }
        }
    }

    /// Apply a turn event. Returns the projections to publish after (pipelined).
    pub async fn on_event(
        &mut self,
        shared: &Shared,
        n: &Normalized,
        facts: &TurnFacts,
        cancel: &CancellationToken,
    ) -> Result<Vec<Outgoing>, TurnIoError> {
        let key = facts.record_key(self.partition);
        // Messages are processed in stream order, so one stored after an open turn's deadline
        // means the deadline has passed in event time: decide it first, even if the deadline set
        // does not hold the turn (e.g. a reload that came back incomplete).
        if let Some((rec, _)) = self.read(&key).await? {
            if rec.state == TurnState::Open {
                if let Some(deadline) = rec.deadline_ms.filter(|d| *d < facts.stored_ms) {
                    self.book.arm(&key, deadline);
                    self.advance(shared, facts.stored_ms, cancel).await?;
                }
            }
        }
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let current = self.read(&key).await?;
            let step = turns::on_event(current.as_ref().map(|(r, v)| (r, *v)), facts, &self.cfg);
            let after = match &step.write {
                Some((rec, expect)) => match self.write(&key, rec, *expect).await {
                    Ok(rev) => Some((rec.clone(), rev)),
                    Err(e) => {
                        // Someone (another owner, or our own write whose ack was lost) wrote
                        // first: decide again against what is stored.
                        self.open.remove(&key);
                        if let WriteError::Other(detail) = &e {
                            warn!(key = %key, error = %detail, "turn write failed; re-reading");
                            tokio::time::sleep(Duration::from_millis(
                                50 * u64::from(attempts.min(20)),
                            ))
                            .await;
                        }
                        if cancel.is_cancelled() && attempts > 20 {
                            return Err(TurnIoError::Cancelled(key));
                        }
                        continue;
                    }
                },
                None => current.clone(),
            };
            if let Some((rec, rev)) = &after {
                self.remember(&key, rec, *rev);
                if step.publish_winner || rec.state == TurnState::Decided {
                    self.publish_winner(shared, &key, rec, *rev, Some((facts.seq, n)), cancel)
                        .await?;
                }
            }
            let mut outs = Vec::new();
            if step.project_self {
                outs.push(pipeline::projection(
                    &shared.names,
                    n,
                    facts.seq,
                    format!("{}:{}:0", shared.names.raw_stream, facts.seq),
                ));
            }
            if let (Some(reason), Some((rec, _))) = (step.suppress, &after) {
                let env = blocked::suppressed(&n.envelope, rec, reason);
                let sn = Normalized {
                    envelope: env,
                    key: n.key.clone(),
                    conversation_id: n.conversation_id.clone(),
                };
                let mut out = pipeline::projection(
                    &shared.names,
                    &sn,
                    facts.seq,
                    format!("{}:{}:suppressed", shared.names.raw_stream, facts.seq),
                );
                out.kind = OutKind::Projection(Role::SystemObservability);
                metrics::counter!(telemetry::SUPPRESSED, "reason" => reason.as_str()).increment(1);
                outs.push(out);
            }
            return Ok(outs);
        }
    }

    /// Decide every open turn whose deadline is before the watermark.
    pub async fn advance(
        &mut self,
        shared: &Shared,
        watermark_ms: i64,
        cancel: &CancellationToken,
    ) -> Result<usize, TurnIoError> {
        let expired = self.book.expire(watermark_ms);
        let mut decided = 0;
        for (_, key) in expired {
            let mut attempts = 0u32;
            loop {
                attempts += 1;
                let Some((rec, rev)) = self.read(&key).await? else {
                    break;
                };
                let Some(step) = turns::on_deadline((&rec, rev)) else {
                    // Decided meanwhile (another owner); make sure its response is out.
                    self.remember(&key, &rec, rev);
                    if rec.state == TurnState::Decided {
                        self.publish_winner(shared, &key, &rec, rev, None, cancel)
                            .await?;
                    }
                    break;
                };
                let Some((new, expect)) = step.write else {
                    break;
                };
                match self.write(&key, &new, expect).await {
                    Ok(rev) => {
                        self.remember(&key, &new, rev);
                        self.publish_winner(shared, &key, &new, rev, None, cancel)
                            .await?;
                        decided += 1;
                        break;
                    }
                    Err(_) => {
                        self.open.remove(&key);
                        if cancel.is_cancelled() && attempts > 20 {
                            return Err(TurnIoError::Cancelled(key));
                        }
                        tokio::time::sleep(Duration::from_millis(20 * u64::from(attempts.min(20))))
                            .await;
                    }
                }
            }
        }
        Ok(decided)
    }

    /// Publish the turn's one response and mark the record published.
    ///
    /// `current` is the event being processed (its sequence and envelope); when it is not the
    /// winner, the winner's raw message is read back from the raw stream.
    async fn publish_winner(
        &mut self,
        shared: &Shared,
        key: &str,
        rec: &TurnRecord,
        rev: u64,
        current: Option<(u64, &Normalized)>,
        cancel: &CancellationToken,
    ) -> Result<(), TurnIoError> {
        if rec.state != TurnState::Decided {
            return Ok(());
        }
        let winner_seq = rec.winner.as_ref().and_then(|w| w.seq);
        let fetched;
        let decider = match (winner_seq, current) {
            (Some(ws), Some((seq, n))) if ws == seq => Some(&n.envelope),
            (Some(ws), _) => {
                fetched = self.fetch_envelope(shared, ws).await;
                fetched.as_ref()
            }
            (None, _) => None,
        };
        if decider.is_none() && rec.winner.as_ref().is_some_and(|w| w.blocked.is_none()) {
            // A real reply must be published as it was written; never substitute a guess.
            return Err(TurnIoError::Kv {
                key: key.to_string(),
                detail: format!(
                    "the winning reply (raw sequence {}) could not be read back from the raw stream",
                    winner_seq.unwrap_or(0)
                ),
            });
        }
        crash_point("after_decide");
        let mut env = blocked::winner_response(rec, decider);
        if let Some(r) = env.raw_event_ref.as_mut() {
            if r.stream.is_empty() {
                r.stream = shared.names.raw_stream.clone();
            }
        }
        let blocked_reason = rec.winner.as_ref().and_then(|w| w.blocked);
        let wn = Normalized {
            envelope: env,
            key: rec.key.clone(),
            conversation_id: Some(rec.conversation_id.clone()),
        };
        let mut out = pipeline::projection(
            &shared.names,
            &wn,
            winner_seq.unwrap_or(0),
            rec.response_msg_id(),
        );
        out.subject = shared
            .names
            .proj_subject(Role::ConversationMain, &rec.key, "a2a.response");
        if !shared.publish_in_place(&out, &[], cancel).await {
            return Err(TurnIoError::Cancelled(key.to_string()));
        }
        if let Err(e) = shared
            .sessions
            .observe(self.partition, &[(winner_seq.unwrap_or(0), &out)], true)
            .await
        {
            return Err(TurnIoError::Kv {
                key: key.to_string(),
                detail: e.to_string(),
            });
        }
        crash_point("after_publish");
        shared.count_projection(Role::ConversationMain);
        metrics::counter!(
            telemetry::TURN_OUTCOMES,
            "outcome" => if blocked_reason.is_some() { "blocked" } else { "response" },
            "reason" => blocked_reason.map(|r| r.as_str()).unwrap_or("none")
        )
        .increment(1);
        // Mark published; a conflict means someone else marked (or re-decided) it: re-read.
        let mut rev = rev;
        let mut attempts = 0;
        loop {
            attempts += 1;
            let marked = turns::published(rec);
            match self.write(key, &marked, Expect::Revision(rev)).await {
                Ok(new_rev) => {
                    self.remember(key, &marked, new_rev);
                    return Ok(());
                }
                Err(e) => {
                    if let WriteError::Other(d) = &e {
                        debug!(key, error = %d, "published mark failed; re-reading");
                    }
                    match self.read(key).await? {
                        Some((r, v)) if r.state == TurnState::Decided && r.winner == rec.winner => {
                            rev = v
                        }
                        Some((r, v)) => {
                            self.remember(key, &r, v);
                            return Ok(());
                        }
                        None => return Ok(()),
                    }
                    if attempts > 50 {
                        return Err(TurnIoError::Kv {
                            key: key.to_string(),
                            detail: "could not mark the response published".into(),
                        });
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
    }

    async fn fetch_envelope(&self, shared: &Shared, seq: u64) -> Option<crate::model::Envelope> {
        let stream = shared.js.get_stream(&shared.names.raw_stream).await.ok()?;
        let msg = stream.get_raw_message(seq).await.ok()?;
        let raw = RawMessage {
            bytes: &msg.payload,
            stream: &shared.names.raw_stream,
            seq,
            stored_subject: msg.subject.as_str(),
            stored_at: msg.time,
            delivered: 1,
        };
        let events = pipeline::normalize_raw(&raw, &shared.names, &shared.ingest, 0).ok()?;
        events.into_iter().next().map(|n| n.envelope)
    }
}

/// Test hook: `COLLAB_TEST_CRASH_AT=<point>` aborts the process at that point of the turn
/// protocol (`after_decide`, `after_publish`, `before_ack`), as a SIGKILL would, so crash
/// recovery can be tested at exact instants.
pub(crate) fn crash_point(point: &str) {
    if std::env::var("COLLAB_TEST_CRASH_AT").is_ok_and(|v| v == point) {
        eprintln!("test hook: crashing at {point}");
        std::process::abort();
    }
}
