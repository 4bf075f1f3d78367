//! The raw streams over time. A deployment's raw traffic is in one set of streams (one, or one
//! per shard) until `collab-projector reshard` moves it to another set: new streams whose first
//! sequence is the next multiple of [`GENERATION_SPAN`], the server's mapping sent to them, the
//! old set sealed. A partition reads every set in order, each to its end, so a key's events stay
//! in order and every input is read once; sequences never repeat over the sets, so checkpoints
//! and turn records taken on one set keep their meaning on the next.

use crate::config::{Names, RawGen, Settings, GENERATION_SPAN};
use async_nats::jetstream::{self, stream};
use futures::TryStreamExt;
use std::collections::BTreeMap;

/// The stream metadata key that records a set's first sequence (absent: 0, a set made before
/// any reshard).
pub const BASE_METADATA: &str = "collab-projector.raw-base";

/// One set of raw streams as found on the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Generation {
    pub base: u64,
    pub shards: u16,
    /// `streams[i]` holds the keys with `h % shards == i`.
    pub streams: Vec<String>,
    /// Every stream of the set is sealed: it takes no more writes.
    pub sealed: bool,
}

impl Generation {
    pub fn as_raw_gen(&self) -> RawGen {
        RawGen {
            base: self.base,
            streams: self.streams.clone(),
        }
    }
}

/// Why the sets of raw streams could not be found or changed.
#[derive(Debug, thiserror::Error)]
pub enum SetsError {
    /// The streams on the server are not a state collab-projector makes; the text says what to do.
    #[error("{0}")]
    Layout(String),
    /// A set misses some of its streams (perhaps being created right now); the text names them.
    #[error("{0}")]
    Incomplete(String),
    #[error("{what}: {source}")]
    Api {
        what: String,
        #[source]
        source: super::error::Source,
    },
}

fn api(what: &str, e: impl Into<super::error::Source>) -> SetsError {
    SetsError::Api {
        what: what.to_string(),
        source: e.into(),
    }
}

/// How long a set found missing some of its streams is looked up again before that is an
/// error: `reshard` creates a set's streams one after another, so a worker starting (or a
/// running one looking) in between finds part of a set that is complete a moment later.
const INCOMPLETE_SETTLE: std::time::Duration = std::time::Duration::from_secs(5);

