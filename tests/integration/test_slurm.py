"""A real Slurm (Debian's slurm-wlm and munge; see tests/slurm.py): slurmctld on a login host,
two nodes with a slurmd each, every one a network namespace with its own hostname and address.
The notebook's kernel runs on the login host, as on a cluster's login node.

- engines that ``ipcluster start`` had Slurm start (its own launcher, the profile the docs
  show), then ``%distrain connect``: ranks as Slurm numbers the tasks, DDP and TensorFlow in
  sync across the nodes, ``status`` naming the job and its nodes;
- ``%distrain start --slurm``: the job's id and its pending state as ``squeue`` gives it, a
  session across both nodes, and no allocation left by ``stop``, a kernel's exit or a kernel
  killed with -9;
- bad requests refused in sbatch's own words, with no job queued.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.kernel_proc import KernelProcess
from tests.procs import cell_started, kill_now, wait_until
from tests.slurm import SlurmCluster

pytestmark = [pytest.mark.cluster, pytest.mark.torch, pytest.mark.slow]

REASON = SlurmCluster.skip_reason()
if REASON:
    pytest.skip(REASON, allow_module_level=True)

BUILD = textwrap.dedent(
    """
    import torch.nn.functional as F

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.hidden, self.out = nn.Linear(8, 16), nn.Linear(16, 2)

        def forward(self, x):
            return self.out(F.relu(self.hidden(x)))

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(64, 8, generator=g), torch.randn(64, 2, generator=g)
    """
)
TRAIN = textwrap.dedent(
    """
    for step in range(10):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    """
)
CHECKSUM = "sum(float(p.detach().double().sum()) for p in model.parameters())"
WHO = (
    "import os, socket\n"
    "(socket.gethostname(), os.environ['SLURM_PROCID'], os.environ['SLURM_LOCALID'], rank)"
)


@pytest.fixture(scope="module")
def slurm():
    with SlurmCluster(["a", "b"]) as s:
        yield s


def _kernel(slurm: SlurmCluster) -> KernelProcess:
    return KernelProcess(slurm.hosts.exec_argv(slurm.login), env=slurm.env)


@pytest.fixture
def kernel(slurm):
    k = _kernel(slurm)
    yield k
    k.close()
    assert slurm.wait_no_jobs() == []


def _ok(result):
    assert result["error"] is None, result["rendered"] or result["err"]
    return result


def _refused(result, words):
    assert result["error"] is not None, result["out"]
    assert words in result["rendered"], result["rendered"]
    return result["rendered"]


def _session_across_nodes(slurm, kernel):
    """A DDP model of the notebook's own class trained across both nodes: identical replicas,
    each rank the Slurm task of the same number."""
    a, b = slurm.nodes
    _ok(kernel.run(f"%%distrain --framework torch --no-plot --timeout 60\n{BUILD}"))
    _ok(kernel.run(f"%%distrain --no-plot -o who\n{WHO}"))
    who = eval(_ok(kernel.run("who.values"))["value"])
    assert who == [(a, "0", "0", 0), (a, "1", "1", 1), (b, "2", "0", 2), (b, "3", "1", 3)]
    for _ in range(2):
        _ok(kernel.run(f"%%distrain --no-plot\n{TRAIN}"))
    same = _ok(kernel.run("%distrain compare model"))["value"]
    assert same == "model: identical on 4 ranks (4 entries)", same


@pytest.mark.tf
def test_connect_to_engines_ipcluster_started_with_slurms_launcher(slurm, kernel, tmp_path):
    """The profile docs/two-machines.md shows, ``ipcluster start --engines=slurm``, then
    ``%distrain connect``: ranks follow Slurm's task numbers, status names the job, and DDP and
    TensorFlow train in sync across the nodes."""
    profile = tmp_path / "profile_slurm"
    profile.mkdir(mode=0o700)
    (profile / "ipcluster_config.py").write_text(
        "c.Cluster.engine_launcher_class = 'slurm'\n"
        f"c.Cluster.controller_ip = '{slurm.address(slurm.login)}'\n"
        "c.SlurmEngineSetLauncher.timelimit = '10:00'\n"
    )
    log = open(tmp_path / "ipcluster.log", "wb")  # noqa: SIM115
    subprocess.run(
        [*slurm.hosts.exec_argv(slurm.login), sys.executable, "-m", "ipyparallel.cluster",
         "start", f"--profile-dir={profile}", "-n", "4", "--daemonize", "--log-level=ERROR"],
        stdout=log, stderr=subprocess.STDOUT, env=slurm.env, check=True, timeout=60,
    )  # fmt: skip
    try:
        out = _ok(kernel.run(f"%distrain connect --profile-dir {profile} -n 4 --timeout 120"))
        assert "connected to 4 engines on 2 hosts" in out["out"], out
        [job] = [line.split()[0] for line in slurm.jobs()]
        status = _ok(kernel.run("%distrain status"))["out"]
        a, b = slurm.nodes
        assert f"  {a} ({slurm.address(a)}): 2 engines, ranks 0-1, GPUs none" in status
        assert re.search(
            rf"^Slurm job {job}: nodes {a}, {b}, RUNNING, time left \d+:\d\d of 10:00$",
            status, re.M,
        ), status  # fmt: skip
        _session_across_nodes(slurm, kernel)
        _tensorflow_in_sync(kernel, 4)
        _ok(kernel.run("%distrain stop"))
    finally:
        subprocess.run(
            [*slurm.hosts.exec_argv(slurm.login), sys.executable, "-m", "ipyparallel.cluster",
             "stop", f"--profile-dir={profile}"],
            env=slurm.env, capture_output=True, timeout=60, check=False,
        )  # fmt: skip
        log.close()


def _blocker(slurm: SlurmCluster) -> str:
    """A job that holds every CPU of both nodes until it is cancelled."""
    out = slurm.run(["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=2",
                     "--output=/dev/null", "--wrap", "sleep 600"])  # fmt: skip
    job = out.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 20
    while not any(line.split()[:2] == [job, "RUNNING"] for line in slurm.jobs()):
        assert time.monotonic() < deadline, slurm.jobs()
        time.sleep(0.2)
    return job


def test_start_slurm_waits_while_pending_trains_across_nodes_and_stop_cancels(
    slurm, kernel, tmp_path
):
    """``%distrain start --slurm`` while another job holds the nodes: the job id, then
    ``PENDING (Resources)``; once the nodes are free, a session across both; ``stop`` leaves
    no allocation."""
    blocker = _blocker(slurm)
    kernel.send("%distrain start --slurm --nodes 2 --per-node 2 --time 10 --timeout 120")
    deadline = time.monotonic() + 60
    while not any("PENDING Resources" in line for line in slurm.jobs()):
        assert time.monotonic() < deadline, slurm.jobs()
        time.sleep(0.3)
    time.sleep(2)  # nbdist reads the state once a second
    slurm.run(["scancel", blocker])
    started = _ok(kernel.result())["out"]
    job = re.search(r"nbdist: Slurm job (\d+) submitted: 2 nodes × 2 engines, time 10\n", started)
    assert job, started
    job = job.group(1)
    assert f"nbdist: Slurm job {job} PENDING (Resources)\n" in started, started
    a, b = slurm.nodes
    assert f"nbdist: Slurm job {job} RUNNING on {a},{b}; waiting for its 4 engines" in started
    assert f"nbdist: 4 workers on 2 hosts, Slurm job {job} (--nodes 2 --per-node 2 --time 10)"
    assert re.search(rf"^Slurm job {job}: nodes {a}, {b}, RUNNING, time left", started, re.M)
    _session_across_nodes(slurm, kernel)
    checksum = float(_ok(kernel.run(f"%%distrain --no-plot\n{CHECKSUM}"))["value"])
    script = tmp_path / "train.py"
    _ok(kernel.run(f"%distrain export {script}"))
    stopped = _ok(kernel.run("%distrain stop"))["out"]
    assert stopped.startswith(f"nbdist: Slurm job {job} cancelled, and the controller stopped")
    assert slurm.wait_no_jobs(20) == []
    _run_export_with_sbatch(slurm, script, job, checksum)


def _run_export_with_sbatch(slurm, script, job, checksum):
    """The export's header: a batch script, given to sbatch as it stands (torchrun named by its
    path, the venv not being on PATH here), runs on both nodes to exit 0 and trains to the
    session's parameters."""
    text = script.read_text()
    header = text.split('"""')[1]
    assert f"It ran in Slurm job {job}, on 2 nodes with 2 workers each." in header
    block = header.split(f"sbatch {script.stem}.sbatch there:\n\n")[1].split("\n\n")[0]
    batch = "\n".join(line[4:] for line in block.splitlines())
    assert batch.splitlines()[:4] == [
        "#!/bin/sh", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=2",
    ]  # fmt: skip
    torchrun = f"{sys.executable.rsplit('/', 1)[0]}/torchrun"
    batch = batch.replace("torchrun ", f"{torchrun} ") + '\necho "srun exited $?"\n'
    (script.parent / "train.sbatch").write_text(batch)
    after = "\n# --- after the cells "
    script.write_text(
        text.replace(after, f"\nif is_main:\n    print('checksum', repr({CHECKSUM}))\n" + after)
    )
    output = script.parent / "train.out"
    submitted = slurm.run(
        ["sbatch", "--parsable", f"--output={output}", f"--chdir={script.parent}",
         str(script.parent / "train.sbatch")]
    )  # fmt: skip
    ran = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 240
    while any(line.split()[0] == ran for line in slurm.jobs()):
        assert time.monotonic() < deadline, output.read_text()[-3000:]
        time.sleep(1)
    out = output.read_text()
    assert "srun exited 0" in out, out[-3000:]
    line = next(ln for ln in out.splitlines() if ln.startswith("checksum "))
    assert float(line.split()[1]) == checksum


