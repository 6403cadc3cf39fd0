#!/usr/bin/env bash
# The engine's GPU checks (issues 6 and 43), a stage per call of the device tool or all in one, each
# well inside its 10-minute limit. The device image holds torch, triton, transformers, safetensors,
# tokenizers, pytest and hypothesis; sloserve runs from src/, and what else it needs travels as wheels
# (below).
#
#   bash benchmarks/gpu_session.sh table      # issue 43's table in one call (item 6): speed, serve and
#                                             # serve-fidelity, each under its own time limit (seconds:
#                                             # SPEED_S, SERVE_S, SERVE_FIDELITY_S; 530 in all), then the
#                                             # table (benchmarks/figures.py)
#   bash benchmarks/gpu_session.sh tests      # Triton kernels vs the reference (fp32/fp16/bf16): attention
#                                             # (split decodes too) and the fused elementwise kernels; CUDA
#                                             # graphs (decode, piecewise) vs eager, the engine vs HF greedy
#                                             # tokens on CUDA
#   bash benchmarks/gpu_session.sh speed      # engine_speed.py (issue 43's engine rows): decode MBU eager and
#                                             # graphed (before / +split decodes / +fused kernels), 8 x 32K
#                                             # contexts, prefill MFU (kernel / dense), small prompts and a
#                                             # mixed step eager / piecewise (the mixed one against its parts'
#                                             # rooflines; again with the chunk's attention on a second
#                                             # stream), each beside its ceiling at the copy and
#                                             # matmul rates measured there (kernels in sequence), a
#                                             # decode step's kernels (torch.profiler); then
#                                             # async_scheduling.py: offline batches of 64 and 256, on / off
#   bash benchmarks/gpu_session.sh kernels    # kernels alone: decode_attention.py (split count and tile),
#                                             # prefill_attention.py (tile, warps and stages),
#                                             # input_copies.py (a decode step's input copies on the host),
#                                             # fused_ops.py (the fused elementwise kernels, by warps),
#                                             # decode_attention.py on DeepSeek-V2-Lite's latent (MLA),
#                                             # moe_layer.py (a MoE layer: by expert / fused / graphed),
#                                             # gguf_dequant.py (GGUF formats: gguf-py / torch on the GPU)
#   bash benchmarks/gpu_session.sh fidelity   # fidelity.py with CUDA graphs: profile, run, simulate;
#                                             # cost_forms.py on the measured profile and the runs' steps
#   bash benchmarks/gpu_session.sh infermax   # infermax_engine.py: Figure 9's schedulers at M = 1K and
#                                             # 10K on the engine and in the simulator (InferMax Fig. 14);
#                                             # after fidelity, whose fit the simulator then uses
#   bash benchmarks/gpu_session.sh serve      # serve_overhead.py on random:llama-3-8b, 300 requests: served /
#                                             # in-process throughput and TPOT, on the client's and the
#                                             # engine's clocks, and the GPU's waits for the host
#                                             # between steps on each side (device idle share), each
#                                             # served process's CPU share over the offline load;
#                                             # py-spy samples the server's
#                                             # processes under the offline load when py-spy is on PATH
#                                             # ($OUT/serve-py-spy.txt, collapsed stacks; their
#                                             # summary by thread in the log: py_spy_summary.py)
#   bash benchmarks/gpu_session.sh serve-fidelity  # serve_fidelity.py (issue 27): the simulator against the
#                                             # server, on the same model options
#   bash benchmarks/gpu_session.sh compile    # torch.compile of the piecewise graphs' pieces (issue 43 item
#                                             # 2): its tests on CUDA, then small prompts and the mixed step
#                                             # eager / piecewise / compiled pieces, and the compile's time
#   bash benchmarks/gpu_session.sh stages tests:250 kernels:110   # these stages, each under its limit
#                                             # (seconds), then the table of what they measured
#   bash benchmarks/gpu_session.sh all        # tests, speed, serve, serve-fidelity and kernels, each under
#                                             # its own limit (TESTS_S, SPEED_S, SERVE_S, SERVE_FIDELITY_S,
#                                             # KERNELS_S), then fidelity, infermax and compile when
#                                             # FIDELITY_S, INFERMAX_S, COMPILE_S are set: longer than one call
#
# A stage that fails or runs out of time does not stop the next one; the exit code is the last failing one's.
#
# The device image (2026-11-26) lacks pydantic (pydantic, pydantic-core, annotated-types,
# typing-inspection, a typing-extensions >= 4.16), gguf, llguidance (the tests' structured outputs), and
# of the serve extra fastapi (with starlette and opentelemetry-api), uvicorn, httptools and
# python-multipart, and py-spy: carry their wheels (`make gpu-wheels` downloads them into .whl/),
# install them with --target, and put that folder on PYTHONPATH (its bin/ on PATH) before calling
# this script; src/ is put in front of whatever PYTHONPATH holds. The first stage of a machine that runs the
# Triton kernels compiles them (about 40 s more; `table`'s speed stage, before the tests).
# The calls prepared on 2026-12-04 (benchmarks/RESULTS.md, "The next GPU session"), each after
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH || exit
# are `bash benchmarks/gpu_session.sh table`, then `bash benchmarks/gpu_session.sh stages tests:250 kernels:110`,
# both on an H200 where one is lent (the limits below were sized there; on an H100 the serve stages run longer).
# Every stage's output goes to $OUT/session.log ($OUT: the device tool's output folder; else ./gpu-logs),
# beside issue 43's figures (figures.jsonl, printed as a table at the end of `table`, `stages` and `all`),
# the serve stage's py-spy stacks and the fidelity stage's profile, preset, engine figures and the engine
# runs' steps (a tar of four steps.csv): seven files, within the tool's eight.
#
# SMOKE=1 runs the same stages on the CPU with a tiny random model and a few requests each: a check of
# this script and of the commands it runs (arguments, imports, files) before device time is spent on
# them; its figures mean nothing. From the repository root, after `make .venv/.engine`:
#   PATH=.venv/bin:$PATH SMOKE=1 TESTS_S=400 SPEED_S=120 SERVE_S=200 SERVE_FIDELITY_S=300 KERNELS_S=200 \
#     FIDELITY_S=300 INFERMAX_S=120 COMPILE_S=200 OUT=/tmp/gpu-smoke bash benchmarks/gpu_session.sh all
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# Issue 43's kernels and graphs: flash decoding's splits and the fused elementwise kernels are the
# engine's defaults since the second GPU session (2026-11-29); long fresh prompts' dense attention,
# piecewise CUDA graphs for steps with a prefill, the served engine's publishing during the next
# forward pass and a mixture of experts on the fused kernels (and CUDA graphs) since the third
# (2026-12-04). Every stage here runs with them all on, as set below, whatever the defaults (the dense
# prefills asking SDPA for cuDNN's attention first on Hopper: "auto"); a stage's own setting overrides.
export SLOSERVE_DECODE_SPLITS=${SLOSERVE_DECODE_SPLITS:-auto} SLOSERVE_FUSED_KERNELS=${SLOSERVE_FUSED_KERNELS:-1}
export SLOSERVE_DENSE_PREFILL=${SLOSERVE_DENSE_PREFILL:-1} SLOSERVE_PIECEWISE_GRAPHS=${SLOSERVE_PIECEWISE_GRAPHS:-1}
export SLOSERVE_DENSE_PREFILL_SDPA=${SLOSERVE_DENSE_PREFILL_SDPA:-auto}
export SLOSERVE_OVERLAP_PUBLISH=${SLOSERVE_OVERLAP_PUBLISH:-1} SLOSERVE_FUSED_MOE=${SLOSERVE_FUSED_MOE:-1}
out=${OUT:-gpu-logs}
mkdir -p "$out"
log="$out/session.log"
# Each benchmark records issue 43's figures here (benchmarks/figures.py); `all` prints the table last.
export SLOSERVE_FIGURES=${SLOSERVE_FIGURES:-$out/figures.jsonl}
echo "== ${1:-} $(date -u +%FT%TZ)" | tee -a "$log"
# (the GPU named in issue 43's table: an H100's figures are against its own peaks, the sessions' before were H200s')
device_name=cpu
if [[ ${SMOKE:-0} != 1 ]]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$log"
  device_name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$log"