/// Every set of raw streams `names` can have made, oldest first; empty when there is none.
/// A set missing one of its streams (still, after [`INCOMPLETE_SETTLE`]), or two sets with the
/// same first sequence, is an error naming them.
pub async fn discover(
    js: &jetstream::Context,
    names: &Names,
) -> Result<Vec<Generation>, SetsError> {
    let started = tokio::time::Instant::now();
    loop {
        match discover_once(js, names).await {
            Err(e @ SetsError::Incomplete(_)) if started.elapsed() < INCOMPLETE_SETTLE => {
                tracing::debug!(error = %e, "a set of raw streams is incomplete; looking again (a reshard may be creating it)");
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
            found => return found,
        }
    }
}

async fn discover_once(
    js: &jetstream::Context,
    names: &Names,
) -> Result<Vec<Generation>, SetsError> {
    let listed: Vec<String> = js
        .stream_names()
        .try_collect()
        .await
        .map_err(|e| api("the list of streams", e))?;
    // shard count -> (index -> (name, sealed, base))
    let mut sets: BTreeMap<u16, BTreeMap<u16, (String, bool, u64)>> = BTreeMap::new();
    for name in listed {
        let Some((i, k)) = names.shard_of_stream_name(&name) else {
            continue;
        };
        let info = js
            .get_stream(&name)
            .await
            .map_err(|e| api(&format!("stream {name}"), e))?
            .cached_info()
            .clone();
        let base = info
            .config
            .metadata
            .get(BASE_METADATA)
            .and_then(|b| b.parse::<u64>().ok())
            .unwrap_or(0);
        sets.entry(k)
            .or_default()
            .insert(i, (name, info.config.sealed, base));
    }
    let mut found = Vec::with_capacity(sets.len());
    for (k, members) in sets {
        let expected = names.shard_stream_names(k);
        if members.len() != usize::from(k) {
            let missing: Vec<&str> = expected
                .iter()
                .filter(|e| !members.values().any(|(n, _, _)| n == *e))
                .map(String::as_str)
                .collect();
            return Err(SetsError::Incomplete(format!(
                "the raw streams over {k} shards are incomplete: {} missing. Create them again with `collab-projector reshard --count {k}` (a reshard that stopped half way) or delete the others",
                missing.join(", ")
            )));
        }
        let base = members.values().map(|(_, _, b)| *b).max().unwrap_or(0);
        let sealed = members.values().all(|(_, s, _)| *s);
        found.push(Generation {
            base,
            shards: k,
            streams: expected,
            sealed,
        });
    }
    found.sort_by_key(|g| g.base);
    if let Some(pair) = found.windows(2).find(|w| w[0].base == w[1].base) {
        return Err(SetsError::Layout(format!(
            "raw streams {} and {} start at the same sequence ({}): only one set of raw streams can be made without `collab-projector reshard`; delete the set that is not in use",
            pair[0].streams.join(", "),
            pair[1].streams.join(", "),
            pair[0].base
        )));
    }
    Ok(found)
}

/// The streams of the set of raw streams starting at sequence `base`, if it is on the server.
pub async fn set_streams(
    js: &jetstream::Context,
    names: &Names,
    base: u64,
) -> Result<Option<Vec<String>>, SetsError> {
    Ok(discover(js, names)
        .await?
        .into_iter()
        .find(|g| g.base == base)
        .map(|g| g.streams))
}

/// Whether any of `streams` is gone from the server (asked by name; an answer other than "no
/// such stream" is an error).
pub async fn any_stream_gone(js: &jetstream::Context, streams: &[String]) -> Result<bool, String> {
    for name in streams {
        match js.get_stream(name).await {
            Ok(_) => {}
            Err(e) if super::error::stream_not_found(&e) => return Ok(true),
            Err(e) => return Err(format!("stream {name}: {e}")),
        }
    }
    Ok(false)
}

/// Record `found` (oldest first, not empty) in `settings`: the newest set is the one the
/// workers provision and producers' traffic goes to once resharded, the others are read first.
pub fn adopt(settings: &mut Settings, found: &[Generation]) {
    let Some((newest, earlier)) = found.split_last() else {
        return;
    };
    settings.nats.shards = newest.shards;
    settings.nats.raw_base = newest.base;
    settings.nats.earlier = earlier.iter().map(Generation::as_raw_gen).collect();
}

/// `names` with the sets of raw streams `found` in place of the ones it was made with.
pub fn with_generations(names: &Names, found: &[Generation]) -> Names {
    let mut n = names.clone();
    if let Some((newest, earlier)) = found.split_last() {
        let earlier: Vec<RawGen> = earlier.iter().map(Generation::as_raw_gen).collect();
        n.set_raw_sets(newest.shards, newest.base, &earlier);
    }
    n
}

/// The first sequence of the set after the one starting at `base`.
pub fn next_base(base: u64) -> u64 {
    (base / GENERATION_SPAN + 1) * GENERATION_SPAN
}

/// Whether partition consumer `consumer` of `stream` has read and acknowledged everything it
/// will ever be given there: the stream is sealed, nothing is pending, nothing awaits an
/// acknowledgement. A missing consumer has not.
pub async fn read_to_its_end(stream: &stream::Stream, consumer: &str) -> Result<bool, String> {
    use async_nats::jetstream::context::ConsumerInfoErrorKind;
    let mut stream = stream.clone();
    let info = stream.info().await.map_err(|e| e.to_string())?;
    if !info.config.sealed {
        return Ok(false);
    }
    match stream.consumer_info(consumer).await {
        Ok(c) => Ok(c.num_pending == 0 && c.num_ack_pending == 0),
        Err(e) if e.kind() == ConsumerInfoErrorKind::NotFound => Ok(false),
        Err(e) => Err(e.to_string()),
    }
}

/// Seal `stream`: it takes no more writes (a publish is refused), and keeps what it holds for
/// the partitions still reading it.
pub async fn seal(js: &jetstream::Context, name: &str) -> Result<bool, SetsError> {
    let mut stream = js
        .get_stream(name)
        .await
        .map_err(|e| api(&format!("stream {name}"), e))?;
    let info = stream
        .info()
        .await
        .map_err(|e| api(&format!("stream {name}"), e))?;
    if info.config.sealed {
        return Ok(false);
    }
    let mut config = info.config.clone();
    config.sealed = true;
    js.update_stream(&config)
        .await
        .map_err(|e| api(&format!("sealing stream {name}"), e))?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_set_starts_at_the_next_multiple_of_the_span() {
        assert_eq!(next_base(0), GENERATION_SPAN);
        assert_eq!(next_base(GENERATION_SPAN), 2 * GENERATION_SPAN);
        assert_eq!(next_base(GENERATION_SPAN + 5), 2 * GENERATION_SPAN);
    }

    #[test]
    fn names_with_generations_read_each_sequence_from_the_set_that_stored_it() {
        let names = Names::new("collab");
        let found = vec![
            Generation {
                base: 0,
                shards: 2,
                streams: names.shard_stream_names(2),
                sealed: true,
            },
            Generation {
                base: GENERATION_SPAN,
                shards: 4,
                streams: names.shard_stream_names(4),
                sealed: false,
            },
        ];
        let n = with_generations(&names, &found);
        assert_eq!(n.raw_streams, names.shard_stream_names(4));
        assert_eq!(n.raw_stream_at(3, 17), "COLLAB_RAW_1OF2");
        assert_eq!(n.raw_stream_at(3, GENERATION_SPAN + 17), "COLLAB_RAW_3OF4");
        assert_eq!(n.raw_stream_at(6, GENERATION_SPAN), "COLLAB_RAW_2OF4");
        for key in ["a", "conv-1", "task-9"] {
            let old = n.raw_stream_of_key_at(key, 5);
            let new = n.raw_stream_of_key_at(key, GENERATION_SPAN + 5);
            assert_eq!(
                old,
                found[0].streams[found[0].as_raw_gen().shard_of_key(key)]
            );
            assert_eq!(new, n.raw_streams[n.shard_of_key(key)]);
        }
        assert_eq!(n.all_raw_streams().len(), 6);
        assert_eq!(
            n.input_of_msg_id("COLLAB_RAW_0OF2:12:0"),
            Some(("COLLAB_RAW_0OF2", 12))
        );
    }

    #[test]
    fn only_the_names_a_set_is_made_with_count_as_raw_streams() {
        let n = Names::new("collab");
        assert_eq!(n.shard_of_stream_name("COLLAB_RAW"), Some((0, 1)));
        assert_eq!(n.shard_of_stream_name("COLLAB_RAW_3OF4"), Some((3, 4)));
        for other in [
            "COLLAB_RAW_4OF4",
            "COLLAB_RAW_03OF4",
            "COLLAB_RAW_0OF1",
            "COLLAB_RAWX",
            "COLLAB_PROJ",
            "COLLAB_RAW_1OF",
        ] {
            assert_eq!(n.shard_of_stream_name(other), None, "{other}");
        }
    }
}
