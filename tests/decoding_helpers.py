"""Decoders and settings the decoding tests share: a scripted chain decoder with known answers, the three methods
by name, a real decoder's <end> bias set, and padding of token rows to compare batches of different widths."""

import torch

from captioner.model.decoder import ShowAttendTellDecoder
from captioner.model.decoding import beam_search, greedy, sample
from conftest import END

METHODS = {"greedy": greedy, "sample": sample, "beam": beam_search}


class ChainDecoder:
    """A scripted decoder: the next word depends only on the previous one (row ``table[previous]``
    of next-word probabilities); alpha is the one-hot of the previous word, so traced alphas show
    which beam each word came from."""

    def __init__(self, table: dict[int, dict[int, float]], vocab: int) -> None:
        probs = torch.full((vocab, vocab), 1e-6)
        for previous, row in table.items():
            for word, p in row.items():
                probs[previous, word] = p
        self.log_probs = (probs / probs.sum(-1, keepdim=True)).log()  # (V, V)
        self.attention = self
        self.vocab = vocab

    def keys(self, features):
        return features

    def init_state(self, features):
        return features.new_zeros(features.size(0), 1), features.new_zeros(features.size(0), 1)

    def step(self, tokens, state, features, keys):
        return self.log_probs[tokens], state, torch.eye(self.vocab)[tokens], None, None


def chain_features(batch: int = 2) -> torch.Tensor:
    """(B, 7, 1) zeros as the features of ``batch`` images: a ChainDecoder reads only their batch size."""
    return torch.zeros(batch, 7, 1)


def with_end_bias(decoder: ShowAttendTellDecoder, bias: float) -> ShowAttendTellDecoder:
    """Set the output bias of <end>: -inf makes <end> impossible, a positive value makes it common."""
    with torch.no_grad():
        decoder.classifier.bias[END] = bias
    return decoder


def pad_to(tokens: torch.Tensor, width: int) -> torch.Tensor:
    """``tokens`` right-padded with <pad> (id 0) to ``width`` along the last dimension."""
    return torch.nn.functional.pad(tokens, (0, width - tokens.size(-1)))
