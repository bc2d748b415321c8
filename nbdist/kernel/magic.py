"""The ``%%distrain`` cell magic and the ``%distrain`` line magic."""

from __future__ import annotations

import argparse
import ast
import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, cell_magic, line_cell_magic, magics_class
from traitlets import Bool, observe

from nbdist.errors import ExportError
from nbdist.kernel import commands, debug
from nbdist.kernel.netns import MODES
from nbdist.kernel.options import _names, _positive_int, parse_run_options, run_parser
from nbdist.kernel.session import Session
from nbdist.protocol import CellName

_DOC = """Run a cell as a distributed training job, one worker per GPU (2 on CPU).

Cell magic::

    %%distrain [-n N] [--framework torch|tf] [--backend gloo|nccl] [--strategy mirrored]
               [--push A,B] [--pull X,Y] [-o NAME] [--ranks R,S] [--timeout S] [--no-check]
               [--scan 1,2,...] [--profile [STEPS]]

Line magic::

{subcommands}

The cell runs on every worker at once, as rank 0 .. N-1 of one job. Before it starts the
process group is ready (``torch.distributed``: nccl with GPUs, gloo without), and the cell
sees these names:

    rank, world_size          this worker's rank and the number of workers
    local_rank, local_world_size   the same, counted on this worker's host
    is_main                   rank == 0: print, save and evaluate only there
    device                    where to put the model: cuda:<local_rank> (this worker's own GPU,
                              as under torchrun) or cpu
    torch, nn, dist           torch, torch.nn, torch.distributed

TensorFlow cells (``--framework tf``, or inferred from ``import tensorflow``/``keras``/
``strategy``) get ``TF_CONFIG`` set for their rank (every engine a worker, task index = rank)
and these names:

    strategy                  a ready tf.distribute.MultiWorkerMirroredStrategy (RING on CPU,
                              NCCL on GPUs, a 15 s collective timeout so a lost peer is an error)
    tf                        tensorflow
    rank, world_size, is_main as above

Build and compile the Keras model inside ``with strategy.scope():``. The batch size given to
``model.fit`` or ``dataset.batch`` is the *global* batch: MWMS splits it across the workers, so
each worker computes ``global_batch / world_size`` samples per step (per-replica batch).
``--strategy mirrored`` runs the cell in one worker with ``tf.distribute.MirroredStrategy`` over
that machine's GPUs (CPU:0 when there is none). Keras 3's multi-worker ``fit`` bug
(keras-team/keras#20585) is patched on the workers.

The workers keep their variables from cell to cell, as ``%%px`` does (a cell runs in each
engine's own namespace): build the model in one cell, train it in the next, look at it in a
third. The value of the cell's last line is shown as IPython shows it: once when every rank
has the same value, one ``[rank N]`` line per rank when they differ. ``display(...)`` works on
the workers. A cell that names no framework runs under the one the workers already have set up
(torch when none yet). ``--fresh`` runs one cell in a throwaway namespace; ``--on 0`` runs it on
some ranks only (to inspect or plot; a collective there cannot complete and is reported).

After an error on every rank that left the process group working (a typo), the variables
stay, as in a Python REPL. After a failure that may have broken the group (one rank raised
while others waited in a collective, an interrupt, a timeout) nbdist rebuilds the group and the
variables are dropped; the error's last line names them. Send notebook data in with ``--push``
(or ``%distrain push``) and bring results back with ``--pull`` (or ``%distrain pull``).
A cell written for torchrun that calls ``dist.init_process_group(...)`` itself works as it
is: nbdist has already set up the group and skips the second initialisation.

Before the cell runs, nbdist reads it (without running it) for the classic mistakes of
distributed training — nn.DataParallel inside DDP, a DataLoader without a DistributedSampler, an
epoch loop without sampler.set_epoch, nccl without GPUs, saving from every rank, a Keras model
built outside strategy.scope(), ... — and prints one line per finding with the fix. Findings
never block the run; --no-check turns them off, --check-only checks without running.

Output of every rank streams into the cell, prefixed ``[rank N]`` (``--ranks 0`` shows one);
beyond 16 ranks, rank 0's lines and at the end a count of the others' (``--ranks all`` shows
every rank's; ``-o res`` keeps them all in ``res.stdout``). The panel and ``%distrain status``
then group the ranks by host.
If a rank raises, the others are stopped within seconds and the error names the rank, the
line of the cell and the remote traceback; the next ``%%distrain`` works as usual.

Examples
--------
A DDP model trained on 2 CPU workers; every rank ends with the same parameters::

    %load_ext nbdist

    %%distrain -n 2 -o result
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(10, 1).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(64, 10), torch.randn(64, 1)
    for step in range(20):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x[rank::world_size]), y[rank::world_size])
        loss.backward()
        opt.step()
    if is_main:
        print(f"final loss {loss.item():.4f}")
    loss.item()                      # result.values holds each rank's value

TensorFlow, two workers, one Keras model::

    %%distrain --framework tf
    import numpy as np, keras
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    x = np.random.rand(256, 8).astype("float32")
    model.fit(x, x.sum(1), batch_size=64, epochs=2, verbose=0)   # 64 = global batch

A session: build, train, check that the replicas agree, train more::

    %%distrain
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(10, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    %%distrain
    for step in range(20):
        opt.zero_grad()
        nn.functional.mse_loss(model(torch.randn(32, 10)), torch.zeros(32, 1)).backward()
        opt.step()

    same = %distrain compare model       # same.identical is True: DDP kept them in sync

Data in, results out::

    data = torch.randn(256, 10)

    %%distrain --push data --pull weights
    weights = data[rank::world_size].mean(0)

A scaling study: the same cell with 1 and then 2 workers, throughput against the ideal line,
speedup and efficiency (``scan.speedup``, ``scan.efficiency``, ``scan.runs``)::

    %%distrain --scan 1,2 -o scan
    model = nn.parallel.DistributedDataParallel(nn.Linear(256, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(100):
        opt.zero_grad()
        model(torch.randn(512, 256)).pow(2).mean().backward()   # autolog counts the samples
        opt.step()

Where each rank's step time goes (torch): 5 optimizer steps profiled after 2 warm-up steps,
split into computation, communication and waiting for peers, with a timeline, the top
operators and a Chrome trace per rank (``res.profile``)::

    %%distrain --profile -o res
    for step in range(50):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

Flags
-----
"""


