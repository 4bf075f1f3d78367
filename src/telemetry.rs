//! Logging setup and every metric name in one place. Labels are small, bounded sets (role,
//! reason, outcome), never ids or error strings.

use tracing_subscriber::{fmt, EnvFilter};

/// Raw messages handled, by `outcome` (projected, dead_lettered), `role` (`none` when
/// dead-lettered) and type `class` ([`type_class`]).
pub const INPUTS: &str = "collab_inputs_total";
/// Projected events published, by `role` and type `class`.
pub const PROJECTED: &str = "collab_projected_total";
/// Deliveries of a raw message after its first (a crash, a lapsed ack wait, a takeover).
pub const REDELIVERIES: &str = "collab_redeliveries_total";
/// Dead letters published, by `reason`.
pub const DEAD_LETTERS: &str = "collab_dead_letters_total";
/// Publishes retried in place after a failure.
pub const PUBLISH_RETRIES: &str = "collab_publish_retries_total";
/// Batches of outputs (atomic or fast-ingest), by `outcome` (stored: stored whole; fell_back:
/// refused, cut or unanswered, what it did not store then published one at a time).
pub const PUBLISH_BATCHES: &str = "collab_publish_batches_total";
/// Publishes that failed in a way waiting does not heal, by `class` (too_large, deposed: a newer
/// owner claimed the partition, fatal: the stream is gone or the user may not publish there).
pub const PUBLISH_FAILURES: &str = "collab_publish_failures_total";
/// Partition consumers found missing and recreated from the partition's checkpoint.
pub const CONSUMERS_RECREATED: &str = "collab_consumers_recreated_total";
/// Partitions started on a consumer whose acknowledgements stop short of the partition's
/// checkpoint: what it delivers again is looked up before it is published.
pub const CONSUMERS_BEHIND: &str = "collab_consumers_behind_checkpoint_total";
/// Look-ups of stored outputs (on the takeover path) that could not answer and were asked again.
pub const LOOKUP_RETRIES: &str = "collab_output_lookup_retries_total";
/// Consumer deliveries that went to another client (a gap in the delivery sequence): the
/// partition started over from its acknowledgement floor.
pub const DELIVERY_GAPS: &str = "collab_delivery_gaps_total";
/// Large fields moved to the object store, and their bytes.
pub const BLOBS_STORED: &str = "collab_blobs_stored_total";
pub const BLOB_BYTES: &str = "collab_blob_bytes_total";
/// Turn outcomes published, by `outcome` (response, blocked) and `reason`.
pub const TURN_OUTCOMES: &str = "collab_turn_outcomes_total";
/// AG-UI run terminals published by the run contract, by `outcome` (terminal: the run's own
/// RUN_FINISHED / RUN_ERROR; timeout: synthesised).
pub const RUN_TERMINALS: &str = "collab_run_terminals_total";
/// Responses suppressed, by `reason` (duplicate, late, not_target).
pub const SUPPRESSED: &str = "collab_responses_suppressed_total";
/// Partitions this worker owns.
pub const PARTITIONS_OWNED: &str = "collab_partitions_owned";
/// Lease renewals that held, and leases lost to another worker.
pub const LEASE_RENEWALS: &str = "collab_lease_renewals_total";
pub const LEASE_LOSSES: &str = "collab_lease_losses_total";
/// Times a partition paused because its lease's validity ran out before the renewal's answer
/// came, and went on once it came.
pub const LEASE_LAPSES_WAITED: &str = "collab_lease_lapses_waited_total";
/// Partitions taken, by `cause`: `free` (unowned, or its lease expired) or `owner_gone` (its
/// owner's connection closed; taken before the lease expired).
pub const TAKEOVERS: &str = "collab_partition_takeovers_total";
/// Per owned partition (`partition` label): messages not yet acknowledged, the age of the oldest
/// of them, and how far the partition's event-time watermark is behind now.
pub const PARTITION_PENDING: &str = "collab_partition_pending_messages";
pub const PARTITION_OLDEST_AGE: &str = "collab_partition_oldest_pending_age_seconds";
pub const PARTITION_WATERMARK_AGE: &str = "collab_partition_watermark_age_seconds";
/// Seconds since this worker last processed a raw message.
pub const LAST_PROCESSED_AGE: &str = "collab_last_processed_age_seconds";
/// 1 while the worker is ready (`/readyz`), else 0.
pub const READY: &str = "collab_ready";
/// Raw store time to the projection's publish acknowledgement, per projection.
pub const END_TO_END: &str = "collab_end_to_end_seconds";
/// Publish to acknowledgement, per projection or dead letter.
pub const PUBLISH_ACK: &str = "collab_publish_ack_seconds";
/// Write to acknowledgement of turn state (records and checkpoints).
pub const STATE_WRITE: &str = "collab_state_write_seconds";
/// How late a synthesised timeout was decided: decision time minus the turn's deadline.
pub const TIMEOUT_LATENESS: &str = "collab_timeout_lateness_seconds";
/// Messages per pull batch.
pub const BATCH_SIZE: &str = "collab_batch_size";
/// Open turns held in memory.
pub const OPEN_TURNS: &str = "collab_open_turns";
/// Projections folded into work sessions (by the worker that owns partition 0).
pub const SESSION_EVENTS_FOLDED: &str = "collab_session_events_folded_total";
/// The projection-stream sequence up to which work sessions are written.
pub const SESSION_FOLD_POSITION: &str = "collab_session_fold_position";
/// Projections stored but not yet folded into work sessions, as the fold last read.
pub const SESSION_FOLD_BEHIND: &str = "collab_session_fold_behind";
/// Projections gone from the stream (aged out, purged) before the work-session fold read them.
pub const SESSION_FOLD_SKIPPED: &str = "collab_session_fold_skipped_total";
/// Projections the work-session fold read but could not parse as an envelope.
pub const SESSION_FOLD_UNREADABLE: &str = "collab_session_fold_unreadable_total";
/// Per bounded stream (`stream` label: the raw, projection and dead-letter streams and the
/// streams behind the buckets), the bytes it holds and its `storage.*_max_bytes` limit.
pub const STORAGE_BYTES: &str = "collab_storage_bytes";
pub const STORAGE_LIMIT: &str = "collab_storage_limit_bytes";
/// Per bounded stream, the messages it holds, and a count limit set on it that no setting
/// names (`max_msgs`; `max_msgs_per_subject` on the raw, projection and dead-letter streams), 0
/// while none is.
pub const STORAGE_MESSAGES: &str = "collab_storage_messages";
pub const STORAGE_COUNT_LIMIT: &str = "collab_storage_count_limit";
/// Tokens reported by producers (docs/contract.md 2c), by agent, model and kind (input, output,
/// cached_input, reasoning).
pub const TOKENS: &str = "collab_tokens_total";
/// Their cost from the configured price table, in millionths of its currency unit, by agent and
/// model (models with a price only). Prometheus counters count whole numbers; divide by 1e6.
pub const COST: &str = "collab_cost_micros_total";
/// OpenTelemetry spans, by outcome: exported, export_failed (dropped: the collector refused or
/// did not answer in time), evicted (an open span given up to stay within otel.max_open).
pub const OTEL_SPANS: &str = "collab_otel_spans_total";

