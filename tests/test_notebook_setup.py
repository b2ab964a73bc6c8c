"""companion.notebook.setup: reproducible chapters, one plot style."""

from __future__ import annotations

import random

import matplotlib
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework.config import (
    disable_op_determinism,
    enable_op_determinism,
    is_op_determinism_enabled,
)

from companion.notebook import BOOK_COLORS, setup


@pytest.fixture(autouse=True)
def _restore_global_state():
    """setup() changes process-wide state; later tests (e.g. Keras' jit_compile choice,
    which is off under op determinism) must not see it."""
    determinism = is_op_determinism_enabled()
    with matplotlib.rc_context():
        yield
    if determinism:
        enable_op_determinism()
    else:
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


def _pretend_a_gpu_is_visible(monkeypatch, visible: bool) -> None:
    real = tf.config.list_physical_devices
    gpu = tf.config.PhysicalDevice(name="/physical_device:GPU:0", device_type="GPU")

    def list_physical_devices(device_type=None):
        devices = [d for d in real(device_type) if d.device_type != "GPU"]
        if visible and device_type in (None, "GPU"):
            devices.append(gpu)
        return devices

    monkeypatch.setattr(tf.config, "list_physical_devices", list_physical_devices)


@pytest.mark.parametrize(
    ("gpu", "deterministic", "enabled"),
    [
        (False, None, True),  # a CPU runtime: the book's outputs, bit for bit
        (True, None, False),  # a GPU runtime: TensorFlow's default kernels, nothing raises
        (True, True, True),  # asked for: ops without a deterministic GPU kernel will raise
        (False, False, False),
        (True, False, False),
    ],
)
def test_setup_enables_op_determinism_unless_a_gpu_is_visible(monkeypatch, gpu, deterministic, enabled):
    _pretend_a_gpu_is_visible(monkeypatch, gpu)
    disable_op_determinism()
    setup(seed=0, deterministic=deterministic)
    assert is_op_determinism_enabled() is enabled
    first = _draws()
    setup(seed=0, deterministic=deterministic)
    assert _draws() == first  # seeded either way


def test_setup_rejects_a_deterministic_that_is_not_a_bool():
    with pytest.raises(TypeError, match="deterministic must be None, True or False, got str 'yes'"):
        setup(seed=0, deterministic="yes")


@pytest.mark.parametrize(("seed", "error"), [(1.5, TypeError), ("0", TypeError), (True, TypeError), (-1, ValueError)])
def test_setup_rejects_bad_seed(seed, error):
    with pytest.raises(error, match="seed"):
        setup(seed=seed)
