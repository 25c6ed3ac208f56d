"""Tokenizer and Vocabulary: deterministic build, encode/decode, JSON round trip, malformed files."""

from __future__ import annotations

import json
from collections import Counter

import nltk
import pytest
import torch

from captioner.config import MAX_VOCAB_SIZE
from captioner.data.vocab import END, END_ID, PAD_ID, SPECIALS, START_ID, UNK_ID, Vocabulary, tokenize, word_counts
from captioner.errors import ConfigError, DataError

CAPTIONS = ["A dog runs.", "a dog sits", "The DOG, a cat!", "a cat sleeps", "a bird"]


def test_tokenize_lower_cases_and_drops_punctuation(monkeypatch):
    monkeypatch.setattr(nltk.data, "path", [])  # no downloaded nltk data may be needed
    assert tokenize("A man's RED-hat, 2 dogs!\n") == ["a", "man", "s", "red", "hat", "2", "dogs"]
    assert tokenize("Café au lait_ok") == ["café", "au", "lait", "ok"]
    assert tokenize("  ...  ") == []


def test_specials_have_fixed_ids():
    vocab = Vocabulary(["dog", "cat"])
    assert vocab.itos[:4] == ["<pad>", "<start>", "<end>", "<unk>"]
    assert (PAD_ID, START_ID, END_ID, UNK_ID) == (0, 1, 2, 3)
    assert vocab.stoi["dog"] == 4 and vocab.stoi["cat"] == 5 and len(vocab) == 6
    assert Vocabulary(vocab.itos).itos == vocab.itos  # a full id list (specials first) is accepted too
    # the module's public names are the owner every other module imports
    assert [vocab.stoi[token] for token in SPECIALS] == [PAD_ID, START_ID, END_ID, UNK_ID] == [0, 1, 2, 3]
    assert not hasattr(Vocabulary, "end_id") and END == "<end>"  # one owner: no alias on the class


def test_repeated_or_special_words_are_refused():
    with pytest.raises(ValueError, match="dog"):
        Vocabulary(["dog", "cat", "dog"])
    with pytest.raises(ValueError, match="<unk>"):
        Vocabulary(["dog", "<unk>"])


def test_a_vocabulary_holds_at_most_max_vocab_size_words_besides_the_specials():
    """Its size is bounded: an untrusted bundle's vocabulary never makes its reader allocate without end."""
    words = [f"w{i}" for i in range(MAX_VOCAB_SIZE + 1)]
    with pytest.raises(DataError, match=r"^1,000,001 words besides the specials, at most 1,000,000$"):
        Vocabulary.from_dict({**Vocabulary([]).to_dict(), "words": [*SPECIALS, *words]})
    assert len(Vocabulary(words[:3])) == 3 + len(SPECIALS)


def test_build_counts_min_count_and_orders_deterministically():
    vocab = Vocabulary.build(CAPTIONS, min_count=2)
    # counts: a 5, dog 3, cat 2 (ties by word); runs/sits/the/sleeps/bird appear once
    assert vocab.itos[4:] == ["a", "dog", "cat"]
    assert Vocabulary.build(reversed(CAPTIONS), min_count=2).itos == vocab.itos
    assert Vocabulary.build(CAPTIONS, min_count=1).itos[4:] == [
        "a",
        "dog",
        "cat",
        "bird",
        "runs",
        "sits",
        "sleeps",
        "the",
    ]
    assert Vocabulary.build(CAPTIONS, min_count=1, max_size=2).itos[4:] == ["a", "dog"]
    assert Vocabulary.build(CAPTIONS).itos[4:] == ["a"]  # default min_count 5


def test_build_rejects_bad_arguments():
    with pytest.raises(ConfigError):
        Vocabulary.build(CAPTIONS, min_count=0)
    with pytest.raises(ConfigError):
        Vocabulary.build(CAPTIONS, max_size=-1)


