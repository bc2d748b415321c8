"""Why a job is being stopped, and when each escalation step happened (see ``job.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from nbdist.protocol import Reason, Stall

IDLE_CPU_SHARE = 0.1  # below 10% of one core, an engine counts as waiting, not working


@dataclass
class Watch:
    """Why the job is being stopped, and when each escalation step happened.

    Ranks here are positions in the job (``Job.ranks[i]`` is the session rank).
    """

    reason: Reason | None = None
    since: float = 0.0
    interrupted: bool = False
    stalled: Stall | None = None  # who stalled, when, at which step
    progress: dict[int, float] = field(default_factory=dict)  # rank -> last progress (monotonic)
    first_progress: float | None = None
    killed: list[int] = field(default_factory=list)
    abandoned: list[int] = field(default_factory=list)  # still running: not nbdist's to kill
    dead: list[int] = field(default_factory=list)
    # Before any progress: each rank's engine CPU time at the last sample, and when it was last
    # seen using the CPU. Every rank idle for the stall limit = they wait on each other.
    cpu: dict[int, float] = field(default_factory=dict)
    cpu_at: float = 0.0
    busy_at: dict[int, float] = field(default_factory=dict)

    def note_progress(self, rank: int, now: float) -> None:
        self.progress[rank] = now
        if self.first_progress is None:
            self.first_progress = now

    def shift(self, seconds: float) -> None:
        """Time that does not count (a rank in the debugger): every clock moves on by it."""
        self.progress = {r: t + seconds for r, t in self.progress.items()}
        if self.first_progress is not None:
            self.first_progress += seconds
        self.busy_at = {r: t + seconds for r, t in self.busy_at.items()}
        self.cpu_at += seconds

    def stuck(self, pending: list[int], now: float, limit: float) -> list[int]:
        """Pending ranks with no progress for ``limit`` s (counted from the first progress)."""
        if self.first_progress is None:
            return []
        return [r for r in pending if now - self.progress.get(r, self.first_progress) > limit]

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

    def start(self, reason: Reason, now: float) -> None:
        if self.reason is None:
            self.reason, self.since = reason, now
