"""Parameter counts of a config without allocating the parameters (`jax.eval_shape`).

    python -m simplified_flax.params --config=sas_p --config.model.vocab_size=50000
    python -m simplified_flax.params --config=sas_p:cpu --breakdown

prints JSON: `total` (every array, fixed anchors included), `trainable` (the `params`
collection), `non_embedding` (trainable minus token and position embeddings) and, with
`--breakdown`, trainable counts per top-level module.
"""
import json

from absl import flags
from simplified_flax import cli
from simplified_flax import config_files

from simplified_flax.model.parameters import count_parameters, variable_shapes

__all__ = ["count_parameters", "variable_shapes", "resolve_vocab_size"]


def resolve_vocab_size(config) -> None:
  """Fills an unset `model.vocab_size` with the configured tokenizer's size, without data:
  259 for bytes, `data.spm_vocab_size` for SentencePiece (which training enforces)."""
  if config.model.vocab_size is None:
    from simplified_flax.data import tokenizers   # only needed when the vocabulary is not given
    config.model.vocab_size = (tokenizers.ByteTokenizer.vocab_size
                               if config.data.tokenizer == "byte" else config.data.spm_vocab_size)


_CONFIG = config_files.define_config_flag("config", config_files.FLAG_HELP)
_BREAKDOWN = flags.DEFINE_bool("breakdown", False, "Also print counts per top-level module.")


def main(argv):
  del argv
  config = _CONFIG.value
  resolve_vocab_size(config)
  print(json.dumps(count_parameters(config.model, _BREAKDOWN.value), indent=1))


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  cli.run(main, "simplified_flax.params")
