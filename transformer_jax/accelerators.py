"""The accelerators we target: their chips' facts, TPU topologies to compile for without a TPU, and the one rule
for the choices that depend on the backend.

    topology = accelerators.tpu_topology("v5e:2x4", num_slices=2)   # compile-only devices (needs libtpu)
    topology.devices, topology.hbm_bytes_per_device, topology.peak_flops_per_device
    accelerators.backend_choices("tpu").compute_dtype                # 'bfloat16'

`libtpu` (the `tpu` extra, the version `jax[tpu]` pins) holds the TPU compiler; `jax.experimental.topologies`
describes a topology's devices to it, so `jax.jit(f).lower(...).compile()` compiles for a TPU slice on any host
(MaxText's `train_compile.py` does the same). Nothing here touches a device; importing this module does not
load libtpu (only `tpu_topology` does).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from typing import Optional, Sequence

import jax


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator chip as its vendor's datasheet gives it (dense bf16 peak, HBM size and bandwidth)."""

  name: str                      # 'v5e', 'H100'
  device_kinds: tuple[str, ...]  # substrings of `jax.Device.device_kind` that name it (first match wins)
  hbm_gib: float                 # HBM per chip, GiB
  bf16_tflops: float             # dense bf16 peak per chip, TFLOP/s
  hbm_gbps: float                # HBM bandwidth per chip, GB/s (1e9 bytes/s)
  megacore: bool = False         # a chip's two TensorCores are one JAX device (v4, v5p); else one per core


# Cloud TPU system-architecture pages and NVIDIA datasheets (SXM parts); TPU v2/v3 bandwidths: Norrie et al.
# (2021), "The Design Process for Google's Training Chips: TPUv2 and TPUv3".
CHIPS: tuple[Chip, ...] = (
    Chip("v2", ("TPU v2",), 16, 45.0, 700, megacore=False),
    Chip("v3", ("TPU v3",), 32, 123.0, 900, megacore=False),
    Chip("v4", ("TPU v4",), 32, 275.0, 1200, megacore=True),
    Chip("v5e", ("TPU v5 lite", "TPU v5e"), 16, 197.0, 819),
    Chip("v5p", ("TPU v5p", "TPU v5"), 95, 459.0, 2765, megacore=True),
    Chip("v6e", ("TPU v6 lite", "TPU v6e"), 32, 918.0, 1640),
    Chip("H100 PCIe", ("H100 PCIe",), 80, 756.0, 2000),
    Chip("H100", ("H100",), 80, 989.4, 3350),
    Chip("H200", ("H200",), 141, 989.4, 4800),
    Chip("A100", ("A100",), 80, 312.0, 2039),
    Chip("L4", ("L4",), 24, 121.0, 300),
)
TPU_GENERATIONS = ("v2", "v3", "v4", "v5e", "v5p", "v6e")


def chip_of(device_kind: str) -> Optional[Chip]:
  """The `Chip` whose `device_kinds` has a substring of `device_kind` (case-insensitive), None if none (CPUs)."""
  kind = device_kind.lower()
  return next((chip for chip in CHIPS if any(k.lower() in kind for k in chip.device_kinds)), None)


def chip_named(name: str) -> Chip:
  """The `Chip` called `name` ('v5e'); ValueError names the known ones."""
  for chip in CHIPS:
    if chip.name == name:
      return chip
  raise ValueError(f"unknown chip {name!r}; one of {', '.join(c.name for c in CHIPS)}")


# ----------------------------------------------------------------------------------------------------------
# TPU topologies, compiled for without a TPU
# ----------------------------------------------------------------------------------------------------------

def libtpu_available() -> bool:
  """Whether the TPU compiler is installed (`pip install .[tpu]`): `libtpu`, found without importing it."""
  return importlib.util.find_spec("libtpu") is not None


@dataclasses.dataclass(frozen=True)
class Topology:
  """A TPU slice (or `num_slices` of them over DCN) as compile-only devices, and what each device holds."""

  name: str                      # 'v5e:2x4'
  chip: Chip
  chips_per_slice: int
  num_slices: int
  devices: tuple                 # compile-only `jax.Device`s (`device.slice_index` for multi-slice)

  @property
  def devices_per_chip(self) -> float:
    return len(self.devices) / (self.chips_per_slice * self.num_slices)

  @property
  def hbm_bytes_per_device(self) -> float:
    return self.chip.hbm_gib * 2**30 / self.devices_per_chip

  @property
  def peak_flops_per_device(self) -> float:
    return self.chip.bf16_tflops * 1e12 / self.devices_per_chip

  @property
  def hbm_bytes_per_second_per_device(self) -> float:
    return self.chip.hbm_gbps * 1e9 / self.devices_per_chip

  def describe(self) -> str:
    slices = f" x {self.num_slices} slices (DCN)" if self.num_slices > 1 else ""
    kind = "TPU " if self.chip.name in TPU_GENERATIONS else ""
    return (f"{self.name}{slices}: {self.chips_per_slice * self.num_slices} {kind}{self.chip.name} chips, "
            f"{len(self.devices)} devices, {self.hbm_bytes_per_device / 2**30:.1f} GiB HBM per device")


