"""The cost model's file: reading and writing a calibration, and where the server keeps one.

:class:`~sglang_kda.policy.cost_model.CostModel` is plain (``to_dict`` / ``from_dict`` are the
file's contents); the files are read and written here. The server loads its fit at start and
saves it back (:mod:`sglang_kda.wiring.budget`); the simulator loads a calibration
(:mod:`sglang_kda.sim.costs`) and the validation writes one (:mod:`sglang_kda.sim.validate`).

Without ``--kda-cost-model FILE`` the server keeps its fit in a cache file per model, device and
dtype (:func:`cache_key`): ``$SGLANG_KDA_CACHE_DIR`` (or ``~/.cache/sglang_kda``)
``/cost_model/<key>.json`` (:func:`default_cache_path`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from sglang_kda.policy.cost_model import CostModel


def save(
    model: CostModel, path: str | os.PathLike, key: str = "", extra: dict | None = None
) -> None:
    """Write ``model`` (and ``extra`` fields beside it) to ``path``, replacing the file whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({**model.to_dict(key), **(extra or {})}, indent=1))
    os.replace(tmp, path)


def load(path: str | os.PathLike) -> CostModel:
    """The cost model written at ``path`` (``ValueError`` for another file format)."""
    return CostModel.from_dict(json.loads(Path(path).read_text()))


def implausible(model: CostModel) -> str | None:
    """Why ``model`` must not plan rounds (``None``: it may): it prices a prompt's tokens at
    nothing, per token and per KDA step both 0. A fit can end there (the non-negative fit puts
    every prefill second on the attention term when the window's prompts are all short), and
    saved to the shared cache file it planned every later server: on the CPU server a model with
    only the attention terms left kept six short prompts waiting 8.0 s behind a 32k prefill
    (head_of_line.py --scenario arrivals) where a fresh fit let them in within 1.4 s."""
    c = model.coef
    if c.per_token <= 0 and c.per_kda_step <= 0:
        return "it prices prefill tokens at 0 (per_token and per_kda_step both 0)"
    return None


def cache_key(model: str, device: str, dtype: str) -> str:
    """The cache key of a calibration: model (its directory name), device and dtype."""
    name = Path(str(model).rstrip("/")).name or str(model)
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in f"{name}-{device}-{dtype}")
    return safe


def default_cache_path(key: str) -> Path:
    """``$SGLANG_KDA_CACHE_DIR`` (or ``~/.cache/sglang_kda``) ``/cost_model/<key>.json``."""
    root = os.environ.get("SGLANG_KDA_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "sglang_kda"
    )
    return Path(root) / "cost_model" / f"{key}.json"
