"""The embedded default model: a tiny, seeded Kimi-Linear checkpoint built fully offline.

``python -m sglang_kda.tiny_model DIR [--seed N]`` (or :func:`build_tiny_model`) writes a model
directory that SGLang 0.5.23 loads through its normal safetensors loader as
``KimiLinearForCausalLM``:

* ``config.json``: a scaled-down Kimi-Linear config (the real checkpoint's field names and
  conventions: 1-based ``linear_attn_config.kda_layers``, NoPE MLA, sigmoid/noaux_tc MoE router).
  Only sizes are scaled down: every value that changes the math is Kimi-Linear-48B-A3B's
  (``routed_scaling_factor`` 2.446, ``moe_renormalize``, sigmoid router with
  ``e_score_correction_bias``, ``use_grouped_topk``, one shared expert, ``first_k_dense_replace``
  1, NoPE MLA, ``rms_norm_eps`` 1e-5, silu), except the expert groups: 4 groups of 2 experts,
  top-2 groups, where the real checkpoint has a single group (a no-op). The context length is
  131072 tokens (see :data:`CONTEXT_LENGTH`).
* ``tokenizer.json`` + ``tokenizer_config.json`` + ``special_tokens_map.json``: a byte-level BPE
  tokenizer (vocab 1024) trained here with ``tokenizers`` on a corpus generated from the embedded
  word lists below by a fixed-seed RNG, with Kimi-style chat special tokens and a Jinja chat
  template, so ``transformers.AutoTokenizer.from_pretrained(DIR)`` works with no hub access.
* ``generation_config.json``.
* ``model.safetensors``: seeded fp32 weights named exactly like a real Kimi-Linear HF checkpoint.
* ``tiny_model_manifest.json``: sha256 of every file above plus the generator version and seed.
  It is written last and makes building idempotent: a directory whose manifest matches the
  requested version/seed and whose files still hash to it is left untouched.

Determinism: the same seed always gives the same bytes. The tokenizer and corpus do not depend on
the seed (only the weights do); every tensor is drawn from its own ``torch.Generator`` seeded from
``(seed, tensor name)``; all arithmetic on weights (including the few BLAS/LAPACK calls) is
done in float64 and rounded to float32 once at the end, so summation-order differences between
machines cannot flip bits in practice; JSON is written with sorted keys; safetensors orders
tensors by name and stores no timestamps; the BPE trainer breaks count ties deterministically.

Layout (layer index is 0-based here, 1-based in ``linear_attn_config``)::

    layer 0: KDA + dense MLP (first_k_dense_replace = 1)
    layer 1: KDA + MoE       layer 2: KDA + MoE       layer 3: MLA (NoPE) + MoE

Numerics are chosen to look like a trained model rather than a fresh init (see
:func:`_make_weights`): Mamba-style KDA gates, ~0.5 delta-rule betas, near-1 norms with small
noise (so a swapped norm weight shows up), non-zero router correction biases (so selection by
biased scores differs from weighting by unbiased scores), and an embedding / lm_head pair that
carries the corpus' bigram statistics so greedy continuations are word-like and prompt-dependent.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import math
import os
import random
import sys
from functools import lru_cache
from pathlib import Path

import torch

GENERATOR_VERSION = "3"
"""Bump whenever the bytes produced for a given seed change (invalidates existing manifests)."""

MANIFEST_NAME = "tiny_model_manifest.json"
VOCAB_SIZE = 1024
CORPUS_SEED = 20240611
"""Fixed: the tokenizer (and the bigram statistics baked into the embeddings) never depend on
the weight seed, so all seeds share one tokenizer."""
CORPUS_SENTENCES = 2400

# Special tokens first so their ids are stable and small. The role markers follow Kimi's naming.
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "[PAD]", "[BOS]", "[EOS]"
IM_USER, IM_ASSISTANT, IM_SYSTEM = "<|im_user|>", "<|im_assistant|>", "<|im_system|>"
IM_MIDDLE, IM_END = "<|im_middle|>", "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (
    PAD_TOKEN,
    BOS_TOKEN,
    EOS_TOKEN,
    IM_USER,
    IM_ASSISTANT,
    IM_SYSTEM,
    IM_MIDDLE,
    IM_END,
)
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
IM_END_ID = SPECIAL_TOKENS.index(IM_END)

# Kimi-style chat template. Content may be a string or a list of OpenAI content parts.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ '<|im_system|>system<|im_middle|>' }}"
    "{%- elif message['role'] == 'user' -%}{{ '<|im_user|>user<|im_middle|>' }}"
    "{%- else -%}{{ '<|im_assistant|>' + message['role'] + '<|im_middle|>' }}{%- endif -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<|im_end|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_assistant|>assistant<|im_middle|>' }}{%- endif -%}"
)

# ---------------------------------------------------------------------------------------------
# Architecture. Scaled-down Kimi-Linear-48B-A3B (hidden 2304, 27 layers, KDA 32x128, MLA
# 32 heads kv_lora 512 nope 128 rope 64, 256 experts top-8 + 1 shared, inter 1024/9216).
# ---------------------------------------------------------------------------------------------
HIDDEN = 128
NUM_LAYERS = 4
KDA_LAYERS_1BASED = [1, 2, 3]
FULL_ATTN_LAYERS_1BASED = [4]
KDA_HEADS, KDA_HEAD_DIM, SHORT_CONV = 4, 32, 4
MLA_HEADS, KV_LORA_RANK, QK_NOPE, QK_ROPE, V_HEAD = 4, 64, 32, 16, 32
NUM_EXPERTS, TOP_K, NUM_SHARED, MOE_INTER = 8, 2, 1, 64
DENSE_INTER = 256
LOGIT_GAIN = 6.0  # sharpens the bigram logits to a trained-model-like range (std ~2)
OUT_GAIN = 0.35  # std gain of residual-branch output projections (o_proj, down_proj, w2)
RMS_EPS = 1e-5  # real Kimi-Linear value; also SGLang's hard-coded KDA o_norm eps (1e-5)
# Router: the real Kimi-Linear-48B-A3B values wherever they change the math. The real factor
# 2.446 (SGLang's CPU engine needs patches/kimi_linear_moe.py for it); renormalised sigmoid
# scores; a non-zero correction bias. The real checkpoint has one expert group (group-limited
# routing is then a no-op); the tiny model uses 4 groups of 2 experts, top-2 groups, so the
# grouped top-k code path that the real config selects (use_grouped_topk) is really exercised.
ROUTED_SCALING_FACTOR = 2.446
MOE_RENORMALIZE = True
NUM_EXPERT_GROUP, TOPK_GROUP = 4, 2
FIRST_K_DENSE = 1  # real value: layer 0 is a dense MLP
# Context length (``model_max_length``, what SGLang reads first, and ``max_position_embeddings``).
# The real checkpoint says 1048576; MLA is NoPE and KDA has no positions, so any length is exact.
# 131072 rather than 1M keeps SGLang's per-request token table (req_to_token, int32 x context
# length x max running requests) small on CPU, and still takes 65,536-token prompts.
CONTEXT_LENGTH = 131072


def make_config() -> dict:
    """The ``config.json`` dict: every field SGLang's KimiLinearConfig / KimiLinearForCausalLM
    and ModelConfig read, with the real checkpoint's names."""
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": MLA_HEADS,
        "num_key_value_heads": MLA_HEADS,
        # The real config's top-level head_dim is hidden/heads (2304/32 = 72); SGLang's
        # ModelConfig hard-codes 72 for KimiLinear anyway and the MLA layer never reads it.
        "head_dim": HIDDEN // MLA_HEADS,
        "intermediate_size": DENSE_INTER,
        "hidden_act": "silu",
        "rms_norm_eps": RMS_EPS,
        "initializer_range": 0.02,
        "max_position_embeddings": CONTEXT_LENGTH,
        "model_max_length": CONTEXT_LENGTH,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "use_cache": True,
        "tie_word_embeddings": False,
        "pad_token_id": PAD_ID,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        # Weights are float32 on purpose: the target is a CPU engine (fp32 matmuls are the fast,
        # exact path there; bf16 without AMX is slow) and fp32 keeps engine-vs-reference checks
        # tight. NOTE: SGLang's `--dtype auto` maps a float32 config to float16 (vLLM legacy), so
        # serve with an explicit `--dtype float32` (or bfloat16).
        "dtype": "float32",
        "torch_dtype": "float32",
        # KDA
        "linear_attn_config": {
            "kda_layers": KDA_LAYERS_1BASED,
            "full_attn_layers": FULL_ATTN_LAYERS_1BASED,
            "num_heads": KDA_HEADS,
            "head_dim": KDA_HEAD_DIM,
            "short_conv_kernel_size": SHORT_CONV,
        },
        # MLA (NoPE, like Kimi-Linear: the rope slice exists but SGLang builds the layer with
        # skip_rope=True, so q_pe/k_pe enter the scores unrotated).
        "q_lora_rank": None,
        "kv_lora_rank": KV_LORA_RANK,
        "qk_nope_head_dim": QK_NOPE,
        "qk_rope_head_dim": QK_ROPE,
        "v_head_dim": V_HEAD,
        "mla_use_nope": True,
        # MoE
        "num_experts": NUM_EXPERTS,
        "num_experts_per_token": TOP_K,
        "num_shared_experts": NUM_SHARED,
        "moe_intermediate_size": MOE_INTER,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": MOE_RENORMALIZE,
        "routed_scaling_factor": ROUTED_SCALING_FACTOR,
        "use_grouped_topk": True,
        "num_expert_group": NUM_EXPERT_GROUP,
        "topk_group": TOPK_GROUP,
        "topk_method": "noaux_tc",
        "first_k_dense_replace": FIRST_K_DENSE,
        "moe_layer_freq": 1,
        "num_nextn_predict_layers": 0,
    }


