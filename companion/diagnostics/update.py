"""A NaN written by the update, not by the gradient: which variable, which optimizer, which arithmetic.

The loss and the gradients of a step can be finite while the update makes a weight or
the optimizer's state non-finite: optimizer arithmetic in a low precision (Adam's
``epsilon=1e-8`` is 0 in ``float16``, so a second moment of 0 gives ``m / 0``), or an
update that carries a weight beyond its dtype's largest value. :func:`find_update`
computes what the optimizer would write, on copies (the model, its optimizer and its
state are left as they are): the same optimizer rebuilt from its config on copies of
the trainable variables, with its state copied in, applied to the step's gradients
once in the variables' own dtype and once in ``float64``. It names the first variable
the update would make non-finite, the optimizer, the arithmetic (read from the values:
the ``float64`` update finite and beyond the dtype's range is an overflow; finite and in
range, with ``epsilon`` rounding to 0 in the dtype and a slot of the optimizer exactly 0
there, is the ``epsilon`` that vanished), the line of user code that created the
optimizer (in the user's files on the stack), and a remedy — the optimizer with an
``epsilon`` the dtype can hold — verified by applying that optimizer, again on copies,
to the same gradients and finding every variable it writes finite.
"""

from __future__ import annotations

import inspect
import linecache
import math
import os
import re
import weakref

import keras
import numpy as np
import tensorflow as tf

from companion import _internal
from companion.diagnostics.causes import CAUSES
from companion.diagnostics.capsule_file import variables_state
from companion.diagnostics.diagnosis import Diagnosis, keep_state
from companion.diagnostics.gradients import _variable_path
from companion.diagnostics.scan import model_state, random_states, scanned_batches
from companion.diagnostics.sources import is_library_file, source_text
from companion.diagnostics.state import restore, snapshot
from companion.diagnostics.step import optimizers_of, pack, step_variables
from companion.diagnostics.trace import nonfinite_mask

__all__ = ["find_update", "own_step_update", "update_diagnosis"]

CAUSE = "nonfinite_update"

#: The optimizer copies of :func:`_apply_on_copies`, per optimizer (dropped with it).
_COPIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _optimizer(model):
    """The optimizer that applies the gradients (a loss-scale optimizer's inner one) and its wrapper."""
    outer = getattr(model, "optimizer", None)
    if not isinstance(outer, keras.optimizers.Optimizer):
        return None, None
    inner = getattr(outer, "inner_optimizer", None)
    return (inner if isinstance(inner, keras.optimizers.Optimizer) else outer), outer


def _gradients(model, loss_fn, x, y, w):
    """The step's gradients (eagerly, as ``fit``'s step computes them), the model's state put back."""
    variables = list(model.trainable_variables)
    saved = model_state(model) + snapshot(random_states(model))
    try:
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            value = loss_fn(x, y, y_pred, w)
        grads = tape.gradient(value, variables)
        written = [(v, np.asarray(v.numpy())) for v in model.non_trainable_variables
                   if tf.as_dtype(v.dtype).is_floating]
        moved = [(v, value) for v, value in written if nonfinite_mask(value).any()]
    finally:
        restore(saved)
    finite = bool(np.all(np.isfinite(np.asarray(tf.cast(value, tf.float32)))))
    return variables, grads, finite, moved


