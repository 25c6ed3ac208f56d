"""Corpus BLEU with nltk: hand-checked values, multiple references, corpus pooling, bad input."""

import math
import warnings

import pytest
from nltk.translate.bleu_score import sentence_bleu

from captioner.evaluation.bleu import corpus_bleu_scores, image_bleu_scores

CAT = "the cat sat on the mat".split()
CAT_REF = "the cat is on the mat".split()


def test_perfect_match_scores_one():
    refs = {1: [CAT, CAT_REF], 2: ["a red circle left of a blue square".split()]}
    hyps = {1: CAT, 2: "a red circle left of a blue square".split()}
    assert corpus_bleu_scores(refs, hyps) == pytest.approx({"bleu1": 1.0, "bleu2": 1.0, "bleu3": 1.0, "bleu4": 1.0})


def test_hand_checked_example_matches_sentence_bleu():
    # Same length (no brevity penalty); clipped n-gram precisions 5/6, 3/5, 1/4, 0/3.
    scores = corpus_bleu_scores({7: [CAT_REF]}, {7: CAT})
    assert scores["bleu1"] == pytest.approx(5 / 6)
    assert scores["bleu2"] == pytest.approx(math.sqrt(5 / 6 * 3 / 5))  # = sqrt(1/2)
    assert scores["bleu3"] == pytest.approx(0.5)  # (5/6 * 3/5 * 1/4) ** (1/3) = 1/8 ** (1/3)
    assert scores["bleu4"] == pytest.approx(0.0, abs=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n in range(1, 5):
            expected = sentence_bleu([CAT_REF], CAT, weights=tuple([1 / n] * n))
            assert scores[f"bleu{n}"] == pytest.approx(expected, abs=1e-12)


def test_all_references_are_used():
    hyp = "the the the the".split()
    one = corpus_bleu_scores({1: [["the", "cat"]]}, {1: hyp})
    both = corpus_bleu_scores({1: [["the", "cat"], ["the", "the", "dog"]]}, {1: hyp})
    assert one["bleu1"] == pytest.approx(1 / 4)  # "the" clipped to its count in the reference: 1
    assert both["bleu1"] == pytest.approx(2 / 4)  # clipped to its max count over references: 2


def test_counts_are_pooled_over_the_corpus_and_images_scored_once():
    refs = {1: [CAT], 2: [["the", "dog"]], 99: [["unused", "reference"]]}
    hyps = {1: CAT, 2: ["a", "cat"]}
    # 6 + 0 matching unigrams out of 6 + 2 (an average of sentence scores would give 0.5)
    assert corpus_bleu_scores(refs, hyps)["bleu1"] == pytest.approx(6 / 8)


def test_empty_hypothesis_scores_zero_without_warnings(capsys):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        alone = corpus_bleu_scores({1: [CAT]}, {1: []})
        mixed = corpus_bleu_scores({1: [CAT], 2: [["a", "cat"]]}, {1: [], 2: ["a", "cat"]})
    assert alone == {"bleu1": 0.0, "bleu2": 0.0, "bleu3": 0.0, "bleu4": 0.0}
    # 2 matching unigrams over 0 + 2 (nltk counts an empty hypothesis as 1 unigram slot: 3),
    # times the brevity penalty of 2 words against 6 + 2 reference words, exp(1 - 8/2)
    assert mixed["bleu1"] == pytest.approx(2 / 3 * math.exp(-3))
    assert mixed["bleu3"] == pytest.approx(0.0, abs=1e-12)
    assert caught == []
    assert capsys.readouterr() == ("", "")


def test_missing_references_raise():
    with pytest.raises(ValueError, match="no references.*ids: 2"):
        corpus_bleu_scores({1: [CAT]}, {1: CAT, 2: CAT})
    with pytest.raises(ValueError, match="no references"):
        corpus_bleu_scores({1: []}, {1: CAT})
    with pytest.raises(ValueError, match="no hypotheses"):
        corpus_bleu_scores({1: [CAT]}, {})


def test_strings_instead_of_tokens_raise():
    with pytest.raises(TypeError, match="lists of tokens"):
        corpus_bleu_scores({1: [CAT]}, {1: "the cat sat on the mat"})
    with pytest.raises(TypeError, match="lists of tokens"):
        corpus_bleu_scores({1: ["the cat is on the mat"]}, {1: CAT})


def test_each_image_alone_is_a_corpus_of_one():
    refs = {7: [CAT_REF], 8: [CAT, CAT_REF], 9: ["a red circle".split()]}
    hyps = {9: "a blue circle".split(), 7: CAT, 8: CAT}
    per_image = image_bleu_scores(refs, hyps)
    assert list(per_image) == [7, 8, 9]
    assert per_image[7] == corpus_bleu_scores({7: [CAT_REF]}, {7: CAT})  # the hand-checked example
    assert per_image[7]["bleu1"] == pytest.approx(5 / 6)
    assert per_image[8] == pytest.approx({"bleu1": 1.0, "bleu2": 1.0, "bleu3": 1.0, "bleu4": 1.0})
    assert per_image[9]["bleu1"] == pytest.approx(2 / 3) and per_image[9]["bleu2"] == pytest.approx(0.0, abs=1e-12)
    corpus = corpus_bleu_scores(refs, hyps)  # pooled counts: not the mean of the images' scores
    assert corpus["bleu2"] != pytest.approx(sum(s["bleu2"] for s in per_image.values()) / 3)
    with pytest.raises(ValueError, match="no references"):
        image_bleu_scores(refs, {5: CAT})
