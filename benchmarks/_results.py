"""The benchmarks' machine-readable results (``--json PATH``), read by the book's performance page.

Every result says where it was measured: the CPU model and its vector extensions, whether
TensorFlow's oneDNN kernels were on (TensorFlow turns them on by default on x86 CPUs with
AVX-512 and off otherwise; ``TF_ENABLE_ONEDNN_OPTS=0`` or ``=1`` decides), and the stack.
Ratios from different CPUs differ, so results of several CPUs are kept side by side:
`default_path` names a file after the benchmark, the CPU and the oneDNN setting.

The results the book shows ship with the package, in ``companion/book/benchmark_results/``
(read by :func:`companion.book.benchmark_results.load_results`): ``--json auto`` and a bare
file name write there; a path with a folder writes where it says.

It also holds what the benchmarks share in measuring and judging: `run_child` (one
measurement in a fresh process), `timed`, `rounds` and `ratio` (runs in this process, in
rounds that cycle through their orders), `quartiles` (of per-round ratios) and `verdict` (a target met, missed
or not resolved by the spread of the rounds).
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import time

from companion.book.benchmark_results import short_cpu_name

#: Where the results the package ships (and the performance chapter shows) live.
RESULTS = pathlib.Path(__file__).resolve().parents[1] / "companion" / "book" / "benchmark_results"

#: CPU flags (as /proc/cpuinfo spells them) that decide which kernels TensorFlow, oneDNN and
#: XLA's code generator use.
_VECTOR_FLAGS = (
    "sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile",
)


def cpu_description() -> dict:
    """The CPU: its model name, the vector extensions that matter to TensorFlow, the core count.

    On Linux from /proc/cpuinfo; elsewhere from :mod:`platform`, without flags.
    """
    model, flags = None, None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            text = handle.read()
    except OSError:
        text = ""
    match = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    if match:
        model = short_cpu_name(match.group(1))
    match = re.search(r"^flags\s*:\s*(.+)$", text, re.MULTILINE)
    if match:
        present = set(match.group(1).split())
        flags = [flag for flag in _VECTOR_FLAGS if flag in present]
    if not model:
        model = platform.processor() or platform.machine() or "unknown CPU"
    return {"model": model, "architecture": platform.machine(), "cores": os.cpu_count(), "flags": flags}


def onednn_state() -> dict:
    """``TF_ENABLE_ONEDNN_OPTS`` as set (``None`` if unset) and whether TensorFlow enabled oneDNN.

    ``enabled`` is TensorFlow's own answer (``IsMklEnabled``, the check TensorFlow's tests
    use), which also covers the default chosen from the CPU when the variable is unset.
    """
    import tensorflow  # noqa: F401  (initialises the oneDNN decision)

    try:  # a private module of TensorFlow: if it moves, say "unknown" rather than fail
        from tensorflow.python.util import _pywrap_util_port

        enabled = bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):
        enabled = None
    return {"TF_ENABLE_ONEDNN_OPTS": os.environ.get("TF_ENABLE_ONEDNN_OPTS"), "enabled": enabled}


def stack() -> dict:
    """Versions of Python, TensorFlow, Keras and NumPy."""
    import keras
    import numpy
    import tensorflow as tf

    return {
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "numpy": numpy.__version__,
    }


def run_child(script: str, *args: str, what: str, env: dict | None = None,
              incomplete: str | None = None) -> dict:
    """Run ``python script --child *args`` in a fresh process; return the last JSON line it printed.

    A fresh process per measurement starts with no traced functions, no compiled kernels
    and an empty allocator, so that no run inherits another's state (and a measurement of
    memory sees only its own). The benchmark's ``--child`` mode does one measurement (in a
    ``--quick`` run of ``scale.py``, ``recovery.py`` or ``update_peak.py``, several) and
    prints it as one JSON object on a line of its own; other lines are passed over.

    Args:
        script: the benchmark's file (its ``__file__``).
        *args: the arguments after ``--child``, as strings.
        what: the run, as the error messages name it ("mlp-8m, fit, 5 epochs").
        env: environment variables to set for the child, on top of this process's and
            ``TF_CPP_MIN_LOG_LEVEL=2``.
        incomplete: if given, the result must say ``"completed": true``; otherwise this
            (the rest of a sentence after "the run of WHAT") is the error's message.

    Returns:
        The child's last JSON line, parsed.

    Raises:
        RuntimeError: the child exited with an error or printed no JSON line (the message
            ends with the last 4000 characters of its stderr), or it did not complete.
    """
    completed = subprocess.run(
        [sys.executable, os.path.abspath(script), "--child", *args],
        capture_output=True, text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **(env or {})),
    )
    lines = [line for line in completed.stdout.splitlines() if line.startswith("{")]
    if completed.returncode != 0 or not lines:
        raise RuntimeError(f"the run of {what} failed (exit {completed.returncode}):\n{completed.stderr[-4000:]}")
    result = json.loads(lines[-1])
    if incomplete is not None and not result["completed"]:
        raise RuntimeError(f"the run of {what} {incomplete}")
    return result


def quartiles(values) -> tuple[float, float, float]:
    """First quartile, median and third quartile of ``values`` (per-round ratios).

    By :func:`statistics.quantiles`' "inclusive" method (the values are the whole sample,
    not a draw from a wider range); a single value (one round, ``--quick``) is all three.
    """
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def verdict(q1: float, q3: float, target: float) -> str:
    """"met" if even the third quartile is within ``target`` (lower is better), "missed" if
    even the first quartile is above it, else "not resolved" (the rounds straddle it)."""
    return "met" if q3 <= target else "missed" if q1 > target else "not resolved"


#: The last line of a benchmark that prints verdicts: how to read them.
VERDICT_LEGEND = ("verdict: the median of the per-round ratios, with their quartiles (met: even the third "
                  "quartile is within the target)")


def ratio_line(row: dict, width: int, extra: str = "") -> str:
    """One printed ratio: ``row``'s label (padded to ``width``), its median and quartiles,
    ``extra``, its target and :func:`verdict`."""
    return (f"  {row['label']:<{width}} ratio {row['ratio']:.2f} (quartiles {row['q1']:.2f} to {row['q3']:.2f})"
            f"{extra}, target {row['target']}: {verdict(row['q1'], row['q3'], row['target'])}")


def timed(fn) -> tuple[float, float]:
    """Wall-clock seconds and process CPU seconds (all threads) of ``fn()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def rounds(runs: dict, repeats: int) -> tuple[dict, dict]:
    """Wall and CPU seconds of each of ``runs`` ({key: function}), ``repeats`` rounds.

    The rounds cycle through all orders of the runs, so that each run follows each other
    run equally often (what one leaves behind, e.g. a warm cache, favours all alike).
    Returns ({key: [wall seconds a round]}, {key: [CPU seconds a round]}).
    """
    wall = {key: [] for key in runs}
    cpu = {key: [] for key in runs}
    orders = list(itertools.permutations(runs))
    for repeat in range(repeats):
        for key in orders[repeat % len(orders)]:
            time.sleep(0.02)
            seconds, cpu_seconds = timed(runs[key])
            wall[key].append(seconds)
            cpu[key].append(cpu_seconds)
    return wall, cpu


