"""hal.compat on this machine's pack against hal's float64 reference (the GPU grid against the real
libraries is tools/gpu_compat.sh): each entry point's arguments mapped as its library defines them.

Data: fresh random caches, shuffled pages, NaN bytes in every page no sequence reads, outputs
poisoned with NaN. Tolerances: outputs are bfloat16, whose rounding alone is a relative error up to
2^-9 per element (about 1.1e-3 in relative L2 over random rows); the emu pack's fp32 arithmetic adds
~1e-6. So rel. L2 <= 5e-3 (the issue's bound) holds with margin on any CPU. The log-sum-exp is fp32
over logits of magnitude < 40: its error is ~1e-5; we allow 1e-3 absolute.
"""

from __future__ import annotations

import math

import pytest
import torch

from hal import fp8, reference
from hal.compat import NotServedError
from hal.compat import flash_attn as fa2
from hal.compat import flash_attn_interface as fa3
from hal.compat import flashinfer as fi
from hal.compat import vllm
from hal.compat.flashinfer import csr_pages

L2 = 5e-3
LSE_ABS = 1e-3


def _batch(seed: int, lens, qlens, hkv: int, gqa: int, d: int, bs: int, dtype=torch.bfloat16):
    """NHD caches with NaN in every unread page, a shuffled block table, rows per sequence."""
    g = torch.Generator().manual_seed(seed)
    per = [(n + bs - 1) // bs for n in lens]
    width = max(per) + 1
    nb = sum(per) + 3
    perm = torch.randperm(nb, generator=g)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    used, k = set(), 0
    for i, p in enumerate(per):
        table[i, :p] = perm[k:k + p].to(torch.int32)
        used.update(perm[k:k + p].tolist())
        k += p
    kc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    for b in set(range(nb)) - used:  # pages no sequence reads: NaN (as bytes for FP8)
        kc.view(torch.uint8)[b] = 0xFF
        vc.view(torch.uint8)[b] = 0xFF
    h = hkv * gqa
    total = sum(qlens)
    q = torch.randn(total, h, d, generator=g).to(torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    return q, kc, vc, table, torch.tensor(lens, dtype=torch.int32), cu


def _ref(q, kc, vc, table, lens, cu, **kw):
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float64)
    out = reference.paged_attention_varlen(q, kc.permute(0, 2, 1, 3), vc.permute(0, 2, 1, 3), table, lens, cu,
                                           lse=lse, **kw)
    return out, lse


GRID = [  # (lens, q_lens, kv heads, gqa, head size, page size, features)
    ([100, 7, 260], [100, 1, 33], 2, 4, 64, 16, {}),
    ([77, 64, 300], [1, 1, 1], 1, 16, 128, 64, {}),
    ([150, 33], [40, 33], 4, 1, 64, 16, dict(window=(31, 0))),
    ([90, 200], [90, 5], 2, 2, 128, 64, dict(softcap=20.0)),
    ([129, 17], [129, 2], 2, 4, 64, 16, dict(alibi=True)),
]


def _features(f, h):
    kw, ref = {}, {}
    if "window" in f:
        kw["window_size"] = f["window"]
        ref["sliding_window"] = f["window"][0] + 1
    if "softcap" in f:
        kw["softcap"] = f["softcap"]
        ref["logits_soft_cap"] = f["softcap"]
    if f.get("alibi"):
        slopes = torch.tensor([2.0 ** (-8 * (i + 1) / h) for i in range(h)], dtype=torch.float32)
        kw["alibi_slopes"] = slopes
        ref["alibi_slopes"] = slopes
    return kw, ref


@pytest.mark.parametrize("case", range(len(GRID)))
def test_fa2_varlen_over_a_block_table(case):
    lens, qlens, hkv, gqa, d, bs, f = GRID[case]
    q, kc, vc, table, seq, cu = _batch(case, lens, qlens, hkv, gqa, d, bs)
    kw, rkw = _features(f, q.shape[1])
    # FA2's varlen takes cu_seqlens_k with a block table: the keys' lengths
    cu_k = torch.tensor([0, *seq.cumsum(0).tolist()], dtype=torch.int32)
    out, lse, probs = fa2.flash_attn_varlen_func(q, kc, vc, cu, cu_k, max(qlens), max(lens), causal=True,
                                                 block_table=table, return_attn_probs=True, **kw)
    ref, rlse = _ref(q, kc, vc, table, seq, cu, **rkw)
    assert probs is None and lse.shape == (q.shape[1], q.shape[0])
    assert reference.relative_l2(out, ref) <= L2
    assert (lse.t().double() - rlse).abs().max().item() <= LSE_ABS


@pytest.mark.parametrize("case", [i for i, c in enumerate(GRID) if not c[-1].get("alibi")])  # FA3 has no ALiBi
def test_fa3_with_kvcache_varlen_rows_over_a_page_table(case):
    lens, qlens, hkv, gqa, d, bs, f = GRID[case]
    q, kc, vc, table, seq, cu = _batch(10 + case, lens, qlens, hkv, gqa, d, bs)
    kw, rkw = _features(f, q.shape[1])
    out, lse, _, _ = fa3.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seq, page_table=table, cu_seqlens_q=cu,
                                           max_seqlen_q=max(qlens), causal=True, return_softmax_lse=True, **kw)
    ref, rlse = _ref(q, kc, vc, table, seq, cu, **rkw)
    assert reference.relative_l2(out, ref) <= L2
    assert (lse.t().double() - rlse).abs().max().item() <= LSE_ABS


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fa3_fp8_cache_with_expanded_descales(dtype):
    """vLLM's FA3 FP8 path: an FP8 cache, k/v descales [batch, kv_heads] expanded from one layer scale."""
    lens, qlens, hkv, gqa, d, bs = [120, 9, 64], [3, 1, 64], 2, 4, 128, 16
    q, kc, vc, table, seq, cu = _batch(30, lens, qlens, hkv, gqa, d, bs, dtype=dtype)
    ks, vs = torch.tensor([0.07]), torch.tensor([0.4])
    out = fa3.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seq, page_table=table, cu_seqlens_q=cu,
                                      max_seqlen_q=64, causal=True, k_descale=ks.expand(3, hkv),
                                      v_descale=vs.expand(3, hkv))
    ref, _ = _ref(q, kc, vc, table, seq, cu, k_scale=0.07, v_scale=0.4)
    assert reference.relative_l2(out, ref) <= L2


