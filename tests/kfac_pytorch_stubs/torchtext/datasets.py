"""``WikiText2``, ``PennTreebank`` and ``WikiText103``: lines of real English, offline.

The text is Python's own documentation as embedded in ``pydoc_data.topics``
(shipped with CPython), split into non-empty lines.  Each data set reads its
own stretch of it; within a stretch every tenth line goes to ``valid``, the
next to ``test``, the rest to ``train``.  The result is a list, so it can be
iterated more than once (the example builds the vocabulary from ``train`` and
then encodes it).

Each split holds an odd number of ``basic_english`` tokens (a final ``"."``
line is added where needed), so an even ``--seq-len`` never divides it: the
example's ``_Dataset`` would then make its last target one token short and the
batch would not stack (a latent bug of the example, left as it is).
"""

from __future__ import annotations

from pydoc_data.topics import topics

from torchtext.data.utils import get_tokenizer

LINES_PER_DATASET = 400
_OFFSETS = {"PennTreebank": 0, "WikiText2": 3000, "WikiText103": 6000}
_SPLITS = ("train", "valid", "test")


def _lines(name: str, root: str, split: str) -> list[str]:
    if split not in _SPLITS:
        raise ValueError(f"stand-in {name}: split={split!r}; allowed: {_SPLITS}")
    text = [line for key in sorted(topics) for line in topics[key].splitlines() if line.strip()]
    start = _OFFSETS[name]
    stretch = text[start : start + LINES_PER_DATASET]
    picks = {"valid": lambda i: i % 10 == 8, "test": lambda i: i % 10 == 9}
    keep = picks.get(split, lambda i: i % 10 < 8)
    lines = [line for i, line in enumerate(stretch) if keep(i)]
    tokenize = get_tokenizer("basic_english")
    if sum(len(tokenize(line)) for line in lines) % 2 == 0:
        lines.append(".")
    return lines


def PennTreebank(root: str = ".data", split: str = "train") -> list[str]:
    """Lines of one split."""
    return _lines("PennTreebank", root, split)


def WikiText2(root: str = ".data", split: str = "train") -> list[str]:
    """Lines of one split."""
    return _lines("WikiText2", root, split)


def WikiText103(root: str = ".data", split: str = "train") -> list[str]:
    """Lines of one split."""
    return _lines("WikiText103", root, split)
