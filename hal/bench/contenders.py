"""What the benchmark compares. Each contender turns a problem into a callable that computes the
attention output (``Prepared``) or raises :class:`~hal.bench.baselines.Skip` with the reason it
cannot run it here. A contender serves decode problems, prefill problems (hal.bench.prefill), or
both (``ops``); a problem gets a row from every selected contender that serves its op.

* ``hal``: the public call with automatic dispatch (``hal.paged_attention``; validation included),
  the note says which pack it picked.
* ``hal:NAME``: every other pack hal knows (``hal.packs()``), forced with ``pack=NAME``.
* ``hal-plan``: ``hal.plan(...)`` made once before timing, ``plan.run(...)`` timed (what an engine
  pays per layer; its host µs beside ``hal``'s is the one-shot call's validation and dispatch saved;
  ``tools/host_time`` measures that per layer with the GPU idle and with a queue of work).
* ``compat-fa2``, ``compat-fa3``, ``compat-flashinfer``: the drop-in entry points (:mod:`hal.bench.compat`):
  an engine's FlashAttention or FlashInfer call, served by hal.
* ``emu-torch`` / ``emu-triton``: the emu pack's two paths called directly (no validation, no
  dispatch): ``hal.kernelpacks.emu.torch_path`` / ``.triton_path``.
* ``torch-sdpa``, ``flashinfer-tc``, ``flashinfer-cc``: the decode baselines (:mod:`hal.bench.baselines`).
* prefill: ``torch-sdpa`` (dense K/V), ``flashinfer-prefill``, ``fa3``, ``fa3-fp8``
  (:mod:`hal.bench.prefill_baselines`); ``emu-torch`` is the emu pack's multi-token PyTorch path
  (``torch_prefill``), ``emu-triton`` its multi-token Triton path where the tree has one.
* MLA decode (:mod:`hal.bench.mla`): ``hal`` / ``hal:NAME`` call ``hal.mla_decode``, ``emu-torch`` /
  ``emu-triton`` the emu pack's MLA paths (``torch_mla`` / ``triton_mla``); the baselines are
  ``torch`` (plain PyTorch, the MLA rows' speed-up reference), ``flashmla``, ``flashmla-fp8`` and
  ``flashinfer-mla`` (:mod:`hal.bench.mla_baselines`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib
from collections.abc import Callable

import torch

import hal
from hal.bench import baselines, mla_baselines, prefill_baselines
from hal.bench.baselines import Skip
from hal.bench.check import emu_runner
from hal.bench.data import Problem
from hal.bench.prefill import emu_call_record

DECODE, PREFILL, MLA = "decode", "prefill", "mla"
BOTH = frozenset({DECODE, PREFILL})
EVERY_OP = frozenset({DECODE, PREFILL, MLA})


@dataclasses.dataclass
class Prepared:
    run: Callable[[], object]           # one call; returns the output tensor or writes ``out``
    out: torch.Tensor | None = None     # poisoned with NaN before the checked call
    note: str = ""
    tolerance: float | None = None      # this problem's own bound (overrides the contender's)


@dataclasses.dataclass(frozen=True)
class Contender:
    name: str
    kind: str                           # "hal" | "emu path" | "baseline"
    what: str
    setup: Callable[[Problem, dict], Prepared]
    ops: frozenset = BOTH               # which problems it serves: "decode", "prefill"
    tolerance: float | None = None      # overrides the check's dtype tolerance (rounds to FP8 on purpose)

    def serves(self, p) -> bool:
        return getattr(p, "op", DECODE) in self.ops


def _hal(pack: str | None):
    def setup(p: Problem, opts: dict) -> Prepared:
        if pack is not None:
            known = {x.NAME: x for x in hal.packs()}
            if pack not in known:
                raise Skip(f"no pack named {pack!r} in this build")
            if not known[pack].availability.ok:
                raise Skip("unavailable: " + "; ".join(known[pack].availability.reasons))
        if p.op == MLA:
            return Prepared(*mla_baselines.hal_mla(p, pack))
        varlen = {}
        if p.op == PREFILL:
            varlen = {"query_start_loc": p.query_start_loc, "max_query_len": p.max_query_len, "causal": True}
        decision = hal.explain(p.query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens, scale=p.scale,
                               k_scale=p.k_scale, v_scale=p.v_scale, max_seq_len=p.max_seq_len, pack=pack, **varlen)
        if decision.pack is None:
            reasons = [r for v in decision.verdicts if v.kind in ("rejected", "unavailable") for r in v.reasons]
            raise Skip("cannot serve this call: " + ("; ".join(dict.fromkeys(reasons)) or "no pack fits"))
        note = "" if pack is not None else f"dispatched to {decision.pack.NAME}" + \
            (" (fallback)" if decision.fallback else "")
        out = torch.empty_like(p.query)
        q, kc, vc, bt, sl = p.query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens
        kw = dict(scale=p.scale, k_scale=p.k_scale, v_scale=p.v_scale, max_seq_len=p.max_seq_len, out=out, pack=pack,
                  **varlen)

        def run():
            hal.paged_attention(q, kc, vc, bt, sl, **kw)

        return Prepared(run, out, note)
    return setup


def nhd_caches(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """The problem's caches as an engine holding NHD [blocks, block_size, kv_heads, d] passes them: the
    permute(0, 2, 1, 3) views of NHD copies (the same values; made once per problem)."""
    if "nhd" not in p.extra:
        p.extra["nhd"] = tuple(c.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
                               for c in (p.key_cache, p.value_cache))
    return p.extra["nhd"]


def _hal_nhd(p: Problem, opts: dict) -> Prepared:
    """As ``hal`` (automatic dispatch), over the NHD views of the same caches: a strided cache's cost."""
    if p.op != DECODE:
        raise Skip("decode problems only")
    kc, vc = nhd_caches(p)
    decision = hal.explain(p.query, kc, vc, p.block_tables, p.seq_lens, scale=p.scale, k_scale=p.k_scale,
                           v_scale=p.v_scale, max_seq_len=p.max_seq_len)
    if decision.pack is None:
        raise Skip("cannot serve this call")
    out = torch.empty_like(p.query)
    kw = dict(scale=p.scale, k_scale=p.k_scale, v_scale=p.v_scale, max_seq_len=p.max_seq_len, out=out)
    q, bt, sl = p.query, p.block_tables, p.seq_lens
    return Prepared(lambda: hal.paged_attention(q, kc, vc, bt, sl, **kw), out,
                    f"NHD views, dispatched to {decision.pack.NAME}" + (" (fallback)" if decision.fallback else ""))