def test_dense_varlen_fa2_and_fa3():
    g = torch.Generator().manual_seed(5)
    hkv, h, d = 2, 8, 64
    k = torch.randn(50, hkv, d, generator=g).to(torch.bfloat16)
    v = torch.randn(50, hkv, d, generator=g).to(torch.bfloat16)
    cu_k = torch.tensor([0, 30, 50], dtype=torch.int32)
    cu_q = torch.tensor([0, 30, 35], dtype=torch.int32)
    q = torch.randn(35, h, d, generator=g).to(torch.bfloat16)
    table = torch.tensor([list(range(30)), list(range(30, 50)) + [49] * 10], dtype=torch.int32)
    ref = reference.paged_attention_varlen(q, k.unsqueeze(2), v.unsqueeze(2), table, torch.tensor([30, 20], dtype=torch.int32),
                                           cu_q, sliding_window=8, logits_soft_cap=30.0)
    out2 = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 30, 30, causal=True, window_size=(7, 0), softcap=30.0)
    out3, lse3 = fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 30, 30, causal=True, window_size=(7, 0), softcap=30.0,
                                            return_attn_probs=True)
    assert reference.relative_l2(out2, ref) <= L2 and torch.equal(out2, out3)
    assert lse3.shape == (h, 35)
    # non-causal over all keys: the bidirectional (encoder) case
    out_nc = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 30, 30, causal=False)
    ref_nc = reference.paged_attention_varlen(q, k.unsqueeze(2), v.unsqueeze(2), table,
                                              torch.tensor([30, 20], dtype=torch.int32), cu_q, causal=False)
    assert reference.relative_l2(out_nc, ref_nc) <= L2


