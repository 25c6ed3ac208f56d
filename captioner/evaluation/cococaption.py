"""The coco-caption scorer (pycocoevalcap): the numbers papers report.

PTB tokenisation (Stanford CoreNLP jar), BLEU-1..4, METEOR 1.5 (jar + paraphrase table shipped inside
pycocoevalcap, runs offline), ROUGE-L and CIDEr-D style CIDEr. The tokeniser and METEOR run ``java``,
so Java must be installed. The scorers' console chatter is silenced.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import IO

from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.meteor.meteor import Meteor
from pycocoevalcap.rouge.rouge import Rouge
from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

from captioner.errors import CaptionerError
from captioner.evaluation.bleu import scored_ids

SPICE_NOTE = (
    "SPICE is not computed: pycocoevalcap's SPICE needs the Stanford CoreNLP models (about 1 GB), "
    "which it downloads on first use, and this project never downloads at run time. Run "
    "pycocoevalcap.spice.spice.Spice on a networked machine to add it."
)

# The names of pycocoevalcap's COCOEvalCap (its ``eval`` and ``imgToEval`` keys), SPICE aside.
METRICS = ("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr")

JAVA_MISSING = (
    "the coco-caption scorer needs Java: its PTB tokeniser and METEOR run `java`, and no working "
    "`java` was found on PATH; install a Java runtime (e.g. openjdk-17-jre-headless) or use the "
    "Java-free BLEU of captioner.evaluation.bleu"
)


def java_available() -> bool:
    """True when a ``java`` executable is on PATH and ``java -version`` succeeds."""
    java = shutil.which("java")
    if java is None:
        return False
    try:
        result = subprocess.run(
            [java, "-version"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


@contextlib.contextmanager
def _captured_fds() -> Iterator[IO[bytes]]:
    """Send this process's stdout and stderr (file descriptors 1 and 2, so also those of child
    processes such as java) into a temporary file while the block runs; yield that file."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as sink:
        try:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            yield sink
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _tail(sink: IO[bytes], lines: int = 3) -> str:
    """The last ``lines`` lines written to ``sink``, as one line of text."""
    sink.seek(0)
    text = sink.read().decode("utf-8", errors="replace").strip().splitlines()
    return " | ".join(text[-lines:]) or "no output"


def _tokenize(
    references: dict[int, list[str]], hypotheses: dict[int, list[str]]
) -> tuple[dict[int, list[str]], dict[int, list[str]]]:
    """PTB-tokenise references and hypotheses in one quiet java run, checking that nothing was lost."""
    # One caption per line for the tokeniser: fold every kind of line break into a space.
    captions = {
        (kind, i): [{"caption": " ".join(c.split())} for c in caps]
        for kind, side in (("ref", references), ("hyp", hypotheses))
        for i, caps in side.items()
    }
    try:
        with _captured_fds() as sink:
            try:
                tokens = PTBTokenizer().tokenize(captions)
            finally:
                detail = _tail(sink)
    except OSError as exc:
        raise CaptionerError(f"coco-caption PTB tokeniser failed: {exc}") from None
    if any(len(tokens.get(key, ())) != len(caps) for key, caps in captions.items()):
        raise CaptionerError(f"coco-caption PTB tokeniser (java) failed: {detail}")
    return ({i: tokens[("ref", i)] for i in references}, {i: tokens[("hyp", i)] for i in hypotheses})


def _start_meteor() -> Meteor:
    """Start the METEOR 1.5 jar (java loads its paraphrase table while the tokeniser runs)."""
    try:
        return Meteor()
    except OSError as exc:
        raise CaptionerError(f"METEOR could not start java: {exc}") from None


def _meteor_scores(meteor: Meteor, gts: dict[int, list[str]], res: dict[int, list[str]]) -> tuple[float, list[float]]:
    """Corpus and per-image METEOR of tokenised captions from a started :class:`Meteor`."""
    try:
        score, scores = meteor.compute_score(gts, res)
    except (ValueError, OSError) as exc:
        meteor.meteor_p.kill()
        stderr = meteor.meteor_p.stderr.read().decode("utf-8", errors="replace").strip()
        last = stderr.splitlines()[-1] if stderr else str(exc)
        raise CaptionerError(f"METEOR (java) failed: {last}") from None
    return float(score), [float(s) for s in scores]


def _stop_meteor(meteor: Meteor) -> None:
    """End the METEOR java process, also after a failure inside ``compute_score``."""
    if meteor.lock.locked():  # compute_score keeps its lock when it fails; Meteor.__del__ needs it
        meteor.lock.release()
    meteor.meteor_p.stdin.close()
    meteor.meteor_p.kill()
    meteor.meteor_p.wait()


def coco_caption_scores(
    references: dict[int, list[str]], hypotheses: dict[int, str]
) -> tuple[dict[str, float], dict[int, dict[str, float]]]:
    """Score raw ``hypotheses`` (image id -> caption) against raw ``references`` (image id -> captions).

    Only the images in ``hypotheses`` are scored, each against all of its references (``references``
    may hold more images). Returns the corpus scores and the scores of each image, both named as
    pycocoevalcap's ``COCOEvalCap`` names them (its ``eval`` and ``imgToEval``, :data:`METRICS`:
    ``Bleu_1``..``Bleu_4``, ``METEOR``, ``ROUGE_L``, ``CIDEr``), as floats on the 0-1 scale (CIDEr is not
    bounded by 1); SPICE is skipped, see :data:`SPICE_NOTE`. CIDEr's idf comes from the scored
    references, so it needs several images to be meaningful.

    Raises ValueError for no hypotheses or an image without references, TypeError for a caption
    that is not a string, and CaptionerError when Java is missing or a java scorer fails.
    """
    image_ids = scored_ids(references, hypotheses)
    refs = {i: list(references[i]) for i in image_ids}
    hyps = {i: [hypotheses[i]] for i in image_ids}
    for i in image_ids:
        if not all(isinstance(c, str) for c in refs[i] + hyps[i]):
            raise TypeError(f"image {i}: captions must be strings")
    if not java_available():
        raise CaptionerError(JAVA_MISSING)

    meteor = _start_meteor()
    try:
        gts, res = _tokenize(refs, hyps)
        bleu, bleu_per_image = Bleu(4).compute_score(gts, res, verbose=0)
        rouge, rouge_per_image = Rouge().compute_score(gts, res)
        cider, cider_per_image = Cider().compute_score(gts, res)
        meteor_score, meteor_per_image = _meteor_scores(meteor, gts, res)
    finally:
        _stop_meteor(meteor)
    corpus = dict(zip(METRICS, [*bleu, meteor_score, rouge, cider]))
    columns = [*bleu_per_image, meteor_per_image, rouge_per_image, cider_per_image]  # each in gts order
    per_image = {i: {name: float(column[row]) for name, column in zip(METRICS, columns)} for row, i in enumerate(gts)}
    return {name: float(value) for name, value in corpus.items()}, per_image
