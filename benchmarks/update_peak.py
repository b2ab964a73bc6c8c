"""What does a conditional around the optimizer's update cost in peak memory, and why?

A guard that decides whether a step counts before it updates anything (``train``'s
deferred update, ``SkipNonFinite``, Keras' ``LossScaleOptimizer``) puts the update under
a conditional on a test of every gradient. This script measures, apart from everything
else ``fit`` does, the peak of TensorFlow's own allocator during one compiled step of a
large MLP with Adam (every run a fresh process; ``TF_CPU_ALLOCATOR_USE_BFC=true``, so
that TensorFlow's CPU allocator keeps count of its peak, which the resident set of the
process does not give exactly):

* ``plain``: the gradients, then Keras' ``optimizer.apply``, as ``fit`` runs it;
* ``tested``: the same, after a test of every gradient's finiteness (their global norm),
  with no conditional: the update waits for every gradient;
* ``conditional``: the update under ``tf.cond`` on that test (all variables at once);
* ``one at a time``: the same conditional, its large variables' updates chained one after
  another (:func:`companion._gradients.one_update_at_a_time`, which ``train``,
  ``NaNDoctor`` and ``SkipNonFinite`` use where a GPU or a TPU is; here forced on the CPU).

Each ratio is a variant's peak minus ``plain``'s, as a multiple of the weights' bytes,
median of the rounds with their quartiles; the target is ``train``'s of issue 41 (0.25).
Run with::

    python benchmarks/update_peak.py [--quick] [--rounds N] [--json PATH]

``--quick`` (a smaller MLP, 1 round, every variant in one process) only checks that the
script runs: its numbers are not the full run's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from _results import quartiles, verdict  # noqa: E402
from _results import run_child as run_child_process  # noqa: E402

VARIANTS = ("plain", "tested", "conditional", "one at a time")
TARGET = 0.25
#: width: (layers of width x width, batch)
SIZES = {"full": (3072, 64), "quick": (1024, 64)}
LAYERS = 3


def child(variant: str, width: int, batch: int) -> dict:
    """One compiled step of a fresh MLP under ``variant``: the allocator's peak, in bytes."""
    import keras
    import numpy as np
    import tensorflow as tf

    from companion._gradients import CHAIN_FROM, global_norm, one_update_at_a_time

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((width,))] + [keras.layers.Dense(width, activation="tanh")
                                                         for _ in range(LAYERS)])
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    x = tf.constant(np.random.default_rng(0).normal(size=(batch, width)).astype("float32"))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x)))
        grads = tape.gradient(loss, model.trainable_variables)
        if variant == "plain":
            optimizer.apply(grads, model.trainable_variables)
            return loss
        finite = tf.math.is_finite(global_norm(grads))
        if variant == "tested":
            with tf.control_dependencies([finite]):
                grads = [tf.identity(g) for g in grads]
            optimizer.apply(grads, model.trainable_variables)
            return loss

        def update():
            if variant == "one at a time":
                with one_update_at_a_time(optimizer, smallest=CHAIN_FROM):
                    optimizer.apply(grads, model.trainable_variables)
            else:
                optimizer.apply(grads, model.trainable_variables)
            return tf.constant(0)

        tf.cond(finite, update, lambda: tf.constant(0))
        return loss

    before = tf.config.experimental.get_memory_info("CPU:0")
    tf.config.experimental.reset_memory_stats("CPU:0")
    for _ in range(3):
        step()
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    weights = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    return {"variant": variant, "peak": peak, "held": before["current"], "weights_bytes": weights,
            "params": int(model.count_params())}


def run_child(variant: str, width: int, batch: int) -> dict:
    # The BFC allocator on the CPU keeps count of its peak (see the docstring).
    return run_child_process(__file__, variant, str(width), str(batch), what=variant,
                             env={"TF_CPU_ALLOCATOR_USE_BFC": "true"})


def run_all_in_one_child(width: int, batch: int) -> dict:
    """--quick: every variant in one fresh process, one after another ({variant: result});
    a later variant's peak is over what the earlier ones left held."""
    every = run_child_process(__file__, ",".join(VARIANTS), str(width), str(batch), what="every variant",
                              env={"TF_CPU_ALLOCATOR_USE_BFC": "true"})
    return {result["variant"]: result for result in every["variants"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a smaller MLP, 1 round, every variant in one process (a smoke test)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of fresh processes (default 3)")
    parser.add_argument("--json", metavar="PATH", help="also write the ratios as JSON ('auto': the default name)")
    parser.add_argument("--child", nargs=3, metavar=("VARIANT", "WIDTH", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        variants, width, batch = args.child
        results = [child(variant, int(width), int(batch)) for variant in variants.split(",")]
        print(json.dumps(results[0] if len(results) == 1 else {"variants": results}), flush=True)
        return 0

    width, batch = SIZES["quick" if args.quick else "full"]
    rounds = 1 if args.quick else args.rounds
    print(f"{rounds} round{'s' * (rounds > 1)}: one compiled Adam step of an MLP of {LAYERS} layers "
          f"{width} x {width}, batch {batch}, "
          + ("every variant in one process" if args.quick else "each variant a fresh process"), flush=True)
    started = time.perf_counter()
    runs = {variant: [] for variant in VARIANTS}
    for r in range(rounds):
        if args.quick:
            print("  every variant in one process", file=sys.stderr, flush=True)
            for variant, result in run_all_in_one_child(width, batch).items():
                runs[variant].append(result)
            continue
        for variant in VARIANTS[r % len(VARIANTS):] + VARIANTS[: r % len(VARIANTS)]:
            print(f"  round {r + 1}/{rounds}: {variant}", file=sys.stderr, flush=True)
            runs[variant].append(run_child(variant, width, batch))
    weights = runs["plain"][0]["weights_bytes"]
    params = runs["plain"][0]["params"]
    print(f"\n{params / 1e6:.2f} M weights ({weights / 2**20:.1f} MiB); the allocator's peak of plain: "
          f"{statistics.median(r['peak'] for r in runs['plain']) / 2**20:.0f} MiB, of which "
          f"{statistics.median(r['held'] for r in runs['plain']) / 2**20:.0f} MiB held before the step")
    rows = []
    for variant in VARIANTS[1:]:
        extras = [(v["peak"] - p["peak"]) / weights for v, p in zip(runs[variant], runs["plain"])]
        q1, median, q3 = quartiles(extras)
        row = dict(label=f"update peak: {variant} / weights' bytes (over plain)", ratio=round(median, 4),
                   q1=round(q1, 4), q3=round(q3, 4), target=TARGET, rounds=rounds, variant=variant,
                   extra_mib=round(median * weights / 2**20, 2), params=params, weights_mib=round(weights / 2**20, 3))
        rows.append(row)
        print(f"  {row['label']:<50} ratio {row['ratio']:.2f} (quartiles {row['q1']:.2f} to {row['q3']:.2f}), "
              f"{row['extra_mib']:+.1f} MiB, target {TARGET}: {verdict(row['q1'], row['q3'], TARGET)}", flush=True)
    print(f"\n{time.perf_counter() - started:.0f} s")
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _results import write_results

        write_results(args.json, "update_peak", rows, extra={"width": width, "layers": LAYERS, "batch": batch})
    return 0


if __name__ == "__main__":
    sys.exit(main())
