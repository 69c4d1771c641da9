"""mkdocs hook: the generated fault-matrix table, rendered as text.

`python -m tests.fault_matrix` writes the table into docs/guarantees.md
between its markers, cells as observed: they hold Python reprs such as
`data_state['pos'][1]`, log prefixes such as `[process=0][slice=0]` and paths
such as `<tmp>/local`, which Markdown would take for reference links and HTML
tags. Outside code spans, this escapes them in the page as built (the file
itself is left as generated).
"""

from __future__ import annotations

BEGIN, END = "<!-- fault-matrix:begin -->", "<!-- fault-matrix:end -->"


def escape_cell_text(line: str) -> str:
  """`[`, `<` and `*` escaped in `line`, except inside `code spans`."""
  parts = line.split("`")
  for i in range(0, len(parts), 2):  # even parts are outside code spans
    parts[i] = parts[i].replace("[", "\\[").replace("<", "&lt;").replace("*", "\\*")
  return "`".join(parts).replace("\\*\\*FAIL\\*\\*", "**FAIL**")  # the failed-row mark


def on_page_markdown(markdown: str, page, config, files) -> str:
  if BEGIN not in markdown or END not in markdown:
    return markdown
  head, rest = markdown.split(BEGIN, 1)
  table, tail = rest.split(END, 1)
  lines = [escape_cell_text(line) if line.startswith("| ") else line for line in table.split("\n")]
  return head + BEGIN + "\n".join(lines) + END + tail