@pytest.mark.parametrize("paged", [True, False])
def test_fa2_with_kvcache_appends_then_attends(paged):
    g = torch.Generator().manual_seed(7)
    b, sq, hkv, h, d = 3, 2, 2, 8, 64
    cached = torch.tensor([10, 0, 40], dtype=torch.int32)
    if paged:
        bs = 16
        kc = torch.randn(12, bs, hkv, d, generator=g).to(torch.bfloat16)
        vc = torch.randn(12, bs, hkv, d, generator=g).to(torch.bfloat16)
        table = torch.randperm(12, generator=g)[:12].to(torch.int32).view(3, 4)
    else:
        kc = torch.randn(b, 64, hkv, d, generator=g).to(torch.bfloat16)
        vc = torch.randn(b, 64, hkv, d, generator=g).to(torch.bfloat16)
        table = None
    kn = torch.randn(b, sq, hkv, d, generator=g).to(torch.bfloat16)
    vn = torch.randn(b, sq, hkv, d, generator=g).to(torch.bfloat16)
    q = torch.randn(b, sq, h, d, generator=g).to(torch.bfloat16)
    out, lse = fa2.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=cached, block_table=table, causal=True,
                                           return_softmax_lse=True)
    assert out.shape == q.shape and lse.shape == (b, h, sq)
    # the new tokens are in the cache at positions cached .. cached + sq - 1
    for i in range(b):
        for t in range(sq):
            pos = int(cached[i]) + t
            row = kc[table[i, pos // 16], pos % 16] if paged else kc[i, pos]
            assert torch.equal(row, kn[i, t])
    if paged:
        rt = table
        kr, vr = kc, vc
    else:  # the region cache as pages of 64
        rt = torch.arange(3, dtype=torch.int32).view(3, 1)
        kr, vr = kc, vc
    cu = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32)
    ref, rlse = _ref(q.reshape(b * sq, h, d), kr, vr, rt, cached + sq, cu)
    assert reference.relative_l2(out.reshape(b * sq, h, d), ref) <= L2
    assert (lse.permute(0, 2, 1).reshape(b * sq, h).double() - rlse).abs().max().item() <= LSE_ABS


@pytest.mark.parametrize("name,dtype", [("fp8", None), ("fp8_e4m3", None), ("fp8_e5m2", None), ("auto", torch.bfloat16)])
def test_vllm_reshape_and_cache_flash_into_uint8_and_stacked_caches(name, dtype):
    g = torch.Generator().manual_seed(3)
    nb, bs, hkv, d = 6, 16, 2, 64
    enc = fp8.kv_cache_dtype(name) if dtype is None else dtype
    store = torch.uint8 if dtype is None else dtype
    kv = torch.zeros(2, nb, bs, hkv, d, dtype=store)  # vLLM's stacked K/V
    key = torch.randn(5, hkv, d, generator=g)
    value = torch.randn(5, hkv, d, generator=g)
    slots = torch.tensor([3, 17, -1, 40, 95])
    ks, vs = torch.tensor([0.05]), torch.tensor([0.1])
    vllm.reshape_and_cache_flash(key, value, kv[0], kv[1], slots, name, ks, vs)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        for which, x, sc in ((0, key, 0.05), (1, value, 0.1)):
            row = kv[which, s // bs, s % bs]
            want = fp8.encode(x[t] / sc, enc) if fp8.is_fp8(enc) else (x[t] / sc).to(enc)
            got = row.view(enc) if store == torch.uint8 else row
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (which, t)
    assert kv[:, 1, 0].abs().sum() == 0 if store != torch.uint8 else kv[:, 1, 0].sum() == 0  # slot 16: untouched


def test_vllm_concat_and_cache_mla():
    g = torch.Generator().manual_seed(4)
    nb, bs, r, p = 4, 16, 512, 64
    cache = torch.zeros(nb, bs, r + p, dtype=torch.uint8)
    kv_c = torch.randn(3, r, generator=g).to(torch.bfloat16)
    k_pe = torch.randn(3, 1, p, generator=g).to(torch.bfloat16)
    vllm.concat_and_cache_mla(kv_c, k_pe, cache, torch.tensor([0, 20, 63]), "fp8", torch.tensor([0.02]))
    enc = fp8.kv_cache_dtype("fp8")
    row = cache[1, 4].view(enc)
    assert torch.equal(row[:r].view(torch.uint8), fp8.encode(kv_c[1].float() / 0.02, enc).view(torch.uint8))
    assert torch.equal(row[r:].view(torch.uint8), fp8.encode(k_pe[1, 0].float() / 0.02, enc).view(torch.uint8))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_flashinfer_decode_and_prefill_wrappers(layout):
    lens, qlens, hkv, gqa, d, bs = [100, 7, 260], [100, 1, 33], 2, 4, 64, 16
    q, kc, vc, table, seq, cu = _batch(40, lens, qlens, hkv, gqa, d, bs)
    indptr, indices, last = csr_pages(table, seq, bs)
    cache = (kc, vc) if layout == "NHD" else (kc.permute(0, 2, 1, 3).contiguous(), vc.permute(0, 2, 1, 3).contiguous())
    ws = torch.empty(1024, dtype=torch.uint8)
    pre = fi.BatchPrefillWithPagedKVCacheWrapper(ws, layout)
    pre.plan(cu, indptr, indices, last, q.shape[1], hkv, d, bs, causal=True, q_data_type=torch.bfloat16)
    out, lse = pre.run(q, cache, return_lse=True)                    # FlashInfer's default: base 2, [tokens, heads]
    ref, rlse = _ref(q, kc, vc, table, seq, cu)
    assert reference.relative_l2(out, ref) <= L2
    assert (lse.double() * math.log(2) - rlse).abs().max().item() <= LSE_ABS
    out2, lse_hn = pre.run(q, torch.stack(cache, 1), return_lse=True, lse_base="ln", lse_layout="HN")
    assert torch.equal(out2, out) and (lse_hn.t().double() - rlse).abs().max().item() <= LSE_ABS

    dec = fi.BatchDecodeWithPagedKVCacheWrapper(ws, layout)
    dec.plan(indptr, indices, last, q.shape[1], hkv, d, bs, q_data_type=torch.bfloat16)
    qd = q[:3].clone()
    o = torch.full_like(qd, float("nan"))
    dec.run(qd, cache, out=o)
    refd, _ = _ref(qd, kc, vc, table, seq, torch.arange(4, dtype=torch.int32))
    assert reference.relative_l2(o, refd) <= L2
    for layer in range(2):  # one hal plan serves every layer of the same layout
        dec.run(qd, cache, out=o)
    assert dec._hal_plan is not None


REFUSALS = [
    (lambda t: fa2.flash_attn_varlen_func(*t, dropout_p=0.1), "dropout_p"),
    (lambda t: fa2.flash_attn_varlen_func(*t, window_size=(3, 3)), "window_size"),
    (lambda t: fa3.flash_attn_varlen_func(*t, q_descale=torch.ones(1)), "q_descale"),
    (lambda t: fa3.flash_attn_varlen_func(*t, attention_chunk=64), "attention_chunk"),
    (lambda t: fa3.flash_attn_varlen_func(*t, seqused_q=torch.ones(2, dtype=torch.int32)), "seqused_q"),
    (lambda t: fa2.flash_attn_with_kvcache(t[0].view(1, 35, 8, 64), t[1].view(1, 50, 2, 64), t[2].view(1, 50, 2, 64),
                                           cache_seqlens=5, rotary_cos=torch.ones(1)), "rotary_cos"),
    (lambda t: fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1), use_cuda_graph=True), "use_cuda_graph"),
    (lambda t: fi.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1)).plan(
        torch.tensor([0, 1]), torch.tensor([0, 1]), torch.tensor([0]), torch.tensor([1]), 8, 2, 64, 16,
        pos_encoding_mode="ROPE_LLAMA"), "pos_encoding_mode"),
]


