#!/usr/bin/env python3
"""Build, for sm_90a and on a machine without a GPU, the FlashInfer JIT modules that the decode
bench's ``flashinfer-tc`` and ``flashinfer-cc`` contenders (hal/bench/baselines.py) load at run
time, and copy each to ``AOT_OUT/<name>/<name>.so``: the layout of ``flashinfer/data/aot/``, where
FlashInfer looks for a module before it would compile one.

What the wrapper asks for (flashinfer-python 0.7.4, ``flashinfer/decode.py``,
``BatchDecodeWithPagedKVCacheWrapper._plan_impl``), for bf16 queries and outputs, int32 indices,
``pos_encoding_mode="NONE"``, no sliding window, no soft cap, no token-head scales:

* ``tc`` (``use_tensor_cores=True, backend="fa2"``): ``flashinfer.prefill.get_batch_prefill_module(
  "fa2", q, kv, o, indptr.dtype, head_dim, head_dim, 0, False, False, False, False)``, which loads
  ``_gen_batch_prefill_primary_module("fa2", *args)`` (``flashinfer/jit/attention/modules.py``:
  the equal-K/V-stride primary, name suffix ``_kv_stride_equal``). Its companion,
  ``_gen_batch_prefill_independent_paged_module``, is loaded only when K and V have different
  strides, which the bench's copies never have, so it is not built.
* ``cc`` (``use_tensor_cores=False``): ``flashinfer.decode.get_batch_decode_module(q, kv, o,
  indptr.dtype, head_dim, head_dim, 0, False, False)`` = ``gen_batch_decode_module(...)``.

The page size is a run-time argument of both (``plan(..., page_size, ...)``; the kernels take it
from the cache's shape): one module serves pages of 16 and 64. The head size and the KV dtype are
compile-time, so there is one module per (kind, head_dim, KV dtype). The names are printed; they are
version-specific: build with exactly the FlashInfer that is carried. Called by prep.sh, which sets
FLASHINFER_CUDA_ARCH_LIST=9.0a, CUDA_HOME, FLASHINFER_WORKSPACE_BASE, MAX_JOBS and AOT_OUT.

usage: prebuild.py [tc] [cc] [64] [128] [256] [bf16] [e4m3fn] [--names]
    (default: tc cc 64 128 256 bf16 e4m3fn; --names prints the module names and builds nothing)
"""
import os
import shutil
import sys
import time
from pathlib import Path

import torch

KINDS = ("tc", "cc")
HEADS = (64, 128, 256)
KV = {"bf16": torch.bfloat16, "e4m3fn": torch.float8_e4m3fn}


def specs(kinds, heads, kvs):
    from flashinfer.jit.attention.modules import _gen_batch_prefill_primary_module, gen_batch_decode_module

    bf16, i32 = torch.bfloat16, torch.int32
    out = []
    for kind in kinds:
        for d in heads:
            for kv in kvs:
                if kind == "tc":  # (backend, q, kv, o, idx, d_qk, d_vo, posenc, swa, soft cap, fp16 qk, token-head sf)
                    out.append(_gen_batch_prefill_primary_module("fa2", bf16, kv, bf16, i32, d, d, 0,
                                                                 False, False, False, False))
                else:  # (q, kv, o, idx, d_qk, d_vo, posenc, swa, soft cap)
                    out.append(gen_batch_decode_module(bf16, kv, bf16, i32, d, d, 0, False, False))
    return out


def parse(argv):
    words = [w for w in argv if w != "--names"]
    unknown = [w for w in words if w not in KINDS and w not in KV and w not in map(str, HEADS)]
    if unknown:
        raise SystemExit(f"unknown argument(s) {unknown}; expected {KINDS}, {HEADS}, {tuple(KV)}, --names")
    kinds = [k for k in KINDS if k in words] or list(KINDS)
    heads = [d for d in HEADS if str(d) in words] or list(HEADS)
    kvs = [KV[k] for k in KV if k in words] or list(KV.values())
    return kinds, heads, kvs


def main() -> int:
    todo = specs(*parse(sys.argv[1:]))
    for s in todo:
        print("spec", s.name, flush=True)
    if "--names" in sys.argv[1:]:
        return 0
    from flashinfer.jit import build_jit_specs
    from flashinfer.jit import env as jit_env

    t = time.time()
    build_jit_specs(todo, verbose=False)
    print(f"built {len(todo)} modules in {time.time() - t:.0f} s", flush=True)
    out = Path(os.environ.get("AOT_OUT", "aot"))
    out.mkdir(parents=True, exist_ok=True)
    for s in todo:
        src = jit_env.FLASHINFER_JIT_DIR / s.name / f"{s.name}.so"
        (out / s.name).mkdir(exist_ok=True)
        shutil.copy2(src, out / s.name / f"{s.name}.so")
        print("copied", s.name, src.stat().st_size, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
