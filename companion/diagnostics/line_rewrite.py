"""A remedy that rewrites the user's statement, applied for one re-run of the failing step.

A :class:`LineRewrite` carries an AST transform of the statement: ``log(1 + exp(x))``
as :func:`softplus`, ``exp(x) / reduce_sum(exp(x))`` as :func:`softmax`, ``x / norm(x)``
as :func:`l2_normalize`, a ``-inf`` literal made finite (:func:`finite_mask`), a double
where (:func:`double_where`). :func:`line_rewritten` finds every live function whose
code holds the line, compiles it again with the statement rewritten, and puts the
original code back when the re-run ends. :mod:`.rewrites` chooses the remedy and
verifies it with this.
"""

from __future__ import annotations

from typing import Callable

import ast
import contextlib
import dataclasses
import os
import types

from companion.diagnostics import user_line

__all__ = ["LineRewrite", "double_where", "finite_mask", "l2_normalize", "line_rewritten", "softmax", "softplus"]


@dataclasses.dataclass(frozen=True)
class LineRewrite:
    """How :func:`~companion.diagnostics.rewrites.verify_clamp` applies a remedy that rewrites
    the user's statement, not one call.

    Attributes:
        transform: ``transform(statement, namespace, function)`` rewrites the statement's
            AST in place (``namespace``: the function's globals; ``function``: the
            definition that holds it, for a formula that the next lines finish) and
            says whether it changed.
        what: the remedy in a few words, for the report.
    """

    transform: Callable[[ast.AST, dict, ast.AST], bool]
    what: str


_TF = "__import__('tensorflow')"


def _expr(text: str) -> ast.expr:
    return ast.parse(text, mode="eval").body


def _same(a, b) -> bool:
    return ast.dump(a) == ast.dump(b)


def _called(node, *names: str) -> bool:
    return isinstance(node, ast.Call) and user_line.last_name(node.func) in names


def _replace_nodes(tree: ast.AST, replace: Callable[[ast.AST], "ast.AST | None"]) -> bool:
    """Every node for which ``replace`` returns a node, replaced by it (outermost first)."""
    changed = False

    class Swap(ast.NodeTransformer):
        def visit(self, node):
            nonlocal changed
            new = replace(node)
            if new is not None:
                changed = True
                return ast.copy_location(new, node)
            return self.generic_visit(node)

    Swap().visit(tree)
    return changed


def softplus(statement, namespace, function=None) -> bool:
    """``log(1 + exp(x))`` -> ``tf.nn.softplus(x)``."""

    def replace(node):
        if _called(node, "log") and len(node.args) == 1 and isinstance(node.args[0], ast.BinOp):
            total = node.args[0]
            if isinstance(total.op, ast.Add):
                for one, other in ((total.left, total.right), (total.right, total.left)):
                    if isinstance(one, ast.Constant) and one.value == 1 and _called(other, "exp") and other.args:
                        call = _expr(f"{_TF}.nn.softplus(x)")
                        call.args = [other.args[0]]
                        return call
        return None

    return _replace_nodes(statement, replace)


def softmax(statement, namespace, function=None) -> bool:
    """``exp(x) / reduce_sum(exp(x), axis)`` -> ``tf.nn.softmax(x, axis)``."""

    def replace(node):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and _called(node.left, "exp"):
            total = node.right
            if _called(total, "reduce_sum", "sum") and total.args and _called(total.args[0], "exp") \
                    and _same(total.args[0].args[0], node.left.args[0]):
                axis = total.args[1] if len(total.args) > 1 else next(
                    (k.value for k in total.keywords if k.arg == "axis"), ast.Constant(-1))
                call = _expr(f"{_TF}.nn.softmax(x, axis=-1)")
                call.args, call.keywords[0].value = [node.left.args[0]], axis
                return call
        return None

    if _replace_nodes(statement, replace):
        return True
    # e = exp(x) on this line, e / reduce_sum(e, axis) on a later one: the later one becomes softmax(x, axis)
    if function is None or not (isinstance(statement, ast.Assign) and len(statement.targets) == 1
                                and isinstance(statement.targets[0], ast.Name) and _called(statement.value, "exp")):
        return False
    name, argument = statement.targets[0].id, statement.value.args[0]

    def later(node):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.left, ast.Name) \
                and node.left.id == name and _called(node.right, "reduce_sum", "sum") and node.right.args \
                and isinstance(node.right.args[0], ast.Name) and node.right.args[0].id == name:
            total = node.right
            axis = total.args[1] if len(total.args) > 1 else next(
                (k.value for k in total.keywords if k.arg == "axis"), ast.Constant(-1))
            call = _expr(f"{_TF}.nn.softmax(x, axis=-1)")
            call.args, call.keywords[0].value = [argument], axis
            return call
        return None

    rest = [n for n in function.body if n.lineno > statement.lineno]
    return any([_replace_nodes(n, later) for n in rest])


