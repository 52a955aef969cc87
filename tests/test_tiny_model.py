"""Tests for the embedded tiny Kimi-Linear model and the independent reference forward.

* build determinism (same seed -> identical bytes, also across processes via the CLI; other
  seed -> other weights, same tokenizer) and idempotency;
* checkpoint layout: config fields as SGLang's KimiLinearConfig parses them, tensor names and
  shapes as a real Kimi-Linear HF checkpoint spells them (what SGLang's load_weights maps);
* tokenizer loads offline with transformers and renders the chat template;
* the reference: chunked KDA == recurrent KDA, prefill+decode (chunked KDA, conv state, absorbed
  MLA over the latent cache) == whole-sequence forward, non-degenerate greedy continuations,
  and agreement with transformers' own KimiLinear implementation where available.

About 30 s on 2 idle CPU cores (two subprocesses overlap the in-process tests).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference_forward as rf  # noqa: E402

from sglang_kda import tiny_model  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [
    "The old river",
    "Alice said:",
    "Why does the dragon",
    "In 1999, Bob traveled to",
]
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """seed 0 built in-process ("a"), seed 0 built by the CLI in a fresh process ("b"), seed 1
    ("c"). The two slow subprocesses (CLI build, SGLang load check on "a") run concurrently
    with the in-process tests; "sglang_check" is the latter's Popen."""
    root = tmp_path_factory.mktemp("tiny_kimi")
    env = {**os.environ, **OFFLINE_ENV, "PYTHONHASHSEED": "12345",
           "SGLANG_USE_CPU_ENGINE": "1"}
    cli = subprocess.Popen(
        [sys.executable, "-m", "sglang_kda.tiny_model", str(root / "b"), "--seed", "0"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    a = tiny_model.build_tiny_model(root / "a", seed=0)
    (root / "work").mkdir()
    sglang_check = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--sglang-load-check", str(a),
         str(root / "work")],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        c = tiny_model.build_tiny_model(root / "c", seed=1)
        cli_out, _ = cli.communicate(timeout=300)
        assert cli.returncode == 0, cli_out
        yield {"a": a, "b": root / "b", "c": c, "sglang_check": sglang_check}
    finally:
        if sglang_check.poll() is None:  # test deselected or failed early
            sglang_check.kill()
            sglang_check.communicate()


@pytest.fixture(scope="module")
def ref(model_dirs: dict) -> rf.ReferenceKimiLinear:
    return rf.ReferenceKimiLinear.load(model_dirs["a"])


@pytest.fixture(scope="module")
def tok(model_dirs: dict):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(model_dirs["a"] / "tokenizer.json"))


# -- build ------------------------------------------------------------------------------------
def test_same_seed_same_bytes(model_dirs: dict) -> None:
    ha, hb = _hashes(model_dirs["a"]), _hashes(model_dirs["b"])
    assert set(ha) == {"config.json", "generation_config.json", "model.safetensors",
                       "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json",
                       tiny_model.MANIFEST_NAME}
    assert ha == hb


def test_other_seed_other_weights(model_dirs: dict) -> None:
    ha, hc = _hashes(model_dirs["a"]), _hashes(model_dirs["c"])
    assert ha["model.safetensors"] != hc["model.safetensors"]
    assert ha["tokenizer.json"] == hc["tokenizer.json"]  # the tokenizer is seed-independent
    assert ha["config.json"] == hc["config.json"]
    with safe_open(str(model_dirs["a"] / "model.safetensors"), "pt") as fa, \
            safe_open(str(model_dirs["c"] / "model.safetensors"), "pt") as fc:
        for name in fa.keys():
            assert not torch.equal(fa.get_tensor(name), fc.get_tensor(name)), name


