//! A partition's acknowledging side: it awaits, in partition order, each processed input's
//! publishes (retrying a failed one in place, or stopping the partition when waiting cannot heal
//! it) and turn-record writes, counts the decided turns towards the published checkpoint, and
//! only then acknowledges: never past an input whose outputs are not all stored, nor past one
//! held by a turn whose open record is deferred.

use super::error::WorkerError;
use super::publish::{self, Failure, Fence};
use super::publisher::{Halt, Publisher};
use super::turns::{
    Checkpoint, Effects, Hold, KvWrite, Mark, TurnIoError, WriteError, CHECKPOINT_EVERY,
};
use crate::pipeline::{OutKind, Outgoing};
use crate::telemetry;
use async_nats::jetstream;
use futures::FutureExt;
use std::collections::VecDeque;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// One input processed in partition order (or deadlines decided while the partition was idle),
/// as the acker receives it.
pub(crate) struct Processed {
    /// The consumer delivery to acknowledge; `None` for messages re-read from the stream at
    /// takeover, and for deadlines decided while the partition was idle.
    msg: Option<jetstream::Message>,
    publishes: Publishes,
    /// Turn-record writes that must be stored before the message is acknowledged.
    writes: Vec<KvWrite>,
    /// Decided turns whose responses are among `publishes`: counted towards the published
    /// checkpoint once those are stored.
    marks: Vec<Mark>,
    /// Turns it opened whose records are deferred: neither it nor anything after it is
    /// acknowledged before they resolve.
    holds: Vec<Hold>,
    /// When its publishes and writes were issued (for their latency).
    issued: tokio::time::Instant,
    /// The raw store time of `msg` (ms since the epoch), for the end-to-end latency.
    stored_ms: Option<i64>,
    /// The raw sequence of the input these are the outputs of (`None`: no input's, a deadline
    /// decided while idle or a barrier).
    input_seq: Option<u64>,
}

impl Processed {
    /// What the turn rules asked for, issued, for `msg`.
    /// `stored_ms`: `msg`'s raw store time (ms since the epoch), which its processing read
    /// already; `None` without a message.
    pub(crate) fn new(
        msg: Option<jetstream::Message>,
        stored_ms: Option<i64>,
        publishes: Publishes,
        fx: Effects,
    ) -> Processed {
        Processed {
            msg,
            publishes,
            writes: fx.writes,
            marks: fx.marks,
            holds: fx.holds,
            issued: tokio::time::Instant::now(),
            stored_ms,
            input_seq: None,
        }
    }

    /// The same, named as the outputs of input `seq`: a publish of them that stops the
    /// partition is charged to that input (see [`Stage::failed_input`]).
    pub(crate) fn of_input(mut self, seq: u64) -> Processed {
        self.input_seq = Some(seq);
        self
    }

    /// `last`, a stand-in for the last delivery a previous owner left unacknowledged (see
    /// [`in_flight_stand_in`]), acknowledged once everything before it is stored: nothing to
    /// publish, no end-to-end latency of its own.
    pub(crate) fn stand_in(last: jetstream::Message) -> Processed {
        Processed::new(Some(last), None, Vec::new(), Effects::default())
    }
}

/// A message whose acknowledgement acknowledges every delivery the consumer `info` describes as
/// made (see [`in_flight_ack_subject`]); `None` where that subject is.
///
/// For a new owner that has read what a previous owner left in flight from the stream and
/// processed it: without it those deliveries stay pending until `ack_wait` returns them.
pub(crate) fn in_flight_stand_in(
    js: &jetstream::Context,
    info: &jetstream::consumer::Info,
) -> Option<jetstream::Message> {
    let reply = in_flight_ack_subject(info)?;
    Some(jetstream::Message {
        message: async_nats::Message {
            subject: async_nats::Subject::from_static("collab.takeover.in_flight"),
            reply: Some(reply.into()),
            payload: bytes::Bytes::new(),
            headers: None,
            status: None,
            description: None,
            length: 0,
        },
        context: js.clone(),
    })
}

