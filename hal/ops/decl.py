"""What declaring an op means. One :class:`OpDecl` per op holds everything hal needs to serve it:
the torch schema, the public keywords' translation into that schema, validation into the frozen
call record packs receive, the fake (shape-only) check, the float64 reference and a typical call
for the probe's smoke test. Registration with ``torch.library``, the public functions, ``explain``,
the probe and the tests' op grids loop over the declared ops (:data:`hal.ops.OPS`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping


@dataclasses.dataclass(frozen=True)
class OpDecl:
    name: str
    schema: str                                  # "(Tensor(a!) out, ...) -> ()" without the name
    features: Mapping[str, str]                  # optional behaviours a call may use -> what they are
    schema_args: Callable[..., tuple]            # the public function's keywords -> the schema's arguments
    check: Callable[..., object]                 # the schema's arguments -> the validated call record
    tensors: Callable[..., dict]                 # the schema's arguments -> the tensors, by argument name
    fake: Callable[..., None]                    # shape-only checks (torch.compile, all-meta calls)
    result: Callable[[tuple], object]            # what the public function returns, from the schema's arguments
    finish: Callable[[object, tuple], None] = lambda call, args: None  # after the pack ran (e.g. copy out back)
    reference: Callable[[object], object] | None = None  # float64 result of a call record
    example: Callable[[object], dict] | None = None      # a typical call's keywords for a target (probe smoke test)
    # Planning (hal.plan): the public keywords that change from layer to layer under one plan, in the
    # order ``Plan.run`` takes them (tensors first, positional; then scales and ``out``, keywords).
    # Each is also the name of its field in the call record. ``scale_args``: which of them are
    # scales (a float or a float32 tensor); ``out`` (if listed) is the output, allocated when None.
    per_layer: tuple[str, ...] = ()
    scale_args: tuple[str, ...] = ()
    # optional outputs among them (``lse``): run takes one exactly when the plan was made with one
    extra_outputs: tuple[str, ...] = ()

    @property
    def pack_arg(self) -> int:
        """Every schema ends with ``str? pack``: the forced pack."""
        return -1


def fake_checks(name: str, tensors: Callable[..., dict], scales: tuple[tuple[str, int, int], ...]):
    """An op's fake: its tensors on one device and not requiring grad, and each scale given one way
    (``scales``: (name, index of the float, index of the tensor) in the schema's arguments)."""
    from hal import validate as v

    def fake(*args) -> None:
        t = tensors(*args)
        v.devices(name, t)
        v.no_autograd(name, t)
        for scale, value_at, tensor_at in scales:
            v.pick(name, scale, args[value_at], args[tensor_at])
    return fake


def copy_out_back(call, args: tuple) -> None:
    """``finish`` of an op with ``out`` first: a view whose last dim is strided was computed densely
    (validation gave the pack a dense ``call.out``): copy it back."""
    if call.out is not args[0]:
        args[0].copy_(call.out)
