#!/usr/bin/env bash
# VNN-COMP: verify one instance.   usage: run_instance.sh v1 CATEGORY ONNX VNNLIB RESULTS TIMEOUT
# Runs `abcrown` with configs/CATEGORY.yaml (configs/default.yaml if there is none), overriding the
# instance, the results file and the timeout; the result (sat/unsat/unknown/timeout/error) is written to
# RESULTS. ONNX, VNNLIB and RESULTS are relative to the current directory. ONNX is a file (.onnx or
# .onnx.gz) or, for a VNN-COMP 2026 multi-network instance, the list "[('f', 'a.onnx'), ('g', 'b.onnx')]";
# VNNLIB is VNN-LIB 1.x or 2.0 (.gz too). A 2.0 sat is written as the 2.0 witness.
# ABCROWN_EXTRA_ARGS (optional) is appended, e.g. ABCROWN_EXTRA_ARGS="--general.device cuda".
# The alpha-beta-CROWN route: with ABCROWN_PATH set (CVE_ENGINE=native turns it off), CVE_ENGINE=abcrown,
# or configs/CATEGORY.yaml saying "engine: abcrown", alpha-beta-CROWN's own config for the category runs
# through the plugin (general.engine abcrown), sharded as the parallel section of configs/CATEGORY.yaml
# says (mode and world_size); see docs/abcrown_plugin.md.
set -euo pipefail
# the instance's clock starts here, as the harness's does (complete_verifier_ext/clock.py)
CVE_CLOCK_START="$(date +%s.%N)"
export CVE_CLOCK_START

usage() {
    echo "usage: $0 v1 CATEGORY ONNX VNNLIB RESULTS TIMEOUT" >&2
    exit 2
}

[[ $# -eq 6 ]] || usage
[[ "$1" == "v1" ]] || { echo "$0: unsupported version '$1' (expected v1)" >&2; usage; }
CATEGORY="$2"
ONNX="$3"
VNNLIB="$4"
RESULTS="$5"
TIMEOUT="$6"
TOOL_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=engine.sh
source "$TOOL_DIR/vnncomp_scripts/engine.sh"

if [[ ! "$TIMEOUT" =~ ^[0-9]+([.][0-9]*)?$ ]]; then
    echo "$0: TIMEOUT must be a number of seconds, got '$TIMEOUT'" >&2
    usage
fi
# the hard end: whatever runs then, the answer is "timeout", written 1 s before TIMEOUT (deadline.py)
CVE_DEADLINE="$(awk -v s="$CVE_CLOCK_START" -v t="$TIMEOUT" 'BEGIN { printf "%.3f", s + t - 1.0 }')"
export CVE_DEADLINE

CONFIG="$TOOL_DIR/configs/$CATEGORY.yaml"
if [[ ! "$CATEGORY" =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]*$ || ! -f "$CONFIG" ]]; then
    echo "$0: no config for category '$CATEGORY', using configs/default.yaml" >&2
    CONFIG="$TOOL_DIR/configs/default.yaml"
fi

read -r -a EXTRA <<< "${ABCROWN_EXTRA_ARGS:-}"

rm -f -- "$RESULTS"  # never leave a stale result from an earlier run
ENGINE="$(engine_of "$CONFIG")"
# through the resident worker that prepare_instance.sh started, if one answers, else cold (worker.py)
WORKER=("${PYTHON:-python3}" -m complete_verifier_ext.worker run "$ENGINE")
if [[ "$ENGINE" == abcrown ]]; then
    exec "${WORKER[@]}" vnncomp "$CATEGORY" "$ONNX" "$VNNLIB" \
        "$RESULTS" "$TIMEOUT" --ours "$CONFIG" ${EXTRA[@]+"${EXTRA[@]}"}
fi
exec "${WORKER[@]}" cli --config "$CONFIG" --general.engine native \
    --model.onnx_path "$ONNX" \
    --specification.vnnlib_path "$VNNLIB" \
    --general.results_file "$RESULTS" \
    --bab.timeout "$TIMEOUT" \
    --general.csv_name null \
    --quiet ${EXTRA[@]+"${EXTRA[@]}"}
