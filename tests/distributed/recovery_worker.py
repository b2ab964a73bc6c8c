"""One worker of the multi-worker recovery tests (tests/distributed/test_training_recovery_distributed.py).

Started by :func:`companion.launch.launch` with ``TF_CONFIG`` set; writes what it saw to
``<out>/worker-<task>.json``. Two runs on ``MultiWorkerMirroredStrategy``, the models and
data of tests/unit/test_training_recovery.py, global batches split between the workers:

- ``rollback``: the tanh MLP with SGD(0.3, momentum 0.9), two epochs, ``on_nonfinite="rollback"``;
- ``spikes``: the small MLP with Adam(3e-3), one epoch of the data with two outlier batches,
  ``skip_loss_spikes=6``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import numpy as np
import tensorflow as tf

import keras

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
options = parser.parse_args()

tf.config.experimental.enable_op_determinism()
strategy = tf.distribute.MultiWorkerMirroredStrategy()
task = strategy.cluster_resolver.task_id

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "unit"))
from test_training_recovery import BATCH, SPIKE_BATCH, mlp, regression, sgd, small_mlp, spiky_data  # noqa: E402

from companion.training import train  # noqa: E402


def finite(model) -> bool:
    return all(np.isfinite(w).all() for w in model.get_weights())


def state(model, history) -> dict:
    return {"weights": [w.tolist() for w in model.get_weights()], "history": history.to_json(),
            "finite": finite(model), "skipped": history.skipped, "spikes": history.spikes,
            "reasons": sorted({r.reason for r in history.reports})}


result = {"task": task, "replicas": strategy.num_replicas_in_sync}
x, y = regression()
with strategy.scope():
    model, optimizer = mlp(), sgd(0.3)
history = train(model, tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH), loss="mse", optimizer=optimizer,
                epochs=2, on_nonfinite="rollback", verbose=0, jit_compile=False)
result["rollback"] = {
    **state(model, history),
    "rollbacks": [{"step": r.step, "restored_step": r.restored_step, "learning_rate": r.learning_rate,
                   "scale": r.scale} for r in history.rollbacks],
    "rate": float(tf.convert_to_tensor(optimizer.learning_rate).numpy()),
}

xs, ys = spiky_data()
with strategy.scope():
    model, optimizer = small_mlp(), keras.optimizers.Adam(3e-3)
history = train(model, tf.data.Dataset.from_tensor_slices((xs, ys)).batch(SPIKE_BATCH), loss="mse",
                optimizer=optimizer, epochs=1, skip_loss_spikes=6, verbose=0, jit_compile=False)
result["spikes"] = state(model, history)

with open(os.path.join(options.out, f"worker-{task}.json"), "w") as file:
    json.dump(result, file)
sys.exit(0)