_TOPOLOGY = re.compile(r"^(v\d+[a-z]?):(\d+(?:x\d+){1,2})$")


def parse_topology(name: str) -> tuple[Chip, tuple[int, ...]]:
  """'v5e:2x4' -> (the v5e `Chip`, (2, 4)); ValueError (one line) names the form and the generations."""
  match = _TOPOLOGY.match(name)
  if not match or match.group(1) not in TPU_GENERATIONS:
    raise ValueError(f"--topology={name!r}: expected GENERATION:AxB[xC] with GENERATION one of "
                     f"{', '.join(TPU_GENERATIONS)} (e.g. v5e:2x4, v4:2x2x1)")
  return chip_named(match.group(1)), tuple(int(n) for n in match.group(2).split("x"))


def tpu_topology(name: str, num_slices: int = 1) -> Topology:
  """The compile-only devices of TPU topology `name` ('v5e:2x4', 'v4:2x2x1'), `num_slices` of them over DCN.

  v4 and v5p are described as megacore (one device per chip, as a TPU VM shows them); v2/v3 have one device
  per TensorCore. A slice smaller than a host's chips (v5e:1x1) gets host bounds of its own size.
  Raises ValueError (one line) on a malformed name, num_slices < 1, or when libtpu is absent.
  """
  chip, dims = parse_topology(name)
  if num_slices < 1:
    raise ValueError(f"--num_slices={num_slices}: must be >= 1")
  if not libtpu_available():
    raise ValueError(f"--topology={name}: compiling for a TPU topology needs libtpu, which is not installed: "
                     "pip install -e '.[tpu]' (the version jax[tpu] pins)")
  # Compile-only use never touches a chip: let several processes (tests under xdist, two plans) load libtpu at
  # once instead of the first one holding /tmp/libtpu_lockfile.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top (loads the TPU plugin)
  kwargs = dict(num_slices=num_slices)
  if chip.name == "v4":
    kwargs["chip_config_name"] = "megacore"
  try:
    devices = topologies.get_topology_desc(topology_name=name, platform="tpu", **kwargs).devices
  except Exception as error:  # noqa: BLE001  (XlaRuntimeError: a slice smaller than a host's default bounds)
    if "chips_per_host_bounds" not in str(error):
      raise
    bounds = tuple(dims) + (1,) * (3 - len(dims))
    devices = topologies.get_topology_desc(topology_name=name, platform="tpu", chips_per_host_bounds=bounds,
                                           **kwargs).devices
  return Topology(name=name, chip=chip, chips_per_slice=math.prod(dims), num_slices=num_slices,
                  devices=tuple(devices))


# ----------------------------------------------------------------------------------------------------------
# GPUs, compiled for without a GPU
# ----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GpuSpec:
  """What XLA's GPU compiler is told of a GPU it compiles for without one (`stream_executor.GpuTargetConfigProto`'s
  `gpu_device_info`, the fields of XLA's `xla/backends/gpu/target_config/specs/*.txtpb`)."""

  description: str               # the `device_kind` the compile-only devices show
  compute_capability: tuple[int, int]
  core_count: int                # streaming multiprocessors
  fpus_per_core: int             # FP32 lanes per SM
  clock_rate_ghz: float          # boost clock
  l2_cache_bytes: int
  shared_memory_per_core: int    # bytes per SM
  shared_memory_per_block_optin: int
  device_memory_bytes: int       # as the CUDA driver reports it (cudaDeviceProp.totalGlobalMem)


# NVIDIA's H100 SXM5 80GB and A100 SXM4 80GB datasheets and CUDA programming guide (compute capability tables);
# the H100's figures are those of XLA's own h100_sxm.txtpb.
GPU_SPECS = {
    "H100": GpuSpec("NVIDIA H100 80GB HBM3", (9, 0), 132, 128, 1.98, 50 * 2**20, 233472, 232448, 84942979072),
    "A100": GpuSpec("NVIDIA A100-SXM4-80GB", (8, 0), 108, 64, 1.41, 40 * 2**20, 167936, 166912, 85899345920),
}
_GPU_TOPOLOGY = re.compile(r"^([A-Z]\d+):(\d+)$")


def cuda_plugin_available() -> bool:
  """Whether XLA's CUDA compiler is installed (`pip install .[gpu-plan]`: jax's CUDA plugin), found unimported."""
  try:
    return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
  except ModuleNotFoundError:  # no jax_plugins namespace package at all
    return False


def gpu_target_config(chip: Chip) -> str:
  """The text `GpuTargetConfigProto` of `chip` (one of `GPU_SPECS`), from its public spec and `chip.hbm_gbps`:
  what `topologies.get_topology_desc(platform="cuda", target_config=...)` compiles for (jax's
  `deviceless_aot_test`, openxla/xla#16913). cuDNN 8.9.4 as XLA's specs give it (no cuDNN is loaded)."""
  spec = GPU_SPECS[chip.name]
  major, minor = spec.compute_capability
  return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: {spec.shared_memory_per_core} threads_per_core_limit: 2048
  core_count: {spec.core_count} fpus_per_core: {spec.fpus_per_core}
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {int(chip.hbm_gbps * 1e9)} l2_cache_size: {spec.l2_cache_bytes}
  clock_rate_ghz: {spec.clock_rate_ghz} device_memory_size: {spec.device_memory_bytes}
  shared_memory_per_block_optin: {spec.shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 8 minor: 9 patch: 4 }}
