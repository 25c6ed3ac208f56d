"""How captions are decoded: validation's and test's settings, and captioning's."""

from __future__ import annotations

import dataclasses
import difflib
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from captioner.config.settings import Settings
from captioner.errors import ConfigError, check_range

MAX_LEN = 20  # words per caption at most, <end> excluded: training's cut (DataConfig) and decoding's limit
# Upper bounds of what a config (and so a bundle, which may come from anyone) can set, far above any use: decoding
# holds (images x beam_size, max_len, grid cells) attention maps, so a bundle never makes it allocate or loop
# without end.
MAX_WORDS = 100  # max_len (decoding's and training's DataConfig.max_len), min_len, no_repeat_ngram_size
MAX_BEAM_SIZE = 32
MAX_LENGTH_PENALTY = 10.0  # GNMT's alpha; 0.6-1.0 are the usual values
MAX_TEMPERATURE = 100.0  # softmax(logits / 100) is all but uniform already
MAX_VOCAB_SIZE = 1_000_000  # words a vocabulary (a bundle's too) holds at most besides the specials
MAX_GROUPS = 64  # diverse beam search's groups at most: each is one more pass over the vocabulary per word
MAX_DIVERSITY = 100.0  # the largest diversity penalty: far beyond any log-prob gap, every earlier word barred


class DecodeMethod(enum.StrEnum):
    """How validation, test and the CLI turn a model into captions."""

    greedy = "greedy"
    beam = "beam"
    diverse = "diverse"  # diverse beam search: the beams in groups, each kept from the words of the earlier ones
    sample = "sample"


class EnsembleMean(enum.StrEnum):
    """How an ensemble's members' word distributions p_m(w) make its own, at every word."""

    log = "log"  # the normalised mean of their log-probabilities (a geometric mean: any member can veto a word)
    prob = "prob"  # the mean of their probabilities, log mean_m p_m(w) (ruotianluo's AttEnsemble, fairseq)


@dataclass
class DecodingConfig(Settings):
    """How captions are decoded: these defaults are validation's and test's (``model.decoding``);
    captioning (``Captioner.generate``) starts from ``captioning()``, the same settings with
    ``CAPTIONING_METHOD``, and a trained model's (``caption()``, the CLI's flags) from those its bundle keeps,
    its run's ``for_captioning()``. ``captioner.model.decoding`` takes one, checked here."""

    # greedy for validation and test (one decode per epoch, fast); captioning: CAPTIONING_METHOD
    method: DecodeMethod = DecodeMethod.greedy
    beam_size: int = 3  # beam and diverse: beams per image (diverse: all groups' together)
    max_len: int = MAX_LEN  # words at most, <end> excluded; a training run's: its data.max_len (conf/model/base.yaml)
    length_penalty: float = 0.0  # beam and diverse: score / ((5 + length) / 6) ** length_penalty (GNMT)
    n_best: int = 1  # beam and diverse: captions returned per image, best first (<= beam_size)
    groups: int = 3  # diverse: groups of beam_size / groups beams each (beam_size a multiple of it)
    diversity: float = 0.5  # diverse: lambda, the log-prob taken off a word per earlier group's beam that chose it
    temperature: float = 1.0  # sample: softmax(logits / temperature)
    top_k: int = 0  # sample: draw among the top_k most likely words only (0: off)
    top_p: float = 1.0  # sample: draw among the fewest most likely words holding top_p of the mass (1: off)
    min_len: int = 0  # no <end> before this many words (0 and 1 alike: a caption always has one word)
    no_repeat_ngram_size: int = 0  # no n-gram of this many words twice in a caption (0: off)
    seed: int | None = None  # sample: seeds its random draws, the same seed the same captions (None: torch's own)

    @classmethod
    def captioning(cls, **settings: Any) -> DecodingConfig:
        """Captioning's settings: ``method=CAPTIONING_METHOD``, then ``settings`` (field names) over them,
        checked as ``captioning_settings`` checks them."""
        return captioning_settings(settings)

    def for_captioning(self) -> DecodingConfig:
        """These settings with captioning's method: how ``captioner evaluate`` decodes, and so a run's final
        scores (its summary, metrics.json, test); each epoch's validation keeps ``method`` (greedy by default:
        the cheaper, paid every epoch)."""
        return dataclasses.replace(self, method=CAPTIONING_METHOD)

    def describe(self) -> str:
        """The method in words: "beam search (beam 3)", "diverse beam search (beam 6 in 3 groups, diversity 0.5)",
        "greedy", "sample", "sample (top-k 10, top-p 0.9)"."""
        if self.method == DecodeMethod.beam:
            return f"beam search (beam {self.beam_size})"
        if self.method == DecodeMethod.diverse:
            return f"diverse beam search (beam {self.beam_size} in {self.groups} groups, diversity {self.diversity})"
        cuts = [f"top-k {self.top_k}"] * bool(self.top_k) + [f"top-p {self.top_p}"] * (self.top_p < 1)
        if self.method == DecodeMethod.sample and cuts:
            return f"sample ({', '.join(cuts)})"
        return str(self.method)

    def check(self) -> None:
        check_range("beam_size", self.beam_size, 1, MAX_BEAM_SIZE, kind=int)
        check_range("max_len", self.max_len, 1, MAX_WORDS, kind=int)
        check_range("length_penalty", self.length_penalty, 0.0, MAX_LENGTH_PENALTY)
        check_range("n_best", self.n_best, 1, kind=int)
        check_range("groups", self.groups, 1, MAX_GROUPS, kind=int)
        check_range("diversity", self.diversity, 0.0, MAX_DIVERSITY)
        check_range("temperature", self.temperature, 1e-6, MAX_TEMPERATURE)
        check_range("top_k", self.top_k, 0, MAX_VOCAB_SIZE, kind=int)  # 0: off; past the vocabulary, every word
        check_range("top_p", self.top_p, 1e-6, 1.0)
        check_range("min_len", self.min_len, 0, MAX_WORDS, kind=int)
        check_range("no_repeat_ngram_size", self.no_repeat_ngram_size, 0, MAX_WORDS, kind=int)
        if self.seed is not None:
            check_range("seed", self.seed, 0, 2**64 - 1, kind=int)  # what torch.Generator.manual_seed takes
        if self.min_len >= self.max_len:
            raise ConfigError(f"min_len={self.min_len} must be < max_len={self.max_len}")
        if self.n_best > self.beam_size:
            raise ConfigError(
                f"n_best={self.n_best} must be <= beam_size={self.beam_size}: a beam search keeps beam_size captions"
            )
        if self.method == DecodeMethod.diverse and self.beam_size % self.groups:
            raise ConfigError(
                f"beam_size={self.beam_size} must be a multiple of groups={self.groups}: diverse beam search shares "
                "the beams out evenly"
            )


