"""SGLang's CPU engine with ``extra_buffer``: the platform plugin and the two CPU stand-ins.

:mod:`sglang_kda.cpu.platform` is selected only by name (``SGLANG_PLATFORM``), and then SGLang's
one refusal of ``extra_buffer`` on CPU (``mamba_hook._platform_supports_mamba_cache_extra_buffer``)
answers yes while everything else stays SGLang's CPU platform. The decode track copies of
:mod:`sglang_kda.cpu.mamba_track` copy what SGLang's Triton kernel copies, and the statement
``patches/schedule_batch.py`` completes is still the last of ``prepare_for_decode``.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from sglang_kda.cpu import mamba_track, platform

_PROBE = textwrap.dedent(
    """
    import json
    import sglang_kda
    from sglang.srt.arg_groups import mamba_hook
    from sglang.srt.platforms import current_platform as p
    print("PROBE " + json.dumps({
        "cls": type(p).__name__,
        "oot": p.is_out_of_tree(),
        "device": p.device_type,
        "dispatch": p.get_dispatch_key_name(),
        "extra_buffer": mamba_hook._platform_supports_mamba_cache_extra_buffer(),
    }))
    """
)


def _probe(**env) -> dict:
    full = {k: v for k, v in os.environ.items() if k != "SGLANG_PLATFORM"}
    full.update(SGLANG_USE_CPU_ENGINE="1", **env)
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], env=full, capture_output=True, text=True, timeout=600
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("PROBE ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("PROBE "))


def test_activate_answers_only_when_selected_by_name(monkeypatch):
    monkeypatch.delenv("SGLANG_PLATFORM", raising=False)
    monkeypatch.setenv("SGLANG_KDA_ENABLE", "1")
    assert platform.activate() is None  # SGLang's discovery in any process: inert
    monkeypatch.setenv("SGLANG_PLATFORM", platform.PLATFORM_NAME)
    assert platform.activate() == platform.QUALNAME


def test_selected_platform_is_sglangs_cpu_platform_with_extra_buffer():
    plain = _probe()
    assert plain == {
        "cls": "CpuSRTPlatform", "oot": False, "device": "cpu", "dispatch": "native",
        "extra_buffer": False,
    }  # fmt: skip
    ours = _probe(SGLANG_PLATFORM=platform.PLATFORM_NAME)
    assert ours == {
        "cls": "KDACpuPlatform", "oot": True, "device": "cpu", "dispatch": "cpu",
        "extra_buffer": True,
    }  # fmt: skip


@pytest.mark.parametrize("check_freed", [False, True])
def test_track_copies_copy_the_masked_rows_of_every_layer(check_freed):
    gen = torch.Generator().manual_seed(3)
    conv = torch.randn(3, 8, 2, 5, generator=gen)  # [layers, slots, W, D]
    ssm = torch.randn(3, 8, 2, 4, 4, generator=gen)
    src = torch.tensor([1, 2, 3, -1])
    dst = torch.tensor([5, 6, 7, 4])
    mask = torch.tensor([True, False, True, True])
    want_conv, want_ssm = conv.clone(), ssm.clone()
    rows = [0, 2] if check_freed else [0, 2, 3]  # a -1 source is skipped only when checked
    for r in rows:
        want_conv[:, dst[r]] = conv[:, src[r]]
        want_ssm[:, dst[r]] = ssm[:, src[r]]
    one_conv, one_ssm = conv[1].clone(), ssm[1].clone()
    mamba_track.track_mamba_states_all_layers(conv, ssm, src, mask, dst, 4, check_freed)
    assert torch.equal(conv, want_conv) and torch.equal(ssm, want_ssm)
    mamba_track.track_mamba_states_if_needed(one_conv, one_ssm, src, mask, dst, 4, check_freed)
    assert torch.equal(one_conv, want_conv[1]) and torch.equal(one_ssm, want_ssm[1])
    # rows past batch_size are not read
    before = conv.clone()
    mamba_track.track_mamba_states_all_layers(conv, ssm, src, mask, dst, 0, check_freed)
    assert torch.equal(conv, before)


def test_prepare_for_decode_still_ends_with_the_pinned_track_mask():
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    fn = getattr(ScheduleBatch, "_orig_prepare_for_decode", ScheduleBatch.prepare_for_decode)
    body = [ln.strip() for ln in inspect.getsource(fn).splitlines() if ln.strip()]
    assert body[-3:] == [
        "self.mamba_track_mask = track_mask_cpu.pin_memory().to(",
        "device=self.device, non_blocking=True",
        ")",
    ], "patches/schedule_batch.py completes this statement: re-read prepare_for_decode"
    assert sum("pin_memory()" in ln for ln in body) == 1


def test_the_track_mask_fallback_knows_both_torch_builds_pinning_errors():
    """The CPU wheel and the CUDA wheel without a GPU (the GPU kit over the H200 image's torch,
    started on a CPU machine) raise different messages when asked to pin; both finish the
    statement without pinning, anything else is raised."""
    from sglang_kda.patches import schedule_batch as patch

    messages = ["Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU"]
    messages.append("Cannot access accelerator device when none is available.")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError) as here:
            torch.zeros(1).pin_memory()
        messages.append(str(here.value))
    for message in messages:
        assert any(m in message for m in patch.NO_PINNING), message
    assert not any(m in "CUDA out of memory" for m in patch.NO_PINNING)
