"""The host tier's plain parts: the CPU copies behind HiCache's ``direct`` backend
(``sglang_kda/cpu/kvcacheio.py``, checked against per-row loops), the host pool's sizing in
states and the too-small warning (``sglang_kda/cache/host_tier.py``)."""

from __future__ import annotations

import torch

from sglang_kda.cache import host_tier
from sglang_kda.cpu import kvcacheio


def _layers(n_layers: int, rows: int, shape: tuple, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((rows, *shape), generator=g) for _ in range(n_layers)]


def test_direct_copies_round_trip_through_a_page_first_host_buffer():
    """Device layer-first -> host page-first (all layers) -> device (one layer at a time): every
    row lands where the indices say, for page size 1 (KDA states) and 4 (KV pages)."""
    for page, shape in ((1, (1, 3, 5)), (4, (1, 6))):
        layers, rows = 3, 16
        dev = _layers(layers, rows, shape, seed=page)
        host = torch.zeros((32 // page, layers, page, *shape))
        src = torch.tensor([2, 3, 4, 5, 8, 9, 10, 11][: 8 if page > 1 else 5])
        dst = torch.tensor([12, 13, 14, 15, 4, 5, 6, 7][: 8 if page > 1 else 5])
        kvcacheio.transfer_kv_all_layer_direct_lf_pf(dev, [host], src, dst, page)
        for layer in range(layers):
            for s, d in zip(src.tolist(), dst.tolist(), strict=True):
                assert torch.equal(host[d // page, layer, d % page], dev[layer][s])
        back = [torch.zeros_like(t) for t in dev]
        for layer in range(layers):
            to_device = kvcacheio.transfer_kv_per_layer_direct_pf_lf
            to_device([host], [back[layer]], dst, src, layer, page)
            for s in src.tolist():
                assert torch.equal(back[layer][s], dev[layer][s])
        untouched = [r for r in range(rows) if r not in src.tolist()]
        assert all(torch.count_nonzero(back[0][r]) == 0 for r in untouched)


def test_direct_layer_first_copy():
    a, b = _layers(2, 8, (4,), seed=3), [torch.zeros(8, 4) for _ in range(2)]
    kvcacheio.transfer_kv_direct(a, b, torch.tensor([1, 6]), torch.tensor([0, 7]), 1)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(y[0], x[1]) and torch.equal(y[7], x[6])
        assert torch.count_nonzero(y[1:7]) == 0


def test_cpu_host_alloc_never_pins():
    seen = {}

    def alloc(dims, dtype, device, pin_memory, allocator, **kw):
        seen.update(pin=pin_memory, **kw)
        return torch.empty(dims, dtype=dtype)

    out = kvcacheio.cpu_host_alloc(alloc)(
        (2, 3), dtype=torch.float32, device="cpu", pin_memory=True, allocator=None,
        registration_granularity_bytes=12,
    )  # fmt: skip
    assert out.shape == (2, 3) and seen == {"pin": False, "registration_granularity_bytes": 12}


def test_host_ratio_gives_the_asked_number_of_states():
    for states, capacity in ((97, 48), (2048, 256), (10, 13), (565, 256)):
        ratio = host_tier.host_ratio(states, capacity)
        assert int(capacity * ratio) == states  # MambaPoolHost: int(capacity x ratio) (+1 page)


def test_capacity_warning_names_the_numbers():
    """Upstream #39436: 565 host state slots, 0 of 8 host hits. At spacing 64 they hold the
    checkpoints of a 36,160-token prompt, not of the model's 131,072-token context."""
    msg = host_tier.capacity_warning(565, 64, 131072)
    assert msg is not None
    assert "565" in msg and "36,160" in msg and "2048" in msg and "--kda-host-state-pool" in msg
    assert host_tier.capacity_warning(2048, 64, 131072) is None
    assert host_tier.capacity_warning(97, 704, 65536) is None  # 94 states at the GPU spacing


def test_host_book_keeps_the_last_use():
    book = host_tier.HostBook()
    book.add(5, 10)
    book.add(7)
    book.add(5)  # a later note without a clock keeps the known one
    assert book.node_ids() == [5, 7] and book.last_access(5) == 10 and book.last_access(7) == 0
    book.forget(5)
    assert book.node_ids() == [7] and len(book) == 1
