"""The distributed-mistakes checker: reads a cell's AST (never runs it) and explains mistakes.

Each rule is one function ``(tree, context) -> list[Finding]`` in ``RULES``. A finding is one
line: what is wrong, why it matters in distributed training, the fix, and where tutorial 04
explains it (tutorial 08 for the rules about ranks that run different code). Findings never
block a run.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from nbdist.protocol import CellName

TUTORIAL = "notebooks/04_common_mistakes.ipynb"
RANKS_TUTORIAL = "notebooks/08_when_ranks_disagree.ipynb"


@dataclass(frozen=True, kw_only=True)
class CheckContext:
    """What the checker knows about the job the cell will run as.

    ``earlier`` holds the sources of the session's earlier cells: a function defined there and
    called from this cell is checked too (its findings point at the call).
    """

    world_size: int = 2
    gpus: int = 0
    earlier: tuple[str, ...] = ()
    earlier_cells: tuple[CellName, ...] = ()  # how the notebook named each of ``earlier``
    cell: CellName | None = None  # the cell checked: lines as its editor shows them


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One mistake found in a cell (``line``: as the editor shows it, in ``cell``)."""

    rule: str
    line: int
    message: str
    cell: str | None = None  # the cell's label (Cell In[12]); None: code that is not a cell

    def __str__(self) -> str:
        where = f"{self.cell}, line {self.line}" if self.cell else f"line {self.line}"
        return f"nbdist check [{self.rule}] {where}: {self.message}"


