"""mkdocs hook: every typed error has a row in docs/troubleshooting.md.

The page's cause/fix table is written by hand; this hook fails a strict build
(a warning) when `emergency_ckpt/errors.py` defines an error class that the
table lacks, or the table names one that no longer exists.
"""

from __future__ import annotations

import ast
import logging
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ERRORS = os.path.join(REPO, "emergency_ckpt", "errors.py")
PAGE = "troubleshooting.md"
log = logging.getLogger("mkdocs.hooks.errors")


def error_classes(path: str = ERRORS) -> list[str]:
  """The names of the classes errors.py defines (read, not imported)."""
  with open(path) as f:
    tree = ast.parse(f.read())
  return [node.name for node in tree.body if isinstance(node, ast.ClassDef)]


def table_rows(markdown: str) -> list[str]:
  """The error names in the first column of the page's tables."""
  return re.findall(r"^\| `(\w+Error)` \|", markdown, flags=re.MULTILINE)


def on_page_markdown(markdown: str, page, config, files) -> str:
  if page.file.src_uri != PAGE:
    return markdown
  classes, rows = error_classes(), table_rows(markdown)
  for name in sorted(set(classes) - set(rows)):
    log.warning("%s: no cause/fix row for emergency_ckpt.errors.%s", PAGE, name)
  for name in sorted(set(rows) - set(classes)):
    log.warning("%s: a row for %s, which emergency_ckpt/errors.py does not define", PAGE, name)
  return markdown
