"""Reading KV-cache scales out of their sources: vLLM's JSON scale files and safetensors
checkpoints (single files, sharded directories with or without an index), each value with its file
and key. The readers return a :class:`Found` (scales per layer and role); the layer-level checks
are :func:`hal.scales.load_kv_scales`'s. Checkpoints are read through ``safe_open``: the header
names the keys, and only the scale tensors are fetched, so a 70B checkpoint costs a few kilobytes
of reads. A path that cannot be read (a symlink loop, no permission) is a KVScaleError naming it."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import pathlib
import stat
from collections.abc import Callable

import torch
from safetensors import safe_open

from hal.fp8 import Encoding, encoding_of
from hal.scale_names import SPELLINGS, KeyMatch, example_key, is_scale_like, match
from hal.scale_values import KVScaleError, Scale, check_value, same_scale, where

__all__ = ["read", "read_checkpoint", "Found", "Entry"]

log = logging.getLogger("hal")

# -- what a source holds ---------------------------------------------------------------------------
@dataclasses.dataclass
class Entry:
    value: Scale
    file: pathlib.Path
    key: str


@dataclasses.dataclass
class Found:
    """The scales one source holds, before layers are checked; shared by the JSON and checkpoint
    readers so both report problems the same way."""

    file: pathlib.Path
    encoding: Encoding
    model_type: str | None
    example: Callable[[int, str], str]  # (layer, "k"|"v") -> the key that scale would have
    looked_for: Callable[[], str]
    entries: dict[int, dict[str, Entry]] = dataclasses.field(default_factory=dict)
    latent: set[int] = dataclasses.field(default_factory=set)  # MLA layers: one latent cache
    unknown: list[str] = dataclasses.field(default_factory=list)
    declares_encoding: bool = False  # the source names its encoding (JSON's kv_cache.dtype)

    def add(self, layer: int, role: str, entry: Entry) -> None:
        roles = self.entries.setdefault(layer, {})
        old = roles.get(role)
        if old is not None and not same_scale(old.value, entry.value):
            raise KVScaleError(
                f"{where(entry.file, entry.key)} layer {layer} has two different {role} scales: "
                f"{_show(entry.value)} here and {_show(old.value)} under key {old.key!r} in {old.file}; "
                f"expected one")
        roles.setdefault(role, entry)

    def unknown_note(self) -> str:
        return (f"{self.file}: {len(self.unknown)} key(s) look like KV scales but match no known "
                f"spelling (hal.scale_names.SPELLINGS), so they were not used: {', '.join(self.unknown[:8])}"
                + (" ..." if len(self.unknown) > 8 else ""))


def _show(s: Scale) -> str:
    return repr(s.tolist()) if isinstance(s, torch.Tensor) else repr(s)


_SCHEMA = ('{"model_type": "llama", "kv_cache": {"dtype": "float8_e4m3fn", '
           '"scaling_factor": {"<tp_rank>": {"<layer>": <scale>}}}}')


def _kind(x) -> str:
    return {dict: "an object", list: "a list", str: "a string"}.get(type(x), type(x).__name__)


def read(source: pathlib.Path, **kw) -> Found:
    """Find what kind of source ``source`` is and read it. A path that cannot be read (a symlink
    loop, no permission) is a :class:`KVScaleError` naming it, never a bare OSError."""
    try:
        return _read(source, **kw)
    except OSError as exc:
        raise KVScaleError(_os_problem(exc, source)) from None


def _os_problem(exc: OSError, source: pathlib.Path) -> str:
    path = exc.filename if exc.filename is not None else source
    problem = exc.strerror or type(exc).__name__
    if exc.errno == errno.ELOOP:
        problem = (f"a symlink loop ({problem}): following its links never reaches a file; expected "
                   f"a file or a link to one")
    elif isinstance(exc, PermissionError):
        problem = f"cannot be read ({problem})"
    else:
        problem = f"cannot be read ({problem}, errno {exc.errno})"
    inside = "" if pathlib.Path(path) == source else f" (reading KV scales from {source})"
    return f"{path}: {problem}{inside}"


def _is_file(path: pathlib.Path) -> bool:
    """``path.is_file()``, except that a path that exists but cannot be resolved (a symlink loop) or
    looked at raises OSError (which :func:`read` reports) instead of passing for absent."""
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


def _read(source: pathlib.Path, **kw) -> Found:
    try:
        source.stat()
    except (FileNotFoundError, NotADirectoryError):
        dangling = f" (a symlink to {os.readlink(source)!r}, which does not exist)" if source.is_symlink() else ""
        raise KVScaleError(f"{source}: no such file or directory{dangling} (expected a JSON scale file, "
                           f"a .safetensors file or a checkpoint directory)") from None
    if source.is_file():
        if source.suffix == ".json":
            return _read_json(source, **kw)
        if source.suffix == ".safetensors":
            return read_checkpoint(source, [source], None, **kw)
        raise KVScaleError(f"{source}: expected a .json scale file, a .safetensors file or a directory; "
                           f"got a {source.suffix or 'suffix-less'} file")
    index = next(iter(sorted(source.glob("*.safetensors.index.json"))), None)
    shards = sorted(source.glob("*.safetensors"))
    scale_files = [p for p in sorted(source.glob("*.json")) if _mentions_kv_cache(p)]
    if shards or index:
        found = read_checkpoint(source, shards, index, **kw)
        if found.entries and scale_files:
            raise KVScaleError(
                f"{source}: both the checkpoint and {scale_files[0].name} hold KV scales; expected one "
                f"source: pass the JSON file or a .safetensors file explicitly")
        if found.entries or not scale_files:
            return found
    if len(scale_files) > 1:
        raise KVScaleError(f"{source}: several JSON scale files ({', '.join(p.name for p in scale_files)}); "
                           f"expected one: pass the one to use")
    if scale_files:
        log.info("%s: reading KV scales from %s", source, scale_files[0].name)
        return _read_json(scale_files[0], **kw)
    raise KVScaleError(f"{source}: no KV scales found: expected .safetensors files or a JSON scale file "
                       f"(one with a 'kv_cache' key) in this directory")


def _mentions_kv_cache(path: pathlib.Path) -> bool:
    """A JSON file in a model directory that may hold KV scales (a cheap look, not a parse)."""
    if path.name.endswith(".index.json") or path.stat().st_size > 64 << 20:
        return False
    return '"kv_cache"' in path.read_text(errors="replace")


def _read_json(path: pathlib.Path, *, tp_rank: int, tp_size: int | None, num_layers: int | None,
               model_type: str | None) -> Found:
    """vLLM's schema: ``kv_cache.scaling_factor[tp_rank][layer]`` (string keys), checked as vLLM's
    pydantic validators do (but with any FP8 dtype), plus hal's ``k_/v_scaling_factor`` extension."""
    try:
        doc = json.loads(path.read_text(), object_pairs_hook=_Object)
    except json.JSONDecodeError as exc:
        raise KVScaleError(f"{path}: malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg} "
                           f"(expected {_SCHEMA})") from None
    except UnicodeDecodeError as exc:
        raise KVScaleError(f"{path}: not a text file ({exc.reason}); expected JSON like {_SCHEMA}") from None
    _no_repeats(doc, path, "")
    if not isinstance(doc, dict) or not isinstance(doc.get("kv_cache"), dict):
        given = _kind(doc.get("kv_cache")) if isinstance(doc, dict) and "kv_cache" in doc else (
            "no such key" if isinstance(doc, dict) else f"{_kind(doc)} at the top level")
        raise KVScaleError(f"{where(path, 'kv_cache')} expected an object, as in {_SCHEMA}; got {given}")
    mt = doc.get("model_type")
    if mt is not None and not isinstance(mt, str):
        raise KVScaleError(f"{where(path, 'model_type')} expected a string or null; got {_kind(mt)}")
    if model_type is not None and mt is not None and mt != model_type:
        raise KVScaleError(f"{where(path, 'model_type')} the scales are for model type {mt!r}; "
                           f"expected {model_type!r}")
    kv = doc["kv_cache"]
    _no_repeats(kv, path, "kv_cache.")
    if "dtype" not in kv:
        raise KVScaleError(f"{where(path, 'kv_cache.dtype')} missing; expected the FP8 encoding the scales "
                           f"were calibrated for, e.g. \"float8_e4m3fn\"")
    encoding = _json_encoding(kv["dtype"], path)
    separate = [r for r in "kv" if f"{r}_scaling_factor" in kv]
    if len(separate) == 1:
        have, lack = separate[0], "v" if separate[0] == "k" else "k"
        raise KVScaleError(f"{where(path, f'kv_cache.{lack}_scaling_factor')} missing, while "
                           f"kv_cache.{have}_scaling_factor is present; expected both (or neither)")
    tables = {"k": "k_scaling_factor", "v": "v_scaling_factor"} if separate else {"kv": "scaling_factor"}
    rank_str = {}

    def example(layer: int, role: str) -> str:
        name = tables.get(role, "scaling_factor")
        return f'kv_cache.{name}["{rank_str.get(name, tp_rank)}"]["{layer}"]'

    found = Found(path, encoding, mt, example,
                  lambda: f"looked under kv_cache.{' and kv_cache.'.join(tables.values())}[\"{tp_rank}\"]")
    found.declares_encoding = True
    for role, name in tables.items():
        key = f"kv_cache.{name}"
        if name not in kv:
            raise KVScaleError(f"{where(path, key)} missing; expected {_SCHEMA}")
        ranks = _int_keys(kv[name], path, key, "TP rank")
        if tp_size is not None and sorted(ranks) != list(range(tp_size)):
            raise KVScaleError(f"{where(path, key)} TP size mismatch: the file holds TP ranks "
                               f"{sorted(ranks)}; expected tp_size={tp_size} (ranks 0..{tp_size - 1})")
        if tp_rank not in ranks:
            raise KVScaleError(f"{where(path, key)} TP rank {tp_rank} missing: the file holds TP ranks "
                               f"{sorted(ranks)}")
        for r, (rs, layers) in ranks.items():
            rank_key = f'{key}["{rs}"]'
            layers = _int_keys(layers, path, rank_key, "layer")
            if r != tp_rank and (num_layers is None or tp_size is None or len(layers) == num_layers):
                continue
            if r != tp_rank:
                raise KVScaleError(f"{where(path, rank_key)} TP rank {r} holds {len(layers)} layers; "
                                   f"expected num_layers={num_layers}")
            rank_str[name] = rs
            for layer, (ls, raw) in layers.items():
                ekey = f'{rank_key}["{ls}"]'
                value = check_value(raw, path, ekey)
                for ro in ("k", "v") if role == "kv" else (role,):
                    found.add(layer, ro, Entry(value, path, ekey))
    return found


