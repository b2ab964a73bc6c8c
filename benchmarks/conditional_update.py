"""Cost of guarding an optimizer update with a ``tf.cond`` or with masked writes, under XLA.

One training step of the compute-bound MLP of ``training_overhead.py`` (1024 features,
two hidden layers of 1024, batch 256, Adam), compiled with XLA, in three forms:

* ``unguarded``: forward, backward, global gradient norm, ``optimizer.apply``;
* ``cond``: the same, with the update under ``tf.cond(isfinite(norm), apply, skip)``,
  the design ``companion.training.train`` used before its masked update;
* ``masked``: the update traced under ``companion.training.masking.masked_writes``,
  where every variable write is ``where(finite, new, old)`` (the design it uses now).

All three are timed in turn in every round, in one process, and each ratio is the median
of the per-round ratios. Usage::

    python benchmarks/conditional_update.py [--rounds 31] [--steps 10] [--quick] [--json auto]

``--quick`` (4 rounds of 2 steps of a 128-wide MLP: seconds) only checks that the benchmark
runs; its ratios are not the compute-bound model's.

The book's performance page reads the ``--json`` result ("about 10 %" for the
conditional is that ratio).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from _results import write_results

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from companion.training.masking import masked_writes  # noqa: E402


def make_step(kind: str, features: int = 1024, width: int = 1024):
    """A model, its Adam optimizer, and one XLA-compiled training step of ``kind``."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((features,)),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(width, activation="relu"),
        keras.layers.Dense(1),
    ])
    optimizer = keras.optimizers.Adam(1e-4)
    optimizer.build(model.trainable_variables)
    variables = model.trainable_variables

    def update(gradients):
        optimizer.apply(gradients, variables)

    @tf.function(jit_compile=True, autograph=False)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        gradients = tape.gradient(loss, variables)
        norm = tf.linalg.global_norm(gradients)
        finite = tf.math.is_finite(norm) & tf.math.is_finite(loss)
        if kind == "unguarded":
            update(gradients)
        elif kind == "cond":
            tf.cond(finite, lambda: (update(gradients), tf.constant(True))[1],
                    lambda: tf.constant(False))
        else:
            with masked_writes(finite):
                update(gradients)
        return loss, finite

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed run")
    parser.add_argument("--quick", action="store_true", help="4 rounds of 2 steps, 128 wide: a smoke test (seconds)")
    parser.add_argument("--json", metavar="PATH", help='also write the result as JSON ("auto": by CPU)')
    args = parser.parse_args()
    features = 1024
    if args.quick:
        args.rounds, args.steps, features = 4, 2, 128

    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(256, features)).astype("float32"))
    y = tf.constant(rng.normal(size=(256, 1)).astype("float32"))
    steps = {kind: make_step(kind, features, features) for kind in ("unguarded", "cond", "masked")}
    for step in steps.values():  # compile and warm up
        for _ in range(3):
            step(x, y)[0].numpy()

    def run(step):
        for _ in range(args.steps):
            result = step(x, y)
        result[0].numpy()  # waits for the last step

    # Wall time, and the CPU time of the process (all of TensorFlow's threads): on a busy
    # machine the wall time also counts waiting for a core, the CPU time much less so.
    times: dict[str, list[float]] = {kind: [] for kind in steps}
    cpu_times: dict[str, list[float]] = {kind: [] for kind in steps}
    for index in range(args.rounds):
        order = list(steps)[index % 3:] + list(steps)[:index % 3]  # rotate the order
        for kind in order:
            start, cpu_start = time.perf_counter(), time.process_time()
            run(steps[kind])
            times[kind].append(time.perf_counter() - start)
            cpu_times[kind].append(time.process_time() - cpu_start)

    print(f"conditional update: {args.steps} XLA steps per run, "
          f"{args.rounds} rounds")
    rows = []
    base = times["unguarded"]
    for kind, label in (("cond", "tf.cond around the update / unguarded"),
                        ("masked", "masked writes / unguarded")):
        per_round = [a / b for a, b in zip(times[kind], base)]
        ratio = statistics.median(per_round)
        q1, _, q3 = statistics.quantiles(per_round, n=4)
        ms = 1e3 * statistics.median(times[kind]) / args.steps
        cpu = statistics.median([a / b for a, b in zip(cpu_times[kind], cpu_times["unguarded"])])
        print(f"  {kind:>6}: {ms:6.2f} ms/step, ratio {ratio:.3f} "
              f"(quartiles {q1:.3f}..{q3:.3f}; CPU time {cpu:.3f})")
        rows.append({"label": f"compute-bound step: {label}", "ratio": ratio,
                     "target": 1.03, "q1": q1, "q3": q3, "cpu": cpu, "ms_per_step": ms})
    ms = 1e3 * statistics.median(base) / args.steps
    print(f"  unguarded: {ms:6.2f} ms/step")
    if args.json:
        write_results(args.json, "conditional_update", rows)


if __name__ == "__main__":
    main()
