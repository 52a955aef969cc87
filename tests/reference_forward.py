"""Independent plain-PyTorch Kimi-Linear forward from ``config.json`` + ``model.safetensors``.

Deliberately imports neither ``sglang`` nor ``sglang_kda``: it is the oracle the engine is checked
against. Semantics follow SGLang 0.5.23 (``srt/models/kimi_linear.py``); where SGLang differs from
the HF modelling code it says so below.

* Decoder layer (pre-norm): ``h = x + attn(rmsnorm(x)); h = h + ffn(rmsnorm(h))``; final RMSNorm;
  untied ``lm_head``. RMSNorm is ``x * rsqrt(mean(x^2) + eps) * w`` (not Gemma's ``1 + w``).
* KDA layers (``linear_attn_config.kda_layers`` are 1-based): q/k/v projections -> depthwise
  causal conv (kernel W, no bias) -> SiLU; q, k L2-normalised per head (``x / sqrt(sum x^2 +
  1e-6)``, as the FLA kernels do), q scaled by ``head_dim^-0.5``; log-decay
  ``g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)`` per channel; ``beta = sigmoid(b_proj x)``;
  delta rule ``S <- diag(exp g) S; S += beta k (v - S^T k)^T; o = S^T q`` with S [K, V] per
  head; output ``rmsnorm(o) * o_norm.w * sigmoid(g_b(g_a(x)))`` (eps 1e-5: SGLang hard-codes
  KimiDeltaAttention's ``rms_norm_eps=1e-5`` default, HF uses ``config.rms_norm_eps``: the same
  for Kimi-Linear-48B-A3B and the tiny model), o_proj.
* MLA layers: ``DeepseekV2AttentionMLA`` as SGLang builds it for Kimi-Linear, i.e. with
  ``skip_rope=True`` (NoPE; SGLang does this unconditionally, whatever ``mla_use_nope`` says):
  ``q = q_proj x`` split [nope | rope]; ``kv_a_proj_with_mqa x`` split [kv_lora | rope];
  the latent goes through ``kv_a_layernorm`` (the rope slice does not; eps ``rms_norm_eps`` as
  in SGLang, where both HF modelling codes use their RMSNorm default 1e-6), ``kv_b_proj`` gives
  per-head [k_nope | v]; keys are ``[k_nope, k_pe]`` with the single k_pe shared by all heads,
  unrotated; softmax scale ``(nope + rope)^-0.5`` (no YaRN mscale since rope_scaling is None).
* MoE (layers >= first_k_dense_replace, every moe_layer_freq): the HF modelling code's router
  (Moonshot's ``KimiSparseMoeBlock``, transformers' ``KimiLinearTopkRouter``; SGLang's
  ``biased_grouped_topk_impl`` is the same function): scores = sigmoid(router logits); experts
  are *selected* by ``scores + e_score_correction_bias``, group-limited (the experts are split
  into ``num_expert_group`` contiguous groups, a group scores the sum of its two best biased
  scores, the best ``topk_group`` groups stay, top-k over their experts); *weighted* by the
  unbiased scores, renormalised ``w / (sum w + 1e-20)`` when ``moe_renormalize``, times
  ``routed_scaling_factor``; experts are SwiGLU ``w2(silu(w1 x) * w3 x)``; the shared expert
  (inter = moe_inter * num_shared) is added unscaled. Where the implementations differ: dropped
  groups' experts are filled with -inf here (SGLang, transformers) and 0.0 in Moonshot's code,
  which only matters when a kept expert's biased score is below 0 (the tiny model's
  non-negative biases rule that out); Moonshot's code skips the renormalisation for top-1, SGLang
  does not (the reference follows SGLang). SGLang's CPU engine omits routed_scaling_factor
  unless patches/kimi_linear_moe.py is applied (the server applies it).

Two code paths compute the same function, so comparing them checks the state handling:

* :meth:`ReferenceKimiLinear.forward` - whole sequence at once: token-by-token KDA recurrence,
  ``F.conv1d`` for the short conv, MHA-style MLA with a causal mask.
* :meth:`ReferenceKimiLinear.extend` / :meth:`decode_step` (used by :meth:`greedy_generate`) -
  like SGLang's extend/decode split: extend runs the *chunked* (WY / UT-transform) KDA form from
  a carried state with the conv window carried in a conv state, and appends MLA's compressed
  latent cache (kv_a after norm + k_pe, exactly what SGLang's MLA KV pool stores); decode runs
  one recurrence step and the *weight-absorbed* MLA over the latent cache.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

L2NORM_EPS = 1e-6  # FLA l2norm / fused recurrent kernels
KDA_O_NORM_EPS = 1e-5  # SGLang KimiDeltaAttention default (not read from config)
RENORM_EPS = 1e-20  # SGLang _RENORMALIZE_SUM_EPSILON


def _single_threaded(fn: Callable) -> Callable:
    """Run ``fn`` with one intra-op thread (restored afterwards). The reference issues many
    tiny ops; on a small, shared CPU box OpenMP's thread hand-off makes them 10-20x slower than
    a single thread."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        previous = torch.get_num_threads()
        if previous == 1:
            return fn(*args, **kwargs)
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(previous)

    return wrapper


