"""companion.book.targets: the families of target functions g(x) that ParameterNet fits."""

from __future__ import annotations

import numpy as np
import pytest

from companion.book import targets



@pytest.mark.parametrize("family", sorted(targets.FAMILIES))
def test_target_batches_are_deterministic_and_include_their_point(family):
    spec = targets.FAMILIES[family]
    xs, ys, parameters = targets.sample(family, 5, 12, seed=7, return_parameters=True)
    again_xs, again_ys = targets.sample(family, 5, 12, seed=7)
    np.testing.assert_array_equal(xs, again_xs)
    np.testing.assert_array_equal(ys, again_ys)
    assert xs.shape == ys.shape == (5, 12, 1) and xs.dtype == ys.dtype == np.float32
    low, high = spec.domain
    assert np.all((xs >= low) & (xs <= high)) and np.all(np.diff(xs[..., 0], axis=1) >= 0)
    assert np.all(np.any(xs[..., 0] == spec.include, axis=1))
    assert np.all(np.isfinite(ys))
    expected = targets.evaluate(family, xs[..., 0], **{k: v[:, None] for k, v in parameters.items()})
    np.testing.assert_allclose(ys[..., 0], expected, rtol=1e-6)
    assert (low < 0) == spec.negative_inputs
    assert not np.array_equal(targets.sample(family, 5, 12, seed=8)[1], ys)


def test_target_dataset_yields_inputs_and_targets():
    data = targets.dataset("power_law", batches=3, batch_size=4, n=10, seed=1)
    assert int(data.cardinality()) == 3
    (xs, ys), y_true = next(iter(data))
    assert xs.shape == (4, 10, 1)
    np.testing.assert_array_equal(ys.numpy(), y_true.numpy())
    first = [b[1].numpy() for b in data]
    np.testing.assert_array_equal(first, [b[1].numpy() for b in data])  # same batches each epoch


def test_target_errors_list_the_families():
    with pytest.raises(ValueError, match="unknown target family 'cube'; valid names: inverse_sqrt, power_law"):
        targets.sample("cube", 2)
    with pytest.raises(ValueError, match="n must be >= 2"):
        targets.sample("sqrt", 2, n=1)
    with pytest.raises(ValueError, match="takes parameters"):
        targets.evaluate("sqrt", [1.0], b=2.0)