class _Object(dict):
    """A JSON object that keeps its key-value pairs as written: ``json.loads`` lets the last of two
    equal keys win, silently; the readers refuse repeats (:func:`_no_repeats`, :func:`_int_keys`)."""

    def __init__(self, pairs):
        super().__init__(pairs)
        self.pairs = pairs


def _no_repeats(obj, path, prefix: str) -> None:
    """A key written twice in ``obj`` (the top level, or ``kv_cache``) is an error naming it."""
    seen = set()
    for k, _ in getattr(obj, "pairs", ()):
        if k in seen:
            where_ = f"the {prefix.rstrip('.')} object" if prefix else "the top-level object"
            raise KVScaleError(f"{where(path, prefix + k)} appears twice in {where_}; expected each key "
                               f"once (JSON readers keep the last one, silently)")
        seen.add(k)


def _int_keys(table, path, key: str, what: str) -> dict[int, tuple[str, object]]:
    """``table``'s entries by the number each key names (``"0"``; ``"00"`` is 0 too): a number named
    twice, by the same key or by two spellings of it, is an error naming the second key."""
    if not isinstance(table, dict):
        raise KVScaleError(f"{where(path, key)} expected an object keyed by {what}; got {_kind(table)}")
    out = {}
    for k, val in getattr(table, "pairs", table.items()):
        if not (k.isascii() and k.isdigit()):
            raise KVScaleError(f"{where(path, key)} expected {what} keys like \"0\"; got {k!r}")
        if int(k) in out:
            first = out[int(k)][0]
            also = "" if first == k else f" (also as {json.dumps(first)})"
            raise KVScaleError(f'{where(path, f"{key}[{json.dumps(k)}]")} {what} {int(k)} appears twice{also}; '
                               f"expected each {what} once (JSON readers keep the last one, silently)")
        out[int(k)] = (k, val)
    return out


