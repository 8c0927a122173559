"""packs/emu/pages.py: reading pages of a paged cache as float32 (the emu PyTorch paths' one reader)."""

from __future__ import annotations

import pytest
import torch

from cases import FP8
from hal import fp8
from hal.kernelpacks.emu import pages

DTYPES = (*FP8, torch.bfloat16, torch.float16)


def _cache(dtype, layout, nb=9, hkv=3, bs=5, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (nb, hkv, bs, d * (1 if fp8.is_fp8(dtype) else 2)), dtype=torch.uint8, generator=gen)
    c = raw.view(dtype)                                   # every byte pattern, NaN and inf included
    if layout == "nhd":  # an engine's [nb, bs, hkv, d] storage as its permute view: blocks not dense
        c = c.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    return c


def _same(a, b) -> bool:
    """Equal bit for bit, except that any NaN equals any NaN (payloads may differ between routes)."""
    return a.shape == b.shape and bool(((a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())).all())


def _expected(cache, blocks):
    """float64-free reference: each block's values widened one by one, head-major."""
    _, hkv, bs, d = cache.shape
    vals = fp8.decode_values(cache.contiguous()) if fp8.is_fp8(cache.dtype) else cache.float()
    return vals[blocks].movedim(-3, -4).reshape(*blocks.shape[:-1], hkv, blocks.shape[-1] * bs, d)


@pytest.mark.parametrize("layout", ["hnd", "nhd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("indexed", [True, False])
@pytest.mark.parametrize("d", [16, 15])   # even: two bytes per lookup; odd: one
def test_gather_equals_elementwise_decode(dtype, layout, indexed, d):
    cache = _cache(dtype, layout, d=d)
    blocks = torch.tensor([[3, 0, 8], [8, 8, 1]])
    got = pages.gather(cache, blocks, indexed=indexed)
    want = _expected(cache, blocks)
    assert got.shape == (2, 3, 15, d)
    assert _same(got, want)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2fnuz, torch.bfloat16], ids=str)
@pytest.mark.parametrize("indexed", [True, False])
@pytest.mark.parametrize("d", [16, 15])
def test_dropped_positions_read_zero_whatever_their_bytes(dtype, indexed, d):
    cache = _cache(dtype, "hnd", d=d, seed=1)
    nan_byte = (0x80 if fp8.encoding_of(dtype).fnuz else 0x7F) if fp8.is_fp8(dtype) else 0xFF
    cache.view(torch.uint8)[4] = nan_byte                                # NaN in every element of block 4
    blocks = torch.tensor([[2, 4], [4, 6]])
    drop = torch.zeros(2, 10, dtype=torch.bool)
    drop[0, 5:] = True          # sequence 0: its second block (block 4) entirely
    drop[1, :3] = True          # sequence 1: the first 3 positions of block 4
    got = pages.gather(cache, blocks, drop=drop, indexed=indexed)
    want = _expected(cache, blocks)
    keep = ~drop[:, None, :, None].expand_as(want)
    assert _same(got[keep], want[keep])
    assert (got[~keep] == 0).all()
    assert want[~keep].isnan().any()      # the test's premise: those positions held NaN


def test_workspace_reuses_buffers_and_one_dimensional_blocks():
    cache = _cache(torch.float8_e4m3fn, "hnd")
    work = pages.Workspace()
    a = pages.gather(cache, torch.tensor([1, 2, 3]), work=work, name="k")
    ptr = a.data_ptr()
    b = pages.gather(cache, torch.tensor([5, 6]), work=work, name="k")        # smaller: same buffer
    assert b.data_ptr() == ptr and b.shape == (3, 10, 16)
    assert _same(b, _expected(cache, torch.tensor([5, 6])))
    c = pages.gather(cache, torch.tensor([0, 1, 2, 3, 4]), work=work, name="k")  # larger: grown
    assert _same(c, _expected(cache, torch.tensor([0, 1, 2, 3, 4])))


def test_cpu_workspace_is_per_thread_and_kept():
    import threading
    a = pages.workspace("cpu")
    assert pages.workspace("cpu") is a and pages.workspace("meta") is not pages.workspace("meta")
    other = []
    t = threading.Thread(target=lambda: other.append(pages.workspace("cpu")))
    t.start()
    t.join()
    assert other[0] is not a