/// The name prefix of the families only `relay` processes expose (a worker has none of them, a
/// relay none of the others).
pub const RELAY_FAMILY_PREFIX: &str = "collab_relay_";

/// Relay: messages stored in the raw stream, by `kind` (a2a_request, a2a_response, a2a_stream,
/// agui).
pub const RELAY_PUBLISHED: &str = "collab_relay_published_total";
/// Relay: messages never published, by `reason` (`relay::DropReason`).
pub const RELAY_DROPPED: &str = "collab_relay_dropped_total";
/// Relay: publish attempts that failed, by `reason`; most are retried.
pub const RELAY_PUBLISH_FAILURES: &str = "collab_relay_publish_failures_total";
/// Relay: messages waiting in the publish queue.
pub const RELAY_QUEUE_DEPTH: &str = "collab_relay_queue_depth";
/// Relay: requests, by `outcome` (forwarded: accepted and published; rejected_status,
/// upstream_unreachable, upstream_failed, bad_request, bad_path, unauthorized, untrusted_peer,
/// rate_limited, rate_limited_bytes: nothing published).
pub const RELAY_REQUESTS: &str = "collab_relay_requests_total";
/// Relay: 1 while connected to NATS, else 0.
pub const RELAY_NATS_CONNECTED: &str = "collab_relay_nats_connected";

/// What a metric family is, for its `# TYPE` line.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Family {
    Counter,
    Gauge,
    /// With these bucket bounds.
    Histogram(&'static [f64]),
}

