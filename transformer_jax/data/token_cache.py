"""The key of the training split's stored token ids: what they were encoded from.

The training split is encoded once into id shards (`id_shards.write_shards`, in `<workdir>/data/<split>.ids/`), so
a restart does not re-read and re-encode it (tens of minutes for WMT14 EN-FR's 36M pairs on a small host).
They are read only under the same key: the same dataset (tfds full name: builder, config - for local text
files a fingerprint of their contents - and version), split, language keys, vocabulary (SHA-256 of the
SentencePiece model, or of the files of a Marian tokenizer directory) and the text normalisation the ids were
encoded with (`normalize.signature`: its version and the Unicode database of NFC); the shards of another key
live in another directory (`id_shards.key_directory`).
"""

from __future__ import annotations

import hashlib

from etils import epath

FORMAT = 2  # 2: sharded ArrayRecord ids (`pipeline`); 1 was one .npz file


def file_sha256(path: str | epath.Path) -> str:
  """SHA-256 (hex) of a file; of a directory, of its files' names and SHA-256s in name order."""
  digest = hashlib.sha256()
  path = epath.Path(path)
  if path.is_dir():
    for child in sorted(path.iterdir(), key=lambda p: p.name):
      if child.is_file():
        digest.update(f"{child.name}:{file_sha256(child)}\n".encode())
    return digest.hexdigest()
  with path.open("rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


def cache_key(dataset_full_name: str, split: str, source_key: str, target_key: str, vocab_file: str,
              normalization: str) -> dict:
  """What the cached ids depend on. `vocab_file` is the tokenizer's `path` (a SentencePiece model, or the
  directory of a Marian tokenizer's files); `normalization` is `normalize.signature(tokenizer.normalization)`."""
  return {"format": FORMAT, "dataset": dataset_full_name, "split": split, "source": source_key,
          "target": target_key, "vocab_sha256": file_sha256(vocab_file), "normalization": normalization}
