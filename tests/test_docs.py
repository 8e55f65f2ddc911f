"""The README as a front door, and the docs it links: the library snippet runs, every relative link resolves.

The README's python block (its "Use it as a library" section) is executed as written, with `tj.base` giving a
1+1-layer model of d_model 32 so it compiles in seconds (every other name and call is the README's own). Links:
each `[text](target)` of README.md and docs/*.md that is not a URL must name an existing file, and a `#anchor`
must be a heading of that file, slugged as GitHub does (lowercase, punctuation but `-` and `_` dropped, spaces
to `-`).
"""

import os
import re

import pytest

import transformer_jax as tj
from transformer_jax import config as config_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
DOCS = os.path.join(REPO, "docs")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _read(path):
  with open(path, encoding="utf-8") as f:
    return f.read()


def _markdown_files():
  return [README] + sorted(os.path.join(DOCS, f) for f in os.listdir(DOCS) if f.endswith(".md"))


def slug(heading: str) -> str:
  """GitHub's anchor of a heading: lowercase, drop what is not a letter, digit, space, `-` or `_`, spaces to `-`."""
  text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
  return text.replace(" ", "-")


def anchors(path) -> set:
  text = FENCE.sub("", _read(path))
  return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*)$", text, re.M)}


def links(path):
  text = FENCE.sub("", _read(path))
  return [m.group(1) for m in LINK.finditer(text) if not re.match(r"[a-z]+:", m.group(1))]


def broken_links(path) -> list:
  broken = []
  for target in links(path):
    file, _, anchor = target.partition("#")
    resolved = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
    if not os.path.exists(resolved):
      broken.append(f"{target} (no file {os.path.relpath(resolved, REPO)})")
    elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
      broken.append(f"{target} (no heading #{anchor})")
  return broken


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: os.path.relpath(p, REPO))
def test_every_relative_link_resolves(path):
  assert broken_links(path) == []


def test_the_link_check_finds_a_missing_file_and_a_missing_anchor(tmp_path):
  (tmp_path / "other.md").write_text("# A heading: `with.code`, (and more)\n")
  page = tmp_path / "page.md"
  page.write_text("[ok](other.md#a-heading-withcode-and-more) [gone](nope.md) [bad](other.md#nope) "
                  "[web](https://example.com/x.md)\n```\n[in code](ignored.md)\n```\n")
  missing = os.path.relpath(str(tmp_path / "nope.md"), REPO)
  assert broken_links(str(page)) == [f"nope.md (no file {missing})", "other.md#nope (no heading #nope)"]


def test_readme_is_a_front_door():
  lines = _read(README).splitlines()
  assert len(lines) <= 150, f"README.md has {len(lines)} lines; the detail belongs in docs/"
  head = lines[:40]
  results = next(i for i, line in enumerate(head) if line.startswith("## Results"))
  assert any(line.startswith("|---") for line in head[results:]), "the results table must end within line 40"
  assert any(line.startswith("## Where to add") for line in lines)


def test_readme_library_snippet_runs(monkeypatch):
  block = re.search(r"^## Use it as a library\n+```python\n(.*?)^```", _read(README), re.S | re.M).group(1)
  small = dict(num_encoder_layers=1, num_decoder_layers=1, d_model=32, d_ff=64, num_heads=2)
  monkeypatch.setattr(tj, "base", lambda vocab_size=37000: config_lib.base(vocab_size=100, **small))
  namespace = {}
  exec(compile(block, "README.md", "exec"), namespace)  # pylint: disable=exec-used
  assert namespace["out"].tokens.shape == (2, 4, 60)
  assert namespace["tokens"].shape == (2, 4, 60)  # beam_search returns every beam, best first
  assert namespace["logits"].shape == (2, 9, 100)
  assert int(namespace["state"].step) == 1 and set(namespace["metrics"]) >= {"loss", "grad_norm"}
