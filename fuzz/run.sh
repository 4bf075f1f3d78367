#!/usr/bin/env bash
# Bounded coverage-guided fuzzing of every target (docs/fuzzing.md).
#
#   fuzz/run.sh [--seconds N] [--install] [--if-possible] [--dev] [--codegen-units N] [--jobs N]
#               [TARGET...]
#
# Seeds the corpus from the fixtures (fuzz/seed_corpus.py), builds the targets with
# `cargo fuzz build --sanitizer none` (which works on stable Rust), runs each TARGET (default:
# all) for N seconds (default 60) and prints a summary line per target: executions, seconds,
# coverage (edges), features, corpus size and the outcome.
#
#   --install        install cargo-fuzz (`cargo install cargo-fuzz --locked`) when it is missing
#   --if-possible    when the toolchain cannot fuzz (no cargo-fuzz and it cannot be installed,
#                    no C++ compiler for libFuzzer, or a rustc without the coverage
#                    instrumentation), say why and exit 0 instead of failing
#   --dev            build without optimisation: a cold build takes a fraction of the time, each
#                    execution is several times slower (what a short CI run wants)
#   --codegen-units  passed to `cargo fuzz build` (faster builds, somewhat slower executions)
#   --jobs N         targets fuzzed at the same time (default: the number of cores)
#
# Exit status: 0 when every target ran clean (or fuzzing was skipped with --if-possible), 1 when
# a target found a crash or an invariant violation (its input is in fuzz/artifacts/<target>/),
# 2 on a usage or build error.
set -uo pipefail

FUZZ_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TARGETS_ALL=(adapter normalize redact envelope config query)
CARGO_FUZZ_VERSION="0.13.2"

seconds=60
install=0
if_possible=0
codegen_units=""
dev=0
at_once="$(nproc 2>/dev/null || echo 1)"
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds="$2"; shift 2 ;;
    --install) install=1; shift ;;
    --if-possible) if_possible=1; shift ;;
    --codegen-units) codegen_units="$2"; shift 2 ;;
    --dev) dev=1; shift ;;
    --jobs) at_once="$2"; shift 2 ;;
    -h|--help) sed -n '2,23p' "${BASH_SOURCE[0]}"; exit 0 ;;
    -*) echo "fuzz/run.sh: unknown option $1" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || targets=("${TARGETS_ALL[@]}")

# Fuzzing cannot run here: explain, then skip (--if-possible) or fail.
cannot() {
  echo "fuzzing skipped: $1" >&2
  echo "the property tests in tests/hostile_input.rs (run by cargo test) check the same invariants on every target" >&2
  if [ "$if_possible" = 1 ]; then exit 0; fi
  exit 2
}

if ! command -v cargo >/dev/null 2>&1; then
  cannot "cargo is not on PATH"
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  if [ "$install" = 1 ]; then
    echo "installing cargo-fuzz ${CARGO_FUZZ_VERSION}"
    if ! cargo install --quiet --locked cargo-fuzz --version "$CARGO_FUZZ_VERSION"; then
      cannot "cargo-fuzz ${CARGO_FUZZ_VERSION} could not be installed with this toolchain ($(rustc --version 2>/dev/null))"
    fi
  else
    cannot "cargo-fuzz is not installed (cargo install cargo-fuzz --locked)"
  fi
fi
if ! command -v c++ >/dev/null 2>&1 && ! command -v g++ >/dev/null 2>&1 && ! command -v clang++ >/dev/null 2>&1; then
  cannot "no C++ compiler (c++, g++ or clang++) to build libFuzzer"
fi
# The coverage instrumentation cargo-fuzz asks rustc for (stable since it needs no -Z flag when
# the sanitizer is none).
probe_dir="$(mktemp -d)"
if ! echo 'fn main() {}' | rustc --edition 2021 -Cpasses=sancov-module \
  -Cllvm-args=-sanitizer-coverage-level=4 -Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
  -Cllvm-args=-sanitizer-coverage-pc-table -Cllvm-args=-sanitizer-coverage-trace-compares \
  --emit=obj -o "$probe_dir/probe.o" - >/dev/null 2>&1; then
  rm -rf "$probe_dir"
  cannot "$(rustc --version 2>/dev/null) does not accept the sanitizer-coverage instrumentation"