# ---------------------------------------------------------------------------------------------
# Building blocks (all shapes: T tokens, H heads, K key dim, V value dim, D channels)
# ---------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., D] -> [..., D]: ``x * rsqrt(mean(x^2) + eps) * weight``."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """[..., K] -> [..., K]: ``x / sqrt(sum x^2 + 1e-6)`` (FLA's in-kernel q/k norm)."""
    return x / torch.sqrt(x.pow(2).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
           w_down: torch.Tensor) -> torch.Tensor:
    """[T, D] -> [T, D]: ``down(silu(gate x) * up x)``; weights are [out, in]."""
    return (F.silu(x @ w_gate.t()) * (x @ w_up.t())) @ w_down.t()


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule.

    Args: q, k [T, H, K] (q already L2-normed and scaled, k L2-normed); v [T, H, V];
        g [T, H, K] log-decay (<= 0); beta [T, H]; state [H, K, V] (not modified).
    Returns: o [T, H, V], final state [H, K, V].
    """
    s = state.clone()
    out = []
    for t in range(q.shape[0]):
        s = s * torch.exp(g[t]).unsqueeze(-1)  # S <- diag(exp g_t) S
        predicted = torch.einsum("hk,hkv->hv", k[t], s)  # S^T k
        u = beta[t].unsqueeze(-1) * (v[t] - predicted)  # beta (v - S^T k)
        s = s + k[t].unsqueeze(-1) * u.unsqueeze(-2)  # S += k u^T
        out.append(torch.einsum("hk,hkv->hv", q[t], s))  # o = S^T q
    return torch.stack(out) if out else v.new_zeros(v.shape), s


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, state: torch.Tensor,
                chunk_size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """The same function as :func:`kda_recurrent`, chunk-parallel (what prefill kernels do).

    Within a chunk with cumulative log-decay ``G_t = sum_{s<=t} g_s`` and entry state S0, the
    recurrence unrolls to ``S_t = diag(e^{G_t}) S0 + sum_{s<=t} diag(e^{G_t - G_s}) k_s u_s^T``
    where the pseudo-values solve the unit lower-triangular system
    ``u_t + beta_t sum_{s<t} A_ts u_s = beta_t (v_t - S0^T (e^{G_t} k_t))`` with
    ``A_ts = sum_d k_t[d] k_s[d] e^{G_t[d] - G_s[d]}``. Then
    ``o_t = S0^T (e^{G_t} q_t) + sum_{s<=t} (q_t . (e^{G_t - G_s} k_s)) u_s``. Only decays
    ``e^{x}`` with ``x <= 0`` are ever formed, so nothing overflows.

    Shapes as in :func:`kda_recurrent`.
    """
    T = q.shape[0]
    s = state.clone()
    outs = []
    for start in range(0, T, chunk_size):
        sl = slice(start, start + chunk_size)
        qc, kc, vc, gc, bc = q[sl], k[sl], v[sl], g[sl], beta[sl]
        n = qc.shape[0]
        cum = torch.cumsum(gc, dim=0)  # [n, H, K]
        causal = torch.tril(torch.ones(n, n, dtype=torch.bool))  # [t, s], s <= t
        diff = cum.unsqueeze(1) - cum.unsqueeze(0)  # [t, s, H, K] = G_t - G_s
        decay = torch.exp(diff.masked_fill(~causal[:, :, None, None], float("-inf")))
        a_kk = torch.einsum("thk,shk,tshk->hts", kc, kc, decay).tril(-1)  # strictly lower
        a_qk = torch.einsum("thk,shk,tshk->hts", qc, kc, decay)  # lower incl. diagonal
        k_dec = kc * torch.exp(cum)  # e^{G_t} k_t
        q_dec = qc * torch.exp(cum)
        rhs = bc.unsqueeze(-1) * (vc - torch.einsum("thk,hkv->thv", k_dec, s))  # [n, H, V]
        eye = torch.eye(n, dtype=q.dtype)
        system = eye + bc.t().unsqueeze(-1) * a_kk  # [H, t, s]: I + diag(beta) A
        u = torch.linalg.solve_triangular(system, rhs.transpose(0, 1), upper=False,
                                          unitriangular=True)  # [H, n, V]
        outs.append(torch.einsum("thk,hkv->thv", q_dec, s)
                    + torch.einsum("hts,hsv->thv", a_qk, u))
        last = cum[-1]  # [H, K]
        k_to_end = kc * torch.exp(last.unsqueeze(0) - cum)  # e^{G_n - G_s} k_s
        s = torch.exp(last).unsqueeze(-1) * s + torch.einsum("shk,hsv->hkv", k_to_end, u)
    return (torch.cat(outs) if outs else v.new_zeros(v.shape)), s


def causal_conv_with_state(x: torch.Tensor, weight: torch.Tensor,
                           conv_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv continuing from ``conv_state``, then SiLU.

    Args: x [T, D] (pre-conv projections), weight [D, W], conv_state [W-1, D] (the previous
        W-1 inputs, oldest first; zeros at sequence start).
    Returns: y [T, D] with ``y_t = silu(sum_i weight[:, i] * window_t[i])`` where window_t are
        inputs t-W+1..t, and the new conv state [W-1, D].
    """
    width = weight.shape[1]
    padded = torch.cat([conv_state, x], dim=0)  # [W-1+T, D]
    windows = padded.unfold(0, width, 1)  # [T, D, W]
    y = F.silu((windows * weight.unsqueeze(0)).sum(dim=-1))
    return y, padded[padded.shape[0] - (width - 1):].clone()


