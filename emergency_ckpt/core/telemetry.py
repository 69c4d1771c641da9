"""Structured events: one JSON line per event, plus a readable log line.

`EventLog.record("save", step=30, tiers=["local"], bytes=..., stall_s=...)`
appends

  {"event": "save", "time": 1767225600.123, "process": 0, "slice": 1, "step": 30, ...}

to the log file (one file per process is the usual setup; several processes
appending to one file also works on a local filesystem, each record being a
single write) and logs

  [process=0][slice=1] save step=30 tiers=local bytes=4194304 stall_s=0.0123

through the "emergency_ckpt" logger (INFO; WARNING when the event carries a
non-null "error"). `emergency-ckpt report LOG...` summarises such files.

Event schema (what the manager records; trainers may add their own events,
e.g. "train_step" with step and duration_s):
  run_start     run_id, topology, optionally wall_start (unix s the job began)
  save          step, tiers (["local", "persistent"]), bytes, stall_s
  save_durable  step, tier ("local" | "partner" | "xor" | "persistent" | "state"),
                durable_s, bytes, error
  save_failed   step, tier, error
  restore       step, source ("local" | "peer" | "partner" | "parity" |
                "persistent"), duration_s, bytes, error, tried (steps
                rejected before this one)
  startup       startup_s, restore_s, age_s: once per manager, written when
                the first save() call returns: from its construction to the
                end of the first restore() that returned (or to the first
                save() call), plus that first save() call (it waits for the
                manager's set-up): the time in restore() and the rest;
                age_s, the time since the construction began
  progress      first_step, last_step, steps, train_s, stall_s: the save()
                calls since the previous progress event (steps: those whose
                training, the time since the previous call, is in train_s;
                stall_s: time inside save(), saving or not), at most one per
                10 s (at a save that saved) and one at close() (closed: true)

Recording never raises on I/O failure: the first failure is logged as a
warning and the event still goes to the logger.

Called by: the manager, the orchestrators and the tiers (recording, any
thread), and the CLI's report (reading).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger("emergency_ckpt")

RESERVED = ("event", "time", "process", "slice")


def _jsonable(value: Any) -> Any:
  """json.dumps fallback: numpy scalars/arrays, sets, paths; anything else as str."""
  if hasattr(value, "tolist"):  # numpy scalar or array
    return value.tolist()
  if isinstance(value, (set, frozenset)):
    return sorted(value, key=repr)
  if isinstance(value, os.PathLike):
    return os.fspath(value)
  return str(value)


def _encode(record: dict) -> bytes:
  try:
    text = json.dumps(record, default=_jsonable)
  except (TypeError, ValueError):  # e.g. a circular structure: keep the event, lose detail
    text = json.dumps({k: v if k in RESERVED else repr(v) for k, v in record.items()})
  return (text + "\n").encode()


def _show(value: Any) -> str:
  if isinstance(value, float):
    return f"{value:.4g}" if math.isfinite(value) else str(value)
  if isinstance(value, (list, tuple)):
    return ",".join(_show(v) for v in value) if value else "[]"
  if isinstance(value, str):
    return value if value and not any(c.isspace() or c in "\"'=" for c in value) else repr(value)
  if isinstance(value, dict):
    return json.dumps(value, default=_jsonable, separators=(",", ":"))
  return str(value)


def format_event(record: dict) -> str:
  """The readable line of an event.

  Args:
    record: an event record.

  Returns:
    `[process=i][slice=s] event key=value ...` (None values left out).
  """
  head = f"[process={record.get('process')}][slice={record.get('slice')}] {record.get('event')}"
  parts = [
    f"{k}={_show(v)}"
    for k, v in record.items()
    if k not in RESERVED and v is not None and k != "error"
  ]
  if record.get("error") is not None:
    parts.append(f"error={_show(str(record['error']))}")
  return " ".join([head, *parts])


class EventLog:
  """Appends one JSON line per event to `path` (None: no file, logging only).

  Thread-safe; every record is written with one unbuffered append, so a
  record is on the file (in the OS) when `record` returns, and a crash can at
  worst tear the last line (which `read_events` skips).
  """

  def __init__(self, path: str | os.PathLike | None, *, process: int, slice: int):
    """Opens the log (a failure to open is logged, not raised).

    Args:
      path: the JSON-lines file ("{process}" in it becomes `process`), or
        None for Python logging only.
      process: this process's index, in every record.
      slice: this process's slice, in every record.
    """
    self.path = None if path is None else os.fspath(path).replace("{process}", str(process))
    self.process = process
    self.slice = slice
    self._lock = threading.Lock()
    self._fd: int | None = None
    self._warned = False
    if self.path is not None:
      try:
        parent = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(parent, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
      except OSError as e:
        self._io_failed(e)

  def _io_failed(self, error: OSError) -> None:
    if not self._warned:
      self._warned = True
      logger.warning(
        "[process=%s][slice=%s] event log %s is not writable (%s); events go to the"
        " log only from now on.",
        self.process,
        self.slice,
        self.path,
        error,
      )

  def record(self, event: str, **fields: Any) -> dict:
    """Records one event. Never raises on I/O failure.

    Args:
      event: the event's name ("save", "restore", ...).
      **fields: its fields (not named event, time, process or slice).

    Returns:
      The record (a dict).

    Raises:
      ValueError: a field uses a reserved name.
    """
    clash = [k for k in RESERVED if k in fields]
    if clash:
      raise ValueError(f"event fields {clash} are reserved; EventLog sets them")
    record = {"event": event, "time": time.time(), "process": self.process, "slice": self.slice}
    record.update(fields)
    level = logging.WARNING if record.get("error") is not None else logging.INFO
    if logger.isEnabledFor(level):
      logger.log(level, "%s", format_event(record))
    if self._fd is not None:
      data = _encode(record)
      with self._lock:
        try:
          if self._fd is not None:
            view = memoryview(data)
            while view:
              view = view[os.write(self._fd, view) :]
        except OSError as e:
          self._io_failed(e)
    return record

  def close(self) -> None:
    """Closes the file; later records go to the logger only."""
    with self._lock:
      fd, self._fd = self._fd, None
    if fd is not None:
      try:
        os.close(fd)
      except OSError:
        pass

  def __enter__(self) -> EventLog:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _parse_line(line: str) -> dict | None:
  try:
    doc = json.loads(line)
  except ValueError:
    # A record torn by a crash, then appended to by the restarted process on the
    # same line: keep the whole record at the end.
    start = line.rfind('{"event"')
    if start <= 0:
      return None
    try:
      doc = json.loads(line[start:])
    except ValueError:
      return None
  return doc if isinstance(doc, dict) and "event" in doc else None


def _expand(path_or_paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[str]:
  if isinstance(path_or_paths, (str, os.PathLike)):
    path_or_paths = [path_or_paths]
  files = []
  for p in path_or_paths:
    p = os.fspath(p)
    if os.path.isdir(p):
      files += sorted(
        os.path.join(p, n) for n in os.listdir(p) if n.endswith((".jsonl", ".ndjson"))
      )
    else:
      files.append(p)
  return files


def read_events(path_or_paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[dict]:
  """Every event of one or more JSON-lines files. A torn last line (a crash
  mid-write) is skipped; other unreadable lines are skipped with a warning.

  Args:
    path_or_paths: a file, a folder (its *.jsonl and *.ndjson files), or
      several.

  Returns:
    The events, sorted by time (stable).

  Raises:
    OSError: a file cannot be read.
  """
  events: list[dict] = []
  for path in _expand(path_or_paths):
    with open(path, encoding="utf-8", errors="replace") as f:
      lines = f.read().split("\n")
    bad = 0
    for i, line in enumerate(lines):
      if not line.strip():
        continue
      doc = _parse_line(line)
      if doc is None:
        if i != len(lines) - 1:  # the last piece has no newline: torn, not bad
          bad += 1
        continue
      events.append(doc)
    if bad:
      logger.warning("%s: skipped %d unreadable line(s)", path, bad)
  events.sort(key=lambda e: e["time"] if isinstance(e.get("time"), (int, float)) else math.inf)
  return events
