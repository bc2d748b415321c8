"""The distributed session: what lives across ``%%distrain`` cells.

One per kernel. It holds the workers (a :class:`~nbdist.kernel.local.LocalCluster` or a
:class:`~nbdist.kernel.connected.ConnectedCluster`: ``connect`` and ``stop`` choose, and nothing
else asks which), what they have set up (the framework, its warm engines and live rendezvous,
whether ``--expose-tf`` was told), the names of the variables the workers hold (for the notices
when they are lost), the log of the cells that built them (for ``%distrain export``) and their
loss curves. Each cell is one :class:`~nbdist.kernel.cell.Cell`, whose outcome the session
applies. When the engines change, the cluster tells the session (``on_change``): what lived on
them is forgotten, and the user told once, with the note of what changed.
"""

from __future__ import annotations

import ast
import pickle
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TextIO

from IPython.core.error import UsageError

from nbdist.engine.hardware import visible_gpus
from nbdist.errors import WorkerError
from nbdist.kernel import healing, regroup
from nbdist.kernel.breakpoints import Desk
from nbdist.kernel.cell import Cell
from nbdist.kernel.checks import CheckContext, check_source
from nbdist.kernel.cluster import Cluster
from nbdist.kernel.connected import ConnectedCluster
from nbdist.kernel.curves import Segment
from nbdist.kernel.debug import FailedCell, debug_hint
from nbdist.kernel.display import HEALED, LiveView
from nbdist.kernel.engines import DEAD_ADVICE, HEAL_ADVICE
from nbdist.kernel.export import CellRecord
from nbdist.kernel.local import LocalCluster, default_workers
from nbdist.kernel.options import RunOptions
from nbdist.kernel.phases import Phases
from nbdist.kernel.prepare import Rendezvous
from nbdist.kernel.prestart import Prestart
from nbdist.kernel.relay import without_addresses
from nbdist.kernel.result import DistrainResult, PerRank, RankResult
from nbdist.kernel.scan import ScanResult, run_scan
from nbdist.kernel.source import dotted_imports, parse_cell
from nbdist.protocol import CellName, SessionState


