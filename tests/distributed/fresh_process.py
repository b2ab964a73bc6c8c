"""A test scenario in a fresh Python process: what the MirroredStrategy tests share.

Two logical CPU devices can only be configured before TensorFlow runs its first op, so
each scenario under ``MirroredStrategy`` runs as a script in a new process (one process for
all the checks of a test module: the TensorFlow import alone takes seconds), which prints
its findings as one line ``RESULT <json>``. :data:`TWO_CPUS` is the script's opening (it
configures the devices and leaves ``json``, ``os``, ``sys`` and ``tf`` imported), and
:func:`run_script` runs a script and returns what it found.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

#: The tests' folder: the scripts find the shared modules (and ``unit/``'s) through the
#: environment variable ``COMPANION_TESTS``.
TESTS = pathlib.Path(__file__).resolve().parents[1]

#: The opening of every script: quiet logs, two logical CPU devices.
TWO_CPUS = textwrap.dedent(
    r"""
    import json, os, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
    """
)


def run_script(script: str, *, timeout: float = 600, what: str = "MirroredStrategy script") -> dict:
    """Run ``script`` in a fresh Python process and return the JSON of its last ``RESULT`` line.

    Fails the test (with the end of the script's stderr) if it exits with an error or
    prints no result.
    """
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONHASHSEED="0", COMPANION_TESTS=str(TESTS))
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout,
                               env=env)
    lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
    if completed.returncode != 0 or not lines:
        pytest.fail(f"{what} failed ({completed.returncode}):\n{completed.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])
