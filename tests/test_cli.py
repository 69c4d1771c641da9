"""Tests of the `emergency-ckpt` CLI: gc, report, bench wiring, inspect/verify.

Every checkpoint folder here is built by hand (no JAX job): local steps with
a valid manifest and shards.bin, persistent tensors/<N> folders (on a
filesystem Orbax's finalized steps are plain digit folders) and state/<N>
through the real StateStore.
"""

from __future__ import annotations

import json
import os
import sys
import time
import zlib

import pytest

from emergency_ckpt import cli
from emergency_ckpt.core import layout
from emergency_ckpt.core.telemetry import EventLog
from emergency_ckpt.local import folders
from emergency_ckpt.local import format as local_format
from emergency_ckpt.state.store import StateStore

RUN = "run-test"


# ---- builders --------------------------------------------------------------------
def local_step(root, step, process=0, run=RUN, nbytes=64) -> str:
  """A valid local step folder (manifest with CRC32s + shards.bin)."""
  d = os.path.join(root, run, f"process_{process}", f"step_{step}")
  os.makedirs(d)
  data = bytes((step + i) % 256 for i in range(nbytes))
  with open(os.path.join(d, "shards.bin"), "wb") as f:
    f.write(data)
  body = {
    "format": local_format.FORMAT,
    "step": step,
    "run_id": run,
    "process_index": process,
    "slice_index": 0,
    "topology": {"process_count": 1, "slice_processes": [[0]]},
    "nbytes": nbytes,
    "saved_at": 1_700_000_000.0,
    "leaves": [
      {
        "path": "w",
        "shape": [nbytes],
        "dtype": "uint8",
        "shards": [
          {"index": [[0, nbytes]], "offset": 0, "nbytes": nbytes, "crc32": zlib.crc32(data)}
        ],
      }
    ],
  }
  with open(os.path.join(d, "manifest.json"), "wb") as f:
    f.write(local_format.encode_manifest(body))
  return d


def local_steps(root, process=0, run=RUN) -> list[int]:
  d = os.path.join(root, run, f"process_{process}")
  return sorted(int(n[5:]) for n in os.listdir(d) if n.startswith("step_"))


def state_step(root, step, *, metrics=None, commit=True, processes=2, skip=()):
  """state/<step>: every process's JSON, then COMMIT (with metrics)."""
  stores = [
    StateStore(os.path.join(root, "state"), process_index=i, process_count=processes)
    for i in range(processes)
  ]
  for s in stores:
    if s._me not in skip:
      s.write(step, {"iterator": step})
  if commit:
    assert stores[0].commit(step, timeout_s=1.0, metrics=metrics)


def tensor_step(root, step):
  d = os.path.join(root, "tensors", str(step), "default")
  os.makedirs(d)
  with open(os.path.join(d, "data"), "wb") as f:
    f.write(b"x" * 100)


def persistent_root(path, run=RUN) -> str:
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "run.json"), "w") as f:
    json.dump({"run_id": run}, f)
  return str(path)


def tensor_steps(root) -> list[int]:
  return sorted(int(n) for n in os.listdir(os.path.join(root, "tensors")) if n.isdigit())


def state_steps(root) -> list[int]:
  return sorted(int(n) for n in os.listdir(os.path.join(root, "state")) if n.isdigit())


def gc_json(capsys, *args) -> dict:
  rc = cli.main(["gc", *map(str, args), "--json"])
  out = json.loads(capsys.readouterr().out)
  out["rc"] = rc
  return out


def kept(doc, tier) -> list[int]:
  return sorted(r["step"] for r in doc["rows"] if r["tier"] == tier and r["action"] == "keep")


def gone(doc, tier) -> list[int]:
  return sorted(
    r["step"]
    for r in doc["rows"]
    if r["tier"] == tier and r["action"] in ("deleted", "would delete")
  )


