//! A partition's reading side: it pulls the partition's raw messages in batches and processes
//! them strictly in stream order (normalise, classify, the turn rules), issuing their outputs
//! and turn-record writes and handing each processed input to the acker. It accounts for every
//! stream sequence: what a previous owner left in flight is read back in full before anything
//! new (a read that stops short starts the partition over), every delivery must follow the
//! previous one in the consumer's sequence (a gap starts it over), and an input delivered before
//! publishes only what is not stored yet.

use super::acker::issue_publishes;
use super::acker::{is_barrier, Processed};
use super::context::WorkerContext;
use super::error::{Source, WorkerError};
use super::publish::Fence;
use super::publisher::Halt;
use super::pull::PullBatch;
use super::stats::Outcome;
use super::turns::{Effects, Flush, PartitionTurns, TurnIoError};
use super::{lease_held_again, LeaseValidity};
use crate::pipeline::{self, RawMessage};
use crate::telemetry;
use crate::turns::book::Watermark;
use async_nats::jetstream::{self, consumer::PullConsumer};
use futures::StreamExt;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// Whether a partition goes on after a step.
pub(crate) enum Flow {
    Continue,
    Stop,
}

/// One running partition: its turns, its event-time watermark and the highest raw sequence it
/// processed.
pub(crate) struct Partition<'a> {
    pub(crate) shared: &'a Arc<WorkerContext>,
    pub(crate) p: u16,
    pub(crate) turns: PartitionTurns,
    pub(crate) watermark: Watermark,
    /// The watermark, for the lag sampler.
    pub(crate) watermark_ms: Arc<AtomicI64>,
    pub(crate) last_seq: u64,
    /// The raw sequence of the input being disposed of (set before any step of it can fail):
    /// a failure is charged to it.
    pub(crate) in_hand: Option<u64>,
    /// Where this partition's barriers are published, and when the last one was sent (ms since
    /// the epoch) if it has not arrived yet.
    pub(crate) barrier_subject: String,
    pub(crate) barrier_sent_ms: Option<i64>,
    /// The set of raw streams a heeded reshard marker announced (see
    /// [`Partition::heed_reshard_marker`]), while it holds the partition's deadlines.
    pub(crate) marked_set: Option<MarkedSet>,
    /// A set of raw streams a reshard marker named and the server did not have, and when that
    /// was looked up (ms since the epoch): markers of it stored before then are passed over.
    pub(crate) absent_set: Option<(u64, i64)>,
    /// The consumer sequence the next delivery must carry: a delivery past it means another
    /// client (a previous owner's late pull, an abandoned request) was delivered to, and what
    /// it got must not be covered by this partition's acknowledgements.
    pub(crate) next_delivery: u64,
    /// Inputs up to this raw sequence may have their outputs stored already (the consumer was
    /// recreated from a checkpoint): each is looked up before it is published, until
    /// [`Partition::look_up_span`] inputs in a row had none of their outputs stored. The
    /// previous owner issued pipelined publishes in input order with at most a publish window
    /// (`consumer.publish_window`) unacknowledged, and stored batches one group of inputs at a
    /// time, so an output not stored can only be followed by stored ones within that span.
    pub(crate) verify_through: u64,
    /// Inputs in a row, looked up under `verify_through`, that had no output stored.
    pub(crate) verify_missed: usize,
    /// Inputs up to this raw sequence were acknowledged by an owner of the partition (its
    /// checkpoint says so) though the consumer delivers them again: their own outputs are known
    /// stored and not published; any other output of their processing is looked up, however
    /// many in a row had nothing stored (an output a replay computes differently is no sign
    /// that the previous owner's publishes ended there).
    pub(crate) verify_all_through: u64,
    /// What the look-ups of those inputs' outputs read of the output subjects (each subject
    /// read once, then only past where it was read); emptied once inputs need no look-up.
    pub(crate) seen: super::publisher::SeenOutputs,
    /// This owner's claim, which every output it publishes expects.
    pub(crate) fence: Fence,
    /// Streamed text held back per open message or tool call, so a secret split over deltas is
    /// redacted whole: fed this partition's inputs in order, and only them.
    pub(crate) streams: crate::redact::StreamRedactor,
    pub(crate) tx: mpsc::Sender<Processed>,
    pub(crate) cancel: &'a CancellationToken,
    /// Cancelled by the acker when a turn-record write failed: stop and restart the partition.
    pub(crate) broken: &'a CancellationToken,
}

