"""What the tests share: a tiny built-in dataset, composed configs, train.py runs and what they leave behind (one
trained run for the whole test run), small models and bundles, and the helpers that build or damage their files.

Under pytest-xdist (README's test command runs two workers) each worker, and every process it starts, runs torch on
one thread, and what is built once per test run (``built_once``) is shared by the workers; docs/testing.md."""

from __future__ import annotations

import csv
import hashlib
import os
import runpy
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import torch
from filelock import FileLock
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from captioner.bundle import CHECKPOINT_KEY, bundle_metadata, read_net, save_bundle
from captioner.config import EncoderConfig, LossConfig, NetConfig, ShapesSpec, from_dict
from captioner.data.shapes import generate_shapes
from captioner.data.vocab import END_ID, PAD_ID, START_ID, Vocabulary
from captioner.fileio import save_torch
from captioner.model.captioner import Captioner, build_captioner
from captioner.model.decoder import ShowAttendTellDecoder
from captioner.model.encoder import Encoder
from captioner.model.losses import CaptionLoss
from captioner.training.schemas import register_schemas

# The fixtures the captioner command's test files share (bundles, inputs, shapes): cli_helpers.py.
pytest_plugins = ["cli_helpers"]

# A pytest-xdist worker's name (gw0, gw1, ...); None in a run without workers.
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if WORKER:
    # the workers share the machine's cores: a second torch thread per worker (or per process a test starts, which
    # inherits OMP_NUM_THREADS) would only wait for the other worker's
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

# A dataset small enough to train on in seconds; the same parameters everywhere so it is generated once.
TINY = ShapesSpec(n_train=240, n_val=24, n_test=24)

# A small model: resnet18 with random weights (at 96 px a 3x3 attention grid), a 16-wide decoder without dropout.
SMALL_NET = {
    "encoder": {"name": "resnet18"},
    "decoder": {"embed_dim": 16, "hidden_dim": 16, "attention_dim": 16, "dropout": 0.0},
}
SMALL_IMAGE_SIZE = 96

# The captioner of the model and bundle tests: resnet18 (random weights; at 96 px a 3x3 map) pooled to a 2x2 grid,
# one self-attention block, a 16-wide decoder without dropout.
CAPTIONER_NET = {
    "encoder": {"name": "resnet18", "weights": None, "grid": 2},
    "self_attention": {"blocks": 1, "heads": 2, "positional": True},
    "decoder": {"embed_dim": 16, "hidden_dim": 16, "attention_dim": 16, "dropout": 0.0},
}

# A tiny hard-attention model of every part (a trained stage, feature norm, self-attention, dot scorer): the
# model of the runs write_run leaves.
RUN_NET = {
    "encoder": {"name": "resnet18", "weights": None, "trainable_stages": 0, "stage": "layer2", "grid": 2},
    "feature_norm": True,
    "self_attention": {},
    "decoder": {"embed_dim": 8, "hidden_dim": 8, "attention_dim": 8, "mode": "hard", "attention": "dot"},
}

# The small decoder of the decoding and SCST tests: V words, D feature channels, L grid locations.
V, D, L = 12, 6, 4
START, END = START_ID, END_ID


# ------------------------------------------------------------------------------------ built once per run
def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    """The folder ``name`` that ``build(folder)`` fills, built once per test run: with pytest-xdist in the folder the
    workers' temporary folders share, by the first worker that asks while the others wait on a lock (a build that
    failed is tried again by the next one). Tests must not change what is inside."""
    base = tmp_path_factory.getbasetemp()
    if WORKER:
        base = base.parent  # pytest-<n>/, the run's own: each worker's base is pytest-<n>/popen-gw<i>
    folder, built = base / name, base / f"{name}.built"
    with FileLock(str(base / f"{name}.lock")):
        if not built.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a failed build left
            folder.mkdir()
            build(folder)
            built.touch()
    return folder