# ---- gc: local roots -------------------------------------------------------------
def test_gc_dry_run_deletes_nothing(tmp_path, capsys):
  root = tmp_path / "local"
  for s in (10, 20, 30, 40, 50):
    local_step(root, s)
  rc = cli.main(["gc", str(root), "--keep", "2", "--dry-run"])
  out = capsys.readouterr().out
  assert rc == 0
  assert local_steps(root) == [10, 20, 30, 40, 50]
  lines = [ln.split() for ln in out.splitlines()]
  assert lines[0][:4] == ["tier", "step", "action", "size"]
  assert [ln[1] for ln in lines[1:6]] == ["10", "20", "30", "40", "50"]
  assert [ln[2] for ln in lines[1:4]] == ["would"] * 3 and lines[4][2] == "keep"
  assert "would delete 3 step folder(s)" in out and "dry run: nothing was deleted" in out
  assert "\033[" not in out  # not a terminal: no escape codes
  doc = gc_json(capsys, root, "--keep", "2", "--dry-run")
  assert gone(doc, "local") == [10, 20, 30] and kept(doc, "local") == [40, 50]
  sizes = [
    os.path.getsize(os.path.join(root, RUN, "process_0", f"step_{s}", name))
    for s in (10, 20, 30)
    for name in ("shards.bin", "manifest.json")
  ]
  assert doc["summary"]["dry_run"] and doc["summary"]["freed_bytes"] == sum(sizes)
  assert local_steps(root) == [10, 20, 30, 40, 50]


def test_gc_local_keep_newest_deletes(tmp_path, capsys):
  root = tmp_path / "local"
  for p in (0, 1):
    for s in (10, 20, 30, 40, 50):
      local_step(root, s, process=p)
  (root / RUN / "process_0" / ".tmp-step_60-abcd").mkdir()  # a save in progress: left alone
  doc = gc_json(capsys, root, "--keep", "2")
  assert doc["rc"] == 0 and doc["summary"]["deleted"] == 6
  assert local_steps(root, 0) == local_steps(root, 1) == [40, 50]
  assert sorted(os.listdir(root / RUN / "process_0")) == [".tmp-step_60-abcd", "step_40", "step_50"]
  assert {r["action"] for r in doc["rows"]} == {"keep", "deleted"}


def test_gc_local_never_deletes_the_newest_step(tmp_path, capsys):
  root = tmp_path / "local"
  for s in (10, 20, 30):
    local_step(root, s)
  doc = gc_json(capsys, root, "--keep", "0")
  assert local_steps(root) == [30]
  row = next(r for r in doc["rows"] if r["step"] == 30)
  assert row["action"] == "keep" and "newest step" in row["reason"]


def test_gc_local_keep_period(tmp_path, capsys):
  root = tmp_path / "local"
  for s in range(5, 55, 5):
    local_step(root, s)
  doc = gc_json(capsys, root, "--keep", "1", "--keep-period", "20", "--dry-run")
  assert kept(doc, "local") == [20, 40, 50]
  reasons = {r["step"]: r["reason"] for r in doc["rows"]}
  assert "multiple of 20" in reasons[40] and "newest 1" in reasons[50]
  assert "not among the newest 1, not a multiple of 20" == reasons[35]


def test_gc_local_with_state_store_keeps_newest_committed(tmp_path, capsys):
  root, pers = tmp_path / "local", persistent_root(tmp_path / "pers")
  for s in (10, 20, 30, 40, 50):
    local_step(root, s)
  for s in (10, 20, 30):
    state_step(pers, s)
  state_step(pers, 40, commit=False, skip=(1,))  # still being committed
  # matched through run.json's run_id; state of the kept local steps is kept too
  doc = gc_json(capsys, root, pers, "--keep", "0", "--dry-run")
  assert kept(doc, "local") == [30, 40, 50]
  reasons = {r["step"]: r["reason"] for r in doc["rows"] if r["tier"] == "local"}
  assert "newest restorable" in reasons[30] and "commit may be in flight" in reasons[50]
  assert kept(doc, "state") == [30, 40] and gone(doc, "state") == [10, 20]
  # the same through --state, local root alone
  doc = gc_json(capsys, root, "--state", pers, "--keep", "0")
  assert local_steps(root) == [30, 40, 50]
  assert state_steps(pers) == [10, 20, 30, 40]  # only the given roots are touched