@pytest.mark.parametrize("call,arg", REFUSALS, ids=[a for _, a in REFUSALS])
def test_what_hal_does_not_serve_is_a_named_error(call, arg):
    g = torch.Generator().manual_seed(1)
    k = torch.randn(50, 2, 64, generator=g).to(torch.bfloat16)
    q = torch.randn(35, 8, 64, generator=g).to(torch.bfloat16)
    args = (q, k, k.clone(), torch.tensor([0, 30, 35], dtype=torch.int32), torch.tensor([0, 30, 50], dtype=torch.int32),
            30, 30)
    with pytest.raises(NotServedError, match=arg):
        call(args)


def test_per_sequence_descales_that_differ_are_refused():
    q, kc, vc, table, seq, cu = _batch(2, [40, 20], [1, 1], 2, 2, 64, 16, dtype=torch.float8_e4m3fn)
    with pytest.raises(NotServedError, match="k_descale"):
        fa3.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seq, page_table=table, cu_seqlens_q=cu, max_seqlen_q=1,
                                    k_descale=torch.rand(2, 2) + 0.5)


def test_one_plan_serves_the_layers_of_a_batch_and_sees_values_written_in_place():
    """The layers of a step share one hal plan (made on the first call); new lengths written into the
    same tensors (CUDA graphs) are read by the next call; another bound makes another plan."""
    from hal.compat import _plans

    _plans.clear()
    lens, qlens, hkv, gqa, d, bs = [100, 7, 60], [1, 1, 1], 2, 4, 64, 16
    q, kc, vc, table, seq, cu = _batch(50, lens, qlens, hkv, gqa, d, bs)
    cu_k = torch.tensor([0, *seq.cumsum(0).tolist()], dtype=torch.int32)
    outs = [fa2.flash_attn_varlen_func(q, kc, vc, cu, cu_k, 1, 112, causal=True, block_table=table) for _ in range(3)]
    assert len(_plans._cache) == 1 and all(torch.equal(o, outs[0]) for o in outs)
    ref, _ = _ref(q, kc, vc, table, seq, cu)
    assert reference.relative_l2(outs[0], ref) <= L2
    cu_k.copy_(torch.tensor([0, 90, 97, 150], dtype=torch.int32))     # in place: lengths 90, 7, 53
    out = fa2.flash_attn_varlen_func(q, kc, vc, cu, cu_k, 1, 112, causal=True, block_table=table)
    assert len(_plans._cache) == 1
    ref2, _ = _ref(q, kc, vc, table, torch.tensor([90, 7, 53], dtype=torch.int32), cu)
    assert reference.relative_l2(out, ref2) <= L2
    fa2.flash_attn_varlen_func(q, kc, vc, cu, cu_k, 1, 128, causal=True, block_table=table)
    assert len(_plans._cache) == 2


