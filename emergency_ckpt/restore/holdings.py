"""Which saved slices the job's ramdisks can serve whole: copies written on
another mesh, partner copies and XOR parity blocks, summarised (pure).

Each process reports what its host holds (local_tier.copies / parity):
  copies: {step: [[topology digest, saved process, saved slice, position,
                   slice size, 1 if a partner copy else 0], ...]}
  parity: {step: [[topology digest, saved process, saved slice, position,
                   slice size, [group positions]], ...]}
A slice summary and then the job summary merge them (gather_tree), per
step, topology and saved slice, into
  {"size": n, "all": ranges held by any copy, "own": ranges held by a
   copy in its writer's folder, "parity": ranges whose own copy also has
   its parity block here, "groups": [[positions of an XOR group], ...]}
and `complete` names, per step, the saved slices whose every position is
held by a copy or rebuildable from its group (every other member holds
its own copy and parity block): each such slice holds the whole state.
O(steps x saved slices) for everyone when copies are whole (positions as
ranges).

Called by: plan.py's slice and job summaries (inside gather_tree), on the
process that summarises. Blocks on nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def ranges(values: Sequence[int]) -> list[list[int]]:
  """Sorted ints as [first, last] runs: [0, 1, 2, 5] -> [[0, 2], [5, 5]].

  Args:
    values: sorted ints.

  Returns:
    The runs.
  """
  out: list[list[int]] = []
  for v in values:
    if out and out[-1][1] == v - 1:
      out[-1][1] = v
    else:
      out.append([v, v])
  return out


def _expand(runs) -> set[int]:
  return {p for a, b in runs for p in range(a, b + 1)}


def _entry(into: dict, step, topo: str, sl, size: int) -> dict:
  by_slice = into.setdefault(str(step), {}).setdefault(topo, {})
  return by_slice.setdefault(
    str(sl), {"size": size, "all": set(), "own": set(), "parity": set(), "groups": set()}
  )


def add_report(into: dict, copies: Mapping, parity: Mapping) -> None:
  """Adds one process's report (see the module docstring) to `into`.

  Args:
    into: the merged summary so far (changed in place).
    copies: the process's copies report.
    parity: the process's parity report.
  """
  for step, found in copies.items():
    for topo, _process, sl, position, size, *partner in found:
      e = _entry(into, step, topo, sl, size)
      e["all"].add(position)
      if not (partner and partner[0]):
        e["own"].add(position)
  for step, found in parity.items():
    for topo, _process, sl, position, size, group in found:
      e = _entry(into, step, topo, sl, size)
      e["parity"].add(position)
      e["groups"].add(tuple(group))


def add_summary(into: dict, summary: Mapping) -> None:
  """Adds a packed summary (pack()) to `into`.

  Args:
    into: the merged summary so far (changed in place).
    summary: a packed summary.
  """
  for step, by_topo in summary.items():
    for topo, slices in by_topo.items():
      for sl, v in slices.items():
        e = _entry(into, step, topo, sl, v["size"])
        for key in ("all", "own", "parity"):
          e[key] |= _expand(v[key])
        e["groups"] |= {tuple(g) for g in v["groups"]}


def pack(merged: Mapping) -> dict:
  """A merged summary as JSON.

  Args:
    merged: the merged summary.

  Returns:
    It as JSON, positions as ranges.
  """
  return {
    step: {
      topo: {
        sl: {
          "size": e["size"],
          **{key: ranges(sorted(e[key])) for key in ("all", "own", "parity")},
          "groups": sorted(list(g) for g in e["groups"]),
        }
        for sl, e in slices.items()
      }
      for topo, slices in by_topo.items()
    }
    for step, by_topo in merged.items()
  }


def rebuildable(e: Mapping[str, Any]) -> set[int]:
  """Positions no copy holds that their XOR group can rebuild.

  Args:
    e: one saved slice's merged entry.

  Returns:
    The positions.
  """
  out = set()
  for group in e["groups"]:
    for m in group:
      if m not in e["all"] and all(i in e["own"] and i in e["parity"] for i in group if i != m):
        out.add(m)
  return out


def complete(merged: Mapping) -> dict:
  """The saved slices the ramdisks serve whole, per step.

  Args:
    merged: the merged summary.

  Returns:
    {step: {"topology": digest, "slices": saved slices every position of
    which is held or rebuildable, "partner_only": {slice: positions only
    partner copies hold}, "parity_only": {slice: positions only parity
    rebuilds}, "groups": {slice: XOR groups}}}, for the steps some saved
    slice is complete for (the topology with most such).
  """
  out = {}
  for step, by_topo in merged.items():
    best = None
    for topo, slices in sorted(by_topo.items()):
      whole, partner_only, parity_only, groups = [], {}, {}, {}
      for sl, e in slices.items():
        rebuilt = rebuildable(e)
        if len(e["all"] | rebuilt) != e["size"]:
          continue
        whole.append(int(sl))
        if e["all"] - e["own"]:
          partner_only[sl] = sorted(e["all"] - e["own"])
        if rebuilt:
          parity_only[sl] = sorted(rebuilt)
          groups[sl] = sorted(list(g) for g in e["groups"])
      if whole and (best is None or len(whole) > len(best["slices"])):
        best = {
          "topology": topo,
          "slices": sorted(whole),
          "partner_only": partner_only,
          "parity_only": parity_only,
          "groups": groups,
        }
    if best is not None:
      out[step] = best
  return out