def _apply_on_copies(optimizer, variables, grads, dtype=None, values=None, state=None, **changes):
    """What ``optimizer`` would write, on copies: ``(new values, the variables with a gradient,
    the optimizer's copy, {id(slot): its new value})``.

    ``values`` and ``state``: the variables' and the optimizer's values to start from (as
    numpy arrays; default: their values now).
    """
    if values is None:
        values = [np.asarray(v.numpy()) for v in variables]
    pairs = [(v, g, value) for v, g, value in zip(variables, grads, values) if g is not None]
    # A built optimizer's copy is built on copies of every variable it was built on, so
    # that its state maps one to one, even when this update is of some of them (a model's
    # own step that applies it to part of the model: ``train`` builds the optimizer on all).
    built_on = _built_on(optimizer, [v for v, _, _ in pairs])
    # The copies are made once per optimizer, dtype and change (a scan of many batches
    # reuses them), and given the values to start from at each call.
    key = (dtype, tuple(sorted(changes.items())), tuple(id(v) for v in built_on))
    made = _COPIES.setdefault(optimizer, {})
    if key not in made:
        clone = type(optimizer).from_config({**optimizer.get_config(), **changes})
        copies = [keras.Variable(np.asarray(v.numpy()).astype(dtype or tf.as_dtype(v.dtype).as_numpy_dtype),
                                 dtype=dtype or v.dtype, trainable=True, name=v.name) for v in built_on]
        clone.build(copies)
        made[key] = (clone, copies, [np.asarray(v.numpy()) for v in clone.variables])
    clone, all_copies, fresh = made[key]
    position = {id(v): i for i, v in enumerate(built_on)}
    starts = {id(v): value for v, _, value in pairs}
    for variable, copy in zip(built_on, all_copies):
        value = starts[id(variable)] if id(variable) in starts else np.asarray(variable.numpy())
        copy.assign(value.astype(tf.as_dtype(copy.dtype).as_numpy_dtype))
    copies = [all_copies[position[id(v)]] for v, _, _ in pairs]
    if not optimizer.built:
        for target, value in zip(clone.variables, fresh):
            target.assign(value)
    if optimizer.built:
        source = list(optimizer.variables)
        target = list(clone.variables)
        if len(source) != len(target) or any(tuple(s.shape) != tuple(t.shape) for s, t in zip(source, target)):
            raise ValueError("the optimizer's state cannot be copied")
        if state is None:
            state = [np.asarray(v.numpy()) for v in source]
        for t, value in zip(target, state):
            if "learning_rate" in str(getattr(t, "path", t.name)) and "learning_rate" in changes:
                continue
            t.assign(value.astype(t.dtype) if np.issubdtype(value.dtype, np.floating) else value)
    cast = [tf.cast(g, dtype or v.dtype) for v, g, _ in pairs]
    clone.apply_gradients(zip(cast, copies))
    slots = {}
    for original, copied in zip(optimizer.variables if optimizer.built else [], clone.variables):
        slots[id(original)] = np.asarray(copied.numpy())
    return [np.asarray(c.numpy()) for c in copies], [v for v, _, _ in pairs], clone, slots


def _built_on(optimizer, applied: list) -> list:
    """The variables ``optimizer``'s state belongs to, in its order: those it was built on
    if it is built and they hold every one of ``applied``; else ``applied``."""
    own = (_internal.variables_built_on(optimizer) or []) if optimizer.built else []
    ids = {id(v) for v in own}
    if own and len(ids) == len(own) and all(id(v) in ids for v in applied):
        return own
    return applied


def _creation_line(optimizer, model=None) -> tuple[str | None, int | None]:
    """The line of user code that created ``optimizer``, in the user's files on the stack.

    A line that calls its class (or names it as a string), spelling the most of its
    arguments' values and nothing else; among equals, the one nearest a line that
    makes ``model`` (its class called, or one of its layers' names as a string).
    """
    files = _user_files()
    cls = re.escape(type(optimizer).__name__)
    values = _argument_values(optimizer)
    markers = _model_markers(model)
    for pattern in (rf"\b{cls}\(", rf"optimizer\s*=\s*['\"]{cls.lower()}['\"]"):
        found = []
        for filename in files:
            lines = linecache.getlines(filename)
            anchors = [i for i, line in enumerate(lines, start=1) if any(re.search(m, line) for m in markers)]
            for lineno, line in enumerate(lines, start=1):
                if line.lstrip().startswith("#") or not re.search(pattern, line):
                    continue
                numbers = [float(n) for n in re.findall(r"(?<![\w.])\d*\.?\d+(?:[eE][-+]?\d+)?", line)]
                matched = [any(math.isclose(v, n, rel_tol=1e-6) for v in values) for n in numbers]
                score = 2 * sum(matched) - len(matched)  # the numbers it spells are the optimizer's
                distance = min((abs(lineno - a) for a in anchors), default=len(lines))
                found.append((-score, distance, len(found), filename, lineno))
        if found:
            _, _, _, filename, lineno = min(found)
            return filename, lineno
    return None, None


