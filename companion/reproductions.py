"""Moved to companion.book.reproductions;
the old path keeps working, with a warning, for one release after the move.

It warns with a ``DeprecationWarning`` and is the new module itself
(:mod:`companion._moved`).
"""

from companion._moved import alias

alias(__name__)