KIMI_48B_FULL_ATTN_LAYERS = (4, 8, 12, 16, 20, 24, 27)
"""Kimi-Linear-48B-A3B's MLA layers (1-based, as its config lists them); the rest are KDA."""


def kimi_linear_48b_config() -> dict:
    """Kimi-Linear-48B-A3B's config.json at full shape (the values SGLang's resolution, the
    launch plan and a dummy-weight serve read): ``tests/test_cuda_launch.py`` plans with it, and
    ``benchmark/gpu_full_shape.py`` serves it with random weights on one GPU."""
    cfg = make_config()
    cfg.update(
        hidden_size=2304, num_hidden_layers=27, num_attention_heads=32, num_key_value_heads=32,
        head_dim=128, intermediate_size=9216, vocab_size=163840, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, num_experts=256,
        num_experts_per_token=8, moe_intermediate_size=1024, torch_dtype="bfloat16",
        dtype="bfloat16", num_expert_group=1, topk_group=1,
    )  # fmt: skip
    full = list(KIMI_48B_FULL_ATTN_LAYERS)
    cfg["linear_attn_config"] = {
        "kda_layers": [i for i in range(1, 28) if i not in full],
        "full_attn_layers": full,
        "num_heads": 32,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
    }
    return cfg


def make_generation_config() -> dict:
    """``generation_config.json``: greedy-friendly defaults; both [EOS] and <|im_end|> stop."""
    return {
        "bos_token_id": BOS_ID,
        "eos_token_id": [EOS_ID, IM_END_ID],
        "pad_token_id": PAD_ID,
        "max_length": CONTEXT_LENGTH,
    }


