"""Epoch-end checkpoints of :func:`companion.training.train`: model, optimizer, the
number of completed epochs and the history, so that a resumed run ends with the same
weights as an uninterrupted one (chapter *Training across machines*).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import tensorflow as tf

from companion.training.results import TrainingHistory

if TYPE_CHECKING:
    from companion.training.cluster import Cluster


class _LoopState(tf.train.experimental.PythonState):
    """The loop's own state in the checkpoint: completed epochs and the history (as JSON)."""

    def __init__(self) -> None:
        self.epochs_done = 0
        self.history = TrainingHistory()

    def serialize(self) -> str:
        return json.dumps({"epochs_done": self.epochs_done, "history": self.history.to_json()})

    def deserialize(self, string) -> None:
        data = json.loads(string.decode() if isinstance(string, bytes) else string)
        self.epochs_done = int(data["epochs_done"])
        self.history = TrainingHistory.from_json(data["history"])


class TrainingCheckpoint:
    """Model, optimizer, completed-epoch counter and history, saved at epoch ends.

    A ``tf.train.Checkpoint`` with the children ``model``, ``optimizer`` (the loss-scale
    wrapper, if any, with the inner optimizer inside), ``model_variables`` (every model
    variable by position, including those Keras does not expose to
    ``tf.train.Checkpoint``, such as the seed-generator state of ``Dropout``) and
    ``loop`` (completed epochs and the :class:`TrainingHistory` as JSON), managed by a
    ``tf.train.CheckpointManager`` that keeps the last two.
    """

    def __init__(self, directory, model, optimizer, cluster: "Cluster | None" = None) -> None:
        self.directory = os.fspath(directory)
        # Under a multi-worker strategy every worker saves (saving may run collective
        # ops), but only the chief writes to ``directory``; the others write to a
        # directory of their own, deleted after each save (as TensorFlow's multi-worker
        # tutorial does). Every worker restores from ``directory``.
        self.scratch = None
        if cluster is not None and not cluster.is_chief:
            self.scratch = os.path.join(self.directory, f".worker-{cluster.task_id}-tmp")
            remove_tree(self.scratch)  # left by a worker that died while saving
        self.loop = _LoopState()
        self.checkpoint = tf.train.Checkpoint(
            model=model,
            optimizer=optimizer,
            model_variables=list(model.variables),
            loop=self.loop,
        )
        self.manager = tf.train.CheckpointManager(self.checkpoint, self.directory, max_to_keep=2)

    def restore(self) -> tuple[int, TrainingHistory] | None:
        path = self.manager.latest_checkpoint
        if path is None:
            return None
        try:
            status = self.checkpoint.restore(path)
            status.expect_partial()  # no deletion-time warnings if it does not match
            status.assert_existing_objects_matched()
        except (AssertionError, ValueError, tf.errors.OpError) as err:
            raise ValueError(
                f"the checkpoint in {self.directory!r} does not match this model and optimizer ({err}); "
                "use another checkpoint_dir or the model and optimizer it was written for"
            ) from None
        return self.loop.epochs_done, self.loop.history

    def save(self, epochs_done: int, history: TrainingHistory) -> None:
        self.loop.epochs_done = epochs_done
        self.loop.history = history
        if self.scratch is None:
            self.manager.save(checkpoint_number=epochs_done)
        else:
            tf.train.CheckpointManager(self.checkpoint, self.scratch, max_to_keep=1).save(checkpoint_number=epochs_done)
            remove_tree(self.scratch)

    @property
    def latest(self) -> str | None:
        """Path prefix of the latest checkpoint in the directory, if any."""
        return self.manager.latest_checkpoint


def remove_tree(path: str) -> None:
    if tf.io.gfile.exists(path):
        tf.io.gfile.rmtree(path)
