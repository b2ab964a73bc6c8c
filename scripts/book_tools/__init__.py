"""The book's tools: what the contributor commands in ``scripts/`` and the tests share.

Not part of the ``companion`` package: nothing here is needed to *use* the book's code. The commands
(``python scripts/<name>.py``) put ``scripts/`` on ``sys.path`` and run a module's ``main``; so do the
tests (``conftest.py``) and the book's build (``_config.yml``, ``sphinx.local_extensions``).

==========================  ===========================================================================
module                      what it holds
==========================  ===========================================================================
:mod:`.settings`            the repository's paths, ``_config.yml``'s settings, ``_toc.yml``'s pages
:mod:`.cells`               the install cell every chapter starts with; what the book shows of a cell
:mod:`.solutions`           exercises' solutions hidden until opened (``scripts/hide_solutions.py``)
:mod:`.causes_table`        the API page's table of the doctor's causes, from ``CAUSES``
:mod:`.refresh`             re-executing the chapters (``scripts/refresh_notebooks.py``)
:mod:`.release`             the version rule, cutting a release, the release workflow's checks and
                            inputs (``scripts/release.py``)
:mod:`.zh`                  the Chinese edition: units, stores, glossary, tree, command
                            (``scripts/translate_book.py``)
:mod:`.sphinx_zh`           the Sphinx extension that builds the Chinese edition with the English one
==========================  ===========================================================================

The names below are the shared ones, defined in the first four modules and listed here so that a
command or a test says ``book_tools.toc_sources()``; patch them where they are defined.
"""

from __future__ import annotations

from .causes_table import API_PAGE, CAUSES_TABLE_HEADER, causes_table, with_causes_table
from .cells import (
    CODE_CELL_LINES,
    CODE_WIDTH,
    COLAB_MARKER,
    COLAB_TAGS,
    colab_cell_source,
    colab_install_spec,
    first_code_cell,
    install_ref,
    installed_ref,
    installed_url,
    is_colab_cell,
    shown_text_lines,
)
from .settings import (
    BOOK,
    LINKED_PAGES,
    ROOT,
    colab_launch_url,
    config,
    html_baseurl,
    linked_pages,
    notebooks,
    package_version,
    pages_url,
    path_to_book,
    rel,
    repository_branch,
    repository_url,
    toc_sources,
)
from .solutions import (
    SOLUTION_CLOSE,
    SOLUTION_CODE_TAG,
    SOLUTION_OPEN,
    hide_solutions,
    is_solution_code,
    solution_details,
    solution_problems,
    split_solution_text,
)

__all__ = [
    "API_PAGE", "BOOK", "CAUSES_TABLE_HEADER", "CODE_CELL_LINES", "CODE_WIDTH", "COLAB_MARKER", "COLAB_TAGS",
    "LINKED_PAGES", "ROOT", "SOLUTION_CLOSE", "SOLUTION_CODE_TAG", "SOLUTION_OPEN", "causes_table",
    "colab_cell_source", "colab_install_spec", "colab_launch_url", "config", "first_code_cell", "hide_solutions",
    "html_baseurl", "install_ref", "installed_ref", "installed_url", "is_colab_cell", "is_solution_code",
    "linked_pages", "notebooks",
    "package_version", "pages_url", "path_to_book", "rel", "repository_branch", "repository_url",
    "shown_text_lines", "solution_details", "solution_problems", "split_solution_text", "toc_sources",
    "with_causes_table",
]
