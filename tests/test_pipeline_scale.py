"""The data path at scale: a million documents prepared by worker processes, a training run
killed with SIGKILL and resumed, and the resumed stream checked against an unkilled one."""
import glob
import json
import time

import numpy as np
import pytest

import configs
from simplified_flax import prepare
from simplified_flax.data import build_pipeline
from test_loop import TINY, kill_and_resume, subprocess_env, train_rows

pytestmark = pytest.mark.slow

NUM_DOCS = 1_000_000
STEPS = 40
# As in test_resume.py: big enough that a step takes milliseconds, so SIGKILL lands
# mid-run, after the step-20 checkpoint.
RUN = {**TINY, "model.n_embd": 128, "model.context_length": 64, "batch_size": 16,
       "data.packing": True, "num_train_steps": STEPS, "checkpoint_every_steps": 10,
       "eval_every_steps": STEPS, "eval_steps": 1}


def _write_million_documents(path) -> None:
  """1M short JSON lines, each with a unique number (so every row can be told apart)."""
  numbers = np.arange(NUM_DOCS)
  with open(path, "w") as f:
    f.write("".join(f'{{"text": "doc {n} {"xyz"[n % 3] * (n % 7)}"}}\n' for n in numbers))


def _overrides(tmp_path) -> dict:
  return {**RUN, "data.name": "text_files", "data.paths": str(tmp_path / "million.jsonl"),
          "data.cache_dir": str(tmp_path / "shards"), "data.shard_docs": 100_000}


def test_million_documents_prepare_train_kill_resume(tmp_path):
  _write_million_documents(tmp_path / "million.jsonl")
  overrides = _overrides(tmp_path)
  config = configs.load("preln:cpu", overrides)

  start = time.perf_counter()
  directories = prepare.prepare(config, workers=2, workdir=None)
  prepare_s = time.perf_counter() - start
  train_shards = glob.glob(f"{directories['train']}/tokens-*.npy")
  assert len(train_shards) == 10  # 950K train documents in shards of 100K

  # Train, SIGKILL after the step-4 checkpoint, resume to the end.
  workdir = tmp_path / "run"
  env = subprocess_env(cache_dir=str(tmp_path / "jax_cache"))  # the resumed run skips compiling
  kill_and_resume(workdir, overrides, env, after_rows=25, steps=STEPS)
  assert sorted(train_rows(workdir)) == list(range(1, STEPS + 1))

  # The data state of the kept checkpoint: a resumed iterator reaches its next batch at once,
  # and that batch (and the next ones) are those an unkilled iterator draws there.
  state_files = [p for p in glob.glob(f"{workdir}/checkpoints/20/**/*", recursive=True)
                 if _is_data_state(p)]
  assert state_files, glob.glob(f"{workdir}/checkpoints/20/**/*", recursive=True)
  state = json.load(open(state_files[0]))
  assert (state["batches_drawn"], state["epoch"], state["position"]) == (20, 0, 20)
  start = time.perf_counter()
  resumed = build_pipeline(configs.load("preln:cpu", overrides), process_index=0,
                           process_count=1).train_iterator()
  resumed.set_state(state)
  first = next(resumed)
  resume_s = time.perf_counter() - start
  assert resume_s < 5, resume_s
  unkilled = build_pipeline(configs.load("preln:cpu", overrides), process_index=0,
                            process_count=1).train_iterator()
  stream = [next(unkilled) for _ in range(23)]
  expected = stream[20:]
  for got, want in zip([first, next(resumed), next(resumed)], expected):
    np.testing.assert_array_equal(got["inputs"], want["inputs"])
    np.testing.assert_array_equal(got["segment_ids"], want["segment_ids"])

  # Two processes read disjoint halves whose union is the global batch.
  halves = [build_pipeline(configs.load("preln:cpu", overrides), process_index=p,
                           process_count=2).train_iterator() for p in range(2)]
  for want in stream[:2]:
    parts = [next(h) for h in halves]
    rows = [set(map(bytes, part["inputs"])) for part in parts]
    assert not rows[0] & rows[1]
    np.testing.assert_array_equal(np.concatenate([p["inputs"] for p in parts]), want["inputs"])
  print(f"prepare 1M documents: {prepare_s:.1f} s; resume to the next batch: {resume_s:.2f} s")


def _is_data_state(path: str) -> bool:
  try:
    return "batches_drawn" in json.load(open(path))
  except (OSError, ValueError, UnicodeDecodeError, TypeError):
    return False