/// The acknowledgement subject of the consumer's last delivery
/// (`$JS.ACK.<stream>.<consumer>.<count>.<stream seq>.<consumer seq>.<time>.<pending>`, the
/// reply subject every JetStream delivery carries), rebuilt from its `delivered` position. Only
/// for consumers with `AckPolicy::All`, where acknowledging a delivery covers all before it;
/// `None` otherwise, or when nothing awaits an acknowledgement.
pub(crate) fn in_flight_ack_subject(info: &jetstream::consumer::Info) -> Option<String> {
    if info.config.ack_policy != jetstream::consumer::AckPolicy::All
        || info.delivered.consumer_sequence == 0
        || info.num_ack_pending == 0
    {
        return None;
    }
    Some(format!(
        "$JS.ACK.{}.{}.1.{}.{}.{}.0",
        info.stream_name,
        info.name,
        info.delivered.stream_sequence,
        info.delivered.consumer_sequence,
        info.delivered
            .last_active
            .and_then(|t| t.timestamp_nanos_opt())
            .unwrap_or(0)
            .max(0),
    ))
}

/// The most processed inputs an acker takes as one group (its outputs stored, with batches, as
/// one run of batches per stream, both streams side by side).
pub(crate) const GROUP_MAX: usize = 1024;

/// How a partition acknowledges a group of processed inputs.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Acks {
    /// Its last delivery (the consumer's `AckPolicy::All` covers everything before it: the
    /// group was processed in order, after everything delivered earlier).
    Last,
    /// Every delivery (consumers created with `AckPolicy::Explicit`).
    Each,
}

impl Acks {
    /// How inputs of a consumer with `policy` are acknowledged.
    pub(crate) fn of(policy: jetstream::consumer::AckPolicy) -> Self {
        match policy {
            jetstream::consumer::AckPolicy::All => Acks::Last,
            _ => Acks::Each,
        }
    }
}

/// A processed input the acker has seen stored, waiting for the holds of the turns it opened.
pub(crate) struct Unacked {
    msg: Option<jetstream::Message>,
    holds: Vec<Hold>,
}

/// Take from the front of `held` the inputs whose holds have all resolved, in order: their
/// deliveries may be acknowledged. Stops at the first input still held.
pub(crate) fn release(held: &mut VecDeque<Unacked>) -> Result<Vec<jetstream::Message>, WriteError> {
    let mut ready = Vec::new();
    while let Some(front) = held.front_mut() {
        while let Some(hold) = front.holds.last() {
            match hold.clone().now_or_never() {
                Some(Ok(_)) => {
                    front.holds.pop();
                }
                Some(Err(e)) => return Err(e),
                None => return Ok(ready),
            }
        }
        if let Some(done) = held.pop_front() {
            ready.extend(done.msg);
        }
    }
    Ok(ready)
}

/// The first unresolved hold, awaited; never resolves without one.
pub(crate) async fn first_hold(hold: Option<Hold>) -> Result<u64, WriteError> {
    match hold {
        Some(h) => h.await,
        None => std::future::pending().await,
    }
}

