#!/usr/bin/env bash
# Runs handler_fuzz for FUZZ_SECONDS (default 60) from the checked-in seed
# corpus; new inputs go to a scratch corpus in the build tree, crashes to
# fuzz-artifacts/ there (each one becomes a regression test).
set -euo pipefail
fuzzer="$1"
seeds="$2"
work="$3"
mkdir -p "$work/corpus" "$work/artifacts"
exec "$fuzzer" -max_total_time="${FUZZ_SECONDS:-60}" -timeout=20 -rss_limit_mb=4096 -max_len=65536 \
  -print_final_stats=1 -artifact_prefix="$work/artifacts/" "$work/corpus" "$seeds"