# ------------------------------------------------------------------------------------- the tiny dataset
@pytest.fixture(scope="session")
def tiny_shapes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A generated built-in dataset (240/24/24 images, 96 px) shared by the whole test run."""
    return built_once(tmp_path_factory, "data", lambda folder: generate_shapes(folder / "shapes", TINY)) / "shapes"


def copy_dataset(tiny_shapes: Path, dest: Path, images: bool = True) -> Path:
    """A copy of the tiny dataset (without its images when ``images`` is false) that a test may damage."""
    ignore = None if images else shutil.ignore_patterns("images")
    return Path(shutil.copytree(tiny_shapes, dest, ignore=ignore))


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (relative path) with the sha256 of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


# ------------------------------------------------------------------------------------ composed configs
def compose_cfg(overrides: list[str], tmp_path: Path) -> DictConfig:
    """Compose conf/config.yaml as train.py would, with the run's folder at ``tmp_path/out``."""
    register_schemas()

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    with open_dict(cfg):
        cfg.paths.root_dir = str(ROOT)
        cfg.paths.output_dir = str(tmp_path / "out")
        cfg.hydra.runtime.output_dir = str(tmp_path / "out")
    HydraConfig().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]  # train.py sees the config without the hydra node, as under @hydra.main
    return cfg


def compose_plain(overrides: list[str], tmp_path: Path) -> dict[str, Any]:
    """``compose_cfg`` resolved to plain data, as validate_config and preflight take it."""
    return OmegaConf.to_container(compose_cfg(overrides, tmp_path), resolve=True)


def tiny_overrides(data_root: Path, out: Path, cache: Path | None = None) -> list[str]:
    """Hydra overrides that point the default config at the tiny dataset and a temporary run folder."""
    cache_value = "null" if cache is None else str(cache)
    return [
        f"data.source.root={data_root}",
        *(f"data.source.{k}={v}" for k, v in asdict(TINY).items()),
        f"data.feature_cache={cache_value}",
        "data.num_workers=0",
        "data.batch_size=16",
        "data.eval_batch_size=24",
        f"paths.log_dir={out}",
        f"hydra.run.dir={out / 'run'}",
        "logger=csv",
        "trainer.enable_progress_bar=false",
    ]


# ------------------------------------------------------------------------------------------ train.py runs
def subprocess_env() -> dict[str, str]:
    """The environment of a train.py subprocess: unbuffered output, as many threads as the tests' own."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}


def run_train(args: list[str], timeout: float = 600, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    """``python train.py ARGS`` in a subprocess (the way users run it)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def run_train_here(args: list[str], monkeypatch: pytest.MonkeyPatch) -> int:
    """``python train.py ARGS`` run as a script in this process (quicker than a subprocess when the test patches
    what the run calls): its exit status (``cli`` returns: 0; it exits otherwise). The environment variable its
    ``cli()`` sets (HYDRA_FULL_ERROR) is restored afterwards, as a process of its own would leave it."""
    monkeypatch.setattr(sys, "argv", [str(ROOT / "train.py"), *args])
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")
    try:
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0


