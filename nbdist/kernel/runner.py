"""One ``%%distrain`` run: rendezvous, submit, stream output, watch, gather, report.

Stopping a job that went wrong escalates, each step bounded (times from ``shared/NOTES.md`` and
this project's fault tests). The backend's ``peer_release_s`` is how long a rank blocked in a
collective takes to notice a lost peer: about 1 s for torch (the failing rank destroys its
group), the collective timeout for TensorFlow.

1. A rank that raises reports its failure and cleans up; peers blocked in a collective with it
   fail on their own within ``peer_release_s``.
2. Ranks still running ``peer_release_s + PEER_GRACE_S`` later (at once on ``--timeout`` or the
   notebook's interrupt) get SIGINT: a rank in Python code (a sleep, a loop) stops at once.
3. Ranks still running ``peer_release_s + KILL_GRACE_S`` after that are killed and every engine
   is replaced, so the next run starts clean.
"""

from __future__ import annotations

import ast
import logging
import pickle
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

from IPython.core.error import UsageError

from nbdist.engine import backends, worker
from nbdist.engine.hardware import visible_gpus
from nbdist.engine.spec import RankSpec
from nbdist.errors import (
    ClusterError,
    JobInterrupted,
    JobStalled,
    JobTimeout,
    RankFailure,
    WorkerDied,
    WorkerError,
)
from nbdist.kernel.checks import CheckContext, calls, check_source
from nbdist.kernel.cluster import LocalCluster, Rendezvous, default_workers
from nbdist.kernel.display import LiveView
from nbdist.kernel.export import LastCell
from nbdist.kernel.exposure import check_tf_exposure
from nbdist.kernel.metrics import MetricsStream
from nbdist.kernel.options import RunOptions
from nbdist.kernel.result import DistrainResult, RankResult
from nbdist.kernel.scan import ScanResult, run_scan
from nbdist.kernel.source import infer_framework, parse_cell

log = logging.getLogger(__name__)

# Beyond the time the backend says a blocked peer needs to notice a lost rank:
PEER_GRACE_S = 2.0  # ... before SIGINT to the ranks still running
KILL_GRACE_S = 3.0  # ... after that, before SIGKILL
POLL_S = 0.02
LIVENESS_EVERY_S = 0.25
CPU_SAMPLE_EVERY_S = 1.0
IDLE_CPU_SHARE = 0.1  # below 10% of one core, an engine counts as waiting, not working
LAST_METRICS_WAIT_S = 2.0  # results can overtake the last metrics message (another channel)


class _OutputRelay:
    """Forwards the ranks' new stdout/stderr lines to the cell, prefixed ``[rank N]``.

    Lines are held for up to ``HOLD_S`` and a burst is written in rank order, so lines that ranks
    print at about the same time (after a collective, say) read ``[rank 0]``, ``[rank 1]``, ...
    instead of in whichever order the messages happened to arrive.
    """

    HOLD_S = 0.3

    def __init__(self, visible: list[bool], out: TextIO, err: TextIO) -> None:
        self.visible = visible
        self._sinks = {"stdout": out, "stderr": err}
        n = len(visible)
        self._seen = {name: [0] * n for name in self._sinks}
        self._partial = {name: [""] * n for name in self._sinks}
        self._held: dict[str, list[tuple[int, str]]] = {name: [] for name in self._sinks}
        self._since: dict[str, float] = {}

    def pump(self, ars: list[Any], final: bool = False) -> None:
        now = time.monotonic()
        for name, sink in self._sinks.items():
            held = self._held[name]
            for rank, ar in enumerate(ars):
                text = getattr(ar, name) or ""
                seen = self._seen[name]
                new, seen[rank] = text[seen[rank] :], len(text)
                if not self.visible[rank] or not (new or final):
                    continue
                lines = (self._partial[name][rank] + new).split("\n")
                self._partial[name][rank] = "" if final else lines.pop()
                held.extend((rank, line) for line in lines if line or not final)
            if held:
                self._since.setdefault(name, now)
            if held and (final or now - self._since[name] >= self.HOLD_S):
                held.sort(key=lambda item: item[0])  # stable: each rank's lines stay in order
                sink.write("".join(f"[rank {rank}] {line}\n" for rank, line in held))
                sink.flush()
                held.clear()
                del self._since[name]


