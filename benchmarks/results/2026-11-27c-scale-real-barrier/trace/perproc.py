import json
import sys

d = json.load(open(sys.argv[1]))
run = [r for r in d if r["n"] == int(sys.argv[2])][-1]
print(
  "p slice | inv_end try_end status_end offer_s offer_e done_s done_e exec_e restore_e | cpu_restore"
)
for p, r in enumerate(run["recs"]):
  tr = r["trace"]
  R = [e for e in tr if e[0] == "RESTORE"][-1]
  t0 = R[2]

  def f(lab, pre="", which=3, tr=tr, t0=t0):
    for e in tr:
      if e[2] >= t0 and e[0] == lab and e[1].startswith(pre):
        return e[which] - t0
    return float("nan")

  print(
    f"{p:2d} {r['slice']:2d} | {f('gather_tree'):.3f} {f('_try_load'):.3f} {f('gather_sparse', 'restore_status'):.3f} {f('exchange_some', '', 2):.3f} {f('exchange_some'):.3f} {f('gather_sparse', 'peer_done', 2):.3f} {f('gather_sparse', 'peer_done'):.3f} {f('_execute'):.3f} {R[3] - t0:.3f} | {r['restore_cpu_s'] * 1e3:.0f}ms {r['source']}"
  )
