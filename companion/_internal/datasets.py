"""Private TensorFlow APIs, one family: the transformations of a ``tf.data`` pipeline.

Each hook says what it relies on and what happens when it is gone, and is registered
(:func:`companion._internal.registry.hook`) with its canary tests.
"""

from __future__ import annotations

from typing import Any, Callable

from companion._internal.registry import hook, warn_once

# --------------------------------------------------------------------------------------
# The map functions of a tf.data pipeline (the NaN doctor names the line that made a NaN)
# --------------------------------------------------------------------------------------
# Relies on: a ``tf.data.Dataset`` listing the datasets it reads from with ``_inputs()``
# (``[]`` for a source), a map (``_MapDataset``, ``_ParallelMapDataset``) keeping the
# ``StructuredFunctionWrapper`` of its function as ``_map_func``, and that wrapper keeping
# the user's Python function as ``_func`` (before autograph converts it).
# Why: a NaN made by the input pipeline (the log of a clipped value, a 0/0 normalisation
# inside ``dataset.map``) is only in the batch; the line that made it is in the user's map
# function, which the doctor re-runs eagerly, op by op, on the elements that map reads.
# If gone: no map function is found; the doctor names the batch's non-finite rows
# without the pipeline's line, with a warning.

#: Dataset classes whose function maps one element to one element (what the doctor re-runs).
MAP_DATASETS = ("_MapDataset", "_ParallelMapDataset", "MapDataset", "ParallelMapDataset")


@hook("tests/contracts/test_tf_internals_datasets.py::test_a_pipeline_lists_its_map_functions_and_their_inputs")
def dataset_map_stages(dataset: Any) -> list[tuple[Any, Callable, str]]:
    """``(input dataset, the user's function, class name)`` for each map of a pipeline, source first."""
    stages: list[tuple[Any, Callable, str]] = []
    if not callable(getattr(dataset, "_inputs", None)):
        warn_once("dataset_inputs", "tf.data.Dataset has no _inputs(): the NaN doctor cannot find a pipeline's "
                  "map functions and names no line of it")
        return stages
    pending, seen = [dataset], set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        try:
            inputs = list(current._inputs())
        except Exception:  # noqa: BLE001 - a dataset class that cannot list them: its inputs are not searched
            inputs = []
        name = type(current).__name__
        if name in MAP_DATASETS:
            wrapper = getattr(current, "_map_func", None)
            function = getattr(wrapper, "_func", None)
            source = getattr(current, "_input_dataset", None) or (inputs[0] if inputs else None)
            if callable(function) and source is not None:
                stages.append((source, function, name))
            else:
                warn_once("map_func", f"a {name} keeps no _map_func._func: the NaN doctor cannot re-run its "
                          "function and names no line of it")
        pending.extend(inputs)
    stages.reverse()  # found from the last transformation back: the source's first
    return stages
