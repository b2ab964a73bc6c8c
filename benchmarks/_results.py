"""The benchmarks' machine-readable results (``--json PATH``), read by the book's performance page.

Every result says where it was measured: the CPU model and its vector extensions, whether
TensorFlow's oneDNN kernels were on (TensorFlow turns them on by default on x86 CPUs with
AVX-512 and off otherwise; ``TF_ENABLE_ONEDNN_OPTS=0`` or ``=1`` decides), and the stack.
Ratios from different CPUs differ, so results of several CPUs are kept side by side:
`default_path` names a file after the benchmark, the CPU and the oneDNN setting.

The results the book shows ship with the package, in ``companion/book/benchmark_results/``
(read by :func:`companion.book.benchmark_results.load_results`): ``--json auto`` and a bare
file name write there; a path with a folder writes where it says.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import pathlib
import re
import sys

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
