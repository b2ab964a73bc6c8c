"""Cost of ``companion.numerics.tilted_mean`` against the naive formula, under XLA.

Measures one forward + backward pass (value and gradient, upstream gradient of ones) of
``tilted_mean`` and of ``naive_tilted_mean`` (``1/(1 - exp(-x)) - 1/x``), each as a
``tf.function(jit_compile=True)``, on the same tensor of 10^6 elements, in float32 and in
float64. All four are timed in turn in every round, in one process, so that a change of
machine load hits all of them. Usage::

    python benchmarks/tilted_mean.py [--size 1000000] [--rounds 41] [--dtype float32 float64]
                                     [--quick] [--json PATH | --json auto]

For each dtype, each round gives one ratio tilted_mean / naive (the two runs of that round);
the verdict is the median of these per-round ratios, printed with their quartiles (both
from the same ratios, so the median lies between them; the target is <= 1.2), next to the
median times of each candidate and the median of the per-round ratios of process CPU
time. ``--quick`` (10^4 elements, 5 rounds: a few seconds) only checks that the benchmark
runs. With ``--json`` it also writes the ratios, the CPU, the oneDNN setting and the
stack, for the book's performance page. ``--json auto`` names the
file after the CPU and the oneDNN setting (``companion/book/benchmark_results/tilted_mean--<cpu>--
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
from companion.book.reproductions import naive_tilted_mean  # noqa: E402


#: The target of issue 28: tilted_mean at most 1.2 times the naive formula.
TARGET = 1.2


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
    parser.add_argument("--quick", action="store_true", help="10^4 elements, 5 rounds: a smoke test (seconds)")
    parser.add_argument("--json", metavar="PATH", help='also write the result as JSON to PATH ("auto": by CPU)')
    args = parser.parse_args()
    if args.quick:
        args.size, args.rounds = 10**4, 5

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
    print(f"under XLA, {args.rounds} rounds (all candidates in each round); verdict:")
    print("the median of the per-round ratios tilted_mean / naive, with their quartiles")
    rows = []
    for dtype in args.dtype:
        naive, ours = medians[(dtype, "naive")], medians[(dtype, "tilted_mean")]
        # One ratio per round, of the two runs made side by side: the verdict is their
        # median, and the quartiles are of the same ratios.
        per_round = [a / b for a, b in zip(times[(dtype, "tilted_mean")], times[(dtype, "naive")])]
        q1, ratio, q3 = statistics.quantiles(per_round, n=4, method="inclusive")
        cpu = statistics.median(
            a / b if b > 0 else float("nan")
            for a, b in zip(cpu_times[(dtype, "tilted_mean")], cpu_times[(dtype, "naive")])
        )
        print(f"  {dtype}: median times naive {naive * 1e3:.2f} ms, tilted_mean {ours * 1e3:.2f} ms")
        print(f"    ratio {ratio:.2f} (quartiles {q1:.2f}..{q3:.2f}; CPU time {cpu:.2f};"
              f" target <= {TARGET})")
        rows.append({
            "label": f"tilted_mean / naive formula ({args.size:,} {dtype})",
            "dtype": dtype, "ratio": ratio, "target": TARGET, "q1": q1, "q3": q3, "cpu": cpu,
            "naive_ms": naive * 1e3, "tilted_mean_ms": ours * 1e3, "rounds": args.rounds,
        })
    if args.json:
        write_results(args.json, "tilted_mean", rows)


if __name__ == "__main__":
    main()
