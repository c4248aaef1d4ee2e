"""Parameter counts of a config without allocating the parameters (docs/building.md,
"Parameter counts").

    python -m simplified_flax.params --config=sas_p:cpu [--config.model.vocab_size=50000] \\
        [--breakdown]

prints JSON: `total` (every array, fixed anchors included), `trainable`, `non_embedding` and,
with `--breakdown`, trainable counts per top-level module. An unset vocab_size is the
tokenizer's: 259 for bytes, `data.spm_vocab_size` for SentencePiece, `data.bpe_vocab_size` for
"bpe", the file's for "hf:...".
"""
import json

from absl import flags

from simplified_flax import cli
from simplified_flax.data import tokenizers
from simplified_flax.model.parameters import count_parameters   # the library call
from simplified_flax.runs import config_checks


def main(argv) -> None:
  config = cli.start(argv).config
  config_checks.validate_run_config(config)
  if config.model.vocab_size is None:
    config.model.vocab_size = tokenizers.nominal_vocab_size(config.data)
  print(json.dumps(count_parameters(config.model, flags.FLAGS.breakdown), indent=1))


if __name__ == "__main__":
  from simplified_flax import config_files  # pylint: disable=g-import-not-at-top
  config_files.define_config_flag()
  flags.DEFINE_bool("breakdown", False, "Also print counts per top-level module.")
  flags.mark_flags_as_required(["config"])
  cli.run(main, "simplified_flax.params")