def check_push(names: tuple[str, ...], user_ns: dict[str, Any]) -> dict[str, Any]:
    """The notebook variables to push, or a ``UsageError`` naming the one that can't go."""
    values = {}
    for name in names:
        if name not in user_ns:
            raise UsageError(
                f"%%distrain: --push {name}: no variable {name!r} in the notebook; define it "
                "in a cell above, or check the spelling."
            )
        try:
            pickle.dumps(user_ns[name])
        except Exception as e:
            raise UsageError(
                f"%%distrain: --push {name}: a {type(user_ns[name]).__name__} cannot be sent to "
                f"the workers ({type(e).__name__}: {e}). Push plain data (arrays, tensors, "
                "dicts) and build objects like models and loaders inside the cell."
            ) from None
        values[name] = user_ns[name]
    return values


@dataclass
class _Watch:
    """Why the job is being stopped, and when each escalation step happened."""

    reason: str | None = None  # "failure", "timeout", "stalled", "interrupt", "died"
    since: float = 0.0
    interrupted: bool = False
    stalled: dict[str, Any] = field(default_factory=dict)  # who stalled, when, at which step
    progress: dict[int, float] = field(default_factory=dict)  # rank -> last progress (monotonic)
    first_progress: float | None = None

    def note_progress(self, rank: int, now: float) -> None:
        self.progress[rank] = now
        if self.first_progress is None:
            self.first_progress = now

    def stuck(self, pending: list[int], now: float, limit: float) -> list[int]:
        """Pending ranks with no progress for ``limit`` s (counted from the first progress)."""
        if self.first_progress is None:
            return []
        return [r for r in pending if now - self.progress.get(r, self.first_progress) > limit]

    killed: list[int] = field(default_factory=list)
    dead: list[int] = field(default_factory=list)
    # Before any progress: each rank's engine CPU time at the last sample, and when it was last
    # seen using the CPU. Every rank idle for the stall limit = they wait on each other.
    cpu: dict[int, float] = field(default_factory=dict)
    cpu_at: float = 0.0
    busy_at: dict[int, float] = field(default_factory=dict)

    def sample_cpu(self, cpu: dict[int, float] | None, now: float) -> None:
        if cpu is None:
            return
        dt = now - self.cpu_at
        for rank, seconds in cpu.items():
            if rank not in self.cpu or seconds - self.cpu[rank] > IDLE_CPU_SHARE * dt:
                self.busy_at[rank] = now
        self.cpu, self.cpu_at = cpu, now

    def all_idle(self, pending: list[int], now: float, limit: float) -> bool:
        """No progress yet, and every pending rank has used (almost) no CPU for ``limit`` s."""
        return (
            self.first_progress is None
            and bool(pending)
            and all(r in self.busy_at and now - self.busy_at[r] > limit for r in pending)
        )

    def start(self, reason: str, now: float) -> None:
        if self.reason is None:
            self.reason, self.since = reason, now


