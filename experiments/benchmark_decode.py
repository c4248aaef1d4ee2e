"""Generated tokens per second of KV-cache decoding, batch 1 and 16, both attention paths.

    python experiments/benchmark_decode.py                          # configs/sas_p.py:cpu
    python experiments/benchmark_decode.py --config=preln:cpu --new_tokens=64 --batches=1,4

Random weights at the config's shape (byte vocabulary, 259), float32, greedy, no early stop:
each row gets a prompt of `--prompt_len` tokens and generates `--new_tokens`. The time is one
whole `decode.generate` call (prefill + loop) after a compiling call, best of `--repeats`;
tokens/s counts generated tokens only, all rows together.
"""
import argparse
import os
import sys
import time

# Run as a script from anywhere: the repository root holds `configs` and `simplified_flax`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

import configs  # pylint: disable=g-import-not-at-top
from simplified_flax.model import decode  # pylint: disable=g-import-not-at-top
from simplified_flax.model import transformer  # pylint: disable=g-import-not-at-top

BYTE_VOCAB = 259


def tokens_per_second(model, variables, batch: int, prompt_len: int, new_tokens: int,
                      repeats: int) -> tuple[float, float]:
  """(generated tokens/s, seconds of the first, compiling call)."""
  prompts_BT = np.random.default_rng(0).integers(3, BYTE_VOCAB, (batch, prompt_len), np.int32)
  lengths_B = np.full((batch,), prompt_len, np.int32)
  run = lambda seed: decode.generate(model, variables, prompts_BT, lengths_B,
                                     jax.random.key(seed), max_new_tokens=new_tokens,
                                     sampling=decode.Sampling(temperature=0)).tokens
  start = time.perf_counter()
  jax.block_until_ready(run(0))
  compile_s = time.perf_counter() - start
  best = float("inf")
  for seed in range(1, repeats + 1):
    start = time.perf_counter()
    jax.block_until_ready(run(seed))
    best = min(best, time.perf_counter() - start)
  return batch * new_tokens / best, compile_s


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="sas_p:cpu")
  parser.add_argument("--batches", default="1,16")
  parser.add_argument("--impls", default="explicit,fused")
  parser.add_argument("--prompt_len", type=int, default=16)
  parser.add_argument("--new_tokens", type=int, default=112)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()

  config = configs.load(args.config)
  config.model.vocab_size = BYTE_VOCAB
  m = config.model
  print(f"{args.config}: L={m.n_layer} D={m.n_embd} H={m.n_head} V={BYTE_VOCAB}, prompt "
        f"{args.prompt_len} + {args.new_tokens} new tokens, float32, greedy, "
        f"{jax.devices()[0].device_kind} x{jax.device_count()}")
  print(f"{'impl':>9} {'batch':>5} {'tokens/s':>10} {'ms/step':>8} {'compile s':>9}")
  for impl in args.impls.split(","):
    config.model.attention_impl = impl
    model = transformer.build_model(config.model)
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))
    for batch in (int(b) for b in args.batches.split(",")):
      rate, compile_s = tokens_per_second(model, variables, batch, args.prompt_len,
                                          args.new_tokens, args.repeats)
      print(f"{impl:>9} {batch:>5} {rate:>10.0f} {1e3 * batch / rate:>8.2f} {compile_s:>9.1f}",
            flush=True)


if __name__ == "__main__":
  main()
