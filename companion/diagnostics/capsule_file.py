"""A NaN capsule's file: the failing step, written and read.

:meth:`Diagnosis.save <companion.diagnostics.Diagnosis.save>` writes one ``.npz``
file: the failing batch, every variable of the model, its metrics and its optimizers
as they were before the step (keyed by path, :func:`named_variables`), the states of
Keras' and TensorFlow's global random generators and of NumPy's, and, as JSON inside
the same file (the ``__meta__`` entry, UTF-8 bytes), the diagnosis, the batch's
structure and the versions that made it. Nothing is pickled:
``np.load(path, allow_pickle=False)`` reads it, and :func:`load` returns it as a
:class:`Capsule`. :func:`~companion.diagnostics.replay` re-runs it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from companion import _internal
from companion._version import __version__
from companion.diagnostics.gradients import _variable_path
from companion.diagnostics.state import components
from companion.diagnostics.step import optimizers_of

__all__ = ["Capsule", "load", "named_variables", "save", "variables_state"]

FORMAT = "companion-nan-capsule"
VERSION = 1


def named_variables(model: Any) -> list[tuple[str, Any]]:
    """``(key, variable)`` of everything a step of ``model`` may change, with unique keys."""
    named, seen, keys = [], set(), set()

    def add(prefix, variables):
        for variable in variables:
            if id(variable) in seen:
                continue
            seen.add(id(variable))
            key = f"{prefix}{_variable_path(variable)}"
            base, n = key, 1
            while key in keys:
                n += 1
                key = f"{base}#{n}"
            keys.add(key)
            named.append((key, variable))

    add("model/", model.variables)
    add("metrics/", getattr(model, "metrics_variables", []) or [])
    for index, optimizer in enumerate(optimizers_of(model)):
        add(f"optimizer{index}/", getattr(optimizer, "variables", ()))
    for index, variable in enumerate(_internal.global_random_states()):
        if id(variable) not in seen:
            seen.add(id(variable))
            named.append((f"random/{index}", variable))
    return named


def _array(value) -> np.ndarray:
    return np.asarray(value.numpy() if hasattr(value, "numpy") else value)


def variables_state(model: Any) -> dict[str, np.ndarray]:
    """Every variable a step of ``model`` may change, by key, as NumPy arrays.

    Under a distribution strategy each variable's first local copy is read, without any
    collective (reading a sync-on-read variable, a metric's, in cross-replica context
    would all-reduce it: under several workers, a collective that only the worker
    diagnosing its shard would join).
    """
    return {key: _array(components(variable)[0]) for key, variable in named_variables(model)}


def _structure(nest, prefix: str, arrays: dict, dtypes: dict):
    """A JSON skeleton of ``nest`` whose leaves are keys into ``arrays``."""
    if nest is None:
        return None
    leaves = tf.nest.flatten(nest)
    keys = []
    for index, leaf in enumerate(leaves):
        key = f"{prefix}/{index}"
        _put(arrays, dtypes, key, _array(leaf))
        keys.append(key)
    skeleton = tf.nest.pack_sequence_as(nest, keys)
    return _jsonable(skeleton)


def _jsonable(skeleton):
    if isinstance(skeleton, dict):
        return {"dict": {str(k): _jsonable(v) for k, v in skeleton.items()}}
    if isinstance(skeleton, (list, tuple)):
        return {"list": [_jsonable(v) for v in skeleton]}
    return skeleton


def _unjson(skeleton, arrays):
    if skeleton is None:
        return None
    if isinstance(skeleton, dict) and "dict" in skeleton:
        return {k: _unjson(v, arrays) for k, v in skeleton["dict"].items()}
    if isinstance(skeleton, dict) and "list" in skeleton:
        return tuple(_unjson(v, arrays) for v in skeleton["list"])
    return arrays[skeleton]


def _put(arrays: dict, dtypes: dict, key: str, value: np.ndarray) -> None:
    dtypes[key] = tf.as_dtype(value.dtype).name if value.dtype.kind in "fciubV" else str(value.dtype)
    if value.dtype.kind == "V" or value.dtype.name == "bfloat16" or dtypes[key] in ("bfloat16", "float8_e4m3fn"):
        value = value.view(np.uint8 if value.dtype.itemsize == 1 else np.uint16)
    arrays[key] = value


def _get(arrays, dtypes: dict, key: str) -> np.ndarray:
    value = np.asarray(arrays[key])
    name = dtypes.get(key)
    if name is not None and name != str(value.dtype):
        try:
            value = value.view(tf.as_dtype(name).as_numpy_dtype)
        except (TypeError, ValueError):  # pragma: no cover - an unknown dtype name
            pass
    return value


def save(diagnosis: Any, path: str | os.PathLike) -> str:
    """Write ``diagnosis`` and the failing step it keeps to ``path`` (see the module docstring)."""
    state = getattr(diagnosis, "_capsule", None)
    if not state:
        raise ValueError(
            "this Diagnosis keeps no failing step to save (it was made by from_dict, or by diagnose_function "
            "on arguments that are not tensors)"
        )
    arrays: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    meta: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "kind": state["kind"],
        "diagnosis": diagnosis.to_dict(),
        "own_step": bool(state.get("own_step", False)),
        "versions": {"companion": __version__, "tensorflow": tf.__version__, "keras": keras.__version__,
                     "numpy": np.__version__},
    }
    if state["kind"] == "model":
        x, y, w = state["batch"]
        meta["batch"] = {
            "x": _structure(x, "batch/x", arrays, dtypes),
            "y": _structure(y, "batch/y", arrays, dtypes),
            "sample_weight": _structure(w, "batch/sample_weight", arrays, dtypes),
        }
        variables = state.get("variables") or {}
        meta["variables"] = list(variables)
        for key, value in variables.items():
            _put(arrays, dtypes, "variables/" + key, np.asarray(value))
    else:
        meta["args"] = _structure(tuple(state["args"]), "args", arrays, dtypes)
    numpy_state = state.get("numpy_random")
    if numpy_state is not None:
        arrays["numpy_random/key"] = np.asarray(numpy_state[1])
        meta["numpy_random"] = {"algorithm": numpy_state[0], "pos": int(numpy_state[2]),
                                "has_gauss": int(numpy_state[3]), "cached_gaussian": float(numpy_state[4])}
    meta["dtypes"] = dtypes
    arrays["__meta__"] = np.frombuffer(json.dumps(meta, allow_nan=True).encode("utf-8"), np.uint8)
    path = os.fspath(path)
    np.savez_compressed(path, **arrays)
    return path if path.endswith(".npz") else path + ".npz"


@dataclasses.dataclass(frozen=True)
class Capsule:
    """A loaded NaN capsule.

    Attributes:
        meta: the JSON metadata (``diagnosis``, ``versions``, ``kind``...);
            ``Diagnosis.from_dict(meta["diagnosis"])`` is the stored diagnosis.
        batch: ``(x, y, sample_weight)`` of the failing step (model capsules).
        args: the positional arguments of the failing call (function capsules).
        variables: key -> value before the step.
    """

    meta: dict
    batch: tuple | None
    args: tuple | None
    variables: dict


def load(path: str | os.PathLike) -> Capsule:
    """Read a capsule written by :meth:`Diagnosis.save` (no pickle is loaded)."""
    with np.load(os.fspath(path), allow_pickle=False) as data:
        arrays = {key: data[key] for key in data.files}
    meta = json.loads(bytes(arrays.pop("__meta__").tobytes()).decode("utf-8"))
    if meta.get("format") != FORMAT:
        raise ValueError(f"{os.fspath(path)} is not a NaN capsule (format {meta.get('format')!r})")
    dtypes = meta.get("dtypes", {})
    values = {key: _get(arrays, dtypes, key) for key in arrays}
    batch = args = None
    if meta["kind"] == "model":
        b = meta["batch"]
        batch = tuple(_unjson(b[part], values) for part in ("x", "y", "sample_weight"))
    else:
        args = _unjson(meta["args"], values)
    variables = {key: values["variables/" + key] for key in meta.get("variables", [])}
    return Capsule(meta=meta, batch=batch, args=args, variables=variables)
