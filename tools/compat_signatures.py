#!/usr/bin/env python3
"""The real libraries' signatures that hal.compat follows, read from their released files without
importing them (Python's ast on the source inside each wheel or sdist), written to or checked against
hal/compat/signatures.json.

Usage:
  tools/compat_signatures.py --check [DIR]   compare the recorded signatures with the artifacts in DIR
                                             (default .whl) that are present; exit 1 on a difference
  tools/compat_signatures.py --write [DIR]   re-record the entries whose artifact is in DIR
Artifacts (pip download --no-deps ...): flash_attn-2.8.3.post2.tar.gz (--no-binary :all:),
fa3_fwd-0.0.3-*.whl, flashinfer_python-0.7.4-*.whl, sgl_flash_mla-1.0.0-*.whl, vllm-0.34.0-*.whl (239 MB: keep it out of .whl,
which travels to the GPU machine, and pass its folder).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import tarfile
import zipfile
from pathlib import Path

RECORD = Path(__file__).resolve().parent.parent / "hal" / "compat" / "signatures.json"

# (artifact glob, file inside it, qualname in that file, the hal.compat object that follows it)
SOURCES = [
    ("flash_attn-2.8.3.post2.tar.gz", "flash_attn/flash_attn_interface.py", "flash_attn_varlen_func",
     "hal.compat.flash_attn:flash_attn_varlen_func"),
    ("flash_attn-2.8.3.post2.tar.gz", "flash_attn/flash_attn_interface.py", "flash_attn_with_kvcache",
     "hal.compat.flash_attn:flash_attn_with_kvcache"),
    ("fa3_fwd-0.0.3-*.whl", "fa3_fwd_interface.py", "flash_attn_varlen_func",
     "hal.compat.flash_attn_interface:flash_attn_varlen_func"),
    ("fa3_fwd-0.0.3-*.whl", "fa3_fwd_interface.py", "flash_attn_with_kvcache",
     "hal.compat.flash_attn_interface:flash_attn_with_kvcache"),
]
SOURCES.append(("vllm-0.34.0-*.whl", "vllm/vllm_flash_attn/flash_attn_interface.py", "flash_attn_varlen_func",
                "hal.compat.vllm_flash_attn:flash_attn_varlen_func"))
for _fn in ("get_mla_metadata", "flash_mla_with_kvcache"):
    SOURCES.append(("sgl_flash_mla-1.0.0-*.whl", "flash_mla/flash_mla_interface.py", _fn, f"hal.compat.flash_mla:{_fn}"))
for _fn in ("reshape_and_cache_flash", "concat_and_cache_mla"):
    SOURCES.append(("vllm-0.34.0-*.whl", "vllm/_custom_ops.py", _fn, f"hal.compat.vllm:{_fn}"))
for _cls, _file in (("BatchDecodeWithPagedKVCacheWrapper", "flashinfer/decode.py"),
                    ("BatchPrefillWithPagedKVCacheWrapper", "flashinfer/prefill.py")):
    for _m in ("__init__", "plan", "run"):
        SOURCES.append(("flashinfer_python-0.7.4-*.whl", _file, f"{_cls}.{_m}", f"hal.compat.flashinfer:{_cls}.{_m}"))


def _read(artifact: Path, inner: str) -> str:
    if artifact.name.endswith(".whl"):
        with zipfile.ZipFile(artifact) as z:
            return z.read(inner).decode()
    with tarfile.open(artifact) as t:
        for m in t.getmembers():
            if m.name.endswith("/" + inner) and m.name.count("/") == inner.count("/") + 1:
                return t.extractfile(m).read().decode()
    raise FileNotFoundError(f"{inner} not in {artifact}")


def _function(tree: ast.Module, qualname: str) -> ast.FunctionDef:
    body, found = tree.body, None
    parts = qualname.split(".")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        hits = [n for n in body if isinstance(n, ast.ClassDef if not last else ast.FunctionDef) and n.name == part]
        if not hits:
            raise KeyError(qualname)
        found = hits[-1]  # an implementation follows its typing overloads
        body = found.body
    return found


def params_of(fn: ast.FunctionDef) -> list[dict]:
    """Each parameter: name, kind (as inspect names it) and default (source text, None if none)."""
    a = fn.args
    out = []
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + a.defaults
    for arg, d in zip(positional, defaults):
        kind = "POSITIONAL_ONLY" if arg in a.posonlyargs else "POSITIONAL_OR_KEYWORD"
        out.append({"name": arg.arg, "kind": kind, "default": None if d is None else ast.unparse(d)})
    if a.vararg:
        out.append({"name": a.vararg.arg, "kind": "VAR_POSITIONAL", "default": None})
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append({"name": arg.arg, "kind": "KEYWORD_ONLY", "default": None if d is None else ast.unparse(d)})
    if a.kwarg:
        out.append({"name": a.kwarg.arg, "kind": "VAR_KEYWORD", "default": None})
    return [p for p in out if p["name"] != "self"]


def extract(directory: Path) -> dict[str, dict]:
    """The entries of SOURCES whose artifact is in ``directory``, by hal.compat object."""
    found = {}
    for pattern, inner, qualname, target in SOURCES:
        hits = sorted(directory.glob(pattern))
        if not hits:
            continue
        tree = ast.parse(_read(hits[-1], inner))
        found[target] = {"library_file": f"{hits[-1].name}:{inner}", "qualname": qualname,
                         "params": params_of(_function(tree, qualname))}
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="compare the record with the artifacts present")
    mode.add_argument("--write", action="store_true", help="re-record the entries whose artifact is present")
    ap.add_argument("dir", nargs="?", default=".whl", help="where the wheels / sdists are (default .whl)")
    args = ap.parse_args(argv)
    record = json.loads(RECORD.read_text())
    got = extract(Path(args.dir))
    if not got:
        sys.stderr.write(f"no artifact of {sorted({s[0] for s in SOURCES})} in {args.dir}\n")
        return 2
    if args.write:
        for target, entry in got.items():
            record["entries"][target] = entry
        RECORD.write_text(json.dumps(record, indent=1) + "\n")
        sys.stdout.write(f"recorded {len(got)} signatures into {RECORD}\n")
        return 0
    bad = [t for t, e in got.items() if record["entries"].get(t, {}).get("params") != e["params"]]
    for t in bad:
        sys.stdout.write(f"differs: {t} ({got[t]['library_file']})\n")
    sys.stdout.write(f"{len(got) - len(bad)} of {len(got)} signatures match the artifacts in {args.dir}\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
