"""``python -m hal.kernelpacks.rocm [--code-objects DIR] [--json]``: what the rocm pack was built for,
each kernel's resources (VGPRs, AGPRs, SGPRs, LDS, scratch, occupancy) per arch, and why the pack
can or cannot run here. Works on any machine."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from . import pack


def report(folder: pathlib.Path = pack.CODE_OBJECTS) -> dict:
    p = pack.RocmPack(folder)
    a = p.availability
    return {"available": a.ok, "reasons": list(a.reasons), **a.build_info}


def render(rep: dict) -> str:
    lines = [f"rocm pack: {'available' if rep['available'] else 'not available here'}"]
    lines += [f"  - {r}" for r in rep["reasons"]]
    lines.append(f"built for: {', '.join(rep['built_archs']) or 'nothing'} ({rep['compiler']})")
    for arch, why in rep["not_built"].items():
        lines.append(f"not built: {arch}: {why}")
    lines.append(f"design: {rep['occupancy_design']}")
    for arch in rep["built_archs"]:
        lines.append(f"\n{arch} (partition size {rep['partition_size'][arch]}):")
        head = ("kernel", "VGPR", "AGPR", "SGPR", "LDS", "scratch", "waves/SIMD")
        lines.append("  {:40} {:>5} {:>5} {:>5} {:>6} {:>7} {:>10}".format(*head))
        for name, r in rep[f"kernels_{arch}"].items():
            lines.append(f"  {name:40} {r['vgpr']:>5} {r['agpr']:>5} {r['sgpr']:>5} {r['lds']:>6} {r['scratch']:>7} "
                         f"{r['occupancy']:>10}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hal.kernelpacks.rocm", description=__doc__)
    ap.add_argument("--code-objects", type=pathlib.Path, default=pack.CODE_OBJECTS)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rep = report(args.code_objects)
    print(json.dumps(rep, indent=1) if args.json else render(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
