"""The NaN doctor for ``model.fit`` users: the :class:`NaNDoctor` callback."""

from __future__ import annotations

import sys
import threading
import warnings
import weakref
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from companion import _internal
from companion._gradients import all_finite
from companion.diagnostics.data import _unpack, batches
from companion.diagnostics.doctor import Diagnosis, diagnose, replace
from companion.diagnostics.remedies import LOW_PRECISION, MAX_STEPS, Steps, verify
from companion.diagnostics.step import step_variables

__all__ = ["NaNDoctor"]


class NaNDoctor(keras.callbacks.Callback):
    """Diagnose the first batch of ``fit`` that makes anything non-finite: one added line.

    ``model.fit(x, y, callbacks=[NaNDoctor()])``. After every batch the callback
    looks at every value ``fit`` logs (``loss``, a GAN's ``d_loss`` and ``g_loss``,
    metrics), and at the model's variables: one compiled call per batch checks that
    every weight is finite (one fused ``reduce_all(is_finite)``, the one value read
    back) and copies the weights and the optimizers' state on their device, for the
    restore (the cost on a clean batch is measured by ``benchmarks/doctor.py``: a few
    ms per step for a model of a million parameters with Adam on a 2-core CPU, most of
    it the copy). So a NaN written into the weights behind a
    finite loss (max-pooling drops NaN: ``maxpool([nan, 1]) = 1``) is named at the
    batch that wrote it. At the first non-finite value it puts back the copy from
    before that batch (``fit`` has applied the non-finite update by then), runs
    :func:`diagnose` on that step's batch (the data ``fit`` was given, in order, or
    ``data``) — the compiled loss, or the model's own ``train_step`` if it has one or
    no compiled loss — prints the :class:`Diagnosis` and, by default, stops training,
    like :class:`keras.callbacks.TerminateOnNaN`. When ``fit`` shuffles arrays
    (``shuffle=True``, its default), the rows of a step are Keras' own permutation: the
    callback then keeps the batches ``fit``'s pipeline yields, so the diagnosis and the
    capsule hold the rows ``fit`` trained on at that step. For a divergence, the
    remedy (a learning rate ten times smaller, or ``clipnorm=1.0``) is verified by
    re-running ``fit``'s steps from its start (the weights copied before its first
    batch) to the failing one with it, after a control re-run without it that must
    fail as ``fit`` did.

    The doctor never breaks the run it watches: any failure of its own is a
    ``RuntimeWarning``, and training goes on (or stops only as ``stop_training`` says).

    Args:
        data: the data to diagnose, as ``fit`` takes it; ``None`` uses the ``x``,
            ``y`` and ``sample_weight`` of the running ``fit`` call.
        loss: passed to :func:`diagnose` (``None``: the compiled loss, or the model's
            own ``train_step``).
        stop_training: stop ``fit`` after the diagnosis (default ``True``).
        restore_weights: keep the restored finite weights and optimizer state (default
            ``True``); if ``False`` the non-finite ones are put back after the diagnosis.
        verbose: print the diagnosis (default ``True``).

    Attributes:
        diagnosis: the :class:`Diagnosis`, or ``None`` (nothing non-finite yet).
        batch: ``(epoch, batch)`` of ``fit``'s step that made the first non-finite
            logged value or weight.
        nonfinite_logs: the names of the logged values that were not finite then.

    Example:
        >>> keras.utils.set_random_seed(0)
        >>> model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        >>> model.compile(loss=lambda y, p: tf.math.log(p - p), optimizer="sgd")
        >>> doctor = NaNDoctor(verbose=False)
        >>> x = np.ones((4, 1))
        >>> _ = model.fit(x, x, batch_size=2, verbose=0, callbacks=[doctor])
        >>> doctor.diagnosis.cause, doctor.diagnosis.op, doctor.diagnosis.phase
        ('log_of_zero', 'Log', 'loss')
    """

    def __init__(
        self,
        data: Any = None,
        loss: Callable | str | None = None,
        *,
        stop_training: bool = True,
        restore_weights: bool = True,
        verbose: bool = True,
    ) -> None:
        super().__init__()
        self.data = data
        self.loss = loss
        self.stop_training = bool(stop_training)
        self.restore_weights = bool(restore_weights)
        self.verbose = bool(verbose)
        self.diagnosis: Diagnosis | None = None
        self.batch: tuple[int, int] | None = None
        self.nonfinite_logs: tuple[str, ...] = ()
        self._fit_data = None
        self._reset()

    def _reset(self) -> None:
        self._before = None  # the variables' values before the running batch
        self._start = None  # ... before fit's first step, and before the epoch's first step
        self._epoch_start = None
        self._epoch_first = 0  # the index (counted from fit's start) of the epoch's first step
        self._epoch_steps: list[int] = []  # the steps fit ran in each epoch
        self._losses: list[float] = []
        self._epoch = 0
        self._done = False
        self._functions = None
        self._steps = 0
        self._shuffled = False  # fit shuffles the rows of arrays
        self._tapped: dict[int, Any] = {}  # step index (from fit's start) -> the batch fit trained on
        self._tapped_bytes = 0
        self._lock = threading.Lock()
        self._produced = 0
        self._untap = None

    def _warn(self, what: str, error: BaseException) -> None:
        warnings.warn(f"the NaN doctor {what}: {error!r}; training goes on without it", RuntimeWarning, stacklevel=3)

    def on_train_begin(self, logs=None) -> None:
        try:
            self._reset()
            self.diagnosis = None
            self.batch = None
            self.nonfinite_logs = ()
            self._fit_data = self.data
            if self._fit_data is None:
                found = _internal.running_fit_arguments(sys._getframe(1))
                if found is not None:
                    self._fit_data = found
            self._tap(sys._getframe(1))
        except Exception as error:  # pragma: no cover - the doctor never ends a run
            self._done = True
            self._warn("could not start", error)

    def _tap(self, frame) -> None:
        """When fit shuffles arrays, keep the batches it trains on (Keras' permutation is its own)."""
        found = _internal.running_fit_locals(frame, ("x", "shuffle", "steps_per_epoch"))
        if found is None or not found["shuffle"] or not _is_arrays(found["x"]):
            return
        self._shuffled = True
        if getattr(self.model, "steps_per_execution", 1) != 1:
            return  # several steps per callback call: the steps are not told apart

        def record(batch) -> None:  # called from tf.data's thread
            size = sum(int(np.asarray(v).nbytes) for v in tf.nest.flatten(batch))
            with self._lock:
                self._tapped[self._produced] = batch
                self._tapped_bytes += size
                self._produced += 1

        self._untap = _internal.tap_fit_batches(frame, record)

    def on_train_end(self, logs=None) -> None:
        untap, self._untap = self._untap, None
        self._tapped = {}
        if untap is not None:
            try:
                untap()
            except Exception as error:  # pragma: no cover - the doctor never ends a run
                self._warn("could not remove its tap of fit's batches", error)

    def on_epoch_begin(self, epoch, logs=None) -> None:
        self._epoch = epoch
        self._epoch_first = self._steps
        self._epoch_steps.append(0)
        self._epoch_start = None
        if self._steps > MAX_STEPS or self._tapped_bytes > MAX_KEPT_BYTES:
            # fit's batches from its start would be too many to keep (or to re-run): this epoch's only
            self._forget(self._steps)

    def _forget(self, before: int) -> None:
        """Drop the kept batches of the steps before ``before``."""
        with self._lock:
            for index in [i for i in list(self._tapped) if i < before]:
                batch = self._tapped.pop(index)
                self._tapped_bytes -= sum(int(np.asarray(v).nbytes) for v in tf.nest.flatten(batch))

    def on_train_batch_begin(self, batch, logs=None) -> None:
        if self._done:
            return
        try:
            if self._functions is None:
                self._functions = _functions(self.model)
            if self._before is None:
                self._before = self._functions.copy()  # asynchronous: nothing is read back
            if self._start is None:
                self._start = self._before  # the same tensors: no copy
            if self._epoch_start is None:
                self._epoch_start = self._before
        except Exception as error:
            self._done = True
            self._warn("could not copy the weights", error)

    def on_train_batch_end(self, batch, logs=None) -> None:
        if self._done:
            return
        try:
            bad_logs = _nonfinite_logs(logs)
            functions = self._functions or _functions(self.model)
            if functions.stale(self.model, self._steps):
                # An optimizer built in the first step (a GAN's d_optimizer): watch its state too.
                old = functions
                self._functions = functions = _functions(self.model)
                weights_ok, after = bool(functions.finite_now()), functions.copy()
                if self._before is not None and len(self._before) != len(after):
                    extended = _extended(old, self._before, functions, after)
                    if self._start is self._before:
                        self._start = extended
                    if self._epoch_start is self._before:
                        self._epoch_start = extended
                    self._before = extended
            else:
                weights_ok, after = functions.check_and_copy()
            self._steps += 1
            if self._epoch_steps:
                self._epoch_steps[-1] += 1
            if self._tapped and (self._steps - self._epoch_first > MAX_STEPS or self._tapped_bytes > MAX_KEPT_BYTES):
                self._forget(self._steps - 1)  # too many to re-run from the epoch's start: the step's own only
            if not bad_logs and weights_ok:
                if logs and "loss" in logs:
                    self._losses.append(_as_float(logs["loss"]))
                self._before = after
                return
            self.nonfinite_logs = tuple(bad_logs)
            self._found(batch)
        except Exception as error:
            self._done = True
            self._warn(f"failed at batch {batch} of epoch {self._epoch}", error)

    def _found(self, batch: int) -> None:
        self._done = True
        self.batch = (self._epoch, batch)
        try:
            self._diagnose(batch)
        finally:
            if self.stop_training:
                self.model.stop_training = True

    def _diagnose(self, batch: int) -> None:
        functions = self._functions
        current = functions.copy()
        before = self._before if self._before is not None else current
        functions.assign(before)
        try:
            try:
                found = self._run(batch)
            except Exception as error:
                found = None
                self._warn(f"could not diagnose batch {batch} of epoch {self._epoch}", error)
            self.diagnosis = found
        finally:
            if not self.restore_weights:
                functions.assign(current)
        if self.verbose:
            what = (
                f"{', '.join(self.nonfinite_logs)} turned non-finite"
                if self.nonfinite_logs
                else "the weights turned non-finite (every logged value is finite)"
            )
            where = f"fit's batch {batch} of epoch {self._epoch}"
            if self.diagnosis is None:
                print(f"NaN doctor: {what} at {where}, but the batch is finite when re-run", flush=True)
            else:
                print(f"NaN doctor: {what} at {where}.\n{self.diagnosis}", flush=True)

    def _run(self, step: int) -> Diagnosis | None:
        data = self._fit_data
        if data is None:
            return None
        if isinstance(data, dict):
            kwargs = dict(y=data["y"], sample_weight=data["sample_weight"], batch_size=data["batch_size"])
            data = data["x"]
            if kwargs["y"] is None and kwargs["sample_weight"] is None and isinstance(data, (tuple, list)):
                data = (tuple(data),)  # fit's x=(a, b, c) is one multi-input x, not (x, y, sample_weight)
        else:
            kwargs = {}
        index = self._steps - 1  # the failing step, counted from fit's start
        trained = self._tapped.get(index)
        found = None
        if trained is not None:  # the rows fit shuffled into this step, as it trained on them
            found = diagnose(self.model, iter([trained]), self.loss, losses_before=self._losses)
            if found is not None:
                found = replace(found, batch=step)
        elif not self._shuffled:  # the step's own batch first (fit's order), then a scan from the start
            found = diagnose(self.model, data, self.loss, skip_batches=step, max_batches=1,
                             losses_before=self._losses, **kwargs)
        if found is not None:
            found = replace(found, epoch=self._epoch)
            return self._verify_run(found, data, kwargs, index)
        # Not the step's batch (fit shuffled rows the doctor could not see, or it is finite
        # when re-run): the first non-finite batch of the data, in order.
        return diagnose(self.model, data, self.loss, losses_before=self._losses, **kwargs)

    def _verify_run(self, found: Diagnosis, data, kwargs, index: int) -> Diagnosis:
        """A divergence's remedy re-run over fit's steps from the earliest state kept."""
        if found.cause != "divergence" or found.dtype in LOW_PRECISION:
            return found
        try:
            steps = self._steps_to(data, kwargs, index)
            if steps is None:
                return found
            capsule = getattr(found, "_capsule", None) or {}
            x, y, w = capsule.get("batch", (None, None, None))
            return verify(found, self.model, None, x, y, w, steps=steps)
        except Exception as error:  # the doctor never raises into fit: the check is said to have failed
            return replace(found, verified=f"not verified: the re-run of fit's steps failed "
                                           f"({type(error).__name__}: {error})"[:300])

    def _steps_to(self, data, kwargs, index: int) -> Steps | None:
        """fit's steps from the earliest state kept to step ``index``, with their batches."""
        variables = self._functions.variables
        if self._shuffled:
            first, start = 0, self._start
            if any(self._tapped.get(i) is None for i in range(index + 1)):  # only this epoch's are kept
                first, start = self._epoch_first, self._epoch_start
            known = [self._tapped.get(i) for i in range(first, index + 1)]
            if start is None or any(b is None for b in known):
                return None
            origin = "the start of fit" if first == 0 else (
                f"the start of epoch {self._epoch} (fit shuffled the rows; the doctor kept this epoch's batches)")

            def shuffled():
                for batch in known:
                    yield _unpack(batch)

            return Steps(variables, list(start), shuffled, len(known), origin)
        if isinstance(data, tf.data.Dataset) or isinstance(data, keras.utils.PyDataset):
            again = " (the dataset read again)"  # one that reshuffles gives another order
        elif _is_arrays(data):
            again = ""
        else:  # a generator: reading it again would take batches from fit
            return None
        origin, start, counts = "the start of fit", self._start, list(self._epoch_steps)
        if index + 1 > MAX_STEPS and self._epoch_start is not None:  # too long a re-run: from the epoch
            origin, start, counts = f"the start of epoch {self._epoch}", self._epoch_start, counts[-1:]
        if start is None:
            return None
        origin += again

        def in_order():
            for count in counts:  # each epoch: its first `count` batches, in order
                for number, batch in enumerate(batches(data, kwargs.get("y"), kwargs.get("sample_weight"),
                                                       kwargs.get("batch_size"))):
                    if number >= count:
                        break
                    yield batch

        return Steps(variables, list(start), in_order, sum(counts), origin)


