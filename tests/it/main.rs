//! Integration tests: one binary, a real nats-server per test.

mod support;

mod adapter_bus;
mod api;
mod bench_smoke;
mod chaos;
mod ops;
mod pipeline;
mod turns;