def test_gc_local_keep_best_from_commit_metrics(tmp_path, capsys):
  root, pers = tmp_path / "local", persistent_root(tmp_path / "pers")
  losses = {10: 0.5, 20: 0.2, 30: 0.9, 40: 0.1, 50: 0.7, 60: 0.8}
  for s, loss in losses.items():
    local_step(root, s)
    state_step(pers, s, metrics={"loss": loss, "acc": 1 - loss})
  doc = gc_json(
    capsys, root, "--state", pers, "--keep", "1", "--keep-best", "2", "--metric", "loss"
  )
  assert local_steps(root) == [20, 40, 60]
  reasons = {r["step"]: r["reason"] for r in doc["rows"]}
  assert "best 2 by loss=0.1 (#1)" in reasons[40] and "best 2 by loss=0.2 (#2)" in reasons[20]
  assert "not among the best 2 (loss=0.5)" in reasons[10]
  doc = gc_json(
    capsys,
    root,
    "--state",
    pers,
    "--keep",
    "0",
    "--keep-best",
    "1",
    "--metric",
    "acc",
    "--mode",
    "max",
  )
  assert local_steps(root) == [40, 60]  # best acc (0.9) + newest committed


def test_gc_keep_best_needs_metric(tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["gc", str(tmp_path), "--keep", "1", "--keep-best", "2"])
  assert e.value.code == 2
  assert "--keep-best K and --metric NAME go together" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    cli.main(["gc", str(tmp_path), "--keep", "-1"])
  with pytest.raises(SystemExit):
    cli.main(["gc", str(tmp_path)])  # --keep is required


def test_gc_missing_dir_fails(tmp_path, capsys):
  rc = cli.main(["gc", str(tmp_path / "nope"), "--keep", "1"])
  assert rc == 1
  assert "no such directory" in capsys.readouterr().out


# ---- gc: persistent roots ---------------------------------------------------------
def test_gc_persistent_keep_period_best(tmp_path, capsys):
  pers = persistent_root(tmp_path / "pers")
  losses = {10: 0.9, 20: 0.1, 30: 0.8, 40: 0.7, 50: 0.6, 60: 0.5, 70: 0.2, 80: 0.4, 90: 0.3}
  for s, loss in {**losses, 100: 0.35}.items():
    tensor_step(pers, s)
    state_step(pers, s, metrics={"loss": loss})
  os.makedirs(os.path.join(pers, "tensors", "110.orbax-checkpoint-tmp-1"))  # unfinalized
  args = ["--keep", "2", "--keep-period", "50", "--keep-best", "2", "--metric", "loss"]
  doc = gc_json(capsys, pers, *args, "--dry-run")
  assert tensor_steps(pers) == list(range(10, 110, 10))
  want = [20, 50, 70, 90, 100]
  assert kept(doc, "persistent") == want and kept(doc, "state") == want
  doc = gc_json(capsys, pers, *args)
  assert doc["rc"] == 0
  assert tensor_steps(pers) == want and state_steps(pers) == want
  assert os.path.isdir(os.path.join(pers, "tensors", "110.orbax-checkpoint-tmp-1"))
  assert (
    StateStore(os.path.join(pers, "state"), process_index=0, process_count=2).committed_steps()
    == want
  )
  assert not [n for n in os.listdir(os.path.join(pers, "tensors")) if n.startswith(".deleting")]


def test_gc_persistent_never_deletes_newest_restorable(tmp_path, capsys):
  pers = persistent_root(tmp_path / "pers")
  for s in (10, 20, 30, 40, 50):
    tensor_step(pers, s)
  for s in (10, 20, 30):
    state_step(pers, s)
  state_step(pers, 40, commit=False, skip=(1,))  # commit in flight
  state_step(pers, 50, commit=False)  # every file written, COMMIT not yet
  doc = gc_json(capsys, pers, "--keep", "0")
  assert tensor_steps(pers) == [30, 40, 50]
  reasons = {(r["tier"], r["step"]): r["reason"] for r in doc["rows"]}
  assert "newest restorable" in reasons[("persistent", 30)]
  assert "may be in flight" in reasons[("persistent", 50)]
  assert state_steps(pers) == [30, 40, 50]  # state of kept tensor steps


