#!/usr/bin/env bash
# Before/after A/B of the user-facing benchmark on one quiet machine: the
# package in $BEFORE (a folder holding an older emergency_ckpt/) against the
# checkout's, alternating, $PAIRS pairs of `python -m emergency_ckpt.bench
# --managers emergency_ckpt`. Run from the repository root (on a lent device
# machine: wheels in .whl, see session.sh). Each run's results.md and a
# summary of the headline rows land in $OUT (or /tmp/ec-ab).
#   BEFORE=_ab/before PAIRS=3 MIB=128 bash benchmarks/device/ab.sh
set -u
RES_DEFAULT=/tmp/ec-ab
source benchmarks/device/setup.sh
BEFORE=${BEFORE:?set BEFORE to a folder holding the older emergency_ckpt/}
BASE=$PYTHONPATH
REPO=$PWD
cd "$RES" || exit 1  # not the checkout: `python -m` would import its package first
for i in $(seq 1 "${PAIRS:-3}"); do
  for side in before after; do
    if [ "$side" = before ]; then export PYTHONPATH=$REPO/$BEFORE:$BASE; else export PYTHONPATH=$REPO:$BASE; fi
    out="$RES/$side$i"
    t0=$SECONDS
    timeout -k 15 "${RUN_S:-240}" $PY -m emergency_ckpt.bench --managers emergency_ckpt \
      --mib-per-replica "${MIB:-128}" --reps "${REPS:-3}" --out "$out" >"$out.log" 2>&1
    echo "== $side$i rc=$? in $((SECONDS - t0)) s ($($PY -c 'import emergency_ckpt, os; print(os.path.dirname(emergency_ckpt.__file__))'))"
  done
done
export PYTHONPATH=$BASE
$PY - "$RES" <<'PY'
import json, os, sys
res = sys.argv[1]
rows = {}
for name in sorted(os.listdir(res)):
  path = os.path.join(res, name, "results.json")
  if not os.path.exists(path):
    continue
  doc = json.load(open(path))
  for key, m in doc["results"]["emergency_ckpt"]["metrics"].items():
    if isinstance(m.get("value"), (int, float)):
      rows.setdefault(key, {})[name] = m["value"]
runs = sorted({n for r in rows.values() for n in r})
print("| metric | " + " | ".join(runs) + " |")
print("|---|" + "---|" * len(runs))
for key, r in rows.items():
  print(f"| {key} | " + " | ".join(f"{r[n]:.4g}" if n in r else "-" for n in runs) + " |")
PY
