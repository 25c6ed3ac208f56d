"""train.py end to end on the tiny dataset: the wandb and MLflow loggers, fast dev runs of each model, learning,
resuming a run, and DDP on two CPU processes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from captioner.bundle import load_trained
from captioner.config import DecodingConfig, from_dict
from captioner.training.logs import finish_wandb
from conftest import RUN_NET, TrainedRun, compose_cfg, run_train, snapshot, tiny_overrides, write_run


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
    assert run.data.metrics["final/val/bleu4"] == pytest.approx(metrics["final/val/bleu4"])
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
    decoding = from_dict(DecodingConfig, OmegaConf.to_container(cfg.model.decoding, resolve=True))
    assert load_trained(out / "bundle.pt").decoding == decoding.for_captioning()  # as its final scores decoded
    assert yaml.safe_load((out / "config.yaml").read_text()) == OmegaConf.to_container(cfg, resolve=True)
    metrics = json.loads((out / "metrics.json").read_text())
    assert 0.0 <= metrics["final/val/bleu1"] <= 1.0


@pytest.mark.slow
def test_training_improves_bleu_far_above_an_untrained_model(
    trained_run: TrainedRun, tiny_shapes: Path, tmp_path: Path
) -> None:
    base = tiny_overrides(tiny_shapes, tmp_path, cache=trained_run.cache)
    run_train([*base, "train=false", "test=false", "hydra.run.dir=" + str(tmp_path / "untrained")])
    before = json.loads((tmp_path / "untrained" / "metrics.json").read_text())
    after = json.loads((trained_run.folder / "metrics.json").read_text())
    assert before["final/val/bleu4"] < 0.05
    assert after["final/val/bleu4"] > 0.3, trained_run.stdout[-2000:]
    assert after["final/val/bleu1"] > before["final/val/bleu1"] + 0.3
    assert "inference bundle:" in trained_run.stdout and "BLEU-4" in trained_run.stdout
    assert after["final/val/attention_correctness"] > 0.0
    assert re.search(r"val/bleu4(=|: )0\.\d{3}\b", trained_run.stdout)  # in the progress bar (tqdm's or rich's)
    output = trained_run.stdout + trained_run.stderr
    assert "GPU available" in output  # Lightning's own messages stay, its advertisement and torch's
    assert "litlogger" not in output and "LeafSpec" not in output  # deprecation of Lightning's code go


@pytest.mark.slow
def test_resume_continues_epoch_step_optimiser_and_schedule(tiny_shapes: Path, tmp_path: Path) -> None:
    # epochs of 5 of the 15 batches: what it takes to see a run pick up where another stopped
    base = [*tiny_overrides(tiny_shapes, tmp_path, cache=tmp_path / "cache"), "+trainer.limit_train_batches=5"]
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
    # the first run's best scored higher than any later epoch can (BLEU-4 2.0): the resumed run must keep it
    (key,) = [key for key in first["callbacks"] if key.startswith("BestCheckpoint")]
    (best,) = first["callbacks"][key]["best_k_models"]
    first["callbacks"][key].update(best_model_score=torch.tensor(2.0), best_k_models={best: torch.tensor(2.0)})
    torch.save(first, tmp_path / "first" / "checkpoints" / "last.ckpt")
    before = snapshot(tmp_path / "first")
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
    assert snapshot(tmp_path / "first") == before  # the earlier run is untouched
    kept = tmp_path / "second" / "checkpoints" / Path(best).name  # its best, linked into the new folder
    assert sorted(path.name for path in kept.parent.iterdir()) == sorted([kept.name, "last.ckpt"])
    assert kept.read_bytes() == Path(best).read_bytes()
    state = second["callbacks"][key]
    assert state["best_model_path"] == str(kept) and float(state["best_model_score"]) == 2.0


@pytest.mark.slow
def test_ddp_with_two_cpu_processes_gives_the_single_process_bleu(
    trained_run: TrainedRun, tiny_shapes: Path, tmp_path: Path
) -> None:
    base = tiny_overrides(tiny_shapes, tmp_path)
    ckpt = trained_run.folder / "checkpoints" / "last.ckpt"
    # 24 validation images over 2 ranks with an eval batch of 5: uneven shards, padded by the sampler.
    common = [*base, "train=false", "test=false", f"ckpt_path={ckpt}", "data.eval_batch_size=5"]
    run_train([*common, "trainer=cpu", f"hydra.run.dir={tmp_path / 'single'}"])
    run_train([*common, "trainer=ddp_cpu", "trainer.devices=2", f"hydra.run.dir={tmp_path / 'ddp'}"])
    single = json.loads((tmp_path / "single" / "metrics.json").read_text())
    ddp = json.loads((tmp_path / "ddp" / "metrics.json").read_text())
    for n in range(1, 5):
        assert ddp[f"final/val/bleu{n}"] == pytest.approx(single[f"final/val/bleu{n}"], abs=1e-9)
    assert single["final/val/bleu1"] > 0.0
    single_caps = json.loads((tmp_path / "single" / "val_captions.json").read_text())
    ddp_caps = json.loads((tmp_path / "ddp" / "val_captions.json").read_text())
    assert len(ddp_caps) == 24 and ddp_caps == single_caps


@pytest.mark.slow
def test_a_run_from_a_checkpoint_reads_and_downloads_no_imagenet_weights(
    tiny_shapes: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model trained from ImageNet weights starts a new run (init_from) on a machine without their file and
    without a network, the download left on: the checkpoint's weights replace them all, so nothing is fetched."""
    torch_home = tmp_path / "torch"
    monkeypatch.setenv("TORCH_HOME", str(torch_home))  # empty: the file is not there, and nothing can download it
    net = {**RUN_NET, "encoder": {**RUN_NET["encoder"], "weights": "IMAGENET1K_V1"}}
    run = write_run(tmp_path / "pretrained", "cross_entropy", net=net)
    args = [*tiny_overrides(tiny_shapes, tmp_path / "out"), f"init_from={run}", "trainer.max_epochs=1", "test=false"]
    proc = run_train([*args, "model.objective=cross_entropy", "+trainer.limit_train_batches=2"], check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    config = yaml.safe_load((tmp_path / "out" / "run" / "config.yaml").read_text())
    assert config["model"]["encoder"]["weights"] == "IMAGENET1K_V1"  # the checkpoint's model, its settings kept
    assert load_trained(str(tmp_path / "out" / "run" / "bundle.pt")).config.encoder.weights == "IMAGENET1K_V1"
    assert not torch_home.exists()  # nothing downloaded, not even a lock file
