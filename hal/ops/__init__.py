"""The declared ops and their registration with ``torch.library`` (schema, CPU and CUDA
implementations, fake implementations), so ``torch.compile(fullgraph=True)`` sees one opaque op and
CUDA graphs capture whatever the selected pack launches. Every op writes into tensors it is given
and returns nothing; the implementation validates into the op's call record, asks the dispatcher
for a pack and runs that pack's implementation of the op on the record. Calling ``torch.ops.hal.*``
directly is therefore as safe as calling the public function.

Adding an op: a module here with its :class:`~hal.ops.decl.OpDecl`, listed in :data:`OPS`, and the
packs that implement it. Nothing else loops over op names by hand.
"""

from __future__ import annotations

import torch

from hal import dispatch, validate
from hal.ops import cache_kv as _cache_kv
from hal.ops import cache_mla as _cache_mla
from hal.ops import mla_decode as _mla_decode
from hal.ops import paged_attention as _paged_attention
from hal.ops.decl import OpDecl

OPS: dict[str, OpDecl] = {d.name: d for d in (_paged_attention.DECL, _cache_kv.DECL, _mla_decode.DECL,
                                                _cache_mla.DECL)}

LIB = torch.library.Library("hal", "DEF")  # noqa: TOR901 - the library lives as long as the process


def _implementation(decl: OpDecl):
    def impl(*args):
        validate.no_autograd(decl.name, decl.tensors(*args))
        call = decl.check(*args)
        dispatch.select(call.call_key, args[decl.pack_arg]).impl(decl.name)(call)
        decl.finish(call, args)
    impl.__name__ = f"{decl.name}_impl"
    return impl


def _fake(decl: OpDecl):
    # FakeTensors (torch.compile) carry their real device; a meta tensor among real ones also lands
    # here, which the decl's fake refuses.
    def fake(*args):
        decl.fake(*args)
    fake.__name__ = f"{decl.name}_fake"
    return fake


for _decl in OPS.values():
    LIB.define(_decl.name + _decl.schema)
    for _device in ("CPU", "CUDA"):  # ROCm torch registers its GPUs under CUDA too
        LIB.impl(_decl.name, _implementation(_decl), _device)
    torch.library.register_fake(f"hal::{_decl.name}", _fake(_decl), lib=LIB)


def call(name: str, **kwargs):
    """Run the declared op ``name`` with the public function's keywords."""
    decl = OPS[name]
    args = decl.schema_args(**kwargs)
    getattr(torch.ops.hal, name).default(*args)
    return decl.result(args)


def prepare(name: str, **kwargs):
    """The validated call record of op ``name`` for these keywords, without running it (tests call
    a pack's implementation on it directly; ``explain`` dispatches it)."""
    decl = OPS[name]
    args = decl.schema_args(**kwargs)
    validate.no_autograd(name, decl.tensors(*args))
    return decl.check(*args)
