import os
import statistics
import sys

from emergency_ckpt.testing import launcher

# the job processes import the worker module from this folder
HERE = os.path.dirname(os.path.abspath(__file__))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))

for n in [int(x) for x in sys.argv[1].split(",")]:
  res = launcher.run_job(
    "coll_worker:worker", n, {"slices": n // 4}, devices_per_process=1, timeout_s=600
  ).check()
  for k in res[0]:
    per_rep = [max(r[k][i] for r in res) for i in range(len(res[0][k]))]
    med = [statistics.median(r[k][i] for r in res) for i in range(len(res[0][k]))]
    print(
      n,
      k,
      "max per rep",
      [round(x * 1e3) for x in per_rep],
      "median per rep",
      [round(x * 1e3) for x in med],
      flush=True,
    )