impl Partition<'_> {
    /// How many looked-up inputs in a row with nothing stored end the look-ups: a publish
    /// window, or an acker's group of inputs if larger (see `verify_through`).
    fn look_up_span(&self) -> usize {
        self.shared
            .settings
            .consumer
            .publish_window
            .max(super::acker::GROUP_MAX)
    }

    pub(crate) fn setup(&self, what: &str, source: impl Into<Source>) -> WorkerError {
        WorkerError::setup(self.p, what, source)
    }

    /// Stop: the lease may have lapsed, and the restart takes over what was left, in order.
    fn lapsed_lease(&self) -> WorkerError {
        WorkerError::Interrupted {
            partition: self.p,
            why: "the lease may have lapsed",
        }
    }

    /// Before work that writes, with the lease's validity run out: wait for the lease loop's
    /// answer instead of starting over. A renewal that comes back is a compare-and-set on the
    /// revision this worker held, so nobody else held the lease meanwhile and the partition goes
    /// on where it was; a lease found lost cancels the partition. A renewal merely late (a
    /// loaded server, a slow round trip) thus costs a pause, never the partition's progress: a
    /// restart reads the in-flight range again, and on a server slow enough to make renewals
    /// late, every attempt could be cut short by the next late one. Still lapsed after the
    /// lease's validity (a third of its TTL) or a third of `ack_wait`, whichever is shorter, it
    /// stops as before: the restart takes over what was left, in order. (The bound is per wait:
    /// a batch held over several waits can outlast `ack_wait`, and its redelivered inputs are
    /// then looked up, as any redelivery is, not stored twice.) `Ok(false)`: the partition was
    /// stopped while waiting (cancelled, or broken by a refused turn-record write).
    async fn wait_out_lapse(&self, lease_valid_until: &LeaseValidity) -> Result<bool, WorkerError> {
        if !lease_valid_until.lapsed() {
            return Ok(true);
        }
        let settings = &self.shared.settings;
        let bound = (settings.workers.lease_ttl / 3).min(settings.consumer.ack_wait / 3);
        let until = tokio::time::Instant::now() + bound;
        let held = lease_held_again(lease_valid_until, self.stopped(), Some(until)).await;
        if self.cancel.is_cancelled() || self.broken.is_cancelled() {
            return Ok(false);
        }
        if !held {
            return Err(self.lapsed_lease());
        }
        metrics::counter!(telemetry::LEASE_LAPSES_WAITED).increment(1);
        Ok(true)
    }

    /// Resolves once the partition is stopped: cancelled, or broken by a refused turn-record
    /// write.
    async fn stopped(&self) {
        tokio::select! {
            _ = self.cancel.cancelled() => {}
            _ = self.broken.cancelled() => {}
        }
    }

    pub(crate) async fn run(
        &mut self,
        stream: &jetstream::stream::Stream,
        consumer: &mut PullConsumer,
        lease_valid_until: &LeaseValidity,
    ) -> Result<(), WorkerError> {
        // Take over what a previous owner left in flight, in order, before anything new.
        let info = consumer
            .info()
            .await
            .map_err(|e| self.setup("consumer info", e))?;
        self.next_delivery = info.delivered.consumer_sequence + 1;
        if info.num_ack_pending > 0 {
            let (from, to) = (
                info.ack_floor.stream_sequence + 1,
                info.delivered.stream_sequence,
            );
            if let Flow::Stop = self.replay(stream, from, to, lease_valid_until).await? {
                return Ok(());
            }
            // The previous owner's deliveries are processed: acknowledge them once their
            // outputs are stored instead of leaving them to come back after `ack_wait`. A
            // partition whose stream takes no more input (sealed by a reshard) could not leave
            // it until then, since nothing later would be delivered to acknowledge.
            if let Some(last) = super::acker::in_flight_stand_in(&self.shared.js, info) {
                if self.tx.send(Processed::stand_in(last)).await.is_err() {
                    return Ok(());
                }
            }
        }
        let batch = self.shared.settings.consumer.batch;
        let skew = self.clock_skew_ms();
        // When a due deadline cannot fire yet (messages are still pending), look again no sooner
        // than this (ms since the epoch): the check costs a JetStream API request.
        let mut idle_check_after = 0i64;
        let mut retry = super::Retry::new(Duration::from_millis(100), Duration::from_secs(5));
        // One timer for the whole run, moved only when what it waits for changes: a timer made
        // afresh for every message costs a registration and a cancellation in the runtime's
        // timer wheel per input. `armed` is what it was last set for (the deadline in ms since
        // the epoch, the flush instant); `None` while it is not set or has fired.
        let timer = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(timer);
        let mut armed: Option<(Option<i64>, Option<tokio::time::Instant>)> = None;
        loop {
            if self.cancel.is_cancelled() || self.broken.is_cancelled() {
                return Ok(());
            }
            // Pull nothing until the lease is renewed, or the lease loop stops the partition.
            if !lease_held_again(lease_valid_until, self.stopped(), None).await {
                continue;
            }
            // A partition kept busy never idles, where a marker's hold is otherwise looked at.
            self.recheck_marked_set().await;
            let mut messages = match PullBatch::request(&self.shared.js, consumer, batch).await {
                Ok(m) => m,
                Err(e) => {
                    warn!(partition = self.p, error = %e, "pull failed; retrying");
                    if !retry.wait(self.cancel).await {
                        return Ok(());
                    }
                    continue;
                }
            };
            retry.reset();
            let mut in_batch = 0usize;
            // Lines logged while the batch is processed carry its first raw sequence (and each
            // input's own where it matters).
            let batch_span = tracing::info_span!("batch", from = tracing::field::Empty);
            // The batch is bounded (size and expiry): finishing it on cancel is the drain.
            loop {
                let due = self
                    .turns
                    .next_deadline()
                    .map(|d| d.saturating_add(skew).max(idle_check_after));
                let flush = self.turns.next_flush();
                let wanted = (due.is_some() || flush.is_some()).then_some((due, flush));
                if wanted != armed {
                    if let Some(at) = timer_instant(due, flush) {
                        timer.as_mut().reset(at);
                    }
                    armed = wanted;
                }
                let next = tokio::select! {
                    biased;
                    _ = self.broken.cancelled() => return Ok(()),
                    m = messages.next() => m,
                    _ = &mut timer, if armed.is_some() => {
                        armed = None;
                        let deadline = due.map(deadline_instant);
                        // A timer's work writes turn records, which no fence guards: only an
                        // owner whose lease is valid may do it (a worker paused past its lease
                        // wakes with its timers due).
                        if !self.wait_out_lapse(lease_valid_until).await? {
                            return Ok(());
                        }
                        let now = tokio::time::Instant::now();
                        if flush.is_some_and(|f| f <= now) {
                            self.flush(Flush::Due).await?;
                        }
                        if deadline.is_some_and(|d| d <= now) {
                            self.idle_tick(consumer).await;
                            idle_check_after = super::now_ms() + IDLE_CHECK_MS;
                        }
                        continue;
                    }
                };
                let Some(next) = next else {
                    if in_batch > 0 {
                        metrics::histogram!(telemetry::BATCH_SIZE).record(in_batch as f64);
                    }
                    break;
                };
                in_batch += 1;
                let msg = match next {
                    Ok(m) => m,
                    Err(e) => {
                        // Messages of this batch may have been lost on the way: start over from
                        // what the consumer says is in flight, so nothing is processed out of
                        // order.
                        debug!(partition = self.p, error = %e, "batch ended with an error");
                        return Err(WorkerError::Interrupted {
                            partition: self.p,
                            why: "a pull batch failed",
                        });
                    }
                };
                // The lease may have lapsed (a renewal late, or this process paused): no more
                // work from this batch until it is known to hold.
                if !self.wait_out_lapse(lease_valid_until).await? {
                    return Ok(());
                }
                if let Ok(info) = msg.info() {
                    if in_batch == 1 {
                        batch_span.record("from", info.stream_sequence);
                    }
                    if info.consumer_sequence != self.next_delivery {
                        // Deliveries in between went to another client: nothing after them may
                        // be acknowledged by this partition. Start over from the ack floor.
                        warn!(
                            partition = self.p,
                            expected = self.next_delivery,
                            got = info.consumer_sequence,
                            seq = info.stream_sequence,
                            "a consumer delivery went elsewhere; restarting the partition"
                        );
                        metrics::counter!(telemetry::DELIVERY_GAPS).increment(1);
                        return Err(WorkerError::Interrupted {
                            partition: self.p,
                            why: "a consumer delivery went to another client",
                        });
                    }
                    self.next_delivery = info.consumer_sequence + 1;
                }
                // Boxed: the step's future is several KiB, and moving it into the span's
                // wrapper and then into this loop's state would copy it whole twice per input.
                let step = Box::pin(self.process_in_order(msg, true, None));
                if let Flow::Stop =
                    tracing::Instrument::instrument(step, batch_span.clone()).await?
                {
                    return Ok(());
                }
            }
        }
    }

    /// Write deferred open records (`what`) outside of any input, and hand the writes to the
    /// acker: the holds of the inputs that opened those turns resolve with them.
    pub(crate) async fn flush(&mut self, what: Flush) -> Result<(), WorkerError> {
        let mut fx = Effects::default();
        self.turns
            .flush(what, &mut fx)
            .await
            .map_err(|e| self.turn_error(e))?;
        self.issue_unprompted(fx).await
    }

    /// Issue what the turn rules asked for outside of any input (deferred open records written,
    /// deadlines decided while idle) and hand it to the acker. Cancelled meanwhile, it hands
    /// nothing over: nothing is acknowledged for it, and the next owner redoes it.
    pub(crate) async fn issue_unprompted(&mut self, mut fx: Effects) -> Result<(), WorkerError> {
        if fx.is_empty() {
            return Ok(());
        }
        let outs = std::mem::take(&mut fx.outs);
        match self.issue(outs, &[]).await {
            Ok(publishes) => {
                let _ = self
                    .tx
                    .send(Processed::new(None, None, publishes, fx))
                    .await;
                Ok(())
            }
            Err(halt) => match self.halted(halt) {
                None => Ok(()),
                Some(e) => Err(e),
            },
        }
    }

    /// A reshard marker read in the stream (see [`Partition::heed_reshard_marker`]), heeded if
    /// the set of raw streams it names is on the server. A marker stored in the set it
    /// announces (the mapping was in place before it was published) says nothing and is
    /// passed over.
    async fn on_reshard_marker(
        &mut self,
        seq: u64,
        stored_ms: i64,
        base: u64,
    ) -> Result<(), WorkerError> {
        if seq >= base {
            return Ok(());
        }
        if self.marked_set.as_ref().is_some_and(|m| m.base == base) {
            self.heed_reshard_marker(seq, stored_ms);
            return Ok(());
        }
        let now = super::now_ms();
        let skew = self.clock_skew_ms();
        // A set found absent a moment ago says nothing of a marker stored after that look-up:
        // a reshard run again after an abandoned one makes its streams, with the same first
        // sequence, before it stores its markers.
        let known_absent = self.absent_set.is_some_and(|(b, at)| {
            b == base
                && now.saturating_sub(at) < MarkedSet::RECHECK_MS
                && stored_ms < at.saturating_sub(skew)
        });
        if known_absent {
            return Ok(());
        }
        // Only a set that exists holds the watermark back: a marker of a reshard abandoned
        // since, or one not published by `reshard`, would stall deadlines. A look-up that fails
        // is no fault of the marker: the partition starts over (and looks the marker up again at
        // start) without charging it.
        let found = match super::generations::set_streams(&self.shared.js, &self.shared.names, base)
            .await
        {
            Ok(found) => found,
            Err(e) => {
                warn!(partition = self.p, seq, error = %e,
                        "the raw streams a reshard marker names could not be looked up; starting over");
                return Err(WorkerError::Interrupted {
                    partition: self.p,
                    why: "the raw streams a reshard marker names could not be looked up",
                });
            }
        };
        match found {
            Some(streams) => {
                self.marked_set = Some(MarkedSet {
                    base,
                    streams,
                    checked_ms: now,
                });
                self.heed_reshard_marker(seq, stored_ms);
            }
            None => {
                self.absent_set = Some((base, now));
                info!(
                    partition = self.p,
                    seq,
                    base,
                    "a reshard marker for a set of raw streams that no longer exists; ignored"
                );
            }
        }
        Ok(())
    }

    /// `turns.clock_skew` in ms.
    fn clock_skew_ms(&self) -> i64 {
        i64::try_from(self.shared.settings.turns.clock_skew.as_millis()).unwrap_or(0)
    }

    /// Held at a reshard marker: look again, at most every [`MarkedSet::RECHECK_MS`], whether
    /// the streams of the set it names are still on the server (asked by name). Once one is
    /// gone (the reshard abandoned: the old mapping put back and the new streams deleted),
    /// nothing more will be stored in that set, the marker says nothing any more, and this
    /// stream's store times decide the deadlines again, without a restart. A look-up that fails
    /// keeps the hold and asks again later.
    pub(crate) async fn recheck_marked_set(&mut self) {
        let now = super::now_ms();
        let Some(m) = self.marked_set.as_mut() else {
            return;
        };
        if self.watermark.cap().is_none()
            || now.saturating_sub(m.checked_ms) < MarkedSet::RECHECK_MS
        {
            return;
        }
        m.checked_ms = now;
        let gone = super::generations::any_stream_gone(&self.shared.js, &m.streams).await;
        let base = m.base;
        match gone {
            Ok(false) => {}
            Ok(true) => {
                warn!(
                    partition = self.p,
                    base,
                    "the raw streams this partition's reshard marker names were deleted (the reshard was abandoned); its deadlines are decided on this stream again"
                );
                self.marked_set = None;
                self.absent_set = Some((base, now));
                self.watermark.lift_cap();
                self.turns.lift_deadline_cap();
            }
            Err(e) => {
                debug!(partition = self.p, base, error = %e,
                    "the raw streams a heeded reshard marker names could not be looked up; asking again later");
            }
        }
    }

    /// The reshard marker a starting partition found in its stream (raw sequence, store time,
    /// the set it names; see `bus::worker`), if any: heeded as one read in the stream.
    pub(crate) fn heed_found_marker(&mut self, found: Option<(u64, i64, MarkedSet)>) {
        if let Some((seq, stored_ms, set)) = found {
            self.marked_set = Some(set);
            self.heed_reshard_marker(seq, stored_ms);
        }
    }

    /// A reshard marker stored at `stored_ms` as raw sequence `seq`, announcing a newer set of
    /// raw streams that is on the server. `collab-projector reshard` stores one in every
    /// partition of the streams it moves raw traffic away from before it tells the operator to
    /// map raw subjects to the new set, so inputs of this partition stored in the new set were
    /// stored after it (give or take the servers' clock skew). From here on, until the servers
    /// all map to the new set, an input of this partition may be stored in either set, and a
    /// store time read here no longer says that everything stored before it was read: a turn's
    /// reply may wait in the new stream, stored before its deadline, while a later input here
    /// says the deadline passed. The watermark stops at the marker (less the skew); deadlines
    /// after it are decided once the partition reads the new set, where its watermark goes on.
    fn heed_reshard_marker(&mut self, seq: u64, stored_ms: i64) {
        let skew = self.clock_skew_ms();
        let cap = stored_ms.saturating_sub(skew);
        if self.watermark.cap().is_none_or(|c| c > cap) {
            info!(
                partition = self.p,
                seq,
                cap_ms = cap,
                "a reshard marker: deadlines after it are decided on the new raw streams"
            );
        }
        self.watermark.cap_at(cap);
        self.turns.cap_deadlines_at(cap);
    }

    /// A due deadline with no message to move the watermark: when the consumer has nothing
    /// pending and everything delivered was processed, send the partition a barrier.
    pub(crate) async fn idle_tick(&mut self, consumer: &mut PullConsumer) {
        // Held at a reshard marker: no barrier stored now can move the watermark past it, and
        // the deadlines wait for the new raw streams, unless those are gone.
        if self.watermark.cap().is_some() {
            self.recheck_marked_set().await;
            if self.watermark.cap().is_some() {
                return;
            }
        }
        let Ok(info) = consumer.info().await else {
            return;
        };
        // Everything delivered was processed: either acknowledged already (by us or a previous
        // owner) or processed by us and awaiting its ack.
        let all_processed =
            info.num_ack_pending == 0 || info.delivered.stream_sequence <= self.last_seq;
        if info.num_pending != 0 || !all_processed {
            return;
        }
        // The consumer's view can lag what the stream has stored: after a stream leader
        // election the new leader commits the old leader's last messages with the store times
        // the old leader gave them, seconds in the past, and a consumer whose leader is on a
        // replica still catching up counts nothing pending. So the clock alone cannot move the
        // watermark. A barrier published to this partition goes through the stream's log
        // behind every message stored before it: when it is delivered, everything stored
        // before its store time (give or take the leaders' clock skew) has been, and its store
        // time moves the watermark like any message's.
        let now = super::now_ms();
        if self
            .barrier_sent_ms
            .is_some_and(|sent| now.saturating_sub(sent) < BARRIER_RETRY_MS)
        {
            return;
        }
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(
            crate::pipeline::H_BARRIER,
            self.shared.names.prefix.as_str(),
        );
        // A core publish: the stream stores it, and nothing waits for a publish-ack permit. A
        // barrier lost on the way (no stream leader) is sent again after BARRIER_RETRY_MS.
        if let Err(e) = self
            .shared
            .js
            .client()
            .publish_with_headers(self.barrier_subject.clone(), headers, bytes::Bytes::new())
            .await
        {
            debug!(partition = self.p, error = %e, "barrier not sent");
        }
        self.barrier_sent_ms = Some(now);
    }

    /// Issue `outs` for `inputs`, fenced by this owner's claim (see [`issue_publishes`]).
    async fn issue(
        &mut self,
        outs: Vec<crate::pipeline::Outgoing>,
        inputs: &[&jetstream::Message],
    ) -> Result<super::acker::Publishes, Halt> {
        let outs = self.held_text_before_synthesised_ends(outs);
        issue_publishes(
            &self.shared.publisher,
            &self.fence,
            outs,
            inputs,
            &self.tx,
            self.cancel,
        )
        .await
    }

    /// A run the run contract ended by its timeout leaves its messages and tool calls open, and
    /// the stream redactor may still hold the end of one (the last word of a message that was
    /// streaming): before each synthesised end, what it holds of that stream is published as a
    /// delta marked `redactionFlush`, as a real end is preceded by. Its Msg-Id is the end's with
    /// `:held` added. (A reload's republished ends have none: what was held is gone with the
    /// previous owner's memory.)
    fn held_text_before_synthesised_ends(
        &mut self,
        outs: Vec<crate::pipeline::Outgoing>,
    ) -> Vec<crate::pipeline::Outgoing> {
        if !outs.iter().any(|o| synthesised_end(&o.msg_id).is_some()) {
            return outs;
        }
        let mut all = Vec::with_capacity(outs.len() + 1);
        for out in outs {
            let held = synthesised_end(&out.msg_id).and_then(|id| self.streams.finish(&id, None));
            if let Some(held) = held {
                let ending: serde_json::Map<String, serde_json::Value> =
                    serde_json::from_slice(&out.payload).unwrap_or_default();
                let context = ["threadId", "runId"]
                    .into_iter()
                    .filter_map(|k| ending.get(k).map(|v| (k.to_string(), v.clone())))
                    .collect();
                let source_seq = out
                    .headers
                    .iter()
                    .find(|(k, _)| *k == pipeline::H_SOURCE_SEQ)
                    .and_then(|(_, v)| v.parse().ok())
                    .unwrap_or(0);
                if let Some(n) = crate::ingest::held_text_event(held, &context, &self.shared.ingest)
                {
                    all.push(pipeline::projection(
                        &self.shared.names,
                        &n,
                        source_seq,
                        format!("{}:held", out.msg_id),
                    ));
                }
            }
            all.push(out);
        }
        all
    }

    /// A halted publish: left for redelivery when shutting down, else the partition stops.
    pub(crate) fn left_or_stopped(&self, halt: Halt) -> Result<Disposition, WorkerError> {
        match self.halted(halt) {
            None => Ok(Disposition::LeftForRedelivery(Unprocessed::ShuttingDown)),
            Some(e) => Err(e),
        }
    }

    pub(crate) fn turn_error(&self, e: TurnIoError) -> WorkerError {
        match e {
            TurnIoError::Publish(source) => WorkerError::of_failure(self.p, source),
            TurnIoError::Conflict { .. } => {
                debug!(partition = self.p, error = %e, "restarting the partition");
                WorkerError::Interrupted {
                    partition: self.p,
                    why: "another owner wrote a turn record",
                }
            }
            TurnIoError::WriteFailed { .. } => {
                debug!(partition = self.p, error = %e, "restarting the partition");
                WorkerError::Interrupted {
                    partition: self.p,
                    why: "a turn record write was not stored",
                }
            }
            e => self.setup("turn state", e),
        }
    }

    /// Process the messages `from..=to` of this partition read straight from the stream (they
    /// were delivered, to a previous owner or to a batch that ended early, but not processed).
    /// Their deliveries are acknowledged when redelivered, after processing them again is a no-op.
    pub(crate) async fn replay(
        &mut self,
        stream: &jetstream::stream::Stream,
        from: u64,
        to: u64,
        lease_valid_until: &LeaseValidity,
    ) -> Result<Flow, WorkerError> {
        if to < from {
            return Ok(Flow::Continue);
        }
        // A named reader, deleted once read: a partition that starts over and over (a stream
        // leader that keeps answering short) would otherwise leave one reader per attempt, and
        // nats-server caps a stream's consumers (1,000 by default).
        let name = format!("replay-{}-{}", self.p, uuid::Uuid::new_v4().simple());
        let replay = stream
            .create_consumer(jetstream::consumer::pull::OrderedConfig {
                name: Some(name.clone()),
                filter_subject: self.shared.settings.partition_filter(self.p),
                deliver_policy: jetstream::consumer::DeliverPolicy::ByStartSequence {
                    start_sequence: from,
                },
                ..Default::default()
            })
            .await
            .map_err(|e| self.setup("reading in-flight messages", e))?;
        let flow = self
            .replay_read(stream, replay, from, to, lease_valid_until)
            .await;
        if let Err(e) = stream.delete_consumer(&name).await {
            debug!(partition = self.p, consumer = %name, error = %e, "replay reader not deleted; it expires by itself");
        }
        flow
    }

    /// The reading half of [`Self::replay`].
    async fn replay_read(
        &mut self,
        stream: &jetstream::stream::Stream,
        replay: jetstream::consumer::Consumer<jetstream::consumer::pull::OrderedConfig>,
        from: u64,
        to: u64,
        lease_valid_until: &LeaseValidity,
    ) -> Result<Flow, WorkerError> {
        let p = self.p;
        let short = |why: &'static str| {
            warn!(
                partition = p,
                from, to, why, "replay incomplete; restarting the partition"
            );
            WorkerError::Interrupted { partition: p, why }
        };

        // None of the partition's messages from `from` on is visible. That is the range having
        // gone from the stream (aged out, deleted), or a server answering from a state that does
        // not have them yet (a stream leader cut off from its cluster, a replica catching up).
        // Only the stream leader can tell: the partition goes on only when it holds none of them,
        // and otherwise starts over, however often, since going on would let the next
        // acknowledgement cover inputs nobody read.
        if replay.cached_info().num_pending == 0 {
            return match self
                .confirm_range_end(stream, from.saturating_sub(1), to)
                .await
            {
                Ok(()) => {
                    debug!(
                        partition = self.p,
                        from, to, "none of the in-flight range is in the stream any more"
                    );
                    Ok(Flow::Continue)
                }
                Err(why) => Err(short(why)),
            };
        }
        let mut replayed = replay
            .messages()
            .await
            .map_err(|e| self.setup("reading in-flight messages", e))?;
        let mut count = 0usize;
        // Every message of the range is processed, or the partition starts over: a replay that
        // ends early (a server pause, a dropped connection) must never let the next
        // acknowledgement cover what it did not reach.
        loop {
            let msg = match tokio::time::timeout(REPLAY_SILENCE, replayed.next()).await {
                Ok(Some(Ok(msg))) => msg,
                Ok(Some(Err(_))) => return Err(short("the replay of in-flight messages failed")),
                Ok(None) | Err(_) => {
                    return Err(short("the replay of in-flight messages stopped short"))
                }
            };
            let Ok(info) = msg.info() else {
                return Err(short("a replayed message's metadata could not be read"));
            };
            let (seq, left) = (info.stream_sequence, info.pending);
            if seq < from {
                // The reader was made again from the partition's first message: the client
                // library remakes an ordered reader that lost its state on the server (deleted,
                // a server restart) before its first delivery with "deliver all". Reading on
                // would process the partition's acknowledged history again, which can hold it
                // for as long as its retention takes to read; a new reader starts at `from`.
                return Err(short(
                    "the replay reader was made again from the stream's start",
                ));
            }
            if seq > to {
                break;
            }
            // As before each live input: turn records are written only under a valid lease.
            if !self.wait_out_lapse(lease_valid_until).await? {
                return Ok(Flow::Stop);
            }
            // A replayed input's delivery count: one more than the times in a row the partition
            // stopped on a failure processing it. The input that keeps failing is dead-lettered
            // `max_deliver` once that reaches the limit, as a consumer delivery would be, and the
            // partition goes on; the inputs before it, which it stops behind, are not charged.
            let delivered = self.shared.failures_at(self.p, seq) + 1;
            count += 1;
            if let Flow::Stop = self.process_in_order(msg, false, Some(delivered)).await? {
                return Ok(Flow::Stop);
            }
            if seq >= to {
                break;
            }
            if left == 0 {
                // Nothing after this message is visible to the replay: the rest of the range was
                // deleted (an operator's delete, the stream's limits), or the replay reads a replica that has not
                // caught up. Only the stream leader can tell the two apart.
                self.confirm_range_end(stream, seq, to)
                    .await
                    .map_err(short)?;
                break;
            }
        }
        debug!(
            partition = self.p,
            from, to, count, "took over in-flight messages"
        );
        Ok(Flow::Continue)
    }

    /// Whether the stream's leader holds none of this partition's messages in `after+1..=to`: a
    /// replay that saw nothing past `after` may end there only then. Asked of the leader (not a
    /// direct get, which a lagging replica may answer), so a replay read from a replica still
    /// catching up is not taken for a complete one.
    async fn confirm_range_end(
        &self,
        stream: &jetstream::stream::Stream,
        after: u64,
        to: u64,
    ) -> Result<(), &'static str> {
        use async_nats::jetstream::stream::RawMessageErrorKind;
        match stream
            .get_first_raw_message_by_subject(
                self.shared.settings.partition_filter(self.p),
                after + 1,
            )
            .await
        {
            Ok(next) if next.sequence <= to => {
                Err("the replay ended before a message the stream leader holds")
            }
            Ok(_) => Ok(()),
            Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => Ok(()),
            Err(_) => Err("the end of the in-flight range could not be confirmed"),
        }
    }

    /// Process one message in partition order, then act on what became of it: hand it to the
    /// acker, or leave it for redelivery. `ack`: whether it is a consumer delivery to
    /// acknowledge (false for messages re-read from the stream).
    pub(crate) async fn process_in_order(
        &mut self,
        msg: jetstream::Message,
        ack: bool,
        delivered: Option<i64>,
    ) -> Result<Flow, WorkerError> {
        let disposed = match self.dispose(msg, ack, delivered).await {
            Ok(d) => d,
            Err(e) => {
                // A step of this input's processing failed (not an interruption, nor a publish
                // that stops the partition until an operator acts): charged to this input, so a
                // failure that persists dead-letters it rather than stalling the partition.
                if let (WorkerError::Setup { .. } | WorkerError::Publish { .. }, Some(seq)) =
                    (&e, self.in_hand)
                {
                    let n = self.shared.note_failure(self.p, seq);
                    debug!(
                        partition = self.p,
                        seq,
                        failures = n,
                        "processing an input failed"
                    );
                }
                return Err(e);
            }
        };
        match disposed {
            Disposition::Issued { processed, outcome } => {
                self.shared.state.count_input(outcome);
                if let Outcome::DeadLettered(reason) = outcome {
                    debug!(
                        partition = self.p,
                        seq = self.last_seq,
                        reason = reason.as_str(),
                        "input dead-lettered"
                    );
                }
                if self.tx.send(processed).await.is_err() {
                    return Ok(Flow::Stop);
                }
                Ok(Flow::Continue)
            }
            Disposition::Barrier(processed) => {
                if self.tx.send(processed).await.is_err() {
                    return Ok(Flow::Stop);
                }
                Ok(Flow::Continue)
            }
            Disposition::LeftForRedelivery(Unprocessed::MetadataUnreadable) => {
                Err(WorkerError::Interrupted {
                    partition: self.p,
                    why: "a delivery's metadata could not be read",
                })
            }
            Disposition::LeftForRedelivery(Unprocessed::ShuttingDown) => Ok(Flow::Stop),
        }
    }

    /// The error a halted publish stops the partition with (`None`: shutting down).
    pub(crate) fn halted(&self, halt: Halt) -> Option<WorkerError> {
        halt.into_error(self.p)
    }

    /// Decide what happens to one message: project it (or dead-letter it) and issue its outputs,
    /// retrying a failed publish in place; or leave it unprocessed.
    pub(crate) async fn dispose(
        &mut self,
        msg: jetstream::Message,
        ack: bool,
        delivered: Option<i64>,
    ) -> Result<Disposition, WorkerError> {
        let info = match msg.info() {
            Ok(info) => info,
            Err(e) => {
                // Without its sequence the message can be neither processed in order nor
                // dead-lettered with a reference; skipping it would let the next group's
                // acknowledgement cover it. Leave it (and what follows) for redelivery.
                warn!(partition = self.p, subject = %msg.subject, reply = ?msg.reply, error = %e,
                    "a delivery's metadata cannot be read; restarting the partition");
                return Ok(Disposition::LeftForRedelivery(
                    Unprocessed::MetadataUnreadable,
                ));
            }
        };
        let seq = info.stream_sequence;
        self.in_hand = Some(seq);
        let stored_ms = info.published.timestamp_millis();
        if info.delivered > 1 {
            self.shared.state.count_redelivery();
        }
        let mut fx = Effects::default();
        self.turns
            .before_input(&mut fx)
            .await
            .map_err(|e| self.turn_error(e))?;
        self.turns
            .reached(self.shared, seq, stored_ms, &mut fx)
            .await
            .map_err(|e| self.turn_error(e))?;
        // Every message stored before this one has been processed: deadlines before its store
        // time have passed in event time.
        self.shared
            .state
            .last_processed_ms
            .store(super::now_ms(), Ordering::Relaxed);
        if let Some(base) = super::acker::reshard_marker(&msg) {
            self.on_reshard_marker(seq, stored_ms, base).await?;
        }
        if let Some(wm) = self.watermark.observe(stored_ms) {
            self.watermark_ms.store(wm, Ordering::Relaxed);
            self.turns
                .advance(self.shared, wm, &mut fx)
                .await
                .map_err(|e| self.turn_error(e))?;
        }
        self.last_seq = self.last_seq.max(seq);
        if is_barrier(&msg) {
            // Not an input: it only moved the watermark. What that decided is issued with it.
            self.barrier_sent_ms = None;
            let outs = std::mem::take(&mut fx.outs);
            let publishes = match self.issue(outs, &[&msg]).await {
                Ok(p) => p,
                Err(halt) => return self.left_or_stopped(halt),
            };
            let processed =
                Processed::new(ack.then_some(msg), ack.then_some(stored_ms), publishes, fx);
            return Ok(Disposition::Barrier(processed));
        }
        let delivered = delivered.unwrap_or(info.delivered);
        let Some(outcome) = self
            .project_input(&msg, &info, delivered, &mut fx)
            .await
            .map_err(|e| self.turn_error(e))?
        else {
            return Ok(Disposition::LeftForRedelivery(Unprocessed::ShuttingDown));
        };
        // Cancelled while a publish kept failing: leave the message for redelivery.
        let mut outs = std::mem::take(&mut fx.outs);
        let verify = seq <= self.verify_through || seq <= self.verify_all_through;
        if !ack || delivered > 1 || verify {
            // Delivered before (to a previous owner, or to this partition before it started
            // over): what of it is stored already is not stored again.
            let (mut kept, issued) = (Vec::with_capacity(outs.len()), outs.len());
            for out in outs {
                // An owner acknowledged this input (the checkpoint says so), which it does only
                // once every output the input's own processing made (its Msg-Id names the input)
                // is stored: no look-up needed. Anything else (a decision's response) is looked up.
                let acknowledged = seq <= self.verify_all_through
                    && pipeline::input_of_msg_id(&out.msg_id, info.stream) == Some(seq);
                if acknowledged {
                    debug!(partition = self.p, seq, subject = %out.subject,
                        "output stored already (acknowledged through the checkpoint)");
                    continue;
                }
                // Boxed (a look-up after a takeover only): its state would otherwise be part
                // of every input's processing future, which is moved whole for each input.
                let stored = Box::pin(self.shared.publisher.stored_already_patiently(
                    &out,
                    seq,
                    stored_ms,
                    &[&msg],
                    self.cancel,
                    self.broken,
                    &mut self.seen,
                ))
                .await;
                match stored {
                    None => {
                        return Ok(Disposition::LeftForRedelivery(Unprocessed::ShuttingDown));
                    }
                    Some(true) => {
                        debug!(partition = self.p, seq, subject = %out.subject, "output stored already");
                    }
                    Some(false) => kept.push(out),
                }
            }
            if ack
                && delivered <= 1
                && seq <= self.verify_through
                && seq > self.verify_all_through
                && issued > 0
            {
                self.verify_missed = if kept.len() == issued {
                    self.verify_missed + 1
                } else {
                    0
                };
                if self.verify_missed >= self.look_up_span() {
                    // Past the previous owner's window: nothing later was stored.
                    debug!(
                        partition = self.p,
                        seq, "no output stored for a publish window in a row; looking up no more"
                    );
                    self.verify_through = 0;
                }
            }
            if kept.len() == issued && issued > 0 {
                debug!(
                    partition = self.p,
                    seq, issued, "no output of a looked-up input stored"
                );
            }
            outs = kept;
        } else if !self.seen.is_empty() {
            self.seen.clear();
        }
        let publishes = match self.issue(outs, &[&msg]).await {
            Ok(p) => p,
            Err(halt) => return self.left_or_stopped(halt),
        };
        let processed = Processed::new(ack.then_some(msg), ack.then_some(stored_ms), publishes, fx)
            .of_input(seq);
        Ok(Disposition::Issued { processed, outcome })
    }
}

