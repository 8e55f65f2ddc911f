"""The peer: the same Transformer and training step in PyTorch (`torch.nn.Transformer`, eager, CPU).

Same sizes as the `ModelConfig`, post-LN, ReLU FFN, dropout `P_drop` on sublayer outputs and on
embedding + position sums, one shared embedding for source, target and the pre-softmax projection (scaled by
√d_model), sinusoidal positions that restart at every packed example, label-smoothed cross-entropy
(`F.cross_entropy(label_smoothing=ε)` = `(1-ε)·onehot + ε/V`, pad ignored, summed and divided by the real
target tokens) and Adam(0.9, 0.98, 1e-9) with the paper's schedule. It trains on the very same packed batches:
the block-diagonal (segment) masks become boolean `attn_mask`s of shape `[batch·heads, q, k]`
(`to_torch_batch`). On plain batches (full rows of one shape, no padding: `to_plain_torch_batch`) it runs as
`nn.Transformer` does best: no source, memory or key-padding masks at all, the decoder's causal mask only,
flagged `tgt_is_causal=True` so that attention takes the causal kernel path.

Differences (stated in the report): `nn.Transformer` adds a final LayerNorm after each stack (2 x d extra
work); the step returns only the loss (ours also returns accuracy, NLL and the gradient norm).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class TorchTransformer(nn.Module):
  def __init__(self, cfg):
    super().__init__()
    self.cfg = cfg
    self.embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
    nn.init.normal_(self.embedding.weight, std=cfg.d_model ** -0.5)
    self.transformer = nn.Transformer(
        d_model=cfg.d_model, nhead=cfg.num_heads, num_encoder_layers=cfg.num_encoder_layers,
        num_decoder_layers=cfg.num_decoder_layers, dim_feedforward=cfg.d_ff, dropout=cfg.dropout_rate,
        activation="relu", batch_first=True, norm_first=False, layer_norm_eps=cfg.layer_norm_epsilon)
    self.dropout = nn.Dropout(cfg.dropout_rate)
    position = np.arange(cfg.max_len)[:, None]
    inv_freq = np.exp(-math.log(10000.0) * np.arange(0, cfg.d_model, 2) / cfg.d_model)
    table = np.zeros((cfg.max_len, cfg.d_model), np.float32)
    table[:, 0::2], table[:, 1::2] = np.sin(position * inv_freq), np.cos(position * inv_freq)
    self.register_buffer("positions", torch.from_numpy(table))

  def embed(self, ids, positions):
    x = self.embedding(ids) * math.sqrt(self.cfg.d_model) + self.positions[positions]
    return self.dropout(x)

  def forward(self, batch):
    src, tgt = batch["inputs"], batch["targets"]
    dec_in = torch.where(batch["targets_position"] == 0, self.cfg.bos_id,
                         torch.roll(tgt, 1, dims=1))  # shift right, BOS at every example start
    logits = self.transformer(
        self.embed(src, batch["inputs_position"]), self.embed(dec_in, batch["targets_position"]),
        src_mask=batch["src_mask"], tgt_mask=batch["tgt_mask"], memory_mask=batch["memory_mask"],
        tgt_is_causal=batch["tgt_is_causal"])
    return F.linear(logits, self.embedding.weight)


def _segment_mask(q_seg, k_seg, causal=False):
  """True = may NOT attend (torch convention). Every query may attend to key 0 of its own row's diagonal
  so that fully padded queries never produce a NaN softmax (their outputs are ignored by the loss)."""
  allowed = (q_seg[:, :, None] == k_seg[:, None, :]) & (k_seg[:, None, :] > 0)
  if causal:
    allowed &= np.tril(np.ones((q_seg.shape[1], k_seg.shape[1]), bool))[None]
  q_len, k_len = q_seg.shape[1], k_seg.shape[1]
  diag = np.eye(q_len, k_len, dtype=bool)[None]
  allowed |= diag & (q_seg == 0)[:, :, None]
  return ~allowed


def to_torch_batch(batch: dict, heads: int) -> dict:
  """A packed numpy batch -> torch tensors plus the boolean masks `[batch·heads, q, k]` of `nn.Transformer`."""
  out = {k: torch.from_numpy(np.asarray(v, np.int64)) for k, v in batch.items()}
  src_seg, tgt_seg = batch["inputs_segmentation"], batch["targets_segmentation"]
  masks = {"src_mask": _segment_mask(src_seg, src_seg), "memory_mask": _segment_mask(tgt_seg, src_seg),
           "tgt_mask": _segment_mask(tgt_seg, tgt_seg, causal=True)}
  for name, mask in masks.items():  # computed once per batch, outside the timed step
    out[name] = torch.from_numpy(np.repeat(mask, heads, axis=0))
  out["token_count"] = int((batch["targets"] != 0).sum())
  out["tgt_is_causal"] = False
  return out


def to_plain_torch_batch(batch: dict) -> dict:
  """A plain numpy batch (`inputs`, `targets` `[rows, length]`, no padding) -> torch tensors, causal mask only.

  Positions are `0..length-1` on every row (the shift-right puts BOS at position 0); `tgt_mask` is the
  `[length, length]` causal mask `nn.Transformer.generate_square_subsequent_mask` builds, with
  `tgt_is_causal=True`; no other mask.
  """
  rows, length = batch["targets"].shape
  positions = torch.arange(length).expand(rows, length)
  return {"inputs": torch.from_numpy(np.asarray(batch["inputs"], np.int64)),
          "targets": torch.from_numpy(np.asarray(batch["targets"], np.int64)),
          "inputs_position": positions, "targets_position": positions, "src_mask": None, "memory_mask": None,
          "tgt_mask": nn.Transformer.generate_square_subsequent_mask(length), "tgt_is_causal": True,
          "token_count": rows * length}


class TorchTrainer:
  """One eager training step: forward, label-smoothed loss, backward, Adam with the rsqrt schedule."""

  def __init__(self, cfg, label_smoothing: float = 0.1, warmup_steps: int = 4000, seed: int = 0):
    torch.manual_seed(seed)
    self.cfg, self.label_smoothing = cfg, label_smoothing
    self.model = TorchTransformer(cfg)
    self.model.train()
    self.opt = torch.optim.Adam(self.model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    d = cfg.d_model
    self.sched = torch.optim.lr_scheduler.LambdaLR(
        self.opt, lambda s: d ** -0.5 * min((s + 1) ** -0.5, (s + 1) * warmup_steps ** -1.5))

  def step(self, batch: dict) -> float:
    logits = self.model(batch)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["targets"].reshape(-1),
                           ignore_index=self.cfg.pad_id, label_smoothing=self.label_smoothing,
                           reduction="sum") / max(batch["token_count"], 1)
    self.opt.zero_grad(set_to_none=True)
    loss.backward()
    self.opt.step()
    self.sched.step()
    return float(loss.detach())

  def num_params(self) -> int:
    return sum(p.numel() for p in self.model.parameters())
