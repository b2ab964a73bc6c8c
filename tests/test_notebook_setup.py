"""companion.notebook.setup: reproducible chapters, one plot style."""

from __future__ import annotations

import random

import matplotlib
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework.config import disable_op_determinism, is_op_determinism_enabled

from companion.notebook import BOOK_COLORS, setup


@pytest.fixture(autouse=True)
def _restore_global_state():
    """setup() changes process-wide state; later tests (e.g. Keras' jit_compile choice,
    which is off under op determinism) must not see it."""
    determinism = is_op_determinism_enabled()
    with matplotlib.rc_context():
        yield
    if not determinism:
        disable_op_determinism()


def _draws():
    return (random.random(), np.random.rand(), float(tf.random.uniform([])))


def test_setup_makes_python_numpy_and_tensorflow_draws_repeatable():
    setup(seed=3)
    first = _draws()
    setup(seed=3)
    assert _draws() == first
    setup(seed=4)
    assert _draws() != first


def test_setup_enables_op_determinism_and_book_style():
    setup(seed=0)
    assert is_op_determinism_enabled()
    assert matplotlib.rcParams["axes.grid"] is True
    colors = [c["color"] for c in matplotlib.rcParams["axes.prop_cycle"]]
    assert colors == BOOK_COLORS


@pytest.mark.parametrize(("seed", "error"), [(1.5, TypeError), ("0", TypeError), (True, TypeError), (-1, ValueError)])
def test_setup_rejects_bad_seed(seed, error):
    with pytest.raises(error, match="seed"):
        setup(seed=seed)
