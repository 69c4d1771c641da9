"""A tier's save schedule as segments, "from step S on, every k steps", and
where a change of interval may begin. Pure.

A segment saves its start step S and S + k, S + 2k, ... until the next
segment starts (k None: its start only). Segments are only ever appended,
each starting after every step already agreed on (the horizon, see
cadence.py), so any two processes that know the schedule up to a step
answer alike for every step up to it.

Called by: save/cadence.py. Blocks on nothing.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class Segment:
  """From step `start` on, a save every `every` steps (None: at `start` only)."""

  start: int
  every: int | None
  seq: int = 0
  """Its place in the tier's schedule: 0 for the first, then 1, 2, ..."""
  why: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)
  """What the deciding process measured (the `cadence` event's `why`)."""

  def to_json(self) -> str:
    """The segment as the primary publishes it."""
    return json.dumps({"start": self.start, "every": self.every, "why": dict(self.why)})

  @classmethod
  def from_json(cls, text: str, seq: int) -> Segment:
    """A published segment.

    Raises:
      ValueError: `text` is not one (a bug or a foreign key: never guessed).
    """
    doc = json.loads(text)
    start, every = doc["start"], doc["every"]
    if not isinstance(start, int) or not (every is None or (isinstance(every, int) and every > 0)):
      raise ValueError(f"not a cadence segment: {text!r}")
    return cls(start, every, seq, doc.get("why") or {})


class TierSchedule:
  """One tier's segments, oldest first.

  Args:
    first: the first segment (seq 0).
  """

  def __init__(self, first: Segment):
    self.segments: list[Segment] = [first]

  @property
  def latest(self) -> Segment:
    """The newest segment (it may start after the current step)."""
    return self.segments[-1]

  def _index(self, step: int) -> int:
    """The index of the segment in force at `step` (-1: before the first)."""
    for i in range(len(self.segments) - 1, -1, -1):
      if self.segments[i].start <= step:
        return i
    return -1

  def saves(self, step: int) -> bool:
    """Whether the tier saves `step`."""
    i = self._index(step)
    if i < 0:
      return False
    seg = self.segments[i]
    return step == seg.start or (seg.every is not None and (step - seg.start) % seg.every == 0)

  def last_save_at_or_before(self, step: int) -> int | None:
    """The newest save step <= `step` (None: none)."""
    i = self._index(step)
    if i < 0:
      return None
    seg = self.segments[i]
    if seg.every is None:
      return seg.start
    return seg.start + (step - seg.start) // seg.every * seg.every

  def next_save_after(self, step: int) -> int | None:
    """The first save step > `step` (None: none in the schedule known)."""
    i = self._index(step)
    following = self.segments[i + 1].start if i + 1 < len(self.segments) else None
    if i >= 0 and self.segments[i].every is not None:
      seg = self.segments[i]
      n = seg.start + ((step - seg.start) // seg.every + 1) * seg.every
      return n if following is None else min(n, following)
    return following

  def add(self, seg: Segment) -> None:
    """Appends `seg`, the next of the schedule.

    Raises:
      ValueError: it is not (its seq is not the next, or it starts no
        later than the newest segment): a bug, never papered over.
    """
    last = self.latest
    if seg.seq != last.seq + 1 or seg.start <= last.start:
      raise ValueError(f"cadence segment {seg} cannot follow {last}")
    self.segments.append(seg)

  def forget_before(self, step: int) -> None:
    """Drops the segments no step >= `step` needs."""
    i = self._index(step)
    if i > 0:
      del self.segments[:i]


def change_start(schedule: TierSchedule, horizon: int, every: int) -> int:
  """Where a new interval `every` may begin: after `horizon` (every step up
  to it is agreed on), at the next save of the schedule in force or sooner:
  `every` steps after its last save at or before `horizon`, if that comes
  first (a shorter interval starts at once).

  Args:
    schedule: the tier's schedule.
    horizon: the last step agreed on.
    every: the new interval.

  Returns:
    The new segment's start (> horizon).
  """
  last = schedule.last_save_at_or_before(horizon)
  sooner = horizon + 1 if last is None else max(horizon + 1, last + every)
  following = schedule.next_save_after(horizon)
  return sooner if following is None else min(following, sooner)