impl Family {
    /// The family's `# TYPE` word.
    pub fn kind(self) -> &'static str {
        match self {
            Family::Counter => "counter",
            Family::Gauge => "gauge",
            Family::Histogram(_) => "histogram",
        }
    }
}

/// Latency buckets, in seconds: 0.5 ms to 30 s.
const LATENCY: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
/// Lateness of synthesised timeouts, in seconds.
const LATENESS: &[f64] = &[0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
/// Batch sizes.
const SIZES: &[f64] = &[1.0, 5.0, 10.0, 50.0, 100.0, 250.0, 500.0, 1000.0];

/// The type classes metrics are labelled with: the first token of an event type when it is one
/// of these, else `other`, so the label set stays bounded whatever producers send.
pub const TYPE_CLASSES: &[&str] = &[
    "a2a", "task", "run", "tool", "text", "message", "step", "state", "subagent", "handoff",
    "agent", "session", "health", "custom",
];

/// The bounded label value for an event type.
pub fn type_class(event_type: &str) -> &'static str {
    TYPE_CLASSES
        .get(type_class_index(event_type))
        .copied()
        .unwrap_or("other")
}

/// The position of an event type's class in [`TYPE_CLASSES`]; `TYPE_CLASSES.len()` for `other`.
pub fn type_class_index(event_type: &str) -> usize {
    let first = event_type.split('.').next().unwrap_or_default();
    TYPE_CLASSES
        .iter()
        .position(|c| *c == first)
        .unwrap_or(TYPE_CLASSES.len())
}

/// Handles of the per-input counters labelled by role and type class, registered once so the
/// hot path does not build and look up a labelled key per input.
pub struct RoleClassCounters {
    name: &'static str,
    /// Indexed by role (as in `Role::ALL`) times class (as in [`type_class_index`]).
    handles: Vec<metrics::Counter>,
}

impl RoleClassCounters {
    /// `name`'s series for every role and class, with `extra` labels on each.
    pub fn new(name: &'static str, extra: &[(&'static str, &'static str)]) -> RoleClassCounters {
        let classes = TYPE_CLASSES.iter().copied().chain(["other"]);
        let mut handles = Vec::new();
        for role in crate::model::Role::ALL {
            for class in classes.clone() {
                let mut labels: Vec<metrics::Label> = extra
                    .iter()
                    .map(|(k, v)| metrics::Label::new(*k, *v))
                    .collect();
                labels.push(metrics::Label::new("role", role.as_str()));
                labels.push(metrics::Label::new("class", class));
                handles.push(metrics::counter!(name, labels));
            }
        }
        RoleClassCounters { name, handles }
    }

    /// Count one for `role` and the class of `event_type`.
    pub fn increment(&self, role: crate::model::Role, event_type: &str) {
        self.increment_class(role, type_class_index(event_type));
    }

    /// Count one for `role` and a class index from [`type_class_index`].
    pub fn increment_class(&self, role: crate::model::Role, class: usize) {
        let r = crate::model::Role::ALL
            .iter()
            .position(|x| *x == role)
            .unwrap_or(0);
        if let Some(c) = self.handles.get(r * (TYPE_CLASSES.len() + 1) + class) {
            c.increment(1);
        }
    }
}

