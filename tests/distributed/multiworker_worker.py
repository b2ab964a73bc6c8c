"""One worker of the multi-worker tests (tests/distributed/test_training_multiworker.py).

Started by :func:`companion.launch.launch` with ``TF_CONFIG`` set; writes what it saw
to ``<out>/<scenario>-worker-<task>.json``. Scenarios:

Runs are without XLA (to save compile time; the skip logic is the same), except the
poisoned run and ``--jit``.

- ``main``: a clean run (4 epochs), a run with a NaN in the part of batch 1 that only
  worker 1 receives, a run whose square root at 0 in worker 1's part of batch 1 the NaN
  doctor diagnoses, the NaN run with ``on_nonfinite="raise"``, keras.io's GAN (two
  optimizers of its own) with a NaN in worker 1's part of batch 1 and its twin trained
  on batch 0 only, then the cluster's all-reduce of 1, 3 and 1024 values;
- ``clean``: the clean run only;
- ``die``: the clean run with ``checkpoint_dir``; worker ``--die-worker`` kills itself
  (SIGKILL, no clean-up) when its input pipeline reaches batch ``--die-at-batch``;
- ``resume``: the clean run again with the same ``checkpoint_dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import sys
import time

import numpy as np
import tensorflow as tf

import keras
from companion.training import NonFiniteError, WorkerLostError, train

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--scenario", choices=["main", "clean", "die", "resume"], required=True)
parser.add_argument("--checkpoint-dir")
parser.add_argument("--die-worker", type=int, default=1)
parser.add_argument("--die-at-batch", type=int, default=20)
parser.add_argument("--die-by", choices=["SIGKILL", "SIGSTOP"], default="SIGKILL",
                    help="SIGSTOP: the worker stops responding without dying")
parser.add_argument("--collective-timeout", type=float, default=None,
                    help="CommunicationOptions(timeout_seconds=...); default: the strategy people create, no options")
parser.add_argument("--sleep-per-batch", type=float, default=0.0,
                    help="seconds of Python work per batch in the input pipeline (as decoding with a Python library)")
parser.add_argument("--jit", action="store_true", help="XLA for the clean run too (the poisoned run always uses it)")
options = parser.parse_args()

EPOCHS, BATCH, BATCHES = 4, 8, 8
tf.config.experimental.enable_op_determinism()
if options.collective_timeout is None:
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
else:
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(timeout_seconds=options.collective_timeout)
    )
task = strategy.cluster_resolver.task_id

rng = np.random.default_rng(0)
X = rng.normal(size=(BATCH * BATCHES, 3)).astype("float32")
Y = (X @ np.array([[1.0], [2.0], [-1.0]], "float32")).astype("float32")
# Global batch 8 over two workers: worker 0 gets rows 0-3 of each batch, worker 1 rows 4-7.
X_POISONED = X.copy()
X_POISONED[BATCH + 6, 0] = np.nan

X_ROOT = np.linspace(1.0, 2.0, BATCH * BATCHES, dtype="float32")[:, None]
X_ROOT[BATCH + 6] = 0.0  # the square root's derivative is infinite there: worker 1's part of batch 1


class Root(keras.layers.Layer):
    def build(self, shape):
        self.w = self.add_weight(shape=(), initializer="ones", name="w")

    def call(self, x):
        return tf.sqrt(self.w * x)


batches_read = []  # global batches this process's input pipeline produced


def count_batches(x):
    batches_read.append(time.time())
    if options.sleep_per_batch:
        time.sleep(options.sleep_per_batch)
    if options.scenario == "die" and task == options.die_worker and len(batches_read) == options.die_at_batch:
        print(f"{options.die_by} to myself at batch {len(batches_read)}", flush=True)
        with open(os.path.join(options.out, f"died-at-{task}"), "w") as file:
            file.write(repr(time.time()))
        os.kill(os.getpid(), getattr(signal, options.die_by))
    return x


def dataset(x, counted=False):
    data = tf.data.Dataset.from_tensor_slices((x, Y)).batch(BATCH)
    if counted:
        data = data.map(lambda a, b: (tf.ensure_shape(tf.py_function(count_batches, [a], tf.float32), a.shape), b))
    return data


def model_and_optimizer():
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
        return model, keras.optimizers.Adam(0.05)


def weights(model):
    return [w.tolist() for w in model.get_weights()]


result = {"task": task, "replicas": strategy.num_replicas_in_sync}
started = time.time()
if options.scenario in ("main", "clean"):
    model, optimizer = model_and_optimizer()
    history = train(model, dataset(X), loss="mse", optimizer=optimizer, epochs=EPOCHS, verbose=0,
                    jit_compile=options.jit)
    result["clean"] = {"history": history.to_json(), "weights": weights(model), "xla": history.xla,
                       "iterations": int(optimizer.iterations.numpy())}
if options.scenario == "main":
    result["nan_in_my_part"] = [
        bool(np.isnan(tf.concat(strategy.experimental_local_results(xb), 0).numpy()).any())
        for xb, _ in strategy.experimental_distribute_dataset(dataset(X_POISONED).take(2))
    ]
    model, optimizer = model_and_optimizer()
    history = train(model, dataset(X_POISONED), loss="mse", optimizer=optimizer, epochs=2, verbose=0)
    result["poisoned"] = {"history": history.to_json(), "weights": weights(model), "xla": history.xla,
                          "iterations": int(optimizer.iterations.numpy())}

    # The NaN doctor: a square root at 0 in the part of batch 1 that only worker 1 receives.
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,)), Root(name="root"), keras.layers.Dense(1)], name="net")
        optimizer = keras.optimizers.SGD(1e-3)
    history = train(model, tf.data.Dataset.from_tensor_slices((X_ROOT, Y)).batch(BATCH), loss="mse",
                    optimizer=optimizer, epochs=1, verbose=0, jit_compile=False)
    result["doctor"] = {"history": history.to_json(), "weights": weights(model),
                        "iterations": int(optimizer.iterations.numpy())}

    model, optimizer = model_and_optimizer()
    try:
        train(model, dataset(X_POISONED), loss="mse", optimizer=optimizer, on_nonfinite="raise", verbose=0,
              jit_compile=False)
        result["raised"] = None
    except NonFiniteError as error:
        result["raised"] = {"step": error.step, "epoch": error.epoch, "message": str(error),
                            "iterations": int(optimizer.iterations.numpy())}
    # keras.io's GAN (two optimizers of its own, tests/unit/test_training_custom_steps.py):
    # a NaN in worker 1's part of batch 1 skips the step on both workers, and the
    # skipped step changes nothing: [batch 0, poisoned batch 1] ends as [batch 0] does.
    tests = pathlib.Path(__file__).resolve().parents[1]  # its shared modules, and unit/ for the models
    sys.path[:0] = [str(tests), str(tests / "unit")]
    import test_training_custom_steps as steps

    gan_states = {}
    for run, batches in (("twin", 1), ("poisoned", 2)):
        with strategy.scope():
            gan, (images, _) = steps._make("gan")
            gan.built = True  # no call(): fit cannot build it symbolically under a strategy
        images = images[:32].copy()
        images[16 + 12] = np.nan  # row 12 of global batch 1: worker 1's half
        gan_history = train(gan, tf.data.Dataset.from_tensor_slices(images).batch(16).take(batches),
                            verbose=0, jit_compile=False)
        gan_states[run] = {"skipped": gan_history.skipped, "steps": gan_history.steps,
                           "diagnosed": [r.diagnosis is not None for r in gan_history.reports],
                           "state": {path: v.tolist() for path, v in steps.every_variable(gan).items()
                                     if not path.endswith("seed_generator_state")}}
    result["gan"] = gan_states

    # The all-reduce of every run above (the loop's one number, the doctor's three and
    # 512): one compiled function of the strategy, whatever the length, in every run.
    from companion.training.cluster import Cluster, _gather_function

    result["gather"] = {
        "rows": [Cluster(strategy).gather(*(1000.0 * task + np.arange(n))).tolist() for n in (1, 3, 1024)],
        "traces": int(_gather_function(strategy).experimental_get_tracing_count()),
    }
if options.scenario in ("die", "resume"):
    model, optimizer = model_and_optimizer()
    try:
        history = train(model, dataset(X, counted=True), loss="mse", optimizer=optimizer, epochs=EPOCHS,
                        checkpoint_dir=options.checkpoint_dir, verbose=0, jit_compile=options.jit)
    except WorkerLostError as error:
        result["lost"] = {"time": time.time(), "message": str(error), "epoch": error.epoch,
                          "checkpoint": error.checkpoint, "peers": list(error.peers),
                          "cause": type(error.__cause__).__name__}
        with open(os.path.join(options.out, f"{options.scenario}-worker-{task}.json"), "w") as file:
            json.dump(result, file)
        raise
    result["history"] = history.to_json()
    result["weights"] = weights(model)
    result["iterations"] = int(optimizer.iterations.numpy())
    result["batches_read"] = len(batches_read)
    result["files"] = sorted(os.listdir(options.checkpoint_dir))
result["seconds"] = time.time() - started
with open(os.path.join(options.out, f"{options.scenario}-worker-{task}.json"), "w") as file:
    json.dump(result, file)
sys.exit(0)
