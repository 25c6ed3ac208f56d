"""CIDEr-D (Vedantam et al. 2015), vectorised in torch: the SCST reward and a validation metric.

The same numbers as pycocoevalcap's ``Cider`` (which computes CIDEr-D) on the same tokens: n-grams of
orders 1-4, tf-idf vectors per order with idf = log(images) - log(max(1, document frequency)), the
hypothesis weight of each n-gram clipped at the reference's, a Gaussian length penalty
exp(-delta^2 / (2 sigma^2)) with sigma = 6, the mean over orders, the mean over references, times 10.
Like pycocoevalcap, the length compared is the caption's number of bigrams (words - 1, 0 for one word).

``CiderD`` turns the references of a corpus into tf-idf vectors once (document frequencies included);
scoring a batch of hypotheses is then a few sorts and binary searches over all of them at once, never a
Python loop over captions. An n-gram is packed into one int64 (each word id + 1 a digit of base
``KEY_BASE[n]``), so a corpus may hold up to ``KEY_BASE[n] - 1`` distinct words (55,107 for n = 4).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from captioner.errors import check_range
from captioner.evaluation.bleu import scored_ids


def _key_base(n: int) -> int:
    """The largest base b with b ** n <= 2 ** 63 - 1: n digits of base b fit in an int64."""
    base = int((2**63 - 1) ** (1 / n))
    while (base + 1) ** n <= 2**63 - 1:
        base += 1
    while base**n > 2**63 - 1:
        base -= 1
    return base


def ngram_counts(words: Tensor, lengths: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The distinct n-grams (orders 1..n) of each caption and how often each occurs in it.

    ``words`` (S,) holds the word ids (>= 0) of C captions one after another, ``lengths`` (C,) their
    lengths. Returns the table of the distinct n-grams, ``keys`` (K,) (packed, sorted) and ``orders``
    (K,) (0 for unigrams), and per (caption, n-gram) entry ``caption`` (E,), ``ngram`` (E,) (its row in
    the table) and ``count`` (E,), sorted by caption, then n-gram.
    """
    base, device = _key_base(n), words.device
    total = words.numel()
    owner = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)  # (S,)
    starts = lengths.cumsum(0) - lengths  # (C,)
    remaining = lengths[owner] - (torch.arange(total, device=device) - starts[owner])  # (S,) words from here on
    digits = torch.cat([words + 1, words.new_zeros(n)])  # (S + n,): 1..W, 0 past the last caption
    key = torch.zeros(total, dtype=torch.long, device=device)
    keys = []
    for k in range(n):  # key of the (k+1)-gram starting at each word
        key = key + digits[k : k + total] * base**k
        keys.append(key)
    packed = torch.stack(keys, dim=1)  # (S, n)
    valid = remaining.unsqueeze(1) > torch.arange(n, device=device)  # (S, n)
    table, ngram = torch.unique(packed[valid], return_inverse=True)  # (K,), (E',)
    orders = torch.zeros_like(table).scatter_(0, ngram, torch.arange(n, device=device).expand(total, n)[valid])
    size = max(table.numel(), 1)
    entry, count = torch.unique(
        owner.unsqueeze(1).expand(total, n)[valid] * size + ngram, return_counts=True
    )  # (E,) distinct (caption, n-gram), sorted
    return table, orders, entry // size, entry % size, count