def _extended(old: "_Functions", before: list, new: "_Functions", after: list) -> list:
    """``before`` (the values of ``old``'s variables) for ``new``'s variables.

    The variables the first step created (an optimizer's, built by its first
    ``apply``) had their initial values before it: 0 for the iteration count and the
    slots (momentum, velocity: Keras creates them as zeros); a loss scale or a learning
    rate keeps its value now (after a non-finite step a dynamic loss scale is halved).
    """
    known = {id(v): value for v, value in zip(old.variables, before)}
    values = []
    for variable, value in zip(new.variables, after):
        if id(variable) in known:
            values.append(known[id(variable)])
            continue
        name = str(getattr(variable, "path", None) or getattr(variable, "name", "")).lower()
        keeps = "scale" in name or "learning_rate" in name
        values.append(value if keeps else tf.zeros_like(value))
    return values


#: The most bytes of fit's shuffled batches the doctor keeps (beyond: the epoch's, then the step's own only).
MAX_KEPT_BYTES = 64 * 2**20


def _is_arrays(x) -> bool:
    """Whether ``x`` is what Keras' array adapter takes (and so shuffles): arrays, nested."""
    leaves = tf.nest.flatten(x)
    return bool(leaves) and all(isinstance(v, (np.ndarray, tf.Tensor)) or hasattr(v, "__array__") for v in leaves)


