"""Canary of companion._internal.datasets: a tf.data pipeline's map functions are found."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from companion import _internal


def _scale(x, y):
    return x * 2.0, y


def _shift(x, y):
    return x + 1.0, y


def test_a_pipeline_lists_its_map_functions_and_their_inputs():
    source = tf.data.Dataset.from_tensor_slices((np.ones((6, 2), "float32"), np.zeros((6, 1), "float32")))
    dataset = source.shuffle(6).map(_scale).batch(3).map(_shift, num_parallel_calls=2).prefetch(1)
    stages = _internal.dataset_map_stages(dataset)
    assert [function for _, function, _ in stages] == [_scale, _shift]
    assert [name for _, _, name in stages] == ["_MapDataset", "_ParallelMapDataset"]
    first_input, second_input = stages[0][0], stages[1][0]
    assert first_input.element_spec[0].shape.as_list() == [2]  # elements before the batch
    assert second_input.element_spec[0].shape.as_list() == [None, 2]  # batches
    x, _ = next(iter(second_input))
    assert np.array_equal(_shift(x, None)[0].numpy(), np.full((3, 2), 3.0, "float32"))
    assert _internal.dataset_map_stages(source) == []