impl std::fmt::Debug for RoleClassCounters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RoleClassCounters({})", self.name)
    }
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
        PUBLISH_BATCHES,
        Family::Counter,
        "Batches of outputs (atomic or fast-ingest), by outcome (stored: stored whole; fell_back: refused, cut or unanswered, what it did not store published one at a time).",
    ),
    (
        PUBLISH_FAILURES,
        Family::Counter,
        "Publishes that failed in a way waiting does not heal, by class (too_large, deposed, fatal).",
    ),
    (
        CONSUMERS_RECREATED,
        Family::Counter,
        "Partition consumers found missing and recreated from the partition's checkpoint.",
    ),
    (
        CONSUMERS_BEHIND,
        Family::Counter,
        "Partitions started on a consumer whose acknowledgements stop short of the partition's checkpoint.",
    ),
    (
        LOOKUP_RETRIES,
        Family::Counter,
        "Look-ups of stored outputs that could not answer and were asked again.",
    ),
    (
        DELIVERY_GAPS,
        Family::Counter,
        "Consumer deliveries that went to another client; the partition started over from its ack floor.",
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
        RUN_TERMINALS,
        Family::Counter,
        "AG-UI run terminals published, by outcome (terminal, timeout).",
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
        REDELIVERIES,
        Family::Counter,
        "Deliveries of a raw message after its first (crash, lapsed ack wait, takeover).",
    ),
    (
        LEASE_RENEWALS,
        Family::Counter,
        "Partition lease renewals that held.",
    ),
    (
        LEASE_LOSSES,
        Family::Counter,
        "Partition leases lost to another worker (the partition stopped at once).",
    ),
    (
        LEASE_LAPSES_WAITED,
        Family::Counter,
        "Pauses of a partition whose lease validity ran out before its renewal was answered, ended by the renewal (late renewals: a slow server or lease loop).",
    ),
    (
        TAKEOVERS,
        Family::Counter,
        "Partitions taken, by cause (free: unowned or lease expired; owner_gone: its owner's connection closed).",
    ),
    (
        PARTITION_PENDING,
        Family::Gauge,
        "Raw messages of an owned partition not yet acknowledged, by partition.",
    ),
    (
        PARTITION_OLDEST_AGE,
        Family::Gauge,
        "Age of the oldest unacknowledged raw message of an owned partition, by partition (0 when none).",
    ),
    (
        PARTITION_WATERMARK_AGE,
        Family::Gauge,
        "How far an owned partition's event-time watermark is behind now, by partition.",
    ),
    (
        LAST_PROCESSED_AGE,
        Family::Gauge,
        "Seconds since this worker last processed a raw message.",
    ),
    (
        READY,
        Family::Gauge,
        "1 while the worker is ready (connected and consuming every owned partition), else 0.",
    ),
    (
        END_TO_END,
        Family::Histogram(LATENCY),
        "Raw store time to the projection's publish acknowledgement, in seconds.",
    ),
    (
        PUBLISH_ACK,
        Family::Histogram(LATENCY),
        "Issue to acknowledgement of projections and dead letters (with batches, the wait for the batch included), in seconds.",
    ),
    (
        STATE_WRITE,
        Family::Histogram(LATENCY),
        "Write to acknowledgement of turn state (records, checkpoints), in seconds.",
    ),
    (
        TIMEOUT_LATENESS,
        Family::Histogram(LATENESS),
        "Decision time minus deadline of synthesised timeouts, in seconds.",
    ),
    (
        BATCH_SIZE,
        Family::Histogram(SIZES),
        "Raw messages per pull batch.",
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
    (
        SESSION_FOLD_BEHIND,
        Family::Gauge,
        "Projections stored but not yet folded into work sessions, as of the fold's last read (0 on a worker that does not fold).",
    ),
    (
        SESSION_FOLD_SKIPPED,
        Family::Counter,
        "Projections gone from the projection stream (aged out or purged) before the work-session fold read them: their events are missing from the work sessions.",
    ),
    (
        SESSION_FOLD_UNREADABLE,
        Family::Counter,
        "Projections the work-session fold read but could not parse as an envelope (written by a newer version?): their events are missing from the work sessions.",
    ),
    (
        STORAGE_BYTES,
        Family::Gauge,
        "Bytes a stream of the deployment holds, by stream (raw, projection, dead letters, and the streams behind the turn, session and lease buckets and the object store), sampled every 15 s.",
    ),
    (
        STORAGE_LIMIT,
        Family::Gauge,
        "A stream's size limit (its storage.*_max_bytes setting as the server holds it), by stream; no series for an unlimited stream.",
    ),
    (
        STORAGE_MESSAGES,
        Family::Gauge,
        "Messages a stream of the deployment holds, by stream, sampled every 15 s.",
    ),
    (
        STORAGE_COUNT_LIMIT,
        Family::Gauge,
        "A count limit set on a stream by hand, which no setting names, by stream and kind (max_msgs, max_msgs_per_subject): once reached, max_msgs makes the stream refuse writes before its size limit and max_msgs_per_subject drops a subject's oldest messages. 0 while none is set; `collab-projector provision` takes it away.",
    ),
    (
        TOKENS,
        Family::Counter,
        "Tokens producers reported, by agent, model and kind (input, output, cached_input, reasoning); past 256 agent and model pairs a worker counts further ones under other.",
    ),
    (
        COST,
        Family::Counter,
        "Cost of the reported tokens from the [usage] price table, in millionths of its currency unit (divide by 1e6), by agent and model (models with a price only).",
    ),
    (
        OTEL_SPANS,
        Family::Counter,
        "OpenTelemetry spans, by outcome (exported; export_failed: dropped, the collector refused or did not answer in time; evicted: an open span given up to stay within otel.max_open).",
    ),
    (
        RELAY_PUBLISHED,
        Family::Counter,
        "Relay: messages stored in the raw stream, by kind (a2a_request, a2a_response, a2a_stream, agui).",
    ),
    (
        RELAY_DROPPED,
        Family::Counter,
        "Relay: messages forwarded but not published, by reason (queue_full, too_large, encoded, no_stream, rejected, shutdown).",
    ),
    (
        RELAY_PUBLISH_FAILURES,
        Family::Counter,
        "Relay: publish attempts that failed, by reason; transient ones are retried.",
    ),
    (
        RELAY_QUEUE_DEPTH,
        Family::Gauge,
        "Relay: messages waiting in the publish queue.",
    ),
    (
        RELAY_REQUESTS,
        Family::Counter,
        "Relay: requests, by outcome (forwarded: accepted and published; rejected_status, upstream_unreachable, upstream_failed, bad_request, bad_path, unauthorized, untrusted_peer, rate_limited: nothing published).",
    ),
    (
        RELAY_NATS_CONNECTED,
        Family::Gauge,
        "Relay: 1 while connected to NATS, else 0.",
    ),
];