class CiderD:
    """CIDEr-D of hypotheses against the references of a fixed corpus, document frequencies computed once.

    ``references[i]`` holds the tokenised reference captions of image i (at least one). The document
    frequencies, idf and reference vectors come from this corpus, as pycocoevalcap computes them from
    the images it scores: scoring every image of the corpus once gives pycocoevalcap's numbers, and the
    SCST reward scores training samples against the training corpus. ``words`` are given ids 0, 1, ...
    first (a model's vocabulary, so ``score_ids`` takes its token ids); the other reference words follow.
    """

    def __init__(
        self,
        references: Sequence[Sequence[Sequence[str]]],
        words: Sequence[str] = (),
        n: int = 4,
        sigma: float = 6.0,
        device: torch.device | str = "cpu",
    ) -> None:
        check_range("n", n, 1, kind=int)
        check_range("sigma", sigma, 1e-12)
        if not references:
            raise ValueError("CIDEr-D needs at least one image with references")
        empty = [i for i, refs in enumerate(references) if not refs]
        if empty:
            raise ValueError(f"{len(empty)} image(s) have no reference captions (first: {empty[0]})")
        self.n, self.sigma = n, float(sigma)
        self.word_ids: dict[str, int] = {}
        for word in (*words, *(w for refs in references for ref in refs for w in ref)):
            self.word_ids.setdefault(word, len(self.word_ids))
        self._check_capacity(len(self.word_ids))
        ref_counts = torch.tensor([len(refs) for refs in references], device=device)  # (I,)
        ref_words = torch.tensor(
            [self.word_ids[w] for refs in references for ref in refs for w in ref], dtype=torch.long, device=device
        )  # (S,)
        ref_lengths = torch.tensor([len(ref) for refs in references for ref in refs], device=device)  # (R,)
        self.keys, orders, caption, ngram, count = ngram_counts(ref_words, ref_lengths, n)  # (K,) sorted; (E,)
        if not self.keys.numel():
            raise ValueError("the reference captions hold no words")
        vocabulary = self.keys.numel()
        image = torch.repeat_interleave(torch.arange(len(references), device=device), ref_counts)[caption]  # (E,)
        # document frequency: the number of images whose references hold the n-gram
        pairs = torch.unique(image * vocabulary + ngram)
        document_frequency = torch.bincount(pairs % vocabulary, minlength=vocabulary)  # (K,)
        self.log_images = math.log(len(references))
        self.idf = self.log_images - document_frequency.double().log()  # (K,), every df >= 1
        weight = count * self.idf[ngram]  # (E,) tf * idf
        self.ref_entry = caption * vocabulary + ngram  # (E,) sorted: (reference, n-gram) packed
        self.ref_weight = weight
        self.ref_norm = self._norms(caption, orders[ngram], weight, ref_lengths.numel())  # (R, n)
        self.ref_length = (ref_lengths - 1).clamp_min(0)  # (R,) bigrams, as pycocoevalcap counts length
        self.ref_counts = ref_counts
        self.first_ref = ref_counts.cumsum(0) - ref_counts  # (I,)
        self.max_refs = int(ref_counts.max())

    def _check_capacity(self, words: int) -> None:
        if words > _key_base(self.n) - 1:
            raise ValueError(
                f"CIDEr-D with n={self.n} packs n-grams into int64 keys and so counts at most "
                f"{_key_base(self.n) - 1:,} distinct words; these captions have {words:,}"
            )

    def _norms(self, caption: Tensor, order: Tensor, weight: Tensor, captions: int) -> Tensor:
        """The norm of each caption's tf-idf vector per order (captions, n)."""
        squares = weight.new_zeros(captions, self.n).index_put_((caption, order), weight.square(), accumulate=True)
        return squares.sqrt()

    def __len__(self) -> int:
        """The number of images in the corpus."""
        return self.ref_counts.numel()

    @property
    def device(self) -> torch.device:
        """Where the tables are (and the token ids to score must be)."""
        return self.keys.device

    def score_ids(self, tokens: Tensor, lengths: Tensor, images: Tensor) -> Tensor:
        """CIDEr-D (N,) float64 of hypotheses given as word ids.

        ``tokens`` (N, T) holds the ids (of ``words`` or of the corpus) of each hypothesis' words in its
        first ``lengths`` (N,) positions (no <start> or <end>), ``images`` (N,) the corpus image each is
        scored against; several hypotheses may share an image. An id not used by the references matches
        nothing. All on the tables' device.
        """
        mask = torch.arange(tokens.size(1), device=tokens.device) < lengths.unsqueeze(1)  # (N, T)
        return self._score(tokens[mask], lengths, images)

    def score(self, hypotheses: Sequence[Sequence[str]], images: Sequence[int]) -> Tensor:
        """CIDEr-D (N,) float64 of tokenised ``hypotheses`` against the references of corpus ``images``.

        Words the references never use are given fresh ids (they match nothing), not stored.
        """
        unseen: dict[str, int] = {}
        ids = []
        for hypothesis in hypotheses:
            for word in hypothesis:
                known = self.word_ids.get(word)
                ids.append(unseen.setdefault(word, len(self.word_ids) + len(unseen)) if known is None else known)
        self._check_capacity(len(self.word_ids) + len(unseen))
        lengths = torch.tensor([len(hyp) for hyp in hypotheses], dtype=torch.long, device=self.device)
        return self._score(
            torch.tensor(ids, dtype=torch.long, device=self.device),
            lengths,
            torch.as_tensor(images, dtype=torch.long, device=self.device),
        )

    def _score(self, words: Tensor, lengths: Tensor, images: Tensor) -> Tensor:
        """CIDEr-D of N hypotheses, concatenated in ``words`` (S,) with ``lengths`` (N,), against ``images`` (N,)."""
        hypotheses = lengths.numel()
        table, orders, caption, ngram, count = ngram_counts(words, lengths, self.n)  # (K',), (E,)
        key, order = table[ngram], orders[ngram]  # (E,)
        vocabulary = self.keys.numel()
        at = torch.searchsorted(self.keys, key).clamp(max=vocabulary - 1)  # (E,) row in the corpus table
        known = self.keys[at] == key
        idf = torch.where(known, self.idf[at], self.log_images)  # (E,): df 0 counts as 1
        weight = count * idf  # (E,)
        norm = self._norms(caption, order, weight, hypotheses)  # (N, n)
        slot = torch.arange(self.max_refs, device=words.device)  # (M,)
        present = slot < self.ref_counts[images].unsqueeze(1)  # (N, M): reference slot m of the image exists
        ref = torch.where(present, self.first_ref[images].unsqueeze(1) + slot, 0)  # (N, M) reference index
        query = ref[caption] * vocabulary + at.unsqueeze(1)  # (E, M): (reference, n-gram) packed
        found = torch.searchsorted(self.ref_entry, query).clamp(max=self.ref_entry.numel() - 1)  # (E, M)
        hit = (self.ref_entry[found] == query) & known.unsqueeze(1) & present[caption]  # (E, M)
        ref_weight = torch.where(hit, self.ref_weight[found], 0.0)  # (E, M)
        clipped = torch.minimum(weight.unsqueeze(1), ref_weight) * ref_weight  # (E, M): CIDEr-D's clipping
        dot = norm.new_zeros(hypotheses, self.n, self.max_refs).index_put_(
            (caption, order), clipped, accumulate=True
        )  # (N, n, M)
        denominator = norm.unsqueeze(2) * self.ref_norm[ref].transpose(1, 2)  # (N, n, M)
        cosine = dot / torch.where(denominator > 0, denominator, 1.0)  # a zero norm has a zero dot product
        delta = ((lengths - 1).clamp_min(0).unsqueeze(1) - self.ref_length[ref]).double()  # (N, M)
        penalty = torch.exp(-delta.square() / (2 * self.sigma**2))
        per_ref = cosine.mean(dim=1) * penalty * present  # (N, M)
        return 10.0 * per_ref.sum(dim=1) / self.ref_counts[images]


def corpus_cider_d(references: Mapping[int, Sequence[Sequence[str]]], hypotheses: Mapping[int, Sequence[str]]) -> float:
    """Mean CIDEr-D of tokenised ``hypotheses`` (image id -> words) against tokenised ``references``.

    As coco-caption scores a split: one hypothesis per image, document frequencies from the references
    of the scored images (``references`` may hold more images). Raises ValueError when there is nothing
    to score or an image has no references.
    """
    image_ids = scored_ids(references, hypotheses)
    cider = CiderD([references[i] for i in image_ids])
    return float(cider.score([hypotheses[i] for i in image_ids], range(len(image_ids))).mean())
