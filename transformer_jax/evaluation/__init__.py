"""Judging translations and attention: sentence and corpus metrics (`metrics`: sacreBLEU, chrF, exact match,
each with its direction), attention diagnostics (`diagnostics`: entropy, near-uniform heads) and plots
(`visualize`)."""
