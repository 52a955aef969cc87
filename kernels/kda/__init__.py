"""Triton chunkwise Kimi Delta Attention (KDA) forward that emits fp32 state checkpoints.

Recurrence, per sequence and head, with an fp32 state ``S`` of shape [K, V]::

    S <- diag(exp(g_t)) S ;  S <- S + beta_t k_t (v_t - S^T k_t)^T ;  o_t = S^T (scale q_t)

(q, k L2-normalised first when asked). The forward runs as five kernels over chunks of
``BT = 64`` tokens; a sequence's chunks sit on the *absolute* 64-token grid, so when
``prefix_len % 64 != 0`` its first chunk is shorter (its leading rows are masked no-ops).
One module per stage, as fla lays out its chunked delta-rule kernels:

- :mod:`.common`: shared device code, written once and inlined: masked row tiles, row norms, and
  the kernel prologues (chunk table -> sequence span, first token row, row masks, base offsets;
  tiled grid rows; strided state tiles).
- :mod:`.gate`: the fused Kimi gate, beta's sigmoid, the in-chunk cumulative decay ``G``
  (log2 units, fp32).
- :mod:`.intra`: ``chunk_kda_fwd_intra_kernel``, per (chunk, head): gate and cumulative decay
  (via :mod:`.gate`), then the A matrices ``Akk`` (fp32) and ``Aqk``.
- :mod:`.solve`: ``chunk_kda_fwd_solve_kernel``, ``(I + A)^-1`` per (chunk, head).
- :mod:`.wy`: ``chunk_kda_fwd_wu_kernel``, the WY factors ``w``, ``u`` and ``kg``, ``qg``.
- :mod:`.state`: ``chunk_kda_fwd_h_kernel``, the serial inter-chunk state recurrence, with
  checkpoint emission straight from the fp32 registers.
- :mod:`.output`: ``chunk_kda_fwd_o_kernel``, ``o = qg S + tril(Aqk) v_new``.
- :mod:`.decode`: ``kda_decode_pool_kernel``, one token per sequence over the state pool.
- :mod:`.ops`: the host side: public entry points (``chunk_kda``, ``kda_extend_pool``,
  ``kda_decode_pool``), checks, chunk / checkpoint tables, ``KERNEL_CONFIG``, launches.

Numerics: per-token decays can reach -13, so the in-chunk cumulative sum reaches ~-830 and
nothing ``exp(G)``-shaped may be split into ``exp(G_i) * exp(-G_j)``. Every exponent here is a
difference ``G_a - G_b`` with ``a`` at or after ``b`` (<= 0: factors can only underflow, and then
the true product is smaller still). Off-diagonal 16x16 blocks factor through the decay at the
last row before the row block (both factors <= 1, then a ``tl.dot``); inside a diagonal
block the pairs of each 8-row half are computed one by one with ``exp2(min(G_i - G_j, 0))`` and
the lower-left quarter factors the same way through the row between the halves.

Import :mod:`sglang_kda.kernels.kda.ops` for the entry points. This package imports no kernel
itself: Triton fixes interpreter vs compiled mode (``TRITON_INTERPRET``) when a ``@triton.jit``
function is defined, i.e. when a stage module is first imported.
"""
