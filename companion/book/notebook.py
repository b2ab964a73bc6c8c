"""One-call set-up for the book's chapters.

Every chapter starts with::

    from companion.book.notebook import setup
    setup(seed=0)

which makes the chapter's outputs reproducible (the test suite re-runs every chapter
under nbval and compares its outputs with the committed ones) and gives every figure the
same look.
"""

from __future__ import annotations

import os
import random
import sys
import threading

from companion._tables import HEADER_WIDTH, TABLE_STYLE, Table, html_table

# (HEADER_WIDTH and TABLE_STYLE, the tables' settings, are companion._tables'; importable here too.)
__all__ = ["BOOK_COLORS", "BOOK_STYLE", "PERTURB_ULP_ENV", "Table", "html_table", "setup"]

#: The environment variable that turns on :func:`setup`'s ``perturb_ulp`` ("1" on, "0" or
#: unset off): ``COMPANION_PERTURB_ULP=1 python -m pytest book`` re-runs every chapter
#: with every new variable one ulp away from its seeded value.
PERTURB_ULP_ENV = "COMPANION_PERTURB_ULP"

#: The matplotlib style of every figure in the book.
BOOK_STYLE: dict[str, object] = {
    "figure.figsize": (6.4, 3.6),
    "figure.dpi": 100,
    "savefig.dpi": 100,
    "figure.constrained_layout.use": True,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.titlesize": "medium",
    "axes.labelsize": "medium",
    "legend.fontsize": "small",
    "legend.frameon": False,
    "lines.linewidth": 1.6,
}
#: Colour cycle of the book (Okabe-Ito, colour-blind safe).
BOOK_COLORS = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000"]


