//! A worker's outputs on their way to JetStream: every partition publishes through one
//! [`Publisher`], which sizes each output ([`publish::wire_size`]) and fences it with the
//! partition's claim, retries in place only what waiting can heal ([`publish::classify`]),
//! stores offloaded fields first, and looks up what a taken-over input already has stored.

use super::error::{Source, WorkerError};
use super::publish::{self, Failure, Fence};
use super::stats::WorkerState;
use crate::config::{Names, PublishBatches};
use crate::pipeline::{self, OutKind, Outgoing};
use crate::telemetry;
use async_nats::jetstream::{self, message::PublishMessage, AckKind};
use futures::StreamExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// Publishing for every partition of a worker, over contexts of its own.
pub struct Publisher {
    /// The partitions' publishes, pipelined (its publish-ack permits are shared out by
    /// [`Publisher::hand_over`]).
    pub(crate) js: jetstream::Context,
    /// A context of its own for publishes retried in place: the acker retries a failed
    /// projection while the projections queued behind it hold `js`'s publish-ack permits, and
    /// only the acker releases those.
    retry_js: jetstream::Context,
    /// The object store for offloaded fields, over a context of its own (a put awaits its acks
    /// inline, so it must not wait for a permit the partitions' publishes hold). Looked up once.
    blobs_js: jetstream::Context,
    blobs: tokio::sync::OnceCell<jetstream::object_store::ObjectStore>,
    /// The projection and dead-letter streams, for looking up what an input taken over from a
    /// previous owner already has stored. Looked up once.
    out_streams: tokio::sync::OnceCell<(jetstream::stream::Stream, jetstream::stream::Stream)>,
    names: Names,
    pub(crate) state: Arc<WorkerState>,
    /// `consumer.ack_wait`: inputs held while a publish is retried are marked in progress a
    /// few times within it.
    ack_wait: Duration,
    /// `projection.duplicate_window`, the window this worker was configured with.
    duplicate_window: Duration,
    /// The projection and dead-letter streams' own duplicate windows (ms) as last read: an
    /// operator may shorten them on the live streams (`nats stream edit --dupe-window`), and a
    /// retried publish collapses with a stored copy by its Msg-Id only within the stream's
    /// window. Read at start, at each partition start and with every storage sample.
    stream_windows: [AtomicU64; 2],
    /// The same streams' `max_age` (ms, 0 for none) as last read, at the same times (see
    /// [`Publisher::may_have_aged_out`]).
    stream_ages: [AtomicU64; 2],
    /// Most publishes a reader issues before it hands them to its acker.
    hand_over: usize,
    /// Test hook: fail every Nth publish attempt before it is sent (0 = never).
    fail_publish_every: u64,
    /// Test hook: take every Nth publish ack as lost once the duplicate window has passed
    /// (0 = never), as a stored output whose answer never came would be.
    lose_ack_every: u64,
    lost_acks: AtomicU64,
    publish_attempts: AtomicU64,
    /// The largest output, headers included, the server and the output streams accept, as last
    /// read (see [`Publisher::out_budget`]).
    out_budget: std::sync::atomic::AtomicUsize,
    /// Set when the server refused an output as too large: the budget is read again before the
    /// partition runs again ([`Publisher::refresh_out_budget`]).
    budget_stale: AtomicBool,
    /// The partitions' connection's reconnects: whether a publish's ack, or any other answer,
    /// may have been lost with one since it was asked.
    reconnects: super::reconnects::Reconnects,
    /// How the partitions' outputs are stored (`nats.publish_batches`), as chosen at start: as
    /// batches sent by their ackers, atomic or fast-ingest, or published one by one as they are
    /// issued.
    batching: Batching,
    /// Set when the server is found to store a batch's messages one by one: from then on the
    /// ackers publish outputs one at a time, in order. They still go through the ackers: readers
    /// publishing new outputs at once could have them stored ahead of earlier ones still waiting
    /// for their acker.
    batches_off: AtomicBool,
    /// The answers to fast-ingest batches.
    fast: super::fast_batch::FastReplies,
}

/// How a worker's partitions store their outputs (`Publisher::batching`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Batching {
    /// Each output published as it is issued, pipelined, with an ack each.
    Off,
    /// Atomic batches (ADR-50, nats-server 2.12): one proposal per batch on a replicated stream.
    Atomic,
    /// Fast-ingest batches (nats-server 2.14) with gap mode `fail`: no output stored after one
    /// the server did not receive, so a publish lost with a dropped connection cannot be
    /// overtaken by the outputs queued behind it.
    Fast,
}

impl Batching {
    fn name(self) -> &'static str {
        match self {
            Batching::Off => "single publishes",
            Batching::Atomic => "atomic batches",
            Batching::Fast => "fast-ingest batches",
        }
    }
}

/// Slack kept below the duplicate window: an output sent earlier than the window less this is
/// looked up before it is sent again (see [`Publisher::stored_past_window`]).
const DUPLICATE_WINDOW_MARGIN: Duration = Duration::from_secs(15);

use super::{nth, test_hook_every, PUBLISH_ACK_WAIT};

impl Publisher {
    /// Publishing over `js`'s connection. `hand_over`: half of `consumer.publish_window` shared
    /// out among the partitions, at most 64, so all partitions together hold fewer unhanded
    /// publishes than `js` has permits.
    pub(crate) async fn new(
        js: jetstream::Context,
        names: Names,
        state: Arc<WorkerState>,
        settings: &crate::config::Settings,
    ) -> Result<Publisher, OutputsUnread> {
        let context = || {
            jetstream::ContextBuilder::new()
                .timeout(PUBLISH_ACK_WAIT)
                .build(js.client())
        };
        let partitions = usize::from(settings.nats.partitions.max(1));
        let fail_publish_every = test_hook_every("COLLAB_TEST_FAIL_PUBLISH_EVERY");
        let outputs = output_configs(&js, &names).await?;
        let replicated = outputs[0]
            .as_ref()
            .map_or(settings.nats.replicas > 1, |c| c.num_replicas > 1);
        let wanted = match settings.nats.publish_batches {
            PublishBatches::Always => Batching::Atomic,
            PublishBatches::Fast if replicated => {
                warn!("nats.publish_batches = \"fast\" on a replicated projection stream: its leader proposes a fast batch's messages one at a time and refuses the fence's second expectation while one is proposed; outputs are stored as atomic batches instead");
                Batching::Atomic
            }
            PublishBatches::Fast => Batching::Fast,
            PublishBatches::Never => Batching::Off,
            PublishBatches::Auto if replicated => Batching::Atomic,
            // Fast-ingest batches keep a key's order across a dropped connection, which
            // pipelined publishes do not.
            PublishBatches::Auto => Batching::Fast,
        };
        let batching = if batches_supported(wanted, &js, &names, &outputs) {
            wanted
        } else {
            Batching::Off
        };
        tracing::info!(
            "outputs are stored as {} (nats.publish_batches)",
            batching.name()
        );
        Ok(Publisher {
            reconnects: super::reconnects::Reconnects::new(&js.client()),
            batching,
            batches_off: AtomicBool::new(false),
            fast: super::fast_batch::FastReplies::new(js.client()),
            retry_js: context(),
            blobs_js: context(),
            blobs: tokio::sync::OnceCell::new(),
            out_streams: tokio::sync::OnceCell::new(),
            out_budget: std::sync::atomic::AtomicUsize::new(output_budget(&js, &outputs)),
            budget_stale: AtomicBool::new(false),
            js,
            names,
            state,
            ack_wait: settings.consumer.ack_wait,
            duplicate_window: settings.projection.duplicate_window,
            stream_windows: outputs.each_ref().map(|c| {
                let window = c
                    .as_ref()
                    .map_or(settings.projection.duplicate_window, |c| c.duplicate_window);
                AtomicU64::new(millis(window))
            }),
            // Unread, a stream's age is taken as configured (never as "no age", which would
            // have a decision older than the stream keeps looked up and published again).
            stream_ages: {
                let set = [settings.projection.max_age, settings.nats.dlq_max_age];
                std::array::from_fn(|i| {
                    let age = outputs[i].as_ref().map_or(set[i], |c| c.max_age);
                    AtomicU64::new(millis(age))
                })
            },
            hand_over: (settings.consumer.publish_window / (2 * partitions)).clamp(1, 64),
            fail_publish_every,
            publish_attempts: AtomicU64::new(0),
            lose_ack_every: test_hook_every("COLLAB_TEST_LOSE_PUBLISH_ACK_EVERY"),
            lost_acks: AtomicU64::new(0),
        })
    }

    /// The largest output, headers included, the server and the output streams accept.
    pub fn out_budget(&self) -> usize {
        self.out_budget.load(Ordering::Relaxed)
    }

    /// The largest envelope a projection may serialise to once its large fields are offloaded:
    /// the output budget less room for the projection's headers.
    pub fn envelope_budget(&self) -> usize {
        self.out_budget().saturating_sub(ENVELOPE_HEADROOM)
    }

    /// Read the output budget again if an output was refused as too large since it was read:
    /// an operator may have lowered an output stream's largest message, or the worker may have
    /// reconnected to a server with a smaller `max_payload`. Outputs made to fit the old budget
    /// would be refused again on every restart of the partition; with the budget read again
    /// they are offloaded, or dead-lettered `too_large`, to fit. Called as a partition starts.
    pub(crate) async fn refresh_out_budget(&self) {
        if !self.budget_stale.swap(false, Ordering::Relaxed) {
            return;
        }
        match output_configs(&self.retry_js, &self.names).await {
            Ok(outputs) => {
                let now = output_budget(&self.js, &outputs);
                let was = self.out_budget.swap(now, Ordering::Relaxed);
                if now != was {
                    warn!(
                        bytes = now,
                        was, "the largest output the server and the output streams accept changed"
                    );
                }
            }
            Err(e) => {
                warn!(error = %e, "reading the output streams' largest message failed; trying again at the partition's next start");
                self.budget_stale.store(true, Ordering::Relaxed);
            }
        }
    }

