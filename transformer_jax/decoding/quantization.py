"""Weight-only int8 for inference, through qwix (Google's JAX quantization library): parameters at rest in int8.

    params = quantization.quantize_params(params, "int8")   # then decode as with float parameters

Every kernel and embedding table (attention projections, feed-forward layers, embeddings: all but a few
thousand of a Transformer's weights) becomes a `qwix.QArray`: int8 values and one float32 absmax scale per
output channel (per row of an embedding table, which is both looked up and the pre-softmax projection,
section 3.4; `_channel_axes`); biases and LayerNorm scales stay float32. The tree is wrapped in `QuantizedParams`,
which the compiled search (`decoding.inference`) dequantizes inside `jit`: a device holds the int8 values, and
XLA fuses the dequantisation into the matmuls' operands where the backend can. Why weights only and why not
`qwix.quantize_model`: qwix's linen interception finds the weights of a `dot_general` by the module's param
identity, which our projections' `kernel.astype(dtype)` hides; quantizing the tree with `qwix.quantize` and
dequantizing it at the search's entry needs no change to the model. Activations stay float (docs/serving.md).
"""

from __future__ import annotations

from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np

MODES = ("", "int8")


@flax.struct.dataclass
class QuantizedParams:
  """A parameter tree whose large kernels are `qwix.QArray`s; `dequantize()` gives the float tree back."""
  tree: Any

  def dequantize(self) -> Any:
    """The float32 parameter tree (`qwix.dequantize` of each QArray), shapes as before quantisation."""
    import qwix  # pylint: disable=g-import-not-at-top (start-up cost: docs/performance.md)
    return jax.tree_util.tree_map(lambda x: qwix.dequantize(x) if isinstance(x, qwix.QArray) else x, self.tree,
                                  is_leaf=lambda x: isinstance(x, qwix.QArray))


def _channel_axes(path: str, ndim: int) -> tuple[int, ...] | None:
  """The axes with their own scale (every axis a matmul does not contract), or None to keep the leaf float.

  Kernels: `[d_in, ...out]` (feed-forward, logits, W^Q/K/V `[d_model, heads, head_dim]`) scale per output;
  W^O `[heads, head_dim, d_model]` (`attention.layer.OutputProjection`, named 'out') per d_model column.
  Embedding tables `[rows, d_model]` (looked up by row, and the tied pre-softmax projection) per row. Biases,
  LayerNorm and relative-position tables (small, added rather than multiplied) stay float32.
  """
  name = path.rsplit("[", 1)[-1].strip("]'\"")
  if ndim < 2 or name not in ("kernel", "embedding", "position_embedding"):
    return None
  if name != "kernel":
    return (0,)
  if "['out']" in path:
    return (ndim - 1,)
  return tuple(range(1, ndim))


def quantize_params(params: Any, mode: str) -> Any:
  """`params` (plain arrays) with weight-only `mode` applied: '' returns them as they are; 'int8' returns a
  `QuantizedParams`. ValueError for another mode."""
  if mode not in MODES:
    raise ValueError(f"--quantize={mode!r}; expected one of {', '.join(repr(m) for m in MODES)}")
  if not mode:
    return params
  import qwix  # pylint: disable=g-import-not-at-top (start-up cost: docs/performance.md)

  def quantize(path, leaf):
    array = jnp.asarray(leaf)
    axes = _channel_axes(jax.tree_util.keystr(path), array.ndim)
    if axes is None or not jnp.issubdtype(array.dtype, jnp.floating):
      return array
    return qwix.quantize(array.astype(jnp.float32), jnp.int8, channelwise_axes=axes)
  return QuantizedParams(jax.tree_util.tree_map_with_path(quantize, params))


def parameter_bytes(params: Any) -> int:
  """Bytes of every array of the tree (int8 values and their scales for a `QuantizedParams`)."""
  return int(sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(params)))
