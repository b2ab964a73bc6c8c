"""Cost of ``companion.numerics.tilted_mean`` against the naive formula, under XLA.

Measures one forward + backward pass (value and gradient, upstream gradient of ones) of
``tilted_mean`` and of ``naive_tilted_mean`` (``1/(1 - exp(-x)) - 1/x``), each as a
``tf.function(jit_compile=True)``, on the same tensor of 10^6 elements, in float32 and in
float64. All four are timed in turn in every round, in one process, so that a change of
machine load hits all of them, and the medians are compared. Usage::

    python benchmarks/tilted_mean.py [--size 1000000] [--rounds 41] [--dtype float32 float64]
                                     [--json PATH | --json auto]

Prints each median and the ratio tilted_mean / naive per dtype (the target is <= 1.5);
with ``--json`` also writes them, with the quartiles of the per-round ratios, the CPU, the
oneDNN setting and the stack, for the book's performance page. ``--json auto`` names the
file after the CPU and the oneDNN setting (``companion/benchmark_results/tilted_mean--<cpu>--
onednn-<on|off>.json``), so results from several CPUs sit side by side. oneDNN is chosen
when TensorFlow starts: run once with ``TF_ENABLE_ONEDNN_OPTS=0`` and once with ``=1``.
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
    parser.add_argument("--dtype", nargs="+", default=["float32", "float64"], choices=["float32", "float64"])
    parser.add_argument("--json", metavar="PATH", help='also write the result as JSON to PATH ("auto": by CPU)')
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    # Magnitudes spread over every region of tilted_mean: the series (|x| <= 4), the closed
    # form, and the range where the naive gradient overflows. Both functions are branch-free,
    # so their cost does not depend on the values.
    values = rng.normal(scale=30.0, size=args.size)
    candidates = {}
    for dtype in args.dtype:
        x = tf.constant(values.astype(dtype))
        candidates[(dtype, "naive")] = (forward_backward(naive_tilted_mean), x)
        candidates[(dtype, "tilted_mean")] = (forward_backward(tilted_mean), x)
    for step, x in candidates.values():  # compile and warm up
        for _ in range(3):
            step(x)[1].numpy()

    # Wall time, and the CPU time of the process (all of TensorFlow's threads): on a busy
    # machine the wall time also counts waiting for a core, the CPU time much less so.
    times: dict[tuple[str, str], list[float]] = {key: [] for key in candidates}
    cpu_times: dict[tuple[str, str], list[float]] = {key: [] for key in candidates}
    for _ in range(args.rounds):
        for key, (step, x) in candidates.items():
            start, cpu_start = time.perf_counter(), time.process_time()
            step(x)[1].numpy()  # .numpy() waits for the result
            times[key].append(time.perf_counter() - start)
            cpu_times[key].append(time.process_time() - cpu_start)

    medians = {key: statistics.median(t) for key, t in times.items()}
    print(f"tilted_mean benchmark: {args.size} elements, forward + backward")
    print(f"under XLA, median of {args.rounds} rounds (all candidates in each round)")
    rows = []
    for dtype in args.dtype:
        naive, ours = medians[(dtype, "naive")], medians[(dtype, "tilted_mean")]
        ratio = ours / naive
        per_round = [a / b for a, b in zip(times[(dtype, "tilted_mean")], times[(dtype, "naive")])]
        q1, _, q3 = statistics.quantiles(per_round, n=4)
        cpu = statistics.median(cpu_times[(dtype, "tilted_mean")]) / statistics.median(cpu_times[(dtype, "naive")])
        print(f"  {dtype}: naive {naive * 1e3:.2f} ms, tilted_mean {ours * 1e3:.2f} ms")
        print(f"    ratio {ratio:.2f} (quartiles {q1:.2f}..{q3:.2f}; CPU time {cpu:.2f};"
              " target <= 1.5)")
        rows.append({
            "label": f"tilted_mean / naive formula ({args.size:,} {dtype})",
            "dtype": dtype, "ratio": ratio, "target": 1.5, "q1": q1, "q3": q3, "cpu": cpu,
            "naive_ms": naive * 1e3, "tilted_mean_ms": ours * 1e3,
        })
    if args.json:
        write_results(args.json, "tilted_mean", rows)


if __name__ == "__main__":
    main()
