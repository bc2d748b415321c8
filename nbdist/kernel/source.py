"""Checks on the cell's source before anything is sent to the engines."""

from __future__ import annotations

import ast

from IPython.core.error import UsageError


def parse_cell(source: str) -> ast.Module:
    """Parse the cell, or raise ``UsageError`` naming the line, before any engine is involved."""
    if not source.strip():
        raise UsageError(
            "%%distrain: the cell is empty. Put the training code below the %%distrain line."
        )
    try:
        return ast.parse(source, "<%%distrain cell>")
    except SyntaxError as e:
        where = f"cell line {e.lineno}" if e.lineno else "the cell"
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


def used_frameworks(tree: ast.Module) -> set[str]:
    """Frameworks the cell's imports and names point at."""
    names = imported_modules(tree)
    names.update(node.id for node in ast.walk(tree) if isinstance(node, ast.Name))
    from nbdist.engine import backends

    return {b.NAME for b in backends.all_backends() if names & b.CELL_NAMES}
