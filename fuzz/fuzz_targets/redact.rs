//! Fuzz target `redact`: see hostile_input::redact and docs/fuzzing.md for what it asserts.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(broken) = hostile_input::redact(data) {
        panic!("invariant broken: {broken}");
    }
});
