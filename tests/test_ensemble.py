"""Ensembles: one model is that model exactly, two copies of one model decode as it does (same tokens, same
scores), two different models score each word with the normalised mean of their log-probabilities (or the mean
of their probabilities, ``mean="prob"``), whole captions included; each model reads the image at its own input
size; different vocabularies, and an unknown mean, are refused in one line (API and CLI)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from captioner import cli, load_model
from captioner.bundle import save_bundle
from captioner.config import DecodingConfig
from captioner.data.vocab import END_ID, PAD_ID, START_ID, UNK_ID
from captioner.errors import ConfigError
from captioner.inference import LoadedEnsemble
from captioner.model.decoding import decode
from captioner.model.ensemble import EnsembleDecoder, Layout
from captioner.model.graphs import GraphCache
from captioner.model.steps import word_log_probs
from cli_helpers import QUICK, WORDS
from conftest import D, L, make_decoder, net_v1, never_ending_captioner, write_bundle

LAYOUT = Layout((2, 2), D, (L, 16))  # make_decoder's: a 2x2 grid of D channels, keys (L, attention_dim 16)
METHODS = [
    DecodingConfig(method="greedy", max_len=6),
    DecodingConfig(method="sample", max_len=6, seed=3),
    DecodingConfig(method="beam", beam_size=3, max_len=6),
    DecodingConfig(method="beam", beam_size=2, max_len=6, min_len=2, no_repeat_ngram_size=2, length_penalty=0.7),
]


def _features(seed: int, locations: int = L) -> torch.Tensor:
    return torch.randn(3, locations, D, generator=torch.Generator().manual_seed(seed))


def _reference(member_logits: list[torch.Tensor], mean: str) -> torch.Tensor:
    """The ensemble's log-distribution over the whole vocabulary (B, V) of its members' logits, averaged as ``mean``
    says, then with <pad>, <start> and <unk> taken out as one model's are."""
    log_probs = torch.stack([logits.log_softmax(dim=1) for logits in member_logits])  # (M, B, V)
    if mean == "log":
        averaged = log_probs.mean(0)
        averaged = averaged - averaged.logsumexp(dim=1, keepdim=True)
    else:
        averaged = log_probs.exp().mean(0).log()
    return word_log_probs(averaged, UNK_ID)


def _same(one, other) -> bool:
    return all(torch.equal(getattr(one, name), getattr(other, name)) for name in ("tokens", "scores", "alphas"))


@pytest.mark.parametrize("settings", METHODS, ids=lambda s: f"{s.method}-{s.beam_size}")
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_an_ensemble_of_one_model_or_of_two_copies_decodes_exactly_as_the_model(settings, static) -> None:
    decoder, features = make_decoder(), _features(1)
    alone = decode(decoder, features, settings, unk_id=UNK_ID, static_shapes=static)
    for copies in (1, 2):
        ensemble = EnsembleDecoder([decoder] * copies, [LAYOUT] * copies)
        together = decode(ensemble, ensemble.pack([features] * copies), settings, unk_id=UNK_ID, static_shapes=static)
        assert _same(alone, together), copies


@pytest.mark.parametrize("mean", ["log", "prob"])
def test_two_models_score_each_word_with_the_mean_of_their_log_probabilities_or_probabilities(mean) -> None:
    decoders, features = [make_decoder(seed=0), make_decoder(seed=7)], [_features(1), _features(2)]
    ensemble = EnsembleDecoder(decoders, [LAYOUT, LAYOUT], mean)
    packed = ensemble.pack(features)
    tokens = torch.full((3,), START_ID)
    with torch.no_grad():
        logits, state, alpha, _, _ = ensemble.step(tokens, ensemble.init_state(packed), packed, ensemble.keys(packed))
        members = [d.step(tokens, d.init_state(f), f, d.attention.keys(f)) for d, f in zip(decoders, features)]
    # over the whole vocabulary, as one model's, then <pad>, <start> and <unk> taken out as one model's are
    expected = _reference([out[0] for out in members], mean)  # (B, V)
    other = _reference([out[0] for out in members], "prob" if mean == "log" else "log")
    assert not torch.allclose(expected, other, atol=1e-3)  # the two means differ on these models
    assert torch.allclose(word_log_probs(logits, UNK_ID), expected, atol=1e-5)
    assert not torch.allclose(expected, word_log_probs(members[0][0], UNK_ID), atol=1e-2)  # not the first's alone
    assert torch.equal(alpha, (members[0][2] + members[1][2]) / 2)
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(state, [*members[0][1], *members[1][1]]))
    first = decode(ensemble, packed, DecodingConfig(method="greedy", max_len=1), unk_id=UNK_ID)
    assert torch.equal(first.tokens[:, 0], expected.argmax(1))
    assert torch.allclose(first.scores, expected.max(1).values, atol=1e-5)