/// What happens to one input. Decided once per message by [`Partition::dispose`] and matched,
/// exhaustively, where the partition decides whether it will be acknowledged.
// Returned once and matched at once, never stored: boxing the large variant would only add an
// allocation per input.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Disposition {
    /// Its outputs are issued (a failed publish was retried in place until it was sent): the
    /// acker acknowledges it once they and its turn-record writes are stored.
    Issued {
        processed: Processed,
        outcome: Outcome,
    },
    /// A barrier: what the watermark it moved decided is issued, and it is acknowledged like an
    /// input, but it is not one (not counted, not projected).
    Barrier(Processed),
    /// Not processed, not acknowledged: the server redelivers it (to this partition's restart or
    /// its next owner), with everything after it in the partition.
    LeftForRedelivery(Unprocessed),
}

/// Why an input is left for redelivery.
pub(crate) enum Unprocessed {
    /// Its delivery metadata (stream sequence, store time) cannot be read: it can be neither
    /// processed in order nor dead-lettered with a reference. The partition restarts.
    MetadataUnreadable,
    /// The worker is stopping while one of its publishes keeps failing.
    ShuttingDown,
}

/// The stream a synthesised end of a timed-out run ends, from its Msg-Id
/// (`run:<key>:<turn>:end:<message|tool>:<id>`, see `turns::runs::end_of`).
fn synthesised_end(msg_id: &str) -> Option<crate::redact::StreamId> {
    use crate::redact::{StreamId, StreamKind};
    let rest = msg_id.strip_prefix("run:")?;
    let mut parts = rest.rsplitn(4, ':');
    let id = crate::model::decode_id(parts.next()?)?;
    let kind = match parts.next()? {
        "message" => StreamKind::Text,
        "tool" => StreamKind::ToolArgs,
        _ => return None,
    };
    if parts.next()? != "end" {
        return None;
    }
    let (key, _turn) = parts.next()?.rsplit_once(':')?;
    Some(StreamId {
        key: key.to_string(),
        kind,
        id,
    })
}

