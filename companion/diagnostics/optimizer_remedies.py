"""Remedies that change the optimizer, checked by re-running ``fit``'s steps with them.

For a divergence (values that grew over the previous steps), a learning rate at or below
0, a schedule that explodes or keeps rising, and targets made from the model's own
outputs, the remedy is the optimizer changed: a learning rate ten times smaller, a
positive learning rate (for a rate, not a schedule object, at or below 0),
``clipnorm=1.0``, or the schedule fixed (a Keras schedule's argument, or the ``return``
line of the user's own schedule clipped into the rates it gave before). Each is checked
by re-running the training steps (:class:`Steps`: from the earliest state the doctor
kept to the failing step, ``model.train_step`` eagerly), first without the remedy, as a
control that must fail as ``fit`` did; the remedy verifies if every step is then finite
and no logged value grows step after step. :func:`from_the_run` reads the causes that
only the run shows (the schedule's rates up to the failing step, targets as large as the
model's outputs). :mod:`.remedies` chooses among the candidates and prints the first
that verifies.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import contextlib
import dataclasses
import os

import keras
import numpy as np
import tensorflow as tf

from companion import _internal
from companion.diagnostics.causes import grew
from companion.diagnostics.data import nonfinite_data
from companion.diagnostics.diagnosis import replace
from companion.diagnostics.state import restore, snapshot
from companion.diagnostics.step import logs_values, pack, step_variables, written_variables

__all__ = ["MAX_STEPS", "Steps", "from_the_run", "rate_candidates", "rates_to", "replicas", "smaller_learning_rate",
           "verify_divergence"]

# --------------------------------------------------------------------------------------
# A divergence: the steps re-run with a smaller learning rate, or with clipnorm
# --------------------------------------------------------------------------------------


#: The most training steps :func:`~companion.diagnostics.remedies.verify` re-runs (eagerly) to
#: check a divergence's remedy.
MAX_STEPS = 500


@dataclasses.dataclass
class Steps:
    """Training steps to re-run with a remedy: from a kept state to the failing step.

    Attributes:
        variables: the variables whose values ``start`` holds (the model's, its
            metrics', its optimizers').
        start: their values at the first of the steps.
        batches: a function returning the ``(x, y, sample_weight)`` batches of the
            steps, in the order ``fit`` trained them, the failing one last.
        count: how many steps that is.
        origin: where they start, for the report (``"the start of fit"``).
    """

    variables: list
    start: list
    batches: Callable[[], Iterable[tuple[Any, Any, Any]]]
    count: int
    origin: str


def _optimizer(model):
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        return None
    inner = getattr(optimizer, "inner_optimizer", None)  # a LossScaleOptimizer's
    return inner if isinstance(inner, keras.optimizers.Optimizer) else optimizer


def _rate(optimizer) -> float | None:
    rate = getattr(optimizer, "learning_rate", None)
    try:
        return float(np.asarray(rate.numpy() if hasattr(rate, "numpy") else rate))
    except (TypeError, ValueError):
        return None


@contextlib.contextmanager
def _learning_rate(optimizer, value: float):
    before = _rate(optimizer)
    optimizer.learning_rate = value  # a TypeError for a LearningRateSchedule: said by the caller
    try:
        yield
    finally:
        optimizer.learning_rate = before


@contextlib.contextmanager
def _clipnorm(optimizer, value: float):
    before = optimizer.clipnorm, optimizer.global_clipnorm, optimizer.clipvalue
    optimizer.clipnorm, optimizer.global_clipnorm, optimizer.clipvalue = value, None, None
    try:
        yield
    finally:
        optimizer.clipnorm, optimizer.global_clipnorm, optimizer.clipvalue = before


def _rerun_steps(model, steps: Steps, change) -> tuple[bool, int, str | None]:
    """The steps re-run eagerly with ``change`` applied: ``(all finite, steps run, grown)``.

    ``grown`` names a logged value that still grew step after step (by the rule that
    calls a run a divergence, :func:`~companion.diagnostics.causes.grew`) though every
    step was finite, with its first and last values; else ``None``. Every variable a
    step writes (and the random generators' states) is put back afterwards, and
    ``change`` is undone, also on an error. An optimizer that has not stepped yet is
    built first, as ``fit`` builds it before its first step, so that its slots are in
    the snapshot (built by the re-run, they would keep the re-run's values).
    """
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, keras.optimizers.Optimizer) and not optimizer.built:
        strategy = getattr(model, "distribute_strategy", None)
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            optimizer.build(model.trainable_variables)
    saved = snapshot(step_variables(model))
    history: dict[str, list[float]] = {}
    try:
        for variable, value in zip(steps.variables, steps.start):
            variable.assign(value)
        with change():
            written = written_variables(model)
            run = 0
            for x, y, w in steps.batches():
                run += 1
                logs = model.train_step(pack(x, y, w))
                finite = True
                for name, value in logs_values(logs):
                    array = np.asarray(tf.cast(value, tf.float32))
                    finite = finite and bool(np.all(np.isfinite(array)))
                    if array.size == 1:
                        history.setdefault(name, []).append(float(array.reshape(-1)[0]))
                finite = finite and all(bool(tf.reduce_all(tf.math.is_finite(v))) for v in written)
                if not finite:
                    return False, run, None
        for name, values in history.items():
            if grew(values):
                return True, run, f"{name} {values[0]:.3g} -> {values[-1]:.3g}"
        return True, run, None
    finally:
        restore(saved)


def _where(run: int, count: int) -> str:
    return "the failing step" if run == count else f"step {run} of the {count}"


def replicas(model) -> int:
    strategy = getattr(model, "distribute_strategy", None)
    return int(getattr(strategy, "num_replicas_in_sync", 1) or 1)


def verify_divergence(d, model, x, y, w, steps, every: bool = False):
    """The divergence's remedies (a smaller rate, else ``clipnorm``) re-run over the steps.

    Returns the remedy printed first and its check; with ``every``, every remedy tried
    with its own check, in order.
    """
    optimizer = _optimizer(model)
    if optimizer is None:
        found = [("a learning rate ten times smaller in the optimizer (or clipnorm=1.0)",
                  "not verified: the model has no Keras optimizer to re-run the step with")]
        return found if every else found[0]
    rate = _rate(optimizer)
    name = type(optimizer).__name__
    smaller = smaller_learning_rate(model)[0]
    tries = []
    if rate is not None and rate > 0:  # a negative rate (a schedule below 0) is not cured by a tenth of it
        tries.append((smaller, f"learning_rate={rate / 10:.3g}", lambda: _learning_rate(optimizer, rate / 10)))
    if not (optimizer.clipnorm and optimizer.clipnorm <= 1.0):
        shown = f"learning_rate={rate:.3g}, " if rate is not None else ""
        why = ("the learning rate at the failing step is {:.3g}: the schedule went below 0 and the steps climb "
               "the loss; clip it at 0 as well".format(rate) if rate is not None and rate <= 0
               else "the weights grew step after step")
        tries.append((f"recompile with gradient clipping: keras.optimizers.{name}({shown}clipnorm=1.0) "
                      f"(each gradient's norm at most 1; {why})",
                      "clipnorm=1.0", lambda: _clipnorm(optimizer, 1.0)))
    found = _rerun_tries(model, x, y, w, steps, tries, d.phase, default=smaller)
    return found if every else next(((r, v) for r, v in found if (v or "").startswith("verified")), found[0])


def _rerun_tries(model, x, y, w, steps, tries, phase=None, default=None) -> list[tuple[str, "str | None"]]:
    """Each of ``tries`` (``(remedy, what, change)``) re-run over the steps: ``[(remedy, verdict)]`` in order.

    The steps are re-run first without a change, as a control that must fail as
    ``fit`` did; a remedy verifies if every step is then finite with it and no logged
    value grows step after step.
    """
    def each(verdict):
        return [(text, verdict) for text, _, _ in tries] or [(default, verdict)]

    if not tries:
        return [(default, None)]
    if replicas(model) > 1:  # an update on one replica, outside the strategy, would wait for the others
        return each(f"not verified: the doctor does not re-run training steps under a distribution "
                    f"strategy of {replicas(model)} replicas")
    if steps is None:
        if phase == "weights":
            return each("not verified: the weights before the step are already non-finite; the steps "
                        "that made them so are not in the data the doctor was given (run fit with "
                        "NaNDoctor from the start)")
        steps = Steps([], [], lambda: [(x, y, w)], 1, "the weights before it")
    if steps.count == 1:
        span = f"the failing step re-run from {steps.origin}"
    else:
        span = f"the {steps.count} steps from {steps.origin} to the failing one re-run with it"
    if steps.count > MAX_STEPS:
        return each(f"not verified: the failing step is {steps.count} steps after {steps.origin}, the "
                    f"earliest state the doctor kept (it re-runs at most {MAX_STEPS}, eagerly)")
    reproduced, run_control, _ = _rerun_steps(model, steps, contextlib.nullcontext)
    if reproduced:  # the control: without a remedy the re-run must fail as fit did
        return each(f"not verified: {span} without a remedy is finite as well (the re-run does not "
                    "reproduce fit's failure, so it cannot show a cure)")
    failures, found = [], []
    for text, what, change in tries:
        try:
            finite, run, grown = _rerun_steps(model, steps, change)
        except TypeError as error:  # a learning-rate schedule is not settable
            failures.append(f"{what} could not be set ({str(error).splitlines()[0][:120]})")
            found.append((text, f"not verified: {failures[-1]} ({span})"))
            continue
        if finite and grown:
            failures.append(f"with {what}, every step is finite but {grown} still grows step after step")
        elif finite:
            tried = "".join(f"; {failure}" for failure in failures)
            found.append((text, f"verified: the step is finite with {what} ({span}, every logged value and "
                                f"weight finite and none growing step after step; without it, "
                                f"{_where(run_control, steps.count)} is not{tried})"))
            continue
        else:
            failures.append(f"with {what}, {_where(run, steps.count)} is still non-finite")
        found.append((text, f"not verified: {failures[-1]} ({span})"))
    if found and not any(v.startswith("verified") for _, v in found):  # the first says what every try found
        found[0] = (found[0][0], f"not verified: {'; '.join(failures)} ({span})")
    return found


def smaller_learning_rate(model):
    """The optimizer as compiled, with a learning rate ten times smaller, as the call to write."""
    optimizer = _optimizer(model)
    value = None if optimizer is None else _rate(optimizer)
    if value is None:
        return ("a learning rate ten times smaller in the optimizer (or clipnorm=1.0)",
                None)
    name = type(optimizer).__name__
    return (f"recompile with a learning rate ten times smaller: keras.optimizers.{name}"
            f"(learning_rate={value / 10:.3g}) (was {value:.3g}; the weights grew step after step)", None)


# --------------------------------------------------------------------------------------
# Causes read from the run: the learning rate, targets made from the model's own outputs
# --------------------------------------------------------------------------------------


def _schedule(optimizer):
    """The optimizer's ``LearningRateSchedule``, or ``None`` for a rate."""
    given = _internal.learning_rate_as_given(optimizer)
    return given if isinstance(given, keras.optimizers.schedules.LearningRateSchedule) else None


#: The most steps whose scheduled rates :func:`rates_to` evaluates one by one.
MAX_RATES = 4096


def rates_to(optimizer) -> tuple[list[float], int]:
    """The learning rate of each step up to the current one (the failing step), and the first step's number.

    A schedule is evaluated at its last :data:`MAX_RATES` steps at most, the current
    one last; a rate is its current value alone.
    """
    schedule = _schedule(optimizer)
    step = int(np.asarray(optimizer.iterations.numpy()))
    if schedule is None:
        rate = _rate(optimizer)
        return ([] if rate is None else [rate]), step
    points = np.arange(max(0, step + 1 - MAX_RATES), step + 1, dtype=np.int64)
    with tf.init_scope():
        try:
            values = np.asarray(schedule(tf.constant(points)), np.float64).reshape(-1)
            if values.shape != points.shape:
                raise ValueError("a schedule that does not map steps elementwise")
        except Exception:  # noqa: BLE001 - a schedule written for one scalar step
            values = np.array([float(np.asarray(schedule(tf.constant(int(p))))) for p in points])
    return [float(v) for v in values], int(points[0])


def _outputs(model, x):
    """The model's outputs on ``x`` (inference), as one NumPy array, or ``None``."""
    try:
        out = model(x, training=False)
    except Exception:  # noqa: BLE001 - a model whose call needs more than the data
        return None
    flat = tf.nest.flatten(out)
    return np.asarray(tf.cast(flat[0], tf.float64)) if len(flat) == 1 else None


def from_the_run(d, model, x, y):
    """``d`` with the cause the run's values show, where they show one the op's alone does not.

    For values that overflowed (a divergence, an overflow, an ``Inf`` met in
    arithmetic, non-finite weights): the learning rate at the failing step and the
    schedule's rates before it (:func:`~companion.diagnostics.causes.rate_cause`), then
    the targets against the model's own outputs on the same inputs
    (:func:`~companion.diagnostics.causes.bootstrapped`). Else ``d`` unchanged.
    """
    from companion.diagnostics.causes import CAUSES, GROWTH_CAUSES, bootstrapped, rate_cause  # noqa: PLC0415

    if d.cause not in GROWTH_CAUSES | {"nonfinite_input"}:
        return d
    optimizer = _optimizer(model)
    found = None
    if optimizer is not None and d.cause != "nonfinite_input":
        summary = rate_cause(*rates_to(optimizer))
        if summary is not None:
            found = "learning_rate", summary
    inputs_finite = not nonfinite_data((x,))  # a NaN in the inputs reaches targets and outputs alike
    if found is None and y is not None and not isinstance(y, (dict, list, tuple)) and inputs_finite:
        outputs = _outputs(model, x)
        summary = None if outputs is None else bootstrapped(np.asarray(y), outputs)
        if summary is not None:
            found = "bootstrapped_targets", summary
    if found is None:
        return d
    name, summary = found
    cause = CAUSES[name]
    return replace(d, cause=name, fix=cause.fix, section=cause.section,
                   inputs_summary=f"{summary}; {d.inputs_summary}" if d.inputs_summary else summary)


class _Clipped(keras.optimizers.schedules.LearningRateSchedule):
    """A schedule's rates clipped into ``[low, high]``: the rewritten schedule, for a re-run."""

    def __init__(self, schedule, low: float, high: float):
        self.schedule, self.low, self.high = schedule, low, high

    def __call__(self, step):
        rate = self.schedule(step)
        return tf.clip_by_value(rate, tf.cast(self.low, rate.dtype), tf.cast(self.high, rate.dtype))

    def get_config(self):
        return {"schedule": self.schedule, "low": self.low, "high": self.high}


@contextlib.contextmanager
def _swapped_schedule(optimizer, schedule):
    before = _schedule(optimizer)
    optimizer.learning_rate = schedule  # Keras' public setter takes a schedule for a schedule
    try:
        yield
    finally:
        optimizer.learning_rate = before


#: Arguments of Keras' own schedules that make a rate grow or fall below 0, and what they should be.
_SCHEDULE_ARGUMENTS = {
    "decay_rate": lambda v: 1.0 / v if v > 1 else (abs(v) if v < 0 else None),
    "end_learning_rate": lambda v: 0.0 if v < 0 else None,
    "alpha": lambda v: 0.0 if v < 0 else None,
    "power": lambda v: abs(v) if v < 0 else None,
    "initial_learning_rate": lambda v: abs(v) if v < 0 else None,
    "warmup_target": lambda v: abs(v) if v is not None and v < 0 else None,
}


def _bounds(rates: list[float]) -> tuple[float, float]:
    """``(low, high)``: the smallest positive rate the schedule gave, and the rate it should not pass."""
    positive = [r for r in rates if r > 0]
    low = min(positive) if positive else 0.0
    earlier = [r for r in rates[:-1] if r > 0]
    high = float(np.median(earlier)) if rates[-1] > 0 and earlier else (max(positive) if positive else 0.0)
    return low, max(high, low)


def _schedule_remedy(optimizer, schedule, rates) -> tuple[str, Any] | None:
    """The schedule rewritten so its rate stays in ``(0, peak]``: ``(remedy, schedule to re-run with)``."""
    low, high = _bounds(rates)
    cls = type(schedule)
    if cls.__module__.startswith("keras."):
        config = schedule.get_config()
        fixed = {k: _SCHEDULE_ARGUMENTS[k](v) for k, v in config.items()
                 if k in _SCHEDULE_ARGUMENTS and isinstance(v, (int, float)) and _SCHEDULE_ARGUMENTS[k](v) is not None}
        if fixed:
            shown = ", ".join(f"{k}={config[k]!r} -> {k}={v:.4g}" for k, v in fixed.items())
            return (f"fix the schedule's arguments: keras.optimizers.schedules.{cls.__name__}(..., {shown}) "
                    f"(its rate at the failing step is {rates[-1]:.3g})", cls.from_config({**config, **fixed}))
        return (f"clip the schedule's rate: learning_rate=lambda: tf.clip_by_value({cls.__name__}(...)"
                f"(optimizer.iterations), {low:.3g}, {high:.3g}) (its rate at the failing step is {rates[-1]:.3g})",
                _Clipped(schedule, low, high))
    import inspect  # noqa: PLC0415

    try:
        lines, first = inspect.getsourcelines(cls.__call__)
        filename = inspect.getsourcefile(cls.__call__)
    except (OSError, TypeError):
        lines, first, filename = [], 0, None
    returns = [(first + i, line.strip()) for i, line in enumerate(lines) if line.strip().startswith("return ")]
    if not returns:
        return (f"clip the rate {cls.__name__}.__call__ returns: tf.clip_by_value(rate, {low:.3g}, {high:.3g}) "
                f"(its rate at the failing step is {rates[-1]:.3g})", _Clipped(schedule, low, high))
    lineno, text = returns[-1]
    expression = text[len("return "):]
    try:  # the expression without a comment after it
        import ast  # noqa: PLC0415

        expression = ast.unparse(ast.parse(text).body[0].value)
        text = f"return {expression}"
    except (SyntaxError, AttributeError, IndexError):
        pass
    return (f"at {os.path.basename(filename)}:{lineno}: {text} -> return tf.clip_by_value({expression}, "
            f"{low:.3g}, {high:.3g}) (the rate of {cls.__name__} kept in [{low:.3g}, {high:.3g}], the rates it "
            f"gave before; at the failing step it is {rates[-1]:.3g})", _Clipped(schedule, low, high))


def rate_candidates(d, model, x, y, w, steps):
    """A wrong learning rate: the schedule fixed, else ``clipnorm``; bootstrapped targets: ``clipnorm``."""
    optimizer = _optimizer(model)
    if optimizer is None:
        return [(_fix_only(d), None)]
    name = type(optimizer).__name__
    rate = _rate(optimizer)
    tries = []
    if d.cause == "learning_rate":
        rates = rates_to(optimizer)[0]
        schedule = _schedule(optimizer)
        if schedule is not None:
            found = _schedule_remedy(optimizer, schedule, rates)
            if found is not None:
                remedy, fixed = found
                tries.append((remedy, "the schedule fixed", lambda fixed=fixed: _swapped_schedule(optimizer, fixed)))
        elif rate is not None and rate <= 0:
            positive = [r for r in rates if r > 0]
            good = abs(rate) if rate < 0 else (min(positive) if positive else None)
            if good:
                tries.append((f"a positive learning rate: keras.optimizers.{name}(learning_rate={good:.3g}) (it is "
                              f"{rate:.3g} at the failing step: every step climbs the loss; where a "
                              f"LearningRateScheduler or your own code sets it, return max(rate, {good:.3g}) there)",
                              f"learning_rate={good:.3g}", lambda: _learning_rate(optimizer, good)))
    shown = "" if rate is None or _schedule(optimizer) is not None else f"learning_rate={rate:.3g}, "
    why = ("the targets are made from the model's own outputs: each step is bounded, so they cannot run away"
           if d.cause == "bootstrapped_targets" else "each step is bounded however large the rate")
    if not (optimizer.clipnorm and optimizer.clipnorm <= 1.0):
        tries.append((f"recompile with gradient clipping: keras.optimizers.{name}({shown}clipnorm=1.0) "
                      f"(each gradient's norm at most 1; {why})", "clipnorm=1.0", lambda: _clipnorm(optimizer, 1.0)))
    if not tries:
        return [(_fix_only(d), None)]
    if d.cause == "bootstrapped_targets" and (steps is None or steps.count <= 1):
        verdict = ("not verified: the targets are made from the model's own outputs by the loop that calls the "
                   "step, and the doctor has only this step, from weights that are already that large (attach "
                   "one NaNDoctor to the whole loop, or re-run the loop with the remedy)")
        return [(text, (lambda v=verdict: v)) for text, _, _ in tries]
    results = _rerun_tries(model, x, y, w, steps, tries, d.phase, default=tries[0][0])
    return [(r, (lambda v=v: v)) for r, v in results]


def _fix_only(d) -> str:
    """The cause's fix, as a remedy with no check."""
    return d.fix
