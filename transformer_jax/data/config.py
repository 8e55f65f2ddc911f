"""`DataConfig`: where the training pairs come from, the vocabulary, and the packed batches.

The `data` section of the experiment schema (`experiment_config.ExperimentConfig.data`, whose rules check it),
kept here so that the data package reads a typed config without importing the schema above it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Where the training pairs come from, the vocabulary, and the packed batches (`transformer_jax.data`)."""

  dataset: str = "number_words"        # number_words | parallel_text | a tfds WMT name, e.g. wmt14_translate/de-en
  builder_config: str = "default"      # tfds builder config (number_words only)
  dir: str = ""                        # parallel_text: the directory of {split}.{lang} files
  source_lang: str = "en"              # source language code (file suffix / tfds feature)
  target_lang: str = "de"              # target language code
  download: bool = False               # let tfds download and prepare a WMT dataset (network, hours)
  tfds_data_dir: str = ""              # prepared tfds data; "" = <workdir>/tfds
  tokenizer: str = "sentencepiece"     # sentencepiece (ours, one shared model) | marian (an imported model)
  vocab_path: str = ""                 # SentencePiece model; "" = <workdir>/vocab/spm.model, trained on first run
  vocab_size: int = 37000              # one shared BPE vocabulary for both languages (section 5.1)
  vocab_model_type: str = "bpe"        # SentencePiece model type: bpe | unigram
  vocab_max_sentences: int = 2_000_000  # uniform sample of training lines (both sides) the vocabulary sees
  vocab_character_coverage: float = 1.0  # SentencePiece character_coverage
  train_split: str = "train"           # split trained on
  eval_splits: tuple[str, ...] = ("validation",)  # splits the evaluators score during training
  lowercase: bool = False              # a case-folded vocabulary: text lowercased before SentencePiece, in
                                       # training and at every encode; outputs are lowercase and scored
                                       # against lowercased references (the Multi30k *.lc.norm.tok protocol)
  subword_alpha: float = 0.0           # > 0: a sampled segmentation of the training pairs every epoch; for
                                       # bpe the probability of skipping a merge (BPE-dropout, Provilkov et
                                       # al., 2020: 0.1), for unigram the smoothing (Kudo, 2018); 0 = off
  subword_from_epoch: int = 0          # the first epoch that samples (earlier ones: deterministic ids)
  max_len: int = 256                   # longest training pair kept (tokens per side), and the packed row length
  tokens_per_batch: int = 26_624       # packed slots per side per micro-batch, all devices (~25k tokens, sec. 5.1)
