"""Where an input pipeline made a NaN: the map function's op and line.

A NaN or Inf that is already in a batch (``nonfinite_input``) was either in the data
or made by the pipeline: the log of a silent audio clip, a 0/0 normalisation of a
constant image, inside a ``dataset.map``. :func:`locate` walks a ``tf.data`` pipeline's
maps from the source on (:func:`companion._internal.dataset_map_stages`: several maps,
``batch`` before or after a map, ``shuffle``, ``prefetch``), re-runs each map's Python
function eagerly on the elements that map reads, and at the first element whose
values are finite but whose mapped values are not, re-runs the function op by op
(:class:`~companion.diagnostics.trace.OpTracer`): the first op that made a non-finite
value, its line in the user's function (inside a ``tf.py_function`` too, where that
function's ops are TensorFlow's), and what its inputs were. Where the line spells the
op (``tf.math.log(x)``, ``x / std``), the remedy is the clamp written on that line
(:func:`~companion.diagnostics.rewrites.choice`), checked by calling the map function
again with it on every element found: its values are then finite, or not.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from companion import _internal
from companion.diagnostics.causes import classify
from companion.diagnostics.diagnosis import replace
from companion.diagnostics.rewrites import _patched, choice
from companion.diagnostics.sources import source_text
from companion.diagnostics.trace import OpEvent, OpTracer, eager_trace, nonfinite_mask

__all__ = ["PipelineFinding", "locate"]

#: The most elements of one map's input the doctor re-runs that map on.
MAX_ELEMENTS = 4096
#: The most seconds the search of a pipeline may take.
MAX_SECONDS = 60.0
#: Elements made non-finite that are kept to check a remedy on.
KEPT = 16


@dataclasses.dataclass(frozen=True)
class PipelineFinding:
    """A map of a pipeline that made non-finite values from finite ones.

    Attributes:
        function: the user's map function.
        number: its position among the pipeline's maps (1 for the one nearest the source).
        count: how many maps the pipeline has.
        searched: how many of that map's input elements were re-run.
        elements: the input elements whose mapped values are not finite (at most ``KEPT``).
        event: the first op of the op-by-op re-run on the first of them that made a
            non-finite value, or ``None`` if the tracer saw none.
    """

    function: Callable
    number: int
    count: int
    searched: int
    elements: tuple
    event: OpEvent | None


def _leaves_finite(structure) -> bool:
    for leaf in tf.nest.flatten(structure):
        dtype = getattr(leaf, "dtype", None)
        if dtype is None:
            array = np.asarray(leaf)
            if array.dtype.kind not in "fc":
                continue
        elif not (tf.as_dtype(dtype).is_floating or tf.as_dtype(dtype).is_complex):
            continue
        array = np.asarray(leaf.numpy() if hasattr(leaf, "numpy") else leaf)
        if array.size and nonfinite_mask(array).any():
            return False
    return True


def _call(function: Callable, element):
    """The map function on one element, as ``dataset.map`` calls it (a tuple is unpacked)."""
    return function(*element) if isinstance(element, tuple) else function(element)


def _trace(function: Callable, element) -> OpEvent | None:
    """The first op that made a non-finite value when ``function`` runs on ``element`` op by op."""
    tracer = OpTracer(max_events=8)  # run to the end: a stop inside a py_function logs its traceback
    tf_filtering = tf.debugging.is_traceback_filtering_enabled()
    try:
        tf.debugging.disable_traceback_filtering()
        with eager_trace(tracer):
            try:
                _call(function, element)
            except Exception:  # noqa: BLE001 - a function that fails eagerly: what the tracer saw so far
                pass
    finally:
        if tf_filtering:
            tf.debugging.enable_traceback_filtering()
    return tracer.events[0] if tracer.events else None


def find(dataset: tf.data.Dataset, *, max_elements: int = MAX_ELEMENTS,
         max_seconds: float = MAX_SECONDS) -> PipelineFinding | None:
    """The first map of ``dataset`` (from the source on) that makes non-finite values from finite ones."""
    stages = _internal.dataset_map_stages(dataset)
    deadline = time.monotonic() + max_seconds
    for number, (source, function, _) in enumerate(stages, start=1):
        bad, searched = [], 0
        try:
            for element in source:
                if searched >= max_elements or time.monotonic() > deadline or len(bad) >= KEPT:
                    break
                searched += 1
                if not _leaves_finite(element):
                    continue  # non-finite before this map: an earlier map's, or the data's
                if not _leaves_finite(_call(function, element)):
                    bad.append(element)
        except Exception:  # noqa: BLE001 - a function that does not run eagerly: this map is not searched
            continue
        if bad:
            return PipelineFinding(function, number, len(stages), searched, tuple(bad), _trace(function, bad[0]))
    return None


def _name(function: Callable) -> str:
    return getattr(function, "__qualname__", None) or getattr(function, "__name__", None) or repr(function)


def locate(diagnosis: Any, dataset: Any) -> Any:
    """``diagnosis`` (a ``nonfinite_input``) with the op and line of the map that made the NaN, where one did.

    The diagnosis keeps its cause and phase; it gains ``op``, ``source`` and ``code``
    (the line of the map function), the op's inputs in ``inputs_summary``, and where
    the line spells the op, the clamp on that line as ``remedy``, with ``verified``
    saying whether the map function's values on the elements found are then finite.
    Returns ``diagnosis`` unchanged if ``dataset`` is not a ``tf.data.Dataset`` or no
    map made a non-finite value from finite ones (the NaN was in the data itself).
    """
    if diagnosis is None or diagnosis.cause != "nonfinite_input" or not isinstance(dataset, tf.data.Dataset):
        return diagnosis
    try:
        found = find(dataset)
    except Exception:  # noqa: BLE001 - the doctor's own failure never hides the diagnosis it has
        return diagnosis
    if found is None:
        return diagnosis
    stage = f"map {found.number} of {found.count}" if found.count > 1 else "map"
    where = f"the input pipeline's {stage}, {_name(found.function)}"
    many = len(found.elements) > 1
    share = (f"{len(found.elements)}{'+' if len(found.elements) >= KEPT else ''} of the {found.searched} "
             f"elements it read {'are' if many else 'is'} finite before it and not after it")
    event = found.event
    if event is None:  # made where the tracer cannot see (NumPy in a numpy_function)
        summary = f"{diagnosis.inputs_summary}; made non-finite in {where}: {share}"
        return replace(diagnosis, inputs_summary=summary)
    record = event.record
    cause, facts = classify(event)
    source = f"{record.filename}:{record.lineno}" if record.filename else None
    summary = (f"{diagnosis.inputs_summary}; made non-finite by {record.op_type} in {where}: {share}"
               f"{' (' + facts + ')' if facts else ''}")
    located = replace(diagnosis, op=record.op_type, source=source, code=source_text(record.filename, record.lineno),
                      inputs_summary=summary)
    return _remedy(located, cause, found)


def _remedy(d, cause: str, found: PipelineFinding):
    """The clamp on the map function's line, checked on the elements it made non-finite."""
    if not d.source or not d.code:
        return d
    probe = replace(d, cause=cause, dtype=d.dtype, remedy=None, verified=None)
    remedy, clamp = choice(probe)
    if remedy is None:
        return d
    remedy = remedy.replace(" (or the loss from logits, from_logits=True)", "")
    if clamp is None:
        return replace(d, remedy=remedy, verified=None)
    filename, _, number = d.source.rpartition(":")
    with _patched(clamp, filename, int(number), d.code) as applied:
        try:
            finite = all(_leaves_finite(_call(found.function, element)) for element in found.elements)
        except Exception as error:  # noqa: BLE001 - said, not raised
            return replace(d, remedy=remedy, verified=f"not verified: the map function raised with the remedy "
                                                      f"({type(error).__name__})")
    if not applied:
        return replace(d, remedy=remedy, verified=None)
    at = f"{os.path.basename(filename)}:{number}"
    count = f"{len(found.elements)} element{'s' if len(found.elements) > 1 else ''}"
    verdict = (f"verified: the map function's values are finite with {clamp.what} at {at} on the {count} it made "
               "non-finite" if finite else
               f"not verified: the map function's values are still non-finite with {clamp.what} at {at}")
    return replace(d, remedy=remedy, verified=verdict)