def _model_markers(model) -> list[str]:
    """Patterns of a line that makes ``model``: its own class called, a layer's name as a string."""
    if model is None:
        return []
    markers = []
    if not type(model).__module__.startswith("keras"):
        markers.append(rf"\b{re.escape(type(model).__name__)}\(")
    for layer in _internal.all_layers(model)[1:]:
        name = getattr(layer, "name", "")
        if name:
            markers.append(rf"name\s*=\s*['\"]{re.escape(name)}['\"]")
    return markers


def _argument_values(optimizer) -> list[float]:
    """The optimizer's numeric arguments (what the call that made it may spell)."""
    config = optimizer.get_config()
    return [float(v) for v in config.values() if isinstance(v, (int, float)) and not isinstance(v, bool)]


def _call(optimizer, **changes) -> str:
    """The optimizer as the call that makes it: its class and every argument that is not the default."""
    cls = type(optimizer)
    config = optimizer.get_config()
    try:
        default = cls().get_config()
    except Exception:  # noqa: BLE001 - an optimizer without defaults: every argument
        default = {}
    shown = []
    for key, value in {**config, **changes}.items():
        if key in ("name",) or (key not in changes and key in default and _same(default[key], value)):
            continue
        if isinstance(value, dict):
            return ""  # a schedule: no one-line call
        if isinstance(value, float):
            value = float(np.format_float_positional(np.float32(value), trim="-"))
        shown.append(f"{key}={value!r}")
    return f"keras.optimizers.{cls.__name__}({', '.join(shown)})"


def _same(default, value) -> bool:
    """``value`` is the default, a float read back from a float32 variable included."""
    if isinstance(default, float) and isinstance(value, float):
        return math.isclose(default, value, rel_tol=1e-6)
    return default == value


def _safe_epsilon(dtype) -> float:
    """The smallest power of ten at or above the dtype's smallest normal number."""
    tiny = float(np.finfo(np.dtype(dtype)).tiny) if np.dtype(dtype) != np.dtype("bfloat16") else 1.2e-38
    return float(10.0 ** math.ceil(math.log10(tiny)))


def _np_dtype(dtype):
    name = tf.as_dtype(dtype).name
    return tf.as_dtype(dtype).as_numpy_dtype if name != "bfloat16" else np.float32


def update_diagnosis(model, loss_fn, x, y, w, index: int | None = None) -> Diagnosis | None:
    """The diagnosis of a step whose loss and gradients are finite and whose update is not; else None."""
    optimizer, outer = _optimizer(model)
    if optimizer is None or loss_fn is None:
        return None
    variables, grads, finite, moved = _gradients(model, loss_fn, x, y, w)
    if not finite or not _finite_gradients(grads):
        return None
    if not optimizer.built:
        optimizer.build(variables)
    found = _update_diagnosis(model, optimizer, variables, grads, index, batch=(x, y, w))
    if found is None and moved:
        return _moving_diagnosis(model, moved, index, x, y, w)
    return found


def _finite_gradients(grads) -> bool:
    return all(g is None or bool(np.all(np.isfinite(np.asarray(tf.cast(tf.convert_to_tensor(g), tf.float32)))))
               for g in grads)


def _writes_nonfinite(optimizer, variables, grads, values=None, state=None) -> bool:
    """Whether ``optimizer``'s update from ``grads`` writes a non-finite value (on copies)."""
    new, _, _, slots = _apply_on_copies(optimizer, variables, grads, values=values, state=state)
    return any(nonfinite_mask(v).any() for v in new) or any(nonfinite_mask(v).any() for v in slots.values()
                                                               if v.dtype.kind == "f")


