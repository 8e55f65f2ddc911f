"""The command line of every program (`experiments/`, `benchmarks/`): `launch.run(main)` starts one.

Flag parsing whose every refusal is one line (`parse_flags`), the config flag with the same (`define_config_flag`),
and the host devices a config asks for (`set_cpu_devices`). The restart with glibc huge pages for XLA's host
buffers happens earlier, when Python imports the program's package (`launch/__init__.py`).
"""

import glob
import importlib.util
import math
import os
import re
import sys
import traceback
from typing import Any, Callable, Sequence

import jax
from absl import app, flags
from etils import epath
from ml_collections import config_flags

from launch import huge_pages
from transformer_jax.run import experiment_config


def _one_line(error: BaseException) -> str:
  return " ".join(str(error).split()) or type(error).__name__


def _refuse(message: str) -> None:
  print(f"error: {message}", file=sys.stderr)
  sys.exit(1)


def _config_file() -> str:
  """The `--config` file the command line names (the program's default when it names none)."""
  argv = sys.argv[1:]
  for i, arg in enumerate(argv):
    if arg.startswith("--config="):
      return arg.split("=", 1)[1]
    if arg == "--config" and i + 1 < len(argv):
      return argv[i + 1]
  return "(the default config file)"


def _raised_in_config_file(error: BaseException) -> str:
  """`--config=<file>:<line>: <Error>: <message>` for an error the config file's own code raised."""
  path = _config_file().split(":", 1)[0]  # ml_collections' `file.py:argument` form
  frames = [f for f in traceback.extract_tb(error.__traceback__)
            if os.path.abspath(f.filename) == os.path.abspath(path)]
  where = f"{path}:{frames[-1].lineno}" if frames else path
  return f"--config={where}: loading it raised {type(error).__name__}: {_one_line(error)}"


def _config_error_message(error: BaseException) -> str:
  if isinstance(error, AttributeError) and "get_config" in str(error):
    return f"--config={_config_file()}: the file defines no get_config() returning the config"
  if isinstance(error, AttributeError):  # ml_collections: an override of a key the config does not have
    key = _one_line(error).strip("\"'")
    given = [a for a in sys.argv[1:] if a.startswith("--config.") and key in a.split("=", 1)[0].split(".")]
    return (f"{given[0] if given else '--config.' + key}: the config has no such key; the keys are those of "
            "transformer_jax/run/experiment_config.py")
  if isinstance(error, SyntaxError):  # the --config file is not Python
    return f"--config={error.filename}:{error.lineno}: {error.msg} (a config file is Python defining get_config())"
  if isinstance(error, OSError) and "No such file or directory" in str(error):
    return f"--config={_config_file()}: no such file"
  if isinstance(error, OSError):  # ml_collections: the --config file could not be loaded
    return _one_line(error).replace("Configuration is not available because of an earlier failure to load: ", "")
  if isinstance(error, (flags.Error, KeyError, ValueError, TypeError)):
    # absl prefixes a validator's message with "flag --x=v: ", which ours already begin with "--x=v: "
    return re.sub(r"^flag (--\S+): \1: ", r"\1: ", _one_line(error))
  return _raised_in_config_file(error)  # anything else the file's own code raised (ImportError, ...)


def define_config_flag(default_file: str, help_text: str) -> None:
  """`--config` (an ml_collections config file, locked, `--config.a.b=value` overrides) with one-line errors.

  ml_collections already applies the command line's overrides while the flag is defined (at import of the
  program), so an unknown key or a missing file is refused here, before anything runs.
  """
  try:
    config_flags.DEFINE_config_file("config", default_file, help_text, lock_config=True)
  except Exception as error:  # pylint: disable=broad-except (the config file is the user's code: bad input)
    _refuse(_config_error_message(error))


def parse_flags(argv: list[str]) -> list[str]:
  """absl flag parsing whose every refusal is one line, `error: ...`, and exit status 1 (absl's own status).

  Beyond absl's checks (unknown flags, bad literals, validators): a `--config` file that cannot be loaded or an
  override of a key that does not exist is named, and a loaded config is checked by converting it to the library's
  `ExperimentConfig` (`from_config_dict`: every key's rule).
  Nothing has been written when this refuses. A config's `num_cpu_devices` is applied here
  (`set_cpu_devices`), before the program's first JAX operation.
  """
  try:
    args = flags.FLAGS(argv)  # runs the --config file: whatever its code raises is bad input
  except Exception as error:  # pylint: disable=broad-except
    _refuse(_config_error_message(error))
  try:
    if "config" in flags.FLAGS and flags.FLAGS.config is not None:
      experiment_config.ExperimentConfig.from_config_dict(flags.FLAGS.config)
      set_cpu_devices(flags.FLAGS.config.get("num_cpu_devices", 0))
    return args
  except (flags.Error, AttributeError, KeyError, OSError, ValueError, TypeError) as error:
    _refuse(_config_error_message(error))