def test_the_fast_path_serves_each_layer_its_own_cache_and_sees_values_written_in_place():
    """After a batch's first call, calls with the same batch tensors take the kept plan and kept cache
    views (hal.compat._flash.varlen's fast path): each layer's own cache is read, lengths and tables
    written in place are seen, and a layer laid out otherwise (another query dtype) is still served."""
    from hal.compat import _common, _plans, vllm_flash_attn

    _plans.clear()
    lens, qlens, hkv, gqa, d, bs = [100, 37, 60], [5, 1, 60], 2, 4, 64, 16
    q, kc, vc, table, seq, cu = _batch(51, lens, qlens, hkv, gqa, d, bs)
    layers = [(kc, vc)] + [tuple(torch.randn_like(x, dtype=torch.float32).to(x.dtype) for x in (kc, vc))
                           for _ in range(2)]

    def call(k, v, qq=q):
        return vllm_flash_attn.flash_attn_varlen_func(qq, k, v, max(qlens), cu, 112, seqused_k=seq, causal=True,
                                                      block_table=table)
    for _ in range(3):
        for k, v in layers:
            got = call(k, v)
            ref, _ = _ref(q, k, v, table, seq, cu)
            assert reference.relative_l2(got, ref) <= L2
    assert len(_plans._fast) == 1 and len(_plans._cache) == 1
    assert all(_common._CACHE_VIEWS[id(x)][2] is not None for kv in layers for x in kv)
    seq.copy_(torch.tensor([90, 37, 64], dtype=torch.int32))              # in place, within the bound
    table.copy_(table.flip(1))
    for k, v in layers:
        ref, _ = _ref(q, k, v, table, seq, cu)
        assert reference.relative_l2(call(k, v), ref) <= L2
    q16 = q.to(torch.float16)                                            # another layout: planned anew
    kf, vf = (x.to(torch.float16) for x in layers[1])
    ref, _ = _ref(q16, kf, vf, table, seq, cu)
    assert reference.relative_l2(call(kf, vf, q16), ref) <= L2


