"""Shared fixtures of the cache tests: SGLang's own ``UnifiedRadixCache`` (FULL + MAMBA, CPU,
KDA chunk 64) with either tree core, and a state-holding insert into it."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def real_cache_factory():
    """``build(backend, max_context_len=2048) -> (cache, allocator, pool)``: SGLang's
    ``UnifiedRadixCache`` with the chosen tree core (``"python"`` or ``"rust"``), built through
    SGLang's own unit-test kit (its Rust inspection build is absent from the wheel, so the plain
    Rust core stands in for it); skips where that core is not available."""
    import sys
    import types
    from unittest import mock

    import sglang_kda  # noqa: F401 - import guards before SGLang

    kit = pytest.importorskip("sglang.test.kits.unified_radix_cache.fixtures")
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.test.kits.unified_radix_cache.config import CacheConfig

    def build(backend: str, max_context_len: int = 2048):
        from sglang.srt.mem_cache.rust_tree_core.adapter import RustUnifiedTreeCore

        name = "sglang.test.kits.unified_radix_cache.rust_unified_tree_core_inspector"
        stand_in = types.ModuleType(name)
        stand_in.RustUnifiedTreeCoreInspector = RustUnifiedTreeCore
        cfg = CacheConfig(
            components=(ComponentType.FULL, ComponentType.MAMBA),
            kv_size=20000,
            max_context_len=max_context_len,
            mamba_cache_size=40,
        )
        with (
            mock.patch.object(kit, "get_device", return_value="cpu"),
            mock.patch.object(kit, "UnifiedTreeCoreInspectionInterface", object),
            mock.patch.dict(sys.modules, {name: stand_in}),
        ):
            cache, allocator, pool = kit.build_fixture(
                cfg, tree_core_backend=backend, mamba_cache_chunk_size=64
            )
        want = "RustUnifiedTreeCore" if backend == "rust" else "UnifiedTreeCore"
        if want not in [c.__name__ for c in type(cache.tree_core).__mro__]:
            pytest.skip(f"the {backend} tree core is not available here")
        return cache, allocator, pool

    return build


@pytest.fixture(scope="session")
def insert_state():
    """``insert(cache, allocator, pool, seq) -> node``: ``seq`` inserted with fresh KV slots and
    one state slot, its state noted in sglang_kda's book at ``len(seq)``."""
    from array import array

    def insert(cache, allocator, pool, seq):
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        from sglang_kda.cache.evict_drive import note_state

        value = allocator.alloc(len(seq))
        slot = pool.mamba_allocator.alloc(1)
        key = RadixKey(array("q", seq))
        res = cache.insert(InsertParams(key=key, value=value, mamba_value=slot))
        note_state(cache, res.last_device_node, len(seq))
        return res.last_device_node

    return insert
