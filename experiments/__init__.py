"""The absl programs of transformer_jax: `python -m experiments.<program> --config=... --workdir=...`.

Importing this package has no side effects; programs start through `experiments.launch.run(main)`.
"""
