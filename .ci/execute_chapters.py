"""Execute every chapter from a folder outside the repository, as a Colab reader would.

    python -I .ci/execute_chapters.py BOOK_DIR [NOTEBOOK ...]

Run with the Python of the environment under test (``-I``: nothing of the current folder on
``sys.path``). Each notebook under BOOK_DIR (or each one given) is copied into a fresh
temporary folder and executed there with nbclient, in a kernel of this Python; only the
installed ``companion`` is importable, no file of the repository is at hand.

- Cells tagged ``nbval-skip`` (the install cell) are left out.
- A cell tagged ``raises-exception`` must raise; any other cell must not.
- Outputs are not compared (that is done on the locked stack, by nbval).

A last cell, added to the copy, checks that the kernel ran this Python and imported
``companion`` from its site-packages (the installed wheel, not a checkout). Exits non-zero if any chapter fails; prints
each chapter's time.
"""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile
import time
from typing import IO

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, DeadKernelError

KERNEL_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONHASHSEED": "0"}
CHECK = """\
import pathlib, sys, sysconfig
import companion
assert sys.executable == {executable!r}, sys.executable
assert pathlib.Path(sysconfig.get_paths()["purelib"]).resolve() in pathlib.Path(companion.__file__).resolve().parents, (
    f"companion imported from {{companion.__file__}}, not from the installed package"
)
"""


def execute(source: pathlib.Path, folder: pathlib.Path, timeout: int, stderr: IO[bytes]) -> list[str]:
    """Execute a copy of ``source`` in ``folder``; return the problems found (empty: it passed).

    The kernel's own stderr (TensorFlow's C++ logging) goes to ``stderr``.
    """
    nb = nbformat.read(source, as_version=4)
    nb.cells = [cell for cell in nb.cells if "nbval-skip" not in cell.metadata.get("tags", [])]
    check = CHECK.format(executable=sys.executable)
    nb.cells.append(nbformat.v4.new_code_cell(check))
    copy = folder / source.name
    nbformat.write(nb, copy)
    client = NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(folder)}}
    )
    try:
        client.execute(stderr=stderr)
    except (CellExecutionError, DeadKernelError) as error:
        return [str(error)[-3000:]]
    problems = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or "raises-exception" not in cell.metadata.get("tags", []):
            continue
        if not any(output.output_type == "error" for output in cell.outputs):
            problems.append(f"cell {index} is tagged raises-exception but raised nothing:\n{cell.source}")
    return problems


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    book = pathlib.Path(argv[0]).resolve()
    notebooks = [pathlib.Path(p).resolve() for p in argv[1:]] or sorted(book.glob("**/*.ipynb"))
    notebooks = [p for p in notebooks if "_build" not in p.parts and ".ipynb_checkpoints" not in p.parts]
    os.environ.update(KERNEL_ENV)
    os.environ.pop("PYTHONPATH", None)
    failed = []
    total = time.perf_counter()
    for notebook in notebooks:
        name = notebook.relative_to(book)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="chapter-") as tmp:
            folder = pathlib.Path(tmp) / name.parent
            folder.mkdir(parents=True)
            os.chdir(folder)  # the kernel starts here; nothing of the repository around it
            log = pathlib.Path(tmp) / "kernel-stderr.txt"
            with log.open("wb") as stderr:
                problems = execute(notebook, folder, timeout=300, stderr=stderr)
            if problems:
                problems.append("the kernel's stderr ended with:\n" + log.read_text(errors="replace")[-2000:])
            os.chdir(tempfile.gettempdir())
        status = "ok" if not problems else "FAILED"
        print(f"  {name}: {status} in {time.perf_counter() - start:.0f} s", flush=True)
        if problems:
            failed.append(name)
            for problem in problems:
                print("    " + problem.replace("\n", "\n    "), flush=True)
    print(f"  {len(notebooks) - len(failed)} of {len(notebooks)} chapters ran in "
          f"{time.perf_counter() - total:.0f} s")
    if failed:
        print("  failed: " + ", ".join(map(str, failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
