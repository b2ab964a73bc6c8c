"""companion.book.notebook.setup: reproducible chapters, one plot style."""

from __future__ import annotations

import random

import matplotlib
import numpy as np
import pytest
import keras
import tensorflow as tf
from tensorflow.python.framework.config import (
    disable_op_determinism,
    enable_op_determinism,
    is_op_determinism_enabled,
)

from companion.book import notebook
from companion.book.notebook import BOOK_COLORS, PERTURB_ULP_ENV, setup


@pytest.fixture(autouse=True)
def _restore_global_state():
    """setup() changes process-wide state; later tests (e.g. Keras' jit_compile choice,
    which is off under op determinism) must not see it."""
    determinism = is_op_determinism_enabled()
    with matplotlib.rc_context():
        yield
    notebook._perturb_new_variables(None)
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


def _cells(page: str, tag: str) -> list[tuple[str, str]]:
    """(style, text) of every <tag> of a table's HTML."""
    import re

    return re.findall(rf'<{tag} style="([^"]*)">(.*?)</{tag}>', page)


def test_html_table_renders_a_header_and_formatted_cells():
    from companion.book.notebook import html_table

    table = html_table(
        [["tf.pow", float("nan"), True, np.int64(3)], ["safe_pow", np.float32(0.125), False, 0]],
        ["power", "d/dx", "finite", "count"],
        caption="at x = 0",
        float_format=".2f",
    )
    page = table._repr_html_()
    assert page.count("<tr>") == 3 and len(_cells(page, "th")) == 4 and len(_cells(page, "td")) == 8
    assert ">at x = 0</caption>" in page
    texts = [text for _, text in _cells(page, "td")]
    assert texts == ["tf.pow", "nan", "True", "3", "safe_pow", "0.12", "False", "0"]  # float32 formatted
    assert table.rows == (("tf.pow", "nan", "True", "3"), ("safe_pow", "0.12", "False", "0"))
    assert repr(table).splitlines()[1].split()[0] == "power"


def test_html_table_has_the_book_style_inline():
    # Inline, so that Jupyter and Colab (which have no book CSS) show the same table.
    from companion.book.notebook import html_table

    page = html_table([["safe_pow", -1.38e-11, -1.38e-11], ["tf.pow", 2.0, float("inf")]],
                      ["power", "value at x = 0", "d/dx"])._repr_html_()
    assert 'style="overflow-x: auto' in page.split("<table")[0]  # a wide table scrolls by itself, not the page
    table_style = page.split('<table class="companion-table" style="', 1)[1].split('"', 1)[0]
    assert "border-collapse: collapse" in table_style and "tabular-nums" in table_style
    assert "border-top: 2px solid" in table_style and "border-bottom: 2px solid" in table_style  # rules
    for style, text in _cells(page, "td"):
        assert "padding: 0.25em 0.75em" in style, text  # cells never run together
        numeric = text not in ("safe_pow", "tf.pow")
        assert ("text-align: right; white-space: nowrap" in style) is numeric, text
        assert ("text-align: left" in style) is (not numeric), text
    header = _cells(page, "th")
    assert [("text-align: right" in style) for style, _ in header] == [False, True, True]  # as their columns
    assert all("border-bottom: 1px solid" in style for style, _ in header)


@pytest.mark.parametrize("name", ["share of points attending most to themselves", "first non-finite step (power law)",
                                  "series, |x| < x* (ulp)", "d/dx at x = -2", "b", "loss"])
def test_long_column_names_break_into_a_few_balanced_lines_never_a_word_a_line(name):
    import html
    import math

    from companion._tables import _header_html

    lines = [html.unescape(line) for line in _header_html(name).split(" ")]  # breaks only at plain spaces
    assert " ".join(line.replace("\xa0", " ") for line in lines) == name
    assert len(lines) == max(1, math.ceil(len(name) / 20)) if len(name) > 20 else lines == [name.replace(" ", "\xa0")]
    never_a_word_a_line = len(lines) == 1 or any(" " in line or "\xa0" in line for line in lines)
    assert all(len(line) <= 20 for line in lines) and never_a_word_a_line


