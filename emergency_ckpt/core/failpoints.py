"""Failpoints: kill (or freeze) this process at a named point, for crash tests.

Set EC_FAILPOINTS="name@step[:action][,name@step[:action]...]" (e.g.
"local.mid_write@3") in a process's environment; `hit(name, step)` then acts
there. Actions: `kill` (the default: SIGKILL, exactly as a preempted host
dies), `stop` (SIGSTOP: the process hangs there for good, as a wedged host
does, until something sends it SIGKILL), `sleepN` (this thread waits N
seconds there and goes on, as a slow disk or scheduler makes it) and `raise`
(this thread raises OSError(EIO) there, as a failing disk, bucket or
allocation does on one host only). Unset (production), `hit` is one dict
lookup.

Points: local.before_write, local.mid_write, local.before_rename,
local.after_rename (the local tier), state.before_write,
state.before_commit,
state.after_commit (the state store), persistent.before_save,
persistent.after_save_call, persistent.finalize_callback (Orbax's
finalization reported, its rename not done), persistent.after_finalize (the
persistent tier).

Called by: the tiers and the state store, at those points; no I/O.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import threading
import time

ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "raise": None}
_SLEEP = re.compile(r"sleep(\d+(?:\.\d+)?)")


def parse(spec: str) -> dict[tuple[str, int], str]:
  """Parses an EC_FAILPOINTS value.

  Args:
    spec: "name@step[:action][,...]".

  Returns:
    {(name, step): action}.

  Raises:
    ValueError: a malformed item (a typo must not silently disarm a crash
      test).
  """
  out = {}
  for item in filter(None, (s.strip() for s in spec.split(","))):
    point, _, action = item.partition(":")
    name, sep, step = point.partition("@")
    action = action or "kill"
    known = action in ACTIONS or _SLEEP.fullmatch(action)
    if not name or not sep or not step.strip().isdigit() or not known:
      raise ValueError(
        f"EC_FAILPOINTS item {item!r} is not name@step[:action] with action in"
        f" {sorted(ACTIONS)} or sleepN (N seconds)"
      )
    out[(name.strip(), int(step))] = action
  return out


_ARMED = parse(os.environ.get("EC_FAILPOINTS", ""))


def hit(name: str, step: int | None) -> None:
  """Kills (or stops, delays, fails) this process if `name@step` is armed.

  Args:
    name: the point's name (e.g. "local.mid_write").
    step: the step being saved (None: points not tied to a step).

  Raises:
    OSError: the action is `raise`.
  """
  if _ARMED and (name, step) in _ARMED:
    action = _ARMED[(name, step)]
    if action == "kill":
      os.kill(os.getpid(), signal.SIGKILL)
    if action == "raise":
      raise OSError(errno.EIO, f"failpoint {name}@{step}: an injected I/O error")
    sleep = _SLEEP.fullmatch(action)
    if sleep:
      time.sleep(float(sleep.group(1)))
      return
    # A process-directed SIGSTOP is taken by whichever thread the kernel picks
    # (usually the main one); on a busy machine this thread could run on for
    # milliseconds (finishing the very write under test) before that thread
    # gets a CPU. Directed at this thread, it stops here, before returning.
    # In a loop: a hung host stays hung even if something sends SIGCONT.
    while True:
      signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


def armed(name: str, step: int | None) -> bool:
  """Whether `name@step` is armed (to make a write stop halfway, say).

  Args:
    name: the point's name.
    step: the step being saved.

  Returns:
    True if armed.
  """
  return (name, step) in _ARMED
