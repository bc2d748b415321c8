"""The parts of ``%distrain start --slurm`` that need no Slurm: the request as typed, the batch
script nbdist writes (GPUs checked here, where no GPU is), Slurm's answers read, ranks in
Slurm's task order, and the export's header. The real Slurm: tests/integration/test_slurm.py."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from IPython.core.error import UsageError

from nbdist.engine.hardware import slurm_task
from nbdist.kernel.engines import rank_engines
from nbdist.kernel.export_torch import slurm_commands
from nbdist.kernel.magic import _joined_sbatch, _subcommand_parser, slurm_request
from nbdist.kernel.runfiles import record_jobs
from nbdist.kernel.slurm import (
    PROGRAM,
    JobState,
    SlurmRequest,
    job_script,
    parse_squeue,
    refusal,
    seconds,
    template,
)
from nbdist.protocol import EngineReport, SlurmTask


def _request(line: str):
    return slurm_request(_subcommand_parser().parse_args(_joined_sbatch(shlex.split(line))))


def test_the_request_as_typed():
    r = _request(
        "start --slurm --nodes 2 --per-node 4 --gpus-per-node 4 --time 1:00:00 --partition gpu "
        '--account proj --warn 120 --sbatch "--qos=debug --constraint=a100"'
    )
    assert r == SlurmRequest(
        nodes=2, per_node=4, gpus_per_node=4, time="1:00:00", partition="gpu", account="proj",
        warn=120, sbatch=("--qos=debug", "--constraint=a100"),
    )  # fmt: skip
    assert r.tasks == 8
    assert r.words() == (
        '--nodes 2 --per-node 4 --gpus-per-node 4 --time 1:00:00 --partition gpu --account proj '
        '--warn 120 --sbatch "--qos=debug --constraint=a100"'
    )
    assert _request("start -n 2") is None


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("start --slurm --nodes 2", "needs --nodes N and --per-node K"),
        ("start --slurm --nodes 2 --per-node 1 -n 2", "the workers are --nodes N × --per-node K"),
        ("start --nodes 2", "--nodes only go with --slurm"),
        ('start --slurm --nodes 1 --per-node 1 --sbatch "debug"', "'debug' is not one"),
    ],
)
def test_a_request_that_does_not_fit_says_what_to_type(line, words):
    with pytest.raises(UsageError, match=words.replace("(", r"\(")):
        _request(line)


def test_the_batch_script_asks_for_every_option_and_the_users_come_last():
    request = SlurmRequest(nodes=2, per_node=4, gpus_per_node=4, time="30", partition="gpu",
                           account="proj", warn=120, sbatch=("--qos=debug",))  # fmt: skip
    script = job_script(request, name="nbdist-x", output=Path("/run/o-%j.out"),
                        program=PROGRAM)  # fmt: skip
    sbatch = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert sbatch == [
        "#SBATCH --job-name=nbdist-x",
        "#SBATCH --export=ALL",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --ntasks=8",
        "#SBATCH --output=/run/o-%j.out",
        "#SBATCH --signal=USR1@120",
        "#SBATCH --no-kill",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --time=30",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj",
        "#SBATCH --qos=debug",
    ]
    # ipyparallel's formatter fills the engine's command line and reads every other brace.
    filled = template(script).format(program_and_args="python -m engine --profile-dir=/p")
    assert filled.splitlines()[-1] == (
        "srun --kill-on-bad-exit=0 --no-kill python -m engine --profile-dir=/p"
    )
    assert 'OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( (SLURM_CPUS_ON_NODE + 3) / 4 ))}"' in filled


def test_slurms_answers_read():
    assert refusal(
        "sbatch: error: invalid partition specified: nosuch\n"
        "allocation failure: Invalid partition name specified\n"
    ) == "invalid partition specified: nosuch; Invalid partition name specified"
    assert refusal("sbatch: error: Batch job submission failed: x\nsbatch: error: Batch job "
                   "submission failed: x\n") == "Batch job submission failed: x"  # fmt: skip
    assert parse_squeue("PENDING|Resources||10:00|10:00\n") == JobState(
        "PENDING", "Resources", "", "10:00", "10:00"
    )
    assert JobState("PENDING", "Resources", "", "", "").words() == "PENDING (Resources)"
    assert JobState("PENDING", "None", "", "", "").words() == "PENDING"
    assert parse_squeue("") is None
    assert [seconds(t) for t in ("9:57", "1:00:00", "2-03:04:05", "UNLIMITED")] == [
        597, 3600, 183845, None
    ]


def test_ranks_follow_slurms_task_numbers_whatever_the_engine_ids():
    def info(address, node, local):
        task = SlurmTask(job="7", procid=node * 2 + local, node=node, local=local,
                         nodename=f"n{node}")  # fmt: skip
        return EngineReport(host=f"n{node}", pid=1, gpus=[], cpus=2, address=address, slurm=task)

    # Engine ids in the order the engines registered: not Slurm's.
    infos = [info("10.0.0.9", 1, 1), info("10.0.0.10", 0, 1), info("10.0.0.10", 0, 0),
             info("10.0.0.9", 1, 0)]  # fmt: skip
    engines = rank_engines([0, 1, 2, 3], infos)
    assert [(e.rank, e.slurm.procid, e.local_rank) for e in engines] == [
        (0, 0, 0), (1, 1, 1), (2, 2, 0), (3, 3, 1)
    ]
    env = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "3", "SLURM_NODEID": "1", "SLURM_LOCALID": "1",
           "SLURMD_NODENAME": "n1"}  # fmt: skip
    assert slurm_task(env) == SlurmTask("7", 3, 1, 1, "n1")
    assert slurm_task({"SLURM_JOB_ID": "7"}) is None  # the batch shell: not a task


def test_a_run_record_names_the_jobs_the_reaper_cancels():
    assert record_jobs('{"started": [], "jobs": ["12", "13"], "folder": "/h/.nbdist/slurm/j"}') == (
        ["12", "13"], "/h/.nbdist/slurm/j"
    )
    assert record_jobs('{"kernel": [1, 2.0], "started": []}') == ([], None)
    assert record_jobs('{"jobs": ["12; rm -rf ~"], "folder": "relative"}') == ([], None)


def test_the_exports_slurm_header():
    text = slurm_commands([("a", "10.0.0.2", "eth0", 2), ("b", "10.0.0.3", "eth0", 2)],
                          "train.py", "12")  # fmt: skip
    assert (
        "#SBATCH --nodes=2\n    #SBATCH --ntasks-per-node=1\n    #SBATCH --cpus-per-task=2"
    ) in text
    assert (
        "srun sh -c 'torchrun --nnodes 2 --nproc_per_node 2 --node_rank $SLURM_NODEID "
        "--master_addr $MASTER_ADDR --master_port 29400 train.py'"
    ) in text