def test_build_is_idempotent(model_dirs: dict, tmp_path: Path) -> None:
    a = model_dirs["a"]
    mtimes = {p.name: p.stat().st_mtime_ns for p in a.iterdir()}
    assert tiny_model.is_complete(a, seed=0) and not tiny_model.is_complete(a, seed=1)
    tiny_model.build_tiny_model(a, seed=0)
    assert {p.name: p.stat().st_mtime_ns for p in a.iterdir()} == mtimes
    # A damaged copy is detected and rebuilt to the exact same bytes.
    d = tmp_path / "damaged"
    d.mkdir()
    for p in a.iterdir():
        (d / p.name).write_bytes(p.read_bytes())
    (d / "config.json").write_text("{}")
    assert not tiny_model.is_complete(d, seed=0)
    tiny_model.build_tiny_model(d, seed=0)
    assert _hashes(d) == _hashes(a)


# -- config: the real Kimi-Linear-48B-A3B values wherever they change the math ----------------
REAL_MATH = {  # moonshotai/Kimi-Linear-48B-A3B-Instruct config.json
    "routed_scaling_factor": 2.446,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "use_grouped_topk": True,
    "num_shared_experts": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "mla_use_nope": True,
    "q_lora_rank": None,
    "rope_scaling": None,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}


def test_config_carries_real_values(model_dirs: dict) -> None:
    cfg = json.loads((model_dirs["a"] / "config.json").read_text())
    assert cfg == tiny_model.make_config()
    assert {k: cfg[k] for k in REAL_MATH} == REAL_MATH
    # Grouped top-k really limits the choice (the real checkpoint has one group, a no-op):
    # several groups, not all of them kept, and more candidates than experts per token.
    e, groups, kept, k = (cfg["num_experts"], cfg["num_expert_group"], cfg["topk_group"],
                          cfg["num_experts_per_token"])
    assert e % groups == 0 and 1 < kept < groups and k < kept * e // groups
    # Long prompts out of the box: SGLang reads model_max_length first (NoPE MLA, no positions).
    assert cfg["model_max_length"] == cfg["max_position_embeddings"] >= 2 * 65536
    tok_cfg = json.loads((model_dirs["a"] / "tokenizer_config.json").read_text())
    assert tok_cfg["model_max_length"] == cfg["model_max_length"]
    # Non-zero, non-negative correction biases (see tiny_model: 0.0 vs -inf group masking).
    with safe_open(str(model_dirs["a"] / "model.safetensors"), "pt") as f:
        for i in range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"]):
            bias = f.get_tensor(f"model.layers.{i}.block_sparse_moe.gate.e_score_correction_bias")
            assert bias.min() >= 0 and bias.std() > 0.03, i


def test_manifest_version_gates_stale_builds(model_dirs: dict, tmp_path: Path) -> None:
    """A build from an older generator version is rebuilt, not reused."""
    d = tmp_path / "stale"
    d.mkdir()
    for p in model_dirs["a"].iterdir():
        (d / p.name).write_bytes(p.read_bytes())
    manifest = json.loads((d / tiny_model.MANIFEST_NAME).read_text())
    manifest["version"] = "2"
    (d / tiny_model.MANIFEST_NAME).write_text(json.dumps(manifest))
    assert not tiny_model.is_complete(d, seed=0)
    tiny_model.build_tiny_model(d, seed=0)
    assert _hashes(d) == _hashes(model_dirs["a"])