def l2_normalize(statement, namespace, function=None) -> bool:
    """``x / norm(x, axis)`` -> ``tf.math.l2_normalize(x, axis)``."""

    def replace(node):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and _called(
                node.right, "norm", "reduce_euclidean_norm") and node.right.args \
                and _same(node.right.args[0], node.left):
            norm = node.right
            axis = next((k.value for k in norm.keywords if k.arg == "axis"), None)
            if axis is None and len(norm.args) > 1 and user_line.last_name(norm.func) == "reduce_euclidean_norm":
                axis = norm.args[1]
            call = _expr(f"{_TF}.math.l2_normalize(x, axis=-1)")
            call.args, call.keywords[0].value = [node.left], axis if axis is not None else ast.Constant(None)
            return call
        # a cosine: reduce_sum(a * b, axis) / (norm(a, axis) * norm(b, axis)) -> the sum of the normalised
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and _called(node.left, "reduce_sum") \
                and node.left.args and isinstance(node.left.args[0], ast.BinOp) \
                and isinstance(node.left.args[0].op, ast.Mult) and isinstance(node.right, ast.BinOp) \
                and isinstance(node.right.op, ast.Mult) and _called(node.right.left, "norm") \
                and _called(node.right.right, "norm"):
            a, b = node.left.args[0].left, node.left.args[0].right
            norms = [node.right.left, node.right.right]
            if {ast.dump(n.args[0]) for n in norms if n.args} == {ast.dump(a), ast.dump(b)}:
                axis = next((k.value for k in norms[0].keywords if k.arg == "axis"), ast.Constant(None))
                unit = [_expr(f"{_TF}.math.l2_normalize(x, axis=-1)") for _ in (a, b)]
                for call, value in zip(unit, (a, b)):
                    call.args, call.keywords[0].value = [value], axis
                total = node.left
                total.args[0] = ast.BinOp(unit[0], ast.Mult(), unit[1])
                return total
        return None

    return _replace_nodes(statement, replace)


def finite_mask(value: float):
    """``-inf`` (``-np.inf``, ``float("-inf")``, ``-math.inf``) -> a large finite negative number."""

    def transform(statement, namespace, function=None) -> bool:
        def replace(node):
            inner = node.operand if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) else None
            if inner is not None and (isinstance(inner, ast.Attribute) and inner.attr in ("inf", "Inf", "infty")
                                      or _called(inner, "float") and inner.args
                                      and getattr(inner.args[0], "value", None) in ("inf", "Inf")):
                return ast.Constant(value)
            if _called(node, "float") and node.args and getattr(node.args[0], "value", None) in ("-inf", "-Inf"):
                return ast.Constant(value)
            return None

        return _replace_nodes(statement, replace)

    return transform


def double_where(op: str | None, safe: float):
    """``tf.where(c, f(x), y)`` -> ``tf.where(c, f(tf.where(c, x, safe)), y)`` for the branch holding ``op``."""

    def transform(statement, namespace, function=None) -> bool:
        call = next((n for n in ast.walk(statement) if _called(n, "where") and len(n.args) >= 3), None)
        if call is None:
            return False
        condition = call.args[0]
        branches = [b for b in call.args[1:3] if user_line.holds(b, op)] or list(call.args[1:3])
        changed = False
        for branch in branches:
            callees = {id(n.func) for n in ast.walk(branch) if isinstance(n, ast.Call)}

            index = call.args.index(branch)

            def replace(node, callees=callees, selected=index == 1):
                if isinstance(node, ast.Name) and id(node) not in callees and isinstance(node.ctx, ast.Load) \
                        and user_line.free(node.id, namespace):
                    guarded = _expr(f"{_TF}.where(c, x, {safe!r})")
                    value = ast.Name(node.id, ast.Load())
                    # the branch taken where c holds sees x there; the other one where c does not
                    guarded.args = [condition, value, guarded.args[2]] if selected else [
                        condition, guarded.args[2], value]
                    return guarded
                return None

            holder = ast.Expression(branch)
            changed = _replace_nodes(holder, replace) or changed
            call.args[index] = holder.body
        return changed

    return transform


