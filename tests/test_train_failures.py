"""How train.py fails or stops: one ``error:`` line on stderr, before the run folder (and torch) where it can be,
a FAILED mark in the folder after the run started, and after a signal an exit status and the command that resumes it."""

from __future__ import annotations

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

from captioner.errors import stop_reason
from captioner.training.logs import finish_wandb
from conftest import CONF, TINY, error_line, run_train, run_train_here, subprocess_env, tiny_overrides, write_bundle

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


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.min_epochs=abc", "trainer.min_epochs='abc' must be an int"),
        ("+callbacks.extra.monitor=val/loss", "callbacks.extra has no _target_ (the class to build)"),
    ],
)
def test_a_value_a_check_did_not_expect_is_one_line_before_any_run_folder(
    override: str, message: str, tmp_path: Path
) -> None:
    proc = run_train([override, f"paths.log_dir={tmp_path}"], check=False, timeout=120)
    assert error_line(proc) == f"error: {message}"
    assert sorted(tmp_path.iterdir()) == []  # no run folder, no FAILED litter


def test_paths_output_dir_is_refused_so_an_earlier_run_s_folder_is_never_written_into(tmp_path: Path) -> None:
    # It bypassed NewRunFolder: a run given an earlier run's folder rewrote its bundle, checkpoints and config.
    earlier = tmp_path / "run"
    earlier.mkdir()
    (earlier / "bundle.pt").write_bytes(b"the earlier run's")
    proc = run_train([f"paths.output_dir={earlier}", f"paths.log_dir={tmp_path / 'logs'}"], check=False, timeout=120)
    assert error_line(proc) == (
        f"error: paths.output_dir={str(earlier)!r}: it is the run's own folder, made new for each run (an earlier "
        "run's is never written into); choose where it goes with hydra.run.dir=DIR"
    )
    assert sorted(tmp_path.iterdir()) == [earlier] and sorted(earlier.iterdir()) == [earlier / "bundle.pt"]
    assert (earlier / "bundle.pt").read_bytes() == b"the earlier run's"


def test_a_check_that_fails_unexpectedly_refuses_the_run_with_one_line(monkeypatch) -> None:
    from omegaconf import OmegaConf

    from captioner.training import validate

    def broken(plain: dict) -> None:
        raise KeyError("somewhere")

    monkeypatch.setattr(validate, "validate_config", broken)
    monkeypatch.setattr(validate, "_job_config", lambda config: {})
    with pytest.raises(validate.ConfigRefused) as refused:
        validate._validate_or_exit(OmegaConf.create({}))
    assert refused.value.code == 2
    assert str(refused.value.error) == "the config could not be checked: KeyError: 'somewhere'"


@pytest.mark.parametrize(
    "start, message",
    [
        (
            "ckpt_path={t}/missing.ckpt",
            "ckpt_path='{t}/missing.ckpt' does not exist; give a run folder or a .ckpt that train.py wrote "
            "(docs/datasets.md#train)",
        ),
        (
            "ckpt_path={t}/run",  # a run stopped before its first checkpoint
            "ckpt_path='{t}/run' is a folder without checkpoints/last.ckpt, the checkpoint a run resumes from (a run "
            "saves it as it trains); give the folder of a run that saved one, or one of its .ckpt files "
            "(docs/datasets.md#train)",
        ),
        (
            "ckpt_path={t}/bundle.pt",
            "ckpt_path='{t}/bundle.pt' is an inference bundle (weights for captioning, no optimiser or training "
            "state), which no run resumes; to resume a run give its folder or its checkpoints/last.ckpt; to start a "
            "new run from this bundle's weights give init_from={t}/bundle.pt instead (docs/datasets.md#train)",
        ),
        (
            "+trainer.limit_train_batch=2",
            "trainer.limit_train_batch is not an argument of lightning.pytorch.trainer.Trainer; did you mean "
            "trainer.limit_train_batches?",
        ),
    ],
    ids=["missing", "no-checkpoint", "bundle", "misspelt-trainer-key"],
)
def test_a_mistyped_command_is_one_line_before_the_config_tree_and_any_run_folder(
    start: str, message: str, tmp_path: Path
) -> None:
    (tmp_path / "run").mkdir()
    write_bundle(tmp_path / "bundle.pt", ["a", "circle"])
    logs = tmp_path / "logs"
    proc = run_train([start.format(t=tmp_path), f"paths.log_dir={logs}"], check=False, timeout=300)
    assert error_line(proc) == f"error: {message.format(t=tmp_path)}"
    assert "config (saved as" not in proc.stdout  # no config tree
    assert not logs.exists()  # no run folder, no FAILED litter