@dataclass(frozen=True)
class Subcommand:
    """One ``%distrain`` subcommand: its arguments, how it is written, what it does. The
    parser, the usage line of every error and the ``%%distrain?`` text come from these."""

    name: str
    usage: str  # its arguments, as written after the name
    help: str
    arguments: Callable[[argparse.ArgumentParser], object] = lambda p: None


def _workers_and_network(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--workers", type=_positive_int, metavar="N")
    p.add_argument("--network", choices=MODES)


def _start_args(p: argparse.ArgumentParser) -> None:
    _workers_and_network(p)
    p.add_argument("--slurm", action="store_true")
    p.add_argument("--nodes", type=_positive_int, metavar="N")
    p.add_argument("--per-node", type=_positive_int, metavar="K")
    p.add_argument("--gpus-per-node", type=_positive_int, metavar="G")
    p.add_argument("--time", metavar="T")
    p.add_argument("--partition", metavar="P")
    p.add_argument("--account", metavar="A")
    p.add_argument("--warn", type=_positive_int, metavar="S")
    p.add_argument("--sbatch", metavar='"OPTIONS"')
    p.add_argument("--controller-ip", metavar="IP")
    p.add_argument("--timeout", type=float, metavar="S")


_SLURM_ONLY = ("nodes", "per_node", "gpus_per_node", "time", "partition", "account", "warn",
               "sbatch", "controller_ip", "timeout")  # fmt: skip


def _joined_sbatch(argv: list[str]) -> list[str]:
    """``--sbatch "--qos=debug"`` as ``--sbatch=--qos=debug``: argparse takes a value that
    starts with ``-`` for an option of its own."""
    out: list[str] = []
    words = iter(argv)
    for word in words:
        if word == "--sbatch":
            out.append(f"--sbatch={next(words, '')}")
        else:
            out.append(word)
    return out


def slurm_request(ns: argparse.Namespace) -> Any:
    """The ``SlurmRequest`` of ``%distrain start --slurm ...``, or a UsageError naming what is
    missing or does not fit."""
    from nbdist.kernel.slurm import DEFAULT_TIMEOUT_S, DEFAULT_WARN_S, SlurmRequest

    if not ns.slurm:
        given = [f"--{k.replace('_', '-')}" for k in _SLURM_ONLY if getattr(ns, k) is not None]
        if given:
            raise UsageError(
                f"%distrain start: {', '.join(given)} only go with --slurm, e.g. "
                "%distrain start --slurm --nodes 2 --per-node 2"
            )
        return None
    if ns.workers is not None or ns.network is not None:
        raise UsageError(
            "%distrain start --slurm: the workers are --nodes N × --per-node K (not -n), on "
            "the cluster's network (not --network)"
        )
    if ns.nodes is None or ns.per_node is None:
        raise UsageError(
            "%distrain start --slurm needs --nodes N and --per-node K (engines per node, one "
            "per GPU), e.g. %distrain start --slurm --nodes 2 --per-node 4 --gpus-per-node 4"
        )
    try:
        extra = tuple(shlex.split(ns.sbatch or ""))
    except ValueError as e:
        raise UsageError(
            f"%distrain start --slurm: cannot split --sbatch {ns.sbatch!r} ({e})"
        ) from None
    bad = [w for w in extra if not w.startswith("-")]
    if bad:
        raise UsageError(
            f"%distrain start --slurm: --sbatch takes sbatch options (each starting with -), "
            f"joined by = where they take a value: {bad[0]!r} is not one. E.g. "
            '--sbatch "--qos=debug --constraint=a100"'
        )
    return SlurmRequest(
        nodes=ns.nodes, per_node=ns.per_node, gpus_per_node=ns.gpus_per_node, time=ns.time,
        partition=ns.partition, account=ns.account,
        warn=ns.warn if ns.warn is not None else DEFAULT_WARN_S, sbatch=extra,
        controller_ip=ns.controller_ip,
        timeout=ns.timeout if ns.timeout is not None else DEFAULT_TIMEOUT_S,
    )  # fmt: skip


def _connect_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile")
    p.add_argument("--cluster-id")
    p.add_argument("--profile-dir")
    p.add_argument("--file", dest="url_file")
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("-n", "--workers", type=_positive_int, metavar="N")


def _export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path")
    p.add_argument("--force", action="store_true")


def _pull_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("names", type=_names("pull"))
    p.add_argument("--rank", type=int, default=0)


def _debug_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("rank", type=int, nargs="?", default=None)
    p.add_argument("-c", "--command", dest="commands", action="append", default=None)


def _sync_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("names", type=_names("sync"))
    p.add_argument("--from", dest="source", type=int, default=0)


SUBCOMMANDS = (
    Subcommand(
        "start", "[-n N] [--network private|isolated|host]",
        "start the workers now (the first %%distrain does it otherwise); --network: private "
        "(default, outbound connections only where slirp4netns is installed), isolated "
        "(loopback only) or host (this machine's network). With --slurm --nodes N --per-node K "
        "[--gpus-per-node G] [--time T] [--partition P] [--account A] [--warn S] [--sbatch "
        '"..."] [--controller-ip IP] [--timeout S]: a Slurm job of N nodes × K engines, '
        "cancelled at %distrain stop",
        _start_args,
    ),
    Subcommand("stop", "", "stop every worker and the controller (a connected cluster: leave it)"),
    Subcommand(
        "restart", "[-n N] [--network private|isolated|host]",
        "fresh workers (after a crash, to change N or the network)", _workers_and_network,
    ),
    Subcommand("status", "", "workers, hosts, GPUs, busy/idle, memory"),
    Subcommand("check", "SOURCE", "check code (a string variable's name, or code) for mistakes"),
    Subcommand(
        "connect", "[--profile NAME] [--cluster-id ID] [--file CONNECTION.json] [-n N]",
        "use the engines of a cluster started elsewhere (ipcluster start --profile NAME, "
        "SSH/MPI/Slurm launchers), once N (or as many as it started) have registered; also "
        "--profile-dir DIR, --timeout S",
        _connect_args,
    ),
    Subcommand(
        "export", "SCRIPT.py [--force]", "the session's cells as one script for torchrun",
        _export_args,
    ),
    Subcommand("reset", "", "drop every worker's variables (the process group stays)"),
    Subcommand(
        "pull", "NAME[,NAME] [--rank R]", "workers' variables into the notebook (rank 0)",
        _pull_args,
    ),
    Subcommand(
        "push", "NAME[,NAME]", "notebook variables onto every worker",
        lambda p: p.add_argument("names", type=_names("push")),
    ),
    Subcommand(
        "sync", "NAME[,NAME] [--from R]",
        "every rank takes rank R's NAME (0 by default): models and optimizers are loaded in "
        "place, anything else is replaced (after an error left a rank a step behind)",
        _sync_args,
    ),
    Subcommand(
        "debug", "[RANK] [-c COMMAND ...]",
        "pdb on the frames of the last cell's failure, on RANK (default: the rank whose error "
        "the cell showed); the prompt is the notebook's input box, or -c gives the commands",
        _debug_args,
    ),
    Subcommand(
        "where", "", "how the last cell ended on every rank (a Stop, an interrupt, an error) "
        "and each rank's stack then, the cell's lines first",
    ),
    Subcommand("vars", "", "the workers' variables: type, shape, same on every rank?"),
    Subcommand(
        "compare", "NAME",
        "is NAME the same on every rank? (x = %distrain compare NAME: x.identical, "
        "x.max_abs_diff)",
        lambda p: p.add_argument("name", type=_names("compare")),
    ),
    Subcommand(
        "auto", "on|off", "run every cell on the workers (%%local cells in the notebook)",
        lambda p: p.add_argument("mode", choices=("on", "off")),
    ),
    Subcommand(
        "heal", "on|off", "when a worker dies, a new engine takes its rank and every rank gets "
        "a survivor's variables (on by default; off: the engines are replaced, the variables "
        "lost)",
        lambda p: p.add_argument("mode", choices=("on", "off")),
    ),
)  # fmt: skip

_SUBCOMMANDS = " | ".join(f"{c.name} {c.usage}".strip() for c in SUBCOMMANDS)


def _subcommands_text() -> str:
    import textwrap

    lines = []
    for c in SUBCOMMANDS:
        lines.append(f"    %distrain {c.name} {c.usage}".rstrip())
        lines += textwrap.wrap(c.help, 92, initial_indent=" " * 8, subsequent_indent=" " * 8)
    return "\n".join(lines)


def _doc() -> str:
    return _DOC.replace("{subcommands}", _subcommands_text()) + run_parser().format_help()


class _SubParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"%distrain: {message}. Use %distrain {_SUBCOMMANDS}.")