class Runner:
    """Runs cells on a :class:`LocalCluster`; one instance per notebook kernel."""

    def __init__(
        self,
        cluster: LocalCluster,
        *,
        out: TextIO | None = None,
        err: TextIO | None = None,
        notify: Callable[[str], None] | None = None,
        display: Callable[..., Any] | None = None,
    ) -> None:
        self.cluster = cluster
        self._out, self._err = out, err
        self._display = display or _ipython_display
        # The Jupyter server's interrupt URL for this kernel: what the Stop button calls.
        self.interrupt_path: str | None = None
        self.view: LiveView | None = None  # the running cell's live view
        self._notify = notify or (lambda msg: print(msg, file=self.out))
        self._run_id = 0
        self.last: LastCell | None = None  # the last cell run, for %distrain export

    @property
    def out(self) -> TextIO:
        return self._out or sys.stdout

    @property
    def err(self) -> TextIO:
        return self._err or sys.stderr

    # -- preparation -----------------------------------------------------------------------------
    def _check_backend(self, opts: RunOptions, framework: str) -> None:
        if opts.backend is not None and framework != "torch":
            raise UsageError(f"%%distrain: --backend is for torch cells; drop it for {framework}.")
        if opts.strategy is not None and framework != "tf":
            raise UsageError(
                f"%%distrain: --strategy is for TensorFlow cells; drop it for {framework}, "
                "or add --framework tf."
            )
        if opts.backend == "nccl" and not any(e.gpu for e in self.cluster.engines):
            raise UsageError(
                "%%distrain: --backend nccl needs GPUs and this cluster has none. "
                "Use --backend gloo, or drop --backend to get gloo on CPU."
            )

    def _warm_up(self, framework: str) -> None:
        if framework in self.cluster.warm:
            return
        self.cluster.apply_all(
            worker.warm_up,
            lambda e: {
                "framework": framework,
                "local_world_size": e.local_world_size,
                "cpus": e.cpus,
            },
        )
        self.cluster.warm.add(framework)

    def _rendezvous(
        self, framework: str, opts: RunOptions, world: int, backend_options: dict[str, Any]
    ) -> list[dict[str, str]]:
        key = (framework, opts.backend, opts.strategy, world)
        live = self.cluster.rendezvous.get(framework)
        if live is not None and live.key == key:
            return live.envs
        hosts = [e.address for e in self.cluster.engines[:world]]
        options = {"master_addr": hosts[0], **backend_options}

        def prepare() -> list[dict]:
            return self.cluster.apply_all(
                worker.prepare,
                lambda e: {
                    "framework": framework,
                    "rank": e.rank,
                    "world_size": world,
                    "options": options,
                },
                ranks=range(world),
            )

        prepared = prepare()
        reasons = sorted({p["restart"] for p in prepared if p.get("restart")})
        if reasons:
            self.cluster.replace_engines(notice=f"nbdist: restarting the workers: {reasons[0]}")
            if self.cluster.stale:
                raise ClusterError(self.cluster.stale)
            self._warm_up(framework)
            prepared = prepare()
        envs = backends.load(framework).rendezvous(hosts, prepared)
        self.cluster.rendezvous[framework] = Rendezvous(key=key, envs=envs)
        return envs

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

    # -- the run ---------------------------------------------------------------------------------
    def run(
        self, opts: RunOptions, source: str, user_ns: dict[str, Any]
    ) -> DistrainResult | ScanResult | None:
        """Run ``source`` as one job on the cluster; see the magic's docstring."""
        self.view = None
        tree = parse_cell(source)
        if opts.check_only:
            self.report_findings(source, opts.workers, quiet=False)
            return None
        if opts.scan is not None:
            return self._scan(opts, source, user_ns)
        framework = infer_framework(tree, opts.framework)
        push = check_push(opts.push, user_ns)
        if opts.check:
            self.report_findings(source, opts.workers or self.cluster.size or None)
        self.cluster.preload = framework  # engines started from here on import it as they start
        self.cluster.ensure(opts.workers)
        self._check_backend(opts, framework)
        backend_options = {
            k: v
            for k, v in (
                ("backend", opts.backend),
                ("strategy", opts.strategy),
                ("timeout", opts.timeout),
            )
            if v is not None
        }
        available = self.cluster.size
        if opts.workers is not None:  # a connected cluster may have more engines than asked for
            available = min(opts.workers, available)
        world = backends.load(framework).workers_used(backend_options, available)
        check_tf_exposure(
            self.cluster, framework, backend_options, allowed=opts.expose_tf, notify=self._notify
        )
        if opts.ranks is not None and max(opts.ranks) >= world:
            raise UsageError(
                f"%%distrain: --ranks {max(opts.ranks)} does not exist; ranks go from 0 to "
                f"{world - 1}."
            )
        self.last = LastCell(
            source=source,
            framework=framework,
            world_size=world,
            autolog=opts.autolog,
            push=push,
            strategy=opts.strategy,
            backend=opts.backend,
        )
        self._warm_up(framework)
        envs = self._rendezvous(framework, opts, world, backend_options)
        self._run_id += 1
        filename = f"<%%distrain cell {self._run_id}>"
        specs = [
            RankSpec(
                run_id=self._run_id,
                framework=framework,
                source=source,
                filename=filename,
                rank=e.rank,
                world_size=world,
                local_rank=e.local_rank,
                local_world_size=min(e.local_world_size, world),
                env=envs[e.rank],
                options=backend_options,
                push=push,
                pull=opts.pull if e.rank == 0 else (),
                autolog=opts.autolog,
            )
            for e in self.cluster.engines[:world]
        ]
        result, pulled = self._execute(specs, opts, framework, may_log(tree, opts.autolog))
        user_ns.update(pulled)
        if opts.out is not None:
            user_ns[opts.out] = result
        return result

    def _scan(self, opts: RunOptions, source: str, user_ns: dict[str, Any]) -> ScanResult:
        first = opts.scan[0]

        def run(n: int) -> DistrainResult:
            # One figure for the whole scan; the checker's warnings once, before the first run.
            single = replace(opts, workers=n, scan=None, plot=False, out=None,
                             check=opts.check and n == first)  # fmt: skip
            return self.run(single, source, user_ns)

        scan = run_scan(
            run,
            opts.scan,
            plot=opts.plot,
            display=self._display,
            out=lambda text: print(text, file=self.out),
        )
        if opts.out is not None:
            user_ns[opts.out] = scan
        return scan

    def _execute(
        self, specs: list[RankSpec], opts: RunOptions, framework: str, expect_metrics: bool
    ) -> tuple[DistrainResult, dict[str, Any]]:
        start = time.monotonic()
        ars = [self.cluster.apply_async(s.rank, worker.run_rank, s) for s in specs]
        outputs = _OutputRelay(
            [opts.ranks is None or s.rank in opts.ranks for s in specs], self.out, self.err
        )
        backend = backends.load(framework)
        release = backend.peer_release_s(specs[0].options)
        stream = MetricsStream(len(specs))
        watch = _Watch()
        live = LiveView(
            len(specs),
            plot=opts.plot,
            smoothing=opts.smoothing,
            display=self._display,
            interrupt_path=self.interrupt_path,
            expect_metrics=expect_metrics,
        )
        self.view = live
        self._watch(ars, outputs, stream, live, watch, opts, start, release)
        wall = time.monotonic() - start
        # ipyparallel may report a dead engine's task as failed before our liveness poll did.
        watch.dead = sorted(set(watch.dead) | set(self.cluster.dead(range(len(specs)))))
        outputs.pump(ars, final=True)

        if watch.killed or watch.dead:
            lost = sorted(set(watch.killed) | set(watch.dead))
            notice = (
                f"nbdist: replacing the engines ({'rank' if len(lost) == 1 else 'ranks'} "
                f"{', '.join(map(str, lost))} had to be killed or died)"
            )
            hosts_pids = {
                r: (self.cluster.engines[r].host, self.cluster.engines[r].pid) for r in lost
            }
            self.cluster.replace_engines(notice=notice)
        else:
            hosts_pids = {}

        reports, failures, stopped = self._collect(ars, specs, watch)
        unhealthy = {
            r: rep["recover_error"] for r, rep in reports.items() if rep.get("recover_error")
        }
        if unhealthy and not (watch.killed or watch.dead):
            rank, why = next(iter(unhealthy.items()))
            self.cluster.replace_engines(
                notice=f"nbdist: replacing the engines (rank {rank} could not clean up after the "
                f"failure: {why})"
            )
        self._drain(ars, stream, [reports.get(s.rank, {}).get("messages", 0) for s in specs])
        summary = live.finish(
            stream.history,
            _states(ars, watch),
            wall=wall,
            framework=framework,
            detail=_batch_detail(stream.meta[0], len(specs)),
        )
        if summary is not None:
            print(summary, file=self.out, flush=True)
        if failures or watch.reason is not None:
            if not backend.KEEPS_RENDEZVOUS_AFTER_FAILURE:
                self.cluster.rendezvous.pop(framework, None)

        if watch.dead:
            where = ", ".join(
                f"rank {r} (host {hosts_pids[r][0]}, pid {hosts_pids[r][1]})" for r in watch.dead
            )
            after = (
                "the engines were replaced and the next %%distrain will run on fresh workers."
                if self.cluster.owned
                else self.cluster.stale or "restart the connected cluster's engines."
            )
            if watch.reason == "interrupt":  # the process exited on the interrupt itself
                raise JobInterrupted(
                    f"interrupted (Stop button or Kernel > Interrupt); stopped ranks "
                    f"{', '.join(map(str, range(len(specs))))}; {where} exited on the interrupt, "
                    f"so {after}"
                )
            raise WorkerDied(f"{where} died during the job; {after}")
        if any(f.exc_type != "KeyboardInterrupt" for f in failures):
            raise WorkerError(failures, stopped=stopped)
        if watch.reason == "timeout":
            raise JobTimeout(
                f"the job ran past --timeout {opts.timeout:g} s; stopped "
                f"ranks {', '.join(map(str, stopped or range(len(specs))))}. "
                "Raise --timeout or make the cell shorter."
            )
        if watch.reason == "stalled":
            raise JobStalled(_stall_message(watch.stalled, opts.stall, stopped, len(specs)))
        if watch.reason == "interrupt":
            raise JobInterrupted(
                f"interrupted (Stop button or Kernel > Interrupt); stopped ranks "
                f"{', '.join(map(str, stopped or range(len(specs))))}. "
                + (
                    self.cluster.stale
                    if self.cluster.stale
                    else "The cluster is ready for the next %%distrain."
                )
            )

        ranks = tuple(
            RankResult(
                rank=s.rank,
                host=reports.get(s.rank, {}).get("host", self.cluster.engines[s.rank].host),
                value=reports.get(s.rank, {}).get("value"),
                value_repr=reports.get(s.rank, {}).get("value_repr"),
                wall=reports.get(s.rank, {}).get("wall", wall),
                stdout=ars[s.rank].stdout or "",
                stderr=ars[s.rank].stderr or "",
            )
            for s in specs
        )
        result = DistrainResult(
            framework=framework,
            world_size=len(specs),
            wall=wall,
            ranks=ranks,
            history=tuple(stream.history),
        )
        return result, reports[0].get("pulled") or {}

    def _watch(
        self,
        ars: list[Any],
        outputs: _OutputRelay,
        stream: MetricsStream,
        live: LiveView,
        watch: _Watch,
        opts: RunOptions,
        start: float,
        release: float,
    ) -> None:
        """Poll until every rank is done, escalating when something goes wrong."""
        peer_grace = release + PEER_GRACE_S
        kill_grace = release + KILL_GRACE_S
        next_liveness = 0.0
        while True:
            try:
                now = time.monotonic()
                outputs.pump(ars)
                for rank, ar in enumerate(ars):
                    if stream.pump(rank, ar.data):
                        watch.note_progress(rank, now)
                pending = [r for r, ar in enumerate(ars) if not ar.ready()]
                if not pending:
                    return
                live.update(stream.history, _states(ars, watch), total_steps=stream.total_steps())
                now = time.monotonic()
                if watch.reason is None:
                    if any(ars[r].ready() and _failed(ars[r]) for r in range(len(ars))):
                        watch.start("failure", now)
                    elif opts.timeout is not None and now - start > opts.timeout:
                        watch.start("timeout", now - peer_grace)
                    elif watch.stuck(pending, now, opts.stall):
                        # Every rank idle for a good part of the limit is part of the stall: the
                        # one furthest behind is the culprit, the others wait for it. (Their last
                        # points arrive in any order within a flush interval.)
                        stuck = watch.stuck(pending, now, opts.stall / 2)
                        watch.stalled = {
                            "ranks": stuck,
                            "steps": list(stream.last_step),
                            "idle": {
                                r: now - watch.progress.get(r, watch.first_progress) for r in stuck
                            },
                        }
                        watch.start("stalled", now - peer_grace)
                if (
                    watch.reason is None
                    and watch.first_progress is None
                    and now - watch.cpu_at >= CPU_SAMPLE_EVERY_S
                ):
                    watch.sample_cpu(self.cluster.cpu_seconds(pending), now)
                    if watch.all_idle(pending, now, opts.stall):
                        watch.stalled = {
                            "ranks": pending,
                            "steps": list(stream.last_step),
                            "idle": {r: now - watch.busy_at[r] for r in pending},
                            "all_idle": True,
                        }
                        watch.start("stalled", now - peer_grace)
                if now >= next_liveness:
                    next_liveness = now + LIVENESS_EVERY_S
                    dead = [r for r in self.cluster.dead(pending) if r not in watch.dead]
                    if dead:
                        watch.dead.extend(dead)
                        watch.start("died", now)
                if watch.reason is not None:
                    waited = now - watch.since
                    if not watch.interrupted and waited >= peer_grace:
                        watch.interrupted = True
                        self.cluster.interrupt(pending)
                    elif watch.interrupted and waited >= peer_grace + kill_grace:
                        alive = [r for r in pending if r not in watch.dead]
                        self.cluster.kill(alive)
                        watch.killed.extend(alive)
                        return
                    if watch.dead and set(pending) <= set(watch.dead):
                        return
                time.sleep(POLL_S)
            except KeyboardInterrupt:
                if watch.reason == "interrupt":  # a second interrupt: stop waiting, kill now
                    watch.since = time.monotonic() - peer_grace - kill_grace
                else:
                    watch.reason = "interrupt"
                    watch.since = time.monotonic() - peer_grace
                    watch.interrupted = False

    @staticmethod
    def _drain(ars: list[Any], stream: MetricsStream, expected: list[int]) -> None:
        """Read the metrics messages still in flight when the results arrived."""
        deadline = time.monotonic() + LAST_METRICS_WAIT_S
        while True:
            for rank, ar in enumerate(ars):
                stream.pump(rank, ar.data)
            if stream.complete(expected) or time.monotonic() > deadline:
                return
            time.sleep(POLL_S)

    def _collect(
        self, ars: list[Any], specs: list[RankSpec], watch: _Watch
    ) -> tuple[dict[int, dict], list[RankFailure], list[int]]:
        """Reports of the ranks that finished; failures; ranks that had to be stopped."""
        reports: dict[int, dict] = {}
        failures: list[RankFailure] = []
        stopped: list[int] = []
        for spec, ar in zip(specs, ars, strict=True):
            r = spec.rank
            if not ar.ready() or r in watch.dead:
                if r not in watch.dead:
                    stopped.append(r)
                continue
            try:
                report = ar.get(0)
            except Exception as e:  # the engine itself failed to run the task
                failures.append(
                    RankFailure(
                        rank=r,
                        host=self.cluster.engines[r].host if r < self.cluster.size else "?",
                        exc_type=type(e).__name__,
                        message=str(e),
                        traceback=str(e),
                        time=time.time(),
                    )
                )
                continue
            reports[r] = report
            if report["failure"] is not None:
                f = report["failure"]
                if f["exc_type"] == "KeyboardInterrupt" and watch.interrupted:
                    stopped.append(r)
                    continue
                failures.append(RankFailure(**f))
        return reports, failures, stopped


