"""One ``%%distrain`` cell, top to bottom: plan, submit and watch, settle, result.

:meth:`Cell.run` reads as the cell's life:

1. **plan** — the framework, the flags checked against it, the data to push; the workers made
   ready (engines that died since the last cell replaced, newcomers ranked, the cluster started
   or resized, the framework imported, the rendezvous made or kept); one
   :class:`~nbdist.protocol.RankSpec` per rank.
2. **submit and watch** — :class:`~nbdist.kernel.job.Job` sends every rank its task, relays
   what they print and log, and escalates when something goes wrong (interrupt, free, kill:
   see :mod:`nbdist.kernel.job`). Engines that died or had to be killed are given up here, in
   one place (``cluster.lose``): a local cluster replaces them all, a connected one goes on
   with the engines that answer.
3. **settle** — what the cell leaves of the session (:class:`~nbdist.protocol.SessionState`;
   the steps are :mod:`nbdist.kernel.regroup`'s):

   * **kept** — the ranks that failed raised on their own (a typo, a shape error), the others
     finished, no rank had to be freed or stopped, and a check that cannot hang (a barrier
     with a timeout) passes on every rank. As in a Python REPL, the variables stay.
   * **rebuilt** — anything that may have broken the group: one rank raised while others
     waited in a collective, an interrupt that found no step boundary, ``--timeout``, a
     stall, a failed check. Every rank leaves the group with its variables kept (DDP models
     unwrapped first: destroying a gloo group under a live DDP model can deadlock); the next
     cell makes a new rendezvous and wraps them again. Whether the replicas still agree is
     said.
   * **healed** — a rank died or had to be killed: a new engine took it, and got a
     survivor's variables (:mod:`nbdist.kernel.healing`).
   * **dropped** — what cannot be rebuilt: sharded state (FSDP2), or the survivors of a
     connected cluster that lost engines with healing off. Every rank drops its variables.
   * **replaced** — a rank was lost and not healed, or SIGINT interrupted a framework that
     cannot go on after it (TensorFlow: ``SURVIVES_INTERRUPT``): the engines were replaced,
     and their variables went with them.
4. **result** — the :class:`CellOutcome`: the state, the names lost, and the result to show
   or the one error to raise (:mod:`nbdist.kernel.failures` words it). The session applies it.
"""

from __future__ import annotations

import ast
import uuid
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from IPython.core.error import UsageError

from nbdist.engine import backends
from nbdist.engine.hardware import visible_gpus
from nbdist.engine.profiling import SKIP_STEPS
from nbdist.errors import DistrainError, JobInterrupted, WorkerError
from nbdist.kernel import breakdown, failures, prepare, regroup
from nbdist.kernel.checks import calls
from nbdist.kernel.display import HEALED, LiveView
from nbdist.kernel.exposure import check_tf_exposure, check_tf_exposure_before_start
from nbdist.kernel.figure import png_data
from nbdist.kernel.healing import interrupt_text
from nbdist.kernel.job import Job, Outcome, states
from nbdist.kernel.libraries import independent_copies
from nbdist.kernel.local import default_workers
from nbdist.kernel.options import RunOptions
from nbdist.kernel.relay import show_displays
from nbdist.kernel.result import DistrainResult, RankResult
from nbdist.kernel.source import imported_modules, loop_steps
from nbdist.protocol import CellName, RankSpec, Reason, SessionState, UnpackError

if TYPE_CHECKING:
    from nbdist.kernel.cluster import Cluster
    from nbdist.kernel.session import Session


@dataclass
class Plan:
    """What the cell runs on: its framework, the group's size, one spec per rank that runs
    it, and the specs of the ranks ``--on`` leaves out."""

    framework: str
    world: int
    specs: list[RankSpec]
    left_out: list[RankSpec]
    push: dict[str, Any] = field(default_factory=dict)  # --push's values, as in the notebook


@dataclass
class CellOutcome:
    """What a cell did to the session, and what it shows."""

    state: SessionState
    lost: list[str] = field(default_factory=list)  # the workers' variables that are gone
    error: DistrainError | None = None  # to raise, its last line saying what became of them
    result: DistrainResult | None = None
    names: list[str] = field(default_factory=list)  # the variables the workers hold now
    pulled: dict[str, Any] = field(default_factory=dict)  # --pull's values, for the notebook
    pull_error: str | None = None  # a --pull name that failed (the cell itself ran)
    warnings: tuple[str, ...] = ()
    plan: Plan | None = None