@pytest.mark.parametrize(
    ("request_", "words"),
    [
        (
            "--nodes 1 --per-node 1 --partition nosuch",
            "invalid partition specified: nosuch; Invalid partition name specified",
        ),
        ("--nodes 3 --per-node 1", "Requested node configuration is not available"),
        ("--nodes 2 --per-node 3", "Requested node configuration is not available"),
        (
            '--nodes 1 --per-node 1 --sbatch "--mem-per-cpu=abc"',
            "Invalid --mem-per-cpu specification",
        ),
    ],
)
def test_a_request_slurm_refuses_is_quoted_in_its_words_and_nothing_is_queued(
    slurm, kernel, request_, words
):
    t = time.monotonic()
    message = _refused(kernel.run(f"%distrain start --slurm {request_}"), words)
    assert time.monotonic() - t < 10
    assert f"%distrain start --slurm {request_}: Slurm refused the job: {words}" in message
    assert "Nothing was queued." in message
    assert slurm.jobs() == []
    assert "no cluster running" in _ok(kernel.run("%distrain status"))["out"]


def test_no_sbatch_on_path_and_a_job_pending_past_its_timeout(slurm, kernel):
    _ok(kernel.run("import os; path = os.environ['PATH']; os.environ['PATH'] = '/nonexistent'"))
    _refused(
        kernel.run("%distrain start --slurm --nodes 1 --per-node 1"),
        "%distrain start --slurm: no sbatch on PATH here",
    )
    _ok(kernel.run("os.environ['PATH'] = path"))
    blocker = _blocker(slurm)
    try:
        t = time.monotonic()
        message = _refused(
            kernel.run("%distrain start --slurm --nodes 1 --per-node 1 --timeout 3"),
            "was still PENDING (Resources) after 3 s: nbdist cancelled it",
        )
        assert time.monotonic() - t < 20, message
        assert [line.split()[0] for line in slurm.jobs()] == [blocker]
    finally:
        slurm.run(["scancel", blocker])