    /// Read the output streams' duplicate windows and ages again (see
    /// [`Publisher::heed_output_stream`]), once each: a partition that starts after a
    /// takeover sends again what its previous owner may have stored, and must know how long the
    /// Msg-Id holds and what may have aged out. A stream that does not answer keeps its last
    /// values (the storage sample reads them again within 15 s).
    pub(crate) async fn refresh_output_streams(&self) {
        for name in [&self.names.proj_stream, &self.names.dlq_stream] {
            match self.retry_js.get_stream(name.as_str()).await {
                Ok(stream) => self.heed_output_stream(name, &stream.cached_info().config),
                Err(e) => {
                    tracing::debug!(stream = %name, error = %e, "the output stream's duplicate window and age not read again")
                }
            }
        }
    }

    /// How long a publish sent again collapses with a stored copy by its Msg-Id: the shortest of
    /// the configured window and the output streams' own, as last read.
    fn duplicate_window(&self) -> Duration {
        let streams = self
            .stream_windows
            .iter()
            .map(|w| Duration::from_millis(w.load(Ordering::Relaxed)));
        streams.fold(self.duplicate_window, Duration::min)
    }

    /// Take the duplicate window and `max_age` of `config`, just read from the output stream
    /// `stream`, as that stream's (other streams are ignored); a changed window is logged.
    pub(crate) fn heed_output_stream(&self, stream: &str, config: &jetstream::stream::Config) {
        let i = if stream == self.names.proj_stream {
            0
        } else if stream == self.names.dlq_stream {
            1
        } else {
            return;
        };
        self.stream_ages[i].store(millis(config.max_age), Ordering::Relaxed);
        let window = config.duplicate_window;
        let now = millis(window);
        let was = self.stream_windows[i].swap(now, Ordering::Relaxed);
        if was != now {
            warn!(
                stream,
                window = ?window,
                was = ?Duration::from_millis(was),
                "an output stream's duplicate window changed; outputs sent again are looked up in the stream once older than it, less 15 s"
            );
        }
    }

    /// Whether the partitions' ackers store outputs (as batches while batching is on, see
    /// [`Publisher::store_batched`]) rather than the readers publishing them as issued.
    pub(crate) fn batches(&self) -> bool {
        self.batching != Batching::Off
    }

    /// How outputs are stored now.
    pub(crate) fn batching(&self) -> Batching {
        if self.batches_off.load(Ordering::Relaxed) {
            Batching::Off
        } else {
            self.batching
        }
    }

    /// Most publishes a reader issues before it hands them to its acker (see `issue_publishes`):
    /// half of `consumer.publish_window` shared out among the partitions, at most 64, so all
    /// partitions together hold fewer unhanded publishes than `js` has permits.
    pub(crate) fn hand_over(&self) -> usize {
        self.hand_over
    }

    /// Test hook (`COLLAB_TEST_LOSE_PUBLISH_ACK_EVERY`): for every Nth publish acknowledged,
    /// how long to wait before taking its ack as lost (the duplicate window and a little more),
    /// so the output is retried in place after its Msg-Id stopped collapsing a second copy.
    pub(crate) fn injected_lost_ack(&self) -> Option<Duration> {
        nth(&self.lost_acks, self.lose_ack_every)
            .then(|| self.duplicate_window() + Duration::from_millis(500))
    }

    /// Test hook: whether this publish or batch attempt is the Nth, to be failed before it is
    /// sent (`COLLAB_TEST_FAIL_PUBLISH_EVERY`).
    fn injected_failure(&self) -> bool {
        nth(&self.publish_attempts, self.fail_publish_every)
    }

    /// The partitions' connection's count of connects so far: read before a publish is sent,
    /// to tell later whether its ack may have gone with a reconnect.
    pub(crate) fn connects(&self) -> u64 {
        self.reconnects.connects()
    }

    /// The partitions' connection's reconnects, for requests other than publishes (see
    /// [`super::reconnects::Reconnects`]).
    pub(crate) fn reconnects(&self) -> &super::reconnects::Reconnects {
        &self.reconnects
    }

    /// The server's answer (`fut`: a publish's ack, a batch's answers) to what was sent when
    /// the connection had connected `connects_at_send` times, or `None` when it has reconnected
    /// since and no answer came within [`super::reconnects::RECONNECT_GRACE`] of that being seen: the answer
    /// went with the old connection, and waiting out the ack timeout would stall the partition
    /// for nothing. The caller sends the outputs again, which collapse by their Msg-Ids if they
    /// were stored.
    pub(crate) async fn ack_unless_lost<F: std::future::IntoFuture>(
        &self,
        fut: F,
        connects_at_send: u64,
    ) -> Option<F::Output> {
        let answer = self
            .reconnects
            .answer_unless_lost(fut, connects_at_send)
            .await;
        answer
            .map_err(|connects| {
                if self.reconnects.first_lost_with(connects) {
                    info!(
                        "publish acks lost with a reconnect; their outputs are sent again (a stored one collapses by its Msg-Id)"
                    );
                }
            })
            .ok()
    }

    /// Issue one publish on `js`, fenced by the partition's claim; the returned future
    /// resolves with the server's ack.
    pub(crate) async fn send(
        &self,
        js: &jetstream::Context,
        out: &Outgoing,
        fence: &Fence,
    ) -> Result<jetstream::context::PublishAckFuture, Failure> {
        if self.injected_failure() {
            return Err(Failure::Transient {
                subject: out.subject.clone(),
                source: jetstream::context::PublishError::with_source(
                    jetstream::context::PublishErrorKind::Other,
                    "injected publish failure (COLLAB_TEST_FAIL_PUBLISH_EVERY)",
                ),
            });
        }
        let publish = PublishMessage::build()
            .payload(out.payload.clone())
            .headers(fence.headers(out))
            .message_id(out.msg_id.as_str());
        js.send_publish(out.subject.clone(), publish)
            .await
            .map_err(|e| publish::classify(&out.subject, e))
    }

    /// Publish an output no earlier send can have stored until the server acknowledges,
    /// backing off between attempts while the failure is one waiting heals. Keeps `inputs`
    /// alive meanwhile so the server does not redeliver them. Gives up on cancellation, or at
    /// once on a failure waiting does not heal.
    pub(crate) async fn publish_in_place(
        &self,
        out: &Outgoing,
        fence: &Fence,
        inputs: &[&jetstream::Message],
        cancel: &CancellationToken,
    ) -> Result<(), Halt> {
        self.publish_in_place_from(out, fence, inputs, cancel, None)
            .await
    }

    /// [`Publisher::publish_in_place`] for an output sent before, issued at `issued` (an ack
    /// given up after a reconnect may be of a send made long before, when the link dropped).
    pub(crate) async fn publish_in_place_since(
        &self,
        out: &Outgoing,
        fence: &Fence,
        inputs: &[&jetstream::Message],
        cancel: &CancellationToken,
        issued: tokio::time::Instant,
    ) -> Result<(), Halt> {
        // Its first send was made at most an ack timeout (of waiting for a permit, or for an
        // ack that failed) before `issued`.
        let waited = chrono::Duration::from_std(issued.elapsed() + PUBLISH_ACK_WAIT)
            .unwrap_or(chrono::Duration::MAX);
        let first_sent = chrono::Utc::now()
            .checked_sub_signed(waited)
            .unwrap_or(chrono::DateTime::<chrono::Utc>::MIN_UTC);
        self.publish_in_place_from(out, fence, inputs, cancel, Some(first_sent))
            .await
    }

    /// Publish `out` in place, first sent at `first_sent`, or never sent yet (`None`): an
    /// output no earlier send can have stored is not looked up before its first send, whatever
    /// the duplicate window. (Looking it up there would read its subject by a consumer of its
    /// own for every such output once the window is under the margin plus an ack timeout: with
    /// fast-ingest batches and a 20 s window, every input of a group of one, at a p50 of 15 ms.)
    async fn publish_in_place_from(
        &self,
        out: &Outgoing,
        fence: &Fence,
        inputs: &[&jetstream::Message],
        cancel: &CancellationToken,
        mut first_sent: Option<chrono::DateTime<chrono::Utc>>,
    ) -> Result<(), Halt> {
        let mut patience = Patience::new();
        // The output may have been stored by its first send or by any retry, with its answer
        // lost: it is looked up once sending it again would no longer collapse by its Msg-Id,
        // and not sent again if stored.
        loop {
            let looked_up = match first_sent {
                Some(at) => self.stored_past_window(out, at).await,
                None => Ok(false),
            };
            match looked_up {
                Ok(true) => {
                    info!(subject = %out.subject, "a retried output was found stored past the duplicate window; not sent again");
                    return Ok(());
                }
                Ok(false) => {}
                Err(e) => {
                    // Cannot tell: ask again rather than publish what may be stored.
                    warn!(error = %e, "retried output past the duplicate window not looked up; asking again");
                    if !self.wait_keeping(inputs, cancel, &mut patience).await {
                        return Err(Halt::Cancelled);
                    }
                    continue;
                }
            }
            first_sent.get_or_insert_with(chrono::Utc::now);
            let connects = self.connects();
            let result = match self.send(&self.retry_js, out, fence).await {
                Ok(fut) => match self.ack_unless_lost(fut, connects).await {
                    Some(answer) => answer
                        .map(|_| ())
                        .map_err(|e| publish::classify(&out.subject, e)),
                    None => Err(Failure::Transient {
                        subject: out.subject.clone(),
                        source: jetstream::context::PublishError::with_source(
                            jetstream::context::PublishErrorKind::Other,
                            "its ack went with a reconnect",
                        ),
                    }),
                },
                Err(f) => Err(f),
            };
            match result {
                Ok(()) => return Ok(()),
                Err(f @ Failure::Transient { .. }) => {
                    self.state.count_publish_retry();
                    if f.is_busy() {
                        // Routine on a replicated stream (counted, not worth a warning each).
                        debug!(error = %f, "publish refused while an earlier one is proposed; retrying in place");
                    } else {
                        warn!(error = %f, "publish failed; retrying in place");
                    }
                }
                Err(f) => return Err(Halt::Failed(self.count_failure(f))),
            }
            if !self.wait_keeping(inputs, cancel, &mut patience).await {
                return Err(Halt::Cancelled);
            }
        }
    }

