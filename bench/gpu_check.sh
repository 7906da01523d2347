#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py): on a machine with one NVIDIA GPU, every CUDA test, the
# sync-debug suite, a bit-exact D2H/H2D round trip (MHA/MLA, bf16/fp8), `kv-lifecycle simulate
# --device cuda --verify all`, the D2H throughput against a pinned copy_, and SGLang's decode
# offload over a 64-layer MHA stack (offload with 200 ms queued, a chunk's launches, retract and
# resume under the staging cap, a repeated page refused, our own copy stream, a held copy at
# shutdown and exit) and, where vLLM 0.32.0 imports, a whole vLLM engine with the connector, one line
# per item, within 8 minutes. Without a GPU it says so and exits 3.
#
#   bash bench/gpu_check.sh            # uses .venv/bin/python, else $PYTHON, else python3
#   bash bench/gpu_check.sh --quick    # fewer simulate requests and throughput repeats
#   bash bench/gpu_check.sh --list     # the items (no GPU needed)
#
# First time on a machine (network needed; a CUDA build of torch, not the README's CPU pin):
#   python3 -m venv .venv && .venv/bin/pip install -q torch -e '.[test]'
set -uo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-}"
if [ -z "$py" ]; then
    if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
if ! "$py" -c 'import torch, msgspec, transitions' 2>/dev/null; then
    echo "gpu_check | environment      | FAIL | $py cannot import torch and the project's dependencies;"
    echo "          install first: python3 -m venv .venv && .venv/bin/pip install -q torch -e '.[test]'"
    exit 1
fi
exec timeout 480 "$py" bench/gpu_check.py "$@"
