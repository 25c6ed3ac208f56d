"""A trained captioner's weights in a model of a vocabulary that holds its words and more (``init_vocab=grow``).

The decoder's word-indexed parameters (``ShowAttendTellDecoder.WORD_ROWS``: the embedding E, the output layer L_o's
weight and bias) have one row per word id: a word the trained model knew keeps its trained row, moved to its id in
the new vocabulary; a new word keeps the new model's own initialisation (an embedding row drawn as ``nn.Embedding``
draws it, an output row and bias as ``nn.Linear`` does), never a copy of a trained row. Every other parameter and
buffer is the trained model's as it is, and must have its shape.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from captioner.errors import ConfigError
from captioner.model.captioner import Captioner
from captioner.model.decoder import ShowAttendTellDecoder

WORD_ROWS = tuple(f"decoder.{name}" for name in ShowAttendTellDecoder.WORD_ROWS)  # as a Captioner names them


def load_trained_weights(
    model: Captioner, trained: Captioner, words: Sequence[str], trained_words: Sequence[str]
) -> None:
    """Load the weights of ``trained`` (for the vocabulary ``trained_words``, in id order) into ``model`` (for
    ``words``, which holds every one of ``trained_words``): with the same words, exactly
    ``model.load_state_dict(trained.state_dict())``.

    ConfigError (one line) for a tensor that one model has and the other has not, or that differs in shape
    (beyond the number of word rows): a network other than the trained one.
    """
    ids = {word: i for i, word in enumerate(words)}
    lost = [word for word in trained_words if word not in ids]
    if lost:
        raise ConfigError(f"the new vocabulary lacks {len(lost)} words of the trained model's: {', '.join(lost[:5])}")
    rows = torch.tensor([ids[word] for word in trained_words])  # (V_trained,): each trained row's id in ``words``
    state, weights = model.state_dict(), trained.state_dict()
    if state.keys() != weights.keys():
        name = sorted(state.keys() ^ weights.keys())[0]
        has, lacks = ("the trained model", "this run's") if name in weights else ("this run's model", "the trained")
        raise ConfigError(f"{has} has {name} and {lacks} has not: another network than the one trained")
    loaded = {}
    for name, value in weights.items():
        fresh = state[name]
        expected = (len(trained_words), *fresh.shape[1:]) if name in WORD_ROWS else fresh.shape
        if value.shape != expected:
            raise ConfigError(
                f"the trained model's {name} is {tuple(value.shape)}, this run's model's {tuple(fresh.shape)}: another "
                "network than the one trained"
            )
        # (V, ...): the trained rows at their words' ids, the new words' rows as ``model`` drew them
        loaded[name] = fresh.clone().index_copy_(0, rows, value.to(fresh)) if name in WORD_ROWS else value
    model.load_state_dict(loaded)
