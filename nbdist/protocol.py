"""What crosses between the notebook's kernel and the engines, written down in one place.

The kernel sends each engine a :class:`RankSpec` per cell and gets a :class:`RankReport` back;
between cells an engine describes itself (:class:`EngineReport`) and its memory
(:class:`MemoryReport`). While a cell runs, each rank publishes through ipyparallel's
``publish_data`` under three kinds of key: batches of :class:`MetricPoint` under
``KEY_PREFIX + seq``, the run's :class:`RunMeta` under ``META_KEY`` and where its cell waits
(:class:`Waiting`) under ``WHERE_KEY`` (``publish_data`` keeps the latest value per key: right for
the last two, why the points go under a key per batch). The kernel's own records of a job,
:class:`Stall`, :class:`Reason` and :class:`RankState`, are here too, so that the words a job's
states are spelled with live in one module.

Standard library only at import (cloudpickle, for :class:`Packed`, is imported where it is
used): both sides import it, and the engine side imports nothing of the kernel's.
"""

from __future__ import annotations

import enum
import sys
from collections import ChainMap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

KEY_PREFIX = "nbdist-"  # + a rank's message number: one batch of points each
META_KEY = "nbdist~meta"  # the run's latest RunMeta, as a dict
WHERE_KEY = "nbdist~where"  # where the rank's cell waits, as a Waiting
STOPPING_KEY = "nbdist~stopping"  # the step a graceful stop ends after, once the rank knows it

INTERRUPT = "KeyboardInterrupt"  # the exception type a rank reports when SIGINT stopped it


class _Word(enum.StrEnum):
    """A member that is its value wherever it is written (``f"{state}"``, ``str(state)``)."""


def pickling_error(value: Any) -> Exception | None:
    """Why ``value`` cannot cross between the notebook and an engine (:func:`pack`), or None
    when it can."""
    import cloudpickle

    try:
        cloudpickle.dumps(value)
    except Exception as e:  # noqa: BLE001 - any pickling failure is the answer
        return e
    return None


def pack_values(
    values: dict[str, Any], refuse: Callable[[str, Any, Exception], Exception]
) -> Packed:
    """``values`` (variables by name) packed (:func:`pack`); where that fails, raises
    ``refuse(name, value, why)`` for the first that cannot cross (:func:`pickling_error`),
    so the message names it and says what to send instead."""
    try:
        return pack(values, tuple(values))
    except Exception:  # noqa: BLE001 - find which one, and say what to send instead
        for name, value in values.items():
            e = pickling_error(value)
            if e is not None:
                raise refuse(name, value, e) from None
        raise


@dataclass(frozen=True)
class Packed:
    """Values of the user's that cross between the notebook and the engines, as cloudpickle's
    bytes (:func:`pack`, :meth:`unpack`).

    ipyparallel pickles what it sends, and pickle sends a class or a function by reference, as
    its module and name. One defined in a notebook cell or a ``%%distrain`` cell lives in
    ``__main__``, which the other side does not have: a notebook dataclass pushed to the
    workers failed there with "Can't get attribute 'Cfg' on <module '__main__'>", and a model
    of a cell's ``class Net`` pulled to the notebook failed in ipyparallel's receiving thread,
    which left the pull waiting 60 s for a result that never came. cloudpickle sends what lives
    in ``__main__`` by value (classes, functions, lambdas, and the globals a function refers
    to), and whatever is importable by reference, as pickle does. The bytes themselves cross
    as plain data, so a value that cannot be rebuilt fails in :meth:`unpack`, where it is
    caught and named, never in ipyparallel's thread.

    A function sent this way takes along the values it refers to, and does not see the other
    side's variables: pass them as arguments.
    """

    data: bytes
    names: tuple[str, ...] = ()  # the variables inside, for messages (empty: one value)
    unwrapped: tuple[str, ...] = ()  # those that were DDP models: their modules are inside

    def unpack(self, where: str = "") -> Any:
        """The values, rebuilt; raises :class:`UnpackError` saying which and why (``where``:
        e.g. " in the notebook")."""
        import pickle

        try:
            return pickle.loads(self.data)  # noqa: S301 - this session's own notebook or engine
        except Exception as e:  # noqa: BLE001 - whatever went wrong is said, with what it was
            what = ", ".join(self.names) or "the value"
            raise UnpackError(
                f"{what} could not be rebuilt{where} ({type(e).__name__}: {e})"
            ) from e


class UnpackError(Exception):
    """A :class:`Packed` value that could not be rebuilt on this side (a module only the other
    side can import, say)."""


def pack(value: Any, names: tuple[str, ...] = ()) -> Packed:
    """``value`` as cloudpickle's bytes (see :class:`Packed`); ``names``: what it holds."""
    import io

    buffer = io.BytesIO()
    packer(buffer).dump(value)
    ddp = ddp_type()
    unwrapped: tuple[str, ...] = ()
    if ddp is not None and names and isinstance(value, dict):
        unwrapped = tuple(n for n in names if isinstance(value.get(n), ddp))
    return Packed(buffer.getvalue(), names, unwrapped)


