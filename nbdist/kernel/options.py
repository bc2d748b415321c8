"""``%%distrain`` flags → a frozen :class:`RunOptions`, and nothing else."""

from __future__ import annotations

import argparse
import functools
import shlex
from collections.abc import Callable
from dataclasses import dataclass

from IPython.core.error import UsageError

from nbdist.engine.backends import frameworks

BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """Everything a ``%%distrain`` line says, validated.

    ``None`` means "not given": the runner then picks the default (one worker per GPU or 2 on
    CPU, the framework the cell uses, nccl with GPUs and gloo without, no time limit).
    """

    workers: int | None = None
    framework: str | None = None
    backend: str | None = None
    strategy: str | None = None
    push: tuple[str, ...] = ()
    pull: tuple[str, ...] = ()
    out: str | None = None
    ranks: tuple[int, ...] | None = None
    all_output: bool = False  # --ranks all: every rank's lines, however many ranks
    timeout: float | None = None
    stall: float = 60.0
    check: bool = True
    check_only: bool = False
    autolog: bool = True
    plot: bool = True
    smoothing: float = 1.0
    logy: bool | None = None  # the loss axis: None decides from the loss
    scan: tuple[int, ...] | None = None
    fresh: bool = False
    on: tuple[int, ...] | None = None
    expose_tf: bool = False
    profile: int | None = None  # --profile: optimizer steps to profile on every rank


DEFAULT_PROFILE_STEPS = 5


class _Parser(argparse.ArgumentParser):
    """argparse that reports mistakes as IPython UsageErrors instead of exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"%%distrain: {message}. Type %%distrain? for the flags and examples.")


def _names(flag: str) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        bad = [n for n in names if not n.isidentifier()]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"{flag} takes comma-separated variable names, e.g. {flag} model,data "
                f"(got {text!r})"
            )
        return names

    parse.__name__ = "names"
    return parse


def _at_least_one(text: str, *, expected: str, too_few: str) -> int:
    """``text`` as a whole number of at least 1, else the error: ``expected`` (and what was
    given), or ``too_few`` (``{value}``: the number given)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{expected}, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(too_few.format(value=value))
    return value


def _positive_int(text: str) -> int:
    return _at_least_one(
        text,
        expected="expected a whole number of workers",
        too_few="needs at least 1 worker, got {value}; try -n 2",
    )


def _shown_ranks(text: str) -> tuple[int, ...] | str:
    return "all" if text.strip() == "all" else _ranks(text)


def _ranks(text: str) -> tuple[int, ...]:
    try:
        ranks = tuple(int(r) for r in text.split(",") if r.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ranks like 0 or 0,1, got {text!r}") from None
    if not ranks or min(ranks) < 0:
        raise argparse.ArgumentTypeError(f"expected ranks like 0 or 0,1, got {text!r}")
    return ranks


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(c) for c in text.split(",") if c.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected worker counts like 1,2 or 1,2,4, got {text!r}"
        ) from None
    if len(counts) < 2 or min(counts) < 1 or len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(
            f"expected two or more different worker counts like 1,2 or 1,2,4, got {text!r}"
        )
    return counts


def _steps(text: str) -> int:
    return _at_least_one(
        text,
        expected="expected a number of steps, e.g. --profile 5",
        too_few="profiles at least 1 step, got {value}",
    )


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number like 0.1, got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return value


