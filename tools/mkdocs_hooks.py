"""MkDocs hooks of the documentation site (``mkdocs.yml``): README.md is its landing page.

The README is the repository's front page and links to the guides as
``docs/<page>.md``; the site's ``docs_dir`` is ``docs/``, so the README
cannot sit in it as it is.  :func:`on_files` adds it as the site's
``index.md`` with those links made relative to ``docs/``, and
:func:`on_page_markdown` maps a guide's ``../README.md`` links to that page,
so every link works both on the repository's web view and on the built
site, and ``mkdocs build --strict`` checks all of them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

#: the landing page's source, beside mkdocs.yml
README = "README.md"
#: a markdown link or image target that starts with ``docs/`` (README.md's view of the guides)
INTO_DOCS = re.compile(r"(\]\()docs/")
#: a guide's link to the README (``../README.md`` or ``../README.md#anchor``)
TO_README = re.compile(r"(\]\()\.\./README\.md(?=[#)])")


def readme_path(config: MkDocsConfig) -> Path:
    return Path(config.config_file_path).parent / README


def landing_page(readme: str) -> str:
    """The README's text as ``docs/index.md``: its ``docs/…`` links made relative to ``docs/``."""
    return INTO_DOCS.sub(r"\1", readme)


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    config.watch.append(str(readme_path(config)))  # `mkdocs serve` rebuilds on a README edit
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    if files.get_file_from_path("index.md") is not None:
        raise ValueError(f"{config.docs_dir}/index.md exists: the landing page is {README}")
    content = landing_page(readme_path(config).read_text(encoding="utf-8"))
    files.append(File.generated(config, "index.md", content=content))
    return files


def on_page_markdown(markdown: str, page: Page, **_: Any) -> str:
    return TO_README.sub(r"\1index.md", markdown)