/// How long a partition waits before asking its consumer again whether a due deadline can fire.
pub(crate) const IDLE_CHECK_MS: i64 = 200;

/// The set of raw streams a heeded reshard marker named.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MarkedSet {
    /// The set's first raw sequence.
    pub(crate) base: u64,
    /// Its streams.
    pub(crate) streams: Vec<String>,
    /// When the set was last looked up, ms since the epoch.
    pub(crate) checked_ms: i64,
}

impl MarkedSet {
    /// How often a partition held at a marker looks its set up again, and how long a set not
    /// found is taken as absent: the pace at which the partitions look for a sealed stream.
    pub(crate) const RECHECK_MS: i64 = 2_000;
}

/// How long a partition waits for its barrier before it sends another (ms).
pub(crate) const BARRIER_RETRY_MS: i64 = 1_000;

/// When the partition's timer is due: at the earlier of the turn deadline `due` (ms since the
/// epoch, clock skew included) and the deferred-record flush `flush`.
fn timer_instant(
    due: Option<i64>,
    flush: Option<tokio::time::Instant>,
) -> Option<tokio::time::Instant> {
    match (due.map(deadline_instant), flush) {
        (Some(d), Some(f)) => Some(d.min(f)),
        (d, f) => d.or(f),
    }
}

/// The instant of the wall-clock time `due` (ms since the epoch); now when it has passed.
fn deadline_instant(due: i64) -> tokio::time::Instant {
    let wait_ms = due.saturating_sub(super::now_ms()).max(0);
    tokio::time::Instant::now() + Duration::from_millis(u64::try_from(wait_ms).unwrap_or(0))
}

