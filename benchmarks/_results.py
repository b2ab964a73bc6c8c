"""The benchmarks' machine-readable results (``--json PATH``), read by the book's performance page.

The results the book shows ship with the package, in ``companion/benchmark_results/``
(read by :func:`companion.benchmark_results.load_results`): ``--json NAME.json``, a bare
file name, writes there; a path with a folder writes where it says.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import pathlib
import sys

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "companion" / "benchmark_results"


def write_results(path: str, benchmark: str, ratios: list[dict]) -> None:
    """Write ``ratios`` (dicts with at least ``label``, ``ratio`` and ``target``) as JSON.

    Each ratio is "lower is better" and ``met`` is added as ``ratio <= target``. The file
    also records where and how it was measured, so a page showing it can say so. A bare
    file name (no folder) is written into :data:`RESULTS`, the results the package ships.
    """
    import keras
    import tensorflow as tf

    rows = [dict(row, met=bool(row["ratio"] <= row["target"])) for row in ratios]
    document = {
        "benchmark": benchmark,
        "command": " ".join(["python", os.path.relpath(sys.argv[0])] + sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "machine": f"{os.cpu_count()} CPU cores ({platform.machine()}), no GPU",
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "ratios": rows,
    }
    if os.path.dirname(path) == "":
        path = str(RESULTS / path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(document, handle, indent=2)
        handle.write("\n")