fi
rm -rf "$probe_dir"

cd "$FUZZ_DIR" || exit 2
if command -v python3 >/dev/null 2>&1; then
  python3 seed_corpus.py corpus || { echo "seeding the corpus failed" >&2; exit 2; }
else
  echo "python3 not found: fuzzing from an empty corpus (fuzz/seed_corpus.py seeds it from the fixtures)" >&2
fi

build_args=(--sanitizer none)
[ -n "$codegen_units" ] && build_args+=(--codegen-units "$codegen_units")
[ "$dev" = 1 ] && build_args+=(--dev)
echo "building the fuzz targets: cargo fuzz build ${build_args[*]} ($(rustc --version))"
build_start=$SECONDS
if ! cargo fuzz build "${build_args[@]}"; then
  echo "cargo fuzz build failed: the fuzz crate (fuzz/) does not compile against the current source" >&2
  exit 2
fi
echo "built in $((SECONDS - build_start)) s"

dict_for() {
  case "$1" in
    config) echo dicts/toml.dict ;;
    query) echo dicts/query.dict ;;
    *) echo dicts/json.dict ;;
  esac
}

# One target's run: its log in logs/<t>.log, its summary line in logs/<t>.summary, and a marker
# logs/<t>.found when it found something.
fuzz_one() {
  local t="$1" log="logs/$1.log" start status elapsed execs last cov ft corp outcome
  rm -f "logs/$t.summary" "logs/$t.found"
  mkdir -p "corpus/$t"
  start=$SECONDS
  cargo fuzz run "${build_args[@]}" "$t" "corpus/$t" -- \
    -max_total_time="$seconds" -dict="$(dict_for "$t")" -max_len=8192 -timeout=10 \
    -rss_limit_mb=2048 -print_final_stats=1 >"$log" 2>&1
  status=$?
  elapsed=$((SECONDS - start))
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
  last=$(grep -E '^#[0-9]+' "$log" | tail -1)
  cov=$(echo "$last" | grep -o 'cov: [0-9]*' | grep -o '[0-9]*')
  ft=$(echo "$last" | grep -o 'ft: [0-9]*' | grep -o '[0-9]*')
  corp=$(echo "$last" | grep -o 'corp: [0-9]*' | grep -o '[0-9]*')
  if [ "$status" = 0 ]; then
    outcome="clean"
  else
    touch "logs/$t.found"
    outcome="FOUND (exit $status): $(grep -m1 -E 'invariant broken|panicked|ERROR: libFuzzer' "$log" | cut -c1-200)"
  fi
  printf '%-10s execs %-10s seconds %-4s cov %-6s ft %-6s corpus %-6s %s\n' \
    "$t" "${execs:-?}" "$elapsed" "${cov:-?}" "${ft:-?}" "${corp:-?}" "$outcome" >"logs/$t.summary"
}

# The targets run side by side, as many at a time as --jobs (each libFuzzer process is
# single-threaded): on two cores six 10 s runs take about half the time they take one by one.
mkdir -p logs
echo "fuzzing ${targets[*]} for ${seconds} s each, ${at_once} at a time"
for t in "${targets[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$at_once" ]; do
    wait -n
  done
  fuzz_one "$t" &
done
wait

found=0
summary=()
for t in "${targets[@]}"; do
  summary+=("$(cat "logs/$t.summary" 2>/dev/null || echo "$t: no result (see fuzz/logs/$t.log)")")
  if [ -e "logs/$t.found" ] || [ ! -e "logs/$t.summary" ]; then
    found=1
    echo "---- $t: last lines of fuzz/logs/$t.log" >&2
    tail -n 40 "logs/$t.log" >&2
    ls "artifacts/$t" 2>/dev/null | sed "s|^|  reproducer: fuzz/artifacts/$t/|" >&2
  fi
done

echo "fuzz summary (${seconds} s per target):"
printf '  %s\n' "${summary[@]}"
if [ "$found" = 1 ]; then
  echo "a fuzz target found a crash or an invariant violation: reproduce it with" >&2
  echo "  cd fuzz && cargo fuzz run --sanitizer none <target> artifacts/<target>/<file>" >&2
  exit 1
fi