def test_a_run_that_fails_after_it_started_marks_its_folder_failed(tmp_path: Path) -> None:
    proc = run_train(["+trainer.max_time=soon", f"paths.log_dir={tmp_path}"], check=False, timeout=300)
    message = "trainer: `Timer(duration='soon')` is not a valid duration"  # Lightning refuses it as it builds one
    assert error_line(proc).startswith(f"error: {message}")
    (run,) = (tmp_path / "train" / "runs").iterdir()  # the failed run's folder says why it failed
    assert (run / "FAILED").read_text().startswith(message)
    assert f"[ERROR] - run failed: {message}" in (run / "train.log").read_text()
    assert yaml.safe_load((run / "config.yaml").read_text())["trainer"]["max_time"] == "soon"
    assert not (run / "STOPPED").exists()


def test_a_crash_is_one_line_stop_reason() -> None:
    assert (
        stop_reason(RuntimeError("CUDA out of memory. Tried to allocate\nmore"))
        == "RuntimeError: CUDA out of memory. Tried to allocate"
    )
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
    assert (first / "STOPPED").read_text() == line.removeprefix("error: ") + "\n"  # stopped, not failed
    assert not (first / "FAILED").exists()
    assert not (first / "bundle.pt").exists()
    resume = shlex.split(match[2])[2:]  # the run's own overrides (Hydra's own left out) and ckpt_path=<its folder>
    assert resume == [*(o for o in common if not o.startswith("hydra.")), f"ckpt_path={first}"]
    if signum == signal.SIGINT:
        return  # resuming is the same for both signals
    resumed = run_train([*resume, f"hydra.run.dir={second}"])
    assert f"Restored all states from the checkpoint at {last}" in resumed.stdout
    assert torch.load(second / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == TINY_STEPS


@pytest.mark.slow
def test_a_run_interrupted_by_ctrl_c_is_marked_stopped_and_resumes(
    tiny_shapes: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    from captioner.training.module import CaptionerModule
    from captioner.training.start import plan_start

    step = CaptionerModule.training_step

    def interrupted(self: CaptionerModule, batch: dict, batch_idx: int) -> object:
        if self.global_step == 2:  # Ctrl-C as the third step starts: Lightning handles it (trainer.interrupted)
            raise KeyboardInterrupt
        return step(self, batch, batch_idx)

    monkeypatch.setattr(CaptionerModule, "training_step", interrupted)
    run = tmp_path / "run"
    args = [*tiny_overrides(tiny_shapes, tmp_path), "test=false", "callbacks.last_checkpoint.every_n_train_steps=1"]
    assert run_train_here(args, monkeypatch) == 128 + signal.SIGINT
    (line,) = capfd.readouterr().err.splitlines()
    last = run / "checkpoints" / "last.ckpt"
    resume = shlex.join(["python", "train.py", *(a for a in args if not a.startswith("hydra.")), f"ckpt_path={run}"])
    assert line == (
        f"error: training stopped by SIGINT at epoch 0, step 2; its last checkpoint is {last}: resume it with {resume}"
    )
    assert (run / "STOPPED").read_text() == line.removeprefix("error: ") + "\n"
    assert not (run / "FAILED").exists() and not (run / "bundle.pt").exists()
    assert f"[ERROR] - run stopped: {line.removeprefix('error: ')}" in (run / "train.log").read_text()
    assert torch.load(last, weights_only=True)["global_step"] == 2
    model = yaml.safe_load((run / "config.yaml").read_text())["model"]  # the run's, which the command repeats
    assert plan_start(str(run), None, model["objective"], model["scst"]["after_epochs"]).resume == str(last)


def test_ctrl_c_outside_the_trainer_s_loops_marks_the_run_stopped(
    tiny_shapes: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    from captioner.training.datamodule import CaptionDataModule

    def interrupted(self: CaptionDataModule, stage: str) -> None:
        raise KeyboardInterrupt  # while the data is read, before Lightning runs

    monkeypatch.setattr(CaptionDataModule, "setup", interrupted)
    run = tmp_path / "run"
    assert run_train_here(tiny_overrides(tiny_shapes, tmp_path), monkeypatch) == 128 + signal.SIGINT
    message = "run stopped by SIGINT, before its first checkpoint: nothing to resume, run it again"
    assert capfd.readouterr().err.splitlines() == [f"error: {message}"]  # no traceback
    assert (run / "STOPPED").read_text() == message + "\n"
    assert not (run / "FAILED").exists()
