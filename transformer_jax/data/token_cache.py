"""The training split's token ids, saved in the workdir so that a restart does not re-read and re-encode it.

A run resumed after preemption rebuilds its data pipeline from scratch: read every training pair from tfds,
encode both sides with SentencePiece. That is seconds for Multi30k and tens of minutes for WMT14 EN-FR
(36M pairs) on a small host, paid again at every restart. `save` writes the encoded split once, as
concatenated ids plus offsets (uint16 when the vocabulary fits), with a key naming what produced them;
`load` returns them only when the key matches: the same dataset (tfds full name: builder, config - for
local text files a fingerprint of their contents - and version), split, language keys, vocabulary (SHA-256
of the SentencePiece model, or of the files of a Marian tokenizer directory) and the text normalisation the
ids were encoded with (`normalize.signature`: its version and the Unicode database of NFC). Anything else (missing, different key, unreadable) means "encode again", with the
reason logged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import uuid
from typing import Optional, Sequence

import numpy as np
from etils import epath

from transformer_jax.workdir import is_local

FORMAT = 1


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


def _flatten(seqs: Sequence[np.ndarray], dtype) -> tuple[np.ndarray, np.ndarray]:
  offsets = np.zeros(len(seqs) + 1, np.int64)
  np.cumsum([len(s) for s in seqs], out=offsets[1:])
  flat = np.concatenate(seqs).astype(dtype) if seqs else np.zeros(0, dtype)
  return flat, offsets


def _split(flat: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
  flat = flat.astype(np.int32)
  return [flat[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]


def save(path: str, key: dict, sources: Sequence[np.ndarray], targets: Sequence[np.ndarray],
         skipped_blank: int) -> None:
  """Writes the ids atomically (a temporary file renamed into place; local or `gs://`)."""
  top = max((int(s.max()) for s in [*sources, *targets] if len(s)), default=0)
  dtype = np.uint16 if top < 2 ** 16 else np.int32
  src_flat, src_offsets = _flatten(sources, dtype)
  tgt_flat, tgt_offsets = _flatten(targets, dtype)
  meta = dict(key, skipped_blank=int(skipped_blank), pairs=len(sources))
  arrays = dict(key=np.asarray(json.dumps(meta, sort_keys=True)), src=src_flat, src_offsets=src_offsets,
                tgt=tgt_flat, tgt_offsets=tgt_offsets)
  path = epath.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.parent / f"{path.name}.{uuid.uuid4().hex}.tmp.npz"  # np.savez adds .npz to other names
  if is_local(path):
    np.savez(tmp, **arrays)
  else:  # zip writing seeks, which a file being uploaded to Cloud Storage cannot: write locally, then copy
    with tempfile.TemporaryDirectory() as scratch:
      local = os.path.join(scratch, "ids.npz")
      np.savez(local, **arrays)
      epath.Path(local).copy(tmp)
  tmp.replace(path)


def read(path: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """(sources, targets) stored at `path`, int32, whatever they were written for (no key check).

  Raises OSError/KeyError on a missing or foreign file."""
  with epath.Path(path).open("rb") as f, np.load(f) as data:
    return _split(data["src"], data["src_offsets"]), _split(data["tgt"], data["tgt_offsets"])


def load(path: str, key: dict) -> Optional[tuple[list[np.ndarray], list[np.ndarray], int]]:
  """(sources, targets, skipped_blank) saved under `key` at `path`, or None (reason logged)."""
  if not epath.Path(path).exists():
    return None
  try:
    with epath.Path(path).open("rb") as f, np.load(f) as data:
      meta = json.loads(str(data["key"]))
      stored = {k: meta.get(k) for k in key}
      if stored != key:
        changed = sorted(k for k in key if stored.get(k) != key[k])
        logging.info("Token-id cache %s was written for another %s; encoding the text again",
                     path, ", ".join(changed))
        return None
      sources = _split(data["src"], data["src_offsets"])
      targets = _split(data["tgt"], data["tgt_offsets"])
  except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
    logging.warning("Token-id cache %s is unreadable (%s); encoding the text again", path, e)
    return None
  if len(sources) != meta["pairs"] or len(targets) != meta["pairs"]:
    logging.warning("Token-id cache %s is incomplete; encoding the text again", path)
    return None
  return sources, targets, int(meta["skipped_blank"])
