//! Reading the projection stream in rounds, for the readers that follow it behind the partitions
//! (the work-session fold, the OpenTelemetry export).
//!
//! A consumer that always holds a pull request open is sent every message in a write of its own
//! the moment it is stored: at moderate rates that is one server write and one wake-up of the
//! reader per projection, for readers that only act once a round has gathered. [`Rounds`] asks
//! for the first message of a round and waits for it; once the round's gathering time has passed
//! it asks for what has been stored since: a small round a hundred at a time with short pauses
//! between, so its burst does not hold up the partitions' own traffic at the server, a larger
//! one back to back. A reader a whole round behind does not wait: its round is there to be read.
//!
//! The consumer is ephemeral, in memory and unacknowledged, as an ordered consumer's is, and
//! every delivery must follow the one before it (consumer sequence `n + 1` after `n`). A gap, a
//! delivery the consumer counts but the reader never got (looked for whenever a wait for a
//! round's first message ends empty or goes with a reconnect, since on a quiet stream no later
//! delivery would show the gap), a lost consumer or any failure is an error: the reader starts
//! again from its checkpoint, and applying a round again changes nothing twice.
//!
//! A round is bounded by bytes as well as by count ([`ROUND_BYTES`] unless set otherwise): its
//! requests after the first message ask the server for no more than the bytes left, so a reader
//! holds at most that much (or one message, when its first is larger), whatever the size of the
//! projections behind it.
//!
//! A request whose deliveries went with a reconnect of the reader's connection is noticed once
//! the connection is back and a short grace has passed ([`Rounds::watching`]): a wait for a
//! round's first message is asked again, a fetch of the rest is a failure at once, rather than
//! either being waited out.

use super::reconnects::Reconnects;
use super::LeaseValidity;
use async_nats::jetstream::{self, consumer};
use futures::StreamExt;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How long one request for a round's first message waits before it is made again.
const FIRST_WAIT: Duration = Duration::from_secs(5);
/// The most messages one request for the rest of a round asks for.
const FETCH_CHUNK: usize = 2_000;
/// A small round (fewer than `PACE_BELOW` messages left to read, the rounds of a reader that
/// keeps up at moderate rates) is fetched `PACED_CHUNK` at a time, `PACE_GAP` apart, rather
/// than all at once: a burst of a thousand deliveries competes with the partitions' own
/// traffic for the server, and showed in their latency tail (docs/performance.md, "Where the
/// latency tail and the 1M slide come from"). A larger round, or a reader behind, is fetched
/// as before, so its catching up is not slowed.
const PACE_BELOW: u64 = 2_000;
const PACED_CHUNK: usize = 100;
const PACE_GAP: Duration = Duration::from_millis(2);
/// The bytes a round holds at most, by default: its messages as the client counts them
/// (subject, headers and payload). A round's first message is taken whatever its size.
pub const ROUND_BYTES: usize = 32 * 1024 * 1024;
/// The server's status when the next message would take a request past its byte limit: the
/// request ends there, and the message stays for the next one. The client library hands it on
/// as an error naming this description (`tests/it/rounds.rs` pins it against the server).
const OVER_MAX_BYTES: &str = "Message Size Exceeds MaxBytes";
/// How long the server keeps the reader's consumer after its last request.
const INACTIVE: Duration = Duration::from_secs(60);
/// How long a request for the rest of a round may go without a word from the server. It asks
/// for what is stored already, so the server answers at once; a request lost with a connection
/// (a server restart, a process paused past the server's patience) is answered never, and the
/// client library sets no timer of its own on such a request.
const FETCH_SILENCE: Duration = Duration::from_secs(10);

/// A reader of one stream, in order from a start sequence, a round at a time.
pub struct Rounds {
    consumer: consumer::Consumer<consumer::pull::Config>,
    stream: String,
    /// The consumer sequence of the last message taken (0: none yet).
    delivered: u64,
    /// The reconnects of the connection the consumer is read on, when watched.
    reconnects: Option<Arc<Reconnects>>,
    /// The bytes a round holds at most (see [`ROUND_BYTES`]).
    max_bytes: usize,
    /// The last round ended at its byte bound: more is stored already.
    cut_by_bytes: bool,
}