device_description_str: "{spec.description}"
"""


def gpu_topology(name: str) -> Topology:
  """The compile-only devices of `name` = 'CHIP:N' (`GPU_SPECS`: 'H100:8' is one HGX/DGX H100 host of 8 GPUs,
  NVLink among them), for XLA's CUDA compiler without a GPU. Its compile-only client gives memory analyses
  and the optimised HLO, no cost analysis. Raises ValueError (one line) on a malformed name or an unknown
  chip, or when the CUDA plugin (the `gpu-plan` extra) is absent."""
  match = _GPU_TOPOLOGY.match(name)
  if not match or match.group(1) not in GPU_SPECS or int(match.group(2)) < 1:
    raise ValueError(f"--topology={name!r}: expected CHIP:N with CHIP one of {', '.join(GPU_SPECS)} and N GPUs "
                     "on one host (e.g. H100:8)")
  if not cuda_plugin_available():
    raise ValueError(f"--topology={name}: compiling for a GPU needs jax's CUDA plugin, which is not installed: "
                     "pip install -e '.[gpu-plan]'")
  # The plugin checks the CUDA libraries' versions when it starts; compile-only use loads none of them.
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top (loads the CUDA plugin)
  chip, count = chip_named(match.group(1)), int(match.group(2))
  devices = topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config(chip),
                                         topology=f"1x1x{count}").devices  # slices x hosts x GPUs per host
  return Topology(name=name, chip=chip, chips_per_slice=count, num_slices=1, devices=tuple(devices))


def compile_topology(name: str, num_slices: int = 1) -> Topology:
  """`tpu_topology(name, num_slices)` for a TPU name ('v5e:2x4'), `gpu_topology(name)` for a GPU one
  ('H100:8'; one host, num_slices 1); ValueError (one line) otherwise."""
  if _GPU_TOPOLOGY.match(name):
    if num_slices != 1:
      raise ValueError(f"--num_slices={num_slices}: a GPU topology ({name}) is one host; use 1")
    return gpu_topology(name)
  return tpu_topology(name, num_slices)


def attached_topology(devices: Optional[Sequence[jax.Device]] = None) -> Optional[Topology]:
  """The `Topology` of the attached devices (default: `jax.devices()`) when they are a known chip, else None."""
  devices = tuple(jax.devices() if devices is None else devices)
  chip = chip_of(devices[0].device_kind)
  if chip is None:
    return None
  per_chip = 1 if chip.megacore or devices[0].platform != "tpu" else 2
  num_slices = len({getattr(d, "slice_index", 0) for d in devices})
  chips = max(len(devices) // per_chip // num_slices, 1)
  return Topology(name=f"{chip.name}:{chips} chips", chip=chip, chips_per_slice=chips, num_slices=num_slices,
                  devices=devices)


# ----------------------------------------------------------------------------------------------------------
# The one rule for choices that depend on the backend
# ----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BackendChoices:
  """What a run uses on one platform where the best choice depends on the backend (docs/performance.md,
  "Compiled for the accelerators we target", has the comparisons behind each)."""

  compute_dtype: str             # `model.dtype` a run should train in (parameters stay float32)


# Beam search's never-reordered cache (`kvcache.BeamSelfAttentionCache`) is no entry: it is the faster form on
# XLA:CPU (measured) and by the TPU compiler's estimate (1.29x per position, docs/performance.md), so it is used
# on every platform.
# Nor are bfloat16 logits (1.4% of base's TPU step) or the TPU's dropout generator (no gain): docs/performance.md,
# "Which ops dominate base's estimate on v5e".
BACKEND_CHOICES = {
    "cpu": BackendChoices(compute_dtype="float32"),  # bf16 is emulated on XLA:CPU
    "gpu": BackendChoices(compute_dtype="bfloat16"),
    "tpu": BackendChoices(compute_dtype="bfloat16"),
}


def backend_choices(platform: str) -> BackendChoices:
  """The `BackendChoices` of `platform` ('cpu', 'gpu' (or 'cuda'/'rocm'), 'tpu'); ValueError on others."""
  platform = "gpu" if platform in ("cuda", "rocm") else platform
  if platform not in BACKEND_CHOICES:
    raise ValueError(f"no backend choices for platform {platform!r}; one of {sorted(BACKEND_CHOICES)}")
  return BACKEND_CHOICES[platform]


def resolve_dtype(dtype: str, platform: str) -> str:
  """`model.dtype` for `platform`: 'auto' is the platform's `compute_dtype`, anything else is kept."""
  return backend_choices(platform).compute_dtype if dtype == "auto" else dtype