def _as_float(value) -> float:
    try:
        return float(np.asarray(value, dtype=np.float64).reshape(-1)[0]) if np.size(value) else float("nan")
    except (TypeError, ValueError):
        return float("nan")


def _nonfinite_logs(logs) -> list[str]:
    """The names of the numeric logged values that hold a NaN or an Inf."""
    bad = []
    for name, value in (logs or {}).items():
        try:
            array = np.asarray(value)
        except Exception:  # pragma: no cover - a value NumPy cannot read: not a number
            continue
        if array.dtype.kind in "fc" and array.size and not np.all(np.isfinite(array)):
            bad.append(str(name))
    return bad


class _Functions:
    """The compiled copy, check and assignment of everything a step may write."""

    def __init__(self, model) -> None:
        self.variables = [v for v in step_variables(model) if not _is_random_state(v)]
        self.count = len(self.variables)
        # Checked: the model's own floating-point variables (a NaN that an optimizer slot
        # holds reaches them in the same step); copied: everything, for an exact restore.
        own = {id(v) for v in model.variables}
        floating = [i for i, v in enumerate(self.variables) if tf.as_dtype(v.dtype).is_floating and id(v) in own]
        variables = self.variables

        def copy():
            return [tf.raw_ops.DeepCopy(x=v.value) for v in variables]

        def check_and_copy():
            values = [tf.raw_ops.DeepCopy(x=v.value) for v in variables]
            return all_finite([values[i] for i in floating]), values

        def finite(values):
            return all_finite([values[i] for i in floating])

        self.copy = tf.function(copy, autograph=False)
        self._check_and_copy = tf.function(check_and_copy, autograph=False)
        self.finite = tf.function(finite, autograph=False)
        self.finite_now = tf.function(lambda: all_finite([variables[i].value for i in floating]), autograph=False)

    def check_and_copy(self) -> tuple[bool, list]:
        ok, values = self._check_and_copy()
        return bool(ok), values

    def stale(self, model, steps: int) -> bool:
        """After the first step, whether the step created variables (an optimizer's)."""
        return steps == 0 and len([v for v in step_variables(model) if not _is_random_state(v)]) != self.count

    def assign(self, values) -> None:
        for variable, value in zip(self.variables, values):
            variable.assign(value)


def _is_random_state(variable) -> bool:
    return any(variable is state for state in _internal.global_random_states())


#: The compiled copy and checks of each model, kept while its variables are the same, so
#: that a new NaNDoctor on each ``fit`` call does not trace them again.
_FUNCTIONS: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def _functions(model) -> _Functions:
    """The :class:`_Functions` of ``model``'s current variables (cached)."""
    key = tuple(id(v) for v in step_variables(model))
    try:
        cached = _FUNCTIONS.get(model)
    except TypeError:  # pragma: no cover - a model that cannot be weakly referenced
        cached = None
    if cached is not None and cached[0] == key:
        return cached[1]
    functions = _Functions(model)
    try:
        _FUNCTIONS[model] = (key, functions)
    except TypeError:  # pragma: no cover
        pass
    return functions
