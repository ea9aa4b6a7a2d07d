#!/usr/bin/env bash
# complete-verifier-ext 0.1.0 into the database's fresh virtual environment: the CPU build of torch
# first (PyPI's default build pulls several GB of CUDA), then the package, whose console script
# complete-verifier-ext lands in the environment's bin/ ($SOLVER_BIN_DIR). CVE_SOURCE overrides where
# the package comes from (a checkout's path, or another pip requirement), e.g. to try this script.
set -euo pipefail
VERSION="0.1.0"
SOURCE="${CVE_SOURCE:-git+https://github.com/complete-verifier-ext/complete_verifier_ext@v${VERSION}}"
python -m pip install --upgrade pip
python -m pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
python -m pip install "${SOURCE}"
BIN="${SOLVER_BIN_DIR:-$(dirname "$(command -v python)")}"
"${BIN}/complete-verifier-ext" --version | grep -qx "${VERSION}"
