"""The lock: `requirements.txt` pins every package of the test and book environment, it is
what `requirements.in` resolves to, the book's lock is a subset of it at the same versions,
and the environment the tests run in is exactly the lock (`.ci/run` installs it into a
fresh virtual environment, so there this checks what installing the lock yields)."""

from __future__ import annotations

import importlib.metadata
import re

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

import book_tools

# The lock is for Python 3.11-3.13 (scripts/lock.sh); another stack has no lock to compare.
tomllib = pytest.importorskip("tomllib")

ROOT = book_tools.ROOT
# What a fresh virtual environment holds before anything is installed: the installer itself.
BOOTSTRAP = {"pip", "setuptools", "wheel"}


def _lines(path) -> list[str]:
    """The requirement lines of a requirements file, without comments."""
    lines = []
    for line in (ROOT / path).read_text().splitlines():
        line = re.sub(r"(^|\s+)#.*$", "", line).strip()
        if line:
            lines.append(line)
    return lines


def _pins(path) -> dict[str, list[Requirement]]:
    pins: dict[str, list[Requirement]] = {}
    for line in _lines(path):
        if line.startswith("-e "):
            continue
        requirement = Requirement(line)
        pins.setdefault(canonicalize_name(requirement.name), []).append(requirement)
    return pins


def _applicable(pins: dict[str, list[Requirement]]) -> dict[str, str]:
    """name -> version of the pins whose marker holds in this environment."""
    chosen = {}
    for name, requirements in pins.items():
        matching = [r for r in requirements if r.marker is None or r.marker.evaluate()]
        assert len(matching) <= 1, f"{name}: several pins apply here: {matching}"
        if matching:
            chosen[name] = str(matching[0].specifier).removeprefix("==")
    return chosen


@pytest.mark.parametrize("lock", ["requirements.txt", "requirements-book.txt"])
def test_every_package_of_the_lock_is_pinned_exactly(lock):
    lines = _lines(lock)
    assert "-e ." in lines, f"{lock} must install the package from the checkout (`-e .`)"
    for line in lines:
        if line == "-e .":
            continue
        assert not line.startswith("-"), f"{lock}: unexpected option line {line!r}"
        requirement = Requirement(line)
        specifiers = list(requirement.specifier)
        assert len(specifiers) == 1 and specifiers[0].operator == "==", f"{lock}: {line!r} is not an exact pin"
        assert "*" not in specifiers[0].version, f"{lock}: {line!r} is not an exact pin"
    assert "bash scripts/lock.sh" in (ROOT / lock).read_text(), f"{lock} does not say how to refresh it"


def test_the_lock_covers_its_input_and_the_package_requirements():
    pins = _pins("requirements.txt")
    for line in _lines("requirements.in") + _lines("requirements-book.in"):
        if line.startswith("-e "):
            continue
        requirement = Requirement(line)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"requirements.in asks for {name}, which the lock does not pin"
        for pin in pins[name]:
            version = str(pin.specifier).removeprefix("==")
            assert requirement.specifier.contains(version, prereleases=True), f"{pin} does not satisfy {line}"
    # The package's loose bounds (pyproject.toml) admit the locked versions.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for line in project["dependencies"]:
        requirement = Requirement(line)
        for pin in pins[canonicalize_name(requirement.name)]:
            assert requirement.specifier.contains(str(pin.specifier).removeprefix("=="))


def test_the_book_lock_is_the_full_lock_restricted_to_what_the_build_needs():
    full, book = _pins("requirements.txt"), _pins("requirements-book.txt")
    assert set(book) < set(full)
    for name, requirements in book.items():
        # Markers may be narrower in the subset (fewer packages need it); versions may not differ.
        versions = {str(r.specifier) for r in requirements}
        assert versions <= {str(r.specifier) for r in full[name]}, (
            f"requirements-book.txt pins {name} {versions}, unlike requirements.txt: run `bash scripts/lock.sh`"
        )
    # It leaves out the test stack.
    assert not {"pytest", "hypothesis", "nbval", "selenium"} & set(book)
    assert {"jupyter-book", "sphinxext-opengraph", "sphinx-sitemap", "tensorflow"} <= set(book)


@pytest.mark.lock
def test_the_test_environment_is_exactly_the_lock():
    """Every locked package is installed at its pinned version, and nothing else is
    installed (apart from the installer that a fresh virtual environment starts with)."""
    locked = _applicable(_pins("requirements.txt"))
    installed = {}
    for dist in importlib.metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        installed[name] = dist.version
    own = canonicalize_name("nan-gradients-companion")
    assert installed.get(own) == book_tools.package_version(), "the package itself is not installed (`-e .`)"
    del installed[own]
    wrong = {n: (v, installed.get(n)) for n, v in locked.items() if n not in installed or
             Version(installed[n]) != Version(v)}
    extra = sorted(set(installed) - set(locked) - BOOTSTRAP)
    assert not wrong, f"locked version vs installed (None: missing): {wrong}; run `pip install -r requirements.txt`"
    assert not extra, f"installed but not in the lock: {extra} (add them to requirements.in and run scripts/lock.sh)"
