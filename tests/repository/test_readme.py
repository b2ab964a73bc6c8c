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
