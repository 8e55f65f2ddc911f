"""Conversions to and from other ecosystems: Hugging Face Marian (`marian`), CTranslate2 (`ctranslate2`).

Optional: `pip install -e '.[interop]'` (transformers, torch CPU, ctranslate2, safetensors). Importing
`transformer_jax` never imports this package; `marian_vocab` (the tokenizer adapter) and the array conversions
in `marian` need only the core dependencies.
"""
