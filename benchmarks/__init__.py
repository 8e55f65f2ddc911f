"""The benchmark programs of transformer_jax: `python -m benchmarks.<program> --flag=...` (absl flags).

They stand on the library, the launcher (`launch`) and the recipes (`experiments/configs`), never on another
program. As for `experiments/`, importing this package imports `launch` first: a `python -m benchmarks.<module>`
restarts there once with glibc huge pages (`launch/huge_pages.py`), so benchmarks time the step the training
programs run.
"""

import importlib

# First: a `python -m` program restarts here once with huge pages (launch/__init__.py).
importlib.import_module("launch")