    /// Whether `out`, first sent (or decided) at `sent_at`, is stored where its Msg-Id no longer
    /// collapses a second copy: `false` while `sent_at` is within the duplicate window (less a
    /// margin), where sending it again collapses with a stored copy; past it, the output's
    /// subject is searched from `sent_at` on. No input's own output is assumed.
    pub(crate) async fn stored_past_window(
        &self,
        out: &Outgoing,
        sent_at: chrono::DateTime<chrono::Utc>,
    ) -> Result<bool, LookupFailed> {
        if age_since(sent_at) + DUPLICATE_WINDOW_MARGIN < self.duplicate_window() {
            return Ok(false);
        }
        self.stored_already(out, 0, sent_at.timestamp_millis())
            .await
    }

    /// Whether `out`, stored (if at all) at or after `since`, may have left its stream by age:
    /// `since` is at least the stream's `max_age` ago, as read from the server at the
    /// partition's start and with every 15 s storage sample, so an edit of the running stream
    /// counts within 15 s (at once for a partition that starts after it). A look-up that did not find such an output cannot tell "never stored" from
    /// "stored, and aged out since".
    pub(crate) fn may_have_aged_out(
        &self,
        out: &Outgoing,
        since: chrono::DateTime<chrono::Utc>,
    ) -> bool {
        let i = match out.kind {
            OutKind::Projection(_) => 0,
            OutKind::DeadLetter(_) => 1,
        };
        let max_age = Duration::from_millis(self.stream_ages[i].load(Ordering::Relaxed));
        !max_age.is_zero() && age_since(since) >= max_age
    }

    /// Whether `out`, an output of the raw input at `seq` (stored at `stored_ms`), is in its
    /// stream already: a previous owner (or an earlier run of this partition) stored it but did
    /// not live to acknowledge the input. Publishing it again would collapse only within the
    /// duplicate window; this look-up holds beyond it. A projection subject's outputs are stored
    /// in raw order, so its last message answers at once unless it is a later input's; otherwise
    /// (and for dead letters) the subject is read from the input's store time on, by a consumer
    /// deleted once read (a stream holds at most 1,000 consumers by default on nats-server 2.15).
    /// A look-up that cannot answer is an error, never a "no": the caller asks again rather than
    /// publish what may be stored.
    ///
    /// A projection over the output budget is looked up as the `too_large` dead letter
    /// [`Publisher::fit`] makes of it (and then as itself, stored under a larger budget before).
    pub(crate) async fn stored_already(
        &self,
        out: &Outgoing,
        seq: u64,
        stored_ms: i64,
    ) -> Result<bool, LookupFailed> {
        self.stored_already_seen(out, seq, stored_ms, &mut SeenOutputs::default())
            .await
    }

    /// [`Publisher::stored_already`], reading through `seen`: what earlier look-ups read of a
    /// subject is not read again.
    async fn stored_already_seen(
        &self,
        out: &Outgoing,
        seq: u64,
        stored_ms: i64,
        seen: &mut SeenOutputs,
    ) -> Result<bool, LookupFailed> {
        if matches!(out.kind, OutKind::Projection(_)) && publish::wire_size(out) > self.out_budget()
        {
            let dead_letter = pipeline::too_large(&self.names, out, self.out_budget());
            if self.stored_as(&dead_letter, seq, stored_ms, seen).await? {
                return Ok(true);
            }
        }
        self.stored_as(out, seq, stored_ms, seen).await
    }

    /// [`Publisher::stored_already`] for `out` exactly as it would be stored.
    async fn stored_as(
        &self,
        out: &Outgoing,
        seq: u64,
        stored_ms: i64,
        seen: &mut SeenOutputs,
    ) -> Result<bool, LookupFailed> {
        if seen.has(&out.subject, &out.msg_id) {
            return Ok(true);
        }
        let failed = |what: &str, e: &dyn std::fmt::Display| LookupFailed {
            subject: out.subject.clone(),
            what: format!("{what}: {e}"),
        };
        let (proj, dlq) = self
            .out_streams
            .get_or_try_init(|| async {
                let proj = self.retry_js.get_stream(&self.names.proj_stream).await?;
                let dlq = self.retry_js.get_stream(&self.names.dlq_stream).await?;
                Ok::<_, jetstream::context::GetStreamError>((proj, dlq))
            })
            .await
            .map_err(|e| failed("opening the output streams", &e))?;
        let stream = match out.kind {
            OutKind::Projection(_) => proj,
            OutKind::DeadLetter(_) => dlq,
        };
        let same = |h: &async_nats::HeaderMap| {
            h.get("Nats-Msg-Id")
                .is_some_and(|id| id.as_str() == out.msg_id)
        };
        let last = match publish::last_from_leader(stream, &out.subject).await {
            Ok(Some(last)) => last,
            Ok(None) => return Ok(false),
            Err(e) => return Err(failed("reading the subject's last message", &e)),
        };
        if same(&last.headers) {
            return Ok(true);
        }
        // A projection subject names the input's key, so only this partition writes it, in raw
        // order: an earlier input's output last means this one is not stored. (This input's own
        // other output last says nothing: an input can put several outputs on one subject, and
        // the scan below decides.) Dead-letter
        // subjects (one per reason) are written by every partition in no common order.
        // Only an output made by one input's own processing (its Msg-Id names that input, see
        // `pipeline::input_msg_id`) says where the partition's processing was; a timeout's
        // response can land on the subject after later inputs' outputs.
        let own_subject = matches!(out.kind, OutKind::Projection(_));
        let last_input = last
            .headers
            .get("Nats-Msg-Id")
            .and_then(|id| self.names.input_of_msg_id(id.as_str()))
            .map(|(_, seq)| seq);
        if own_subject && last_input.is_some_and(|s| s < seq) {
            return Ok(false);
        }
        // Look for this one among the subject's messages since the input was stored (give or
        // take the servers' clocks); the subject's last message older than that means none is.
        let since_ms = stored_ms.saturating_sub(60_000);
        if last.time.timestamp_millis() < since_ms {
            return Ok(false);
        }
        // What was read of this subject before covers it from its window's start on: only
        // what was stored past that needs reading.
        let deliver_policy = match seen.read_through(&out.subject, since_ms) {
            Some(through) if last.sequence <= through => return Ok(false),
            Some(through) => jetstream::consumer::DeliverPolicy::ByStartSequence {
                start_sequence: through + 1,
            },
            None => jetstream::consumer::DeliverPolicy::ByStartTime {
                start_time: chrono::DateTime::from_timestamp_millis(since_ms).unwrap_or_default(),
            },
        };
        let name = format!("lookup-{}", uuid::Uuid::new_v4().simple());
        let reader = lookup_reader(stream, &name, &out.subject, deliver_policy)
            .await
            .map_err(|e| failed("creating the look-up reader", &e))?;
        let read = read_msg_ids(reader, last.sequence).await;
        if let Err(e) = stream.delete_consumer(&name).await {
            debug!(consumer = %name, error = %e, "look-up reader not deleted; it expires by itself");
        }
        let ids = read.map_err(|e| failed("reading the subject", &e))?;
        debug!(subject = %out.subject, read = ids.len(), through = last.sequence,
            "read a subject's outputs for look-ups");
        seen.record(&out.subject, since_ms, last.sequence, ids);
        Ok(seen.has(&out.subject, &out.msg_id))
    }

