//! What parsing a raw input costs with the worker's parser (serde_json into an order-preserving
//! `Value`) against the alternatives: a SIMD parser into an order-preserving DOM (sonic-rs), a
//! SIMD parser into an owned and a borrowed DOM (simd-json), and a lazy parse that only splits
//! the top-level object into borrowed raw fields (serde_json `RawValue`), the floor of any
//! "parse only what is read" design.
//!
//! `cargo bench --bench parse` (add `-- --quick` for a fast pass). The inputs are the bench's
//! own traffic (`sim`: the realistic mix and turn-only traffic), 2,000 messages each, parsed one
//! after another; docs/performance.md has the figures and what was decided from them.

// A micro-benchmark whose sample data does not behave as expected must stop, not measure.
#![allow(clippy::panic, clippy::expect_used, clippy::unwrap_used)]

use collab_projector::sim::{Generator, Mix};
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use serde::Deserialize;
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::collections::HashMap;
use std::hint::black_box;
use std::time::Duration;

const MESSAGES: usize = 2_000;

fn corpus(mix: Mix) -> Vec<Vec<u8>> {
    let mut gen = Generator::new("collab", 7, mix);
    let mut out = Vec::new();
    while out.len() < MESSAGES {
        out.extend(gen.next_scenario().into_iter().map(|e| e.body));
    }
    out.truncate(MESSAGES);
    out
}

/// A top-level key, borrowed unless it holds an escape.
#[derive(Deserialize, PartialEq, Eq, Hash)]
struct Key<'a>(#[serde(borrow)] Cow<'a, str>);

/// The top-level object split into its keys and their unparsed values.
type Split<'a> = HashMap<Key<'a>, &'a RawValue>;

fn parsers(c: &mut Criterion) {
    for (name, mix) in [("mixed", Mix::REALISTIC), ("turns", Mix::TURNS_ONLY)] {
        let inputs = corpus(mix);
        // Every input the parsers are compared on must be one they all accept (the mix holds a
        // little malformed input on purpose, which each rejects in its own time).
        let inputs: Vec<Vec<u8>> = inputs
            .into_iter()
            .filter(|b| serde_json::from_slice::<serde_json::Value>(b).is_ok())
            .collect();
        for b in &inputs {
            assert!(sonic_rs::from_slice::<sonic_rs::Value>(b).is_ok());
            assert_eq!(
                sonic_rs::from_slice::<serde_json::Value>(b).ok(),
                serde_json::from_slice::<serde_json::Value>(b).ok()
            );
            assert!(simd_json::to_owned_value(&mut b.clone()).is_ok());
        }
        let bytes: usize = inputs.iter().map(Vec::len).sum();
        let mut g = c.benchmark_group(format!(
            "parse {name} ({} messages, {} bytes on average)",
            inputs.len(),
            bytes / inputs.len().max(1)
        ));
        g.throughput(Throughput::Elements(inputs.len() as u64));
        g.bench_function("serde_json Value, order kept (the worker's)", |b| {
            b.iter(|| {
                for i in &inputs {
                    black_box(serde_json::from_slice::<serde_json::Value>(black_box(i)).ok());
                }
            })
        });
        g.bench_function("sonic-rs Value, order kept", |b| {
            b.iter(|| {
                for i in &inputs {
                    black_box(sonic_rs::from_slice::<sonic_rs::Value>(black_box(i)).ok());
                }
            })
        });
        g.bench_function("sonic-rs into the worker's serde_json Value", |b| {
            b.iter(|| {
                for i in &inputs {
                    black_box(sonic_rs::from_slice::<serde_json::Value>(black_box(i)).ok());
                }
            })
        });
        // simd-json parses in place: each round starts from a fresh copy, which is also what the
        // worker would have to make of a message's payload.
        g.bench_function("simd-json owned value", |b| {
            b.iter_batched_ref(
                || inputs.clone(),
                |copies| {
                    for i in copies.iter_mut() {
                        black_box(simd_json::to_owned_value(black_box(i)).ok());
                    }
                },
                BatchSize::LargeInput,
            )
        });
        g.bench_function("simd-json borrowed value", |b| {
            b.iter_batched_ref(
                || inputs.clone(),
                |copies| {
                    for i in copies.iter_mut() {
                        black_box(simd_json::to_borrowed_value(black_box(i)).is_ok());
                    }
                },
                BatchSize::LargeInput,
            )
        });
        g.bench_function("serde_json top-level split, fields unparsed", |b| {
            b.iter(|| {
                for i in &inputs {
                    black_box(serde_json::from_slice::<Split<'_>>(black_box(i)).ok());
                }
            })
        });
        g.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3));
    targets = parsers
}
criterion_main!(benches);
