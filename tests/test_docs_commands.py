"""Every command the README and the docs pages mark runnable (`<!-- docs-test: run ... -->`),
executed as written at tiny scale: what the marker appends (`$TINY_TRAIN`: a few steps of a
tiny model on a small corpus) and nothing else, so a changed command, flag or field fails
here until its page changes with it (docs/testing.md, "Docs that cannot rot"). The README's
quick start and the commands that run on its workdir are test_docs_quickstart.py. Marked
`docs`: CI runs these in their own step."""
import pytest

import docs_pages
import docs_runner

pytestmark = [pytest.mark.docs, pytest.mark.filterwarnings("ignore")]
ALONE = [b for b in docs_pages.marked("run")[1:] if b.options()[0].get("needs") is None]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
  return docs_runner.command_env(tmp_path_factory)


@pytest.mark.parametrize("block", ALONE, ids=[b.where for b in ALONE])
def test_a_documented_command_runs_as_written(block, env, tmp_path):
  docs_runner.run_and_check(block, tmp_path, env)
