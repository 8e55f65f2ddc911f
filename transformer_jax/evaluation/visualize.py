"""Attention heatmaps (from the model's own weights path) and learning curves, drawn with matplotlib."""

from __future__ import annotations

import json
from typing import Sequence

import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from etils import epath

from transformer_jax.config import ModelConfig
from transformer_jax.model import ATTENTION_KINDS, attention_weights

KINDS = ATTENTION_KINDS


def attention_maps(params, config: ModelConfig, source_ids: Sequence[int],
                   target_ids: Sequence[int]) -> dict[str, np.ndarray]:
  """Attention weights of one sentence pair, teacher-forced: kind -> `[layers, heads, q_len, kv_len]`.

  `encoder_self` is `[layers, heads, src, src]`, `decoder_self` `[layers, heads, tgt, tgt]` and `cross`
  `[layers, heads, tgt, src]`; decoder query t is the position predicting `target_ids[t]`. The weights are
  sown by `MultiHeadAttention` (`sow_attention_weights=True`), i.e. computed by the model itself.
  """
  inputs = jnp.asarray([list(source_ids)], jnp.int32)
  targets = jnp.asarray([list(target_ids)], jnp.int32)
  weights = attention_weights(params, config, inputs, targets)
  return {kind: np.stack([np.asarray(layer[0]) for layer in weights[kind]]) for kind in KINDS}


def plot_attention(maps: dict[str, np.ndarray], source_tokens: Sequence[str], target_tokens: Sequence[str],
                   path: str | None = None, cell_inches: float = 1.6):
  """A grid: one row per (kind, layer), one column per head; tokens on the axes. Returns the figure."""
  rows = [(kind, layer) for kind in KINDS for layer in range(maps[kind].shape[0])]
  heads = maps[KINDS[0]].shape[1]
  fig, axes = plt.subplots(len(rows), heads, figsize=(cell_inches * heads + 1, cell_inches * len(rows) + 1),
                           squeeze=False)
  labels = {"encoder_self": (source_tokens, source_tokens), "decoder_self": (target_tokens, target_tokens),
            "cross": (target_tokens, source_tokens)}
  small = max(3, 8 - max(len(source_tokens), len(target_tokens)) // 6)
  for r, (kind, layer) in enumerate(rows):
    y_labels, x_labels = labels[kind]
    for h in range(heads):
      ax = axes[r][h]
      ax.imshow(maps[kind][layer, h], cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
      ax.set_xticks(range(len(x_labels)))
      ax.set_yticks(range(len(y_labels)))
      ax.set_xticklabels(x_labels if r == len(rows) - 1 or kind != rows[r + 1][0] else [], rotation=90,
                         fontsize=small)
      ax.set_yticklabels(y_labels if h == 0 else [], fontsize=small)
      if r == 0:
        ax.set_title(f"head {h}", fontsize=8)
      if h == 0:
        ax.set_ylabel(f"{kind}\nlayer {layer}", fontsize=7)
  fig.tight_layout()
  if path is not None:
    save_figure(fig, path)
  return fig


def save_figure(fig, path: str) -> None:
  """`fig` as an image file at `path` (local or gs://; the format from its suffix, e.g. .png, .pdf), 110 dpi."""
  path = epath.Path(path)
  with path.open("wb") as f:
    fig.savefig(f, format=path.suffix[1:] or None, dpi=110)


def plot_learning_curves(metrics_jsonl: str, path: str | None = None):
  """Train loss, validation loss and (when logged) validation BLEU against minutes since the first log."""
  text = epath.Path(metrics_jsonl).read_text(encoding="utf-8")
  rows = [json.loads(line) for line in text.split("\n") if line.strip()]
  if not rows:
    raise ValueError(f"{metrics_jsonl} has no logged metrics")
  t0 = rows[0]["time"]
  series: dict[str, tuple[list[float], list[float]]] = {}
  for row in rows:
    for key, value in row.items():
      if key in ("step", "time"):
        continue
      xs, ys = series.setdefault(key, ([], []))
      xs.append((row["time"] - t0) / 60)
      ys.append(value)
  loss_keys = [k for k in series if k.endswith("/loss")]
  bleu_keys = [k for k in series if k.endswith("/bleu")]
  fig, axes = plt.subplots(1, 2 if bleu_keys else 1, figsize=(11 if bleu_keys else 6, 4), squeeze=False)
  for key in loss_keys:
    axes[0][0].plot(*series[key], label=key)
  axes[0][0].set_xlabel("minutes")
  axes[0][0].set_ylabel("label-smoothed loss")
  axes[0][0].legend()
  if bleu_keys:
    for key in bleu_keys:
      axes[0][1].plot(*series[key], marker="o", label=key)
    axes[0][1].set_xlabel("minutes")
    axes[0][1].set_ylabel("BLEU")
    axes[0][1].legend()
  fig.tight_layout()
  if path is not None:
    save_figure(fig, path)
  return fig