def test_gc_persistent_state_only_steps(tmp_path, capsys):
  """State of local-tier saves (no tensors) follows the rules among committed
  steps; uncommitted state older than the newest commit goes."""
  pers, root = persistent_root(tmp_path / "pers"), tmp_path / "local"
  for s in (20, 40):
    tensor_step(pers, s)
  for s in range(5, 50, 5):
    state_step(pers, s)
  state_step(pers, 12, commit=False, skip=(1,))  # an abandoned commit
  state_step(pers, 50, commit=False, skip=(0,))  # in flight
  for s in (25, 45):
    local_step(root, s)
  doc = gc_json(capsys, root, pers, "--keep", "1", "--keep-period", "30", "--dry-run")
  assert kept(doc, "persistent") == [40]
  assert kept(doc, "local") == [45]
  assert kept(doc, "state") == [30, 40, 45, 50]
  reasons = {(r["tier"], r["step"]): r["reason"] for r in doc["rows"]}
  assert reasons[("state", 12)].startswith("uncommitted")
  assert "state of a kept persistent step" in reasons[("state", 40)]
  assert "may be in flight" in reasons[("state", 50)]
  # a kept local step keeps its state
  doc = gc_json(capsys, root, pers, "--keep", "2", "--dry-run")
  assert kept(doc, "local") == [25, 45]
  assert 25 in kept(doc, "state")
  assert (
    "state of a kept local step"
    in {(r["tier"], r["step"]): r["reason"] for r in doc["rows"]}[("state", 25)]
  )


def test_gc_table_and_inspect_after(tmp_path, capsys):
  pers = persistent_root(tmp_path / "pers")
  for s in (10, 20, 30):
    tensor_step(pers, s)
    state_step(pers, s)
  assert cli.main(["gc", pers, "--keep", "1"]) == 0
  out = capsys.readouterr().out
  assert "deleted 4 step folder(s)" in out
  rows = {(ln.split()[0], ln.split()[1]): ln.split()[2] for ln in out.splitlines()[1:] if ln}
  assert rows[("persistent", "10")] == "deleted" and rows[("state", "30")] == "keep"
  assert cli.main(["inspect", pers, "--json"]) == 0
  listed = json.loads(capsys.readouterr().out)
  assert [(r["step"], r["tensors"], r["state"]) for r in listed] == [(30, "committed", "committed")]


def test_inspect_and_verify_local(tmp_path, capsys):
  root = tmp_path / "local"
  local_step(root, 10)
  d = local_step(root, 20)
  spare = os.path.join(root, RUN, "process_0", ".tmp-spare-0123456789ab")
  os.makedirs(spare)  # a retired step's file kept for the next save
  assert cli.main(["verify", str(root)]) == 0
  capsys.readouterr()
  assert cli.main(["inspect", str(root), "--json"]) == 0
  rows = json.loads(capsys.readouterr().out)
  statuses = {os.path.basename(r["path"]): r.get("status") for r in rows if r["tier"] == "local"}
  assert statuses[".tmp-spare-0123456789ab"].startswith("spare")
  with open(os.path.join(d, "shards.bin"), "r+b") as f:
    f.write(b"\xff")
  assert cli.main(["verify", str(root), "--step", "20"]) == 1
  assert "fails its checksum" in capsys.readouterr().out


def test_inspect_verify_gc_ignore_stray_names_alike(tmp_path, capsys):
  """A stray `step_x` (inspect raised ValueError on it) and a stray
  `process_y` are not part of the layout: inspect, verify and gc list the
  same good steps and leave the strays alone."""
  root = tmp_path / "local"
  for s in (10, 20):
    local_step(root, s)
  os.makedirs(root / RUN / "process_0" / "step_x")
  with open(root / RUN / "process_0" / "step_x" / "manifest.json", "w") as f:
    f.write("{}")
  os.makedirs(root / RUN / "process_y" / "step_5")
  assert cli.main(["inspect", str(root), "--json"]) == 0
  rows = json.loads(capsys.readouterr().out)
  assert [(r["process"], r["step"], r["status"]) for r in rows] == [
    ("process_0", 10, "ok"),
    ("process_0", 20, "ok"),
  ]
  assert cli.main(["verify", str(root)]) == 0
  assert "step_x" not in capsys.readouterr().out
  doc = gc_json(capsys, root, "--keep", "1")
  assert doc["rc"] == 0 and gone(doc, "local") == [10] and kept(doc, "local") == [20]
  assert sorted(os.listdir(root / RUN / "process_0")) == ["step_20", "step_x"]
  assert os.listdir(root / RUN / "process_y") == ["step_5"]


