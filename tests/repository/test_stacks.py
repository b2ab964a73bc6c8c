"""The stacks CI tests besides the lock (.ci/stacks/*.txt) are the ones the package declares."""

from __future__ import annotations

import re
import tomllib

import book_tools

STACKS = book_tools.ROOT / ".ci" / "stacks"
PYPROJECT = tomllib.loads((book_tools.ROOT / "pyproject.toml").read_text())


def _stack(name: str) -> tuple[str, dict[str, str]]:
    """(python version, {package: pinned version}) of .ci/stacks/NAME.txt."""
    text = (STACKS / f"{name}.txt").read_text()
    python = re.search(r"^# *python: *([0-9.]+)\s*$", text, re.M).group(1)
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)\s*$", text, re.M))
    return python, {package.lower(): _normal(version) for package, version in pins.items()}


def _normal(version: str) -> str:
    """``2.16.0`` and ``2.16`` alike: ``2.16``."""
    parts = [int(part) for part in version.split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return ".".join(map(str, parts))


def _lower_bounds(requirements: list[str]) -> dict[str, str]:
    bounds = {}
    for requirement in requirements:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9.]+)(?:\s*,.*)?", requirement.strip())
        assert match, f"{requirement!r}: every dependency must have a lower bound (>=)"
        bounds[match.group(1).lower()] = _normal(match.group(2))
    return bounds


def test_the_oldest_stack_is_exactly_the_lower_bounds_pyproject_declares():
    python, pins = _stack("oldest")
    project = PYPROJECT["project"]
    declared = _lower_bounds(project["dependencies"])
    declared["matplotlib"] = _lower_bounds(project["optional-dependencies"]["book"])["matplotlib"]
    assert project["requires-python"] == f">={python}"
    assert pins == declared, "pin each lower bound of pyproject.toml in .ci/stacks/oldest.txt, and nothing else"


def test_the_colab_stack_is_colab_s_python_tensorflow_keras_numpy_and_matplotlib():
    python, pins = _stack("colab")
    assert python == "3.13"
    assert set(pins) == {"tensorflow", "keras", "numpy", "matplotlib"}
    declared = _lower_bounds(PYPROJECT["project"]["dependencies"])
    for package, bound in declared.items():
        as_tuple = lambda version: tuple(int(part) for part in version.split("."))  # noqa: E731
        assert as_tuple(pins[package]) >= as_tuple(bound), f"Colab's {package} is below pyproject's bound"


def test_ci_runs_the_stacks_after_the_locked_suite():
    ci = (book_tools.ROOT / ".ci" / "run").read_text()
    # The environments may be installed in the background from the start; the stacks' tests
    # run after the locked suite.
    assert "python -m pytest" in ci and "STACKS_PHASE=test STACKS_PARTS=" in ci
    assert ci.index("python -m pytest") < ci.index("STACKS_PHASE=test STACKS_PARTS=")
    assert ci.index("STACKS_PHASE=install bash .ci/stacks.sh") < ci.index("STACKS_PHASE=test STACKS_PARTS=")
    # The unit tests of both stacks, whichever lane runs them.
    assert "STACKS_PHASE=test STACKS_PARTS=unit bash .ci/stacks.sh colab" in ci
    assert "STACKS_PHASE=test STACKS_PARTS=unit bash .ci/stacks.sh oldest" in ci
    # The chapters on Colab's stack, where readers run them; the oldest stack is the
    # package's floor for users' own code: its unit tests (its pins say so, for
    # `bash .ci/stacks.sh` run alone, as the workflow's stacks job does).
    assert "STACKS_PHASE=test STACKS_PARTS=chapters bash .ci/stacks.sh colab ||" in ci
    pins = (book_tools.ROOT / ".ci" / "stacks" / "oldest.txt").read_text()
    assert re.search(r"^# *chapters: *no", pins, re.M) and "chapters: no" not in (
        book_tools.ROOT / ".ci" / "stacks" / "colab.txt").read_text()


def test_ci_runs_keras_tests_of_fit_through_train_on_the_lock_and_the_colab_stack():
    # Issue 21: Keras' own tests of fit with fit routed to train, on both stacks.
    ci = (book_tools.ROOT / ".ci" / "run").read_text()
    stacks = (book_tools.ROOT / ".ci" / "stacks.sh").read_text()
    assert "KERAS_SUITE=ci python -m pytest tests/contracts/test_keras_suite.py" in ci
    unit_part = stacks[stacks.index('if [ "$parts" != chapters ]'):stacks.index('if [ "$parts" != unit ]')]
    assert '[ "$name" = colab ]' in unit_part and '.ci/keras_suite.sh" "$name"' in unit_part
    assert (book_tools.ROOT / ".ci" / "keras_suite.sh").stat().st_mode & 0o111, "keras_suite.sh is not executable"