impl Rounds {
    /// Read `stream` from `start` (its first message if that is gone).
    pub async fn new(stream: &jetstream::stream::Stream, start: u64) -> Result<Rounds, String> {
        let name = &stream.cached_info().config.name;
        let consumer = stream
            .create_consumer(consumer::pull::Config {
                deliver_policy: consumer::DeliverPolicy::ByStartSequence {
                    start_sequence: start,
                },
                ack_policy: consumer::AckPolicy::None,
                memory_storage: true,
                num_replicas: 1,
                inactive_threshold: INACTIVE,
                ..Default::default()
            })
            .await
            .map_err(|e| format!("reading {name}: {e}"))?;
        Ok(Rounds {
            consumer,
            stream: name.clone(),
            delivered: 0,
            reconnects: None,
            max_bytes: ROUND_BYTES,
            cut_by_bytes: false,
        })
    }

    /// Bound each round to `bytes` instead of [`ROUND_BYTES`] (at least one message a round).
    pub fn max_bytes(mut self, bytes: usize) -> Rounds {
        self.max_bytes = bytes.max(1);
        self
    }

    /// Watch `reconnects`, those of the connection the stream was opened on: a request whose
    /// deliveries went with one is not waited out (see the module's documentation).
    pub(crate) fn watching(mut self, reconnects: Arc<Reconnects>) -> Rounds {
        self.reconnects = Some(reconnects);
        self
    }

    /// The watched connection's count of connects (0 when not watched).
    fn connects(&self) -> u64 {
        self.reconnects.as_ref().map_or(0, |r| r.connects())
    }

    /// `fut`, a delivery of a request sent at `connects`, unless it went with a reconnect since.
    async fn unless_lost<F: std::future::Future>(
        &self,
        fut: F,
        connects: u64,
    ) -> Result<F::Output, u64> {
        match &self.reconnects {
            Some(r) => r.answer_unless_lost(fut, connects).await,
            None => Ok(fut.await),
        }
    }

    /// The next round: its first message, then what was stored within `gather` after it (at most
    /// `max` messages in all, and at most the reader's byte bound once past the first; without
    /// waiting when `max` are stored already), handed over only while the lease on partition 0
    /// holds, so a worker that lost it without noticing yet does nothing. `Ok(None)`: cancelled.
    pub async fn next(
        &mut self,
        cancel: &CancellationToken,
        lease_valid_until: &LeaseValidity,
        gather: Duration,
        max: usize,
    ) -> Result<Option<Vec<jetstream::Message>>, String> {
        let mut round = Vec::new();
        // The round's bytes, as the client counts each message.
        let mut bytes = 0usize;
        // Messages stored behind the round's first one when it arrived.
        let mut behind = 0u64;
        while round.is_empty() {
            let connects = self.connects();
            let mut first = self
                .consumer
                .batch()
                .max_messages(1)
                .expires(FIRST_WAIT)
                .messages()
                .await
                .map_err(|e| self.failed(e))?;
            let got = tokio::select! {
                _ = cancel.cancelled() => return Ok(None),
                m = self.unless_lost(first.next(), connects) => m,
            };
            let Ok(got) = got else {
                // The request went with a reconnect: asked again, unless the server delivered
                // on it meanwhile (the delivery went with the old connection).
                tracing::debug!(stream = %self.stream, "a wait for a round's first message went with a reconnect; asking again");
                self.nothing_delivered_unread().await?;
                continue;
            };
            match got {
                Some(m) => {
                    let (m, pending) = self.take(m.map_err(|e| self.failed(e))?)?;
                    behind = pending;
                    bytes = m.message.length;
                    round.push(m);
                }
                // Nothing within the wait. A consumer that is gone answers no request, so ask
                // whether it is still there, and whether it delivered anything this reader
                // never got, before waiting again.
                None => self.nothing_delivered_unread().await?,
            }
        }
        // Gathering is for a reader that keeps up: one that is a whole round behind has its
        // round stored already, and waiting would only slow its catching up. A round's worth of
        // bytes counts too: the last round ended at its byte bound, or what is stored behind,
        // at the size of the first message, fills one.
        let stored = usize::try_from(behind).map_or(usize::MAX, |b| b.saturating_add(1));
        let a_round_behind =
            stored >= max || self.cut_by_bytes || stored.saturating_mul(bytes) >= self.max_bytes;
        if !a_round_behind {
            tokio::select! {
                _ = cancel.cancelled() => return Ok(None),
                _ = tokio::time::sleep(gather) => {}
            }
        }
        // Paced while the round stays small (see `PACE_BELOW`); once more than that is left to
        // read, the rest comes without pauses.
        let mut paced = !a_round_behind;
        // Messages stored behind the last one taken (unknown until the first fetch).
        let mut left: Option<u64> = None;
        // The server cut a request at the round's byte bound.
        let mut full = false;
        while round.len() < max && bytes < self.max_bytes {
            paced = paced && left.is_none_or(|l| l < PACE_BELOW);
            if paced && left.is_some() {
                tokio::select! {
                    _ = cancel.cancelled() => return Ok(None),
                    _ = tokio::time::sleep(PACE_GAP) => {}
                }
            }
            let chunk = if paced { PACED_CHUNK } else { FETCH_CHUNK };
            let want = (max - round.len()).min(chunk);
            let connects = self.connects();
            let mut rest = self
                .consumer
                .fetch()
                .max_messages(want)
                .max_bytes(self.max_bytes - bytes)
                .messages()
                .await
                .map_err(|e| self.failed(e))?;
            let mut got = 0usize;
            loop {
                let next = tokio::select! {
                    _ = cancel.cancelled() => return Ok(None),
                    next = self.delivery(&mut rest, connects) => next?,
                };
                let m = match next {
                    None => break,
                    Some(Ok(m)) => m,
                    // The next message would take the round past its bytes: it is the next
                    // round's (the server delivered nothing of it).
                    Some(Err(e)) if e.to_string().contains(OVER_MAX_BYTES) => {
                        full = true;
                        break;
                    }
                    Some(Err(e)) => return Err(self.failed(e)),
                };
                let (m, pending) = self.take(m)?;
                left = Some(pending);
                bytes = bytes.saturating_add(m.message.length);
                round.push(m);
                got += 1;
            }
            if full || got < want {
                break;
            }
        }
        self.cut_by_bytes = full || bytes >= self.max_bytes;
        if !super::lease_held_again(lease_valid_until, cancel.cancelled(), None).await {
            return Ok(None);
        }
        Ok(Some(round))
    }

