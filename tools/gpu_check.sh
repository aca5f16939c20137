#!/usr/bin/env bash
# The one prepared script for a GPU machine (an offline H200): the GPU tests, the MLA kernel
# (v3: 16 / 64 / 128 heads at 512 + 64 vs the float64 oracle, its key tile sized to the device)
# and model, the MLA decode table (% of the measured copy / cuBLAS roofline), the kernel
# benchmark table, the xp sampler on NumPy vs CuPy (noise bit for bit,
# token agreement on fp32 and fp16 logits), then the engine end to end (tools/gpu_e2e.py:
# decode tok/s at batch 1, 64, 256, device-busy fraction, greedy tokens vs the CPU engine),
# and speculative decoding off / ngram / suffix at batch 1 and 64 (tools/bench_spec.py: tokens
# identical to off, output tok/s, acceptance), and the int4 KV cache end to end
# (tests/test_int4_gpu.py: the cuda engine with --kv-cache-dtype int4 vs the CPU engine, device
# window operations and attention vs the CPU), int4 KV decode timed beside fp16
# (tools/bench_int4_kernels.py) and prefill TFLOP/s (tools/bench_kernels.py); the timeouts add up
# to 9 min 50 s at most (a 10-minute call; tests/test_gpu_check_script.py holds the sum).
# Without a usable CUDA GPU it says so and exits 2 at once.
#
#   bash tools/gpu_check.sh            # python3 (or $PYTHON) with cupy; kvcore from src/
#
# Python packages missing on the GPU machine travel as wheels in $KVCORE_WHEELS (default
# ./gpu_wheels, untracked, so it travels with the working tree); they are installed with
# pip --no-index --no-deps. Fill it here with `bash tools/gpu_check.sh --fetch-wheels`
# (pure-Python wheels only: structlog and gguf, which that image lacks); the same call copies
# the default model's config and tokenizer to ./gpu_model (untracked too) for the end-to-end
# run's random weights of its shape. Do not commit either folder.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
WHEELS="${KVCORE_WHEELS:-gpu_wheels}"

MODEL="${KVCORE_HOME:-$HOME/.cache/kvcore}/models/SmolLM2-135M-Instruct"
if [ "${1:-}" = "--fetch-wheels" ]; then
    "$PY" -m pip download --only-binary=:all: --no-deps --dest "$WHEELS" structlog gguf || exit $?
    # the default model's config and tokenizer (3.5 MB) for the end-to-end run's random
    # weights: the 93 MB model itself cannot travel to the GPU machine (64 MiB at most)
    mkdir -p gpu_model && cp "$MODEL"/*.json gpu_model/
    exit $?
fi

if ! timeout 20 "$PY" -c 'import cupy, sys; sys.exit(0 if cupy.cuda.runtime.getDeviceCount() > 0 else 1)' \
        >/dev/null 2>&1; then
    echo "gpu_check: no CUDA GPU available (cupy cannot see a device); nothing was run" >&2
    exit 2
fi

if compgen -G "$WHEELS/*.whl" >/dev/null; then
    "$PY" -m pip install --quiet --no-index --no-deps "$WHEELS"/*.whl || exit 3
fi
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
export KVCORE_EMU_CACHE="${KVCORE_EMU_CACHE:-/tmp/kvcore_cuda_emu}"

"$PY" -c 'import cupy; p = cupy.cuda.runtime.getDeviceProperties(0); print("gpu_check:", p["name"].decode(), "cupy", cupy.__version__)'
status=0
echo "== pytest -m gpu"
timeout 120 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gpu.py \
    tests/test_cuda_graph_gpu.py tests/test_sampling_xp_gpu.py || status=1
echo "== MLA v3 (DeepSeek): the kernel at 512 + 64 vs the float64 oracle, its key tile, a tiny model GPU vs CPU, decode vs the roofline"
timeout 60 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_mla_gpu.py || status=1
timeout 45 "$PY" tools/bench_mla.py --quick --iters 10 || status=1
echo "== tools/bench_kernels.py"
timeout 85 "$PY" tools/bench_kernels.py --iters 10 || status=1
echo "== tools/bench_int4_kernels.py (int4 KV decode beside fp16: time, bandwidth, speed-up)"
timeout 40 "$PY" tools/bench_int4_kernels.py --quick --iters 10 || status=1
echo "== tools/check_sampler_devices.py"
timeout 45 "$PY" tools/check_sampler_devices.py || status=1
echo "== int4 KV cache end to end (tests/test_int4_gpu.py)"
timeout 40 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_int4_gpu.py || status=1
echo "== tools/gpu_e2e.py (the engine on the GPU: tok/s, busy fraction, greedy vs the CPU engine)"
if [ -f "$MODEL/model.safetensors" ]; then
    SOURCE=(--model "$MODEL")
elif [ -f gpu_model/config.json ]; then
    SOURCE=(--like gpu_model)
else
    SOURCE=()
fi
if [ ${#SOURCE[@]} -gt 0 ]; then
    timeout 95 "$PY" tools/gpu_e2e.py "${SOURCE[@]}" || status=1
    echo "== tools/bench_spec.py (speculative decoding at batch 1 and 64: identical tokens, tok/s)"
    timeout 40 "$PY" tools/bench_spec.py "${SOURCE[@]}" --device cuda --num-prompts 4 \
        --max-tokens 32 --streams 1,64 || status=1
else
    echo "gpu_e2e, bench_spec: no default model and no gpu_model/ (run --fetch-wheels first): skipped"
    status=1
fi
exit $status
