"""Re-running a NaN capsule: :func:`replay`.

A capsule (:mod:`~companion.diagnostics.capsule_file`) is the failing step as one file,
written by :meth:`Diagnosis.save <companion.diagnostics.Diagnosis.save>`.
:func:`replay` puts its state into a model (the user's, possibly edited: a layer
moved to float32, a clamp added, a smaller learning rate) and runs the step again with
the doctor; it says whether the step is finite now.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable

import keras
import tensorflow as tf

from companion.diagnostics.capsule_file import load, named_variables, save
from companion.diagnostics.diagnosis import Diagnosis
from companion.diagnostics.doctor import diagnose
from companion.diagnostics.function import diagnose_function

__all__ = ["Replayed", "load", "replay", "save"]


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
    capsule = load(path)
    before = Diagnosis.from_dict(capsule.meta["diagnosis"])
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