    /// [`Publisher::stored_already`], asked again (keeping `inputs` alive) until it answers.
    /// `None`: cancelled, or the partition broke (its acker stopped), first.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn stored_already_patiently(
        &self,
        out: &Outgoing,
        seq: u64,
        stored_ms: i64,
        inputs: &[&jetstream::Message],
        cancel: &CancellationToken,
        broken: &CancellationToken,
        seen: &mut SeenOutputs,
    ) -> Option<bool> {
        let mut patience = Patience::new();
        loop {
            if broken.is_cancelled() {
                return None;
            }
            match self.stored_already_seen(out, seq, stored_ms, seen).await {
                Ok(stored) => return Some(stored),
                Err(e) => {
                    metrics::counter!(telemetry::LOOKUP_RETRIES).increment(1);
                    warn!(seq, error = %e, "look-up of a stored output failed; asking again");
                }
            }
            if !self.wait_keeping(inputs, cancel, &mut patience).await {
                return None;
            }
        }
    }

    /// Store `outs` (outputs of inputs taken in partition order) as batches: each stream's
    /// outputs in order, each batch only once the one before it on that stream is answered, the
    /// projection stream's and the dead-letter stream's side by side. What is stored of each
    /// stream's outputs is always a prefix of them, so a projection subject (one key's) is
    /// stored in raw order; across the two streams, anything stored past an output not stored is
    /// within this group of inputs (the takeover's look-ups go on for at least a group, see
    /// [`super::acker::GROUP_MAX`]). Atomic batches store all of a batch or nothing, and a
    /// replicated stream proposes a whole batch at once; fast-ingest batches store a prefix of
    /// each batch and stop at the first message the server did not receive. Every message keeps
    /// its Msg-Id and the fence expectation, so nothing past a newer claim is stored. What a
    /// batch did not store (a Msg-Id stored before, as after a takeover, refusing an atomic
    /// batch; a fast batch cut by a dropped connection; a server without batches; no answer in
    /// time) is published again one output at a time, in place, where a stored Msg-Id collapses
    /// alone.
    ///
    /// A halt comes with the index in `outs` of the output being stored when it came (of the
    /// earlier one when both streams halt; a failure before a shutdown).
    pub(crate) async fn store_batched(
        &self,
        outs: &[&Outgoing],
        fence: &Fence,
        inputs: &[&jetstream::Message],
        cancel: &CancellationToken,
    ) -> Result<(), (Halt, usize)> {
        let (dead, live): (Vec<usize>, Vec<usize>) =
            (0..outs.len()).partition(|&i| matches!(outs[i].kind, OutKind::DeadLetter(_)));
        if dead.is_empty() || live.is_empty() {
            return self.store_in_order(outs, &[], fence, inputs, cancel).await;
        }
        let pick = |places: &[usize]| places.iter().map(|&i| outs[i]).collect::<Vec<_>>();
        let (projections, dead_letters) = (pick(&live), pick(&dead));
        let (a, b) = tokio::join!(
            self.store_in_order(&projections, &live, fence, inputs, cancel),
            self.store_in_order(&dead_letters, &dead, fence, inputs, cancel),
        );
        match (a, b) {
            (Ok(()), Ok(())) => Ok(()),
            (Err(e), Ok(())) | (Ok(()), Err(e)) => Err(e),
            (Err(a), Err(b)) => Err(match (&a.0, &b.0) {
                (Halt::Failed(_), Halt::Cancelled) => a,
                (Halt::Cancelled, Halt::Failed(_)) => b,
                _ if a.1 <= b.1 => a,
                _ => b,
            }),
        }
    }

    /// One stream's outputs (`outs`), stored as batches one after the other, what a batch did
    /// not store published one at a time before the next batch. A halt comes with the output's
    /// place: its index in `outs`, or `places[index]` when places are given.
    async fn store_in_order(
        &self,
        outs: &[&Outgoing],
        places: &[usize],
        fence: &Fence,
        inputs: &[&jetstream::Message],
        cancel: &CancellationToken,
    ) -> Result<(), (Halt, usize)> {
        let place = |i: usize| places.get(i).copied().unwrap_or(i);
        let mut at = 0;
        for chunk in batches_of(outs) {
            let sent = tokio::time::Instant::now();
            // Batching may have been turned off since these were issued. `unsent`: nothing of
            // the chunk went to the server (a fast batch of one output is published on its own).
            let (stored, unsent) = match self.batching() {
                Batching::Atomic => match self.try_batch(chunk, fence).await {
                    Ok(true) => (chunk.len(), false),
                    Ok(false) => (0, false),
                    Err(halt) => return Err((halt, place(at))),
                },
                Batching::Fast if chunk.len() < 2 => (0, true),
                Batching::Fast => match self.try_fast_batch(chunk, fence).await {
                    Ok(stored) => (stored.min(chunk.len()), false),
                    Err((halt, i)) => return Err((halt, place(at + i))),
                },
                Batching::Off => (0, true),
            };
            for (i, out) in chunk.iter().enumerate().skip(stored) {
                let published = if unsent {
                    self.publish_in_place(out, fence, inputs, cancel).await
                } else {
                    self.publish_in_place_since(out, fence, inputs, cancel, sent)
                        .await
                };
                published.map_err(|halt| (halt, place(at + i)))?;
            }
            at += chunk.len();
        }
        Ok(())
    }

    /// Send `chunk` as one fast-ingest batch: how many of its outputs, from the first, are
    /// stored (the rest are to be published one at a time, counted), or a halt when the fence
    /// was lost (with the index of the output refused). A single output is not sent here
    /// ([`Publisher::store_in_order`] publishes it in place, just as ordered).
    async fn try_fast_batch(
        &self,
        chunk: &[&Outgoing],
        fence: &Fence,
    ) -> Result<usize, (Halt, usize)> {
        let stored = match self.send_fast_batch(chunk, fence).await {
            FastOutcome::Stored => {
                metrics::counter!(telemetry::PUBLISH_BATCHES, "outcome" => "stored").increment(1);
                if let Some(wait) = self.injected_lost_ack() {
                    // As if the batch's answer never came: its outputs go one at a time.
                    tokio::time::sleep(wait).await;
                    return Ok(0);
                }
                return Ok(chunk.len());
            }
            FastOutcome::Deposed(f, at) => {
                return Err((Halt::Failed(self.count_failure(f)), at.min(chunk.len() - 1)))
            }
            FastOutcome::Unsupported(answer) => {
                self.batches_off.store(true, Ordering::Relaxed);
                warn!(answer = %answer, "the server answered a fast-ingest batch's message as a single publish (older than nats-server 2.14?); outputs are published one at a time from now on");
                0
            }
            FastOutcome::Stopped(stored, why) => {
                info!(outputs = chunk.len(), stored, why = %why, "a fast-ingest batch stopped; its other outputs are published one at a time, in order");
                stored
            }
        };
        metrics::counter!(telemetry::PUBLISH_BATCHES, "outcome" => "fell_back").increment(1);
        Ok(stored)
    }

    /// One fast-ingest batch, every message published with its place in the batch, the last
    /// committing it; then its answers read until the final one. A reconnect since the first
    /// send ends the wait after [`super::reconnects::RECONNECT_GRACE`] (an answer sent before it went with the
    /// old connection), as does [`BATCH_COMMIT_TIMEOUT`] without one; its outputs are then
    /// published one at a time, where a stored one collapses by its Msg-Id.
    async fn send_fast_batch(&self, chunk: &[&Outgoing], fence: &Fence) -> FastOutcome {
        let unknown = |why: String| FastOutcome::Stopped(0, why);
        if self.injected_failure() {
            return unknown("injected batch failure (COLLAB_TEST_FAIL_PUBLISH_EVERY)".into());
        }
        let mut batch = match self.fast.open().await {
            Ok(b) => b,
            Err(e) => return unknown(e),
        };
        let connects_at_send = self.connects();
        let client = self.js.client();
        for (i, out) in chunk.iter().enumerate() {
            let mut headers = fence.headers(out);
            headers.insert("Nats-Msg-Id", out.msg_id.as_str());
            if let Err(e) = client
                .publish_with_reply_and_headers(
                    out.subject.clone(),
                    batch.reply(i + 1, chunk.len()),
                    headers,
                    out.payload.clone(),
                )
                .await
            {
                return unknown(format!("sending: {e}"));
            }
        }
        let last = &chunk[chunk.len() - 1].subject;
        let answers = read_fast_answers(&mut batch.answers, chunk.len(), last);
        match tokio::time::timeout(
            BATCH_COMMIT_TIMEOUT,
            self.ack_unless_lost(answers, connects_at_send),
        )
        .await
        {
            Ok(Some(outcome)) => outcome,
            Ok(None) => unknown("reconnected before the answer".into()),
            Err(_) => unknown("no answer in time".into()),
        }
    }

    /// Send `chunk` as one atomic batch: `true` when stored, `false` when it is to be published
    /// one output at a time (counted and said why), a halt when the fence was lost.
    async fn try_batch(&self, chunk: &[&Outgoing], fence: &Fence) -> Result<bool, Halt> {
        match self.send_batch(chunk, fence).await {
            Ok(()) => {
                metrics::counter!(telemetry::PUBLISH_BATCHES, "outcome" => "stored").increment(1);
                return Ok(true);
            }
            Err(BatchRefused::Deposed(f)) => return Err(Halt::Failed(self.count_failure(f))),
            Err(BatchRefused::Unsupported(answer)) => {
                self.batches_off.store(true, Ordering::Relaxed);
                warn!(answer = %answer, "the server stored an atomic batch's messages one by one (older than nats-server 2.12?); outputs are published one at a time from now on");
            }
            Err(BatchRefused::Other(why)) => {
                debug!(outputs = chunk.len(), why = %why, "atomic batch not stored; publishing its outputs one at a time");
            }
        }
        metrics::counter!(telemetry::PUBLISH_BATCHES, "outcome" => "fell_back").increment(1);
        Ok(false)
    }

    /// One atomic batch: every output but the last published, the last sent with the commit
    /// and its answer awaited.
    async fn send_batch(&self, chunk: &[&Outgoing], fence: &Fence) -> Result<(), BatchRefused> {
        let Some((last, rest)) = chunk.split_last() else {
            return Ok(());
        };
        if self.injected_failure() {
            return Err(BatchRefused::Other(
                "injected batch failure (COLLAB_TEST_FAIL_PUBLISH_EVERY)".into(),
            ));
        }
        let client = self.js.client();
        let id = uuid::Uuid::new_v4().simple().to_string();
        let headers = |out: &Outgoing, seq: usize| {
            let mut h = fence.headers(out);
            h.insert("Nats-Msg-Id", out.msg_id.as_str());
            h.insert("Nats-Batch-Id", id.as_str());
            h.insert("Nats-Batch-Sequence", seq.to_string());
            h
        };
        for (i, out) in rest.iter().enumerate() {
            client
                .publish_with_headers(
                    out.subject.clone(),
                    headers(out, i + 1),
                    out.payload.clone(),
                )
                .await
                .map_err(|e| BatchRefused::Other(format!("sending: {e}")))?;
        }
        let mut commit = headers(last, chunk.len());
        commit.insert("Nats-Batch-Commit", "1");
        let request = async_nats::Request::new()
            .headers(commit)
            .payload(last.payload.clone())
            .timeout(Some(BATCH_COMMIT_TIMEOUT));
        let answer = client
            .send_request(last.subject.clone(), request)
            .await
            .map_err(|e| BatchRefused::Other(format!("commit: {e}")))?;
        batch_answer(&answer.payload, chunk.len(), &last.subject)
    }

    /// Count (and log) a failure waiting does not heal.
    pub(crate) fn count_failure(&self, f: Failure) -> Failure {
        metrics::counter!(telemetry::PUBLISH_FAILURES, "class" => f.class()).increment(1);
        if matches!(f, Failure::TooLarge { .. }) {
            self.budget_stale.store(true, Ordering::Relaxed);
        }
        match &f {
            Failure::Deposed { .. } => warn!(error = %f, "partition claimed by another owner"),
            _ => tracing::error!(error = %f, "an output cannot be stored; stopping the partition"),
        }
        f
    }

    /// `out`, made to fit [`Publisher::out_budget`]: a dead letter keeps an excerpt, a
    /// projection still too large (its payload is offloaded already) becomes a `too_large`
    /// dead letter.
    pub(crate) fn fit(&self, out: Outgoing) -> Outgoing {
        let out = match out.kind {
            OutKind::Projection(_) if publish::wire_size(&out) > self.out_budget() => {
                warn!(subject = %out.subject, bytes = out.payload.len(),
                    "a projection is too large to publish; dead-lettering its input too_large");
                pipeline::too_large(&self.names, &out, self.out_budget())
            }
            _ => out,
        };
        if !matches!(out.kind, OutKind::DeadLetter(_)) {
            return out;
        }
        // A dead letter's Msg-Id names its input's raw stream (one of the shards).
        let source = self
            .names
            .input_of_msg_id(&out.msg_id)
            .map_or(self.names.raw_stream.as_str(), |(stream, _)| stream)
            .to_string();
        publish::fit_dead_letter(out, &source, self.out_budget())
    }

    /// Store the fields an input's projections refer to, before those are published. Retried
    /// in place like a publish; `false` on cancellation (the input is left for redelivery, and
    /// storing the same blob again writes the same object).
    pub(crate) async fn store_blobs_in_place(
        &self,
        blobs: &[crate::blobs::Blob],
        inputs: &[&jetstream::Message],
        cancel: &CancellationToken,
    ) -> bool {
        for blob in blobs {
            let failed = |e: &str| {
                warn!(blob = %blob.id, bytes = blob.data.len(), error = %e,
                    "storing an offloaded field failed; retrying in place");
            };
            if !self
                .in_place(inputs, cancel, || self.put_blob(blob), failed)
                .await
            {
                return false;
            }
        }
        true
    }

    /// Store one offloaded field (counted once stored); storing the same blob again writes the
    /// same object.
    pub(crate) async fn put_blob(&self, blob: &crate::blobs::Blob) -> Result<(), String> {
        use crate::blobs::{META_CONTENT_TYPE, META_ROLE, META_SHA256};
        let store = self
            .blobs
            .get_or_try_init(|| self.blobs_js.get_object_store(&self.names.blobs_store))
            .await
            .map_err(|e| format!("object store {}: {e}", self.names.blobs_store))?;
        let meta = jetstream::object_store::ObjectMetadata {
            name: blob.id.clone(),
            description: Some("offloaded field".into()),
            metadata: [
                (META_ROLE, blob.role.as_str()),
                (META_SHA256, blob.sha256.as_str()),
                (META_CONTENT_TYPE, blob.content_type),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
            ..Default::default()
        };
        store
            .put(meta, &mut blob.data.as_ref())
            .await
            .map_err(|e| e.to_string())?;
        metrics::counter!(telemetry::BLOBS_STORED).increment(1);
        metrics::counter!(telemetry::BLOB_BYTES).increment(blob.data.len() as u64);
        Ok(())
    }

    /// Run `attempt` until it succeeds, backing off between attempts and telling `failed` each
    /// failure. Keeps `inputs` alive meanwhile so the server does not redeliver them. Gives up
    /// only on cancellation, after a while (the inputs then stay unacknowledged, for
    /// redelivery).
    pub(crate) async fn in_place<F, Fut>(
        &self,
        inputs: &[&jetstream::Message],
        cancel: &CancellationToken,
        mut attempt: F,
        failed: impl Fn(&str),
    ) -> bool
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<(), String>>,
    {
        let mut patience = Patience::new();
        loop {
            match attempt().await {
                Ok(()) => return true,
                Err(e) => failed(&e),
            }
            if !self.wait_keeping(inputs, cancel, &mut patience).await {
                return false;
            }
        }
    }

    /// Wait before the next attempt of something retried in place, keeping `inputs` from being
    /// redelivered meanwhile. `false`: stop trying (cancelled, and given a while to succeed).
    pub(crate) async fn wait_keeping(
        &self,
        inputs: &[&jetstream::Message],
        cancel: &CancellationToken,
        patience: &mut Patience,
    ) -> bool {
        let delay = patience.retry.next_delay();
        if cancel.is_cancelled() {
            if patience.since_cancel >= self.ack_wait.min(Duration::from_secs(10)) {
                return false;
            }
            patience.since_cancel += delay;
        }
        tokio::time::sleep(delay).await;
        patience.since_progress += delay;
        if patience.since_progress >= self.ack_wait / 3 {
            for m in inputs {
                let _ = m.ack_with(AckKind::Progress).await;
            }
            patience.since_progress = Duration::ZERO;
        }
        true
    }
}