def _hal_plan(p: Problem, opts: dict) -> Prepared:
    """The plan made here (validation, dispatch, launch planning: not timed); each timed call is one
    ``plan.run`` with the problem's per-layer tensors."""
    if p.op == MLA:
        qn, qp, ckv, kpe, bt, sl = mla_baselines._args(p)
        kw = mla_baselines._hal_kwargs(p)
        out = mla_baselines._out(p)
        plan = hal.plan("mla_decode", qn, qp, ckv, kpe, bt, sl, out=out, **kw)
        cs, ps = kw["ckv_scale"], kw["kpe_scale"]
        return Prepared(lambda: plan.run(qn, qp, ckv, kpe, ckv_scale=cs, kpe_scale=ps, out=out), out,
                        f"plan on {plan.pack}")
    varlen = {}
    if p.op == PREFILL:
        varlen = {"query_start_loc": p.query_start_loc, "max_query_len": p.max_query_len, "causal": True}
    out = torch.empty_like(p.query)
    q, kc, vc, ks, vs = p.query, p.key_cache, p.value_cache, p.k_scale, p.v_scale
    try:
        plan = hal.plan("paged_attention", q, kc, vc, p.block_tables, p.seq_lens, scale=p.scale, k_scale=ks,
                        v_scale=vs, max_seq_len=p.max_seq_len, out=out, **varlen)
    except hal.NotSupportedError as exc:
        raise Skip(f"cannot serve this call: {str(exc).splitlines()[0]}") from None
    return Prepared(lambda: plan.run(q, kc, vc, k_scale=ks, v_scale=vs, out=out), out, f"plan on {plan.pack}")