class Session:
    """Runs cells on the workers and keeps track of what the workers hold."""

    def __init__(
        self,
        *,
        out: TextIO | None = None,
        err: TextIO | None = None,
        notify: Callable[[str], None] | None = None,
        display: Callable[..., Any] | None = None,
        publish: Callable[..., Any] | None = None,
    ) -> None:
        self._out, self._err = out, err
        self.display = display or _ipython_display
        self.publish = publish or _ipython_publish
        self.notify = notify or (lambda msg: print(msg, file=self.out))
        self.cluster: Cluster = self._local()
        self.prestart: Prestart | None = None
        # The Jupyter server's interrupt URL for this kernel: what the Stop button calls.
        self.interrupt_path: str | None = None
        # Whether the ranks' unfinished lines (progress bars) are shown as they change: a front
        # end updates a display in place; a terminal would print each update on a new line.
        self.live_progress = False
        self.view: LiveView | None = None  # the running cell's live view
        self.framework: str | None = None  # what the workers have set up
        self.warm: set[str] = set()  # frameworks the engines have imported
        self.rendezvous: dict[str, Rendezvous] = {}  # each framework's live one
        self.exposure_told = False  # --expose-tf's notice shown for these workers
        self.variables: list[str] = []  # what the workers hold, as of the last cell
        self.phases = Phases()  # where the last cell's time went
        self.carried: healing.Carried | None = None  # saved at a Slurm job's time limit
        self.heal_lost = True  # %distrain heal off: a lost rank takes the variables with it
        self.cells: list[CellRecord] = []  # the cells that built it, for %distrain export
        self.curve: list[Segment] = []  # the loss curves of its training cells, continued
        self.curve_key: str | None = None  # the model they trained (Recorder.model's key)
        # Ranks of a connected cluster still running a cell nbdist gave up on: which cell.
        self.still_running: dict[int, str] = {}
        self.failed: FailedCell | None = None  # the last cell, if it failed: %distrain debug
        self.breakpoints = Desk()  # where a rank at breakpoint() reaches the notebook
        self._run_id = 0
        self._changes: list[str | None] = []  # the engines changed: what to tell, not yet told

    @property
    def out(self) -> TextIO:
        return self._out or sys.stdout

    @property
    def err(self) -> TextIO:
        return self._err or sys.stderr

    def next_run_id(self) -> int:
        self._run_id += 1
        return self._run_id

    # -- the workers -----------------------------------------------------------------------------
    def _local(self) -> LocalCluster:
        cluster = LocalCluster(notify=self.notify)
        cluster.on_change = self._engines_changed
        return cluster

    def begin_prestart(self, preload: str | None) -> None:
        """Begin starting the default workers in the background (``%load_ext``)."""
        if (
            self.cluster.running
            or self.prestart is not None
            or not isinstance(self.cluster, LocalCluster)
        ):
            return
        self.cluster.preload = preload
        self.prestart = Prestart(self.cluster)
        self.prestart.begin()

    def ready(self) -> None:
        """Whatever the background start left: its notices shown, its client attached."""
        if self.prestart is not None:
            self.prestart.finish()

    @property
    def background_error(self) -> BaseException | None:
        """Why the background start failed (None if it did not, or was never begun)."""
        return None if self.prestart is None else self.prestart.error

    def ensure(self, n: int | None, *, preload: str | None = None) -> None:
        """Workers ready for a cell on ``n`` of them: the background start's error raised once,
        engines that died since the last cell replaced, late engines ranked, the cluster
        started or resized."""
        if self.prestart is not None:
            self.prestart.raise_error()
        cluster = self.cluster
        if preload is not None:
            cluster.preload = preload  # engines started from here on import it as they start
        self.replace_dead()
        if cluster.running and cluster.newcomers():
            cluster.take_newcomers()
            self.apply_changes()
        if not cluster.running:
            self.exposure_told = False
        cluster.ensure(n, note="the workers were restarted or resized")
        self.apply_changes()

    def start(self, n: int | None) -> None:
        """``%distrain start``: start the workers, or resize the running ones."""
        self.ready()
        cluster = self.cluster
        if cluster.running:
            cluster.ensure(n, note="the workers were resized")
        else:
            if self.prestart is not None:
                self.prestart.raise_error()
            self.exposure_told = False
            cluster.ensure(n)
        self.apply_changes()

    def restart(self, n: int | None) -> None:
        self.ready()
        self.exposure_told = False
        self.cluster.restart(n)
        self.apply_changes()

    def stop(self) -> str:
        """``%distrain stop``: a local cluster stops, a connected one is left (its engines keep
        running) for a local one not started yet. What happened, in words."""
        cluster = self.cluster
        if self.prestart is not None:
            self.prestart.cancel()
        was = cluster.running
        connected = isinstance(cluster, ConnectedCluster)
        # A connected cluster's engines are not stopped: one sentence says so, and what they
        # hold (nothing "stopped", nothing "gone", as a second notice said).
        cluster.stop(note=None if connected else "the workers were stopped")
        self.apply_changes()
        if isinstance(cluster, ConnectedCluster):
            self.cluster = self._local()
            return cluster.left_text() if was else "nbdist: no cluster was running"
        return "nbdist: cluster stopped" if was else "nbdist: no cluster was running"

    def connect(self, **how: Any) -> None:
        """``%distrain connect``: attach to a cluster started elsewhere; its engines become the
        workers (the local ones, or a background start, are left first)."""
        if self.prestart is not None:
            self.prestart.cancel()  # workers begun at %load_ext are not wanted now
        old = self.cluster
        connected = ConnectedCluster(notify=self.notify)
        connected.on_change = self._engines_changed

        def leave() -> None:
            if old.running:
                self.notify("nbdist: leaving the current cluster for the one to connect to")
                old.stop(note="the notebook left its workers for the connected cluster")

        connected.connect(before=leave, **how)
        self.cluster = connected
        self.exposure_told = False
        self.apply_changes()

    def start_slurm(self, request: Any) -> None:
        """``%distrain start --slurm``: a Slurm job's engines become the workers (the current
        ones are left once Slurm accepted the request). A session kept at the last job's time
        limit (:meth:`_keep_for_next_job`) goes on on the new job's ranks."""
        from nbdist.kernel.slurm import SlurmJobCluster

        if self.prestart is not None:
            self.prestart.cancel()
        old = self.cluster
        job = SlurmJobCluster(request, notify=self.notify)
        job.on_change = self._engines_changed
        carried, kept = self.carried, (self.cells, self.curve, self.curve_key)

        def leave() -> None:
            if old.running:
                self.notify("nbdist: leaving the current workers for the Slurm job's")
                why = "the notebook left its workers for a Slurm job's"
                old.stop(note=None if carried else why)

        job.start_job(before=leave)
        self.cluster = job
        self.exposure_told = False
        self.apply_changes()
        if carried is not None:
            names = healing.carry_in(job, carried)
            self.carried = None
            self.variables = names
            self.cells, self.curve, self.curve_key = kept
            self.notify(
                f"nbdist: the session goes on: every rank got the saved variables "
                f"({', '.join(names) or 'none'}); the next cell wraps "
                f"{', '.join(sorted(carried.rewrap)) or 'no model'} in DistributedDataParallel "
                "again, on the new job's group"
            )

    def _before_time_limit(self) -> None:
        """A cell asked for within ``--warn`` of the Slurm job's time limit (its warning came
        between cells, or is near): the session goes to the notebook first, and the cell does
        not start on a job about to end."""
        from nbdist.kernel.slurm import SlurmJobCluster

        cluster = self.cluster
        if not isinstance(cluster, SlurmJobCluster) or (near := cluster.near_end()) is None:
            return
        saved = ""
        framework = self.framework
        if self.carried is None and self.variables and framework and healing.can_carry(framework):
            saved = f"{self._carry_out(cluster, framework).text()}; "
        elif self.carried is not None:
            saved = "the session's variables are saved in the notebook; "
        saved = saved[:1].upper() + saved[1:]
        raise UsageError(
            f"%%distrain: {near}, its time limit: the cell did not start. {saved}"
            f"%distrain start --slurm {cluster.request.words()} "
            + ("goes on with them on a new job." if saved else "starts a new job.")
        )

    def _keep_for_next_job(self, error: Any, framework: str) -> None:
        """A cell stopped by the Slurm job's time-limit warning: the session's variables come
        to the notebook, for the next ``%distrain start --slurm`` (torch only)."""
        from nbdist.kernel.slurm import SlurmJobCluster

        cluster = self.cluster
        if not isinstance(cluster, SlurmJobCluster) or not healing.can_carry(framework):
            return
        try:
            carried = self._carry_out(cluster, framework)
        except Exception as e:  # noqa: BLE001 - said; the job still runs
            error.state = f"{error.state} The session could not be saved ({e})."
            return
        error.state = (
            f"{carried.text()[0].upper()}{carried.text()[1:]}, and the group left. "
            f"%distrain start --slurm {cluster.request.words()} gives them to a new job's "
            "ranks (it cancels this one); a cell on this job before its end wraps the models "
            "again on a new group."
        )

    def _carry_out(self, cluster: Any, framework: str) -> healing.Carried:
        """The session to the notebook (``self.carried``): every rank left the group, so the
        next cell on these engines makes a new one."""
        from nbdist.engine import backends

        self.carried = healing.carry_out(cluster, framework, self.imports())
        if not backends.load(framework).KEEPS_RENDEZVOUS_AFTER_FAILURE:
            self.rendezvous.pop(framework, None)
        return self.carried

    def close(self) -> None:
        if self.prestart is not None:
            self.prestart.cancel()
        self.cluster.stop()
        self.breakpoints.close()

    def status_text(self) -> str:
        self.ready()
        return self.cluster.status_text(
            self.warm, advice=self.dead_advice(), running=self.still_running
        )

    def dead_advice(self) -> str:
        """What the next cell does about ranks that died between cells."""
        if not self.heal_lost or not self.cluster.running:
            return DEAD_ADVICE
        dead = self.cluster.dead(range(self.cluster.size))
        can = healing.why_not(self.cluster, self.framework, dead, variables=bool(self.variables))
        return HEAL_ADVICE if can is None else DEAD_ADVICE

    def _engines_changed(self, note: str | None) -> None:
        """The cluster's engines changed: what was set up on them is gone; the variables are
        forgotten at the next :meth:`apply_changes` (with ``note`` told), or by the cell that
        caused it (None: its error tells)."""
        self.warm.clear()
        self.rendezvous.clear()
        self._changes.append(note)

    def apply_changes(self) -> None:
        """After anything that may have changed the engines: say what was lost, once."""
        if not self._changes:
            return
        notes = [n for n in self._changes if n]
        if notes and self.variables:
            self.notify(
                f"nbdist: {notes[0]}; their variables ({', '.join(self.variables)}) are gone: "
                "re-run the cells that build them."
            )
        self.forget()

    # -- the workers' state ----------------------------------------------------------------------
    def forget(self) -> None:
        """The workers hold nothing any more (reset, restart, a rebuilt group)."""
        self.variables, self.cells, self.curve, self.curve_key = [], [], [], None
        self._changes = []

    def replace_dead(self) -> None:
        """Engines that died since the last cell (a worker that exited, ``kill -9``, the
        out-of-memory killer) are named, and the engines replaced (on a connected cluster: the
        others go on), before anything runs."""
        cluster = self.cluster
        if not cluster.running or not cluster.engines or cluster.stale:
            return  # a connected cluster that needs a restart has said so already
        dead = cluster.dead(range(cluster.size))
        if not dead:
            return
        gone = cluster.gone_text(dead, when=" after its last cell")
        if self.heal(dead, gone=gone) is not None:
            return
        cluster.replace_dead(dead, gone)
        self.apply_changes()

    def heal(
        self,
        dead: list[int],
        *,
        framework: str | None = None,
        variables: bool | None = None,
        gone: str | None = None,
        notify: Any = None,
        interrupted: bool = False,
        running: ast.Module | None = None,
    ) -> healing.Healed | None:
        """Rebuild the dead ranks from a survivor, the variables kept (``nbdist.kernel
        .healing``); None where it cannot, or ``%distrain heal off`` (the engines are then
        replaced as before). ``framework`` and ``variables`` default to the session's (a cell
        that lost ranks passes its own, and its source: ``running``); ``notify`` to the
        session's."""
        if not self.heal_lost:
            return None
        framework = framework or self.framework
        held = bool(self.variables) if variables is None else variables
        changes = len(self._changes)
        healed = healing.try_heal(
            self.cluster, framework, dead, variables=held, notify=notify or self.notify,
            announce=self.notify, gone=gone, interrupted=interrupted,
            imports=self.imports(running),
        )  # fmt: skip
        if healed is not None and framework is not None:  # (a healing had a framework)
            del self._changes[changes:]  # engines a TensorFlow healing replaced: nothing lost
            if self.curve:  # the healed models are new objects: the next cell's curve goes on
                self.curve_key = HEALED
            self.warm.clear()  # the new engines import the framework at the next cell
            self.rendezvous.pop(framework, None)  # the next cell makes a new group
        return healed

    def imports(self, running: ast.Module | None = None) -> tuple[str, ...]:
        """The dotted modules the session's cells (and the ``running`` one) imported
        (:func:`~nbdist.kernel.source.dotted_imports`)."""
        found = dotted_imports(running) if running is not None else set()
        for record in self.cells:
            if record.kind == "cell":
                found |= dotted_imports(parse_cell(record.source))
        return tuple(sorted(found))

    def drop(self, framework: str, why: str) -> None:
        """Every worker drops its variables and its part of the group, with a notice."""
        names = regroup.drop(
            self.cluster, self.rendezvous, framework, list(range(self.cluster.size))
        )
        if names:
            self.notify(f"nbdist: {why}; the workers' variables ({', '.join(names)}) were dropped")
        self.forget()

    def report_findings(
        self, source: str, workers: int | None, *, quiet: bool = True, cell: CellName | None = None
    ) -> list:
        """Show what the mistakes checker finds in ``source``, one line each (``cell``: the
        cell it is, whose lines the findings name as the editor shows them)."""
        if self.cluster.running:
            gpus = sum(e.gpu is not None for e in self.cluster.engines)
        else:
            gpus = len(visible_gpus())
        context = CheckContext(
            world_size=workers or default_workers(),
            gpus=gpus,
            earlier=tuple(c.source for c in self.cells if c.kind == "cell"),
            earlier_cells=tuple(c.name for c in self.cells if c.kind == "cell"),
            cell=cell,
        )
        findings = check_source(source, context)
        for finding in findings:
            self.notify(str(finding))
        if not findings and not quiet:
            self.notify("nbdist check: no distributed-training mistakes found")
        return findings

    # -- a cell ----------------------------------------------------------------------------------
    def run(
        self,
        opts: RunOptions,
        source: str,
        user_ns: dict[str, Any],
        cell: CellName | None = None,
    ) -> Any:
        """Run ``source`` on the workers; returns what the cell shows (its last value).
        ``cell``: how the notebook names it (its execution count, its first line)."""
        self.view = None
        cell = cell or CellName()
        tree = parse_cell(source, cell)
        if opts.check_only:
            self.report_findings(source, opts.workers, quiet=False, cell=cell)
            return None
        if opts.scan is not None:
            return self._scan(opts, source, user_ns, cell)
        result, shown = self._run(opts, source, tree, user_ns, cell)
        if opts.out is not None:
            user_ns[opts.out] = result
        return None if source.rstrip().endswith(";") else shown

    def _scan(
        self, opts: RunOptions, source: str, user_ns: dict[str, Any], cell: CellName
    ) -> ScanResult:
        sizes = opts.scan
        assert sizes is not None  # (the caller runs a scan for --scan)
        first, tree = sizes[0], parse_cell(source, cell)

        def run(n: int) -> DistrainResult:
            # One figure for the whole scan; the checker's warnings once, before the first run.
            single = replace(opts, workers=n, scan=None, plot=False, out=None, fresh=True,
                             check=opts.check and n == first)  # fmt: skip
            return self._run(single, source, tree, user_ns, cell)[0]

        scan = run_scan(
            run, sizes, plot=opts.plot, display=self.display,
            out=lambda text: print(text, file=self.out),
        )  # fmt: skip
        if opts.out is not None:
            user_ns[opts.out] = scan
        return scan

    def _run(
        self,
        opts: RunOptions,
        source: str,
        tree: ast.Module,
        user_ns: dict[str, Any],
        cell: CellName | None = None,
    ) -> tuple[DistrainResult, Any]:
        """One cell, and its outcome applied to the session."""
        self.ready()
        self._before_time_limit()
        self.failed = None
        done = Cell(self, opts, source, tree, user_ns, cell).run()
        if done.error is not None and done.result is None:  # not a graceful stop's notice
            self.failed = FailedCell.of(done.error, (cell or CellName()).label)
            if isinstance(done.error, WorkerError) and done.state != SessionState.REPLACED:
                done.error.notes.append(debug_hint(self.failed.raised[0]))
        if done.state in (SessionState.DROPPED, SessionState.REPLACED, SessionState.STOPPED):
            self.forget()
        if done.error is not None and done.result is None:
            if done.state in (SessionState.KEPT, SessionState.REBUILT) and not opts.fresh:
                self.variables = done.names
            raise done.error
        result, plan = done.result, done.plan
        assert result is not None and plan is not None  # (the cell ran: an error was raised)
        if not opts.fresh:
            self.variables = (
                done.names if opts.on is None else sorted({*self.variables, *done.names})
            )
        self.cells.append(
            CellRecord(
                source=source,
                framework=result.framework,
                world_size=plan.world,
                autolog=opts.autolog,
                push=plan.push,
                strategy=opts.strategy,
                backend=opts.backend,
                fresh=opts.fresh,
                on=opts.on,
                nodes=_nodes(self.cluster.engines[: plan.world]),
                slurm_job=_slurm_job(self.cluster.engines[: plan.world]),
                name=cell or CellName(),
            )  # fmt: skip
        )
        if done.error is not None:  # a graceful stop: the cell is taken in, then the notice
            if getattr(done.error, "outside", False):
                self._keep_for_next_job(done.error, result.framework)
            raise done.error
        if done.pull_error is not None:
            raise UsageError(f"%%distrain: {done.pull_error} (the cell itself ran).")
        user_ns.update(done.pulled)
        shown = shown_value(result)
        self.phases.mark("result")
        return result, shown


