"""The Chinese edition (简体中文版): written from the English sources and the stored translations.

One set of chapters, two languages. Every page of the book (each source that ``_toc.yml`` lists) has a
translation store beside it, ``<page>.zh.json`` (``book/case_a/reproduce.ipynb`` ->
``book/case_a/reproduce.zh.json``). It holds one entry per *unit* of English text: a markdown cell of a notebook
(keyed by the cell's id) or a block of a markdown page (keyed ``b<index>``; blocks are separated by blank lines,
fenced code blocks kept whole, a table's rows each their own block). Each entry keeps the SHA-256 of the English text it translates, that English text
(so that ``--stale`` can show what changed), and the Chinese text; the repository's and the book's URLs are kept as
placeholders, so that a fork's other ``repository.url`` needs no new translation. ``_site.zh.json`` at the root holds the book's
title, the part captions of ``_toc.yml`` and the footer.

The Chinese tree mirrors the English one under ``zh/`` (``zh/book/case_a/reproduce.ipynb``), so that every page
has the same path in both editions (the built site puts the Chinese one under ``zh/``):

- a notebook is the English notebook with each markdown cell's source replaced by its translation: code cells,
  their outputs, execution counts and every metadata field are the English notebook's, byte for byte (the file is
  written exactly as nbformat writes the English one);
- a markdown page is the translations of its blocks, joined as the English blocks are;
- in both, each glossary term (``book/glossary.zh.md``) gets its English once per page, at its first use in
  running text, and a line break between two Chinese characters is removed (a browser shows it as a space;
  the stores keep the translations wrapped as they were written);
- ``zh/_config.yml`` is ``_config.yml`` with the Chinese title, ``language: zh_CN``, the site's URLs under
  ``zh/`` and the paths made relative to ``zh/``; ``zh/_toc.yml`` is ``_toc.yml`` with Chinese captions and
  the glossary page (``book/glossary.zh.md``, written in Chinese only) added;
- ``book/references.bib`` is copied.

A unit's translation is looked up by its key and the hash of its current English text; failing that, by the hash
alone (a cell that moved, a block that shifted). When neither matches, the translation is *missing* (no entry for
the key) or *stale* (the English changed after it was translated), and writing fails naming the page and the
cell. ``tests/book/test_translations.py`` checks the same and that the Chinese notebooks' code and outputs are the
English ones.

The modules, in the order the text flows:

- :mod:`.units`: the English units of a page (a notebook's markdown cells, a markdown page's blocks
  and table rows) and of the site (title, footer, part captions);
- :mod:`.store`: the translation stores (``<page>.zh.json``), the lookup by key and hash, the problems,
  and the export/import of units for translating;
- :mod:`.glossary`: the English of each glossary term at its first use on a page;
- :mod:`.render`: the Chinese tree ``zh/`` (notebooks, pages, ``_config.yml``, ``_toc.yml``);
- :mod:`.cli`: ``python scripts/translate_book.py``.

The Sphinx extension that builds this tree with the English book is :mod:`book_tools.sphinx_zh`.
"""