impl Partition<'_> {
    /// Project one message into `fx`: its outputs, and what its turn asks for. `None`: cancelled
    /// while a large field could not be stored (the message is left for redelivery).
    pub(crate) async fn project_input(
        &mut self,
        msg: &jetstream::Message,
        info: &jetstream::message::Info<'_>,
        delivered: i64,
        fx: &mut Effects,
    ) -> Result<Option<Outcome>, TurnIoError> {
        let (shared, cancel) = (self.shared, self.cancel);
        let turns = &mut self.turns;
        let raw = RawMessage {
            delivered,
            ..RawMessage::from_delivery(msg, info)
        };
        let mut events = match pipeline::normalize_raw_streamed(
            &raw,
            &shared.names,
            &shared.ingest,
            shared.settings.consumer.max_deliver,
            &mut self.streams,
        ) {
            Err(rejection) => {
                if rejection.reason == crate::model::DlqReason::MaxDeliver {
                    // An event dead-lettered for its deliveries is still read by a streamed
                    // answer's artifact read, which this owner can no longer tell it need not make.
                    turns.forget_streamed();
                }
                fx.outs
                    .push(pipeline::dead_letter(&shared.names, &raw, &rejection));
                return Ok(Some(Outcome::DeadLettered(rejection.reason)));
            }
            Ok(events) => events,
        };
        let blobs = pipeline::offload(
            &mut events,
            raw.bytes.len(),
            &shared.settings.limits,
            shared.publisher.envelope_budget(),
        );
        if !blobs.is_empty()
            && !Box::pin(
                shared
                    .publisher
                    .store_blobs_in_place(&blobs, &[msg], cancel),
            )
            .await
        {
            return Ok(None);
        }
        let enforce = &shared.settings.turns.enforce_roles;
        for (i, n) in events.iter().enumerate() {
            if let Some(usage) = crate::usage::read(&n.envelope) {
                shared
                    .usage_meter
                    .record(crate::usage::spender(&n.envelope).as_deref(), &usage);
            }
            // AG-UI run events follow the run contract (docs/contract.md section 2b) whatever their role; the turn
            // machinery carries both kinds of exchange.
            let run = if shared.settings.runs.enforce {
                pipeline::run_event(n, &raw, &shared.names).and_then(|ev| turns.run_facts(&ev))
            } else {
                None
            };
            let facts = run.or_else(|| pipeline::turn_facts(n, &raw, &shared.names, enforce));
            match facts {
                Some(f) => turns.on_event(shared, n, &f, fx).await?,
                None => {
                    turns.saw(n);
                    fx.outs.push(pipeline::projection(
                        &shared.names,
                        n,
                        raw.seq,
                        pipeline::input_msg_id(raw.stream, raw.seq, i),
                    ));
                }
            }
        }
        let (role, class) = events.first().map_or(
            (
                crate::model::Role::SystemObservability,
                telemetry::TYPE_CLASSES.len(),
            ),
            |n| {
                (
                    n.role(),
                    telemetry::type_class_index(&n.envelope.event_type),
                )
            },
        );
        Ok(Some(Outcome::Projected { role, class }))
    }
}

