"""TensorFlow MultiWorkerMirroredStrategy (and single-engine MirroredStrategy).

TensorFlow configures its collectives once per process, from ``TF_CONFIG``, when the first
strategy is created (see ``shared/NOTES.md``):

* every engine picks its gRPC port once and keeps it for life, so every rendezvous on the same
  engines yields the same ``TF_CONFIG`` (new ports on live engines hang silently);
* one ``MultiWorkerMirroredStrategy`` object serves the whole session, so a Keras model built
  in ``strategy.scope()`` in one cell can ``fit`` in the next; after a failure that broke the
  collectives, :func:`recover` drops it and the next cell gets a new one (~0.04 s, same
  ``TF_CONFIG``);
* every collective has a timeout, so a rank that raised inside ``model.fit`` makes its peers fail
  with DeadlineExceeded instead of blocking forever, and the engines stay usable;
* a worker process that dies poisons the survivors: the notebook side replaces every engine.

Keras 3's ``model.fit`` fails under MultiWorkerMirroredStrategy with two or more workers
(keras-team/keras#20585, still open in Keras 3.15). :func:`patch_keras` fixes the two internals
involved; it is applied only to Keras 3 versions that have them.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from nbdist.engine import stopping
from nbdist.engine.state import EngineState
from nbdist.protocol import Prepared, RankSpec

NAME = "tf"
TITLE = "TensorFlow"  # how messages name it
MODULE = "tensorflow"  # what must be installed for it
# The names a cell of this framework uses (imports, bare names): how nbdist tells which one a
# cell is for.
CELL_NAMES = frozenset({"tensorflow", "tf", "keras", "strategy"})
FLAGS = ("strategy",)  # the %%distrain flags that are this framework's own
CHOSEN_BY = ("strategy",)  # ... and those that choose it when --framework is not given
# Other frameworks' flags that TensorFlow cells are asked for, and why they are not here.
NOT_HERE = {
    "profile": (
        "nbdist's step breakdown reads torch.profiler's events; TensorFlow's profiler "
        "(tf.profiler.experimental.start(logdir) ... stop(), then TensorBoard's Profile tab) "
        "records each worker's trace, CollectiveReduceV2 ops included, but nbdist does not read "
        "it yet. Call it in the cell, or drop --profile"
    ),
}
# TensorFlow starts its runtime at import (and loads CUDA libraries before the GPU pinning):
# imported by the warm-up call, after the engine registered.
PRELOAD_AT_START = False
# What ranks that ran different numbers of steps should do instead.
SAME_STEPS = (
    "give every worker the same number of steps (the same steps_per_epoch, a dataset each "
    "worker reads the same number of batches from)"
)
# Stop ends a Keras fit at a batch every worker reaches (stop_board: the coordination service).
GRACEFUL_STOP = True
KEEPS_RENDEZVOUS_AFTER_FAILURE = True
# A worker that finished cannot free a peer blocked in a collective with it (the collective
# timeout does), and dropping its strategy meanwhile crashed TensorFlow: a segfault in the
# "collective_ops" thread of the waiting worker, or in the finished worker itself (3 of 8 full
# test runs here, kernel log, 2026-12-03). Its session is dropped once no rank waits any more.
RELEASE_FREES_PEERS = False
# A KeyboardInterrupt lands anywhere in TensorFlow's Python code (a __del__ releasing a function,
# a collective being set up), and its runtime is not safe after that: later cells on the same
# engines segfaulted (in the main thread and in "collective_ops", about every other full test
# run here). Engines that got SIGINT during a TF cell are replaced.
SURVIVES_INTERRUPT = False
# Healing (nbdist.kernel.healing): this strategy cannot change its cluster in place, so a
# healing replaces every engine, each taking a survivor's variables (its Keras models saved
# whole), and the next cell builds the models again in its new strategy's scope.
NOT_HEALED = None  # (it heals)
FIXED_CLUSTER = "MultiWorkerMirroredStrategy"  # the group that cannot change its cluster
GROUP = "strategy"  # what messages call what a failure rebuilds
REWRAP = "builds {models} in its new strategy's scope"  # the next cell, for kept models
EXPORTER = "nbdist.kernel.export_tf"  # %distrain export's part for it (a kernel module)
ENGINE_MB = 596  # as torch's ENGINE_MB: TensorFlow 2.21's CPU build, measured the same way
# TensorFlow's C++ runtime logs through absl, which ignores TF_CPP_MIN_LOG_LEVEL for what it
# writes before absl::InitializeLog: "I0000 00:00:1796295494.300853    9290 coordination_
# service.cc:221] Initializing CoordinationService" and a dozen more per new strategy, captured
# from the engine's stderr whenever they reach it before the task ends. These are INFO and
# WARNING lines, the ones TF_CPP_MIN_LOG_LEVEL=2 asks TensorFlow to leave out; errors stay.
# One of them ("Example stragglers:") continues on a line of its own with a task name.
OUTPUT_NOISE = (
    r"[IW]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [\w.-]+:\d+\] "
    r"|/job:\w+/replica:\d+/task:\d+$"
)
COLLECTIVE_TIMEOUT_S = 15.0
STRATEGIES = ("multiworker", "mirrored")

log = logging.getLogger(__name__)


def collective_timeout(options: Mapping[str, Any]) -> float:
    """Seconds a collective may wait for a peer: the default, or less with ``--timeout``."""
    limit = options.get("timeout")
    return min(COLLECTIVE_TIMEOUT_S, limit) if limit else COLLECTIVE_TIMEOUT_S


def peer_release_s(options: Mapping[str, Any]) -> float:
    """How long a rank blocked in a collective takes to notice that its peer is gone."""
    return collective_timeout(options)


def rendezvous_key(options: Mapping[str, Any], *, gpus: bool, world: int) -> tuple[Any, ...]:
    """What a strategy is made for (``--timeout`` left out, as for torch)."""
    return (NAME, options.get("strategy") or "multiworker", world)


def opens_servers(options: Mapping[str, Any]) -> bool:
    """MultiWorkerMirroredStrategy starts a gRPC server in every worker, which runs any code
    sent to it; ``--strategy mirrored`` runs in one process and opens none."""
    return options.get("strategy") != "mirrored"


def workers_used(options: Mapping[str, Any], available: int) -> int:
    """MirroredStrategy runs in one engine (over that machine's GPUs); MWMS on all of them."""
    return 1 if options.get("strategy") == "mirrored" else available


def _mode(options: Mapping[str, Any]) -> str:
    return "mirrored" if options.get("strategy") == "mirrored" else "multiworker"


def preload() -> None:
    """Imports only: no op runs, so threading and TF_CONFIG can still be set afterwards."""
    # TensorFlow's C++ INFO lines and its per-collective Python INFO logs would flood the cell.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.get_logger().setLevel(logging.WARNING)
    import keras  # noqa: F401 - ~2 s of imports, paid here rather than in the first cell


def warm_up(*, local_world_size: int, cpus: int) -> None:
    import tensorflow as tf

    from nbdist.engine.state import engine_state

    preload()
    index = engine_state().cuda_index
    gpus = tf.config.list_physical_devices("GPU")
    if index is not None and local_world_size > 1 and index < len(gpus):
        # The engine sees its host's GPUs (as torch's cuda:<local rank> needs); a worker of a
        # multi-worker strategy uses its own only, as one worker per GPU.
        tf.config.set_visible_devices(gpus[index], "GPU")

    # Threading must be set before TensorFlow runs its first op in this process.
    threads = max(1, cpus // max(1, local_world_size))
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)


def prepare(
    *, rank: int, world_size: int, options: Mapping[str, Any], state: EngineState
) -> Prepared:
    slot = state.slot(NAME)
    mode = _mode(options)
    if slot.get("mode") not in (None, mode):
        return Prepared(
            restart=f"TensorFlow in these workers already ran {slot['mode']} collectives and "
            f"cannot switch to {mode} in the same process"
        )
    configured = slot.get("tf_config")
    if mode == "multiworker" and configured is not None:
        workers = len(json.loads(configured)["cluster"]["worker"])
        if workers != world_size:
            return Prepared(
                restart=f"TensorFlow in these workers is set up for {workers} workers and "
                f"cannot join a job of {world_size} in the same process"
            )
    if "port" not in slot:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((state.address or "127.0.0.1", 0))
            slot["port"] = s.getsockname()[1]
    return Prepared(info={"port": slot["port"]})


def rendezvous(hosts: Sequence[str], prepared: Sequence[Prepared]) -> list[dict[str, str]]:
    """Per-rank ``TF_CONFIG``: every engine a worker, task index = rank."""
    workers = [f"{host}:{p.info['port']}" for host, p in zip(hosts, prepared, strict=True)]
    return [
        {
            "TF_CONFIG": json.dumps(
                {"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}},
                sort_keys=True,
            )
        }
        for rank in range(len(hosts))
    ]


def patch_keras() -> bool:
    """Fix Keras 3 ``fit`` under multi-worker MWMS; returns whether the patch applies."""
    import keras

    if not keras.__version__.startswith("3."):
        return False
    from keras.src.backend.tensorflow import trainer as tf_trainer

    if getattr(tf_trainer, "_nbdist_patched", False):
        return True
    if not (
        hasattr(tf_trainer, "reduce_per_replica")
        and hasattr(tf_trainer.TensorFlowTrainer, "_maybe_symbolic_build")
    ):
        log.warning(
            "Keras %s: internals changed; multi-worker fit is not patched", keras.__version__
        )
        return False
    import tensorflow as tf
    from keras.src import tree

    original_reduce = tf_trainer.reduce_per_replica

    def reduce_per_replica(values: Any, strategy: Any, reduction: Any) -> Any:
        # Keras reduces scalar metrics across workers with axis=0, which scalars don't have.
        if reduction in ("auto", "mean") and tf_trainer._collective_all_reduce_multi_worker(
            strategy
        ):
            return tree.map_structure(
                lambda v: strategy.reduce("MEAN", v, axis=None if v.shape.rank == 0 else 0),
                values,
            )
        return original_reduce(values, strategy, reduction)

    def _maybe_symbolic_build(self: Any, iterator: Any = None, data_batch: Any = None) -> Any:
        if self._distribute_strategy is None:
            return
        if iterator is not None:
            for _, _, it in iterator:
                batch = next(it)
                # Only shapes matter for the symbolic build: a local replica's batch will do.
                # Keras reduced it across workers, which MWMS cannot do outside a tf.function.
                data_batch = tree.map_structure(
                    lambda x: (
                        self.distribute_strategy.experimental_local_results(x)[0]
                        if isinstance(x, tf.distribute.DistributedValues)
                        else x
                    ),
                    batch,
                )
                break
        with self.distribute_strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    tf_trainer.reduce_per_replica = reduce_per_replica
    tf_trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
    tf_trainer._nbdist_patched = True
    return True


@contextmanager
def session(spec: RankSpec, state: EngineState) -> Iterator[dict[str, Any]]:
    with _quiet(), _session(spec, state) as names:
        yield names


@contextmanager
def _session(spec: RankSpec, state: EngineState) -> Iterator[dict[str, Any]]:
    import tensorflow as tf

    slot = state.slot(NAME)
    patch_keras()
    gpus = tf.config.list_physical_devices("GPU")
    mode = _mode(spec.options)
    timeout = collective_timeout(spec.options)
    strategy = slot.get("strategy")
    if strategy is not None and slot.get("strategy_key") == mode:
        # The session's strategy, with the collective timeout it was made with: models built
        # in its scope in earlier cells must keep working, so a later --timeout does not
        # replace it.
        pass
    elif mode == "mirrored":
        strategy = tf.distribute.MirroredStrategy()
    else:
        # The same TF_CONFIG as any earlier strategy in this process (new ports on live engines
        # hang silently): each engine keeps its port and address, and a job of another size
        # gets the engines replaced first (prepare's "restart").
        tf_config = os.environ["TF_CONFIG"]
        implementation = (
            tf.distribute.experimental.CommunicationImplementation.NCCL
            if gpus
            else tf.distribute.experimental.CommunicationImplementation.RING
        )
        options = tf.distribute.experimental.CommunicationOptions(
            implementation=implementation, timeout_seconds=timeout
        )
        strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
        slot["tf_config"] = tf_config
    slot.update(mode=mode, strategy=strategy, strategy_key=mode)
    with _autolog(state.recorder, spec.world_size):
        yield {"tf": tf, "strategy": strategy}


@contextmanager
def _autolog(recorder: Any, world_size: int) -> Iterator[None]:
    """Add a callback to every ``model.fit`` of the run that records each batch's loss.

    Keras passes the epoch's running mean as ``logs["loss"]``; the callback turns it back into
    the batch's own loss, so plots do not jump at epoch boundaries. ``samples`` is this worker's
    share of the global batch when ``fit`` is given ``batch_size``.
    """
    import keras

    if recorder is None or not recorder.autolog:
        yield
        return

    class _Autolog(keras.callbacks.Callback):
        def __init__(self, per_worker: int | None) -> None:
            super().__init__()
            self.per_worker = per_worker
            self.mean = 0.0
            self.synced = False
            self.stop: stopping.StopAtStep | None = None

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self.mean = 0.0

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self._record(batch, logs)
            try:  # a graceful stop ends fit after this batch, on every worker alike
                stopping.boundary("batch")
            except stopping.StopAtStep as stop:
                self.model.stop_training = True
                self.stop = stop

        def _record(self, batch: int, logs: Any) -> None:
            if not logs or "loss" not in logs:
                return
            mean = float(logs["loss"])
            n = batch + 1
            metrics: dict[str, Any] = {"loss": mean * n - self.mean * (n - 1)}
            self.mean = mean
            if self.per_worker:
                metrics["samples"] = self.per_worker
            recorder.auto(**metrics)
            recorder.steps += 1
            if self.synced:  # each batch all-reduced its gradients across the workers
                recorder.collectives = (recorder.collectives or 0) + 1

        def on_train_begin(self, logs: Any = None) -> None:
            steps, epochs = self.params.get("steps"), self.params.get("epochs")
            if steps and epochs:
                recorder.expect(steps * epochs)
            recorder.model(self.model)
            # A model built outside strategy.scope() trains on this worker alone.
            strategy = getattr(self.model, "distribute_strategy", None)
            self.synced = getattr(strategy, "num_replicas_in_sync", 1) > 1
            if recorder.collectives is None:
                recorder.collectives = 0

    real_fit = keras.Model.fit

    def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        batch = kwargs.get("batch_size")
        if batch is None and args:
            try:  # a batched tf.data.Dataset knows its batch size
                batch = int(args[0]._batch_size)
            except (AttributeError, TypeError, ValueError):
                batch = None
        if batch:
            recorder.meta(global_batch=batch, per_replica_batch=batch // world_size)
        callbacks = list(kwargs.get("callbacks") or [])
        autolog = _Autolog(batch // world_size if batch else None)
        callbacks.append(autolog)
        kwargs["callbacks"] = callbacks
        history = real_fit(self, *args, **kwargs)
        if autolog.stop is not None:  # fit ended at the agreed batch: so does the cell
            raise autolog.stop
        return history

    own = "fit" in vars(keras.Model)  # fit is inherited from the backend's trainer
    keras.Model.fit = fit
    try:
        yield
    finally:
        if own:
            keras.Model.fit = real_fit
        else:
            del keras.Model.fit


@contextmanager
def _quiet() -> Iterator[None]:
    """Silence two messages every MWMS run would print, neither of them about the user's code.

    absl warns "Enabling collective ops after program startup may cause error when accessing
    previously created tensors" each time a strategy is created (nbdist creates no tensor before
    its strategy), and Keras warns that ``shuffle=True`` (``fit``'s default) is ignored for every
    ``tf.data`` input.
    """
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore",
                message="`shuffle=True` was passed, but will be ignored",
                category=UserWarning,
            )
            yield
    finally:
        absl.setLevel(level)


def stop_board(spec: RankSpec, state: EngineState) -> Any:
    """The coordination service's key-value store that every worker of the strategy reaches
    (one worker: a board of its own)."""
    if spec.world_size == 1:
        return stopping.OneRank()
    from tensorflow.python.eager import context

    return stopping.KeyValueBoard(context.context(), spec.nonce or str(spec.run_id))


def healthy(state: EngineState, *, timeout: float) -> str | None:
    """A Python error on every rank leaves TensorFlow's collectives as they were; a collective
    that failed shows as a lost-peer error, which the notebook sees in the reports."""
    return None


def recover(state: EngineState) -> None:
    """A new strategy for the next cell; the same TF_CONFIG works again after a timeout."""
    slot = state.slot(NAME)
    slot.pop("strategy", None)
    slot.pop("strategy_key", None)
