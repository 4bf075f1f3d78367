//! How one partition runs ([`run_partition`]) over what the partitions of a worker share
//! ([`WorkerContext`], in `context`): claim it, reload its turns, open (or recreate) its
//! consumer, then compose its jobs, each in a file of its own:
//!
//! - `reader`: reads the partition in stream order and processes each input, accounting
//!   for every sequence (in-flight inputs taken over in full, delivery gaps, inputs delivered
//!   before);
//! - [`super::publisher`] with [`super::publish`]: every output sized, fenced by the partition's
//!   claim, and its failures classified;
//! - `acker`: awaits each input's outputs and turn writes in order, then acknowledges;
//! - [`super::stats`]: the counters and the partition's sampled lag.
//!
//! A crash anywhere in between is repaired by redelivery: deterministic Msg-Ids, the turn
//! records, the fence and the look-up of stored outputs make reprocessing idempotent. Nothing
//! here waits for the work sessions: they are folded from the projection stream by
//! [`super::sessions::run_fold`], off this path.

use super::acker::{ack_stage, Acks, Processed, Stage};
use super::context::WorkerContext;
use super::error::{Source, WorkerError};
use super::publish::Fence;
use super::reader::Partition;
use super::stats::{sample_lag, WorkerState};
use super::turns::{Flush, PartitionTurns, TurnIoError};
use crate::config::Names;
use crate::telemetry;
use crate::turns::book::Watermark;
use async_nats::jetstream;
use async_nats::jetstream::consumer::PullConsumer;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::{debug, info, warn};

