//! Create the streams, consumers and buckets of docs/contract.md section 1, or check that existing ones
//! match. An existing resource whose configuration differs is never changed or deleted: the
//! difference is reported and the caller stops. The one exception is its size limit
//! (`storage.*_max_bytes`) and discard policy: a stream or bucket without them (created before
//! they existed) or with other values gets them, so every deployment is bounded; a limit below
//! what a stream already holds is refused, since the server would make room by dropping data.

use crate::config::{Layout, Names, Settings};
use async_nats::jetstream::context::ConsumerInfoErrorKind as consumer_info_error;
use async_nats::jetstream::{self, consumer, kv, object_store, stream};
use std::time::Duration;
use tracing::info;

#[derive(Debug, thiserror::Error)]
pub enum ProvisionError {
    #[error("{resource} exists with a different configuration: {differences}. collab-projector does not change that on an existing resource (only its size and count limits, its batch permissions and the lease bucket's age): update it yourself (e.g. `nats stream edit`), delete it if its data may go, or change this configuration to match")]
    Differs {
        resource: String,
        differences: String,
    },
    /// The `provision` command run with another `workers.lease_ttl` than running workers'.
    #[error("bucket {bucket}: {workers} with another workers.lease_ttl than this configuration's {ttl}. Workers of two lease TTLs wait out each other's leases by their own, so the lease bucket's age is changed only with every worker stopped: stop them (a worker stopped cleanly deletes its heartbeat; a crashed one's stays for the bucket's age, or delete its w.<id> key: `nats kv del {bucket} w.<id>`), and run provision again; or run it with their workers.lease_ttl (docs/operations.md, \"Storage limits\")")]
    LeaseTtlInUse {
        bucket: String,
        /// The workers, each with its TTL (`w1 runs with 30s`).
        workers: String,
        ttl: String,
    },
    #[error("{0}")]
    Layout(String),
    #[error(transparent)]
    Sets(#[from] super::generations::SetsError),
    #[error("{resource}: {source}")]
    Api {
        resource: String,
        #[source]
        source: super::error::Source,
    },
    /// The server could not reserve a stream's or bucket's size limit: its JetStream storage
    /// (`max_file_store`) has less room than the deployment's limits ask for.
    #[error("{resource}: the server has no room to reserve {setting} ({bytes}): {source}. A JetStream server reserves each stream's and bucket's size limit when it is made, and this deployment's limits come to {total}{replicas}, which must fit in the server's JetStream storage (its max_file_store, by default 75% of the disk's free space when the server started) beside what its other streams reserve. Lower the storage.*_max_bytes settings (COLLAB_STORAGE__RAW_MAX_BYTES and the like) or raise max_file_store in the server's jetstream block (docs/operations.md, \"Storage limits\")")]
    NoRoom {
        resource: String,
        setting: &'static str,
        bytes: Size,
        total: Size,
        replicas: Replicas,
        #[source]
        source: super::error::Source,
    },
}

/// A byte count as people read it, to the nearest tenth (`3 GiB`, `6.5 GiB`, `512 MiB`,
/// `1000 bytes`).
#[derive(Debug, Clone, Copy)]
pub struct Size(pub u64);

impl std::fmt::Display for Size {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const UNITS: [(u128, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
        let bytes = u128::from(self.0);
        for (unit, name) in UNITS {
            if bytes >= unit {
                let tenths = (bytes * 10 + unit / 2) / unit;
                return if tenths % 10 == 0 {
                    write!(f, "{} {name}", tenths / 10)
                } else {
                    write!(f, "{}.{} {name}", tenths / 10, tenths % 10)
                };
            }
        }
        write!(f, "{} bytes", self.0)
    }
}

/// `, times nats.replicas (3)` when the deployment is replicated; nothing otherwise.
#[derive(Debug, Clone, Copy)]
pub struct Replicas(pub usize);

impl std::fmt::Display for Replicas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0 > 1 {
            write!(f, " times nats.replicas ({})", self.0)
        } else {
            Ok(())
        }
    }
}

