"""A griffe extension for the documentation site: the docstrings' reST markup as markdown.

kaisa's docstrings are read by ``help()`` and by editors as much as by the
site, and use Sphinx's roles (``:class:`kaisa.KFACConfig```) and literal
blocks (``…as follows::``).  mkdocstrings renders docstrings as markdown,
where both would show as written; this rewrites them, for the site only, as
inline code and a plain colon.  ``mkdocs.yml`` loads it
(``plugins.mkdocstrings.handlers.python.options.extensions``).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

#: a Sphinx cross-reference role, its target without ``~`` or a leading dot
ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|attr|data|exc|obj|const):`[~.]*([^`]+)`")
#: a paragraph that ends in ``::`` (reST: a literal block follows)
LITERAL = re.compile(r"(?<=\S)::$", re.MULTILINE)


def as_markdown(docstring: str) -> str:
    """``docstring`` with its roles as inline code and its ``::`` as ``:``."""
    return LITERAL.sub(":", ROLE.sub(r"`\1`", docstring))


class RestMarkup(griffe.Extension):
    """Rewrites every docstring griffe reads (:func:`as_markdown`)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = as_markdown(obj.docstring.value)
