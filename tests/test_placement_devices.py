"""Data parallelism on 8 simulated CPU devices: jit (data axis), jit with each device updating
its slice of the weights, pmap and jit with FSDP all give the losses of one device on the same
global batches, and resume from their checkpoints (the sliced one in replicated shardings)."""
import json
import subprocess
import sys

import numpy as np
import pytest

from test_loop import REPO, TINY, subprocess_env, write_corpus

pytestmark = pytest.mark.slow

STEPS = 5
# Runs in a child process started with 8 host devices (XLA_FLAGS must precede `import jax`).
SCRIPT = r"""
import json, shutil, sys
import jax
from test_loop import make_config
from simplified_flax.training import placement
from simplified_flax.data import build_pipeline
from simplified_flax.train import create_train_state, train_and_evaluate, train_step

overrides, root = json.loads(sys.argv[1]), sys.argv[2]
config = make_config(overrides)
pipeline = build_pipeline(config, workdir=root)
iterator = pipeline.train_iterator()
batches = [next(iterator) for _ in range(config.num_train_steps)]

# Reference: the plain jitted step on one device.
state = create_train_state(config, jax.random.PRNGKey(config.seed))
step = jax.jit(train_step)
out = {"devices": jax.device_count(), "reference": []}
for batch in batches:
  state, metrics = step(state, batch)
  out["reference"].append(float(metrics["loss"]))

def losses(workdir):
  rows = [json.loads(line) for line in open(f"{workdir}/metrics.jsonl")]
  return ([r["loss"] for r in rows if "loss" in r],
          [r["eval_loss"] for r in rows if "eval_loss" in r])

SLICED = {"parallel.shard_update": True}
for name, run_overrides in (("jit", {}), ("pmap", {"parallel.mode": "pmap"}),
                            ("fsdp", {"parallel.fsdp": 2}), ("sliced", SLICED)):
  run = make_config({**overrides, **run_overrides})
  train_and_evaluate(run, f"{root}/{name}", pipeline=pipeline, tensorboard=False)
  out[name], out[name + "_eval"] = losses(f"{root}/{name}")
  if name != "jit":   # restore: drop the last checkpoint, resume from step 3
    shutil.rmtree(f"{root}/{name}/checkpoints/{config.num_train_steps}")
    if name == "sliced":   # the sliced optimiser state into a replicated one
      run = make_config(overrides)
    train_and_evaluate(run, f"{root}/{name}", pipeline=pipeline, tensorboard=False)
    out[name + "_resumed"] = losses(f"{root}/{name}")[0]

sharded = create_train_state(config, jax.random.PRNGKey(0), mesh=placement.make_mesh(fsdp=2))
out["fsdp_kernel_spec"] = str(sharded.params["h_0"]["mlp"]["c_fc"]["kernel"].sharding.spec)
out["fsdp_bias_spec"] = str(sharded.params["h_0"]["attn"]["c_attn"]["bias"].sharding.spec)
sliced_config = make_config({**overrides, **SLICED})
sliced_config.model.vocab_size = config.model.vocab_size   # set by build_pipeline
sliced = create_train_state(sliced_config, jax.random.PRNGKey(0), mesh=placement.make_mesh(fsdp=2))
mu = next(x for path, x in jax.tree_util.tree_leaves_with_path(sliced.opt_state)
          if "mu" in (key := jax.tree_util.keystr(path)) and "h_0" in key and "c_fc" in key
          and "kernel" in key)
out["update_spec"], out["update_shard"] = str(mu.sharding.spec), list(mu.addressable_shards[0].data.shape)
out["kernel_shape"] = list(mu.shape)
print("RESULT " + json.dumps(out))
"""


def test_eight_devices_match_one_device_in_every_mode(tmp_path):
  # One test (one child process): xdist would run a shared fixture once per worker.
  overrides = {**TINY, **write_corpus(tmp_path), "model.n_embd": 64, "num_train_steps": STEPS,
               "checkpoint_every_steps": 3, "eval_every_steps": STEPS}
  proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(overrides), str(tmp_path)],
                        cwd=REPO, env=subprocess_env(8, str(tmp_path / "jax_cache")),
                        capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
  results = json.loads(line[len("RESULT "):])

  assert results["devices"] == 8
  for mode in ("jit", "pmap", "fsdp", "sliced"):
    assert len(results[mode]) == STEPS, mode
    np.testing.assert_allclose(results[mode], results["reference"], atol=1e-5, err_msg=mode)
    np.testing.assert_allclose(results[mode + "_eval"], results["jit_eval"], atol=1e-5,
                               err_msg=mode)
  for mode in ("pmap", "fsdp"):   # restoring in this mode repeats the same steps
    assert results[mode + "_resumed"] == results[mode], mode
  np.testing.assert_allclose(results["sliced_resumed"], results["sliced"], atol=1e-6)
  assert "fsdp" in results["fsdp_kernel_spec"]        # large leaves sharded,
  assert "fsdp" not in results["fsdp_bias_spec"]      # small ones replicated
  # The sliced optimiser state: in the weight's FSDP shard, 1/4 of it on each device (data 4).
  assert "'fsdp', 'data'" in results["update_spec"], results["update_spec"]
  assert np.prod(results["update_shard"]) * 8 == np.prod(results["kernel_shape"])
