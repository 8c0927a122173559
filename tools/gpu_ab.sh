#!/usr/bin/env bash
# A/B of two builds of the cuda pack on one lease of the device machine (lease-to-lease differences
# of a few percent make tables from different days a poor judge of a kernel change; docs/bench.md,
# "A/B of two builds"). Run from the repo root on the device machine, with both modules built here for
# Python 3.12 and xz'd (tools/build_cuda_inplace.sh, then `xz -c packs/cuda/_C*.so > build/C312.so.xz`;
# the other one kept as build/C312_base.so.xz) and carried along.
#   TESTS=1 (default): the cuda tests on the new build first (TEST_SEL, default: every cuda test not slow)
#   SHAPES (bench SPECs or sets), KV (default e4m3fn), CONTENDERS (default hal:cuda), BUDGET (0.3),
#   ORDER ("new base"; "new base new" to see the drift within the lease)
#   MORE: further builds as NAME=PATH words (e.g. "x=build/C312_x.so.xz"), timed where ORDER names them
#   (ORDER="new base x"), so that several candidates share one lease; tests still run on NEW only
# Prints, per (shape, KV, contender), the time and fraction of copy of each build, and each / base.
set -o pipefail
OUT=${OUT:-results}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
SO=packs/cuda/_C.cpython-312-x86_64-linux-gnu.so
NEW=${NEW:-build/C312.so.xz} BASE=${BASE:-build/C312_base.so.xz}
declare -A BUILD=([new]="$NEW" [base]="$BASE")
for w in ${MORE:-}; do BUILD[${w%%=*}]=${w#*=}; done
for v in ${ORDER:-new base}; do
  f=${BUILD[$v]:-}
  [ -n "$f" ] || { echo "gpu_ab: ORDER names $v, which is neither new, base nor in MORE" >&2; exit 2; }
  [ -f "$f" ] || { echo "gpu_ab: $f is missing (carry it along)" >&2; exit 2; }
done
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
xz -dc "$NEW" > $SO
if [ "${TESTS:-1}" = 1 ]; then
  # shellcheck disable=SC2086
  timeout ${TEST_T:-300} python3 -m pytest -q -p no:cacheprovider -n 12 ${TEST_SEL:-tests -m "cuda and not slow"} 2>&1 \
    | tail -25 | tee "$OUT/pytest.log"
fi
SH=${SHAPES:-"mla:64x4096x16 mla:16x32768x16 64x4096x32x8x128 32x8192x128x8x128"}
i=0
for v in ${ORDER:-new base}; do
  i=$((i + 1))
  xz -dc "${BUILD[$v]}" > $SO
  # shellcheck disable=SC2086
  timeout ${BENCH_T:-200} python3 tools/bench --shapes $SH --kv-dtype ${KV:-e4m3fn} --contenders ${CONTENDERS:-hal:cuda} \
    --budget ${BUDGET:-0.3} --json "$OUT/bench-$i-$v.json" 2>"$OUT/bench-$i-$v.log" > "$OUT/bench-$i-$v.txt"
  echo "== run $i ($v): $(tail -1 "$OUT/bench-$i-$v.log")"
done
python3 - "$OUT" <<'PY'
import glob, json, os, re, sys
runs = {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "bench-*-*.json"))):
    i, v = re.match(r"bench-(\d+)-(\w+)\.json", os.path.basename(f)).groups()
    for r in json.load(open(f))["rows"]:
        if r["contender"].startswith("hal"):
            runs.setdefault((r["shape"], r["kv_dtype"], r["contender"]), []).append((int(i), v, r))
for (shape, kv, who), rs in runs.items():
    cells = [f"{v}{i}: " + (f"{r['time_us']:.1f} us {r['fraction_of_copy']:.3f}" if r["status"] == "ok" else r["status"])
             for i, v, r in sorted(rs, key=lambda x: x[0])]
    t = {v: r["time_us"] for i, v, r in rs if r["status"] == "ok"}
    ratio = "".join(f"  {v}/base {t[v] / t['base']:.3f}" for v in t if v != "base") if "base" in t else ""
    print(f"{shape} {kv} {who}: " + "; ".join(cells) + ratio)
PY
