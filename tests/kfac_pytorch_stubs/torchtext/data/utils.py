"""``get_tokenizer('basic_english')``: torchtext's rules (lower-case, split off punctuation)."""

from __future__ import annotations

import re
from collections.abc import Callable

_RULES = [
    (re.compile(r"\'"), " '  "),
    (re.compile(r"\""), ""),
    (re.compile(r"\."), " . "),
    (re.compile(r"<br \/>"), " "),
    (re.compile(r","), " , "),
    (re.compile(r"\("), " ( "),
    (re.compile(r"\)"), " ) "),
    (re.compile(r"\!"), " ! "),
    (re.compile(r"\?"), " ? "),
    (re.compile(r"\;"), " "),
    (re.compile(r"\:"), " "),
    (re.compile(r"\s+"), " "),
]


def _basic_english(line: str) -> list[str]:
    line = line.lower()
    for pattern, replacement in _RULES:
        line = pattern.sub(replacement, line)
    return line.split()


def get_tokenizer(tokenizer: str | None, language: str = "en") -> Callable[[str], list[str]]:
    """Only ``'basic_english'`` (what the example asks for) and ``None`` (split on spaces)."""
    if tokenizer is None:
        return str.split
    if tokenizer != "basic_english":
        raise ValueError(
            f"stand-in get_tokenizer: tokenizer={tokenizer!r}; allowed: 'basic_english', None"
        )
    return _basic_english
