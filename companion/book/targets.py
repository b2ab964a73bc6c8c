"""The families of target functions g(x) that the case-A chapters fit with ParameterNet.

Each family draws random functions, for example ``g(x) = a x^b`` with ``a`` and ``b``
uniform in given ranges, and samples each one at ``n`` points. A batch is a pair of
float32 arrays ``(xs, ys)`` of shape ``(batch, n, 1)``, the input ParameterNet reads;
:func:`dataset` wraps batches as a ``tf.data.Dataset`` of ``((xs, ys), ys)``, the
``(inputs, targets)`` pairs a training loop expects. Everything is deterministic given
``seed``.

The families are chosen to hit the places where case A's powers fail:

=================  ==============================  ============  =====================================
name               g(x)                            x             what it exercises
=================  ==============================  ============  =====================================
``power_law``      ``a x^b``, b in [0.25, 2]       [0, 2]        x = 0 exactly, exponents below 1
``sqrt``           ``a sqrt(x)``                   [0, 2]        x = 0 exactly, g' infinite at 0
``inverse_sqrt``   ``a / sqrt(x)``                 [0.01, 1]     steep, large values near 0
``signed_power``   ``a sign(x) |x|^b``             [-1, 1]       negative inputs, x = 0 exactly
``two_powers``     ``a1 x^b1 + a2 x^b2``           [0, 2]        a sum of two terms, x = 0 exactly
=================  ==============================  ============  =====================================
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import numpy as np
from companion._checks import check_int

__all__ = ["FAMILIES", "TargetFamily", "dataset", "evaluate", "sample"]


@dataclasses.dataclass(frozen=True)
class TargetFamily:
    """A family of random target functions and how to sample them.

    Attributes:
        name: the key in :data:`FAMILIES`.
        formula: the formula, for labels and tables.
        function: ``function(x, **parameters)``, vectorised NumPy, float64.
        parameters: name -> ``(low, high)``: each function draws its parameters
            uniformly from these ranges.
        domain: ``(low, high)`` of the sampled x.
        include: a point every function is sampled at exactly (e.g. ``0.0``), or None.
        log_spacing: draw x uniformly in ``log x`` rather than in ``x`` (for steep
            targets, so the steep part is sampled as densely as the flat one).
        negative_inputs: the domain has x < 0: fit with signed powers
            (``ParameterNet``'s ``"signed_power"`` fix).
    """

    name: str
    formula: str
    function: Callable[..., np.ndarray]
    parameters: Mapping[str, tuple[float, float]]
    domain: tuple[float, float]
    include: float | None = None
    log_spacing: bool = False
    negative_inputs: bool = False


def _power_law(x, a, b):
    return a * np.power(x, b)


def _sqrt(x, a):
    return a * np.sqrt(x)


def _inverse_sqrt(x, a):
    return a / np.sqrt(x)


def _signed_power(x, a, b):
    return a * np.sign(x) * np.power(np.abs(x), b)


def _two_powers(x, a1, b1, a2, b2):
    return a1 * np.power(x, b1) + a2 * np.power(x, b2)


#: The target families, by name.
FAMILIES: dict[str, TargetFamily] = {
    family.name: family
    for family in [
        TargetFamily(
            "power_law", "a x^b", _power_law, {"a": (0.5, 2.0), "b": (0.25, 2.0)}, (0.0, 2.0), include=0.0
        ),
        TargetFamily("sqrt", "a sqrt(x)", _sqrt, {"a": (0.5, 2.0)}, (0.0, 2.0), include=0.0),
        TargetFamily(
            "inverse_sqrt", "a / sqrt(x)", _inverse_sqrt, {"a": (0.1, 1.0)}, (0.01, 1.0), include=1.0, log_spacing=True
        ),
        TargetFamily(
            "signed_power",
            "a sign(x) |x|^b",
            _signed_power,
            {"a": (0.5, 2.0), "b": (0.25, 2.0)},
            (-1.0, 1.0),
            include=0.0,
            negative_inputs=True,
        ),
        TargetFamily(
            "two_powers",
            "a1 x^b1 + a2 x^b2",
            _two_powers,
            {"a1": (0.5, 1.5), "b1": (0.25, 1.0), "a2": (0.5, 1.5), "b2": (1.0, 2.0)},
            (0.0, 2.0),
            include=0.0,
        ),
    ]
}


def _family(family: str | TargetFamily) -> TargetFamily:
    if isinstance(family, TargetFamily):
        return family
    if not isinstance(family, str):
        raise TypeError(f"family must be a name like 'sqrt' or a TargetFamily, got {type(family).__name__}")
    if family not in FAMILIES:
        raise ValueError(f"unknown target family {family!r}; valid names: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[family]


def _check_count(label: str, value, minimum: int) -> int:
    return check_int(label, value, minimum)


def evaluate(family: str | TargetFamily, x, **parameters) -> np.ndarray:
    """``g(x)`` of one member of ``family``, in float64 (e.g. to plot it on a dense grid).

    Args:
        family: a name in :data:`FAMILIES` or a :class:`TargetFamily`.
        x: array-like of inputs.
        **parameters: the family's parameters, e.g. ``a=1.0, b=0.5`` for
            ``"power_law"`` (arrays broadcast against ``x``).

    Returns:
        ``g(x)`` as a float64 array.

    Raises:
        ValueError: if ``family`` is unknown or the parameters are not the family's.

    Example:
        >>> evaluate("sqrt", [0.0, 4.0], a=2.0)
        array([0., 4.])
    """
    spec = _family(family)
    if set(parameters) != set(spec.parameters):
        raise ValueError(f"family {spec.name!r} takes parameters {sorted(spec.parameters)}, got {sorted(parameters)}")
    x = np.asarray(x, dtype=np.float64)
    return spec.function(x, **{k: np.asarray(v, dtype=np.float64) for k, v in parameters.items()})


def sample(
    family: str | TargetFamily,
    batch_size: int,
    n: int = 32,
    *,
    seed: int = 0,
    return_parameters: bool = False,
):
    """A batch of ``batch_size`` random functions from ``family``, each sampled at ``n`` points.

    Each function draws its parameters uniformly from the family's ranges and its ``n``
    points uniformly from the domain (in ``log x`` for ``log_spacing`` families), one of
    them replaced by ``family.include`` (e.g. exactly ``x = 0``), sorted. ``g`` is
    evaluated in float64 and rounded to float32.

    Args:
        family: a name in :data:`FAMILIES` (``"power_law"``, ``"sqrt"``,
            ``"inverse_sqrt"``, ``"signed_power"``, ``"two_powers"``) or a
            :class:`TargetFamily`.
        batch_size: number of functions, >= 1.
        n: points per function, >= 2.
        seed: seed of the NumPy generator: the same seed gives the same arrays.
        return_parameters: also return the parameters of each function.

    Returns:
        ``(xs, ys)``, float32 arrays of shape ``(batch_size, n, 1)``; with
        ``return_parameters``, ``(xs, ys, parameters)`` where ``parameters`` maps each
        parameter name to a float64 array ``(batch_size,)``.

    Raises:
        TypeError, ValueError: for an unknown family or a bad count.

    Example:
        >>> xs, ys = sample("sqrt", batch_size=4, n=8, seed=0)
        >>> xs.shape, ys.dtype, float(xs[:, 0].max())  # every sample holds x = 0
        ((4, 8, 1), dtype('float32'), 0.0)
    """
    spec = _family(family)
    batch_size = _check_count("batch_size", batch_size, 1)
    n = _check_count("n", n, 2)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    rng = np.random.default_rng(seed)
    parameters = {name: rng.uniform(low, high, batch_size) for name, (low, high) in spec.parameters.items()}
    low, high = spec.domain
    if spec.log_spacing:
        xs = np.exp(rng.uniform(np.log(low), np.log(high), (batch_size, n)))
    else:
        xs = rng.uniform(low, high, (batch_size, n))
    if spec.include is not None:
        xs[:, 0] = spec.include
    xs = np.sort(xs.astype(np.float32).astype(np.float64), axis=1)
    ys = spec.function(xs, **{name: values[:, None] for name, values in parameters.items()})
    xs, ys = xs[..., None].astype(np.float32), ys[..., None].astype(np.float32)
    return (xs, ys, parameters) if return_parameters else (xs, ys)


def dataset(
    family: str | TargetFamily,
    batches: int,
    batch_size: int = 16,
    n: int = 32,
    *,
    seed: int = 0,
):
    """``batches`` batches from ``family`` as a ``tf.data.Dataset`` of ``((xs, ys), ys)``.

    The element is ``(inputs, targets)``: ParameterNet is called as ``model((xs, ys))``
    and its prediction at ``xs`` is compared with ``ys``. All batches are drawn at once
    with :func:`sample` (``batches * batch_size`` functions, ``seed``), so iterating the
    dataset again gives the same batches in the same order.

    Args:
        family: a name in :data:`FAMILIES` or a :class:`TargetFamily`.
        batches: number of batches, >= 1.
        batch_size: functions per batch, >= 1.
        n: points per function, >= 2.
        seed: seed of the NumPy generator.

    Returns:
        A ``tf.data.Dataset`` with ``batches`` elements ``((xs, ys), ys)``, each array
        float32 of shape ``(batch_size, n, 1)``.

    Example:
        >>> data = dataset("power_law", batches=3, batch_size=8, seed=1)
        >>> int(data.cardinality()), data.element_spec[1].shape
        (3, TensorShape([8, 32, 1]))
    """
    import tensorflow as tf

    batches = _check_count("batches", batches, 1)
    batch_size = _check_count("batch_size", batch_size, 1)
    xs, ys = sample(family, batches * batch_size, n, seed=seed)
    return tf.data.Dataset.from_tensor_slices(((xs, ys), ys)).batch(batch_size, drop_remainder=True)