def _subcommand_parser() -> argparse.ArgumentParser:
    p = _SubParser(prog="%distrain", add_help=False, allow_abbrev=False)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_SubParser)
    for c in SUBCOMMANDS:
        if c.name != "check":  # takes code as typed: shlex would eat its quotes
            c.arguments(sub.add_parser(c.name, add_help=False))
    return p


def _interrupt_path(shell: Any) -> str | None:
    """``api/kernels/<id>/interrupt`` for the Jupyter kernel this runs in, else None."""
    if getattr(shell, "kernel", None) is None:
        return None
    try:
        from ipykernel import get_connection_file

        name = os.path.basename(get_connection_file())
    except Exception:  # not started by a Jupyter server: no URL to call
        return None
    if not (name.startswith("kernel-") and name.endswith(".json")):
        return None
    return f"api/kernels/{name[len('kernel-') : -len('.json')]}/interrupt"


PRESTART_ENV = "NBDIST_PRESTART"


def prestart_wanted(shell: Any, configured: bool) -> bool:
    """Whether ``%load_ext nbdist`` starts the workers in the background: ``$NBDIST_PRESTART``
    (0/1) when set, else the ``prestart`` trait, in a Jupyter kernel only (a terminal IPython or
    a script has no one reading while the workers start)."""
    env = os.environ.get(PRESTART_ENV, "").strip().lower()
    if env in ("0", "false", "no", "off"):
        return False
    if env in ("1", "true", "yes", "on"):
        return True
    return configured and getattr(shell, "kernel", None) is not None