def test_grow_keeps_the_words_and_their_ids_and_appends_the_new_ones_the_build_rule_admits():
    base = Vocabulary(["fish", "dog", "the"])  # not in build's order: growing never reorders
    counts = word_counts(CAPTIONS)  # a 5, dog 3, cat 2, the/runs/sits/sleeps/bird 1
    grown = base.grow(counts, min_count=2)
    assert grown.itos == [*base.itos, "a", "cat"]  # dog and the are there already; words seen once are not admitted
    assert base.grow(counts, min_count=1).itos[len(base) :] == ["a", "cat", "bird", "runs", "sits", "sleeps"]
    assert base.grow(counts, min_count=1, max_size=4).itos[4:] == ["fish", "dog", "the", "a"]  # room for one
    assert base.grow(counts, min_count=1, max_size=2) == base  # no room: a vocabulary is never cut
    assert grown.grow(counts, min_count=2) == grown  # nothing new: the same words and ids
    assert Vocabulary([]).grow(counts, min_count=2) == Vocabulary.build(CAPTIONS, min_count=2)
    with pytest.raises(ConfigError):
        base.grow(counts, min_count=0)


def test_unknown_counts_what_encode_reads_as_unk():
    vocab = Vocabulary(["a", "dog", "cat"])
    unknown = vocab.unknown(word_counts(CAPTIONS))
    assert unknown == Counter({"runs": 1, "sits": 1, "the": 1, "sleeps": 1, "bird": 1})
    assert sum(vocab.encode(c, max_len=20).count(UNK_ID) for c in CAPTIONS) == unknown.total() == 5
    assert vocab.grow(word_counts(CAPTIONS), min_count=1).unknown(word_counts(CAPTIONS)) == Counter()


def test_encode_unknown_words_and_max_len():
    vocab = Vocabulary.build(CAPTIONS, min_count=2)
    a, dog, cat = vocab.stoi["a"], vocab.stoi["dog"], vocab.stoi["cat"]
    assert vocab.encode("A dog chases a CAT.", max_len=20) == [1, a, dog, 3, a, cat, 2]
    assert vocab.encode("A dog chases a CAT.", max_len=2) == [1, a, dog, 2]
    assert vocab.encode("!!!", max_len=5) == [1, 2]


def test_decode_skips_start_and_pad_and_stops_at_end():
    vocab = Vocabulary(["dog", "cat"])
    assert vocab.decode([1, 4, 3, 5, 2, 4, 0]) == ["dog", "<unk>", "cat"]
    assert vocab.decode(torch.tensor([4, 0, 5])) == ["dog", "cat"]
    assert vocab.decode(vocab.encode("cat dog", 10)) == ["cat", "dog"]


def test_save_load_round_trip_is_json(tmp_path):
    vocab = Vocabulary.build(CAPTIONS, min_count=1)
    path = tmp_path / "sub" / "vocab.json"
    vocab.save(path)
    stored = json.loads(path.read_text())
    assert stored == {"format": "captioner-vocab", "version": 1, "words": vocab.itos}
    loaded = Vocabulary.load(path)
    assert loaded == vocab and loaded.stoi == vocab.stoi
    assert loaded.fingerprint() == vocab.fingerprint() and len(vocab.fingerprint()) == 16
    assert Vocabulary.from_dict(vocab.to_dict()) == vocab


def test_fingerprint_changes_with_the_words():
    assert Vocabulary(["dog", "cat"]).fingerprint() != Vocabulary(["cat", "dog"]).fingerprint()


@pytest.mark.parametrize(
    "content, problem",
    [
        ("[1, 2", "not valid JSON"),
        (json.dumps({"format": "other", "version": 1, "words": []}), "not a captioner vocabulary"),
        (json.dumps({"format": "captioner-vocab", "version": 9, "words": []}), "version 9 is not supported"),
        (json.dumps({"format": "captioner-vocab", "version": 1, "words": ["a", 3]}), "list of non-empty strings"),
        (json.dumps({"format": "captioner-vocab", "version": 1, "words": ["dog"]}), "must start with <pad>"),
        (
            json.dumps(
                {"format": "captioner-vocab", "version": 1, "words": ["<pad>", "<start>", "<end>", "<unk>", "a", "a"]}
            ),
            "repeat",
        ),
        (json.dumps(["<pad>"]), "not a captioner vocabulary"),
    ],
)
def test_malformed_vocab_file(tmp_path, content, problem):
    path = tmp_path / "vocab.json"
    path.write_text(content)
    with pytest.raises(DataError) as info:
        Vocabulary.load(path)
    assert str(path) in str(info.value) and problem in str(info.value)


def test_missing_vocab_file(tmp_path):
    with pytest.raises(DataError, match="vocab.json"):
        Vocabulary.load(tmp_path / "vocab.json")
