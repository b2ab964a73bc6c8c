"""Every script in benchmarks/ runs: its --quick mode exits 0, prints and writes its ratios.

The benchmarks are not timed tests (their targets are checked by running them in full,
on a quiet machine); this only makes sure none of them crashes unnoticed, e.g. on a
renamed import. Each runs in a fresh process, as a user starts it, with this checkout's
``companion`` first on the path and ``--json`` into a temporary folder (never into the
results the package ships).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

from companion.book.benchmark_results import BenchmarkResult

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"

#: What each benchmark prints for each of its ratios (a regular expression with the ratio
#: as its one group), and how many ratios it measures.
PRINTED_RATIOS = {
    "tilted_mean.py": (r"ratio (\d+\.\d+) \(quartiles", 2),
    "conditional_update.py": (r"ratio (\d+\.\d+) \(quartiles", 2),
    "training_overhead.py": (r"wall (\d+\.\d+)x", 5),
    "doctor.py": (r"wall +(\d+\.\d+)x", 3),
    "cold_start.py": (r"ratio (\d+\.\d+) \(quartiles", 2),
    # 1 model x 3 variants x (steady time, extra memory)
    "scale.py": (r"ratio (-?\d+\.\d+) \(quartiles", 6),
    # 1 model x (steady time, extra memory)
    "recovery.py": (r"ratio (-?\d+\.\d+) \(quartiles", 2),
    # 3 variants' peak over the plain update's, per byte of weights
    "update_peak.py": (r"ratio (-?\d+\.\d+) \(quartiles", 3),
    # 1 model x 3 variants' allocator peak over fit's, per byte of weights
    "device_memory.py": (r"ratio (-?\d+\.\d+) \(quartiles", 3),
}

#: Benchmarks some of whose ratios are differences, 0 or below when there is no cost:
#: scale.py's and device_memory.py's extra memory over fit's, per byte of weights;
#: recovery.py's over train()'s.
SIGNED = {"scale.py", "recovery.py", "update_peak.py", "device_memory.py"}


def test_every_benchmark_script_is_covered():
    scripts = {path.name for path in BENCHMARKS.glob("*.py") if not path.name.startswith("_")}
    assert scripts == set(PRINTED_RATIOS)


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory):
    """Every benchmark's --quick run, started together (most of each is tracing, which
    leaves a core idle): {script: (completed process, path of its JSON)}."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONHASHSEED="0")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    started = {}
    for script in sorted(PRINTED_RATIOS):
        folder = tmp_path_factory.mktemp(script.removesuffix(".py"))
        output = folder / "result.json"
        process = subprocess.Popen(
            [sys.executable, str(BENCHMARKS / script), "--quick", "--json", str(output)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=folder,
        )
        started[script] = (process, output)
    runs = {}
    for script, (process, output) in started.items():
        try:
            stdout, stderr = process.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        runs[script] = (subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr), output)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(PRINTED_RATIOS))
def test_benchmark_quick_mode_exits_0_and_reports_its_ratios(script, quick_runs):
    pattern, count = PRINTED_RATIOS[script]
    completed, output = quick_runs[script]
    assert completed.returncode == 0, completed.stderr[-4000:]
    printed = [float(value) for value in re.findall(pattern, completed.stdout)]
    assert len(printed) == count, completed.stdout
    assert all((value > 0 or script in SIGNED) and math.isfinite(value) for value in printed), completed.stdout
    # The JSON the book reads: the same ratios, each with quartiles around it.
    result = BenchmarkResult.from_document(json.loads(output.read_text()), source=script)
    assert len(result.ratios) == count
    for row in result.ratios:
        assert row["q1"] <= row["ratio"] <= row["q3"], row
        assert any(abs(row["ratio"] - value) <= 0.006 for value in printed), (row, printed)
    assert {"TF_ENABLE_ONEDNN_OPTS", "enabled"} <= set(result.document["onednn"])  # the setting