def _json_encoding(name, path) -> Encoding:
    key = "kv_cache.dtype"
    if isinstance(name, str):
        try:
            return encoding_of(name.removeprefix("fp8_"))
        except ValueError:
            pass
    hint = ""
    if name in ("fp8", "fp8_e4m3", "e4m3", "float8_e4m3"):
        hint = (" (an e4m3 family name is ambiguous: OCP e4m3fn on NVIDIA and gfx950, e4m3fnuz on "
                "gfx942; name the encoding the scales were calibrated for)")
    raise KVScaleError(f"{where(path, key)} expected an FP8 encoding (float8_e4m3fn, float8_e4m3fnuz, "
                       f"float8_e5m2, float8_e5m2fnuz); got {name!r}{hint}")


# -- checkpoints ------------------------------------------------------------------------------------
def read_checkpoint(source: pathlib.Path, shards: list[pathlib.Path], index: pathlib.Path | None, *,
                    tp_rank: int, tp_size: int | None, num_layers: int | None,
                    model_type: str | None) -> Found:
    """The KV scales in safetensors ``shards`` (or the shards ``index`` names). Scales are taken as
    calibrated for e4m3fn; per-head scales are sliced to ``tp_rank``'s KV heads."""
    directory = source if source.is_dir() else source.parent
    like: list[KeyMatch] = []

    def example(layer: int, role: str) -> str:
        return example_key(layer, role, like[0] if like else None)

    def looked_for() -> str:
        shown = like[0].spelling.suffix if like else "self_attn.k_scale"
        return (f"looked for keys like '<prefix>layers.N.{shown}' in {len(SPELLINGS)} spellings "
                f"(hal.scale_names.SPELLINGS) in {len(shards) or 'the indexed'} safetensors file(s)")

    found = Found(source, encoding_of(torch.float8_e4m3fn), _config_model_type(directory, model_type),
                  example, looked_for)
    wanted: dict[pathlib.Path, list[KeyMatch]] = {}
    for file, keys in _scale_keys_by_file(directory, shards, index).items():
        for key in keys:
            m = match(key)
            if m is not None:
                wanted.setdefault(file, []).append(m)
            elif is_scale_like(key):
                found.unknown.append(f"{file.name}: {key}")
    legacy = []
    try:
        for file, matches in wanted.items():
            try:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    raw = {m.key: f.get_tensor(m.key) for m in matches}
            except Exception as exc:  # safetensors raises its own error types
                raise KVScaleError(f"{file}: cannot read the scale tensors: {exc}") from None
            for m in matches:
                t = raw[m.key]
                value = check_value(t.reshape(()) if t.numel() == 1 else t, file, m.key)
                value = _tp_slice(value, tp_rank, tp_size, file, m.key)
                for role in ("k", "v") if m.spelling.role == "kv" else (m.spelling.role,):
                    found.add(m.layer, role, Entry(value, file, m.key))
                if m.spelling.latent:
                    found.latent.add(m.layer)
                if m.spelling.role == "kv":
                    legacy.append(m.key)
                if not like:
                    like.append(m)
    except KVScaleError as exc:
        if found.unknown:
            raise KVScaleError(f"{exc}\n{found.unknown_note()}") from None
        raise
    if legacy:
        log.info("%s: %d legacy kv_scale key(s) (e.g. %r): each is used for both the k and the v scale "
                 "of its layer", source, len(legacy), legacy[0])
    return found


