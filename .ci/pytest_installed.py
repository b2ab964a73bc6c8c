"""pytest with the given arguments, then a check that `companion` came from the installed wheel.

Run with ``python -I`` (neither the current folder nor PYTHONPATH on sys.path) and pytest's
``--import-mode=importlib`` (pytest adds no folder of the checkout either): .ci/stacks.sh's
unit tests and .ci/keras_suite.sh test the package as a reader installs it.
"""

import pathlib
import sys
import sysconfig

import pytest

code = pytest.main(sys.argv[1:])
import companion  # noqa: E402

where = pathlib.Path(companion.__file__).resolve()
if pathlib.Path(sysconfig.get_paths()["purelib"]).resolve() not in where.parents:
    sys.exit(f"the tests imported companion from {where}, not from the installed wheel")
sys.exit(code)
