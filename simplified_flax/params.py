"""Parameter counts of a config without allocating the parameters (`jax.eval_shape`).

    python -m simplified_flax.params --config=sas_p --config.model.vocab_size=50000
    python -m simplified_flax.params --config=sas_p:cpu --breakdown

prints JSON: `total` (every array, fixed anchors included), `trainable` (the `params`
collection), `non_embedding` (trainable minus token and position embeddings) and, with
`--breakdown`, trainable counts per top-level module. An unset vocab_size is the configured
tokenizer's: 259 for bytes, `data.spm_vocab_size` for SentencePiece.
"""
import json

from absl import flags

from simplified_flax import cli
from simplified_flax.data import tokenizers
from simplified_flax.model.parameters import count_parameters, variable_shapes
from simplified_flax.runs import config_checks

__all__ = ["count_parameters", "variable_shapes"]


def main(argv) -> None:
  config = cli.start(argv).config
  config_checks.validate_run_config(config)
  if config.model.vocab_size is None:
    config.model.vocab_size = (tokenizers.ByteTokenizer.vocab_size
                               if config.data.tokenizer == "byte" else config.data.spm_vocab_size)
  print(json.dumps(count_parameters(config.model, flags.FLAGS.breakdown), indent=1))


if __name__ == "__main__":
  from simplified_flax import config_files  # pylint: disable=g-import-not-at-top
  config_files.define_config_flag("config", config_files.FLAG_HELP)
  flags.DEFINE_bool("breakdown", False, "Also print counts per top-level module.")
  flags.mark_flags_as_required(["config"])
  cli.run(main, "simplified_flax.params")