def setup(seed: int = 0, *, deterministic: bool | None = None, perturb_ulp: bool | None = None) -> None:
    """Make a chapter reproducible and quiet, and set the book's plot style.

    It

    1. quiets TensorFlow's C++ logging (``TF_CPP_MIN_LOG_LEVEL=2``; this only takes
       effect if TensorFlow has not been imported yet, so call ``setup`` first) and
       Python-side TensorFlow warnings;
    2. seeds Python's :mod:`random`, NumPy and TensorFlow with ``seed``
       (:func:`keras.utils.set_random_seed`);
    3. enables op determinism (:func:`tf.config.experimental.enable_op_determinism`),
       so the same code on the same machine gives bit-identical results, unless a GPU
       is visible (see below);
    4. sets the matplotlib style :data:`BOOK_STYLE` and colours :data:`BOOK_COLORS`, if matplotlib is installed;
    5. with ``perturb_ulp``, moves every variable created from then on one ulp away from
       its initial value (below).

    **One ulp away.** A printed digit that a different order of summation would change
    (another CPU's vector width, another kernel) is a defect of the chapter: it passes
    here and fails on a reader's machine. ``perturb_ulp=True`` (or the environment
    variable ``COMPANION_PERTURB_ULP=1`` when ``perturb_ulp`` is ``None``) makes that
    class of defect visible on one machine: every floating-point ``tf.Variable`` created
    afterwards in this thread (every Keras weight, optimizer slot and metric, and every
    ``tf.Variable`` made from a computed value) starts with each finite, non-zero element moved to the
    neighbouring float, up or down at random (seeded by ``seed``, so the perturbed run is
    itself reproducible). Left as they are: exact zeros, infinities and NaNs; integer
    variables; a variable whose every element is a whole number (at most 2**24 in
    float32: Keras' ``ones`` and ``identity`` initialisers, a loss scale of 2**15), which
    every CPU computes exactly and a chapter may use to place a model on the point it
    studies (a random draw is never one); a variable made from a Python number or a list of them
    (``tf.Variable(1.0)``: what the author typed, the same on every CPU and often exactly
    the point a chapter studies; its initial value computed by TensorFlow or NumPy is
    moved); values restored from a checkpoint; and variables created under a
    ``tf.distribute`` strategy (whose replicas must stay equal). A one-ulp change is what a
    different rounding of the first sum does; a printed digit that survives it survives
    the reader's CPU. ``setup`` without it (the default) creates variables untouched. It
    uses the public ``tf.variable_creator_scope``; call ``setup`` outside any
    ``strategy.scope()``.

    **On a GPU.** Op determinism makes every op either run a deterministic kernel or
    raise ``UnimplementedError`` when it has none on the device (TensorFlow's
    documentation of ``enable_op_determinism``); which ops those are changes from one
    TensorFlow release to the next. The book's outputs are made and checked on a CPU
    and would differ in their last digits on a GPU anyway (other kernels), so there
    determinism buys a reader little and could stop a chapter halfway. By default
    (``deterministic=None``) ``setup`` therefore enables it only when TensorFlow sees
    no GPU: on a GPU runtime (e.g. Colab's) the chapters run with TensorFlow's default
    kernels, seeded but not bit-reproducible from run to run. ``deterministic=True``
    enables it on any device (an op without a deterministic GPU kernel then raises);
    ``deterministic=False`` leaves TensorFlow's setting as it is. Nothing in
    ``companion`` pins work to a device: on a GPU runtime the chapters' tensors live on
    the GPU as TensorFlow places them.

    Args:
        seed: a non-negative integer.
        deterministic: ``None`` (default): enable op determinism unless a GPU is visible;
            ``True``: enable it on any device; ``False``: do not enable it.
        perturb_ulp: ``None`` (default): as the environment variable
            ``COMPANION_PERTURB_ULP`` says ("1" on; unset, empty or "0" off);
            ``True``/``False``: on or off, whatever the environment says.

    Raises:
        TypeError: if ``seed`` is not an integer (``bool`` included), or
            ``deterministic`` or ``perturb_ulp`` is not ``None``, ``True`` or ``False``.
        ValueError: if ``seed`` is negative, or ``COMPANION_PERTURB_ULP`` is set to
            something other than "", "0" or "1".

    Example:
        >>> from companion.book.notebook import setup
        >>> setup(seed=0)

    Every chapter calls it first; the intro of the book says what it does on a GPU.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if deterministic is not None and not isinstance(deterministic, bool):
        kind = type(deterministic).__name__
        raise TypeError(f"deterministic must be None, True or False, got {kind} {deterministic!r}")
    if perturb_ulp is not None and not isinstance(perturb_ulp, bool):
        kind = type(perturb_ulp).__name__
        raise TypeError(f"perturb_ulp must be None, True or False, got {kind} {perturb_ulp!r}")
    if perturb_ulp is None:
        perturb_ulp = _perturb_ulp_from_environment()

    if "tensorflow" not in sys.modules:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    random.seed(seed)
    keras.utils.set_random_seed(seed)
    if deterministic is None:
        # Listing physical devices does not initialise TensorFlow's runtime, so a chapter
        # can still configure logical devices after setup().
        deterministic = not tf.config.list_physical_devices("GPU")
    if deterministic:
        tf.config.experimental.enable_op_determinism()
    _perturb_new_variables(seed if perturb_ulp else None)

    try:
        import matplotlib
    except ImportError:  # the package does not require matplotlib
        return
    from cycler import cycler

    style = dict(BOOK_STYLE)
    style["axes.prop_cycle"] = cycler(color=BOOK_COLORS)
    matplotlib.rcParams.update(style)


def _perturb_ulp_from_environment() -> bool:
    value = os.environ.get(PERTURB_ULP_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{PERTURB_ULP_ENV} must be unset, '0' or '1', got {value!r}")
    return value == "1"


# The perturbation: the seed of its random directions (None: off), how many variables it
# has moved (each variable's directions come from (seed, that count)), and the threads
# whose variable-creator stack holds the creator below (installed once per thread, on
# first use, and never removed: switching off only sets the seed to None).
_perturbation: dict[str, int | None] = {"seed": None, "count": 0}
_perturbing_threads: dict[int, object] = {}


def _one_ulp_away(value, seed: int, index: int, dtype=None):
    """``value`` with each finite non-zero element moved to a neighbouring float (a seeded random direction)."""
    import tensorflow as tf

    value = tf.convert_to_tensor(value, dtype=dtype)
    bits_dtype = {tf.float16: tf.int16, tf.bfloat16: tf.int16, tf.float32: tf.int32, tf.float64: tf.int64}.get(
        value.dtype
    )
    if bits_dtype is None:  # integers, booleans, complex numbers, strings: as they are
        return value
    # Whole numbers up to 2**digits (Keras' ``ones`` and ``identity``, a loss scale of
    # 2**15, a count) are exact on every CPU: any order of summation of them gives them
    # bit for bit, so a variable made only of them is left, as zeros are.
    digits = {tf.float16: 11, tf.bfloat16: 8, tf.float32: 24, tf.float64: 53}[value.dtype]
    whole = tf.reduce_all((tf.math.floor(value) == value) & (tf.abs(value) <= 2.0**digits))
    up = tf.random.stateless_uniform(tf.shape(value), seed=[seed, index]) < 0.5
    # The bits of a float, read as a signed integer, grow with its magnitude: +1 moves a
    # positive float up (towards +inf) and a negative one down.
    step = tf.where(tf.not_equal(up, value < 0), tf.ones([], bits_dtype), -tf.ones([], bits_dtype))
    bits = tf.bitcast(value, bits_dtype)
    moved = tf.bitcast(bits + step, value.dtype)
    moved = tf.where(tf.math.is_finite(moved), moved, tf.bitcast(bits - step, value.dtype))  # not past the largest
    return tf.where(tf.math.is_finite(value) & tf.not_equal(value, 0) & ~whole, moved, value)


def _is_typed_literal(value) -> bool:
    """Whether ``value`` is a Python number or a (nested) list or tuple of them.

    Such a value is what the author typed (``tf.Variable(1.5)``, ``tf.Variable([3.0, 4.0])``):
    the same on every CPU, often placed exactly on the point a chapter is about (b = 1,
    x = -50), so the perturbation leaves it. Values computed by TensorFlow or NumPy
    (initialisers, random draws, arrays) are what another CPU may round differently.
    """
    if isinstance(value, (bool, int, float)):
        return True
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(_is_typed_literal(v) for v in value)


def _perturbing_creator(next_creator, **kwargs):
    import tensorflow as tf

    from companion import _internal

    seed = _perturbation["seed"]
    initial = kwargs.get("initial_value")
    if (
        seed is None
        or initial is None
        or _is_typed_literal(initial)
        or tf.distribute.has_strategy()
        or _internal.is_checkpoint_restore(initial)
    ):
        return next_creator(**kwargs)
    index = _perturbation["count"]
    _perturbation["count"] = index + 1
    dtype = kwargs.get("dtype")
    if callable(initial):
        kwargs["initial_value"] = lambda: _one_ulp_away(initial(), seed, index, dtype)
    else:
        try:
            kwargs["initial_value"] = _one_ulp_away(initial, seed, index, dtype)
        except (TypeError, ValueError):  # not convertible to the dtype: tf.Variable says why
            pass
    return next_creator(**kwargs)


def _perturb_new_variables(seed: int | None) -> None:
    """Move every variable created from now on by one ulp (``seed``), or stop (``None``)."""
    _perturbation["seed"] = seed
    _perturbation["count"] = 0
    thread = threading.get_ident()
    if seed is not None and thread not in _perturbing_threads:
        import tensorflow as tf

        scope = tf.variable_creator_scope(_perturbing_creator)
        scope.__enter__()  # for the rest of the process: kept referenced so it is never closed
        _perturbing_threads[thread] = scope
