#!/usr/bin/env bash
# One prepared GPU session (a lent H200, 15 minutes of device time in all, start included): every
# step has its own timeout and the whole script stops itself at 580 s (GPU_CHECK_BUDGET_S), so it
# fits one 600 s call. Everything lands in $OUT/gpu_check.txt (plus each step's JSON and CSV,
# written as soon as measured, so a cut-off run still reports what it got).
#
# On the device tool's machine (its image's python3 with CUDA torch 2.11 + Triton, no SGLang,
# nothing fetchable), from the GPU kit (`make gpu-kit`, docs/gpu.md):
#   carry ["build/gpu-kit/sglang-kda-gpu-kit.tar.xz", ".whl"]; command: bash benchmark/gpu_check.sh
# where .whl holds fla's pure-Python wheels (flash_linear_attention, fla_core; see
# requirements/test.txt), made here with
#   echo /.whl/ >> .git/info/exclude
#   .venv/bin/pip download --no-deps -d .whl flash-linear-attention==0.6.0 fla-core==0.6.0
# The kit is extracted to /tmp/gpu-kit and its site-packages put first on PYTHONPATH for the
# serving steps. Elsewhere: PY=.venv/bin/python bash benchmark/gpu_check.sh (a venv with CUDA
# torch + Triton, and SGLang 0.5.23 with this package installed when there is no kit).
#
# Steps, in issue 37's order (budget s):
#   1 device facts (30);
#   2 serving the tiny model in bf16 with the GPU's default flags plus --attention-backend triton
#     (benchmark/gpu_serve_check.py, 150): answers against the float64 reference, cached tokens on
#     a repeat, an off-grid divergence, twins, a 1,500-token divergence and a prompt longer than
#     one chunk, the overlap scheduler and extra_buffer reported, cache integrity;
#   3 Kimi-Linear-48B-A3B at full shape with random weights, kda defaults then --kda-policy stock
#     (benchmark/gpu_full_shape.py, 270): a 32k prompt cold, one sharing 30k of it, eight decodes
#     beside a fresh 32k prefill: TTFT, ITL p50/p99, worst gap, cached tokens, peak GPU memory
#     against the launcher's plan;
#   4 kernel timings, ours / fla / SGLang's at T = 8k and 32k with checkpoints every 64, 256 and
#     1024 (benchmark/kernel_kda.py, 100);
#   then, with whatever time is left, the kernel checks of 2026-12-04's runs
#   (benchmark/results/gpu_check/): decode captured in a CUDA graph, the GPU-marked tests, the
#   2,100-sequence grid.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmark/results/gpu_check}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.txt"
: >"$LOG"
DEADLINE=$(( $(date +%s) + ${GPU_CHECK_BUDGET_S:-580} ))
export PYTHONUNBUFFERED=1

if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    PY=.venv/bin/python
  else
    PY=python3
  fi
