"""A notebook's kernel in a process of its own (inside a simulated host's network, say), driven
cell by cell: ``KernelProcess(prefix).run("%distrain status")`` returns what the cell printed,
its error and its value, as a notebook would show them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

DRIVER = textwrap.dedent(
    """
    import json, os, sys, traceback
    os.environ.setdefault("NBDIST_PRESTART", "0")
    from IPython.testing.globalipapp import start_ipython
    from IPython.utils.capture import capture_output
    ip = start_ipython()
    ip.run_line_magic("load_ext", "nbdist")
    reply = os.fdopen(os.dup(1), "w")
    for line in sys.stdin:
        code = json.loads(line)
        with capture_output() as cap:
            result = ip.run_cell(code)
        error = result.error_in_exec or result.error_before_exec
        rendered = ""
        if error is not None:
            render = getattr(error, "_render_traceback_", None)
            rendered = "\\n".join(render()) if render else "".join(
                traceback.format_exception(type(error), error, error.__traceback__))
        value = result.result
        reply.write(json.dumps({
            "out": cap.stdout, "err": cap.stderr, "error": type(error).__name__ if error else None,
            "rendered": rendered, "value": repr(value) if value is not None else None,
        }) + "\\n")
        reply.flush()
    ip.run_line_magic("unload_ext", "nbdist")
    """
)


class KernelProcess:
    """A kernel started with ``prefix`` (e.g. ``ip netns exec NS``) before its Python."""

    def __init__(self, prefix: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-c", DRIVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )

    def send(self, code: str) -> None:
        """Start a cell; :meth:`result` waits for what it gave."""
        self.proc.stdin.write(json.dumps(code) + "\n")
        self.proc.stdin.flush()

    def result(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the kernel exited: {self.proc.stderr.read()[-3000:]}")
        return json.loads(line)

    def run(self, code: str) -> dict[str, Any]:
        self.send(code)
        return self.result()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