def may_log(tree: ast.Module, autolog: bool) -> bool:
    """Whether the cell records metrics: it calls ``log``, or autolog sees ``backward``/``fit``."""
    names = ("log", "backward", "fit") if autolog else ("log",)
    return any(calls(tree, *names))


def _ipython_display(*objs: Any, **kwargs: Any) -> Any:
    from IPython.display import display

    return display(*objs, **kwargs)


def _states(ars: list[Any], watch: _Watch) -> list[str]:
    """Each rank's state for the panel."""
    out = []
    for ar in ars:
        if not ar.ready():
            out.append("stopping" if watch.reason else "running")
        elif _failed(ar):
            stopped = watch.interrupted and _failure_type(ar) == "KeyboardInterrupt"
            out.append("stopped" if stopped else "failed")
        else:
            out.append("done")
    return out


def _stall_message(stalled: dict[str, Any], limit: float, stopped: list[int], world: int) -> str:
    """Names the stalled ranks that are furthest behind as stuck; the others as waiting."""
    steps = stalled["steps"]
    if stalled.get("all_idle"):
        ranks = ", ".join(map(str, stalled["ranks"]))
        return (
            f"no progress for {limit:g} s and every rank sits idle (ranks {ranks}, no CPU use, "
            "none past its first step): they are waiting on each other, e.g. a collective that "
            "not every rank reached, mismatched collectives, or a rank blocked on a sleep, a lock "
            f"or input. Stopped ranks {', '.join(map(str, stopped or range(world)))}. If the cell "
            "waits on purpose (a download), allow longer with --stall S."
        )

    def at(rank: int) -> str:
        return "before its first step" if steps[rank] is None else f"at step {steps[rank]}"

    behind = min(-1 if steps[r] is None else steps[r] for r in stalled["ranks"])
    stuck = [r for r in stalled["ranks"] if (-1 if steps[r] is None else steps[r]) == behind]
    parts = [
        f"rank {r} is stuck {at(r)} (no progress for {stalled['idle'][r]:.0f} s)" for r in stuck
    ]
    parts += [f"rank {r} waits {at(r)}" for r in range(world) if r not in stuck]
    return (
        f"no progress for {limit:g} s: {'; '.join(parts)}. "
        f"Stopped ranks {', '.join(map(str, stopped or range(world)))}. Look for what the stuck "
        "rank waits for (a collective the other ranks skipped, a sleep, a deadlock), or allow "
        "longer pauses with --stall S."
    )


def _batch_detail(meta: dict[str, Any], world: int) -> str:
    if not meta.get("global_batch"):
        return ""
    return (
        f", global batch {meta['global_batch']} = {meta['per_replica_batch']} per replica x {world}"
    )


def _failure_type(ar: Any) -> str | None:
    try:
        return ar.get(0)["failure"]["exc_type"]
    except Exception:
        return None


def _failed(ar: Any) -> bool:
    try:
        return ar.get(0)["failure"] is not None
    except Exception:
        return True
