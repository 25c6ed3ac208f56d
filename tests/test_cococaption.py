"""The coco-caption suite (pycocoevalcap): a real run with Java, and the errors around it."""

import contextlib
import io
import json

import pytest
from pycocoevalcap.eval import COCOEvalCap
from pycocotools.coco import COCO

from captioner.errors import CaptionerError
from captioner.evaluation import cococaption
from captioner.evaluation.cococaption import METRICS, SPICE_NOTE, coco_caption_scores, java_available

HAS_JAVA = java_available()

REFERENCES = {
    1: ["a red circle is left of a blue square", "a red circle and a blue square"],
    2: ["a green triangle above a yellow circle", "the triangle is green"],
    3: ["two blue squares", "a pair of blue squares side by side"],
}
# Same words as the first reference, but case, punctuation and spacing that PTB tokenisation removes.
HYPOTHESES = {
    1: "A red circle is left of a blue square.",
    2: "A green  triangle, above a yellow circle!",
    3: "Two blue squares",
}


class _NoSpice:
    """Stands in for pycocoevalcap's SPICE, which would download the Stanford CoreNLP models."""

    def compute_score(self, gts, res):
        return 0.0, [0.0] * len(gts)

    def method(self):
        return "SPICE"


def _cocoevalcap(references: dict, hypotheses: dict, folder) -> COCOEvalCap:
    """pycocoevalcap's own COCOEvalCap run on the same captions, its prints silenced."""
    images = [{"id": i, "file_name": f"{i}.png"} for i in references]
    annotations = [
        {"id": 10 * i + k, "image_id": i, "caption": c} for i, caps in references.items() for k, c in enumerate(caps)
    ]
    (folder / "refs.json").write_text(json.dumps({"images": images, "annotations": annotations}))
    (folder / "res.json").write_text(json.dumps([{"image_id": i, "caption": c} for i, c in hypotheses.items()]))
    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO(str(folder / "refs.json"))
        scorer = COCOEvalCap(coco, coco.loadRes(str(folder / "res.json")))
        scorer.evaluate()
    return scorer


@pytest.mark.slow
@pytest.mark.skipif(not HAS_JAVA, reason="the coco-caption scorer needs java")
def test_real_suite_gives_the_scores_and_names_of_cocoevalcap(monkeypatch, tmp_path, capfd):
    # Image 1 has the words of its first reference (case and punctuation that PTB tokenisation removes).
    hypotheses = {**HYPOTHESES, 2: "a yellow circle", 3: "two blue squares side by side"}
    scores, per_image = coco_caption_scores(REFERENCES, hypotheses)
    assert capfd.readouterr() == ("", "")  # scorer and java chatter silenced
    assert list(scores) == list(METRICS) == ["Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr"]
    assert all(isinstance(value, float) for value in scores.values())
    assert sorted(per_image) == [1, 2, 3] and all(list(s) == list(METRICS) for s in per_image.values())
    for name in ("Bleu_4", "METEOR", "ROUGE_L"):  # METEOR: the jar ran offline
        assert per_image[1][name] == pytest.approx(1.0, abs=1e-6)
    assert per_image[2]["Bleu_1"] < 1.0 and per_image[2]["CIDEr"] < per_image[1]["CIDEr"]

    monkeypatch.setattr("pycocoevalcap.eval.Spice", _NoSpice)
    reference = _cocoevalcap(REFERENCES, hypotheses, tmp_path)
    assert scores == pytest.approx({k: v for k, v in reference.eval.items() if k != "SPICE"}, abs=1e-9)
    for image_id, expected in reference.imgToEval.items():
        assert per_image[image_id] == pytest.approx(
            {k: v for k, v in expected.items() if k not in ("SPICE", "image_id")}, abs=1e-9
        )


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