/// Distinct agent and model pairs one process labels token and cost series with; further pairs
/// are counted under `other`, so a producer inventing agent names cannot grow `/metrics` without
/// bound.
pub const MAX_USAGE_SERIES: usize = 256;

/// Counts reported usage as [`TOKENS`] and [`COST`], with a bounded label set.
pub struct UsageMeter {
    prices: crate::usage::Prices,
    pairs: std::sync::Mutex<std::collections::HashSet<(String, String)>>,
}

impl UsageMeter {
    pub fn new(prices: crate::usage::Prices) -> UsageMeter {
        UsageMeter {
            prices,
            pairs: std::sync::Mutex::new(std::collections::HashSet::new()),
        }
    }

    /// The labels `agent` and `model` are counted under: themselves while the process has seen
    /// fewer than [`MAX_USAGE_SERIES`] pairs (or this pair before), else `other`.
    pub fn labels(&self, agent: &str, model: &str) -> (String, String) {
        let pair = (agent.to_string(), model.to_string());
        let Ok(mut pairs) = self.pairs.lock() else {
            return ("other".into(), "other".into());
        };
        if pairs.contains(&pair) || pairs.len() < MAX_USAGE_SERIES {
            pairs.insert(pair.clone());
            pair
        } else {
            ("other".into(), "other".into())
        }
    }

    /// Count `usage`, spent by `agent` (`unknown` when no agent is named).
    pub fn record(&self, agent: Option<&str>, usage: &crate::usage::Usage) {
        let (agent, model) = self.labels(
            agent.unwrap_or("unknown"),
            usage.model.as_deref().unwrap_or("unknown"),
        );
        let kinds = [
            ("input", Some(usage.input_tokens)),
            ("output", Some(usage.output_tokens)),
            ("cached_input", usage.cached_input_tokens),
            ("reasoning", usage.reasoning_tokens),
        ];
        for (kind, n) in kinds {
            if let Some(n) = n.filter(|n| *n > 0) {
                metrics::counter!(TOKENS, "agent" => agent.clone(), "model" => model.clone(), "kind" => kind)
                    .increment(n);
            }
        }
        if let Some(cost) = self.prices.cost(usage) {
            let micros = (cost * 1_000_000.0).round();
            if micros >= 1.0 {
                metrics::counter!(COST, "agent" => agent, "model" => model)
                    .increment(micros as u64);
            }
        }
    }
}

