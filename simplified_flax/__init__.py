"""Simplified Transformer blocks (SAS, SAS-P, ...) and the OP block in JAX/Flax linen.

The model never imports training, data or checkpointing code: a notebook can use
`simplified_flax.model.transformer` and `simplified_flax.model.attention` alone.
"""
__version__ = "0.1.0"