def _scale_keys_by_file(directory: pathlib.Path, shards, index) -> dict[pathlib.Path, list[str]]:
    """The scale-like keys of each shard: from the index when there is one (no shard is opened to
    list keys), else from each shard's header."""
    out: dict[pathlib.Path, list[str]] = {}
    if index is not None:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
            raise KVScaleError(f"{where(index, 'weight_map')} expected a safetensors index "
                               f"({{\"weight_map\": {{key: shard file}}}}); reading it failed: "
                               f"{type(exc).__name__}: {exc}") from None
        if not isinstance(weight_map, dict):
            raise KVScaleError(f"{where(index, 'weight_map')} expected an object; got {_kind(weight_map)}")
        for key, shard in weight_map.items():
            if match(key) is None and not is_scale_like(key):
                continue
            path = directory / str(shard)
            if not _is_file(path):
                raise KVScaleError(f"{where(index, key)} the index puts it in shard {shard!r}, which "
                                   f"does not exist in {directory}")
            out.setdefault(path, []).append(key)
        return out
    for file in shards:
        file.stat()  # a symlink loop: an OSError that read() names, not safetensors' "no such file"
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                keys = list(f.keys())
        except Exception as exc:
            raise KVScaleError(f"{file}: not a readable safetensors file: {exc}") from None
        out[file] = [k for k in keys if match(k) is not None or is_scale_like(k)]
    return out


