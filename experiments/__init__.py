"""The absl programs of transformer_jax: `python -m experiments.<program> --config=... --workdir=...`.

Programs start through `experiments.launch.run(main)`. The one side effect of importing this package: when
Python imports it to run `python -m experiments.<module>`, the process first restarts itself once with glibc
huge pages (`experiments/huge_pages.py`), before the program's own imports. Any other import has none.
"""

from experiments import huge_pages

if huge_pages.starting_as_program():
  huge_pages.maybe_reexecute()