# Each stage's model and sizes: issue 43's (Llama-3-8B's shape in bf16 on the GPU), or SMOKE's.
engine=(--model random:llama-3-8b --device cuda --dtype bfloat16)
model=("${engine[@]}" --max-model-len 4096 --kv-capacity-tokens 131072)
grid=(--prefill-chunks 32,64,128,256,512,1024,2048,4096 --context-lens 0,512,2048
  --batch-sizes 1,2,4,8,16,32,64,128,256 --decode-kv-lens 128,512,2048)
speed=() fidelity=() layers=32 requests=300
# The compile stage: engine_speed.py's small prompts and mixed step only
compile=(--batch-sizes '' --prefill '' --long-batch 0 --profile-kernels '' --no-ceilings --compile-pieces)
async_ab=(--batches 64,256 --prompt-len 128 --output-len 128 --repeats 2)
decode_attention=()
# The mixed step's chunk (512 after 1,024 cached), a fresh 1K prompt, a long prompt's last chunk
prefill_attention=(--cases 1024+512,0+1024,3072+1024)
# DeepSeek-V2-Lite's 16 query heads on its one 576-number latent key (keys only)
mla_attention=(--mla 16 --cases 1x1024,1x8192,8x32768,64x1024,256x1024 --splits 1,2,4,8,16,32)
moe_layer=()
gguf_dequant=()
input_copies=()
fused_ops=()
# The profile of serve-fidelity's grid: 3 timings a batch (its default, 5, is for the CPU's noise)
serve_fidelity=(--repeats 3)
# B = 256: the simulator's ratios at M = 1K are those of B = 1024 within 0.03 (2026-11-26).
infermax=(--num-requests 256 --capacities 1000,10000)
if [[ ${SMOKE:-0} == 1 ]]; then
  engine=(--model random:tiny-llama --device cpu --dtype float32)
  model=("${engine[@]}" --max-model-len 1024 --kv-capacity-tokens 65536)
  grid=(--prefill-chunks 16,64,256 --context-lens 0,256 --batch-sizes 1,4,16 --decode-kv-lens 64,256 --repeats 2)
  # (--gpu and --rates: the ratios, the ceilings and their records run too, meaning nothing on the CPU)
  speed=(--batch-sizes 1,8 --kv-len 64 --long-context 512 --long-batch 2 --mixed 64:128:8 --prefill 256
    --small-prompts 64 --repeats 2 --gpu h200 --rates 4.24,685)
  decode_attention=(--smoke)
  prefill_attention=(--smoke)
  mla_attention=(--smoke --mla 4)
  moe_layer=(--smoke)
  input_copies=(--smoke)
  fused_ops=(--smoke)
  serve_fidelity=()
  gguf_dequant=(--rows 256 --columns 1024 --repeats 1)
  compile+=(--kv-len 64 --mixed 64:128:8 --small-prompts 64 --repeats 2)
  fidelity=(--max-model-len 1024 --kv-capacity-tokens 65536 --num-requests 20 "${grid[@]}")
  layers=2 requests=20
  async_ab=(--batches 4,8 --prompt-len 16 --output-len 8 --repeats 1)
  infermax=(--num-requests 24 --inputs 4,16 --capacities 200)