/// Await, in order, each group's publishes and turn-record writes, count its decisions towards
/// the published checkpoint, then acknowledge it, up to the first input still held by a turn
/// whose record is deferred (never past it: a crash must redeliver that input). Returns an error
/// (and cancels `broken`) when a turn-record or checkpoint write was refused: nothing more is
/// acknowledged, the partition restarts.
pub(crate) async fn ack_stage(
    publisher: Arc<Publisher>,
    stage: Stage,
    mut rx: mpsc::Receiver<Processed>,
    mut checkpoint: Checkpoint,
    cancel: CancellationToken,
    broken: CancellationToken,
) -> Result<(), WorkerError> {
    let Stage {
        p,
        acks,
        fence,
        failed_input,
    } = stage;
    let refused = |e: TurnIoError| {
        warn!(partition = p, error = %e, "turn state write refused; restarting the partition");
        broken.cancel();
        WorkerError::Interrupted {
            partition: p,
            why: "a turn state write was refused",
        }
    };
    // A hold that failed: abandoned by a stopping partition (acknowledge nothing more, quietly),
    // or its write refused.
    let hold_failed = |e: WriteError| -> Result<(), WorkerError> {
        match e {
            WriteError::Abandoned => Ok(()),
            e => Err(refused(e.for_key("(deferred open write)"))),
        }
    };
    // A publish that stops the partition is charged to the input whose output it was.
    let charged = |e: WorkerError, input_seq: Option<u64>| {
        if let (WorkerError::Publish { .. }, Some(seq)) = (&e, input_seq) {
            failed_input(seq);
        }
        e
    };
    let mut held: VecDeque<Unacked> = VecDeque::new();
    let latencies = Latencies {
        ack: metrics::histogram!(telemetry::PUBLISH_ACK),
        end_to_end: metrics::histogram!(telemetry::END_TO_END),
        write: metrics::histogram!(telemetry::STATE_WRITE),
    };
    let issuer = Issuer {
        publisher: &publisher,
        fence: &fence,
        cancel: &cancel,
        broken: &broken,
        p,
    };
    // One timer, moved on only when it fires: a timer made afresh for every group costs a
    // registration and a cancellation in the runtime's timer wheel per group. A checkpoint
    // look every CHECKPOINT_EVERY whether or not inputs arrive is the same as one after a
    // quiet CHECKPOINT_EVERY: `maybe_write` writes only what is due.
    let tick = tokio::time::sleep(CHECKPOINT_EVERY);
    tokio::pin!(tick);
    loop {
        let front = held.front().and_then(|u| u.holds.last().cloned());
        let first = tokio::select! {
            next = rx.recv() => match next {
                Some(first) => Some(first),
                None => break,
            },
            resolved = first_hold(front) => {
                if let Err(e) = resolved {
                    return hold_failed(e);
                }
                None
            }
            _ = &mut tick => {
                tick.as_mut().reset(tokio::time::Instant::now() + CHECKPOINT_EVERY);
                checkpoint.maybe_write(false).await.map_err(refused)?;
                None
            }
        };
        if let Some(first) = first {
            let mut items = vec![first];
            while items.len() < GROUP_MAX {
                match rx.try_recv() {
                    Ok(i) => items.push(i),
                    Err(_) => break,
                }
            }
            match issuer.store_batches(&mut items).await {
                Ok(Awaited::ShuttingDown) => return Ok(()),
                Ok(Awaited::Stored) => {}
                Err((e, input_seq)) => return Err(charged(e, input_seq)),
            }
            let mut marks = Vec::new();
            for idx in 0..items.len() {
                let publishes = std::mem::take(&mut items[idx].publishes);
                let (issued, stored_ms) = (items[idx].issued, items[idx].stored_ms);
                let awaited = match issuer
                    .await_publishes(publishes, issued, stored_ms, &items, &latencies)
                    .await
                {
                    Ok(awaited) => awaited,
                    Err(e) => return Err(charged(e, items[idx].input_seq)),
                };
                if let Awaited::ShuttingDown = awaited {
                    return Ok(());
                }
                for w in std::mem::take(&mut items[idx].writes) {
                    if let Err(e) = w.await {
                        return Err(refused(e.for_key("(pipelined write)")));
                    }
                    latencies
                        .write
                        .record(items[idx].issued.elapsed().as_secs_f64());
                }
                marks.append(&mut items[idx].marks);
            }
            if !marks.is_empty() {
                super::turns::crash_point("after_publish");
                checkpoint.stored(marks).await.map_err(refused)?;
            }
            checkpoint.maybe_write(false).await.map_err(refused)?;
            held.extend(items.into_iter().map(|i| Unacked {
                msg: i.msg,
                holds: i.holds,
            }));
        }
        let ready = match release(&mut held) {
            Ok(ready) => ready,
            Err(e) => return hold_failed(e),
        };
        acknowledge_ready(ready, &mut checkpoint, p, acks).await;
    }
    // Drained: the partition wrote its deferred records before it stopped; wait for them.
    debug!(
        partition = p,
        inputs = held.len(),
        "acker waiting for the last held inputs"
    );
    for mut u in std::mem::take(&mut held) {
        for hold in u.holds.drain(..) {
            if let Err(e) = hold.await {
                return hold_failed(e);
            }
        }
        held.push_back(u);
    }
    let ready = release(&mut held).unwrap_or_default();
    acknowledge_ready(ready, &mut checkpoint, p, acks).await;
    // Drained: a final checkpoint spares the next owner republishing what was stored.
    if let Err(e) = checkpoint.maybe_write(true).await {
        debug!(partition = p, error = %e, "final published checkpoint not written");
    }
    debug!(partition = p, "acker drained");
    Ok(())
}

