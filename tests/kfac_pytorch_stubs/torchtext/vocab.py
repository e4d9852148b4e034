"""``build_vocab_from_iterator`` and the ``Vocab`` methods the example calls."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence


class Vocab:
    """Token ↔ index map; unknown tokens map to the default index once it is set."""

    def __init__(self, tokens: Sequence[str]) -> None:
        self._itos = list(tokens)
        self._stoi = {token: i for i, token in enumerate(self._itos)}
        self._default: int | None = None

    def __len__(self) -> int:
        return len(self._itos)

    def __contains__(self, token: str) -> bool:
        return token in self._stoi

    def __getitem__(self, token: str) -> int:
        if token in self._stoi:
            return self._stoi[token]
        if self._default is None:
            raise RuntimeError(f"token {token!r} not found and default index is not set")
        return self._default

    def __call__(self, tokens: Iterable[str]) -> list[int]:
        return [self[token] for token in tokens]

    def set_default_index(self, index: int | None) -> None:
        self._default = index

    def get_default_index(self) -> int | None:
        return self._default

    def lookup_tokens(self, indices: Iterable[int]) -> list[str]:
        return [self._itos[int(i)] for i in indices]

    def get_itos(self) -> list[str]:
        return list(self._itos)

    def get_stoi(self) -> dict[str, int]:
        return dict(self._stoi)


def build_vocab_from_iterator(
    iterator: Iterable[Iterable[str]],
    min_freq: int = 1,
    specials: Sequence[str] | None = None,
    special_first: bool = True,
    max_tokens: int | None = None,
) -> Vocab:
    """torchtext's order: specials, then tokens by falling frequency, ties alphabetical."""
    counter: Counter[str] = Counter()
    for tokens in iterator:
        counter.update(tokens)
    specials = list(specials or [])
    ranked = sorted(counter.items(), key=lambda item: (-item[1], item[0]))
    words = [t for t, n in ranked if n >= min_freq and t not in specials]
    if max_tokens is not None:
        words = words[: max_tokens - len(specials)]
    return Vocab(specials + words if special_first else words + specials)
