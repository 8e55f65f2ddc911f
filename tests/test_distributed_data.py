"""Two processes joined by `jax.distributed` on localhost (tests/distributed_workers.py) train on one corpus
through the streaming pipeline (transformer_jax/data/pipeline.py, issue 51): the vocabulary is trained by
process 0, the id shards are written by both, each process reads a disjoint half of every epoch's pairs
(counted from the packed rows it trains on) and their union is every kept pair once; a kill -9 of both
processes and a restart end bit-identical to an uninterrupted run."""

import dataclasses
import json
import os
import signal
import time

import numpy as np
import pytest

import distributed_workers
import helpers
from transformer_jax.data import records
from transformer_jax.data.number_words import NumberWords

_DATA = """
    import dataclasses
    from experiments.configs import number_words
    from transformer_jax.data import datasets, id_shards
    from transformer_jax.run.experiment_config import ExperimentConfig
    id_shards.SHARD_PAIRS = 500  # 4 shards of the tiny split: each process writes two
    cfg = dataclasses.replace(ExperimentConfig.from_config_dict(number_words.get_config()).data, builder_config="tiny",
                              vocab_size=128, tfds_data_dir=sys.argv[3] + "/tfds", max_len=32, tokens_per_batch=16 * 32)
    data = datasets.build_datasets(cfg, sys.argv[3] + "/work", seed=0, process_index=jax.process_index(),
                                   process_count=jax.process_count(), barrier=multihost.sync_processes)
    train = data.train
    sources, targets = train.shards.read_all()
    index = {(tuple(s), tuple(t)): i for i, (s, t) in enumerate(zip(sources, targets))}
    read, rows = [], None
    for _ in range(100):  # ~1.7 epochs of this process's share
      batch = next(train)
      rows = batch["inputs"].shape[0]
      for r in range(rows):
        for seg in range(1, batch["inputs_segmentation"][r].max() + 1):
          s = batch["inputs"][r][batch["inputs_segmentation"][r] == seg]
          t = batch["targets"][r][batch["targets_segmentation"][r] == seg]
          read.append(index[(tuple(int(x) for x in s), tuple(int(x) for x in t))])
    print("RESULT " + json.dumps({
        "epochs": [train.epoch_pairs(e).tolist() for e in range(3)], "consumed": train.consumed, "read": read,
        "kept": train.kept.tolist(), "rows": rows, "shards": len(train.shards.paths)}), flush=True)
"""


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
  """The tiny number-words split prepared once (tfds preparation is not written for two processes at once)."""
  root = tmp_path_factory.mktemp("shared")
  records.prepare(NumberWords, config="tiny", data_dir=str(root / "tfds"))
  return root


def test_two_processes_read_disjoint_halves_of_every_epoch(prepared, tmp_path):
  hosts = distributed_workers.run_workers(_DATA, tmp_path, num_processes=2, args=(str(prepared),), timeout=300)
  kept = hosts[0]["kept"]
  assert hosts[1]["kept"] == kept and len(kept) > 1900 and hosts[0]["shards"] == 4
  assert [h["rows"] for h in hosts] == [8, 8]  # each process builds its 8 rows of the 16-row global batch
  for epoch in range(3):
    shares = [h["epochs"][epoch] for h in hosts]
    assert abs(len(shares[0]) - len(shares[1])) <= 1 and not set(shares[0]) & set(shares[1])
    assert sorted(shares[0] + shares[1]) == kept  # every kept pair once per epoch, between the two processes
  for h in hosts:  # what each process trained on, counted from its packed rows: its share of the stream so far
    stream = [i for epoch in h["epochs"] for i in epoch][:h["consumed"]]
    assert h["consumed"] > len(h["epochs"][0]) and sorted(h["read"]) == sorted(stream)


_TRAIN = """
    import helpers
    from transformer_jax.run import trainer
    from transformer_jax.run.experiment_config import ExperimentConfig
    from pathlib import Path
    tmp, steps = Path(sys.argv[3]), int(sys.argv[4])
    config = helpers.tiny_number_words_config(tmp)
    config.data.update(dict(max_len=32, tokens_per_batch=16 * 32))
    config.update(dict(num_train_steps=steps, warmup_steps=4, log_every_steps=1, checkpoint_every_steps=2,
                       checkpoint_keep=20))
    config.model.dropout_rate = 0.1
    config.evals.loss.every_steps = 0
    config.evals.bleu.every_steps = 0
    config.evals.attention.every_steps = 0
    config.final_eval.split = ""
    result = trainer.train_and_evaluate(ExperimentConfig.from_config_dict(config), sys.argv[5])
    leaves = jax.tree_util.tree_leaves(result.state.params)
    digest = hashlib.sha256(b"".join(np.asarray(x.addressable_data(0)).tobytes() for x in leaves)).hexdigest()
    print("RESULT " + json.dumps({"params_sha256": digest, "step": result.final_step}), flush=True)
"""
_TRAIN = "\n    import hashlib\n    import numpy as np" + _TRAIN


def _checkpointed(workdir, step):
  return (workdir / "checkpoints" / str(step) / "_CHECKPOINT_METADATA").exists()


