r"""Transformer (base) on WMT 2014 English -> German: the paper's recipe (Vaswani et al., 2017; Table 3, sec. 5-6).

Prepare the data once on a machine with network (see docs/reproducing.md), then, on 8 accelerators:

    python -m experiments.train --config=experiments/configs/wmt14_ende_base.py --workdir=$WORKDIR \
        --config.data.tfds_data_dir=$TFDS_DIR

On fewer accelerators keep tokens_per_batch x grad_accum_steps = 26,624 slots per side (~25k real tokens):

    1 accelerator:  --config.data.tokens_per_batch=3328 --config.grad_accum_steps=8
    2 accelerators: --config.data.tokens_per_batch=13312 --config.grad_accum_steps=2
    4 accelerators: --config.data.tokens_per_batch=6656 --config.grad_accum_steps=4

Then average the last `decode.average_last` checkpoints and score newstest2014 with beam 4, alpha 0.6:

    python -m experiments.average_checkpoints --workdir=$WORKDIR --last=5
    python -m experiments.evaluate --workdir=$WORKDIR --checkpoint=$WORKDIR/averaged \
        --source=newstest2014.en --reference=newstest2014.de --beam_size=4 --alpha=0.6 --extra_len=50 \
        --tokenized_bleu

Paper: 27.3 BLEU on newstest2014 (tokenized, compound-split), 25.8 BLEU / 4.92 perplexity on newstest2013.
"""

import ml_collections

from experiments.configs import default

# The paper's batch: ~25,000 source + ~25,000 target tokens per step (section 5.1). `tokens_per_batch` counts
# packed slots per side (padding included): 104 rows x 256 slots = 26,624 slots, 13 rows per device on 8
# devices. First-fit packing of WMT-like lengths fills ~90% of the source and ~98% of the target slots
# (English is the shorter side), i.e. ~24k source + ~26k target real tokens; the run logs the real padding
# efficiency at start-up.
TOKENS_PER_STEP = 26_624
ROW_LENGTH = 256


def get_config() -> ml_collections.ConfigDict:
  config = default.get_config()
  # Model: Transformer (base), Table 3: N=6, d_model=512, d_ff=2048, h=8, d_k=d_v=64, P_drop=0.1, post-LN,
  # sinusoidal positions, shared source/target/softmax embedding scaled by sqrt(d_model), no attention or ReLU
  # dropout: `ModelConfig`'s defaults. vocab_size is replaced by the size of the trained vocabulary. max_len
  # only sizes the sinusoid table and caps decoding (source length + 50); it is larger than data.max_len so
  # that long test sentences (eval and test splits are not length-filtered) still fit.
  # dtype 'auto': bfloat16 compute on TPU and GPU, float32 on CPU (accelerators.BACKEND_CHOICES; parameters and
  # Adam stay float32; docs/performance.md, "Compiled for the accelerators we target").
  config.model.update(vocab_size=37000, max_len=512, dtype="auto")

  config.data.dataset = "wmt14_translate/de-en"   # tfds: train = Europarl v7 + CommonCrawl + News Commentary v9
  config.data.builder_config = ""                 # (number_words only; the WMT config is in the dataset name)
  config.data.vocab_size = 37000                  # one shared BPE vocabulary of ~37k tokens (section 5.1)
  config.data.eval_splits = ("validation",)       # newstest2013 (the paper's dev set); final_eval: newstest2014
  config.data.max_len = ROW_LENGTH                # longest training pair kept (tokens), and the packed row length
  config.data.tokens_per_batch = TOKENS_PER_STEP  # slots per side per micro-batch, across all devices

  # Optimisation (sections 5.3-5.4), default.py's values: Adam(0.9, 0.98, 1e-9), warmup 4000 (peak lr 7.0e-4),
  # label smoothing 0.1, 100k steps. Micro-batches per step: tokens_per_batch x grad_accum_steps is the batch
  # of one optimizer step; 1 is for 8 accelerators (on fewer see the module docstring).
  config.num_train_steps = 100_000

  config.evals.loss.every_steps = 5000            # loss / perplexity on newstest2013
  # Periodic greedy sacreBLEU on the first examples of newstest2013 (a progress signal, not the paper's score).
  config.evals.bleu.every_steps = 10_000
  # Section 6.1: a checkpoint every 10 minutes, the last 5 averaged, beam 4, alpha 0.6, input length + 50:
  # default.py's values.
  return config
