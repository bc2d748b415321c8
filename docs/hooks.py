"""MkDocs hooks: the tutorials and the repository files the pages link to, in the site.

The pages link to files outside ``docs/`` as a reader of the repository sees them: a tutorial
as ``../notebooks/01_first_distributed_cell.ipynb``, a test as ``../tests/unit/test_x.py``.
Those links work on a code host as they are; for the site:

* every notebook in ``notebooks/`` becomes the page ``notebooks/<name>/``, rendered by
  mkdocs-jupyter from its stored outputs (``execute: false`` in ``mkdocs.yml``), and a link to
  ``../notebooks/<name>.ipynb`` leads there;
* any other file a page links to (a test, a benchmark script, ``Makefile``) is copied into the
  site at its path in the repository, and the link leads to the copy.

A link to a repository file that does not exist fails the build, as a broken link between
pages does under ``mkdocs build --strict``.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
# The target of a Markdown link or image, up to an optional #anchor or title.
LINK = re.compile(r"(\]\()([^)\s#]+)")


def _repo_file(config, path: str) -> File:
    """A repository file (``path`` relative to the repository's root) at the same path in the
    site. A file with ``src_dir`` the repository, not ``File.generated``: mkdocs-jupyter's
    wrapper finds the notebook to read from ``src_dir``, and a generated file has none."""
    return File(
        path,
        src_dir=str(ROOT),
        dest_dir=config["site_dir"],
        use_directory_urls=config["use_directory_urls"],
    )


def _outside_docs(page_uri: str, target: str) -> str | None:
    """The repository path a page's link points to, when it leaves ``docs/``; else None."""
    if "://" in target or target.startswith(("/", "mailto:")):
        return None
    path = posixpath.normpath(posixpath.join("docs", posixpath.dirname(page_uri), target))
    if path.startswith("docs/") or path.startswith("../"):
        return None
    return path


# Before mkdocs-jupyter's on_files (priority 0), so that it renders the tutorials it finds.
@event_priority(50)
def on_files(files, config):
    docs = Path(config["docs_dir"])
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        files.append(_repo_file(config, f"notebooks/{notebook.name}"))
    wanted: set[str] = set()
    for page in docs.rglob("*.md"):
        uri = page.relative_to(docs).as_posix()
        for _, target in LINK.findall(page.read_text(encoding="utf-8")):
            path = _outside_docs(uri, target)
            if path is not None and not path.startswith("notebooks/"):
                wanted.add(path)
    for path in sorted(wanted):
        source = ROOT / path
        if not source.is_file():
            raise PluginError(f"a page links to {path}, which is not a file in the repository")
        files.append(_repo_file(config, path))
    return files


def on_page_markdown(markdown, page, config, files):
    def site_link(match: re.Match) -> str:
        path = _outside_docs(page.file.src_uri, match.group(2))
        if path is None:
            return match.group(0)
        here = posixpath.dirname(page.file.src_uri)
        return match.group(1) + posixpath.relpath(path, here or ".")

    return LINK.sub(site_link, markdown)
