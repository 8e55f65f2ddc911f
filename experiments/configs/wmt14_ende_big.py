r"""Transformer (big) on WMT 2014 English -> German: the paper's recipe (Vaswani et al., 2017; Table 3, sec. 5-6).

Same data, vocabulary, batch, optimizer and decoding as `wmt14_ende_base.py`; differs in size (d_model=1024,
d_ff=4096, h=16), P_drop=0.3, 300k steps and the average of the last 20 checkpoints. On 8 accelerators:

    python -m experiments.train --config=experiments/configs/wmt14_ende_big.py --workdir=$WORKDIR \
        --config.data.tfds_data_dir=$TFDS_DIR

On fewer accelerators keep tokens_per_batch x grad_accum_steps = 26,624 slots per side (~25k real tokens),
e.g. on 1: --config.data.tokens_per_batch=3328 --config.grad_accum_steps=8. Then:

    python -m experiments.average_checkpoints --workdir=$WORKDIR --last=20
    python -m experiments.evaluate --workdir=$WORKDIR --checkpoint=$WORKDIR/averaged \
        --source=newstest2014.en --reference=newstest2014.de --beam_size=4 --alpha=0.6 --extra_len=50 \
        --tokenized_bleu

Paper: 28.4 BLEU on newstest2014 (tokenized, compound-split).
"""

import ml_collections

from experiments.configs import wmt14_ende_base


def get_config() -> ml_collections.ConfigDict:
  config = wmt14_ende_base.get_config()

  # Transformer (big), Table 3: N=6, d_model=1024, d_ff=4096, h=16, d_k=d_v=64, P_drop=0.3 for EN-DE.
  config.model.update(d_model=1024, d_ff=4096, num_heads=16, dropout_rate=0.3)

  # 300k steps (3.5 days on 8 P100s in the paper); warmup, Adam and label smoothing as for base.
  config.num_train_steps = 300_000
  config.evals.loss.every_steps = 10_000
  config.evals.attention.every_steps = 10_000
  config.evals.bleu.every_steps = 20_000

  # A checkpoint every 10 minutes; the reported model averages the last 20 of them (section 6.1).
  config.checkpoint_keep = 20
  config.decode.average_last = 20
  return config
