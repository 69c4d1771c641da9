"""mkdocs hook: the CLI reference, rendered from the parser at build time.

`docs/cli.md` holds the marker `<!-- cli-help -->`; `on_page_markdown`
replaces it with the `--help` text of `emergency-ckpt` and of every
subcommand, taken from `emergency_ckpt.cli.build_parser()`, so the page
cannot drift from the code. Importing the CLI imports no JAX.
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MARKER = "<!-- cli-help -->"
WIDTH = "88"  # argparse wraps help text at $COLUMNS - 2


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
  for action in parser._actions:  # argparse has no public accessor for them
    if isinstance(action, argparse._SubParsersAction):
      return dict(action.choices)
  return {}


def render_cli_help() -> str:
  """The markdown of every command's help: the top level, then each subcommand."""
  if REPO not in sys.path:  # a checkout without the package installed
    sys.path.insert(0, REPO)
  from emergency_ckpt.cli import build_parser  # noqa: PLC0415 - imported at build time only

  saved = os.environ.get("COLUMNS")
  os.environ["COLUMNS"] = WIDTH
  try:
    parser = build_parser()
    parts = ["## `emergency-ckpt`", "", "```text", parser.format_help().rstrip(), "```", ""]
    for name, sub in _subparsers(parser).items():
      parts += [f"## `emergency-ckpt {name}`", "", "```text", sub.format_help().rstrip(), "```", ""]
  finally:
    if saved is None:
      del os.environ["COLUMNS"]
    else:
      os.environ["COLUMNS"] = saved
  return "\n".join(parts)


def on_page_markdown(markdown: str, page, config, files) -> str:
  if MARKER not in markdown:
    return markdown
  return markdown.replace(MARKER, render_cli_help())
