"""One-call set-up for the book's chapters.

Every chapter starts with::

    from companion.notebook import setup
    setup(seed=0)

which makes the chapter's outputs reproducible (the test suite re-runs every chapter
under nbval and compares its outputs with the committed ones) and gives every figure the
same look.
"""

from __future__ import annotations

import os
import random
import sys

__all__ = ["BOOK_COLORS", "BOOK_STYLE", "setup"]

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


def setup(seed: int = 0, *, deterministic: bool | None = None) -> None:
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
    4. sets the matplotlib style :data:`BOOK_STYLE` and colours :data:`BOOK_COLORS`, if matplotlib is installed.

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

    Raises:
        TypeError: if ``seed`` is not an integer (``bool`` included), or
            ``deterministic`` is not ``None``, ``True`` or ``False``.
        ValueError: if ``seed`` is negative.

    Example:
        >>> from companion.notebook import setup
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

    try:
        import matplotlib
    except ImportError:  # the package does not require matplotlib
        return
    from cycler import cycler

    style = dict(BOOK_STYLE)
    style["axes.prop_cycle"] = cycler(color=BOOK_COLORS)
    matplotlib.rcParams.update(style)
