import json
import os
import statistics
import sys

from emergency_ckpt.testing import launcher

from emergency_ckpt.bench import scale_real

# the job processes import the worker module from this folder
HERE = os.path.dirname(os.path.abspath(__file__))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))

scale_real.WORKERS = "trace_worker"
CAP = []
orig = launcher.run_job


def rj(target, *a, **kw):
  res = orig(target, *a, **kw)
  if target.endswith("restart_worker"):
    CAP.append(res.check())
  return res


launcher.run_job = rj
ns = [int(x) for x in sys.argv[1].split(",")]
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 1
out = []
for _rep in range(reps):
  for n in ns:
    CAP.clear()
    scale_real.measure_real_jobs([n], job_reps=1)
    recs = CAP[0]
    out.append({"n": n, "recs": recs})
    # summary: per label, max over processes of end - restore_start
    starts = []
    for _r in recs:
      pass
    print(
      f"n={n}: restore max {max(r['restore_s'] for r in recs):.3f} median {statistics.median(r['restore_s'] for r in recs):.3f}",
      flush=True,
    )
json.dump(out, open(sys.argv[3] if len(sys.argv) > 3 else "trace.json", "w"))