def set_cpu_devices(count: int) -> None:
  """Makes JAX's CPU backend `count` devices (`jax_num_cpu_devices`; 0 leaves JAX's default, XLA_FLAGS' count).

  Why a 2-core host wants 2: XLA:CPU runs one op of a step at a time for most of it (docs/performance.md), so
  one device keeps ~1.2 cores busy; two devices, each running half of the data-parallel batch, keep both busy
  (the multi30k recipe's step: 1.06-1.12x real target tokens/s, side by side, docs/multi30k_runs.md). The gradients
  are the same sums. It must run before JAX starts its backends; raises RuntimeError after that (JAX's error).
  Only the CPU backend is affected: on a GPU or TPU host the mesh is still made of the accelerators.
  """
  if count:
    jax.config.update("jax_num_cpu_devices", int(count))


def check_flags(**flag_to_key: str) -> None:
  """Registers absl validators: each named flag must satisfy the rule of its config key (`experiment_config.RULES`)."""
  for flag, key in flag_to_key.items():
    def validator(value, flag=flag, key=key):
      if value is not None:
        try:
          experiment_config.check_value(key, value, flag=f"--{flag}")
        except experiment_config.ConfigError as error:
          raise flags.ValidationError(str(error)) from None
      return True
    flags.register_validator(flag, validator)


def check_ranges(**flag_to_range: tuple[float, float]) -> None:
  """Registers absl validators: each named number flag must be finite and within its (low, high), both
  included; an integer flag is also held to int32 (`experiment_config.INT32_MAX`), what JAX sizes hold."""
  for flag, (low, high) in flag_to_range.items():
    def validator(value, flag=flag, low=low, high=high):
      if value is None:
        return True
      is_int = isinstance(value, int)
      top = min(high, experiment_config.INT32_MAX) if is_int else high
      if not (math.isfinite(value) and low <= value <= top):
        kind = "an integer" if is_int else "a finite number"
        raise flags.ValidationError(f"--{flag}={value}: must be {kind} in [{low}, {top}]")
      return True
    flags.register_validator(flag, validator)


def check_files_exist(*flag_names: str) -> None:
  """Registers absl validators: each named flag, when set, must name an existing file."""
  for name in flag_names:
    flags.register_validator(name, lambda path: path is None or epath.Path(path).is_file(),
                             message=f"--{name} must name an existing file")


def _writable_file_path(path: str | None) -> bool:
  if path is None:
    return True
  target = epath.Path(path)
  return not target.is_dir() and not any(parent.is_file() for parent in target.parents)


def check_output_files(*flag_names: str) -> None:
  """Registers absl validators: each named flag, when set, must name a file that can be written (not an existing
  directory, no existing file among its parents), checked before any work whose result it would hold."""
  for name in flag_names:
    flags.register_validator(name, _writable_file_path,
                             message=f"--{name} must name a file to write (it is a directory, or under a file)")


def check_list_choices(name: str, choices: Sequence[str]) -> None:
  """Registers an absl validator: each item of the list flag `name` must be one of `choices` (the refusal names
  the unknown ones and lists the choices)."""
  def validator(values: list[str] | None) -> bool:
    unknown = sorted(set(values or ()) - set(choices))
    if unknown:
      raise flags.ValidationError(f"unknown {unknown}; of {','.join(choices)}")
    return True
  flags.register_validator(name, validator)


def run(main: Callable[[list[str]], Any]) -> None:
  """Starts an absl program: `absl.app.run(main)` with `parse_flags`.

  Every program ends with `if __name__ == "__main__": launch.run(main)`. A `python -m experiments.<program>`
  has restarted with huge pages already (`launch/__init__.py`); a program started some other way restarts
  here, once.
  """
  huge_pages.maybe_reexecute()
  skip_absent_tpu()
  app.run(main, flags_parser=parse_flags)


def skip_absent_tpu() -> None:
  """On a host with the `tpu` extra's libtpu but no TPU chip (no /dev/accel*, no /dev/vfio/<n>) and no CUDA
  plugin, JAX's backends are limited to the CPU (`JAX_PLATFORMS=cpu`): otherwise libtpu's failed start prints five
  lines of warnings in every program. Compile-only TPU plans do not need the TPU backend (`accelerators`).
  `JAX_PLATFORMS` set by the caller is kept; must run before JAX starts its backends."""
  if "JAX_PLATFORMS" in os.environ or importlib.util.find_spec("libtpu") is None:
    return
  if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
    return
  if any(importlib.util.find_spec(name) for name in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
    return
  os.environ["JAX_PLATFORMS"] = "cpu"
  jax.config.update("jax_platforms", "cpu")
