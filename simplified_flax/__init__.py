"""Simplified Transformer blocks (SAS, SAS-P, ...) and the OP block in JAX/Flax linen.

`simplified_flax.model` imports no training, data or checkpointing code (a notebook can use it
alone); `simplified_flax.configs` holds the config files (the repository's `configs/`).
"""
__version__ = "0.1.0"

from simplified_flax import config_files

configs = config_files.configs_package()
