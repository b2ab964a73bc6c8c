"""companion installs from a git URL, as the Colab cell and the README install it; its sdist
and wheel carry the licence, the type marker and a description written for its users."""

from __future__ import annotations

import email
import json
import pathlib
import re
import subprocess
import sys
import tarfile
import zipfile

import pytest

import book_tools


@pytest.mark.slow
def test_pip_installs_companion_from_a_git_url(tmp_path):
    if not (book_tools.ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    target = tmp_path / "site"
    # `git+file://localhost/<path>`, not `git+file:///<path>`: pip before 23.3 (e.g. the 23.2
    # that Python 3.11.7 and 3.12.1 bring) rejects a PEP 508 URL without a host as an
    # "Invalid requirement"; git reads both forms as the same local repository.
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
         f"nan-gradients-companion @ git+file://localhost{book_tools.ROOT}"],
        check=True, capture_output=True, text=True, timeout=600,
    )
    modules = {p.relative_to(target / "companion").as_posix() for p in (target / "companion").rglob("*.py")}
    assert {"__init__.py", "_version.py", "numerics.py", "book/__init__.py", "book/notebook.py"} <= modules
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


@pytest.fixture(scope="module")
def distributions(tmp_path_factory) -> dict[str, pathlib.Path]:
    """The sdist and the wheel, built as the release workflow builds them (`python -m build`)."""
    out = tmp_path_factory.mktemp("dist")
    result = subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(out), str(book_tools.ROOT)],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    version = book_tools.package_version()
    return {
        "sdist": out / f"nan_gradients_companion-{version}.tar.gz",
        "wheel": out / f"nan_gradients_companion-{version}-py3-none-any.whl",
    }


def _wheel_metadata(wheel: pathlib.Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return email.message_from_bytes(archive.read(name))


@pytest.mark.slow
def test_wheel_carries_the_licence_and_the_type_marker(distributions):
    wheel = distributions["wheel"]
    assert wheel.is_file(), f"no wheel among {list(wheel.parent.iterdir())}"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        licences = [n for n in names if re.fullmatch(r"[^/]+\.dist-info/licenses/LICENSE", n)]
        assert licences, f"the wheel has no LICENSE under .dist-info/licenses/: {names}"
        assert archive.read(licences[0]) == (book_tools.ROOT / "LICENSE").read_bytes()
        assert "companion/py.typed" in names, "PEP 561: the wheel must carry companion/py.typed"
        # package data the chapters read where there is no repository (Colab)
        assert {"companion/book/data/nan_reports.csv", "companion/book/data/multiworker_train.py"} <= set(names)
        modules = {n for n in names if n.startswith("companion/") and n.endswith(".py")}
        assert "companion/numerics.py" in modules and "companion/_version.py" in modules
    metadata = _wheel_metadata(wheel)
    assert metadata["License-Expression"] == "MIT"
    assert metadata.get_all("License-File") == ["LICENSE"]


@pytest.mark.slow
def test_sdist_carries_the_licence_and_the_package_description(distributions):
    sdist = distributions["sdist"]
    with tarfile.open(sdist) as archive:
        root = f"nan_gradients_companion-{book_tools.package_version()}"
        names = set(archive.getnames())
        assert f"{root}/LICENSE" in names
        assert archive.extractfile(f"{root}/LICENSE").read() == (book_tools.ROOT / "LICENSE").read_bytes()
        assert f"{root}/companion/py.typed" in names
        assert f"{root}/companion/README.md" in names
        # Nothing that needs the repository around it (MANIFEST.in).
        assert not [n for n in names if n.startswith(f"{root}/tests/")]


@pytest.mark.slow
def test_package_metadata_is_written_for_people_who_install_it(distributions):
    metadata = _wheel_metadata(distributions["wheel"])
    description = metadata.get_payload(decode=True).decode("utf-8")
    assert description.strip() == (book_tools.ROOT / "companion" / "README.md").read_text().strip()
    assert "jupyter-book build" not in description, "the package description is not the repository's README"
    assert metadata["Description-Content-Type"].startswith("text/markdown")
    urls = dict(u.split(", ", 1) for u in metadata.get_all("Project-URL"))
    repository = book_tools.repository_url()
    assert urls["Source"] == repository
    assert urls["Issues"] == f"{repository}/issues"
    assert urls["Changelog"].startswith(f"{repository}/blob/") and urls["Changelog"].endswith("/CHANGELOG.md")
    assert urls["Homepage"] == book_tools.pages_url()
    assert urls["Documentation"].startswith(book_tools.pages_url())
    classifiers = metadata.get_all("Classifier")
    assert "Typing :: Typed" in classifiers
    requires = re.search(r">=\s*(\d+)\.(\d+)", metadata["Requires-Python"]).groups()
    lowest = tuple(map(int, requires))
    versions = sorted(tuple(map(int, c.rsplit(" ", 1)[1].split("."))) for c in classifiers
                      if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c))
    assert versions[0] == lowest, "the classifiers start at the lowest Python that Requires-Python allows"
    assert "tensorflow" in metadata["Keywords"].lower()


def test_package_description_example_prints_what_it_says(tmp_path):
    text = (book_tools.ROOT / "companion" / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    expected = re.search(r"```text\n(.*?)```", text, re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**__import__("os").environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == expected


def test_package_description_installs_the_current_release():
    text = (book_tools.ROOT / "companion" / "README.md").read_text()
    assert f'pip install "{book_tools.colab_install_spec()}"' in text
