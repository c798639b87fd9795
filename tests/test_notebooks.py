"""The notebooks execute top to bottom on the bundled SmolLM2 (kernel: this interpreter).

``make test`` runs them under TransformerLens 3.9 (the fast path) and ``make test-tl4`` under 4
(``load_model`` returns a ``TransformerBridge``); a check cell appended to the executed copy
asserts which one the kernel used.

The .ipynb files are stored with the outputs of a real top-to-bottom run (progress bars off:
``LENS_ATTRIB_PROGRESS=0``), so that they read as a tour without running them; here each one also
runs in a fresh ``python3`` kernel (registered into the virtual environment when missing) with a
per-cell timeout, and every code cell must finish without an error output.

Re-execute and save them with
``LENS_ATTRIB_PROGRESS=0 HF_HUB_OFFLINE=1 .venv/bin/jupyter-execute --inplace notebooks/*.ipynb``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXPECTED = {"01_tour.ipynb", "02_evaluation.ipynb", "03_head_pruning.ipynb"}


def _ensure_kernel() -> str:
    """A ``python3`` kernel spec that runs this interpreter (installed into sys.prefix)."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec("python3")
        if Path(spec.argv[0]).resolve() == Path(sys.executable).resolve() or os.path.samefile(
            spec.argv[0], sys.executable
        ):
            return "python3"
    except (NoSuchKernel, FileNotFoundError, OSError):
        pass
    from ipykernel.kernelspec import install

    install(prefix=sys.prefix, kernel_name="python3")
    return "python3"


def test_notebooks_present_and_saved_with_outputs_of_one_clean_run():
    """Every code cell ran once, in order, without an error; figures are saved; no progress-bar
    residue (carriage returns, unrendered widgets) in the saved outputs."""
    assert {p.name for p in NOTEBOOKS} == EXPECTED
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        code = [cell for cell in nb.cells if cell.cell_type == "code"]
        assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), path.name
        outputs = [o for c in code for o in c.outputs]
        assert not [o for o in outputs if o.output_type == "error"], path.name
        streams = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
        assert "\r" not in streams and "it/s]" not in streams, f"{path.name}: progress bar saved"
        data = [o.get("data", {}) for o in outputs]
        assert not [d for d in data if "application/vnd.jupyter.widget-view+json" in d]
        assert [d for d in data if "application/vnd.plotly.v1+json" in d], path.name


_BACKEND_CHECK = """\
from importlib.metadata import version
from lens_attrib.backend import is_bridge
assert version("transformer-lens") == {version!r}, version("transformer-lens")
assert is_bridge(model) is {bridge}, type(model)
"""


def _tl_version() -> str:
    from importlib.metadata import version

    return version("transformer-lens")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path):
    nb = nbformat.read(path, as_version=4)
    # The kernel must be this interpreter's TransformerLens, and the notebook's model its backend.
    tl = _tl_version()
    check = _BACKEND_CHECK.format(version=tl, bridge=int(tl.split(".")[0]) >= 4)
    nb.cells.append(nbformat.v4.new_code_cell(check))
    env_before = os.environ.get("HF_HUB_OFFLINE")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        client = nbclient.NotebookClient(
            nb,
            kernel_name=_ensure_kernel(),
            timeout=300,
            resources={"metadata": {"path": str(ROOT)}},
        )
        client.execute()
    finally:
        if env_before is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        errors = [o for o in cell.outputs if o.output_type == "error"]
        assert not errors, f"{path.name}: {errors[0].ename}: {errors[0].evalue}"
    figures = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if "application/vnd.plotly.v1+json" in o.get("data", {})
    ]
    assert figures, f"{path.name} shows no plotly figure"
