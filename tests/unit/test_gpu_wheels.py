"""make gpu-wheels keeps the wheels of what the bare GPU machine lacks, and nothing it has."""

import importlib.util
from importlib import metadata
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "gpu_wheels", Path(__file__).parents[2] / "scripts" / "gpu_wheels.py"
)
gpu_wheels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_wheels)

DOWNLOADED = [
    "ipyparallel-9.2.0-py3-none-any.whl",
    "pyzmq-27.3.0-cp312-abi3-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl",
    "python_dateutil-4.0.0-py3-none-any.whl",  # matplotlib's: on the machine
    "psutil-7.2.2-cp36-abi3-manylinux2014_x86_64.whl",
    "tqdm-4.70.1-py3-none-any.whl",  # huggingface_hub's (accelerate): on the machine
    "Pygments-2.21.0-py3-none-any.whl",  # pytest's: on the machine
    "typing_extensions-4.16.0-py3-none-any.whl",  # torch's: on the machine
    "jupyter_core-5.9.1-py3-none-any.whl",
    "nest_asyncio2-1.7.4-py3-none-any.whl",
]


def test_keeps_only_what_the_machine_lacks():
    assert gpu_wheels.keep(DOWNLOADED) == [
        "ipyparallel-9.2.0-py3-none-any.whl",
        "jupyter_core-5.9.1-py3-none-any.whl",
        "nest_asyncio2-1.7.4-py3-none-any.whl",
        "pyzmq-27.3.0-cp312-abi3-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl",
    ]
    assert gpu_wheels.keep(["ipython-9.18.1.tar.gz"]) == []  # wheels only


def test_needed_packages_are_pinned_to_the_tested_versions():
    pins = dict(r.split("==") if "==" in r else (r, None) for r in gpu_wheels.requirements())
    assert set(pins) == set(gpu_wheels.NEEDED)
    for name, version in pins.items():
        try:
            assert version == metadata.version(name)
        except metadata.PackageNotFoundError:
            assert version is None
    assert not {gpu_wheels.normalize(n) for n in gpu_wheels.NEEDED} & gpu_wheels.ON_THE_BOX
