"""The Colab quickstart (`notebooks/quickstart.ipynb`): stored clean, and executed top to bottom on CPU.

The run injects papermill-style parameters (a tiny setting and a temporary WORKDIR) in a cell right after the
cell tagged `parameters`, and executes with a `python3` kernel spec written for this interpreter (so the
kernel imports this checkout's environment whatever other kernels are installed).
"""

import json
import os
import time

import nbformat

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "notebooks", "quickstart.ipynb")


def _read():
  return nbformat.read(NOTEBOOK, as_version=4)


def _parameters_index(nb) -> int:
  tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])]
  assert len(tagged) == 1, "exactly one cell must be tagged 'parameters'"
  return tagged[0]


def test_notebook_is_stored_without_outputs_and_has_a_parameters_cell():
  nb = _read()
  nbformat.validate(nb)
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert cell.outputs == [] and cell.execution_count is None, cell.source[:80]
  source = nb.cells[_parameters_index(nb)].source
  for name in ("NUM_TRAIN_STEPS", "WORKDIR", "TINY"):
    assert f"{name} =" in source
  assert nb.metadata.kernelspec.name == "python3"


def test_quickstart_runs_top_to_bottom_on_cpu(tmp_path, monkeypatch):
  from nbclient import NotebookClient
  from ipykernel.kernelspec import write_kernel_spec

  nb = _read()
  workdir = str(tmp_path / "run")
  injected = nbformat.v4.new_code_cell(
      f"NUM_TRAIN_STEPS = 30\nTINY = True\nWORKDIR = {workdir!r}", metadata={"tags": ["injected-parameters"]})
  nb.cells.insert(_parameters_index(nb) + 1, injected)

  # A 'python3' kernel spec for this interpreter, found first (JUPYTER_PATH precedes user/system dirs).
  write_kernel_spec(str(tmp_path / "jupyter" / "kernels" / "python3"))
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
  monkeypatch.delenv("XLA_FLAGS", raising=False)  # compiled as in a user's runtime (conftest.py)
  monkeypatch.setenv("PYTHONPATH", REPO)

  start = time.time()
  NotebookClient(nb, kernel_name="python3", timeout=300, allow_errors=False,
                 resources={"metadata": {"path": REPO}}).execute()
  seconds = time.time() - start

  texts, images = [], 0
  for cell in nb.cells:
    for out in cell.get("outputs", []):
      if out.output_type == "stream":
        texts.append(out.text)
      elif out.output_type in ("display_data", "execute_result"):
        texts.append(out.data.get("text/plain", ""))
        images += "image/png" in out.data
  text = "\n".join(texts)
  assert "on CPU: [CpuDevice(id=0)]" in text
  assert "step 30/30" in text and "stopped at step 30" in text
  assert "twenty-one\n    -> " in text
  assert "Exact match on 50 test examples" in text
  assert images == 2, f"expected the attention grid and the learning curve, got {images} images"
  assert os.path.exists(os.path.join(workdir, "metrics.jsonl"))
  assert json.load(open(os.path.join(workdir, "final_eval.json")))["examples"] == 50
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["10", "20", "30"]
  print(f"notebook executed in {seconds:.0f}s")