def _code_objects(code, filename: str):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType) and const.co_filename == filename:
            yield from _code_objects(const, filename)


def _lines_of(code) -> set:
    return {line for _, _, line in code.co_lines() if line is not None}


def _innermost_code(filename: str, lineno: int):
    """The innermost code object of ``filename`` whose lines include ``lineno``, from its module's functions."""
    namespace = user_line.module_of(filename) or {}
    roots, seen = [], set()

    def visit(obj, depth=0):
        if id(obj) in seen or depth > 3:
            return
        seen.add(id(obj))
        function = getattr(obj, "python_function", obj)  # a tf.function
        function = getattr(function, "__func__", function)
        code = getattr(function, "__code__", None)
        if isinstance(code, types.CodeType) and os.path.realpath(code.co_filename) == os.path.realpath(filename):
            roots.append(code)
        if isinstance(obj, type) and getattr(obj, "__module__", None) == namespace.get("__name__"):
            for value in vars(obj).values():
                visit(value, depth + 1)

    for value in list(namespace.values()):
        visit(value)
    best = None
    for root in roots:
        for code in _code_objects(root, root.co_filename):
            if lineno in _lines_of(code) and (best is None or len(_lines_of(code)) < len(_lines_of(best))):
                best = code
    return best


def _rewritten_code(function, lineno: int, rewrite: LineRewrite):
    """``function``'s code with the statement at ``lineno`` rewritten, or ``None``."""
    import inspect  # noqa: PLC0415
    import textwrap  # noqa: PLC0415

    code = function.__code__
    try:
        source = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError):
        return None
    tree = ast.parse(source)
    definition = tree.body[0]
    if not isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    definition.decorator_list = []
    ast.increment_lineno(tree, code.co_firstlineno - definition.lineno)
    statements = [n for n in ast.walk(definition) if isinstance(n, ast.stmt) and n is not definition
                  and n.lineno <= lineno <= (n.end_lineno or n.lineno)]
    if not statements:
        return None
    statement = min(statements, key=lambda n: (n.end_lineno or n.lineno) - n.lineno)
    if not rewrite.transform(statement, function.__globals__, definition):
        return None
    free = list(code.co_freevars)
    outer = ast.parse(f"def __rewritten__():\n    {' = '.join(free + ['None']) if free else 'pass'}\n"
                      f"    return None").body[0]
    outer.body = [outer.body[0], definition, ast.Return(ast.Name(definition.name, ast.Load()))]
    module = ast.Module([outer], [])
    ast.fix_missing_locations(module)
    scope: dict = {}
    exec(compile(module, code.co_filename, "exec"), dict(function.__globals__), scope)  # noqa: S102
    new = scope["__rewritten__"]().__code__
    return new if new.co_freevars == code.co_freevars else None


@contextlib.contextmanager
def line_rewritten(rewrite: LineRewrite, filename: str, lineno: int):
    """Every live function whose code holds ``filename:lineno`` runs with that statement rewritten.

    Yields a list that is not empty when the rewrite was applied; every function's code
    is put back when the block ends, also on an error.
    """
    import gc  # noqa: PLC0415

    applied: list[int] = []
    code = _innermost_code(filename, lineno)
    functions = [] if code is None else [f for f in gc.get_referrers(code) if isinstance(f, types.FunctionType)]
    undo = []
    try:
        for function in functions:
            new = _rewritten_code(function, lineno, rewrite)
            if new is not None:
                undo.append((function, function.__code__))
                function.__code__ = new
                applied.append(1)
        yield applied
    finally:
        for function, original in undo:
            function.__code__ = original