def _update_diagnosis(model, optimizer, variables, grads, index, values=None, state=None,
                      batch=None) -> Diagnosis | None:
    """The diagnosis of ``optimizer``'s update from these finite gradients, if it writes a non-finite value.

    ``batch``: the step's ``(x, y, sample_weight)``, for a remedy checked by re-running the
    step on a copy of the model.
    """
    new, applied, clone, slots = _apply_on_copies(optimizer, variables, grads, values=values, state=state)
    bad = next((i for i, value in enumerate(new) if nonfinite_mask(value).any()), None)
    bad_slots = [s for s in optimizer.variables if id(s) in slots and nonfinite_mask(slots[id(s)]).any()]
    if bad is None and not bad_slots:
        return None
    filename, lineno = _creation_line(optimizer, model)
    name = type(optimizer).__name__
    try:
        wide, _, _, wide_slots = _apply_on_copies(optimizer, variables, grads, dtype="float64", values=values,
                                                  state=state)
    except Exception:  # noqa: BLE001 - a state that cannot be widened: no float64 comparison
        wide, wide_slots = None, {}
    if bad is not None:
        variable, value, target = applied[bad], new[bad], applied[bad]
        wide_value = wide[bad] if wide is not None else None
    else:  # the update's own state: the slot of which weight
        variable, value = bad_slots[0], slots[id(bad_slots[0])]
        wide_value = wide_slots.get(id(variable))
        slot_path = _variable_path(variable).replace("/", "_")
        target = next((v for v in applied if _variable_path(v).replace("/", "_") in slot_path), None)
    dtype = tf.as_dtype(variable.dtype).name
    mask = nonfinite_mask(value)
    count = int(mask.sum())
    path = _variable_path(variable)
    summary = f"{name}'s update writes {count} non-finite of {value.size} entries of {path} ({dtype})"
    remedy = verified = None
    epsilon = getattr(optimizer, "epsilon", None)
    limit = _largest(variable.dtype)
    epsilon_vanishes = isinstance(epsilon, (int, float)) and dtype in ("float16", "bfloat16") and (
        np.asarray(epsilon, _np_dtype(variable.dtype)) == 0)
    if wide_value is not None and np.all(np.isfinite(wide_value[mask])):
        largest = float(np.max(np.abs(wide_value[mask])))
        if largest > limit:
            summary += f"; in float64 the update is finite, up to {largest:.3g}, beyond {dtype}'s largest {limit:.6g}"
        elif epsilon_vanishes and bad is not None:
            zero = _zero_slot(optimizer, variable, slots, mask)
            summary += (f"; epsilon={epsilon:g} is 0 in {dtype}" + (f", and {zero} exactly 0 at "
                        f"{'those entries' if count > 1 else 'that entry'}" if zero else "")
                        + f": a division by 0 ({'0/0' if np.isnan(value[mask]).any() else 'x/0'}) that "
                        f"float64 does not make (the update is finite there)")
        else:
            square = _largest_square(target, applied, grads)
            summary += f"; in float64 the update is finite there, within {dtype}'s range"
            if square is not None and square > limit:
                summary += (f": the gradient's square, up to {square:.3g}, is beyond {dtype}'s largest "
                            f"{limit:.6g} (the optimizer's second moment overflows)")
    elif wide_value is not None:
        summary += "; in float64 the update is non-finite too"
    if epsilon_vanishes and bad is not None:
        remedy, verified = _epsilon_remedy(optimizer, variables, grads, variable.dtype, filename, lineno,
                                           values, state)
    if remedy is None and dtype in ("float16", "bfloat16") and target is not None:
        layer = _owner_layer(model, target)
        if layer is not None:
            remedy, verified = _mixed_remedy(model, layer, batch)
    cause = CAUSES[CAUSE]
    return Diagnosis(
        batch=index, phase="update", op=f"{name}.apply", forward_op=None,
        layer=_owner_path(model, target if target is not None else variable),
        source=f"{filename}:{lineno}" if filename else None, variables=(path,), dtype=dtype,
        inputs_summary=summary, cause=CAUSE, fix=cause.fix, section=cause.section,
        symptom="finite loss and gradients, non-finite update", code=source_text(filename, lineno),
        remedy=remedy, verified=verified,
    )