def test_inspect_reports_a_step_folder_without_its_manifest(tmp_path, capsys):
  root = tmp_path / "local"
  local_step(root, 10)
  os.makedirs(root / RUN / "process_0" / "step_20")  # no manifest: not a step
  assert cli.main(["verify", str(root)]) == 1
  out = capsys.readouterr().out
  assert "no manifest.json" in out and "BAD" in out
  doc = gc_json(capsys, root, "--keep", "0")
  assert [r["step"] for r in doc["rows"]] == [10]  # gc ignores it, as restore does


_NO_JAX = """
import json, sys
from emergency_ckpt.cli import main
rc = main(sys.argv[1:])
heavy = sorted(m for m in ("jax", "jaxlib", "orbax", "tensorstore") if m in sys.modules)
print("EC_RESULT " + json.dumps({"rc": rc, "heavy": heavy}), file=sys.stderr)
"""

_COMMANDS = [
  ["inspect", "{local}", "{pers}"],
  ["verify", "{local}", "{pers}"],
  ["gc", "{local}", "{pers}", "--keep", "1"],
]


@pytest.mark.parametrize("argv", _COMMANDS, ids=[c[0] for c in _COMMANDS])
def test_folder_commands_import_neither_jax_nor_orbax(tmp_path, argv):
  """gc, inspect and verify on local and persistent roots run in a fresh
  interpreter without importing JAX or Orbax; only verify reads persistent
  tensors (tensorstore), and these hand-built steps record no shard
  checksums, so it reports them BAD."""
  import subprocess  # noqa: PLC0415

  import emergency_ckpt  # noqa: PLC0415

  root = tmp_path / "local"
  for s in (10, 20, 30):
    local_step(root, s)
  os.makedirs(root / RUN / "process_0" / "step_x")
  pers = persistent_root(tmp_path / "pers")
  for s in (10, 20, 30):
    tensor_step(pers, s)
    state_step(pers, s)
  argv = [a.format(local=root, pers=pers) for a in argv]
  repo = os.path.dirname(os.path.dirname(os.path.abspath(emergency_ckpt.__file__)))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
  proc = subprocess.run(
    [sys.executable, "-c", _NO_JAX, *argv], env=env, capture_output=True, text=True, timeout=120
  )
  line = [ln for ln in proc.stderr.splitlines() if ln.startswith("EC_RESULT ")]
  assert line, proc.stderr[-3000:]
  want = {"rc": 1, "heavy": ["tensorstore"]} if argv[0] == "verify" else {"rc": 0, "heavy": []}
  assert json.loads(line[-1].removeprefix("EC_RESULT ")) == want, proc.stdout[-3000:]
  if argv[0] == "verify":
    assert "SHARDS is missing" in proc.stdout, proc.stdout[-3000:]
  if argv[0] == "gc":
    proc_dir = layout.process_dir(str(root), RUN, 0)
    assert folders.list_local_steps(proc_dir) == [30] and tensor_steps(pers) == [30]


def test_delete_step_dir(tmp_path):
  d = local_step(tmp_path, 10)
  folders.delete_local_step_dir(d)
  assert os.listdir(os.path.dirname(d)) == []
  folders.delete_local_step_dir(d)  # absent: no-op
  target = local_step(tmp_path, 20, process=1)
  link = os.path.join(os.path.dirname(d), "step_30")
  os.symlink(target, link)
  folders.delete_local_step_dir(link)  # the link goes, never its target
  assert os.listdir(os.path.dirname(d)) == [] and os.path.isdir(target)


# ---- report ------------------------------------------------------------------------
T0 = 1_700_000_000.0


def ev(t, event, process, **fields):
  return {"event": event, "time": T0 + t, "process": process, "slice": process, **fields}