# ---------------------------------------------------------------------------------------------
# Corpus: English-like sentences from embedded word lists and a fixed-seed RNG.
# ---------------------------------------------------------------------------------------------
_NOUNS = (
    "river mountain garden window teacher doctor farmer engine market village city forest "
    "ocean island bridge tower castle kitchen library student author painter sailor soldier "
    "merchant child mother father brother sister friend neighbor stranger captain king queen "
    "horse dog cat bird fish wolf bear fox rabbit lion tiger eagle owl snake dragon robot "
    "computer machine lamp table chair door wall road street train ship boat plane car wheel "
    "letter book story song poem picture map clock key box bottle cup plate bread apple cheese "
    "soup coffee tea water fire stone metal glass paper wood cloud rain snow wind storm star "
    "moon sun sky light shadow morning evening night winter summer spring autumn season year "
    "question answer problem idea plan reason result number language word voice music dream "
    "memory secret journey adventure festival game lesson office school museum theater hospital "
    "station harbor valley desert field meadow lake hill cave path corner village garden"
).split()
_IRREGULAR_PLURALS = {
    "child": "children",
    "wolf": "wolves",
    "fish": "fish",
    "city": "cities",
    "story": "stories",
    "library": "libraries",
    "valley": "valleys",
}
_VERBS = (
    "walk talk open close carry watch follow visit paint build answer study travel cook clean "
    "play call help move turn start finish remember forget explain describe discover explore "
    "imagine measure collect deliver repair protect climb cross enter leave guard wander listen "
    "borrow count dance laugh learn notice pull push reach share shout smile wait wish wonder "
    "jump kick knock hunt fill mark plant print rescue return search sign water"
).split()
_IRREGULAR_PAST = {"build": "built", "leave": "left", "forget": "forgot"}
_ADJECTIVES = (
    "old young small large quiet loud bright dark warm cold happy sad quick slow brave gentle "
    "strange famous hidden golden silver green blue red white black tall short heavy light "
    "clever curious careful busy empty full ancient modern simple difficult beautiful tired "
    "hungry kind proud calm wild distant narrow wide deep soft rough sharp sweet bitter clean "
    "dusty broken lucky lonely"
).split()
_ADVERBS = (
    "slowly quickly quietly loudly carefully happily sadly suddenly finally often never always "
    "again together alone early late soon yesterday today tomorrow gently bravely"
).split()
_NAMES = (
    "Alice Bob Clara David Emma Felix Grace Henry Iris Jack Karen Leo Maya Nora Oscar Paul "
    "Rosa Sam Tara Victor Wendy Yuri Zoe"
).split()
_PLACES = (
    "Paris London Berlin Tokyo Cairo Lima Oslo Rome Madrid Vienna Dublin Prague Athens Seoul"
).split()
_PREPOSITIONS = "in on near under over behind beside across through along into from with".split()
_CONNECTORS = ("and then", "but", "because", "so", "while", "after that", "before")


