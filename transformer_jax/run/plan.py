"""A run compiled for its accelerator before it runs: memory per device, FLOPs, collectives, the compiler's own
step-time estimate, and the refusal of a run that cannot fit.

    programs = plan.build_programs(config, model_config, mesh)       # the run's own steps, on abstract arrays
    report = plan.compile_report(programs.train, topology)            # compiled for the mesh's devices
    plan.check_fits(report, topology.hbm_bytes_per_device)            # one-line ValueError when it cannot fit

The steps are the trainer's (`factories.abstract_state`, `factories.make_train_step`, `make_eval_step`, the
recipe's beam search `decoding.inference.search_program`) lowered on `jax.ShapeDtypeStruct`s carrying the
mesh's shardings, so the mesh may hold compile-only devices of a TPU topology (`accelerators.tpu_topology`:
`libtpu` compiles for a slice without a TPU, as MaxText's `train_compile.py`). What a compiled program says
about itself (XLA's `memory_analysis`, `cost_analysis` and its optimised HLO) is read into a `CompiledReport`.
`benchmarks.tpu_plan` is the program over this module.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import importlib.metadata
import json
import math
import pathlib
import re
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import accelerators, sharding
from transformer_jax.config import ModelConfig
from transformer_jax.decoding import generate, inference
from transformer_jax.run import factories
from transformer_jax.run.experiment_config import ExperimentConfig
from transformer_jax.training import steps

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_PACKED_KEYS = ("inputs", "targets") + steps.PACKING_KEYS
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
             "f64": 8, "s64": 8, "u64": 8}
_SHAPE = re.compile(r"\b(pred|[sfu]\d+|bf16)\[([\d,]*)\]")
_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")
# The levers a refused run is told of (the config keys that lower the peak memory of its train step).
LEVERS = ("--config.mesh.fsdp (split parameters and Adam moments)", "--config.grad_accum_steps with a smaller "
          "--config.data.tokens_per_batch", "--config.model.remat=True")


@dataclasses.dataclass(frozen=True)
class Programs:
  """The run's compiled programs, as lowerable callables and their abstract arguments."""

  train: tuple                   # (PartitionedFunction, args): (state, batch, rng) -> (state, metrics)
  eval: tuple                    # (PartitionedFunction, args): (params, batch) -> sums
  decode: Optional[tuple]        # (jitted search, args) on the mesh's first device, or None (decode_rows=0)
  target_tokens: int             # target slots per optimizer step (tokens_per_batch x grad_accum_steps)
  decode_tokens: int             # output slots of one decode batch (rows x max_decode_len)


def abstract_batch(config: ExperimentConfig, mesh: jax.sharding.Mesh, rules, *, accum: int = 1,
                   tokens: Optional[int] = None) -> dict:
  """The trainer's packed batch as int32 `jax.ShapeDtypeStruct`s `[rows, data.max_len]` (`[accum, rows, ...]`
  with accumulation), rows = `tokens // data.max_len` (default `data.tokens_per_batch`) rounded up to the batch
  split, split over the batch mesh axes."""
  tokens = config.data.tokens_per_batch if tokens is None else tokens
  ways = sharding.batch_ways(mesh, rules)
  rows = -(-(tokens // config.data.max_len) // ways) * ways
  shape = (accum, rows, config.data.max_len) if accum > 1 else (rows, config.data.max_len)
  spec = sharding.batch_sharding(mesh, rules, accum=accum > 1)
  return {key: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=spec) for key in _PACKED_KEYS}


def build_programs(config: ExperimentConfig, model_config: ModelConfig, mesh: jax.sharding.Mesh, *,
                   decode_rows: int = 64, decode_src_len: int = 64) -> Programs:
  """The train and eval steps `experiments.train` runs for `config` on `mesh`, and the recipe's decoding
  (`config.decode`'s beam size and alpha; `decode_rows` sources of `decode_src_len` tokens, outputs up to
  `decode_src_len + decode.extra_len`), all on abstract arrays. Raises ValueError when the model or the batch
  does not split over the mesh (`sharding.validate_model_for_mesh`)."""
  rules = sharding.validate_model_for_mesh(model_config, mesh)
  init_rng, _ = jax.random.split(jax.random.key(config.seed))
  state = factories.abstract_state(config, model_config, mesh, init_rng, rules)
  rng = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype,
                             sharding=sharding.replicated(mesh))
  train_step = factories.make_train_step(config, factories.train_model_config(config, model_config, 1), mesh,
                                         state, rules)
  accum = config.grad_accum_steps
  train = (train_step, (state, abstract_batch(config, mesh, rules, accum=accum), rng))
  eval_step = factories.make_eval_step(config, model_config, mesh, state.params, rules)
  evaluation = (eval_step, (state.params, abstract_batch(config, mesh, rules,
                                                         tokens=config.evals.loss.tokens_per_batch)))
  decode, decode_len = None, min(decode_src_len + config.decode.extra_len, model_config.max_len)
  if decode_rows:
    decode = _decode_program(config, model_config, state.params, mesh.devices.flat[0], decode_rows,
                             decode_src_len, decode_len)
  return Programs(train=train, eval=evaluation, decode=decode,
                  target_tokens=config.data.tokens_per_batch * accum, decode_tokens=decode_rows * decode_len)


