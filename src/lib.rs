//! collab-projector: consumes raw multi-agent collaboration events from NATS JetStream,
//! normalises them into one envelope, classifies each into one of four roles, enforces the
//! turn contract (exactly one `a2a.response` per main-main turn), and republishes
//! role-partitioned projections for UIs.
//!
//! # Layout
//!
//! - [`model`]: roles, the envelope, dead-letter reasons, the id-to-token rule.
//! - [`config`]: settings from `config/default.toml`, environment and flags; resource names.
//! - [`ingest`]: one raw message to envelopes, per input format (adapter, collaboration, runtime).
//! - [`classify`]: the `eventRole` rules.
//! - [`facets`]: owner / scope / phase / surface derived from the event class.
//! - [`pipeline`]: a raw message to the messages to publish (projections or a dead letter).
//! - [`bus`]: NATS: connect, provision, the partition workers.
//! - [`app`]: the `run` command: workers, HTTP, signals.
//! - [`ops`]: operator commands: `audit`, `dlq replay`.
//! - [`http`]: health, readiness and metrics endpoints.
//! - [`api`]: the projection API for UIs: events, live stream (SSE), work sessions, MPLP export.
//! - [`sessions`]: work-session aggregation (pure); `bus::sessions` folds the projection stream
//!   into KV with it, off the projection path.
//! - [`localnats`]: start a local nats-server for `demo`, `bench` and tests.
//! - [`sim`]: the traffic generator of `demo` and `bench`.
//! - [`demo`]: the `demo` command.
//! - [`bench`]: the `bench` command: throughput, latency and turn-book scale against nats-server.
//! - [`turns`]: the turn contract: the pure state machine, the deadline set, blocked outcomes.
//! - [`telemetry`]: logging and metric names.

pub mod api;
pub mod app;
pub mod bench;
pub mod bus;
pub mod classify;
pub mod config;
pub mod demo;
pub mod facets;
pub mod http;
pub mod ingest;
pub mod localnats;
pub mod model;
pub mod ops;
pub mod pipeline;
pub mod sessions;
pub mod sim;
pub mod telemetry;
pub mod turns;