/// Most outputs in one batch (the server takes up to 1,000 in an atomic batch).
const BATCH_MAX: usize = 500;

/// Most payload bytes in one batch: the server holds an atomic batch in memory until its
/// commit.
const BATCH_MAX_BYTES: usize = 8 << 20;

/// `outs` cut, in order, into batches of at most [`BATCH_MAX`] outputs and [`BATCH_MAX_BYTES`]
/// of payload (an output larger than that is a batch of its own).
fn batches_of<'a, 'o>(outs: &'a [&'o Outgoing]) -> Vec<&'a [&'o Outgoing]> {
    let mut cut = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, out) in outs.iter().enumerate() {
        let size = out.payload.len();
        if i > start && (i - start >= BATCH_MAX || bytes + size > BATCH_MAX_BYTES) {
            cut.push(&outs[start..i]);
            (start, bytes) = (i, 0);
        }
        bytes += size;
    }
    if start < outs.len() {
        cut.push(&outs[start..]);
    }
    cut
}

/// How long a batch waits for the server's final answer before its outputs are published one
/// at a time (an atomic batch not committed stores nothing; a fast-ingest batch stored a prefix,
/// whose outputs collapse by their Msg-Ids).
const BATCH_COMMIT_TIMEOUT: Duration = Duration::from_secs(5);

/// A batch answer's `error`, when it is a lost fence (classified as a single publish's
/// refusal is, [`publish::classify`]): the partition was claimed by a newer owner.
fn fence_lost(subject: &str, error: &jetstream::Error) -> Option<Failure> {
    let source = jetstream::context::PublishError::with_source(
        jetstream::context::PublishErrorKind::Other,
        error.clone(),
    );
    match publish::classify(subject, source) {
        f @ Failure::Deposed { .. } => Some(f),
        _ => None,
    }
}

/// Read a fast-ingest batch of `sent` messages' answers (the last one sent to `subject`) to the
/// final one: what the batch came to.
async fn read_fast_answers(
    answers: &mut tokio::sync::mpsc::UnboundedReceiver<bytes::Bytes>,
    sent: usize,
    subject: &str,
) -> FastOutcome {
    use super::fast_batch::{answer, Answer};
    let mut refused = None;
    while let Some(payload) = answers.recv().await {
        match answer(&payload) {
            Err(e) => return FastOutcome::Stopped(0, e),
            Ok(Answer::Progress) => {}
            Ok(Answer::Refused(error)) => {
                refused.get_or_insert(error);
            }
            Ok(Answer::Done(Err(error))) => {
                let lost = refused.as_ref().and_then(|r| fence_lost(subject, r));
                return match lost.or_else(|| fence_lost(subject, &error)) {
                    Some(f) => FastOutcome::Deposed(f, 0),
                    None => FastOutcome::Stopped(0, format!("refused: {error}")),
                };
            }
            Ok(Answer::Done(Ok(None))) => {
                return FastOutcome::Unsupported(String::from_utf8_lossy(&payload).into())
            }
            Ok(Answer::Done(Ok(Some(count)))) => {
                let count = usize::try_from(count).unwrap_or(usize::MAX);
                if count >= sent && refused.is_none() {
                    return FastOutcome::Stored;
                }
                if let Some(f) = refused.as_ref().and_then(|r| fence_lost(subject, r)) {
                    return FastOutcome::Deposed(f, count);
                }
                let why = refused.map_or("a gap (a message lost on the way)".into(), |e| {
                    format!("refused: {e}")
                });
                return FastOutcome::Stopped(count.min(sent), why);
            }
        }
    }
    FastOutcome::Stopped(0, "the answers' subscription ended".into())
}

/// What a fast-ingest batch came to.
enum FastOutcome {
    /// Every output stored (or collapsed with a stored copy by its Msg-Id).
    Stored,
    /// The first this many outputs stored, none after (a gap, a refusal, or no answer: 0).
    Stopped(usize, String),
    /// The fence's expectation failed at the output with this index: a newer owner claimed
    /// the partition.
    Deposed(Failure, usize),
    /// A plain publish ack: the server does not know fast batches.
    Unsupported(String),
}

/// Why an atomic batch was not stored.
#[derive(Debug)]
enum BatchRefused {
    /// The fence's expectation failed: a newer owner claimed the partition.
    Deposed(Failure),
    /// Anything else: its outputs are published one at a time.
    Other(String),
    /// A plain publish ack: the server stored the batch's messages one by one (it does not know
    /// atomic batches). Its outputs are published one at a time, and no batch is sent again.
    Unsupported(String),
}

/// A batch commit's answer: a publish ack naming the batch and its count, or an API error.
#[derive(serde::Deserialize)]
struct CommitAnswer {
    error: Option<jetstream::Error>,
    batch: Option<String>,
    count: Option<u64>,
}

/// What the server answered a batch's commit: stored whole, or refused (classified as a single
/// publish's refusal is, [`publish::classify`]: only a lost fence is not healed by publishing
/// the outputs one at a time).
fn batch_answer(payload: &[u8], sent: usize, subject: &str) -> Result<(), BatchRefused> {
    let answer: CommitAnswer = serde_json::from_slice(payload).map_err(|e| {
        BatchRefused::Other(format!(
            "unreadable answer ({e}): {}",
            String::from_utf8_lossy(payload)
        ))
    })?;
    if let Some(error) = answer.error {
        return Err(match fence_lost(subject, &error) {
            Some(f) => BatchRefused::Deposed(f),
            None => BatchRefused::Other(format!("refused: {error}")),
        });
    }
    if answer.batch.is_none() {
        return Err(BatchRefused::Unsupported(
            String::from_utf8_lossy(payload).into_owned(),
        ));
    }
    if answer.count != u64::try_from(sent).ok() {
        return Err(BatchRefused::Other(format!(
            "unexpected answer for {sent} outputs: {}",
            String::from_utf8_lossy(payload)
        )));
    }
    Ok(())
}

