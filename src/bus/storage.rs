//! How full the deployment's streams and buckets are, sampled for `/metrics` before any of them
//! fills: a full raw stream refuses producers, and a full projection or dead-letter stream or
//! bucket stops the partitions writing to it (docs/operations.md, "Storage limits").

use super::publisher::Publisher;
use super::stats::WorkerState;
use crate::config::Settings;
use crate::telemetry::{self, StreamFill};
use async_nats::jetstream;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How often the worker reads its streams' sizes: well inside the alert's 10 minutes, and seven
/// or so small requests each time.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(15);

/// The JetStream streams that hold the deployment's data, each bounded by a `storage.*` setting:
/// those `provision` makes (the raw streams, one per shard, the projection and dead-letter
/// streams), and the streams behind its buckets and the object store of offloaded fields.
pub fn bounded_streams(s: &Settings) -> Vec<String> {
    bounded_streams_kinds(s)
        .into_iter()
        .map(|(st, _)| st)
        .collect()
}

/// [`bounded_streams`], each with whether it is a key-value bucket's (whose per-key limit is
/// its history, see [`count_limits`]).
fn bounded_streams_kinds(s: &Settings) -> Vec<(String, bool)> {
    let streams = super::provision::stream_configs(s)
        .into_iter()
        .map(|(c, _)| (c.name, false));
    let buckets = super::provision::kv_configs(s)
        .into_iter()
        .map(|c| (format!("KV_{}", c.bucket), true));
    streams
        .chain(buckets)
        .chain([(format!("OBJ_{}", s.names().blobs_store), false)])
        .collect()
}

/// Read `stream`'s size, and its configuration; `None` when the server does not answer or
/// the stream is missing (the gauges then keep their last value, and the next sample tries
/// again).
async fn fill_of(
    js: &jetstream::Context,
    stream: &str,
    kv_bucket: bool,
) -> Option<(StreamFill, jetstream::stream::Config)> {
    // Looking a stream up reads its info: one request per stream.
    let st = js.get_stream(stream).await.ok()?;
    let info = st.cached_info();
    let fill = StreamFill {
        stream: stream.to_string(),
        bytes: info.state.bytes,
        limit: u64::try_from(info.config.max_bytes).ok(),
        messages: info.state.messages,
        count_limits: count_limits(&info.config, kv_bucket),
    };
    Some((fill, info.config.clone()))
}

/// The count limits of a stream configured `config` that no setting names: `provision` makes
/// none, and takes them away (see `provision::Limits`). A key-value bucket's (`kv_bucket`)
/// per-key limit is its history, no count limit.
pub fn count_limits(config: &jetstream::stream::Config, kv_bucket: bool) -> Vec<(String, u64)> {
    let mut limits = Vec::new();
    if let Ok(max) = u64::try_from(config.max_messages) {
        limits.push(("max_msgs".to_string(), max));
    }
    if let (false, Ok(max)) = (kv_bucket, u64::try_from(config.max_messages_per_subject)) {
        limits.push(("max_msgs_per_subject".to_string(), max));
    }
    limits
}

/// The kinds of count limit a stream may have (see [`count_limits`]).
const COUNT_LIMIT_KINDS: [&str; 2] = ["max_msgs", "max_msgs_per_subject"];

/// Set the storage gauges of `fill`'s stream.
pub fn record(fill: &StreamFill) {
    let label = fill.stream.clone();
    metrics::gauge!(telemetry::STORAGE_BYTES, "stream" => label.clone()).set(fill.bytes as f64);
    metrics::gauge!(telemetry::STORAGE_MESSAGES, "stream" => label.clone())
        .set(fill.messages as f64);
    // An unlimited stream has no limit series: the fill alert divides by it and so skips it.
    if let Some(limit) = fill.limit {
        metrics::gauge!(telemetry::STORAGE_LIMIT, "stream" => label.clone()).set(limit as f64);
    }
    // 0 while no count limit of that kind is set (the alert fires above it).
    for kind in COUNT_LIMIT_KINDS {
        let limit = fill
            .count_limits
            .iter()
            .find(|(k, _)| k == kind)
            .map_or(0.0, |(_, l)| *l as f64);
        metrics::gauge!(telemetry::STORAGE_COUNT_LIMIT, "stream" => label.clone(), "kind" => kind)
            .set(limit);
    }
}