def test_a_list_window_size_is_served_on_every_call():
    """window_size as a list (unhashable, so never a fast-path key) is served the same each call."""
    from hal.compat import _plans, vllm_flash_attn

    _plans.clear()
    q, kc, vc, table, seq, cu = _batch(54, [80, 33], [1, 1], 2, 2, 64, 16)
    outs = [vllm_flash_attn.flash_attn_varlen_func(q, kc, vc, 1, cu, 80, seqused_k=seq, causal=True, block_table=table,
                                                   window_size=[15, 0]) for _ in range(2)]
    ref, _ = _ref(q, kc, vc, table, seq, cu, sliding_window=16)
    assert len(_plans._fast) == 0 and all(reference.relative_l2(o, ref) <= L2 for o in outs)


def test_a_converted_block_table_is_not_kept_so_values_written_into_it_are_seen():
    """An int64 block table is converted per call: a plan over the copy would not see values written
    into the caller's table later, so such a call never takes the fast path."""
    from hal.compat import _plans, vllm_flash_attn

    _plans.clear()
    q, kc, vc, table, seq, cu = _batch(52, [80, 33], [1, 1], 2, 2, 64, 16)
    t64 = table.to(torch.int64)
    for _ in range(2):
        vllm_flash_attn.flash_attn_varlen_func(q, kc, vc, 1, cu, 80, seqused_k=seq, causal=True, block_table=t64)
    assert len(_plans._fast) == 0
    t64.copy_(t64.flip(1))
    got = vllm_flash_attn.flash_attn_varlen_func(q, kc, vc, 1, cu, 80, seqused_k=seq, causal=True, block_table=t64)
    ref, _ = _ref(q, kc, vc, t64.to(torch.int32), seq, cu)
    assert reference.relative_l2(got, ref) <= L2


def test_a_kept_cache_view_does_not_keep_the_cache_alive():
    """The kept NHD views are tensors over the cache's storage, dropped when the engine drops the cache
    (a weakref), so no KV cache stays allocated because hal.compat once served it."""
    import gc
    import weakref

    from hal.compat import _common, _plans, vllm_flash_attn

    _plans.clear()
    q, kc, vc, table, seq, cu = _batch(53, [40, 20], [1, 1], 2, 2, 64, 16)
    for _ in range(3):
        vllm_flash_attn.flash_attn_varlen_func(q, kc, vc, 1, cu, 48, seqused_k=seq, causal=True, block_table=table)
    key, alive = id(kc), weakref.ref(kc)
    assert _common._CACHE_VIEWS[key][2] is not None
    del kc
    gc.collect()
    assert alive() is None and key not in _common._CACHE_VIEWS


@pytest.mark.parametrize("case", range(len(GRID)))
def test_vllm_flash_attn_varlen_as_vllms_backend_calls_it(case):
    """vLLM's FlashAttention backend: block_table + seqused_k, out given (poisoned), the lse asked for."""
    from hal.compat import vllm_flash_attn
    lens, qlens, hkv, gqa, d, bs, f = GRID[case]
    q, kc, vc, table, seq, cu = _batch(60 + case, lens, qlens, hkv, gqa, d, bs)
    kw, rkw = _features(f, q.shape[1])
    out = torch.full_like(q, float("nan"))
    got, lse = vllm_flash_attn.flash_attn_varlen_func(q, kc, vc, max(qlens), cu, max(lens), seqused_k=seq,
                                                      causal=True, block_table=table, return_softmax_lse=True,
                                                      out=out, fa_version=3, num_splits=4, **kw)
    ref, rlse = _ref(q, kc, vc, table, seq, cu, **rkw)
    assert got is out and reference.relative_l2(out, ref) <= L2
    assert lse.shape == (q.shape[1], q.shape[0]) and (lse.t().double() - rlse).abs().max().item() <= LSE_ABS