/// Whether batches of kind `batching` can be sent: the server knows them and both output
/// streams (`outputs`) allow them (a server that does not know them does not keep the
/// setting). Says why not.
fn batches_supported(
    batching: Batching,
    js: &jetstream::Context,
    names: &Names,
    outputs: &[Option<jetstream::stream::Config>; 2],
) -> bool {
    let (first, setting, allows): (_, _, fn(&jetstream::stream::Config) -> bool) = match batching {
        Batching::Off => return true,
        Batching::Atomic => (ATOMIC_BATCH_SERVER, "allow_atomic", |c| {
            c.allow_atomic_publish
        }),
        Batching::Fast => (FAST_BATCH_SERVER, "allow_batched", |c| {
            c.allow_batch_publish
        }),
    };
    let version = js.client().server_info().version;
    if super::parse_version(&version) < Some(first) {
        warn!(server = %version, "nats.publish_batches: {} need nats-server {}.{} or later; outputs are published one at a time",
            batching.name(), first.0, first.1);
        return false;
    }
    for (name, config) in [&names.proj_stream, &names.dlq_stream]
        .into_iter()
        .zip(outputs)
    {
        if !config.as_ref().is_some_and(allows) {
            warn!(stream = %name,
                "the stream does not allow {} ({setting}; run `collab-projector provision`); outputs are published one at a time", batching.name());
            return false;
        }
    }
    true
}

/// The first server version with atomic batches.
pub(crate) const ATOMIC_BATCH_SERVER: (u64, u64, u64) = (2, 12, 0);

/// The first server version with fast-ingest batches.
pub(crate) const FAST_BATCH_SERVER: (u64, u64, u64) = (2, 14, 0);

/// Why issuing an output stopped before it was stored.
#[derive(Debug)]
pub(crate) enum Halt {
    /// The worker is stopping while the publish keeps failing: leave the input for redelivery.
    Cancelled,
    /// A failure waiting does not heal (see [`publish::classify`]).
    Failed(Failure),
}

impl Halt {
    /// What the partition does about it: a lost fence is an interruption (the new owner has
    /// the partition); anything else stops it loudly.
    pub(crate) fn into_error(self, partition: u16) -> Option<WorkerError> {
        match self {
            Halt::Cancelled => None,
            Halt::Failed(failure) => Some(WorkerError::of_failure(partition, failure)),
        }
    }
}

/// The state of one thing retried in place: its backoff, and how long since the inputs it
/// holds were last marked in progress and since the worker started stopping.
pub(crate) struct Patience {
    retry: super::Retry,
    since_progress: Duration,
    since_cancel: Duration,
}

impl Patience {
    pub(crate) fn new() -> Patience {
        Patience {
            retry: super::Retry::new(Duration::from_millis(50), Duration::from_secs(2)),
            since_progress: Duration::ZERO,
            since_cancel: Duration::ZERO,
        }
    }
}