    /// The next delivery of a fetch sent when the watched connection had connected `connects`
    /// times (`None`: the fetch is complete). One timer at a time: each
    /// [`super::reconnects::RECONNECT_CHECK`] without a delivery looks for a reconnect since the
    /// fetch (then its grace, and a failure) and counts toward [`FETCH_SILENCE`].
    async fn delivery<S>(&self, rest: &mut S, connects: u64) -> Result<Option<S::Item>, String>
    where
        S: futures::Stream + Unpin,
    {
        let silence = || {
            self.failed(format!(
                "the server sent nothing for {} s of a request for stored messages",
                FETCH_SILENCE.as_secs()
            ))
        };
        let Some(r) = &self.reconnects else {
            return tokio::time::timeout(FETCH_SILENCE, rest.next())
                .await
                .map_err(|_| silence());
        };
        let started = tokio::time::Instant::now();
        loop {
            let check = super::reconnects::RECONNECT_CHECK;
            if let Ok(next) = tokio::time::timeout(check, rest.next()).await {
                return Ok(next);
            }
            if r.connects() != connects {
                return r
                    .answer_unless_lost(rest.next(), connects)
                    .await
                    .map_err(|_| {
                        self.failed("a request for stored messages went with a reconnect")
                    });
            }
            if started.elapsed() >= FETCH_SILENCE {
                return Err(silence());
            }
        }
    }

    /// Take one delivery, which must follow the last one taken, with the count of messages
    /// stored behind it.
    fn take(&mut self, m: jetstream::Message) -> Result<(jetstream::Message, u64), String> {
        let info = m
            .info()
            .map_err(|e| format!("reading {}: a delivery's metadata: {e}", self.stream))?;
        let wanted = self.delivered + 1;
        if info.consumer_sequence != wanted {
            return Err(format!(
                "reading {}: delivery {} arrived where {wanted} was due",
                self.stream, info.consumer_sequence
            ));
        }
        self.delivered = wanted;
        let pending = info.pending;
        Ok((m, pending))
    }

    /// The consumer, asked, has delivered nothing past the last message taken. A delivery
    /// lost on its way (with a reconnect, or to a request this reader stopped waiting for)
    /// otherwise shows only as a gap once the next one arrives, which on a quiet stream may be
    /// never: that message would stay unread. Failing makes the reader start again from its
    /// checkpoint and read it.
    async fn nothing_delivered_unread(&self) -> Result<(), String> {
        let info = self.consumer.get_info().await.map_err(|e| self.failed(e))?;
        let delivered = info.delivered.consumer_sequence;
        if delivered != self.delivered {
            return Err(format!(
                "reading {}: the server delivered up to {delivered}, this reader took up to {}: a delivery went astray",
                self.stream, self.delivered
            ));
        }
        Ok(())
    }

    fn failed(&self, e: impl std::fmt::Display) -> String {
        format!("reading {}: {e}", self.stream)
    }
}
