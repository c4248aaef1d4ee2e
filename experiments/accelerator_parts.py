"""The measurements of `accelerator_check.py`, each a function of a small settings dict
(b's round-robin timing is `benchmark.measure`, e's profile `step_breakdown.breakdown`, both
shared with the benchmark command).

Each returns plain JSON-able results; nothing here writes files or parses flags. Shapes are
the caller's: the full check uses the paper's (18 layers, D=768, H=12, T=128, V=50,257),
`--tiny` shrinks every one so that the whole check runs on a CPU in about a minute.
"""
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import configs
from experiments import benchmark
from experiments import step_breakdown
from simplified_flax import fast
from simplified_flax.fast import attention as fast_attention
from simplified_flax.fast import target_platform
from simplified_flax.model import transformer
from simplified_flax.training.step import create_train_state, eval_step, train_step

OOM_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory")


def is_oom(err: BaseException) -> bool:
  return any(marker in str(err) for marker in OOM_MARKERS)


def relative_error(got, want) -> float:
  """||got - want|| / ||want||, in float64 on the host."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def uses_cudnn(fn: Callable, *args) -> bool:
  """Whether XLA compiled `fn(*args)` to a cuDNN fused-attention call (custom call target
  `__cudnn$fmha...`)."""
  return "__cudnn$fmha" in jax.jit(fn).lower(*args).compile().as_text()


# ---------------------------------------------------------------------------- a. equalities

def _auto_plan(platform: str) -> fast.Plan:
  """The speed package's plan (`fast.choose`, model.grad_rules="auto") for a verified config on
  `platform`, fused form: what a training step on it runs."""
  config = configs.load("sas_p", {"model.vocab_size": 256, "model.attention_impl": "fused"})
  return fast.choose(config.model, dtype=jnp.float32, platform=platform)


def attention_equalities(shape: Mapping[str, int]) -> List[Dict[str, Any]]:
  """Explicit == fused shaped attention (causal, padded bidirectional, packed), per dtype, in
  the speed package's form on this platform (`fast.attention.shaped_attention` under the
  "auto" plan: the platform's attention and combine kernels where they apply).

  float32 runs at "highest" matmul precision (no TF32), so the only difference left is the
  order of summation; bfloat16 runs as a model would. On a GPU the plain term's kernel is also
  compared with cuDNN's (`implementation="cudnn"`) where cuDNN takes the shape.
  """
  B, T, H, d = shape["batch"], shape["seq_len"], shape["heads"], shape["head_dim"]
  keys = jax.random.split(jax.random.PRNGKey(0), 6)
  gains = dict(resid_gain=jax.random.uniform(keys[3], (H,), minval=0.5, maxval=1.5),
               skip_gain=jax.random.uniform(keys[4], (H,), minval=0.5, maxval=1.5),
               centre_gain=jax.random.uniform(keys[5], (H,), minval=0.5, maxval=1.5))
  lengths_B = jnp.array([T, T // 2] * (B // 2) + [T] * (B % 2))
  key_mask_BT = jnp.arange(T)[None, :] < lengths_B[:, None]
  segment_ids_BT = 1 + (jnp.arange(T)[None, :] >= T // 3).astype(jnp.int32) * jnp.ones(
      (B, 1), jnp.int32)
  cases = {"causal": dict(causal=True),
           "bidirectional_padded": dict(causal=False, key_mask=key_mask_BT),
           "causal_packed": dict(causal=True, segment_ids=segment_ids_BT)}
  plan = _auto_plan(target_platform.current())
  rows = []
  for dtype, precision, tolerance in (("float32", "highest", 1e-4), ("bfloat16", "default", 3e-2)):
    q, k, v = (jax.random.normal(key, (B, T, H, d), dtype) for key in keys[:3])
    with jax.default_matmul_precision(precision):
      for case, kwargs in cases.items():
        run = lambda impl, kw=kwargs: jax.jit(lambda q, k, v: fast_attention.shaped_attention(
            plan, q, k, v, impl=impl, **gains, **kw))(q, k, v)
        error = relative_error(run("fused"), run("explicit"))
        rows.append({"check": f"shaped attention {case}", "dtype": dtype, "rel_error": error,
                     "tolerance": tolerance, "ok": error < tolerance})
    if jax.default_backend() == "gpu" and dtype == "bfloat16":
      rows.append(_cudnn_row(q, k, v, tolerance))
  return rows


def _cudnn_row(q, k, v, tolerance) -> Dict[str, Any]:
  plain = lambda impl: (lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation=impl))
  try:
    error = relative_error(jax.jit(plain("cudnn"))(q, k, v), jax.jit(plain("xla"))(q, k, v))
  except Exception as err:  # pylint: disable=broad-except  (cuDNN refuses some shapes)
    return {"check": "cuDNN vs XLA attention (causal)", "dtype": "bfloat16", "ok": None,
            "note": f"cuDNN not available: {str(err).splitlines()[0][:200]}"}
  return {"check": "cuDNN vs XLA attention (causal)", "dtype": "bfloat16", "rel_error": error,
          "tolerance": tolerance, "ok": error < tolerance}


def model_equalities(spec: str, overrides: Mapping[str, Any]) -> List[Dict[str, Any]]:
  """Logits of one model on the explicit and the fused path (same parameters), per dtype, and
  whether the fused path compiled to cuDNN. Both are the model a step on this platform builds
  (`fast.build_model`: the speed package's where its plan applies)."""
  rows = []
  for dtype, precision, tolerance in (("float32", "highest", 1e-4), ("bfloat16", "default", 3e-2)):
    config = configs.load(spec, dict(overrides, dtype=dtype))
    tokens_BT = jax.random.randint(jax.random.PRNGKey(1), (2, config.model.context_length), 0,
                                   config.model.vocab_size)
    explicit_config = config.model.copy_and_resolve_references()
    explicit_config.attention_impl = "explicit"
    explicit = fast.build_model(explicit_config, dtype=dtype)
    variables = explicit.init(jax.random.PRNGKey(0), tokens_BT)
    fused_config = config.model.copy_and_resolve_references()
    fused_config.attention_impl = "fused"
    fused = fast.build_model(fused_config, dtype=dtype)
    with jax.default_matmul_precision(precision):
      want = jax.jit(explicit.apply)(variables, tokens_BT)
      got = jax.jit(fused.apply)(variables, tokens_BT)
      cudnn = uses_cudnn(fused.apply, variables, tokens_BT)
    error = relative_error(got, want)
    rows.append({"check": f"{spec} logits, fused vs explicit", "dtype": dtype,
                 "rel_error": error, "tolerance": tolerance, "ok": error < tolerance,
                 "fused_path_uses_cudnn": cudnn})
    rows.extend(_fast_against_reference(spec, config, variables, tokens_BT, precision,
                                        tolerance))
  return rows


def _fast_against_reference(spec, config, variables, tokens_BT, precision, tolerance):
  """The model a step on this device runs (`fast.build_model`, model.attention_impl as
  configured) against the reference model (simplified_flax/model, explicit form): logits and
  the gradients of their mean square, the seam of tests/test_fast_matrix.py on real kernels."""
  reference_config = config.model.copy_and_resolve_references()
  reference_config.attention_impl = "explicit"
  reference = transformer.build_model(reference_config, dtype=config.dtype)
  model = fast.build_model(config.model, dtype=config.dtype)
  def value_and_grad(m):
    loss = lambda p: jnp.mean(jnp.square(m.apply({**variables, "params": p}, tokens_BT)))
    return jax.jit(jax.value_and_grad(loss))(variables["params"])
  with jax.default_matmul_precision(precision):
    (_, got), (_, want) = value_and_grad(model), value_and_grad(reference)
    logits_error = relative_error(jax.jit(model.apply)(variables, tokens_BT),
                                  jax.jit(reference.apply)(variables, tokens_BT))
  flat = lambda tree: jnp.concatenate([jnp.ravel(g).astype(jnp.float32)
                                       for g in jax.tree.leaves(tree)])
  grad_error = relative_error(flat(got), flat(want))
  plan = getattr(model, "plan", None)
  path = "reference (no plan)" if plan is None else f"plan {sorted(plan.rules)}"
  return [{"check": f"{spec} {what}, fast vs reference ({path})", "dtype": config.dtype,
           "rel_error": error, "tolerance": tolerance, "ok": error < tolerance}
          for what, error in (("logits", logits_error), ("gradients", grad_error))]


# ----------------------------------------------------------------------------- b. benchmark

def make_runners(waves: Sequence[Mapping[str, Any]],
                 batch_sizes: Sequence[int]) -> Dict[str, Any]:
  """benchmark.Runner per (name, config) of every wave, at the first batch size of
  `batch_sizes` that fits every config. A wave compiles in parallel threads (XLA compiles
  outside the GIL), one wave after another: where a later wave's step is a program an
  earlier wave compiled, a persistent compilation cache hands it over."""
  for batch_size in batch_sizes:
    runners = {}
    try:
      for wave in waves:
        for config in wave.values():
          config.batch_size = batch_size
        with concurrent.futures.ThreadPoolExecutor(max(1, len(wave))) as pool:
          futures = {name: pool.submit(benchmark.Runner, name, config)
                     for name, config in wave.items()}
          runners.update({name: f.result() for name, f in futures.items()})
      return runners
    except Exception as err:  # pylint: disable=broad-except
      if not is_oom(err):
        raise
      print(f"batch {batch_size} does not fit ({str(err).splitlines()[0][:120]}); halving",
            flush=True)
  raise RuntimeError(f"No batch size of {list(batch_sizes)} fits.")


# ------------------------------------------------------------------------- c. long context

def long_context(spec: str, overrides: Mapping[str, Any], lengths: Sequence[int],
                 steps: int) -> List[Dict[str, Any]]:
  """Step memory (XLA's buffers) and median step time of explicit vs fused at each T; an
  out-of-memory compile or run is reported as such."""
  rows = []
  for T in lengths:
    for impl in ("explicit", "fused"):
      config = configs.load(spec, dict(overrides, **{
          "model.context_length": T, "model.max_position_embeddings": T,
          "model.attention_impl": impl}))
      row = {"seq_len": T, "attention_impl": impl, "batch_size": config.batch_size}
      try:
        runner = benchmark.Runner(f"{impl}@{T}", config)
        times = [runner.run(1) for _ in range(steps)]
        row.update(memory_bytes=runner.memory, step_time_s=statistics.median(times),
                   tokens_per_sec=config.batch_size * T / statistics.median(times), oom=False)
        del runner
      except Exception as err:  # pylint: disable=broad-except
        if not is_oom(err):
          raise
        row.update(oom=True, error=str(err).splitlines()[0][:200])
      rows.append(row)
      print(f"long context T={T} {impl}: " + (
          "out of memory" if row["oom"] else
          f"{row['memory_bytes'] / 2**30:.2f} GiB, {1e3 * row['step_time_s']:.1f} ms/step"),
            flush=True)
  return rows


# --------------------------------------------------------------------- d. training comparison

def window_batches(tokens_N: np.ndarray, batch_size: int, seq_len: int, seed: int):
  """Infinite batches of random windows [B, T] of a flat token array; the same sequence for
  the same seed, so every variant trains on the same data in the same order."""
  rng = np.random.default_rng(seed)
  while True:
    starts_B = rng.integers(0, len(tokens_N) - seq_len, size=batch_size)
    yield {"inputs": np.stack([tokens_N[s:s + seq_len] for s in starts_B]).astype(np.int32)}


def train_comparison(named: Mapping[str, Any], train_N: np.ndarray, eval_N: np.ndarray, *,
                     log_every: int, eval_every: int, eval_batches: int) -> Dict[str, Any]:
  """Trains each config for its num_train_steps on the same windows; loss vs step and time.

  Steps are compiled before the clock starts, and the clock covers only training (evaluation
  time is excluded), so `time_s` compares the variants' training speed as well as loss.
  """
  def compile_one(config):
    state = create_train_state(config, jax.random.PRNGKey(config.seed))
    batch = next(window_batches(train_N, config.batch_size, config.model.context_length, 0))
    # The state is kept: an AOT-compiled step accepts only states with the same static fields.
    return (state, jax.jit(train_step, donate_argnums=0).lower(state, batch).compile(),
            jax.jit(eval_step).lower(state, batch).compile())

  with concurrent.futures.ThreadPoolExecutor(len(named)) as pool:   # compiles in parallel
    compiled = dict(zip(named, pool.map(compile_one, named.values())))
  results = {}
  for name, config in named.items():
    T, B = config.model.context_length, config.batch_size
    evals = list(zip(range(eval_batches), window_batches(eval_N, B, T, seed=1)))
    state, step_fn, eval_fn = compiled.pop(name)
    batches = window_batches(train_N, B, T, seed=0)
    history, elapsed = [], 0.0
    start = time.perf_counter()
    for step in range(1, config.num_train_steps + 1):
      state, metrics = step_fn(state, next(batches))
      last = step == config.num_train_steps
      if step % log_every == 0 or last:
        loss = float(metrics["loss"])   # one host sync per log_every steps
        now = time.perf_counter()
        elapsed, start = elapsed + now - start, now
        history.append({"step": step, "loss": loss, "time_s": elapsed})
      if step % eval_every == 0 or last:
        sums = [eval_fn(state, batch) for _, batch in evals]
        loss = float(sum(x["loss_sum"] for x in sums) / sum(x["weight_sum"] for x in sums))
        history.append({"step": step, "eval_loss": loss, "time_s": elapsed})
        print(f"{name} step {step}: eval loss {loss:.4f} ({elapsed:.0f}s)", flush=True)
        start = time.perf_counter()   # evaluation is not training time
    train_rows = [r for r in history if "loss" in r]
    results[name] = {"history": history, "train_s": elapsed,
                     "tokens_per_sec": config.num_train_steps * B * T / elapsed,
                     "final_eval_loss": history[-1]["eval_loss"],
                     "final_train_loss": float(np.mean([r["loss"] for r in train_rows[-5:]]))}
    del state, step_fn
  return results


# ----------------------------------------------------------------------- e. step breakdown

def breakdowns(runners: Mapping[str, Any], names: Sequence[str], steps: int) -> Dict[str, Any]:
  """step_breakdown.breakdown of each named runner's compiled step (already warm), with
  its median step time (b's rounds, else `steps` steps timed here)."""
  results = {}
  for name in names:
    runner = runners[name]
    step_s = statistics.median(runner.times) if runner.times else runner.run(steps)
    results[name] = dict(step_breakdown.breakdown(runner.step, runner.run, steps),
                         step_time_s=step_s, batch_size=runner.config.batch_size)
    print(step_breakdown.table(name, results[name], step_s), flush=True)
  return results


# --------------------------------------------------------------------------- f. XLA flags

def xla_flag_runs(spec: str, overrides: Mapping[str, Any], flag_sets: Sequence[str], *,
                  rounds: int, steps: int, matmul_size: int, timeout_s: int) -> List[Dict]:
  """One `python experiments/benchmark.py` process per entry of `flag_sets` (XLA reads its
  flags once, when the backend starts), the first being the reference (usually ""): tokens/s,
  the matmul peak and the compile time of each, and their ratios to the first (the matmul
  peak's ratio shows how much the machine itself drifted between the processes), and the
  share of each part of the step in its --breakdown (CUDA graphs may hide kernels from the
  trace: a run with them off shows every kernel)."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=repo, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  rows = []
  for flag_set in flag_sets:
    command = [sys.executable, os.path.join(repo, "experiments", "benchmark.py"),
               f"--configs={spec}", f"--rounds={rounds}", f"--steps={steps}",
               f"--matmul_size={matmul_size}", f"--xla_flags={flag_set}", "--breakdown"] + [
                   f"--config.{k}={v}" for k, v in overrides.items()]
    row = {"xla_flags": flag_set}
    try:
      done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True,
                            timeout=timeout_s, check=False)
      if done.returncode != 0:
        row["error"] = (done.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
      else:
        result = json.loads(done.stdout.strip().splitlines()[-1])[spec]
        row.update({k: result[k] for k in ("tokens_per_sec", "step_time_s", "compile_s",
                                           "matmul_peak_flops_per_s", "batch_size")})
        row["shares"] = {part: p["share"] for part, p in result["breakdown"]["parts"].items()}
    except subprocess.TimeoutExpired:
      row["error"] = f"took longer than {timeout_s} s"
    reference = rows[0] if rows else row
    if "error" not in row and "error" not in reference:
      row["tokens_ratio"] = row["tokens_per_sec"] / reference["tokens_per_sec"]
      row["peak_ratio"] = row["matmul_peak_flops_per_s"] / reference["matmul_peak_flops_per_s"]
    rows.append(row)
    print(f"XLA flags {flag_set or '(none)'}: " + (row.get("error") or
          f"{row['tokens_per_sec']:,.0f} tokens/s (x{row.get('tokens_ratio', 1):.3f})"), flush=True)
  return rows
