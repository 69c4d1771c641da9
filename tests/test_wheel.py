"""The package installs: a wheel built from this checkout, installed into a
fresh virtual environment, runs the demo, the benchmark and the folder
commands from a working directory outside the checkout.

The fresh environment has no pip install of its own dependencies: a .pth file
puts this interpreter's site-packages (jax, orbax, ...) after its own. Only
directories are listed there, so this environment's .pth files (the editable
install's finder of emergency_ckpt) are not processed: `emergency_ckpt` is
the wheel's copy, which the test checks.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = (
  "emergency_ckpt/__init__.py",
  "emergency_ckpt/cli/__init__.py",
  "emergency_ckpt/demo/launcher.py",
  "emergency_ckpt/demo/job_process.py",
  "emergency_ckpt/demo/main.py",
  "emergency_ckpt/demo/trainer.py",
  "emergency_ckpt/demo/cpu_demo.yaml",
  "emergency_ckpt/bench/run.py",
  "emergency_ckpt/bench/workers.py",
)


def _run(cmd: list[str], cwd: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
  proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, (
    f"{cmd} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
  )
  return proc


def _can_build_offline() -> bool:
  """setuptools builds wheels itself from 70.1 on; before, it needs `wheel`.
  Python 3.12's venvs hold no setuptools at all: pip then builds in isolation."""
  try:
    import setuptools  # noqa: PLC0415
  except ImportError:
    return False
  major, minor = (int(x) for x in setuptools.__version__.split(".")[:2])
  return (major, minor) >= (70, 1) or importlib.util.find_spec("wheel") is not None


def _build_wheel(tmp: str) -> str:
  """Builds from a copy of pyproject.toml and emergency_ckpt/ (an in-tree
  build would write build/ and *.egg-info into the shared checkout)."""
  src = os.path.join(tmp, "src")
  os.makedirs(src)
  shutil.copy(os.path.join(REPO, "pyproject.toml"), src)
  shutil.copytree(
    os.path.join(REPO, "emergency_ckpt"),
    os.path.join(src, "emergency_ckpt"),
    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
  )
  out = os.path.join(tmp, "dist")
  cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", out, src]
  if _can_build_offline():
    cmd.insert(-1, "--no-build-isolation")  # else pip fetches setuptools>=68 from its index
  _run(cmd, tmp, dict(os.environ), timeout=300)
  (wheel,) = [f for f in os.listdir(out) if f.endswith(".whl")]
  return os.path.join(out, wheel)


