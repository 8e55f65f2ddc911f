"""The absl programs of transformer_jax: `python -m experiments.<program> --config=... --workdir=...`.

Each program is thin (flags -> config -> one library call) and starts through `launch.run(main)`, the launcher
it shares with `benchmarks/`. Importing this package imports `launch` first: a `python -m experiments.<module>`
restarts there once with glibc huge pages (`launch/huge_pages.py`), before the program's own imports.
"""

import importlib

# First: a `python -m` program restarts here once with huge pages (launch/__init__.py).
importlib.import_module("launch")
