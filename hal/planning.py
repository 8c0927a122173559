"""Planning once per step: ``hal.plan(op, ...)`` validates and dispatches a call's geometry once,
``Plan.run(...)`` runs it per layer.

An engine calls attention once per layer per step with the same batch geometry (block tables,
lengths, row offsets, shapes and dtypes, host bounds); only the layer's query, caches, scales and
output change. A one-shot call pays for validation, dispatch and the pack's launch planning every
time. :func:`plan` does all of it once, from a whole call (layer 0's tensors, say): the op's
declaration (:mod:`hal.ops`) checks every argument into its call record, exactly as the one-shot
call does (the same errors), the dispatcher picks the pack, and the pack prepares a runner
(:meth:`hal.pack.Pack.prepare`: the cuda pack computes its split of the context, allocates the
split-K workspace and builds its launch arguments here). :meth:`Plan.run` then takes one layer's
per-layer arguments (the declaration's ``per_layer`` names), checks that each is laid out like the
planned one (one tuple compare per tensor: dtype, shape, strides, device, 16-byte alignment but
for scales; the kind of each scale; straight-line code generated per op from its declaration), and
hands them to the runner. No validation of values, no dispatch, no host
sync; on the cuda pack no allocation either (with ``out`` given), so ``run`` is CUDA-graph safe.

Why skipping the rest is safe: everything the one-shot call validates that is not per-layer lives
in the plan (the same tensors: block tables, lengths, row offsets, bounds), and everything
dispatch and the pack's plan read from the per-layer tensors (dtypes, shapes, strides, alignment,
scale kinds) is what ``run`` compares. What ``run`` does not look at are values: a per-layer scale
*tensor* is not read to check it is finite and > 0 (the one-shot call reads it only on the CPU or
under ``HAL_DEBUG``), a float scale is. With ``HAL_DEBUG=1`` set when the plan is made, every
``run`` validates in full as the one-shot call would, and checks the result plans the same call.

A plan holds its geometry tensors (not copies): write a step's new block tables or lengths into
them in place (CUDA graphs) only within the bounds the plan was made with (``max_seq_len``,
``max_query_len``, the block table's width); anything else needs a new plan.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable

import torch

from hal import dispatch, env, validate
from hal import ops as _ops

__all__ = ["Plan", "plan", "record_runner"]

# what each per-layer argument is: its check in run. _EXTRA: an optional output (``lse``) that run
# takes exactly when the plan was made with one (_EXTRA_NONE: made without)
_TENSOR, _OUT, _SCALE, _FLOAT_SCALE, _EXTRA, _EXTRA_NONE = 0, 1, 2, 3, 4, 5
_F32_LO, _F32_HI = 2.0 ** -149, float(torch.finfo(torch.float32).max)   # validate.positive_f32's range
# the kinds a scale is planned as
_NONE, _FLOAT, _HOST0, _TENSOR0, _TENSOR1 = "none", "float", "host", "0-d tensor", "[n] tensor"


def record_runner(impl: Callable, call) -> Callable[[dict], None]:
    """The default runner of a plan: ``impl`` (a pack's implementation, taking a call record) on a
    copy of the planned record ``call`` with the layer's fields swapped in. The copy is a shallow
    one of the frozen record's ``__dict__`` (what ``dataclasses.replace`` gives, at a tenth of its
    cost): the same record the one-shot call would have built for that layer."""
    cls = type(call)
    base = dict(call.__dict__)
    new = object.__new__

    def run(fields: dict) -> None:
        rec = new(cls)
        d = rec.__dict__
        d.update(base)
        d.update(fields)
        impl(rec)
    run.__name__ = f"run_{getattr(impl, '__name__', 'impl')}"
    run.planned_fields = base  # Plan swaps the per-layer tensors in it for stand-ins (_stand_in)
    return run


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    """A tensor's layout without its memory (the meta device), for what a plan keeps of a layer."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _layout(t: torch.Tensor, scale: bool = False) -> tuple:
    """What run compares: dtype, shape, strides, device and (not for scales) 16-byte alignment. A GPU
    tensor's device is its index (``get_device`` is ~0.4 us a tensor cheaper than comparing
    ``.device``; any CPU or meta tensor gives -1, never a GPU's index); others keep ``.device``."""
    d = t.get_device()
    return (t.dtype, t.shape, t.stride(), d if d >= 0 else t.device, None if scale else t.data_ptr() % 16 == 0)


def _layout_text(sig: tuple) -> str:
    dtype, shape, stride, device, aligned = sig
    where = "" if aligned is None else ", 16-byte aligned" if aligned else ", not 16-byte aligned"
    on = f"GPU {device}" if isinstance(device, int) else device
    return f"{str(dtype).removeprefix('torch.')} {list(shape)} with strides {tuple(stride)} on {on}{where}"


