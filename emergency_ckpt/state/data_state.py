"""The trainer's data_state: what save(data_state=...) may hold, how it is stored and read back.

A dict of JSON values is stored as it is; an object with get_state() (a
grain iterator, say) as its state, wrapped so that bytes survive JSON. A
value JSON cannot hold exactly (a numpy scalar, a NaN, a non-string key) is
refused at save, naming where it is, rather than changed on the way.

Called by: the manager (encode at save(), decode at restore()),
SavedDataStates for restore's data_state_remap; the state store writes and
reads the encoded value.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from emergency_ckpt.errors import DataStateError

if TYPE_CHECKING:
  from emergency_ckpt.state.store import StateStore

OBJECT_KEY = "__ec_get_state__"


def _find_bad(value: Any, where: str) -> str | None:
  if value is None or isinstance(value, (str, bool, int)):
    return None
  if isinstance(value, float):
    return None if math.isfinite(value) else f"{where} (non-finite float {value})"
  if isinstance(value, dict):
    for k, v in value.items():
      if not isinstance(k, str):
        return f"{where}[{k!r}] (key is {type(k).__name__}, must be str)"
      bad = _find_bad(v, f"{where}[{k!r}]")
      if bad:
        return bad
    return None
  if isinstance(value, (list, tuple)):
    for i, v in enumerate(value):
      bad = _find_bad(v, f"{where}[{i}]")
      if bad:
        return bad
    return None
  return f"{where} (a {type(value).__name__})"


def validate_data_state(data_state: Any) -> None:
  """Checks that JSON holds a data_state exactly.

  Args:
    data_state: a dict of JSON values, or None.

  Raises:
    DataStateError: naming the first value JSON cannot hold exactly, or
      `data_state` is not a dict.
  """
  if data_state is None:
    return
  if not isinstance(data_state, dict):
    raise DataStateError(
      f"data_state must be a dict of JSON values or None, got a"
      f" {type(data_state).__name__}. Use e.g. {{'iterator': it.get_state()}}."
    )
  bad = _find_bad(data_state, "data_state")
  if bad:
    raise DataStateError(
      f"data_state is not JSON-serialisable at {bad}. Convert it to str, int,"
      " float, bool, None, list or dict (numpy scalars: .item(); bytes: base64)."
    )


def encode_data_state(source: Any) -> dict | None:
  """What save(data_state=...) stores.

  Args:
    source: a dict of JSON values (or None), stored as it is; or an object
      with get_state() (a grain iterator, say), whose state is stored,
      wrapped so that bytes survive JSON.

  Returns:
    The JSON value to store.

  Raises:
    DataStateError: naming what cannot be stored.
  """
  if source is None or isinstance(source, dict):
    validate_data_state(source)
    return source
  get_state = getattr(source, "get_state", None)
  if not callable(get_state):
    raise DataStateError(
      f"data_state must be a dict of JSON values, None, or an object with"
      f" get_state()/set_state() (like a grain iterator); got a {type(source).__name__}."
    )
  value = get_state()
  if isinstance(value, (bytes, bytearray)):
    return {OBJECT_KEY: {"bytes_b64": base64.b64encode(bytes(value)).decode()}}
  bad = _find_bad(value, f"{type(source).__name__}.get_state()")
  if bad:
    raise DataStateError(
      f"data_state is not JSON-serialisable at {bad}. Return str, int, float,"
      " bool, None, list, dict or bytes from get_state()."
    )
  return {OBJECT_KEY: {"json": value}}


def decode_data_state(stored: Any) -> Any:
  """Inverse of encode_data_state.

  Args:
    stored: the JSON value read back.

  Returns:
    An object's state as get_state() returned it (bytes included); a dict
    as it was saved.
  """
  if isinstance(stored, dict) and set(stored) == {OBJECT_KEY}:
    wrapped = stored[OBJECT_KEY]
    if "bytes_b64" in wrapped:
      return base64.b64decode(wrapped["bytes_b64"])
    return wrapped["json"]
  return stored


class SavedDataStates(Mapping):
  """{saved process index: its data state (decoded)} of one committed step.

  Each file is read and verified when first accessed (then kept): what
  CheckpointManager.restore's data_state_remap receives. Read-only.

  Args:
    store: the state store holding the step.
    step: the committed step.
    count: how many processes saved it.
  """

  def __init__(self, store: StateStore, step: int, count: int):
    self._store, self._step, self._count = store, step, count
    self._read: dict[int, Any] = {}

  def __getitem__(self, process: int) -> Any:
    if not isinstance(process, int) or not 0 <= process < self._count:
      raise KeyError(process)
    if process not in self._read:
      stored = self._store.read(self._step, process=process, count=self._count)
      self._read[process] = decode_data_state(stored)
    return self._read[process]

  def __iter__(self):
    return iter(range(self._count))

  def __len__(self) -> int:
    return self._count