def _plural(noun: str) -> str:
    """English plural of ``noun`` (good enough for the embedded list)."""
    if noun in _IRREGULAR_PLURALS:
        return _IRREGULAR_PLURALS[noun]
    if noun.endswith(("s", "x", "ch", "sh")):
        return noun + "es"
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"


def _past(verb: str) -> str:
    """Simple past of ``verb``."""
    if verb in _IRREGULAR_PAST:
        return _IRREGULAR_PAST[verb]
    if verb.endswith("e"):
        return verb + "d"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ied"
    return verb + "ed"


def _third_person(verb: str) -> str:
    """Third-person singular present of ``verb``."""
    if verb.endswith(("s", "x", "ch", "sh", "o")):
        return verb + "es"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + "s"


def _sentence(rng: random.Random) -> str:
    """One random sentence from a handful of templates."""
    c = rng.choice

    def np_() -> str:  # noun phrase
        r = rng.random()
        if r < 0.45:
            return f"the {c(_ADJECTIVES)} {c(_NOUNS)}"
        if r < 0.7:
            return f"the {c(_NOUNS)}"
        if r < 0.85:
            return f"a {c(_ADJECTIVES)} {c(_NOUNS)}"
        return f"{rng.randint(2, 99)} {_plural(c(_NOUNS))}"

    kind = rng.randrange(8)
    if kind == 0:
        s = f"{np_()} {_past(c(_VERBS))} {np_()} {c(_PREPOSITIONS)} {np_()}."
    elif kind == 1:
        s = f"{c(_NAMES)} {_third_person(c(_VERBS))} {c(_ADVERBS)} {c(_PREPOSITIONS)} {np_()}."
    elif kind == 2:
        s = f"why does {np_()} {c(_VERBS)} {np_()}?"
    elif kind == 3:
        s = (
            f"in {rng.randint(1800, 2030)}, {c(_NAMES)} {_past(c(_VERBS))} to {c(_PLACES)} "
            f"with {np_()}."
        )
    elif kind == 4:
        s = (
            f"{np_()} was {c(_ADJECTIVES)}, {c(_CONNECTORS)} {np_()} {_past(c(_VERBS))} "
            f"{c(_ADVERBS)}."
        )
    elif kind == 5:
        s = f'{c(_NAMES)} said: "{np_()} is {c(_ADJECTIVES)} and {c(_ADJECTIVES)}."'
    elif kind == 6:
        s = f"there are {rng.randint(2, 12)} {_plural(c(_NOUNS))} {c(_PREPOSITIONS)} {np_()}."
    else:
        s = f"can you {c(_VERBS)} {np_()} {c(_ADVERBS)}? yes, {c(_NAMES)} can."
    return s[0].upper() + s[1:]


