"""Run ``sglang_kda.launch_server.main``'s CUDA branch on a CPU machine posing as an H200 node.

Used by tests/test_cuda_launch.py in a fresh interpreter (the stubs must precede every SGLang
import, and SGLang caches platform facts per process)::

    python tests/h200_stub.py '[["--model-path", DIR, "--tp", "4"], ...]'

What is stubbed is only what a CPU machine cannot answer: ``torch.cuda`` says 8 devices of
143,771 MiB, compute capability 9.0; SGLang's platform facts are set through its own seam
(``sglang.srt.runtime_context.override_platform``: CUDA, sm90, flashinfer present); its GPU
memory probe (``get_device_memory_capacity``, which runs ``nvidia-smi``) answers 143,771 MiB.
Everything else is real: SGLang's argument parsing and resolution pipeline, sglang_kda's plugin
and patches, the launcher's refusals and checkpoint plan. ``run_server`` is replaced by a
recorder, so nothing is spawned.

Prints one JSON line per argv: ``rc``, the resolved fields, the config the launcher exported
(``SGLANG_KDA_*``), and the launcher's stderr.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import types

H200_MIB = 143771
GPU_FIELDS = (
    "device",
    "page_size",
    "chunked_prefill_size",
    "max_prefill_tokens",
    "mem_fraction_static",
    "attention_backend",
    "mamba_radix_cache_strategy",
    "disable_overlap_schedule",
    "tp_size",
    "linear_attn_prefill_backend",
    "linear_attn_decode_backend",
    "mamba_track_interval",
)


def install_h200() -> None:
    import torch

    props = types.SimpleNamespace(
        name="NVIDIA H200",
        total_memory=H200_MIB * 2**20,
        major=9,
        minor=0,
        multi_processor_count=132,
    )
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 8
    torch.cuda.get_device_properties = lambda i=0: props
    torch.cuda.get_device_capability = lambda i=0: (9, 0)
    torch.cuda.get_device_name = lambda i=0: props.name
    torch.cuda.mem_get_info = lambda i=0: (props.total_memory - 2**30, props.total_memory)

    from sglang.srt.runtime_context import override_platform

    override_platform(
        is_cuda=True, is_hip=False, is_npu=False, is_xpu=False, is_musa=False, is_mps=False,
        is_sm90=True, is_sm100=False, is_sm100_or_sm110=False, is_sm110=False, is_sm120=False,
        is_blackwell=False, is_hopper_with_cuda_12_3=True, has_amx=False, has_flashinfer=True,
        device_sm=90, device_capability=(9, 0),
    ).install()  # fmt: skip
    import sglang.srt.arg_groups.memory_hook as memory_hook
    import sglang.srt.utils.common as common

    def capacity(device=None):
        return float(H200_MIB)

    common.get_device_memory_capacity = capacity
    memory_hook.get_device_memory_capacity = capacity


def run(argv: list[str]) -> dict:
    import sglang.launch_server as sglang_launch

    from sglang_kda import launch_server

    seen: dict = {}

    def record(server_args):
        seen["args"] = server_args

    sglang_launch.run_server = record
    before = {k: v for k, v in os.environ.items() if k.startswith("SGLANG_KDA_")}
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = launch_server.main(list(argv))
    out = {"rc": rc, "stderr": err.getvalue(), "resolved": None}
    out["env"] = {k: v for k, v in os.environ.items() if k.startswith("SGLANG_KDA_")}
    for k in set(os.environ) - set(before):  # each run starts from the same environment
        if k.startswith("SGLANG_KDA_"):
            del os.environ[k]
    for k, v in before.items():
        os.environ[k] = v
    if "args" in seen:
        args = seen["args"]
        args.resolve_once()  # what run_server does first (a no-op when the plan already ran it)
        out["resolved"] = {f: _plain(launch_server.resolved(args, f)) for f in GPU_FIELDS}
    return out


def _plain(v):
    return v if isinstance(v, (int, float, str, bool, type(None))) else str(v)


def main() -> int:
    cases = json.loads(sys.argv[1])
    install_h200()
    for argv in cases:
        print(json.dumps(run(argv)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
