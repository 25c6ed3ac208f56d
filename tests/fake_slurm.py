"""SLURM's sbatch, srun and sacct on one machine, as far as submitit uses them: ``python fake_slurm.py COMMAND ARGS``.

sbatch keeps a copy of the script in ``$FAKE_SLURM_LOG`` and starts it in the background (each task of an array)
with the variables SLURM sets from its ``#SBATCH`` lines, then prints the job id; srun starts
``$SLURM_NTASKS_PER_NODE`` tasks of its command, each with its rank's variables and its ``--output``/``--error``
files; sacct says RUNNING until a job's script has ended, then COMPLETED. One node only.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

LOG = Path(os.environ.get("FAKE_SLURM_LOG", "."))  # the scripts sbatch was given, and each job's state


def sbatch(script: str) -> None:
    """Start the job script ``script`` (each task of an array) in the background; print its job id."""
    kept = shutil.copy(script, LOG / f"sbatch_{len(list(LOG.glob('sbatch_*')))}.sh")  # submitit moves its own
    flags = dict(re.findall(r"^#SBATCH --([\w-]+)=(.*)$", Path(kept).read_text(), re.M))
    job = str(15000 + os.getpid() % 9000)  # Lightning's port is 15000 + its last four digits
    array = re.match(r"(\d+)-(\d+)", flags["array"]) if "array" in flags else None
    for task in range(int(array[1]), int(array[2]) + 1) if array else [None]:
        env = {
            "SLURM_JOB_ID": job if task is None else f"{job}{task}",
            "SLURM_JOB_NAME": flags["job-name"],
            "SLURM_NNODES": flags["nodes"],
            "SLURM_JOB_NUM_NODES": flags["nodes"],
            "SLURM_NODELIST": "localhost",
            "SLURM_JOB_NODELIST": "localhost",
            "SLURM_NTASKS_PER_NODE": flags["ntasks-per-node"],
        }
        if task is not None:
            env |= {"SLURM_ARRAY_JOB_ID": job, "SLURM_ARRAY_TASK_ID": str(task)}
        state = LOG / (f"{job}.state" if task is None else f"{job}_{task}.state")
        state.write_text("RUNNING")
        with open(state.with_suffix(".log"), "w") as out:  # not sbatch's stdout, which submitit reads to its end
            run = f"bash {kept}; echo COMPLETED > {state}"
            subprocess.Popen(["bash", "-c", run], env={**os.environ, **env}, stdout=out, stderr=out)
    print(f"Submitted batch job {job}")


def srun(args: list[str]) -> int:
    """Run the command in ``args`` (after srun's options) once per task; the largest exit status."""
    files = {}
    while args[0].startswith("--"):
        flag = args.pop(0)
        if flag != "--unbuffered":
            files[flag] = args.pop(0)
    tasks = int(os.environ["SLURM_NTASKS_PER_NODE"])
    array_task = os.environ.get("SLURM_ARRAY_TASK_ID", "")
    job = os.environ.get("SLURM_ARRAY_JOB_ID", os.environ["SLURM_JOB_ID"])
    procs = []
    for rank in range(tasks):
        fields = {"%A": job, "%a": array_task, "%t": str(rank), "%j": os.environ["SLURM_JOB_ID"]}
        paths = {flag: Path(_fill(name, fields)) for flag, name in files.items()}
        for path in paths.values():
            path.parent.mkdir(parents=True, exist_ok=True)
        ranks = {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_NTASKS": str(tasks)}
        with open(paths["--output"], "a") as out, open(paths["--error"], "a") as err:
            procs.append(subprocess.Popen(args, env={**os.environ, **ranks}, stdout=out, stderr=err))
    return max(proc.wait() for proc in procs)


def _fill(pattern: str, fields: dict[str, str]) -> str:
    """``pattern`` with each of SLURM's ``%`` fields (``%j``, ``%A``, ...) replaced by its value in ``fields``."""
    for field, value in fields.items():
        pattern = pattern.replace(field, value)
    return pattern


def sacct(args: list[str]) -> None:
    """The state of every job (or array task) of the ids after ``-j``, as ``sacct --parsable2`` prints it."""
    print("JobID|State|NodeList")
    for job in args[args.index("-j") + 1 :: 2]:
        for state in sorted(LOG.glob(f"{job}*.state")):
            print(f"{state.stem}|{state.read_text().strip()}|localhost")


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "sbatch":
        sbatch(rest[-1])
    elif command == "srun":
        sys.exit(srun(rest))
    else:
        sacct(rest)
