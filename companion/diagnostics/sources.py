"""Which frames of a Python stack are the user's, and which Keras layer is running.

Shared by :mod:`~companion.diagnostics.trace` (the op-by-op re-run) and
:mod:`~companion.diagnostics.locate`: a NaN is reported at the innermost line of code
that is neither TensorFlow, Keras, NumPy, the standard library, nor this package's own
plumbing (the diagnostics, the loss resolution and the training loop).
"""

from __future__ import annotations

import functools
import linecache
import os
import sysconfig

import keras

_LIBRARY_PACKAGES = frozenset(
    {"tensorflow", "keras", "tf_keras", "absl", "numpy", "tensorflow_probability", "ml_dtypes", "_pytest", "pluggy"}
)
_STDLIB = os.path.normcase(os.path.realpath(sysconfig.get_paths()["stdlib"]))
_COMPANION = os.path.normcase(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
# companion's own plumbing: a NaN is never "in" these, it is in the code they call.
_COMPANION_PLUMBING = ("diagnostics", "training", "losses.py", "optimizers.py", "_")


@functools.lru_cache(maxsize=4096)
def is_library_file(filename: str) -> bool:
    """Whether ``filename`` belongs to a library (or to companion's plumbing), not to the user."""
    if filename.startswith("<frozen") or filename.startswith("<string"):
        return True
    normalized = os.path.normcase(os.path.realpath(filename))
    parts = normalized.split(os.sep)
    for i, part in enumerate(parts[:-1]):
        if part in ("site-packages", "dist-packages") and parts[i + 1] in _LIBRARY_PACKAGES:
            return True
    if normalized.startswith(_COMPANION + os.sep):
        inner = normalized[len(_COMPANION) + 1:].split(os.sep)[0]
        return inner.startswith(_COMPANION_PLUMBING)
    return normalized.startswith(_STDLIB + os.sep) and "site-packages" not in parts


def layer_path(layer) -> str:
    """A Keras layer's path (``"net/dense"``), or its name."""
    return str(getattr(layer, "path", None) or layer.name)


def where_in_user_code(frame) -> tuple[str | None, str | None, int | None]:
    """``(layer path, file, line)`` seen from ``frame`` outwards.

    The layer is the innermost Keras layer whose ``call`` is on the stack; the file and
    line are those of the innermost frame of user code.
    """
    layer = filename = lineno = None
    while frame is not None:
        code = frame.f_code
        if filename is None and not is_library_file(code.co_filename):
            filename, lineno = code.co_filename, frame.f_lineno
        if layer is None and code.co_name == "call":
            this = frame.f_locals.get("self")
            if isinstance(this, keras.layers.Layer) and not isinstance(this, keras.losses.Loss):
                layer = layer_path(this)
        if layer is not None and filename is not None:
            break
        frame = frame.f_back
    return layer, filename, lineno


def source_text(filename: str | None, lineno: int | None) -> str | None:
    """The stripped text of a source line, or ``None``."""
    if filename is None or lineno is None:
        return None
    return linecache.getline(filename, lineno).strip() or None
