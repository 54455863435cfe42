#!/usr/bin/env bash
# Builds the C ABI's libFuzzer harness (tests/fuzz/fuzz_c_abi.cpp) with clang, AddressSanitizer and
# UndefinedBehaviorSanitizer, and runs it; any finding stops the run with a non-zero status and the
# input that caused it (crash-*) in the corpus directory. test.sh runs a short run; a long one:
#   scripts/fuzz.sh 3600            seconds to fuzz (default 60)
#   KDA_FUZZ_RUNS=1000000 scripts/fuzz.sh 3600   stop after that many executions (or the time)
# The build is CMakePresets.json's `fuzz` in build-fuzz/, which keeps the corpus and the findings too.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

seconds="${1:-60}"
dir=build-fuzz
bash scripts/install_deps.sh clang-14 libclang-rt-14-dev

cmake --preset fuzz >/dev/null
cmake --build --preset fuzz -j "${KDA_JOBS:-2}"

mkdir -p "$dir/corpus" "$dir/findings"
log="$dir/fuzz.log"
echo "== fuzzing the C ABI for $seconds s (log: $log)"
# Leaks are findings too; a fuzzed allocation too large to make is an error the library must report
# (allocator_may_return_null), not an abort.
set +e
ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:allocator_may_return_null=1" \
  UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" KDA_FUZZ_STATS=1 \
  "$dir/tests/fuzz/kda_fuzz_c_abi" -max_total_time="$seconds" -runs="${KDA_FUZZ_RUNS:--1}" -max_len=2048 -timeout=60 \
  -print_final_stats=1 \
  -artifact_prefix="$dir/findings/" "$dir/corpus" >"$log" 2>&1
status=$?
set -e
grep -E "^(stat::number_of_executed_units|stat::peak_rss_mb|stat::new_units_added)" "$log" || true
grep -E "#[0-9]+ +DONE +cov" "$log" | tail -1 || true
grep -E "^kda fuzz: " "$log" || true
if ((status != 0)); then
  echo "fuzz: a finding (exit $status); the last lines of $log:" >&2
  tail -n 60 "$log" >&2
  exit "$status"
fi
echo "== fuzz: no finding"