/// A stream this full is named in the log (once, until it falls below [`WARN_CLEARS_AT`]).
pub const WARN_AT: f64 = 0.9;
pub const WARN_CLEARS_AT: f64 = 0.8;

/// Whether `stream` at `fill` is to be named in the log now; `warned` holds the streams named
/// and not yet back below [`WARN_CLEARS_AT`].
pub fn should_warn(warned: &mut std::collections::BTreeSet<String>, fill: &StreamFill) -> bool {
    let Some(ratio) = fill.ratio() else {
        return false;
    };
    if ratio >= WARN_AT {
        return warned.insert(fill.stream.clone());
    }
    if ratio < WARN_CLEARS_AT {
        warned.remove(&fill.stream);
    }
    false
}

/// Sample every bounded stream's size every [`SAMPLE_EVERY`] until `stop`, into the gauges and
/// `state` (which `status` reports), and the output streams' duplicate windows and ages into
/// `publisher` (see [`Publisher::heed_output_stream`]). A server that does not answer holds
/// a pass up to its request timeout per stream, never the worker's shutdown.
pub async fn sample(
    js: jetstream::Context,
    settings: Settings,
    state: Arc<WorkerState>,
    publisher: Arc<Publisher>,
    stop: CancellationToken,
) {
    let streams = bounded_streams_kinds(&settings);
    let mut warned = Warned::default();
    loop {
        tokio::select! {
            () = sample_once(&js, &streams, &state, &publisher, &mut warned) => {}
            () = stop.cancelled() => break,
        }
        tokio::select! {
            () = tokio::time::sleep(SAMPLE_EVERY) => {}
            () = stop.cancelled() => break,
        }
    }
}

/// The streams named in the log and not yet back to normal: nearly full, and with a count
/// limit set.
#[derive(Default)]
struct Warned {
    full: std::collections::BTreeSet<String>,
    counted: std::collections::BTreeSet<String>,
}

/// Whether `fill`'s count limits are to be named in the log now (once, until they are gone);
/// `counted` holds the streams named with a count limit still set.
pub fn should_warn_of_counts(
    counted: &mut std::collections::BTreeSet<String>,
    fill: &StreamFill,
) -> bool {
    if fill.count_limits.is_empty() {
        counted.remove(&fill.stream);
        return false;
    }
    counted.insert(fill.stream.clone())
}

