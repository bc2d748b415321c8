"""TensorFlow's part of ``%distrain export``'s script (see :mod:`nbdist.kernel.export`): the
strategy set up as nbdist did, and one ``TF_CONFIG`` per worker process to run it with."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nbdist.kernel.export import CellRecord, Script

_SETUP = """
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf

# TF_CONFIG (set by you, one per process) lists every worker and this process's index; it must
# be in the environment before TensorFlow runs its first op.
tf_config = json.loads(os.environ["TF_CONFIG"])
rank = tf_config["task"]["index"]
world_size = len(tf_config["cluster"]["worker"])
local_rank, local_world_size = rank, world_size  # one machine; adjust for several
is_main = rank == 0
_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
threads = max(1, _cores // local_world_size)
tf.config.threading.set_intra_op_parallelism_threads(threads)
tf.config.threading.set_inter_op_parallelism_threads(threads)

try:  # Keras 3's fit fails under multi-worker MWMS (keras-team/keras#20585): nbdist's fix
    from nbdist.engine.backends.tf_mwms import patch_keras

    patch_keras()
except ImportError:
    print("nbdist is not installed: Keras 3 model.fit may fail with several workers "
          "(keras-team/keras#20585)")

gpus = tf.config.list_physical_devices("GPU")
communication = tf.distribute.experimental.CommunicationOptions(
    implementation=tf.distribute.experimental.CommunicationImplementation.NCCL
    if gpus
    else tf.distribute.experimental.CommunicationImplementation.RING,
    timeout_seconds=30,  # a dead peer is reported instead of hanging
)
strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=communication)
"""

_MIRRORED = """
import os
import sys

import tensorflow as tf

rank, world_size, local_rank, local_world_size, is_main = 0, 1, 0, 1, True
strategy = tf.distribute.MirroredStrategy()  # every GPU of this machine (CPU:0 without)
"""


def script(ran: Sequence[CellRecord], used: set[str], path: Path) -> Script:
    """The set-up before the cells, and how to run the script (see export_torch.script)."""
    from nbdist.kernel.export import Script

    last = ran[-1]
    if last.strategy == "mirrored":
        return Script(setup=[_MIRRORED], how=f"Run it with:\n\n    python {path.name}\n")
    n = last.world_size
    workers = ", ".join(f'"localhost:{12345 + i}"' for i in range(n))
    how = (
        f"Run one process per worker, each with its own TF_CONFIG (here {n} on this "
        "machine):\n\n"
        + "\n".join(
            f'    TF_CONFIG=\'{{"cluster": {{"worker": [{workers}]}}, '
            f'"task": {{"type": "worker", "index": {i}}}}}\' python {path.name} &'
            for i in range(n)
        )
        + "\n"
    )
    return Script(setup=[_SETUP], how=how)