def run_script(script: str | Path, *args: str, timeout: float = 600) -> None:
    """``python SCRIPT ARGS`` from the checkout's root, this checkout's captioner in every process it starts (a test
    module run as a script that spawns its own DDP ranks); the test fails with the tail of its stderr when it exits
    non-zero, and is killed and failed when it outlives ``timeout`` (a hang never holds the suite)."""
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        cwd=ROOT,
        env={**subprocess_env(), "PYTHONPATH": str(ROOT)},  # this checkout's captioner, in every rank
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def error_line(proc: subprocess.CompletedProcess) -> str:
    """The single ``error: ...`` line a failed train.py printed; fails when stderr holds anything else."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    return lines[0]


def metrics_rows(run: Path) -> list[dict[str, str]]:
    """The rows of a run's CSV log (``logger=csv``), one per logged step; "" where a key was not logged."""
    with open(run / "csv" / "version_0" / "metrics.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def logged(run: Path, key: str) -> dict[int, float]:
    """The values of ``key`` in a run's CSV log, by step, in the order they were logged."""
    return {int(row["step"]): float(row[key]) for row in metrics_rows(run) if row.get(key)}


@dataclass(frozen=True)
class TrainedRun:
    """A finished train.py run: its folder, what it printed, and the feature cache it read."""

    folder: Path
    stdout: str
    stderr: str
    cache: Path


# The epochs of the shared trained run: its greedy val BLEU-4 passes 0.3 at the 4th (test_train_runs asserts it).
TRAINED_EPOCHS = 6


@pytest.fixture(scope="session")
def trained_run(tiny_shapes: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainedRun:
    """A cross-entropy run of train.py on the tiny dataset (``TRAINED_EPOCHS`` epochs, the frozen stem's features
    cached, the progress bar on, no early stopping, no test): the one trained model of the test run, built once
    (``built_once``). test_train_runs checks that it learned; SCST, DDP validation, ... start from it. Tests read
    its folder and cache, and copy them to change anything."""

    def train(folder: Path) -> None:
        proc = run_train(
            [
                *tiny_overrides(tiny_shapes, folder, cache=folder / "cache"),
                "model.objective=cross_entropy",  # the demo's SCST epochs: tests/test_scst.py
                f"trainer.max_epochs={TRAINED_EPOCHS}",
                "test=false",
                "callbacks.early_stopping=null",
                "trainer.enable_progress_bar=true",
            ]
        )
        (folder / "stdout.txt").write_text(proc.stdout)
        (folder / "stderr.txt").write_text(proc.stderr)

    folder = built_once(tmp_path_factory, "trained", train)
    stdout, stderr = ((folder / f"{name}.txt").read_text() for name in ("stdout", "stderr"))
    return TrainedRun(folder / "run", stdout, stderr, folder / "cache")


# --------------------------------------------------------------------------------- models and their files
@pytest.fixture(scope="module")
def small_vocab() -> Vocabulary:
    """Seven words: eleven ids with the specials."""
    return Vocabulary(["a", "red", "blue", "circle", "square", "left", "of"])


@pytest.fixture(scope="module")
def small_model(small_vocab: Vocabulary) -> Captioner:
    """A ``CAPTIONER_NET`` captioner in eval mode whose self-attention gate is open (tests must not change it)."""
    torch.manual_seed(0)
    captioner = build_captioner(net_v1(CAPTIONER_NET), len(small_vocab)).eval()
    with torch.no_grad():
        captioner.self_attention.blocks[0].gamma.fill_(0.5)
    return captioner


def never_ending_captioner(
    words: Sequence[str], mode: str = "soft", favoured: Sequence[str] = ()
) -> tuple[Captioner, Vocabulary, dict]:
    """An untrained ``SMALL_NET`` captioner (seeded, in eval mode), its vocabulary and config: its captions
    never end (always max_len words) and the ``favoured`` words are far likelier than the others."""
    torch.manual_seed(0)
    vocab = Vocabulary(words)
    config = {**SMALL_NET, "decoder": {**SMALL_NET["decoder"], "mode": mode}}
    model = build_captioner(net_v1(config), len(vocab)).eval()
    with torch.no_grad():
        model.decoder.classifier.bias[END_ID] = -1e4
        for word in favoured:
            model.decoder.classifier.bias[vocab.stoi[word]] += 20.0
    return model, vocab, config


def write_bundle(path: Path, words: Sequence[str], mode: str = "soft", favoured: Sequence[str] = ()) -> Path:
    """The bundle of ``never_ending_captioner`` at ``path`` (for SMALL_IMAGE_SIZE images); returns ``path``."""
    model, vocab, config = never_ending_captioner(words, mode, favoured)
    save_bundle(path, model, vocab, net_v1(config), preprocess={"image_size": SMALL_IMAGE_SIZE})
    return path


def tampered(bundle: str | Path, path: Path, change: Callable[[dict], None]) -> Path:
    """A copy of ``bundle`` at ``path`` with ``change`` applied to its loaded contents; returns ``path``."""
    raw = torch.load(bundle, weights_only=True)
    change(raw)
    torch.save(raw, path)
    return path


def write_run(folder: Path, objective: str | None, bundle: bool = True, net: Mapping[str, Any] = RUN_NET) -> Path:
    """A run folder as train.py leaves it: checkpoints/last.ckpt (written with ``objective``; None: before
    model.objective existed) and bundle.pt, for a tiny ``net`` model trained on 64 px images (its encoder's
    pretrained weights, if it names them, are not read: the run's files hold every weight)."""
    vocab = Vocabulary(["a", "red", "circle"])
    model = build_captioner(net_v1(net).without_pretrained(), len(vocab))
    hyper = {} if objective is None else {"objective": objective}
    (folder / "checkpoints").mkdir(parents=True)
    save_torch(
        {
            "pytorch-lightning_version": "2.6.0",
            "epoch": 3,
            "hyper_parameters": hyper,
            "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
            CHECKPOINT_KEY: bundle_metadata(net_v1(net), vocab, {"image_size": 64}),
        },
        folder / "checkpoints" / "last.ckpt",
    )
    if bundle:
        save_bundle(folder / "bundle.pt", model, vocab, net_v1(net), {"image_size": 64})
    return folder


def make_encoder(name: str, **options: Any) -> Encoder:
    """The Encoder of torchvision model ``name`` (random weights), frozen and read at its last stage unless
    ``options`` (other EncoderConfig fields) say otherwise."""
    return Encoder(EncoderConfig(name, **{"stage": None, "trainable_stages": 0, **options}))


def net_v1(config: Mapping[str, Any]) -> NetConfig:
    """The NetConfig of ``config`` written in version 1 of the bundle format (``captioner.bundle_v1``), the layout
    of ``CAPTIONER_NET``, ``SMALL_NET`` and ``RUN_NET``: what a key left out means is fixed there for good."""
    return read_net(config, 1)


def net_config(**options: Any) -> NetConfig:
    """A NetConfig from flat options: NetConfig's own fields (attention, scorer, encoder, ...) by name, every
    other option a DecoderConfig field: ``net_config(attention="hard", hidden_dim=16)``."""
    own = {item.name for item in fields(NetConfig)}
    decoder = {key: options.pop(key) for key in list(options) if key not in own}
    return from_dict(NetConfig, {**options, "decoder": decoder})


@pytest.fixture(autouse=True)
def sigint_as_it_was():
    """Every test leaves Ctrl-C's handler as it found it (Lightning ignores SIGINT after handling a
    KeyboardInterrupt in this process, and an ignored SIGINT is inherited by every later subprocess: a
    ``train.py`` that the signal test interrupts would finish and exit 0)."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)


def make_decoder(attention: str = "soft", seed: int = 0, **options: Any) -> ShowAttendTellDecoder:
    """A seeded (V words, D channels) decoder 16 wide without dropout, in eval mode; ``options`` are its other
    settings (``net_config``'s)."""
    torch.manual_seed(seed)
    settings = net_config(attention=attention, embed_dim=16, hidden_dim=16, attention_dim=16, dropout=0.0, **options)
    return ShowAttendTellDecoder(V, D, settings).eval()


def make_loss(pad_id: int = PAD_ID, unk_id: int | None = None, **options: Any) -> CaptionLoss:
    """A CaptionLoss with the paper's ds_lambda = 1 unless ``options`` (LossConfig fields) say otherwise."""
    return CaptionLoss(LossConfig(**{"ds_lambda": 1.0, **options}), pad_id, unk_id)


def features_for(batch: int = 5, seed: int = 1) -> torch.Tensor:
    """Random grid features (batch, L, D) for ``make_decoder``'s decoder."""
    return torch.randn(batch, L, D, generator=torch.Generator().manual_seed(seed))


def random_images(batch: int = 2, size: int = SMALL_IMAGE_SIZE, seed: int = 0) -> torch.Tensor:
    """A seeded batch of normal noise images (batch, 3, size, size)."""
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


class Links(HTMLParser):
    """The ``src`` and ``href`` links of an HTML page (as written, URL-quoted) and its text."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.links += [value for name, value in attrs if name in ("src", "href") and value]

    def handle_data(self, data: str) -> None:
        self.text.append(data)
