"""Install metadata: the runtime leaves test/notebook tooling and TensorFlow to extras, and
requirements.txt (the CPU/CI set the README's quick start installs) covers every extra the
tests and experiments need."""
import os
import pathlib
import re
import subprocess
import sys
import tomllib

REPO = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
FLOORS = REPO / ".ci" / "floors.txt"


def _name(requirement: str) -> str:
  return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_runtime_needs_no_tensorflow_and_no_test_or_notebook_tooling():
  runtime = {_name(r) for r in PROJECT["dependencies"]}
  assert not runtime & {"tensorflow", "tensorflow-cpu", "tensorflow-datasets", "pytest",
                        "nbclient", "ipykernel", "matplotlib", "jaxlib"}, runtime
  extras = PROJECT["optional-dependencies"]
  assert {"cpu", "cuda12", "tpu", "test", "experiments", "data", "hf"} <= set(extras)
  for platform in ("cpu", "cuda12", "tpu"):
    assert extras[platform] == [f"jax[{platform}]>=0.8.3"]
  # Compiling for NVIDIA GPUs without the GPU runtime, but with cuDNN (without it the program
  # would quietly take XLA's attention): the CUDA plugin, the CUDA compiler, cuDNN, cudart.
  assert {_name(r) for r in extras["cuda12-compile"]} == {
      "jax", "nvidia-cuda-nvcc-cu12", "nvidia-cudnn-cu12", "nvidia-cuda-runtime-cu12"}
  assert "jax[cuda12-local]>=0.8.3" in extras["cuda12-compile"]


def test_requirements_txt_holds_the_runtime_and_the_cpu_ci_extras():
  lines = [l.split("#")[0].strip() for l in (REPO / "requirements.txt").read_text().splitlines()]
  listed = {_name(l) for l in lines if l}
  extras = PROJECT["optional-dependencies"]
  wanted = PROJECT["dependencies"] + [r for e in ("data", "hf", "test", "experiments", "convert")
                                      for r in extras[e]]
  assert {_name(r) for r in wanted} - {"jax"} <= listed
  assert any(l.startswith("jax[cpu]") for l in lines)     # the CPU backend, as [cpu]


def _floor_pins() -> dict[str, str]:
  lines = [l.split("#")[0].strip() for l in FLOORS.read_text().splitlines()]
  return dict(l.split("==") for l in lines if l)


def test_every_runtime_dependency_has_a_floor_pinned_in_the_ci_constraints_and_no_ceiling():
  pins = _floor_pins()
  for requirement in PROJECT["dependencies"]:
    name = _name(requirement)
    floor = re.search(r">=([0-9.]+)", requirement)
    assert floor and "<" not in requirement, requirement      # open ceiling, named floor
    assert name in pins, f"{name} is not pinned in {FLOORS}"
    assert pins[name].startswith(floor.group(1)), (requirement, pins[name])
  assert "importlib-resources" not in {_name(r) for r in PROJECT["dependencies"]}


def test_the_wheel_installs_the_configs_inside_the_package():
  tool = PYPROJECT["tool"]["setuptools"]
  packages = set(tool["packages"])
  assert tool["package-dir"] == {"simplified_flax.configs": "configs"}
  on_disk = {".".join(p.parent.relative_to(REPO).parts)
             for p in (REPO / "simplified_flax").rglob("__init__.py")}
  assert packages == on_disk | {"simplified_flax.configs"}   # no top-level configs


def test_the_entry_points_import_no_sentencepiece_and_no_importlib_resources():
  code = ("import sys, simplified_flax.train, simplified_flax.evaluate, simplified_flax.sample, "
          "simplified_flax.data; print(sorted({'sentencepiece', 'importlib_resources'} & "
          "set(sys.modules)))")
  done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                        timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert done.stdout.strip() == "[]", done.stderr[-2000:]


def test_the_entry_points_help_names_only_files_that_exist():
  """`python -m simplified_flax.<cli> --help` prints the module docstring: every source file
  it points to must be there."""
  package = REPO / "simplified_flax"
  files = {p.name for p in REPO.rglob("*.py")} | {
      str(p.relative_to(root)) for root in (package, REPO) for p in root.rglob("*.py")}
  for cli in ("train", "evaluate", "sample", "finetune", "prepare", "params", "benchmark",
              "convert"):
    text = (REPO / "simplified_flax" / f"{cli}.py").read_text().split('"""')[1]
    for name in re.findall(r"[\w/]+\.py\b", text):
      assert name in files, f"simplified_flax/{cli}.py's help names {name}, which does not exist"
