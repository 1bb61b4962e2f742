"""The notebooks are committed without outputs, match their generator, and run: each draws its figures and ends
with a conclusion computed from its own output. The README figure's script runs."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
FIGURES = {"compare_plans.ipynb": 5, "scaling.ipynb": 2, "fidelity.ipynb": 4}
"""Notebook -> figures (image/png outputs) it draws at least."""


def _read(name: str):
    return nbformat.read(NOTEBOOKS / name, as_version=4)


def test_every_notebook_is_listed():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(FIGURES)


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_committed_without_outputs(name):
    for cell in _read(name).cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{name}: clear outputs before committing"


def test_notebooks_match_their_generator():
    result = subprocess.run([sys.executable, str(NOTEBOOKS / "make_notebooks.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _outputs(cell) -> list[dict]:
    return cell.get("outputs", [])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FIGURES))
def test_notebook_runs_draws_its_figures_and_concludes(name):
    nb = _read(name)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    assert nb.cells[0].cell_type == "markdown" and "**Question:**" in nb.cells[0].source
    figures = sum("image/png" in o.get("data", {}) for cell in nb.cells for o in _outputs(cell))
    assert figures >= FIGURES[name]
    heading, last = nb.cells[-2], nb.cells[-1]
    assert heading.cell_type == "markdown" and heading.source == "## Conclusion"
    conclusions = [o["data"]["text/markdown"] for o in _outputs(last) if "text/markdown" in o.get("data", {})]
    assert len(conclusions) == 1
    assert len(re.findall(r"\d", conclusions[0])) >= 5, conclusions[0]
    assert "nan" not in conclusions[0].lower(), conclusions[0]


@pytest.mark.slow
def test_readme_figure_script_writes_the_png(tmp_path):
    script = NOTEBOOKS.parent / "scripts" / "make_figures.py"
    # one GPU count and two sizes: the notebook plans the figure's whole sweep already
    result = subprocess.run([sys.executable, str(script), "--out", str(tmp_path), "--gpus", "16", "--sides", "448",
                             "1344"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    png = tmp_path / "compare_plans_32b.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (NOTEBOOKS.parent / "docs" / "figures" / png.name).is_file(), "commit the README figure"