def write_log(path, events):
  with open(path, "w") as f:
    for e in events:
      f.write(json.dumps(e) + "\n")


def run_events() -> tuple[list[dict], list[dict]]:
  """Two processes (slices 0, 1) over 100 s; both restore at t=60 (step 30),
  process 0 again at t=90 (step 40)."""
  logs = []
  for p in (0, 1):
    e = [ev(0, "run_start", p, run_id="r1", topology={"process_count": 2}, wall_start=T0 - 5)]
    t = 1.0
    for step in range(1, 46):
      e.append(ev(t, "train_step", p, step=step, duration_s=0.5))
      if step % 10 == 0:
        tiers = ["local", "persistent"] if step % 20 == 0 else ["local"]
        e.append(ev(t + 0.1, "save", p, step=step, tiers=tiers, bytes=100, stall_s=0.1 * (p + 1)))
        e.append(
          ev(
            t + 0.2,
            "save_durable",
            p,
            step=step,
            tier="local",
            durable_s=0.5,
            bytes=100,
            error=None,
          )
        )
        e.append(ev(t + 0.3, "save_durable", p, step=step, tier="state", durable_s=1.0, error=None))
        if "persistent" in tiers and p == 0:
          e.append(
            ev(
              t + 0.4,
              "save_durable",
              p,
              step=step,
              tier="persistent",
              durable_s=3.0 if step == 20 else None,
              bytes=100,
              error=None if step == 20 else "upload failed: 503",
            )
          )
      t += 1.0
    # crash after step 45; restart
    e.append(ev(55, "run_start", p, run_id="r1", topology={"process_count": 2}))
    e.append(
      ev(
        60,
        "restore",
        p,
        step=30,
        source="local" if p == 0 else "peer",
        duration_s=2.0,
        bytes=100,
        error=None,
        tried=[40],
      )
    )
    logs.append(e)
  # process 0 trains 31..42, saves 40, crashes again, restores 40 from persistent
  e = logs[0]
  for i, step in enumerate(range(31, 43)):
    e.append(ev(61 + i, "train_step", 0, step=step, duration_s=1.0))
  e.append(ev(71.5, "save", 0, step=40, tiers=["local"], bytes=100, stall_s=0.1))
  e.append(ev(72, "save_failed", 0, step=40, tier="local", error="ENOSPC"))
  e.append(
    ev(
      90,
      "restore",
      0,
      step=40,
      source="persistent",
      duration_s=4.0,
      bytes=100,
      error=None,
      tried=[],
    )
  )
  logs[1].append(ev(95, "train_step", 1, step=31, duration_s=0.5))
  return logs


def test_report_numbers(tmp_path, capsys):
  logs = run_events()
  paths = []
  for p, events in enumerate(logs):
    paths.append(tmp_path / f"events_{p}.jsonl")
    write_log(paths[-1], events)
  with open(paths[1], "a") as f:
    f.write('{"event": "save", "ti')  # torn last line
  assert cli.main(["report", *map(str, paths), "--json"]) == 0
  s = json.loads(capsys.readouterr().out)
  assert s["run_ids"] == ["r1"] and s["processes"] == 2 and s["slices"] == 2
  assert s["wall_s"] == pytest.approx(100.0)  # wall_start (-5) to the last event (95)
  # process 1: 4 saves x 0.2 s stall = 0.8 s of 100 s
  assert s["overhead_process"] == 1
  assert s["checkpoint_overhead_pct"] == pytest.approx(0.8)
  assert s["stall"]["saves"] == 9 and s["stall"]["max_s"] == pytest.approx(0.2)
  tiers = {t["tier"]: t for t in s["tiers"]}
  assert tiers["local"]["saved_steps"] == 4 and tiers["persistent"]["saved_steps"] == 2
  assert tiers["local"]["durable_mean_s"] == pytest.approx(0.5)
  assert tiers["state"]["durable_mean_s"] == pytest.approx(1.0)
  assert tiers["persistent"]["durable_steps"] == 1 and tiers["persistent"]["failed"] == 1
  assert tiers["persistent"]["durable_mean_s"] == pytest.approx(3.0)
  assert tiers["local"]["failed"] == 1  # the ENOSPC
  r = [(x["process"], x["step"], x["source"]) for x in s["restores"]]
  assert r == [(0, 30, "local"), (1, 30, "peer"), (0, 40, "persistent")]
  first, peer, second = s["restores"]
  assert (first["newest_saved"], first["lost_steps"]) == (40, 10)
  assert (first["newest_trained"], first["redone_steps"]) == (45, 15)
  assert first["redone_s"] == pytest.approx(15 * 0.5)
  assert first["tried"] == [40] and peer["lost_steps"] == 10
  # the second restore counts only what was trained since the first
  assert (second["newest_trained"], second["redone_steps"]) == (42, 2)
  assert second["redone_s"] == pytest.approx(2.0) and second["lost_steps"] == 0
  assert s["restore_total_s"] == pytest.approx(8.0)
  errors = [(e["event"], e["process"], e["step"], e["error"]) for e in s["errors"]]
  assert ("save_durable", 0, 40, "upload failed: 503") in errors
  assert ("save_failed", 0, 40, "ENOSPC") in errors and len(errors) == 2

  assert cli.main(["report", str(tmp_path)]) == 0  # a folder of *.jsonl
  out = capsys.readouterr().out
  assert "checkpoint overhead  0.80 % (process 1" in out
  assert "wall time            100.0 s" in out
  for word in ("peer", "persistent", "ENOSPC", "upload failed: 503", "redone steps"):
    assert word in out
  assert "\033[" not in out