fi

# Each STAGE:SECONDS given, the stage under its time limit; then issue 43's table from what they recorded.
# The exit code is the last failing stage's (0 when every stage passed).
run_stages() {
  local status=0 stage start rc
  for stage in "$@"; do
    start=$SECONDS
    timeout "${stage#*:}" bash "$0" "${stage%%:*}" || { rc=$?; status=$rc; echo "stage ${stage%%:*} exited $rc"; }
    echo "stage ${stage%%:*}: $((SECONDS - start)) s" | tee -a "$log"
  done
  python3 benchmarks/figures.py "$SLOSERVE_FIGURES" "$device_name" 2>&1 | tee -a "$log"
  return $status
}

case "${1:-}" in
  tests)
    # (piecewise graphs off but in their own test: every engine the tests make would capture them; the
    # compiled pieces' tests compile for a minute: the compile stage runs them)
    # (-vv: each test's name as it ends, so that a run cut at the stage's limit still says what passed; the
    # architectures' CPU tests, test_architectures.py, are CI's: their Triton backend's run here,
    # test_triton_backend_gives_hf_greedy_tokens)
    SLOSERVE_PIECEWISE_GRAPHS=0 python3 -m pytest -p no:cacheprovider -vv -rfEs --tb=short tests/engine/test_triton_attention.py tests/engine/test_fused_ops.py \
      tests/engine/test_cuda_graphs.py tests/engine/test_piecewise_graphs.py tests/engine/test_attention.py \
      tests/engine/test_engine.py tests/engine/test_async_scheduling.py tests/engine/test_device_idle.py \
      tests/engine/test_fused_moe.py::test_fused_experts_are_the_reference \
      tests/engine/test_fused_moe.py::test_models_on_fused_experts_give_hf_greedy_tokens \
      tests/engine/test_mla.py::test_long_prompts_by_head_beside_short_ones_over_the_latent_give_hf_greedy_tokens \
      tests/engine/test_mamba.py::test_on_cuda_a_hybrid_models_captured_decode_steps_give_hf_greedy_tokens \
      tests/engine/test_sampler.py::test_on_cuda_the_score_controls_and_sampling_never_wait_for_the_device \
      tests/engine/test_gguf_dequant.py \
      -k "not compiled" 2>&1 | tee -a "$log"
    ;;
  speed)
    # (engine_speed.py captures the piecewise graphs it compares itself)
    SLOSERVE_PIECEWISE_GRAPHS=0 python3 benchmarks/engine_speed.py "${engine[@]}" "${speed[@]}" 2>&1 | tee -a "$log"
    # Async scheduling on / off (issue 43 item 1), after the table: the stage's limit cuts this, not the table
    SLOSERVE_PIECEWISE_GRAPHS=0 python3 benchmarks/async_scheduling.py "${engine[@]}" "${async_ab[@]}" 2>&1 \
      | tee -a "$log"
    ;;
  kernels)
    # Flash decoding's split count and tile, the decode attention alone (added 2026-11-29, about 50 s)
    python3 benchmarks/decode_attention.py "${decode_attention[@]}" 2>&1 | tee -a "$log"
    # The prefill kernel's tile, warps and stages, its attention alone (added 2026-12-06, about 60 s): the mixed
    # step's chunk took 1.4 ms at about 245 TFLOP/s on 2026-12-04
    python3 benchmarks/prefill_attention.py "${prefill_attention[@]}" 2>&1 | tee -a "$log"
    # A decode step's input copies on the host (added 2026-12-04, about 15 s): where the served engine's 11-13%
    # of py-spy samples in copy_to_device went, and whether InputStaging's copies cost less on the host
    python3 benchmarks/input_copies.py "${input_copies[@]}" 2>&1 | tee -a "$log"
    # The fused elementwise kernels alone (added 2026-12-04 late, about 40 s): add-and-RMSNorm's warps (3.1 us
    # a call at batch 1 on 2026-12-04, where SiLU-and-multiply took 1.4) and each kernel against its bytes
    python3 benchmarks/fused_ops.py "${fused_ops[@]}" 2>&1 | tee -a "$log"
    # MLA's decode attention alone (added 2026-11-30, about 30 s)
    python3 benchmarks/decode_attention.py "${mla_attention[@]}" 2>&1 | tee -a "$log"
    # A MoE layer alone, by expert against the fused kernels (added 2026-11-30, about 20 s)
    python3 benchmarks/moe_layer.py "${moe_layer[@]}" 2>&1 | tee -a "$log"
    # A GGUF model's matrices dequantized by gguf-py on the host or by torch on the GPU (added 2026-12-02, about
    # 10 s): what a GGUF model's start would save
    python3 benchmarks/gguf_dequant.py "${gguf_dequant[@]}" 2>&1 | tee -a "$log"
    ;;
  fidelity)
    # The summaries stay behind; the profile, the preset fitted to it and the engine's figures come
    # back, so that cost_forms.py can compare the cost model's forms against the engine on any machine.
    python3 benchmarks/fidelity.py "${engine[@]}" "${fidelity[@]}" --out /tmp/fidelity 2>&1 | tee -a "$log"
    cp /tmp/fidelity/preset.json "$out/fidelity-preset.json"
    cp /tmp/fidelity/profile.csv "$out/fidelity-profile.csv"
    cp /tmp/fidelity/engine.json "$out/fidelity-engine.json"
    # Each engine run's steps (shape and measured seconds): one file, to leave room under the eight.
    tar -czf "$out/fidelity-steps.tar.gz" -C /tmp/fidelity engine-vllm-offline/steps.csv engine-vllm-poisson/steps.csv \
      engine-sarathi-offline/steps.csv engine-sarathi-poisson/steps.csv
    python3 benchmarks/cost_forms.py --csv /tmp/fidelity/profile.csv --layers "$layers" --engine /tmp/fidelity/engine.json \
      --steps /tmp/fidelity/engine-*/steps.csv 2>&1 | tee -a "$log"
    ;;
  infermax)
    # The simulator prices the runs with the fidelity stage's fit of this engine where it ran first.
    cost=()
    [[ -f /tmp/fidelity/preset.json ]] && cost=(--cost-model /tmp/fidelity/preset.json)
    python3 benchmarks/infermax_engine.py "${engine[@]}" "${infermax[@]}" "${cost[@]}" 2>&1 | tee -a "$log"
    ;;
  serve)
    python3 -c "import aiohttp, sloserve.server.app, sloserve.bench.client" || {
      echo "the serve stage needs the serve extra's packages (see the top of this script)" >&2
      exit 2
    }
    spy=()
    command -v py-spy >/dev/null && spy=(--py-spy "$out/serve-py-spy.txt" --py-spy-seconds 20)
    python3 benchmarks/serve_overhead.py "${model[@]}" --no-pin --num-requests "$requests" --rate 8 "${spy[@]}" 2>&1 | tee -a "$log"
    # Where the engine core's and the server's threads were (in the log: it comes back without the samples)
    if [[ -s "$out/serve-py-spy.txt" ]]; then
      python3 benchmarks/py_spy_summary.py "$out/serve-py-spy.txt" 2>&1 | tee -a "$log"
    fi
    ;;
  serve-fidelity)
    python3 benchmarks/serve_fidelity.py "${model[@]}" --no-pin --num-requests "$requests" "${grid[@]}" \
      "${serve_fidelity[@]}" 2>&1 \
      | tee -a "$log"
    ;;
  compile)
    SLOSERVE_PIECEWISE_GRAPHS=0 python3 -m pytest -p no:cacheprovider -rs tests/engine/test_piecewise_graphs.py \
      -k compiled 2>&1 | tee -a "$log"
    SLOSERVE_PIECEWISE_GRAPHS=0 python3 benchmarks/engine_speed.py "${engine[@]}" "${compile[@]}" 2>&1 | tee -a "$log"
    ;;
  table)
    # Issue 43's table in one call of under nine minutes (item 6); the 2026-12-04 session's speed and serve
    # stages took 146 s (with the kernels then in it) and 110 s
    run_stages speed:"${SPEED_S:-180}" serve:"${SERVE_S:-130}" serve-fidelity:"${SERVE_FIDELITY_S:-220}"
    ;;
  stages)
    shift
    run_stages "$@"
    ;;
  all)
    run_stages tests:"${TESTS_S:-250}" speed:"${SPEED_S:-180}" serve:"${SERVE_S:-130}" \
      serve-fidelity:"${SERVE_FIDELITY_S:-220}" kernels:"${KERNELS_S:-110}" ${FIDELITY_S:+fidelity:$FIDELITY_S} \
      ${INFERMAX_S:+infermax:$INFERMAX_S} ${COMPILE_S:+compile:$COMPILE_S}
    ;;
  *)
    echo "usage: $0 table|tests|speed|kernels|serve|serve-fidelity|fidelity|infermax|compile|all" >&2
    echo "       $0 stages STAGE:SECONDS..." >&2
    exit 2
    ;;
esac
