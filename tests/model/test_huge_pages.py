"""Weights and KV pools on huge pages (layers/hugepages.py): the same values, the mappings
advised (the model's weights and its KV pools), a tensor held twice still one tensor, and
the same tokens out."""

from __future__ import annotations

import pytest
import torch

from fornax import LLM, SamplingParams
from fornax.layers import hugepages
from fornax.layers.linear import DenseBf16, Linear
from fornax.layers.process_memory import resident_bytes
from tests.model.tiny_models import build_tiny_model

pytestmark = pytest.mark.skipif(not hugepages.HUGE_PAGES_USABLE, reason="no transparent huge pages here")


def _mapping_flags(ptr: int) -> str:
    """VmFlags of the mapping holding address ptr (/proc/self/smaps); 'hg' = MADV_HUGEPAGE."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and line.startswith("VmFlags:"):
                return line
    raise AssertionError(f"no mapping holds {ptr:#x}")


def test_zeros_are_untouched_until_written_aligned_and_advised(monkeypatch):
    pools = hugepages.zeros_many(
        [((4096 * 16, 3, 64), torch.bfloat16)] * 2 + [((1000, 3), torch.float32)]
    )  # 2 x 12 MiB
    first = pools[0]
    assert first.shape == (4096 * 16, 3, 64) and first.dtype == torch.bfloat16 and first.is_contiguous()
    assert first.data_ptr() % hugepages.HUGE_PAGE == 0
    assert all(t.data_ptr() % hugepages.ALIGN == 0 for t in pools)
    assert " hg" in _mapping_flags(first.data_ptr())
    spans = [(t.data_ptr(), t.numel() * t.element_size()) for t in pools]
    assert resident_bytes(spans) == 0  # nothing resident before the first write
    pools[1][-1].fill_(1.5)
    assert 0 < resident_bytes(spans) <= hugepages.HUGE_PAGE  # one page (huge or small) written
    # (read after the count: mincore counts pages that reads mapped to the kernel's zero page)
    assert pools[1].float().sum().item() == 1.5 * 3 * 64
    assert pools[0].abs().sum().item() == 0 and pools[2].abs().sum().item() == 0
    # under a page: plain torch memory, no mapping of its own. Asked of the module, not of
    # /proc: malloc's memory is not this module's to vouch for (in one full-suite run the small
    # tensor's malloc memory lay in a mapping with the huge-page advice, VmFlags "hg").
    mappings = []
    monkeypatch.setattr(
        hugepages, "_huge_page_bytes", lambda *a, **k: mappings.append(a) or pytest.fail("mapped")
    )
    small = hugepages.zeros((10, 3), torch.float32)
    assert not mappings and small.shape == (10, 3) and small.abs().sum().item() == 0


def test_pack_keeps_values_in_one_advised_mapping():
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(100, 7, generator=g).bfloat16(),
        torch.randint(-127, 128, (3000, 1000), dtype=torch.int8, generator=g),
        torch.randn(5, generator=g),
        torch.randn(64, 64, generator=g).t(),  # not contiguous: packed contiguous
        torch.arange(3, dtype=torch.int32),
    ]
    packed = hugepages.pack(tensors)
    for before, after in zip(tensors, packed):
        assert after.dtype == before.dtype and after.shape == before.shape and after.is_contiguous()
        assert torch.equal(after, before)
        assert after.data_ptr() % hugepages.ALIGN == 0
    ptrs = [t.data_ptr() for t in packed]
    assert ptrs == sorted(ptrs) and ptrs[-1] - ptrs[0] < 4 << 20  # one after another, one mapping
    assert all(" hg" in _mapping_flags(p) for p in ptrs)
    few = [torch.ones(10), torch.zeros(3)]
    assert all(a is b for a, b in zip(hugepages.pack(few), few))  # under a page together: untouched


def test_model_weights_packed_shared_and_same_tokens(tmp_path, monkeypatch):
    """A tiny model's weights are under one huge page, so the threshold is lowered to a small
    page here: the packing itself is what is under test."""
    build_tiny_model("llama", tmp_path)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 99, 200, 31, 7], [250, 3, 3, 9]]
    monkeypatch.setattr(hugepages, "HUGE_PAGES_USABLE", False)
    plain = LLM(str(tmp_path), num_blocks=64, progress=False, quantization="int4", small_step_max_rows=2)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    monkeypatch.setattr(hugepages, "HUGE_PAGES_USABLE", True)
    monkeypatch.setattr(hugepages, "HUGE_PAGE", 4096)
    packed = LLM(str(tmp_path), num_blocks=64, progress=False, quantization="int4", small_step_max_rows=2)
    model = packed.engine.runner.model
    assert [o.outputs[0].token_ids for o in packed.generate(prompts, params)] == expected
    cache = packed.engine.runner.kv_cache
    assert all(
        " hg" in _mapping_flags(pool.data_ptr()) for layer in cache.layers for pool in layer.tensors()
    )  # KV pools too
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(" hg" in _mapping_flags(m.weight.data_ptr()) for m in linears)
    for m in linears:
        if isinstance(m.mid, DenseBf16):  # the dense form holds the Linear's own weight
            assert m.mid.weight.data_ptr() == m.weight.data_ptr()
        if m.small is not None:
            assert all(
                " hg" in _mapping_flags(t.data_ptr())
                for t in vars(m.small).values()
                if isinstance(t, torch.Tensor)
            )
