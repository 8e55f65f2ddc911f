"""Test-wide setup: 8 forced host (CPU) devices, so sharding tests run on a laptop.

The flag must be set before jax is imported anywhere in the test process.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import pytest  # noqa: E402

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