def _scale_kind(planned, given) -> str:
    if isinstance(planned, torch.Tensor):
        return _TENSOR1 if planned.dim() == 1 else _TENSOR0
    if given is None:
        return _NONE
    if isinstance(given, torch.Tensor):  # a 0-d CPU tensor with a GPU cache: a host scalar
        return _HOST0
    return _FLOAT


class Plan:
    """One call's geometry, validated and dispatched once (see the module docstring). Made by
    :func:`hal.plan`; ``run`` per layer. Attributes: ``op``, ``pack`` (the name of the pack that
    runs it), ``call`` (the planned call record), ``per_layer`` (what ``run`` takes)."""

    def __init__(self, op: str, call, pack, runner: Callable[[dict], None], public: dict, debug: bool):
        decl = _ops.OPS[op]
        self.op, self.call, self.pack, self.per_layer = op, call, pack.NAME, decl.per_layer
        self._runner, self._public, self._debug = runner, public, debug
        self._device = None
        kinds, sigs = [], []
        for name in decl.per_layer:
            planned = getattr(call, name)
            given = public.get(name)
            if name in decl.scale_args:
                kind = _scale_kind(planned, given)
                kinds.append(_SCALE if kind in (_TENSOR0, _TENSOR1) else _FLOAT_SCALE)
                sigs.append((kind, _layout(planned, scale=True) if isinstance(planned, torch.Tensor) else None))
                continue
            if name in decl.extra_outputs:
                kinds.append(_EXTRA if planned is not None else _EXTRA_NONE)
                sigs.append(_layout(planned) if planned is not None else None)
                continue
            if planned is not given:
                validate.fail(op, name, "laid out with a unit stride in its last dim to be planned (hal.plan's "
                              "run neither copies nor allocates; the one-shot call copies such views)",
                              f"strides {tuple(given.stride())}")
            kinds.append(_OUT if name == "out" else _TENSOR)
            sigs.append(_layout(planned))
            if self._device is None:
                self._device = planned.device
        self._sigs = tuple(sigs)
        gpu = self._device is not None and self._device.type != "cpu" and self._device.index is not None
        # A runner may also take the layer's data pointers and scales directly (``raw`` with its
        # ``raw_layout``: the cuda pack's prepared launch): run then reads each pointer once, for its
        # alignment check and the launch, and builds no fields dict.
        raw = getattr(runner, "raw_layout", None)
        if raw is not None and not all(n in decl.per_layer for n in raw[0] + raw[2]):
            raw = None
        self._raw = runner.raw if raw is not None else None
        self.run = types.MethodType(_run_function(op, tuple(kinds), gpu, raw), self)
        # A plan keeps none of the tensors of the layer it was made over (every run gives its own), so
        # they are freed when their owner drops them: an engine's KV cache, while hal.compat keeps plans.
        stand_ins = {n: _stand_in(v) for n in decl.per_layer if isinstance(v := getattr(call, n), torch.Tensor)}
        light = object.__new__(type(call))
        light.__dict__.update(call.__dict__)
        light.__dict__.update(stand_ins)
        self.call = light
        self._public = {k: stand_ins.get(k, v) for k, v in public.items()}
        base = getattr(runner, "planned_fields", None)
        if base is not None:
            base.update((n, t) for n, t in stand_ins.items() if n in base)

    def __repr__(self) -> str:
        return f"<hal plan of {self.op} on pack {self.pack}: {self.call.call_key.describe()}>"

    def run(self, *args, **kwargs):  # replaced per plan by the function _run_function generates
        """One layer: the declaration's ``per_layer`` arguments (tensors positional or by name,
        scales and ``out`` by name), laid out like the planned ones. Returns ``out`` (allocated,
        with the planned strides, when not given) for attention ops, None for cache writes."""
        raise NotImplementedError

    def __call__(self, *args, **kwargs):
        return self.run(*args, **kwargs)

    # -- the slow paths: errors and HAL_DEBUG --------------------------------------------------
    def _extra(self, name: str, v, sig) -> None:
        """An optional output given to run where the plan has none, or missing where it has one."""
        if sig is None:
            validate.fail(self.op, name, f"None in plan.run (the plan was made without {name}; make one with it)",
                          validate.desc(v) if isinstance(v, torch.Tensor) else repr(v))
        if v is None:
            validate.fail(self.op, name, f"given to plan.run (the plan was made with {name}: "
                          f"{_layout_text(sig)})", "None")
        self._mismatch(name, v, sig)

    def _mismatch(self, name: str, v, sig: tuple) -> None:
        if v is None:
            got = "None"
        elif not isinstance(v, torch.Tensor):
            got = f"{v!r} ({type(v).__name__})"
        else:
            got = _layout_text(_layout(v, scale=sig[4] is None))
        validate.fail(self.op, name, f"laid out like the planned one ({_layout_text(sig)}) in plan.run; "
                      f"another layout needs a new hal.plan", got)

    def _scale(self, name: str, v, planned):
        kind, sig = planned
        if kind in (_FLOAT, _NONE, _HOST0):
            if v is None:
                if kind == _NONE:
                    return 1.0
                validate.fail(self.op, name, f"given to plan.run (the plan was made with a {kind} {name}; "
                              "None would mean 1.0)", "None")
            if isinstance(v, torch.Tensor):
                if v.dim() == 0 and v.device.type == "cpu" and v.dtype == torch.float32 \
                        and self._device.type != "cpu":
                    v = float(v.item())  # a host scalar, as the one-shot call takes it
                else:
                    validate.fail(self.op, name, f"a float in plan.run (the plan was made with a {kind} {name}; a "
                                  "tensor scale needs a plan made with a tensor)", validate.desc(v))
            f = validate.real(self.op, name, v, "a float or a float32 tensor")
            if not validate.positive_f32(f):
                validate.fail(self.op, name, validate.positive_f32_text(f), repr(f))
            return f
        try:
            ok = _layout(v, scale=True) == sig
        except AttributeError:
            ok = False
        if not ok:
            if not isinstance(v, torch.Tensor):
                validate.fail(self.op, name, f"a {kind} like the planned one in plan.run (a float scale needs a "
                              "plan made with a float)", f"{v!r} ({type(v).__name__})")
            self._mismatch(name, v, sig)
        return v

    def _full_check(self, values: dict) -> None:
        """HAL_DEBUG: validate this layer's call as the one-shot call would, and check it plans the
        same call (key and geometry) as the plan."""
        kw = {**self._public, **{k: v for k, v in values.items()}}
        call = _ops.prepare(self.op, **kw)
        if call.call_key != self.call.call_key or call.geometry != self.call.geometry:
            raise validate.ArgumentError(
                f"hal.{self.op}: this layer's arguments plan another call than the plan was made for "
                f"({call.call_key.describe()}; planned {self.call.call_key.describe()}); make a new hal.plan")


