//! `collab-projector reshard`: move raw traffic to another number of raw streams on a running
//! deployment (docs/operations.md, "Changing the shard count").
//!
//! 1. The new set of streams is created beside the current one, its sequences starting at the
//!    next multiple of [`crate::config::GENERATION_SPAN`] (see `bus::generations`).
//!    A reshard marker is stored in every partition of the current streams (see
//!    [`mark_partitions`]) before the command says which mapping to install.
//! 2. The operator installs the subject mapping the new count needs and reloads the servers;
//!    the command publishes a barrier for a key of each new shard until every one is stored by
//!    its new stream, so it knows the mapping is live.
//! 3. The current streams are sealed: from then on nothing can be stored there, and a publish
//!    that still reaches them (a node not reloaded yet) is refused, never lost.
//! 4. Each partition reads its sealed stream to its end and goes on with the new one (its
//!    checkpoint and open turns carry over: sequences never repeat); the command waits for every
//!    partition and reports how long the move took and how much was left to read.
//!
//! `--drop-sealed` removes sealed sets every consumer has read to its end.

use crate::bus::error::Source;
use crate::bus::generations::{self, Generation};
use crate::bus::provision::{self, ProvisionError};
use crate::config::{Names, Settings};
use async_nats::jetstream;
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum ReshardError {
    /// The request cannot be carried out as given; the text says what to change.
    #[error("{0}")]
    Refused(String),
    /// Waited as long as asked for something outside the command (the mapping, the workers).
    #[error("{0}")]
    TimedOut(String),
    #[error(transparent)]
    Connect(#[from] crate::bus::ConnectError),
    #[error(transparent)]
    Layout(#[from] ProvisionError),
    #[error(transparent)]
    Sets(#[from] generations::SetsError),
    #[error("{what}: {source}")]
    Api {
        what: String,
        #[source]
        source: Source,
    },
}

fn api(what: impl Into<String>, e: impl Into<Source>) -> ReshardError {
    ReshardError::Api {
        what: what.into(),
        source: e.into(),
    }
}

/// What the command reports as it goes.
#[derive(Debug, Clone)]
pub enum Step {
    /// The new streams exist; the server needs `mapping` in place of the one it has.
    Created {
        streams: Vec<String>,
        mapping: String,
        resumed: bool,
    },
    /// Still waiting for the server's mapping.
    WaitingForMapping { elapsed: Duration },
    /// The old streams are sealed.
    Sealed { streams: Vec<String> },
    /// Partitions past the sealed streams, and inputs left in them.
    Moving {
        moved: u16,
        partitions: u16,
        left: u64,
    },
}

/// What a finished reshard did.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Resharded {
    pub from_shards: u16,
    pub to_shards: u16,
    pub created: Vec<String>,
    pub sealed: Vec<String>,
    /// The new streams' first sequence.
    pub base: u64,
    /// From the start until the mapping was seen live (s).
    pub mapping_wait_s: f64,
    /// Inputs the deployment's partitions had not acknowledged in the sealed streams when they
    /// were sealed.
    pub left_at_seal: u64,
    /// From the seal until every partition had read the sealed streams to their end and was
    /// reading the new ones (s).
    pub move_s: f64,
}

/// How often the command looks again while it waits.
const POLL: Duration = Duration::from_millis(500);

/// Move the deployment `settings` describes to `count` raw streams, waiting at most `wait` for
/// the mapping and as long again for the partitions.
pub async fn reshard(
    settings: &Settings,
    count: u16,
    wait: Duration,
    mut step: impl FnMut(Step),
) -> Result<Resharded, ReshardError> {
    let mut wanted = settings.clone();
    wanted.nats.shards = count;
    wanted
        .validate()
        .map_err(|e| ReshardError::Refused(e.to_string()))?;
    let (_client, js) = crate::bus::connect_as(settings, "collab-projector reshard").await?;
    let mut settings = settings.clone();
    settings.nats.version.clear();
    let found = generations::discover(&js, &settings.names()).await?;
    let Some(newest) = found.last().cloned() else {
        return Err(ReshardError::Refused(format!(
            "there are no raw streams under the prefix {:?} yet: set nats.shards = {count} and start the workers, which create them",
            settings.nats.prefix
        )));
    };
    // The streams on the server say how many there are now, whatever nats.shards says.
    settings.nats.shards = newest.shards;
    provision::adopt_layout(&js, &mut settings).await?;
    let open: Vec<&Generation> = found.iter().filter(|g| !g.sealed).collect();
    // The set raw traffic goes to now (the one to seal), and the set it moves to.
    let (current, target, resumed) = match open.as_slice() {
        // Done already (a command run again after it finished): nothing to do.
        [only] if only.shards == count && *only == &newest => {
            return Ok(Resharded {
                from_shards: count,
                to_shards: count,
                created: Vec::new(),
                sealed: Vec::new(),
                base: only.base,
                mapping_wait_s: 0.0,
                left_at_seal: 0,
                move_s: 0.0,
            });
        }
        [only] => {
            if *only != &newest {
                return Err(ReshardError::Refused(format!(
                    "the newest raw streams ({}) are sealed while older ones ({}) are not: this is not a state a reshard leaves; check the streams with `nats stream ls`",
                    newest.streams.join(", "),
                    only.streams.join(", ")
                )));
            }
            let wanted_names = settings.names().shard_stream_names(count);
            let taken: Vec<&str> = found
                .iter()
                .flat_map(|g| g.streams.iter())
                .filter(|s| wanted_names.contains(s))
                .map(String::as_str)
                .collect();
            if !taken.is_empty() {
                return Err(ReshardError::Refused(format!(
                    "streams {} hold an earlier set of raw traffic over {count} shards: remove them with `collab-projector reshard --drop-sealed` (once every partition has read them) before going back to {count}",
                    taken.join(", ")
                )));
            }
            let created = create_set(&js, &settings, count, generations::next_base(newest.base))
                .await?;
            ((*only).clone(), created, false)
        }
        [older, newer] if newer.shards == count && *newer == &newest => {
            ((*older).clone(), (*newer).clone(), true)
        }
        [older, newer] => {
            return Err(ReshardError::Refused(format!(
                "a reshard from {} to {} stream(s) is under way: finish it first (`collab-projector reshard --count {}`)",
                older.shards, newer.shards, newer.shards
            )))
        }
        _ => {
            return Err(ReshardError::Refused(format!(
                "the raw streams are in a state no reshard leaves: {} sets take writes",
                open.len()
            )))
        }
    };
    let target_names = {
        let mut n = settings.names();
        n.set_shards(count);
        n
    };
    mark_partitions(&js, &settings, (&current, &target), resumed, wait).await?;
    step(Step::Created {
        streams: target.streams.clone(),
        mapping: target_names
            .shard_mapping_config()
            .unwrap_or_else(|| target_names.unsharded_mapping_config()),
        resumed,
    });

    let started = Instant::now();
    wait_for_mapping(&js, &target_names, &target, wait, &mut step).await?;
    let mapping_wait_s = started.elapsed().as_secs_f64();

    let partitions = settings.nats.partitions;
    let names = settings.names();
    let consumers: Vec<String> = (0..partitions).map(|p| names.consumer_name(p)).collect();
    let mut sealed = Vec::new();
    for name in &current.streams {
        generations::seal(&js, name).await?;
        sealed.push(name.clone());
    }
    step(Step::Sealed {
        streams: sealed.clone(),
    });
    let sealed_at = Instant::now();
    let (old, new) = (
        handles(&js, &current.streams).await?,
        handles(&js, &target.streams).await?,
    );
    let left_at_seal = wait_for_move((&old, &new), &consumers, sealed_at, wait, &mut step).await?;
    Ok(Resharded {
        from_shards: current.shards,
        to_shards: count,
        created: if resumed {
            Vec::new()
        } else {
            target.streams.clone()
        },
        sealed,
        base: target.base,
        mapping_wait_s,
        left_at_seal,
        move_s: sealed_at.elapsed().as_secs_f64(),
    })
}

/// Poll the partitions until every one has moved past the sealed `old` streams, within `wait`
/// of the seal; the inputs that were left in them at the first poll.
async fn wait_for_move(
    (old, new): (&[jetstream::stream::Stream], &[jetstream::stream::Stream]),
    consumers: &[String],
    sealed_at: Instant,
    wait: Duration,
    step: &mut impl FnMut(Step),
) -> Result<u64, ReshardError> {
    let partitions = u16::try_from(consumers.len()).unwrap_or(u16::MAX);
    let mut left_at_seal = None;
    loop {
        let (moved, left) = match moved_past((old, new), consumers).await {
            Ok(counts) => counts,
            // A look-up the server did not answer in time (a loaded or electing cluster) is
            // asked again at the next poll, within the same wait.
            Err(Lookup {
                error,
                unanswered: true,
            }) if sealed_at.elapsed() <= wait => {
                tracing::warn!(%error, "a consumer look-up went unanswered; asking again");
                tokio::time::sleep(POLL).await;
                continue;
            }
            Err(Lookup { error, .. }) => return Err(error),
        };
        left_at_seal.get_or_insert(left);
        step(Step::Moving {
            moved,
            partitions,
            left,
        });
        if moved == partitions {
            return Ok(left_at_seal.unwrap_or(0));
        }
        if sealed_at.elapsed() > wait {
            return Err(ReshardError::TimedOut(format!(
                "{} of {partitions} partitions have not read the sealed streams to their end after {:?} ({left} inputs left): are the workers running? Run the same command again to keep waiting",
                partitions - moved,
                wait
            )));
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Create the `count` raw streams of a new set starting at sequence `base`, with the current
/// layout and limits.
async fn create_set(
    js: &jetstream::Context,
    settings: &Settings,
    count: u16,
    base: u64,
) -> Result<Generation, ReshardError> {
    let mut s = settings.clone();
    s.nats.shards = count;
    s.nats.earlier.clear();
    s.nats.raw_base = base;
    let names = s.names();
    for (mut config, _) in provision::stream_configs(&s)
        .into_iter()
        .take(usize::from(count))
    {
        config.first_sequence = Some(base);
        config
            .metadata
            .insert(generations::BASE_METADATA.to_string(), base.to_string());
        let name = config.name.clone();
        js.create_stream(config)
            .await
            .map_err(|e| api(format!("creating stream {name}"), e))?;
    }
    Ok(Generation {
        base,
        shards: count,
        streams: names.raw_streams.clone(),
        sealed: false,
    })
}

/// Store a reshard marker in every partition of the `current` streams, before the operator is
/// told to map raw subjects to `target`: once some server maps them to `target` and others do
/// not yet, a partition's inputs can be stored in either set, and its watermark stops at the
/// marker until it reads `target` (see `bus::reader`, `Partition::heed_reshard_marker`). One
/// marker for each partition of the largest count the layout supports reaches every partition
/// of every count, a projection version's too. A command run again (`resumed`) stores them
/// again, in case the first run stopped half way; a partition heeds the first it reads. A
/// marker that lands in `target` (the mapping is installed already, as when the command is run
/// again after the reload) is harmless and passed over.
async fn mark_partitions(
    js: &jetstream::Context,
    settings: &Settings,
    (current, target): (&Generation, &Generation),
    resumed: bool,
    wait: Duration,
) -> Result<(), ReshardError> {
    let names = settings.names();
    let most = settings.layout().levels.last().copied().unwrap_or(1);
    let started = Instant::now();
    let mut left: Vec<u16> = (0..most).collect();
    let mut in_target = 0usize;
    // Acknowledgements awaited a chunk at a time, within the connection's publish window.
    let chunk = settings.consumer.publish_window.clamp(1, 64);
    while !left.is_empty() {
        let mut failed = Vec::new();
        let mut last_error = None;
        for some in left.chunks(chunk) {
            let mut pending = Vec::with_capacity(some.len());
            for &p in some {
                let mut headers = async_nats::HeaderMap::new();
                headers.insert(crate::pipeline::H_BARRIER, names.prefix.as_str());
                headers.insert(crate::pipeline::H_RESHARD, target.base.to_string().as_str());
                let sent = js
                    .publish_with_headers(
                        names.reshard_marker_subject(p, most),
                        headers,
                        bytes::Bytes::new(),
                    )
                    .await;
                pending.push((p, sent));
            }
            for (p, sent) in pending {
                let stored = match sent {
                    Ok(ack) => ack.await,
                    Err(e) => Err(e),
                };
                match stored {
                    Ok(ack) if current.streams.contains(&ack.stream) => {}
                    Ok(_) => in_target += 1,
                    Err(e) => {
                        last_error = Some(e.to_string());
                        failed.push(p);
                    }
                }
            }
        }
        left = failed;
        if let Some(e) = last_error {
            if started.elapsed() > wait {
                return Err(ReshardError::TimedOut(format!(
                    "{} of {most} reshard markers could not be stored in {} after {wait:?} ({e}): is every stream there up? Run the same command again",
                    left.len(),
                    current.streams.join(", ")
                )));
            }
            tokio::time::sleep(POLL).await;
        }
    }
    if in_target > 0 && !resumed {
        tracing::warn!(
            markers = in_target,
            streams = %target.streams.join(", "),
            "reshard markers were stored in the new streams: the servers map raw subjects there already"
        );
    }
    Ok(())
}

/// Publish a barrier for a key of each of `target`'s shards until each is stored by its stream
/// there: the server's mapping sends raw traffic to the new set.
async fn wait_for_mapping(
    js: &jetstream::Context,
    target_names: &Names,
    target: &Generation,
    wait: Duration,
    step: &mut impl FnMut(Step),
) -> Result<(), ReshardError> {
    let started = Instant::now();
    let mut next_report = Duration::ZERO;
    loop {
        let mut live = true;
        for (i, want) in (0..target.shards).zip(&target.streams) {
            let subject = target_names.barrier_subject(i, target.shards);
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(crate::pipeline::H_BARRIER, target_names.prefix.as_str());
            let stored = match js
                .publish_with_headers(subject, headers, bytes::Bytes::new())
                .await
            {
                Ok(ack) => ack.await.ok(),
                Err(_) => None,
            };
            if stored.is_none_or(|a| a.stream != *want) {
                live = false;
                break;
            }
        }
        if live {
            return Ok(());
        }
        let elapsed = started.elapsed();
        if elapsed > wait {
            return Err(ReshardError::TimedOut(format!(
                "the server still does not send raw traffic to {} after {wait:?}: install the mapping printed above on every node and reload them (`nats-server --signal reload`), then run the same command again",
                target.streams.join(", ")
            )));
        }
        if elapsed >= next_report {
            step(Step::WaitingForMapping { elapsed });
            next_report = elapsed + Duration::from_secs(5);
        }
        tokio::time::sleep(POLL).await;
    }
}

/// The streams named `names`, looked up once.
async fn handles(
    js: &jetstream::Context,
    names: &[String],
) -> Result<Vec<jetstream::stream::Stream>, ReshardError> {
    let mut out = Vec::with_capacity(names.len());
    for name in names {
        out.push(
            js.get_stream(name)
                .await
                .map_err(|e| api(format!("stream {name}"), e))?,
        );
    }
    Ok(out)
}

/// How many of the partitions have moved past the `old` streams: read them to their end (their
/// consumer there has nothing pending or unacknowledged) and read the `new` ones (their consumer
/// there is being pulled from, or has delivered); and the inputs left in `old`. Partition `p`
/// reads stream `p % len` of each.
async fn moved_past(
    (old, new): (&[jetstream::stream::Stream], &[jetstream::stream::Stream]),
    consumers: &[String],
) -> Result<(u16, u64), Lookup> {
    use jetstream::context::{ConsumerInfoError, ConsumerInfoErrorKind};
    let nth = |streams: &[jetstream::stream::Stream], p: usize| {
        streams
            .get(p % streams.len().max(1))
            .cloned()
            .ok_or_else(|| ReshardError::Refused("a set of raw streams has no stream".into()))
    };
    let failed = |stream: &jetstream::stream::Stream, consumer: &str, e: ConsumerInfoError| {
        let name = &stream.cached_info().config.name;
        Lookup {
            unanswered: matches!(
                e.kind(),
                ConsumerInfoErrorKind::TimedOut
                    | ConsumerInfoErrorKind::Request
                    | ConsumerInfoErrorKind::NoResponders
                    | ConsumerInfoErrorKind::Offline
            ),
            error: api(format!("consumer {name}/{consumer}"), e),
        }
    };
    let refused = |error| Lookup {
        error,
        unanswered: false,
    };
    let mut moved = 0u16;
    let mut left = 0u64;
    for (p, consumer) in consumers.iter().enumerate() {
        let stream = nth(old, p).map_err(refused)?;
        let here = match stream.consumer_info(consumer).await {
            Ok(c) => c.num_pending + u64::try_from(c.num_ack_pending).unwrap_or(0),
            // A partition that never read this set has nothing there.
            Err(e) if e.kind() == ConsumerInfoErrorKind::NotFound => 0,
            Err(e) => return Err(failed(&stream, consumer, e)),
        };
        left += here;
        if here > 0 {
            continue;
        }
        let stream = nth(new, p).map_err(refused)?;
        match stream.consumer_info(consumer).await {
            Ok(c) if c.num_waiting > 0 || c.delivered.consumer_sequence > 0 => moved += 1,
            Ok(_) => {}
            Err(e) if e.kind() == ConsumerInfoErrorKind::NotFound => {}
            Err(e) => return Err(failed(&stream, consumer, e)),
        }
    }
    Ok((moved, left))
}

/// A partition look-up of [`moved_past`] that failed; `unanswered`: the server did not answer
/// (timed out, no responder, the consumer's replicas offline), which waiting may heal.
struct Lookup {
    error: ReshardError,
    unanswered: bool,
}

/// What `--drop-sealed` removed.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Dropped {
    pub streams: Vec<String>,
}

/// Delete every sealed set of raw streams whose consumers (the deployment's partitions, and
/// those of any projection version) have all read it to its end. A set some consumer still
/// reads is refused, naming it. The audits and reprojections of the traffic they held go with
/// them.
pub async fn drop_sealed(settings: &Settings) -> Result<Dropped, ReshardError> {
    use futures::StreamExt;
    let (_client, js) = crate::bus::connect_as(settings, "collab-projector reshard").await?;
    let mut names_settings = settings.clone();
    names_settings.nats.version.clear();
    let found = generations::discover(&js, &names_settings.names()).await?;
    let sealed: Vec<&Generation> = found
        .iter()
        .take(found.len().saturating_sub(1))
        .filter(|g| g.sealed)
        .collect();
    if sealed.is_empty() {
        return Err(ReshardError::Refused(
            "there is no sealed set of raw streams to drop".into(),
        ));
    }
    // A turn or run opened by a request in a sealed stream may stay open until its deadline,
    // and deciding it reads the request back (a response held before its send, the response):
    // the streams go only once every such deadline has passed.
    let longest = settings
        .turns
        .max_timeout
        .max(settings.runs.timeout)
        .max(settings.turns.early_hold)
        .saturating_add(settings.turns.clock_skew);
    let mut reading = Vec::new();
    for g in &sealed {
        for name in &g.streams {
            let mut stream = js
                .get_stream(name)
                .await
                .map_err(|e| api(format!("stream {name}"), e))?;
            let last = stream
                .info()
                .await
                .map_err(|e| api(format!("stream {name}"), e))?
                .state
                .last_timestamp;
            let age = chrono::Utc::now()
                .signed_duration_since(last)
                .to_std()
                .unwrap_or_default();
            if age < longest {
                return Err(ReshardError::Refused(format!(
                    "the last input of {name} is {}s old: turns and runs it opened may stay open until their deadline (turns.max_timeout, runs.timeout: {}s). Drop the sealed streams in {}s",
                    age.as_secs(),
                    longest.as_secs(),
                    (longest - age).as_secs() + 1
                )));
            }
            let mut consumers = stream.consumers();
            while let Some(info) = consumers.next().await {
                let info = info.map_err(|e| api(format!("consumers of {name}"), e))?;
                if info.num_pending > 0 || info.num_ack_pending > 0 {
                    reading.push(format!(
                        "{name}/{} ({} left)",
                        info.name,
                        info.num_pending + u64::try_from(info.num_ack_pending).unwrap_or(0)
                    ));
                }
            }
        }
    }
    if !reading.is_empty() {
        return Err(ReshardError::Refused(format!(
            "consumers still read the sealed raw streams: {}. Let them finish (their workers must run), or delete a consumer that is no longer used",
            reading.join(", ")
        )));
    }
    let mut dropped = Vec::new();
    for g in sealed {
        for name in &g.streams {
            js.delete_stream(name)
                .await
                .map_err(|e| api(format!("deleting stream {name}"), e))?;
            dropped.push(name.clone());
        }
    }
    Ok(Dropped { streams: dropped })
}
