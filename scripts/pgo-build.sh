#!/usr/bin/env bash
# A profile-guided (PGO) release build of collab-projector (docs/performance.md, "Profile-guided
# builds").
#
#   scripts/pgo-build.sh [--messages N] [--out PATH]
#
# 1. builds the release binary instrumented (`-Cprofile-generate`) into target/pgo/generate;
# 2. runs it on the bench's passthrough, mixed and turn-only traffic (`collab-projector bench
#    --only baseline,mixed,turns`, N messages each, default 100000), which starts its own
#    nats-server (it must be on PATH) and writes the branch and call counts of that run. The
#    passthrough is trained too: code the run never reaches is laid out as cold, and a bench whose
#    reference ran cold would read ratios higher than the pipeline earned;
# 3. merges them with the llvm-profdata of rustc's own LLVM version;
# 4. builds the release binary again with those counts (`-Cprofile-use`) into target/pgo/use and
#    installs it at the --out path (default target/pgo/collab-projector).
#
# The profile is made from the tree being built, every time: no profile data is kept in the
# repository, so it never goes stale against the code. Two release builds from scratch and the
# training run: about 11 minutes on this project's 2-core machine.
#
# Needs llvm-profdata of the LLVM major version `rustc -vV` names: `rustup component add
# llvm-tools`, or Debian's `llvm-<major>` package (/usr/lib/llvm-<major>/bin/llvm-profdata).
# Exit status: 0 with the binary built, 2 on a usage error, otherwise the failing step's (1 when a
# prerequisite is missing).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"

messages=100000
out="$repo_root/target/pgo/collab-projector"
while [ $# -gt 0 ]; do
  case "$1" in
    --messages) messages="${2:?--messages needs a count}"; shift 2 ;;
    --out) out="${2:?--out needs a path}"; shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "unknown argument: $1 (see scripts/pgo-build.sh --help)" >&2; exit 2 ;;
  esac
done
case "$messages" in
  ''|*[!0-9]*) echo "--messages takes a whole number, not '$messages'" >&2; exit 2 ;;
esac

if ! command -v nats-server >/dev/null 2>&1; then
  echo "nats-server is not on PATH: the training run needs it (README.md, Prerequisites)" >&2
  exit 1
fi

# llvm-profdata must read the raw profiles rustc's LLVM writes: same major version.
rustc_version="$(rustc -vV)"
llvm_major="$(sed -n 's/^LLVM version: \([0-9]*\).*/\1/p' <<<"$rustc_version")"
host="$(sed -n 's/^host: //p' <<<"$rustc_version")"
if [ -z "$llvm_major" ] || [ -z "$host" ]; then
  echo "could not read rustc's LLVM version and host from 'rustc -vV'" >&2
  exit 1
fi
profdata=""
sysroot_tool="$(rustc --print sysroot)/lib/rustlib/$host/bin/llvm-profdata"
for candidate in "$sysroot_tool" "llvm-profdata-$llvm_major" "/usr/lib/llvm-$llvm_major/bin/llvm-profdata" llvm-profdata; do
  path="$(command -v "$candidate" 2>/dev/null || true)"
  [ -n "$path" ] || continue
  major="$("$path" --version 2>/dev/null | sed -n 's/.*LLVM version \([0-9]*\).*/\1/p' | head -n1)"
  if [ "$major" = "$llvm_major" ]; then
    profdata="$path"
    break
  fi
done
if [ -z "$profdata" ]; then
  echo "no llvm-profdata of LLVM $llvm_major (rustc's) found: run 'rustup component add llvm-tools'," >&2
  echo "or install Debian's llvm-$llvm_major (apt-get install llvm-$llvm_major), then run this again" >&2
  exit 1
fi
echo "using $profdata (LLVM $llvm_major)"

target_dir="$repo_root/target/pgo"
profiles="$target_dir/profiles"
rm -rf "$profiles"
mkdir -p "$profiles"

# COLLAB_BUILD_KIND names each build in its `bench` reports (`build=pgo-instrumented`, `build=pgo`).
# Both builds name --target: RUSTFLAGS then reach the project and its dependencies but not build
# scripts or procedural macros, which run while compiling and would write profiles of their own.
echo "1/4 building the instrumented binary (target/pgo/generate)"
RUSTFLAGS="${RUSTFLAGS:-} -Cprofile-generate=$profiles" COLLAB_BUILD_KIND=pgo-instrumented \
  cargo build --release --locked --target "$host" --target-dir "$target_dir/generate"

echo "2/4 training run: collab-projector bench --only baseline,mixed,turns --messages $messages"
"$target_dir/generate/$host/release/collab-projector" bench --only baseline,mixed,turns --messages "$messages" --quiet

shopt -s nullglob
raw=("$profiles"/*.profraw)
if [ ${#raw[@]} -eq 0 ]; then
  echo "the training run wrote no profile into $profiles" >&2
  exit 1
fi
echo "3/4 merging ${#raw[@]} profile(s)"
"$profdata" merge -o "$profiles/merged.profdata" "${raw[@]}"

echo "4/4 building with the profile (target/pgo/use)"
RUSTFLAGS="${RUSTFLAGS:-} -Cprofile-use=$profiles/merged.profdata" COLLAB_BUILD_KIND=pgo \
  cargo build --release --locked --target "$host" --target-dir "$target_dir/use"

mkdir -p "$(dirname "$out")"
install -m 0755 "$target_dir/use/$host/release/collab-projector" "$out"
echo "built $out"
