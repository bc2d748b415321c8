"""The workloads the launchers in ``launchers.py`` run: same model, data, steps and threads.

``torch_train`` / ``tf_train`` are the CPU comparison; ``gpu_train`` is the one for
``launchers.py --tag gpu``, sized so that a step keeps a GPU busy.

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


GPU_WIDTH, GPU_LAYERS = 4096, 4


def gpu_train(steps: int, batch: int) -> dict[str, Any]:
    """DDP training, on this rank's GPU, of an MLP sized for one: ``GPU_LAYERS`` linear layers of
    width ``GPU_WIDTH`` in bf16 (67M parameters), synthetic data already on the GPU. Needs an
    nccl default process group and the rank's GPU as the current device."""
    import torch
    import torch.distributed as dist
    from torch import nn

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(GPU_LAYERS):
        layers += [nn.Linear(GPU_WIDTH, GPU_WIDTH), nn.ReLU()]
    model = nn.Sequential(*layers[:-1]).to(device=device, dtype=torch.bfloat16)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator(device=device).manual_seed(rank)
    x = torch.randn(batch, GPU_WIDTH, device=device, dtype=torch.bfloat16, generator=g)
    y = torch.randint(0, GPU_WIDTH, (batch,), device=device, generator=g)
    stamps = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()  # the stamp is the step's end on the GPU, not its queueing
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