def test_members_on_different_grids_attend_on_the_first_one_s() -> None:
    decoders = [make_decoder(seed=0), make_decoder(seed=7)]
    ensemble = EnsembleDecoder(decoders, [LAYOUT, Layout((4, 4), D, (16, 16))])
    packed = ensemble.pack([_features(1), _features(2, locations=16)])
    for settings in METHODS:
        generation = decode(ensemble, packed, settings, unk_id=UNK_ID)
        ended = generation.tokens != PAD_ID  # the words of each caption, <end> included
        assert generation.alphas.shape[-1] == 4
        assert torch.allclose(generation.alphas.sum(-1)[ended], torch.ones(int(ended.sum())), atol=1e-5)
    with pytest.raises(ValueError, match="member 1"):
        ensemble.pack([_features(1), _features(2)])  # the second member's grid is 4x4


def test_the_decoding_graph_path_gives_the_eager_captions() -> None:
    ensemble = EnsembleDecoder([make_decoder(seed=0), make_decoder(seed=7)], [LAYOUT, LAYOUT])
    packed = ensemble.pack([_features(1), _features(2)])
    settings = DecodingConfig(method="beam", beam_size=3, max_len=6)
    ensemble.use_decoding_graphs(False)
    eager = decode(ensemble, packed, settings, static_shapes=True)
    ensemble.graph_caches = {(None, None): GraphCache(capture=False)}  # replays through the cache on the CPU
    assert _same(decode(ensemble, packed, settings, static_shapes=True), eager)
    assert _same(decode(ensemble, packed, settings, static_shapes=True), eager)
    assert ensemble.decoding_graphs.captures == 1


def _other_bundle(path: Path, words: list[str], image_size: int) -> Path:
    """A never-ending captioner with other weights, for ``image_size`` images."""
    model, vocab, config = never_ending_captioner(words)
    with torch.no_grad():
        for weight in model.decoder.parameters():
            weight.add_(0.3 * torch.randn_like(weight))
        model.decoder.classifier.bias[END_ID] = -1e4
    save_bundle(path, model, vocab, net_v1(config), preprocess={"image_size": image_size})
    return path


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("ensemble")
    return {
        "a": write_bundle(folder / "a.pt", WORDS),
        "b": _other_bundle(folder / "b.pt", WORDS, 64),  # a 2x2 grid where a's is 3x3
        "other_words": write_bundle(folder / "c.pt", [*WORDS[:-1], "below"]),
    }


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("photos")
    paths = []
    for number in range(3):
        path = folder / f"{number}.png"
        Image.effect_noise((50 + 10 * number, 40), 30 + 20 * number).convert("RGB").save(path)
        paths.append(str(path))
    return paths


def test_load_model_of_a_list_captions_as_the_model_for_copies_and_reads_each_input_size(bundles, photos) -> None:
    alone = load_model(bundles["a"])
    beam = {"method": "beam", "beam_size": 2, "max_len": 4}
    expected = alone.caption(photos, **beam)
    for paths in ([bundles["a"]], [bundles["a"], bundles["a"]]):
        ensemble = load_model(paths)
        assert isinstance(ensemble, LoadedEnsemble) and ensemble.decoding == alone.decoding
        for mine, theirs in zip(ensemble.caption(photos, **beam), expected):
            assert mine.words == theirs.words and mine.score == theirs.score and mine.grid == theirs.grid == (3, 3)
            assert torch.equal(mine.alphas, theirs.alphas)
    mixed = load_model([bundles["a"], bundles["b"]])
    assert mixed.members[1].image_size == 64 and mixed.transform(Image.open(photos[0]))[1].shape == (3, 64, 64)
    results = mixed.caption(photos, **beam)
    assert [len(r.words) for r in results] == [4, 4, 4] and all(r.grid == (3, 3) for r in results)
    assert [r.words for r in results] != [r.words for r in expected]  # the second model has its say
    assert "LoadedEnsemble of 2 models" in repr(mixed) and "64 px" in repr(mixed)


def test_different_vocabularies_are_refused_in_one_line(bundles, photos, capsys) -> None:
    with pytest.raises(ConfigError, match="different vocabularies") as error:
        load_model([bundles["a"], bundles["other_words"]])
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="^mean='geometric': an ensemble averages 'log' or 'prob'$"):
        load_model([bundles["a"], bundles["a"]], mean="geometric")
    assert "mean of their probabilities" in repr(load_model([bundles["a"], bundles["a"]], mean="prob"))
    for mean in ("prob", "geometric"):  # with one model, as --ensemble-mean with one --model: not silently ignored
        with pytest.raises(ConfigError, match=f"^mean='{mean}' goes with a list of models"):
            load_model(bundles["a"], mean=mean)
    args = ["caption", photos[0], "--model", str(bundles["a"]), "--model", str(bundles["other_words"]), *QUICK]
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "different vocabularies" in err and "\n" not in err