def _decode_program(config: ExperimentConfig, model_config: ModelConfig, params: Any, device: jax.Device,
                    rows: int, src_len: int, max_decode_len: int) -> tuple:
  """The recipe's beam search (`decode.beam_size`, `decode.alpha`) over one `[rows, src_len]` batch on one
  device, as `decoding.inference.decode_ids` dispatches it (evaluation decodes on one device)."""
  options = generate.DecodeOptions(strategy="beam", beam_size=config.decode.beam_size, alpha=config.decode.alpha,
                                   token_log_probs=False)
  one = jax.sharding.SingleDeviceSharding(device)
  on_device = lambda shape, dtype=jnp.int32: jax.ShapeDtypeStruct(shape, dtype, sharding=one)  # noqa: E731
  params = jax.tree_util.tree_map(lambda x: on_device(x.shape, x.dtype), params)
  args = ((params,), on_device((rows, src_len)), on_device((rows,)), on_device((rows,)), on_device(()),
          on_device((rows, 0)), on_device((rows,)))
  return inference.search_program(model_config, options, max_decode_len), args


# ----------------------------------------------------------------------------------------------------------
# What a compiled program says about itself
# ----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class CompiledReport:
  """One compiled program on one device of its mesh (XLA's analyses are per device of an SPMD program)."""

  compile_seconds: float
  argument_bytes: int
  output_bytes: int
  alias_bytes: int               # outputs that reuse a donated argument's buffer
  temp_bytes: int
  peak_bytes: int                # the compiler's peak of live buffers (arguments + temps + outputs not aliased)
  flops: float                   # per device, as the compiler counts them
  bytes_accessed: float          # per device
  optimal_seconds: Optional[float]  # the compiler's own estimate of the step's time (None if absent)
  collectives: dict = dataclasses.field(default_factory=dict)  # kind -> {"count", "bytes"} (bytes per device)
  custom_calls: dict = dataclasses.field(default_factory=dict)  # custom_call_target -> count (optimised HLO)
  top_ops: list = dataclasses.field(default_factory=list)  # [[share of estimated cycles, source op], ...] (TPU)
  from_cache: bool = False       # read back from `compile_report`'s cache (compile_seconds is the original's)

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def lower(program: tuple) -> jax.stages.Lowered:
  """`program` = (callable with `.lower`, args) lowered on its abstract arguments."""
  fn, args = program
  return fn.lower(*args)


def compile_report(program: tuple, cache_dir: Optional[str] = None, cache_key: str = "") -> CompiledReport:
  """Compiles `program` (`Programs.train` / `.eval` / `.decode`) and reads its analyses into a report.

  With `cache_dir`, a report is kept as JSON under the hash of the lowered program's text, `cache_key` (say,
  the topology) and the jax and compilers' versions, and a repeat is read back without compiling: JAX's persistent
  compilation cache cannot serve compile-only devices (a compile-only client cannot deserialise an executable).
  `compile_seconds` is the original compile's.
  """
  lowered = lower(program)
  path = None
  if cache_dir:
    digest = hashlib.sha256("\n".join([lowered.as_text(), cache_key, jax.__version__, _compiler_versions()]).encode())
    path = pathlib.Path(cache_dir) / f"{digest.hexdigest()[:32]}.json"
    if path.exists():
      return CompiledReport(**dict(json.loads(path.read_text()), from_cache=True))
  report = analyse(lowered)
  if path is not None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.to_json()))
  return report


