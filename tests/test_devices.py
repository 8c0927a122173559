"""Issue 18, part 1 on any machine: a call whose tensors are on two devices is a clear error naming the
argument, for every op and for hal.plan, checked here by moving one tensor at a time to the ``meta``
device (which no pack computes on). On GPUs, tests/test_multi_gpu.py runs the ops with the current
device set to another GPU than the tensors' (tests/multigpu/tp_step.py)."""

from __future__ import annotations

import pytest
import torch
from test_emu_mla import make_mla

import hal

pytestmark = pytest.mark.emu


def _decode_args():
    q = torch.randn(2, 4, 64).bfloat16()
    kc = torch.zeros(4, 2, 16, 64, dtype=torch.bfloat16)
    return dict(query=q, key_cache=kc, value_cache=kc.clone(), block_tables=torch.tensor([[0], [1]], dtype=torch.int32),
                seq_lens=torch.tensor([3, 5], dtype=torch.int32))


def _cache_kv_args():
    kc = torch.zeros(4, 2, 16, 64, dtype=torch.bfloat16)
    return dict(key=torch.randn(3, 2, 64), value=torch.randn(3, 2, 64), key_cache=kc, value_cache=kc.clone(),
                slot_mapping=torch.tensor([0, 1, 2]))


def _mla_args():
    case = make_mla([20, 7], heads=16, ckv_dtype=torch.bfloat16, seed=1)
    args = {k: case[k] for k in ("q_nope", "q_pe", "ckv_cache", "kpe_cache", "block_tables", "seq_lens")}
    return {**args, "scale": case["scale"], "ckv_scale": case["ckv_scale"], "kpe_scale": case["kpe_scale"]}


def _cache_mla_args():
    buf = torch.zeros(2, 16, 576, dtype=torch.bfloat16)
    return dict(kv_c=torch.randn(3, 512), k_pe=torch.randn(3, 64), ckv_cache=buf[..., :512], kpe_cache=buf[..., 512:],
                slot_mapping=torch.tensor([0, 1, 2]))


CASES = {
    "paged_attention": (_decode_args, ("query", "key_cache", "value_cache", "block_tables", "seq_lens")),
    "cache_kv": (_cache_kv_args, ("key", "value", "key_cache", "value_cache", "slot_mapping")),
    "mla_decode": (_mla_args, ("q_nope", "q_pe", "ckv_cache", "kpe_cache", "block_tables", "seq_lens")),
    "cache_mla": (_cache_mla_args, ("kv_c", "k_pe", "ckv_cache", "kpe_cache", "slot_mapping")),
}


def _moved(args: dict, name: str) -> dict:
    out = dict(args)
    out[name] = args[name].to("meta")
    if name == "ckv_cache" and "kpe_cache" in args and args["kpe_cache"]._base is not None:
        out["ckv_cache"] = torch.empty_like(args["ckv_cache"], device="meta")
    return out


@pytest.mark.parametrize("op,name", [(op, n) for op, (_, names) in CASES.items() for n in names])
@pytest.mark.parametrize("how", ["call", "plan"])
def test_a_tensor_on_another_device_is_an_error_naming_it(op, name, how):
    make, _ = CASES[op]
    args = _moved(make(), name)
    run = (lambda: getattr(hal, op)(**args)) if how == "call" else (lambda: hal.plan(op, **args))
    with pytest.raises((ValueError, TypeError)) as e:
        run()
    text = str(e.value)
    # the moved tensor is named, or (when it is the one the others are compared with) the other
    # tensor is, with both devices
    names = CASES[op][1]
    assert "meta" in text and (name in text or ("cpu" in text and any(n in text for n in names))), text


@pytest.mark.parametrize("op", sorted(CASES))
def test_the_same_calls_on_one_device_run(op):
    make, _ = CASES[op]
    getattr(hal, op)(**make())
