"""The coco-caption suite (pycocoevalcap): a real run with Java, and the errors around it."""

import pytest

from captioner.errors import CaptionerError
from captioner.evaluation import cococaption
from captioner.evaluation.cococaption import SPICE_NOTE, coco_caption_scores, java_available

HAS_JAVA = java_available()

REFERENCES = {
    1: ["a red circle is left of a blue square", "a red circle and a blue square"],
    2: ["a green triangle above a yellow circle", "the triangle is green"],
    3: ["two blue squares", "a pair of blue squares side by side"],
}
# Same words as the first reference, but case, punctuation and spacing that PTB tokenisation removes.
HYPOTHESES = {1: "A red circle is left of a blue square.", 2: "A green  triangle, above a yellow circle!",
              3: "Two blue squares"}


@pytest.mark.slow
@pytest.mark.skipif(not HAS_JAVA, reason="the coco-caption scorer needs java")
def test_real_suite_on_identical_captions(capfd):
    scores = coco_caption_scores(REFERENCES, HYPOTHESES)
    assert set(scores) == {"BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr"}
    assert all(isinstance(value, float) for value in scores.values())
    for n in range(1, 5):
        assert scores[f"BLEU-{n}"] == pytest.approx(1.0, abs=1e-6)
    assert scores["METEOR"] == pytest.approx(1.0, abs=1e-6)  # the METEOR jar ran offline
    assert scores["ROUGE-L"] == pytest.approx(1.0)
    assert scores["CIDEr"] > 1.0
    assert capfd.readouterr() == ("", "")  # scorer and java chatter silenced


def test_missing_java_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert not java_available()
    with pytest.raises(CaptionerError, match="needs Java"):
        coco_caption_scores(REFERENCES, HYPOTHESES)


def test_bad_input_fails_before_java(monkeypatch):
    monkeypatch.setattr(cococaption, "java_available", lambda: pytest.fail("java must not be checked"))
    with pytest.raises(ValueError, match="no references.*ids: 4"):
        coco_caption_scores(REFERENCES, {1: "a red circle", 4: "a square"})
    with pytest.raises(ValueError, match="no hypotheses"):
        coco_caption_scores(REFERENCES, {})
    with pytest.raises(TypeError, match="image 1: captions must be strings"):
        coco_caption_scores(REFERENCES, {1: ["a", "red", "circle"]})


def test_spice_note_explains_the_skip():
    assert "SPICE" in SPICE_NOTE and "download" in SPICE_NOTE