@pytest.mark.parametrize("how", ["kill -9", "exit"])
def test_a_kernel_that_ends_leaves_no_allocation(slurm, how):
    """The kernel's exit cancels the job (its exit handler); a kernel killed with -9 too (the
    reaper, from the run record). squeue is empty within 20 s."""
    folder = Path.home() / ".nbdist" / "slurm"
    before = set(folder.iterdir()) if folder.exists() else set()
    k = _kernel(slurm)
    try:
        _ok(k.run("%distrain start --slurm --nodes 2 --per-node 1 --time 5"))
        assert len(slurm.jobs()) == 1
    finally:
        if how == "kill -9":
            kill_now(k.proc.pid)
        else:
            k.close()
    assert slurm.wait_no_jobs(20) == []
    assert not [p for h in slurm.nodes for p in slurm.hosts.pids(h) if _is_engine(p)]
    assert wait_until(lambda: set(folder.iterdir()) <= before, 10), list(folder.iterdir())


def _is_engine(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"nbdist.engine.boot" in f.read()
    except OSError:
        return False


def _training_on_two_nodes(kernel, tmp_path) -> str:
    """A Slurm job of one engine on each node, a DDP model built, and a long training cell
    sent, running on both ranks when this returns; the job's id."""
    started = _ok(kernel.run("%distrain start --slurm --nodes 2 --per-node 1 --time 10"))
    job = re.search(r"Slurm job (\d+) submitted", started["out"]).group(1)
    _ok(kernel.run(f"%%distrain --framework torch --no-plot --timeout 60\n{BUILD}"))
    first, running = cell_started(tmp_path, 2)
    long_cell = "import time\nfor step in range(100000):\n" + textwrap.indent(TRAIN, "    ")
    long_cell += "    time.sleep(0.01)\n"
    kernel.send(f"%%distrain --no-plot\n{first}{long_cell}")
    assert wait_until(lambda: all(p.exists() for p in running), 60)
    return job


def test_the_time_limit_warning_stops_the_cell_and_the_next_job_goes_on(slurm, kernel, tmp_path):
    """Slurm's warning before the time limit (the job asks for it with --signal=USR1@WARN; sent
    here with scancel -s USR1 as slurmctld sends it, to every step's tasks) stops the running
    cell at a step boundary and names the job's limit; the session comes to the notebook, and
    the next ``start --slurm`` gives it to the new job's ranks, the old job cancelled."""
    job = _training_on_two_nodes(kernel, tmp_path)
    time.sleep(1)
    slurm.run(["scancel", "-s", "USR1", job])
    stopped = kernel.result()
    assert stopped["error"] == "JobInterrupted", stopped
    text = stopped["rendered"]
    assert re.search(
        rf"stopped \(the time-limit warning of Slurm job {job}: \d+:\d\d left of its 10:00\): "
        r"every rank stopped after step \d+", text,
    ), text  # fmt: skip
    assert "were saved in the notebook" in text, text
    checksum = _ok(kernel.run(f"%%distrain --no-plot\n{CHECKSUM}"))["value"]

    moved = _ok(kernel.run("%distrain start --slurm --nodes 2 --per-node 1 --time 2 --warn 100"))
    moved = moved["out"]
    started_at = time.monotonic()
    assert f"nbdist: Slurm job {job} cancelled" not in moved  # said once, by the stop below
    new_job = re.search(r"Slurm job (\d+) submitted", moved).group(1)
    assert new_job != job
    assert (
        "the session goes on: every rank got the saved variables (F, Net, g, loss, model, opt, "
        "step, time, x, y); the next cell wraps model in DistributedDataParallel again"
    ) in moved, moved
    assert [line.split()[0] for line in slurm.jobs()] == [new_job]
    assert _ok(kernel.run(f"%%distrain --no-plot\n{CHECKSUM}"))["value"] == checksum
    _ok(kernel.run(f"%%distrain --no-plot\n{TRAIN}"))
    same = _ok(kernel.run("%distrain compare model"))["value"]
    assert same == "model: identical on 2 ranks (4 entries)", same
    trained = _ok(kernel.run(f"%%distrain --no-plot\n{CHECKSUM}"))["value"]

    # Within --warn of the limit (at most 2:00 left when the start returned), between cells:
    # the session is saved first, and the cell does not start.
    time.sleep(max(0.0, started_at + 21 - time.monotonic()))
    late = kernel.run(f"%%distrain --no-plot\n{TRAIN}")
    assert late["error"] == "UsageError", late
    assert re.search(
        rf"%%distrain: Slurm job {new_job} ends in 1:\d\d, its time limit: the cell did not "
        r"start. The session's variables \(.*model.*\) were saved in the notebook; %distrain "
        r"start --slurm --nodes 2 --per-node 1 --time 2 --warn 100 goes on with them on a new "
        "job.", late["rendered"],
    ), late["rendered"]  # fmt: skip
    _ok(kernel.run("%distrain start --slurm --nodes 2 --per-node 1 --time 10"))
    assert _ok(kernel.run(f"%%distrain --no-plot\n{CHECKSUM}"))["value"] == trained
    _ok(kernel.run("%distrain stop"))


def test_a_node_lost_mid_cell_is_named_and_slurm_gives_a_new_engine(slurm, kernel, tmp_path):
    """Node b dies in the middle of a cell (its slurmd and every process on it killed): its
    rank is named with the host within seconds, and the session heals with an engine from a new
    Slurm job, on the node that is left; the job that lost a node goes on (--no-kill)."""
    a, b = slurm.nodes
    _training_on_two_nodes(kernel, tmp_path)
    t = time.monotonic()
    slurm.kill_node(b)
    try:
        _heals(slurm, kernel, t)
    finally:
        slurm.revive(b)


def _heals(slurm, kernel, t):
    a, b = slurm.nodes
    lost = kernel.result()
    assert lost["error"] is not None, lost
    text = lost["out"] + lost["rendered"]
    assert f"rank 1 (host {b}, pid " in text, text
    assert (
        f"stopped answering during the job: the controller lost its heartbeat (died, or {b} "
        "unreachable)"
    ) in text, text
    assert "The session was healed: a new engine took rank 1" in text, text
    took = time.monotonic() - t
    print(f"node lost -> cell ended, healed: {took:.1f} s")
    assert took < 60, text
    _ok(kernel.run(f"%%distrain --no-plot -o who\n{WHO}"))
    hosts = [w[0] for w in eval(_ok(kernel.run("who.values"))["value"])]
    assert hosts == [a, a], hosts
    _ok(kernel.run(f"%%distrain --no-plot\n{TRAIN}"))
    same = _ok(kernel.run("%distrain compare model"))["value"]
    assert same == "model: identical on 2 ranks (4 entries)", same
    status = _ok(kernel.run("%distrain status"))["out"]
    assert len(re.findall(r"^Slurm job \d+: nodes ", status, re.M)) == 2, status
    _ok(kernel.run("%distrain stop"))


def _tensorflow_in_sync(kernel, world: int) -> None:
    """TensorFlow's MultiWorkerMirroredStrategy on the engines: the workers train one Keras
    model in sync (every worker's weights the same)."""
    cell = textwrap.dedent(
        """
        import numpy as np, keras
        with strategy.scope():
            tf_model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            tf_model.compile(optimizer="sgd", loss="mse")
        data = np.random.default_rng(0).normal(size=(256, 4)).astype("float32")
        tf_model.fit(data, data.sum(1), batch_size=64, epochs=2, verbose=0)
        [round(float(w.sum()), 6) for w in tf_model.get_weights()]
        """
    )
    _ok(kernel.run(f"%%distrain --framework tf --no-plot --expose-tf -o tfres\n{cell}"))
    values = eval(_ok(kernel.run("tfres.values"))["value"])
    assert len(values) == world and all(v == values[0] for v in values), values


@pytest.mark.tf
def test_tensorflow_multiworker_across_slurm_nodes(slurm, kernel):
    """TensorFlow on a job of one engine per node, then ``%distrain restart``."""
    first = _ok(kernel.run("%distrain start --slurm --nodes 2 --per-node 1 --time 10"))["out"]
    job = re.search(r"Slurm job (\d+) submitted", first).group(1)
    _tensorflow_in_sync(kernel, 2)
    # %distrain restart: the job cancelled, the same request submitted again.
    refused = kernel.run("%distrain restart -n 4")
    assert refused["error"] == "UsageError", refused
    assert "are --nodes × --per-node (2)" in refused["rendered"]
    again = _ok(kernel.run("%distrain restart"))["out"]
    new_job = re.search(r"nbdist: Slurm job (\d+) submitted: 2 nodes × 1 engine, time 10", again)
    assert new_job and new_job.group(1) != job, again
    assert [line.split()[0] for line in slurm.jobs()] == [new_job.group(1)]
    too_many = kernel.run("%%distrain -n 3\nrank")
    assert too_many["error"] == "UsageError", too_many
    assert "-n 3, but the Slurm job has 2 engines" in too_many["rendered"]
    _ok(kernel.run("%distrain stop"))
