"""`python -m benchmarks.accelerator_check` in its CPU tiny mode: every section a row, refusals as rows."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import accelerator_check as check

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_peak_table_knows_the_chips_by_their_jax_device_kind():
  assert check.peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
  assert check.peak_tflops("NVIDIA H100 PCIe") == 756.0
  assert check.peak_tflops("NVIDIA H200") == 989.4
  assert check.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
  assert check.peak_tflops("NVIDIA L4") == 121.0
  assert check.peak_tflops("TPU v4") == 275.0
  assert check.peak_tflops("TPU v5 lite") == 197.0
  assert check.peak_tflops("TPU v5p") == 459.0
  assert check.peak_tflops("TPU v6 lite") == 918.0
  assert check.peak_tflops("cpu") is None


def test_an_error_is_a_row_not_a_crash():
  def too_big():
    raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 81.5GiB.")

  def broken():
    raise ValueError("something\nwent wrong")

  (row,) = check.guarded("train", "big bf16", too_big)
  assert (row.status, row.value) == ("refused", "too big for the device: RESOURCE_EXHAUSTED: Out of memory while "
                                                "trying to allocate 81.5GiB.")
  (row,) = check.guarded("train", "base bf16", broken)
  assert (row.status, row.value) == ("failed", "ValueError: something went wrong")
  (row,) = check.guarded("attention", "xla vs cudnn", check.refuse("needs a GPU"))
  assert (row.status, row.value) == ("refused", "needs a GPU")


def test_tiny_mode_runs_every_section_and_writes_its_json(tmp_path):
  output = tmp_path / "check.json"
  result = subprocess.run([sys.executable, "-m", "benchmarks.accelerator_check", "--tiny", f"--output={output}"],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True,
                          timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(output.read_text())
  rows = {(r["section"], r["item"]): r for r in report["rows"]}
  assert report["tiny"] and [r["section"] for r in report["rows"]] == [
      "devices", "matmul", "train", "train", "train", "attention", "decode", "decode", "number_words", "checkpoint"]
  # The printed table holds the same rows.
  printed = [line for line in result.stdout.splitlines() if line.split(" ")[0] in check.SECTIONS]
  assert printed == [check.format_row(check.Row(**r)) for r in report["rows"]]
  devices = rows[("devices", "seen")]["detail"]
  assert devices["platform"] == "cpu" and devices["count"] >= 1 and devices["peak_bf16_tflops"] is None
  # Refusals are rows: no GPU for cudnn, the paper's presets in tiny mode.
  assert rows[("attention", "xla vs cudnn")]["status"] == "refused"
  assert "needs an NVIDIA GPU (this is cpu)" in rows[("attention", "xla vs cudnn")]["value"]
  assert rows[("train", "base bf16")]["status"] == rows[("train", "big bf16")]["status"] == "refused"
  train = rows[("train", "tiny bf16 8x32")]
  assert train["status"] == "ok"
  assert train["detail"]["tokens_per_s"] == pytest.approx(8 * 32 / train["detail"]["step_s"])
  assert train["detail"]["mfu_peak"] is None and train["detail"]["mfu_matmul"] > 0
  assert train["detail"]["first_metrics"]["loss"] > 0
  # The compiler's own analysis of the same step (XLA:CPU gives no time estimate; a TPU or GPU does).
  assert train["detail"]["compiled_peak_bytes"] > 0 and train["detail"]["estimate_source"] in ("compiler", "none")
  matmul = rows[("matmul", "bf16 512x512")]
  assert matmul["detail"]["tflops"] == pytest.approx(2 * 512 ** 3 / matmul["detail"]["seconds"] / 1e12)
  for search in ("greedy", "beam 4"):
    (decode,) = [r for (s, item), r in rows.items() if s == "decode" and item.startswith(search)]
    assert decode["status"] == "ok" and decode["detail"]["output_tokens"] > decode["detail"]["sources"]
  (words,) = [r for (s, _), r in rows.items() if s == "number_words"]
  assert words["status"] == "ok" and words["detail"]["steps"] == 30 and 0 <= words["detail"]["exact_match"] <= 1
  (checkpoint,) = [r for (s, _), r in rows.items() if s == "checkpoint"]
  assert checkpoint["status"] == "ok"
  assert checkpoint["detail"]["same_values"] and checkpoint["detail"]["same_shardings"]


def test_an_unknown_section_to_skip_is_one_line(tmp_path):
  result = subprocess.run([sys.executable, "-m", "benchmarks.accelerator_check", "--skip=train,gpu"],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": REPO, "TRANSFORMER_JAX_HUGE_PAGES": "0"},
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 1 and result.stderr.startswith("error: flag --skip=")  # absl flags, one line
  assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.strip().endswith(
      "unknown ['gpu']; of devices,matmul,train,attention,decode,number_words,checkpoint")
