"""Two machines: simulated hosts (network namespaces joined by a bridge, an sshd each, names that
resolve nowhere, see tests/hosts.py), engines started on them by ipyparallel's SSH launcher,
and the notebook's kernel on the first host. The session across hosts, TensorFlow with
--expose-tf, the exported script run with torchrun on both hosts, and a host's link cut in the
middle of a cell and restored. Then once with ipyparallel's MPI launcher (Open MPI over ssh),
where Open MPI and mpi4py are installed. The profiles are the ones docs/two-machines.md shows."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from tests.hosts import Hosts
from tests.kernel_proc import KernelProcess
from tests.procs import cell_started, wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.torch, pytest.mark.slow]

REASON = Hosts.skip_reason()
if REASON:
    pytest.skip(REASON, allow_module_level=True)

CLUSTER_ID = "twohosts"
BUILD = textwrap.dedent(
    """
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(),
                                                              nn.Linear(16, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(64, 8, generator=g), torch.randn(64, 2, generator=g)
    """
)
TRAIN = textwrap.dedent(
    """
    for step in range(10):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    """
)
CHECKSUM = "sum(float(p.detach().double().sum()) for p in model.parameters())"


@pytest.fixture(scope="module")
def hosts():
    with Hosts(["a", "b"]) as h:
        a = h.names[0]
        profile = h.folder / "profile_ssh"
        profile.mkdir(mode=0o700)
        remote = h.folder / "remote_profile"  # where ssh copies the connection files to
        (profile / "ipcluster_config.py").write_text(
            "c.Cluster.engine_launcher_class = 'ssh'\n"
            f"c.SSHEngineSetLauncher.engines = {{'{a}': 2, '{h.names[1]}': 2}}\n"
            f"c.SSHLauncher.ssh_args = ['-F', '{h.ssh_config}']\n"
            f"c.SSHLauncher.scp_args = ['-F', '{h.ssh_config}']\n"
            f"c.SSHLauncher.remote_python = '{sys.executable}'\n"
            f"c.SSHLauncher.remote_profile_dir = '{remote}'\n"
            "c.SSHEngineSetLauncher.delay = 0.1\n"
        )
        # A lost engine is noticed after 3 s of missed heartbeats, not ipyparallel's 30.
        (profile / "ipcontroller_config.py").write_text(
            f"c.IPController.ip = '{h.addresses[a]}'\n"
            "c.HeartMonitor.period = 500\n"
            "c.HeartMonitor.max_heartmonitor_misses = 6\n"
        )
        with _ipcluster(h, profile):
            yield h, profile, remote


@contextlib.contextmanager
def _ipcluster(h, profile):
    """``ipcluster start -n 4`` with ``profile`` on the first host, as a person would type it."""
    log = open(h.folder / f"ipcluster-{profile.name}.log", "wb")  # noqa: SIM115
    ipcluster = subprocess.Popen(
        [*h.exec_argv(h.names[0]), sys.executable, "-m", "ipyparallel.cluster", "start",
         f"--profile-dir={profile}", f"--cluster-id={CLUSTER_ID}", "-n", "4",
         "--log-level=ERROR"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        yield
    finally:
        ipcluster.kill()  # its stop would fetch logs over ssh for a minute; Hosts ends the rest
        ipcluster.wait()
        log.close()


@pytest.fixture(scope="module")
def kernel(hosts):
    h, _, _ = hosts
    k = KernelProcess(h.exec_argv(h.names[0]))
    yield k
    k.close()


def _engines(h, host):
    """The pids of the ipyparallel engines (not their ssh or nanny) running on ``host``."""
    found = set()
    for pid in h.pids(host):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv[0].endswith(b"python") and argv[1:3] == [b"-m", b"ipyparallel.engine"]:
            found.add(pid)
    return found


def _ok(result):
    assert result["error"] is None, result["rendered"] or result["err"]
    return result


def test_a_session_across_two_hosts_and_its_export_run_with_torchrun(hosts, kernel):
    h, profile, _ = hosts
    a, b = h.names
    connect = (
        f"%distrain connect --profile-dir {profile} --cluster-id {CLUSTER_ID} -n 4 --timeout 120"
    )
    out = _ok(kernel.run(connect))["out"]
    assert (
        f"nbdist: connected to 4 engines on 2 hosts ({h.addresses[a]}: 2 engines, "
        f"{h.addresses[b]}: 2 engines)" in out
    ), out
    status = _ok(kernel.run("%distrain status"))["out"]
    assert f"  {a} ({h.addresses[a]}): 2 engines, ranks 0-1, GPUs none" in status
    assert f"  {b} ({h.addresses[b]}): 2 engines, ranks 2-3, GPUs none" in status

    _ok(kernel.run(f"%%distrain --framework torch --no-plot --timeout 60\n{BUILD}"))
    where = _ok(kernel.run(
        "%%distrain --no-plot -o res\n"
        "import os, socket\n"
        "(socket.gethostname(), os.environ['MASTER_ADDR'], os.environ.get('GROUP_RANK'))"
    ))  # fmt: skip
    assert "[c10d]" not in where["err"]  # the hostname warning is left out of the cell
    values = _ok(kernel.run("res.values"))["value"]
    assert values == repr([(a, h.addresses[a], "0")] * 2 + [(b, h.addresses[a], "1")] * 2)
    for _ in range(2):
        _ok(kernel.run(f"%%distrain --no-plot\n{TRAIN}"))
    same = _ok(kernel.run("%distrain compare model"))["value"]
    assert same == "model: identical on 4 ranks (4 entries)"
    checksum = float(_ok(kernel.run(f"%%distrain --no-plot\n{CHECKSUM}"))["value"])

    script = h.folder / "train.py"
    _ok(kernel.run(f"%distrain export {script}"))
    text = script.read_text()
    assert f"_INTERFACES = {{'{a}': 'eth0', '{b}': 'eth0'}}" in text
    commands = {}
    lines = text.split('"""')[1].splitlines()
    for i, line in enumerate(lines):
        if line.startswith("    # on "):
            commands[line.split()[2]] = lines[i + 1].strip()
    assert list(commands) == [a, b]
    assert commands[a] == (
        f"GLOO_SOCKET_IFNAME=eth0 torchrun --nnodes 2 --nproc_per_node 2 --node_rank 0 "
        f"--master_addr {h.addresses[a]} --master_port 29400 train.py"
    )
    after = "\n# --- after the cells "
    script.write_text(
        text.replace(after, f"\nif is_main:\n    print('checksum', repr({CHECKSUM}))\n" + after)
    )
    torchrun = f"{sys.executable.rsplit('/', 1)[0]}/torchrun"
    runs = [
        subprocess.Popen(
            [
                *h.exec_argv(a),
                *h.ssh_argv(host),
                f"cd {h.folder} && {commands[host].replace('torchrun', torchrun)}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for host in (a, b)
    ]
    outs = [r.communicate(timeout=240) for r in runs]
    for r, (_, err) in zip(runs, outs, strict=True):
        assert r.returncode == 0, err[-3000:]
    line = next(ln for ln in outs[0][0].splitlines() if ln.startswith("checksum "))
    assert float(line.split()[1]) == checksum


@pytest.mark.tf
def test_tensorflow_across_two_hosts_needs_expose_tf_and_trains_in_sync(hosts, kernel):
    h, profile, _ = hosts
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
    refused = kernel.run(f"%%distrain --framework tf --no-plot\n{cell}")
    assert refused["error"] == "UsageError" and "add --expose-tf" in refused["rendered"]
    ran = _ok(kernel.run(f"%%distrain --framework tf --no-plot --expose-tf -o tfres\n{cell}"))
    assert "can run code in your workers" in ran["out"]
    values = eval(_ok(kernel.run("tfres.values"))["value"])  # a list of 4 lists of floats
    assert len(values) == 4 and all(v == values[0] for v in values)
    _ok(kernel.run(f"%distrain connect --profile-dir {profile} --cluster-id {CLUSTER_ID} -n 4"))


def test_a_host_cut_off_mid_cell_and_back(hosts, kernel, tmp_path):
    """Host b's link goes down in the middle of a cell: its ranks are reported as not
    answering, the engines on host a are neither killed nor restarted, and the next cell trains
    on them with the variables they held; engines started on b once it is back join at the
    next cell."""
    h, profile, remote = hosts
    a, b = h.names
    _ok(kernel.run(f"%distrain connect --profile-dir {profile} --cluster-id {CLUSTER_ID} -n 4"))
    _ok(kernel.run(f"%%distrain --framework torch --no-plot --timeout 15\n{BUILD}"))
    engines_a = _engines(h, a)
    assert len(engines_a) == 2, engines_a
    long_cell = "import time\nfor step in range(1000):\n" + textwrap.indent(TRAIN, "    ")
    long_cell += "    time.sleep(0.05)\n"
    # The link goes down once every rank runs the cell (a file each writes as it starts).
    first, running = cell_started(tmp_path, 4)
    kernel.send(f"%%distrain --no-plot\n{first}{long_cell}")
    wait_until(lambda: all(p.exists() for p in running))
    time.sleep(0.5)  # into the loop's collectives
    cut = time.monotonic()
    h.cut(b)
    result = kernel.result()
    took = time.monotonic() - cut
    assert result["error"] == "WorkerDied", result
    assert (
        f"rank 2 (host {b}, pid" in result["rendered"]
        and "stopped answering during the job: the controller lost their heartbeat (died, or "
        f"{b} unreachable)"
        in result["rendered"]
    ), result["rendered"]
    assert took < 3 + 15 + 15, took  # the heartbeat, the collective timeout, the grace
    # The SSH launcher starts its whole host list, not two engines: the survivors go on alone,
    # and keep their variables (they train on below).
    said = result["out"] + result["rendered"]
    assert (
        "The session was healed on fewer ranks: no engine could be started for ranks 2, 3, so the "
        "2 that answer go on as ranks 0-1, and every rank got rank 0's variables (" in said
    ), said
    assert _engines(h, a) == engines_a  # nothing killed or restarted on the host that answers
    _ok(kernel.run(f"%%distrain --no-plot\n{TRAIN}"))
    ran = _ok(kernel.run(
        "%%distrain --no-plot -o res\nimport socket\n(rank, world_size, socket.gethostname())"
    ))  # fmt: skip
    assert _ok(kernel.run("res.values"))["value"] == repr([(0, 2, a), (1, 2, a)]), ran

    h.restore(b)
    for _ in range(2):  # as a person would, with ipcluster engines or by hand
        subprocess.Popen(
            [*h.exec_argv(a), *h.ssh_argv(b),
             f"nohup {sys.executable} -m ipyparallel.engine --profile-dir={remote} "
             f"--cluster-id={CLUSTER_ID} --log-level=ERROR > /dev/null 2>&1 &"],
        ).wait(30)  # fmt: skip
    # They register a few seconds apart (more on a loaded machine): each joins at the next cell.
    deadline = time.monotonic() + 60
    said = []
    while True:
        said.append(_ok(kernel.run("%%distrain --no-plot -o res\nworld_size"))["out"])
        values = _ok(kernel.run("res.values"))["value"]
        if values == repr([4, 4, 4, 4]) or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert values == repr([4, 4, 4, 4]), said
    joined = [line for out in said for line in out.splitlines() if "registered since" in line]
    assert joined in (
        ["nbdist: 2 engines registered since (2 before, 4 now): the workers are ranked anew and "
         "their process group rebuilt"],
        ["nbdist: 1 engine registered since (2 before, 3 now): the workers are ranked anew and "
         "their process group rebuilt",
         "nbdist: 1 engine registered since (3 before, 4 now): the workers are ranked anew and "
         "their process group rebuilt"],
    ), said  # fmt: skip


def _mpi_missing() -> str | None:
    if shutil.which("mpiexec") is None:
        return "needs Open MPI's mpiexec (apt-get install openmpi-bin)"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "needs mpi4py (pip install mpi4py; make installs it where mpicc is)"
    return None


@pytest.mark.skipif(_mpi_missing() is not None, reason=str(_mpi_missing()))
def test_engines_started_by_ipyparallels_mpi_launcher_across_two_hosts():
    """ipcluster's MPI launcher: mpiexec starts the engines on both hosts over ssh; Open MPI
    passes the controller's connection only where told to (-x)."""
    with Hosts(["a", "b"]) as h:
        a, b = h.names
        profile = h.folder / "profile_mpi"
        profile.mkdir(mode=0o700)
        (profile / "ipcluster_config.py").write_text(
            "c.Cluster.engine_launcher_class = 'mpi'\n"
            "c.MPILauncher.mpi_args = [\n"
            f"    '--host', '{a}:2,{b}:2',\n"
            f"    '--mca', 'plm_rsh_args', '-F {h.ssh_config}',\n"
            "    '--mca', 'oob_tcp_if_include', 'eth0', '--mca', 'btl_tcp_if_include', 'eth0',\n"
            "    '-x', 'IPP_PROFILE_DIR', '-x', 'IPP_CLUSTER_ID', '-x', 'IPP_CONNECTION_INFO',\n"
            "    '--allow-run-as-root',\n"
            "]\n"
        )
        (profile / "ipcontroller_config.py").write_text(f"c.IPController.ip = '{h.addresses[a]}'\n")
        with _ipcluster(h, profile):
            kernel = KernelProcess(h.exec_argv(a))
            try:
                out = _ok(kernel.run(
                    f"%distrain connect --profile-dir {profile} --cluster-id {CLUSTER_ID} "
                    "-n 4 --timeout 120"
                ))["out"]  # fmt: skip
                assert "nbdist: connected to 4 engines on 2 hosts" in out, out
                status = _ok(kernel.run("%distrain status"))["out"]
                assert f"  {b} ({h.addresses[b]}): 2 engines, ranks 2-3, GPUs none" in status
                _ok(kernel.run(f"%%distrain --framework torch --no-plot\n{BUILD}\n{TRAIN}"))
                same = _ok(kernel.run("%distrain compare model"))["value"]
                assert same == "model: identical on 4 ranks (4 entries)"
                where = _ok(kernel.run(
                    "%%distrain --no-plot -o res\nimport socket\n"
                    "(socket.gethostname(), mpi_rank, mpi_size)"
                ))  # fmt: skip
                assert where["error"] is None
                values = eval(_ok(kernel.run("res.values"))["value"])
                assert [v[0] for v in values] == [a, a, b, b]
                assert sorted(v[1] for v in values) == [0, 1, 2, 3] and values[0][2] == 4
            finally:
                kernel.close()
