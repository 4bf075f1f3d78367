//! collab-projector: consumes raw multi-agent collaboration events from NATS JetStream,
//! normalises them into one envelope, classifies each into one of four roles, enforces the
//! turn contract (exactly one `a2a.response` per main-main turn), and republishes
//! role-partitioned projections for UIs.
//!
//! # Layout
//!
//! - [`model`]: roles, the envelope, dead-letter reasons, the id-to-token rule.
//! - [`config`]: settings from `config/default.toml`, environment and flags; resource names.
//! - [`ingest`]: one raw message to envelopes, per input format (adapter, collaboration, runtime,
//!   AG-UI).
//! - [`classify`]: the `eventRole` rules.
//! - [`identity`]: which agent a raw subject says published a message, and whether the event
//!   speaks only as that agent (pure).
//! - `facets`: owner / scope / phase / surface derived from the event class.
//! - [`facts`]: facts the normaliser and the turn rules both read (failure signals, blocked
//!   reasons, AG-UI types), kept below both.
//! - [`pipeline`]: a raw message to the messages to publish (projections or a dead letter).
//! - [`redact`]: secret redaction, applied to every input right after it is parsed.
//! - [`blobs`]: large fields moved to the object store and replaced by a reference.
//! - [`bus`]: NATS: connect, provision, the partition workers (`worker` composes `reader`,
//!   `publisher` with `publish`, `acker`, `stats`), leases, the work-session fold.
//! - [`app`]: the `run` command: workers, HTTP, signals.
//! - [`ops`]: operator commands: `audit`, `dlq replay`.
//! - [`status`]: the `status` command: every worker's service-API report as one fleet view.
//! - `http`: health, readiness and metrics endpoints.
//! - [`api`]: the projection API for UIs: events, live stream (SSE), work sessions, MPLP export.
//! - `viewer`: the built-in page at `/` over that API (plain files compiled in).
//! - `sessions`: work-session aggregation (pure); `bus::sessions` folds the projection stream
//!   into KV with it, off the projection path.
//! - Behind the `tools` feature (on by default; the command needs it): [`localnats`] starts a
//!   local nats-server for `demo`, `bench` and the integration tests; `sim` generates their
//!   traffic; [`demo`] and [`bench`](mod@bench) are those commands. Without it the library carries no
//!   process, temporary-file or progress-bar dependency.
//! - [`relay`]: the `relay` command: a reverse proxy in front of an A2A or AG-UI agent that
//!   publishes the traffic it forwards to the raw stream.
//! - [`turns`]: the turn contract: the pure state machine, the deadline set, blocked outcomes.
//! - [`telemetry`]: logging and metric names.
//! - [`usage`]: token usage read from any of the producers' shapes, and its cost from the
//!   operator's price table (pure).
//!
//! # The hot path and its state
//!
//! A partition's reader normalises each raw message once, classifies it, runs the turn rules and
//! issues its publishes and turn-record writes without waiting; its acker awaits them in order
//! and acknowledges each group of inputs with one acknowledgement (the consumers'
//! `AckPolicy::All`). The only state written on that path is the turn fence in `collab_turns`: a
//! turn's decision, stamped with the owner's term and sent through the partition's decision queue
//! in decision order, and, for a turn still undecided after `turns.open_write_delay`, its open
//! record first. Until the turn has a stored record the send that opened it holds the partition's
//! acknowledgements back, so a crash redelivers it. Publishes wait for one of the worker's
//! publish-ack permits, which only the ackers release: a reader hands what it issued to its acker
//! every few publishes (never holding its share of permits while it waits for one), and nothing an
//! acker awaits (turn records, checkpoints, retries) takes a permit from that pool. Whether a decision's response is stored is one published checkpoint
//! per partition per second (`ck.p<N>`), not a write per turn. Work sessions are a fold over the
//! projection stream on a thread and a connection of their own; leases are renewed from another.
//! docs/reliability.md says why each guarantee still holds; docs/architecture.md draws the path.

// Product functions stay under 150 lines (`clippy::too_many_lines`, denied in Cargo.toml and
// checked on the library as shipped); the unit-test build allows it, for long scenario tests.
#![cfg_attr(test, allow(clippy::too_many_lines))]

pub mod api;
pub mod app;
#[cfg(feature = "tools")]
pub mod bench;
pub mod blobs;
pub mod bus;
pub mod classify;
pub mod config;
#[cfg(feature = "tools")]
pub mod demo;
mod facets;
pub mod facts;
#[cfg(test)]
mod golden;
mod http;
pub mod identity;
pub mod ingest;
#[cfg(feature = "tools")]
pub mod localnats;
pub mod model;
pub mod ops;
pub mod otel;
pub mod pipeline;
pub mod redact;
pub mod relay;
pub mod reproject;
pub mod reshard;
pub mod served;
pub mod sessions;
/// Generated traffic for `demo`, `bench` and the benchmarks.
#[cfg(feature = "tools")]
pub mod sim;
pub mod spans;
pub mod status;
pub mod telemetry;
pub mod threads;
pub mod tree;
pub mod turns;
pub mod usage;
mod viewer;
pub mod waiting;
