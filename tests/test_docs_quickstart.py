"""The README's quick-start train command, run as written at tiny scale, and the documented
commands that continue its workdir (`needs=quickstart`: resume, evaluate, sample), each on a
copy of it (docs/testing.md, "Docs that cannot rot"). Marked `docs`."""
import shutil

import pytest

import docs_pages
import docs_runner

pytestmark = [pytest.mark.docs, pytest.mark.filterwarnings("ignore")]
RUNNABLE = docs_pages.marked("run")
README_TRAIN = RUNNABLE[0]
ON_IT = [b for b in RUNNABLE[1:] if b.options()[0].get("needs") == "quickstart"]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
  return docs_runner.command_env(tmp_path_factory)


@pytest.fixture(scope="module")
def quickstart(env, tmp_path_factory):
  """The folder the README's train command ran in (its `workdirs/sas_p`); its install
  (.ci/run's, which CI runs before this step) is checked by test_docs_static.py."""
  cwd = tmp_path_factory.mktemp("quickstart")
  (line,) = docs_pages.commands(README_TRAIN.text)
  _, train = line.split(" && ", 1)
  status, output = docs_runner.run(README_TRAIN, cwd, env, command=train)
  assert status == 0, f"{README_TRAIN.where}: {train}\n{output[-4000:]}"
  assert "step 3/3" in output
  return cwd


def test_the_readme_quick_start_trains_and_evaluates(quickstart):
  rows = (quickstart / "workdirs" / "sas_p" / "metrics.jsonl").read_text().splitlines()
  assert any("eval_loss" in row for row in rows)
  assert (quickstart / "workdirs" / "sas_p" / "checkpoints").is_dir()


@pytest.mark.parametrize("block", ON_IT, ids=[b.where for b in ON_IT])
def test_a_command_on_the_quick_start_run_works_as_written(block, quickstart, env, tmp_path):
  shutil.copytree(quickstart / "workdirs", tmp_path / "workdirs")
  docs_runner.run_and_check(block, tmp_path, env)
