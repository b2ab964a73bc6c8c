"""The guarded step's records, read on the host: what a run's history holds of each step.

The traced step (:mod:`companion.training.step`) writes one row per step into a small
buffer of variables (columns :data:`LOSS`, :data:`NORM`, :data:`APPLIED`, :data:`SCALE`,
:data:`SPIKE`, :data:`TESTED`, and the NaN/Inf counts of each gradient of a skipped step); after every host call
:class:`~companion.training.callbacks.GuardCallback` drains it and
:func:`append_records` turns the rows into the :class:`TrainingHistory`: losses, norms,
loss scales, and a :class:`SkippedStep` with its diagnosis for each skipped step.
:func:`nonfinite_error` words the error a run of skipped steps ends with, and
:class:`DoctorView` is what the NaN doctor reads of the run.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np

from companion.diagnostics.gradients import GradientRecord, GradientReport
from companion.training.results import NonFiniteError, SkippedStep, TrainingHistory

#: Columns of a step record (``SPIKE``: skipped as a loss spike; ``TESTED``: the deferred
#: update took the tested path, after which the host measures the update's bounds again).
LOSS, NORM, APPLIED, SCALE, SPIKE, TESTED = range(6)
#: How many columns a step record has.
COLUMNS = 6


def append_records(history: TrainingHistory, records, counts, variables, *, epoch: int, loss_scaled: bool,
                   diagnose: Callable[[int], Any] | None = None) -> list[float]:
    """Append one host call's step records to ``history``; the applied steps' losses.

    Args:
        history: the run's :class:`TrainingHistory`.
        records: the drained rows, one per step (columns :data:`LOSS`, :data:`NORM`,
            :data:`APPLIED`, :data:`SCALE`, :data:`SPIKE`).
        counts: per step, the NaN and Inf counts of each variable's gradient, or ``None``
            when every step was applied.
        variables: the trainable variables the counts are of.
        epoch: the epoch the steps belong to.
        loss_scaled: whether a dynamic loss scale was recorded.
        diagnose: called with the index of the run's first non-finite step, for its
            diagnosis (the NaN doctor runs once per run; never on a loss spike).
    """
    applied_losses = []
    diagnosed = any(r.reason == "nonfinite" for r in history.reports)
    for k, row in enumerate(records):
        index = history.steps
        loss, norm, applied = float(row[LOSS]), float(row[NORM]), row[APPLIED] > 0.5
        history.step_loss.append(loss)
        history.grad_norm.append(norm)
        scale = float(row[SCALE]) if loss_scaled else None
        if scale is not None:
            history.loss_scale.append(scale)
        if applied:
            applied_losses.append(loss)
            continue
        history.skipped.append(index)
        reason = "spike" if len(row) > SPIKE and row[SPIKE] > 0.5 else "nonfinite"
        nan_counts, inf_counts = counts[k] if counts is not None else (np.zeros(0), np.zeros(0))
        gradients = [
            GradientRecord(
                path=str(v.path), shape=tuple(int(d) for d in v.shape), nan_count=int(nan_counts[i]),
                inf_count=int(inf_counts[i]), max_abs=None,
            )
            for i, v in enumerate(variables)
            if i < len(nan_counts) and (nan_counts[i] or inf_counts[i])
        ]
        # The NaN doctor, once per run: on the first non-finite step only (on every
        # worker: the hook's exchange is a collective every worker must join).
        diagnosis = None
        if reason == "nonfinite" and not diagnosed and diagnose is not None:
            diagnosis, diagnosed = diagnose(index), True
        history.reports.append(
            SkippedStep(
                step=index, epoch=epoch, loss=loss, gradients=GradientReport(gradients),
                loss_scale=scale, grad_norm=norm, diagnosis=diagnosis, reason=reason,
            )
        )
    return applied_losses


def nonfinite_error(history, consecutive, limit, on_nonfinite, loss_scaled, *, last: int | None = None,
                    end: str | None = None, diagnosis=None) -> NonFiniteError:
    """The :class:`NonFiniteError` for the last ``consecutive`` skipped steps (those up to
    step ``last``, if given); ``end`` replaces the sentence on the state left in place."""
    reports = [r for r in history.reports if last is None or r.step <= last]
    reports = tuple(reports[-consecutive:])
    last = reports[-1]
    if on_nonfinite == "raise":
        head = f"non-finite loss or gradients at step {last.step} (epoch {last.epoch}) with on_nonfinite='raise'"
    else:
        head = (
            f"{consecutive} consecutive steps with non-finite loss or gradients "
            f"(max_consecutive_nonfinite={limit}), the last at step {last.step} (epoch {last.epoch})"
        )
    if last.gradients:
        variables = ", ".join(f"{r.path} ({r.nan_count} NaN, {r.inf_count} Inf)" for r in last.gradients)
        detail = f"loss {last.loss:.6g}; non-finite gradients in {variables}"
    else:
        detail = f"loss {last.loss:.6g}; {last.cause()}"
    if loss_scaled and reports[0].loss_scale is not None:
        detail += f"; loss scale {reports[0].loss_scale:g} -> {last.loss_scale:g}"
    good = reports[0].step - 1
    state = f"after step {good}" if good >= 0 else "at the start of training"
    if end is None:
        end = f"No update was applied on these steps: the weights and optimizer state are those {state}."
    if diagnosis is None:  # the NaN doctor's, of the run's first non-finite step
        diagnosis = next((r.diagnosis for r in history.reports if r.diagnosis is not None), None)
    return NonFiniteError(
        f"{head}: {detail}. {end}",
        step=last.step,
        epoch=last.epoch,
        reports=reports,
        history=history,
        diagnosis=diagnosis,
    )


class DoctorView:
    """What :func:`companion.diagnostics.hooks.diagnose_skipped_step` reads of a run.

    Args:
        model: the model being trained.
        strategy: its distribution strategy.
        history: the run's :class:`TrainingHistory` (``epoch_steps`` locates the batch).
        replay: a function returning an epoch's batches in ``fit``'s order (see
            :func:`companion.training.inputs.replay_batches`) or ``None``; called once,
            at the first skipped step, as :attr:`distributed`.
        cluster: the :class:`~companion.training.cluster.Cluster`, or ``None``.
        verbose: whether the diagnosis is printed.
        shuffled: whether ``fit`` shuffled the rows of the arrays it was given (the
            replay then holds the epoch's rows unshuffled, not the step's batch).

    Its ``optimizer`` is the model's (compiled by then): the doctor restores its
    variables too.
    """

    def __init__(self, model, strategy, history, replay, cluster=None, *, verbose: bool = False,
                 shuffled: bool = False) -> None:
        self.model, self.strategy, self.history, self.cluster = model, strategy, history, cluster
        self.verbose, self.shuffled = verbose, shuffled
        self._replay = replay

    @property
    def optimizer(self):
        return getattr(self.model, "optimizer", None)

    @functools.cached_property
    def distributed(self):
        """An epoch's batches, or ``None`` if the inputs cannot be read again."""
        return self._replay()
