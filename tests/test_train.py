"""train.py + conf/: composition, validation, fast dev runs, learning, resume and DDP."""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
import yaml
from hydra.utils import instantiate
from omegaconf import OmegaConf

from captioner.errors import stop_reason
from captioner.training.logs import finish_wandb
from captioner.training.validate import validate_config
from conftest import (
    CONF,
    TINY,
    compose_cfg,
    compose_plain,
    error_line,
    net_v1,
    run_train,
    subprocess_env,
    tiny_overrides,
)

EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_validates_and_instantiates(experiment: str, tmp_path: Path) -> None:
    # The ImageNet weight file cannot be downloaded here; the offline message is tested in test_encoder.
    cfg = compose_cfg([f"experiment={experiment}", "model.encoder.weights=null"], tmp_path)
    settings = validate_config(OmegaConf.to_container(cfg, resolve=True))
    from captioner.data.vocab import Vocabulary
    from captioner.training.datamodule import CaptionDataModule
    from captioner.training.module import CaptionerModule

    datamodule = CaptionDataModule(instantiate(cfg.data.source), settings.data)
    assert datamodule.settings.batch_size == cfg.data.batch_size
    vocab = Vocabulary([f"w{i}" for i in range(20)])
    module = CaptionerModule(vocab, settings.model)
    assert module.net.attention == cfg.model.attention
    if cfg.trainer.accelerator == "cpu":
        assert instantiate(cfg.trainer).max_epochs == cfg.trainer.max_epochs


@pytest.mark.parametrize(
    "group,options",
    [
        ("data", ["shapes"]),  # the others with their experiments: test_config's bare-dataset test
        ("model", ["soft", "hard"]),
        ("trainer", ["cpu", "gpu", "ddp", "ddp_cpu", "multi_node"]),
        ("logger", ["csv", "tensorboard", "wandb", "mlflow", "none"]),
    ],
)
def test_every_group_option_composes_and_validates(group: str, options: list[str], tmp_path: Path) -> None:
    for option in options:
        validate_config(compose_plain([f"{group}={option}"], tmp_path))


