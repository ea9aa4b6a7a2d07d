#!/usr/bin/env bash
# VNN-COMP: install the tool.   usage: install_tool.sh v1
# Installs torch 2.13.0, then this package (editable), which provides the `abcrown` command.
# Set PYTHON to choose the interpreter (default: python3).
set -euo pipefail

usage() {
    echo "usage: $0 v1" >&2
    echo "  installs torch==2.13.0 and complete_verifier_ext (the 'abcrown' command)" >&2
    exit 2
}

[[ $# -eq 1 ]] || usage
[[ "$1" == "v1" ]] || { echo "$0: unsupported version '$1' (expected v1)" >&2; usage; }

TOOL_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"

echo "Installing torch==2.13.0 with $PYTHON"
"$PYTHON" -m pip install "torch==2.13.0"
echo "Installing complete_verifier_ext from $TOOL_DIR"
"$PYTHON" -m pip install -e "$TOOL_DIR"
"$PYTHON" -c "import complete_verifier_ext, torch; print('complete_verifier_ext installed; torch', torch.__version__)"
