"""Checks on the cell's source before anything is sent to the engines."""

from __future__ import annotations

import ast

from IPython.core.error import UsageError

from nbdist.kernel.checks import calls
from nbdist.protocol import CellName


def parse_cell(source: str, cell: CellName | None = None) -> ast.Module:
    """Parse the cell, or raise ``UsageError`` naming the line (as the editor shows it, in
    ``cell``), before any engine is involved."""
    if not source.strip():
        raise UsageError(
            "%%distrain: the cell is empty. Put the training code below the %%distrain line."
        )
    try:
        return ast.parse(source, "<%%distrain cell>")
    except SyntaxError as e:
        cell = cell or CellName()
        where = cell.at(e.lineno + cell.first_line - 1) if e.lineno else cell.label
        text = f": {e.text.strip()}" if e.text else ""
        raise UsageError(
            f"%%distrain: syntax error at {where}{text} ({e.msg}). Nothing was run; fix the line "
            "and run the cell again."
        ) from None


def imported_modules(tree: ast.AST) -> set[str]:
    """The top-level packages the cell imports (``transformers`` for ``from transformers.x
    import y``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def dotted_imports(tree: ast.AST) -> set[str]:
    """The submodules the cell imports as ``import a.b``, which binds only ``a``: a healing
    imports them where the session arrives, since ``a`` alone would lack ``a.b``."""
    return {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
        if "." in alias.name
    }


# What a training step calls, as the panel counts steps (autolog's backward, an optimizer step,
# log()).
STEP_CALLS = frozenset({"backward", "step", "log"})


def loop_steps(tree: ast.Module) -> int | None:
    """How many steps the cell's own text says its training loop takes, for the panel's ETA:
    a ``for ... in range(N)`` loop (constant bounds) whose body takes a step (calls
    ``backward()``, ``.step()`` or ``log()``, itself or through a function the cell defines),
    times the sizes of the ``range`` loops around it. None where the text does not say (a loop
    over a data loader, a bound that is a variable)."""
    stepping = {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and _steps(node.body, frozenset())
    }
    found: list[int] = []

    def visit(body: list[ast.stmt], outer: int | None) -> None:
        for node in body:
            if isinstance(node, (ast.For, ast.AsyncFor)):
                n = _range_length(node.iter)
                size = None if n is None or outer is None else outer * n
                if _steps(node.body, stepping):
                    if size is not None:
                        found.append(size)
                    continue
                visit(node.body, size)
            elif isinstance(node, (ast.With, ast.AsyncWith, ast.If, ast.Try)):
                for part in ("body", "orelse", "finalbody"):
                    visit(getattr(node, part, []) or [], outer)

    visit(tree.body, 1)
    return found[0] if len(found) == 1 else None


def _steps(body: list[ast.stmt], stepping: frozenset[str] | set[str]) -> bool:
    """Whether ``body`` takes a training step itself, outside loops of its own."""
    for stmt in body:
        if isinstance(stmt, (ast.For, ast.AsyncFor, ast.While, ast.FunctionDef, ast.ClassDef)):
            continue
        if next(calls(stmt, *STEP_CALLS, *stepping), None) is not None:
            return True
    return False


def _range_length(node: ast.expr) -> int | None:
    if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "range"):
        return None
    args = []
    for a in node.args:
        try:
            args.append(int(ast.literal_eval(a)))
        except (ValueError, TypeError, SyntaxError):
            return None
    if not 1 <= len(args) <= 3 or node.keywords:
        return None
    return len(range(*args))


def used_frameworks(tree: ast.Module) -> set[str]:
    """Frameworks the cell's imports and names point at."""
    names = imported_modules(tree)
    names.update(node.id for node in ast.walk(tree) if isinstance(node, ast.Name))
    from nbdist.engine import backends

    return {b.NAME for b in backends.all_backends() if names & b.CELL_NAMES}
