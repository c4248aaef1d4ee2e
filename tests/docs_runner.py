"""Running the blocks the pages mark runnable (tests/docs_pages.py finds them), for
tests/test_docs_commands.py and test_docs_quickstart.py: the environment every command gets,
and one block run and checked as the page documents it."""
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import docs_pages

REPO = docs_pages.REPO
# What `$TINY_TRAIN` in a marker stands for: a few steps of a tiny model on a small corpus.
TINY_TRAIN = ("--config.num_train_steps=3 --config.model.n_layer=2 --config.model.n_embd=32 "
              "--config.model.n_head=2 --config.model.context_length=16 --config.batch_size=8 "
              "--config.log_every_steps=1 --config.eval_every_steps=3 --config.eval_steps=1 "
              "--config.checkpoint_every_steps=1 --config.data.roots={corpus}")
WORDS = ["def", "class", "return", "import", "self", "for", "in", "if", "else", "print",
         "value", "data", "(", ")", ":", "x", "y", "=", "+", "0", "1"]


def _document(rng) -> str:
  return "\n".join(" ".join(rng.choice(WORDS, size=12)) for _ in range(40))


def command_env(tmp_path_factory) -> dict:
  """The environment of every command: a HOME of its own (prepared shards and hub caches land
  there, shared by the commands of one test module), `$TINY_TRAIN` on a small corpus of .py
  files, one compilation cache for all xdist workers of the run (their base folders share a
  parent), so that the same tiny programs compile once, and no network."""
  home = tmp_path_factory.mktemp("docs_home")
  corpus = home / "corpus"
  corpus.mkdir()
  rng = np.random.default_rng(0)
  for i in range(30):
    (corpus / f"module{i:02d}.py").write_text(_document(rng))
  run_root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    run_root = run_root.parent
  base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
  return dict(base, HOME=str(home), JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
              JAX_COMPILATION_CACHE_DIR=str(run_root / "docs_jax_cache"),
              PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
              TINY_TRAIN=TINY_TRAIN.format(corpus=corpus),
              PATH=os.path.dirname(sys.executable) + os.pathsep + base.get("PATH", ""))


def run(block: docs_pages.Block, cwd, env: dict, command: str | None = None):
  """The block's commands (or `command`) in bash, in `cwd`, with the marker's arguments
  appended to each; returns (status, stdout + stderr) of the last that ran."""
  options, extra = block.options()
  for path in filter(None, options.get("jsonl", "").split(",")):
    target = cwd / path
    target.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(len(path))
    target.write_text("".join(json.dumps({"text": _document(rng)}) + "\n" for _ in range(30)))
  if "experiments/" in block.text:   # `python experiments/x.py` as from the repository root
    (cwd / "experiments").symlink_to(REPO / "experiments")
  if block.language == "python":
    done = subprocess.run([sys.executable, "-c", block.text], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    return done.returncode, done.stdout + done.stderr
  for line in [command] if command else docs_pages.commands(block.text):
    done = subprocess.run(["bash", "-c", f"{line} {extra}"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode:
      break   # the status the page documents is the failing command's
  return done.returncode, done.stdout + done.stderr


def run_and_check(block: docs_pages.Block, cwd, env: dict) -> None:
  """Runs the block (skipped without a module its marker `requires=`, failed instead under
  SIMPLIFIED_FLAX_REQUIRE_AOT=1) and checks the status the marker names (0 by default) and,
  for a `console` block, that every output line it shows was printed."""
  options, _ = block.options()
  module = options.get("requires")
  if module and importlib.util.find_spec(module) is None:
    if os.environ.get("SIMPLIFIED_FLAX_REQUIRE_AOT") == "1":
      pytest.fail(f"{block.where} needs {module}, which is not installed")
    pytest.skip(f"{block.where} needs {module}")
  status, output = run(block, cwd, env)
  assert status == int(options.get("status", "0")), f"{block.where}:\n{output[-4000:]}"
  if block.language == "console":   # the output the page shows, line for line
    lines = set(output.splitlines())
    for shown in docs_pages.console_output(block.text):
      assert shown in lines, f"{block.where}: the page shows\n{shown}\nbut it printed\n{output}"