def _emu_torch(p: Problem, opts: dict) -> Prepared:
    if p.op == MLA:
        return Prepared(*mla_baselines.emu_torch(p))
    out = torch.empty_like(p.query)
    if p.op == PREFILL:
        from hal.kernelpacks.emu import torch_prefill
        call = emu_call_record(p, out)
        return Prepared(lambda: torch_prefill.paged_attention(call), out, "torch_prefill")
    from hal.kernelpacks.emu import torch_path
    return Prepared(emu_runner(torch_path, out, p), out)


# where the emu pack's multi-token Triton path lives (module, function taking the call record)
EMU_TRITON_VARLEN = (("hal.kernelpacks.emu.triton_prefill", "paged_attention"),
                     ("hal.kernelpacks.emu.triton_path", "paged_attention_varlen"))


def _emu_triton_varlen(p: Problem) -> Prepared:
    import importlib.util
    for name, fn in EMU_TRITON_VARLEN:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            continue
        module = importlib.import_module(name)
        if hasattr(module, fn):
            out = torch.empty_like(p.query)
            call = emu_call_record(p, out)
            impl = getattr(module, fn)
            return Prepared(lambda impl=impl, call=call: impl(call), out, f"{name.rsplit('.', 1)[1]}.{fn}")
    raise Skip("the emu pack has no multi-token Triton path in this tree; looked for "
               + ", ".join(f"{m.rsplit('.', 1)[1]}.{f}" for m, f in EMU_TRITON_VARLEN))


def _emu_triton(p: Problem, opts: dict) -> Prepared:
    if p.device.type != "cuda":
        raise Skip("the Triton path runs on GPUs only")
    from hal.kernelpacks.emu import pack as emu_pack
    why = emu_pack.triton_usable()
    if why:
        raise Skip(f"Triton path not usable: {why}")
    if p.op == MLA:
        return Prepared(*mla_baselines.emu_triton(p))
    if p.op == PREFILL:
        return _emu_triton_varlen(p)
    name = "hal.kernelpacks.emu.triton_path"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name in (name, "triton") or (exc.name and name.startswith(exc.name)):
            raise Skip(f"{name} is not in this tree yet ({exc})") from None
        raise
    out = torch.empty_like(p.query)
    return Prepared(emu_runner(module, out, p), out)


def _torch_sdpa(p: Problem, opts: dict) -> Prepared:
    if p.op == PREFILL:
        run, out, note = prefill_baselines.torch_sdpa(p)
        return Prepared(run, out, note)
    return Prepared(baselines.torch_sdpa(p))


def _prefill_baseline(fn, with_opts: bool = False):
    def setup(p: Problem, opts: dict) -> Prepared:
        run, out, note = fn(p, bool(opts.get("flashinfer_jit"))) if with_opts else fn(p)
        return Prepared(run, out, note)
    return setup


def _flashinfer(tensor_cores: bool):
    def setup(p: Problem, opts: dict) -> Prepared:
        run, out, note = baselines.flashinfer_decode(p, tensor_cores, bool(opts.get("flashinfer_jit")))
        return Prepared(run, out, note)
    return setup


def _mla(fn, with_opts: bool = False):
    def setup(p, opts: dict) -> Prepared:
        return Prepared(*(fn(p, bool(opts.get("flashinfer_jit"))) if with_opts else fn(p)))
    return setup


BASELINE = "torch-sdpa"
MLA_BASELINE = "torch"
BASELINES = {DECODE: BASELINE, PREFILL: BASELINE, MLA: MLA_BASELINE}   # the speed-ups' reference, per op