# How captioning decodes by default (validation and test: DecodingConfig.method): beam search finds better
# captions than greedy decoding, for a cost paid once per image rather than every epoch.
CAPTIONING_METHOD = DecodeMethod.beam
CAPTIONING_BATCH_SIZE = 32  # images encoded and decoded together (caption(), `captioner caption --batch-size`)
CAPTIONING_WORKERS = 2  # processes decoding image files while the model captions (`--workers`; 0: this one)

# The captioning settings that only one method reads: given with another method they are refused, as keywords of
# ``caption()`` and as the command line's flags (``--beam-size`` with ``--method greedy``).
BEAMS = (DecodeMethod.beam, DecodeMethod.diverse)
METHOD_SETTINGS = {
    "beam_size": BEAMS,
    "length_penalty": BEAMS,
    "n_best": BEAMS,
    "groups": (DecodeMethod.diverse,),
    "diversity": (DecodeMethod.diverse,),
    "temperature": (DecodeMethod.sample,),
    "top_k": (DecodeMethod.sample,),
    "top_p": (DecodeMethod.sample,),
    "seed": (DecodeMethod.sample,),
}


def flag(name: str) -> str:
    """The command line's flag of a decoding setting: ``beam_size`` -> ``--beam-size``."""
    return "--" + name.replace("_", "-")


def captioning_settings(
    settings: Mapping[str, Any], flags: bool = False, base: DecodingConfig | None = None
) -> DecodingConfig:
    """How one captioning call decodes: ``settings`` (field names) over ``base`` (a model's: how its run decoded
    its final scores; None: captioning's defaults), checked.

    The one check of ``caption()``'s keywords and the command line's decoding flags. TypeError for a name that
    is no setting (naming the nearest one); ConfigError for a setting that the method does not read
    (``METHOD_SETTINGS``: ``beam_size`` with greedy decoding) or a bad value. ``flags``: the messages name the
    command line's flags (``--beam-size``) rather than the keywords.
    """
    names = [field.name for field in dataclasses.fields(DecodingConfig)]
    for name in settings:
        if name not in names:
            nearest = difflib.get_close_matches(name, names, n=1)
            hint = f"; did you mean {nearest[0]!r}?" if nearest else ""
            raise TypeError(f"unexpected keyword argument {name!r}{hint} (decoding settings: {', '.join(names)})")

    def spell(name: str, value: object = None) -> str:
        if value is None:
            return flag(name) if flags else name
        return f"{flag(name)} {value}" if flags else f"{name}={str(value)!r}"

    try:
        config = dataclasses.replace(base or DecodingConfig(method=CAPTIONING_METHOD), **settings)
    except ConfigError as exc:
        message = str(exc)
        if flags:
            for name in names:
                message = message.replace(name, flag(name))
        raise ConfigError(message) from None
    for name in sorted(set(settings) & set(METHOD_SETTINGS)):
        if config.method not in METHOD_SETTINGS[name]:
            subject = "this command" if flags else "this call"
            default = " (the default)" if config.method == CAPTIONING_METHOD else ""
            methods = " or ".join(spell("method", method) for method in METHOD_SETTINGS[name])
            raise ConfigError(
                f"{spell(name)} goes with {methods}; {subject} decodes with {spell('method', config.method)}{default}"
            )
    return config
