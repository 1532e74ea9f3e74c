#!/usr/bin/env bash
# Run benchmarks/gpu/check.py (kernel tests, kernel timings, resources, then the offline
# throughput benchmark) on a CUDA machine whose Python already has torch, triton and transformers,
# without installing minipaged's dependencies over them: the checkout goes on PYTHONPATH as it is
# (minipaged/kernels/__init__.py finds the root's kernels/ there). `gguf`, which minipaged's
# loader imports, is installed into a scratch folder from a wheel when the machine lacks it:
#     pip download --no-deps gguf==0.19.0 -d .cache/wheels      # where there is a network
#
# Usage, from the repository's root:
#     benchmarks/gpu/run_on_device.sh [check.py's arguments]    # e.g. --skip-tests
#     THROUGHPUT_ONLY=1 benchmarks/gpu/run_on_device.sh         # gpu/throughput.py alone
# Results, logs and the profiled decode steps' trace go to $OUT (default: benchmarks/results/).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import gguf" 2>/dev/null; then
    wheel=$(ls .cache/wheels/gguf-*.whl 2>/dev/null | head -n 1 || true)
    if [ -z "$wheel" ]; then
        echo "gguf is missing: put its wheel in .cache/wheels/ (see the top of this script)" >&2
        exit 2
    fi
    deps=$(mktemp -d)
    "$PY" -m pip install --quiet --no-index --no-deps --target "$deps" "$wheel"
    export PYTHONPATH="$PYTHONPATH:$deps"
fi
unset TRITON_INTERPRET
"$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton',
triton.__version__, '| transformers', transformers.__version__, '|',
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA')"

status=0
if [ -n "${THROUGHPUT_ONLY:-}" ]; then
    "$PY" benchmarks/gpu/throughput.py --trace "$OUT/decode_trace.json" \
        --out "$OUT/gpu_throughput.json" "$@" 2>&1 | tee "$OUT/throughput.log" || status=$?
else
    "$PY" benchmarks/gpu/check.py --workers "$(nproc)" --trace "$OUT/decode_trace.json" "$@" \
        2>&1 | tee "$OUT/gpu_check.log" || status=$?
    if [ "$OUT" != benchmarks/results ]; then
        cp benchmarks/results/gpu_*.json "$OUT"/ 2>/dev/null || true
    fi
fi
gzip -f "$OUT/decode_trace.json" 2>/dev/null || true
exit "$status"
