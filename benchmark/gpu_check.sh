#!/usr/bin/env bash
# One prepared GPU session (a lent H200, 15 minutes of device time in all, start included): every
# step has its own timeout and the whole script stops itself at 580 s (GPU_CHECK_BUDGET_S), so it
# fits one 600 s call. Everything lands in $OUT/gpu_check.txt (plus the benchmark CSV and JSON).
#
# On the device tool's machine (python3 with CUDA torch + Triton there, nothing fetchable):
#   carry [".whl"]; command: bash benchmark/gpu_check.sh
# where .whl holds fla's pure-Python wheels (flash_linear_attention, fla_core; see
# requirements/test.txt). Made here with
#   echo /.whl/ >> .git/info/exclude
#   .venv/bin/pip download --no-deps -d .whl flash-linear-attention==0.6.0 fla-core==0.6.0
# Elsewhere: PY=.venv/bin/python bash benchmark/gpu_check.sh (a venv with CUDA torch + triton;
# with SGLang 0.5.23 and this package installed, `pip install -e .`, step 8 serves the model).
#
# Steps, ordered by what a cut-off run should still have told (budget s; what 2026-12-04's H200
# run took, benchmark/results/gpu_check/): 1 device facts (40; 27: importing fla imports
# transformers); 2 decode captured in a CUDA graph, replayed against eager (20; 5); 3 pre-warm:
# compile our kernels at the Kimi shapes (40; 19); 4 the GPU-marked tests and the capture test:
# larger shapes, bf16, fla (whose autotune alone took over 70 s), one extend through the adapter
# with grid checkpoints + SGLang's extra_buffer track snapshot under CUDA's sync debug mode (150);
# 5 the other kernel tests compiled on sm_90 (190; the first 24 took 150, cold compiles about
# 6 s a test); 6 grid: 2,100 one-token sequences at H = 32 (rows past 65,535) against unbatched
# calls (30; did not finish in 20); 7 timing ours / fla / SGLang at T = 8k, 32k with checkpoints
# every 64, 256, 1024, bf16 error vs fla (120; fla's autotune comes first); 8 serving (240) only
# where SGLang is installed: the tiny model in bf16 with default flags (overlap scheduler,
# extra_buffer; auto = our Triton kernel under the kda policy), with --kda-kernel triton
# --page-size 64, then SGLang's own kernel if time is left: answers vs the float64 reference,
# cached tokens on a repeat, an off-grid divergence, twins and a 1,500-token divergence, cache
# integrity (benchmark/gpu_serve_check.py; skipped, saying so, where SGLang is not installed: the
# lent machine has no SGLang and it is too large to carry).
# Cannot check on the lent machine: anything of the serving path (no SGLang there, no network to
# install it, 64 MiB per command) -- SGLang's resolution on CUDA, upstream's packed decode beside
# our extend, the launch plan's memory reserve. Those need a machine with SGLang installed.
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

step "device" 40 bash -c "nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv; \
  $PY -c 'import torch, triton; print(\"torch\", torch.__version__, \"triton\", triton.__version__)'; \
  $PY -c 'import fla; print(\"fla\", fla.__version__)' || echo 'fla: not importable'"

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

# Serving needs the installed package (its plugin is an entry point), so not the SITE path.
if PYTHONPATH="$PLAIN_PYTHONPATH" $PY -c "
import sglang, importlib.metadata as m
assert sglang.__version__ == '0.5.23', sglang.__version__
assert any(e.name == 'sglang_kda' for e in m.entry_points(group='sglang.srt.plugins'))
" >>"$LOG" 2>&1; then
  step "serving" 240 env PYTHONPATH="$PLAIN_PYTHONPATH" $PY benchmark/gpu_serve_check.py \
    --out "$OUT" --deadline-s 200 --ready-timeout 150
else
  echo "=== serving: skipped: SGLang 0.5.23 with sglang_kda installed is not importable here" \
    "(pip install sglang==0.5.23 and pip install -e . first; the lent machine has no SGLang)" \
    | tee -a "$LOG"
fi

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

step "timing" ${TIMING_S:-120} $PY benchmark/kernel_kda.py --T ${TIMING_T:-8192,32768} --reps 3 --out "$OUT/kernel_kda.csv"


echo "gpu_check: done in $(( $(date +%s) - DEADLINE + ${GPU_CHECK_BUDGET_S:-580} ))s; log $LOG" | tee -a "$LOG"