def call_name(node: ast.AST) -> str:
    """``a.b.C(...)`` → ``"C"``; ``C(...)`` → ``"C"``; anything else → ``""``."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return ""


def calls(tree: ast.AST, *names: str) -> Iterator[ast.Call]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and call_name(node) in names:
            yield node


def _kwarg(call: ast.Call, name: str) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


def _is_const(node: ast.AST | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value == value


_DDP = ("DistributedDataParallel", "DDP")


def dataparallel_with_ddp(tree: ast.Module, ctx: CheckContext) -> list[Finding]:
    if not any(calls(tree, *_DDP)):
        return []
    return [
        Finding(
            rule="dataparallel-in-ddp",
            line=call.lineno,
            message="nn.DataParallel together with DistributedDataParallel: each DDP worker "
            "already owns one device, and DataParallel inside it splits batches across threads "
            "and breaks gradient averaging. Drop nn.DataParallel and wrap the model in DDP only "
            f"(see {TUTORIAL}, 'DataParallel inside DDP').",
        )
        for call in calls(tree, "DataParallel")
    ]


def loader_without_sampler(tree: ast.Module, ctx: CheckContext) -> list[Finding]:
    if not any(calls(tree, *_DDP)):
        return []
    out = []
    for call in calls(tree, "DataLoader"):
        sampler = _kwarg(call, "sampler")
        if sampler is None and _kwarg(call, "batch_sampler") is None and len(call.args) < 4:
            out.append(
                Finding(
                    rule="loader-without-sampler",
                    line=call.lineno,
                    message="DataLoader without a DistributedSampler in a DDP cell: every rank "
                    "trains on the whole dataset, so each epoch does world_size times the work "
                    "and the ranks see the same batches. Pass "
                    "sampler=DistributedSampler(dataset) "
                    f"(see {TUTORIAL}, 'Data loading').",
                )
            )
        elif sampler is not None and _is_const(_kwarg(call, "shuffle"), True):
            out.append(
                Finding(
                    rule="shuffle-with-sampler",
                    line=call.lineno,
                    message="DataLoader with shuffle=True and a sampler: PyTorch raises "
                    "'sampler option is mutually exclusive with shuffle'. Drop shuffle=True; "
                    "DistributedSampler shuffles itself (shuffle=True is its default) "
                    f"(see {TUTORIAL}, 'Data loading').",
                )
            )
    return out


def missing_set_epoch(tree: ast.Module, ctx: CheckContext) -> list[Finding]:
    if not any(calls(tree, "DistributedSampler")) or any(calls(tree, "set_epoch")):
        return []
    out = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.For)
            and isinstance(node.target, ast.Name)
            and "epoch" in node.target.id.lower()
        ):
            out.append(
                Finding(
                    rule="missing-set-epoch",
                    line=node.lineno,
                    message="epoch loop without sampler.set_epoch(epoch): DistributedSampler "
                    "then shuffles the same way every epoch. Call sampler.set_epoch(epoch) at "
                    f"the top of the loop (see {TUTORIAL}, 'Data loading').",
                )
            )
    return out


def _backend_arg(call: ast.Call) -> ast.expr | None:
    return _kwarg(call, "backend") or (call.args[0] if call.args else None)


def init_process_group_rules(tree: ast.Module, ctx: CheckContext) -> list[Finding]:
    inits = sorted(calls(tree, "init_process_group"), key=lambda c: c.lineno)
    out = []
    for call in inits:
        backend = _backend_arg(call)
        if ctx.gpus == 0 and _is_const(backend, "nccl"):
            out.append(
                Finding(
                    rule="nccl-without-gpu",
                    line=call.lineno,
                    message="init_process_group('nccl') on workers without a GPU: nccl only "
                    "runs on CUDA devices. Use backend='gloo' or drop the argument "
                    f"(see {TUTORIAL}, 'Process groups').",
                )
            )
    for call in inits[1:]:
        out.append(
            Finding(
                rule="second-init",
                line=call.lineno,
                message="a second init_process_group: the default group can be initialised "
                "once per process ('trying to initialize the default process group twice'). "
                "Keep one call, or use dist.new_group for a sub-group "
                f"(see {TUTORIAL}, 'Process groups').",
            )
        )
    return out


def bare_cuda(tree: ast.Module, ctx: CheckContext) -> list[Finding]:
    if ctx.gpus < 2 or ctx.world_size < 2:
        return []
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = call_name(node)
        bare = (name == "cuda" and not node.args and not node.keywords) or (
            name in ("to", "device") and node.args and _is_const(node.args[0], "cuda")
        )
        if bare:
            out.append(
                Finding(
                    rule="cuda-without-local-device",
                    line=node.lineno,
                    message="'cuda' without a device index in a multi-GPU job: under torchrun "
                    "every rank would land on GPU 0. Use .to(device) (nbdist sets it per rank) or "
                    f"torch.device('cuda', local_rank) (see {TUTORIAL}, 'Devices').",
                )
            )
    return out


_RANK_WORDS = ("rank", "is_main", "get_rank", "main_process", "local_rank", "gpu_id")


def _mentions_rank(test: ast.AST) -> bool:
    for node in ast.walk(test):
        if isinstance(node, ast.Name) and node.id in _RANK_WORDS:
            return True
        if isinstance(node, ast.Attribute) and node.attr in _RANK_WORDS:
            return True
    return False


def _guarded(node: ast.AST) -> bool:
    return isinstance(node, (ast.If, ast.IfExp)) and _mentions_rank(node.test)


def _walk_unguarded(
    node: ast.AST, in_loop: bool = False, skip: frozenset[str] = frozenset()
) -> Iterator[tuple[ast.AST, bool]]:
    """Nodes not under an ``if`` on the rank, with whether they sit inside a loop; the bodies
    of the functions named in ``skip`` are left out too."""
    for child in ast.iter_child_nodes(node):
        if _guarded(child):
            continue
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and child.name in skip:
            continue
        yield child, in_loop
        yield from _walk_unguarded(child, in_loop or isinstance(child, (ast.For, ast.While)), skip)


def _called_under_guard_only(tree: ast.Module) -> frozenset[str]:
    """Functions (and methods) of the cell that it calls only under an ``if`` on the rank: a
    save in their body is guarded by their caller (``if self.gpu_id == 0: self._save(...)``)."""
    guarded = {id(n) for g in ast.walk(tree) if _guarded(g) for n in ast.walk(g)}
    out = set()
    for fn in _functions(tree):
        inside = {id(n) for n in ast.walk(fn)}  # its own calls (torch.save in a def save)
        sites = [
            id(n) in guarded
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and call_name(n) == fn.name and id(n) not in inside
        ]
        if sites and all(sites):
            out.add(fn.name)
    return frozenset(out)


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Every function and method defined in ``tree``."""
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