def _nodes(engines: Any) -> tuple[tuple[str, str, str | None, int], ...]:
    """The machines ``engines`` run on, in rank order: (hostname, address, interface, count)."""
    nodes: dict[str, list[Any]] = {}
    for e in engines:
        nodes.setdefault(e.address, []).append(e)
    return tuple((es[0].host, a, es[0].interface, len(es)) for a, es in nodes.items())


def _slurm_job(engines: Any) -> str | None:
    """The Slurm job every one of ``engines`` runs in, else None."""
    jobs = {e.slurm.job if e.slurm is not None else None for e in engines}
    return jobs.pop() if len(jobs) == 1 else None


def shown_value(result: DistrainResult) -> Any:
    """What the cell shows, as IPython would: the value when every rank's is the same, one
    labelled entry per rank when they differ, nothing when there is no value."""
    ranks = result.ranks
    if all(r.value_repr is None for r in ranks):
        return None
    # A value whose repr holds a memory address (<History object at 0x7fcf...>) is the same
    # on every rank when nothing else differs.
    first_repr = without_addresses(ranks[0].value_repr or "")
    if all(without_addresses(r.value_repr or "") == first_repr for r in ranks) and _same(ranks):
        first = ranks[0]
        return first.value if first.value is not None else _Repr(first.value_repr or "")
    return PerRank(
        [r.value if r.value is not None else _Repr(r.value_repr or "None") for r in ranks],
        [r.rank for r in ranks],
    )


def _same(ranks: tuple[RankResult, ...]) -> bool:
    try:
        dumps = {pickle.dumps(r.value) for r in ranks}
    except Exception:  # repr equality was all there is to go on
        return True
    return len(dumps) == 1


class _Repr:
    """A value that could not come back from the workers: shown by its repr."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _ipython_display(*objs: Any, **kwargs: Any) -> Any:
    from IPython.display import display

    return display(*objs, **kwargs)


def _ipython_publish(data: dict, metadata: dict) -> None:
    from IPython.display import publish_display_data

    publish_display_data(data, metadata)