def _compiler_versions() -> str:
  """The installed versions of the compilers a report may come from (libtpu, jax's CUDA plugin)."""
  versions = []
  for package in ("libtpu", "jax-cuda12-pjrt"):
    try:
      versions.append(f"{package}=={importlib.metadata.version(package)}")
    except importlib.metadata.PackageNotFoundError:
      versions.append(f"{package}: none")
  return ", ".join(versions)


def analyse(lowered: jax.stages.Lowered) -> CompiledReport:
  """Compiles `lowered` (timed) and reads `memory_analysis`, `cost_analysis` and the optimised HLO's collectives."""
  return timed_compile(lowered.compile)[1]


def timed_compile(compile_fn) -> tuple[jax.stages.Compiled, CompiledReport]:
  """(the executable `compile_fn()` returns, its report with the compile's seconds); a compile the TPU compiler
  refuses as RESOURCE_EXHAUSTED is DoesNotFitError (one line)."""
  start = time.perf_counter()
  try:
    compiled = compile_fn()
  except jax.errors.JaxRuntimeError as error:
    if "RESOURCE_EXHAUSTED" not in str(error):
      raise
    raise DoesNotFitError(_compiler_refusal(str(error))) from None
  return compiled, read_report(compiled, time.perf_counter() - start)


def read_report(compiled: jax.stages.Compiled, compile_seconds: float) -> CompiledReport:
  """What `compiled` says about itself: `memory_analysis`, `cost_analysis` (FLOPs 0 and no `optimal_seconds`
  where the backend gives none: a compile-only GPU client) and its optimised HLO's collectives."""
  hlo = compiled.as_text()
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = (cost[0] if cost else {}) if isinstance(cost, (list, tuple)) else (cost or {})
  peak = getattr(memory, "peak_memory_in_bytes", 0) or (
      memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
      + memory.temp_size_in_bytes)
  optimal = cost.get("optimal_seconds")
  return CompiledReport(
      compile_seconds=compile_seconds, argument_bytes=int(memory.argument_size_in_bytes),
      output_bytes=int(memory.output_size_in_bytes), alias_bytes=int(memory.alias_size_in_bytes),
      temp_bytes=int(memory.temp_size_in_bytes), peak_bytes=int(peak), flops=float(cost.get("flops", 0.0)),
      bytes_accessed=float(cost.get("bytes accessed", 0.0)),
      optimal_seconds=None if optimal is None else float(optimal), collectives=collectives(hlo),
      custom_calls=custom_calls(hlo), top_ops=top_ops(hlo))


def collectives(hlo_text: str) -> dict:
  """{kind: {"count", "bytes"}} of the collectives in an optimised HLO module's text (`COLLECTIVES`; async
  `-start` forms counted once, their `-done` not): bytes of each op's result shape(s), per device."""
  found: dict = collections.defaultdict(lambda: {"count": 0, "bytes": 0})
  for line in hlo_text.splitlines():
    match = _OP.search(line)
    if not match:
      continue
    kind = match.group(2)
    found[kind]["count"] += 1
    found[kind]["bytes"] += _shape_bytes(match.group(1), async_start=bool(match.group(3)))
  return {kind: dict(found[kind]) for kind in COLLECTIVES if kind in found}


_CUSTOM_CALL = re.compile(r'custom-call\(.*custom_call_target="([^"]+)"')


def custom_calls(hlo_text: str) -> dict:
  """{custom_call_target: count} of an optimised HLO module's text. On TPU some are ops the cost model prices
  at -1 s each (`uncovered_ops`): in the train steps planned here `ConcatBitcast`, the bitcast that joins a
  buffer's asynchronously prefetched slices (no data moved, so 0 s is their right price), and `X64Combine`
  where 64-bit values are split (unsafe_rbg keys); gather helpers (`AssumeGatherIndicesInBound`) are priced."""
  return dict(collections.Counter(_CUSTOM_CALL.findall(hlo_text)))


_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def top_ops(hlo_text: str, count: int = 10) -> list:
  """[[share, source op], ...]: the TPU cost model's `estimated_cycles` of each op of the optimised HLO (its
  backend_config; fusions are priced whole and named by their root's source op), summed per source op with
  the layer index dropped (`layer_*`), the `count` largest shares of the total first. [] where the backend
  gives no per-op estimate (CPU, GPU)."""
  cycles: collections.Counter = collections.Counter()
  for line in hlo_text.splitlines():
    found = _CYCLES.search(line)
    if found:
      name = _OP_NAME.search(line)
      op = re.sub(r"layer_\d+", "layer_*", name.group(1) if name else "(unnamed)").replace("jit(train_step)/", "")
      cycles[op] += int(found.group(1))
  total = sum(cycles.values())
  return [[round(c / total, 4), op] for op, c in cycles.most_common(count)] if total else []