_METRIC_WORDS = ("loss", "acc", "metric", "score")


def unguarded_side_effects(tree: ast.Module, ctx: CheckContext) -> list[Finding]:
    out = []
    for node, in_loop in _walk_unguarded(tree, skip=_called_under_guard_only(tree)):
        if not isinstance(node, ast.Call):
            continue
        name = call_name(node)
        # torch.distributed.checkpoint's save is collective: every rank calls it.
        collective_save = isinstance(node.func, ast.Attribute) and ast.unparse(node.func.value) in (
            "dcp",
            "torch.distributed.checkpoint",
        )
        if name in ("save", "save_weights", "save_model") and not collective_save:
            out.append(
                Finding(
                    rule="unguarded-save",
                    line=node.lineno,
                    message=f"{name}(...) on every rank: all workers write the same file at "
                    "once and can corrupt it. Save from one rank: 'if is_main:' "
                    f"(see {TUTORIAL}, 'One rank speaks').",
                )
            )
        elif name == "print" and in_loop:
            text = ast.unparse(node).lower()
            if any(word in text for word in _METRIC_WORDS):
                out.append(
                    Finding(
                        rule="unguarded-print",
                        line=node.lineno,
                        message="printing metrics from every rank inside the training loop: "
                        "the output repeats world_size times and shows each rank's own batch "
                        "loss. Print under 'if is_main:' "
                        f"(see {TUTORIAL}, 'One rank speaks').",
                    )
                )
    return out


_KERAS_BUILDERS = ("Sequential", "Model", "Functional")
_OPTIMIZERS = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Nadam")


def _scope_blocks(tree: ast.Module) -> list[ast.With]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.With)
        and any(call_name(item.context_expr) == "scope" for item in node.items)
    ]


def keras_outside_scope(tree: ast.Module, ctx: CheckContext) -> list[Finding]:
    blocks = _scope_blocks(tree)
    inside = {id(n) for b in blocks for n in ast.walk(b)}
    if not any(id(c) in inside for c in calls(tree, "compile")):
        return []
    out = []
    for call in calls(tree, *_KERAS_BUILDERS, *_OPTIMIZERS):
        is_keras_optimizer = "optimizers" in ast.unparse(call.func)
        if id(call) in inside or (call_name(call) in _OPTIMIZERS and not is_keras_optimizer):
            continue
        out.append(
            Finding(
                rule="keras-outside-scope",
                line=call.lineno,
                message=f"{call_name(call)}(...) created outside strategy.scope() but compiled "
                "inside it: its variables are not mirrored, and Keras 3 fails in fit with a bare "
                "AssertionError. Create the model and optimizer inside 'with strategy.scope():' "
                f"(see {TUTORIAL}, 'strategy.scope()').",
            )
        )
    return out


def tfconfig_connect(tree: ast.Module, ctx: CheckContext) -> list[Finding]:
    resolvers: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and call_name(node.value) == "TFConfigClusterResolver":
            resolvers.update(t.id for t in node.targets if isinstance(t, ast.Name))
    out = []
    for call in calls(tree, "connect"):
        target = call.func.value if isinstance(call.func, ast.Attribute) else None
        if target is None:
            continue
        if call_name(target) == "TFConfigClusterResolver" or (
            isinstance(target, ast.Name) and target.id in resolvers
        ):
            out.append(
                Finding(
                    rule="tfconfig-connect",
                    line=call.lineno,
                    message="TFConfigClusterResolver has no connect() (only the TPU resolver "
                    "has): this raises AttributeError. MultiWorkerMirroredStrategy reads "
                    "TF_CONFIG itself; pass cluster_resolver=TFConfigClusterResolver() or "
                    f"nothing (see {TUTORIAL}, 'TF_CONFIG').",
                )
            )
    return out


