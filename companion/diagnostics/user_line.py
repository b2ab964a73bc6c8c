"""The user's line as the remedies read it: how it spells an op, and what its names are.

:data:`SPELLING` is how the user's code spells an op (what a remedy rewrites);
:func:`expression` is the statement's expression (a ``return``'s or an assignment's
value), :func:`branches` the branches of its ``where``, :func:`holds` whether a branch
spells the op; :func:`resolve`, :func:`pure` and :func:`free` say what a name on the
line is (a TensorFlow function, a module, the ``where``'s input), and :func:`module_of`
is the namespace a file's code runs in. Shared by :mod:`.rewrites` (the remedy written
against the line, the clamp that applies it) and :mod:`.line_rewrite` (the line
rewritten for a re-run).
"""

from __future__ import annotations

import ast
import builtins
import linecache
import os
import sys
import types

import numpy as np

__all__ = ["SPELLING", "branches", "expression", "free", "holds", "last_name", "module_of", "pure", "resolve"]

#: How the user's code spells an op (what the remedy rewrites).
SPELLING = {
    "Sqrt": "tf.sqrt", "Log": "tf.math.log", "Pow": "tf.pow", "Acos": "tf.acos", "Asin": "tf.asin",
    "Exp": "tf.exp", "Lgamma": "tf.math.lgamma", "Atan2": "tf.atan2", "Angle": "tf.math.angle",
    "Rsqrt": "tf.math.rsqrt", "Reciprocal": "tf.math.reciprocal",
}


_BRANCH_SPELLING = {
    "RealDiv": ("/", "divide", "truediv", "realdiv", "reciprocal"), "Div": ("/", "divide", "div"),
    "Reciprocal": ("/", "reciprocal"), "Inv": ("/", "reciprocal"), "Pow": ("**", "pow", "power"),
    "Log": ("log",), "Log1p": ("log1p",), "Exp": ("exp",), "Sqrt": ("sqrt",), "Rsqrt": ("rsqrt",),
}

#: Packages whose functions a branch may call when the safe value is tried on it.
_PURE = ("tensorflow", "keras", "numpy", "math", "companion")


def expression(source: str | None, code: str):
    """The expression of the user's statement (a ``return``'s or an assignment's value), or ``None``.

    The statement is the line alone, else the line continued on the next one or two.
    """
    texts = [code.strip()]
    filename, _, number = (source or "").rpartition(":")
    if filename and number.isdigit():
        lines = [linecache.getline(filename, int(number) + k).strip() for k in range(3)]
        texts += [" ".join(lines[:2]), " ".join(lines)]
    for text in texts:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        value = getattr(tree.body[0], "value", None) if len(tree.body) == 1 else None
        if isinstance(value, ast.expr):
            return value
    return None


def branches(expression) -> list:
    """The branches of the first ``where(c, a, b)`` call in ``expression``, or ``[expression]``."""
    for node in ast.walk(expression):
        if isinstance(node, ast.Call) and last_name(node.func) == "where":
            branches = list(node.args[1:3]) + [k.value for k in node.keywords if k.arg in ("x", "y", "x1", "x2")]
            if branches:
                return branches
    return [expression]


def last_name(node) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def holds(branch, op: str | None) -> bool:
    """Whether ``branch`` spells ``op`` (a call of its name, or its operator)."""
    names = set(_BRANCH_SPELLING.get(op or "", ()))
    spelled = SPELLING.get(op or "", "").rpartition(".")[2]
    if spelled:
        names.add(spelled)
    for node in ast.walk(branch):
        if isinstance(node, ast.BinOp):
            if isinstance(node.op, ast.Div) and "/" in names or isinstance(node.op, ast.Pow) and "**" in names:
                return True
        if isinstance(node, ast.Call) and last_name(node.func) in names:
            return True
    return False


def resolve(node, namespace: dict):
    """The object an attribute chain (``tf.math.log``) names, or ``None``."""
    if isinstance(node, ast.Name):
        return namespace.get(node.id, getattr(builtins, node.id, None))
    if isinstance(node, ast.Attribute):
        holder = resolve(node.value, namespace)
        return None if holder is None else getattr(holder, node.attr, None)
    return None


def pure(obj) -> bool:
    """A module or function of TensorFlow, Keras, NumPy or math (safe to call on a constant)."""
    name = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", None) or ""
    if isinstance(obj, np.ufunc):
        return True
    return name.split(".")[0] in _PURE


def free(name: str, namespace: dict) -> bool:
    """Whether the branch's ``name`` is the where's input (not a module, function or number)."""
    known = namespace.get(name, getattr(builtins, name, None))
    return not (isinstance(known, (types.ModuleType, int, float)) or callable(known))


def module_of(filename: str):
    """The namespace (a module's ``__dict__``) whose code is in ``filename``."""
    target = os.path.realpath(filename)
    name = os.path.basename(target)
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str) and os.path.basename(path) == name and os.path.realpath(path) == target:
            return vars(module)
    main = sys.modules.get("__main__")
    return vars(main) if main is not None else None  # a notebook's cell or a script
