//! Running a version's workers over a range of the raw stream, and removing a version.

use super::{diff, Diff, Progress};
use crate::app::{self, RunOptions};
use crate::bus::error::Source;
use crate::config::{Names, Settings};
use async_nats::jetstream;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Why `reproject` stopped.
#[derive(Debug, thiserror::Error)]
pub enum ReprojectError {
    /// The request cannot be carried out as given; the text says what to change.
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Connect(#[from] crate::bus::ConnectError),
    #[error(transparent)]
    App(#[from] app::AppError),
    #[error(transparent)]
    Layout(#[from] crate::bus::provision::ProvisionError),
    #[error(transparent)]
    Ops(#[from] crate::ops::OpsError),
    #[error("{what}: {source}")]
    Api {
        what: String,
        #[source]
        source: Source,
    },
}

fn api(what: impl Into<String>, e: impl Into<Source>) -> ReprojectError {
    ReprojectError::Api {
        what: what.into(),
        source: e.into(),
    }
}

/// What to reproject.
#[derive(Debug, Clone)]
pub struct Plan {
    /// First raw sequence (default: the stream's first).
    pub from: Option<u64>,
    /// Last raw sequence (default: the stream's last when the run starts).
    pub to: Option<u64>,
    /// How long the version keeps running once it has processed the range, so deadlines that
    /// fall due in event time are decided as they were in the deployment.
    pub settle: Duration,
    /// Examples shown per kind of change.
    pub examples: usize,
}

/// Run projection version `settings.nats.version` over the plan's range of the raw stream,
/// reporting progress, then compare its outputs with the deployment's.
///
/// The version must not exist yet: its streams, buckets and consumers are created here and
/// kept afterwards, so it can be inspected, compared again, switched to or dropped.
pub async fn run(
    settings: &Settings,
    plan: &Plan,
    mut progress: impl FnMut(Progress),
) -> Result<Diff, ReprojectError> {
    let version = settings.names();
    if version.version.is_empty() {
        return Err(ReprojectError::Refused(
            "name the version to compute (--version v2): the deployment's own projections are never recomputed in place".into(),
        ));
    }
    let (_client, js) = crate::bus::connect_as(settings, "collab-projector reproject").await?;
    // The version reads the raw stream's layout with its own partition count (repartitioning).
    let mut settings = settings.clone();
    crate::bus::provision::adopt_layout(&js, &mut settings).await?;
    let settings = &settings;
    // Every set of raw streams, the sealed ones of earlier reshards first.
    let live = super::live_names(settings);
    if js.get_stream(&version.proj_stream).await.is_ok() {
        return Err(ReprojectError::Refused(format!(
            "projection version {:?} exists already (stream {}): choose another --version, or remove it first with `collab-projector reproject --version {} --drop`",
            version.version, version.proj_stream, version.version
        )));
    }
    let all = live.all_raw_streams();
    let sharded = all.len() > 1;
    if sharded && (plan.from.is_some() || plan.to.is_some()) {
        return Err(ReprojectError::Refused(format!(
            "raw traffic is in {} streams ({}), each with its own sequences: it is reprojected whole, without --from or --to",
            all.len(),
            all.join(", ")
        )));
    }
    // Each raw stream's range: the one asked for, else all it holds.
    let mut ranges = Vec::new();
    for name in all {
        let mut raw = js
            .get_stream(name)
            .await
            .map_err(|e| api(format!("stream {name}"), e))?;
        let state = raw
            .info()
            .await
            .map_err(|e| api(format!("stream {name}"), e))?
            .state
            .clone();
        let from = plan
            .from
            .unwrap_or(state.first_sequence)
            .max(state.first_sequence);
        let to = plan
            .to
            .unwrap_or(state.last_sequence)
            .min(state.last_sequence);
        if state.messages == 0 || from > to {
            if !sharded {
                return Err(ReprojectError::Refused(format!(
                    "nothing to reproject: {name} holds sequences {}..={}, the range asked is {from}..={to}",
                    state.first_sequence, state.last_sequence
                )));
            }
            continue;
        }
        // How many streams its set has: each of the version's partitions reads one of them.
        let shards = live.shard_of_stream_name(name).map_or(1, |(_, k)| k);
        ranges.push((raw, from, to, shards));
    }
    if ranges.is_empty() {
        return Err(ReprojectError::Refused(format!(
            "nothing to reproject: the raw streams {} hold no messages",
            live.all_raw_streams().join(", ")
        )));
    }
    // The sequences outputs are compared over: the range asked (unsharded), all of them
    // (sharded: every shard is reprojected whole).
    let (from, to) = if sharded {
        (1, u64::MAX)
    } else {
        (ranges[0].1, ranges[0].2)
    };
    // The version's consumers start at the range; provisioning keeps them as they are.
    if from > 1 {
        let raw = &ranges[0].0;
        for p in 0..settings.nats.partitions {
            let config =
                crate::bus::provision::resumed_consumer_config(settings, p, Some(from - 1));
            raw.create_consumer(config)
                .await
                .map_err(|e| api(format!("consumer {}", version.consumer_name(p)), e))?;
        }
    }
    let cancel = CancellationToken::new();
    let running = app::start(
        settings.clone(),
        RunOptions {
            workers: true,
            http: false,
            metrics: None,
        },
        cancel.clone(),
    )
    .await?;
    let total: u64 = ranges.iter().map(|(_, f, t, _)| t - f + 1).sum();
    let mut outcome = Ok(());
    let mut offset = 0;
    for (raw, f, t, shards) in &ranges {
        let per_shard = settings.nats.partitions / (*shards).max(1);
        outcome = follow(
            raw,
            &version,
            Some(per_shard),
            Stop::Never,
            *f,
            *t,
            |done| {
                progress(Progress {
                    done: offset + done,
                    total,
                });
            },
        )
        .await
        .map(|_| ());
        if outcome.is_err() {
            break;
        }
        offset += t - f + 1;
    }
    if outcome.is_ok() {
        tokio::time::sleep(plan.settle).await;
    }
    cancel.cancel();
    running.wait().await;
    outcome?;
    let live_behind = !live_processed(&js, &live, &ranges).await;
    progress(Progress { done: total, total });
    let mut l = super::Outputs::new();
    let mut v = super::Outputs::new();
    for (names, outputs) in [(&live, &mut l), (&version, &mut v)] {
        for stream in [&names.proj_stream, &names.dlq_stream] {
            crate::ops::each_message(&js, stream, 1, false, |m| {
                super::add(outputs, m, &names.prefix, from, to);
            })
            .await?;
        }
    }
    let mut d = diff(&l, &v, from, to, plan.examples);
    d.live_behind = live_behind;
    for c in d.examples.iter_mut() {
        if let (super::ChangeKind::Payload, (Some(a), Some(b))) = (c.kind, c.stored) {
            if let (Some(a), Some(b)) = (
                stored_payload(&js, &live, c.live.as_deref(), a).await,
                stored_payload(&js, &version, c.version.as_deref(), b).await,
            ) {
                c.fields = super::payload_fields(&a, &b);
            }
        }
    }
    Ok(d)
}

/// The payload stored at `seq` of the projection or dead-letter stream `subject` belongs to.
async fn stored_payload(
    js: &jetstream::Context,
    names: &Names,
    subject: Option<&str>,
    seq: u64,
) -> Option<bytes::Bytes> {
    let stream = if subject?.starts_with("dlq.") {
        &names.dlq_stream
    } else {
        &names.proj_stream
    };
    let s = js.get_stream(stream).await.ok()?;
    s.get_raw_message(seq).await.ok().map(|m| m.payload)
}

/// Whether the deployment `live` has processed `ranges` (each raw stream with its first and last
/// sequence). A running deployment under load may still be behind: its outputs are compared once
/// its partitions have processed the ranges too, or with what it has (said in the report) after
/// `LIVE_WAIT`, or as soon as none of its workers holds a partition: a stopped deployment
/// processes nothing more, however long it is waited for.
async fn live_processed(
    js: &jetstream::Context,
    live: &Names,
    ranges: &[(jetstream::stream::Stream, u64, u64, u16)],
) -> bool {
    let bucket = js.get_key_value(&live.leases_bucket).await.ok();
    // No lease bucket: no worker of the deployment ever ran. A lookup that fails otherwise
    // tells nothing, and the wait is only bounded by `LIVE_WAIT`.
    let never_ran = bucket.is_none()
        && matches!(
            js.get_stream(format!("KV_{}", live.leases_bucket)).await,
            Err(e) if crate::bus::error::stream_not_found(&e)
        );
    let stop = match &bucket {
        Some(bucket) => Stop::WhenUnowned(Some(bucket)),
        None if never_ran => Stop::WhenUnowned(None),
        None => Stop::Never,
    };
    let waited = tokio::time::timeout(LIVE_WAIT, async {
        for (raw, f, t, _) in ranges {
            if !follow(raw, live, None, stop, *f, *t, |_| {}).await? {
                return Ok(false);
            }
        }
        Ok::<bool, ReprojectError>(true)
    })
    .await;
    matches!(waited, Ok(Ok(true)))
}

/// How long the comparison waits for the deployment to process the range.
const LIVE_WAIT: Duration = Duration::from_secs(30);

/// What ends [`follow`]'s wait besides the range being processed.
#[derive(Clone, Copy)]
enum Stop<'a> {
    Never,
    /// No worker of the set has held a partition for [`UNOWNED_FOR`] (a stopped set processes
    /// nothing more), by its lease bucket (`None`: it has none).
    WhenUnowned(Option<&'a jetstream::kv::Store>),
}

/// How long a set of workers must be seen holding no partition before [`follow`] stops waiting
/// for it: longer than a lease's hand-over between two workers takes.
const UNOWNED_FOR: Duration = Duration::from_secs(1);

/// Wait until every partition consumer of the set of workers `names` names has processed the
/// range: it has nothing in flight or pending there (what it holds after `to`, the barriers of
/// any set of workers included, does not count). `expected`: the set's partition count, when
/// known (the version's; the deployment's may differ from it and is read from its consumers).
///
/// `true`: the range is processed; `false`: `stop` ended the wait first.
async fn follow(
    raw: &jetstream::stream::Stream,
    names: &Names,
    expected: Option<u16>,
    stop: Stop<'_>,
    from: u64,
    to: u64,
    mut progress: impl FnMut(u64),
) -> Result<bool, ReprojectError> {
    let mut unowned_since: Option<tokio::time::Instant> = None;
    loop {
        let (found, listed) = match partition_consumers(raw, names).await {
            Some(found) => (found, true),
            None => (Vec::new(), false),
        };
        // Not all created yet (provisioning under way), or the list was cut short.
        let count = usize::from(expected.unwrap_or(0)).max(found.len()).max(1);
        let mut done = 0u64;
        let mut finished = listed && found.len() >= count;
        for info in &found {
            let through = processed_through(raw, info, from, to).await;
            finished &= through >= to;
            done += through + 1 - from;
        }
        progress(done / count as u64);
        if finished {
            return Ok(true);
        }
        if let Stop::WhenUnowned(bucket) = stop {
            // A bucket that cannot be listed counts as held: only a clear answer ends the wait.
            let held = match bucket {
                Some(bucket) => crate::bus::leases::any_held(bucket).await.unwrap_or(true),
                None => false,
            };
            if held {
                unowned_since = None;
            } else if unowned_since
                .get_or_insert_with(tokio::time::Instant::now)
                .elapsed()
                >= UNOWNED_FOR
            {
                return Ok(false);
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// How far into `from..=to` a partition consumer has processed: `to` once nothing of its
/// partition at or below `to` is pending or in flight, its ack floor otherwise.
async fn processed_through(
    raw: &jetstream::stream::Stream,
    info: &jetstream::consumer::Info,
    from: u64,
    to: u64,
) -> u64 {
    use async_nats::jetstream::stream::RawMessageErrorKind;
    let floor = info.ack_floor.stream_sequence;
    if (info.num_pending == 0 && info.num_ack_pending == 0) || floor >= to {
        return to;
    }
    let filter = if info.config.filter_subject.is_empty() {
        ">".to_string()
    } else {
        info.config.filter_subject.clone()
    };
    match raw
        .get_first_raw_message_by_subject(filter, floor + 1)
        .await
    {
        Ok(next) if next.sequence > to => to,
        Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => to,
        _ => floor.clamp(from - 1, to),
    }
}

/// The partition consumers of the set of workers `names` names, whatever their count; `None` when
/// the list was cut short.
async fn partition_consumers(
    raw: &jetstream::stream::Stream,
    names: &Names,
) -> Option<Vec<jetstream::consumer::Info>> {
    use futures::StreamExt;
    let mut found = Vec::new();
    let mut consumers = raw.consumers();
    while let Some(info) = consumers.next().await {
        let info = info.ok()?;
        if names.consumer_partition(&info.name).is_some() {
            found.push(info);
        }
    }
    Some(found)
}

/// What `--switch` did.
#[derive(Debug, Clone)]
pub struct Switched {
    pub switch: crate::served::Switch,
    /// Inputs the served version's consumers have not acknowledged yet (pending or in flight).
    pub pending: u64,
    /// The served version's projection subjects, for NATS subscribers.
    pub subjects: String,
}

/// Make the deployment's API serve projection version `version` (empty: its own projections
/// again, the way back). A version must exist (its projection stream); what its consumers have
/// not acknowledged yet is reported, since nothing but its own workers keeps it current.
pub async fn switch(settings: &Settings, version: &str) -> Result<Switched, ReprojectError> {
    let (_client, js) = crate::bus::connect_as(settings, "collab-projector reproject").await?;
    let live = super::live_names(settings);
    let target = Names::versioned(&live.raw_prefix, version);
    if js.get_stream(&target.proj_stream).await.is_err() {
        return Err(ReprojectError::Refused(if version.is_empty() {
            format!(
                "the deployment has no projection stream {}: run `collab-projector provision` first",
                target.proj_stream
            )
        } else {
            format!(
                "projection version {version:?} does not exist (no stream {}): compute it first with `collab-projector reproject --version {version}`",
                target.proj_stream
            )
        }));
    }
    let mut pending = 0u64;
    for name in &live.raw_streams {
        if let Ok(raw) = js.get_stream(name).await {
            for info in partition_consumers(&raw, &target).await.unwrap_or_default() {
                pending += info.num_pending + info.num_ack_pending as u64;
            }
        }
    }
    let switch = crate::served::write(&js, &live, version, settings.nats.replicas)
        .await
        .map_err(|e| api("writing the served version", e))?;
    Ok(Switched {
        switch,
        pending,
        subjects: format!("{}.proj.>", target.prefix),
    })
}

/// What `drop` removed.
#[derive(Debug, Default, Clone)]
pub struct Dropped {
    pub removed: Vec<String>,
}

/// Remove projection version `settings.nats.version`: its partition consumers on the raw stream,
/// its streams, buckets and object store. The raw stream and the deployment's own projections
/// are never touched.
pub async fn drop_version(settings: &Settings) -> Result<Dropped, ReprojectError> {
    let version = settings.names();
    if version.version.is_empty() {
        return Err(ReprojectError::Refused(
            "name the version to remove (--version v2); the deployment's own projections cannot be dropped here".into(),
        ));
    }
    let (_client, js) = crate::bus::connect_as(settings, "collab-projector reproject").await?;
    let live = super::live_names(settings);
    let served = crate::served::read(&js, &live)
        .await
        .map_err(|e| api("the served version", e))?;
    if served.is_some_and(|s| s.version == version.version) {
        return Err(ReprojectError::Refused(format!(
            "projection version {:?} is the one the API serves: switch back first (`collab-projector reproject --switch-back`, or `--version <other> --switch`)",
            version.version
        )));
    }
    let mut out = Dropped::default();
    let found = crate::bus::generations::discover(&js, &version)
        .await
        .map_err(crate::bus::provision::ProvisionError::from)?;
    let version = crate::bus::generations::with_generations(&version, &found);
    for stream in version.all_raw_streams() {
        let Ok(raw) = js.get_stream(stream).await else {
            continue;
        };
        // Every partition consumer of the version, whatever its partition count.
        let names: Vec<String> = partition_consumers(&raw, &version)
            .await
            .unwrap_or_default()
            .into_iter()
            .map(|info| info.name)
            .collect();
        for name in names {
            if raw.delete_consumer(&name).await.is_ok() {
                out.removed.push(format!("consumer {name}"));
            }
        }
    }
    for stream in [&version.proj_stream, &version.dlq_stream] {
        if js.delete_stream(stream).await.is_ok() {
            out.removed.push(format!("stream {stream}"));
        }
    }
    for bucket in [
        &version.turns_bucket,
        &version.sessions_bucket,
        &version.leases_bucket,
    ] {
        if js.delete_key_value(bucket).await.is_ok() {
            out.removed.push(format!("bucket {bucket}"));
        }
    }
    if js.delete_object_store(&version.blobs_store).await.is_ok() {
        out.removed
            .push(format!("object store {}", version.blobs_store));
    }
    Ok(out)
}
