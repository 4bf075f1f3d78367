//! Logging setup and every metric name in one place. Labels are small, bounded sets (role,
//! reason, outcome), never ids or error strings.

use tracing_subscriber::{fmt, EnvFilter};

/// Raw messages handled, by `outcome` (projected, dead_lettered, already_projected).
pub const INPUTS: &str = "collab_inputs_total";
/// Projected events published, by `role`.
pub const PROJECTED: &str = "collab_projected_total";
/// Dead letters published, by `reason`.
pub const DEAD_LETTERS: &str = "collab_dead_letters_total";
/// Publishes retried in place after a failure.
pub const PUBLISH_RETRIES: &str = "collab_publish_retries_total";
/// Large fields moved to the object store, and their bytes.
pub const BLOBS_STORED: &str = "collab_blobs_stored_total";
pub const BLOB_BYTES: &str = "collab_blob_bytes_total";
/// Turn outcomes published, by `outcome` (response, blocked) and `reason`.
pub const TURN_OUTCOMES: &str = "collab_turn_outcomes_total";
/// Responses suppressed, by `reason` (duplicate, late).
pub const SUPPRESSED: &str = "collab_responses_suppressed_total";
/// Partitions this worker owns.
pub const PARTITIONS_OWNED: &str = "collab_partitions_owned";
/// Open turns held in memory.
pub const OPEN_TURNS: &str = "collab_open_turns";
/// Projections folded into work sessions (by the worker that owns partition 0).
pub const SESSION_EVENTS_FOLDED: &str = "collab_session_events_folded_total";
/// The projection-stream sequence up to which work sessions are written.
pub const SESSION_FOLD_POSITION: &str = "collab_session_fold_position";

/// What a metric family is, for its `# TYPE` line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Counter,
    Gauge,
}

/// Every metric family with its kind and its `# HELP` text.
pub const FAMILIES: &[(&str, Family, &str)] = &[
    (
        INPUTS,
        Family::Counter,
        "Raw messages handled, by outcome (projected, dead_lettered).",
    ),
    (
        PROJECTED,
        Family::Counter,
        "Projected events published, by role.",
    ),
    (
        DEAD_LETTERS,
        Family::Counter,
        "Dead letters published, by reason.",
    ),
    (
        PUBLISH_RETRIES,
        Family::Counter,
        "Publishes retried in place after a failure.",
    ),
    (
        BLOBS_STORED,
        Family::Counter,
        "Fields over limits.max_inline_bytes moved to the object store.",
    ),
    (
        BLOB_BYTES,
        Family::Counter,
        "Bytes of the fields moved to the object store.",
    ),
    (
        TURN_OUTCOMES,
        Family::Counter,
        "Turn responses published, by outcome (response, blocked) and reason.",
    ),
    (
        SUPPRESSED,
        Family::Counter,
        "Later replies and duplicates kept out of the response subject, by reason.",
    ),
    (
        PARTITIONS_OWNED,
        Family::Gauge,
        "Partitions this worker owns.",
    ),
    (
        OPEN_TURNS,
        Family::Gauge,
        "Open turns held by this worker's partitions.",
    ),
    (
        SESSION_EVENTS_FOLDED,
        Family::Counter,
        "Projections folded into work sessions (by the owner of partition 0).",
    ),
    (
        SESSION_FOLD_POSITION,
        Family::Gauge,
        "Projection-stream sequence up to which work sessions are written.",
    ),
];

/// Register the description of every family with the installed recorder, so `/metrics` gives
/// each its `# HELP` and `# TYPE` lines.
pub fn describe_metrics() {
    for &(name, family, help) in FAMILIES {
        match family {
            Family::Counter => metrics::describe_counter!(name, help),
            Family::Gauge => metrics::describe_gauge!(name, help),
        }
    }
}

/// Initialise logging: `RUST_LOG` filters (default `default_filter`), `COLLAB_LOG_FORMAT=json`
/// for JSON lines.
pub fn init_logging(default_filter: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let json = std::env::var("COLLAB_LOG_FORMAT").is_ok_and(|v| v == "json");
    let builder = fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_is_exposed_with_help_and_type() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            describe_metrics();
            for &(name, family, _) in FAMILIES {
                match family {
                    Family::Counter => metrics::counter!(name).increment(1),
                    Family::Gauge => metrics::gauge!(name).set(1.0),
                }
            }
        });
        let text = handle.render();
        for &(name, family, help) in FAMILIES {
            let kind = match family {
                Family::Counter => "counter",
                Family::Gauge => "gauge",
            };
            assert!(
                text.contains(&format!("# HELP {name} {help}\n")),
                "{name}: {text}"
            );
            assert!(
                text.contains(&format!("# TYPE {name} {kind}\n")),
                "{name}: {text}"
            );
        }
    }

    #[test]
    fn family_names_are_unique_and_prometheus_shaped() {
        let mut seen = std::collections::HashSet::new();
        for &(name, family, _) in FAMILIES {
            assert!(seen.insert(name), "{name} listed twice");
            assert!(name.starts_with("collab_"), "{name}");
            assert!(
                name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
                "{name}"
            );
            assert_eq!(
                name.ends_with("_total"),
                family == Family::Counter,
                "{name}"
            );
        }
    }
}