@pytest.mark.parametrize(("name", "longest_line", "lines"), [
    ("value at x = 0", 10, ["value at", "x = 0"]),  # the relation keeps x = 0 whole
    ("fit at x = 0 (d = 1)", 10, ["fit at x = 0", "(d = 1)"]),
    ("every exponent above 1 after step 0", 12, ["every exponent", "above 1", "after step 0"]),
    ("rows with one > 0.99, unscaled", 12, ["rows with", "one > 0.99,", "unscaled"]),
])
def test_column_names_break_where_the_longest_line_is_shortest_and_never_inside_a_relation(
        name, longest_line, lines):
    from companion._tables import _header_lines

    assert _header_lines(name, longest_line) == lines


def test_a_table_of_many_columns_breaks_its_names_into_shorter_lines():
    # Eleven columns of "d/dx at x = -2" would be 11 x 14 characters wide on one line each:
    # wider than the book's text column (tests/book/test_browser.py measures the page).
    import html
    import re

    from companion.book.notebook import HEADER_WIDTH, html_table

    names = ["power", "b"] + [f"{what} at x = {x}" for what in ("value", "d/dx", "d/db") for x in (-2, 0, 2)]
    page = html_table([["safe_pow", 0.5] + [0.0] * 9], names)._repr_html_()
    headers = [html.unescape(text) for _, text in _cells(page, "th")]
    assert [h.replace("\xa0", " ") for h in headers] == names
    lines = [line for h in headers for line in re.split(" ", h)]
    assert max(len(line) for line in lines) <= max(10, HEADER_WIDTH // len(names)) < 14
    assert "d/dx\xa0at x\xa0=\xa0-2" in headers  # "d/dx at" over "x = -2"
    few = html_table([[1.0, 2.0]], ["d/dx at x = -2", "b"])._repr_html_()
    assert "d/dx&nbsp;at&nbsp;x&nbsp;=&nbsp;-2</th>" in few  # two columns: one line


def test_html_table_escapes_text():
    from companion.book.notebook import html_table

    page = html_table([["a < b & c"]], ["<x>"])._repr_html_()
    assert ">&lt;x&gt;</th>" in page and ">a &lt; b &amp; c</td>" in page


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
    from companion.book.notebook import html_table

    with pytest.raises(error, match=match):
        html_table(rows, header)


# --- perturb_ulp: every new variable one ulp away ----------------------------------------


def _fresh_variables() -> dict[str, np.ndarray]:
    """The variables of a Dense, an Embedding, a seeded tf.Variable and an optimizer, as created now."""
    import keras

    dense = keras.layers.Dense(8)
    dense.build((None, 16))
    embedding = keras.layers.Embedding(50, 4)
    embedding.build((None,))
    optimizer = keras.optimizers.Adam(learning_rate=1e-3)
    optimizer.build(dense.trainable_variables)
    return {
        "dense kernel": dense.kernel.numpy(),
        "dense bias": dense.bias.numpy(),
        "embeddings": embedding.embeddings.numpy(),
        "tf.Variable": tf.Variable(tf.random.normal([64])).numpy(),
        "tf.Variable(callable)": tf.Variable(lambda: tf.fill([3], 1.5)).numpy(),
        "tf.Variable(numpy)": tf.Variable(np.linspace(0.5, 2.0, 7, dtype=np.float32)).numpy(),
        "learning rate": np.asarray(optimizer.learning_rate.numpy()),
    }


def _one_ulp_apart(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (b == np.nextafter(a, np.inf)) | (b == np.nextafter(a, -np.inf))


@pytest.fixture
def no_perturb_env(monkeypatch):
    monkeypatch.delenv(PERTURB_ULP_ENV, raising=False)


def test_perturb_ulp_moves_every_variable_by_exactly_one_ulp(no_perturb_env):
    setup(seed=0)
    seeded = _fresh_variables()
    setup(seed=0, perturb_ulp=True)
    perturbed = _fresh_variables()
    # Keras before 3.13 (the oldest stack's 3.5) makes the learning-rate variable from the
    # float the user typed, which the switch leaves exact by design; 3.13 and newer make it
    # from a computed tensor, which moves.
    keras_version = tuple(int(part) for part in keras.__version__.split(".")[:2])
    if keras_version < (3, 13):
        assert (perturbed.pop("learning rate") == seeded.pop("learning rate")).all()
    for name, value in seeded.items():
        moved = perturbed[name]
        assert moved.dtype == value.dtype and moved.shape == value.shape, name
        nonzero = value != 0
        assert _one_ulp_apart(value[nonzero], moved[nonzero]).all(), f"{name}: not one ulp away"
        assert (moved[~nonzero] == 0).all(), f"{name}: an exact zero moved"
    assert (seeded["dense bias"] == 0).all()  # zeros-initialised, and left so
    kernel_up = perturbed["dense kernel"] > seeded["dense kernel"]
    assert 0.3 < kernel_up.mean() < 0.7, "the directions are not a random mix of up and down"


def test_perturb_ulp_leaves_variables_of_whole_numbers(no_perturb_env):
    # Keras' ones and identity initialisers and the loss scale of 2**15 are exact on every
    # CPU; a chapter places a model on the point it studies with them.
    setup(seed=0, perturb_ulp=True)
    ones = keras.layers.Dense(3, kernel_initializer="ones")
    ones.build((None, 2))
    identity = keras.layers.Dense(3, kernel_initializer="identity")
    identity.build((None, 3))
    scaler = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    scaler.build([tf.Variable([1.0, 2.0])])
    assert (ones.kernel.numpy() == 1).all()
    np.testing.assert_array_equal(identity.kernel.numpy(), np.eye(3, dtype=np.float32))
    assert float(scaler.dynamic_scale) == 2.0**15
    assert (tf.Variable(tf.fill([4], 2.0**24), dtype=tf.float32).numpy() == 2.0**24).all()
    for dtype in (tf.float16, tf.float64):
        assert (tf.Variable(tf.ones([4], dtype)).numpy() == 1).all(), dtype
    # Not whole, or beyond where every whole number is a float: every non-zero element moves.
    for value in ([1.0, 2.5, 0.0], [2.0**25, 2.0**25, 0.0]):
        moved = tf.Variable(tf.constant(value)).numpy()
        typed = np.asarray(value, np.float32)
        assert _one_ulp_apart(typed[:2], moved[:2]).all() and moved[2] == 0, value
    single = keras.layers.Dense(1, use_bias=False)  # a random draw of one element moves
    single.build((None, 1))
    setup(seed=0)
    seeded = keras.layers.Dense(1, use_bias=False)
    seeded.build((None, 1))
    assert _one_ulp_apart(seeded.kernel.numpy(), single.kernel.numpy()).all()


def test_without_perturb_ulp_variables_are_exactly_as_seeded(no_perturb_env):
    setup(seed=0)
    before = _fresh_variables()
    setup(seed=0, perturb_ulp=True)
    _fresh_variables()
    setup(seed=0)  # the environment says nothing: off again
    after = _fresh_variables()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)


def test_the_perturbed_run_is_itself_reproducible(no_perturb_env):
    setup(seed=0, perturb_ulp=True)
    first = _fresh_variables()
    setup(seed=0, perturb_ulp=True)
    second = _fresh_variables()
    for name in first:
        np.testing.assert_array_equal(second[name], first[name], err_msg=name)
    setup(seed=1, perturb_ulp=True)
    other_seed = tf.Variable(tf.fill([256], 1.5)).numpy()
    setup(seed=0, perturb_ulp=True)
    assert (tf.Variable(tf.fill([256], 1.5)).numpy() != other_seed).any()


@pytest.mark.parametrize(("value", "switch", "perturbed"), [("1", None, True), ("0", None, False), ("", None, False),
                                                            ("1", False, False), ("0", True, True)])
def test_the_environment_variable_turns_it_on_unless_the_argument_says(monkeypatch, value, switch, perturbed):
    monkeypatch.setenv(PERTURB_ULP_ENV, value)
    setup(seed=0, perturb_ulp=switch)
    moved = float(tf.Variable(tf.constant(1.5)).numpy()) != 1.5
    assert moved is perturbed


def test_a_value_the_author_typed_is_not_moved(no_perturb_env):
    # tf.Variable(1.0) or ([3.0, 4.0]) is the same on every CPU, and often the very point a
    # chapter studies (b = 1, where x^b turns NaN below); what TensorFlow computes is moved.
    setup(seed=0, perturb_ulp=True)
    assert float(tf.Variable(1.0).numpy()) == 1.0 and float(tf.Variable(-50.0).numpy()) == -50.0
    assert tf.Variable([3.0, 4.0]).numpy().tolist() == [3.0, 4.0]
    assert tf.Variable([[0.5], [2.0]]).numpy().tolist() == [[0.5], [2.0]]
    assert float(tf.Variable(tf.constant(1.5)).numpy()) != 1.5
    assert float(tf.Variable(np.float32(1.5)).numpy()) != 1.5


def test_a_bad_environment_value_or_argument_is_rejected(monkeypatch):
    monkeypatch.setenv(PERTURB_ULP_ENV, "yes")
    with pytest.raises(ValueError, match="COMPANION_PERTURB_ULP must be unset, '0' or '1', got 'yes'"):
        setup(seed=0)
    with pytest.raises(TypeError, match="perturb_ulp must be None, True or False, got int 1"):
        setup(seed=0, perturb_ulp=1)


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16, tf.float32, tf.float64])
def test_every_float_dtype_moves_to_a_neighbouring_float_and_special_values_stay(no_perturb_env, dtype):
    bits = {tf.float16: tf.int16, tf.bfloat16: tf.int16, tf.float32: tf.int32, tf.float64: tf.int64}[dtype]
    big = float(tf.as_dtype(dtype).max)
    values = tf.constant([1.0, -1.0, 0.5, -3.25, 1e-3, big, -big, 0.0, -0.0, np.inf, -np.inf, np.nan], dtype)
    setup(seed=0, perturb_ulp=True)
    moved = tf.Variable(values).read_value()
    step = (tf.bitcast(moved, bits) - tf.bitcast(values, bits)).numpy()
    finite = 7  # the first seven are finite and non-zero: each went to the next float up or down
    assert set(np.abs(step[:finite]).tolist()) == {1}, step
    assert np.isfinite(tf.cast(moved, tf.float64).numpy()[:finite]).all()  # not past the largest float
    assert (step[finite:] == 0).all(), "a zero, an infinity or a NaN moved"
    assert tf.Variable(tf.constant(7)).numpy() == 7 and tf.Variable(tf.constant([True])).numpy().all()  # as they are


def test_variables_under_a_strategy_and_restored_values_are_not_moved(no_perturb_env, tmp_path):
    setup(seed=0, perturb_ulp=True)
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        assert float(tf.Variable(tf.constant(1.0)).numpy()) == 1.0
    saved = tf.Variable(tf.constant([0.1, 0.2, 0.3]))
    path = tf.train.Checkpoint(v=saved).save(str(tmp_path / "ckpt"))
    fresh = tf.Variable(tf.constant([0.5, 0.5, 0.5]))
    tf.train.Checkpoint(v=fresh).restore(path).assert_consumed()
    np.testing.assert_array_equal(fresh.numpy(), saved.numpy())  # bit for bit, the checkpoint's value
