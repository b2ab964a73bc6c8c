"""The worker script of the book's chapter *Training across machines*.

Package data, not a module of companion (nothing imports it): the chapter copies it to a
working directory and starts it on two workers, as

    python -m companion.launch --workers 2 multiworker_train.py OUT MODE

OUT is a directory for the results (``worker-<i>.json``) and the checkpoints; MODE is
``crash`` (train two epochs, then worker 1 is killed) or ``resume`` (train to epoch 4
from the checkpoints, then on data with a NaN in worker 1's half of a batch, then Keras'
own ``model.fit`` on the same cluster).
"""
import json, os, pathlib, signal, socket, sys, time

import keras
import numpy as np
import tensorflow as tf

from companion.training import NonFiniteError, WorkerLostError, train

out, mode = sys.argv[1], sys.argv[2]
tf.config.experimental.enable_op_determinism()
strategy = tf.distribute.MultiWorkerMirroredStrategy()  # no options
worker = strategy.cluster_resolver.task_id

rng = np.random.default_rng(0)
x = rng.normal(size=(256, 3)).astype("float32")
y = x @ np.array([[1.0], [2.0], [-1.0]], "float32")
decode = lambda a: (time.sleep(0.02), a)[1]  # Python work, as decoding files
slow = lambda a: tf.ensure_shape(tf.py_function(decode, [a], tf.float32),
                                 a.shape)
batches = lambda x: (tf.data.Dataset.from_tensor_slices((x, y))
                     .batch(32).map(lambda a, b: (slow(a), b)))  # global: 32

keras.utils.set_random_seed(0)
with strategy.scope():
    model = keras.Sequential([keras.Input((3,)),
                              keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(1)])
    optimizer = keras.optimizers.Adam(0.02)
fit = lambda data, epochs, **options: train(
    model, data, loss="mse", optimizer=optimizer, epochs=epochs,
    jit_compile=False, **options)
checkpoints = os.path.join(out, "checkpoints")
result = {"worker": worker, "replicas": strategy.num_replicas_in_sync,
          "interfaces": [name for _, name in socket.if_nameindex()]}
save = lambda: pathlib.Path(out, f"worker-{worker}.json").write_text(
    json.dumps(result))

if mode == "crash":
    fit(batches(x), 2, checkpoint_dir=checkpoints, verbose=2)  # epochs 1, 2
    if worker == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # worker 1 dies
try:
    history = fit(batches(x), 4, checkpoint_dir=checkpoints, verbose=2)
except WorkerLostError as error:
    result["error"] = {"type": type(error).__name__, "epoch": error.epoch,
                       "message": str(error),
                       "checkpoint": os.path.basename(error.checkpoint)}
    save()
    raise
result["history"] = history.to_json()
result["weights"] = [w.tolist() for w in model.get_weights()]

x[32 + 20, 0] = np.nan  # batch 1, example 20: in worker 1's half
result["skipped"] = fit(batches(x), 1, verbose=0).skipped
try:
    fit(batches(x), 1, verbose=0, on_nonfinite="raise")
except NonFiniteError as error:
    result["raised"] = f"{type(error).__name__} at step {error.step}"
result["finite"] = all(np.isfinite(w).all().item()
                       for w in model.get_weights())

with strategy.scope():  # Keras' own fit, on the same cluster and model
    model.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse")
try:
    model.fit(batches(np.nan_to_num(x)), epochs=1, verbose=0)
    result["fit"] = "model.fit ran"
except Exception as error:
    result["fit"] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
save()
# After model.fit's error, TensorFlow's shutdown can wait for ever on the
# coordination service (the chief's did, here): leave without it.
os._exit(0)
