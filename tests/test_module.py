"""CaptionerModule: the model it builds from its settings, and its training-time schedule of the decoder."""

import pytest

from captioner.data.vocab import Vocabulary
from captioner.model.captioner import build_captioner
from captioner.model.self_attention import SelfAttentionStack
from captioner.training.module import CaptionerModule

CAPTIONS = ["a red circle", "a blue square on the left", "a green triangle at the top"]
SMALL = {"name": "resnet18", "stage": "layer1", "grid": 2}


@pytest.fixture(scope="module")
def vocab() -> Vocabulary:
    return Vocabulary.build(CAPTIONS, min_count=1)


@pytest.mark.parametrize(("self_attention", "blocks"), [(None, 0), ({"blocks": 0}, 0), ({}, 0), ({"blocks": 2}, 2)])
def test_self_attention_blocks_are_built_only_when_asked(vocab, self_attention, blocks):
    module = CaptionerModule(vocab, encoder=SMALL, self_attention=self_attention)
    stack = module.model.self_attention
    assert (0 if stack is None else len(stack.blocks)) == blocks
    assert stack is None or isinstance(stack, SelfAttentionStack)
    rebuilt = build_captioner(module.net_config, len(vocab)).self_attention  # what the bundle rebuilds
    assert (0 if rebuilt is None else len(rebuilt.blocks)) == blocks


def test_unk_is_excluded_from_the_loss(vocab):
    module = CaptionerModule(vocab, encoder=SMALL)
    assert module.criterion.unk_id == vocab.unk_id and module.criterion.pad_id == vocab.pad_id