@lru_cache(maxsize=1)
def corpus_text() -> str:
    """The tokenizer's training corpus (~150 KB, generated, deterministic, seed-independent)."""
    rng = random.Random(CORPUS_SEED)
    paragraphs = []
    for _ in range(CORPUS_SENTENCES // 6):
        paragraphs.append(" ".join(_sentence(rng) for _ in range(6)))
    return "\n\n".join(paragraphs) + "\n"


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------
def train_tokenizer() -> "tokenizers.Tokenizer":  # noqa: F821 (lazy import)
    """Byte-level BPE (GPT-2 style pre-tokenisation), vocab exactly :data:`VOCAB_SIZE`, with the
    special tokens at ids 0..7. The BPE trainer breaks count ties by pair order, so training is
    deterministic; the result is checked against the expected vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text().split("\n\n"), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, want {VOCAB_SIZE}")
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok


def _tokenizer_config() -> dict:
    """``tokenizer_config.json`` for ``PreTrainedTokenizerFast`` (transformers 4 and 5)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "additional_special_tokens": list(SPECIAL_TOKENS[3:]),
        "clean_up_tokenization_spaces": False,
        "model_max_length": CONTEXT_LENGTH,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, t in enumerate(SPECIAL_TOKENS)
        },
    }


def _special_tokens_map() -> dict:
    return {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": list(SPECIAL_TOKENS[3:]),
    }


def _bigram_counts(tok: "tokenizers.Tokenizer") -> torch.Tensor:  # noqa: F821
    """[V, V] float64 bigram counts of the tokenised corpus (sentence boundaries included)."""
    pairs: list[int] = []
    for enc in tok.encode_batch(corpus_text().split("\n\n")):
        ids = enc.ids
        pairs.extend(a * VOCAB_SIZE + b for a, b in zip(ids[:-1], ids[1:]))
    counts = torch.bincount(
        torch.tensor(pairs, dtype=torch.int64), minlength=VOCAB_SIZE * VOCAB_SIZE
    )
    return counts.to(torch.float64).view(VOCAB_SIZE, VOCAB_SIZE)


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------
def _gen(seed: int, name: str) -> torch.Generator:
    """An independent generator per (seed, tensor): adding a tensor never shifts the others."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _normal(seed: int, name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
    return torch.randn(shape, generator=_gen(seed, name), dtype=torch.float64) * std


def _uniform(seed: int, name: str, shape: tuple[int, ...], lo: float, hi: float) -> torch.Tensor:
    return lo + (hi - lo) * torch.rand(shape, generator=_gen(seed, name), dtype=torch.float64)


def _linear(seed: int, name: str, out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
    """[out, in] weight with std gain/sqrt(in): keeps activations O(1) like a trained net."""
    return _normal(seed, name, (out_f, in_f), gain / math.sqrt(in_f))


def _norm(seed: int, name: str, dim: int) -> torch.Tensor:
    """RMSNorm weight ~1 with a little spread so a swapped/misloaded norm is detectable."""
    return 1.0 + _normal(seed, name, (dim,), 0.1)


def _orthonormal_columns(x: torch.Tensor) -> torch.Tensor:
    """[N, M] -> [N, M] with orthonormal columns spanning the same space (Cholesky-QR applied
    twice; only matmul + Cholesky + triangular solve, all float64)."""
    for _ in range(2):
        chol = torch.linalg.cholesky(x.t() @ x)
        x = torch.linalg.solve_triangular(chol, x.t(), upper=False).t()
    return x


def _embeddings(seed: int, bigrams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``embed_tokens`` [V, H] and ``lm_head`` [V, H] carrying the corpus bigram model.

    Target: centred, smoothed, floored bigram log-probs ``L[a, b] ~ log P(b | a)`` ([V, V]).
    A rank-H factorisation ``L ~ (Q) (Q^T L)`` comes from a seeded randomized range finder
    (Q = orthonormal basis of ``L L^T L R`` for a random R [V, H]); embeddings are the rows of
    Q rescaled to rms 1 (plus a little noise so tokens unseen in the corpus stay distinct) and
    lm_head is the least-squares fit ``emb @ lm_head.T ~ gain * L``. A hidden state close to its
    input embedding thus predicts a plausible next token (greedy bigram chains read like the
    corpus), and the attention / MoE layers perturb that enough to make continuations
    prompt-specific. Float64 throughout.
    """
    V = VOCAB_SIZE
    unigram = bigrams.sum(dim=0) + bigrams.sum(dim=1) + 0.01
    unigram = unigram / unigram.sum()
    cond = (bigrams + 0.1 * unigram) / (bigrams.sum(dim=1, keepdim=True) + 0.1)
    target = cond.log().clamp_min(-7.0)
    target = target - target.mean(dim=1, keepdim=True)
    probe = _normal(seed, "embed_basis", (V, HIDDEN), 1.0)
    basis = _orthonormal_columns(target @ (target.t() @ (target @ probe)))
    emb = basis * math.sqrt(V) + _normal(seed, "model.embed_tokens.weight", (V, HIDDEN), 0.1)
    emb = emb / emb.pow(2).mean(dim=1, keepdim=True).sqrt()
    # Least-squares lm_head for the final (row-normalised) embeddings: emb @ head.T ~ target.
    # Fitting after the normalisation keeps every token's logits in the same range.
    head = torch.linalg.solve(emb.t() @ emb, emb.t() @ target).t() * LOGIT_GAIN
    head = head + _normal(seed, "lm_head.weight", (V, HIDDEN), 0.01)
    return emb, head