def _shape_bytes(result_type: str, async_start: bool) -> int:
  """Bytes of an HLO result type `f32[8,512]` or a tuple of them; an async `-start`'s tuple holds the operands
  and then the results, so only its second half is counted."""
  sizes = [_ITEMSIZE.get(dtype, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
           for dtype, dims in _SHAPE.findall(result_type)]
  if async_start and len(sizes) > 1:
    sizes = sizes[len(sizes) // 2:]
  return int(sum(sizes))


# ----------------------------------------------------------------------------------------------------------
# Fitting in the device's memory
# ----------------------------------------------------------------------------------------------------------

class DoesNotFitError(ValueError):
  """The compiled train step needs more memory per device than the device holds (the message is one line)."""


_EXHAUSTED = re.compile(r"required for (.*?) \(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)")


def _compiler_refusal(message: str) -> str:
  """DoesNotFitError's line for a compile the TPU compiler refused as RESOURCE_EXHAUSTED (it plans the memory
  and refuses a program whose buffers cannot fit, before any report exists)."""
  match = _EXHAUSTED.search(message)
  if match:
    what, need, have = match.groups()
    head = f"the train step needs {float(need):.2f} GiB per device at its peak ({what}), the device holds " \
           f"{float(have):.2f} GiB (the TPU compiler's own count)"
  else:
    head = "the TPU compiler ran out of device memory: " + " ".join(message.split())[:200]
  return head + ": refused before anything is written; levers: " + "; ".join(LEVERS)


def check_fits(report: CompiledReport, capacity_bytes: float, what: str = "the train step") -> None:
  """Raises DoesNotFitError (one line: peak, capacity, the `LEVERS`) when `report.peak_bytes` exceeds
  `capacity_bytes` (the device's HBM)."""
  if report.peak_bytes > capacity_bytes:
    raise DoesNotFitError(
        f"{what} needs {report.peak_bytes / 2**30:.2f} GiB per device at its peak (arguments "
        f"{report.argument_bytes / 2**30:.2f} GiB, temporaries {report.temp_bytes / 2**30:.2f} GiB), the device "
        f"holds {capacity_bytes / 2**30:.2f} GiB: refused before anything is written; levers: "
        + "; ".join(LEVERS))


@dataclasses.dataclass(frozen=True)
class CheckedStep:
  """The train step the fit check compiled (`check_run_fits`): the run uses it instead of compiling again."""

  config: ExperimentConfig
  model_config: ModelConfig      # the step's (`factories.train_model_config` at update 1)
  train_step: Any                # sharding.PartitionedFunction holding the compiled executable
  report: CompiledReport

  def step_for(self, config: ExperimentConfig, model_config: ModelConfig) -> Optional[Any]:
    """The compiled step when it is the one `config` and `model_config` ask for, else None."""
    return self.train_step if (config, model_config) == (self.config, self.model_config) else None


def device_capacity(device: jax.Device) -> Optional[int]:
  """Bytes `device` holds (`memory_stats()['bytes_limit']`: TPUs and GPUs), None where it reports none (CPUs)."""
  return (device.memory_stats() or {}).get("bytes_limit") or None


def check_run_fits(config: ExperimentConfig, mesh: jax.sharding.Mesh) -> Optional[CheckedStep]:
  """Refuses (DoesNotFitError, one line) a run whose compiled train step needs more memory per device than the
  mesh's first device holds (`device_capacity`); does nothing (None) on devices that report no limit (CPUs).
  The model's vocabulary is `data.vocab_size` (the size the tokenizer is trained to), else `model.vocab_size`.
  Costs the one compile of the train step the run needs: the trainer calls it before it writes and then runs
  the returned `CheckedStep.train_step` (`sharding.PartitionedFunction.compile` keeps the executable).
  Each process reads one of its own devices (another host's is not addressable: memory_stats() raises)."""
  local = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
  capacity = device_capacity(local)
  if not capacity:
    return None
  model_config = factories.model_config_from(config, config.data.vocab_size or config.model.vocab_size,
                                             local.platform)
  train_step, args = build_programs(config, model_config, mesh, decode_rows=0).train
  _, report = timed_compile(lambda: train_step.compile(*args))
  check_fits(report, capacity)
  return CheckedStep(config=config, model_config=factories.train_model_config(config, model_config, 1),
                     train_step=train_step, report=report)


def fit_candidates(config: ExperimentConfig, num_devices: int, max_accum: int = 8) -> list[ExperimentConfig]:
  """The configs the plan tries, cheapest first, to fit `config` on `num_devices`: the config as given, then
  FSDP over 2, 4, ... devices (data takes the rest), then Megatron tensor splits of 2 and 4, then gradient
  accumulation of 2, 4, ... `max_accum` micro-batches of `tokens_per_batch / k` (the same optimizer batch)."""
  out = [config]
  fsdp = 2
  while fsdp <= num_devices:
    out.append(dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, data=-1, fsdp=fsdp, tensor=1)))
    fsdp *= 2
  for tensor in (2, 4):
    if tensor <= num_devices:
      out.append(dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, data=-1, fsdp=1, tensor=tensor)))
  accum = 2
  while accum <= max_accum and config.data.tokens_per_batch % (accum * config.data.max_len) == 0:
    out.append(dataclasses.replace(config, grad_accum_steps=config.grad_accum_steps * accum,
                              data=dataclasses.replace(config.data,
                                                       tokens_per_batch=config.data.tokens_per_batch // accum)))
    accum *= 2
  return out


def describe_split(config: ExperimentConfig) -> str:
  """'mesh data=-1 fsdp=2 tensor=1, 26624 tokens x 1 micro-batch': what `fit_candidates` varies."""
  m = config.mesh
  return (f"mesh data={m.data} fsdp={m.fsdp} tensor={m.tensor}, tokens_per_batch={config.data.tokens_per_batch} "
          f"x grad_accum_steps={config.grad_accum_steps}")


# ----------------------------------------------------------------------------------------------------------
# What the figures mean
# ----------------------------------------------------------------------------------------------------------

def roofline_seconds(report: CompiledReport, topology: accelerators.Topology) -> float:
  """`max(flops / peak, bytes accessed / HBM bandwidth)` of one device: the step's time were it bound only by
  the chip's bf16 peak or its HBM (a lower bound of the time, not a prediction)."""
  return max(report.flops / topology.peak_flops_per_device,
             report.bytes_accessed / topology.hbm_bytes_per_second_per_device)


def uncovered_ops(report: CompiledReport) -> int:
  """How many ops the TPU compiler's cost model left out of `optimal_seconds`: it adds -1 s for each op it has
  no estimate for, so a negative total is `known - n` with n a whole number (e.g. -643.97 = 0.0275 s known
  for 644 ops left out; docs/performance.md, "Compiled for the accelerators we target"). 0 when positive.
  The n ops are custom calls (`CompiledReport.custom_calls`): base's train step on one v5e device holds 509
  `ConcatBitcast` and n = 509; in every step checked n = ConcatBitcast + X64Combine."""
  if report.optimal_seconds is None or report.optimal_seconds >= 0:
    return 0
  return -math.floor(report.optimal_seconds)


def step_estimate(report: CompiledReport, topology: accelerators.Topology) -> tuple[Optional[float], str]:
  """(seconds, source) of one step on one device. 'compiler': `optimal_seconds` as given (positive);
  'compiler-N': its known part once the -1 s of each of the N ops it left out is removed (`uncovered_ops`;
  read only where the roofline is under 0.5 s, so that the whole seconds cannot be the known part's);
  'roofline': `roofline_seconds`, where the compiler gives nothing readable; (None, 'no cost analysis') where
  the compiler gives no cost at all (XLA's compile-only GPU client: no FLOPs, bytes or estimate)."""
  if report.optimal_seconds is None and not report.flops and not report.bytes_accessed:
    return None, "no cost analysis"
  roofline = roofline_seconds(report, topology)
  if report.optimal_seconds is None:
    return roofline, "roofline"
  missing = uncovered_ops(report)
  if not missing:
    return report.optimal_seconds, "compiler"
  known = report.optimal_seconds + missing
  if roofline < 0.5 and known > 0:
    return known, f"compiler-{missing}"
  return roofline, "roofline"