# -- checkpoint layout ------------------------------------------------------------------------
def _expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Kimi-Linear HF checkpoint names/shapes, written out from the config independently of
    tiny_model (these are the names SGLang's KimiLinearForCausalLM.load_weights maps: q/k/v and
    b/f_a/g_a into fused_qkvbfg_a_proj, f_b/g_b into fused_fg_b_proj, q/k/v_conv1d into
    qkv_conv1d, experts.E.w1/w3/w2 into w13/w2, shared gate/up into gate_up_proj)."""
    hid, lac = cfg["hidden_size"], cfg["linear_attn_config"]
    h, d, w = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
    mh, nope, rope, vd = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"],
                          cfg["qk_rope_head_dim"], cfg["v_head_dim"])
    lora, inter, e = cfg["kv_lora_rank"], cfg["moe_intermediate_size"], cfg["num_experts"]
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg["vocab_size"], hid),
        "model.norm.weight": (hid,),
        "lm_head.weight": (cfg["vocab_size"], hid),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (hid,)
        out[p + "post_attention_layernorm.weight"] = (hid,)
        a = p + "self_attn."
        if i + 1 in lac["kda_layers"]:
            for n in "qkv":
                out[a + f"{n}_proj.weight"] = (h * d, hid)
                out[a + f"{n}_conv1d.weight"] = (h * d, 1, w)  # nn.Conv1d depthwise layout
            out[a + "b_proj.weight"] = (h, hid)
            out[a + "f_a_proj.weight"] = out[a + "g_a_proj.weight"] = (d, hid)
            out[a + "f_b_proj.weight"] = out[a + "g_b_proj.weight"] = (h * d, d)
            out[a + "A_log"] = (1, 1, h, 1)  # SGLang's sharded loader narrows dim 2
            out[a + "dt_bias"] = (h * d,)
            out[a + "o_norm.weight"] = (d,)
            out[a + "o_proj.weight"] = (hid, h * d)
        else:
            assert i + 1 in lac["full_attn_layers"]
            out[a + "q_proj.weight"] = (mh * (nope + rope), hid)
            out[a + "kv_a_proj_with_mqa.weight"] = (lora + rope, hid)
            out[a + "kv_a_layernorm.weight"] = (lora,)
            out[a + "kv_b_proj.weight"] = (mh * (nope + vd), lora)
            out[a + "o_proj.weight"] = (hid, mh * vd)
        sparse = i >= cfg["first_k_dense_replace"] and i % cfg["moe_layer_freq"] == 0
        if not sparse:
            out[p + "mlp.gate_proj.weight"] = (cfg["intermediate_size"], hid)
            out[p + "mlp.up_proj.weight"] = (cfg["intermediate_size"], hid)
            out[p + "mlp.down_proj.weight"] = (hid, cfg["intermediate_size"])
            continue
        m = p + "block_sparse_moe."
        out[m + "gate.weight"] = (e, hid)
        out[m + "gate.e_score_correction_bias"] = (e,)
        for j in range(e):
            out[m + f"experts.{j}.w1.weight"] = (inter, hid)
            out[m + f"experts.{j}.w3.weight"] = (inter, hid)
            out[m + f"experts.{j}.w2.weight"] = (hid, inter)
        sh = inter * cfg["num_shared_experts"]
        out[m + "shared_experts.gate_proj.weight"] = (sh, hid)
        out[m + "shared_experts.up_proj.weight"] = (sh, hid)
        out[m + "shared_experts.down_proj.weight"] = (hid, sh)
    return out


def test_weight_names_and_shapes(model_dirs: dict) -> None:
    cfg = json.loads((model_dirs["a"] / "config.json").read_text())
    with safe_open(str(model_dirs["a"] / "model.safetensors"), "pt") as f:
        got = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        assert all(f.get_slice(k).get_dtype() == "F32" for k in f.keys())
        assert f.metadata() == {"format": "pt"}
    assert got == _expected_shapes(cfg)
    assert got == tiny_model.expected_weight_shapes()


def test_tokenizer_offline(model_dirs: dict) -> None:
    for k, v in OFFLINE_ENV.items():
        os.environ.setdefault(k, v)
    from transformers import AutoTokenizer

    d = model_dirs["a"]
    cfg = json.loads((d / "config.json").read_text())
    t = AutoTokenizer.from_pretrained(str(d))
    assert len(t) == cfg["vocab_size"] == 1024
    assert (t.bos_token_id, t.eos_token_id, t.pad_token_id) == (
        cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"])
    text = t.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
        tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
                    "<|im_user|>user<|im_middle|>Hi there<|im_end|>"
                    "<|im_assistant|>assistant<|im_middle|>")
    ids = t(text, add_special_tokens=False).input_ids
    assert ids[0] == t.convert_tokens_to_ids("<|im_system|>") == 5
    assert t.decode(ids, skip_special_tokens=True) == "systemBe brief.userHi thereassistant"
    assert t.decode(t("The old river walked.").input_ids) == "The old river walked."
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, t.convert_tokens_to_ids("<|im_end|>")]


# -- reference --------------------------------------------------------------------------------
def test_kda_chunked_matches_recurrent() -> None:
    g = torch.Generator().manual_seed(0)
    T, H, K, V = 37, 3, 8, 5
    q = rf.l2_normalize(torch.randn(T, H, K, generator=g, dtype=torch.float64)) * K ** -0.5
    k = rf.l2_normalize(torch.randn(T, H, K, generator=g, dtype=torch.float64))
    v = torch.randn(T, H, V, generator=g, dtype=torch.float64)
    gate = -torch.rand(T, H, K, generator=g, dtype=torch.float64) * 2.0  # strong decay too
    beta = torch.rand(T, H, generator=g, dtype=torch.float64)
    s0 = torch.randn(H, K, V, generator=g, dtype=torch.float64)
    o_ref, s_ref = rf.kda_recurrent(q, k, v, gate, beta, s0)
    for chunk in (1, 4, 16, 64):
        o, s = rf.kda_chunked(q, k, v, gate, beta, s0, chunk_size=chunk)
        torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-10)
        torch.testing.assert_close(s, s_ref, rtol=0, atol=1e-10)


def test_route_groups_bias_renormalisation_scaling() -> None:
    """A hand-checked routing example: 8 experts in 4 groups of 2, top-2 groups, top-2 experts,
    the bias decides the selection, the unbiased scores the weights."""
    E, H = 8, 8
    cfg = {"linear_attn_config": {"kda_layers": [], "num_heads": 1, "head_dim": 1,
                                  "short_conv_kernel_size": 2},
           "num_hidden_layers": 2, "rms_norm_eps": 1e-5, "num_attention_heads": 1,
           "kv_lora_rank": 1, "qk_nope_head_dim": 1, "qk_rope_head_dim": 1, "v_head_dim": 1,
           "num_experts": E, "num_experts_per_token": 2, "first_k_dense_replace": 1,
           "moe_renormalize": True, "routed_scaling_factor": 2.446, "num_expert_group": 4,
           "topk_group": 2}
    # Identity router: the logits are x itself.
    sig = torch.tensor([0.90, 0.05, 0.60, 0.55, 0.50, 0.45, 0.10, 0.80], dtype=torch.float64)
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.20, 0.0, 0.0], dtype=torch.float64)
    w = {"model.layers.1.block_sparse_moe.gate.weight": torch.eye(E, H, dtype=torch.float64),
         "model.layers.1.block_sparse_moe.gate.e_score_correction_bias": bias}
    ref = rf.ReferenceKimiLinear(cfg, w)
    x = torch.logit(sig).unsqueeze(0)
    weights, ids = ref.route(1, x)
    # Biased group scores: {0,1}: 0.95, {2,3}: 1.15, {4,5}: 1.15, {6,7}: 0.90 -> groups 1 and 2
    # survive, so expert 0 (best score 0.9) and expert 7 (0.8) are out; among 2..5 the biased
    # scores are 0.60, 0.55, 0.50, 0.65 -> experts 5 and 2 (expert 5 only thanks to its bias).
    assert sorted(ids[0].tolist()) == [2, 5]
    got = dict(zip(ids[0].tolist(), weights[0].tolist()))
    total = 0.60 + 0.45  # unbiased scores, renormalised, times the factor
    assert got[2] == pytest.approx(2.446 * 0.60 / total, abs=1e-12)
    assert got[5] == pytest.approx(2.446 * 0.45 / total, abs=1e-12)
    # Without renormalisation the unbiased scores are only scaled.
    ref.renormalize = False
    weights, ids = ref.route(1, x)
    got = dict(zip(ids[0].tolist(), weights[0].tolist()))
    assert got == pytest.approx({2: 2.446 * 0.60, 5: 2.446 * 0.45}, abs=1e-12)


def test_incremental_decode_matches_full_forward(ref: rf.ReferenceKimiLinear, tok) -> None:
    prompts = PROMPTS + [
        "Alice said: \"the golden dragon is brave and kind.\" In 1999, Bob traveled to Paris "
        "with 12 cats, and then"  # > 2 prefill chunks of 16
    ]
    for text in prompts:
        ids = tok.encode(text).ids
        new, logits = ref.greedy_generate(ids, 12, return_logits=True)
        full = ref.forward(ids + new[:-1])[len(ids) - 1:]
        torch.testing.assert_close(logits, full, rtol=0, atol=1e-4)
        assert new == full.argmax(dim=-1).tolist()
    # Prefill in pieces (prefix reuse / chunked prefill) carries state exactly.
    ids = tok.encode(prompts[-1]).ids
    state = ref.new_state()
    parts = [ref.extend(state, ids[:5]), ref.extend(state, ids[5:23], chunk_size=8),
             ref.extend(state, ids[23:])]
    torch.testing.assert_close(torch.cat(parts), ref.forward(ids), rtol=0, atol=1e-4)


def test_greedy_not_degenerate(ref: rf.ReferenceKimiLinear, tok) -> None:
    outs = []
    for text in PROMPTS:
        new = ref.greedy_generate(tok.encode(text).ids, 16)
        counts = torch.bincount(torch.tensor(new), minlength=1024)
        assert len(set(new)) >= 3, (text, tok.decode(new))
        assert counts.max() <= 0.6 * len(new), (text, tok.decode(new))
        outs.append(tuple(new))
    assert len(set(outs)) == len(outs), [tok.decode(list(o)) for o in outs]


def test_realistic_statistics(ref: rf.ReferenceKimiLinear, tok) -> None:
    """The init behaves like a trained model: Mamba-like decays, beta ~0.5, the router's
    correction bias changes some selections, logits in a sensible range."""
    ids = torch.tensor(tok.encode(
        "The old river walked slowly near the golden castle. Why does the dragon sleep?").ids)
    x = ref.w["model.embed_tokens.weight"][ids]
    _, _, _, gate, beta = ref._kda_inputs(0, x)
    assert -0.3 < gate.median().item() < -0.02 and gate.max().item() < 0
    assert 0.35 < beta.mean().item() < 0.65
    a_log = ref.w["model.layers.0.self_attn.A_log"].flatten()
    assert 1.0 <= a_log.exp().min().item() and a_log.exp().max().item() <= 16.0
    dt = torch.nn.functional.softplus(ref.w["model.layers.0.self_attn.dt_bias"])
    assert 9e-4 < dt.min().item() and dt.max().item() < 0.11
    _, chosen = ref.route(1, x)
    scores = torch.sigmoid(x @ ref.w["model.layers.1.block_sparse_moe.gate.weight"].t())
    unbiased = scores.topk(2).indices.sort(dim=1).values
    assert (unbiased != chosen.sort(dim=1).values).any()
    bias = ref.w["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"]
    ungrouped = (scores + bias).topk(2).indices.sort(dim=1).values
    assert (ungrouped != chosen.sort(dim=1).values).any()  # the group limit matters too
    logits = ref.forward(ids)
    assert 0.5 < logits.std(dim=-1).mean().item() < 10


def test_reference_matches_transformers(model_dirs: dict, ref, tok) -> None:
    """transformers' own KimiLinear (torch fallbacks) is a third, external implementation.
    Known deviation: HF's kv_a_layernorm uses eps 1e-6, SGLang (and the reference) 1e-5."""
    for k, v in OFFLINE_ENV.items():
        os.environ.setdefault(k, v)
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "KimiLinearForCausalLM"):
        pytest.skip("this transformers has no native KimiLinear")
    hf = transformers.KimiLinearForCausalLM.from_pretrained(
        str(model_dirs["a"]), dtype=torch.float32, experts_implementation="eager")
    ids = tok.encode(PROMPTS[2] + " sleep near the old castle?").ids
    with torch.no_grad():
        out = hf(torch.tensor([ids]), use_cache=False).logits[0].double()
    torch.testing.assert_close(out, ref.forward(ids), rtol=0, atol=2e-3)