fi
# the source tree as the sglang_kda package with its kernels (no install needed): the kernels
# come from the symlink, every other submodule from the checkout's sglang_kda/
SITE=/tmp/sglang_kda_site
mkdir -p "$SITE/sglang_kda"
ln -sfn "$PWD/kernels" "$SITE/sglang_kda/kernels"
echo "__path__.append('$PWD/sglang_kda')" >"$SITE/sglang_kda/__init__.py"
PLAIN_PYTHONPATH=${PYTHONPATH:-}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/fla_site .whl/*.whl >>"$LOG" 2>&1 && export PYTHONPATH="/tmp/fla_site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$SITE:$PWD:${PYTHONPATH:-}"
# `python -` and `python -m` put the working directory first on sys.path, where the checkout's
# sglang_kda/ (no kernels/ inside it) would shadow the SITE package above
export PYTHONSAFEPATH=1

step() {  # step NAME SECONDS CMD...: bounded by its budget and by the script's deadline
  local name=$1 budget=$2
  shift 2
  local left=$(( DEADLINE - $(date +%s) ))
  [ "$left" -lt "$budget" ] && budget=$left
  if [ "$budget" -le 5 ]; then
    echo "=== $name: skipped (out of time)" | tee -a "$LOG"
    return
  fi
  echo "=== $name (budget ${budget}s)" | tee -a "$LOG"
  local t0=$(date +%s)
  timeout "$budget" "$@" 2>&1 | tee -a "$LOG"
  echo "=== $name: rc=${PIPESTATUS[0]} in $(( $(date +%s) - t0 ))s" | tee -a "$LOG"
}

# The GPU kit, when carried: SGLang 0.5.23 trimmed, sgl_kernel 0.4.5 and this package, for the
# serving steps (SGLang's own wheel asks for sgl_kernel >= 0.4.9, which does not link against the
# image's torch 2.11)
KIT=${GPU_KIT:-build/gpu-kit/sglang-kda-gpu-kit.tar.xz}
SERVE_PYTHONPATH=$PLAIN_PYTHONPATH
if [ -f "$KIT" ]; then
  rm -rf /tmp/gpu-kit && mkdir -p /tmp/gpu-kit && tar -xJf "$KIT" -C /tmp/gpu-kit \
    && SERVE_PYTHONPATH="/tmp/gpu-kit/site:$PWD${PLAIN_PYTHONPATH:+:$PLAIN_PYTHONPATH}" \
    && export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 \
    && echo "gpu kit: $KIT extracted to /tmp/gpu-kit ($(cat /tmp/gpu-kit/gpu-kit.json | head -c 300))" | tee -a "$LOG"
fi
# Serving needs SGLang and this package's plugin entry point (the kit's, or an install's)
serving_ok() {
  PYTHONPATH="$SERVE_PYTHONPATH" $PY -c "
import sglang, importlib.metadata as m
assert sglang.__version__ == '0.5.23', sglang.__version__
assert any(e.name == 'sglang_kda' for e in m.entry_points(group='sglang.srt.plugins'))
" >>"$LOG" 2>&1
}
NO_SERVING="skipped: SGLang 0.5.23 with sglang_kda is not importable here (carry the GPU kit, or pip install sglang==0.5.23 and pip install -e .)"

step "device" 30 bash -c "nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv; \
  $PY -c 'import torch, triton; print(\"torch\", torch.__version__, \"triton\", triton.__version__)'; \
  $PY -c 'import fla; print(\"fla\", fla.__version__)' || echo 'fla: not importable'"

if serving_ok; then
  step "serving tiny" 150 env PYTHONPATH="$SERVE_PYTHONPATH" $PY benchmark/gpu_serve_check.py \
    --out "$OUT" --deadline-s 120 --ready-timeout 100 --attention-backend triton
  step "full shape" 270 env PYTHONPATH="$SERVE_PYTHONPATH" $PY benchmark/gpu_full_shape.py \
    --out "$OUT" --deadline-s 230 --ready-timeout 150
else
  echo "=== serving: $NO_SERVING" | tee -a "$LOG"
fi

step "timing" ${TIMING_S:-100} $PY benchmark/kernel_kda.py --T ${TIMING_T:-8192,32768} --reps 3 --out "$OUT/kernel_kda.csv"

# With the time left: the kernel checks of the 2026-12-04 runs
step "decode graph" 20 $PY - <<'EOF'
import torch
import sglang_kda.kernels.kda.ops as kt
H, D, N, dev = 32, 128, 64, "cuda"
torch.manual_seed(0)
q, k, v = (torch.randn(N, H, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
g, b = torch.randn(N, H, D, device=dev), torch.randn(N, H, device=dev)
A_log, dt_bias = torch.zeros(H, device=dev), torch.zeros(H * D, device=dev)
idx = torch.arange(N, device=dev, dtype=torch.int32)
idx[-1] = -1  # a padded entry
pool0 = torch.randn(N + 1, H, D, D, device=dev)
pool_e, pool_g = pool0.clone(), pool0.clone()
o_e = kt.kda_decode_pool(q, k, v, g, b, A_log=A_log, dt_bias=dt_bias, ssm_states=pool_e, cache_indices=idx)
kt.kda_decode_pool(q, k, v, g, b, A_log=A_log, dt_bias=dt_bias, ssm_states=pool0.clone(), cache_indices=idx)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    o_g = kt.kda_decode_pool(q, k, v, g, b, A_log=A_log, dt_bias=dt_bias, ssm_states=pool_g,
                             cache_indices=idx)
pool_g.copy_(pool0)
graph.replay()
torch.cuda.synchronize()
print("decode graph replay == eager:", torch.equal(o_g, o_e), torch.equal(pool_g, pool_e))
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(100):
    graph.replay()
end.record()
torch.cuda.synchronize()
print(f"decode step (N={N}, H={H}) in a graph: {start.elapsed_time(end) / 100 * 1e3:.1f} us")
EOF

step "prewarm" 40 $PY - <<'EOF'
import time, torch
import sglang_kda.kernels.kda.ops as kt
t0 = time.time()
H, D, T = 32, 128, 4096
dev = "cuda"
q, k, v = (torch.randn(1, T, H, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
g = -torch.rand(1, T, H, D, device=dev) * 0.5
beta = torch.rand(1, T, H, device=dev)
for C in (None, 64, 256, 1024):
    kt.chunk_kda(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True,
                 checkpoint_every=C)
    torch.cuda.synchronize()
    print(f"  chunk_kda checkpoint_every={C}: {time.time() - t0:.1f}s", flush=True)
A_log = torch.zeros(H, device=dev); dt_bias = torch.zeros(H * D, device=dev)
pool = torch.zeros(4, H, D, D, device=dev)
kt.kda_extend_pool(q, k, v, g.bfloat16(), beta.bfloat16(), A_log=A_log, dt_bias=dt_bias,
                   ssm_states=pool, cache_indices=torch.tensor([1], device=dev),
                   cu_seqlens=torch.tensor([0, T], device=dev), checkpoint_every=256,
                   prefix_lens=[0])
kt.kda_decode_pool(q[0, :4], k[0, :4], v[0, :4], g[0, :4], beta[0, :4], A_log=A_log,
                   dt_bias=dt_bias, ssm_states=pool, cache_indices=torch.tensor([0, 1, 2, 3], device=dev))
torch.cuda.synchronize()
print(f"ours compiled in {time.time() - t0:.1f}s")
EOF

# Cold compiles: every shape the tests use specialises other kernel variants than the
# pre-warm's, so their first calls compile too (about 6 s a test on 2026-12-04).
step "gpu tests" 150 $PY -m pytest -q -rfEs --durations=8 tests/kernels/test_capture_gpu.py \
  tests/kernels/test_kda_triton.py -m gpu -p no:cacheprovider -o addopts="" --import-mode=importlib
step "kernel tests compiled" 190 $PY -m pytest -q -rfEs --durations=8 \
  tests/kernels/test_kda_triton.py -m "not gpu" -p no:cacheprovider -o addopts="" \
  --import-mode=importlib

step "grid" 30 $PY - <<'EOF'
# 2,100 one-token sequences at H = 32: 67,200 (sequence, head) rows, past CUDA's 65,535 limit
# on grid axis 1 before the rows were tiled (grid_rows); checked against the unbatched calls.
import torch
import sglang_kda.kernels.kda.ops as kt
N, H, D, dev = 2100, 32, 128, "cuda"
torch.manual_seed(0)
q, k, v = (torch.randn(1, N, H, D, device=dev) for _ in range(3))
g, beta = -torch.rand(1, N, H, D, device=dev) * 0.5, torch.rand(1, N, H, device=dev)
cu = torch.arange(N + 1, device=dev)
o, ht = kt.chunk_kda(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True,
                     cu_seqlens=cu)
for i in (0, 1234, N - 1):
    oi, hi = kt.chunk_kda(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], g[:, i:i + 1],
                          beta[:, i:i + 1], output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o[:, i:i + 1], oi, atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(ht[i:i + 1], hi, atol=1e-4, rtol=1e-3)
print(f"grid: {N} sequences x {H} heads launched (rows {N * H}), 3 spot checks equal")
EOF


echo "gpu_check: done in $(( $(date +%s) - DEADLINE + ${GPU_CHECK_BUDGET_S:-580} ))s; log $LOG" | tee -a "$LOG"
