#!/usr/bin/env python3
"""Build, for sm_90a and on a machine without a GPU, the FlashInfer JIT modules that
``BatchMLAPagedAttentionWrapper(..., backend="fa3")`` loads at run time in the MLA decode bench
(hal/bench/mla_baselines.py), and copy each to ``AOT_OUT/<name>/<name>.so``: the layout of
``flashinfer/data/aot/``, where FlashInfer looks for a module before it would compile one.

What the wrapper asks for (flashinfer-python 0.7.4, ``flashinfer/mla/_batch_mla/_backends/
fa3_backend.py``): ``get_batch_mla_module("fa3", q_data_type, kv_data_type, output_dtype,
qo_indptr.dtype, head_dim_ckv, head_dim_kpe, use_profiler)``, which is
``flashinfer.jit.gen_batch_mla_module(...)`` (``flashinfer/jit/attention/modules.py``). The bench
plans with bf16 queries and outputs, int32 indices, head_dim_ckv 512, head_dim_kpe 64, no profiler,
and a bf16 or an e4m3fn cache, so the two modules are

    batch_mla_attention_dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32_head_dim_ckv_512_head_dim_kpe_64_profiler_False_planabi2_sm90
    batch_mla_attention_dtype_q_bf16_dtype_kv_e4m3_dtype_o_bf16_dtype_idx_i32_head_dim_ckv_512_head_dim_kpe_64_profiler_False_planabi2_sm90

(the names are printed; they are version-specific: build with exactly the FlashInfer that is
carried). Called by prep.sh, which sets FLASHINFER_CUDA_ARCH_LIST=9.0a, CUDA_HOME,
FLASHINFER_WORKSPACE_BASE, MAX_JOBS and AOT_OUT.

usage: prebuild_mla.py [bf16] [e4m3fn] [fa2]     (default: bf16 e4m3fn, fa3 backend only;
                                                   ``fa2`` adds the fa2 modules of both)
"""
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from flashinfer.jit import build_jit_specs, gen_batch_mla_module
from flashinfer.jit import env as jit_env

KV = {"bf16": torch.bfloat16, "e4m3fn": torch.float8_e4m3fn}


def specs(which: list[str]):
    kvs = [KV[w] for w in which if w in KV] or list(KV.values())
    backends = ["fa3"] + (["fa2"] if "fa2" in which else [])
    out = []
    for backend in backends:
        for kv in kvs:
            # the wrapper's call: (backend, q, kv, o, qo_indptr.dtype, head_dim_ckv, head_dim_kpe, use_profiler)
            out.append(gen_batch_mla_module(backend, torch.bfloat16, kv, torch.bfloat16, torch.int32, 512, 64, False))
    return out


def main() -> int:
    unknown = [w for w in sys.argv[1:] if w not in KV and w != "fa2"]
    if unknown:
        print(f"unknown argument(s) {unknown}; expected bf16, e4m3fn, fa2", file=sys.stderr)
        return 2
    todo = specs(sys.argv[1:])
    for s in todo:
        print("spec", s.name, flush=True)
    t = time.time()
    build_jit_specs(todo, verbose=False)
    print(f"built in {time.time() - t:.0f} s", flush=True)
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