def test_report_from_event_log(tmp_path, capsys):
  """Logs written through EventLog by two 'processes' report sensibly."""
  paths = [tmp_path / f"p{p}.jsonl" for p in (0, 1)]
  logs = [EventLog(path, process=p, slice=p) for p, path in enumerate(paths)]
  for log in logs:
    log.record("run_start", run_id="live", topology={"process_count": 2})
  for step in (10, 20):
    for log in logs:
      log.record("save", step=step, tiers=["local"], bytes=10, stall_s=0.01)
      log.record("save_durable", step=step, tier="local", durable_s=0.02, bytes=10, error=None)
  time.sleep(0.05)
  for log, source in zip(logs, ("local", "peer")):
    log.record("restore", step=10, source=source, duration_s=0.01, bytes=10, error=None, tried=[20])
    log.close()
  assert cli.main(["report", *map(str, paths), "--json"]) == 0
  s = json.loads(capsys.readouterr().out)
  assert s["run_ids"] == ["live"] and s["wall_s"] > 0
  assert s["checkpoint_overhead_pct"] == pytest.approx(100 * 0.02 / s["wall_s"])
  assert [(r["process"], r["source"], r["lost_steps"]) for r in s["restores"]] == [
    (0, "local", 10),
    (1, "peer", 10),
  ]


def test_report_png_without_matplotlib(tmp_path, capsys, monkeypatch):
  path = tmp_path / "e.jsonl"
  write_log(path, run_events()[0])
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
  assert cli.main(["report", str(path), "--png", str(tmp_path / "t.png")]) == 1
  captured = capsys.readouterr()
  assert "checkpoint overhead" in captured.out  # the text report still comes
  assert "needs matplotlib" in captured.err and "pip install matplotlib" in captured.err
  assert not (tmp_path / "t.png").exists()


def test_report_png(tmp_path, capsys):
  pytest.importorskip("matplotlib")
  path = tmp_path / "e.jsonl"
  write_log(path, [e for log in run_events() for e in log])
  assert cli.main(["report", str(path), "--png", str(tmp_path / "t.png")]) == 0
  assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_without_events(tmp_path, capsys):
  (tmp_path / "empty.jsonl").write_text("")
  assert cli.main(["report", str(tmp_path / "empty.jsonl")]) == 1
  assert "no events" in capsys.readouterr().err
  assert cli.main(["report", str(tmp_path / "missing.jsonl")]) == 1
  assert "no such file" in capsys.readouterr().err


# ---- bench ---------------------------------------------------------------------------
def test_bench_help(capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["bench", "--help"])
  assert e.value.code == 0
  out = capsys.readouterr().out
  for flag in ("--quick", "--mib-per-replica", "--reps", "--out", "bench.log"):
    assert flag in out