def ratio(wall: dict, cpu: dict, top: str, bottom: str) -> dict:
    """``top``'s time over ``bottom``'s, from `rounds`' seconds.

    Ratios of runs of the same round cancel slow drifts of the machine's speed: ``wall``
    is the median of the per-round wall-clock ratios and ``quartiles`` their first and
    third quartiles (:func:`statistics.quantiles`' default method); ``fastest`` is the
    ratio of the fastest runs, ``cpu`` the median of the per-round CPU-time ratios.
    """
    ratios = [a / b for a, b in zip(wall[top], wall[bottom])]
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return {
        "wall": statistics.median(ratios),
        "quartiles": (q1, q3),
        "fastest": min(wall[top]) / min(wall[bottom]),
        "cpu": statistics.median(a / b for a, b in zip(cpu[top], cpu[bottom])),
    }


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown-cpu"


def default_path(benchmark: str) -> str:
    """``companion/book/benchmark_results/<benchmark>--<cpu>--onednn-<on|off>.json`` for this machine and setting."""
    cpu = cpu_description()
    flags = cpu["flags"] or []
    # The widest vector extension goes into the name: one model name can hide both.
    vector = next((flag for flag in ("avx512f", "avx2", "avx") if flag in flags), None)
    name = _slug(cpu["model"] + (f" {vector.replace('avx512f', 'avx512')}" if vector else ""))
    onednn = {True: "on", False: "off", None: "unknown"}[onednn_state()["enabled"]]
    return str(RESULTS / f"{benchmark}--{name}--onednn-{onednn}.json")


def write_results(path: str, benchmark: str, ratios: list[dict], extra: dict | None = None) -> None:
    """Write ``ratios`` (dicts with at least ``label``, ``ratio`` and ``target``) as JSON.

    Each ratio is "lower is better" and ``met`` is added as ``ratio <= target``. The file
    also records where and how it was measured (``cpu``, ``onednn``, ``stack``, the
    ``load_average`` over 1, 5 and 15 minutes when it was written, and, for
    pages written for the first format, ``machine``, ``tensorflow`` and ``keras``), so a
    page showing it can say so. ``path`` "auto" means `default_path`. ``extra``: further
    fields of the document (e.g. ``cold_start``'s ``split``).
    """
    import tensorflow as tf

    if path == "auto":
        path = default_path(benchmark)
    elif os.path.dirname(path) == "":
        path = str(RESULTS / path)
    cpu = cpu_description()
    versions = stack()
    gpus = tf.config.list_physical_devices("GPU")
    rows = [dict(row, met=bool(row["ratio"] <= row["target"])) for row in ratios]
    command = " ".join(["python", os.path.relpath(sys.argv[0])] + sys.argv[1:])
    onednn = onednn_state()
    if onednn["TF_ENABLE_ONEDNN_OPTS"] is not None:
        command = f"TF_ENABLE_ONEDNN_OPTS={onednn['TF_ENABLE_ONEDNN_OPTS']} {command}"
    document = {
        "benchmark": benchmark,
        "command": command,
        "date": datetime.date.today().isoformat(),
        "machine": f"{cpu['model']}, {cpu['cores']} CPU cores ({cpu['architecture']}), "
        + (f"{len(gpus)} GPU" if gpus else "no GPU")
        + f", oneDNN {({True: 'on', False: 'off', None: 'unknown'})[onednn['enabled']]}",
        "cpu": cpu,
        "onednn": onednn,
        "stack": versions,
        # Other processes compete for the cores: ratios measured under load are less sure.
        "load_average": [round(value, 2) for value in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "tensorflow": versions["tensorflow"],
        "keras": versions["keras"],
        "ratios": rows,
        **(extra or {}),
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(document, handle, indent=2)
        handle.write("\n")
    print(f"wrote {os.path.relpath(path)}")