def _largest(dtype) -> float:
    name = tf.as_dtype(dtype).name
    return 3.39e38 if name == "bfloat16" else float(np.finfo(_np_dtype(dtype)).max)


def _largest_square(target, applied, grads) -> float | None:
    """The largest square of ``target``'s gradient, in float64."""
    pairs = [g for v, g in zip(applied, [g for g in grads if g is not None]) if v is target]
    if not pairs:
        return None
    values = np.asarray(tf.cast(tf.convert_to_tensor(pairs[0]), tf.float64))
    return float(np.max(values * values)) if values.size else None


def _mixed_remedy(model, layer, batch):
    """The layer with ``dtype="mixed_float16"`` (float32 variables), checked on a copy of the model."""
    filename, lineno = _layer_line(layer, model)
    where = f"at {os.path.basename(filename)}:{lineno}: " if filename else ""
    remedy = (f"{where}{type(layer).__name__}(..., dtype=\"mixed_float16\") for layer {layer.name!r}: its "
              f"variables and the optimizer's arithmetic on them in float32, its computation in float16")
    if batch is None:
        return remedy, "not verified: the step's batch is not known here"
    try:
        _, written = _float32_copy_run(model, layer, *batch, dtype="mixed_float16")
    except Exception as error:  # noqa: BLE001 - a model that cannot be copied: said, not raised
        return remedy, f"not verified: the model could not be copied with that layer's dtype ({type(error).__name__})"
    finite = all(np.all(np.isfinite(v)) for v in written if v.dtype.kind == "f")
    return remedy, (f"verified: the failing step, run on a copy of the model with {layer.name!r} in "
                    f"mixed_float16, writes every one of its {len(written)} variables finite" if finite else
                    f"not verified: with {layer.name!r} in mixed_float16 a variable is still non-finite")


def _zero_slot(optimizer, variable, slots, mask) -> str | None:
    """The paths of ``optimizer``'s slots for ``variable`` that are exactly 0 where the update is non-finite."""
    found = []
    for slot in optimizer.variables:
        value = slots.get(id(slot))
        if value is None or value.shape != mask.shape or slot is variable:
            continue
        path = _variable_path(slot)
        if _variable_path(variable).replace("/", "_") not in path.replace("/", "_"):
            continue
        if np.all(value[mask] == 0):
            found.append(path)
    if not found:
        return None
    return " and ".join(found) + (" are" if len(found) > 1 else " is")


def _epsilon_remedy(optimizer, variables, grads, dtype, filename, lineno, values=None, state=None):
    """The optimizer with an ``epsilon`` that ``dtype`` holds, checked on copies: ``(remedy, verified)``."""
    epsilon = _safe_epsilon(_np_dtype(dtype))
    call = _call(optimizer, epsilon=epsilon)
    if not call:
        return None, None
    where = f" (the optimizer made at {os.path.basename(filename)}:{lineno})" if filename else ""
    remedy = f"{call}{where}: an epsilon that {tf.as_dtype(dtype).name} holds"
    try:
        new, _, clone, _ = _apply_on_copies(optimizer, variables, grads, values=values, state=state,
                                            epsilon=epsilon)
        state = [np.asarray(v.numpy()) for v in clone.variables]
        finite = all(np.all(np.isfinite(v)) for v in new) and all(
            np.all(np.isfinite(v)) for v in state if v.dtype.kind == "f")
    except Exception as error:  # noqa: BLE001 - said, not raised
        return remedy, f"not verified: the update with epsilon={epsilon:g} failed ({type(error).__name__})"
    written = len(new) + len(state)
    return remedy, (f"verified: the update with epsilon={epsilon:g}, applied on copies to the failing step's "
                    f"gradients, writes every one of its {written} variables finite" if finite else
                    f"not verified: the update with epsilon={epsilon:g} is still non-finite")


