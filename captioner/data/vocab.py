"""Tokenizer and vocabulary: built from training captions only (or a trained model's grown with their new words),
saved as JSON (never pickled)."""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Iterable, Sequence

from nltk.tokenize import RegexpTokenizer

from captioner.config import MAX_VOCAB_SIZE, DataConfig
from captioner.errors import DataError, check_range
from captioner.fileio import read_json, write_json

_TOKENIZER = RegexpTokenizer(r"[^\W_]+")  # runs of letters/digits; needs no downloaded nltk data
_FORMAT, _VERSION = "captioner-vocab", 1

# The special tokens, first in every vocabulary in this order: ids 0..3.
PAD, START, END, UNK = "<pad>", "<start>", "<end>", "<unk>"
SPECIALS = (PAD, START, END, UNK)
PAD_ID, START_ID, END_ID, UNK_ID = range(len(SPECIALS))


def tokenize(text: str) -> list[str]:
    """Lower-case ``text`` and split it into words and numbers (punctuation dropped)."""
    return _TOKENIZER.tokenize(text.lower())


def has_words(caption: str) -> bool:
    """Whether ``tokenize`` reads a word in ``caption``: one that is empty, or only punctuation, symbols or emoji,
    would train (and be scored as) an empty sentence, so no reader takes it as a caption."""
    return bool(tokenize(caption))


def word_counts(captions: Iterable[str], lengths: Counter[int] | None = None) -> Counter[str]:
    """How often each word (``tokenize``'s) occurs in ``captions``; ``lengths`` (when given) counts the captions
    by their number of words on the way."""
    counts: Counter[str] = Counter()
    for caption in captions:
        words = tokenize(caption)
        counts.update(words)
        if lengths is not None:
            lengths[len(words)] += 1
    return counts


class Vocabulary:
    """Word <-> id mapping; ids 0..3 are ``<pad>``, ``<start>``, ``<end>``, ``<unk>``."""

    def __init__(self, words: Sequence[str]) -> None:
        """``words`` in id order; the four specials are put first unless ``words`` starts with them. ValueError
        for a repeated word or more than ``MAX_VOCAB_SIZE`` words besides the specials."""
        words = list(words)
        if tuple(words[:4]) == SPECIALS:
            words = words[4:]
        if len(words) > MAX_VOCAB_SIZE:
            raise ValueError(f"{len(words):,} words besides the specials, at most {MAX_VOCAB_SIZE:,}")
        repeated = sorted(w for w, n in Counter(words).items() if n > 1 or w in SPECIALS)
        if repeated:
            raise ValueError(f"vocabulary words repeat or clash with the specials: {repeated[:5]}")
        self.itos: list[str] = [*SPECIALS, *words]
        self.stoi: dict[str, int] = {w: i for i, w in enumerate(self.itos)}

    @classmethod
    def build(
        cls, captions: Iterable[str], min_count: int = DataConfig.min_word_count, max_size: int | None = None
    ) -> Vocabulary:
        """Words seen at least ``min_count`` times in ``captions``, most frequent first (ties by word).

        ``max_size`` caps the number of words besides the four specials. Pass training captions only.
        """
        return cls([]).grow(word_counts(captions), min_count, max_size)

    def grow(
        self, counts: Counter[str], min_count: int = DataConfig.min_word_count, max_size: int | None = None
    ) -> Vocabulary:
        """This vocabulary's words in their order (their ids unchanged), then the words of ``counts`` (word ->
        occurrences in the training captions: ``word_counts``) it lacks that occur at least ``min_count`` times,
        most frequent first (ties by word), as many as bring the words besides the specials to ``max_size`` (None:
        all; a vocabulary already that large gains none)."""
        check_range("min_count", min_count, 1, kind=int)
        if max_size is not None:
            check_range("max_size", max_size, 0, kind=int)
        new = sorted(
            (w for w, n in counts.items() if n >= min_count and w not in self.stoi), key=lambda w: (-counts[w], w)
        )
        room = None if max_size is None else max(0, max_size - (len(self) - len(SPECIALS)))
        return type(self)([*self.itos, *new[:room]])

    def unknown(self, counts: Counter[str]) -> Counter[str]:
        """The words of ``counts`` (word -> occurrences: ``word_counts``) that this vocabulary lacks, each with its
        occurrences: what ``encode`` reads as ``<unk>``."""
        return Counter({w: n for w, n in counts.items() if w not in self.stoi})

    def encode(self, caption: str, max_len: int) -> list[int]:
        """``[<start>] + ids of the first max_len words (unknown -> <unk>) + [<end>]``."""
        ids = [self.stoi.get(word, UNK_ID) for word in tokenize(caption)[:max_len]]
        return [START_ID, *ids, END_ID]

    def decode(self, ids: Iterable[int]) -> list[str]:
        """Words of ``ids``, skipping ``<start>``/``<pad>`` and stopping at ``<end>``."""
        words = []
        for i in ids:
            i = int(i)
            if i == END_ID:
                break
            if i not in (START_ID, PAD_ID):
                words.append(self.itos[i])
        return words

    def __len__(self) -> int:
        return len(self.itos)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocabulary) and self.itos == other.itos

    __hash__ = None  # mutable lists inside: not hashable

    def to_dict(self) -> dict:
        """JSON-ready form: ``{"format", "version", "words"}`` with ``words`` the full id -> word list."""
        return {"format": _FORMAT, "version": _VERSION, "words": list(self.itos)}

    @classmethod
    def from_dict(cls, d: dict) -> Vocabulary:
        """Inverse of ``to_dict``; raises DataError describing what is malformed."""
        if not isinstance(d, dict) or d.get("format") != _FORMAT:
            raise DataError(f'not a captioner vocabulary (expected "format": "{_FORMAT}")')
        if d.get("version") != _VERSION:
            raise DataError(f"vocabulary version {d.get('version')!r} is not supported (expected {_VERSION})")
        words = d.get("words")
        if not isinstance(words, list) or not all(isinstance(w, str) and w for w in words):
            raise DataError('vocabulary "words" must be a list of non-empty strings')
        if tuple(words[:4]) != SPECIALS:
            raise DataError(f'vocabulary "words" must start with {", ".join(SPECIALS)}')
        try:
            return cls(words)
        except ValueError as exc:
            raise DataError(str(exc)) from None

    def save(self, path: str | os.PathLike) -> None:
        """Write the vocabulary as JSON, atomically."""
        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Vocabulary:
        """Read a vocabulary JSON file; DataError naming the file when it is missing or malformed."""
        data = read_json(path, "vocabulary file")
        try:
            return cls.from_dict(data)
        except DataError as exc:
            raise DataError(f"{path}: {exc}") from None

    def fingerprint(self) -> str:
        """A short sha256 hex digest of the word list: equal fingerprints mean equal ids."""
        return hashlib.sha256(json.dumps(self.itos).encode("utf-8")).hexdigest()[:16]
