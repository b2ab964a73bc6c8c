"""The old import paths of the modules that moved to :mod:`companion.book`.

The chapters' support code (``companion.notebook``, ``companion.models``, ...) moved under
:mod:`companion.book` so that the top level of :mod:`companion` lists only what a user
imports into a project. The old paths keep working for one release: each is a small module
that calls :func:`alias`, which warns with a ``DeprecationWarning`` (attributed to the line
that imports the old path, so Jupyter shows it in the reader's cell) and then makes the old
name the new module itself, so ``companion.notebook is companion.book.notebook``.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings

#: Old module name -> new module name(s). ``companion.checklist`` became two modules.
MOVED: dict[str, tuple[str, ...]] = {
    "companion.accuracy": ("companion.book.accuracy",),
    "companion.benchmark_results": ("companion.book.benchmark_results",),
    "companion.checklist": ("companion.book.survey", "companion.book.cases"),
    "companion.models": ("companion.book.models",),
    "companion.notebook": ("companion.book.notebook",),
    "companion.reports": ("companion.book.reports",),
    "companion.reproductions": ("companion.book.reproductions",),
    "companion.runs": ("companion.book.runs",),
    "companion.targets": ("companion.book.targets",),
}

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_IMPORTLIB_DIR = os.path.dirname(os.path.abspath(importlib.__file__))


def _skipped_by_warnings(filename: str) -> bool:
    """A frame ``warnings.warn`` steps over without counting it (the import system's own)."""
    return "importlib" in filename and "_bootstrap" in filename


def _stacklevel() -> int:
    """The ``stacklevel`` that attributes a warning to the code that imported the old path.

    Steps over the old path's stub module, this package's ``__getattr__``,
    ``importlib.import_module`` and the import system (which ``warnings`` skips by itself).
    """
    frame, level = sys._getframe(2), 2  # 1: alias(), whose caller is the stub module
    while frame is not None:
        filename = frame.f_code.co_filename
        if _skipped_by_warnings(filename):
            frame = frame.f_back
            continue
        directory = os.path.dirname(os.path.abspath(filename))
        if directory not in (_PACKAGE_DIR, _IMPORTLIB_DIR):  # companion/*.py, importlib/__init__.py
            return level
        frame, level = frame.f_back, level + 1
    return 1


def alias(old: str) -> None:
    """Warn that ``old`` moved, and make ``sys.modules[old]`` the module it moved to.

    Called by the stub module that still sits at the old path, as ``alias(__name__)``. A
    module that became two (``companion.checklist``) keeps its stub, filled with both new
    modules' public names.
    """
    new = MOVED[old]
    warnings.warn(
        f"{old} has moved to {' and '.join(new)}: import it from there "
        "(the old name keeps working for one release)",
        DeprecationWarning,
        stacklevel=_stacklevel(),
    )
    modules = [importlib.import_module(name) for name in new]
    if len(modules) == 1:
        sys.modules[old] = modules[0]
        return
    stub = sys.modules[old]
    names: list[str] = []
    for module in modules:
        for name in module.__all__:
            setattr(stub, name, getattr(module, name))
            names.append(name)
    stub.__all__ = sorted(names)
