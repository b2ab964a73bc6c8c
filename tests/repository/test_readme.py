"""The README's two commands and its usage example stay true."""

from __future__ import annotations

import re
import subprocess
import sys

import book_tools

README = (book_tools.ROOT / "README.md").read_text()


def test_readme_starts_with_the_build_and_test_commands():
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1).strip().splitlines()
    commands = [line.split("#")[0].strip() for line in first_block]
    assert commands == [
        "pip install -r requirements.txt && jupyter-book build .",
        "pip install -r requirements.txt && python -m pytest",
    ]
    assert README.index("```bash") < README.index("\n## ")  # before any section
    ci = (book_tools.ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci, ".ci/run must run the README's test command"


def test_readme_usage_example_prints_what_the_readme_says(tmp_path):
    section = README[README.index("## Use the package"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    expected = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**__import__("os").environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == expected


def test_the_layout_tables_name_every_module_of_companion_and_only_those():
    """README's tables of companion/ and companion/__init__'s docstring match the tree."""
    import companion
    from companion import _moved

    package = book_tools.ROOT / "companion"
    section = README[README.index("Inside `companion/`"):README.index("## Contributing")]
    listed = {name.rstrip("/") for name in re.findall(r"`([\w.]+/?)`", section)}

    def entries(folder):
        return {p.name for p in folder.iterdir()
                if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").is_file()}

    stubs = {f"{name.split('.')[-1]}.py" for name in _moved.MOVED} | {"_version.py"}
    missing = (entries(package) - stubs - {"book"}) | (entries(package / "book") | {"data"})
    missing = {name for name in missing if name not in listed}
    assert not missing, f"not in README's layout tables: {sorted(missing)}"
    every_file = {p.name for p in package.rglob("*.py")} | {p.name for p in package.rglob("*") if p.is_dir()}
    stale = sorted(name for name in listed if name.endswith(".py") and name not in every_file)
    assert not stale, f"README's layout tables name files that do not exist: {stale}"
    # the package docstring names every module a user imports, and the book's package
    for name in companion.__all__:
        if name != "__version__":
            assert f"{name}:" in companion.__doc__ or f"companion.{name}" in companion.__doc__, name