def strategy_after_ops(tree: ast.Module, ctx: CheckContext) -> list[Finding]:
    created = sorted(calls(tree, "MultiWorkerMirroredStrategy"), key=lambda c: c.lineno)
    if not created:
        return []
    first = created[0].lineno
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or node.lineno >= first:
            continue
        text = ast.unparse(node.func)
        if text.startswith(("tf.", "tensorflow.")) and not text.startswith(
            ("tf.distribute", "tf.config", "tensorflow.distribute", "tensorflow.config")
        ):
            return [
                Finding(
                    rule="strategy-after-ops",
                    line=first,
                    message=f"MultiWorkerMirroredStrategy created after other TensorFlow ops "
                    f"(line {node.lineno}): collectives must be configured at program start, "
                    "else 'Collective ops must be configured at program startup'. Create the "
                    f"strategy first (see {TUTORIAL}, 'TF_CONFIG').",
                )
            ]
    return []


def per_worker_batch(tree: ast.Module, ctx: CheckContext) -> list[Finding]:
    if not any(calls(tree, "MultiWorkerMirroredStrategy", "scope")):
        return []
    out = []
    for call in calls(tree, "batch"):
        if call.args and isinstance(call.args[0], ast.Name):
            name = call.args[0].id.lower()
            if "per_worker" in name or "per_replica" in name:
                out.append(
                    Finding(
                        rule="per-worker-batch",
                        line=call.lineno,
                        message=f"dataset batched with {call.args[0].id}: with "
                        "MultiWorkerMirroredStrategy a dataset given to fit is batched with the "
                        "global batch size, which the strategy splits across workers. Use "
                        "per_worker_batch * strategy.num_replicas_in_sync "
                        f"(see {TUTORIAL}, 'Global batch').",
                    )
                )
    return out


_MP_MODULES = ("multiprocessing", "torch.multiprocessing")
_STARTERS = ("spawn", "start_processes", "Process")


