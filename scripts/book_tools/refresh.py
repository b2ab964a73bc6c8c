"""Refresh every chapter: sync its install cell, hide its solutions, re-execute it in place, drop stderr.

    python scripts/refresh_notebooks.py              # every notebook under book/
    python scripts/refresh_notebooks.py book/x.ipynb # just these

Run it after changing `companion` code that a chapter shows (or the doctor's CAUSES: it
rewrites the API page's table of them), after changing
`repository.url` in `_config.yml` (it also rewrites the links in README.md and the book's
pages) or the package version (the install cells, and the install lines and Colab links of
README.md and the book's pages, name the code of the version: `cells.install_ref`), and
commit the result: the test
suite re-runs every chapter under nbval and fails when the committed outputs are stale.
Notebooks run with the same environment as the tests (cwd = the notebook's folder,
TensorFlow's C++ logging quiet), and stderr outputs are dropped: they are machine noise,
and nbval leaves them out of the comparison too (conftest.py).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import time

import nbformat
from nbclient import NotebookClient

from . import cells, settings, solutions
from .causes_table import API_PAGE, with_causes_table

KERNEL_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONHASHSEED": "0"}
# Never in the kernels that make the committed outputs: COMPANION_PERTURB_ULP=1 (the CI
# check that moves every new variable by one ulp) would commit perturbed outputs.
KERNEL_ENV_UNSET = ("COMPANION_PERTURB_ULP",)


def prepare_kernel_environment() -> None:
    """The environment the kernels inherit: the tests' settings, and no ulp perturbation."""
    os.environ.update(KERNEL_ENV)
    for name in KERNEL_ENV_UNSET:
        if os.environ.pop(name, None) is not None:
            print(f"{name} is unset for the refresh: committed outputs are made unperturbed", flush=True)


def sync_colab_cell(nb) -> bool:
    """Make the first code cell the canonical Colab cell; return whether it changed."""
    source = cells.colab_cell_source()
    cell = cells.first_code_cell(nb)
    if cells.is_colab_cell(cell):
        changed = cell["source"] != source or cell["metadata"].get("tags") != cells.COLAB_TAGS
        cell["source"] = source
        cell["metadata"]["tags"] = list(cells.COLAB_TAGS)
        cell["outputs"] = []
        cell["execution_count"] = None
        return changed
    new = nbformat.v4.new_code_cell(source, metadata={"tags": list(cells.COLAB_TAGS)})
    index = nb["cells"].index(cell) if cell is not None else len(nb["cells"])
    nb["cells"].insert(index, new)
    return True


def refresh(path: pathlib.Path, execute: bool = True, timeout: int = 300) -> None:
    nb = nbformat.read(path, as_version=4)
    sync_colab_cell(nb)
    solutions.hide_solutions(nb)  # tags and wrappers only
    if execute:
        prepare_kernel_environment()
        start = time.perf_counter()
        NotebookClient(
            nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
        ).execute()
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                cell["outputs"] = [
                    o for o in cell["outputs"] if not (o["output_type"] == "stream" and o["name"] == "stderr")
                ]
        print(f"{path}: executed in {time.perf_counter() - start:.1f} s", flush=True)
    nbformat.write(nb, path)


def sync_links(old_url: str, new_url: str) -> None:
    """Replace the previous repository URL, and the book's URL derived from it, in README.md,
    the book's pages and the other files of ``settings.LINKED_PAGES``."""
    replacements = {old_url: new_url, settings.pages_url(old_url): settings.pages_url(new_url)}
    for page in settings.linked_pages():
        text = page.read_text()
        new_text = text
        for old, new in replacements.items():
            new_text = new_text.replace(old, new)
        if new_text != text:
            page.write_text(new_text)
            print(f"{page}: repository links now point to {new_url}")


def sync_install_refs() -> list[str]:
    """Point the install lines and Colab links of README.md, companion/README.md and the book's pages
    at the code of this version (``cells.install_ref``: the release's tag, or the development branch).
    Returns the pages rewritten."""
    written = []
    for page in cells.install_ref_pages():
        text = page.read_text()
        new_text = cells.with_install_ref(text)
        if new_text != text:
            page.write_text(new_text)
            written.append(settings.rel(page))
            print(f"{settings.rel(page)}: install lines and Colab links now name @{cells.install_ref()}")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", type=pathlib.Path, help="default: every notebook under book/")
    parser.add_argument("--no-execute", action="store_true",
                        help="only sync the install cells and lines and the API page's causes table")
    args = parser.parse_args(argv)
    paths = args.notebooks or settings.notebooks()
    new_url = settings.repository_url()
    for path in settings.notebooks():
        cell = cells.first_code_cell(nbformat.read(path, as_version=4))
        old_url = cells.installed_url("".join(cell["source"])) if cell else None
        if old_url and old_url != new_url:
            sync_links(old_url, new_url)
            break
    sync_install_refs()
    api = API_PAGE.read_text()
    if with_causes_table(api) != api:
        API_PAGE.write_text(with_causes_table(api))
        print(f"{API_PAGE.relative_to(settings.ROOT)}: the causes table, from CAUSES", flush=True)
    for i, path in enumerate(paths, 1):
        print(f"[{i}/{len(paths)}] {path}", flush=True)
        refresh(path.resolve(), execute=not args.no_execute)
    return 0