def packer(file: Any, pickler: type | None = None) -> Any:
    """A cloudpickle pickler (or ``pickler``, a subclass of it) writing to ``file``, that
    sends a ``DistributedDataParallel`` model as the module it wraps: rebuilding one needs a
    process group, which the notebook does not have (pulling a DDP model failed there with
    "Default process group has not been initialized")."""
    import cloudpickle

    cls: Any = pickler or cloudpickle.Pickler
    ddp = ddp_type()
    if ddp is not None:  # read when the pickler is made: a class attribute, not an instance's
        table = ChainMap({ddp: _ddp_module}, cls.dispatch_table)
        cls = type("ModulesForDDP", (cls,), {"dispatch_table": table})
    return cls(file)


def ddp_type() -> Any:
    """torch's ``DistributedDataParallel`` where torch is imported (never imported for it)."""
    parallel = sys.modules.get("torch.nn.parallel")
    ddp = getattr(parallel, "DistributedDataParallel", None)
    return ddp if isinstance(ddp, type) else None


def _ddp_module(model: Any) -> tuple[Any, ...]:
    return (_same, (model.module,))


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class CellName:
    """A ``%%distrain`` cell as the notebook names it, as IPython does: ``Cell In[12]`` (its
    execution count), and its lines as the editor shows them, the ``%%distrain`` line being
    line 1 (``first_line``: the editor line of the code's first line, 2 under the magic's line,
    1 for a cell that auto mode runs on the workers)."""

    count: int | None = None
    first_line: int = 2

    @property
    def label(self) -> str:
        return f"Cell In[{self.count}]" if self.count is not None else "the cell"

    def at(self, line: int) -> str:
        """``"Cell In[12], line 9"`` (``line``: as the editor shows it)."""
        return f"{self.label}, line {line}"


class Reason(_Word):
    """Why a job is being stopped."""

    FAILURE = "failure"  # a rank raised
    TIMEOUT = "timeout"  # --timeout passed
    STALLED = "stalled"  # no progress for --stall seconds
    INTERRUPT = "interrupt"  # the notebook's interrupt (the Stop button)
    DIED = "died"  # an engine process ended (or its host stopped answering)


class RankState(_Word):
    """A rank's state in the panel's table."""

    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"
    DONE = "done"


class SessionState(_Word):
    """What a cell left of the session (see ``nbdist.kernel.cell``)."""

    OK = "ok"  # the cell succeeded
    KEPT = "kept"  # a rank raised on its own; the group works and the variables stay
    REBUILT = "rebuilt"  # the group was rebuilt around the variables, every rank keeps its own
    DROPPED = "dropped"  # every rank dropped its variables and its part of the group
    REPLACED = "replaced"  # the engines were replaced: their variables went with them
    HEALED = "healed"  # a lost rank's new engine got a survivor's variables; a new group next
    STOPPED = "stopped"  # the clean-up was interrupted and the cluster stopped


@dataclass(frozen=True)
class RankFailure:
    """What one rank reported when its cell raised.

    ``collateral`` is True when the rank failed only because a peer failed first (its collective
    lost the peer, or nbdist interrupted it): such ranks are listed, not shown in full.
    """

    rank: int
    host: str
    exc_type: str
    message: str
    traceback: str
    line: int | None = None
    line_text: str = ""
    time: float = 0.0
    collateral: bool = False
    cell: str = ""  # the cell's label, Cell In[12] (``line`` is as its editor shows it)
    pid: int = 0  # the engine's process, which keeps the frames for %distrain debug

    @property
    def where(self) -> str:
        """``"Cell In[12], line 9"``: where in the cell it raised."""
        return f"{self.cell or 'the cell'}, line {self.line}"

    @property
    def headline(self) -> str:
        return f"{self.exc_type}: {self.message}" if self.message else self.exc_type

    @property
    def interrupted(self) -> bool:
        """The rank stopped on SIGINT (nbdist's, or the cell raised KeyboardInterrupt)."""
        return self.exc_type == INTERRUPT


@dataclass(frozen=True, kw_only=True)
class RankSpec:
    """One rank's share of a ``%%distrain`` run.

    ``env`` is the per-rank environment from the backend's ``rendezvous``; it is applied for the
    duration of the run only. ``options`` are backend options (e.g. ``{"backend": "gloo"}``).
    """

    run_id: int
    framework: str
    source: str
    filename: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    env: dict[str, str]
    options: dict[str, Any] = field(default_factory=dict)
    push: Packed | None = None  # --push's notebook variables, a dict by name
    pull: tuple[str, ...] = ()
    ranks: tuple[int, ...] = ()  # the ranks that run the cell (--on); empty: all of world_size
    nonce: str = ""  # this run's alone (a graceful stop's keys: nbdist.engine.stopping)
    cell: CellName = field(default_factory=CellName)  # as the notebook names it
    autolog: bool = True
    fresh: bool = False  # run in a throwaway namespace instead of the session's
    profile: int = 0  # optimizer steps to profile (--profile; nbdist.engine.profiling)
    # Where breakpoint() reaches the notebook: its Unix socket and key (nbdist.engine.breakpoints)
    debug: tuple[str, bytes] | None = None