/// Register every family with the installed recorder: its description (the `# HELP` and
/// `# TYPE` lines), and a zero for each series known in advance, so that a family exists (and a
/// rate over it is defined) before its first event.
pub fn register_metrics() {
    describe_metrics();
    for name in [
        REDELIVERIES,
        PUBLISH_RETRIES,
        CONSUMERS_RECREATED,
        CONSUMERS_BEHIND,
        LOOKUP_RETRIES,
        DELIVERY_GAPS,
        BLOBS_STORED,
        BLOB_BYTES,
        LEASE_RENEWALS,
        LEASE_LOSSES,
        LEASE_LAPSES_WAITED,
        SESSION_EVENTS_FOLDED,
        SESSION_FOLD_SKIPPED,
        SESSION_FOLD_UNREADABLE,
    ] {
        metrics::counter!(name).absolute(0);
    }
    for reason in crate::model::DlqReason::ALL {
        metrics::counter!(DEAD_LETTERS, "reason" => reason.as_str()).absolute(0);
    }
    for outcome in ["stored", "fell_back"] {
        metrics::counter!(PUBLISH_BATCHES, "outcome" => outcome).absolute(0);
    }
    for class in ["too_large", "deposed", "fatal"] {
        metrics::counter!(PUBLISH_FAILURES, "class" => class).absolute(0);
    }
    for outcome in ["exported", "export_failed", "evicted"] {
        metrics::counter!(OTEL_SPANS, "outcome" => outcome).absolute(0);
    }
    // Agents and models are known only when usage comes; the overflow series (`other`) exists
    // in every process, so the families do too.
    for kind in ["input", "output", "cached_input", "reasoning"] {
        metrics::counter!(TOKENS, "agent" => "other", "model" => "other", "kind" => kind)
            .absolute(0);
    }
    metrics::counter!(COST, "agent" => "other", "model" => "other").absolute(0);
    for cause in ["free", "owner_gone"] {
        metrics::counter!(TAKEOVERS, "cause" => cause).absolute(0);
    }
    for reason in crate::turns::SuppressReason::ALL {
        metrics::counter!(SUPPRESSED, "reason" => reason.as_str()).absolute(0);
    }
    metrics::counter!(TURN_OUTCOMES, "outcome" => "response", "reason" => "none").absolute(0);
    for outcome in ["terminal", "timeout"] {
        metrics::counter!(RUN_TERMINALS, "outcome" => outcome).absolute(0);
    }
    for reason in ["timeout", "error", "not_found"] {
        metrics::counter!(TURN_OUTCOMES, "outcome" => "blocked", "reason" => reason).absolute(0);
    }
    for name in [
        PARTITIONS_OWNED,
        OPEN_TURNS,
        READY,
        LAST_PROCESSED_AGE,
        SESSION_FOLD_POSITION,
        SESSION_FOLD_BEHIND,
    ] {
        metrics::gauge!(name).set(0.0);
    }
}

/// Register the description of every family with the installed recorder, so `/metrics` gives
/// each its `# HELP` and `# TYPE` lines once it has a series.
pub fn describe_metrics() {
    for &(name, family, help) in FAMILIES {
        match family {
            Family::Counter => metrics::describe_counter!(name, help),
            Family::Gauge => metrics::describe_gauge!(name, help),
            Family::Histogram(_) => metrics::describe_histogram!(name, help),
        }
    }
}

/// The Prometheus exporter, with every histogram family's buckets (without them the exporter
/// renders summaries).
pub fn prometheus_builder() -> metrics_exporter_prometheus::PrometheusBuilder {
    use metrics_exporter_prometheus::Matcher;
    let mut builder = metrics_exporter_prometheus::PrometheusBuilder::new();
    for &(name, family, _) in FAMILIES {
        if let Family::Histogram(buckets) = family {
            // Only an empty bucket list is refused, and none is.
            builder = match builder.set_buckets_for_metric(Matcher::Full(name.into()), buckets) {
                Ok(b) => b,
                Err(_) => metrics_exporter_prometheus::PrometheusBuilder::new(),
            };
        }
    }
    builder
}

/// What a worker says of itself on the NATS service API: the data of its `$SRV.STATS` reply
/// (`nats micro stats collab-projector`) and the answer of the `collab-projector.status`
/// endpoint. `collab-projector status` reads it from every worker.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct WorkerStatus {
    /// `workers.id`.
    pub worker_id: String,
    pub version: String,
    /// Since the process started.
    pub uptime_ms: u64,
    /// As `/readyz`: connected and consuming every owned partition.
    pub ready: bool,
    pub nats_connected: bool,
    /// Whether this process runs workers at all (`run --no-workers` serves the API only).
    pub workers: bool,
    pub partitions_owned: usize,
    pub partitions_running: usize,
    /// Every owned partition, by number.
    pub partitions: Vec<PartitionStatus>,
    /// Counters since the process started (rates are their differences over time).
    pub inputs: u64,
    pub projected: u64,
    pub dead_lettered: u64,
    pub redeliveries: u64,
    pub publish_retries: u64,
    pub lease_renewals: u64,
    pub lease_losses: u64,
    pub takeovers: u64,
    /// Open turns held by this worker's partitions.
    pub open_turns: i64,
    /// Since this worker last processed a raw message; `None` before the first.
    pub last_processed_age_ms: Option<u64>,
    /// How full each stream of the deployment was at this worker's last sample (empty before
    /// the first, and for API-only processes).
    pub storage: Vec<StreamFill>,
    /// The work-session fold, from the worker that runs it (the owner of partition 0); `None`
    /// from the others, and from versions that did not report it.
    pub session_fold: Option<FoldStatus>,
}

