"""`benchmarks.recipe_speed`: variants of a recipe timed side by side on a workdir's cached ids.

A workdir is faked with what a run leaves (id shards in `data/train.ids/` through `id_shards.write_id_arrays`,
`config.json`); the
probe must build each variant's own batches and compiled step, report one row per variant with the reference
first, and refuse bad variants and missing workdirs in one line without writing anything.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from etils import epath

from benchmarks import recipe_speed
from experiments.configs import multi30k
from transformer_jax.data import id_shards

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = "experiments/configs/multi30k.py"
TINY = "model.d_model=32,model.d_ff=64,model.num_heads=2,model.num_encoder_layers=1,model.num_decoder_layers=1"


@pytest.fixture
def workdir(tmp_path):
  rng = np.random.default_rng(0)
  pairs = [(rng.integers(4, 200, rng.integers(3, 30)), rng.integers(4, 200, rng.integers(3, 30)))
           for _ in range(300)]
  eos = np.array([3])
  id_shards.write_id_arrays(epath.Path(tmp_path) / "data" / "train.ids" / "k", {"test": 1},
                           [np.concatenate([s, eos]) for s, _ in pairs], [np.concatenate([t, eos]) for _, t in pairs],
                           vocab_size=200)
  (tmp_path / "config.json").write_text(json.dumps({"model": {"vocab_size": 200}}))
  return tmp_path


def test_the_workdirs_id_shards_are_found(workdir):
  sources, targets = id_shards.IdShards.newest(workdir / "data" / "train.ids").read_all()
  assert len(sources) == len(targets) == 300
  assert all(s.dtype == np.int32 and s[-1] == 3 for s in sources)


def test_parse_variant():
  assert recipe_speed.parse_variant("rows 64: data.max_len=64, data.tokens_per_batch=2048") == (
      "rows 64", {"data.max_len": 64, "data.tokens_per_batch": 2048})
  assert recipe_speed.parse_variant("gelu:model.activation=gelu") == ("gelu", {"model.activation": "gelu"})
  assert recipe_speed.parse_variant("as is:") == ("as is", {})
  for bad in ("no colon", ":data.max_len=64", "x:data.max_len"):
    with pytest.raises(ValueError, match="--variant"):
      recipe_speed.parse_variant(bad)


def _compare(workdir, *variants, rounds=1, steps_per_round=1, batches=1):
  recipe_speed.compare(str(workdir), multi30k.get_config(), RECIPE, list(variants), rounds, steps_per_round, batches)


def test_variants_are_timed_side_by_side(workdir, capsys):
  _compare(workdir, f"rows 32:{TINY},data.max_len=32,data.tokens_per_batch=256",
           f"rows 64:{TINY},data.max_len=64,data.tokens_per_batch=512", steps_per_round=2, batches=2)
  lines = capsys.readouterr().out.strip().splitlines()
  assert lines[0].split()[0] == "variant" and len(lines) == 3
  assert lines[1].startswith("rows 32") and " 1.00x " in lines[1]  # the first variant is the reference
  assert lines[2].startswith("rows 64")
  real_tokens = [float(line.split()[-4]) for line in lines[1:]]  # columns from the right: names have spaces
  assert 0 < real_tokens[0] <= 256 and 256 < real_tokens[1] <= 512  # each variant packed its own batches


def test_each_variant_runs_on_its_own_number_of_devices(workdir, capsys):
  """The recipe splits its batches over 2 host devices (num_cpu_devices); a variant can ask for 1."""
  _compare(workdir, f"two:{TINY},data.max_len=32,data.tokens_per_batch=256",
           f"one:{TINY},data.max_len=32,data.tokens_per_batch=256,num_cpu_devices=0")
  lines = capsys.readouterr().out.strip().splitlines()[1:]
  assert [(line.split()[0], line.split()[2]) for line in lines] == [("two", "2"), ("one", "1")]
  # Same batches, same gradients: only the split differs, so the real tokens per batch are equal.
  assert lines[0].split()[-4] == lines[1].split()[-4]


def test_a_variant_whose_rows_do_not_split_over_its_devices_is_refused(workdir):
  with pytest.raises(ValueError, match="packs 3 rows of data.max_len=32 slots, which do not split over the 2 "
                     "devices"):
    _compare(workdir, f"odd:{TINY},data.max_len=32,data.tokens_per_batch=96")


@pytest.mark.parametrize("extra, message", [
    (["--variant=x:model.no_such_field=1"], "'model.no_such_field' is not in experiments/configs/multi30k.py"),
    (["--variant=x:model.d_model.width=1"], "'model.d_model.width' is not in experiments/configs/multi30k.py"),
    (["--variant=x:nowhere.d_model=1"], "'nowhere.d_model' is not in experiments/configs/multi30k.py"),
    (["--variant=x:data.max_len=long"], "max_len"),  # a value of another type than the key's
    (["--variant=no colon"], "expected NAME:KEY=VALUE"),
    (["--rounds=0"], "--rounds"),  # absl's bound
    (["--config.model.d_model=x"], "d_model"),  # an override of the recipe's config file, as experiments.train's
])
def test_bad_variants_are_one_line_refusals(workdir, extra, message):
  before = sorted(p.name for p in workdir.rglob("*"))
  proc = subprocess.run([sys.executable, "-m", "benchmarks.recipe_speed", f"--workdir={workdir}",
                         *extra], cwd=REPO, capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, PYTHONPATH=REPO, TRANSFORMER_JAX_HUGE_PAGES="0"))
  assert proc.returncode == 1 and proc.stderr.startswith("error: ") and message in proc.stderr
  assert len(proc.stderr.strip().splitlines()) == 1
  assert sorted(p.name for p in workdir.rglob("*")) == before


def test_missing_workdir_is_a_one_line_refusal(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"none/data/train.ids does not exist or is incomplete"):
    _compare(tmp_path / "none")