def _mp_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(names bound to a multiprocessing module, process starters imported by name)."""
    modules, starters = {"mp", *_MP_MODULES}, set[str]()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in _MP_MODULES:
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module in _MP_MODULES:
            starters.update(a.asname or a.name for a in node.names if a.name in _STARTERS)
    return modules, starters


def spawn_in_cell(tree: ast.Module, ctx: CheckContext) -> list[Finding]:
    modules, starters = _mp_names(tree)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        by_module = (
            isinstance(func, ast.Attribute)
            and func.attr in _STARTERS
            and ast.unparse(func.value) in modules
        )
        if not (by_module or (isinstance(func, ast.Name) and func.id in starters)):
            continue
        target = (
            _kwarg(node, "target") or _kwarg(node, "fn") or (node.args[0] if node.args else None)
        )
        fn = target.id if isinstance(target, ast.Name) else "your_worker"
        out.append(
            Finding(
                rule="spawn-in-cell",
                line=node.lineno,
                message=f"{ast.unparse(func)}(...) starts worker processes from a %%distrain "
                "cell: nbdist already runs one process per rank, and processes started from "
                "a worker cannot join its group (nbdist stops the cell with an error). Call "
                f"{fn}(rank, world_size) directly (see {RANKS_TUTORIAL}, 'One process per rank').",
            )
        )
    return out


def _is_rank(node: ast.AST | None) -> bool:
    """The global rank: ``rank``, ``dist.get_rank()``, ``f"cuda:{rank}"``."""
    if isinstance(node, ast.Name):
        return node.id == "rank"
    if isinstance(node, ast.Call):
        return call_name(node) == "get_rank"
    if isinstance(node, ast.JoinedStr):
        return any(isinstance(v, ast.FormattedValue) and _is_rank(v.value) for v in node.values)
    return False


def rank_as_gpu_index(tree: ast.Module, ctx: CheckContext) -> list[Finding]:
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name, args = call_name(node), node.args
        ids = _kwarg(node, "device_ids")
        if isinstance(ids, (ast.List, ast.Tuple)) and any(map(_is_rank, ids.elts)):
            what = f"device_ids={ast.unparse(ids)}"
        elif _is_rank(_kwarg(node, "output_device")):
            what = "output_device=rank"
        elif name in ("to", "cuda", "set_device") and args and _is_rank(args[0]):
            what = f"{name}({ast.unparse(args[0])})"
        elif name == "device" and any(map(_is_rank, args)):
            what = ast.unparse(node)
        else:
            continue
        out.append(
            Finding(
                rule="rank-as-gpu-index",
                line=node.lineno,
                message=f"{what} uses the global rank as a GPU index: on several hosts rank is "
                "not a GPU index (rank 5 on a 4-GPU host has no GPU 5), and on CPU workers "
                "there is no GPU at all. nbdist already pins each worker to its GPU: use "
                "model.to(device), and DDP(model) without device_ids "
                f"(see {RANKS_TUTORIAL}, 'One process per rank').",
            )
        )
    return out


_GPU_INDEX_WORDS = ("gpu", "rank", "device_id", "device_index")


def _looks_like_gpu_index(node: ast.AST | None) -> bool:
    """An expression that reads as a GPU index: ``3``, ``local_rank``, ``self.gpu_id``,
    ``int(os.environ["LOCAL_RANK"])``, ``f"cuda:{local_rank}"``, ``"cuda:1"``."""
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool):
            return False
        return isinstance(value, int) or (isinstance(value, str) and value.startswith("cuda"))
    if isinstance(node, (ast.Name, ast.Attribute)):
        name = (node.id if isinstance(node, ast.Name) else node.attr).lower()
        return any(word in name for word in _GPU_INDEX_WORDS)
    if isinstance(node, ast.Call) and call_name(node) == "int" and node.args:
        text = ast.unparse(node.args[0]).upper()
        return "RANK" in text or "GPU" in text
    if isinstance(node, ast.Subscript):
        return "RANK" in ast.unparse(node).upper()
    if isinstance(node, ast.JoinedStr):
        head = node.values[0] if node.values else None
        return isinstance(head, ast.Constant) and str(head.value).startswith("cuda")
    return False


_SET_DEVICE = ("set_device", "device_index", "set_device_index")


def cuda_without_gpu(tree: ast.Module, ctx: CheckContext) -> list[Finding]:
    """Code written for GPU workers (``torch.cuda.set_device(LOCAL_RANK)``, ``.to(gpu_id)``,
    ``.cuda()``) run on workers that have none."""
    if ctx.gpus:
        return []
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name, args = call_name(node), node.args
        if name in _SET_DEVICE and isinstance(node.func, ast.Attribute):
            what = f"{ast.unparse(node.func)}(...)"
        elif name == "cuda" and isinstance(node.func, ast.Attribute):
            if ast.unparse(node.func.value) in ("torch", "tf"):
                continue
            what = f".cuda({ast.unparse(args[0]) if args else ''})"
        elif name == "to" and args and _looks_like_gpu_index(args[0]) and not _is_rank(args[0]):
            what = f".to({ast.unparse(args[0])})"
        elif (
            isinstance(ids := _kwarg(node, "device_ids"), (ast.List, ast.Tuple))
            and ids.elts
            and not any(map(_is_rank, ids.elts))
        ):
            what = f"device_ids={ast.unparse(ids)}"
        else:
            continue
        out.append(
            Finding(
                rule="cuda-without-gpu",
                line=node.lineno,
                message=f"{what} asks for a GPU, and these workers have none: torch raises "
                '("Torch not compiled with CUDA", "no attribute \'_cuda_setDevice\'"). Use '
                "the device nbdist set for each worker: model.to(device), x.to(device) (cpu "
                f"here, the worker's own GPU where there are GPUs) (see {TUTORIAL}, 'Devices').",
            )
        )
    return out


def _per_rank_slice(node: ast.AST) -> bool:
    """``data[rank::world_size]``, ``torch.chunk(data, n)[rank]``, ``np.array_split(...)[rank]``."""
    if not isinstance(node, ast.Subscript):
        return False
    index = node.slice
    if isinstance(index, ast.Slice):
        return _is_rank(index.lower) and index.step is not None
    return _is_rank(index) and call_name(node.value) in ("chunk", "array_split", "tensor_split")


_COLLECTIVE_CALLS = ("backward", "all_reduce", "all_gather", "broadcast", "barrier", "reduce")


def uneven_slices(tree: ast.Module, ctx: CheckContext) -> list[Finding]:
    slices: dict[str, int] = {}  # name -> the line of the per-rank slice it comes from
    joined = {id(n) for w in _with_blocks(tree, "Join") for n in ast.walk(w)}
    for node in sorted(
        (n for n in ast.walk(tree) if isinstance(n, ast.Assign)), key=lambda n: n.lineno
    ):
        used = [
            slices[n.id] for n in ast.walk(node.value) if isinstance(n, ast.Name) and n.id in slices
        ]
        source = next(
            (
                n.lineno
                for n in ast.walk(node.value)
                if isinstance(n, ast.Subscript) and _per_rank_slice(n)
            ),
            None,
        )
        line = source or (used[0] if used else None)
        if line is not None:
            for target in node.targets:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        slices[n.id] = line
    out = []
    for loop in ast.walk(tree):
        if not isinstance(loop, ast.For) or id(loop) in joined:
            continue
        from_slice = [
            slices[n.id] for n in ast.walk(loop.iter) if isinstance(n, ast.Name) and n.id in slices
        ]
        collective = next(calls(ast.Module(loop.body, type_ignores=[]), *_COLLECTIVE_CALLS), None)
        if from_slice and collective is not None:
            out.append(
                Finding(
                    rule="uneven-slices",
                    line=loop.lineno,
                    message=f"a warning: this loop runs over a per-rank slice of the data (line "
                    f"{from_slice[0]}) and calls {call_name(collective)}() inside. When the rows "
                    "do not divide evenly the ranks run different numbers of steps, and the rank "
                    "with more waits forever in its last collective. Give every rank the same "
                    "number of batches (DistributedSampler pads; drop_last=True) or wrap the loop "
                    "in torch.distributed.algorithms.Join; if every slice has the same length, "
                    f"ignore this (see {RANKS_TUTORIAL}, 'Uneven inputs').",
                )
            )
    return out


def _with_blocks(tree: ast.Module, name: str) -> list[ast.With]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.With)
        and any(call_name(item.context_expr) == name for item in node.items)
    ]


RULES: tuple[Callable[[ast.Module, CheckContext], list[Finding]], ...] = (
    dataparallel_with_ddp,
    loader_without_sampler,
    missing_set_epoch,
    init_process_group_rules,
    bare_cuda,
    unguarded_side_effects,
    keras_outside_scope,
    tfconfig_connect,
    strategy_after_ops,
    per_worker_batch,
    spawn_in_cell,
    rank_as_gpu_index,
    uneven_slices,
    cuda_without_gpu,
)
# The rules that also look into the functions of earlier cells a cell calls: they are about
# what a call does, wherever it was written (an mp.spawn in a run_demo() defined above).
CALL_RULES = (spawn_in_cell, cuda_without_gpu, init_process_group_rules)


def _definitions(
    sources: tuple[str, ...], cells: tuple[CellName, ...] = ()
) -> dict[str, tuple[ast.FunctionDef | ast.AsyncFunctionDef, str]]:
    """Functions (and methods) the earlier cells define, by name, each with where (``Cell
    In[7]``, its lines as the editor shows them, where the cell's name is known); a later
    definition wins."""
    global _last_definitions
    start, defs = 0, {}
    if _last_definitions is not None:  # the session's cells as last time, and more: go on
        known, named, merged = _last_definitions
        if sources[: len(known)] == known and cells[: len(named)] == named:
            start, defs = len(known), dict(merged)
    for i in range(start, len(sources)):
        defs.update(_cell_functions(sources[i], cells[i] if i < len(cells) else None))
    _last_definitions = (sources, cells, defs)
    return dict(defs)


# The last _definitions: a session's earlier cells only grow, so each cell merges only the
# cells added since (merging them all each time grew with the session).
_last_definitions: tuple[tuple[str, ...], tuple[CellName, ...], dict[str, Any]] | None = None


@functools.lru_cache(maxsize=256)
def _cell_functions(
    source: str, cell: CellName | None
) -> dict[str, tuple[ast.FunctionDef | ast.AsyncFunctionDef, str]]:
    """One earlier cell's functions, parsed once (a session's cells are checked again at every
    cell: parsing them all each time made a warm cell's check grow with the session, 3 ms a
    cell after 50 of them). The rules only read the trees."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}
    if cell is not None:
        ast.increment_lineno(tree, cell.first_line - 1)
    where = cell.label if cell is not None and cell.count is not None else "an earlier cell"
    return {fn.name: (fn, where) for fn in _functions(tree)}


