"""nbdist: put ``%%distrain`` on a notebook cell and it runs as a distributed training job.

Load it with ``%load_ext nbdist``; ``%%distrain?`` shows the flags and examples.
``import nbdist`` imports no framework: torch and TensorFlow load on the engines, when a job
needs them.
"""

from typing import Any as _Any

from nbdist.engine.metrics import log
from nbdist.errors import (
    ClusterError,
    DistrainError,
    ExportError,
    JobInterrupted,
    JobStalled,
    JobTimeout,
    NbdistWarning,
    RankFailure,
    RanksDisagree,
    WorkerDied,
    WorkerError,
)
from nbdist.kernel.breakdown import ProfileReport, RankProfile
from nbdist.kernel.checks import CheckContext, Finding, check_source
from nbdist.kernel.options import RunOptions
from nbdist.kernel.result import DistrainResult, RankResult
from nbdist.kernel.scan import ScanResult

__version__ = "0.1.0"

__all__ = [
    "CheckContext",
    "ClusterError",
    "DistrainError",
    "DistrainResult",
    "ExportError",
    "Finding",
    "JobInterrupted",
    "JobStalled",
    "JobTimeout",
    "NbdistWarning",
    "ProfileReport",
    "RankFailure",
    "RankProfile",
    "RankResult",
    "RanksDisagree",
    "RunOptions",
    "ScanResult",
    "WorkerDied",
    "WorkerError",
    "__version__",
    "check_source",
    "load_ipython_extension",
    "log",
    "unload_ipython_extension",
]


def load_ipython_extension(ipython: _Any) -> None:
    """``%load_ext nbdist``: register ``%%distrain`` / ``%distrain`` in this kernel, and (in a
    Jupyter kernel) begin starting the workers in the background; it returns at once."""
    import sys

    if sys.platform == "win32":
        from IPython.core.error import UsageError

        raise UsageError(
            "nbdist needs Linux or macOS (it runs its workers as POSIX processes); on Windows, "
            "run Jupyter inside WSL2, where nbdist works as on Linux."
        )
    from nbdist.kernel.magic import DistrainMagics

    magics = DistrainMagics(ipython)
    ipython.register_magics(magics)
    magics.start_in_background()


def unload_ipython_extension(ipython: _Any) -> None:
    """``%unload_ext nbdist``: stop the cluster this kernel started."""
    magics = ipython.magics_manager.registry.pop("DistrainMagics", None)
    if magics is not None:
        magics.close()
