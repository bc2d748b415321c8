"""The distributed session: what lives across ``%%distrain`` cells.

One per kernel. It holds the cluster, the framework the workers have set up, the names of the
variables the workers hold (for the notices when they are lost) and the log of the cells that
built them (for ``%distrain export``). Each cell is one :class:`~nbdist.kernel.job.Job`; what a
failed job means for the session is decided in :mod:`nbdist.kernel.failures`.
"""

from __future__ import annotations

import ast
import pickle
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TextIO

from IPython.core.error import UsageError

from nbdist.engine import backends
from nbdist.engine.hardware import visible_gpus
from nbdist.engine.spec import RankSpec
from nbdist.errors import JobInterrupted
from nbdist.kernel import failures, prepare
from nbdist.kernel.checks import CheckContext, calls, check_source
from nbdist.kernel.cluster import LocalCluster, default_workers
from nbdist.kernel.curves import Segment
from nbdist.kernel.display import LiveView
from nbdist.kernel.export import CellRecord
from nbdist.kernel.exposure import check_tf_exposure, check_tf_exposure_before_start
from nbdist.kernel.job import Job, Outcome, states
from nbdist.kernel.options import RunOptions
from nbdist.kernel.relay import show_displays
from nbdist.kernel.result import DistrainResult, PerRank, RankResult
from nbdist.kernel.scan import ScanResult, run_scan
from nbdist.kernel.source import parse_cell