@functools.lru_cache(maxsize=256)
def _cell_findings(
    source: str, world_size: int, gpus: int, first_line: int
) -> tuple[ast.Module, tuple[Finding, ...]] | None:
    """The cell's tree (lines as the editor shows them) and what ``RULES`` find in it, once per
    cell text and job shape: a cell run again (the usual way of a notebook) is not read again.
    None for a cell that does not parse. The rules only read the tree, and only the context's
    ``world_size`` and ``gpus``."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    if first_line != 1:  # every line said as the editor shows it, the messages' too
        ast.increment_lineno(tree, first_line - 1)
    ctx = CheckContext(world_size=world_size, gpus=gpus)
    return tree, tuple(f for rule in RULES for f in rule(tree, ctx))


def _reached(
    tree: ast.Module, defs: dict[str, tuple[ast.FunctionDef | ast.AsyncFunctionDef, str]]
) -> Iterator[tuple[ast.FunctionDef | ast.AsyncFunctionDef, str, ast.Call]]:
    """Earlier cells' functions the cell calls, directly or through one another, each with
    where it is defined and the call in the cell that leads to it."""
    local = {fn.name for fn in _functions(tree)}
    seen: set[str] = set()
    for call in sorted(
        (n for n in ast.walk(tree) if isinstance(n, ast.Call)), key=lambda n: n.lineno
    ):
        stack = [call_name(call)]
        while stack:
            name = stack.pop()
            if name in seen or name in local or name not in defs:
                continue
            seen.add(name)
            fn, where = defs[name]
            yield fn, where, call
            stack.extend(call_name(n) for n in ast.walk(fn) if isinstance(n, ast.Call))


def check_source(source: str, context: CheckContext | None = None) -> list[Finding]:
    """Every finding for ``source``, in line order (``[]`` for a cell that does not parse).

    Functions of earlier cells (``context.earlier``) that the cell calls are checked by the
    rules about calls (``CALL_RULES``); their findings name the function and point at the
    cell line that calls it.
    """
    ctx = context or CheckContext()
    first_line = ctx.cell.first_line if ctx.cell is not None else 1
    checked = _cell_findings(source, ctx.world_size, ctx.gpus, first_line)
    if checked is None:
        return []
    tree, found = checked
    findings = list(found)
    for fn, where, call in _reached(tree, _definitions(ctx.earlier, ctx.earlier_cells)):
        body = ast.Module(body=[fn], type_ignores=[])
        for rule in CALL_RULES:
            for f in rule(body, ctx):
                findings.append(
                    Finding(
                        rule=f.rule,
                        line=call.lineno,
                        message=f"in {fn.name}(), defined in {where} (its line {f.line}): "
                        f"{f.message}",
                    )
                )
    if ctx.cell is not None:
        findings = [replace(f, cell=ctx.cell.label) for f in findings]
    return sorted(findings, key=lambda f: (f.line, f.rule))
