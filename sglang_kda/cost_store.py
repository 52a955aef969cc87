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
