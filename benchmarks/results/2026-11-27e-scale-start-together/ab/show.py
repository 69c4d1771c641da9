import glob
import json
import os
import sys

"""One line per A/B run: python show.py FOLDER (the JSONs of ab.sh)."""

for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
  d = json.load(open(f))
  name = os.path.basename(f).rsplit("-", 1)[0]
  r = d["ratio_64_16"]

  def g(n, k, d=d):
    return d[n][k]["max"] * 1e3

  print(
    f"{os.path.basename(f):22s} latest {g('16', 'latest_step_s'):6.0f} {g('64', 'latest_step_s'):6.0f} {r['latest_step_s']['max']:4.1f}x  again {g('16', 'latest_step_again_s'):5.0f} {g('64', 'latest_step_again_s'):5.0f} {r['latest_step_again_s']['max']:4.1f}x  restore {g('16', 'restore_s'):5.0f} {g('64', 'restore_s'):6.0f} {r['restore_s']['max']:4.1f}x  p0cpu {g('64', 'restore_cpu_s'):4.0f} med {d['64']['restore_cpu_s']['median'] * 1e3:4.1f}"
  )
