"""Where ``--profile``'s traces pass on the engine: a folder of this user's alone, never the
shared temp folder (nbdist.engine.profiling._trace)."""

from __future__ import annotations

import gzip
import os
import stat
import tempfile

from nbdist.engine.profiling import _trace


class Exporter:
    """Writes a trace as torch's exporter does: ``<path>.tmp`` with mode 0666, then renamed."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.modes: list[int] = []

    def export_chrome_trace(self, path: str) -> None:
        folder = os.path.dirname(path)
        self.paths.append(path)
        self.modes.append(stat.S_IMODE(os.stat(folder).st_mode))
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        os.write(fd, b'{"traceEvents": []}')
        os.close(fd)
        os.replace(tmp, path)


def test_a_trace_is_exported_into_a_private_folder_and_nothing_is_left():
    prof = Exporter()
    data = _trace(prof)
    assert gzip.decompress(data) == b'{"traceEvents": []}'
    (path,) = prof.paths
    folder = os.path.dirname(path)
    assert os.path.dirname(folder) == tempfile.gettempdir()  # a folder inside, not the folder
    assert prof.modes == [0o700]  # nobody else can read the trace, or plant a .tmp link there
    assert not os.path.exists(folder)
