"""Engine entry point, instead of ``python -m ipyparallel.engine`` (see
``nbdist.kernel.local.engine_command``).

When the cluster is started for a cell whose framework is known, ``NBDIST_PRELOAD`` names it and
the engine imports it *before* it starts and registers: torch takes ~2.5 s to import and
``torch._dynamo`` ~1.5 s more, and while the engine registers the controller is starting too, so
paying the imports here rather than in a warm-up call after registration shortens a cold start.
Nothing else differs from a plain ``ipengine``; a failed preload is only logged (the warm-up call
imports again and reports properly).

Before anything else (before any thread starts), an engine of a local cluster joins the cluster's
private network namespace (:mod:`nbdist.engine.netns`); if it cannot, it exits rather than run
on the host's network unannounced.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    # The notebook's folder, after everything else (see nbdist.kernel.local.engine_command;
    # the engine's IPython puts it first again, and worker.engine_info back last).
    sys.path.append(os.getcwd())
    from nbdist.engine import netns

    try:
        netns.join_from_env()
    except OSError as e:
        print(f"nbdist: engine could not join the cluster's private network: {e}", file=sys.stderr)
        sys.exit(1)
    from nbdist.engine import stopping

    # A graceful stop's signal must never end the engine, nor the nanny it starts.
    stopping.ignore_until_the_first_cell()
    framework = os.environ.pop("NBDIST_PRELOAD", "")
    if framework:
        try:
            from nbdist.engine import backends

            backends.load(framework).preload()
        except Exception as e:  # the warm-up call will raise it where the user sees it
            print(f"nbdist: preloading {framework} failed: {e!r}", file=sys.stderr)
    from ipyparallel.engine.app import main as engine_main

    engine_main()


if __name__ == "__main__":
    main()
