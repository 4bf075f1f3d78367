//! Integration tests: one binary, a real nats-server per test.

#![allow(
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::panic,
    clippy::too_many_lines
)]

mod support;

mod adapter_bus;
mod api;
mod atomic_batch;
mod auth;
mod bench_smoke;
mod chaos;
mod conversations;
mod delegation;
mod docs;
mod fast_batch;
mod fuzz_api;
mod layout;
mod operability;
mod ops;
mod otel;
mod pipeline;
mod redaction;
mod relay;
mod reproject;
mod reshard;
mod rounds;
mod runs;
mod schemas;
mod shards;
mod shell;
mod spec_fixtures;
mod trust;
mod turns;
mod ui;