class Cell:
    """One run of ``source`` with ``opts`` in ``session``."""

    def __init__(
        self,
        session: Session,
        opts: RunOptions,
        source: str,
        tree: ast.Module,
        user_ns: dict,
        name: CellName | None = None,
    ) -> None:
        self.session = session
        self.opts = opts
        self.source = source
        self.tree = tree
        self.user_ns = user_ns
        self.name = name or CellName()
        self.job: Job | None = None
        self.replicas: regroup.Replicas | None = None  # after a rebuilt group: do they agree
        self.sharded: list[str] = []  # the variables a rebuild had to drop with the group

    @property
    def cluster(self) -> Cluster:
        return self.session.cluster

    def run(self) -> CellOutcome:
        plan = self.plan()
        job = self.submit(plan)
        phases = self.session.phases
        phases.mark("plan")
        try:
            outcome = job.watch_until_done(phases)
            if outcome.lost:
                self.give_up_lost(outcome, plan.framework)
            job.finish(outcome)
            state, dropped = self.settle(outcome, plan.framework)
            phases.mark("settle")
            if outcome.reports:
                phases.note("engine", max(r.wall for r in outcome.reports.values()))
            return self.result(outcome, plan, state, dropped)
        except KeyboardInterrupt:
            # An interrupt outside the watch loop's own handling (a second one while the ranks
            # were being stopped, or one while the results were being shown): stop what may
            # still run and leave a clean session, never a raw traceback or a half state.
            return self.interrupted(job, plan.framework)

    # -- 1. plan ---------------------------------------------------------------------------------
    def plan(self) -> Plan:
        """Check the flags, have the cluster and the rendezvous ready; one spec per rank."""
        opts, session, source = self.opts, self.session, self.source
        session.still_running = {}  # a cell given up on is done by the time another runs
        framework = prepare.choose_framework(self.tree, opts, session.framework)
        prepare.check_flags(opts, framework)
        push, packed = prepare.check_push(opts.push, self.user_ns)
        session.phases.mark("plan")
        if opts.check:
            session.report_findings(
                source, opts.workers or self.cluster.size or None, cell=self.name
            )
        session.phases.mark("checker")
        options = prepare.backend_options(opts)
        cluster = self.cluster
        if opts.workers is not None or not cluster.running:  # known before touching the cluster
            expected = opts.workers or default_workers()
            _check_ranks(opts, backends.load(framework).workers_used(options, expected))
        if not cluster.running:
            prepare.check_gpus(opts, gpus=bool(visible_gpus()))
            check_tf_exposure_before_start(framework, options, allowed=opts.expose_tf)
        session.ensure(opts.workers, preload=framework)
        cluster = self.cluster
        prepare.check_gpus(opts, gpus=any(e.gpu for e in cluster.engines))
        available = cluster.size
        if opts.workers is not None:  # a connected cluster may have more engines than asked for
            available = min(opts.workers, available)
        world = backends.load(framework).workers_used(options, available)
        session.exposure_told = check_tf_exposure(
            cluster, framework, options, allowed=opts.expose_tf, notify=session.notify,
            told=session.exposure_told,
        )  # fmt: skip
        _check_ranks(opts, world)
        prepare.warm_up(cluster, framework, session.warm)
        live = session.rendezvous.get(framework)
        if live is not None and live.key != prepare.rendezvous_key(cluster, framework, opts, world):
            session.drop(framework, "a new process group was needed for these flags")
        envs = prepare.rendezvous(cluster, framework, opts, world, options, session)
        session.apply_changes()
        session.framework = framework
        run_id = session.next_run_id()
        nonce = uuid.uuid4().hex[:16]
        job_ranks = list(opts.on) if opts.on is not None else list(range(world))
        every = [
            RankSpec(
                run_id=run_id,
                framework=framework,
                source=source,
                filename=f"<nbdist cell {run_id}>",
                cell=self.name,
                rank=e.rank,
                world_size=world,
                local_rank=e.local_rank,
                local_world_size=min(e.local_world_size, world),
                env=envs[e.rank],
                options=options,
                push=packed,
                pull=opts.pull if e.rank == job_ranks[0] else (),
                ranks=tuple(job_ranks) if opts.on is not None else (),
                nonce=nonce,
                autolog=opts.autolog,
                fresh=opts.fresh,
                profile=opts.profile or 0,
                debug=session.breakpoints.channel(),
            )
            for e in cluster.engines[:world]
        ]
        specs = [every[r] for r in job_ranks]
        left_out = [s for s in every if s.rank not in job_ranks]
        return Plan(framework=framework, world=world, specs=specs, left_out=left_out, push=push)

    # -- 2. submit and watch ---------------------------------------------------------------------
    def submit(self, plan: Plan) -> Job:
        session, opts = self.session, self.opts
        live_view = LiveView(
            len(plan.specs),
            plot=opts.plot,
            smoothing=opts.smoothing,
            display=session.display,
            interrupt_path=session.interrupt_path,
            expect_metrics=may_log(self.tree, opts.autolog),
            logy=opts.logy,
            earlier=session.curve,
            earlier_key=session.curve_key,
            hosts=[self.cluster.engines[s.rank].host for s in plan.specs],
            graceful=backends.load(plan.framework).GRACEFUL_STOP,
            expected_steps=loop_steps(self.tree),
        )
        session.view = live_view
        self.job = Job(
            self.cluster, plan.specs, opts=opts, live=live_view, out=session.out,
            err=session.err, world=plan.world, left_out=plan.left_out,
            display=session.display if session.live_progress else None,
            breakpoints=session.breakpoints,
        )  # fmt: skip
        return self.job

    def give_up_lost(self, outcome: Outcome, framework: str) -> None:
        """The ranks that died or had to be killed: a torch session is healed (new engines at
        those ranks, or the survivors alone, get a survivor's variables: ``Session.heal``),
        unless ``%distrain heal off``; else the cluster replaces its engines (a local one) or
        goes on with those that answer (a connected one: nothing is killed there)."""
        lost = [outcome.ranks[p] for p in outcome.lost]
        session = self.session
        # What the survivors hold: the variables of the cells before, and of this one.
        held = bool(session.variables) or any(r.names for r in outcome.reports.values())
        said: list[str] = []  # healed: the error's last line says so; else why not, now
        outcome.healed = session.heal(
            lost, framework=framework, variables=held, notify=said.append,
            interrupted=outcome.watch.reason == Reason.INTERRUPT, running=self.tree,
        )  # fmt: skip
        if outcome.healed is not None:
            return
        for line in said:
            session.notify(line)
        hosts = sorted({outcome.hosts_pids[p][0] for p in outcome.lost})
        what = self.cluster.lose(lost, hosts)
        outcome.replaced, outcome.shrunk = what == "replaced", what == "shrunk"

    # -- 3. settle -------------------------------------------------------------------------------
    def settle(self, outcome: Outcome, framework: str) -> tuple[SessionState, list[str]]:
        """Bring the session to a known state after ``outcome``: the state, and the names of
        the variables dropped."""
        cluster, watch = self.cluster, outcome.watch
        if outcome.healed is not None:
            return SessionState.HEALED, []
        if outcome.replaced:
            return SessionState.REPLACED, []
        if outcome.shrunk:  # the engines that answer go on, in a group of their own
            return SessionState.DROPPED, self.drop(framework, list(range(cluster.size)))
        interrupted = watch.interrupted or any(f.interrupted for f in outcome.failures)
        if interrupted and not backends.load(framework).SURVIVES_INTERRUPT:
            cluster.replace_engines(why=interrupt_text(framework))
            return SessionState.REPLACED, []
        if watch.reason is None and not outcome.failures:
            return SessionState.OK, []
        # The ranks that raised did so on their own and no rank had to be freed or stopped: the
        # group may still work; a barrier over the whole group (--on's left-out ranks too) says
        # whether.
        own_errors = (
            watch.reason in (None, Reason.FAILURE)
            and not outcome.stopped
            and not outcome.released
            and not outcome.left
            and not any(failures.lost_peer(f) or f.interrupted for f in outcome.failures)
        )
        if own_errors and regroup.group_works(cluster, framework, list(range(outcome.world))):
            return SessionState.KEPT, []
        still = {outcome.ranks[p] for p in watch.abandoned}
        if outcome.released:  # sharded state, dropped with the group where a rank was freed
            self.sharded = sorted(outcome.sharded)
            everyone = [r for r in range(cluster.size) if r not in outcome.released]
            return SessionState.DROPPED, self.drop(
                framework, everyone, already=outcome.dropped, queued=still
            )
        # Anything else that may have broken the group (a rank raised while others waited in a
        # collective, an interrupt, --timeout, a stall): it is rebuilt around the variables,
        # as a healing does, and every rank keeps its own.
        leaving = [r for r in range(cluster.size) if r not in outcome.left]
        rebuilt = regroup.rebuild(
            cluster, self.session.rendezvous, framework, leaving, queued=still
        )
        self.replicas, self.sharded = rebuilt.replicas, rebuilt.sharded
        return rebuilt.state, rebuilt.dropped

    def drop(
        self,
        framework: str,
        ranks: list[int],
        *,
        already: set[str] | None = None,
        queued: AbstractSet[int] = frozenset(),
    ) -> list[str]:
        return regroup.drop(
            self.cluster, self.session.rendezvous, framework, ranks, already=already,
            queued=queued,
        )  # fmt: skip

    # -- 4. result -------------------------------------------------------------------------------
    def result(
        self, outcome: Outcome, plan: Plan, state: SessionState, dropped: list[str]
    ) -> CellOutcome:
        session, opts, job = self.session, self.opts, self.job
        assert job is not None  # (the job ran)
        live_view = job.live
        meta = outcome.meta
        reports = outcome.reports
        # A graceful stop: how many steps each rank completed. The step it was stopped in (its
        # loss computed, its update not taken) leaves the curve, so that every number said
        # (the Stop message, the summary, the figure) is of the steps the model took.
        stopped_at = {r.rank: r.stopped_at for r in reports.values() if r.stopped_at is not None}
        taken = min(stopped_at.values()) if stopped_at else None
        if taken is not None:
            outcome.history = [h for h in outcome.history if h["step"] < taken]
        detail = (
            f", global batch {meta.global_batch} = {meta.per_replica_batch} per replica "
            f"x {len(plan.specs)}"
            if meta.global_batch
            else ""
        )
        summary = live_view.finish(
            outcome.history, states(outcome.ars, outcome.watch), wall=outcome.wall,
            framework=plan.framework, detail=detail, key=meta.model, steps_taken=taken,
        )  # fmt: skip
        if summary is not None:
            print(summary, file=session.out, flush=True)
        segment = live_view.agg.segment()
        if segment is not None:
            session.curve = [*session.curve, segment] if live_view.continued else [segment]
            # A healing in this cell made its models new objects: the next cell's curve goes on.
            session.curve_key = HEALED if outcome.healed is not None else live_view.key
        show_displays(outcome.ars, outcome.ranks, session.publish)
        profile = self._profile(outcome) if opts.profile else None
        cluster = self.cluster
        error = failures.error_for(outcome, opts, cluster)
        if isinstance(error, WorkerError):
            note = failures.network_note(error.failures, cluster.network)
            if note is not None:
                error.notes.append(note)
        lost = []
        if state == SessionState.REPLACED:
            lost = sorted({*dropped, *session.variables})
        elif state == SessionState.DROPPED:
            lost = dropped
        kept = state in (SessionState.KEPT, SessionState.REBUILT)
        held: list[str] = []
        if kept:  # what every rank holds now
            reported = (r.names for r in outcome.reports.values())
            held = sorted(set(session.variables).union(*reported))
        if error is not None:
            raised = error.ranks if isinstance(error, WorkerError) else []
            line = failures.state_line(
                state, held if kept else lost,
                connected_stale=cluster.stale, replicas=self.replicas, sharded=self.sharded,
                framework=plan.framework, raised=raised,
            )  # fmt: skip
            if outcome.healed is not None:
                said = outcome.healed.text()
                line = said[0].upper() + said[1:]
            error.state = line or error.state  # a graceful stop's says what it kept
            session.still_running = {
                outcome.ranks[p]: self.name.label for p in outcome.watch.abandoned
            }
            if outcome.watch.abandoned:
                still = [cluster.engines[outcome.ranks[p]] for p in outcome.watch.abandoned]
                error.state = "\n".join(filter(None, [error.state, failures.still_running(still)]))
            return CellOutcome(state=state, lost=lost, error=error, names=held)
        warnings: tuple[str, ...] = ()
        if opts.on is None:
            warning = independent_copies(
                [reports[p] for p in sorted(reports)], imported_modules(self.tree)
            )
            if warning is not None:
                print(warning, file=session.err, flush=True)
                warnings = (warning,)
        pull_errors = [r.pull_error for r in reports.values() if r.pull_error]
        pulled: dict[str, Any] = {}
        if reports[0].pulled is not None and not pull_errors:
            try:
                pulled = reports[0].pulled.unpack(" in the notebook")
            except UnpackError as e:
                pull_errors = [f"--pull {e} (rank {outcome.ranks[0]})"]
        return CellOutcome(
            # A graceful stop: the cell's outcome is kept as a finished cell's is, and the
            # session raises the notice after taking it in.
            error=failures.graceful_stop(
                stopped_at,
                live_view.agg.step_text,
                why=None if outcome.stop_asked else self.cluster.outside_stop(),
            )  # fmt: skip
            if stopped_at
            else None,
            state=state,
            lost=lost,
            result=_result(outcome, plan.framework, warnings, profile, err=session.err),
            names=reports[0].names,
            pulled=pulled,
            pull_error=pull_errors[0] if pull_errors else None,
            warnings=warnings,
            plan=plan,
        )

    def _profile(self, outcome: Outcome) -> Any:
        """``--profile``: the breakdown of the ranks' windows, shown under the figure."""
        session = self.session
        reports = outcome.reports
        if not reports:
            return None
        windows = {outcome.ranks[p]: reports[p].profile for p in sorted(reports)}
        count = self.name.count
        run_id = self.job.specs[0].run_id if self.job is not None else 0
        name = f"In{count}" if count is not None else f"cell{run_id}"
        report, text = breakdown.from_reports(windows, name, skipped=SKIP_STEPS)
        if report is not None and self.opts.plot:
            session.display(
                {
                    "image/png": png_data(breakdown.timeline_png(report)),
                    "text/plain": "<nbdist profile: time per step, per rank>",
                },
                raw=True,
            )
        print(text, file=session.out, flush=True)
        return report

    def interrupted(self, job: Job, framework: str) -> CellOutcome:
        session, cluster = self.session, self.cluster
        session.rendezvous.pop(framework, None)  # whatever the ranks did: a new group
        names: list[str] = []
        try:
            # Not when clean-up replaced the engines and was interrupted: the cluster is stopped
            # then (see LocalCluster.replace_engines), and the next cell starts a new one.
            if cluster.running and max(job.ranks) < cluster.size:
                cluster.interrupt(job.ranks)
                names = self.drop(framework, list(range(cluster.size)))
        except KeyboardInterrupt:  # yet another: the rendezvous is gone already, that is enough
            pass
        lost = sorted({*names, *session.variables})
        error = JobInterrupted(
            "interrupted (Stop button or Kernel > Interrupt); stopped ranks "
            f"{', '.join(map(str, job.ranks))}."
        )
        state = SessionState.DROPPED if cluster.running else SessionState.STOPPED
        error.state = failures.state_line(
            state, lost, connected_stale=cluster.stale,
            why=", since an interrupt cut the stopping of the ranks short",
        )  # fmt: skip
        return CellOutcome(state=state, lost=lost, error=error)


