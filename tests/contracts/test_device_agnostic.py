"""Nothing in `companion` pins work to a device.

Readers run the chapters on CPU and GPU runtimes, and the training loop must run under any
`tf.distribute` strategy, so the package must leave placement to TensorFlow. This test reads
the package's source (every ``.py`` file under ``companion/``, subpackages included) and
fails on:

- a call ``*.device("...")`` or ``device("...")`` with a constant name (``tf.device``,
  ``keras.device``, ``tf.compat.v1.device``, or one imported under its own name);
- a string constant that names a device, like ``"/CPU:0"``, ``"/device:GPU:0"`` or
  ``"/job:worker/replica:0/task:0/device:CPU:0"``;
- a call of ``set_visible_devices`` (hiding the GPU pins everything to the CPU).

A device chosen from the arguments (``tf.device(device)``) or from what TensorFlow lists
(``tf.config.list_logical_devices``) is not a fixed name and is allowed.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "companion"

DEVICE_NAME = re.compile(r"(?i)(^|/|device:)(cpu|gpu|tpu|xla_cpu|xla_gpu):\d+")


def _is_constant_name(node: ast.AST) -> bool:
    """A string literal, or an f-string whose parts are all literal (no placeholder)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value != ""
    if isinstance(node, ast.JoinedStr):
        return all(isinstance(part, ast.Constant) for part in node.values)
    return False


def device_pinnings(source: str, filename: str = "<source>") -> list[str]:
    """Every place in ``source`` that pins work to a fixed device, as "file:line: what"."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            args = [*node.args, *(keyword.value for keyword in node.keywords)]
            if name == "device" and any(_is_constant_name(arg) for arg in args):
                found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
            if name == "set_visible_devices":
                found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and DEVICE_NAME.search(node.value):
            found.append(f"{filename}:{node.lineno}: the device name {node.value!r}")
    return found


def _package_sources() -> list[pathlib.Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_the_package_sources_are_found():
    names = {path.relative_to(PACKAGE).as_posix() for path in _package_sources()}
    assert {"__init__.py", "numerics.py", "notebook.py", "attention.py"} <= names


def test_companion_pins_no_work_to_a_device():
    found = []
    for path in _package_sources():
        found += device_pinnings(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE.parent)))
    assert not found, "companion must leave device placement to TensorFlow:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source",
    [
        'with tf.device("/CPU:0"):\n    y = x + 1',
        "with tf.device('/device:GPU:0'):\n    pass",
        'with tensorflow.compat.v1.device("cpu:0"):\n    pass',
        'with keras.device("cpu"):\n    pass',
        'from tensorflow import device\nwith device(device_name="/gpu:1"):\n    pass',
        'with tf.device(f"/CPU:0"):\n    pass',
        'DEFAULT = "/job:worker/replica:0/task:0/device:CPU:0"',
        'tf.config.set_visible_devices([], "GPU")',
        'tf.config.experimental.set_visible_devices(cpus)',
    ],
)
def test_the_scan_finds_a_fixed_device(source):
    assert len(device_pinnings(source)) >= 1


@pytest.mark.parametrize(
    "source",
    [
        "with tf.device(device):\n    pass",
        "with tf.device(strategy.extended.worker_devices[0]):\n    pass",
        'with tf.device(f"/job:worker/task:{index}"):\n    pass',
        "with tf.device(None):\n    pass",
        'devices = tf.config.list_logical_devices("GPU")',
        'message = "no GPU is visible"',
    ],
)
def test_the_scan_allows_placement_left_to_tensorflow(source):
    assert device_pinnings(source) == []
