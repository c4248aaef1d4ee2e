"""The README and the docs pages against the code, without running anything (fast, in the
main suite; the build and the commands are tests/test_docs_build.py and
test_docs_commands.py): every config field a page or a config docstring names exists, every
runnable marker marks a block, and the README's two commands are the ones CI runs."""
import re

import pytest

import docs_pages
from simplified_flax import config_files

CI_RUN = (docs_pages.REPO / ".ci" / "run").read_text()


@pytest.fixture(scope="module")
def fields():
  return docs_pages.known_config_fields()


def test_every_config_field_a_page_names_exists(fields):
  unknown = {page.name: sorted(docs_pages.config_field_uses(page) - fields)
             for page in docs_pages.pages()}
  assert not {k: v for k, v in unknown.items() if v}, unknown


def test_the_field_check_sees_the_forms_pages_use(fields, tmp_path):
  """It reads `model.x`, `config.data.x`, `--config.x=`, `--set=x=` and `--finetune.x=`, and
  would report a misspelled one."""
  page = tmp_path / "page.md"
  page.write_text("Set `model.n_layr`, `config.data.nam`, `--finetune.epoch=5`.\n\n"
                  "    python -m simplified_flax.train --config.optimizer.lr=1 \\\n"
                  "        --config=sas_p\n    python experiments/throughput.py --set=dtyp.x=1\n")
  assert docs_pages.config_field_uses(page) - fields == {
      "model.n_layr", "data.nam", "finetune.epoch", "optimizer.lr", "dtyp.x"}


def test_every_config_docstring_command_loads_its_config_and_names_real_fields(fields):
  for name, commands in docs_pages.config_docstring_commands().items():
    if name == "__init__.py":
      continue
    assert commands, f"configs/{name}: its docstring has no command that runs it"
    for command in commands:
      spec = re.search(r"--config=(\S+)", command).group(1)
      config_files.load(spec)   # the file and its switches exist
      named = set(re.findall(r"--((?:config|finetune)(?:\.\w+)+)=", command))
      assert {n.removeprefix("config.") for n in named} <= fields, command


def test_every_runnable_marker_marks_a_block_and_the_readme_trains_first():
  runnable = docs_pages.marked("run")     # asserts each marker is right before a block
  assert runnable[0].page == docs_pages.README
  assert "python -m simplified_flax.train" in runnable[0].text
  assert len(docs_pages.marked("build")) == 1


def _readme_blocks():
  return [b for b in docs_pages.blocks(docs_pages.README) if b.language == "bash"]


def test_the_readme_installs_what_ci_installs_and_tests_with_ci_s_command():
  """The train command's install is .ci/run's (which CI runs; the docs test runs the rest),
  and the test command is in .ci/run verbatim (it cannot run inside pytest)."""
  train, test = [docs_pages.commands(b.text) for b in _readme_blocks()[:2]]
  install, _ = train[0].split(" && ", 1)
  ci_lines = [l.strip() for l in CI_RUN.splitlines()]
  assert test[0] in ci_lines, test[0]
  assert install.replace(" -q", "") == test[0].split(" && ")[0].replace(" -q", ""), install


def _headings(page) -> set[str]:
  text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
  return {h.replace("`", "") for h in re.findall(r"^#{1,6} (.+?)\s*$", text, flags=re.M)}


def test_every_docs_page_and_section_the_code_cites_exists():
  """Docstrings and comments cite pages as `docs/<page>.md, "<Heading>"`: each page and
  heading they name is there."""
  cited = 0
  for path in [p for d in ("simplified_flax", "configs", "experiments", "tests")
               for p in sorted((docs_pages.REPO / d).rglob("*.py"))]:
    text = path.read_text()
    for page, heading in re.findall(r"docs/(\w+)\.md(?:,\s*\"([^\"]+)\")?", text):
      target = docs_pages.DOCS / f"{page}.md"
      assert target.is_file(), f"{path.name} cites docs/{page}.md"
      if heading:
        heading = re.sub(r"\s*\n\s*(?:#\s*)?", " ", heading)
        assert heading in _headings(target), f"{path.name} cites docs/{page}.md, {heading!r}"
      cited += 1
  assert cited > 20
