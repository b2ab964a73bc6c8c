"""Fixtures shared by the tests: the built book's (packaging, launch buttons, API page,
browser), the deferred update's switch, and tf.data's autotuning turned off in the test
processes.

The book is built once per test session, with the README's build command plus warnings as
errors and nitpicky references, into a temporary folder; every test that looks at the HTML
shares that one build.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import subprocess
import sys
import time

import pytest

# The tests' shared modules (training_data, keras_io_models; distributed/fresh_process for the
# MirroredStrategy tests) and the test modules another one imports
# (test_doctor_reports, test_training_custom_steps, test_browser, test_translations) import
# by name, also under --import-mode=importlib (which puts no test folder on sys.path).
_TESTS = pathlib.Path(__file__).resolve().parent
for _folder in ("book", "unit", "distributed", ""):
    sys.path.insert(0, str(_TESTS / _folder))

import book_tools  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def tf_data_without_autotuning():
    """tf.data's autotuning off by default in pytest's processes (each xdist worker's): the
    default of ``tf.data.Options().autotune.enabled`` is ``False`` for the session, and
    every ``iter(dataset)`` pipeline gets its autotuning setting written out (a pipeline
    with no options in its graph, as most of the tests' own, would autotune by the
    runtime's default; one that sets it keeps its setting; the scripts that tests run in fresh
    processes and the chapters' kernels keep autotuning). Both are put back at the
    session's end (an ``Options`` read meanwhile keeps ``False``: TensorFlow's getter
    stores it).

    An iterator of a pipeline that autotunes (Keras' own input pipelines, a ``prefetch`` or
    ``map`` with ``tf.data.AUTOTUNE``) runs a model thread; in the lock's TensorFlow (2.21)
    freeing such an iterator late (a garbage collection, tests later) can wait for that
    thread's next wake-up, up to a minute, with no CPU used. Measured in this suite (2026-12-05): in
    each run, five tests or so that stalled 10-80 s (a different few each time, whichever
    was running when the collection came), 130-240 s of the two workers' time;
    test_doctor_remedies.py and test_models.py in one process took 63.0 s for 55.0 s of
    CPU with autotuning, 50.2 s for 51.3 s without. With the default alone, the pipelines
    that tests build themselves kept autotuning: two or three stalls of 29-57 s a run
    remained (2026-12-05, the same wait in gdb), none with the options written out.
    Autotuning sets buffer sizes and parallelism only: no element, order or value changes.
    If TensorFlow's options module moves, the tests run with autotuning as it is.
    """
    try:
        from tensorflow.python.data.ops import iterator_ops
        from tensorflow.python.data.ops import options as data_options
        from tensorflow.python.data.util import options as options_util
    except ImportError:
        yield
        return
    default = data_options.AutotuneOptions.enabled
    data_options.AutotuneOptions.enabled = options_util.create_option(
        name="enabled", ty=bool, docstring=default.__doc__, default_factory=lambda: False)
    # A pipeline no one gave options to (a test's own ``from_tensor_slices(...).batch(8)``
    # handed to fit) carries none in its graph, and the runtime's default is to autotune:
    # every iterator's pipeline gets the options written out.
    create_iterator = iterator_ops.OwnedIterator._create_iterator

    def create_without_autotuning(self, dataset):
        options = data_options.Options()
        options.autotune.enabled = dataset.options().autotune.enabled
        return create_iterator(self, dataset.with_options(options))

    iterator_ops.OwnedIterator._create_iterator = create_without_autotuning
    yield
    iterator_ops.OwnedIterator._create_iterator = create_iterator
    data_options.AutotuneOptions.enabled = default


@dataclasses.dataclass(frozen=True)
class BuiltBook:
    html: pathlib.Path
    returncode: int
    log: str
    seconds: float

    def page(self, source: pathlib.Path) -> pathlib.Path:
        """The HTML page built from a source file of the book (a .md or .ipynb under ROOT)."""
        return self.html / source.relative_to(book_tools.ROOT).with_suffix(".html")


def _problems_first(log: str) -> str:
    """The warning and error lines of a build log, then its end."""
    problems = [line for line in log.splitlines() if re.search(r"\b(WARNING|ERROR|CRITICAL)\b", line)]
    problems = [line for line in problems if "absl::InitializeLog" not in line]  # TensorFlow's import noise
    return "\n".join(problems[:50]) + "\n...\n" + log[-3000:]


@pytest.fixture(scope="session")
def built_book(tmp_path_factory) -> BuiltBook:
    """`jupyter-book build . -W -n --keep-going`, run once for the whole session."""
    out = tmp_path_factory.mktemp("book")
    jupyter_book = pathlib.Path(sys.executable).with_name("jupyter-book")
    start = time.perf_counter()
    result = subprocess.run(
        [str(jupyter_book), "build", str(book_tools.ROOT), "-W", "-n", "--keep-going", "--path-output", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    book = BuiltBook(
        html=out / "_build" / "html",
        returncode=result.returncode,
        log=_problems_first(result.stdout + result.stderr),
        seconds=time.perf_counter() - start,
    )
    if not (book.html / "index.html").exists():
        pytest.fail(f"the book did not build:\n{book.log}")
    return book


@pytest.fixture
def always_defer(monkeypatch):
    """``train`` defers the update whatever the call's length: the tests of the deferred
    update on small models (a short call on one takes the masked step, see
    ``companion.training.deferred.DEFER_FROM``)."""
    from companion.training import deferred

    monkeypatch.setattr(deferred, "DEFER_FROM", 0)
