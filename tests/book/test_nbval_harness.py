"""The nbval harness fails a chapter whose committed outputs no longer match its code."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

import book_tools

CHAPTER = book_tools.BOOK / "foundations" / "finite_loss_nan_gradients.ipynb"


@pytest.mark.slow
def test_a_stale_output_fails_under_nbval_and_only_that_cell(tmp_path):
    # Inside the repository (so the root conftest and pytest config apply), in a folder
    # that the main run does not collect; in this one process (-n 0: no pytest-xdist workers).
    work = book_tools.ROOT / "_build" / "nbval-stale-test"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        nb = json.loads(CHAPTER.read_text())
        code_cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
        stale_index = next(
            i for i, c in enumerate(code_cells) if any(o.get("name") == "stdout" for o in c["outputs"])
        )
        stream = next(o for o in code_cells[stale_index]["outputs"] if o.get("name") == "stdout")
        text = "".join(stream["text"])
        stream["text"] = text.replace("nan", "0.0", 1)
        assert stream["text"] != text
        stale = work / CHAPTER.name
        stale.write_text(json.dumps(nb))

        report = tmp_path / "report.xml"
        result = subprocess.run(
            [sys.executable, "-m", "pytest", str(stale), f"--junitxml={report}", "-q", "-n", "0"],
            cwd=book_tools.ROOT, capture_output=True, text=True, timeout=600,
        )
        assert result.returncode == 1, result.stdout[-3000:]
        cases = ET.parse(report).getroot().iter("testcase")
        failed = [c.get("name") for c in cases if c.find("failure") is not None or c.find("error") is not None]
        # nbval names its items "Cell N", N counting code cells only.
        assert failed == [f"Cell {stale_index}"], (failed, result.stdout[-3000:])
        assert "0.0" in result.stdout  # the report shows the stale text
    finally:
        shutil.rmtree(work, ignore_errors=True)
