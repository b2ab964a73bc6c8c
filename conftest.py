"""Shared test set-up, for tests/ and for the notebooks under book/ alike.

nbval (0.11) compares a cell's stderr stream like any other output. TensorFlow writes
machine-dependent lines there (CPU features, CUDA probing, XLA compilation), so the
comparison leaves stderr out, in both the committed and the fresh outputs; everything
else (stdout, results, error names) is compared strictly. The committed notebooks carry
no stderr either (scripts/refresh_notebooks.py drops it).
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
    import nbval.plugin as _nbval_plugin
except ImportError:  # nbval not installed: the notebooks are simply not collected
    _nbval_plugin = None

if _nbval_plugin is not None:
    _transform = _nbval_plugin.transform_streams_for_comparison

    def _without_stderr(outputs):
        kept = [o for o in outputs if not (o.get("output_type") == "stream" and o.get("name") == "stderr")]
        return _transform(kept)

    _nbval_plugin.transform_streams_for_comparison = _without_stderr