def _tp_slice(value: Scale, tp_rank: int, tp_size: int | None, file, key: str) -> Scale:
    """A checkpoint's per-head scale covers every KV head; a TP rank holds a contiguous slice of them
    (or, when there are fewer heads than ranks, one replicated head, as vLLM shards them)."""
    if not isinstance(value, torch.Tensor) or not tp_size or tp_size == 1:
        return value
    heads = value.numel()
    if heads % tp_size == 0:
        n = heads // tp_size
        return value[tp_rank * n:(tp_rank + 1) * n].clone()
    if tp_size % heads == 0:
        i = tp_rank // (tp_size // heads)
        return value[i:i + 1].clone()
    raise KVScaleError(f"{where(file, key)} the per-head scale has {heads} heads, which do not divide "
                       f"among tp_size={tp_size} ranks (expected a multiple or a divisor of {tp_size})")


def _config_model_type(directory: pathlib.Path, model_type: str | None) -> str | None:
    """The model type in the checkpoint's config.json, checked against ``model_type`` (a multimodal
    config may match through its ``text_config``). No config.json: nothing to check."""
    cfg = directory / "config.json"
    if not _is_file(cfg):
        return None
    try:
        doc = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        if model_type is None:
            return None
        raise KVScaleError(f"{cfg}: malformed JSON ({exc}); cannot check model_type={model_type!r}") from None
    if not isinstance(doc, dict):
        return None
    text = doc.get("text_config")
    types = {doc.get("model_type"), text.get("model_type") if isinstance(text, dict) else None} - {None}
    if model_type is not None and types and model_type not in types:
        raise KVScaleError(f"{where(cfg, 'model_type')} the checkpoint is a {' / '.join(sorted(map(str, types)))} "
                           f"model; expected model_type={model_type!r}")
    mt = doc.get("model_type")
    return mt if isinstance(mt, str) else None
