"""CIDEr-D: the vectorised scorer gives pycocoevalcap's numbers, per image and per corpus."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from pycocoevalcap.cider.cider import Cider

from captioner.evaluation.cider import CiderD, corpus_cider_d, ngram_counts


def random_corpus(seed: int, images: int = 40, words: int = 25) -> tuple[list[list[list[str]]], list[list[str]]]:
    """References (1-6 per image, 1-14 words) and one hypothesis per image (0-12 words) over a small
    vocabulary, so n-grams repeat inside captions and across images; some hypotheses use unseen words."""
    rng = random.Random(seed)
    vocabulary = [f"w{i}" for i in range(words)]

    def caption(low: int, high: int) -> list[str]:
        pool = vocabulary[: rng.choice([4, words])]  # a few captions over 4 words: repeated n-grams
        return [rng.choice(pool) for _ in range(rng.randint(low, high))]

    references = [[caption(1, 14) for _ in range(rng.randint(1, 6))] for _ in range(images)]
    hypotheses = [caption(0, 12) + (["unseen", "novel", "unseen"] if i % 7 == 0 else []) for i in range(images)]
    return references, hypotheses


def coco_cider(references: list[list[list[str]]], hypotheses: list[list[str]]) -> tuple[float, np.ndarray]:
    """pycocoevalcap's Cider on the same tokens (it splits captions on spaces)."""
    gts = {i: [" ".join(ref) for ref in refs] for i, refs in enumerate(references)}
    res = {i: [" ".join(hyp)] for i, hyp in enumerate(hypotheses)}
    score, scores = Cider().compute_score(gts, res)
    return float(score), np.asarray(scores)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_equals_pycocoevalcap_per_image_and_for_the_corpus(seed: int) -> None:
    references, hypotheses = random_corpus(seed)
    expected_mean, expected = coco_cider(references, hypotheses)
    cider = CiderD(references)
    assert len(cider) == len(references)
    scores = cider.score(hypotheses, range(len(hypotheses)))
    assert scores.dtype == torch.float64 and scores.shape == (len(hypotheses),)
    np.testing.assert_allclose(scores.numpy(), expected, rtol=0, atol=1e-6)
    assert expected.max() > 1.0 and (expected == 0).any()  # the corpus has good and hopeless hypotheses
    as_dicts = corpus_cider_d(dict(enumerate(references)), dict(enumerate(hypotheses)))
    assert as_dicts == pytest.approx(expected_mean, abs=1e-6)


def test_document_frequencies_come_from_the_corpus_once_for_any_number_of_samples() -> None:
    """Several hypotheses per image and any subset of images are scored with the corpus's document
    frequencies: k samples of an image score as pycocoevalcap scores each of them on the whole corpus."""
    references, _ = random_corpus(3)
    cider = CiderD(references)
    samples = [random_corpus(seed)[1] for seed in (4, 5, 6)]  # 3 hypotheses for every image
    expected = np.stack([coco_cider(references, hyps)[1] for hyps in samples], axis=1)  # (images, 3)
    picked = [7, 3, 3, 30]  # a batch: some images, one of them twice
    hypotheses = [samples[k][i] for i in picked for k in range(3)]
    images = [i for i in picked for _ in range(3)]
    scores = cider.score(hypotheses, images).view(len(picked), 3)
    np.testing.assert_allclose(scores.numpy(), expected[picked], rtol=0, atol=1e-6)


def test_token_ids_score_like_words() -> None:
    references, hypotheses = random_corpus(7)
    vocabulary = ["<pad>", "<start>", "<end>", "<unk>", *sorted({w for refs in references for r in refs for w in r})]
    cider = CiderD(references, words=vocabulary)
    assert [cider.word_ids[w] for w in vocabulary] == list(range(len(vocabulary)))
    known = [[w for w in hyp if w in cider.word_ids] for hyp in hypotheses]
    lengths = torch.tensor([len(hyp) for hyp in known])
    tokens = torch.full((len(known), int(lengths.max()) + 2), 2)  # padded with <end> ids: ignored
    for row, hyp in enumerate(known):
        tokens[row, : len(hyp)] = torch.tensor([cider.word_ids[w] for w in hyp], dtype=torch.long)
    images = torch.arange(len(known))
    assert torch.equal(cider.score_ids(tokens, lengths, images), cider.score(known, range(len(known))))
    # <unk> matches nothing, even where a reference word is out of the vocabulary
    unknown = cider.score_ids(torch.tensor([[3, 3]]), torch.tensor([2]), torch.tensor([0]))
    assert unknown.item() == 0.0


def test_hand_computed_value_and_clipping() -> None:
    """Two images, one reference each: the hypothesis 'a a' against 'a b' counts 'a' once (clipped)."""
    references = [[["a", "b"]], [["c"]]]
    cider = CiderD(references)
    # idf: log 2 for every n-gram (each occurs in one image of two)
    # hypothesis "a b": unigram and bigram vectors equal the reference's: cosine 1 at orders 1-2, 0 at 3-4
    assert cider.score([["a", "b"]], [0]).item() == pytest.approx(10 * (1 + 1) / 4)
    # "a a": unigram tf 2 -> weight 2 log 2, clipped to the reference's log 2; |h| = 2 log 2, |r| = sqrt 2 log 2
    clipped = (np.log(2) * np.log(2)) / (2 * np.log(2) * np.sqrt(2) * np.log(2))
    penalty_free = cider.score([["a", "a"]], [0]).item()
    assert penalty_free == pytest.approx(10 * clipped / 4)
    assert penalty_free == pytest.approx(coco_cider(references, [["a", "a"], ["c"]])[1][0])


def test_ngram_counts_are_per_caption() -> None:
    words = torch.tensor([5, 5, 5, 7, 5])  # captions [5 5 5] and [7 5]
    table, orders, caption, ngram, count = ngram_counts(words, torch.tensor([3, 2]), n=2)
    found = sorted((int(c), int(orders[g]), int(k)) for c, g, k in zip(caption, ngram, count))
    assert found == [(0, 0, 3), (0, 1, 2), (1, 0, 1), (1, 0, 1), (1, 1, 1)]  # "5": 3, "5 5": 2; "7", "5", "7 5"
    assert caption.tolist() == sorted(caption.tolist())


def test_bad_references_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one image"):
        CiderD([])
    with pytest.raises(ValueError, match="1 image\\(s\\) have no reference captions"):
        CiderD([[["a"]], []])
    with pytest.raises(ValueError, match="no words"):
        CiderD([[[]]])
    with pytest.raises(ValueError, match="no references"):
        corpus_cider_d({1: [["a"]]}, {2: ["a"]})