def _make_weights(seed: int, bigrams: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """All checkpoint tensors (float64 here), named exactly like the Kimi-Linear HF checkpoint.

    Shapes (H = hidden 128; KDA: h=4 heads, d=32, W=4; MLA: 4 heads, nope 32, rope 16, v 32,
    kv_lora 64; MoE: 8 experts, inter 64, 1 shared expert):

    * KDA ``self_attn``: q/k/v_proj [h*d, H]; b_proj [h, H]; f_a_proj, g_a_proj [d, H];
      f_b_proj, g_b_proj [h*d, d]; q/k/v_conv1d [h*d, 1, W] (nn.Conv1d depthwise layout, which
      SGLang's fused qkv_conv1d param has after its unsqueeze(1)); A_log [1, 1, h, 1] (SGLang
      shards dim 2); dt_bias [h*d]; o_norm [d]; o_proj [H, h*d]. No biases.
    * MLA ``self_attn``: q_proj [4*(32+16), H]; kv_a_proj_with_mqa [64+16, H]; kv_a_layernorm
      [64]; kv_b_proj [4*(32+32), 64]; o_proj [H, 4*32].
    * dense ``mlp``: gate_proj/up_proj [256, H], down_proj [H, 256].
    * ``block_sparse_moe``: gate.weight [8, H], gate.e_score_correction_bias [8];
      experts.E.w1/w3 [64, H] (gate/up), experts.E.w2 [H, 64] (down);
      shared_experts.gate_proj/up_proj [64, H], shared_experts.down_proj [H, 64].
    """
    w: dict[str, torch.Tensor] = {}
    if bigrams is None:  # shapes only (see expected_weight_shapes)
        emb = head = torch.zeros(VOCAB_SIZE, HIDDEN, dtype=torch.float64)
    else:
        emb, head = _embeddings(seed, bigrams)
    w["model.embed_tokens.weight"] = emb
    w["lm_head.weight"] = head
    w["model.norm.weight"] = _norm(seed, "model.norm.weight", HIDDEN)
    proj = KDA_HEADS * KDA_HEAD_DIM
    # Residual-branch outputs use a smaller gain so the stream stays dominated by the token
    # embedding (bigram signal) while every layer still visibly moves the logits.
    out_gain = OUT_GAIN
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = _norm(seed, p + "input_layernorm.weight", HIDDEN)
        w[p + "post_attention_layernorm.weight"] = _norm(
            seed, p + "post_attention_layernorm.weight", HIDDEN
        )
        a = p + "self_attn."
        if (i + 1) in KDA_LAYERS_1BASED:
            for n in ("q_proj", "k_proj", "v_proj"):
                w[a + n + ".weight"] = _linear(seed, a + n, proj, HIDDEN)
            for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
                # Short conv: nn.Conv1d's default U(+-1/sqrt(W)) plus a dominant current-token
                # tap (index W-1), as trained short convs look.
                conv = _uniform(seed, a + n, (proj, 1, SHORT_CONV), -0.5, 0.5)
                conv[:, :, -1] += 1.0
                w[a + n + ".weight"] = conv
            # beta = sigmoid(b_proj x): ~N(0, 0.5) logits -> beta mostly in [0.3, 0.7].
            w[a + "b_proj.weight"] = _linear(seed, a + "b_proj", KDA_HEADS, HIDDEN, 0.5)
            # Forget gate g = -exp(A_log) * softplus(f_b(f_a x) + dt_bias). Mamba init:
            # softplus(dt_bias) log-uniform in [1e-3, 0.1], A = exp(A_log) uniform in [1, 16];
            # f is small (std ~0.3) so the per-token log-decay median is ~ -0.1.
            dt = torch.exp(_uniform(seed, a + "dt", (proj,), math.log(1e-3), math.log(1e-1)))
            w[a + "dt_bias"] = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
            w[a + "A_log"] = torch.log(_uniform(seed, a + "A", (KDA_HEADS,), 1.0, 16.0)).view(
                1, 1, KDA_HEADS, 1
            )
            w[a + "f_a_proj.weight"] = _linear(seed, a + "f_a_proj", KDA_HEAD_DIM, HIDDEN)
            w[a + "f_b_proj.weight"] = _linear(seed, a + "f_b_proj", proj, KDA_HEAD_DIM, 0.3)
            w[a + "g_a_proj.weight"] = _linear(seed, a + "g_a_proj", KDA_HEAD_DIM, HIDDEN)
            w[a + "g_b_proj.weight"] = _linear(seed, a + "g_b_proj", proj, KDA_HEAD_DIM)
            w[a + "o_norm.weight"] = _norm(seed, a + "o_norm.weight", KDA_HEAD_DIM)
            w[a + "o_proj.weight"] = _linear(seed, a + "o_proj", HIDDEN, proj, out_gain)
        else:
            qk = QK_NOPE + QK_ROPE
            w[a + "q_proj.weight"] = _linear(seed, a + "q_proj", MLA_HEADS * qk, HIDDEN)
            w[a + "kv_a_proj_with_mqa.weight"] = _linear(
                seed, a + "kv_a_proj_with_mqa", KV_LORA_RANK + QK_ROPE, HIDDEN
            )
            w[a + "kv_a_layernorm.weight"] = _norm(seed, a + "kv_a_layernorm.weight", KV_LORA_RANK)
            w[a + "kv_b_proj.weight"] = _linear(
                seed, a + "kv_b_proj", MLA_HEADS * (QK_NOPE + V_HEAD), KV_LORA_RANK
            )
            w[a + "o_proj.weight"] = _linear(
                seed, a + "o_proj", HIDDEN, MLA_HEADS * V_HEAD, out_gain
            )
        if i < FIRST_K_DENSE:
            m = p + "mlp."
            w[m + "gate_proj.weight"] = _linear(seed, m + "gate_proj", DENSE_INTER, HIDDEN)
            w[m + "up_proj.weight"] = _linear(seed, m + "up_proj", DENSE_INTER, HIDDEN)
            w[m + "down_proj.weight"] = _linear(
                seed, m + "down_proj", HIDDEN, DENSE_INTER, out_gain
            )
        else:
            m = p + "block_sparse_moe."
            # Router logits ~N(0, 1.5^2) so sigmoid scores spread over (0, 1); the correction
            # bias is the same order as score gaps so it really changes the selection. It is
            # non-negative so every biased score is > 0: Moonshot's published modelling code
            # fills the experts of dropped groups with 0.0 where SGLang and transformers use
            # -inf, and the two only pick differently when a kept expert scores below 0.
            w[m + "gate.weight"] = _linear(seed, m + "gate", NUM_EXPERTS, HIDDEN, 1.5)
            w[m + "gate.e_score_correction_bias"] = _uniform(
                seed, m + "gate.e_score_correction_bias", (NUM_EXPERTS,), 0.0, 0.3
            )
            for e in range(NUM_EXPERTS):
                x = f"{m}experts.{e}."
                w[x + "w1.weight"] = _linear(seed, x + "w1", MOE_INTER, HIDDEN)
                w[x + "w3.weight"] = _linear(seed, x + "w3", MOE_INTER, HIDDEN)
                # Trained experts are calibrated to the factor their output is multiplied by.
                w[x + "w2.weight"] = _linear(
                    seed, x + "w2", HIDDEN, MOE_INTER, out_gain / ROUTED_SCALING_FACTOR
                )
            s = m + "shared_experts."
            inter = MOE_INTER * NUM_SHARED
            w[s + "gate_proj.weight"] = _linear(seed, s + "gate_proj", inter, HIDDEN)
            w[s + "up_proj.weight"] = _linear(seed, s + "up_proj", inter, HIDDEN)
            w[s + "down_proj.weight"] = _linear(seed, s + "down_proj", HIDDEN, inter, out_gain)
    return w


def expected_weight_shapes() -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in ``model.safetensors`` (cheap: no tokenizer needed)."""
    return {k: tuple(v.shape) for k, v in _make_weights(0, None).items()}


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------
def _json_bytes(obj: dict) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


def _render_files(seed: int) -> dict[str, bytes]:
    """Every file of the model directory (except the manifest) as bytes."""
    from safetensors.torch import save as st_save

    tok = train_tokenizer()
    weights = _make_weights(seed, _bigram_counts(tok))
    tensors = {k: weights[k].to(torch.float32).contiguous() for k in sorted(weights)}
    return {
        "config.json": _json_bytes(make_config()),
        "generation_config.json": _json_bytes(make_generation_config()),
        "tokenizer.json": tok.to_str(pretty=True).encode() + b"\n",
        "tokenizer_config.json": _json_bytes(_tokenizer_config()),
        "special_tokens_map.json": _json_bytes(_special_tokens_map()),
        "model.safetensors": st_save(tensors, metadata={"format": "pt"}),
    }


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def is_complete(path: str | os.PathLike, seed: int = 0) -> bool:
    """True when ``path`` holds this generator version's model for ``seed``, unmodified."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("version") != GENERATOR_VERSION or manifest.get("seed") != seed:
        return False
    files = manifest.get("files") or {}
    if not files:
        return False
    return all((path / n).is_file() and _sha256_file(path / n) == h for n, h in files.items())


def _write_atomic(path: Path, data: bytes) -> None:
    # Concurrent builders (e.g. parallel test workers) write identical bytes; tmp + replace
    # keeps readers from ever seeing a half-written file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def build_tiny_model(path: str | os.PathLike, seed: int = 0) -> Path:
    """Write the tiny Kimi-Linear model for ``seed`` into ``path`` and return it.

    Idempotent: returns immediately when ``path`` already has a matching, intact manifest.
    Files from an older version / other seed are overwritten (the manifest is removed first and
    written last, so an interrupted build is never mistaken for a complete one).
    """
    path = Path(path)
    if is_complete(path, seed):
        return path
    path.mkdir(parents=True, exist_ok=True)
    # Several processes may build the same directory at once (parallel test workers, two
    # servers started together): one builds under an exclusive lock, the others wait and find
    # it complete.
    with open(path.with_name(f".{path.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_complete(path, seed):
            return path
        (path / MANIFEST_NAME).unlink(missing_ok=True)
        files = _render_files(seed)
        for name, data in files.items():
            _write_atomic(path / name, data)
        manifest = {
            "generator": "sglang_kda.tiny_model",
            "version": GENERATOR_VERSION,
            "seed": seed,
            "files": {n: hashlib.sha256(d).hexdigest() for n, d in sorted(files.items())},
        }
        _write_atomic(path / MANIFEST_NAME, _json_bytes(manifest))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_kda.tiny_model",
        description="Write the tiny seeded Kimi-Linear model directory (offline).",
    )
    parser.add_argument("dir", type=Path, help="output model directory")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    args = parser.parse_args(argv)
    out = build_tiny_model(args.dir, seed=args.seed)
    n_params = sum(math.prod(s) for s in expected_weight_shapes().values())
    print(f"{out}: Kimi-Linear tiny model, seed {args.seed}, {n_params:,} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