@functools.cache
def _positional(op: str) -> tuple[str, ...]:
    """The names of the public function's positional parameters (``schema_args`` mirrors it)."""
    params = inspect.signature(_ops.OPS[op].schema_args).parameters.values()
    return tuple(p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD)


@functools.cache
def _run_function(op: str, kinds: tuple[int, ...], gpu: bool = False, raw: tuple | None = None):
    """``run`` for plans of ``op`` whose per-layer arguments are checked as ``kinds`` say: straight-
    line code (one layout tuple compare per tensor, a range check per float scale), generated once
    per op and kinds as dataclasses generates ``__init__``: a loop over the arguments costs more
    than the checks. The plan's layouts are ``self._sigs``; anything unusual goes to the plan's
    slow paths (which raise, or normalise a scale the one-shot call would accept). ``gpu``: the plan's
    tensors are on a GPU, whose index ``get_device`` reads (see ``_layout``). ``raw``: the runner's
    ``raw_layout`` (tensor names, how many pointer slots, scale names), or None to call the runner
    with the fields dict."""
    device = "get_device()" if gpu else "device"
    decl = _ops.OPS[op]
    names = decl.per_layer
    tensors = [n for n, k in zip(names, kinds) if k == _TENSOR]
    keywords = [n for n, k in zip(names, kinds) if k != _TENSOR]
    params = ", ".join(tensors) + (", *, " + ", ".join(f"{n}=None" for n in keywords) if keywords else "")
    lines = [f"def run(self, {params}):",
             "    sigs = self._sigs"]
    pointers = set(raw[0]) if raw is not None else set()
    for i, (n, k) in enumerate(zip(names, kinds)):
        read = [f"        p_{n} = {n}.data_ptr()"] if n in pointers else []   # once: the check and the launch
        aligned = "None" if k == _SCALE else f"p_{n} % 16 == 0" if read else f"{n}.data_ptr() % 16 == 0"
        check = ["    try:"] + read + [
                 f"        ok = ({n}.dtype, {n}.shape, {n}.stride(), {n}.{device}, {aligned}) == sigs[{i}]"
                 + ("" if k != _SCALE else "[1]"),
                 "    except AttributeError:",
                 "        ok = False"]
        if k == _TENSOR:
            lines += check + ["    if not ok:", f"        self._mismatch({n!r}, {n}, sigs[{i}])"]
        elif k == _OUT:
            lines += [f"    if {n} is None:",
                      f"        {n} = _empty(sigs[{i}][1], sigs[{i}][2], dtype=sigs[{i}][0], device=self._device)"]
            lines += ([f"        p_{n} = {n}.data_ptr()"] if read else []) + ["    else:"]
            lines += ["    " + line for line in check] + \
                     ["        if not ok:", f"            self._mismatch({n!r}, {n}, sigs[{i}])"]
        elif k == _SCALE:
            lines += check + ["    if not ok:", f"        {n} = self._scale({n!r}, {n}, sigs[{i}])"]
        elif k == _EXTRA_NONE:
            lines += [f"    if {n} is not None:", f"        self._extra({n!r}, {n}, None)"]
        elif k == _EXTRA:
            lines += check + ["    if not ok:", f"        self._extra({n!r}, {n}, sigs[{i}])"]
        else:  # a float scale: a Python float within float32's positive finite range passes as it is,
            # and None where the plan was made without one (1.0, as the one-shot call reads it)
            lines += [f"    if {n} is None and sigs[{i}][0] == {_NONE!r}:",
                      f"        {n} = 1.0",
                      f"    elif type({n}) is not float or not ({_F32_LO!r} <= {n} <= {_F32_HI!r}):",
                      f"        {n} = self._scale({n!r}, {n}, sigs[{i}])"]
    fields = "{" + ", ".join(f"{n!r}: {n}" for n in names) + "}"
    graded = [n for n, k in zip(names, kinds) if k in (_TENSOR, _OUT, _SCALE, _EXTRA)]   # tensors by now
    if raw is None:
        lines += [f"    fields = {fields}",
                  f"    if _grad() and ({' or '.join(f'{n}.requires_grad' for n in graded)}):",
                  f"        _no_autograd({op!r}, fields)",
                  "    if self._debug:",
                  "        self._full_check(fields)",
                  "    self._runner(fields)"]
    else:
        tensors, width, scales = raw
        kind = dict(zip(names, kinds))
        ptrs = [f"p_{n}" for n in tensors] + ["0"] * (width - len(tensors))
        sp = [f"{n}.data_ptr()" if kind[n] == _SCALE else "0" for n in scales]
        sv = ["1.0" if kind[n] == _SCALE else n for n in scales]
        lines += [f"    if _grad() and ({' or '.join(f'{n}.requires_grad' for n in graded)}):",
                  f"        _no_autograd({op!r}, {fields})",
                  "    if self._debug:",
                  f"        self._full_check({fields})",
                  f"    self._raw({', '.join(ptrs + sp + sv)})"]
    lines += [f"    return {'out' if 'out' in names else 'None'}"]
    namespace = {"_grad": torch.is_grad_enabled, "_no_autograd": validate.no_autograd, "_empty": torch.empty_strided}
    exec("\n".join(lines), namespace)  # noqa: S102 - generated from the op's declaration, nothing else
    fn = namespace["run"]
    fn.__qualname__ = f"hal.plan({op!r}).run"
    fn.__doc__ = Plan.run.__doc__
    return fn