/// The work-session fold in a [`WorkerStatus`].
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct FoldStatus {
    /// The projection-stream sequence up to which work sessions are written.
    pub position: u64,
    /// Projections stored but not yet folded, as the fold last read.
    pub behind: u64,
}

/// One stream's size in a [`WorkerStatus`].
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct StreamFill {
    pub stream: String,
    pub bytes: u64,
    /// Its size limit; `None` when it has none.
    pub limit: Option<u64>,
    pub messages: u64,
    /// Count limits set on it that no setting names, as `(kind, limit)`: `max_msgs`, and
    /// `max_msgs_per_subject` on a stream that is no bucket (a bucket's is its history).
    pub count_limits: Vec<(String, u64)>,
}

impl StreamFill {
    /// Its count limits as people read them: `max_msgs 1000, max_msgs_per_subject 5`.
    pub fn count_limits_text(&self) -> String {
        let limits: Vec<String> = self
            .count_limits
            .iter()
            .map(|(kind, limit)| format!("{kind} {limit}"))
            .collect();
        limits.join(", ")
    }

    /// The share of its limit the stream holds, when it has one.
    pub fn ratio(&self) -> Option<f64> {
        self.limit
            .filter(|l| *l > 0)
            .map(|l| self.bytes as f64 / l as f64)
    }
}

/// One owned partition in a [`WorkerStatus`].
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct PartitionStatus {
    pub partition: u16,
    /// Raw messages not yet acknowledged (pending plus in flight), at the last sample.
    pub pending: u64,
    /// Age of the oldest of them; `None` when nothing is pending.
    pub oldest_pending_age_ms: Option<u64>,
    /// How far the event-time watermark is behind now; `None` before the first message.
    pub watermark_age_ms: Option<u64>,
    /// Since the partition's acknowledgements last moved forward (or it started).
    pub progress_age_ms: u64,
}

/// Initialise logging: `RUST_LOG` filters (default `default_filter`), `COLLAB_LOG_FORMAT=json`
/// for JSON lines. Colour only when standard error is a terminal and `NO_COLOR` is unset or
/// empty, so files and pipes get plain text.
///
/// A log line that cannot be written (its pipe was closed, the disk is full) is dropped: a
/// failed write must never reach the caller. tracing-subscriber reports a failed write with
/// `eprintln!`, which panics when standard error is the closed pipe, and that panic would end
/// whichever task was logging, the one that handles SIGTERM included.
pub fn init_logging(default_filter: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let json = std::env::var("COLLAB_LOG_FORMAT").is_ok_and(|v| v == "json");
    let builder = fmt()
        .with_env_filter(filter)
        .with_writer(|| LossyWriter(std::io::stderr()))
        .with_ansi(colour_wanted(
            std::io::IsTerminal::is_terminal(&std::io::stderr()),
            std::env::var_os("NO_COLOR").as_deref(),
        ))
        .log_internal_errors(false);
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}

/// Whether to colour output: only on a terminal, and never when `NO_COLOR` is set to anything
/// but the empty string (<https://no-color.org>).
pub fn colour_wanted(is_terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    is_terminal && no_color.is_none_or(std::ffi::OsStr::is_empty)
}

/// A writer whose writes always succeed: what the inner writer refuses is dropped.
pub struct LossyWriter<W>(pub W);

impl<W: std::io::Write> std::io::Write for LossyWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let _ = self.0.write_all(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let _ = self.0.flush();
        Ok(())
    }
}

/// Print one line to standard output, dropping it when standard output is gone (a closed pipe):
/// unlike `println!`, never panics.
pub fn say(line: &str) {
    use std::io::Write;
    // One write with its newline: where stdout and stderr share a file (a log capture, `2>&1`),
    // a log line written between the text and its newline would end up on the report's line.
    let mut bytes = Vec::with_capacity(line.len() + 1);
    bytes.extend_from_slice(line.as_bytes());
    bytes.push(b'\n');
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(&bytes);
    let _ = out.flush();
}

