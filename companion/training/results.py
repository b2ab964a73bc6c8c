"""What :func:`companion.training.train` returns and raises.

:class:`TrainingHistory` records every step (loss, gradient norm, whether it was
applied) and a :class:`SkippedStep` per skipped one; :class:`NonFiniteError` and
:class:`WorkerLostError` stop training with the history so far. All of them survive a
JSON round trip, which is how the history travels in checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import keras
import numpy as np

from companion.diagnostics.diagnosis import Diagnosis
from companion.diagnostics.gradients import GradientRecord, GradientReport

__all__ = ["NonFiniteError", "Rollback", "SkippedStep", "TrainingHistory", "WorkerLostError"]


class NonFiniteError(FloatingPointError):
    """Training stopped because of non-finite losses or gradients.

    Raised by :func:`train` at the first non-finite step when
    ``on_nonfinite="raise"``, or after ``max_consecutive_nonfinite`` consecutive
    non-finite steps when ``on_nonfinite="skip"``. None of these steps applied an
    update, so the model's weights and the optimizer's state are bit-identical to those
    after the last good step. With ``on_nonfinite="rollback"`` it is raised when the
    NaN doctor puts the cause in the data or a function's domain (no rollback then:
    the weights are those the applied steps left), or after ``max_rollbacks``
    rollbacks (the last good state restored first); the message says which.

    Attributes:
        step: index (0-based, counted over all epochs) of the last non-finite step.
        epoch: index (0-based) of its epoch.
        reports: the :class:`SkippedStep` records of the consecutive non-finite steps.
        history: the :class:`TrainingHistory` up to and including ``step``.
        diagnosis: with ``on_nonfinite="rollback"``, the NaN doctor's
            :class:`~companion.diagnostics.Diagnosis` of the first of these steps (or
            ``None``); else ``None``.
    """

    def __init__(
        self,
        message: str,
        *,
        step: int,
        epoch: int,
        reports: tuple[SkippedStep, ...] = (),
        history: TrainingHistory | None = None,
        diagnosis: Diagnosis | None = None,
    ) -> None:
        super().__init__(message)
        self.step = step
        self.epoch = epoch
        self.reports = tuple(reports)
        self.history = history
        self.diagnosis = diagnosis


@dataclasses.dataclass(frozen=True)
class SkippedStep:
    """One step that applied no update: its loss or gradients were not finite, or its
    loss was a spike (``train(..., skip_loss_spikes=z)``).

    Attributes:
        step: index of the step (0-based, counted over all epochs), i.e. its position
            in :attr:`TrainingHistory.step_loss`.
        epoch: index (0-based) of its epoch.
        loss: the step's loss (may itself be NaN or Inf).
        gradients: a :class:`~companion.diagnostics.GradientReport` of the variables
            whose gradient had NaN or Inf entries, with the counts; empty if only the
            loss was non-finite. Under a distribution strategy these are the
            gradients summed over replicas.
        loss_scale: the dynamic loss scale used in that step (mixed float16), else
            ``None``.
        diagnosis: on the first skipped step of a run, the NaN doctor's
            :class:`~companion.diagnostics.Diagnosis` of its batch (op, layer, line,
            cause, fix); ``None`` on the others, or if the NaN did not reproduce.
            Under several replicas its ``inputs_summary`` names the replica whose
            part of the batch made the NaN; with several workers every worker records
            the same diagnosis, whose ``worker`` is the worker whose shard made it.
            With ``on_nonfinite="rollback"``, also on the first step of each run of
            non-finite steps that reached ``max_consecutive_nonfinite``.
        reason: ``"nonfinite"`` (the loss, the gradients or a write were not finite)
            or ``"spike"`` (a finite loss more than ``skip_loss_spikes`` running
            standard deviations above its running mean).
    """

    step: int
    epoch: int
    loss: float
    gradients: GradientReport
    loss_scale: float | None = None
    grad_norm: float | None = None
    diagnosis: Diagnosis | None = None
    reason: str = "nonfinite"

    def __str__(self) -> str:
        scale = f", loss scale {self.loss_scale:g}" if self.loss_scale is not None else ""
        return f"step {self.step} (epoch {self.epoch}): loss {self.loss:.6g}{scale}; {self.cause()}"

    def cause(self) -> str:
        """Why the step was skipped, in words."""
        if self.reason == "spike":
            return "a loss spike: a finite loss far above the running mean of the applied steps' losses"
        if self.gradients:
            return "non-finite gradients: " + "; ".join(
                f"{r.path} ({r.nan_count} NaN, {r.inf_count} Inf of {_size(r.shape)})" for r in self.gradients
            )
        if self.grad_norm is not None and math.isinf(self.grad_norm) and math.isfinite(self.loss):
            return "all gradient entries finite, but their global norm overflows float32"
        return "non-finite loss; all gradients finite"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-compatible dict (used by the checkpoint)."""
        return {
            "step": self.step,
            "epoch": self.epoch,
            "loss": self.loss,
            "loss_scale": self.loss_scale,
            "grad_norm": self.grad_norm,
            "diagnosis": self.diagnosis.to_dict() if self.diagnosis is not None else None,
            "reason": self.reason,
            "gradients": [
                {field.name: getattr(r, field.name) for field in dataclasses.fields(r)} for r in self.gradients
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SkippedStep":
        """Inverse of :meth:`to_dict`."""
        records = [GradientRecord(**{**r, "shape": tuple(r["shape"])}) for r in data["gradients"]]
        return cls(
            step=int(data["step"]),
            epoch=int(data["epoch"]),
            loss=float(data["loss"]),
            gradients=GradientReport(records),
            loss_scale=data.get("loss_scale"),
            grad_norm=data.get("grad_norm"),
            diagnosis=Diagnosis.from_dict(data["diagnosis"]) if data.get("diagnosis") else None,
            reason=str(data.get("reason", "nonfinite")),  # records written before spikes were skipped
        )


@dataclasses.dataclass(frozen=True)
class Rollback:
    """One rollback of ``train(..., on_nonfinite="rollback")``: the last good state
    restored, and every optimizer's learning rate multiplied by ``rollback_lr_factor``.

    Attributes:
        step: the step (0-based, counted over all epochs) at which
            ``max_consecutive_nonfinite`` consecutive steps had been non-finite.
        restored_step: the step whose starting state was restored: the weights and
            optimizer state as they were before step ``restored_step`` ran
            (a snapshot taken at the start of an epoch).
        learning_rate: the model optimizer's learning rate after the rollback (for a
            schedule, its value at the restored iteration).
        epoch: the epoch (0-based) of ``step``.
        scale: what every learning rate is multiplied by since the run began
            (``rollback_lr_factor`` to the power of the rollbacks so far); a resumed
            run applies it again to a schedule.
        cause: the NaN doctor's cause for the first step of the run of non-finite
            steps (a name of ``companion.diagnostics.CAUSES``), or ``None``.
    """

    step: int
    restored_step: int
    learning_rate: float
    epoch: int = 0
    scale: float = 1.0
    cause: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-compatible dict (used by the checkpoint)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Rollback":
        """Inverse of :meth:`to_dict`."""
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def _plain(value):
    """A log value as JSON can hold it (a non-scalar metric as a list)."""
    array = np.asarray(value)
    if array.ndim == 0:
        return array.item() if array.dtype.kind in "biuf" else value
    return array.tolist()


def _size(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) if shape else 1


@dataclasses.dataclass(eq=False)
class TrainingHistory(keras.callbacks.History):
    """What :func:`train` did, step by step; also the ``keras.callbacks.History`` of the run.

    ``train`` returns it where ``fit`` returns its ``History``, and it is one: ``.history``
    (the logs of every epoch, with exactly ``fit``'s keys), ``.epoch`` (the epoch
    indices run) and ``.params`` (``verbose``, ``epochs``, ``steps``) are ``fit``'s, and
    ``model.history`` is this object. Skipped steps are reported here, never in the logs.

    All step indices are 0-based and count over all epochs, so ``step_loss[i]`` and
    ``grad_norm[i]`` describe step ``i`` and ``skipped`` lists positions in them.

    Attributes:
        step_loss: the loss of every step, applied or skipped (a skipped step's loss
            may be NaN or Inf).
        grad_norm: the global gradient norm of every step, before clipping.
        skipped: indices of the steps that applied no update (non-finite, or a loss
            spike).
        reports: one :class:`SkippedStep` per skipped step: why (``reason``), which
            variables had NaN or Inf gradients, and how many entries.
        rollbacks: one :class:`Rollback` per rollback of
            ``on_nonfinite="rollback"``: the failing step, the restored step, the
            learning rate after it.
        epoch_loss: per completed epoch, the mean loss of its applied steps (NaN if
            none was applied).
        epoch_steps: per completed epoch, the number of steps.
        loss_scale: with dynamic loss scaling (a ``mixed_float16`` model, or a
            :class:`keras.optimizers.LossScaleOptimizer`), the loss scale used in each
            step; empty otherwise.
        loss_scale_stalled: ``True`` once the dynamic loss scale fell to 1 or below:
            the non-finite gradients were then not an overflow that a smaller scale can
            fix (a warning is issued at the same time).
        xla: whether the steps ran XLA-compiled (``None`` before the first step).
        history: per completed epoch, the logs ``model.fit`` records in its
            :class:`keras.callbacks.History`: ``loss`` (the batch-size-weighted mean of
            the applied steps' losses), each metric, ``val_`` entries with
            ``validation_data``, and whatever callbacks add (e.g. ``learning_rate``);
            the same keys as ``fit``'s.
        epoch: the indices of the epochs run, as ``History.epoch`` (with a checkpoint,
            the restored epochs too).
        update: how the last step's update was compiled (``None`` before the first
            step): ``"masked"`` (every variable write of the update selects between the
            new and the old value, fused into the update under XLA), ``"whole"`` (the
            update under a conditional, e.g. with a loss scaler or an update that cannot
            be masked), ``"graph"`` (several replicas, or no XLA), or ``"unguarded"``
            (``on_nonfinite="ignore"``). The results are the same; only the speed
            differs (chapter *A training loop that survives NaN*).
    """

    step_loss: list[float] = dataclasses.field(default_factory=list)
    grad_norm: list[float] = dataclasses.field(default_factory=list)
    skipped: list[int] = dataclasses.field(default_factory=list)
    reports: list[SkippedStep] = dataclasses.field(default_factory=list)
    rollbacks: list[Rollback] = dataclasses.field(default_factory=list)
    epoch_loss: list[float] = dataclasses.field(default_factory=list)
    epoch_steps: list[int] = dataclasses.field(default_factory=list)
    loss_scale: list[float] = dataclasses.field(default_factory=list)
    loss_scale_stalled: bool = False
    xla: bool | None = None
    update: str | None = None
    history: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    epoch: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        # keras.callbacks.Callback's own state (History.__init__ would reset .history).
        self.params = None
        self._model = None

    def on_train_begin(self, logs=None):
        """As ``History``, but the epochs restored from a checkpoint stay recorded."""
        self.epoch = list(self.epoch)

    @property
    def steps(self) -> int:
        """Number of steps run (applied or skipped)."""
        return len(self.step_loss)

    @property
    def epochs(self) -> int:
        """Number of completed epochs."""
        return len(self.epoch_loss)

    @property
    def spikes(self) -> list[int]:
        """Indices of the steps skipped as loss spikes (``skip_loss_spikes``)."""
        return [r.step for r in self.reports if r.reason == "spike"]

    def trailing_nonfinite(self) -> int:
        """Number of consecutive non-finite steps at the end of the history (a step
        skipped as a loss spike was finite: it ends the run, as an applied step does)."""
        count, expected = 0, self.steps - 1
        for k, index in enumerate(reversed(self.skipped)):
            report = self.reports[-1 - k] if k < len(self.reports) else None  # one report per skipped step
            if index != expected or (report is not None and report.step == index and report.reason != "nonfinite"):
                break
            count, expected = count + 1, expected - 1
        return count

    def to_json(self) -> str:
        """The history as a JSON string (NaN and Inf are written as JavaScript literals)."""
        data = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        data["history"] = {k: [_plain(v) for v in values] for k, values in self.history.items()}
        data["reports"] = [r.to_dict() for r in self.reports]
        data["rollbacks"] = [r.to_dict() for r in self.rollbacks]
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> "TrainingHistory":
        """Inverse of :meth:`to_json`."""
        data = json.loads(text)
        data["reports"] = [SkippedStep.from_dict(r) for r in data["reports"]]
        data["rollbacks"] = [Rollback.from_dict(r) for r in data.get("rollbacks", [])]
        return cls(**data)

    def __str__(self) -> str:
        last = f", last epoch loss {self.epoch_loss[-1]:.6g}" if self.epoch_loss else ""
        return f"TrainingHistory({self.epochs} epochs, {self.steps} steps, {len(self.skipped)} skipped{last})"


class WorkerLostError(RuntimeError):
    """A worker of a multi-worker run lost a peer, so training stopped on this worker.

    Raised by :func:`train` under ``tf.distribute.MultiWorkerMirroredStrategy`` when a
    collective operation fails because another worker crashed, was stopped, became
    unreachable, or did not reach the collective within the strategy's collective
    timeout. TensorFlow then aborts every collective op of the process, so it cannot go
    on: restart all workers. With ``checkpoint_dir`` they resume after the last
    completed epoch; a failure during an epoch does not touch the checkpoints already
    written.

    Attributes:
        task: this worker's task, e.g. ``"worker 1"``.
        peers: the tasks TensorFlow named as the cause, e.g. ``("/job:worker/replica:0/task:0",)``
            (empty if it did not say, as for a timeout).
        epoch: index (0-based) of the epoch that was running.
        checkpoint: the latest checkpoint in ``checkpoint_dir`` (where a restart resumes),
            or ``None``.
        history: the :class:`TrainingHistory` up to the last steps that completed.
    """

    def __init__(
        self,
        message: str,
        *,
        task: str,
        peers: tuple[str, ...],
        epoch: int,
        checkpoint: str | None,
        history: TrainingHistory,
    ) -> None:
        super().__init__(message)
        self.task = task
        self.peers = tuple(peers)
        self.epoch = epoch
        self.checkpoint = checkpoint
        self.history = history
