"""Sample from a trained decoder: the command line and the library call behind it (docs/sampling.md,
"Sampling").

    python -m simplified_flax.sample --workdir=DIR --prompt='def fib(n):' \\
        [--prompt=...] [--max_new_tokens=N --temperature=0.8 --top_k=0 --top_p=0.95 --seed=0]

continues every prompt in one batch from the latest good checkpoint of DIR, read-only (safe
while the run still writes there); temperature 0 is greedy decoding.
"""
import sys
from typing import Sequence

from absl import app
from absl import flags
from absl import logging
import jax

from simplified_flax import cli
from simplified_flax import retries
from simplified_flax.model import decode
from simplified_flax.model.transformer import build_model
from simplified_flax.runs import compilation_cache
from simplified_flax.runs import config_checks
from simplified_flax.training.evaluation import load_config, load_tokenizer, restore_read_only


def sample_text(model, variables, tokenizer, prompts: Sequence[str], *, max_new_tokens: int,
                sampling: decode.Sampling, seed: int = 0, pad_multiple: int = 16) -> list[str]:
  """The continuation of each prompt (decoded text, without the prompt and the eod token)."""
  encoded = [tokenizer.encode(p) for p in prompts]
  prompts_BT, lengths_B = decode.pad_prompts(encoded, tokenizer.pad_id, pad_multiple)
  out = decode.generate(model, variables, prompts_BT, lengths_B, jax.random.key(seed),
                        max_new_tokens=max_new_tokens, sampling=sampling,
                        eod_id=tokenizer.eod_id, pad_id=tokenizer.pad_id)
  tokens_BN, counts_B = jax.device_get((out.tokens, out.num_tokens))
  return [tokenizer.decode(t for t in row[:n] if t != tokenizer.eod_id)
          for row, n in zip(tokens_BN, counts_B)]


def main(argv) -> None:
  f = cli.start(argv)
  compilation_cache.enable(*compilation_cache.choose(f.compilation_cache_dir))   # not the run's
  config = load_config(f.workdir)
  if config.model.kind != "decoder":
    raise app.UsageError(f"{f.workdir} holds a {config.model.kind}; sampling needs a decoder.")
  config.model.attention_impl = f.attention_impl or config.model.attention_impl
  config_checks.validate_run_config(config)
  retries.configure_from(config, f.workdir)
  restored = restore_read_only(f.workdir, config, step=f.step)
  variables = {"params": restored.state.params, **restored.state.constants}
  model = build_model(config.model, dtype=f.dtype)
  tokenizer = load_tokenizer(config, f.workdir)
  longest_prompt = max(len(tokenizer.encode(p)) for p in f.prompt)
  context = config.model.context_length
  max_new_tokens = f.max_new_tokens or max(1, context - longest_prompt)
  if longest_prompt + max_new_tokens > context:
    logging.warning("Prompt + max_new_tokens = %d tokens exceeds the training context of %d: "
                    "positions past it were never trained.", longest_prompt + max_new_tokens,
                    context)
  sampling = decode.Sampling(f.temperature, f.top_k, f.top_p)
  texts = sample_text(model, variables, tokenizer, f.prompt, max_new_tokens=max_new_tokens,
                      sampling=sampling, seed=f.seed)
  print(f"# step {restored.step} of {f.workdir}; {sampling}, seed {f.seed}", file=sys.stderr)
  for prompt, text in zip(f.prompt, texts):
    print(prompt + text, flush=True)
    if len(f.prompt) > 1:
      print("-" * 72)


if __name__ == "__main__":
  flags.DEFINE_string("workdir", None, "The --workdir of a training run.", required=True)
  flags.DEFINE_multi_string("prompt", None, "Text to continue (repeat for a batch).",
                            required=True)
  flags.DEFINE_integer("max_new_tokens", None, "Tokens to generate per prompt at most "
                       "(default: up to the training context, model.context_length).")
  flags.DEFINE_float("temperature", 0.8, "Softmax temperature; 0 is greedy.")
  flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens; 0: all.")
  flags.DEFINE_float("top_p", 0.95, "Nucleus sampling mass; 1: off.")
  flags.DEFINE_integer("seed", 0, "Sampling seed: the same seed gives the same text.")
  flags.DEFINE_integer("step", None, "Restore this checkpoint step (default: the latest).")
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype.")
  flags.DEFINE_enum("attention_impl", None, ["auto", "explicit", "fused"],
                    "Attention path (default: the run's).")
  compilation_cache.define_flag()
  cli.run(main, "simplified_flax.sample")
