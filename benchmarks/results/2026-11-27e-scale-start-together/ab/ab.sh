#!/bin/bash
# ab.sh OUTDIR ROUNDS TREE...: ROUNDS times, scale_real 16,64 --reps 1 in each TREE
# (a checkout of the library; $PY: the interpreter) in turn.
out=$1; shift; rounds=$1; shift
mkdir -p $out
for r in $(seq 1 $rounds); do
  for t in "$@"; do
    name=$(basename $t)
    (cd $t && ${PY:-python} -m emergency_ckpt.bench.scale_real --processes 16,64 --reps 1 --out $out/$name-$r.json > $out/$name-$r.log 2>&1)
    echo "$(date +%T) $name round $r rc=$?"
  done
done