class Session:
    """Runs cells on a :class:`LocalCluster` and keeps track of what the workers hold."""

    def __init__(
        self,
        cluster: LocalCluster,
        *,
        out: TextIO | None = None,
        err: TextIO | None = None,
        notify: Callable[[str], None] | None = None,
        display: Callable[..., Any] | None = None,
        publish: Callable[..., Any] | None = None,
    ) -> None:
        self.cluster = cluster
        self._out, self._err = out, err
        self._display = display or _ipython_display
        self._publish = publish or _ipython_publish
        self._notify = notify or (lambda msg: print(msg, file=self.out))
        # The Jupyter server's interrupt URL for this kernel: what the Stop button calls.
        self.interrupt_path: str | None = None
        self.view: LiveView | None = None  # the running cell's live view
        self.framework: str | None = None  # what the workers have set up
        self.variables: list[str] = []  # what the workers hold, as of the last cell
        self.cells: list[CellRecord] = []  # the cells that built it, for %distrain export
        self.curve: list[Segment] = []  # the loss curves of its training cells, continued
        self._run_id = 0
        self._engines: tuple[tuple[int, int], ...] = ()  # (engine id, pid) the variables live on

    @property
    def out(self) -> TextIO:
        return self._out or sys.stdout

    @property
    def err(self) -> TextIO:
        return self._err or sys.stderr

    # -- the workers' state ----------------------------------------------------------------------
    def forget(self) -> None:
        """The workers hold nothing any more (reset, restart, a rebuilt group)."""
        self.variables, self.cells, self.curve = [], [], []
        self._engines = self._engine_ids()

    def _engine_ids(self) -> tuple[tuple[int, int], ...]:
        # Ids alone repeat after a restart (a new controller counts from 0 again).
        return tuple((e.engine_id, e.pid) for e in self.cluster.engines)

    def note_engines(self, why: str = "the workers were restarted") -> None:
        """After anything that may have replaced the engines: say what was lost, once."""
        if self._engine_ids() == self._engines:
            return
        if self.variables:
            self._notify(
                f"nbdist: {why}; their variables ({', '.join(self.variables)}) are gone: "
                "re-run the cells that build them."
            )
        self.forget()

    def drop(self, framework: str, why: str) -> None:
        """Every worker drops its variables and its part of the group, with a notice."""
        names = failures.drop(self.cluster, framework, list(range(self.cluster.size)))
        if names:
            self._notify(f"nbdist: {why}; the workers' variables ({', '.join(names)}) were dropped")
        self.forget()

    def report_findings(self, source: str, workers: int | None, *, quiet: bool = True) -> list:
        """Show what the mistakes checker finds in ``source``, one line each."""
        if self.cluster.running:
            gpus = sum(e.gpu is not None for e in self.cluster.engines)
        else:
            gpus = len(visible_gpus())
        context = CheckContext(world_size=workers or default_workers(), gpus=gpus)
        findings = check_source(source, context)
        for finding in findings:
            self._notify(str(finding))
        if not findings and not quiet:
            self._notify("nbdist check: no distributed-training mistakes found")
        return findings

    # -- a cell ----------------------------------------------------------------------------------
    def run(self, opts: RunOptions, source: str, user_ns: dict[str, Any]) -> Any:
        """Run ``source`` on the workers; returns what the cell shows (its last value)."""
        self.view = None
        tree = parse_cell(source)
        if opts.check_only:
            self.report_findings(source, opts.workers, quiet=False)
            return None
        if opts.scan is not None:
            return self._scan(opts, source, user_ns)
        result, shown = self._run(opts, source, tree, user_ns)
        if opts.out is not None:
            user_ns[opts.out] = result
        return None if source.rstrip().endswith(";") else shown

    def _scan(self, opts: RunOptions, source: str, user_ns: dict[str, Any]) -> ScanResult:
        first, tree = opts.scan[0], parse_cell(source)

        def run(n: int) -> DistrainResult:
            # One figure for the whole scan; the checker's warnings once, before the first run.
            single = replace(opts, workers=n, scan=None, plot=False, out=None, fresh=True,
                             check=opts.check and n == first)  # fmt: skip
            return self._run(single, source, tree, user_ns)[0]

        scan = run_scan(
            run, opts.scan, plot=opts.plot, display=self._display,
            out=lambda text: print(text, file=self.out),
        )  # fmt: skip
        if opts.out is not None:
            user_ns[opts.out] = scan
        return scan

    def _plan(
        self, opts: RunOptions, source: str, tree: ast.Module, user_ns: dict[str, Any]
    ) -> tuple[str, int, list[RankSpec], list[RankSpec]]:
        """Check the flags, have the cluster and the rendezvous ready; (framework, world size,
        one spec per rank that runs the cell, the specs of the ranks ``--on`` leaves out)."""
        framework = prepare.choose_framework(tree, opts, self.framework)
        prepare.check_flags(opts, framework)
        push = prepare.check_push(opts.push, user_ns)
        if opts.check:
            self.report_findings(source, opts.workers or self.cluster.size or None)
        cluster = self.cluster
        options = prepare.backend_options(opts)
        if opts.workers is not None or not cluster.running:  # known before touching the cluster
            expected = opts.workers or default_workers()
            _check_ranks(opts, backends.load(framework).workers_used(options, expected))
        if not cluster.running:
            prepare.check_gpus(opts, gpus=bool(visible_gpus()))
            check_tf_exposure_before_start(framework, options, allowed=opts.expose_tf)
        cluster.preload = framework  # engines started from here on import it as they start
        cluster.ensure(opts.workers)
        self.note_engines("the workers were restarted or resized")
        prepare.check_gpus(opts, gpus=any(e.gpu for e in cluster.engines))
        available = cluster.size
        if opts.workers is not None:  # a connected cluster may have more engines than asked for
            available = min(opts.workers, available)
        world = backends.load(framework).workers_used(options, available)
        check_tf_exposure(cluster, framework, options, allowed=opts.expose_tf, notify=self._notify)
        _check_ranks(opts, world)
        prepare.warm_up(cluster, framework)
        live = cluster.rendezvous.get(framework)
        if live is not None and live.key != prepare.rendezvous_key(cluster, framework, opts, world):
            self.drop(framework, "a new process group was needed for these flags")
        envs = prepare.rendezvous(cluster, framework, opts, world, options)
        self.note_engines("the workers were restarted")
        self.framework = framework
        self._run_id += 1
        job_ranks = list(opts.on) if opts.on is not None else list(range(world))
        every = [
            RankSpec(
                run_id=self._run_id,
                framework=framework,
                source=source,
                filename=f"<%%distrain cell {self._run_id}>",
                rank=e.rank,
                world_size=world,
                local_rank=e.local_rank,
                local_world_size=min(e.local_world_size, world),
                env=envs[e.rank],
                options=options,
                push=push,
                pull=opts.pull if e.rank == job_ranks[0] else (),
                autolog=opts.autolog,
                fresh=opts.fresh,
            )
            for e in cluster.engines[:world]
        ]
        specs = [every[r] for r in job_ranks]
        left_out = [s for s in every if s.rank not in job_ranks]
        return framework, world, specs, left_out

    def _run(
        self, opts: RunOptions, source: str, tree: ast.Module, user_ns: dict[str, Any]
    ) -> tuple[DistrainResult, Any]:
        framework, world, specs, left_out = self._plan(opts, source, tree, user_ns)
        live_view = LiveView(
            len(specs),
            plot=opts.plot,
            smoothing=opts.smoothing,
            display=self._display,
            interrupt_path=self.interrupt_path,
            expect_metrics=may_log(tree, opts.autolog),
            logy=opts.logy,
            earlier=self.curve,
            hosts=[self.cluster.engines[s.rank].host for s in specs],
        )
        self.view = live_view
        job = Job(self.cluster, specs, opts=opts, live=live_view, out=self.out, err=self.err,
                  world=world, left_out=left_out)  # fmt: skip
        try:
            return self._finish(job, framework, world, opts, source, user_ns)
        except KeyboardInterrupt:
            # An interrupt outside the watch loop's own handling (a second one while the ranks
            # were being stopped, or one while the results were being shown): stop what may
            # still run and leave a clean session, never a raw traceback or a half state.
            raise self._interrupted(job, framework) from None

    def _interrupted(self, job: Job, framework: str) -> JobInterrupted:
        self.cluster.rendezvous.pop(framework, None)  # whatever the ranks did: a new group
        names: list[str] = []
        try:
            # Not when clean-up replaced the engines and was interrupted: the cluster is stopped
            # then (see LocalCluster.replace_engines), and the next cell starts a new one.
            if self.cluster.running and max(job.ranks) < self.cluster.size:
                self.cluster.interrupt(job.ranks)
                names = failures.drop(self.cluster, framework, list(range(self.cluster.size)))
        except KeyboardInterrupt:  # yet another: the rendezvous is gone already, that is enough
            pass
        lost = sorted({*names, *self.variables})
        self.forget()
        error = JobInterrupted(
            "interrupted (Stop button or Kernel > Interrupt); stopped ranks "
            f"{', '.join(map(str, job.ranks))}."
        )
        state = "dropped" if self.cluster.running else "stopped"
        error.state = failures.state_line(state, lost, connected_stale=self.cluster.stale)
        return error

    def _finish(
        self,
        job: Job,
        framework: str,
        world: int,
        opts: RunOptions,
        source: str,
        user_ns: dict[str, Any],
    ) -> tuple[DistrainResult, Any]:
        """Run the job, settle the session, show the results; the value to show."""
        live_view = job.live
        specs = job.specs
        outcome = job.run()
        state, dropped = failures.settle(self.cluster, outcome, framework)
        meta = outcome.meta
        detail = (
            f", global batch {meta['global_batch']} = {meta['per_replica_batch']} per replica "
            f"x {len(specs)}"
            if meta.get("global_batch")
            else ""
        )
        summary = live_view.finish(
            outcome.history, states(outcome.ars, outcome.watch), wall=outcome.wall,
            framework=framework, detail=detail,
        )  # fmt: skip
        if summary is not None:
            print(summary, file=self.out, flush=True)
        segment = live_view.agg.segment()
        if segment is not None:
            self.curve.append(segment)
        show_displays(outcome.ars, outcome.ranks, self._publish)
        error = failures.error_for(outcome, opts)
        if state in ("dropped", "replaced"):
            lost = sorted({*dropped, *self.variables}) if state == "replaced" else dropped
            self.forget()
            if error is not None:
                error.state = failures.state_line(state, lost, connected_stale=self.cluster.stale)
        elif error is not None:
            error.state = failures.state_line(state, [], connected_stale=self.cluster.stale)
        if error is not None:
            raise error
        reports = outcome.reports
        if not opts.fresh:
            names = reports[0].names
            self.variables = names if opts.on is None else sorted({*self.variables, *names})
        self.cells.append(
            CellRecord(
                source=source,
                framework=framework,
                world_size=world,
                autolog=opts.autolog,
                push=specs[0].push,
                strategy=opts.strategy,
                backend=opts.backend,
                fresh=opts.fresh,
                on=opts.on,
            )  # fmt: skip
        )
        result = _result(outcome, framework)
        pull_errors = [r.pull_error for r in reports.values() if r.pull_error]
        if pull_errors:
            raise UsageError(f"%%distrain: {pull_errors[0]} (the cell itself ran).")
        user_ns.update(reports[0].pulled)
        return result, shown_value(result)


