"""hal.compat against the real libraries on an NVIDIA GPU: the same arguments into the library's call
and into hal.compat's, compared within bf16 rounding (rel. L2 <= 5e-3: both round a 16-bit output of
fp32 math, ~2^-9 per element) over 16-bit caches; over FP8 caches against hal's float64 reference of
the same bytes (the libraries' FP8 paths round Q or P to FP8). Needs the wheels the bench carries
(tools/gpu_compat.sh installs them: FlashInfer 0.7.4's trimmed copy with its prebuilt head-128
modules, fa3-fwd 0.0.3); each missing library skips with its reason. FlashInfer's paged kernels are
also the reference for the FlashAttention entry points' paged calls (fa3-fwd 0.0.3 has no paged KV
for pages of 16 or 64)."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from hal import reference
from hal.compat.flashinfer import csr_pages

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

L2 = 5e-3
DEV = "cuda"


def _lib(name: str):
    try:
        return importlib.import_module(name)
    except Exception as exc:  # ImportError, or a module whose .so does not load
        pytest.skip(f"import {name} failed ({type(exc).__name__}: {exc}); tools/gpu_compat.sh installs it")


def _paged(seed, lens, qlens, hkv, gqa, d, bs, dtype=torch.bfloat16):
    g = torch.Generator(device=DEV).manual_seed(seed)
    per = [(n + bs - 1) // bs for n in lens]
    nb = sum(per) + 4
    perm = torch.randperm(nb, device=DEV, generator=g)
    table = torch.zeros(len(lens), max(per), dtype=torch.int32, device=DEV)
    k = 0
    for i, p in enumerate(per):
        table[i, :p] = perm[k:k + p].to(torch.int32)
        k += p
    kc = torch.randn(nb, bs, hkv, d, device=DEV, generator=g).to(dtype)
    vc = torch.randn(nb, bs, hkv, d, device=DEV, generator=g).to(dtype)
    q = torch.randn(sum(qlens), hkv * gqa, d, device=DEV, generator=g).to(torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    return q, kc, vc, table, torch.tensor(lens, dtype=torch.int32, device=DEV), cu


GRID = [  # lens, q_lens, kv heads, gqa, page, window_left, soft-cap
    ([1000, 37, 2049], [1000, 1, 64], 8, 4, 16, -1, None),
    ([512, 300], [512, 7], 8, 1, 64, -1, None),
    ([777, 129, 64], [1, 1, 1], 4, 8, 16, -1, None),
    ([900, 400], [200, 400], 2, 16, 64, 127, None),
    ([640, 65], [100, 65], 8, 4, 16, -1, 30.0),
]


def _real_prefill(fi, q, kc, vc, table, lens, cu, bs, window_left, cap):
    indptr, indices, last = csr_pages(table, lens, bs)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
    try:
        w.plan(cu, indptr, indices, last, q.shape[1], kc.shape[2], q.shape[2], bs, causal=True,
               window_left=window_left, logits_soft_cap=cap, q_data_type=q.dtype, kv_data_type=kc.dtype)
        return w.run(q, (kc, vc), return_lse=True)
    except Exception as exc:  # a module the trimmed copy does not prebuild
        pytest.skip(f"FlashInfer could not run this case ({type(exc).__name__}: {exc})")


@pytest.mark.parametrize("case", range(len(GRID)))
def test_paged_entry_points_match_flashinfer(case):
    """vLLM's flash_attn_varlen_func, FA3's flash_attn_with_kvcache and the FlashInfer prefill wrapper,
    all through hal.compat, against the real FlashInfer prefill over the same NHD pages."""
    fi = _lib("flashinfer")
    from hal.compat import flash_attn_interface, flashinfer, vllm_flash_attn
    lens, qlens, hkv, gqa, bs, wl, cap = GRID[case]
    q, kc, vc, table, seq, cu = _paged(case, lens, qlens, hkv, gqa, 128, bs)
    want, want_lse = _real_prefill(fi, q, kc, vc, table, seq, cu, bs, wl, cap)
    window = (wl, 0) if wl >= 0 else (-1, -1)
    got, lse = vllm_flash_attn.flash_attn_varlen_func(q, kc, vc, max(qlens), cu, max(lens), seqused_k=seq,
                                                      causal=True, window_size=window, softcap=cap or 0.0,
                                                      block_table=table, return_softmax_lse=True)
    assert reference.relative_l2(got, want) <= L2
    assert (lse.t() - want_lse * math.log(2)).abs().max().item() <= 1e-2   # FlashInfer's lse is base 2
    got3 = flash_attn_interface.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seq, page_table=table, cu_seqlens_q=cu,
                                                        max_seqlen_q=max(qlens), causal=True, window_size=window,
                                                        softcap=cap or 0.0)
    assert reference.relative_l2(got3, want) <= L2
    indptr, indices, last = csr_pages(table, seq, bs)
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1, device=DEV), "NHD")
    w.plan(cu, indptr, indices, last, q.shape[1], hkv, 128, bs, causal=True, window_left=wl, logits_soft_cap=cap)
    got_fi, lse_fi = w.run(q, (kc, vc), return_lse=True)
    assert reference.relative_l2(got_fi, want) <= L2 and (lse_fi - want_lse).abs().max().item() <= 1e-2


@pytest.mark.parametrize("case", [i for i, c in enumerate(GRID) if c[1] == [1] * len(c[1])] + [0])
def test_flashinfer_decode_wrapper_matches_flashinfer(case):
    fi = _lib("flashinfer")
    from hal.compat import flashinfer
    lens, _, hkv, gqa, bs, wl, cap = GRID[case]
    q, kc, vc, table, seq, _ = _paged(20 + case, lens, [1] * len(lens), hkv, gqa, 128, bs)
    indptr, indices, last = csr_pages(table, seq, bs)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    real = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    try:
        real.plan(indptr, indices, last, q.shape[1], hkv, 128, bs, window_left=wl, logits_soft_cap=cap,
                  q_data_type=q.dtype, kv_data_type=kc.dtype)
        want = real.run(q, (kc, vc))
    except Exception as exc:
        pytest.skip(f"FlashInfer could not run this case ({type(exc).__name__}: {exc})")
    ours = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    ours.plan(indptr, indices, last, q.shape[1], hkv, 128, bs, window_left=wl, logits_soft_cap=cap,
              q_data_type=q.dtype, kv_data_type=kc.dtype)
    assert reference.relative_l2(ours.run(q, (kc, vc)), want) <= L2


@pytest.mark.parametrize("lens", [[1000, 2049, 37], [4096]])
def test_fa3_dense_varlen_matches_fa3(lens):
    fa3 = _lib("fa3_fwd_interface")
    from hal.compat import flash_attn_interface
    g = torch.Generator(device=DEV).manual_seed(len(lens))
    hkv, h, d = 8, 32, 128
    total = sum(lens)
    k = torch.randn(total, hkv, d, device=DEV, generator=g).to(torch.bfloat16)
    v = torch.randn(total, hkv, d, device=DEV, generator=g).to(torch.bfloat16)
    q = torch.randn(total, h, d, device=DEV, generator=g).to(torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    want = fa3.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    want = want[0] if isinstance(want, tuple) else want
    with pytest.warns(Warning):  # pages of one token: served by the emu pack, with the reason
        got = flash_attn_interface.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    assert reference.relative_l2(got, want) <= L2


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("case", range(len(GRID)))
def test_fp8_caches_through_vllm_entry_points_match_the_float64_reference(case, dtype):
    """vLLM's writer into a uint8 cache, then vLLM's attention call with the layer scales expanded to
    [batch, kv_heads] descales: hal's float64 reference over the same bytes."""
    from hal.compat import vllm, vllm_flash_attn
    lens, qlens, hkv, gqa, bs, wl, cap = GRID[case]
    q, kc16, vc16, table, seq, cu = _paged(40 + case, lens, qlens, hkv, gqa, 128, bs)
    name = "fp8" if dtype == torch.float8_e4m3fn else "fp8_e5m2"
    kv = torch.full((2, *kc16.shape), 0x7F, dtype=torch.uint8, device=DEV)   # NaN bytes, then every slot written
    slots = torch.arange(kc16.shape[0] * bs, device=DEV)
    ks, vs = torch.tensor([0.02], device=DEV), torch.tensor([0.03], device=DEV)
    vllm.reshape_and_cache_flash(kc16.reshape(-1, hkv, 128), vc16.reshape(-1, hkv, 128), kv[0], kv[1], slots, name,
                                 ks, vs)
    kc, vc = kv[0].view(dtype), kv[1].view(dtype)
    window = (wl, 0) if wl >= 0 else (-1, -1)
    b = seq.shape[0]
    got = vllm_flash_attn.flash_attn_varlen_func(q, kc, vc, max(qlens), cu, max(lens), seqused_k=seq, causal=True,
                                                 window_size=window, softcap=cap or 0.0, block_table=table,
                                                 k_descale=ks.expand(b, hkv), v_descale=vs.expand(b, hkv), fa_version=3)
    want = reference.paged_attention_varlen(q, kc.permute(0, 2, 1, 3), vc.permute(0, 2, 1, 3), table, seq, cu,
                                            k_scale=0.02, v_scale=0.03, logits_soft_cap=cap,
                                            sliding_window=wl + 1 if wl >= 0 else None)
    assert reference.relative_l2(got, want) <= L2