def _owner_path(model, variable) -> str | None:
    path = _variable_path(variable)
    head, _, _ = path.rpartition("/")
    return head or None


def _owner_layer(model, variable):
    """The innermost layer holding ``variable`` (of those that hold it, the one with the
    fewest weights: a layer's weights include its sublayers')."""
    owners = [layer for layer in _internal.all_layers(model)[1:] if any(v is variable for v in layer.weights)]
    return min(owners, key=lambda layer: len(layer.weights)) if owners else None


def _float32_copy_run(model, layer, x, y=None, w=None, dtype="float32"):
    """The failing step run on a copy of ``model`` with ``layer`` in float32.

    With the compiled loss and targets, a whole training step (``train_on_batch``, the
    optimizer's state copied in), else the training forward pass. Returns the values of
    the layer's copy's variables and of every variable the step wrote; raises where the
    model cannot be cloned (a subclassed model).
    """
    def clone(each):
        config = each.get_config()
        if each is layer:
            config = {**config, "dtype": dtype}
        return each.__class__.from_config(config)

    copy = keras.models.clone_model(model, clone_function=clone)
    if len(copy.weights) != len(model.weights):
        raise ValueError("the copy has other weights")
    for target, source in zip(copy.weights, model.weights):
        target.assign(np.asarray(source.numpy()).astype(tf.as_dtype(target.dtype).as_numpy_dtype))
    copied = next(c for c, o in zip(_internal.all_layers(copy), _internal.all_layers(model)) if o is layer)
    optimizer, _ = _optimizer(model)
    if y is not None and optimizer is not None and getattr(model, "loss", None) is not None:
        # the whole step: the forward pass's writes and the update, the optimizer's state copied in
        copy.compile(optimizer=type(optimizer).from_config(optimizer.get_config()), loss=model.loss)
        copy.optimizer.build(copy.trainable_variables)
        if optimizer.built and len(copy.optimizer.variables) == len(optimizer.variables):
            for target, source in zip(copy.optimizer.variables, optimizer.variables):
                if tuple(target.shape) == tuple(source.shape):
                    target.assign(np.asarray(source.numpy()).astype(tf.as_dtype(target.dtype).as_numpy_dtype))
        copy.train_on_batch(x, y, sample_weight=w)
        written = list(copy.variables) + list(copy.optimizer.variables)
    else:
        copy(x, training=True)
        written = list(copied.variables)
    return [np.asarray(v.numpy()) for v in copied.variables], [np.asarray(v.numpy()) for v in written]


def _layer_line(layer, model) -> tuple[str | None, int | None]:
    """The line of user code that made ``layer``: its class called with its name, else its class called."""
    files = _user_files()
    cls = re.escape(type(layer).__name__)
    name = re.escape(getattr(layer, "name", "") or "\0")
    for pattern in (rf"\b{cls}\(.*name\s*=\s*['\"]{name}['\"]", rf"\b{cls}\("):
        for filename in files:
            for lineno, line in enumerate(linecache.getlines(filename), start=1):
                if not line.lstrip().startswith("#") and re.search(pattern, line):
                    return filename, lineno
    return None, None