@dataclass(kw_only=True)
class RankReport:
    """What one rank sends back from a run (``worker.run_rank`` never raises: a failure of the
    cell is ``failure``). The notebook reads these fields, nothing else."""

    rank: int
    host: str
    pid: int
    failure: RankFailure | None = None
    value: Packed | None = None  # the last expression's value, when it can go to the notebook
    value_repr: str | None = None  # its repr; None when the cell has no value
    names: list[str] = field(default_factory=list)  # the session's variables after the run
    messages: int = 0  # metrics messages published (the notebook waits for that many)
    wall: float = 0.0
    pulled: Packed | None = None  # --pull's values, a dict by name (first rank only)
    pull_error: str | None = None  # a --pull name that failed (the cell itself ran)
    steps: int = 0  # training steps autolog saw (backward()s, Keras batches)
    collectives: int | None = None  # collectives run during the cell; None: not counted
    libraries: dict[str, str] = field(default_factory=dict)  # training libraries loaded: version
    stopped_at: int | None = None  # the step boundary a graceful stop ended the cell at
    profile: dict[str, Any] | None = None  # --profile's window (nbdist.engine.profiling)


@dataclass(frozen=True)
class EngineReport:
    """What an engine says of itself (``worker.engine_info``), once per engine."""

    host: str
    pid: int
    gpus: list[str]  # the GPUs it sees, as CUDA_VISIBLE_DEVICES names them
    cpus: int  # the CPUs it may use
    address: str | None  # the address other hosts reach it at (None: not known)
    addresses: list[str] = field(default_factory=list)  # its host's non-loopback IPv4 addresses
    interfaces: dict[str, str] = field(default_factory=dict)  # address -> interface name
    slurm: SlurmTask | None = None  # the Slurm task it runs as (started by srun), else None


@dataclass(frozen=True)
class SlurmTask:
    """Which task of which Slurm job an engine is, from the environment ``srun`` gives it."""

    job: str  # SLURM_JOB_ID
    procid: int  # SLURM_PROCID: its rank in the job step
    node: int  # SLURM_NODEID: its node's place in the job's node list
    local: int  # SLURM_LOCALID: its place on that node
    nodename: str  # SLURMD_NODENAME


@dataclass(frozen=True)
class MemoryReport:
    """An engine's memory between cells (``%distrain status``, ``reset``)."""

    rss: int  # resident memory, bytes
    gpu: int | None  # the GPU memory its tensors hold (None: CUDA not started)
    gpus: list[dict[str, Any]]  # its GPUs: name, memory in use by every process
    variables: int  # variables in the session namespace
    dropped: list[str] = field(default_factory=list)  # what a reset dropped


@dataclass(frozen=True)
class DebugReply:
    """What a rank's debugger printed for one line of input (``%distrain debug``), and the
    prompt to show next: ``"Pdb "``, the console's ``">>> "`` / ``"... "``, or ``"ended"``."""

    text: str
    prompt: str
    ended: bool = False


@dataclass(frozen=True)
class Waiting:
    """Where a rank's cell is while it runs: its line, and the collective it waits in."""

    line: int
    line_text: str
    collective: str | None = None
    # torch's flight recorder: the last collective this rank entered ("#12 gloo:all_reduce")
    flight: str | None = None


@dataclass(frozen=True)
class Prepared:
    """An engine's part of a new rendezvous (``worker.prepare``): what the backend needs from
    it (``info``: a free port, its address), or why the engine cannot take part any more."""

    info: dict[str, Any] = field(default_factory=dict)
    restart: str | None = None  # the engine must be replaced first, because ...


class MetricPoint(NamedTuple):
    """One logged point, as a rank sends it (the kernel adds the rank)."""

    step: int
    time: float  # unix time, which samples/s is computed from
    metrics: dict[str, Any]


@dataclass
class RunMeta:
    """Facts about a run that the panel shows; the latest one a rank published wins."""

    total_steps: int | None = None  # for the ETA
    global_batch: int | None = None  # Keras: the batch across every replica ...
    per_replica_batch: int | None = None  # ... and each replica's share
    model: str | None = None  # which model autolog sees train (curves continue for the same)


@dataclass
class Stall:
    """Who stalled, at which step, where each waiting rank waits, and which ranks finished the
    cell meanwhile (session ranks): what tells ranks that disagree from one stuck rank."""

    ranks: list[int]  # the ranks that stalled
    steps: dict[int, int | None]  # each rank's last logged step
    idle: dict[int, float]  # how long each stalled rank has been idle, seconds
    framework: str
    release_s: float  # how long a waiting rank takes to notice a lost peer
    cell: str = "the cell"  # the cell's label, Cell In[12]: where each rank waits is in it
    where: dict[int, Waiting | None] = field(default_factory=dict)
    finished: list[int] = field(default_factory=list)  # ranks that finished the cell meanwhile
    all_idle: bool = False  # caught with every rank idle before any progress
