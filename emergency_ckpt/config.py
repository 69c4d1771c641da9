"""YAML config files -> option dataclasses, 1:1, with `key.sub=value` overrides.

Unknown keys are rejected by name. String values expand environment variables
(`$VAR`, `${VAR}`), so one file serves every host: e.g.
`directory: /dev/shm/ckpt-${HOSTNAME}`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from emergency_ckpt.errors import ConfigError
from emergency_ckpt.options import (
  CheckpointManagerOptions,
  LocalTierOptions,
  PeerOptions,
  PersistentTierOptions,
)

_NESTED = {"local": LocalTierOptions, "persistent": PersistentTierOptions, "peer": PeerOptions}


def _build(cls, data: Mapping[str, Any], where: str):
  if not isinstance(data, Mapping):
    raise ConfigError(f"{where} must be a mapping, got {type(data).__name__}.")
  fields = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(data) - set(fields))
  if unknown:
    raise ConfigError(
      f"unknown key(s) {', '.join(where + '.' + k if where else k for k in unknown)};"
      f" valid keys{' of ' + where if where else ''}: {', '.join(sorted(fields))}."
    )
  kwargs = {}
  for key, value in data.items():
    path = f"{where}.{key}" if where else key
    if cls is CheckpointManagerOptions and key in _NESTED:
      kwargs[key] = _build(_NESTED[key], value or {}, path)
    else:
      kwargs[key] = _expand(value, path) if isinstance(value, str) else value
  missing = [
    name
    for name, f in fields.items()
    if name not in kwargs
    and f.default is dataclasses.MISSING
    and f.default_factory is dataclasses.MISSING
  ]
  if missing:
    raise ConfigError(
      f"missing required key(s): {', '.join((where + '.' if where else '') + m for m in missing)}."
    )
  return cls(**kwargs)


def apply_overrides(data: dict, overrides: Iterable[str]) -> dict:
  """Applies `a.b=value` overrides to a nested dict of options.

  Args:
    data: the options as a nested dict (a YAML file's content); not modified.
    overrides: `key.sub=value` strings, applied in order; each value is
      parsed as YAML (an empty value is None), and missing sections are
      created.

  Returns:
    A copy of `data` with the overrides applied.

  Raises:
    ConfigError: an override lacks `=` or a key, its value is not valid
      YAML, or it reaches into a key that is not a section.
  """
  data = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in data.items()}
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"override {item!r} must look like key.sub=value.")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
      raise ConfigError(f"override {item!r} must look like key.sub=value (empty key).")
    node = data
    for part in parts[:-1]:
      child = node.get(part)
      if child is None:
        child = node[part] = {}
      elif isinstance(child, Mapping):
        child = node[part] = dict(child)
      else:
        raise ConfigError(f"override {item!r}: {part} is not a section.")
      node = child
    try:
      node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
      raise ConfigError(f"override {item!r}: value is not valid YAML: {e}") from None
  return data


def options_from_dict(
  data: Mapping[str, Any], overrides: Iterable[str] = ()
) -> CheckpointManagerOptions:
  """Builds the options from a nested dict, as load_config does from a file.

  Args:
    data: the manager's fields at the top level, the tiers' under `local`,
      `persistent` and `peer`; string values expand `$VAR` / `${VAR}`.
    overrides: `key.sub=value` strings (apply_overrides).

  Returns:
    The options, the same object as built in code.

  Raises:
    ConfigError: an unknown or missing key, a section that is not a
      mapping, a bad override, or an unset environment variable.
    InvalidOptionsError: a field has an impossible value (names it).
  """
  return _build(CheckpointManagerOptions, apply_overrides(dict(data), overrides), "")


def load_config(path: str | os.PathLike, overrides: Iterable[str] = ()) -> CheckpointManagerOptions:
  """Reads a YAML file into CheckpointManagerOptions (the same object as built in code).

  Args:
    path: the YAML file.
    overrides: `key.sub=value` strings applied after reading (apply_overrides).

  Returns:
    The options.

  Raises:
    ConfigError: the file cannot be read or is not valid YAML, or as
      options_from_dict.
    InvalidOptionsError: as options_from_dict.
  """
  try:
    with open(path) as f:
      data = yaml.safe_load(f) or {}
  except OSError as e:
    raise ConfigError(f"cannot read config {path}: {e}") from None
  except yaml.YAMLError as e:
    raise ConfigError(f"config {path} is not valid YAML: {e}") from None
  return options_from_dict(data, overrides)


_UNSET_VAR = re.compile(r"\$(\w+|\{[^}]*\})")


def _expand(value: str, path: str) -> str:
  """$VAR / ${VAR} from the environment; an unset variable is an error (a
  literal "${CKPT_ROOT}/x" would silently become a relative folder)."""
  expanded = os.path.expandvars(value)
  left = _UNSET_VAR.search(expanded)
  if left:
    name = left.group(1).strip("{}")
    raise ConfigError(
      f"{path}: environment variable {name} is not set (in {value!r}). Export it, or"
      f" override the key: {path}=..."
    )
  return expanded


def field_docs(cls) -> dict[str, str]:
  """Field docstrings (the string literal after each field), for docs and --help.

  Args:
    cls: an option dataclass.

  Returns:
    {field name: its docstring on one line}; fields without one are left out.
  """
  import ast  # noqa: PLC0415
  import inspect  # noqa: PLC0415
  import textwrap  # noqa: PLC0415

  tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
  body = tree.body[0].body
  docs = {}
  for node, nxt in zip(body, body[1:]):
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
      if isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant):
        docs[node.target.id] = " ".join(str(nxt.value.value).split())
  return docs
