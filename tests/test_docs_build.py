"""The documentation site builds with warnings as errors, which fails on a broken link, heading
anchor or file; the README's links resolve; and every flag a page or a config docstring names
is a flag of its command (docs/testing.md, "Docs that cannot rot"). Marked `docs`: CI runs
these in their own step, with the `[docs]` extra installed."""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

import docs_pages

pytestmark = pytest.mark.docs
REPO = docs_pages.REPO


def _sphinx_command() -> list[str]:
  (block,) = docs_pages.marked("build")
  (command,) = docs_pages.commands(block.text)
  words = shlex.split(command)
  assert words[:3] == ["python", "-m", "sphinx"] and "-W" in words, command
  return [sys.executable] + words[1:]


def test_the_documented_build_passes_with_warnings_as_errors():
  done = subprocess.run(_sphinx_command(), cwd=REPO, capture_output=True, text=True,
                        timeout=600)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
  assert (REPO / "docs" / "_build" / "api.html").is_file()
  api = (REPO / "docs" / "_build" / "api.html").read_text()
  for name in ("build_model", "create_train_state", "train_step", "eval_step",
               "train_and_evaluate", "shaped_attention", "build_pipeline", "compile_for"):
    assert f'id="simplified_flax.' in api and f".{name}\"" in api, name   # autodoc found it


def test_the_build_fails_on_a_broken_anchor_page_or_file(tmp_path):
  """The same conf.py on a two-page site: a good link, a heading anchor and a repository file
  build; each broken kind alone fails the build."""
  (tmp_path / "docs").mkdir()
  shutil.copy(REPO / "docs" / "conf.py", tmp_path / "docs" / "conf.py")
  (tmp_path / "results").mkdir()
  (tmp_path / "results" / "report.md").write_text("# A report\n")
  (tmp_path / "docs" / "other.md").write_text("# Other\n\n## A heading\n")
  good = ("[a](other.md#a-heading) [b](../results/report.md)")
  command = [sys.executable, "-m", "sphinx", "-W", "-q", "-b", "html", "docs", "docs/_build"]
  for link, builds in [(good, True), ("[a](other.md#no-such-heading)", False),
                       ("[a](missing.md)", False), ("[a](../results/missing.md)", False)]:
    (tmp_path / "docs" / "index.md").write_text(
        f"# Top\n\n```{{toctree}}\nother\n```\n\n{link}\n")
    shutil.rmtree(tmp_path / "docs" / "_build", ignore_errors=True)
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert (done.returncode == 0) == builds, (link, done.stderr[-2000:])


def _anchors(page) -> set[str]:
  from myst_parser.slugs import github_slugify  # pylint: disable=import-outside-toplevel
  text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
  return {github_slugify(re.sub(r"`", "", h)) for h in
          re.findall(r"^#{1,6} (.+?)\s*$", text, flags=re.M)}


def test_every_link_of_the_readme_resolves_with_its_anchor():
  """The README is no Sphinx page (GitHub shows it), so its links are checked here: each
  relative target exists, and an anchor into a docs page names one of its headings."""
  links = re.findall(r"\]\(([^)\s]+)\)", docs_pages.README.read_text())
  assert len(links) > 20
  for link in links:
    if re.match(r"[a-z]+://", link):
      continue
    path, _, anchor = link.partition("#")
    target = (docs_pages.README.parent / path) if path else docs_pages.README
    assert target.exists(), link
    if anchor:
      assert anchor in _anchors(target), (link, sorted(_anchors(target)))


def _entry_points() -> list[str]:
  modules = [f"simplified_flax.{p.stem}" for p in sorted((REPO / "simplified_flax").glob("*.py"))
             if "__main__" in p.read_text()]
  scripts = [f"experiments/{p.name}" for p in sorted((REPO / "experiments").glob("*.py"))
             if 'if __name__ == "__main__"' in p.read_text()]
  return modules + scripts


@pytest.fixture(scope="module")
def program_flags() -> dict[str, set[str]]:
  programs = _entry_points()
  done = subprocess.run([sys.executable, str(REPO / "tests" / "docs_flags.py"), *programs],
                        cwd=REPO, capture_output=True, text=True, timeout=600,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert done.returncode == 0, done.stderr[-3000:]
  return {name: set(flags) for name, flags in json.loads(done.stdout).items()}


def test_every_flag_a_page_or_a_config_docstring_names_exists(program_flags):
  every = set().union(*program_flags.values())
  uses = [u for page in docs_pages.pages() for u in docs_pages.flag_uses(page)]
  for name, commands in docs_pages.config_docstring_commands().items():
    uses += docs_pages.flag_uses_in(commands, f"configs/{name}")
  assert len(uses) > 100
  unknown = [u for u in uses if u.flag not in program_flags.get(u.program, every)]
  assert not unknown, unknown
  named = {u.program for u in uses} - {None}
  assert named <= set(program_flags), named - set(program_flags)   # no command of ours unseen


def test_the_flag_check_catches_a_renamed_flag(program_flags, tmp_path):
  page = tmp_path / "page.md"
  page.write_text("    python -m simplified_flax.evaluate --workdir=w --eval_step=5\n\n"
                  "Pass `--max_new_token=4` to sample.\n")
  uses = docs_pages.flag_uses(page)
  every = set().union(*program_flags.values())
  assert [u.flag for u in uses if u.flag not in program_flags.get(u.program, every)] == [
      "eval_step", "max_new_token"]
