"""Sweeps through Hydra's submitit launcher: ``hydra/launcher=local`` runs each job in processes of its own and
leaves the same run folders a single run does; a job that fails is marked and the sweep ends with its error;
``hydra/launcher=slurm`` asks SLURM for what the trainer will use; the tasks either launcher starts are the
trainer's DDP ranks (on this machine, SLURM's commands are ``fake_slurm.py``'s)."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate

from captioner.bundle import load_trained
from captioner.run_files import (
    BUNDLE_NAME,
    CHECKPOINT_DIR,
    CONFIG_FILE,
    CURVES_FILE,
    FAILED_FILE,
    LAST_CHECKPOINT,
    METRICS_FILE,
    SAMPLES_DIR,
    VAL_CAPTIONS_FILE,
)
from captioner.training.schemas import register_schemas
from conftest import CONF, run_train, tiny_overrides

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")

# What a finished run leaves in its folder (besides its checkpoints and the CSV log).
RUN_FILES = {".hydra", BUNDLE_NAME, CONFIG_FILE, CURVES_FILE, METRICS_FILE, SAMPLES_DIR, VAL_CAPTIONS_FILE, "train.log"}
# After tiny_overrides: two training steps, then a validation of four images (in each process), no test.
SHORT = [
    "trainer.max_epochs=1",
    "+trainer.limit_train_batches=2",
    "+trainer.limit_val_batches=1",
    "data.eval_batch_size=4",
    "test=false",
]


def _sweep(logs: Path) -> Path:
    """The one sweep folder under ``logs`` (``paths.log_dir``)."""
    (sweep,) = (logs / "train" / "multiruns").iterdir()
    return sweep


def _job_logs(sweep: Path) -> list[str]:
    """The stdout of every job the local executor ran (``.submitit/<job id>/``), in no particular order."""
    return [log.read_text() for log in sweep.glob(".submitit/*/*_log.out")]


@pytest.mark.slow
def test_a_local_sweep_runs_each_job_in_a_process_of_its_own_into_a_complete_run_folder(
    tiny_shapes: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the two jobs run at once on the tests' two cores
    proc = run_train(["-m", "hydra/launcher=local", "model=soft,hard", *tiny_overrides(tiny_shapes, tmp_path), *SHORT])
    assert proc.stderr == ""
    sweep = _sweep(tmp_path)  # tiny_overrides' paths.log_dir
    assert sorted(p.name for p in sweep.iterdir()) == [".submitit", "0", "1", "multirun.yaml"]
    logs = _job_logs(sweep)
    assert len(logs) == 2  # two submitit jobs, each its own process with its own log
    for job, mode in (("0", "soft"), ("1", "hard")):
        run = sweep / job
        assert {p.name for p in run.iterdir()} >= RUN_FILES and not (run / FAILED_FILE).exists()
        assert (run / CHECKPOINT_DIR / LAST_CHECKPOINT).is_file()
        assert yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text())[0] == f"model={mode}"
        assert yaml.safe_load((run / CONFIG_FILE).read_text())["model"]["attention"] == mode
        assert "final/val/bleu4" in json.loads((run / METRICS_FILE).read_text())
        assert load_trained(run).config.attention.value == mode  # the bundle of the job's own model
        # the closing summary, in the job's own log
        assert sum(f"inference bundle: {run / BUNDLE_NAME}\n" in log for log in logs) == 1


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["basic", "local"])  # in the sweep's process, one after another; each its own
def test_failed_jobs_of_a_sweep_are_marked_and_the_sweep_ends_with_their_errors(launcher: str, tmp_path: Path) -> None:
    # max_time=soon: a value Lightning refuses as it builds the trainer, so job 0 fails once it has started
    args = ["-m", f"hydra/launcher={launcher}", "model.decoder.dropout=0.5,2", "+trainer.max_time=soon"]
    proc = run_train([*args, f"paths.log_dir={tmp_path / 'logs'}"], check=False, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: trainer: `Timer(duration='soon')` is not a valid")
    assert lines[1] == "error: model.decoder.dropout=2.0 must be in [0.0, 0.99]"  # job 1: refused before it started
    sweep = _sweep(tmp_path / "logs")
    for job, line in zip(("0", "1"), lines):
        assert (sweep / job / FAILED_FILE).read_text() == line.removeprefix("error: ") + "\n"
        assert f"job {job} of the sweep failed: {sweep / job / FAILED_FILE}" in proc.stdout
    assert (sweep / "0" / CONFIG_FILE).is_file() and not (sweep / "1" / CONFIG_FILE).exists()


def _readme_sweep() -> list[str]:
    """The overrides of the README's SLURM sweep, each swept key at its first value."""
    readme = (CONF.parent / "README.md").read_text()
    command = re.search(r"^python train\.py -m (hydra/launcher=slurm .*?)\n```", readme, re.M | re.S)[1]
    return [override.split(",")[0] for override in command.replace("\\\n", " ").split()]


