"""Shared fixtures: tiny model configs of every variant; the `floor` subset; a temporary
default compilation cache for every command the tests start."""
import os

# Before JAX is imported: the tests run on the CPU, also where libtpu or the CUDA plugin is
# installed to compile for those (tests/test_compile.py), as `simplified_flax.compile` does.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
# The tests check values, never speed, and most of their CPU time is XLA:CPU compiling tiny
# programs, nearly all of it in generating the fused kernels' code (the HLO passes take a
# tenth). Three flags make that cheap: LLVM at its lowest optimisation level (a third faster),
# and XLA:CPU's loop emitters for fusions in place of its newer fusion emitters (2.5 times
# faster again: 6 tiny gradient programs, 3.7 s -> 1.45 s). No fast-math either way: values
# move by round-off only (the losses and gradients of 10 tiny programs differ from XLA's
# defaults by at most 4e-4 of a leaf's largest entry, with either flag or both). Child
# processes get the same flags (test_loop.py). The docs' commands run with XLA's defaults
# (tests/docs_runner.py), as a user runs them.
FAST_COMPILE_XLA_FLAGS = ("--xla_backend_optimization_level=0 "
                          "--xla_llvm_disable_expensive_passes=true "
                          "--xla_cpu_use_fusion_emitters=false")
if FAST_COMPILE_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"),
                                                   FAST_COMPILE_XLA_FLAGS]))

import pytest  # pylint: disable=wrong-import-position

import configs  # pylint: disable=wrong-import-position


def _config_kinds() -> dict:
  """{config name: its model kind} for every file of configs/ (listed, never typed by hand)."""
  from simplified_flax import config_files  # pylint: disable=import-outside-toplevel
  return {name: configs.load(name).model.kind for name in config_files.known_configs()}


CONFIG_KINDS = _config_kinds()
ALL_CONFIGS = tuple(sorted(CONFIG_KINDS))   # every file, base.py (Pre-LN's defaults) included
# The variants: every file but base.py, which preln.py runs unchanged.
DECODER_VARIANTS = tuple(n for n in ALL_CONFIGS if CONFIG_KINDS[n] == "decoder" and n != "base")
ENCODER_VARIANTS = tuple(n for n in ALL_CONFIGS if CONFIG_KINDS[n] == "encoder")
TINY_MODEL = dict(n_layer=2, n_embd=32, n_head=4, context_length=16, vocab_size=61)


def load_config(name: str, arg: str = ""):
  return configs.load(f"{name}:{arg}")


def tiny_config(name: str, **model_overrides):
  config = load_config(name)
  config.model.update(dict(TINY_MODEL, **model_overrides))
  return config


@pytest.fixture
def tiny():
  return tiny_config


@pytest.fixture(scope="session", autouse=True)
def temporary_cache_home(tmp_path_factory):
  """XDG_CACHE_HOME of this session and its child processes: a temporary folder, so that the
  commands' default compilation cache (`$XDG_CACHE_HOME/simplified_flax/jax`) never writes to
  the real ~/.cache. xdist's workers share it (their base folders are siblings), and the tests'
  own compiles use it too: the suite compiles the same tiny programs in many tests and child
  processes, and each is compiled once."""
  before = os.environ.get("XDG_CACHE_HOME")
  base = tmp_path_factory.getbasetemp()
  shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
  os.environ["XDG_CACHE_HOME"] = str(shared / "cache_home")
  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_compilation_cache_dir",
                    str(shared / "cache_home" / "simplified_flax" / "jax"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  yield os.environ["XDG_CACHE_HOME"]
  if before is None:
    os.environ.pop("XDG_CACHE_HOME", None)
  else:
    os.environ["XDG_CACHE_HOME"] = before


# The fast subset CI also runs on the oldest supported releases (.ci/floors.txt): the model,
# attention, a train step, checkpoint save and restore, a 20-step CLI run, decoding. Named
# here, in one place, rather than by decorators spread over the files.
FLOOR_SUBSET = (
    "test_attention.py::test_explicit_and_fused_agree_outputs_and_gradients",
    "test_model.py::test_packed_rows_equal_separate_sequences",
    "test_model.py::test_every_trainable_gain_learns_after_one_step[sas_p]",
    "test_step.py::test_training_reduces_the_loss_and_counts_steps",
    "test_step.py::test_gradient_accumulation_equals_one_big_batch",
    "test_loop.py::test_run_writes_metrics_config_checkpoints_and_events",
    "test_loop.py::test_evaluate_restores_the_latest_checkpoint",
    "test_loop.py::test_corrupt_latest_checkpoint_falls_back_to_the_previous_one",
    "test_config_files.py::test_a_20_step_run_by_config_name_from_another_folder",
    "test_decode.py::test_cached_decoding_equals_the_full_forward_pass[sas_p-explicit]",
    "test_decode.py::test_generation_compiles_once_and_matches_step_by_step_greedy_decoding",
)


def _floor_key(item) -> str:
  return f"{item.path.name}::{item.name}"


def pytest_collection_modifyitems(config, items):
  """Marks FLOOR_SUBSET `floor`; a `-m floor` run that collects a file of the subset without
  one of its named tests fails, so that a renamed test never shrinks the subset unnoticed.
  Then orders the files with slow tests first (below)."""
  names = set(FLOOR_SUBSET)
  for item in items:
    if _floor_key(item) in names or _floor_key(item).split("[")[0] in names:
      item.add_marker(pytest.mark.floor)
  if config.getoption("markexpr", "") == "floor":
    found = {_floor_key(i) for i in items} | {_floor_key(i).split("[")[0] for i in items}
    files = {i.path.name for i in items}
    missing = {n for n in names - found if n.split("::")[0] in files}
    if missing:
      raise pytest.UsageError(f"FLOOR_SUBSET names tests that do not exist: {sorted(missing)}")
  # The files that hold end-to-end (`slow`) tests first, each file's tests kept together (its
  # module fixtures set up once): xdist's work stealing then ends the run on short tests,
  # rather than one worker finishing a minute-long test while the other waits.
  slow_files = {item.path for item in items if item.get_closest_marker("slow")}
  items.sort(key=lambda item: item.path not in slow_files)


def pytest_ignore_collect(collection_path, config):
  """`-m floor` collects only the subset's files: the floor venv has no TensorFlow or
  notebook tooling, which other test files import at the top."""
  if config.getoption("markexpr", "") != "floor" or collection_path.suffix != ".py":
    return None
  if not collection_path.name.startswith("test_"):
    return None
  return collection_path.name not in {name.split("::")[0] for name in FLOOR_SUBSET} or None