/// A duration in whole milliseconds, saturating.
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The configurations of the projection and dead-letter streams, in that order (`None`: not
/// read), looked up once at start.
async fn output_configs(
    js: &jetstream::Context,
    names: &Names,
) -> Result<[Option<jetstream::stream::Config>; 2], OutputsUnread> {
    let mut configs = [None, None];
    for (i, name) in [&names.proj_stream, &names.dlq_stream]
        .into_iter()
        .enumerate()
    {
        configs[i] = output_config(js, name).await?;
    }
    Ok(configs)
}

/// The configuration of the output stream `name` (`None`: it does not exist), asked again
/// (backing off) while the server does not answer, as during a leader election, for up to
/// [`OUTPUTS_PATIENCE`]. Taking an unanswered look-up for "no such stream" would choose how
/// outputs are published (one at a time on a replicated stream, which reorders a key's
/// projections) and how large they may be from a guess.
async fn output_config(
    js: &jetstream::Context,
    name: &str,
) -> Result<Option<jetstream::stream::Config>, OutputsUnread> {
    let started = tokio::time::Instant::now();
    let mut retry = super::Retry::new(Duration::from_millis(100), Duration::from_secs(2));
    loop {
        let error: Source = match js.get_stream(name).await {
            Ok(mut stream) => match stream.info().await {
                Ok(info) => return Ok(Some(info.config.clone())),
                Err(e) => Box::new(e),
            },
            Err(e) if super::error::stream_not_found(&e) => return Ok(None),
            Err(e) => Box::new(e),
        };
        if started.elapsed() >= OUTPUTS_PATIENCE {
            return Err(OutputsUnread {
                stream: name.to_string(),
                source: error,
            });
        }
        warn!(stream = %name, error = %error, "reading the output stream's configuration failed; asking again");
        tokio::time::sleep(retry.next_delay()).await;
    }
}

/// How long a starting worker asks for its output streams' configurations before it gives up.
const OUTPUTS_PATIENCE: Duration = Duration::from_secs(30);

/// An output stream whose configuration the server did not give within [`OUTPUTS_PATIENCE`].
#[derive(Debug, thiserror::Error)]
#[error("reading the configuration of the output stream {stream} (is the server reachable and the stream provisioned with `collab-projector provision`?)")]
pub struct OutputsUnread {
    stream: String,
    #[source]
    source: Source,
}

/// The largest output the server (`max_payload`) and the projection and dead-letter streams
/// (`outputs`: their largest message, when set) accept.
fn output_budget(js: &jetstream::Context, outputs: &[Option<jetstream::stream::Config>]) -> usize {
    outputs
        .iter()
        .flatten()
        .filter_map(|c| usize::try_from(c.max_message_size).ok())
        .filter(|&max| max > 0)
        .fold(js.client().server_info().max_payload, usize::min)
}

/// Room left for an envelope's projection headers: an envelope is offloaded until it fits in
/// the output budget less this.
const ENVELOPE_HEADROOM: usize = 4096;

/// How long ago `t` was by this host's clock (zero for a time ahead of it).
fn age_since(t: chrono::DateTime<chrono::Utc>) -> Duration {
    chrono::Utc::now()
        .signed_duration_since(t)
        .to_std()
        .unwrap_or_default()
}

/// A look-up of stored outputs that could not answer (the server did not, or refused a reader).
#[derive(Debug, thiserror::Error)]
#[error("looking up whether {subject} holds an output failed: {what}")]
pub struct LookupFailed {
    subject: String,
    what: String,
}

/// A reader of `subject`'s headers (the Msg-Ids are all a look-up reads), named `name`, from
/// `from` on.
async fn lookup_reader(
    stream: &jetstream::stream::Stream,
    name: &str,
    subject: &str,
    from: jetstream::consumer::DeliverPolicy,
) -> Result<
    jetstream::consumer::Consumer<jetstream::consumer::pull::OrderedConfig>,
    jetstream::stream::ConsumerError,
> {
    stream
        .create_consumer(jetstream::consumer::pull::OrderedConfig {
            name: Some(name.to_string()),
            filter_subject: subject.to_string(),
            deliver_policy: from,
            headers_only: true,
            ..Default::default()
        })
        .await
}

/// The Msg-Ids of what `reader` (a headers-only reader of one subject) delivers, through
/// stream sequence `until`, the subject's last message when the look-up began.
///
/// The reader's own count of what is left says nothing here: it is kept by the replica the
/// reader was placed on, which may lag behind the leader (a node catching up after a network
/// partition) and count 0 before the output sought. Only reaching `until` ends the read.
///
/// The client library remakes an ordered reader that lost its state on the server (deleted, a
/// server restart), under a name of its own; one remade before its first delivery starts from
/// the stream's start ("deliver all"). Reading on would go through the subject's whole history,
/// as long as its stream keeps it, so a first delivery from a remade reader fails the look-up
/// instead (the remade reader is deleted), and the look-up is asked again with a reader of its
/// own range. One remade later starts after its last delivery, and is read on.
async fn read_msg_ids(
    reader: jetstream::consumer::Consumer<jetstream::consumer::pull::OrderedConfig>,
    until: u64,
) -> Result<Vec<String>, String> {
    let name = reader.cached_info().name.clone();
    let mut messages = reader.messages().await.map_err(|e| e.to_string())?;
    let mut ids = Vec::new();
    let mut first = true;
    loop {
        let m = match tokio::time::timeout(Duration::from_secs(5), messages.next()).await {
            Ok(Some(Ok(m))) => m,
            Ok(Some(Err(e))) => return Err(e.to_string()),
            Ok(None) => return Err("the reader ended".into()),
            Err(_) => {
                return Err(format!(
                    "nothing delivered within 5 s before stream sequence {until}, the subject's last message"
                ))
            }
        };
        let info = m.info().map_err(|e| e.to_string())?;
        if std::mem::take(&mut first) && info.consumer != name {
            let remade = info.consumer.to_string();
            let deleted = m
                .context
                .delete_consumer_from_stream(&remade, info.stream)
                .await;
            if let Err(e) = deleted {
                debug!(consumer = %remade, error = %e, "remade look-up reader not deleted; it expires by itself");
            }
            return Err(format!(
                "the look-up reader was made again from the stream's start as {remade} (its first delivery was stream sequence {})",
                info.stream_sequence
            ));
        }
        if let Some(id) = m.headers.as_ref().and_then(|h| h.get("Nats-Msg-Id")) {
            ids.push(id.as_str().to_owned());
        }
        if info.stream_sequence >= until {
            return Ok(ids);
        }
    }
}

/// What one partition's look-ups of stored outputs have read (see
/// [`Publisher::stored_already`]), so a subject that many looked-up inputs share is read once
/// and then only past where it was read: after a takeover, every input delivered again is looked
/// up, and most of a partition's outputs land on a few subjects. Per subject, the Msg-Ids stored
/// on it from a store time on through a stream sequence. A stored message is never rewritten, so
/// a Msg-Id read stays an answer; the subject's last message is still read by every look-up that
/// finds nothing here. Bounded at [`SEEN_IDS_MAX`] Msg-Ids: past that it starts over.
#[derive(Debug, Default)]
pub(crate) struct SeenOutputs {
    subjects: std::collections::HashMap<String, SeenSubject>,
    ids: usize,
}

#[derive(Debug)]
struct SeenSubject {
    /// Store time (ms since the epoch) the subject was read from.
    from_ms: i64,
    /// Stream sequence it was read through.
    through: u64,
    ids: std::collections::HashSet<String>,
}

/// The most Msg-Ids [`SeenOutputs`] keeps (about 100 bytes each).
const SEEN_IDS_MAX: usize = 200_000;

impl SeenOutputs {
    /// Whether `msg_id` was read on `subject`.
    fn has(&self, subject: &str, msg_id: &str) -> bool {
        self.subjects
            .get(subject)
            .is_some_and(|s| s.ids.contains(msg_id))
    }

    /// The stream sequence `subject` was read through, if it was read from `since_ms` or
    /// earlier on.
    fn read_through(&self, subject: &str, since_ms: i64) -> Option<u64> {
        self.subjects
            .get(subject)
            .filter(|s| s.from_ms <= since_ms)
            .map(|s| s.through)
    }

    /// `subject` read through `through`: from `since_ms` on, or past what was read before when
    /// that covers `since_ms`.
    fn record(&mut self, subject: &str, since_ms: i64, through: u64, ids: Vec<String>) {
        if self.ids + ids.len() > SEEN_IDS_MAX {
            self.clear();
        }
        let extends = self.read_through(subject, since_ms).is_some();
        if !extends {
            if let Some(old) = self.subjects.remove(subject) {
                self.ids -= old.ids.len();
            }
        }
        let entry = self
            .subjects
            .entry(subject.to_owned())
            .or_insert_with(|| SeenSubject {
                from_ms: since_ms,
                through,
                ids: std::collections::HashSet::new(),
            });
        entry.through = entry.through.max(through);
        for id in ids {
            if entry.ids.insert(id) {
                self.ids += 1;
            }
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.subjects.is_empty()
    }

    pub(crate) fn clear(&mut self) {
        self.subjects.clear();
        self.ids = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::DlqReason;

    /// The one output of raw input `raw_seq`, a task event on `subject`.
    #[cfg(feature = "tools")]
    fn task_output(names: &Names, subject: &str, raw_seq: u64) -> Outgoing {
        projection(
            crate::model::Role::OrchestrationTask,
            subject.to_string(),
            format!("{{\"raw\":{raw_seq}}}"),
            crate::pipeline::input_msg_id(&names.raw_stream, raw_seq, 0),
        )
    }

    /// A projection of `role` on `subject`, with no headers.
    fn projection(
        role: crate::model::Role,
        subject: String,
        payload: String,
        msg_id: String,
    ) -> Outgoing {
        Outgoing {
            subject,
            payload: bytes::Bytes::from(payload),
            msg_id,
            headers: Vec::new(),
            kind: OutKind::Projection(role),
        }
    }

    fn out(bytes: usize) -> Outgoing {
        Outgoing {
            subject: "collab.dlq.bad_json".into(),
            payload: bytes::Bytes::from(vec![b'x'; bytes]),
            msg_id: "COLLAB_RAW:1:dlq".into(),
            headers: Vec::new(),
            kind: OutKind::DeadLetter(DlqReason::BadJson),
        }
    }

    #[test]
    fn batches_keep_order_and_stay_within_their_count_and_bytes() {
        let small: Vec<Outgoing> = (0..1201).map(|_| out(10)).collect();
        let refs: Vec<&Outgoing> = small.iter().collect();
        let sizes: Vec<usize> = batches_of(&refs).iter().map(|b| b.len()).collect();
        assert_eq!(sizes, [500, 500, 201]);

        let big: Vec<Outgoing> = [3 << 20, 3 << 20, 3 << 20, 9 << 20, 1]
            .into_iter()
            .map(out)
            .collect();
        let refs: Vec<&Outgoing> = big.iter().collect();
        let cut = batches_of(&refs);
        let sizes: Vec<usize> = cut.iter().map(|b| b.len()).collect();
        assert_eq!(
            sizes,
            [2, 1, 1, 1],
            "8 MiB per batch; a larger output alone"
        );
        let flat: Vec<*const Outgoing> = cut
            .iter()
            .flat_map(|b| b.iter().map(|o| *o as *const _))
            .collect();
        let want: Vec<*const Outgoing> = big.iter().map(|o| o as *const _).collect();
        assert_eq!(flat, want, "in order, nothing left out");

        assert!(batches_of(&[]).is_empty());
    }

    #[test]
    fn a_commit_answer_is_stored_deposed_unsupported_or_refused() {
        let answer = |json: &str, sent| batch_answer(json.as_bytes(), sent, "collab.proj.x");
        assert!(answer(r#"{"stream":"P","seq":9,"batch":"b","count":3}"#, 3).is_ok());
        assert!(matches!(
            answer(
                r#"{"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 1"},"stream":"P","seq":0}"#,
                3
            ),
            Err(BatchRefused::Deposed(Failure::Deposed { .. }))
        ));
        for refused in [
            r#"{"error":{"code":400,"err_code":10201,"description":"atomic publish batch contains duplicate message id"}}"#,
            r#"{"error":{"code":400,"err_code":10164,"description":"wrong last sequence"}}"#,
            r#"{"stream":"P","seq":9,"batch":"b","count":2}"#,
            "not json",
        ] {
            assert!(
                matches!(answer(refused, 3), Err(BatchRefused::Other(_))),
                "{refused}"
            );
        }
        assert!(matches!(
            answer(r#"{"stream":"P","seq":9}"#, 3),
            Err(BatchRefused::Unsupported(_))
        ));
    }

    /// Store `out` as a previous owner would have (no fence), with its Msg-Id and headers: its
    /// stream sequence.
    #[cfg(feature = "tools")]
    async fn store_unfenced(js: &jetstream::Context, out: &Outgoing) -> u64 {
        let mut message = PublishMessage::build()
            .payload(out.payload.clone())
            .message_id(out.msg_id.as_str());
        for (name, value) in &out.headers {
            message = message.header(*name, value.as_str());
        }
        js.send_publish(out.subject.clone(), message)
            .await
            .expect("sent")
            .await
            .expect("stored")
            .sequence
    }

    /// A local nats-server with the default deployment provisioned, and a publisher on it;
    /// `None` (the test skipped) without nats-server on PATH outside CI.
    #[cfg(feature = "tools")]
    async fn provisioned_publisher() -> Option<(
        crate::localnats::LocalNats,
        jetstream::Context,
        Names,
        Publisher,
    )> {
        if crate::localnats::LocalNats::find_binary().is_none() {
            assert!(
                std::env::var_os("CI").is_none(),
                "this test needs nats-server on PATH"
            );
            eprintln!("SKIPPED: no nats-server on PATH");
            return None;
        }
        let nats = crate::localnats::LocalNats::start(Default::default())
            .await
            .expect("a local nats-server");
        let client = async_nats::connect(nats.url()).await.expect("connected");
        let js = jetstream::new(client);
        let settings = crate::config::Settings::default();
        super::super::provision::provision(&js, &settings)
            .await
            .expect("provisioned");
        let names = settings.names();
        let publisher = Publisher::new(
            js.clone(),
            names.clone(),
            Arc::new(WorkerState::default()),
            &settings,
        )
        .await
        .expect("a publisher");
        Some((nats, js, names, publisher))
    }

    /// Against a real server: the look-up of one output of an input whose later output on the
    /// same subject is the subject's last message finds it stored (the subject's last message
    /// being this input's own says nothing about which of its outputs are stored).
    #[cfg(feature = "tools")]
    #[tokio::test]
    async fn the_lookup_finds_an_output_stored_before_a_later_output_of_the_same_input() {
        let Some((_nats, js, names, publisher)) = provisioned_publisher().await else {
            return;
        };
        let raw_seq = 7;
        let subject = names.proj_subject(crate::model::Role::SystemObservability, "k", "run.delta");
        let output = |i: usize| {
            projection(
                crate::model::Role::SystemObservability,
                subject.clone(),
                format!("{{\"i\":{i}}}"),
                crate::pipeline::input_msg_id(&names.raw_stream, raw_seq, i),
            )
        };
        // An earlier input's output, then this input's outputs 0 and 1, on one subject.
        let earlier = Outgoing {
            msg_id: crate::pipeline::input_msg_id(&names.raw_stream, raw_seq - 1, 0),
            ..output(9)
        };
        for out in [&earlier, &output(0), &output(1)] {
            store_unfenced(&js, out).await;
        }
        let now = crate::bus::now_ms();
        for i in [0, 1] {
            assert!(
                matches!(
                    publisher.stored_already(&output(i), raw_seq, now).await,
                    Ok(true)
                ),
                "output {i} is stored"
            );
        }
        assert!(
            matches!(
                publisher.stored_already(&output(2), raw_seq, now).await,
                Ok(false)
            ),
            "output 2 is not stored"
        );
    }

    /// Against a real server: look-ups after a takeover read through one [`SeenOutputs`] read
    /// a subject once, then only what was stored on it since. Each input's output is found
    /// when stored and not found when not, as without it, including one stored after the
    /// subject was first read and one whose subject was read past it before it was stored.
    #[cfg(feature = "tools")]
    #[tokio::test]
    async fn lookups_through_seen_outputs_read_a_subject_once_and_then_only_what_is_new() {
        let Some((_nats, js, names, publisher)) = provisioned_publisher().await else {
            return;
        };
        let subject =
            names.proj_subject(crate::model::Role::OrchestrationTask, "t", "task.updated");
        let output = |raw_seq: u64| task_output(&names, &subject, raw_seq);
        let store = |raw_seq: u64| {
            let (js, out) = (js.clone(), output(raw_seq));
            async move { store_unfenced(&js, &out).await }
        };
        // Inputs 10..=14 stored; 15 (its input was taken over) was not; 16 and 17 were.
        for raw_seq in [10, 11, 12, 13, 14, 16] {
            store(raw_seq).await;
        }
        let mut last = store(17).await;
        let now = crate::bus::now_ms();
        let mut seen = SeenOutputs::default();
        // Looked up in raw order, as a partition's inputs are after a takeover.
        macro_rules! lookup {
            ($raw_seq:expr) => {
                publisher
                    .stored_already_seen(&output($raw_seq), $raw_seq, now, &mut seen)
                    .await
                    .expect("answered")
            };
        }
        assert!(lookup!(10), "input 10's output is stored");
        assert_eq!(
            seen.read_through(&subject, now - 60_000),
            Some(last),
            "read once, through the last"
        );
        assert_eq!(seen.ids, 7);
        for raw_seq in [11, 12, 13, 14] {
            assert!(lookup!(raw_seq), "input {raw_seq}'s output is stored");
        }
        assert!(!lookup!(15), "input 15's output is not stored");
        assert!(lookup!(16), "input 16's output is stored");
        // Stored after the subject was read (this owner's own publish, or a fenced one's late
        // store): read past where the subject was read.
        let stored_late = store(15).await;
        assert!(stored_late > last);
        last = store(18).await;
        assert!(
            lookup!(15),
            "input 15's output, stored after the first read, is found"
        );
        assert_eq!(seen.read_through(&subject, now - 60_000), Some(last));
        assert_eq!(seen.ids, 9);
        assert!(!lookup!(19), "input 19's output is not stored");
        assert_eq!(
            seen.ids, 9,
            "nothing new read when the subject's last was read"
        );
    }

    /// Against a real server: a look-up reader that loses its state on the server before its
    /// first delivery (deleted here; a server restart does the same) is remade by the client
    /// library from the stream's start. Its read fails, naming that, instead of going through
    /// the subject's whole history, and leaves no reader behind; a reader made again reads only
    /// its own range.
    #[cfg(feature = "tools")]
    #[tokio::test]
    async fn a_lookup_reader_remade_from_the_streams_start_fails_instead_of_reading_all_history() {
        use futures::TryStreamExt;
        let Some((_nats, js, names, _publisher)) = provisioned_publisher().await else {
            return;
        };
        let subject = names.proj_subject(crate::model::Role::OrchestrationTask, "h", "task.done");
        let output = |raw_seq: u64| task_output(&names, &subject, raw_seq);
        // The subject's history, older than what the look-up reads.
        let mut last = 0;
        for raw_seq in 1..=5 {
            last = store_unfenced(&js, &output(raw_seq)).await;
        }
        let stream = js.get_stream(&names.proj_stream).await.expect("stream");
        let from = jetstream::consumer::DeliverPolicy::ByStartSequence {
            start_sequence: last + 1,
        };
        let name = "lookup-remade";
        let reader = lookup_reader(&stream, name, &subject, from)
            .await
            .expect("a reader");
        let read = tokio::spawn(read_msg_ids(reader, last + 1));
        // Its pull waits for the output not stored yet; the reader goes from the server.
        tokio::time::sleep(Duration::from_millis(300)).await;
        stream.delete_consumer(name).await.expect("deleted");
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(store_unfenced(&js, &output(6)).await, last + 1);
        let read = tokio::time::timeout(Duration::from_secs(20), read)
            .await
            .expect("the read ends")
            .expect("joined");
        let err = read.expect_err("a reader remade from the stream's start is not read on");
        assert!(
            err.contains("made again from the stream's start"),
            "the failure says why: {err}"
        );
        // The remade reader is gone with the failure; a reader made again reads its range.
        let names_left: Vec<String> = stream
            .consumer_names()
            .try_collect()
            .await
            .expect("consumer names");
        assert!(
            !names_left.iter().any(|n| n.starts_with(name)),
            "no look-up reader left behind: {names_left:?}"
        );
        let again = lookup_reader(&stream, "lookup-again", &subject, from)
            .await
            .expect("a reader");
        let ids = read_msg_ids(again, last + 1).await.expect("read");
        assert_eq!(ids, vec![output(6).msg_id], "only the reader's own range");
    }

    /// Against a real server: a group's projections and dead letters, interleaved as a mix's
    /// are, stored as fast-ingest batches with the two streams side by side: each output stored
    /// once, each stream's in the group's order. With the fence lost to a newer claim nothing
    /// is stored, and the halt names the group's first output (both streams halt; the earlier
    /// place is the one charged).
    #[cfg(feature = "tools")]
    #[tokio::test]
    async fn a_groups_projections_and_dead_letters_are_stored_side_by_side_each_in_order() {
        let Some((_nats, js, names, publisher)) = provisioned_publisher().await else {
            return;
        };
        assert_eq!(publisher.batching(), Batching::Fast, "auto on one server");
        let group = |tag: &str| -> Vec<Outgoing> {
            (0..60u64)
                .map(|i| {
                    let msg_id = format!("{tag}-{i}");
                    if i % 5 == 2 {
                        Outgoing {
                            subject: names.dlq_subject(DlqReason::BadJson),
                            payload: bytes::Bytes::from(msg_id.clone()),
                            msg_id,
                            headers: Vec::new(),
                            kind: OutKind::DeadLetter(DlqReason::BadJson),
                        }
                    } else {
                        projection(
                            crate::model::Role::OrchestrationTask,
                            names.proj_subject(
                                crate::model::Role::OrchestrationTask,
                                &format!("k{}", i % 3),
                                "task.updated",
                            ),
                            msg_id.clone(),
                            msg_id,
                        )
                    }
                })
                .collect()
        };
        let stored_payloads = |stream: String| {
            let js = js.clone();
            async move {
                let mut stream = js.get_stream(&stream).await.expect("the stream");
                let last = stream.info().await.expect("its info").state.last_sequence;
                let mut payloads = Vec::new();
                // Fence claims are on subjects of their own (and the older ones deleted).
                for seq in 1..=last {
                    if let Ok(m) = stream.get_raw_message(seq).await {
                        if !m.subject.contains("fence") {
                            payloads.push(String::from_utf8_lossy(&m.payload).into_owned());
                        }
                    }
                }
                payloads
            }
        };
        let fence = Fence::claim(&js, &names, 0, "first", false)
            .await
            .expect("claimed");
        let outs = group("a");
        let refs: Vec<&Outgoing> = outs.iter().collect();
        assert!(publisher
            .store_batched(&refs, &fence, &[], &CancellationToken::new())
            .await
            .is_ok());
        let expected = |dead: bool| -> Vec<String> {
            outs.iter()
                .filter(|o| matches!(o.kind, OutKind::DeadLetter(_)) == dead)
                .map(|o| o.msg_id.clone())
                .collect()
        };
        assert_eq!(
            stored_payloads(names.proj_stream.clone()).await,
            expected(false)
        );
        assert_eq!(
            stored_payloads(names.dlq_stream.clone()).await,
            expected(true)
        );

        Fence::claim(&js, &names, 0, "second", false)
            .await
            .expect("claimed again");
        let late = group("b");
        let refs: Vec<&Outgoing> = late.iter().collect();
        let halted = publisher
            .store_batched(&refs, &fence, &[], &CancellationToken::new())
            .await;
        assert!(
            matches!(halted, Err((Halt::Failed(Failure::Deposed { .. }), 0))),
            "the old owner's group halts at its first output"
        );
        assert_eq!(
            stored_payloads(names.proj_stream.clone()).await,
            expected(false)
        );
        assert_eq!(
            stored_payloads(names.dlq_stream.clone()).await,
            expected(true)
        );
    }

    #[test]
    fn seen_outputs_extend_a_subject_covering_the_window_and_start_over_otherwise() {
        let mut seen = SeenOutputs::default();
        let ids = |r: std::ops::Range<u32>| r.map(|i| format!("id-{i}")).collect::<Vec<_>>();
        seen.record("a", 1_000, 5, ids(0..5));
        assert_eq!(seen.read_through("a", 1_000), Some(5));
        assert_eq!(
            seen.read_through("a", 2_000),
            Some(5),
            "a later window is covered"
        );
        assert_eq!(
            seen.read_through("a", 999),
            None,
            "an earlier window is not"
        );
        assert_eq!(seen.read_through("b", 1_000), None);
        // Read on from sequence 6, for a later input.
        seen.record("a", 2_000, 8, ids(5..8));
        assert!(seen.has("a", "id-0") && seen.has("a", "id-7"));
        assert_eq!(
            seen.read_through("a", 1_000),
            Some(8),
            "still read from 1,000 on"
        );
        assert_eq!(seen.ids, 8);
        // Read afresh from an earlier time: replaces what was read.
        seen.record("a", 500, 9, ids(100..102));
        assert!(!seen.has("a", "id-0"));
        assert!(seen.has("a", "id-101"));
        assert_eq!(seen.ids, 2);
        // Past the bound it starts over.
        seen.record("b", 0, 1, ids(0..(SEEN_IDS_MAX as u32 - 2)));
        assert_eq!(seen.ids, SEEN_IDS_MAX);
        seen.record("c", 0, 1, ids(0..1));
        assert_eq!(seen.ids, 1);
        assert!(!seen.has("a", "id-101") && seen.has("c", "id-0"));
        seen.clear();
        assert!(seen.is_empty());
    }

    /// Against a real server: a projection over the output budget, stored by an earlier owner as
    /// the `too_large` dead letter it becomes, is found stored (a takeover past the duplicate
    /// window must not dead-letter its input a second time); one never stored is not.
    #[cfg(feature = "tools")]
    #[tokio::test]
    async fn the_lookup_of_a_projection_over_the_budget_finds_its_too_large_dead_letter() {
        let Some((_nats, js, names, publisher)) = provisioned_publisher().await else {
            return;
        };
        let raw_seq = 11;
        let huge = |i: usize| Outgoing {
            subject: names.proj_subject(crate::model::Role::ConversationMain, "k", "a2a.request"),
            payload: bytes::Bytes::from(vec![b'x'; publisher.out_budget() + 1]),
            msg_id: crate::pipeline::input_msg_id(&names.raw_stream, raw_seq, i),
            headers: Vec::new(),
            kind: OutKind::Projection(crate::model::Role::ConversationMain),
        };
        let stored = publisher.fit(huge(0));
        assert!(matches!(stored.kind, OutKind::DeadLetter(_)));
        store_unfenced(&js, &stored).await;
        let now = crate::bus::now_ms();
        assert!(
            matches!(
                publisher.stored_already(&huge(0), raw_seq, now).await,
                Ok(true)
            ),
            "the projection stored as its too_large dead letter is found"
        );
        assert!(
            matches!(
                publisher.stored_already(&huge(1), raw_seq, now).await,
                Ok(false)
            ),
            "another output of the input, never stored, is not"
        );
    }
}
