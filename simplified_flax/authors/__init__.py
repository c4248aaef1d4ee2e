"""The authors' PyTorch checkpoints (github bobby-he/simplified_transformers) in both directions:
their HF GPT-2-style `config.json` (config_map.py), their parameter names and layout
(params_map.py), and folders of either kind (dirs.py; `python -m simplified_flax.convert`).
"""


class ConversionError(ValueError):
  """A checkpoint or config that the other side cannot express, or a folder that cannot be
  read or must not be written; the message is one line naming the file or field."""
