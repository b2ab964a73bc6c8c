"""companion installs from a git URL, as the Colab cell and the README install it."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

import book_tools


@pytest.mark.slow
def test_pip_installs_companion_from_a_git_url(tmp_path):
    if not (book_tools.ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
         f"nan-gradients-companion @ git+file://{book_tools.ROOT}"],
        check=True, capture_output=True, text=True, timeout=600,
    )
    modules = {p.name for p in (target / "companion").glob("*.py")}
    assert {"__init__.py", "_version.py", "numerics.py", "notebook.py"} <= modules
    dist_info = list(target.glob("nan_gradients_companion-*.dist-info"))
    assert [d.name for d in dist_info] == [f"nan_gradients_companion-{book_tools.package_version()}.dist-info"]
    # The installed copy imports and reports the same version, without the source tree on the path.
    out = subprocess.run(
        [sys.executable, "-c", "import companion, sys; print(companion.__version__, companion.__file__)"],
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}, cwd=tmp_path,
        check=True, capture_output=True, text=True, timeout=120,
    ).stdout.split()
    assert out[0] == book_tools.package_version()
    assert pathlib.Path(out[1]).is_relative_to(target)


@pytest.mark.slow
def test_book_builds_without_warnings(built_book):
    """The README's build command, with warnings as errors and nitpicky references
    (the session's one build, tests/conftest.py)."""
    assert built_book.returncode == 0, built_book.log
    html = built_book.html
    for notebook in book_tools.notebooks():
        page = built_book.page(notebook)
        assert page.exists(), f"{page} was not built"
        # The committed outputs are rendered: one <img> per figure the notebook holds.
        figures = sum(
            "image/png" in output.get("data", {})
            for cell in json.loads(notebook.read_text())["cells"]
            for output in cell.get("outputs", [])
        )
        assert page.read_text().count("<img") >= figures
    assert (html / "index.html").exists()
