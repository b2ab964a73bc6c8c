"""Shared test set-up, for tests/ and for the notebooks under book/ alike.

nbval (0.11) compares a cell's stderr stream like any other output. TensorFlow writes
machine-dependent lines there (CPU features, CUDA probing, XLA compilation), so the
comparison leaves stderr out, in both the committed and the fresh outputs; everything
else (stdout, results, error names) is compared strictly. The committed notebooks carry
no stderr either (scripts/refresh_notebooks.py drops it).

The property tests (hypothesis) run under one of two profiles registered here:

- ``deterministic``, the default: the same 50 examples per test on every run and every
  machine (``derandomize=True``), so a red test suite is red for a reason in the code,
  not for a new random draw;
- ``thorough``: 500 fresh random examples per test (10 times as many; about 20 minutes
  on 2 cores), to search for new failures before a release or after a change to
  ``companion.numerics``. Select it with hypothesis' own pytest option::

      python -m pytest tests --hypothesis-profile=thorough

  (or ``HYPOTHESIS_PROFILE=thorough``). A failure prints the example and a
  ``@reproduce_failure`` blob to replay it; add the example to the test as an
  ``@example`` so the deterministic run keeps checking it.
"""

from __future__ import annotations

import os
import pathlib
import sys

# Kernels started by nbval inherit this environment.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("PYTHONHASHSEED", "0")

ROOT = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "scripts"))

try:
    from hypothesis import settings as _hypothesis_settings
except ImportError:  # hypothesis not installed: the property tests are not collected
    _hypothesis_settings = None

if _hypothesis_settings is not None:
    # deadline=None: TensorFlow's first call of a function traces it, which can take far
    # longer than hypothesis' default deadline of 200 ms per example.
    _hypothesis_settings.register_profile(
        "deterministic", max_examples=50, derandomize=True, database=None, deadline=None, print_blob=True
    )
    _hypothesis_settings.register_profile("thorough", max_examples=500, deadline=None, print_blob=True)
    # Loaded here, before hypothesis' pytest plugin reads --hypothesis-profile, which wins.
    _hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))

try:
    import nbval.plugin as _nbval_plugin
except ImportError:  # nbval not installed: the notebooks are simply not collected
    _nbval_plugin = None

if _nbval_plugin is not None:
    _transform = _nbval_plugin.transform_streams_for_comparison

    def _without_stderr(outputs):
        kept = [o for o in outputs if not (o.get("output_type") == "stream" and o.get("name") == "stderr")]
        return _transform(kept)

    _nbval_plugin.transform_streams_for_comparison = _without_stderr


# Two workers (pytest-xdist; `-n 2 --dist loadfile` in pyproject.toml's addopts): each
# file is one unit of work, run in order by one worker, so a notebook's cells share one
# kernel and a module's fixtures run once. Two changes to xdist's `loadfile`:
#
# - the test files that look at the built book are one unit, so that the book (the
#   session-scoped `built_book` of tests/conftest.py, a few minutes) is built once, not once
#   per worker (tests/repository/test_parallel.py checks that every file using it is in this unit);
# - a worker that needs work gets the longest unit left (the longest first, then the shorter
#   ones fill in: the two workers end close together), by UNIT_SECONDS: the seconds each unit
#   took, run one after another (2026-12-02, two cores shared with other work: only their
#   order matters); a unit not listed comes after those, the one with more tests first.
BUILT_BOOK_FILES = ("tests/book/test_browser.py", "tests/book/test_browser_zh.py", "tests/book/test_built_book.py",
                    "tests/repository/test_packaging.py")
UNIT_SECONDS = {
    "the built book": 280,
    "tests/contracts/test_training_keras_contracts.py": 150,
    "tests/unit/test_benchmarks.py": 140,
    "tests/unit/test_doctor_remedies.py": 130,
    "tests/unit/test_doctor_remedy_order.py": 80,
    "tests/unit/test_doctor_fit_guard.py": 40,
    "tests/unit/test_doctor_update_nan.py": 37,
    "tests/unit/test_doctor_values_causes.py": 32,
    "tests/distributed/test_training_multiworker.py": 110,
    "tests/unit/test_training_loop.py": 105,
    "tests/unit/test_training_custom_steps.py": 100,
    "tests/unit/test_finding_your_own_nan.py": 100,
    "tests/distributed/test_launch.py": 90,
    "book/tools/training_across_machines.ipynb": 55,
    "book/closing/finding_your_own_nan.ipynb": 50,
    "book/closing/checklist.ipynb": 45,
    "tests/distributed/test_training_recovery_distributed.py": 85,
    "tests/contracts/test_training_fit_parity.py": 45,
    "tests/unit/test_training_recovery.py": 45,
    "tests/unit/test_models.py": 45,
    "tests/unit/test_doctor_custom_steps.py": 45,
    "book/case_a/fixed_parameternet.ipynb": 40,
    "tests/distributed/test_training_distributed.py": 40,
    "book/case_a/reproduce.ipynb": 35,
    "tests/unit/test_powers.py": 30,
    "book/case_b/training.ipynb": 30,
    "tests/unit/test_tilted_mean.py": 30,
    "tests/unit/test_docstrings.py": 25,
    "tests/unit/test_runs.py": 25,
    "tests/unit/test_doctor.py": 25,
    "book/tools/training_loop.ipynb": 45,
    "book/tools/performance.ipynb": 20,
}

try:
    from xdist.scheduler import LoadScopeScheduling as _LoadScopeScheduling
except ImportError:  # no xdist: one process runs every test, in collection order
    _LoadScopeScheduling = None

if _LoadScopeScheduling is not None:
    import pytest

    class _FileScheduling(_LoadScopeScheduling):
        """xdist's ``loadfile``, with the built book's files as one unit, longest unit first."""

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "the built book" if path in BUILT_BOOK_FILES else path

        def _assign_work_unit(self, node) -> None:
            longest = max(self.workqueue, key=lambda scope: (UNIT_SECONDS.get(scope, 0), len(self.workqueue[scope])))
            self.workqueue.move_to_end(longest, last=False)
            super()._assign_work_unit(node)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_make_scheduler(config, log):
        if config.getoption("dist") == "loadfile":
            return _FileScheduling(config, log)
        return None  # another --dist: xdist's own