/// The value of `series` (a metric's name, with its labels as rendered) in Prometheus text,
/// when the text shows it.
#[cfg(test)]
pub(crate) fn rendered_value(text: &str, series: &str) -> Option<String> {
    text.lines()
        .find(|l| {
            l.strip_prefix(series)
                .is_some_and(|rest| rest.starts_with(' '))
        })
        .and_then(|l| l.rsplit(' ').next())
        .map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_is_counted_by_agent_and_model_with_a_bounded_label_set() {
        let recorder = prometheus_builder().build_recorder();
        let handle = recorder.handle();
        let prices = crate::usage::Prices::new(&[crate::usage::Price {
            model: "m".into(),
            input_per_mtok: 1.0,
            output_per_mtok: 2.0,
            cached_input_per_mtok: None,
        }])
        .unwrap_or_default();
        let meter = UsageMeter::new(prices);
        let usage = crate::usage::Usage {
            input_tokens: 1_000,
            output_tokens: 500,
            reasoning_tokens: Some(20),
            model: Some("m".into()),
            ..Default::default()
        };
        metrics::with_local_recorder(&recorder, || {
            meter.record(Some("ruda"), &usage);
            meter.record(Some("ruda"), &usage);
            for i in 0..MAX_USAGE_SERIES {
                meter.record(Some(&format!("agent-{i}")), &usage);
            }
        });
        let text = handle.render();
        let line = |series: &str| rendered_value(&text, series);
        assert_eq!(
            line(r#"collab_tokens_total{agent="ruda",model="m",kind="input"}"#).as_deref(),
            Some("2000")
        );
        assert_eq!(
            line(r#"collab_tokens_total{agent="ruda",model="m",kind="reasoning"}"#).as_deref(),
            Some("40")
        );
        // 1000 input at 1/M plus 500 output at 2/M: 0.002 per event, 2000 micros.
        assert_eq!(
            line(r#"collab_cost_micros_total{agent="ruda",model="m"}"#).as_deref(),
            Some("4000")
        );
        // ruda plus 255 more pairs fill the set; the last agent counts under other.
        assert!(text.contains(r#"agent="agent-254""#));
        assert!(!text.contains(r#"agent="agent-255""#));
        assert_eq!(
            line(r#"collab_tokens_total{agent="other",model="other",kind="input"}"#).as_deref(),
            Some("1000")
        );
    }

    #[test]
    fn every_family_is_exposed_with_help_and_type() {
        let recorder = prometheus_builder().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            describe_metrics();
            for &(name, family, _) in FAMILIES {
                match family {
                    Family::Counter => metrics::counter!(name).increment(1),
                    Family::Gauge => metrics::gauge!(name).set(1.0),
                    Family::Histogram(_) => metrics::histogram!(name).record(0.3),
                }
            }
        });
        let text = handle.render();
        for &(name, family, help) in FAMILIES {
            let kind = family.kind();
            if let Family::Histogram(buckets) = family {
                let top = buckets.last().copied().unwrap_or_default();
                assert!(
                    text.contains(&format!("{name}_bucket{{le=\"{top}\"}} 1\n")),
                    "{name} has its buckets: {text}"
                );
            }
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
    fn colour_only_on_a_terminal_without_no_color() {
        use std::ffi::OsStr;
        assert!(colour_wanted(true, None));
        assert!(colour_wanted(true, Some(OsStr::new(""))));
        assert!(!colour_wanted(true, Some(OsStr::new("1"))));
        assert!(!colour_wanted(false, None));
    }

    #[test]
    fn a_lossy_writer_reports_success_when_its_inner_writer_fails() {
        use std::io::Write;
        struct Closed;
        impl Write for Closed {
            fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
                Err(std::io::ErrorKind::BrokenPipe.into())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Err(std::io::ErrorKind::BrokenPipe.into())
            }
        }
        let mut w = LossyWriter(Closed);
        assert_eq!(w.write(b"line\n").ok(), Some(5));
        assert!(w.flush().is_ok());
    }

    #[test]
    fn type_classes_are_bounded() {
        assert_eq!(type_class("a2a.response"), "a2a");
        assert_eq!(type_class("tool.call.started"), "tool");
        assert_eq!(type_class("anything.else"), "other");
        assert_eq!(type_class(""), "other");
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
