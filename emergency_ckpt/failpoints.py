"""Failpoints: SIGKILL this process at a named point, for crash tests.

Set EC_FAILPOINTS="name@step[,name@step...]" (e.g. "local.mid_write@3") in a
process's environment; `hit(name, step)` then kills it there, exactly as a
preempted host dies. Unset (production), `hit` is one dict lookup.
"""

from __future__ import annotations

import os
import signal


def _parse(spec: str) -> set[tuple[str, int]]:
  out = set()
  for item in filter(None, (s.strip() for s in spec.split(","))):
    name, _, step = item.partition("@")
    out.add((name, int(step)))
  return out


_ARMED = _parse(os.environ.get("EC_FAILPOINTS", ""))


def hit(name: str, step: int) -> None:
  """Kills this process with SIGKILL if `name@step` is armed."""
  if _ARMED and (name, step) in _ARMED:
    os.kill(os.getpid(), signal.SIGKILL)


def armed(name: str, step: int) -> bool:
  """True if `name@step` is armed (to make a write stop halfway, say)."""
  return (name, step) in _ARMED
