r"""Transformer (big) on WMT 2014 English -> French: the paper's recipe (Vaswani et al., 2017; Table 3, sec. 5-6).

As `wmt14_ende_big.py` except for the data (36M sentence pairs, a 32k shared vocabulary) and P_drop=0.1
(section 6.1: the EN-FR big model "used dropout rate P_drop = 0.1, instead of 0.3"). On 8 accelerators:

    python -m experiments.train --config=experiments/configs/wmt14_enfr_big.py --workdir=$WORKDIR \
        --config.data.tfds_data_dir=$TFDS_DIR

On fewer accelerators keep tokens_per_batch x grad_accum_steps = 26,624 slots per side (~25k real tokens),
e.g. on 1: --config.data.tokens_per_batch=3328 --config.grad_accum_steps=8. Then:

    python -m experiments.average_checkpoints --workdir=$WORKDIR --last=20
    python -m experiments.evaluate --workdir=$WORKDIR --checkpoint=$WORKDIR/averaged \
        --source=newstest2014.en --reference=newstest2014.fr --beam_size=4 --alpha=0.6 --extra_len=50 \
        --tokenized_bleu

Paper: 41.8 BLEU on newstest2014 (41.0 in the NeurIPS text), tokenized.
"""

import ml_collections

from experiments.configs import wmt14_ende_big


def get_config() -> ml_collections.ConfigDict:
  config = wmt14_ende_big.get_config()

  # Transformer (big) with P_drop=0.1 for EN-FR.
  config.model.update(vocab_size=32000, dropout_rate=0.1)

  # WMT 2014 EN-FR through tfds: train = Europarl v7 + CommonCrawl + UN + News Commentary v9 + Giga-FrEn
  # (~36M pairs, ~40M before filtering); validation = newstest2013, test = newstest2014. English -> French.
  config.data.dataset = "wmt14_translate/fr-en"
  config.data.target_lang = "fr"
  # The paper's 32k word-piece vocabulary (section 5.1); SentencePiece BPE is the closest subword model here.
  config.data.vocab_size = 32000
  return config
