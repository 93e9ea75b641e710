"""The research notebooks (``experiments/notebooks/*.ipynb``) run top to bottom with the shipped model set, on
CPU, through the public API: a change that breaks that API (or the behaviour the notebooks assert, e.g. greedy
DDTree output equal to AR) fails here. Notebooks are committed without outputs; their figures go to a temporary
directory (``DFLASH_FIGURES``) so the run leaves the tree clean."""

import json
import os
import sys

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

# No xdist group: each notebook runs in its own kernel and shares nothing, so the two workers may split them.

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NB_DIR = os.path.join(ROOT, "experiments", "notebooks")
NOTEBOOKS = sorted(f for f in os.listdir(NB_DIR) if f.endswith(".ipynb"))
FIGURES = {  # what each notebook must save
    "01_quickstart.ipynb": [],
    "02_inside_a_tree.ipynb": ["ddtree_one_tree.png", "acceptance_histogram.png", "tau_vs_budget_and_block.png"],
    "03_prompt_compression.ipynb": ["pflash_chunk_scores.png"],
    "04_kv_residency.ipynb": ["kvflash_residency.png", "kvflash_page_traffic.png"],
}


def test_every_notebook_is_listed():
    assert NOTEBOOKS == sorted(FIGURES)


@pytest.fixture(scope="module")
def kernel_dirs(tmp_path_factory) -> list[str]:
    """A ``python3`` kernel spec bound to this interpreter (whatever other ``python3`` specs the machine has)."""
    d = tmp_path_factory.mktemp("kernels")
    (d / "python3").mkdir()
    (d / "python3" / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (tests)", "language": "python"}))
    return [str(d)]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, kernel_dirs, tmp_path, monkeypatch):
    nb = nbformat.read(os.path.join(NB_DIR, name), as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{name}: commit notebooks without outputs"
    monkeypatch.setenv("DFLASH_FIGURES", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    # first, a probe: the kernel is this interpreter and imports this checkout's package
    probe = nbformat.v4.new_code_cell("import sys, dflash_jax; print(sys.executable); print(dflash_jax.__file__)")
    nb.cells.insert(0, probe)
    km = KernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=kernel_dirs))
    client = NotebookClient(nb, km=km, timeout=300, resources={"metadata": {"path": NB_DIR}})
    client.execute()  # raises CellExecutionError on the first failing cell
    exe, pkg = probe.outputs[0]["text"].split()
    assert os.path.realpath(exe) == os.path.realpath(sys.executable) and pkg.startswith(ROOT + os.sep)
    for fig in FIGURES[name]:
        assert (tmp_path / fig).stat().st_size > 10_000, f"{name} did not save {fig}"
