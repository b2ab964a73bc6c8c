"""The book's intro says which TensorFlow and Keras its numbers come from: the lock's."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _pinned(package: str) -> str:
    text = (ROOT / "requirements.txt").read_text(encoding="utf-8")
    match = re.search(rf"^{package}==([\w.]+)\s*(#.*)?$", text, re.MULTILINE)  # uv adds "# via" comments
    assert match, f"requirements.txt pins no exact {package} version"
    return match.group(1)


def test_intro_names_the_locked_tensorflow_and_keras():
    intro = " ".join((ROOT / "book" / "intro.md").read_text(encoding="utf-8").split())
    tensorflow, keras = _pinned("tensorflow"), _pinned("keras")
    assert f"TensorFlow {tensorflow} and Keras {keras}" in intro, (tensorflow, keras)


def test_intro_says_what_setup_does_on_a_gpu():
    intro = (ROOT / "book" / "intro.md").read_text(encoding="utf-8")
    assert "**On a GPU runtime.**" in intro
    assert "deterministic=True" in intro
