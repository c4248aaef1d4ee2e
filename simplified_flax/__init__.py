"""Simplified Transformer blocks (SAS, SAS-P, ...) and the OP block in JAX/Flax linen.

The model never imports training, data or checkpointing code: a notebook can use
`simplified_flax.models` and `simplified_flax.attention` alone.
"""
__version__ = "0.1.0"
