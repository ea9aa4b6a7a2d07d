#!/usr/bin/env bash
# VNN-COMP: prepare one instance.   usage: prepare_instance.sh v1 CATEGORY ONNX VNNLIB
# Checks that the category is known (configs/CATEGORY.yaml exists, or it is one of the categories run
# with configs/default.yaml) and that the two files exist. Exit 0 when the instance can be run.
# It starts and stops nothing: other programs are never killed.
set -euo pipefail

# Categories without their own config, run by run_instance.sh with configs/default.yaml.
DEFAULT_CATEGORIES=(test)

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

if [[ ! "$CATEGORY" =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]*$ ]]; then
    echo "$0: invalid category name '$CATEGORY'" >&2
    exit 1
fi

CONFIG="$TOOL_DIR/configs/$CATEGORY.yaml"
if [[ ! -f "$CONFIG" ]]; then
    known=0
    for c in "${DEFAULT_CATEGORIES[@]}"; do
        [[ "$c" == "$CATEGORY" ]] && known=1
    done
    if [[ $known -eq 0 ]]; then
        echo "$0: unknown category '$CATEGORY' (no $CONFIG)" >&2
        exit 1
    fi
    CONFIG="$TOOL_DIR/configs/default.yaml"
fi

for f in "$ONNX" "$VNNLIB"; do
    if [[ ! -f "$f" ]]; then
        echo "$0: file not found: $f" >&2
        exit 1
    fi
done

echo "Prepared category '$CATEGORY' (config $CONFIG)"
exit 0