/// How long a replay waits for the next message of its range before it gives up (and the
/// partition starts over).
pub(crate) const REPLAY_SILENCE: Duration = Duration::from_secs(5);

#[cfg(test)]
mod tests {
    use super::synthesised_end;
    use crate::redact::{StreamId, StreamKind};

    #[test]
    fn a_synthesised_end_names_the_stream_it_ends() {
        let id = |key: &str, kind, id: &str| StreamId {
            key: key.into(),
            kind,
            id: id.into(),
        };
        assert_eq!(
            synthesised_end("run:th-1:r1:end:message:m1"),
            Some(id("th-1", StreamKind::Text, "m1"))
        );
        // Ids that are no key token are encoded in the Msg-Id, and decoded back.
        let encoded = crate::model::encode_id("call 9:x");
        assert_eq!(
            synthesised_end(&format!("run:th-1:r1:end:tool:{encoded}")),
            Some(id("th-1", StreamKind::ToolArgs, "call 9:x"))
        );
        // The run's own terminal, a turn's response and an input's outputs end no stream.
        for other in [
            "run:th-1:r1",
            "turn:k:t1",
            "COLLAB_RAW:5:0",
            "run:th-1:r1:end:other:m1",
        ] {
            assert_eq!(synthesised_end(other), None, "{other}");
        }
    }
}