/// What the acker of a partition needs besides its channels.
pub(crate) struct Stage {
    pub(crate) p: u16,
    pub(crate) acks: Acks,
    pub(crate) fence: Fence,
    /// Told the raw sequence of an input whose publish stopped the partition: the replay's
    /// delivery count of that input (so a publish that keeps failing for one input
    /// dead-letters it `max_deliver` instead of stopping its partition for good).
    pub(crate) failed_input: Box<dyn Fn(u64) + Send + Sync>,
}

/// The raw sequence of the last of `ready` (inputs in partition order).
pub(crate) fn last_sequence(ready: &[jetstream::Message]) -> Option<u64> {
    ready
        .iter()
        .rev()
        .find_map(|m| m.info().ok().map(|i| i.stream_sequence))
}

/// A partition's own barrier: the header, an empty body, and a subject ending as barrier
/// subjects do (`_watermark<n>.barrier`, see `Names::barrier_subject`) without the `_as.<agent>`
/// tokens that producers' users are confined to (docs/security.md). A producer's
/// message that happens to carry the header but has a body, or another subject, is an input like
/// any other (nothing a producer sends is acknowledged unseen).
pub(crate) fn is_barrier(msg: &jetstream::Message) -> bool {
    barrier_stored(msg.subject.as_str(), &msg.payload, msg.headers.as_ref())
}

/// [`is_barrier`] of a message stored as `subject` with `payload` and `headers`.
fn barrier_stored(subject: &str, payload: &[u8], headers: Option<&async_nats::HeaderMap>) -> bool {
    payload.is_empty()
        && barrier_shaped(subject)
        && headers.is_some_and(|h| h.get(crate::pipeline::H_BARRIER).is_some())
}

/// The set of raw streams a reshard marker announces (the first sequence of that set): a
/// barrier stored as `._watermark<n>.reshard` by `collab-projector reshard` in the streams it
/// moves raw traffic away from (see `bus::reader`). `None` for anything else.
pub(crate) fn reshard_marker(msg: &jetstream::Message) -> Option<u64> {
    marker_stored(msg.subject.as_str(), &msg.payload, msg.headers.as_ref())
}

/// [`reshard_marker`] of a message stored as `subject` with `payload` and `headers` (as a
/// look-up by subject returns it).
pub(crate) fn marker_stored(
    subject: &str,
    payload: &[u8],
    headers: Option<&async_nats::HeaderMap>,
) -> Option<u64> {
    if !barrier_stored(subject, payload, headers) || !subject.ends_with(".reshard") {
        return None;
    }
    headers?
        .get(crate::pipeline::H_RESHARD)?
        .as_str()
        .parse()
        .ok()
}

