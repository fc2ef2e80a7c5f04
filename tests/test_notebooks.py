"""Execute the notebooks (each asserts the seed's numbers in its cells) with small settings.

The kernel is ``python3`` of the interpreter running the tests (jupyter_client maps the spec's ``python`` to
``sys.executable``); ``running_example.ipynb`` is committed with its outputs stripped; ``gradient_lab.ipynb`` and
``scaling_laws.ipynb`` are committed with theirs, from a full run, to be read without running them (the tests check
what they printed as well as running them again, quickly).
"""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).parents[1] / "notebooks"


def execute(name: str, monkeypatch, **env: str):
    """Run a notebook in a fresh ``python3`` kernel, which inherits this process's environment."""
    for key, value in {"MLX_LLM_NB_QUICK": "1", "JAX_PLATFORMS": "cpu", "MPLBACKEND": "Agg", **env}.items():
        monkeypatch.setenv(key, value)
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbclient.NotebookClient(nb, kernel_name="python3", timeout=600,
                            resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return nb


def printed(nb) -> str:
    return "".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                   for out in cell.get("outputs", []) if out.get("output_type") == "stream")


def committed_outputs(name: str) -> str:
    """What a notebook committed with its outputs printed: every code cell ran, none raised."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert all(cell.execution_count for cell in code), "run it and commit it with its outputs"
    assert not any(out.get("output_type") == "error" for cell in code for out in cell.outputs)
    return printed(nb)


def test_running_example_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOKS / "running_example.ipynb", as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, "strip the outputs before committing"


@pytest.mark.slow
def test_running_example_notebook(monkeypatch):
    text = printed(execute("running_example.ipynb", monkeypatch))
    assert "loss 1.109373924 -> 1.084831548" in text
    assert "tied=False: 50 parameters" in text and "tied=True: 42 parameters" in text
    assert "12 scalars, 48 bytes" in text


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    """The notebook's sweep directory, shared by its two executions (the second trains nothing)."""
    return str(tmp_path_factory.mktemp("notebook-sweep") / "sweep")


SCALING_LAWS_LINES = ("quick mode: False", "L = 1.9300", "240 runs, 4500 starts", "converged: True", "15 runs in ",
                      "run again: trained nothing", "held out: budget 1.26e+10 FLOPs, law refitted on the 10 runs",
                      "20 runs; Approach 3: N* ∝ C^0.193", "held out 9.9e+11 FLOPs: mean |loss error| 0.2006")


def test_scaling_laws_is_committed_with_its_outputs():
    """A full run's outputs (Hoffmann's whole grid, the 15-point notebook sweep, the committed sweep's held-out
    block), its plots included."""
    text = committed_outputs("scaling_laws.ipynb")
    assert all(line in text for line in SCALING_LAWS_LINES), [x for x in SCALING_LAWS_LINES if x not in text]
    nb = nbformat.read(NOTEBOOKS / "scaling_laws.ipynb", as_version=4)
    plots = sum("image/png" in out.get("data", {}) for cell in nb.cells if cell.cell_type == "code"
                for out in cell.outputs)
    assert plots >= 4


@pytest.mark.slow
def test_scaling_laws_notebook(monkeypatch, sweep_dir):
    text = printed(execute("scaling_laws.ipynb", monkeypatch, MLX_LLM_NB_SWEEP_DIR=sweep_dir))
    assert "L = 1.9933" in text and "L = 1.9366" in text and "L = 1.9300" in text
    if "are not on this machine" not in text:
        assert "240 runs, 16 starts" in text and "converged: True" in text
    assert "9 runs in " in text and "run again: trained nothing" in text
    assert "held out: budget 9e+08 FLOPs, law refitted on the 6 runs below it" in text
    assert text.count("predicted") >= 3  # the three held-out runs, each with its interval


@pytest.mark.slow
def test_scaling_laws_notebook_without_the_published_runs(monkeypatch, tmp_path, sweep_dir):
    text = printed(execute("scaling_laws.ipynb", monkeypatch, MLX_LLM_RUNS_CSV=str(tmp_path / "absent.csv"),
                           MLX_LLM_NB_SWEEP_DIR=sweep_dir))
    assert "are not on this machine" in text
    assert "L = 1.9300" in text  # everything that does not need the runs still runs and checks


GRADIENT_LAB_LINES = ("max relative error, analytic ~ autodiff:", "ok: False; worst: layer/w_gate (analytic~autodiff)",
                      "ok: False; worst: layer/w_gate (autodiff~central)",
                      "failing: ['layer/ffn_norm', 'layer/w_gate', 'z']",
                      "hybrid Mamba/MoE: analytic = autodiff = central differences on every leaf")


def test_gradient_lab_is_committed_with_its_outputs():
    text = committed_outputs("gradient_lab.ipynb")
    assert all(line in text for line in GRADIENT_LAB_LINES)


@pytest.mark.slow
def test_gradient_lab_notebook(monkeypatch):
    text = printed(execute("gradient_lab.ipynb", monkeypatch))
    assert all(line in text for line in GRADIENT_LAB_LINES)
    assert "x64 enabled in this kernel: False" in text  # check_grads ran in float64 and gave the setting back