/// Whether the server refused to create or grow a stream because its JetStream storage cannot
/// reserve the stream's size limit (error code 10047), wherever in the error's chain it says so.
fn storage_exhausted(e: &(dyn std::error::Error + 'static)) -> bool {
    use async_nats::jetstream::context::{CreateStreamError, CreateStreamErrorKind};
    use async_nats::jetstream::ErrorCode;
    let mut next = Some(e);
    while let Some(err) = next {
        let code = if let Some(js) = err.downcast_ref::<async_nats::jetstream::Error>() {
            Some(js.error_code())
        } else if let Some(create) = err.downcast_ref::<CreateStreamError>() {
            match create.kind() {
                CreateStreamErrorKind::JetStream(js) => Some(js.error_code()),
                _ => None,
            }
        } else {
            None
        };
        if code == Some(ErrorCode::STORAGE_RESOURCES_EXCEEDED) {
            return true;
        }
        next = err.source();
    }
    false
}

/// The size limits every stream and bucket of the deployment asks the server to reserve, in
/// bytes, before replication.
pub fn reserved_bytes(s: &Settings) -> u64 {
    let streams = stream_configs(s).into_iter().map(|(c, _)| c.max_bytes);
    let buckets = kv_configs(s).into_iter().map(|c| c.max_bytes);
    streams
        .chain(buckets)
        .chain([s.storage.blobs_max_bytes])
        .map(|b| u64::try_from(b).unwrap_or(0))
        .sum()
}

/// [`api`] for a step that reserves `setting`'s bytes (creating a stream or bucket, setting its
/// limit): a refusal for want of storage names the settings to change and the server's limit.
fn reserving(
    resource: &str,
    setting: &'static str,
    bytes: i64,
    s: &Settings,
    e: impl Into<super::error::Source>,
) -> ProvisionError {
    let source = e.into();
    if storage_exhausted(source.as_ref()) {
        return ProvisionError::NoRoom {
            resource: resource.to_string(),
            setting,
            bytes: Size(u64::try_from(bytes).unwrap_or(0)),
            total: Size(reserved_bytes(s)),
            replicas: Replicas(s.nats.replicas),
            source,
        };
    }
    ProvisionError::Api {
        resource: resource.to_string(),
        source,
    }
}

fn api(resource: &str, e: impl Into<super::error::Source>) -> ProvisionError {
    ProvisionError::Api {
        resource: resource.to_string(),
        source: e.into(),
    }
}

/// What provisioning did, for `provision`'s report.
#[derive(Debug, Default, Clone)]
pub struct Report {
    pub created: Vec<String>,
    pub unchanged: Vec<String>,
    /// Existing resources whose size limit or discard policy was set.
    pub updated: Vec<String>,
}

/// Raw stream `shard`'s transform: a key's events are stored under its partition tokens
/// ([`crate::config::Layout`]), whichever shard holds them.
pub fn raw_transform(names: &Names, layout: &Layout, shard: usize) -> stream::SubjectTransform {
    stream::SubjectTransform {
        source: names.shard_subjects(shard),
        destination: layout.destination(&names.raw_prefix),
    }
}

/// Settle the layout `settings` work with: the raw stream's own when it exists, the one
/// `nats.max_partitions` gives a new stream otherwise (settings settled already are not read
/// again); then check that `nats.partitions` is a
/// count it supports, so every partition is read with one filter.
pub async fn adopt_layout(
    js: &jetstream::Context,
    settings: &mut Settings,
) -> Result<(), ProvisionError> {
    // Read once: `run` settles it before provisioning, which then finds it settled.
    let found = if settings.nats.layout.is_none() {
        let names = settings.names();
        let sets = super::generations::discover(js, &names).await?;
        if let Some(newest) = sets.last() {
            let k = settings.nats.shards;
            // A count the raw streams never had is a mistake (another deployment's settings, a
            // server without this one's streams); one they had before a reshard is not: the
            // newest set is used, so workers whose settings still name the old count keep up.
            if !sets.iter().any(|g| g.shards == k) {
                let held: Vec<String> = sets.iter().flat_map(|g| g.streams.clone()).collect();
                return Err(ProvisionError::Layout(format!(
                    "nats.shards is {k}, which wants raw stream(s) {}, but the server holds {}: set nats.shards to the count those were made with (the N of <PREFIX>_RAW_<i>OF<N>, 1 for <PREFIX>_RAW), or change it on the running deployment with `collab-projector reshard --count {k}`",
                    names.shard_stream_names(k).join(", "),
                    held.join(", ")
                )));
            }
            if newest.shards != k {
                tracing::info!(
                    configured = k,
                    found = newest.shards,
                    streams = %newest.streams.join(", "),
                    "raw traffic was resharded since nats.shards was set; reading the newest raw streams"
                );
            }
            super::generations::adopt(settings, &sets);
        }
        let first = settings.names().raw_stream_of(0).to_string();
        find_stream(js, &first, &format!("stream {first}")).await?
    } else {
        None
    };
    let label = format!("stream {}", settings.names().raw_stream_of(0));
    if let Some(raw) = found {
        let destination = raw
            .cached_info()
            .config
            .subject_transform
            .as_ref()
            .map(|t| t.destination.clone());
        let Some(layout) = destination.as_deref().and_then(Layout::of_destination) else {
            return Err(ProvisionError::Layout(format!(
                "{label} has no partition transform ({destination:?}): it was not made by collab-projector"
            )));
        };
        settings.nats.layout = Some(layout);
    }
    let layout = settings.layout();
    let partitions = settings.nats.partitions;
    if !layout.supports(partitions) {
        return Err(ProvisionError::Layout(format!(
            "nats.partitions is {partitions}, which {label} cannot be read with (it stores one partition token per supported count): choose one of {}",
            layout.counts()
        )));
    }
    settings.nats.layout = Some(layout);
    Ok(())
}

/// Over shards, check that the server's subject mapping sends each key to the raw stream the
/// workers read it from: a barrier (a raw message every partition skips, see `bus::reader`) for
/// a key of each shard must be stored by that shard's stream. Without the mapping no stream
/// takes raw traffic at all, and producers' publishes would fail.
async fn check_shard_mapping(js: &jetstream::Context, names: &Names) -> Result<(), ProvisionError> {
    let k = names.shards();
    if k <= 1 && names.earlier.is_empty() {
        return Ok(());
    }
    let fix = format!(
        "the server must map {} to the {k} raw streams: `collab-projector shards --count {k}` prints the mapping to add (then reload the server)",
        names.raw_subjects()
    );
    for (i, want) in (0..k).zip(&names.raw_streams) {
        let subject = names.barrier_subject(i, k);
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(crate::pipeline::H_BARRIER, names.prefix.as_str());
        let stored = match js
            .publish_with_headers(subject.clone(), headers, bytes::Bytes::new())
            .await
        {
            Ok(ack) => ack.await,
            Err(e) => Err(e),
        };
        match stored {
            Ok(ack) if ack.stream == *want => {}
            // A reshard under way: until the server's mapping moves, raw traffic still goes to
            // the earlier streams, which take writes until `reshard` seals them.
            Ok(ack)
                if names
                    .earlier
                    .iter()
                    .any(|g| g.streams.contains(&ack.stream)) => {}
            Ok(ack) => {
                return Err(ProvisionError::Layout(format!(
                    "a raw message on {subject} was stored by stream {}, not {want}: {fix}",
                    ack.stream
                )))
            }
            Err(e) if e.kind() == jetstream::context::PublishErrorKind::StreamNotFound => {
                return Err(ProvisionError::Layout(format!(
                    "no raw stream stored a message on {subject} ({e}): {fix}"
                )))
            }
            // A stream answered (full, no leader yet): the mapping is not what failed.
            Err(e) => return Err(api(&format!("a barrier to raw stream {want}"), e)),
        }
    }
    Ok(())
}

/// The streams to provision, each with the setting that bounds its size: every raw stream (one
/// per shard), then the projection and dead-letter streams.
pub fn stream_configs(s: &Settings) -> Vec<(stream::Config, &'static str)> {
    let n = s.names();
    let replicas = s.nats.replicas;
    let k = n.shards();
    let raw = n.raw_streams.iter().enumerate().map(|(i, name)| {
        let description = if k > 1 {
            format!("collab-projector raw input, shard {i} of {k}, partitioned by key")
        } else {
            "collab-projector raw input, partitioned by key".to_string()
        };
        stream::Config {
            name: name.clone(),
            description: Some(description),
            subjects: vec![n.shard_subjects(i)],
            subject_transform: Some(raw_transform(&n, &s.layout(), i)),
            max_age: s.nats.raw_max_age,
            // Accepted input is never dropped: when full, a publish is refused.
            max_bytes: s.storage.raw_max_bytes,
            discard: stream::DiscardPolicy::New,
            duplicate_window: s.projection.duplicate_window,
            num_replicas: replicas,
            storage: stream::StorageType::File,
            ..Default::default()
        }
    });
    let raw: Vec<(stream::Config, &'static str)> =
        raw.map(|c| (c, "storage.raw_max_bytes")).collect();
    let others = vec![
        stream::Config {
            name: n.proj_stream.clone(),
            description: Some("collab-projector role-partitioned projections".into()),
            subjects: vec![format!("{}.proj.>", n.prefix)],
            max_age: s.projection.max_age,
            // Projections cannot be rebuilt (docs/operations.md, "Backup"): when full, publishing
            // one waits for room, as dead-lettering does, rather than dropping the oldest.
            max_bytes: s.storage.proj_max_bytes,
            discard: stream::DiscardPolicy::New,
            duplicate_window: s.projection.duplicate_window,
            num_replicas: replicas,
            storage: stream::StorageType::File,
            // Partitions may store their outputs as batches (`nats.publish_batches`).
            allow_atomic_publish: true,
            allow_batch_publish: true,
            ..Default::default()
        },
        stream::Config {
            name: n.dlq_stream.clone(),
            description: Some("collab-projector dead letters".into()),
            subjects: vec![format!("{}.dlq.>", n.prefix)],
            max_age: s.nats.dlq_max_age,
            // A dead letter is never dropped: when full, dead-lettering waits for room.
            max_bytes: s.storage.dlq_max_bytes,
            discard: stream::DiscardPolicy::New,
            duplicate_window: s.projection.duplicate_window,
            num_replicas: replicas,
            storage: stream::StorageType::File,
            // Partitions may store their outputs as batches (`nats.publish_batches`).
            allow_atomic_publish: true,
            allow_batch_publish: true,
            ..Default::default()
        },
    ];
    let bounds = ["storage.proj_max_bytes", "storage.dlq_max_bytes"];
    raw.into_iter()
        .chain(others.into_iter().zip(bounds))
        .collect()
}

/// Record `field` as different when `have != want`.
fn differ<T: PartialEq + std::fmt::Debug>(d: &mut Vec<String>, field: &str, have: T, want: T) {
    if have != want {
        d.push(format!("{field} {have:?} (wanted {want:?})"));
    }
}

fn stream_differences(have: &stream::Config, want: &stream::Config) -> Vec<String> {
    let mut d = Vec::new();
    let mut hs = have.subjects.clone();
    let mut ws = want.subjects.clone();
    hs.sort();
    ws.sort();
    differ(&mut d, "subjects", hs, ws);
    let ht = have
        .subject_transform
        .as_ref()
        .map(|t| (&t.source, &t.destination));
    let wt = want
        .subject_transform
        .as_ref()
        .map(|t| (&t.source, &t.destination));
    differ(&mut d, "subject_transform", ht, wt);
    differ(&mut d, "max_age", have.max_age, want.max_age);
    differ(
        &mut d,
        "duplicate_window",
        have.duplicate_window,
        want.duplicate_window,
    );
    differ(&mut d, "replicas", have.num_replicas, want.num_replicas);
    differ(&mut d, "storage", &have.storage, &want.storage);
    differ(&mut d, "retention", &have.retention, &want.retention);
    d
}

/// Partition `p`'s consumer, starting after raw sequence `resume_after` when the partition ran
/// before (its checkpoint says where its outputs end), from the start otherwise.
pub fn resumed_consumer_config(
    s: &Settings,
    p: u16,
    resume_after: Option<u64>,
) -> consumer::pull::Config {
    let mut config = consumer_config(s, p);
    if let Some(after) = resume_after {
        config.deliver_policy = consumer::DeliverPolicy::ByStartSequence {
            start_sequence: after + 1,
        };
    }
    config
}

/// An existing bucket or object store: check its retention, give it the size limit of `setting`
/// (refusing new writes when full), and report it unchanged when it already had both. A bucket
/// whose entries only live while renewed (`renewed`: the leases, under [`LeaseAge::Restore`]) is given its `max_age` back
/// instead of refused: its age is the lease TTL, not data to keep. `kv_bucket`: a key-value
/// bucket (its per-key history is no count limit), not the object store.
async fn bound_existing(
    (js, s): (&jetstream::Context, &Settings),
    st: &mut stream::Stream,
    (label, setting): (String, &'static str),
    (max_age, replicas, max_bytes): (Duration, usize, i64),
    (kv_bucket, renewed): (bool, bool),
    report: &mut Report,
) -> Result<(), ProvisionError> {
    same_retention(st, &label, (!renewed).then_some(max_age), replicas).await?;
    let discard = stream::DiscardPolicy::New;
    let want = Limits {
        max_bytes,
        discard,
        atomic: false,
        fast: false,
        // A key-value bucket keeps its history in the per-subject limit.
        per_subject: !kv_bucket,
        max_age: renewed.then_some(max_age),
    };
    if !set_limits((js, s), st, &label, setting, want, report).await? {
        report.unchanged.push(label);
    }
    Ok(())
}

/// What an existing stream is given when it lacks it: a size limit, a discard policy, and
/// atomic and fast-ingest batches (`atomic`, `fast`: wanted; never taken away). A count of
/// messages no setting names is taken away (`max_msgs`, and `max_msgs_per_subject` with its
/// `discard_new_per_subject` where `per_subject`): set by hand on the live stream, it would
/// make the stream refuse writes before its size limit or, per subject, drop a subject's
/// oldest messages. (A largest message, `max_msg_size`, is kept: the workers size their
/// outputs to it.)
#[derive(Clone, Copy)]
struct Limits {
    max_bytes: i64,
    discard: stream::DiscardPolicy,
    atomic: bool,
    fast: bool,
    per_subject: bool,
    /// An age to give the stream back (with the duplicate window a bucket of that age is made
    /// with); `None`: its age is checked, never changed (`same_retention`).
    max_age: Option<Duration>,
}

/// No limit, in a stream's configuration.
const UNLIMITED: i64 = -1;

/// The duplicate window of a bucket that keeps values `max_age`: what the server gives a new
/// one (two minutes, or the age when shorter).
fn bucket_duplicate_window(max_age: Duration) -> Duration {
    const TWO_MINUTES: Duration = Duration::from_secs(120);
    if max_age.is_zero() {
        TWO_MINUTES
    } else {
        max_age.min(TWO_MINUTES)
    }
}

/// The limits of an existing stream that are not the wanted ones.
fn limit_differences(have: &stream::Config, want: Limits) -> Vec<String> {
    let mut d = Vec::new();
    differ(&mut d, "max_bytes", have.max_bytes, want.max_bytes);
    differ(&mut d, "discard", have.discard, want.discard);
    differ(&mut d, "max_msgs", have.max_messages, UNLIMITED);
    if want.per_subject {
        differ(
            &mut d,
            "max_msgs_per_subject",
            have.max_messages_per_subject,
            UNLIMITED,
        );
        // Only meaningful with a per-subject limit: the server refuses it without one.
        differ(
            &mut d,
            "discard_new_per_subject",
            have.discard_new_per_subject,
            false,
        );
    }
    if let Some(age) = want.max_age {
        differ(&mut d, "max_age", have.max_age, age);
    }
    if want.atomic {
        differ(&mut d, "allow_atomic", have.allow_atomic_publish, true);
    }
    if want.fast {
        differ(&mut d, "allow_batched", have.allow_batch_publish, true);
    }
    d
}

/// Give the existing stream `st` the size limit `max_bytes` and `discard` (and atomic batches
/// when `atomic`, fast-ingest batches when `fast`), unless it already has them. A limit below
/// the bytes it holds is refused: the server would drop data to fit.
async fn set_limits(
    (js, s): (&jetstream::Context, &Settings),
    st: &mut stream::Stream,
    label: &str,
    setting: &'static str,
    want: Limits,
    report: &mut Report,
) -> Result<bool, ProvisionError> {
    let info = st.info().await.map_err(|e| api(label, e))?;
    let d = limit_differences(&info.config, want);
    if d.is_empty() {
        return Ok(false);
    }
    let held = info.state.bytes;
    if u64::try_from(want.max_bytes).is_ok_and(|m| held > m) {
        return Err(ProvisionError::Differs {
            resource: label.to_string(),
            differences: format!(
                "it holds {held} bytes, more than {setting} ({}); raise {setting} or make room (e.g. `nats stream purge`) first",
                want.max_bytes
            ),
        });
    }
    let mut config = info.config.clone();
    config.max_bytes = want.max_bytes;
    config.discard = want.discard;
    config.max_messages = UNLIMITED;
    if want.per_subject {
        config.max_messages_per_subject = UNLIMITED;
        config.discard_new_per_subject = false;
    }
    if let Some(age) = want.max_age {
        config.max_age = age;
        config.duplicate_window = bucket_duplicate_window(age);
    }
    config.allow_atomic_publish |= want.atomic;
    config.allow_batch_publish |= want.fast;
    js.update_stream(&config)
        .await
        .map_err(|e| reserving(label, setting, want.max_bytes, s, e))?;
    info!(resource = label, changes = %d.join("; "), "limits set on an existing resource");
    report.updated.push(format!("{label}: {}", d.join("; ")));
    Ok(true)
}

pub fn consumer_config(s: &Settings, p: u16) -> consumer::pull::Config {
    let n = s.names();
    consumer::pull::Config {
        durable_name: Some(n.consumer_name(p)),
        description: Some(format!("collab-projector partition {p}")),
        filter_subject: s.partition_filter(p),
        // A partition is processed in order, so one acknowledgement covers every message before
        // it: one ack per group of inputs instead of one per input.
        ack_policy: consumer::AckPolicy::All,
        ack_wait: s.consumer.ack_wait,
        max_deliver: s.consumer.max_deliver,
        max_ack_pending: s.consumer.max_ack_pending,
        deliver_policy: consumer::DeliverPolicy::All,
        num_replicas: s.nats.replicas,
        // The consumer's state is a copy of what the partition's checkpoint and its look-ups of
        // stored outputs recover anyway, so a server restart that clears it loses nothing.
        memory_storage: s.consumer.memory_state,
        ..Default::default()
    }
}

fn consumer_differences(have: &consumer::Config, want: &consumer::pull::Config) -> Vec<String> {
    let mut d = Vec::new();
    differ(
        &mut d,
        "filter_subject",
        &have.filter_subject,
        &want.filter_subject,
    );
    differ(
        &mut d,
        "filter_subjects",
        &have.filter_subjects,
        &want.filter_subjects,
    );
    differ(&mut d, "ack_wait", have.ack_wait, want.ack_wait);
    differ(&mut d, "max_deliver", have.max_deliver, want.max_deliver);
    differ(
        &mut d,
        "max_ack_pending",
        have.max_ack_pending,
        want.max_ack_pending,
    );
    // Storage (`consumer.memory_state`) is not compared: the partition's owner makes a consumer
    // of the other storage again when the partition starts (`worker::open_consumer`).
    // Consumers created before acknowledgements covered whole groups acknowledge every message
    // (`explicit`); the worker keeps doing so for them. Both are correct.
    if have.ack_policy != consumer::AckPolicy::Explicit {
        differ(&mut d, "ack_policy", &have.ack_policy, &want.ack_policy);
    }
    d
}

pub fn kv_configs(s: &Settings) -> Vec<kv::Config> {
    let n = s.names();
    let base = |bucket: &str, description: &str, max_age: Duration, max_bytes: i64| kv::Config {
        bucket: bucket.to_string(),
        description: description.to_string(),
        history: 1,
        max_age,
        max_bytes,
        num_replicas: s.nats.replicas,
        storage: stream::StorageType::File,
        ..Default::default()
    };
    vec![
        base(
            &n.turns_bucket,
            "collab-projector turn records",
            s.turns.retention,
            s.storage.turns_max_bytes,
        ),
        base(
            &n.sessions_bucket,
            "collab-projector work sessions",
            s.projection.max_age,
            s.storage.sessions_max_bytes,
        ),
        base(
            &n.leases_bucket,
            "collab-projector partition leases and worker heartbeats",
            s.workers.lease_ttl,
            s.storage.leases_max_bytes,
        ),
    ]
}

/// What `provision` does with a lease bucket whose age is not `workers.lease_ttl`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseAge {
    /// Refuse, naming both (what a starting worker does: another TTL may be the running
    /// workers', and a worker waits out a gone worker's leases by its own TTL).
    Check,
    /// Give the bucket `workers.lease_ttl` as its age (the `provision` command, run with the
    /// deployment's configuration: after an age cut by hand, or to change the TTL with every
    /// worker stopped).
    Restore,
}

/// Create what is missing, check what exists. Consumers are created for every partition.
pub async fn provision(js: &jetstream::Context, s: &Settings) -> Result<Report, ProvisionError> {
    provision_with(js, s, LeaseAge::Check).await
}

/// [`provision`], with the lease bucket's age checked or given back (`lease_age`).
pub async fn provision_with(
    js: &jetstream::Context,
    s: &Settings,
    lease_age: LeaseAge,
) -> Result<Report, ProvisionError> {
    let mut settled = s.clone();
    adopt_layout(js, &mut settled).await?;
    let s = &settled;
    let mut report = Report::default();
    // A server older than atomic batches (2.12), or fast-ingest batches (2.14), is not asked to
    // allow them (a strict one would refuse the field).
    let version = super::parse_version(&js.client().server_info().version);
    let atomic = version >= Some(super::publisher::ATOMIC_BATCH_SERVER);
    let fast = version >= Some(super::publisher::FAST_BATCH_SERVER);
    for (mut want, setting) in stream_configs(s) {
        want.allow_atomic_publish &= atomic;
        want.allow_batch_publish &= fast;
        let name = format!("stream {}", want.name);
        match find_stream(js, &want.name, &name).await? {
            Some(mut existing) => {
                let info = existing.info().await.map_err(|e| api(&name, e))?;
                let d = stream_differences(&info.config, &want);
                if !d.is_empty() {
                    return Err(ProvisionError::Differs {
                        resource: name,
                        differences: d.join("; "),
                    });
                }
                let set = set_limits(
                    (js, s),
                    &mut existing,
                    &name,
                    setting,
                    Limits {
                        max_bytes: want.max_bytes,
                        discard: want.discard,
                        atomic: want.allow_atomic_publish,
                        fast: want.allow_batch_publish,
                        per_subject: true,
                        max_age: None,
                    },
                    &mut report,
                )
                .await?;
                if !set {
                    report.unchanged.push(name);
                }
            }
            None => {
                let bytes = want.max_bytes;
                js.create_stream(want)
                    .await
                    .map_err(|e| reserving(&name, setting, bytes, s, e))?;
                report.created.push(name);
            }
        }
    }
    let names = s.names();
    check_shard_mapping(js, &names).await?;
    let mut raws = Vec::with_capacity(names.raw_streams.len());
    for name in &names.raw_streams {
        raws.push(js.get_stream(name).await.map_err(|e| api(name, e))?);
    }
    for p in 0..s.nats.partitions {
        let want = consumer_config(s, p);
        let cname = names.consumer_name(p);
        let stream = names.raw_stream_of(p);
        let label = format!("consumer {stream}/{cname}");
        let raw = &raws[usize::from(p) % raws.len()];
        match raw.consumer_info(&cname).await {
            Ok(info) => {
                let d = consumer_differences(&info.config, &want);
                if !d.is_empty() {
                    return Err(ProvisionError::Differs {
                        resource: label,
                        differences: d.join("; "),
                    });
                }
                report.unchanged.push(label);
            }
            Err(e) if e.kind() == consumer_info_error::NotFound => {
                // A partition that ran before resumes where its outputs end (its checkpoint),
                // so a deleted consumer never projects the stream a second time.
                let resume = match js.get_key_value(&names.turns_bucket).await {
                    Ok(kv) => super::turns::resume_after(&kv, p)
                        .await
                        .map_err(|e| api(&format!("checkpoint of partition {p}"), e))?,
                    Err(_) => None,
                };
                match raw
                    .create_consumer(resumed_consumer_config(s, p, resume))
                    .await
                {
                    Ok(_) => report.created.push(label),
                    // Made by someone else between the look-up and the create: the partition's
                    // owner switching the consumer's storage deletes it and makes it again, and
                    // a create that meets a consumer of the other storage is refused (10012).
                    // One that now exists as this worker would have it (storage aside, which its
                    // owner settles) is taken as it is.
                    Err(e) => match raw.consumer_info(&cname).await {
                        Ok(info) if consumer_differences(&info.config, &want).is_empty() => {
                            info!(consumer = %label, "made by another worker while this one looked; taken as it is");
                            report.unchanged.push(label);
                        }
                        _ => return Err(api(&label, e)),
                    },
                }
            }
            Err(e) => return Err(api(&label, e)),
        }
    }
    provision_buckets((js, s), lease_age, &mut report).await?;
    let blobs = names.blobs_store.clone();
    let label = format!("object store {blobs}");
    // A blob lives as long as the projections that refer to it.
    let want = object_store::Config {
        bucket: blobs.clone(),
        description: Some("collab-projector offloaded fields".into()),
        max_age: s.projection.max_age,
        max_bytes: s.storage.blobs_max_bytes,
        num_replicas: s.nats.replicas,
        ..Default::default()
    };
    match find_stream(js, &format!("OBJ_{blobs}"), &label).await? {
        Some(mut st) => {
            let bound = (want.max_age, want.num_replicas, want.max_bytes);
            let at = (label, "storage.blobs_max_bytes");
            bound_existing((js, s), &mut st, at, bound, (false, false), &mut report).await?;
        }
        None => {
            let bytes = want.max_bytes;
            js.create_object_store(want)
                .await
                .map_err(|e| reserving(&label, "storage.blobs_max_bytes", bytes, s, e))?;
            report.created.push(label);
        }
    }
    Ok(report)
}

/// The key-value buckets of [`provision_with`]: made when missing, bounded when they exist.
async fn provision_buckets(
    (js, s): (&jetstream::Context, &Settings),
    lease_age: LeaseAge,
    report: &mut Report,
) -> Result<(), ProvisionError> {
    let names = s.names();
    let settings = [
        "storage.turns_max_bytes",
        "storage.sessions_max_bytes",
        "storage.leases_max_bytes",
    ];
    for (want, setting) in kv_configs(s).into_iter().zip(settings) {
        let label = format!("bucket {}", want.bucket);
        match find_stream(js, &format!("KV_{}", want.bucket), &label).await? {
            Some(mut st) => {
                // Buckets refuse writes when full (the client library's policy for new ones).
                let bound = (want.max_age, want.num_replicas, want.max_bytes);
                // Lease entries live while renewed: the bucket's age is `workers.lease_ttl`.
                let leases = want.bucket == names.leases_bucket;
                let renewed = leases && lease_age == LeaseAge::Restore;
                if renewed {
                    refuse_other_lease_ttls(js, &want.bucket, s.workers.lease_ttl).await?;
                }
                let at = (label, setting);
                let kind = (true, renewed);
                bound_existing((js, s), &mut st, at, bound, kind, report)
                    .await
                    .map_err(|e| match e {
                        ProvisionError::Differs {
                            resource,
                            differences,
                        } if leases => ProvisionError::Differs {
                            resource,
                            differences: format!(
                                "{differences} (its age is the lease TTL: with every worker on this workers.lease_ttl, `collab-projector provision` sets it)"
                            ),
                        },
                        e => e,
                    })?;
            }
            None => {
                let bytes = want.max_bytes;
                js.create_key_value(want)
                    .await
                    .map_err(|e| reserving(&label, setting, bytes, s, e))?;
                report.created.push(label);
            }
        }
    }
    Ok(())
}

/// Refuse to give the lease bucket `ttl` as its age while workers whose heartbeats are in it
/// run with another lease TTL.
async fn refuse_other_lease_ttls(
    js: &jetstream::Context,
    bucket: &str,
    ttl: Duration,
) -> Result<(), ProvisionError> {
    let label = format!("bucket {bucket}");
    let store = js.get_key_value(bucket).await.map_err(|e| api(&label, e))?;
    let other = other_lease_ttls(&store, ttl)
        .await
        .map_err(|e| api(&label, e))?;
    if other.is_empty() {
        return Ok(());
    }
    let workers = other
        .iter()
        .map(|(id, theirs)| {
            format!(
                "worker {id} runs with {}",
                humantime::format_duration(*theirs)
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    Err(ProvisionError::LeaseTtlInUse {
        bucket: bucket.to_string(),
        workers,
        ttl: humantime::format_duration(ttl).to_string(),
    })
}

/// The workers whose heartbeats are in the lease bucket that run with another
/// `workers.lease_ttl` than `ttl`, each with its own. (A heartbeat lives as long as the bucket
/// keeps entries, so a worker stopped within that is still named.) A heartbeat that does not
/// say its TTL is passed over.
async fn other_lease_ttls(
    store: &kv::Store,
    ttl: Duration,
) -> Result<Vec<(String, Duration)>, String> {
    use futures::StreamExt;
    let mut ids = Vec::new();
    let mut keys = store.keys().await.map_err(|e| e.to_string())?;
    while let Some(k) = keys.next().await {
        let k = k.map_err(|e| e.to_string())?;
        if let Some(id) = k.strip_prefix(super::HEARTBEAT_PREFIX) {
            ids.push(id.to_string());
        }
    }
    let mut other = Vec::new();
    for id in ids {
        let key = format!("{}{id}", super::HEARTBEAT_PREFIX);
        let Some(entry) = super::leader_entry(store, &key)
            .await
            .map_err(|e| format!("heartbeat {key}: {e}"))?
        else {
            continue;
        };
        // Compared in whole milliseconds, as the heartbeat writes it.
        if let Some(theirs) = heartbeat_ttl(&entry).filter(|t| t.as_millis() != ttl.as_millis()) {
            other.push((id, theirs));
        }
    }
    Ok(other)
}

/// The lease TTL a heartbeat says its worker runs with.
fn heartbeat_ttl(entry: &super::LeaderEntry) -> Option<Duration> {
    if !entry.put {
        return None;
    }
    let ms = entry
        .headers
        .get(super::H_LEASE_TTL_MS)?
        .as_str()
        .parse::<u64>()
        .ok()?;
    Some(Duration::from_millis(ms))
}

/// Check that an existing bucket's stream keeps values as long and on as many replicas as
/// configured (its other settings, but its size limit, are the client library's); `max_age`
/// `None`: its age is not checked (it is set back instead, see [`Limits::max_age`]).
async fn same_retention(
    st: &mut stream::Stream,
    label: &str,
    max_age: Option<Duration>,
    replicas: usize,
) -> Result<(), ProvisionError> {
    let info = st.info().await.map_err(|e| api(label, e))?;
    let mut d = Vec::new();
    if let Some(max_age) = max_age {
        differ(&mut d, "max_age", info.config.max_age, max_age);
    }
    differ(&mut d, "replicas", info.config.num_replicas, replicas);
    if !d.is_empty() {
        return Err(ProvisionError::Differs {
            resource: label.to_string(),
            differences: d.join("; "),
        });
    }
    Ok(())
}

/// The stream `name`, or `None` when the server says it does not exist (by its error code). Any
/// other failure (no answer, no permission, JetStream off) is an error: a resource is created
/// only when it is known to be missing.
async fn find_stream(
    js: &jetstream::Context,
    name: &str,
    label: &str,
) -> Result<Option<stream::Stream>, ProvisionError> {
    match js.get_stream(name).await {
        Ok(s) => Ok(Some(s)),
        Err(e) if super::error::stream_not_found(&e) => Ok(None),
        Err(e) => Err(api(label, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use async_nats::jetstream::context::{CreateStreamError, CreateStreamErrorKind};

    fn server_error(err_code: u64) -> async_nats::jetstream::Error {
        let body = format!(
            r#"{{"code":500,"err_code":{err_code},"description":"insufficient storage resources available"}}"#
        );
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn sizes_read_as_people_write_them() {
        let text = |n: u64| Size(n).to_string();
        assert_eq!(text(3 << 30), "3 GiB");
        assert_eq!(text((13 << 30) / 2), "6.5 GiB");
        assert_eq!(text(512 << 20), "512 MiB");
        assert_eq!(text(1536), "1.5 KiB");
        assert_eq!(text(1000), "1000 bytes");
        assert_eq!(text((1 << 30) * 15 / 8), "1.9 GiB");
        assert!(text(u64::MAX).ends_with(" GiB"));
        assert_eq!(Replicas(1).to_string(), "");
        assert_eq!(Replicas(3).to_string(), " times nats.replicas (3)");
    }

    #[test]
    fn a_refused_reservation_is_found_wherever_the_chain_carries_it() {
        let direct = server_error(10047);
        assert!(storage_exhausted(&direct));
        let created = CreateStreamError::new(CreateStreamErrorKind::JetStream(server_error(10047)));
        assert!(storage_exhausted(&created));
        // A bucket's creation carries the stream's error as its source.
        let bucket = async_nats::jetstream::context::CreateKeyValueError::with_source(
            async_nats::jetstream::context::CreateKeyValueErrorKind::BucketCreate,
            created,
        );
        assert!(storage_exhausted(&bucket));
        // Other refusals are not taken for it.
        assert!(!storage_exhausted(&server_error(10058)));
        let timed_out = CreateStreamError::new(CreateStreamErrorKind::TimedOut);
        assert!(!storage_exhausted(&timed_out));
    }

    #[test]
    fn the_default_limits_reserve_six_and_a_half_gibibytes() {
        let s = Settings::default();
        assert_eq!(Size(reserved_bytes(&s)).to_string(), "6.5 GiB");
        let mut sharded = s.clone();
        sharded.nats.shards = 4;
        assert_eq!(
            reserved_bytes(&sharded) - reserved_bytes(&s),
            3 * u64::try_from(s.storage.raw_max_bytes).unwrap_or(0)
        );
    }
}
