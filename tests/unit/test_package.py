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
    modules = {"errors", "kernel", "engine"}  # subpackages, reachable but not API
    assert public - modules == set(nbdist.__all__) - {"__version__"}