# ``python -c SCRIPT OUT ARGS...``: train.py with ARGS; at exit, whether torch was imported is written to OUT.
TORCH_IMPORTED = f"""import atexit, runpy, sys
out = sys.argv.pop(1)
atexit.register(lambda: open(out, "w").write(str("torch" in sys.modules)))
sys.argv[0] = {str(CONF.parent / "train.py")!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""

TINY_STEPS = TINY.n_train // 16  # training steps of one epoch with tiny_overrides (data.batch_size=16)


@pytest.mark.parametrize("sweep", [False, True])
def test_a_wrong_value_stops_before_the_run_folder_the_config_tree_and_torch(sweep: bool, tmp_path: Path) -> None:
    flag = tmp_path / "torch_imported"
    logs = tmp_path / "outputs"  # paths.log_dir by default, for a run started in tmp_path
    for override, message in [
        ("model.decoder.dropout=2", "model.decoder.dropout=2.0 must be in [0.0, 0.99]"),
        ("data.batch_size=${missing}", "data.batch_size: Interpolation key 'missing' not found"),
    ]:
        command = [sys.executable, "-c", TORCH_IMPORTED, str(flag), *["-m"] * sweep, override]
        proc = subprocess.run(command, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=120)
        assert error_line(proc) == f"error: {message}"
        assert flag.read_text() == "False"
        assert "config (saved as" not in proc.stdout  # no config tree
        assert sweep or not logs.exists()  # no run folder, no FAILED litter (a sweep's folder is made first)


def test_a_missing_file_is_one_line_before_any_run_folder(tmp_path: Path) -> None:
    missing = tmp_path / "missing.ckpt"
    proc = run_train([f"ckpt_path={missing}", f"paths.log_dir={tmp_path}"], check=False, timeout=120)
    assert error_line(proc) == (
        f"error: ckpt_path='{missing}' does not exist; give a run folder, a .ckpt or a bundle (docs/datasets.md#train)"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # preflight: no run folder, no FAILED litter


def test_a_run_that_fails_after_it_started_marks_its_folder_failed(tmp_path: Path) -> None:
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(b"\x80\x04K\x01.")  # a pickle, not a checkpoint
    proc = run_train([f"ckpt_path={junk}", f"paths.log_dir={tmp_path}"], check=False, timeout=120)
    message = f"checkpoint {junk} is truncated or corrupt"
    assert error_line(proc).startswith(f"error: {message}")
    (run,) = (tmp_path / "train" / "runs").iterdir()  # the failed run's folder says why it failed
    assert (run / "FAILED").read_text().startswith(message)
    assert f"[ERROR] - run failed: {message}" in (run / "train.log").read_text()
    assert yaml.safe_load((run / "config.yaml").read_text())["ckpt_path"] == str(junk)


def test_resuming_from_an_inference_bundle_is_one_line(tmp_path: Path) -> None:
    from captioner.bundle import save_bundle
    from captioner.data.vocab import Vocabulary
    from captioner.model.captioner import build_captioner

    vocab = Vocabulary(["a", "circle"])
    config = {"encoder": {"name": "resnet18"}, "decoder": {"embed_dim": 8, "hidden_dim": 8, "attention_dim": 8}}
    net = net_v1(config)
    model = build_captioner(net, len(vocab))
    save_bundle(tmp_path / "bundle.pt", model, vocab, net, {"image_size": 64})
    proc = run_train([f"ckpt_path={tmp_path / 'bundle.pt'}", f"paths.log_dir={tmp_path}"], check=False, timeout=120)
    assert error_line(proc) == (
        f"error: ckpt_path='{tmp_path / 'bundle.pt'}' is an inference bundle (weights for captioning, no "
        "optimiser or training state); to resume a run give its folder or its checkpoints/last.ckpt, to start a "
        "new run from its weights give init_from"
    )


def test_a_crash_or_interrupt_is_one_line_stop_reason() -> None:
    assert (
        stop_reason(RuntimeError("CUDA out of memory. Tried to allocate\nmore"))
        == "RuntimeError: CUDA out of memory. Tried to allocate"
    )
    assert stop_reason(KeyboardInterrupt()) == "interrupted (KeyboardInterrupt)"
    assert stop_reason(SystemExit(1)) == "stopped with exit status 1"
    assert stop_reason(SystemExit(0)) is None


def test_finish_wandb_closes_an_open_run_only(monkeypatch) -> None:
    finished = []
    fake = types.SimpleNamespace(run=None, finish=lambda exit_code: finished.append(exit_code))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    finish_wandb(failed=False)
    fake.run = object()
    finish_wandb(failed=True)
    assert finished == [1]


def _short_run(tiny_shapes: Path, tmp_path: Path, logger: list[str]) -> list[str]:
    """A training run of two steps and one validation, with ``logger`` instead of the CSV logger."""
    base = [o for o in tiny_overrides(tiny_shapes, tmp_path) if o != "logger=csv"]
    return [
        *base,
        *logger,
        "trainer.max_epochs=1",
        "+trainer.limit_train_batches=2",
        "trainer.log_every_n_steps=1",
        "test=false",
    ]


@pytest.mark.slow
def test_wandb_logger_offline(tiny_shapes: Path, tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    import train

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    cfg = compose_cfg(_short_run(tiny_shapes, tmp_path, ["logger=wandb", "logger.wandb.offline=true"]), tmp_path)
    try:
        train.train(cfg)
    finally:
        finish_wandb(failed=False)
    (run,) = (Path(cfg.paths.output_dir) / "wandb").glob("offline-run-*")
    (log_file,) = run.glob("run-*.wandb")
    history = log_file.read_bytes()
    assert b"val/bleu4" in history and b"train/loss" in history  # what Lightning logged, kept offline


@pytest.mark.slow
def test_mlflow_logger_to_a_local_folder(tiny_shapes: Path, tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    import train

    cfg = compose_cfg(_short_run(tiny_shapes, tmp_path, ["logger=mlflow"]), tmp_path)
    train.train(cfg)
    client = MlflowClient(cfg.logger.mlflow.tracking_uri)
    assert cfg.logger.mlflow.tracking_uri == f"sqlite:///{tmp_path}/mlflow/mlflow.db"
    (run,) = client.search_runs([client.get_experiment_by_name("train").experiment_id])
    metrics = json.loads((Path(cfg.paths.output_dir) / "metrics.json").read_text())
    assert run.data.metrics["val/bleu4"] == pytest.approx(metrics["val/bleu4"])
    assert run.data.tags["run_folder"] == cfg.paths.output_dir
    assert run.info.status == "FINISHED"


@pytest.mark.parametrize(
    "extra",
    [
        ["model=soft"],
        ["model=hard"],
        [
            "model=soft",
            "model.self_attention.blocks=1",
            "model.self_attention.heads=2",
            "model.self_attention.positional=relative",
            "model.scorer=multihead",
            "model.decoder.attention_heads=2",
        ],
    ],
)
def test_fast_dev_run(extra: list[str], tiny_shapes: Path, tmp_path: Path, capsys) -> None:
    import train

    cfg = compose_cfg([*tiny_overrides(tiny_shapes, tmp_path), "debug=fast", *extra], tmp_path)
    train.train(cfg)
    hard = "; hard attention reading the most likely location (argmax)"  # what the final scores were decoded with
    assert (hard in capsys.readouterr().out) == (extra == ["model=hard"])
    out = Path(cfg.paths.output_dir)
    assert (out / "bundle.pt").is_file()
    assert yaml.safe_load((out / "config.yaml").read_text()) == OmegaConf.to_container(cfg, resolve=True)
    metrics = json.loads((out / "metrics.json").read_text())
    assert 0.0 <= metrics["val/bleu1"] <= 1.0


@pytest.mark.slow
def test_training_improves_bleu_far_above_an_untrained_model(tiny_shapes: Path, tmp_path: Path) -> None:
    base = tiny_overrides(tiny_shapes, tmp_path, cache=tmp_path / "cache")
    run_train([*base, "train=false", "test=false", "hydra.run.dir=" + str(tmp_path / "untrained")])
    trained = run_train(
        [
            *base,
            "model.objective=cross_entropy",  # the demo's SCST epochs: tests/test_scst.py (12 here would be slow)
            "trainer.max_epochs=12",
            "test=false",
            "callbacks.early_stopping=null",
            "trainer.enable_progress_bar=true",
        ]
    )
    before = json.loads((tmp_path / "untrained" / "metrics.json").read_text())
    after = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert before["val/bleu4"] < 0.05
    assert after["val/bleu4"] > 0.3, trained.stdout[-2000:]
    assert after["val/bleu1"] > before["val/bleu1"] + 0.3
    assert "inference bundle:" in trained.stdout and "BLEU-4" in trained.stdout
    assert after["val/attention_correctness"] > 0.0
    assert re.search(r"val/bleu4(=|: )0\.\d{3}\b", trained.stdout)  # in the progress bar (tqdm's or rich's)
    output = trained.stdout + trained.stderr
    assert "GPU available" in output  # Lightning's own messages stay, its advertisement and torch's
    assert "litlogger" not in output and "LeafSpec" not in output  # deprecation of Lightning's code go


@pytest.mark.slow
def test_resume_continues_epoch_step_optimiser_and_schedule(tiny_shapes: Path, tmp_path: Path) -> None:
    base = tiny_overrides(tiny_shapes, tmp_path, cache=tmp_path / "cache")
    run_train(
        [
            *base,
            "trainer.max_epochs=2",
            "test=false",
            "callbacks.early_stopping=null",
            f"hydra.run.dir={tmp_path / 'first'}",
        ]
    )
    first = torch.load(tmp_path / "first" / "checkpoints" / "last.ckpt", weights_only=True)
    run_train(
        [
            *base,
            "trainer.max_epochs=3",
            "test=false",
            "callbacks.early_stopping=null",
            f"ckpt_path={tmp_path / 'first'}",
            f"hydra.run.dir={tmp_path / 'second'}",
        ]
    )
    second = torch.load(tmp_path / "second" / "checkpoints" / "last.ckpt", weights_only=True)
    steps_per_epoch = first["global_step"] // 2
    assert first["epoch"] == 1 and second["epoch"] == 2
    assert second["global_step"] == first["global_step"] + steps_per_epoch
    first_sched = first["lr_schedulers"][0]
    second_sched = second["lr_schedulers"][0]
    assert second_sched["last_epoch"] == first_sched["last_epoch"] + steps_per_epoch
    first_adam = first["optimizer_states"][0]["state"][0]["step"]
    second_adam = second["optimizer_states"][0]["state"][0]["step"]
    assert float(second_adam) == float(first_adam) + steps_per_epoch
    assert (tmp_path / "first" / "checkpoints" / "last.ckpt").is_file()  # the earlier run is untouched


@pytest.mark.slow
def test_ddp_with_two_cpu_processes_gives_the_single_process_bleu(tiny_shapes: Path, tmp_path: Path) -> None:
    base = tiny_overrides(tiny_shapes, tmp_path)
    run_train(
        [*base, "trainer.max_epochs=2", "test=false", "data.feature_cache=null", f"hydra.run.dir={tmp_path / 'fit'}"]
    )
    ckpt = tmp_path / "fit" / "checkpoints" / "last.ckpt"
    # 24 validation images over 2 ranks with an eval batch of 5: uneven shards, padded by the sampler.
    common = [*base, "train=false", "test=false", f"ckpt_path={ckpt}", "data.eval_batch_size=5"]
    run_train([*common, "trainer=cpu", f"hydra.run.dir={tmp_path / 'single'}"])
    run_train([*common, "trainer=ddp_cpu", "trainer.devices=2", f"hydra.run.dir={tmp_path / 'ddp'}"])
    single = json.loads((tmp_path / "single" / "metrics.json").read_text())
    ddp = json.loads((tmp_path / "ddp" / "metrics.json").read_text())
    for n in range(1, 5):
        assert ddp[f"val/bleu{n}"] == pytest.approx(single[f"val/bleu{n}"], abs=1e-9)
    assert single["val/bleu1"] > 0.0
    single_caps = json.loads((tmp_path / "single" / "val_captions.json").read_text())
    ddp_caps = json.loads((tmp_path / "ddp" / "val_captions.json").read_text())
    assert len(ddp_caps) == 24 and ddp_caps == single_caps


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_run_stopped_by_a_signal_exits_non_zero_and_says_how_to_resume(
    signum: signal.Signals, tiny_shapes: Path, tmp_path: Path
) -> None:
    common = [
        *tiny_overrides(tiny_shapes, tmp_path),
        "trainer.max_epochs=1",
        "test=false",
        "callbacks.last_checkpoint.every_n_train_steps=2",
    ]
    first, second = tmp_path / "first", tmp_path / "second"
    last = first / "checkpoints" / "last.ckpt"
    command = [sys.executable, str(CONF.parent / "train.py"), *common, f"hydra.run.dir={first}"]
    proc = subprocess.Popen(
        command, cwd=CONF.parent, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 300
    while not last.exists():  # decoding images (no feature cache) keeps each step well over 20 ms
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.02)
    proc.send_signal(signum)
    stderr = proc.communicate(timeout=300)[1]
    assert proc.returncode == 128 + signum  # a scheduler tells it from a finished run (0) and a user error (2)
    (line,) = stderr.splitlines()
    match = re.fullmatch(
        rf"error: training stopped by {signum.name} at epoch 0, step (\d+); its last checkpoint is "
        rf"{re.escape(str(first))}/checkpoints/last\.ckpt: resume it with (python train\.py .*)",
        line,
    )
    assert match and 0 < int(match[1]) < TINY_STEPS, line
    assert (first / "FAILED").read_text() == line.removeprefix("error: ") + "\n"
    assert not (first / "bundle.pt").exists()
    resume = shlex.split(match[2])[2:]  # the run's own overrides (Hydra's own left out) and ckpt_path=<its folder>
    assert resume == [*(o for o in common if not o.startswith("hydra.")), f"ckpt_path={first}"]
    if signum == signal.SIGINT:
        return  # resuming is the same for both signals
    resumed = run_train([*resume, f"hydra.run.dir={second}"])
    assert f"Restored all states from the checkpoint at {last}" in resumed.stdout
    assert torch.load(second / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == TINY_STEPS