def _make_venv(tmp: str, wheel: str) -> tuple[str, dict]:
  """A venv holding only the wheel; dependencies come from this interpreter's
  site-packages through a .pth file. Returns its bin folder and environment."""
  venv = os.path.join(tmp, "venv")
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
  python = os.path.join(venv, "bin", "python")
  site = subprocess.run(
    [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
    capture_output=True,
    text=True,
    check=True,
  ).stdout.strip()
  deps = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
  with open(os.path.join(site, "deps.pth"), "w") as f:
    f.write("".join(f"{d}\n" for d in sorted(deps)))
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
  env["PATH"] = os.path.join(venv, "bin") + os.pathsep + env.get("PATH", "")
  # pip comes from the deps; --ignore-installed: never touch the editable install there
  install = [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed"]
  _run([*install, wheel], tmp, env, timeout=120)
  return os.path.join(venv, "bin"), env


def test_wheel_installs_and_runs_outside_the_checkout(tmp_path):
  tmp = str(tmp_path)
  assert not os.path.realpath(tmp).startswith(os.path.realpath(REPO) + os.sep)
  wheel = _build_wheel(tmp)
  with zipfile.ZipFile(wheel) as z:
    names = z.namelist()
    packaged_config = z.read("emergency_ckpt/demo/cpu_demo.yaml").decode()
  missing = [p for p in SHIPPED if p not in names]
  assert not missing, f"not in the wheel: {missing}"
  assert not [n for n in names if n.split("/")[0] in ("tests", "examples", "benchmarks")], names
  # the wheel is the library: no test harness, no research study
  harness = [
    n
    for n in names
    if n.startswith("emergency_ckpt/testing/") or "gcs_server" in n or "gcs_proxy" in n
  ]
  assert not harness, harness
  studies = ("scale", "elastic", "shared_read", "redundancy", "device_")
  research = [
    n for n in names if n.startswith("emergency_ckpt/bench/") and n[21:].startswith(studies)
  ]
  assert not research, research
  with open(os.path.join(REPO, "configs", "cpu_demo.yaml")) as f:
    assert packaged_config == f.read(), "the demo's config must stay configs/cpu_demo.yaml"

  bin_dir, env = _make_venv(tmp, wheel)
  work = os.path.join(tmp, "work")  # the working directory: outside the checkout
  os.makedirs(work)
  python = os.path.join(bin_dir, "python")
  where = _run([python, "-c", "import emergency_ckpt as e; print(e.__file__)"], work, env, 120)
  assert where.stdout.startswith(os.path.join(tmp, "venv") + os.sep), where.stdout
  cli = os.path.join(bin_dir, "emergency-ckpt")
  with open(cli) as f:
    assert python in f.read(500), "the script must run the new venv's interpreter"

  # The demo: three 4-process jobs; --root keeps its folders for the commands below.
  root = os.path.join(tmp, "demo")
  demo = _run([cli, "demo", "--root", root], work, env, timeout=600)
  assert "DEMO OK" in demo.stdout, demo.stdout
  local = [os.path.join(root, "ramdisk", f"host_{i}") for i in (0, 2)]
  persistent = os.path.join(root, "persistent")

  rows = json.loads(_run([cli, "inspect", persistent, *local, "--json"], work, env, 120).stdout)
  held = {(r["tier"], r["step"]) for r in rows}
  assert {("persistent", 20), ("persistent", 40), ("local", 40)} <= held, rows
  rows = json.loads(_run([cli, "verify", persistent, *local, "--json"], work, env, 120).stdout)
  assert {r["tier"] for r in rows} == {"persistent", "local"}, rows  # exit 0: all good
  assert all(r["status"] == "ok" for r in rows if r["tier"] == "local"), rows
  dry = [cli, "gc", persistent, *local, "--keep", "1", "--dry-run", "--json"]
  doc = json.loads(_run(dry, work, env, 120).stdout)
  assert doc["summary"]["dry_run"] and doc["summary"]["deleted"] > 0, doc["summary"]
  gone = {(r["tier"], r["step"]) for r in doc["rows"] if r["action"] == "would delete"}
  assert ("persistent", 20) in gone and ("persistent", 40) not in gone, doc["rows"]
  assert os.path.isdir(os.path.join(persistent, "tensors", "20"))  # a dry run deletes nothing
  events = os.path.join(root, "events")
  report = json.loads(_run([cli, "report", events, "--json"], work, env, 120).stdout)
  restores = report["restores"]
  assert sorted((r["slice"], r["source"]) for r in restores) == [
    (0, "local"),
    (0, "local"),
    (1, "peer"),
    (1, "peer"),
  ], restores

  # The benchmark at its smallest: our manager only (raw bounds, main job, one restart).
  out = os.path.join(tmp, "bench")
  bench = _run(
    [cli, "bench", "--quick", "--managers", "emergency_ckpt", "--out", out], work, env, 600
  )
  assert "| metric | raw bound | emergency_ckpt |" in bench.stdout, bench.stdout[-3000:]
  with open(os.path.join(out, "results.json")) as f:
    results = json.load(f)
  assert results["errors"] == {}, results["errors"]
  assert results["results"]["emergency_ckpt"]["extras"]["restart"]["bit_exact"]

  usage = _run([python, "-m", "emergency_ckpt.bench", "--help"], work, env, 120)
  assert "--quick" in usage.stdout
