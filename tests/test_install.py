"""Install metadata: the runtime leaves test/notebook tooling and TensorFlow to extras, and
requirements.txt (the CPU/CI set the README's quick start installs) covers every extra the
tests and experiments need."""
import pathlib
import re
import tomllib

REPO = pathlib.Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _name(requirement: str) -> str:
  return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_runtime_needs_no_tensorflow_and_no_test_or_notebook_tooling():
  runtime = {_name(r) for r in PROJECT["dependencies"]}
  assert not runtime & {"tensorflow", "tensorflow-cpu", "tensorflow-datasets", "pytest",
                        "nbclient", "ipykernel", "matplotlib", "jaxlib"}, runtime
  extras = PROJECT["optional-dependencies"]
  assert {"cpu", "cuda12", "tpu", "test", "experiments", "data"} <= set(extras)
  for platform in ("cpu", "cuda12", "tpu"):
    assert extras[platform] == [f"jax[{platform}]>=0.8.3"]


def test_requirements_txt_holds_the_runtime_and_the_cpu_ci_extras():
  lines = [l.split("#")[0].strip() for l in (REPO / "requirements.txt").read_text().splitlines()]
  listed = {_name(l) for l in lines if l}
  extras = PROJECT["optional-dependencies"]
  wanted = PROJECT["dependencies"] + [r for e in ("data", "test", "experiments")
                                      for r in extras[e]]
  assert {_name(r) for r in wanted} - {"jax"} <= listed
  assert any(l.startswith("jax[cpu]") for l in lines)     # the CPU backend, as [cpu]
