r"""Per-device train-state memory and step time of the base Transformer under data parallelism vs FSDP.

    python -m benchmarks.sharding_bench                      # 8 forced host CPU devices
    python -m benchmarks.sharding_bench --meshes=data=8 --meshes=fsdp=8,data=1 --rows=8 --length=128

Every mesh trains the same model (`config.base(vocab_size=32000)`, float32, dropout as the preset) with the
trainer's own compiled step for that mesh (`common.build_train_step`: `factories.create_state` +
`factories.make_train_step` of the default recipe with the preset's sizes) on the same fixed batch (`rows` x `length` tokens per side), a few timed steps after the compiling one. Reported per
mesh: the train state's bytes on each device (params + Adam moments: the addressable shards), XLA's temporary
buffer estimate for the step (per device, where the backend reports it), the compile time and the median
step time. On CPU the devices are forced host devices sharing the machine's cores: step times are only
indicative (FSDP's all-gathers are memory copies here, and all "devices" compete for the same cores).
"""

import os
import sys

if "jax" not in sys.modules and "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  _devices = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--devices=")), "8")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={_devices}").strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import gc  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
from absl import flags  # noqa: E402

from benchmarks import common  # noqa: E402
import launch  # noqa: E402
from transformer_jax import config as presets  # noqa: E402
from transformer_jax import sharding  # noqa: E402


def parse_mesh(text: str) -> dict[str, int]:
  """'fsdp=8,data=1' -> {'fsdp': 8, 'data': 1} (unnamed axes keep make_mesh's defaults).

  Raises ValueError naming the flag for an axis that is not one of `sharding.MESH_AXES` or a size that is not
  a positive integer."""
  values = {}
  for part in text.split(","):
    name, _, size = part.partition("=")
    if name.strip() not in sharding.MESH_AXES or not size.strip().isdigit() or int(size) < 1:
      raise ValueError(f"--meshes={text}: expected AXIS=SIZE,... with axes of {', '.join(sharding.MESH_AXES)} "
                       "and positive sizes (e.g. 'fsdp=8,data=1')")
    values[name.strip()] = int(size)
  return values


def measure(mesh_values: dict[str, int], model_config, rows: int, length: int, steps: int) -> dict:
  mesh = sharding.make_mesh(**mesh_values)
  start = time.perf_counter()
  built = common.build_train_step(common.train_config(model_config), mesh=mesh)
  jax.block_until_ready(built.state)
  init_s = time.perf_counter() - start
  state, step, rng = built.state, built.step, built.rng
  state_bytes = sharding.per_device_bytes(state)
  batch = built.shard(common.plain_batch(rows, length, model_config.vocab_size))
  start = time.perf_counter()
  compiled = step.lower(state, batch, rng).compile()
  compile_s = time.perf_counter() - start
  temp_bytes = None
  try:
    analysis = compiled.memory_analysis()
    temp_bytes = getattr(analysis, "temp_size_in_bytes", None)
  except Exception:  # not every backend reports it
    pass

  state, metrics = step(state, batch, rng)  # first call (cached executable after compile())
  jax.block_until_ready(metrics)
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    state, metrics = step(state, batch, rng)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  result = dict(mesh=dict(mesh.shape), state_bytes_max=max(state_bytes.values()),
                state_bytes_min=min(state_bytes.values()), temp_bytes=temp_bytes, init_s=init_s,
                compile_s=compile_s, step_s=statistics.median(times), loss=float(metrics["loss"]),
                params=sum(x.size for x in jax.tree_util.tree_leaves(state.params)))
  del state, metrics, batch, compiled, step, built
  gc.collect()
  return result


FLAGS = flags.FLAGS


def define_flags() -> None:
  """The program's flags (defined only when it runs as the program)."""
  flags.DEFINE_multi_string("meshes", ["data=8", "fsdp=8,data=1"],
                            "mesh to measure, e.g. 'data=8' or 'fsdp=8,data=1' (repeatable)")
  flags.DEFINE_integer("devices", 8, "forced host devices (CPU only; read before JAX starts)", lower_bound=1)
  flags.DEFINE_integer("vocab_size", 32000, "vocabulary size of the base model")
  flags.DEFINE_integer("rows", 8, "batch rows")
  flags.DEFINE_integer("length", 128, "tokens per row, both sides")
  flags.DEFINE_integer("steps", 5, "timed steps after the first", lower_bound=1)
  common.check_flag("meshes", lambda texts: [parse_mesh(text) for text in texts])


@launch.program
def main() -> None:
  meshes = [parse_mesh(m) for m in FLAGS.meshes]
  model_config = presets.base(vocab_size=FLAGS.vocab_size)
  warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

  print(f"{jax.device_count()} {jax.devices()[0].platform} devices; base model, vocab {FLAGS.vocab_size}, "
        f"float32; batch {FLAGS.rows} rows x {FLAGS.length} tokens per side; median of {FLAGS.steps} steps")
  results = []
  for values in meshes:
    result = measure(values, model_config, FLAGS.rows, FLAGS.length, FLAGS.steps)
    results.append(result)
    print(f"  done {result['mesh']}", flush=True)

  mib = 1 / 2 ** 20
  header = (f"{'mesh (data x fsdp x tensor)':<28} {'state MiB/device':>17} {'XLA temp MiB/dev':>17} "
            f"{'compile s':>10} {'step s (median)':>16} {'loss':>8}")
  print(f"\n{results[0]['params'] / 1e6:.1f}M parameters\n{header}\n{'-' * len(header)}")
  for r in results:
    shape = " x ".join(str(r["mesh"][a]) for a in sharding.MESH_AXES)
    temp = f"{r['temp_bytes'] * mib:.1f}" if r["temp_bytes"] is not None else "n/a"
    print(f"{shape:<28} {r['state_bytes_max'] * mib:>17.1f} {temp:>17} {r['compile_s']:>10.1f} "
          f"{r['step_s']:>16.3f} {r['loss']:>8.4f}")


if __name__ == "__main__":
  define_flags()
  launch.run(main)