@functools.cache
def run_parser() -> argparse.ArgumentParser:
    """The parser behind ``%%distrain``; its help is part of the magic's docstring. Built once:
    building it took ~2 ms, a tenth of a short cell."""
    p = _Parser(prog="%%distrain", add_help=False, allow_abbrev=False)
    p.add_argument(
        "-n",
        "--workers",
        type=_positive_int,
        metavar="N",
        help="number of workers (default: one per GPU, 2 on a CPU-only machine)",
    )
    p.add_argument(
        "--framework",
        choices=frameworks(),
        help="framework of the cell (default: inferred from the cell)",
    )
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        help="torch.distributed backend (default: nccl with GPUs, gloo without)",
    )
    p.add_argument(
        "--strategy",
        choices=("multiworker", "mirrored"),
        help="TensorFlow: MultiWorkerMirroredStrategy on every worker (default), or "
        "MirroredStrategy in one worker over its machine's GPUs",
    )
    p.add_argument(
        "--expose-tf",
        action="store_true",
        help="TensorFlow multi-worker where the workers cannot get a private network (a "
        "connected cluster, or namespaces refused): accept that their gRPC servers, which run "
        "any code sent to them, are reachable by everyone who reaches the engines' hosts",
    )
    p.add_argument(
        "--push",
        type=_names("--push"),
        default=(),
        metavar="A,B",
        help="notebook variables to send to every worker",
    )
    p.add_argument(
        "--pull",
        type=_names("--pull"),
        default=(),
        metavar="X,Y",
        help="variables to bring back from rank 0 into the notebook",
    )
    p.add_argument(
        "-o",
        "--out",
        metavar="NAME",
        help="store the result object (values, times, output per rank) as NAME",
    )
    p.add_argument(
        "--ranks",
        type=_shown_ranks,
        metavar="R,S",
        help="show the output of these ranks only, or 'all' (default: every rank up to 16 "
        "ranks; beyond, rank 0 and a count of the others' lines)",
    )
    p.add_argument(
        "--timeout", type=_seconds, metavar="S", help="stop the whole job after S seconds"
    )
    p.add_argument(
        "--no-plot",
        dest="plot",
        action="store_false",
        help="no live panel or final figure; the one-line summary only",
    )
    p.add_argument(
        "--smooth",
        type=_fraction,
        default=1.0,
        metavar="A",
        help="EMA smoothing of the loss curve, 0 < A <= 1 (1: none; 0.1: strong)",
    )
    p.add_argument(
        "--logy",
        dest="logy",
        action="store_true",
        default=None,
        help="loss axis logarithmic (default: when the loss spans more than two decades)",
    )
    p.add_argument("--no-logy", dest="logy", action="store_false", help="loss axis linear, always")
    p.add_argument(
        "--no-autolog",
        dest="autolog",
        action="store_false",
        help="record only what the cell passes to log(...); no automatic loss/batch capture",
    )
    p.add_argument(
        "--stall",
        type=_seconds,
        default=60.0,
        metavar="S",
        help="stop the job when a rank makes no progress (logged step, backward, Keras batch) "
        "for S seconds after the first progress of any rank, or, before any progress, when "
        "every rank sits idle (no CPU) for S seconds (default 60)",
    )
    p.add_argument(
        "--scan",
        type=_counts,
        metavar="1,2,...",
        help="scaling study: run the cell once with each number of workers and show the "
        "throughput, speedup and efficiency against the ideal line",
    )
    p.add_argument(
        "--profile",
        type=_steps,
        nargs="?",
        const=DEFAULT_PROFILE_STEPS,
        metavar="STEPS",
        help="torch: profile STEPS optimizer steps on every rank (default "
        f"{DEFAULT_PROFILE_STEPS}, after 2 warm-up steps) and show where each rank's step time "
        "goes: computation, communication, waiting for peers; a timeline, the top operators "
        "and a Chrome trace per rank",
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="run this cell in a throwaway namespace: it neither sees nor leaves variables on "
        "the workers (--scan always does)",
    )
    p.add_argument(
        "--on",
        type=_ranks,
        metavar="R,S",
        help="run the cell on these ranks only (to inspect or plot); a collective in it cannot "
        "complete and is reported",
    )
    p.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help="skip the distributed-mistakes checker for this cell",
    )
    p.add_argument(
        "--check-only",
        action="store_true",
        help="only check the cell for distributed mistakes; run nothing",
    )
    return p


def parse_run_options(line: str) -> RunOptions:
    """Parse a ``%%distrain`` line; raises ``UsageError`` with the fix on any mistake."""
    try:
        argv = shlex.split(line)
    except ValueError as e:
        raise UsageError(f"%%distrain: cannot split the flags ({e}); check the quotes") from None
    ns = run_parser().parse_args(argv)
    if ns.out is not None and not ns.out.isidentifier():
        raise UsageError(f"%%distrain: -o needs a variable name, got {ns.out!r}; e.g. -o result")
    if ns.scan is not None and ns.workers is not None:
        raise UsageError(
            f"%%distrain: --scan {','.join(map(str, ns.scan))} sets the worker counts itself; "
            "drop -n."
        )
    if ns.scan is not None and (ns.strategy == "mirrored" or ns.pull or ns.on):
        flag = "--pull" if ns.pull else "--on" if ns.on else "--strategy mirrored"
        raise UsageError(
            f"%%distrain: --scan runs the cell several times; {flag} does not go with it. "
            "Drop one of them."
        )
    return RunOptions(
        workers=ns.workers,
        framework=ns.framework,
        backend=ns.backend,
        strategy=ns.strategy,
        push=ns.push,
        pull=ns.pull,
        out=ns.out,
        ranks=None if ns.ranks == "all" else ns.ranks,
        all_output=ns.ranks == "all",
        timeout=ns.timeout,
        stall=ns.stall,
        check=ns.check,
        check_only=ns.check_only,
        autolog=ns.autolog,
        plot=ns.plot,
        smoothing=ns.smooth,
        logy=ns.logy,
        scan=ns.scan,
        fresh=ns.fresh or ns.scan is not None,
        on=tuple(sorted(set(ns.on))) if ns.on is not None else None,
        expose_tf=ns.expose_tf,
        profile=ns.profile,
    )
