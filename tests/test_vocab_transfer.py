"""A trained captioner's weights in a model whose vocabulary grew (``init_vocab=grow``): model/vocab_transfer.py,
and a run of train.py that grows the vocabulary of the model it starts from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from captioner.bundle import load_trained
from captioner.data.vocab import Vocabulary
from captioner.errors import ConfigError
from captioner.model.captioner import Captioner, build_captioner
from captioner.model.vocab_transfer import WORD_ROWS, load_trained_weights
from conftest import CAPTIONER_NET, SMALL_IMAGE_SIZE, net_v1, run_train, tiny_overrides, write_run

TRAINED = Vocabulary(["a", "red", "circle", "left", "of"])
GROWN = Vocabulary([*TRAINED.itos, "star", "cross", "striped"])  # the trained words in their order, then new ones


def _model(vocab: Vocabulary, seed: int, **decoder: Any) -> Captioner:
    """A seeded ``CAPTIONER_NET`` captioner (self-attention, a 2x2 grid) for ``vocab``, its decoder's settings
    changed by ``decoder``, in eval mode."""
    torch.manual_seed(seed)
    config = {**CAPTIONER_NET, "decoder": {**CAPTIONER_NET["decoder"], **decoder}}
    return build_captioner(net_v1(config), len(vocab)).eval()


def test_shared_words_keep_their_trained_rows_and_new_words_the_new_model_s_own() -> None:
    trained, model = _model(TRAINED, seed=0), _model(GROWN, seed=1)
    drawn = {name: value.clone() for name, value in model.state_dict().items()}
    load_trained_weights(model, trained, GROWN.itos, TRAINED.itos)
    state, weights, old = model.state_dict(), trained.state_dict(), len(TRAINED)
    for name in WORD_ROWS:  # the embedding, the output layer's weight and bias
        assert state[name].shape[0] == len(GROWN)
        assert torch.equal(state[name][:old], weights[name])  # the specials and the trained words: exactly theirs
        assert torch.equal(state[name][old:], drawn[name][old:])  # the new words: as the new model drew them
        assert not any(torch.equal(new, row) for new in state[name][old:] for row in weights[name])  # no copies
    assert all(torch.equal(state[name], weights[name]) for name in weights if name not in WORD_ROWS)
    images = torch.rand(2, 3, SMALL_IMAGE_SIZE, SMALL_IMAGE_SIZE)
    captions = torch.tensor([[1, 4, 5, 6, 2], [1, 4, 7, 8, 2]])  # trained words only
    with torch.no_grad():
        grown_logits, trained_logits = model(images, captions).logits, trained(images, captions).logits  # (N, T, V)
    assert grown_logits.shape[-1] == len(GROWN)
    torch.testing.assert_close(grown_logits[..., :old], trained_logits, rtol=0, atol=1e-6)  # the same scores


def test_with_the_same_words_it_is_load_state_dict() -> None:
    trained = _model(TRAINED, seed=0)
    loaded, transferred = _model(TRAINED, seed=1), _model(TRAINED, seed=1)
    loaded.load_state_dict(trained.state_dict())
    load_trained_weights(transferred, trained, TRAINED.itos, TRAINED.itos)
    expected = loaded.state_dict()
    assert all(torch.equal(value, expected[name]) for name, value in transferred.state_dict().items())


def test_rows_follow_their_words_to_their_new_ids() -> None:
    trained, model = _model(TRAINED, seed=0), _model(GROWN, seed=1)
    shuffled = [*TRAINED.itos[:4], "of", "star", "a", "left", "circle", "cross", "red", "striped"]
    load_trained_weights(model, trained, shuffled, TRAINED.itos)
    embedding = model.decoder.embedding.weight
    for word in TRAINED.itos:
        assert torch.equal(embedding[shuffled.index(word)], trained.decoder.embedding.weight[TRAINED.stoi[word]])


@pytest.mark.parametrize(
    "decoder,message",
    [
        ({"hidden_dim": 8}, r"the trained model's decoder\.\S+ is \(\d+(, \d+)*\), this run's model's \(\d+"),
        ({"gate": "none"}, r"the trained model has decoder\.f_beta\.bias and this run's has not"),
        (
            {"embed_dim": 8},
            r"the trained model's decoder\.embedding\.weight is \(9, 16\), this run's model's \(12, 8\)",
        ),
    ],
)
def test_another_network_is_refused_in_one_line(decoder: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{message}.*: another network than the one trained$") as refused:
        load_trained_weights(_model(GROWN, seed=1, **decoder), _model(TRAINED, seed=0), GROWN.itos, TRAINED.itos)
    assert "\n" not in str(refused.value)


def test_a_vocabulary_that_lost_trained_words_is_refused() -> None:
    lost = [word for word in GROWN.itos if word not in ("red", "left")]
    model, trained = _model(Vocabulary(lost), seed=1), _model(TRAINED, seed=0)
    with pytest.raises(ConfigError, match=r"^the new vocabulary lacks 2 words of the trained model's: red, left$"):
        load_trained_weights(model, trained, lost, TRAINED.itos)


@pytest.mark.parametrize(
    "options", [{}, {"deep_output": False}, {"mode": "hard", "attention": "dot"}, {"gate": "vector"}]
)
def test_the_word_rows_are_every_tensor_whose_size_is_the_vocabulary_s(options: dict[str, Any]) -> None:
    small, large = _model(TRAINED, seed=0, **options).state_dict(), _model(GROWN, seed=0, **options).state_dict()
    assert small.keys() == large.keys()
    assert {name for name in small if small[name].shape != large[name].shape} == set(WORD_ROWS)


def test_train_py_grows_the_vocabulary_of_the_model_init_from_starts_from(tiny_shapes: Path, tmp_path: Path) -> None:
    run = write_run(tmp_path / "trained", None)  # a tiny model of the words a, red, circle
    trained = load_trained(run / "bundle.pt")
    args = [*tiny_overrides(tiny_shapes, tmp_path), f"init_from={run}", "train=false", "test=false"]
    proc = run_train([*args, "init_vocab=grow", "+trainer.limit_val_batches=1"], timeout=300)
    grown = load_trained(tmp_path / "run" / "bundle.pt")  # the model as the new run starts: no step trained
    old = len(trained.vocab)
    assert grown.vocab.itos[:old] == trained.vocab.itos and len(grown.vocab) > old + 10  # the shapes' words
    assert {"square", "triangle", "blue", "left"} <= set(grown.vocab.itos[old:])
    assert f"gains {len(grown.vocab) - old} training words" in proc.stdout
    assert "read as <unk> by the vocabulary of data.vocab_file=" in proc.stdout and "grown" in proc.stdout
    state, weights = grown.model.state_dict(), trained.model.state_dict()
    for name in WORD_ROWS:
        assert torch.equal(state[name][:old], weights[name])
        assert not any(torch.equal(new, row) for new in state[name][old:] for row in weights[name])
    assert all(torch.equal(state[name], weights[name]) for name in weights if name not in WORD_ROWS)
