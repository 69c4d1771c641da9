"""Output of the `emergency-ckpt` commands: aligned tables (ANSI styles only on
a terminal), sizes and seconds, and a progress display on stderr."""

from __future__ import annotations

import os
import shutil
import sys
import threading
from collections.abc import Callable
from typing import Any


def isatty(stream) -> bool:
  """Whether a stream is a terminal.

  Args:
    stream: a file object.

  Returns:
    True if it is a terminal; False also when it cannot say.
  """
  try:
    return bool(stream.isatty())
  except (AttributeError, ValueError):
    return False


class Style:
  """ANSI styles, only when `stream` (stdout) is a terminal and NO_COLOR is unset.

  Args:
    stream: the output; None: sys.stdout.
  """

  _CODES = {"bold": "1", "dim": "2", "red": "31", "green": "32", "yellow": "33"}

  def __init__(self, stream=None):
    stream = sys.stdout if stream is None else stream
    self.on = isatty(stream) and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb"

  def __call__(self, text: str, *styles: str) -> str:
    if not self.on or not styles:
      return text
    return f"\033[{';'.join(self._CODES[s] for s in styles)}m{text}\033[0m"


def grid(
  headers: list[str],
  rows: list[list[Any]],
  style: Style | None = None,
  color: Callable[[str, str], tuple[str, ...]] | None = None,
) -> str:
  """An aligned text table.

  Args:
    headers: the column names (bold).
    rows: the cells, one list per row (None shows as "-").
    style: the styles to apply; None: Style() of stdout.
    color: names styles for a cell, given (header, cell text); applied after
      padding, so alignment holds (only on a terminal).

  Returns:
    The table, one line per row, without trailing spaces.
  """
  style = style or Style()
  cells = [["-" if v is None else str(v) for v in row] for row in rows]
  widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
  last = len(headers) - 1
  lines = [
    "  ".join(
      style(h.ljust(w) if i < last else h, "bold") for i, (h, w) in enumerate(zip(headers, widths))
    )
  ]
  for r in cells:
    out = []
    for i, (h, v, w) in enumerate(zip(headers, r, widths)):
      text = v.ljust(w) if i < last else v
      out.append(style(text, *(color(h, v) if color else ())))
    lines.append("  ".join(out).rstrip())
  return "\n".join(line.rstrip() for line in lines)


def mib(nbytes: int | None) -> str:
  """A size for a table.

  Args:
    nbytes: a size in bytes, or None.

  Returns:
    It in KiB, MiB or GiB; "" for None.
  """
  if nbytes is None:
    return ""
  if nbytes < 1 << 20:
    return f"{nbytes / 1024:.1f} KiB"
  if nbytes < 1 << 30:
    return f"{nbytes / (1 << 20):.1f} MiB"
  return f"{nbytes / (1 << 30):.2f} GiB"


def secs(value: float | None, digits: int = 3) -> str:
  """Seconds for a table.

  Args:
    value: seconds, or None.
    digits: decimals shown.

  Returns:
    The value with `digits` decimals; "-" for None.
  """
  return "-" if value is None else f"{value:.{digits}f}"


class Progress:
  """Progress on stderr: on a terminal one status line rewritten in place;
  otherwise only permanent lines, plain (no escape or control codes).

  Args:
    stream: the output; None: sys.stderr.
  """

  def __init__(self, stream=None):
    self.stream = sys.stderr if stream is None else stream
    self.tty = isatty(self.stream)
    self._shown = 0
    self._lock = threading.Lock()

  def status(self, text: str) -> None:
    """Shows a transient line (terminal only), cut to the terminal's width.

    Args:
      text: the line.
    """
    if not self.tty:
      return
    with self._lock:
      text = text[: max(20, shutil.get_terminal_size((100, 24)).columns - 1)]  # no wrap
      self.stream.write("\r" + text + " " * max(0, self._shown - len(text)))
      self.stream.flush()
      self._shown = len(text)

  def line(self, text: str) -> None:
    """Writes a permanent line (replacing the status line on a terminal).

    Args:
      text: the line.
    """
    with self._lock:
      if self._shown:
        self.stream.write("\r" + " " * self._shown + "\r")
        self._shown = 0
      self.stream.write(text + "\n")
      self.stream.flush()

  def clear(self) -> None:
    """Erases the status line, if one is shown."""
    with self._lock:
      if self._shown:
        self.stream.write("\r" + " " * self._shown + "\r")
        self.stream.flush()
        self._shown = 0
