import subprocess
import sys

import nbdist


def test_import_loads_no_framework_or_widgets():
    code = (
        "import sys, nbdist, nbdist.kernel.magic, nbdist.engine.worker;"
        "print(sorted(m for m in ('torch', 'tensorflow', 'keras', 'ipywidgets', 'ipyparallel',"
        " 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_public_api_is_curated():
    public = {name for name in dir(nbdist) if not name.startswith("_")}
    # Modules and subpackages, reachable but not API.
    modules = {"errors", "kernel", "engine", "protocol", "ranks"}
    assert public - modules == set(nbdist.__all__) - {"__version__"}


def test_load_ext_on_windows_says_what_works(monkeypatch):
    import sys

    import pytest
    from IPython.core.error import UsageError

    import nbdist

    monkeypatch.setattr(sys, "platform", "win32")
    with pytest.raises(UsageError) as info:
        nbdist.load_ipython_extension(object())
    assert str(info.value) == (
        "nbdist needs Linux or macOS (it runs its workers as POSIX processes); on Windows, run "
        "Jupyter inside WSL2, where nbdist works as on Linux."
    )


def test_the_package_says_which_systems_it_runs_on():
    from importlib.metadata import metadata

    classifiers = metadata("nbdist").get_all("Classifier")
    assert "Operating System :: POSIX :: Linux" in classifiers
    assert "Operating System :: MacOS" in classifiers


def test_every_error_nbdist_raises_is_in_one_tree():
    import inspect

    from nbdist import errors

    raised = [
        c
        for module in _modules()
        for _, c in inspect.getmembers(module, inspect.isclass)
        if issubclass(c, Exception) and c.__module__.startswith("nbdist")
    ]
    assert errors.ExportError in raised
    outside = {c.__qualname__ for c in raised if not issubclass(c, errors.DistrainError)}
    # A warning, and signals caught where they are raised (on the engine; in the kernel: a
    # value that cannot be rebuilt is said in a UsageError, or in the rank's failure).
    assert outside == {"NbdistWarning", "_PullError", "UnpackError"}


def _modules():
    import importlib
    import pkgutil

    import nbdist

    for info in pkgutil.walk_packages(nbdist.__path__, "nbdist."):
        yield importlib.import_module(info.name)