@pytest.mark.parametrize("cmd", ["gc", "report", "inspect", "verify", "demo"])
def test_every_command_has_help(cmd, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main([cmd, "--help"])
  assert e.value.code == 0 and len(capsys.readouterr().out) > 300


class FakeBench:
  """Stands in for emergency_ckpt.bench.run.main: records argv, reports jobs."""

  def __init__(self, fail=()):
    self.argv = None
    self.fail = fail

  def __call__(self, argv, on_job=None):
    from emergency_ckpt.bench import run  # noqa: PLC0415

    args = run.parse_args(argv)
    self.argv = argv
    labels = ["raw"]
    for m in args.managers:
      labels.append(f"{m}-main")
      if f"{m}-main" not in self.fail:
        labels += [f"{m}-restart-{k}" for k in range(args.reps)]
    for label in labels:
      on_job(label, "start", None, None)
      print(f"[bench   0.0s] {label}: detail", file=sys.stderr)
      if label in self.fail:
        on_job(label, "failed", 1.5, "process 0 rc=1: boom")
      else:
        on_job(label, "done", 2.0, None)
    print("| results table |")
    return 1 if self.fail else 0


def test_bench_wiring_and_progress(tmp_path, capsys, monkeypatch):
  run = pytest.importorskip("emergency_ckpt.bench.run")
  fake = FakeBench()
  monkeypatch.setattr(run, "main", fake)
  out = tmp_path / "bench"
  rc = cli.main(
    ["bench", "--quick", "--reps", "2", "--out", str(out), "--managers", "emergency_ckpt"]
  )
  assert rc == 0
  assert fake.argv == [
    "--out",
    str(out),
    "--quick",
    "--reps",
    "2",
    "--managers",
    "emergency_ckpt",
  ]
  captured = capsys.readouterr()
  assert "| results table |" in captured.out
  err = captured.err.splitlines()
  assert "4 MiB per replica, 2 rep(s), managers emergency_ckpt: 4 jobs" in err[0]
  assert err[1] == "[1/4] raw bounds (memcpy, ramdisk, persistent disk) ..."
  assert err[2] == "[1/4] raw bounds (memcpy, ramdisk, persistent disk) done in 2.0s"
  assert err[3].startswith("[2/4] emergency_ckpt main job")
  assert err[5] == "[3/4] emergency_ckpt restart rep 1/2 (spawn to restored) ..."
  assert err[7] == "[4/4] emergency_ckpt restart rep 2/2 (spawn to restored) ..."
  assert "finished" in err[-1] and "bench.log" in err[-1]
  assert ": detail" not in captured.err  # the detailed log went to the file
  assert "raw: detail" in (out / "bench.log").read_text()
  assert "\033[" not in captured.err and "\r" not in captured.err


def test_bench_failed_main_skips_its_restarts(tmp_path, capsys, monkeypatch):
  run = pytest.importorskip("emergency_ckpt.bench.run")
  monkeypatch.setattr(run, "main", FakeBench(fail=("emergency_ckpt-main",)))
  rc = cli.main(
    [
      "bench",
      "--quick",
      "--out",
      str(tmp_path),
      "--managers",
      "emergency_ckpt,orbax_p2p",
      "--verbose",
    ]
  )
  assert rc == 1
  err = capsys.readouterr().err
  assert "[2/5] emergency_ckpt main job" in err and "FAILED after 1.5s: process 0 rc=1: boom" in err
  assert "[3/4] orbax_p2p main job" in err and "[4/4] orbax_p2p restart rep 1/1" in err
  assert "raw: detail" in err  # --verbose: the detailed log on stderr
  assert "failed jobs: emergency_ckpt-main" in err


def test_bench_rejects_bad_arguments(capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["bench", "--reps", "0"])
  assert e.value.code == 2
  with pytest.raises(SystemExit):
    cli.main(["bench", "--managers", "nope"])
  for study in (
    "--scale",
    "--elastic",
    "--shared-read",
  ):  # research studies: benchmarks/, not the wheel
    with pytest.raises(SystemExit):
      cli.main(["bench", study])