QUEUE = ["hydra/launcher=slurm", "hydra.launcher.partition=gpu", "hydra.launcher.timeout_min=2880"]


@pytest.mark.parametrize(
    "overrides,nodes,gpus",
    [
        ([*QUEUE, "trainer=multi_node"], 2, 8),
        ([*QUEUE, "trainer=multi_node", "trainer.devices=4", "trainer.num_nodes=3"], 3, 4),
        ([*QUEUE, "trainer=gpu"], 1, 1),
        (_readme_sweep(), 2, 8),
    ],
)
def test_the_slurm_launcher_asks_for_the_trainers_nodes_and_one_task_per_gpu(
    overrides: list[str], nodes: int, gpus: int
) -> None:
    register_schemas()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    params = instantiate(cfg.hydra.launcher).params
    assert (params["nodes"], params["gpus_per_node"], params["tasks_per_node"]) == (nodes, gpus, gpus)
    assert (params["partition"], params["timeout_min"]) == ("gpu", 2880)
    assert params["submitit_folder"] == f"{cfg.hydra.sweep.dir}/.submitit/%j"
    assert (cfg.trainer.devices, cfg.trainer.get("num_nodes", 1)) == (gpus, nodes)  # what Lightning will check


def _fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Put fake_slurm.py's sbatch, srun and sacct first on the PATH; the folder where sbatch keeps its scripts."""
    commands, slurm = tmp_path / "bin", tmp_path / "slurm"
    commands.mkdir()
    slurm.mkdir()
    fake = Path(__file__).parent / "fake_slurm.py"
    for command in ("sbatch", "srun", "sacct"):
        (commands / command).write_text(f'#!/bin/sh\nexec {sys.executable} {fake} {command} "$@"\n')
        (commands / command).chmod(0o755)
    monkeypatch.setenv("PATH", f"{commands}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM_LOG", str(slurm))
    return slurm


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["local", "slurm"])
def test_a_sweeps_job_trains_with_the_tasks_its_launcher_started_as_its_ranks(
    launcher: str, tiny_shapes: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # two processes on the tests' two cores
    queue = ["hydra.launcher.partition=debug", "hydra.launcher.timeout_min=30", "hydra.launcher.gpus_per_node=null"]
    args = ["-m", f"hydra/launcher={launcher}", "trainer=ddp_cpu", "trainer.devices=2", "callbacks.samples=null"]
    slurm = _fake_slurm(tmp_path, monkeypatch) if launcher == "slurm" else None
    proc = run_train([*args, *(queue if slurm else []), *tiny_overrides(tiny_shapes, tmp_path), *SHORT])
    assert proc.stderr == ""
    if slurm is not None:
        (script,) = slurm.glob("sbatch_*.sh")  # one job: an sbatch script of its own, no array
        flags = dict(re.findall(r"^#SBATCH --([\w-]+)=(.*)$", script.read_text(), re.M))
        assert {"nodes": "1", "ntasks-per-node": "2", "partition": "debug", "time": "30"}.items() <= flags.items()
        assert "gpus-per-node" not in flags and "array" not in flags
    sweep = _sweep(tmp_path)
    run = sweep / "0"
    assert (run / BUNDLE_NAME).is_file() and (run / CHECKPOINT_DIR / LAST_CHECKPOINT).is_file()
    assert "final/val/bleu4" in json.loads((run / METRICS_FILE).read_text()) and not (run / FAILED_FILE).exists()
    (job,) = (p for p in (sweep / ".submitit").iterdir() if p.name.isdigit())
    logs = [(job / f"{job.name}_{task}_log.out").read_text() for task in (0, 1)]
    for rank, log in enumerate(logs):  # the launcher's two tasks are the two ranks: Lightning started no process
        assert f"Initializing distributed: GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/2" in log
    assert f"inference bundle: {run / BUNDLE_NAME}\n" in logs[0] and "inference bundle" not in logs[1]
