"""The one workload every launcher in ``launchers.py`` runs: same model, data, steps and threads.

Imported by the torchrun script, accelerate's ``notebook_launcher`` function, the ``%%distrain``
cells and the plain TensorFlow workers. Each returns a dict with the wall-clock time
(``time.time()``)
at the end of every step, so the driver can compute time-to-first-step from its own launch time.
"""

from __future__ import annotations

import time
from typing import Any

IN, HIDDEN, OUT = 256, 1024, 10


def torch_train(steps: int, batch: int, threads: int = 1) -> dict[str, Any]:
    """DDP training of an MLP on synthetic data; needs a default process group (gloo or nccl)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(threads)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    )
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(IN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, OUT),
    ).to(device)
    model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, IN, generator=g).to(device)
    y = torch.randint(0, OUT, (batch,), generator=g).to(device)
    stamps = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if device is not None:
            torch.cuda.synchronize()
        stamps.append(time.time())
    return {"rank": rank, "world": world, "batch": batch, "stamps": stamps, "loss": float(loss)}


def tf_train(strategy: Any, steps: int, batch: int) -> dict[str, Any]:
    """Keras ``fit`` of the same MLP under ``strategy``; ``batch`` is per worker."""
    import keras
    import numpy as np

    world = strategy.num_replicas_in_sync
    global_batch = batch * world
    stamps: list[float] = []

    class Stamp(keras.callbacks.Callback):
        def on_train_batch_end(self, step, logs=None):
            stamps.append(time.time())

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((IN,)),
                keras.layers.Dense(HIDDEN, activation="relu"),
                keras.layers.Dense(HIDDEN, activation="relu"),
                keras.layers.Dense(OUT),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * global_batch, IN)).astype("float32")
    y = rng.integers(0, OUT, size=(steps * global_batch,))
    hist = model.fit(
        x, y, batch_size=global_batch, epochs=1, verbose=0, shuffle=False, callbacks=[Stamp()]
    )
    return {"world": world, "batch": batch, "stamps": stamps, "loss": hist.history["loss"][-1]}