@pytest.mark.parametrize("rows", [1, 2])
def test_flash_mla_matches_flashmla(rows):
    """FlashMLA's dense decode (sgl-flash-mla 1.0.0, legacy sm_90 kernels, page 64, bf16) and
    hal.compat.flash_mla with the same arguments; the lse too (natural log both)."""
    fm = _lib("flash_mla")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("FlashMLA's dense kernels are sm_90 only")
    from hal.compat import flash_mla
    g = torch.Generator(device=DEV).manual_seed(rows)
    r, p, bs, h, lens = 512, 64, 64, 128, [4096, 777, 65, 2000]
    per = [(n + bs - 1) // bs for n in lens]
    nb = sum(per) + 3
    cache = torch.randn(nb, bs, 1, r + p, device=DEV, generator=g).to(torch.bfloat16)
    table = torch.zeros(len(lens), max(per), dtype=torch.int32, device=DEV)
    perm, k = torch.randperm(nb, device=DEV, generator=g).to(torch.int32), 0
    for i, n in enumerate(per):
        table[i, :n] = perm[k:k + n]
        k += n
    seq = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = torch.randn(len(lens), rows, h, r + p, device=DEV, generator=g).to(torch.bfloat16)
    meta, _ = fm.get_mla_metadata()
    want, want_lse = fm.flash_mla_with_kvcache(q, cache, table, seq, r, meta, causal=rows > 1, use_legacy=True)
    ours, _ = flash_mla.get_mla_metadata()
    with pytest.warns(Warning):  # the lse: served by the emu pack today, with the reason
        got, lse = flash_mla.flash_mla_with_kvcache(q, cache, table, seq, r, ours, causal=rows > 1, use_legacy=True)
    assert reference.relative_l2(got, want) <= L2
    assert (lse - want_lse).abs().max().item() <= 1e-2
