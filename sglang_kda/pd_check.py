"""Which settings a PD prefill server and its decode server must share, and the check a decode
server runs on each prefill server it meets (``patches/disaggregation_conn.py`` wires it in).

The decode server receives raw bytes: KV pages addressed by page id and KDA state slots (the
recurrent state and the short-conv state), written into its own pools at its own item sizes.
They mean the same thing on both sides only if both servers run

- the same model (``--served-model-name``, which defaults to ``--model-path``: the weights that
  produced the KV and states, and the layer shapes);
- the same ``--page-size`` (pages are sent by id);
- the same KV dtype (``--kv-cache-dtype``, where ``auto`` means ``--dtype``);
- the same ``--dtype`` (under sglang_kda's launcher it also sets the conv-state dtype:
  ``SGLANG_MAMBA_CONV_DTYPE=float32`` for a float32 model);
- the same ``--mamba-ssm-dtype`` (the recurrent state's dtype; unset = the model config's).

Free to differ (they change how the prefill server computes or caches, not what it sends):
``--kda-policy``, ``--kda-kernel`` (every kernel writes SGLang's state layout, which the decode
kernels read), ``--kda-checkpoint-every`` and the other checkpoint-cache flags, SGLang's
``--enable-int8-mamba-checkpoint`` (it quantises the tree's checkpoints only; the request's own
live state, the one sent, stays in the state pool's dtype), the budget flags, chunk sizes and
TP sizes (SGLang reslices MLA KV across TP sizes).

Not checked: a ``SGLANG_MAMBA_CONV_DTYPE`` set by hand on one side only (an environment
variable, not in ``/server_info``).

Also here: :class:`EarlyAborts`, the prefill side's memory of abort notices that arrived before
the request they name (the same patch wires it in).

A plain module: no SGLang import.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Hashable, Mapping

MUST_AGREE: tuple[tuple[str, str], ...] = (
    ("model", "--served-model-name (defaults to --model-path)"),
    ("page_size", "--page-size"),
    ("kv_dtype", "--kv-cache-dtype (auto = --dtype)"),
    ("dtype", "--dtype"),
    ("mamba_ssm_dtype", "--mamba-ssm-dtype"),
)
"""(key of :func:`transfer_settings`, the flag a user changes to fix a mismatch)."""

FIELDS = ("served_model_name", "model_path", "page_size", "kv_cache_dtype", "dtype",
          "mamba_ssm_dtype")  # fmt: skip
"""The ``ServerArgs`` fields :func:`transfer_settings` reads."""


def _text(value: Any) -> str | None:
    if value is None:
        return None
    text = str(value)
    return text[len("torch.") :] if text.startswith("torch.") else text


def model_ssm_dtype(config: Mapping[str, Any] | None) -> str:
    """The recurrent-state dtype a server takes without ``--mamba-ssm-dtype``: the model
    config's ``mamba_ssm_dtype`` (``text_config``'s for VL models), else float32 (SGLang's
    ``mamba2_state_dtype``)."""
    config = config or {}
    text = config.get("text_config") or {}
    return str(text.get("mamba_ssm_dtype") or config.get("mamba_ssm_dtype") or "float32")


def transfer_settings(
    get: Callable[[str], Any] | Mapping[str, Any], ssm_default: str = "float32"
) -> dict[str, str | None]:
    """The settings of :data:`MUST_AGREE` from a server's arguments: ``get`` reads one
    ``ServerArgs`` field (or a mapping, such as ``/server_info``'s resolved fields);
    ``ssm_default``: the state dtype without ``--mamba-ssm-dtype`` (:func:`model_ssm_dtype` of
    the model both sides should run)."""
    read = get.get if isinstance(get, Mapping) else get
    dtype = _text(read("dtype"))
    kv = _text(read("kv_cache_dtype"))
    page = read("page_size")
    return {
        "model": _text(read("served_model_name") or read("model_path")),
        "page_size": str(int(page)) if page is not None else "1",
        "kv_dtype": dtype if kv in (None, "auto") else kv,
        "dtype": dtype,
        "mamba_ssm_dtype": _text(read("mamba_ssm_dtype")) or ssm_default,
    }


def mismatches(prefill: Mapping[str, Any], decode: Mapping[str, Any]) -> list[str]:
    """One line per setting of :data:`MUST_AGREE` on which the two sides differ, naming the
    flag and both values; [] when they agree."""
    return [
        f"{flag}: prefill {prefill.get(key)!r}, decode {decode.get(key)!r}"
        for key, flag in MUST_AGREE
        if prefill.get(key) != decode.get(key)
    ]


def refusal(bootstrap_addr: str, lines: list[str]) -> str:
    """The error a request gets (and the decode server logs) when its prefill server's settings
    differ from the decode server's."""
    return (
        f"sglang_kda: prefill server {bootstrap_addr} and this decode server differ on flags that "
        f"must agree for the KV and KDA state transfer: {'; '.join(lines)}. Start both with the "
        "same values (docs/scale-out.md, PD). Requests through this prefill server fail until it "
        "is restarted."
    )


class EarlyAborts:
    """Abort notices a PD prefill server received for requests it has not registered yet.

    The router sends each request to both servers at once. A decode server that fails a request
    at its handshake (a refused prefill server, a client abort) notifies the prefill server at
    once, and that notice can arrive before the prefill server has registered the request's
    bootstrap room. Upstream drops a notice for an unknown room, so the prefill half then waits
    for a handshake that never comes until its bootstrap timeout (300 s by default), and the
    client with it. The notice is kept here for ``ttl`` seconds instead; the room fails as soon
    as it is registered (:meth:`take`).

    Thread-safe: notices come in on the transfer backend's thread, rooms open on the scheduler's.
    """

    def __init__(self, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl, self.clock = ttl, clock
        self._expiry: dict[Hashable, float] = {}
        self._lock = threading.Lock()
        self.kept = 0  # notices kept for rooms unknown when they came
        self.taken = 0  # rooms failed at registration by a kept notice

    def _prune(self, now: float) -> None:
        for room in [r for r, t in self._expiry.items() if t <= now]:
            del self._expiry[room]

    def note(self, room: Hashable) -> None:
        """A notice for ``room``, which the prefill server does not know (yet)."""
        with self._lock:
            now = self.clock()
            self._prune(now)
            self._expiry[room] = now + self.ttl
            self.kept += 1

    def take(self, room: Hashable) -> bool:
        """Whether a notice for ``room`` came before it was registered (forgotten once asked)."""
        with self._lock:
            self._prune(self.clock())
            found = self._expiry.pop(room, None) is not None
            self.taken += found
            return found

    def __len__(self) -> int:
        with self._lock:
            self._prune(self.clock())
            return len(self._expiry)


EARLY_ABORT_REASON = (
    "sglang_kda: the decode server aborted this request before this prefill server registered "
    "it (the decode side failed it at its handshake; its error says why)"
)
"""The failure a prefill server records for a room failed by a kept early abort notice."""