# -- SGLang itself --------------------------------------------------------------------------
def _sglang_load_check(model_dir: Path, workdir: Path) -> None:
    """Run in a fresh process (``python tests/test_tiny_model.py --sglang-load-check DIR WORK``):
    build SGLang's own KimiLinearForCausalLM for this config on CPU (single-rank gloo group),
    load the checkpoint with its ``load_weights``, check every parameter against the checkpoint
    tensors it should have been fused from, and run SGLang's dense MLP / MoE blocks (CPU
    routing + ``moe_forward_native``) against the reference. Exit code 77 = SGLang unusable."""
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    for k, v in OFFLINE_ENV.items():
        os.environ.setdefault(k, v)
    try:
        from sglang.srt import runtime_context
        from sglang.srt.configs.kimi_linear import KimiLinearConfig
        from sglang.srt.distributed.parallel_state import (
            init_distributed_environment,
            initialize_model_parallel,
        )
        from sglang.srt.server_args import ServerArgs
    except Exception as exc:  # pragma: no cover - environment problem, not a model problem
        print(f"sglang import failed: {exc!r}")
        sys.exit(77)
    from safetensors.torch import load_file

    args = ServerArgs(model_path=str(model_dir), device="cpu", dtype="float32", tp_size=1,
                      mamba_radix_cache_strategy="no_buffer", disable_radix_cache=True)
    runtime_context.publish(args, role="test", ranks=runtime_context.SpawnRanks(world_rank=0))
    raw = json.loads((model_dir / "config.json").read_text())
    cfg = KimiLinearConfig(**raw)
    # 1-based kda_layers [1, 2, 3] -> 0-based layers 0-2 are KDA, layer 3 is MLA.
    assert [cfg.is_kda_layer(i) for i in range(cfg.num_hidden_layers)] == [
        True, True, True, False]
    assert cfg.linear_layer_ids == [0, 1, 2] and cfg.full_attention_layer_ids == [3]
    assert cfg.is_mla and cfg.is_moe and cfg.is_linear_attn and cfg.mla_use_nope is True
    assert cfg.num_experts_per_token == 2 and cfg.n_routed_experts == 8
    assert cfg.routed_scaling_factor == 2.446 and cfg.dtype == torch.float32
    assert (cfg.moe_renormalize, cfg.use_grouped_topk, cfg.num_expert_group, cfg.topk_group) == (
        True, True, 4, 2)
    from sglang.srt.utils.hf_transformers import get_context_length

    assert get_context_length(cfg) == raw["model_max_length"] >= 2 * 65536

    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"file://{workdir / 'pg'}")
    initialize_model_parallel(backend="gloo")
    # As the server does: the CPU engine needs patches/kimi_linear_moe.py for
    # routed_scaling_factor (tests/cpu/test_kimi_moe.py shows it off without).
    from sglang_kda.patches import current_context, patch_module

    patch_module("kimi_linear_moe").apply(current_context())
    from sglang.srt.models.kimi_linear import KimiLinearForCausalLM

    model = KimiLinearForCausalLM(cfg)
    ckpt = load_file(str(model_dir / "model.safetensors"))
    model.load_weights(sorted(ckpt.items()))

    def cat(*names: str) -> torch.Tensor:
        return torch.cat([ckpt[n] for n in names])

    expect: dict[str, torch.Tensor] = {}
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        expect[name] = ckpt[name]
    for i in range(cfg.num_hidden_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            expect[p + n] = ckpt[p + n]
        if cfg.is_kda_layer(i):
            expect[a + "fused_qkvbfg_a_proj.weight"] = cat(
                *(a + n + ".weight" for n in ("q_proj", "k_proj", "v_proj", "b_proj",
                                              "f_a_proj", "g_a_proj")))
            expect[a + "fused_fg_b_proj.weight"] = torch.stack(
                [ckpt[a + "f_b_proj.weight"], ckpt[a + "g_b_proj.weight"]])
            expect[a + "qkv_conv1d.weight"] = cat(*(a + f"{n}_conv1d.weight" for n in "qkv"))
            for n in ("A_log", "dt_bias", "o_norm.weight", "o_proj.weight"):
                expect[a + n] = ckpt[a + n]
        else:
            for n in ("q_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"):
                expect[a + n + ".weight"] = ckpt[a + n + ".weight"]
        if i < cfg.first_k_dense_replace:
            m = p + "mlp."
            expect[m + "gate_up_proj.weight"] = cat(m + "gate_proj.weight", m + "up_proj.weight")
            expect[m + "down_proj.weight"] = ckpt[m + "down_proj.weight"]
            continue
        m = p + "block_sparse_moe."
        for n in ("gate.weight", "gate.e_score_correction_bias", "shared_experts.down_proj.weight"):
            expect[m + n] = ckpt[m + n]
        s = m + "shared_experts."
        expect[s + "gate_up_proj.weight"] = cat(s + "gate_proj.weight", s + "up_proj.weight")
        e = range(cfg.num_experts)
        expect[m + "experts.w13_weight"] = torch.stack(
            [cat(f"{m}experts.{j}.w1.weight", f"{m}experts.{j}.w3.weight") for j in e])
        expect[m + "experts.w2_weight"] = torch.stack(
            [ckpt[f"{m}experts.{j}.w2.weight"] for j in e])
    params = dict(model.named_parameters())
    assert set(params) == set(expect), sorted(set(params) ^ set(expect))
    # Semantics the reference hard-codes: NoPE MLA with scale (nope+rope)^-0.5, KDA o_norm
    # eps 1e-5 with a sigmoid gate, kv_a_layernorm eps from the config.
    mla = model.model.layers[3].self_attn
    assert mla.rotary_emb is None
    assert mla.scaling == (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    assert mla.kv_a_layernorm.variance_epsilon == cfg.rms_norm_eps
    kda = model.model.layers[0].self_attn
    assert kda.o_norm.eps == rf.KDA_O_NORM_EPS and kda.o_norm.activation == "sigmoid"
    # The router SGLang builds reads the config's routing values.
    for i in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        tc = model.model.layers[i].mlp.topk.topk_config
        assert (tc.use_grouped_topk, tc.num_expert_group, tc.topk_group, tc.renormalize) == (
            True, 4, 2, True)
        assert tc.routed_scaling_factor == 2.446 and tc.apply_routed_scaling_factor_on_output
        assert tc.correction_bias is model.model.layers[i].mlp.gate.e_score_correction_bias
    for name, want in expect.items():
        assert torch.equal(params[name].detach(), want), name

    ref = rf.ReferenceKimiLinear.load(model_dir, dtype=torch.float32)
    x = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for i in range(cfg.num_hidden_layers):
            got = model.model.layers[i].mlp(x.clone())
            torch.testing.assert_close(got, ref._ffn(i, x), rtol=0, atol=1e-5)
        # SGLang's fused KDA input GEMMs (the CPU-portable part of its KDA layer) split into the
        # same q|k|v, beta logits, forget-gate and output-gate pre-activations.
        w, a = ref.w, "model.layers.0.self_attn."
        mixed_qkv, beta_raw, f_raw, g_raw = kda.forward_qkvbfg_fused(x)
        want = {
            "qkv": torch.cat([x @ w[a + f"{n}_proj.weight"].t() for n in "qkv"], dim=-1),
            "beta": x @ w[a + "b_proj.weight"].t(),
            "f": (x @ w[a + "f_a_proj.weight"].t()) @ w[a + "f_b_proj.weight"].t(),
            "g": (x @ w[a + "g_a_proj.weight"].t()) @ w[a + "g_b_proj.weight"].t(),
        }
        for key, got in zip(want, (mixed_qkv, beta_raw, f_raw, g_raw)):
            torch.testing.assert_close(got.reshape(want[key].shape), want[key], rtol=0,
                                       atol=1e-5, msg=key)
    print("SGLANG_LOAD_CHECK_OK")


def test_sglang_loads_checkpoint(model_dirs: dict) -> None:
    """SGLang's own config class, model class and load_weights accept the checkpoint, every
    fused parameter holds exactly the right tensors, and SGLang's MoE routing agrees with the
    reference (see _sglang_load_check; a subprocess keeps torch.distributed out of pytest)."""
    proc: subprocess.Popen = model_dirs["sglang_check"]
    out, _ = proc.communicate(timeout=600)
    if proc.returncode == 77:
        pytest.skip(out.strip()[-500:])
    assert proc.returncode == 0 and "SGLANG_LOAD_CHECK_OK" in out, out[-6000:]


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--sglang-load-check":
        _sglang_load_check(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        sys.exit(pytest.main([__file__, *sys.argv[1:]]))