def test_the_commands_decode_with_the_ensemble(bundles, photos, tmp_path, capsys) -> None:
    models = ["--model", str(bundles["a"]), "--model", str(bundles["b"])]
    assert cli.main(["caption", *photos, *models, *QUICK, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    expected = load_model([bundles["a"], bundles["b"]]).caption(photos, max_len=3)
    assert [row["caption"] for row in rows] == [result.caption for result in expected]
    assert cli.main(["attend", photos[0], *models, *QUICK, "--out", str(tmp_path / "overlay.png")]) == 0
    assert Image.open(tmp_path / "overlay.png").size[0] > 0
    capsys.readouterr()
    assert cli.main(["caption", *photos, *models, *QUICK, "--json", "--ensemble-mean", "prob"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    expected = load_model([bundles["a"], bundles["b"]], mean="prob").caption(photos, max_len=3)
    assert [(row["caption"], row["score"]) for row in rows] == [(r.caption, round(r.score, 4)) for r in expected]
    assert cli.main(["caption", *photos, *models[:2], *QUICK, "--ensemble-mean", "prob"]) == 2
    assert capsys.readouterr().err.strip() == "error: --ensemble-mean prob: one --model is not an ensemble"


def test_evaluate_with_two_copies_of_a_model_scores_as_the_model_and_names_them(bundles, shapes, tmp_path) -> None:
    common = ["evaluate", "--shapes", str(shapes), "--split", "test", "--no-coco", "--method", "greedy", *QUICK]
    assert cli.main([*common, "--model", str(bundles["a"]), "--out", str(tmp_path / "one")]) == 0
    models = ["--model", str(bundles["a"]), "--model", str(bundles["a"])]
    assert cli.main([*common, *models, "--out", str(tmp_path / "two")]) == 0
    one, two = (json.loads((tmp_path / name / "metrics.json").read_text()) for name in ("one", "two"))
    assert two["ensemble"] == [str(bundles["a"])] * 2 and "ensemble" not in one
    assert two["bleu"] == one["bleu"]
    assert (tmp_path / "one" / "results.json").read_text() == (tmp_path / "two" / "results.json").read_text()


def test_hard_inference_is_read_by_each_hard_attention_member_and_refused_without_one(bundles, tmp_path) -> None:
    import argparse

    from captioner.cli.options import load

    hard = write_bundle(tmp_path / "hard.pt", WORDS, mode="hard")
    args = argparse.Namespace(model=[str(bundles["a"]), str(hard)], hard_inference="expectation", given=set())
    loaded = load(args, torch.device("cpu"))
    assert [member.model.decoder.hard_read for member in loaded.members] == [None, "expectation"]
    assert loaded.model.decoder.hard_read is None  # the members read differently
    args.model = [str(bundles["a"])] * 2
    with pytest.raises(ConfigError, match=r"a\.pt uses soft attention, .*a\.pt uses soft attention; the option"):
        load(args, torch.device("cpu"))


def _teacher_forced(decoders, features, tokens: torch.Tensor, mean: str) -> torch.Tensor:
    """The ensemble's log-probability (B, T), averaged as ``mean`` says, of each word of ``tokens`` (B, T) given
    the words before it, each member stepped on its own state: the reference the decoding functions must
    reproduce."""
    states = [d.init_state(f) for d, f in zip(decoders, features)]
    previous, scores = torch.full((tokens.shape[0],), START_ID), []
    for t in range(tokens.shape[1]):
        steps = [d.step(previous, s, f, d.attention.keys(f)) for d, s, f in zip(decoders, states, features)]
        states = [out[1] for out in steps]
        words = _reference([out[0] for out in steps], mean)  # (B, V)
        scores.append(words.gather(1, tokens[:, t : t + 1]).squeeze(1))
        previous = tokens[:, t]
    return torch.stack(scores, dim=1)


@pytest.mark.parametrize("mean", ["log", "prob"])
@pytest.mark.parametrize("settings", [METHODS[0], METHODS[2]], ids=["greedy", "beam-3"])
def test_two_different_models_decode_whole_captions_as_each_member_stepped_on_its_own_state(settings, mean) -> None:
    decoders, features = [make_decoder(seed=0), make_decoder(seed=7)], [_features(1), _features(2)]
    ensemble = EnsembleDecoder(decoders, [LAYOUT, LAYOUT], mean)
    with torch.no_grad():
        got = decode(ensemble, ensemble.pack(features), settings, unk_id=UNK_ID)
        reference = _teacher_forced(decoders, features, got.tokens, mean)
    words = got.tokens != PAD_ID  # (B, T): the words of each caption, <end> included
    # greedy: the sum of its words' reference scores; beam (no length penalty): its best caption's, whose every
    # step reordered the members' states with the beams: a member given another's state or row would differ
    assert torch.allclose(got.scores, reference.where(words, 0).sum(1), atol=1e-4)
