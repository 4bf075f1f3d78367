//! Fuzz target `config`: see hostile_input::config and docs/fuzzing.md for what it asserts.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(broken) = hostile_input::config(data) {
        panic!("invariant broken: {broken}");
    }
});
