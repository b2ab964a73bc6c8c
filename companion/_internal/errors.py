"""Private TensorFlow/Keras APIs, one family: tensorFlow's error texts: XLA compilation failures, collective failures.

Each hook says what it relies on and what happens when it is gone, and is registered
(:func:`companion._internal.registry.hook`) with its canary tests.
"""

from __future__ import annotations

import re


from companion._internal.registry import hook


# --------------------------------------------------------------------------------------
# TensorFlow's error texts
# --------------------------------------------------------------------------------------
# Relies on: the wording of TensorFlow's messages for (a) an XLA compilation failure,
# (b) an aborted collective. They are not an API.
# If gone: (a) an XLA failure is raised instead of retried without XLA; (b) the
# WorkerLostError message quotes the first line of TensorFlow's error. Each canary
# test provokes the real error.

_XLA_MARKERS = ("_XlaMustCompile", "XLA_CPU_JIT", "XLA_GPU_JIT", "XLA_TPU_JIT", "could not be compiled", "XlaCompile")


@hook('test_xla_failure_text_is_recognised')
def looks_like_xla_failure(error: Exception) -> bool:
    """Whether ``error`` says that XLA could not compile a function."""
    return any(marker in str(error) for marker in _XLA_MARKERS)


@hook('test_xla_failure_text_is_recognised')
def xla_failure_summary(error: Exception) -> str:
    """One line saying why XLA failed, e.g. ``"no XLA kernel for EagerPyFunc"``."""
    text = str(error)
    unsupported = re.search(r"on XLA_\w+_JIT: ([\w, ]+)", text)
    if unsupported:
        return f"no XLA kernel for {unsupported.group(1).strip()}"
    for line in text.splitlines():
        if "XLA" in line or "compile" in line:
            return line.strip()[:300]
    return text.strip().splitlines()[0][:300] if text.strip() else type(error).__name__


@hook('test_collective_error_texts_are_summarised')
def collective_error_summary(text: str) -> str:
    """The line of a failed collective's error message that says what happened."""
    text = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", text)
    aborted = re.search(r"Collective ops is aborted by: (.+)", text)
    if aborted:
        return aborted.group(1).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if re.search(r"unhealthy|timed out|reset by peer|refused|Socket closed|is down|unavailable", line, re.I):
            return line
    return lines[0] if lines else ""


@hook('test_collective_error_texts_are_summarised')
def tasks_named_in(text: str) -> tuple[str, ...]:
    """The ``/job:…/replica:…/task:…`` names in an error message, in order, once each."""
    return tuple(dict.fromkeys(re.findall(r"/job:\w+/replica:\d+/task:\d+", text)))
