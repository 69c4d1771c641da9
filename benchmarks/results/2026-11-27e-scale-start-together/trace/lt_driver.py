import json
import os
import sys

from emergency_ckpt.testing import launcher

from emergency_ckpt.bench import scale_real

HERE = os.path.dirname(os.path.abspath(__file__))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))
scale_real.WORKERS = "lt_worker"
CAP = []
orig = launcher.run_job


def rj(target, *a, **kw):
  res = orig(target, *a, **kw)
  if target.endswith("restart_worker"):
    CAP.append(res.check())
  return res


launcher.run_job = rj
out = []
for n in [int(x) for x in sys.argv[1].split(",")]:
  CAP.clear()
  scale_real.measure_real_jobs([n], job_reps=1, latest_reps=1)
  out.append({"n": n, "recs": CAP[0]})
json.dump(out, open(sys.argv[2], "w"))
