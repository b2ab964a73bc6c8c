"""``python -m companion.diagnostics your_script.py [args]``: the NaN doctor, no code change.

Runs an unmodified training script (or ``-m package.module``) with the doctor attached:
every ``keras.Model.fit`` it calls gets a :class:`~companion.diagnostics.NaNDoctor`
callback (unless it already has one), which prints the diagnosis at the first batch
that makes a logged value or a weight non-finite and stops that ``fit`` (``--keep-going``:
training goes on); every :func:`companion.training.train` it calls prints the diagnosis
of its first skipped step, even with ``verbose=0``. The script sees its own arguments
in ``sys.argv`` and runs as ``__main__``, as JAX's ``JAX_DEBUG_NANS=1`` needs no change
to the code either. Everything is put back when the script ends.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import runpy
import sys
import threading
from typing import Iterator, Sequence

USAGE = """usage: python -m companion.diagnostics [--keep-going] script.py [args ...]
       python -m companion.diagnostics [--keep-going] -m package.module [args ...]

Run a training script unchanged, with the NaN doctor attached to every keras fit and
companion.training.train it calls; the diagnosis is printed at the first NaN.
  --keep-going   do not stop fit at the first NaN (the doctor still diagnoses it once)
"""

_state = threading.local()


def _in_train() -> bool:
    """Whether this ``fit`` is the one :func:`companion.training.train` runs (it has its own doctor)."""
    if getattr(_state, "train_depth", 0):
        return True
    frame = sys._getframe(2)
    while frame is not None:
        if os.sep + os.path.join("companion", "training") + os.sep in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def attached(*, stop_training: bool = True) -> Iterator[None]:
    """While the block runs, every ``keras.Model.fit`` and ``companion.training.train`` has the doctor."""
    import keras  # noqa: PLC0415 - only when a script is run

    import companion.training as training  # noqa: PLC0415
    from companion.diagnostics.callback import NaNDoctor  # noqa: PLC0415

    original_fit = keras.Model.fit
    signature = inspect.signature(original_fit)
    original_train = training.train

    def fit(self, *args, **kwargs):
        if _in_train():
            return original_fit(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        callbacks = list(bound.arguments.get("callbacks") or [])
        if not any(isinstance(c, NaNDoctor) for c in callbacks):
            callbacks.append(NaNDoctor(stop_training=stop_training))
        bound.arguments["callbacks"] = callbacks
        return original_fit(*bound.args, **bound.kwargs)

    def train(model, *args, **kwargs):
        _state.train_depth = getattr(_state, "train_depth", 0) + 1
        quiet = kwargs.get("verbose", "auto") == 0
        try:
            history = original_train(model, *args, **kwargs)
        except Exception as error:
            reports = getattr(error, "reports", ())
            _print_first(reports, quiet)
            raise
        finally:
            _state.train_depth -= 1
        _print_first(getattr(history, "reports", ()), quiet)
        return history

    fit.__wrapped__ = original_fit
    train.__wrapped__ = original_train
    keras.Model.fit = fit
    training.train = train
    try:
        yield
    finally:
        keras.Model.fit = original_fit
        training.train = original_train


def _print_first(reports, quiet: bool) -> None:
    """Print the diagnosis of ``train``'s first skipped step, if ``train`` did not (``verbose=0``)."""
    if not quiet:
        return
    for report in reports:
        diagnosis = getattr(report, "diagnosis", None)
        if diagnosis is not None:
            print(f"NaN doctor: companion.training.train skipped step {report.step}.\n{diagnosis}", flush=True)
            return


def main(argv: Sequence[str] | None = None) -> int:
    """Run a script or module with the doctor attached (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    stop = True
    while argv and argv[0] == "--keep-going":
        stop = False
        argv.pop(0)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    if argv[0] == "-m":
        if len(argv) < 2:
            print(USAGE, end="", file=sys.stderr)
            return 2
        module, rest = argv[1], argv[2:]
        sys.argv = [module, *rest]
        with attached(stop_training=stop):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    script, rest = argv[0], argv[1:]
    if not os.path.exists(script):
        print(f"python -m companion.diagnostics: no such script: {script}", file=sys.stderr)
        return 2
    sys.argv = [script, *rest]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    with attached(stop_training=stop):
        runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
