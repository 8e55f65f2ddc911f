"""Test-wide setup: 8 host (CPU) devices, so sharding tests run on a laptop; XLA:CPU's generated code at LLVM
-O0; one XLA compilation cache for the whole run.

-O0 (`--xla_backend_optimization_level=0` in XLA_FLAGS, which the programs the tests start inherit): the same
HLO programs, after the same XLA passes, giving the same numbers (the saved decoding references match), compiled
~20% faster; the tests' models are tiny, so compiling is most of their time. The tests whose time is training
run it at -O2, as a user's run: the Multi30k recipe end to end and the notebook start their programs without
the flag, the bf16 training test compiles its step with `compiler_options` (117 s at -O0, 40 s at -O2).
The 8 devices are `jax_num_cpu_devices` of this process only: the programs the tests start get a user's one.

All must be set before JAX starts its backends in the test process. The cache is JAX's persistent compilation
cache in a fresh temporary folder that the pytest-xdist workers and the programs the tests start (resume after
SIGKILL, the recipe end to end) inherit through the environment, so a train step that many tests build alike is
compiled once per run instead of once per test and process; it is removed when the run ends. Nothing persists
between runs; `JAX_COMPILATION_CACHE_DIR` set by the caller is used as it is (empty: no cache).
"""

import os
import shutil
import tempfile

if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):  # xdist's workers inherit it
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
# The suite runs on the host's CPU; with libtpu installed (the tpu extra) a TPU backend would otherwise be tried
# (and log its failure) in every process. TPU topologies still compile (tests/test_tpu_plan.py).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the first process of the run (xdist's controller) makes it
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE = tempfile.mkdtemp(prefix="transformer_jax-tests-xla-")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
else:
  _OWN_CACHE = None

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def pytest_unconfigure(config):
  if _OWN_CACHE is not None:  # only the process that made it; xdist's workers inherit the controller's
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)


SHARED_MULTI30K = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "multi30k")


@pytest.fixture(scope="session")
def multi30k_dir():
  """The shared Multi30k corpus; tests that need it skip only when the folder is absent."""
  path = os.path.abspath(SHARED_MULTI30K)
  if not os.path.isdir(path):
    pytest.skip(f"{path} not present")
  return path


@pytest.fixture(autouse=True, scope="session")
def _no_real_wmt_download():
  """A real WMT `download_and_prepare()` hangs for minutes without network: make it fail at once.

  `tfds.testing.mock_data` replaces the method while it is active, so mocked tests are unaffected.
  """
  import tensorflow_datasets as tfds

  original = tfds.core.DatasetBuilder.download_and_prepare

  def guarded(self, *args, **kwargs):
    if self.name.startswith("wmt"):
      raise RuntimeError(f"test tried to download {self.name}; use tfds.testing.mock_data")
    return original(self, *args, **kwargs)

  tfds.core.DatasetBuilder.download_and_prepare = guarded
  yield
  tfds.core.DatasetBuilder.download_and_prepare = original
