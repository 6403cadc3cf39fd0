#!/usr/bin/env bash
# The engine's GPU checks (issue 6), one stage per call of the device tool, each well inside its
# 10-minute limit. The device image already holds torch, triton, transformers, safetensors, tokenizers,
# pytest, hypothesis and sloserve's other needs, so nothing is installed: sloserve runs from src/.
#
#   bash benchmarks/gpu_session.sh tests      # Triton kernels vs the reference (fp32/fp16/bf16), CUDA
#                                             # graphs vs eager, the engine vs HF greedy tokens on CUDA
#   bash benchmarks/gpu_session.sh speed      # engine_speed.py: decode MBU (eager and graphed), prefill MFU
#   bash benchmarks/gpu_session.sh fidelity   # fidelity.py with CUDA graphs: profile, run, simulate;
#                                             # cost_forms.py on the measured profile
#   bash benchmarks/gpu_session.sh serve      # serve_overhead.py and serve_fidelity.py (issue 27) on
#                                             # random:llama-3-8b; needs the serve extra's packages
#                                             # (fastapi, uvicorn, aiohttp, prometheus-client, jinja2),
#                                             # which the device image may lack: carry their wheels
#   bash benchmarks/gpu_session.sh all        # tests, speed and fidelity in one call, each under its own
#                                             # time limit (seconds: TESTS_S, SPEED_S, FIDELITY_S)
#
# The device image lacks pydantic and gguf (and the serve extra): carry their wheels and put them on
# PYTHONPATH before calling this script; src/ is put in front of whatever PYTHONPATH holds.
# Each stage's log goes to $OUT (the device tool's output folder) or ./gpu-logs.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
out=${OUT:-gpu-logs}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/device.txt"

case "${1:-}" in
  tests)
    python3 -m pytest -q -p no:cacheprovider tests/test_triton_attention.py tests/test_cuda_graphs.py \
      tests/test_attention.py tests/test_engine.py 2>&1 | tee "$out/tests.log"
    ;;
  speed)
    python3 benchmarks/engine_speed.py 2>&1 | tee "$out/engine_speed.log"
    ;;
  fidelity)
    # The summaries stay behind (the device tool returns at most 8 files); the fitted preset comes back.
    python3 benchmarks/fidelity.py --out /tmp/fidelity 2>&1 | tee "$out/fidelity.log"
    cp /tmp/fidelity/preset.json "$out/fidelity-preset.json"
    cp /tmp/fidelity/profile.csv "$out/fidelity-profile.csv"
    # InferMax's straight line against the line with a knee, on the batch times just measured.
    python3 benchmarks/cost_forms.py --csv /tmp/fidelity/profile.csv --layers 32 2>&1 | tee "$out/cost_forms.log"
    ;;
  serve)
    python3 -c "import fastapi, uvicorn, aiohttp, prometheus_client, jinja2" || {
      echo "the serve stage needs the serve extra: pip install --no-deps the wheels of fastapi, uvicorn, aiohttp, prometheus-client, jinja2" >&2
      exit 2
    }
    model=(--model random:llama-3-8b --device cuda --dtype bfloat16 --max-model-len 4096 --kv-capacity-tokens 131072)
    python3 benchmarks/serve_overhead.py "${model[@]}" --no-pin --num-requests 1000 --rate 8 2>&1 | tee "$out/serve_overhead.log"
    python3 benchmarks/serve_fidelity.py "${model[@]}" --no-pin --num-requests 1000 \
      --prefill-chunks 32,64,128,256,512,1024,2048,4096 --context-lens 0,512,2048 \
      --batch-sizes 1,2,4,8,16,32,64,128,256 --decode-kv-lens 128,512,2048 2>&1 | tee "$out/serve_fidelity.log"
    ;;
  all)
    # One stage failing or running out of time does not stop the next one; the exit code is the worst.
    status=0
    for stage in tests:${TESTS_S:-150} speed:${SPEED_S:-120} fidelity:${FIDELITY_S:-240}; do
      start=$SECONDS
      timeout "${stage#*:}" bash "$0" "${stage%%:*}" || { rc=$?; status=$rc; echo "stage ${stage%%:*} exited $rc"; }
      echo "stage ${stage%%:*}: $((SECONDS - start)) s" | tee -a "$out/stages.txt"
    done
    exit $status
    ;;
  *)
    echo "usage: $0 tests|speed|fidelity|serve|all" >&2
    exit 2
    ;;
esac
