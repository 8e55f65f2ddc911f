"""Generated blocks inside hand-written Markdown: a program rewrites only what lies between its two markers.

    replace_block("docs/results.md", "multi30k:last-run", text)

The block is delimited by `<!-- NAME:start -->` and `<!-- NAME:end -->`; everything around it (tables and notes
written by people) is kept. A file without the markers gets the block appended (created if missing), so a
program never erases what it did not write.
"""

from __future__ import annotations

import os


def markers(name: str) -> tuple[str, str]:
  return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def replace_block(path: str, name: str, body: str, *, append_if_missing: bool = True) -> bool:
  """Writes `body` between `name`'s markers in `path`; False (file untouched) when the markers are missing
  and `append_if_missing` is False. The file is replaced atomically (written beside it, then renamed)."""
  start, end = markers(name)
  text = ""
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      text = f.read()
  block = f"{start}\n{body.rstrip()}\n{end}"
  if start in text and end in text:
    head, rest = text.split(start, 1)
    text = head + block + rest.split(end, 1)[1]
  elif append_if_missing:
    text = (text.rstrip() + "\n\n" if text.strip() else "") + block + "\n"
  else:
    return False
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(tmp, path)
  return True
