//! Fuzz target `query`: see hostile_input::query and docs/fuzzing.md for what it asserts.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(broken) = hostile_input::query(data) {
        panic!("invariant broken: {broken}");
    }
});
