"""Simplified Transformer blocks (SAS, SAS-P, ...) and the OP block in JAX/Flax linen.

The model never imports training, data or checkpointing code: a notebook can use
`simplified_flax.model.transformer` and `simplified_flax.model.attention` alone.
`simplified_flax.configs` holds the config files (the repository's `configs/` folder).
"""
__version__ = "0.1.0"

from simplified_flax import config_files

configs = config_files.configs_package()