def plan(op: str, /, *args, **kwargs) -> Plan:
    """Validate and dispatch a call of op ``op`` once; returns a :class:`Plan` whose ``run`` executes
    it per layer. ``args``/``kwargs`` are the public function's (``hal.paged_attention``,
    ``hal.mla_decode``, ``hal.cache_kv``, ``hal.cache_mla``), with one layer's tensors: they are
    validated exactly as that call validates them (the same errors), and fix the layout every
    layer's tensors must have. Runs nothing.

        p = hal.plan("paged_attention", q0, kc[0], vc[0], block_tables, seq_lens, k_scale=ks[0],
                     v_scale=vs[0], max_seq_len=max_len)
        for layer in range(n_layers):
            p.run(q[layer], kc[layer], vc[layer], k_scale=ks[layer], v_scale=vs[layer], out=o[layer])
    """
    decl = _ops.OPS.get(op)
    if decl is None:
        raise ValueError(f"hal.plan: op must be one of {', '.join(_ops.OPS)}; got {op!r}")
    if not decl.per_layer:
        raise ValueError(f"hal.plan: op {op} declares no per-layer arguments, so it cannot be planned")
    sargs = decl.schema_args(*args, **kwargs)   # Python checks the call's shape; then the keywords by name
    public = dict(zip(_positional(op), args))
    public.update(kwargs)
    validate.no_autograd(op, decl.tensors(*sargs))
    call = decl.check(*sargs)
    pack = dispatch.select(call.call_key, sargs[decl.pack_arg])
    runner = pack.prepare(op, call)
    if "out" in decl.per_layer and public.get("out") is None:
        public["out"] = call.out  # allocated by schema_args: planned as given
    return Plan(op, call, pack, runner, public, env.debug())