/// Whether a stored raw subject ends as a barrier subject does, `._watermark<n>.barrier`, or
/// a reshard marker's, `._watermark<n>.reshard`, with no `_as` token anywhere (every subject a
/// producer's user may publish on has one).
fn barrier_shaped(subject: &str) -> bool {
    let mut tokens = subject.rsplit('.');
    !subject.split('.').any(|t| t == "_as")
        && matches!(tokens.next(), Some("barrier" | "reshard"))
        && tokens
            .next()
            .and_then(|t| t.strip_prefix("_watermark"))
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// Acknowledge `ready` (inputs in partition order, all stored and released): its last delivery,
/// or each one.
pub(crate) async fn acknowledge(p: u16, acks: Acks, ready: Vec<jetstream::Message>) {
    if ready.is_empty() {
        return;
    }
    super::turns::crash_point("before_ack");
    let to_ack: Vec<jetstream::Message> = match acks {
        Acks::Each => ready,
        Acks::Last => ready.into_iter().last().into_iter().collect(),
    };
    for msg in to_ack {
        tracing::trace!(partition = p, seq = ?msg.info().ok().map(|i| i.stream_sequence), "acknowledging");
        if let Err(e) = msg.ack().await {
            debug!(partition = p, error = %e, "ack failed; the message will be redelivered (its outputs collapse by Msg-Id)");
        }
    }
}

/// The acker's latency histograms, registered once.
struct Latencies {
    ack: metrics::Histogram,
    end_to_end: metrics::Histogram,
    write: metrics::Histogram,
}

/// How awaiting an input's publishes ended, when it did not stop the partition.
enum Awaited {
    Stored,
    /// Shutting down with a publish still failing: acknowledge nothing more; redelivery
    /// repairs.
    ShuttingDown,
}

/// What awaiting publishes needs of the stage.
struct Issuer<'a> {
    publisher: &'a Publisher,
    fence: &'a Fence,
    cancel: &'a CancellationToken,
    broken: &'a CancellationToken,
    p: u16,
}

impl Issuer<'_> {
    /// Await one input's publishes in order. A transient failure is retried in place (holding
    /// the inputs of `items` in progress); any other stops the partition, acknowledging nothing
    /// after it.
    async fn await_publishes(
        &self,
        publishes: Publishes,
        issued: tokio::time::Instant,
        stored_ms: Option<i64>,
        items: &[Processed],
        latencies: &Latencies,
    ) -> Result<Awaited, WorkerError> {
        // Nothing after a failure that waiting cannot heal is acknowledged: the partition stops.
        let stopped = |failure: Failure| {
            self.broken.cancel();
            WorkerError::of_failure(self.p, failure)
        };
        for (out, state) in publishes {
            let failed = match state {
                Issued::Sent(fut, connects) => {
                    match self.publisher.ack_unless_lost(fut, connects).await {
                        Some(Ok(_)) => match self.publisher.injected_lost_ack() {
                            Some(wait) => {
                                tokio::time::sleep(wait).await;
                                true
                            }
                            None => false,
                        },
                        Some(Err(e)) => match publish::classify(&out.subject, e) {
                            Failure::Transient { .. } => true,
                            f => return Err(stopped(self.publisher.count_failure(f))),
                        },
                        // Its ack went with a reconnect: sent again below.
                        None => {
                            self.publisher.state.count_publish_retry();
                            true
                        }
                    }
                }
                Issued::Stored => false,
                // `store_batches` ran first; an output it did not store is published here.
                Issued::Batched => true,
            };
            if !failed {
                latencies.ack.record(issued.elapsed().as_secs_f64());
                if let (OutKind::Projection(_), Some(stored)) = (out.kind, stored_ms) {
                    let ms = super::now_ms().saturating_sub(stored).max(0);
                    latencies.end_to_end.record(ms as f64 / 1000.0);
                }
                continue;
            }
            let inputs: Vec<&jetstream::Message> =
                items.iter().filter_map(|i| i.msg.as_ref()).collect();
            // Sent before its input's publishes were handed over (`issued`), however long its
            // ack was waited for since.
            match self
                .publisher
                .publish_in_place_since(&out, self.fence, &inputs, self.cancel, issued)
                .await
            {
                Ok(()) => {}
                Err(Halt::Cancelled) => return Ok(Awaited::ShuttingDown),
                Err(Halt::Failed(failure)) => return Err(stopped(failure)),
            }
        }
        Ok(Awaited::Stored)
    }

    /// Store the outputs of `items` left for a batch ([`Issued::Batched`]), in order, as
    /// batches (see [`Publisher::store_batched`]), and mark them stored. A failure that stops the
    /// partition comes with the raw sequence of the input whose output it was, if any.
    async fn store_batches(
        &self,
        items: &mut [Processed],
    ) -> Result<Awaited, (WorkerError, Option<u64>)> {
        let stored = {
            let (outs, owners): (Vec<&Outgoing>, Vec<Option<u64>>) = items
                .iter()
                .flat_map(|i| i.publishes.iter().map(move |p| (p, i.input_seq)))
                .filter(|((_, issued), _)| matches!(issued, Issued::Batched))
                .map(|((out, _), seq)| (out, seq))
                .unzip();
            if outs.is_empty() {
                return Ok(Awaited::Stored);
            }
            let inputs: Vec<&jetstream::Message> =
                items.iter().filter_map(|i| i.msg.as_ref()).collect();
            self.publisher
                .store_batched(&outs, self.fence, &inputs, self.cancel)
                .await
                .map_err(|(halt, at)| (halt, owners.get(at).copied().flatten()))
        };
        match stored {
            Ok(()) => {}
            Err((Halt::Cancelled, _)) => return Ok(Awaited::ShuttingDown),
            Err((Halt::Failed(failure), input_seq)) => {
                self.broken.cancel();
                return Err((WorkerError::of_failure(self.p, failure), input_seq));
            }
        }
        for (_, issued) in items.iter_mut().flat_map(|i| i.publishes.iter_mut()) {
            if matches!(issued, Issued::Batched) {
                *issued = Issued::Stored;
            }
        }
        Ok(Awaited::Stored)
    }
}