def _result(outcome: Outcome, framework: str) -> DistrainResult:
    reports = outcome.reports
    return DistrainResult(
        framework=framework,
        world_size=len(outcome.ranks),
        wall=outcome.wall,
        ranks=tuple(
            RankResult(
                rank=rank,
                host=reports[p].host,
                value=reports[p].value,
                value_repr=reports[p].value_repr,
                wall=reports[p].wall,
                stdout=outcome.ars[p].stdout or "",
                stderr=outcome.ars[p].stderr or "",
            )
            for p, rank in enumerate(outcome.ranks)
        ),
        history=tuple({**h, "rank": outcome.ranks[h["rank"]]} for h in outcome.history),
    )


def _check_ranks(opts: RunOptions, world: int) -> None:
    for flag, ranks in (("--ranks", opts.ranks), ("--on", opts.on)):
        if ranks is not None and max(ranks) >= world:
            raise UsageError(
                f"%%distrain: {flag} {max(ranks)} does not exist; ranks go from 0 to {world - 1}."
            )


def shown_value(result: DistrainResult) -> Any:
    """What the cell shows, as IPython would: the value when every rank's is the same, one
    labelled entry per rank when they differ, nothing when there is no value."""
    ranks = result.ranks
    if all(r.value_repr is None for r in ranks):
        return None
    if all(r.value_repr == ranks[0].value_repr for r in ranks) and _same(ranks):
        first = ranks[0]
        return first.value if first.value is not None else _Repr(first.value_repr)
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


def may_log(tree: ast.Module, autolog: bool) -> bool:
    """Whether the cell records metrics: it calls ``log``, or autolog sees ``backward``/``fit``."""
    names = ("log", "backward", "fit") if autolog else ("log",)
    return any(calls(tree, *names))


def _ipython_display(*objs: Any, **kwargs: Any) -> Any:
    from IPython.display import display

    return display(*objs, **kwargs)


def _ipython_publish(data: dict, metadata: dict) -> None:
    from IPython.display import publish_display_data

    publish_display_data(data, metadata)
