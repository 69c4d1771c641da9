#!/usr/bin/env bash
# One lent GPU session's measurements, run from the repository root on the
# device machine (16 cores, one NVIDIA GPU, jax and tensorstore in its image):
#   with STALL=1 device_stall (save stall with real device-to-host copies),
#   then, on the same quiet 16-core host, the CPU benchmarks whose targets
#   are ratios (issue 18: bench.redundancy, XOR overlap on and off in turn;
#   issue 17: --managers emergency_ckpt once), while the time budget lasts. Everything lands in $OUT/all.tgz
#   and $OUT/console.log (the tool returns at most 8 files).
# Wheels for what the machine's image lacks (orbax-checkpoint 0.12.8, crc32c)
# travel in .whl (ignored by git; `pip download --no-deps --only-binary=:all:
# --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl NAME==VERSION`).
# Here, on CPU: NO_WHEELS=1 PY=.venv/bin/python STALL_MIB=64
#   STALL_ARGS="--matmuls 1 --matmul-size 64" bash benchmarks/device/session.sh
# Results: benchmarks/results/device-gpu.md, persistent.md, redundancy-overlap.md.
set -u
BUDGET_S=${BUDGET_S:-480}
RES_DEFAULT=/tmp/ec-device-results
source benchmarks/device/setup.sh
start=$SECONDS
left() { echo $((BUDGET_S - (SECONDS - start))); }
part() {  # part NAME LIMIT_S CMD...: runs CMD if LIMIT_S still fits the budget
  local name=$1 limit=$2; shift 2
  if (( $(left) < limit )); then echo "== skip $name ($(left) s left)"; return; fi
  echo "== $name (limit ${limit} s, $(left) s left)"
  local t0=$SECONDS
  timeout -k 15 -s INT "$limit" "$@" >"$RES/$name.log" 2>&1
  echo "== $name rc=$? in $((SECONDS - t0)) s"; tail -n 25 "$RES/$name.log"
}
{ nvidia-smi -L; nproc; free -g | head -2; df -h /dev/shm /tmp | tail -2
  $PY -c "import jax, importlib.metadata as m; print(*(p + ' ' + m.version(p) for p in ('jax', 'jaxlib', 'orbax-checkpoint', 'tensorstore')), jax.devices())"
} 2>&1
if [ -n "${STALL:-}" ]; then  # measured in two sessions already (README: On a GPU)
  part stall "${STALL_S:-200}" $PY -m benchmarks.device_stall --out "$RES/stall" \
    --mib "${STALL_MIB:-4096}" --reps 3 ${STALL_ARGS:-}
fi
# issue 18: XOR chunks beside the local write (the default on 16 cores) and
# after it, alternately, three pairs
for i in 1 2 3; do
  part "redundancy$i" "${RED_S:-120}" $PY -m benchmarks.redundancy --out "$RES/redundancy$i"
  part "redundancy-off$i" "${RED_S:-120}" $PY -m benchmarks.redundancy \
    --out "$RES/redundancy-off$i" --overlap off
done
part persistent "${MAIN_S:-120}" $PY -m emergency_ckpt.bench --managers emergency_ckpt \
  --out "$RES/persistent"
find "$RES" -name '*.npy' -delete
tar czf "${OUT:-/tmp}/all.tgz" -C "$RES" . && ls -la "${OUT:-/tmp}/all.tgz"
