"""A NaN capsule: the failing step as one file, and :func:`replay` to re-run it.

:meth:`Diagnosis.save <companion.diagnostics.Diagnosis.save>` writes one ``.npz``
file: the failing batch, every variable of the model, its metrics and its optimizers
as they were before the step (keyed by path), the states of Keras' and TensorFlow's
global random generators and of NumPy's, and, as JSON inside the same file (the
``__meta__`` entry, UTF-8 bytes), the diagnosis, the batch's structure and the versions
that made it. Nothing is pickled: ``np.load(path, allow_pickle=False)`` reads it.

:func:`replay` puts that state into a model (the user's, possibly edited: a layer
moved to float32, a clamp added, a smaller learning rate) and runs the step again with
the doctor; it says whether the step is finite now.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from companion import _internal
from companion._version import __version__
from companion.diagnostics.gradients import _variable_path
from companion.diagnostics.state import components
from companion.diagnostics.step import optimizers_of

__all__ = ["Replayed", "load", "replay", "save"]

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
        meta: the JSON metadata (``diagnosis``, ``versions``, ``kind``...).
        batch: ``(x, y, sample_weight)`` of the failing step (model capsules).
        args: the positional arguments of the failing call (function capsules).
        variables: key -> value before the step.
    """

    meta: dict
    batch: tuple | None
    args: tuple | None
    variables: dict

    @property
    def diagnosis(self):
        """The :class:`~companion.diagnostics.Diagnosis` stored in the file."""
        from companion.diagnostics.doctor import Diagnosis  # noqa: PLC0415

        return Diagnosis.from_dict(self.meta["diagnosis"])


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


@dataclasses.dataclass(frozen=True)
class Replayed:
    """What :func:`replay` found.

    Attributes:
        finite: whether the step is finite now.
        diagnosis: the doctor's diagnosis of the step, if it is still non-finite.
        restored: how many saved variables were put into the model.
        missing: keys of saved variables the model has no match for (a changed shape, a
            removed layer, an optimizer not built yet).
        before: the diagnosis stored in the capsule.
    """

    finite: bool
    diagnosis: Any
    restored: int
    missing: tuple[str, ...]
    before: Any

    def __str__(self) -> str:
        head = (
            f"replay: the step is finite now (it was {self.before.cause}"
            + (f" in {self.before.op}" if self.before.op else "") + ")"
            if self.finite
            else "replay: the step is still non-finite"
        )
        lines = [head, f"  restored {self.restored} variable{'s' if self.restored != 1 else ''}"
                 + (f"; {len(self.missing)} not matched: {', '.join(self.missing[:3])}"
                    + (" ..." if len(self.missing) > 3 else "") if self.missing else "")]
        if self.diagnosis is not None:
            lines.append(str(self.diagnosis))
        return "\n".join(lines)


def _restore_into(model, saved: dict) -> tuple[int, tuple[str, ...]]:
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, keras.optimizers.Optimizer) and not optimizer.built and model.built:
        optimizer.build(model.trainable_variables)
    targets = dict(named_variables(model))
    # A rebuilt model has other automatic names (custom_3/dense_3): match the rest in order.
    by_shape: dict[str, list] = {}
    for key, variable in targets.items():
        by_shape.setdefault(_generic(key), []).append(key)
    restored, missing = 0, []
    for key, value in saved.items():
        if key not in targets and by_shape.get(_generic(key)):
            key_here = by_shape[_generic(key)].pop(0)
        else:
            key_here = key
            if _generic(key) in by_shape and key in by_shape[_generic(key)]:
                by_shape[_generic(key)].remove(key)
        variable = targets.get(key_here)
        if variable is None or tuple(variable.shape) != tuple(value.shape):
            missing.append(key)
            continue
        dtype = tf.as_dtype(variable.dtype)
        variable.assign(tf.cast(tf.convert_to_tensor(value), dtype) if dtype != tf.as_dtype(value.dtype) else value)
        restored += 1
    return restored, tuple(missing)


def _generic(key: str) -> str:
    """A key without the model's name and Keras' numbering: ``model/custom_3/dense_3/kernel`` -> ``model/dense/kernel``."""
    parts = key.split("/")
    if len(parts) > 2 and not parts[0].startswith("random"):
        parts = [parts[0]] + parts[2:]  # the model's or optimizer's own name may differ too
    return "/".join(re.sub(r"_\d+$", "", part) for part in parts)


def replay(
    path: str | os.PathLike,
    model_or_step: keras.Model | Callable[..., Any],
    *,
    loss: Callable | str | None = None,
    verbose: bool = True,
) -> Replayed:
    """Re-run the failing step of a capsule on a (possibly edited) model or step function.

    For a Keras model, every saved variable (the model's, its metrics', its
    optimizers', the global random generators') is assigned to the model's variable of
    the same path and shape, the batch goes through :func:`diagnose` (the model's own
    ``train_step`` if it has one, else the compiled loss, or ``loss``), and the model
    keeps the restored state. For a function, it is called as :func:`diagnose_function`
    calls it: with the capsule's arguments (a function capsule), or with ``x, y`` (and
    ``sample_weight`` if there is one) of the saved batch.

    Args:
        path: a file written by :meth:`Diagnosis.save`.
        model_or_step: the model (rebuilt from the user's code, with any fix applied),
            or the training-step function.
        loss: for a model, passed to :func:`diagnose`.
        verbose: print the result.

    Returns:
        A :class:`Replayed`: ``finite``, the new ``diagnosis`` if not, what was restored.

    Raises:
        TypeError: if ``model_or_step`` is neither a Keras model nor callable.
        ValueError: if ``path`` is not a capsule.

    Example:
        >>> import tempfile
        >>> from companion.diagnostics import diagnose
        >>> model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        >>> model.compile(loss=lambda y, p: tf.math.log(p - p), optimizer="sgd")
        >>> d = diagnose(model, (np.ones((2, 1)), np.ones((2, 1))))
        >>> path = d.save(os.path.join(tempfile.mkdtemp(), "nan.npz"))
        >>> model.compile(loss="mse", optimizer="sgd")  # the fix
        >>> replay(path, model, verbose=False).finite
        True
    """
    from companion.diagnostics.doctor import diagnose  # noqa: PLC0415
    from companion.diagnostics.function import diagnose_function  # noqa: PLC0415

    capsule = load(path)
    before = capsule.diagnosis
    if isinstance(model_or_step, keras.Model):
        model = model_or_step
        x, y, w = capsule.batch
        if not model.built:
            try:
                model(x)
            except Exception:  # pragma: no cover - a model without call(): its train_step builds it
                pass
        restored, missing = _restore_into(model, capsule.variables)
        found = diagnose(model, iter([(x, y, w)]), loss)
    elif callable(model_or_step):
        restored, missing = 0, ()
        if capsule.args is not None:
            args = capsule.args
        else:
            x, y, w = capsule.batch
            args = tuple(a for a in (x, y, w) if a is not None)
        found = diagnose_function(model_or_step, *args)
    else:
        raise TypeError(f"model_or_step must be a Keras model or a callable, got {type(model_or_step).__name__}")
    result = Replayed(finite=found is None, diagnosis=found, restored=restored, missing=missing, before=before)
    if verbose:
        print(result)
    return result
