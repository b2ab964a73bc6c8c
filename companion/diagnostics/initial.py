"""Weights that are not finite before any training step: which layer, which variable, what set them.

A weight that starts ``NaN`` or ``Inf`` (an output bias set to the log of a class prior
that is 0, a data-dependent initialisation that divides by a spread of 0) makes the
first step non-finite, and no training step can cure it: a guarded step skips every
step, and ``fit`` writes ``NaN`` everywhere. :func:`origin` says where such a value came
from: the layer that owns the variable; whether the layer's own initializer makes it
(the initializer is called again on the variable's shape) or a value assigned after the
layer was built; and the line of user code that sets it, found in the user's files on
the stack (the script or test that called the doctor) and in the layer's own class: a
line that assigns the variable (``.bias.assign(...)``), passes its initializer
(``bias_initializer=...``) or sets the layer's weights (``set_weights``).
"""

from __future__ import annotations

import dataclasses
import inspect
import linecache
import os
import re
from typing import Any

import numpy as np

from companion import _internal
from companion.diagnostics.gradients import _variable_path
from companion.diagnostics.sources import is_library_file, layer_path
from companion.diagnostics.trace import nonfinite_mask

__all__ = ["Origin", "before_any_step", "nonfinite_variables", "origin"]


@dataclasses.dataclass(frozen=True)
class Origin:
    """Where a non-finite initial weight came from.

    Attributes:
        layer: path of the layer that owns the variable (``None`` if no layer does).
        attribute: the variable's name in its layer (``"bias"``).
        how: ``"its initializer Constant(...)"`` or ``"a value assigned after the layer
            was built"``.
        filename: the file of the line that sets it, or ``None``.
        lineno: that line's number, or ``None``.
    """

    layer: str | None
    attribute: str
    how: str
    filename: str | None
    lineno: int | None


def nonfinite_variables(model: Any) -> list[tuple[Any, np.ndarray]]:
    """``(variable, value)`` of every variable of ``model`` holding a NaN or an Inf."""
    bad = []
    for variable in model.variables:
        value = np.asarray(variable.numpy())
        if value.dtype.kind in "fcV" and nonfinite_mask(value).any():
            bad.append((variable, value))
    return bad


def before_any_step(model: Any) -> bool:
    """Whether no optimizer step has been applied to ``model`` (its optimizer's ``iterations`` is 0)."""
    optimizer = getattr(model, "optimizer", None)
    iterations = getattr(optimizer, "iterations", None)
    if iterations is None:
        return True
    try:
        return int(np.asarray(iterations.numpy() if hasattr(iterations, "numpy") else iterations)) == 0
    except (TypeError, ValueError):  # pragma: no cover - an optimizer that cannot say
        return False


def _owner(model, variable):
    """The innermost layer of ``model`` whose weights hold ``variable`` (the fewest weights)."""
    holders = [layer for layer in _internal.all_layers(model) if any(v is variable for v in layer.weights)]
    return min(holders, key=lambda layer: len(layer.weights)) if holders else None


def _attribute(layer, variable) -> str:
    if layer is not None:
        for name, value in vars(layer).items():
            if value is variable and not name.startswith("_"):
                return name
    return str(getattr(variable, "name", "variable")).split("/")[-1].split(":")[0]


def _initializer_makes_it(layer, attribute: str, variable) -> str | None:
    initializer = getattr(layer, f"{attribute}_initializer", None) if layer is not None else None
    if initializer is None or not callable(initializer):
        return None
    try:
        value = np.asarray(initializer(tuple(variable.shape), dtype=str(np.dtype(variable.dtype))))
    except Exception:  # noqa: BLE001 - an initializer that cannot be called again: say nothing of it
        return None
    if nonfinite_mask(value).any():
        config = getattr(initializer, "get_config", dict)()
        shown = ", ".join(f"{k}={v!r}" for k, v in config.items() if k != "seed")
        return f"its initializer {attribute}_initializer={type(initializer).__name__}({shown})"
    return None


def _user_files(layer) -> list[str]:
    files = []
    frame = inspect.currentframe()
    while frame is not None:
        name = frame.f_code.co_filename
        if not is_library_file(name) and os.path.exists(name) and name not in files:
            files.append(name)
        frame = frame.f_back
    if layer is not None:
        try:
            name = inspect.getsourcefile(type(layer))
        except TypeError:
            name = None
        if name and not is_library_file(name) and name not in files:
            files.insert(0, name)
    return files


def _setting_line(files, layer, attribute: str, by_initializer: bool) -> tuple[str | None, int | None]:
    """The first line of ``files`` that sets the variable: an initializer argument or an assignment."""
    name = re.escape(getattr(layer, "name", "") or "\0")
    attr = re.escape(attribute)
    initializer = [rf"['\"]{name}['\"].*\b{attr}_initializer\s*=", rf"\b{attr}_initializer\s*="]
    assigned = [
        rf"['\"]{name}['\"].*\.{attr}\.assign\(",  # model.get_layer("out").bias.assign(...)
        rf"\b{attr}\.assign\(",  # self.bias.assign(...), layer.bias.assign(...)
        rf"['\"]{name}['\"].*\.set_weights\(",
        r"\.set_weights\(",
    ]
    for pattern in (initializer + assigned) if by_initializer else (assigned + initializer):
        for filename in files:
            for lineno, line in enumerate(linecache.getlines(filename), start=1):
                if not line.lstrip().startswith("#") and re.search(pattern, line):
                    return filename, lineno
    return None, None


def origin(model: Any, variable: Any) -> Origin:
    """Where the non-finite value of ``variable`` (a variable of ``model``) came from.

    Args:
        model: the Keras model.
        variable: one of its variables, holding a NaN or an Inf.

    Returns:
        An :class:`Origin`: the layer, the variable's name in it, whether its
        initializer makes the value, and the user's line that sets it (if found).
    """
    layer = _owner(model, variable)
    attribute = _attribute(layer, variable)
    by_initializer = _initializer_makes_it(layer, attribute, variable)
    how = by_initializer or "a value assigned after the layer was built"
    filename, lineno = _setting_line(_user_files(layer), layer, attribute, by_initializer is not None)
    return Origin(layer=layer_path(layer) if layer is not None and layer is not model else None,
                  attribute=attribute, how=how, filename=filename, lineno=lineno)


def describe(model: Any, bad: list[tuple[Any, np.ndarray]]) -> tuple[Origin, str]:
    """The origin of the first of ``bad`` (from :func:`nonfinite_variables`), and a summary of all."""
    variable, value = bad[0]
    found = origin(model, variable)
    mask = nonfinite_mask(value)
    kinds = [k for k, m in (("NaN", np.isnan(value)), ("+Inf", np.isposinf(value)), ("-Inf", np.isneginf(value)))
             if np.any(m)] if value.dtype.kind == "f" else ["non-finite"]
    summary = (f"{int(mask.sum())} of {value.size} entries of {_variable_path(variable)} are "
               f"{'/'.join(kinds)} before any training step, set by {found.how}")
    if len(bad) > 1:
        summary += f" (and {len(bad) - 1} more variable{'s' if len(bad) > 2 else ''})"
    return found, summary
