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


def test_html_table_renders_a_header_and_formatted_cells():
    from companion.notebook import html_table

    table = html_table(
        [["tf.pow", float("nan"), True, np.int64(3)], ["safe_pow", np.float32(0.125), False, 0]],
        ["power", "d/dx", "finite", "count"],
        caption="at x = 0",
        float_format=".2f",
    )
    page = table._repr_html_()
    assert page.count("<tr>") == 3 and page.count("<th>") == 4
    assert "<caption>at x = 0</caption>" in page
    assert '<td style="text-align: right">0.12</td>' in page  # float32 formatted, right-aligned
    assert '<td style="text-align: right">nan</td>' in page
    assert "<td>tf.pow</td>" in page
    assert table.rows == (("tf.pow", "nan", "True", "3"), ("safe_pow", "0.12", "False", "0"))
    assert repr(table).splitlines()[1].split()[0] == "power"


def test_html_table_escapes_text():
    from companion.notebook import html_table

    page = html_table([["a < b & c"]], ["<x>"])._repr_html_()
    assert "<th>&lt;x&gt;</th>" in page and "<td>a &lt; b &amp; c</td>" in page


@pytest.mark.parametrize(
    ("rows", "header", "error", "match"),
    [
        ("abc", None, TypeError, "sequence of rows"),
        ([1, 2], None, TypeError, "row 0"),
        ([[1, 2], [3]], None, ValueError, "same number of cells"),
        ([[1, 2]], ["a"], ValueError, "header has 1 names"),
    ],
)
def test_html_table_rejects_ragged_or_non_tabular_input(rows, header, error, match):
    from companion.notebook import html_table

    with pytest.raises(error, match=match):
        html_table(rows, header)
