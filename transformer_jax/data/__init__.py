"""Datasets for `transformer_jax` experiments."""