def _result(
    outcome: Outcome,
    framework: str,
    warnings: tuple[str, ...] = (),
    profile: Any = None,
    *,
    err: Any = None,
) -> DistrainResult:
    reports = outcome.reports
    values = {p: _value(r, outcome.ranks[p], err) for p, r in reports.items()}
    return DistrainResult(
        framework=framework,
        warnings=warnings,
        profile=profile,
        world_size=len(outcome.ranks),
        wall=outcome.wall,
        ranks=tuple(
            RankResult(
                rank=rank,
                host=reports[p].host,
                value=values[p],
                value_repr=reports[p].value_repr,
                wall=reports[p].wall,
                stdout=outcome.ars[p].stdout or "",
                stderr=outcome.ars[p].stderr or "",
            )
            for p, rank in enumerate(outcome.ranks)
        ),
        history=tuple({**h, "rank": outcome.ranks[h["rank"]]} for h in outcome.history),
    )


def _value(report: Any, rank: int, err: Any) -> Any:
    """A rank's value, rebuilt in the notebook; None (its repr is shown) where it cannot be,
    with a line saying why."""
    if report.value is None:
        return None
    try:
        return report.value.unpack(" in the notebook")
    except UnpackError as e:
        print(f"nbdist: rank {rank}'s {e}; its repr is shown", file=err, flush=True)
        return None


def _check_ranks(opts: RunOptions, world: int) -> None:
    for flag, ranks in (("--ranks", opts.ranks), ("--on", opts.on)):
        if ranks is not None and max(ranks) >= world:
            raise UsageError(
                f"%%distrain: {flag} {max(ranks)} does not exist; ranks go from 0 to {world - 1}."
            )


def may_log(tree: ast.Module, autolog: bool) -> bool:
    """Whether the cell records metrics: it calls ``log``, or autolog sees ``backward``/``fit``."""
    names = ("log", "backward", "fit") if autolog else ("log",)
    return any(calls(tree, *names))
