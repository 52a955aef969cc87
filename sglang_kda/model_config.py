"""The served model's ``config.json``: read from a local model directory, else the hub's copy
SGLang fetches too. The launcher's checkpoint plan, the PD settings check and the host tier's
context length read it; plain Python (the hub client is imported only for a hub model)."""

from __future__ import annotations

import json
from pathlib import Path


def model_config_json(model_path: str, revision=None) -> dict | None:
    """The model's ``config.json`` (a local directory, else the hub's copy SGLang fetches too)."""
    local = Path(model_path) / "config.json"
    try:
        if local.is_file():
            return json.loads(local.read_text())
        from huggingface_hub import hf_hub_download

        return json.loads(
            Path(hf_hub_download(model_path, "config.json", revision=revision)).read_text()
        )
    except Exception:  # noqa: BLE001 - no config: the grid spacing stays
        return None