def _moving_diagnosis(model, moved, index, x, y=None, w=None) -> Diagnosis:
    """A non-trainable variable (a moving statistic) that the training forward pass made non-finite."""
    variable, value = moved[0]
    path = _variable_path(variable)
    dtype = tf.as_dtype(variable.dtype).name
    mask = nonfinite_mask(value)
    layer = _owner_layer(model, variable)
    kind = type(layer).__name__ if layer is not None else "a layer"
    summary = (f"{kind}'s training forward pass writes {int(mask.sum())} non-finite of {value.size} entries of "
               f"{path} ({dtype}), a non-trainable variable (a moving statistic)")
    remedy = verified = filename = lineno = None
    if layer is not None:
        filename, lineno = _layer_line(layer, model)
        where = f"at {os.path.basename(filename)}:{lineno}: " if filename else ""
        remedy = (f"{where}{type(layer).__name__}(..., dtype=\"float32\") for layer {layer.name!r}: its "
                  f"statistics and variables in float32")
        try:
            values, written = _float32_copy_run(model, layer, x, y, w)
            position = next(i for i, v in enumerate(layer.variables) if v is variable)
            wide = values[position]
            finite = all(np.all(np.isfinite(v)) for v in written if v.dtype.kind == "f")
            if dtype in ("float16", "bfloat16") and np.all(np.isfinite(wide[mask])):
                largest = float(np.max(np.abs(wide[mask])))
                limit = float(np.finfo(_np_dtype(variable.dtype)).max) if dtype != "bfloat16" else 3.39e38
                if largest > limit:
                    summary += (f"; in float32 it is finite, up to {largest:.3g}, beyond {dtype}'s largest "
                                f"{limit:.6g}: the statistic overflows when it is stored")
            verified = (f"verified: the failing step, run on a copy of the model with {layer.name!r} in "
                        f"float32, writes every one of its {len(written)} variables finite" if finite else
                        f"not verified: with {layer.name!r} in float32 a variable is still non-finite")
        except Exception as error:  # noqa: BLE001 - a model that cannot be copied: said, not raised
            verified = f"not verified: the model could not be copied with the layer in float32 ({type(error).__name__})"
    cause = CAUSES[CAUSE]
    return Diagnosis(
        batch=index, phase="update", op=None, forward_op=None, layer=_owner_path(model, variable),
        source=f"{filename}:{lineno}" if filename else None,
        variables=tuple(_variable_path(v) for v, _ in moved), dtype=dtype, inputs_summary=summary,
        cause=CAUSE, fix=cause.fix, section=cause.section, symptom="finite loss and gradients, non-finite update",
        code=source_text(filename, lineno), remedy=remedy, verified=verified,
    )


#: How IPython and ipykernel name a notebook cell's code (its source is kept in linecache).
_CELL = re.compile(r"^<ipython-input-\d+-[0-9a-f]+>$|ipykernel_\d+[/\\]\d+\.py$")


def _user_files() -> list[str]:
    """The user's files on the stack, then the notebook cells run so far, latest first (the
    optimizer or the layer may have been made in an earlier cell than the one that runs)."""
    files = []
    frame = inspect.currentframe()
    while frame is not None:
        name = frame.f_code.co_filename
        if (not is_library_file(name) and name not in files
                and (os.path.exists(name) or (_CELL.search(name) and linecache.getlines(name)))):
            files.append(name)
        frame = frame.f_back
    files += [name for name in reversed(list(linecache.cache)) if _CELL.search(name) and name not in files]
    return files


def own_step_update(model, x, y, w, index: int | None = None) -> Diagnosis | None:
    """For a model's own ``train_step``: the first optimizer ``apply`` of the step whose gradients
    are finite and whose update (on copies) is not, diagnosed; else None. The step runs eagerly
    once, every variable it may write put back afterwards."""
    applies = []

    def recording(optimizer, apply):
        def recorded(grads, trainable_variables=None):
            variables = list(trainable_variables if trainable_variables is not None else [])
            grads = list(grads)
            if variables and not applies:  # the first apply with a non-finite update is enough
                applies.append((optimizer, variables, [None if g is None else tf.identity(g) for g in grads],
                                [np.asarray(v.numpy()) for v in variables],
                                [np.asarray(v.numpy()) for v in optimizer.variables] if optimizer.built else None))
                if not _finite_gradients(grads) or not _writes_nonfinite(optimizer, variables, grads,
                                                                         applies[-1][3], applies[-1][4]):
                    applies.pop()
            return apply(grads, trainable_variables)
        return recorded

    optimizers = [o for o in optimizers_of(model) if not isinstance(o, keras.optimizers.LossScaleOptimizer)]
    saved = snapshot(step_variables(model))
    patched = []
    try:
        for optimizer in optimizers:
            patched.append((optimizer, "apply" in vars(optimizer), vars(optimizer).get("apply")))
            optimizer.apply = recording(optimizer, optimizer.apply)
        model.train_step(pack(x, y, w))
    finally:
        for optimizer, had, previous in patched:
            if had:
                optimizer.apply = previous
            else:
                try:
                    del optimizer.apply
                except AttributeError:
                    pass
        restore(saved)
    if not applies:
        return None
    optimizer, variables, grads, values, state = applies[0]
    return _update_diagnosis(model, optimizer, variables, grads, index, values, state, batch=(x, y, w))


