"""The benchmark programs of transformer_jax: `python -m benchmarks.<program> --flag=...` (absl flags).

As in `experiments/__init__.py`: when Python imports this package to run `python -m benchmarks.<module>`, the
process first restarts itself once with glibc huge pages (`experiments/huge_pages.py`), before the program's
own imports, so benchmarks time the step the training programs run. Any other import has no side effect.
"""

from experiments import huge_pages

if huge_pages.starting_as_program():
  huge_pages.maybe_reexecute()
