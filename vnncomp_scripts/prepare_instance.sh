#!/usr/bin/env bash
# VNN-COMP: prepare one instance.   usage: prepare_instance.sh v1 CATEGORY ONNX VNNLIB
# ONNX: a file (.onnx or .onnx.gz) or a VNN-COMP 2026 network list; VNNLIB: VNN-LIB 1.x or 2.0 (.gz too).
# Accepts any category, as run_instance.sh does (configs/CATEGORY.yaml when it exists, else
# configs/default.yaml), and checks that the two files exist. Exit 0 when the instance can be run.
# It starts (or finds running) the resident worker of the instance's engine, which has imported the
# verifier once so that run_instance.sh does not pay for it (complete_verifier_ext/worker.py; it ends
# on its own when idle; CVE_WORKER=off turns it off). Other programs are never killed.
set -euo pipefail

usage() {
    echo "usage: $0 v1 CATEGORY ONNX VNNLIB" >&2
    exit 2
}

[[ $# -eq 4 ]] || usage
[[ "$1" == "v1" ]] || { echo "$0: unsupported version '$1' (expected v1)" >&2; usage; }
CATEGORY="$2"
ONNX="$3"
VNNLIB="$4"
TOOL_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=engine.sh
source "$TOOL_DIR/vnncomp_scripts/engine.sh"

CONFIG="$TOOL_DIR/configs/$CATEGORY.yaml"
if [[ ! "$CATEGORY" =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]*$ || ! -f "$CONFIG" ]]; then
    CONFIG="$TOOL_DIR/configs/default.yaml"  # the same choice as run_instance.sh
fi

# ONNX is one file or (VNN-COMP 2026) a list naming each network: "[('f', 'a.onnx'), ('g', 'b.onnx')]"
FILES=("$ONNX")
if [[ "$ONNX" == \[* ]]; then
    if ! LISTED="$("${PYTHON:-python3}" -c 'import ast, sys
try:
    print("\n".join(p for _, p in ast.literal_eval(sys.argv[1])))
except Exception:
    sys.exit(1)' "$ONNX")"; then
        echo "$0: not a network list [('name', 'file.onnx'), ...]: $ONNX" >&2
        exit 1
    fi
    mapfile -t FILES <<< "$LISTED"
fi
for f in "${FILES[@]}" "$VNNLIB"; do
    if [[ ! -f "$f" ]]; then
        echo "$0: file not found: $f" >&2
        exit 1
    fi
done

ENGINE="$(engine_of "$CONFIG")"
if ! "${PYTHON:-python3}" -m complete_verifier_ext.worker start "$ENGINE"; then
    echo "$0: no resident worker (run_instance.sh starts cold)" >&2
fi
echo "Prepared category '$CATEGORY' (config $CONFIG, engine $ENGINE)"
exit 0