/// The raw stream partition `p` reads now, asked for once the connection is up, with the sets
/// of raw streams it was chosen from: the oldest set (see `bus::generations`) whose stream for
/// `p` is not sealed, or not yet read to its end by the partition's consumer there.
///
/// A partition restarted because the server went away (a pull that failed as the server shut
/// down) would otherwise send its first request into the dying connection, or before the
/// reconnect, and wait out the full request timeout for an answer that cannot come. It waits for
/// the connection instead, and gives the first request a short bound: no answer in time is an
/// interruption, retried at once, not a failure. `None` when `cancel` fires first.
async fn raw_stream(
    shared: &WorkerContext,
    p: u16,
    cancel: &CancellationToken,
) -> Result<Option<(jetstream::stream::Stream, Arc<Names>)>, WorkerError> {
    let client = shared.js.client();
    while client.connection_state() != async_nats::connection::State::Connected {
        if cancel.is_cancelled() {
            return Ok(None);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let consumer = shared.names.consumer_name(p);
    let mut raw = shared.raw_names();
    let mut first = true;
    for looked_again in [false, true] {
        let sets: Vec<String> = raw
            .earlier
            .iter()
            .map(|g| g.stream_of(usize::from(p)).to_string())
            .chain(std::iter::once(raw.raw_stream_of(p).to_string()))
            .collect();
        for (i, name) in sets.iter().enumerate() {
            let newest = i + 1 == sets.len();
            let asked = shared.js.get_stream(name);
            let answer =
                if first {
                    first = false;
                    match tokio::time::timeout(FIRST_REQUEST_WITHIN, asked).await {
                        Ok(answer) => answer,
                        Err(_) => return Err(WorkerError::Interrupted {
                            partition: p,
                            why: "the server did not answer the partition's first request in time",
                        }),
                    }
                } else {
                    asked.await
                };
            let stream = match answer {
                Ok(stream) => stream,
                // An earlier set dropped since this process looked (`reshard --drop-sealed`
                // drops only sets every partition has read).
                Err(e) if !newest && super::error::stream_not_found(&e) => continue,
                Err(e) => {
                    return Err(WorkerError::setup(
                        p,
                        format!("stream {name}"),
                        Source::from(e),
                    ))
                }
            };
            if stream.cached_info().config.sealed {
                let done = super::generations::read_to_its_end(&stream, &consumer)
                    .await
                    .map_err(|e| WorkerError::setup(p, format!("consumer {name}/{consumer}"), e))?;
                if done {
                    continue;
                }
            }
            return Ok(Some((stream, raw)));
        }
        if looked_again {
            break;
        }
        // Every set this process knows is sealed and read: a reshard it has not seen.
        raw = shared
            .refresh_raw()
            .await
            .map_err(|e| WorkerError::setup(p, "the raw streams", e))?;
    }
    Err(WorkerError::setup(
        p,
        "the raw streams",
        format!(
            "every raw stream partition {p} reads is sealed and read to its end, and there is no newer one: finish the reshard (`collab-projector reshard --count <K>` creates the new streams)"
        ),
    ))
}

/// The first reshard marker partition `p` reads in `stream` that names a set of raw streams
/// on the server (see `Partition::heed_reshard_marker`), as its raw sequence, its store time in
/// ms, and the set it names. `collab-projector reshard` publishes one for each
/// partition of the largest count the raw streams' layout supports, so partition `p` of any
/// count reads the one made for `p`; a command run again publishes them again, and the first
/// is the one that counts (a later one would let through what was stored between them). A
/// reshard abandoned by deleting the streams it made leaves its markers behind: they hold
/// nothing back once that set is gone.
async fn reshard_marker_in(
    shared: &WorkerContext,
    stream: &jetstream::stream::Stream,
    p: u16,
) -> Result<Option<(u64, i64, super::reader::MarkedSet)>, WorkerError> {
    use jetstream::stream::RawMessageErrorKind;
    let layout = shared.settings.layout();
    let most = layout.levels.last().copied().unwrap_or(1);
    let names = &shared.names;
    let Some(subject) =
        layout.stored_subject(&names.raw_prefix, &names.reshard_marker_subject(p, most))
    else {
        return Ok(None);
    };
    let setup = |e: Source| WorkerError::setup(p, "looking up the raw stream's reshard markers", e);
    let mut from = 0u64;
    // Each set of raw streams is left by one reshard that finished; the rest were abandoned.
    for _ in 0..MARKERS_LOOKED_AT {
        let m = match stream
            .get_first_raw_message_by_subject(&subject, from)
            .await
        {
            Ok(m) => m,
            Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => return Ok(None),
            Err(e) => return Err(setup(Source::from(e))),
        };
        from = m.sequence + 1;
        let Some(base) = super::acker::marker_stored(&m.subject, &m.payload, Some(&m.headers))
        else {
            continue;
        };
        if m.sequence >= base {
            continue;
        }
        let found = super::generations::set_streams(&shared.js, names, base)
            .await
            .map_err(|e| setup(Source::from(e)))?;
        if let Some(streams) = found {
            let set = super::reader::MarkedSet {
                base,
                streams,
                checked_ms: super::now_ms(),
            };
            return Ok(Some((m.sequence, m.time.timestamp_millis(), set)));
        }
        info!(
            partition = p,
            seq = m.sequence,
            base,
            "a reshard marker for a set of raw streams that no longer exists; ignored"
        );
    }
    Ok(None)
}

/// How many reshard markers of one partition a starting partition looks at, at most.
const MARKERS_LOOKED_AT: usize = 64;

/// How long a starting partition waits for its first answer from the server (the raw stream's
/// description) before it starts over.
const FIRST_REQUEST_WITHIN: Duration = Duration::from_secs(1);

/// Claim partition `p`'s fence for `owner`. Earlier claims in the projection stream are left
/// to the work-session fold, which removes them once it has read them (see [`Fence::claim`]);
/// with the fold off, the claim removes them.
async fn claim(
    shared: &WorkerContext,
    p: u16,
    owner: &str,
) -> Result<Fence, async_nats::jetstream::context::PublishError> {
    let fold_reads = !shared.settings.workers.without_session_fold;
    Fence::claim(&shared.js, &shared.names, p, owner, fold_reads).await
}

/// Run one partition until `cancel`: finish the batch in hand, acknowledge what was published,
/// and return.
///
/// `lease_valid_until` ([`super::LeaseValidity`]) is how long this worker's lease on the
/// partition is known to hold: past it (a paused process, a stalled renewal) the partition takes
/// no work, so a worker that lost its lease without noticing yet does not process next to the
/// new owner.
pub async fn run_partition(
    shared: Arc<WorkerContext>,
    p: u16,
    owner: &str,
    cancel: CancellationToken,
    lease_valid_until: Arc<super::LeaseValidity>,
) -> Result<(), WorkerError> {
    let setup = |what: &str, source: Source| WorkerError::setup(p, what, source);
    let Some((stream, raw)) = raw_stream(&shared, p, &cancel).await? else {
        return Ok(());
    };
    // An output refused as too large since the last start: what fits is read again first.
    shared.publisher.refresh_out_budget().await;
    // Outputs it sends again are looked up once past the output streams' duplicate windows as
    // they stand now, which an operator may have shortened, and decisions older than the
    // streams keep anything are not published again (their ages, read here too).
    shared.publisher.refresh_output_streams().await;
    // Everything below stops with `cancel`, or when this set of raw streams is sealed and read
    // to its end (`moved`): the partition then starts again on the next set.
    let moved = CancellationToken::new();
    let outer = cancel;
    let cancel = outer.child_token();
    // Without a deadline the wait ends lapsed only when the partition is stopped meanwhile (a
    // lease found lost): then it claims nothing.
    if !super::lease_held_again(&lease_valid_until, cancel.cancelled(), None).await {
        return Ok(());
    }
    // Claimed before anything is published (a reload may republish responses): from here on a
    // previous owner's outputs, however late they arrive, are refused by the server.
    let fence = claim(&shared, p, owner)
        .await
        .map_err(|e| setup("claiming the partition's fence", e.into()))?;
    let mut turns = PartitionTurns::new(&shared, p, fence.clone(), raw.clone())
        .await
        .map_err(|e| setup("opening the turn state", e.into()))?;
    let (loaded, checkpoint) = match turns.reload(&shared, &cancel).await {
        Ok(r) => r,
        Err(TurnIoError::Publish(source)) => return Err(WorkerError::of_failure(p, source)),
        Err(e) => return Err(setup("reloading the turn state", e.into())),
    };
    let resume_after = checkpoint.resume_after();
    let (mut consumer, recreated) = open_consumer(&shared, &stream, p, resume_after).await?;
    // A reshard marker acknowledged by an earlier owner is not delivered again: looked up here,
    // it holds this owner's watermark as it held theirs. One stored after this look-up is
    // delivered (it follows everything in the stream now).
    let marker = reshard_marker_in(&shared, &stream, p).await?;
    // Every task this partition starts is aborted with it: a shutdown that gives up on a drain
    // (`workers.drain_timeout`) aborts the partition's task, and nothing of it may run on.
    let watch = AbortOnDropHandle::new(tokio::spawn(watch_for_end(
        stream.clone(),
        shared.names.consumer_name(p),
        moved.clone(),
        cancel.clone(),
    )));
    // A consumer whose acknowledgements stop short of the checkpoint lost some of them (an ack
    // that never reached the server, or consumer state a new consumer leader did not have):
    // what it delivers again may have its outputs stored, beyond any duplicate window.
    let behind = !recreated && acks_behind(p, &consumer, resume_after);
    // Inputs up to the stream's end now may have their outputs stored already, even on their
    // first delivery: a recreated consumer starts after the checkpoint, which can be up to a
    // second behind what was acknowledged, and a consumer whose leader changed may have lost
    // deliveries it made (a replica that had not recorded them became leader) with its
    // acknowledgements intact, so it delivers again, as first deliveries, inputs a previous
    // owner processed. Only a partition nobody ran before skips this. The look-ups stop after a
    // publish window of inputs in a row had nothing stored (see `Partition::dispose`).
    let verify_through = if recreated || behind || checkpoint.inherited() {
        last_sequence(&stream).await
    } else {
        0
    };
    let _running = Running::count(&shared.state);
    debug!(partition = p, loaded, "partition started");
    let watermark_ms = Arc::new(AtomicI64::new(0));
    let sampler_stop = CancellationToken::new();
    let _sampler_stop_on_abort = sampler_stop.clone().drop_guard();
    let sampler = AbortOnDropHandle::new(tokio::spawn(sample_lag(
        shared.state.clone(),
        p,
        shared.settings.partition_filter(p),
        consumer.clone(),
        stream.clone(),
        watermark_ms.clone(),
        sampler_stop.clone(),
    )));

    // Sharded: the first partition of each shard dead-letters what producers stored in it
    // under another shard's keys (see `bus::strays`).
    let strays = AbortOnDropHandle::new(tokio::spawn(super::strays::sweep(
        shared.clone(),
        super::strays::Shard {
            p,
            raw: raw.clone(),
            stream: stream.cached_info().config.name.clone(),
        },
        fence.clone(),
        sampler_stop.clone(),
        moved.clone(),
    )));

    let (tx, rx) = mpsc::channel::<Processed>(512);
    let broken = CancellationToken::new();
    let acker = AbortOnDropHandle::new(tokio::spawn(tracing::Instrument::in_current_span(
        ack_stage(
            shared.publisher.clone(),
            Stage {
                p,
                acks: Acks::of(consumer.cached_info().config.ack_policy),
                fence: fence.clone(),
                failed_input: shared.failures_of(p),
            },
            rx,
            checkpoint,
            cancel.clone(),
            broken.clone(),
        ),
    )));
    let mut part = Partition {
        shared: &shared,
        p,
        turns,
        watermark: Watermark::default(),
        watermark_ms,
        last_seq: 0,
        in_hand: None,
        barrier_subject: shared
            .names
            .barrier_subject(p, shared.settings.nats.partitions),
        barrier_sent_ms: None,
        marked_set: None,
        absent_set: None,
        next_delivery: 0,
        verify_through,
        verify_missed: 0,
        seen: Default::default(),
        verify_all_through: if behind { resume_after.unwrap_or(0) } else { 0 },
        fence,
        streams: crate::redact::StreamRedactor::new(
            shared.ingest.redactor.clone(),
            crate::redact::StreamLimits::default(),
        ),
        tx,
        cancel: &cancel,
        broken: &broken,
    };
    part.heed_found_marker(marker);
    let mut result = part.run(&stream, &mut consumer, &lease_valid_until).await;
    debug!(
        partition = p,
        ok = result.is_ok(),
        "partition reader stopped"
    );
    if result.is_ok() && !broken.is_cancelled() && !lease_valid_until.lapsed() {
        // Stopping with the lease still valid (a drain, a release for balance): write the open
        // records still deferred, so everything processed can be acknowledged and the next
        // owner has nothing to take over twice. With the lease lost or lapsed (another owner
        // may have loaded the partition's records already), nothing is written: those inputs
        // stay unacknowledged and the next owner processes them again.
        if let Err(e) = part.flush(Flush::All).await {
            result = Err(e);
        }
    }
    drop(part);
    debug!(partition = p, "waiting for the acker to drain");
    let acked = acker.await;
    // Read to its end: the stray search makes its last round (see `bus::strays`) by itself.
    if !moved.is_cancelled() {
        sampler_stop.cancel();
    }
    let _ = strays.await;
    sampler_stop.cancel();
    let _ = sampler.await;
    watch.abort();
    debug!(partition = p, "partition stopped");
    match acked {
        Ok(Err(e)) => return Err(e),
        // A panic in the acker (a library's, since the project's own are lint-denied) stops
        // the partition loudly: the lease loop restarts it from what is acknowledged.
        Err(e) => return Err(WorkerError::setup(p, "the acknowledgement task", e)),
        Ok(Ok(())) => {}
    }
    if broken.is_cancelled() {
        return Err(WorkerError::Interrupted {
            partition: p,
            why: "a turn state write was refused",
        });
    }
    if result.is_ok() && moved.is_cancelled() && !outer.is_cancelled() {
        return Err(moved_on(&shared, p, &stream).await);
    }
    result
}

/// A partition counted as running for as long as this lives (its task ends, or is aborted).
struct Running<'a>(&'a WorkerState);

impl<'a> Running<'a> {
    fn count(state: &'a WorkerState) -> Running<'a> {
        state.partitions_running.fetch_add(1, Ordering::Relaxed);
        Running(state)
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.partitions_running.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Whether the consumer's acknowledgements stop short of the partition's checkpoint, said and
/// counted when they do.
fn acks_behind(p: u16, consumer: &PullConsumer, resume_after: Option<u64>) -> bool {
    let ack_floor = consumer.cached_info().ack_floor.stream_sequence;
    let behind = resume_after.is_some_and(|ck| ack_floor < ck);
    if behind {
        warn!(
            partition = p,
            ack_floor,
            checkpoint = ?resume_after,
            "the consumer's acknowledgements stop short of the partition's checkpoint; \
             looking up the outputs of what it delivers again"
        );
        metrics::counter!(telemetry::CONSUMERS_BEHIND).increment(1);
    }
    behind
}

/// The stream's last sequence now (`u64::MAX` when it cannot be read: everything is looked up).
async fn last_sequence(stream: &jetstream::stream::Stream) -> u64 {
    let mut stream = stream.clone();
    stream
        .info()
        .await
        .map(|i| i.state.last_sequence)
        .unwrap_or(u64::MAX)
}

/// Partition `p` read its sealed `stream` to its end: look the raw streams up again (a reshard
/// this process has not seen made the next ones) and restart the partition on the next.
async fn moved_on(
    shared: &WorkerContext,
    p: u16,
    stream: &jetstream::stream::Stream,
) -> WorkerError {
    info!(
        partition = p,
        stream = %stream.cached_info().config.name,
        "the partition read its sealed raw stream to its end; going on with the next one"
    );
    if let Err(e) = shared.refresh_raw().await {
        warn!(partition = p, error = %e, "the raw streams could not be looked up again");
    }
    WorkerError::Interrupted {
        partition: p,
        why: "its raw stream is sealed and read to its end",
    }
}

/// How often a partition looks whether its raw stream was sealed (`collab-projector reshard`)
/// and read to its end.
const END_CHECK_EVERY: Duration = Duration::from_secs(2);

/// Cancel `moved` once `stream` is sealed and partition consumer `consumer` has read and
/// acknowledged everything in it; stop with `stop`.
async fn watch_for_end(
    stream: jetstream::stream::Stream,
    consumer: String,
    moved: CancellationToken,
    stop: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(END_CHECK_EVERY) => {}
            _ = stop.cancelled() => return,
        }
        match super::generations::read_to_its_end(&stream, &consumer).await {
            Ok(true) => {
                moved.cancel();
                stop.cancel();
                return;
            }
            Ok(false) => {}
            Err(e) => {
                debug!(consumer, error = %e, "could not look whether the raw stream is read to its end")
            }
        }
    }
}

/// The partition's durable consumer; recreated when missing (deleted by an operator, lost with
/// a server's store or, kept in memory, with a server restart), from where the partition's
/// outputs end (`resume_after`, the published checkpoint), never from the start of the stream
/// unless the partition never ran. One whose storage is not what `consumer.memory_state` says
/// (made before the setting changed) is deleted and made again the same way, so the setting
/// takes effect on the partition's next start.
async fn open_consumer(
    shared: &WorkerContext,
    stream: &jetstream::stream::Stream,
    p: u16,
    resume_after: Option<u64>,
) -> Result<(PullConsumer, bool), WorkerError> {
    use jetstream::context::ConsumerInfoErrorKind;
    let name = shared.names.consumer_name(p);
    let setup = |what: String, source: Source| WorkerError::setup(p, what, source);
    let memory = shared.settings.consumer.memory_state;
    let switched = match stream.consumer_info(&name).await {
        Ok(info) if info.config.memory_storage != memory => {
            // Only this partition's owner reads the consumer, and it has not read yet: what the
            // old consumer held is what a deleted one's recreation recovers. A delete that fails
            // leaves the partition to start again, and look again.
            stream
                .delete_consumer(&name)
                .await
                .map_err(|e| setup(format!("deleting consumer {name}"), e.into()))?;
            true
        }
        Ok(info) => {
            // Recreated by provisioning from the checkpoint and not read from yet: its first
            // inputs are looked up like those of a consumer recreated here.
            let resumed = info.delivered.consumer_sequence == 0
                && matches!(
                    info.config.deliver_policy,
                    jetstream::consumer::DeliverPolicy::ByStartSequence { .. }
                );
            return stream
                .get_consumer(&name)
                .await
                .map(|c| (c, resumed))
                .map_err(|e| setup(format!("consumer {name}"), e));
        }
        Err(e) if e.kind() == ConsumerInfoErrorKind::NotFound => false,
        Err(e) => return Err(setup(format!("consumer {name}"), e.into())),
    };
    let config = super::provision::resumed_consumer_config(&shared.settings, p, resume_after);
    let base = stream
        .cached_info()
        .config
        .metadata
        .get(super::generations::BASE_METADATA)
        .and_then(|b| b.parse::<u64>().ok())
        .unwrap_or(0);
    if switched {
        info!(consumer = %name, memory_state = memory, resume_after = ?resume_after,
            "switching the partition's consumer to the storage consumer.memory_state names; making it again from the partition's checkpoint");
    } else if base > 0 && resume_after.unwrap_or(0) < base {
        // A set of raw streams a reshard made, which this partition starts on: its checkpoint
        // is on an earlier set, so the consumer starts at this set's first message.
        info!(consumer = %name, stream = %stream.cached_info().config.name,
            "the partition starts on a new set of raw streams");
    } else if memory {
        // Expected after a server restart: the server kept its state in memory.
        info!(consumer = %name, resume_after = ?resume_after,
            "the partition's consumer is gone (its state is in the server's memory, which a server restart clears, or it was deleted); recreating it from the partition's checkpoint");
        shared.state.count_consumer_recreated();
    } else {
        warn!(consumer = %name, resume_after = ?resume_after,
            "the partition's consumer is missing; recreating it from the partition's checkpoint");
        shared.state.count_consumer_recreated();
    }
    stream
        .create_consumer(config)
        .await
        .map(|c| (c, true))
        .map_err(|e| setup(format!("recreating consumer {name}"), e.into()))
}
