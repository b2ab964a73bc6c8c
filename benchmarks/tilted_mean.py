"""Cost of ``companion.numerics.tilted_mean`` against the naive formula, under XLA.

Measures one forward + backward pass (value and gradient, upstream gradient of ones) of
``tilted_mean`` and of ``naive_tilted_mean`` (``1/(1 - exp(-x)) - 1/x``), each as a
``tf.function(jit_compile=True)``, on the same float32 tensor of 10^6 elements. The two are
timed alternately in one process, so that a change of machine load hits both, and the
medians are compared. Usage::

    python benchmarks/tilted_mean.py [--size 1000000] [--rounds 41] [--dtype float32] [--json PATH]

Prints each median and the ratio tilted_mean / naive (the target is <= 1.5); with
``--json`` also writes it, with the quartiles of the per-round ratios, for the book's
performance page.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from _results import write_results

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from companion.numerics import tilted_mean  # noqa: E402
from companion.reproductions import naive_tilted_mean  # noqa: E402


def forward_backward(fn):
    """``x -> (fn(x), d fn(x) / dx)`` as one XLA-compiled function."""

    @tf.function(jit_compile=True)
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fn(x)
        return y, tape.gradient(y, x)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=10**6)
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    # Magnitudes spread over every region of tilted_mean: the series (|x| <= 4), the closed
    # form, and the range where the naive gradient overflows. Both functions are branch-free,
    # so their cost does not depend on the values.
    values = rng.normal(scale=30.0, size=args.size).astype(args.dtype)
    x = tf.constant(values)
    candidates = {"naive": forward_backward(naive_tilted_mean), "tilted_mean": forward_backward(tilted_mean)}
    for step in candidates.values():  # compile and warm up
        for _ in range(3):
            step(x)[1].numpy()

    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(args.rounds):
        for name, step in candidates.items():
            start = time.perf_counter()
            step(x)[1].numpy()  # .numpy() waits for the result
            times[name].append(time.perf_counter() - start)

    medians = {name: statistics.median(t) for name, t in times.items()}
    print(f"tilted_mean benchmark: {args.size} {args.dtype} elements, forward + backward under XLA, "
          f"median of {args.rounds} alternating rounds")
    for name, median in medians.items():
        print(f"  {name:<12s} {median * 1e3:8.3f} ms")
    ratio = medians["tilted_mean"] / medians["naive"]
    print(f"  ratio tilted_mean / naive = {ratio:.2f}  (target <= 1.5)")
    if args.json:
        q1, _, q3 = statistics.quantiles([a / b for a, b in zip(times["tilted_mean"], times["naive"])], n=4)
        label = f"tilted_mean / naive formula ({args.size:,} {args.dtype})"
        write_results(
            args.json, "tilted_mean", [{"label": label, "ratio": ratio, "target": 1.5, "q1": q1, "q3": q3}]
        )


if __name__ == "__main__":
    main()