/// Acknowledge the inputs released, raising the checkpoint's `acked` first.
///
/// Barriers among them stay in the raw stream. Deleting a stored message the server counts as
/// an acknowledgement on every consumer that has it in flight, and under `AckPolicy::All` that
/// covers everything the consumer delivered before it: another set of workers over the same
/// raw stream (a projection version, a reprojection, the deployment beside a version) holding
/// an input unacknowledged behind that barrier would see it acknowledged for it, and a crash
/// there would lose the input's turn. A barrier is an empty message; they age out with the
/// stream's own limits.
async fn acknowledge_ready(
    ready: Vec<jetstream::Message>,
    checkpoint: &mut Checkpoint,
    p: u16,
    acks: Acks,
) {
    if let Some(last) = last_sequence(&ready) {
        checkpoint.acked(last);
    }
    acknowledge(p, acks, ready).await;
}

/// An input's outputs as issued, each with how it stands.
pub(crate) type Publishes = Vec<(Outgoing, Issued)>;

/// How an issued output stands.
pub(crate) enum Issued {
    /// Published; the future of its publish ack, and the connection's count of connects
    /// before it was sent (see [`Publisher::ack_unless_lost`]).
    Sent(jetstream::context::PublishAckFuture, u64),
    /// Stored already (by a retry in place, or with its batch).
    Stored,
    /// Left for the acker to store in a batch (`Publisher::batches`).
    Batched,
}

/// Issue the publishes of `outs` in order, pipelined. A publish that cannot be sent is retried
/// before anything later is sent, so per-key order holds. `None` if cancelled meanwhile (or the
/// acker is gone).
///
/// Every `WorkerContext::hand_over` publishes, the ones issued so far go to the acker ahead of
/// the rest (as a group of their own, acknowledging nothing): a publish waits for one of the
/// context's publish-ack permits, which only the ackers release, so a reader must never wait for
/// one while holding more than its share of them. One input can have hundreds of outputs (the
/// blocked responses of every deadline a late message passes); without the hand-over, a few
/// partitions doing that at once would hold every permit and wait for each other forever.
pub(crate) async fn issue_publishes(
    publisher: &Publisher,
    fence: &Fence,
    outs: Vec<Outgoing>,
    inputs: &[&jetstream::Message],
    acker: &mpsc::Sender<Processed>,
    cancel: &CancellationToken,
) -> Result<Publishes, Halt> {
    if publisher.batches() {
        // Sent by the acker, batched: no publish-ack permit is taken here.
        return Ok(outs
            .into_iter()
            .map(|out| {
                let out = publisher.fit(out);
                publisher.state.count_output(&out);
                (out, Issued::Batched)
            })
            .collect());
    }
    let hand_over = publisher.hand_over();
    let mut pending = Vec::with_capacity(outs.len().min(hand_over));
    for out in outs {
        if pending.len() >= hand_over {
            let ahead =
                Processed::new(None, None, std::mem::take(&mut pending), Effects::default());
            acker.send(ahead).await.map_err(|_| Halt::Cancelled)?;
        }
        let out = publisher.fit(out);
        publisher.state.count_output(&out);
        let connects = publisher.connects();
        let fut = match publisher.send(&publisher.js, &out, fence).await {
            Ok(f) => Issued::Sent(f, connects),
            Err(f @ Failure::Transient { .. }) => {
                warn!(error = %f, "publish failed; retrying in place");
                publisher
                    .publish_in_place(&out, fence, inputs, cancel)
                    .await?;
                Issued::Stored
            }
            Err(f) => return Err(Halt::Failed(publisher.count_failure(f))),
        };
        pending.push((out, fut));
    }
    Ok(pending)
}