@magics_class
class DistrainMagics(Magics):
    """Holds this kernel's cluster and session; one instance per ``%load_ext nbdist``."""

    prestart = Bool(
        True,
        help="Start the workers in the background at %load_ext nbdist (in a Jupyter kernel), "
        "so that the first %%distrain cell finds them warm. Set it in ipython_config.py, or "
        "run %config DistrainMagics.prestart = False right after %load_ext to stop workers no "
        "cell has used yet. NBDIST_PRESTART=0|1 in the environment overrides it.",
    ).tag(config=True)

    def __init__(self, shell: InteractiveShell) -> None:
        super().__init__(shell)
        self.ipython = shell  # (Magics.shell may be None, this one is not)
        self.session = Session(notify=self._notify)
        self.session.interrupt_path = _interrupt_path(shell)
        self.session.live_progress = getattr(shell, "kernel", None) is not None
        self.auto = False
        self._auto_cell = False  # the cell being run is one auto mode sent to the workers
        self._prestarted = False  # workers started at %load_ext that no command has used yet
        shell.input_transformers_cleanup.append(self._transform)
        # The number IPython gives the cell that runs (In [12]): by the time a cell magic runs,
        # the shell's count is the next cell's, for a cell kept in the history.
        self._cell_count: int | None = None
        shell.events.register("pre_run_cell", self._cell_starts)
        shell.events.register("post_run_cell", self._cell_ends)

    @property
    def cluster(self) -> Any:
        """The workers the session runs on now (local, or connected)."""
        return self.session.cluster

    def start_in_background(self) -> bool:
        """At ``%load_ext``: begin starting the default workers (torch preloaded when it is
        installed; TensorFlow stays on demand) and return at once. Whether it began."""
        if not prestart_wanted(self.shell, self.prestart):
            return False
        import importlib.util

        from nbdist.engine import backends

        preload = next(
            (
                b.NAME
                for b in backends.all_backends()
                if b.PRELOAD_AT_START and importlib.util.find_spec(b.MODULE)
            ),
            None,
        )
        self.session.begin_prestart(preload)
        self._prestarted = True
        return True

    @observe("prestart")
    def _prestart_changed(self, change: Any) -> None:
        # getattr: the shell's config sets the trait inside Magics.__init__, before ours runs.
        if not change["new"] and getattr(self, "_prestarted", False):
            self._prestarted = False
            self.session.stop()

    @staticmethod
    def _notify(message: str) -> None:
        print(message, file=sys.stdout, flush=True)

    @line_cell_magic
    def distrain(self, line: str, cell: str | None = None) -> Any:
        self._prestarted = False
        auto, self._auto_cell = self._auto_cell, False
        if cell is None:
            return self._subcommand(line)
        self.session.phases.start()
        opts = parse_run_options(line)
        self.session.phases.mark("options")
        # Named as IPython names the cell (In [12]), its lines as the editor shows them: the
        # %%distrain line is line 1, but in a cell auto mode sends, which has none.
        count = self.ipython.execution_count if self._cell_count is None else self._cell_count
        name = CellName(count=count, first_line=1 if auto else 2)
        return self.session.run(opts, cell, self.ipython.user_ns, name)

    @cell_magic
    def local(self, line: str, cell: str) -> Any:
        """Run this cell in the notebook's own kernel (while ``%distrain auto on``).

        A cell typed with ``%%local`` on its first line never gets here: ``_transform`` takes
        the line off and the kernel runs the rest as any cell (IPython's tracebacks, ``await``,
        the history). This runs one given to ``run_cell_magic``."""
        self.ipython.run_cell(cell, store_history=False)

    def _transform(self, lines: list[str]) -> list[str]:
        """The first transform of every cell: a ``%%local`` cell runs as a plain one, in the
        notebook; with ``%distrain auto on``, a cell that starts with no ``%`` runs on the
        workers."""
        if not lines:
            return lines
        first = lines[0].strip()
        if first == "%%local":
            return lines[1:] or ["\n"]
        if not self.auto or not first or first.startswith(("%", "!", "?")):
            return lines
        self._auto_cell = True  # the cell's own first line is line 1 (see distrain)
        return ["%%distrain\n", *lines]

    def _check(self, text: str) -> None:
        """``%distrain check SOURCE``: SOURCE as typed (shlex would eat its quotes)."""
        if not text:
            raise UsageError(
                "%distrain check needs code or the name of a string variable holding it, "
                "e.g. %distrain check my_cell"
            )
        value = self.ipython.user_ns.get(text)
        source = value if isinstance(value, str) else text
        try:
            ast.parse(source)
        except SyntaxError as e:
            self._notify(
                f"nbdist check: the code does not parse (line {e.lineno}: {e.msg}); "
                "nothing was checked"
            )
            return
        self.session.report_findings(source, self.cluster.size or None, quiet=False)

    def _subcommand(self, line: str) -> Any:
        words = line.split(None, 1)
        if words and words[0] == "check":
            return self._check(words[1].strip() if len(words) > 1 else "")
        try:
            argv = shlex.split(line)
        except ValueError as e:
            raise UsageError(f"%distrain: cannot split {line!r} ({e})") from None
        if not argv:
            raise UsageError(
                f"%distrain needs a subcommand: {_SUBCOMMANDS}. "
                "To run a cell, put %%distrain (two %) on its first line."
            )
        ns = _subcommand_parser().parse_args(_joined_sbatch(argv))
        return getattr(self, f"_{ns.command}")(ns)

    # -- one method per subcommand (SUBCOMMANDS) -------------------------------------------------
    def _network(self, ns: argparse.Namespace) -> None:
        if ns.network is None:
            return
        self.session.ready()
        cluster = self.cluster
        now = cluster.network_now() if hasattr(cluster, "network_now") else None
        if ns.command == "start" and now is not None and now != ns.network:
            raise UsageError(
                f"%distrain start --network {ns.network}: the workers run on the {now} "
                f"network; %distrain restart --network {ns.network} starts them anew on it."
            )
        cluster.network_mode = ns.network

    def _start(self, ns: argparse.Namespace) -> None:
        request = slurm_request(ns)
        if request is not None:
            self.session.start_slurm(request)
            print(self.session.status_text())
            return
        self._network(ns)
        self.session.start(ns.workers)
        print(self.session.status_text())

    def _restart(self, ns: argparse.Namespace) -> None:
        self._network(ns)
        self._notify("nbdist: restarting the workers")
        self.session.restart(ns.workers)
        print(self.session.status_text())

    def _stop(self, ns: argparse.Namespace) -> None:
        print(self.session.stop())

    def _status(self, ns: argparse.Namespace) -> None:
        error = self.session.background_error
        if error is not None:
            print(f"nbdist: the workers could not be started in the background: {error}")
        print("\n".join([self.session.status_text(), *commands.status_lines(self.session)]))

    def _connect(self, ns: argparse.Namespace) -> None:
        self.session.connect(
            profile=ns.profile,
            cluster_id=ns.cluster_id,
            profile_dir=ns.profile_dir,
            url_file=ns.url_file,
            timeout=ns.timeout,
            workers=ns.workers,
        )
        print(self.cluster.connected_text())

    def _export(self, ns: argparse.Namespace) -> None:
        from nbdist.kernel.export import export_script

        path = ns.path
        if not path.endswith(".py"):
            raise UsageError(f"%distrain export: {path!r} should be a .py file, e.g. train.py")
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise UsageError(f"%distrain export: no folder {folder}; create it first.")
        try:
            written = export_script(self.session.cells, path, force=ns.force)
        except ExportError as e:
            raise UsageError(
                f"%distrain export: {e}. (Run the cells, then %distrain export train.py.)"
            ) from None
        extra = f" (and {written[1].name}, the --push data)" if len(written) > 1 else ""
        print(f"nbdist: wrote {written[0]}{extra}; how to run it is at the top of the file.")

    def _reset(self, ns: argparse.Namespace) -> None:
        print(commands.reset(self.session))

    def _pull(self, ns: argparse.Namespace) -> None:
        print(commands.pull(self.session, ns.names, ns.rank, self.ipython.user_ns))

    def _push(self, ns: argparse.Namespace) -> None:
        print(commands.push(self.session, ns.names, self.ipython.user_ns))

    def _sync(self, ns: argparse.Namespace) -> None:
        print(commands.sync(self.session, ns.names, ns.source))

    def _debug(self, ns: argparse.Namespace) -> None:
        self.session.ready()
        debug.debug(self.session, ns.rank, ns.commands, ask=input, out=print)

    def _where(self, ns: argparse.Namespace) -> None:
        self.session.ready()
        debug.where(self.session, out=print)

    def _vars(self, ns: argparse.Namespace) -> Any:
        return commands.variables(self.session)

    def _compare(self, ns: argparse.Namespace) -> Any:
        if len(ns.name) != 1:
            raise UsageError("%distrain compare takes one variable name, e.g. compare model")
        return commands.compare(self.session, ns.name[0])

    def _auto(self, ns: argparse.Namespace) -> None:
        self.auto = ns.mode == "on"
        print(
            "nbdist: auto on: every cell runs on the workers; %%local runs one in the "
            "notebook, %distrain auto off ends it"
            if self.auto
            else "nbdist: auto off: cells run in the notebook again"
        )

    def _heal(self, ns: argparse.Namespace) -> None:
        self.session.heal_lost = ns.mode == "on"
        print(
            "nbdist: heal on: when a worker dies, a new engine takes its rank (on a connected "
            "cluster without a launcher nbdist can use, the others go on alone) and every rank "
            "gets the lowest survivor's variables; DDP models are wrapped again on a new group"
            if self.session.heal_lost
            else "nbdist: heal off: a worker that dies takes the session's variables with it"
        )

    def _cell_starts(self, info: Any) -> None:
        count = self.ipython.execution_count
        self._cell_count = count - 1 if getattr(info, "store_history", False) else count

    def _cell_ends(self, result: Any) -> None:
        self._cell_count = None

    def close(self) -> None:
        if self._transform in self.ipython.input_transformers_cleanup:
            self.ipython.input_transformers_cleanup.remove(self._transform)
        for event, callback in (
            ("pre_run_cell", self._cell_starts),
            ("post_run_cell", self._cell_ends),
        ):
            try:
                self.ipython.events.unregister(event, callback)
            except ValueError:
                pass
        self.session.close()


DistrainMagics.distrain.__doc__ = _doc()