def test_more_query_rows_than_keys_is_a_named_error():
    """FlashAttention gives zeros for causal rows before the first key (seqlen_q > seqlen_k); hal's rows
    are the sequence's last tokens, so such a call is refused by name, never computed differently."""
    from hal.validate import ArgumentError
    q, kc, vc, table, seq, cu = _batch(70, [3, 20], [3, 1], 2, 2, 64, 16)
    cu5 = torch.tensor([0, 5, 6], dtype=torch.int32)
    q5 = torch.randn(6, q.shape[1], q.shape[2]).to(torch.bfloat16)
    with pytest.raises(ArgumentError, match="query_start_loc"):
        fa2.flash_attn_varlen_func(q5, kc, vc, cu5, torch.tensor([0, 3, 23], dtype=torch.int32), 5, 20, causal=True,
                                   block_table=table)


@pytest.mark.parametrize("rows,dtype", [(1, torch.bfloat16), (2, torch.bfloat16), (1, torch.float8_e4m3fn)])
def test_flash_mla_dense_decode(rows, dtype):
    """FlashMLA's dense decode (sgl-flash-mla 1.0.0's call): q [b, s_q, h, 576] over one [blocks, 64, 1, 576]
    cache whose first 512 columns are also the value; the metadata object keeps the plan for the next
    layer. Against hal's float64 reference over the same two views."""
    from hal.compat import flash_mla
    g = torch.Generator().manual_seed(rows)
    r, p, bs, h, lens = 512, 64, 64, 16, [150, 65, 128]
    nb = 12
    cache = torch.randn(nb, bs, 1, r + p, generator=g).to(dtype)
    table = torch.randperm(nb, generator=g)[:9].to(torch.int32).view(3, 3)
    seq = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(3, rows, h, r + p, generator=g).to(torch.bfloat16)
    meta, splits = flash_mla.get_mla_metadata(seq, rows * h, 1)
    assert splits is None and not meta.have_initialized
    ds = torch.tensor([0.05]) if dtype != torch.bfloat16 else None
    out, lse = flash_mla.flash_mla_with_kvcache(q, cache, table, seq, r, meta, causal=rows > 1, descale_k=ds)
    assert meta.have_initialized and out.shape == (3, rows, h, r) and lse.shape == (3, h, rows)
    qsl = torch.arange(0, 3 * rows + 1, rows, dtype=torch.int32)
    ref_lse = torch.empty(3 * rows, h, dtype=torch.float64)
    s = None if ds is None else 0.05
    ref = reference.mla_decode(q[..., :r].reshape(-1, h, r), q[..., r:].reshape(-1, h, p), cache[:, :, 0, :r],
                               cache[:, :, 0, r:], table, seq, qsl, scale=(r + p) ** -0.5, ckv_scale=s, kpe_scale=s,
                               lse=ref_lse)
    assert reference.relative_l2(out.reshape(-1, h, r), ref) <= L2
    assert (lse.permute(0, 2, 1).reshape(-1, h).double() - ref_lse).abs().max().item() <= LSE_ABS
    plan = meta.plan
    again, _ = flash_mla.flash_mla_with_kvcache(q, cache, table, seq, r, meta, causal=rows > 1, descale_k=ds)
    assert meta.plan is plan and torch.equal(again, out)
    with pytest.raises(NotServedError, match="indices"):
        flash_mla.flash_mla_with_kvcache(q, cache, table, seq, r, meta, indices=torch.zeros(3, rows, 8, dtype=torch.int32))