/// One pass over `streams`.
async fn sample_once(
    js: &jetstream::Context,
    streams: &[(String, bool)],
    state: &WorkerState,
    publisher: &Publisher,
    warned: &mut Warned,
) {
    for (stream, kv_bucket) in streams {
        let Some((fill, config)) = fill_of(js, stream, *kv_bucket).await else {
            tracing::debug!(stream = %stream, "could not read the stream's size");
            continue;
        };
        publisher.heed_output_stream(stream, &config);
        record(&fill);
        if should_warn_of_counts(&mut warned.counted, &fill) {
            tracing::warn!(
                stream = %stream,
                limits = %fill.count_limits_text(),
                messages = fill.messages,
                "a count limit no setting names is set on a stream: once reached, max_msgs makes the stream refuse writes before its size limit (a raw stream refuses producers, any other stops the partitions writing to it), and max_msgs_per_subject drops a subject's oldest messages (unless discard_new_per_subject is set); run `collab-projector provision` to take it away (docs/operations.md, \"Storage limits\")"
            );
        }
        if should_warn(&mut warned.full, &fill) {
            tracing::warn!(
                stream = %stream,
                bytes = fill.bytes,
                limit = fill.limit.unwrap_or(0),
                "stream nearly full: when full, a raw stream refuses producers' publishes and any other stops the partitions writing to it; raise its storage.*_max_bytes setting and run `provision`, or make room (docs/operations.md, \"Storage limits\")"
            );
        }
        if let Ok(mut fills) = state.storage.lock() {
            fills.insert(stream.clone(), fill);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_stream_with_a_storage_limit_is_sampled() {
        let mut s = Settings::default();
        s.nats.shards = 2;
        let streams = bounded_streams(&s);
        assert_eq!(
            streams,
            [
                "COLLAB_RAW_0OF2",
                "COLLAB_RAW_1OF2",
                "COLLAB_PROJ",
                "COLLAB_DLQ",
                "KV_collab_turns",
                "KV_collab_work_sessions",
                "KV_collab_leases",
                "OBJ_collab_blobs",
            ]
        );
        // One sampled stream per storage limit the provisioner sets.
        let provisioned = crate::bus::provision::stream_configs(&s).len()
            + crate::bus::provision::kv_configs(&s).len()
            + 1;
        assert_eq!(streams.len(), provisioned);
    }

    #[test]
    fn a_nearly_full_stream_is_named_once_until_it_empties() {
        let mut warned = std::collections::BTreeSet::new();
        let at = |stream: &str, bytes| StreamFill {
            stream: stream.to_string(),
            bytes,
            limit: Some(100),
            ..Default::default()
        };
        let raw = |bytes| at("COLLAB_RAW", bytes);
        assert!(!should_warn(&mut warned, &raw(89)));
        assert!(should_warn(&mut warned, &raw(90)));
        assert!(!should_warn(&mut warned, &raw(95)));
        // Another stream is named on its own.
        assert!(should_warn(&mut warned, &at("COLLAB_DLQ", 99)));
        // Falling a little keeps it named; below 80 % it may be named again.
        assert!(!should_warn(&mut warned, &raw(85)));
        assert!(!should_warn(&mut warned, &raw(91)));
        assert!(!should_warn(&mut warned, &raw(79)));
        assert!(should_warn(&mut warned, &raw(92)));
        // An unlimited stream is never full.
        let unlimited = StreamFill {
            stream: "COLLAB_PROJ".into(),
            bytes: u64::MAX,
            limit: None,
            ..Default::default()
        };
        assert!(!should_warn(&mut warned, &unlimited));
    }

    #[test]
    fn count_limits_are_those_no_setting_makes_and_are_named_once_while_set() {
        let mut config = jetstream::stream::Config {
            max_messages: -1,
            max_messages_per_subject: -1,
            ..Default::default()
        };
        assert!(count_limits(&config, false).is_empty());
        config.max_messages = 1000;
        config.max_messages_per_subject = 1;
        assert_eq!(
            count_limits(&config, false),
            [
                ("max_msgs".to_string(), 1000),
                ("max_msgs_per_subject".to_string(), 1)
            ]
        );
        // A key-value bucket keeps its history in the per-subject limit.
        assert_eq!(
            count_limits(&config, true),
            [("max_msgs".to_string(), 1000)]
        );
        let mut counted = std::collections::BTreeSet::new();
        let mut fill = StreamFill {
            stream: "COLLAB_PROJ".into(),
            count_limits: count_limits(&config, false),
            ..Default::default()
        };
        assert!(should_warn_of_counts(&mut counted, &fill));
        assert!(!should_warn_of_counts(&mut counted, &fill));
        fill.count_limits.clear();
        assert!(!should_warn_of_counts(&mut counted, &fill));
        fill.count_limits = count_limits(&config, false);
        assert!(should_warn_of_counts(&mut counted, &fill));
    }

    #[test]
    fn the_ratio_is_of_a_limit_only() {
        let fill = |bytes, limit| StreamFill {
            stream: "COLLAB_RAW".into(),
            bytes,
            limit,
            ..Default::default()
        };
        assert_eq!(fill(512, Some(1024)).ratio(), Some(0.5));
        assert_eq!(fill(512, None).ratio(), None);
        assert_eq!(fill(0, Some(0)).ratio(), None);
    }
}
