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