# ---------------------------------------------------------------------------------------------
# State
# ---------------------------------------------------------------------------------------------
@dataclass
class KDALayerState:
    """conv [3, W-1, H*K]: the last W-1 pre-conv q, k, v projections (oldest first); ssm
    [H, K, V] recurrent state (SGLang's pool keeps the transpose, [H, V, K])."""

    conv: torch.Tensor
    ssm: torch.Tensor


@dataclass
class MLALayerCache:
    """What SGLang's MLA KV pool stores per token: ckv [T, kv_lora] (after kv_a_layernorm) and
    the shared, unrotated k_pe [T, rope]."""

    ckv: torch.Tensor
    kpe: torch.Tensor


@dataclass
class KimiLinearState:
    """Per-request decoding state: one entry per layer index."""

    layers: dict[int, KDALayerState | MLALayerCache] = field(default_factory=dict)
    num_tokens: int = 0


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------
class ReferenceKimiLinear:
    """Plain-PyTorch Kimi-Linear (KDA + NoPE MLA + sigmoid MoE), default float64."""

    def __init__(self, config: dict, weights: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.float64) -> None:
        self.config = config
        self.dtype = dtype
        self.w = {k: v.to(dtype) for k, v in weights.items()}
        lac = config["linear_attn_config"]
        self.num_layers: int = config["num_hidden_layers"]
        self.kda_layers = {i for i in range(self.num_layers) if (i + 1) in lac["kda_layers"]}
        self.kda_heads: int = lac["num_heads"]
        self.kda_head_dim: int = lac["head_dim"]
        self.conv_width: int = lac["short_conv_kernel_size"]
        self.eps: float = config["rms_norm_eps"]
        self.mla_heads: int = config["num_attention_heads"]
        self.kv_lora: int = config["kv_lora_rank"]
        self.nope: int = config["qk_nope_head_dim"]
        self.rope: int = config["qk_rope_head_dim"]
        self.v_dim: int = config["v_head_dim"]
        if config.get("q_lora_rank") is not None:
            raise NotImplementedError("q_lora_rank (q_a/q_b projections) not supported")
        if config.get("rope_scaling"):
            raise NotImplementedError("rope_scaling (YaRN mscale) not supported")
        self.num_experts = config.get("num_experts")
        self.top_k = config.get("num_experts_per_token")
        self.first_dense = config.get("first_k_dense_replace", 0)
        self.moe_freq = config.get("moe_layer_freq", 1)
        # The checkpoint's names first, transformers' aliases second.
        self.renormalize = bool(config.get("moe_renormalize",
                                           config.get("norm_topk_prob", True)))
        self.routed_scale = float(config.get("routed_scaling_factor", 1.0))
        self.n_group = config.get("num_expert_group", config.get("n_group")) or 1
        self.topk_group = config.get("topk_group") or 1
        if self.num_experts is not None:
            per_group = self.num_experts // self.n_group
            if self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
                raise ValueError("num_experts / num_expert_group / topk_group do not fit")
            if self.top_k > self.topk_group * per_group:
                raise ValueError("top-k exceeds the experts of the kept groups")
        if config.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            raise NotImplementedError("only the sigmoid (noaux_tc) router is implemented")
        if config.get("hidden_act", "silu") != "silu":
            raise NotImplementedError("only silu is implemented")

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype = torch.float64
             ) -> "ReferenceKimiLinear":
        """Read ``config.json`` and ``model.safetensors`` from ``model_dir``."""
        model_dir = Path(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        return cls(config, load_file(str(model_dir / "model.safetensors")), dtype)

    # -- helpers --------------------------------------------------------------------------
    def _is_moe(self, i: int) -> bool:
        return (self.num_experts is not None and i >= self.first_dense
                and i % self.moe_freq == 0)

    def _ids(self, input_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(list(input_ids) if not torch.is_tensor(input_ids) else input_ids,
                               dtype=torch.long).reshape(-1)

    def new_state(self) -> KimiLinearState:
        """Empty state: zero conv windows / recurrent states, empty MLA caches."""
        st = KimiLinearState()
        proj = self.kda_heads * self.kda_head_dim
        for i in range(self.num_layers):
            if i in self.kda_layers:
                st.layers[i] = KDALayerState(
                    conv=torch.zeros(3, self.conv_width - 1, proj, dtype=self.dtype),
                    ssm=torch.zeros(self.kda_heads, self.kda_head_dim, self.kda_head_dim,
                                    dtype=self.dtype))
            else:
                st.layers[i] = MLALayerCache(
                    ckv=torch.zeros(0, self.kv_lora, dtype=self.dtype),
                    kpe=torch.zeros(0, self.rope, dtype=self.dtype))
        return st

    # -- KDA ------------------------------------------------------------------------------
    def _kda_inputs(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Projections before the conv: q, k, v [T, H*K]; g [T, H, K]; beta [T, H]."""
        p = f"model.layers.{i}.self_attn."
        w = self.w
        H, K = self.kda_heads, self.kda_head_dim
        q, k, v = (x @ w[p + f"{n}_proj.weight"].t() for n in "qkv")
        f = (x @ w[p + "f_a_proj.weight"].t()) @ w[p + "f_b_proj.weight"].t()
        a = torch.exp(w[p + "A_log"].reshape(H, 1))  # A_log is [1, 1, H, 1]
        g = -a * F.softplus(f.view(-1, H, K) + w[p + "dt_bias"].view(H, K))
        beta = torch.sigmoid(x @ w[p + "b_proj.weight"].t())
        return q, k, v, g, beta

    def _kda_output(self, i: int, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Gated RMSNorm + o_proj: o [T, H, V] -> [T, hidden]."""
        p = f"model.layers.{i}.self_attn."
        w = self.w
        gate = (x @ w[p + "g_a_proj.weight"].t()) @ w[p + "g_b_proj.weight"].t()
        o = rms_norm(o, w[p + "o_norm.weight"], KDA_O_NORM_EPS)
        o = o * torch.sigmoid(gate.view_as(o))
        return o.reshape(o.shape[0], -1) @ w[p + "o_proj.weight"].t()

    def _qk_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, H*K] -> [T, H, K]; q, k L2-normalised, q scaled by K^-0.5."""
        H, K = self.kda_heads, self.kda_head_dim
        q = l2_normalize(q.view(-1, H, K)) * K ** -0.5
        return q, l2_normalize(k.view(-1, H, K)), v.view(-1, H, K)

    def _kda_full(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Whole-sequence KDA from zero state (F.conv1d + token recurrence)."""
        p = f"model.layers.{i}.self_attn."
        q, k, v, g, beta = self._kda_inputs(i, x)
        T, W = x.shape[0], self.conv_width
        conv = []
        for name, val in (("q", q), ("k", k), ("v", v)):
            weight = self.w[p + f"{name}_conv1d.weight"]  # [D, 1, W]
            y = F.conv1d(val.t().unsqueeze(0), weight, padding=W - 1, groups=weight.shape[0])
            conv.append(F.silu(y[0, :, :T].t()))
        qh, kh, vh = self._qk_heads(*conv)
        zero = torch.zeros(self.kda_heads, self.kda_head_dim, self.kda_head_dim,
                           dtype=self.dtype)
        o, _ = kda_recurrent(qh, kh, vh, g, beta, zero)
        return self._kda_output(i, x, o)

    def _kda_stateful(self, i: int, x: torch.Tensor, st: KDALayerState,
                      chunked: bool, chunk_size: int) -> torch.Tensor:
        """KDA continuing from ``st`` (updated in place): chunked for extend, recurrent step
        for decode."""
        p = f"model.layers.{i}.self_attn."
        q, k, v, g, beta = self._kda_inputs(i, x)
        conv = []
        for j, (name, val) in enumerate((("q", q), ("k", k), ("v", v))):
            weight = self.w[p + f"{name}_conv1d.weight"][:, 0, :]  # [D, W]
            y, st.conv[j] = causal_conv_with_state(val, weight, st.conv[j])
            conv.append(y)
        qh, kh, vh = self._qk_heads(*conv)
        if chunked:
            o, st.ssm = kda_chunked(qh, kh, vh, g, beta, st.ssm, chunk_size)
        else:
            o, st.ssm = kda_recurrent(qh, kh, vh, g, beta, st.ssm)
        return self._kda_output(i, x, o)

    # -- MLA ------------------------------------------------------------------------------
    def _mla_project(self, i: int, x: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hm, nope+rope]; ckv [T, kv_lora] (normed latent); kpe [T, rope]."""
        p = f"model.layers.{i}.self_attn."
        w = self.w
        q = (x @ w[p + "q_proj.weight"].t()).view(-1, self.mla_heads, self.nope + self.rope)
        latent = x @ w[p + "kv_a_proj_with_mqa.weight"].t()
        ckv = rms_norm(latent[:, :self.kv_lora], w[p + "kv_a_layernorm.weight"], self.eps)
        return q, ckv, latent[:, self.kv_lora:]

    def _mla_attend_mha(self, i: int, q: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                        q_offset: int) -> torch.Tensor:
        """Non-absorbed MLA (SGLang's prefill / MHA path): expand the latent cache to per-head
        k, v and attend causally. q [Tq, Hm, nope+rope] are the last Tq of the Tk keys."""
        p = f"model.layers.{i}.self_attn."
        Hm = self.mla_heads
        kv = (ckv @ self.w[p + "kv_b_proj.weight"].t()).view(-1, Hm, self.nope + self.v_dim)
        k = torch.cat([kv[..., :self.nope], kpe.unsqueeze(1).expand(-1, Hm, -1)], dim=-1)
        v = kv[..., self.nope:]
        scores = torch.einsum("thd,shd->hts", q, k) * (self.nope + self.rope) ** -0.5
        tq, tk = q.shape[0], k.shape[0]
        allowed = (torch.arange(tk)[None, :] <= (q_offset + torch.arange(tq))[:, None])
        scores = scores.masked_fill(~allowed, float("-inf"))
        o = torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), v)
        return o.reshape(tq, -1) @ self.w[p + "o_proj.weight"].t()

    def _mla_attend_absorbed(self, i: int, q: torch.Tensor, ckv: torch.Tensor,
                             kpe: torch.Tensor) -> torch.Tensor:
        """Weight-absorbed MLA (SGLang's decode path): q_nope is mapped into the latent space
        with W_kc, scores against the latent cache, output mapped back with W_vc.
        q [1, Hm, nope+rope] attends to all cached tokens."""
        p = f"model.layers.{i}.self_attn."
        kv_b = self.w[p + "kv_b_proj.weight"].view(self.mla_heads, self.nope + self.v_dim,
                                                   self.kv_lora)
        w_kc, w_vc = kv_b[:, :self.nope], kv_b[:, self.nope:]  # [Hm, nope|v, kv_lora]
        q_nope, q_pe = q[..., :self.nope], q[..., self.nope:]
        q_lat = torch.einsum("thn,hnc->thc", q_nope, w_kc)  # [1, Hm, kv_lora]
        scores = (torch.einsum("thc,sc->hts", q_lat, ckv)
                  + torch.einsum("thr,sr->hts", q_pe, kpe)) * (self.nope + self.rope) ** -0.5
        o_lat = torch.einsum("hts,sc->thc", torch.softmax(scores, dim=-1), ckv)
        o = torch.einsum("thc,hvc->thv", o_lat, w_vc)  # [1, Hm, v]
        return o.reshape(1, -1) @ self.w[p + "o_proj.weight"].t()

    # -- MoE / MLP ------------------------------------------------------------------------
    def route(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sigmoid, bias-corrected, group-limited router of layer ``i`` (see the module
        docstring): x [T, hidden] -> (weights [T, k] including routed_scaling_factor,
        expert ids [T, k])."""
        p = f"model.layers.{i}.block_sparse_moe.gate."
        scores = torch.sigmoid(x @ self.w[p + "weight"].t())  # [T, E]
        choice = scores + self.w[p + "e_score_correction_bias"]
        T, E = choice.shape
        grouped = choice.view(T, self.n_group, E // self.n_group)
        group_scores = grouped.topk(min(2, E // self.n_group), dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, True)
        masked = choice.masked_fill(~keep.repeat_interleave(E // self.n_group, dim=1),
                                    float("-inf"))
        ids = masked.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + RENORM_EPS)
        return weights * self.routed_scale, ids

    def _ffn(self, i: int, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        if not self._is_moe(i):
            p = f"model.layers.{i}.mlp."
            return swiglu(x, w[p + "gate_proj.weight"], w[p + "up_proj.weight"],
                          w[p + "down_proj.weight"])
        p = f"model.layers.{i}.block_sparse_moe."
        weights, ids = self.route(i, x)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            rows, slot = torch.nonzero(ids == e, as_tuple=True)
            if rows.numel() == 0:
                continue
            xe = p + f"experts.{e}."
            y = swiglu(x[rows], w[xe + "w1.weight"], w[xe + "w3.weight"], w[xe + "w2.weight"])
            out.index_add_(0, rows, y * weights[rows, slot].unsqueeze(-1))
        s = p + "shared_experts."
        return out + swiglu(x, w[s + "gate_proj.weight"], w[s + "up_proj.weight"],
                            w[s + "down_proj.weight"])

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(h, self.w["model.norm.weight"], self.eps) @ self.w["lm_head.weight"].t()

    def _block(self, i: int, h: torch.Tensor, attn) -> torch.Tensor:
        p = f"model.layers.{i}."
        h = h + attn(rms_norm(h, self.w[p + "input_layernorm.weight"], self.eps))
        return h + self._ffn(i, rms_norm(h, self.w[p + "post_attention_layernorm.weight"],
                                         self.eps))

    # -- public API -----------------------------------------------------------------------
    @torch.no_grad()
    @_single_threaded
    def forward(self, input_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Whole-sequence forward from an empty state: ids [T] -> logits [T, vocab]."""
        ids = self._ids(input_ids)
        h = self.w["model.embed_tokens.weight"][ids]
        for i in range(self.num_layers):
            if i in self.kda_layers:
                h = self._block(i, h, lambda x, i=i: self._kda_full(i, x))
            else:
                def mla(x: torch.Tensor, i: int = i) -> torch.Tensor:
                    q, ckv, kpe = self._mla_project(i, x)
                    return self._mla_attend_mha(i, q, ckv, kpe, 0)
                h = self._block(i, h, mla)
        return self._logits(h)

    @torch.no_grad()
    @_single_threaded
    def extend(self, state: KimiLinearState, input_ids: Sequence[int] | torch.Tensor,
               chunk_size: int = 16) -> torch.Tensor:
        """Prefill ``input_ids`` on top of ``state`` (updated in place; may be non-empty, like
        a prefix-cache hit or chunked prefill): ids [T] -> logits [T, vocab]."""
        ids = self._ids(input_ids)
        h = self.w["model.embed_tokens.weight"][ids]
        offset = state.num_tokens
        for i in range(self.num_layers):
            st = state.layers[i]
            if i in self.kda_layers:
                h = self._block(i, h, lambda x, i=i, st=st: self._kda_stateful(
                    i, x, st, chunked=True, chunk_size=chunk_size))
            else:
                def mla(x: torch.Tensor, i: int = i, st: MLALayerCache = st) -> torch.Tensor:
                    q, ckv, kpe = self._mla_project(i, x)
                    st.ckv, st.kpe = torch.cat([st.ckv, ckv]), torch.cat([st.kpe, kpe])
                    return self._mla_attend_mha(i, q, st.ckv, st.kpe, offset)
                h = self._block(i, h, mla)
        state.num_tokens += ids.numel()
        return self._logits(h)

    @torch.no_grad()
    @_single_threaded
    def decode_step(self, state: KimiLinearState, token_id: int) -> torch.Tensor:
        """One decode token on top of ``state`` (updated in place) -> logits [vocab]."""
        h = self.w["model.embed_tokens.weight"][self._ids([token_id])]
        for i in range(self.num_layers):
            st = state.layers[i]
            if i in self.kda_layers:
                h = self._block(i, h, lambda x, i=i, st=st: self._kda_stateful(
                    i, x, st, chunked=False, chunk_size=1))
            else:
                def mla(x: torch.Tensor, i: int = i, st: MLALayerCache = st) -> torch.Tensor:
                    q, ckv, kpe = self._mla_project(i, x)
                    st.ckv, st.kpe = torch.cat([st.ckv, ckv]), torch.cat([st.kpe, kpe])
                    return self._mla_attend_absorbed(i, q, st.ckv, st.kpe)
                h = self._block(i, h, mla)
        state.num_tokens += 1
        return self._logits(h)[0]

    @torch.no_grad()
    @_single_threaded
    def greedy_generate(self, input_ids: Sequence[int] | torch.Tensor, max_new_tokens: int,
                        stop_token_ids: Iterable[int] | None = None,
                        return_logits: bool = False,
                        chunk_size: int = 16) -> list[int] | tuple[list[int], torch.Tensor]:
        """Greedy decoding: chunked prefill of the prompt, then one :meth:`decode_step` per
        token. Stops after ``max_new_tokens`` or right after emitting a stop id (none by
        default, like SGLang with ``ignore_eos``).

        Returns the new token ids; with ``return_logits`` also the logits that chose them,
        [n_new, vocab] (row 0 from prefill, row j>0 from decode step j).
        """
        stop = set(stop_token_ids or ())
        state = self.new_state()
        logits = self.extend(state, input_ids, chunk_size=chunk_size)[-1]
        out: list[int] = []
        rows: list[torch.Tensor] = []
        while len(out) < max_new_tokens:
            rows.append(logits)
            tok = int(torch.argmax(logits))
            out.append(tok)
            if tok in stop or len(out) == max_new_tokens:
                break
            logits = self.decode_step(state, tok)
        if return_logits:
            return out, (torch.stack(rows) if rows else torch.zeros(0, 0, dtype=self.dtype))
        return out


def parameter_count(model_dir: str | Path) -> int:
    """Total number of parameters in ``model.safetensors``."""
    return sum(t.numel() for t in load_file(str(Path(model_dir) / "model.safetensors")).values())


__all__ = [
    "KimiLinearState",
    "ReferenceKimiLinear",
    "causal_conv_with_state",
    "kda_chunked",
    "kda_recurrent",
    "parameter_count",
]
