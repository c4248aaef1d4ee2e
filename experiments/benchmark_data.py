"""Does the data pipeline keep up with training? Tokens per second delivered vs consumed.

    python experiments/benchmark_data.py                       # configs/preln.py:cpu
    python experiments/benchmark_data.py --config=preln:cpu,encoder --batches=3000

Prints the pipeline's tokens/s (batches drawn from `train_iterator()`, prefetch thread
included, after the corpus is prepared and tokenized) and the tokens/s of one jitted
forward + backward + AdamW step of the config's model on this machine, and their ratio. The
target is a ratio of at least 10: the pipeline must never be what a run waits on.
"""
import argparse
import os
import sys
import tempfile
import time

# Run as a script from anywhere: the repository root holds `configs` and `simplified_flax`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import configs  # pylint: disable=g-import-not-at-top
from simplified_flax.data import build_pipeline  # pylint: disable=g-import-not-at-top


def pipeline_tokens_per_second(pipeline, num_batches: int) -> tuple[float, float]:
  """(tokens/s, seconds to the first batch) of the training iterator."""
  iterator = pipeline.train_iterator()
  start = time.perf_counter()
  batch = next(iterator)
  first = time.perf_counter() - start
  tokens = 0
  start = time.perf_counter()
  for _ in range(num_batches):
    batch = next(iterator)
    tokens += batch["inputs"].size
  return tokens / (time.perf_counter() - start), first


def training_tokens_per_second(config, batch: dict, steps: int) -> float:
  """Tokens/s of a jitted forward + backward + AdamW update of `config.model` on `batch`."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from simplified_flax.model.transformer import build_model  # pylint: disable=g-import-not-at-top

  model = build_model(config.model, dtype="float32")
  tokens_BxT = jnp.asarray(batch["inputs"])
  variables = model.init(jax.random.PRNGKey(0), tokens_BxT)
  optimizer = optax.adamw(config.optimizer.learning_rate,
                          weight_decay=config.optimizer.weight_decay)
  opt_state = optimizer.init(variables["params"])
  extra = {k: v for k, v in variables.items() if k != "params"}
  # Next-token loss for the decoder, scored-position loss for the encoder: same cost either way.
  targets_BxT = jnp.asarray(batch.get("targets", batch["inputs"]))

  def loss_fn(params):
    logits_BxTxV = model.apply({"params": params, **extra}, tokens_BxT)
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, targets_BxT).mean()

  @jax.jit
  def step(params, opt_state):
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  params = variables["params"]
  params, opt_state, loss = step(params, opt_state)  # compile
  loss.block_until_ready()
  start = time.perf_counter()
  for _ in range(steps):
    params, opt_state, loss = step(params, opt_state)
  loss.block_until_ready()
  return steps * tokens_BxT.size / (time.perf_counter() - start)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="preln:cpu", help="configs/<module>.py:<arg>")
  parser.add_argument("--batches", type=int, default=2000, help="pipeline batches to time")
  parser.add_argument("--steps", type=int, default=10, help="training steps to time")
  parser.add_argument("--workdir", default=None, help="default: a temporary directory")
  args = parser.parse_args()

  config = configs.load(args.config)
  workdir = args.workdir or tempfile.mkdtemp(prefix="benchmark_data_")
  start = time.perf_counter()
  pipeline = build_pipeline(config, workdir=workdir, process_index=0, process_count=1)
  build_s = time.perf_counter() - start
  data_tps, first_s = pipeline_tokens_per_second(pipeline, args.batches)
  B, T = config.batch_size, config.model.context_length
  print(f"config {args.config}: batch {B} x T {T}, {config.model.kind}, "
        f"tokenizer {config.data.tokenizer} (vocab {pipeline.tokenizer.vocab_size}), "
        f"packing {config.data.packing}")
  print(f"pipeline build (prepare/tokenize or reuse): {build_s:.2f} s; first batch {first_s:.3f} s")
  print(f"pipeline: {data_tps:,.0f} tokens/s")
  try:
    train_tps = training_tokens_per_second(config, next(pipeline.train_iterator()), args.steps)
  except ImportError as e:
    print(f"training step: not measured ({e}). TODO: needs simplified_flax.model.transformer.build_model.")
    return
  print(f"training step (fwd+bwd+AdamW, jit, float32): {train_tps:,.0f} tokens/s")
  ratio = data_tps / train_tps
  print(f"pipeline / training = {ratio:,.0f}x  (target >= 10x: {'met' if ratio >= 10 else 'MISSED'})")


if __name__ == "__main__":
  main()