@pytest.mark.slow
def test_kill_9_of_both_processes_then_restart_is_bit_identical(prepared, tmp_path):
  steps = 12
  whole = distributed_workers.run_workers(_TRAIN, tmp_path / "a", args=(str(prepared), str(steps),
                                                                        str(tmp_path / "a" / "w")), timeout=400) \
      if (tmp_path / "a").mkdir() is None else None
  workdir = tmp_path / "b" / "w"
  (tmp_path / "b").mkdir()
  procs = distributed_workers.start_workers(_TRAIN, tmp_path / "b", args=(str(prepared), str(steps),
                                                                          str(workdir)), log_to=tmp_path / "b")
  try:
    helpers.wait_for(lambda: _checkpointed(workdir, 6), procs[0], timeout=300)
  finally:
    for proc in procs:
      proc.send_signal(signal.SIGKILL)
      proc.wait()
  assert not _checkpointed(workdir, steps)  # killed mid-run
  resumed = distributed_workers.run_workers(_TRAIN, tmp_path / "b", args=(str(prepared), str(steps),
                                                                          str(workdir)), timeout=400)
  assert [r["step"] for r in resumed] == [steps, steps]
  assert [r["params_sha256"] for r in resumed] == [r["params_sha256"] for r in whole]
  losses = {}
  with open(workdir / "metrics.jsonl") as f:
    for line in f:
      row = json.loads(line)
      if "train/loss" in row:
        losses.setdefault(row["step"], set()).add(row["train/loss"])
  assert all(len(v) == 1 for v in losses.values())  # a step logged by the killed run and again: the same loss
  assert np.isfinite([v.pop() for v in losses.values()]).all()


def test_every_process_meets_the_same_barriers_whatever_it_finds_on_disk(prepared, tmp_path):
  """Process 0 on a fresh workdir trains the vocabulary and writes the shards; process 1 arriving after it finds
  them all: both still call the same barriers in the same order (a process that skipped one would meet another
  process's next barrier under a different name: jax's `sync_global_devices` name mismatch)."""
  from experiments.configs import number_words
  from transformer_jax.data import datasets
  from transformer_jax.run.experiment_config import ExperimentConfig
  cfg = dataclasses.replace(ExperimentConfig.from_config_dict(number_words.get_config()).data, builder_config="tiny",
                            vocab_size=128, tfds_data_dir=str(prepared / "tfds"), max_len=32, tokens_per_batch=16 * 32)
  met = {0: [], 1: []}
  for process_index in (0, 1):
    datasets.build_datasets(cfg, str(tmp_path / "work"), seed=0, process_index=process_index, process_count=2,
                            barrier=met[process_index].append)
  assert (tmp_path / "work" / "vocab").exists()
  assert met[0] == met[1] == ["vocabulary", "token ids"]


_PROGRAM = """
    import os, runpy
    os.environ["TRANSFORMER_JAX_HUGE_PAGES"] = "0"  # this worker is the program: no restart
    sys.argv = ["experiments/train.py", *sys.argv[3:], "--config.distributed=True"]  # joined by the preamble
    runpy.run_module("experiments.train", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("full", [(0, 1), (1,)], ids=["both disks", "process 1's disk"])
def test_a_failed_background_save_stops_both_processes_in_one_line_each(prepared, tmp_path, full):
  """Issue 67: a checkpoint save that fails in orbax's background write (the disk 'fills' once step 8 is saved:
  RLIMIT_FSIZE of 40 kB on the processes `full`, as in test_edges' one-process test) stops the two processes of
  `experiments.train` joined by `jax.distributed` with one error line each, not a hang in the next collective."""
  import resource
  workdir = tmp_path / "w"
  flags = (f"--workdir={workdir}", "--config.data.builder_config=tiny", "--config.data.vocab_size=128",
           f"--config.data.tfds_data_dir={prepared / 'tfds'}", "--config.data.max_len=32",
           "--config.data.tokens_per_batch=512", "--config.model.d_model=32", "--config.model.d_ff=64",
           "--config.model.num_heads=2", "--config.model.num_encoder_layers=1", "--config.model.num_decoder_layers=1",
           "--config.num_train_steps=100000", "--config.warmup_steps=4", "--config.checkpoint_every_steps=8",
           "--config.checkpoint_every_minutes=0", "--config.evals.loss.every_steps=0",
           "--config.evals.attention.every_steps=0", "--config.final_eval.split=")
  procs = distributed_workers.start_workers(_PROGRAM, tmp_path, args=flags, log_to=tmp_path)
  try:
    deadline = time.time() + 300
    while not _checkpointed(workdir, 8) and time.time() < deadline and all(p.poll() is None for p in procs):
      time.sleep(0.01)
    assert _checkpointed(workdir, 8), [(tmp_path / f"{i}.log").read_text()[-3000:] for i in range(2)]
    for i in full:
      resource.prlimit(procs[i].pid, resource.RLIMIT_FSIZE, (40_000, 40_000))
    for proc in procs:
      proc.wait(timeout=300)  # a hang fails here
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
  for i, proc in enumerate(procs):
    log = (tmp_path / f"{i}.log").read_text()
    lines = [line for line in log.strip().splitlines() if line.startswith("error: ")]
    assert proc.returncode == 1 and "Traceback" not in log, log[-3000:]
    assert len(lines) == 1 and log.strip().splitlines()[-1] == lines[0], log[-3000:]
    assert "could not be written" in lines[0], lines[0]
    assert "the last complete checkpoint is step 8" in lines[0], lines[0]
    assert (i in full) or "another process could not write its share" in lines[0], lines[0]
  assert [d for d in os.listdir(workdir / "checkpoints") if d.isdigit()] == ["8"]