def _hal_split(p: Problem, opts: dict) -> Prepared:
    """A mixed batch as two calls, its one-row sequences (laid out first, as a SPEC's decode group is)
    as a decode call and the rest as a multi-token call, on views of the same tensors: what the one
    mixed call is measured against (the cuda issue: within 10%)."""
    if p.op != PREFILL:
        raise Skip("prefill problems only")
    qlens = [b - a for a, b in zip(p.starts, p.starts[1:])]
    k = next((i for i, q in enumerate(qlens) if q != 1), len(qlens))
    if k == 0 or k == len(qlens) or any(q == 1 for q in qlens[k:]):
        raise Skip("not a mixed batch with its one-row sequences first")
    out = torch.empty_like(p.query)
    common = dict(scale=p.scale, k_scale=p.k_scale, v_scale=p.v_scale)
    dec = (p.query[:k], p.key_cache, p.value_cache, p.block_tables[:k], p.seq_lens[:k])
    pre = (p.query[k:], p.key_cache, p.value_cache, p.block_tables[k:], p.seq_lens[k:])
    # each call with its own host bounds, as an engine issuing two calls would pass them
    dec_kw = dict(max_seq_len=max(p.lens[:k]))
    pre_kw = dict(query_start_loc=(p.query_start_loc[k:] - k).contiguous(), max_query_len=p.max_query_len,
                  max_seq_len=max(p.lens[k:]), causal=True)
    names = {hal.explain(*dec, **common, **dec_kw).pack.NAME, hal.explain(*pre, **common, **pre_kw).pack.NAME}

    def run():
        hal.paged_attention(*dec, **common, **dec_kw, out=out[:k])
        hal.paged_attention(*pre, **common, **pre_kw, out=out[k:])

    return Prepared(run, out, f"2 calls ({k} decode rows, then the rest), dispatched to {'/'.join(sorted(names))}")


def _hal_cuda_kernel(attr: str, kernel: str, source: str):
    """The cuda pack with one of its kernel choices (``launch.<attr>``) forced to ``kernel``."""
    def prepare(p: Problem, opts: dict) -> Prepared:
        prepared = _hal("cuda")(p, opts)  # first: a skip with its reason where the pack is unavailable
        from hal.kernelpacks.cuda import launch
        inner = prepared.run

        def run():
            saved = getattr(launch, attr)
            setattr(launch, attr, kernel)
            try:
                inner()
            finally:
                setattr(launch, attr, saved)

        return Prepared(run, prepared.out, f"{source} ({kernel}) where it runs")
    return prepare


def _hal_cuda_wgmma(p: Problem, opts: dict) -> Prepared:
    """The cuda pack with its sm_90a kernel forced: csrc/prefill_sm90.cuh for multi-token attention,
    csrc/mla_sm90.cuh for MLA decode (64-row tiles)."""
    if p.op == PREFILL:
        return _hal_cuda_kernel("PREFILL_KERNEL", "wgmma", "csrc/prefill_sm90.cuh")(p, opts)
    if p.op == MLA:
        return _hal_cuda_kernel("MLA_KERNEL", "wgmma", "csrc/mla_sm90.cuh")(p, opts)
    raise Skip("prefill and MLA problems only")


def _hal_cuda_cute(p: Problem, opts: dict) -> Prepared:
    """The cuda pack with its CuTe multi-token kernel forced (csrc/prefill_cute.cuh: head 64 and 128;
    other heads take csrc/prefill_sm90.cuh or mma.sync)."""
    if p.op != PREFILL:
        raise Skip("prefill problems only")
    return _hal_cuda_kernel("PREFILL_KERNEL", "cute", "csrc/prefill_cute.cuh")(p, opts)


def _hal_cuda_mma(p: Problem, opts: dict) -> Prepared:
    """The cuda pack with its mma.sync MLA kernel (csrc/mla.cuh) forced."""
    if p.op != MLA:
        raise Skip("MLA problems only")
    return _hal_cuda_kernel("MLA_KERNEL", "mma", "csrc/mla.cuh")(p, opts)


def _hal_cuda_narrow(p: Problem, opts: dict) -> Prepared:
    """The cuda pack with its narrow MLA kernel (csrc/mla_narrow.cuh: warps split the latent's columns)
    forced for 16-row tiles."""
    if p.op != MLA:
        raise Skip("MLA problems only")
    return _hal_cuda_kernel("MLA_KERNEL", "narrow", "csrc/mla_narrow.cuh")(p, opts)