#[cfg(test)]
mod tests {
    use super::{barrier_shaped, in_flight_ack_subject};

    #[test]
    fn only_the_barrier_subjects_are_barrier_shaped() {
        let names = crate::config::Settings::default().names();
        for (p, partitions) in [(0, 16), (5, 16), (63, 64)] {
            let stored = names.stored_subject(&names.barrier_subject(p, partitions));
            assert!(barrier_shaped(&stored), "{stored}");
            let marker = names.stored_subject(&names.reshard_marker_subject(p, partitions));
            assert!(barrier_shaped(&marker), "{marker}");
        }
        // A producer's subjects carry `_as.<agent>`; none of these is a barrier.
        for subject in [
            "collab.in.0.c1._as.ruda.barrier",
            "collab.in.0.c1._as.ruda._watermark7.barrier",
            "collab.in.0.c1.barrier",
            "collab.in.0._watermark.barrier",
            "collab.in.0._watermark7x.barrier",
            "collab.in.0._watermark7.barrier.more",
            "collab.in.0.c1._as.ruda._watermark7.reshard",
            "collab.in.0._watermark7.resharded",
        ] {
            assert!(!barrier_shaped(subject), "{subject}");
        }
    }
    use async_nats::jetstream::consumer::Info;

    fn info(ack_policy: &str, ack_pending: usize) -> Info {
        let json = serde_json::json!({
            "stream_name": "COLLAB_RAW",
            "name": "collab-p3",
            "created": "2026-11-28T12:00:00Z",
            "config": {"durable_name": "collab-p3", "ack_policy": ack_policy, "deliver_policy": "all", "replay_policy": "instant"},
            "delivered": {"consumer_seq": 17, "stream_seq": 4242, "last_active": "2026-11-28T12:00:01Z"},
            "ack_floor": {"consumer_seq": 9, "stream_seq": 4100},
            "num_ack_pending": ack_pending,
            "num_redelivered": 0,
            "num_waiting": 0,
            "num_pending": 0
        });
        match serde_json::from_value(json) {
            Ok(i) => i,
            Err(e) => panic!("consumer info: {e}"),
        }
    }

    #[test]
    fn the_stand_in_acknowledges_the_last_delivery_in_the_servers_reply_format() {
        // Nine tokens, as the server parses an acknowledgement: stream, consumer, delivery
        // count, stream sequence, consumer sequence, time, pending.
        assert_eq!(
            in_flight_ack_subject(&info("all", 8)).as_deref(),
            Some("$JS.ACK.COLLAB_RAW.collab-p3.1.4242.17.1795867201000000000.0")
        );
    }

    #[test]
    fn only_consumers_acknowledging_all_before_a_delivery_get_a_stand_in() {
        // An explicit acknowledgement would cover the last delivery only.
        assert_eq!(in_flight_ack_subject(&info("explicit", 8)), None);
        assert_eq!(in_flight_ack_subject(&info("all", 0)), None);
    }
}