def _compiled_check(model, loss_fn, optimizer):
    """``check(x, y, w) -> bool``: whether the step's loss and gradients are finite and its update
    (on copies of the variables and of the optimizer's state) or its forward pass writes a
    non-finite value; one ``tf.function``, the model's state put back by the caller."""
    variables = list(model.trainable_variables)
    if not optimizer.built:
        optimizer.build(variables)
    clone = type(optimizer).from_config(optimizer.get_config())
    copies = [keras.Variable(np.asarray(v.numpy()), dtype=v.dtype, trainable=True, name=v.name) for v in variables]
    clone.build(copies)
    if len(clone.variables) != len(optimizer.variables):
        return None
    state = list(model.non_trainable_variables)

    def finite(values) -> tf.Tensor:
        flags = [tf.reduce_all(tf.math.is_finite(tf.cast(v, tf.float32))) for v in values
                 if tf.as_dtype(v.dtype).is_floating]
        return tf.reduce_all(tf.stack(flags)) if flags else tf.constant(True)

    @tf.function(reduce_retracing=True)
    def check(x, y, w):
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            value = loss_fn(x, y, y_pred, w)
        grads = tape.gradient(value, variables)
        before = tf.logical_and(finite([value]), finite([g for g in grads if g is not None]))
        for copy, variable in zip(copies, variables):
            copy.assign(variable)
        for target, source in zip(clone.variables, optimizer.variables):
            target.assign(tf.cast(source, target.dtype))
        clone.apply_gradients([(g, c) for g, c in zip(grads, copies) if g is not None])
        after = tf.logical_and(finite([c.value for c in copies] + [v.value for v in clone.variables]),
                               finite([v.value for v in state]))
        return tf.logical_and(before, tf.logical_not(after))

    return check


def find_update(model, data, loss_fn, y, sample_weight, batch_size, max_batches, skip) -> Diagnosis | None:
    """The first batch whose update (not its loss or gradients) is non-finite, diagnosed; else None.

    Each batch's check is compiled (its loss, gradients and update on copies in one
    ``tf.function``); the batch it flags is diagnosed op by op (:func:`update_diagnosis`).
    """
    optimizer, _ = _optimizer(model)
    if loss_fn is None or optimizer is None:
        return None
    check = None
    for index, batch in scanned_batches(model, data, y, sample_weight, batch_size, max_batches, skip):
        x, y_true, weights = batch
        if check is None:
            try:
                check = _compiled_check(model, loss_fn, optimizer) or False
            except Exception:  # noqa: BLE001 - an optimizer that cannot be copied: each batch eagerly
                check = False
        if check:
            saved = model_state(model) + snapshot(random_states(model))
            try:
                flagged = bool(check(x, y_true, weights))
            except Exception:  # noqa: BLE001 - a step the check cannot trace: this batch eagerly
                flagged = True
            finally:
                restore(saved)
            if not flagged:
                continue
        state = variables_state(model)  # before the step, for Diagnosis.save
        found = update_diagnosis(model, loss_fn, x, y_true, weights, index)
        if found is not None:
            return keep_state(found, {"kind": "model", "batch": (x, y_true, weights), "variables": state,
                                      "own_step": False, "numpy_random": np.random.get_state()})
    return None