def _hal_cuda_uniform(p: Problem, opts: dict) -> Prepared:
    """The cuda pack with MLA decode's uniform split (launch.MLA_SCHEDULE = "uniform") instead of the
    balanced work list of csrc/mla_schedule.cu."""
    if p.op != MLA:
        raise Skip("MLA problems only")
    return _hal_cuda_kernel("MLA_SCHEDULE", "uniform", "the uniform split")(p, opts)


def _compat(fn):
    def setup(p, opts: dict) -> Prepared:
        return Prepared(fn(p), None, "hal.compat")
    return setup


def baseline_for(op: str) -> str:
    return BASELINES.get(op, BASELINE)


def all_contenders() -> list[Contender]:
    """Every contender this build knows, in display order (packs found at run time)."""
    out = [Contender("hal", "hal", "hal.paged_attention / hal.mla_decode, automatic dispatch", _hal(None),
                     ops=EVERY_OP),
           Contender("hal-plan", "hal", "hal.plan once (not timed), then plan.run per call, automatic dispatch",
                     _hal_plan, ops=EVERY_OP),
           Contender("hal-nhd", "hal", "hal.paged_attention over NHD cache views (permute(0, 2, 1, 3) of NHD "
                     "copies), automatic dispatch", _hal_nhd, ops=frozenset({DECODE}))]
    out.append(Contender("hal-split", "hal", "a mixed batch as two hal.paged_attention calls (decode rows, then "
                         "the multi-token rest), automatic dispatch", _hal_split, ops=frozenset({PREFILL})))
    for p in hal.packs():
        if p.NAME != "emu":
            out.append(Contender(f"hal:{p.NAME}", "hal", f"hal.paged_attention / hal.mla_decode(pack={p.NAME!r})",
                                 _hal(p.NAME), ops=EVERY_OP))
        if p.NAME == "cuda":
            out.append(Contender("hal:cuda-wgmma", "hal", "hal.paged_attention / hal.mla_decode(pack='cuda') with "
                                 "the sm_90a kernel forced (wgmma, producer warpgroup)", _hal_cuda_wgmma,
                                 ops=frozenset({PREFILL, MLA})))
            out.append(Contender("hal:cuda-cute", "hal", "hal.paged_attention(pack='cuda') with the CuTe "
                                 "multi-token kernel forced (sm_90a, head 64/128)", _hal_cuda_cute,
                                 ops=frozenset({PREFILL})))
            out.append(Contender("hal:cuda-mma", "hal", "hal.mla_decode(pack='cuda') with the mma.sync kernel "
                                 "(csrc/mla.cuh) forced", _hal_cuda_mma, ops=frozenset({MLA})))
            out.append(Contender("hal:cuda-narrow", "hal", "hal.mla_decode(pack='cuda') with the narrow kernel "
                                 "(csrc/mla_narrow.cuh) forced for 16-row tiles", _hal_cuda_narrow,
                                 ops=frozenset({MLA})))
            out.append(Contender("hal:cuda-uniform", "hal", "hal.mla_decode(pack='cuda') with the uniform split "
                                 "of the context (planned on the host from the longest sequence) instead of the "
                                 "balanced work list", _hal_cuda_uniform, ops=frozenset({MLA})))
    from hal.bench import compat
    for name, (fn, what, ops) in {
            "compat-fa2": (compat.fa2_varlen, "hal.compat.flash_attn.flash_attn_varlen_func (FA2's call, block table, "
                           "NHD caches), 16-bit caches", BOTH),
            "compat-fa3": (compat.fa3_kvcache, "hal.compat.flash_attn_interface.flash_attn_with_kvcache (FA3's call as "
                           "vLLM makes it: page_table, varlen rows, k/v descales), NHD caches", BOTH),
            "compat-flashinfer": (compat.flashinfer_wrapper, "hal.compat.flashinfer decode / prefill wrapper (plan "
                                  "not timed, run timed), HND caches", BOTH)}.items():
        out.append(Contender(name, "hal", what, _compat(fn), ops=ops))
    out += [
        Contender("emu-torch", "emu path", "emu pack, PyTorch path, called directly", _emu_torch, ops=EVERY_OP),
        Contender("emu-triton", "emu path", "emu pack, Triton path, called directly", _emu_triton, ops=EVERY_OP),
        Contender(BASELINE, "baseline", "plain PyTorch: decode: padded gather + cast/scale + SDPA (GQA) timed; "
                  "prefill: SDPA (causal, bottom-right) on dense K/V gathered before timing", _torch_sdpa),
        Contender("flashinfer-tc", "baseline", "FlashInfer BatchDecodeWithPagedKVCacheWrapper, tensor cores",
                  _flashinfer(True), ops=frozenset({DECODE})),
        Contender("flashinfer-cc", "baseline", "FlashInfer BatchDecodeWithPagedKVCacheWrapper, CUDA cores",
                  _flashinfer(False), ops=frozenset({DECODE})),
        Contender("flashinfer-prefill", "baseline", "FlashInfer BatchPrefillWithPagedKVCacheWrapper, fa2, causal",
                  _prefill_baseline(prefill_baselines.flashinfer_prefill, True), ops=frozenset({PREFILL})),
        Contender("fa3", "ceiling", "FlashAttention-3 (fa3-fwd) varlen, bf16, contiguous K/V",
                  _prefill_baseline(prefill_baselines.fa3_bf16), ops=frozenset({PREFILL})),
        Contender("fa3-fp8", "ceiling", "FlashAttention-3 (fa3-fwd) varlen, FP8 Q/K/V with descales, contiguous K/V",
                  _prefill_baseline(prefill_baselines.fa3_fp8), ops=frozenset({PREFILL}),
                  tolerance=prefill_baselines.FA3_FP8_TOLERANCE),
        Contender(MLA_BASELINE, "baseline", "plain PyTorch MLA: padded gather, dequantize, float32 scores, softmax, "
                  "bf16 probabilities x latent, all timed", _mla(mla_baselines.torch_mla), ops=frozenset({MLA})),
        Contender("flashmla", "baseline", "FlashMLA (sgl-flash-mla) dense bf16 decode, page 64, the problem's own cache",
                  _mla(mla_baselines.flashmla_bf16), ops=frozenset({MLA})),
        Contender("flashmla-fp8", "baseline", "FlashMLA (sgl-flash-mla) dense FP8 decode: FP8 Q (quantized before "
                  "timing), latent and rotary part, P in FP8; flagged", _mla(mla_baselines.flashmla_fp8),
                  ops=frozenset({MLA}), tolerance=mla_baselines.FLASHMLA_FP8_TOLERANCE),
        Contender("flashinfer-mla", "baseline", "FlashInfer BatchMLAPagedAttentionWrapper, fa3, bf16 Q over a bf16 or "
                  "e4m3fn latent (rotary part copied to e4m3fn there: flagged)",
                  _mla(mla_baselines.flashinfer_mla, True), ops=frozenset({MLA})),
    ]
    return out


def select(patterns: list[str] | None, known: list[Contender] | None = None) -> list[Contender]:
    """Contenders whose names match any pattern (fnmatch, comma-separated allowed), in display
    order; the baselines (torch-sdpa; torch for MLA) are always kept, since every speed-up is quoted
    against them."""
    known = known if known is not None else all_contenders()
    if not patterns:
        return known
    pats = [t.strip() for item in patterns for t in item.split(",") if t.strip()]
    unknown = [x for x in pats if not any(fnmatch.fnmatch(c.name, x) for c in known)]
    if unknown:
        raise ValueError(f"no contender matches {', '.join(unknown)}: known are {', '.join(c.name for c in known)}")
    keep = set(BASELINES.values())
    return [c for c in known if c.name in keep or any(fnmatch.fnmatch(c.name, x) for x in pats)]
