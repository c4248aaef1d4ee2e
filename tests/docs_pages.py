"""The README and the docs pages as data for their tests: fenced blocks and the commands they
mark as runnable, the commands and flags every page names, the config fields it names, and
every field a config can have. One source of truth: the tests read the commands from here.

A runnable block is a fenced block right after a marker line (docs/testing.md, "Docs that
cannot rot"):

    <!-- docs-test: run [status=N] [needs=quickstart] [jsonl=P,...] [requires=MOD] [ARGS ...] -->

ARGS (after the options) are appended to the block's command; `$TINY_TRAIN` among them is
expanded by bash from the test's environment.
"""
import ast
import dataclasses
import pathlib
import re
import shlex

REPO = pathlib.Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
README = REPO / "README.md"
MARKER = re.compile(r"^<!-- docs-test: (\w+)(.*?)-->\s*$")
OPTIONS = ("status", "needs", "jsonl", "requires")


def pages() -> list[pathlib.Path]:
  """The README first, then every docs page."""
  return [README] + sorted(DOCS.glob("*.md"))


@dataclasses.dataclass
class Block:
  page: pathlib.Path
  line: int                 # 1-based line of the opening fence
  language: str
  text: str
  marker: str | None = None  # "run", "build", ... of the marker line before it, if any
  marker_args: str = ""

  @property
  def where(self) -> str:
    return f"{self.page.relative_to(REPO)}:{self.line}"

  def options(self) -> tuple[dict[str, str], str]:
    """The marker's `key=value` options and the arguments to append."""
    options, rest = {}, []
    for word in shlex.split(self.marker_args, posix=False):
      key, eq, value = word.partition("=")
      if eq and key in OPTIONS and not rest:
        options[key] = value
      else:
        rest.append(word)
    return options, " ".join(rest)


def blocks(page: pathlib.Path) -> list[Block]:
  """Every fenced block of `page`, with the marker line right before it."""
  found, lines = [], page.read_text().splitlines()
  i = 0
  while i < len(lines):
    fence = re.match(r"^(\s*)(```+)(.*)$", lines[i])
    if not fence:
      i += 1
      continue
    indent, ticks, language = fence.groups()
    end = i + 1
    while end < len(lines) and not lines[end].strip().startswith(ticks):
      end += 1
    body = "\n".join(l[len(indent):] for l in lines[i + 1:end])
    before = lines[i - 1] if i else ""
    marker = MARKER.match(before.strip())
    found.append(Block(page, i + 1, language.strip(), body,
                       marker.group(1) if marker else None,
                       marker.group(2).strip() if marker else ""))
    i = end + 1
  return found


def marked(kind: str = "run") -> list[Block]:
  """The blocks marked `kind` on every page, in page order; a marker not followed by a
  fenced block is an error (it would silently test nothing)."""
  out = []
  for page in pages():
    lines = page.read_text().splitlines()
    markers = [n for n, l in enumerate(lines, 1) if MARKER.match(l.strip())]
    found = [b for b in blocks(page) if b.marker]
    assert {b.line - 1 for b in found} == set(markers), (
        f"{page.name}: a docs-test marker must stand right before a fenced block "
        f"(marker lines {markers})")
    out += [b for b in found if b.marker == kind]
  return out


def commands(text: str) -> list[str]:
  """The shell commands of a block: `\\` continuations joined, `$ ` prompts kept as the
  command, output lines of a `console` block and comments dropped."""
  joined = re.sub(r"\\\n\s*", " ", text)
  lines = joined.splitlines()
  if any(l.startswith("$ ") for l in lines):
    lines = [l[2:] for l in lines if l.startswith("$ ")]
  return [l for l in lines if l.strip() and not l.lstrip().startswith("#")]


def console_output(text: str) -> list[str]:
  """The lines a `console` block shows as the output of its `$ ` commands."""
  return [l for l in text.splitlines() if l.strip() and not l.startswith("$ ")]


# ------------------------------------------------------------------------------------------
# Commands, flags and config fields named anywhere on a page.
# ------------------------------------------------------------------------------------------

PROGRAM = re.compile(r"(?:^|\s)python3? (?:-m (simplified_flax\.\w+)|(experiments/\w+\.py))")
FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9_]*)((?:\.[a-z0-9_]+)*)(?![\w-])")
FIELD = re.compile(r"^(?:--)?(?:config\.)?((?:model|data|optimizer|parallel|finetune)"
                   r"(?:\.[a-z][a-z0-9_]*)+)(?:=.*)?$")
FILE_SUFFIXES = (".py", ".md", ".json", ".safetensors", ".model", ".bin")
SET_KEY = re.compile(r"--(?:set|vary)=([a-z_]+(?:\.[a-z0-9_]+)*)=")


def inline_code(text: str) -> list[str]:
  """The `code spans` of markdown text outside fenced blocks."""
  outside = re.sub(r"^(\s*)```.*?^\1```", "", text, flags=re.S | re.M)
  return [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", outside)]


def code_texts(page: pathlib.Path) -> list[str]:
  """Every command-like text of a page: its fenced blocks' lines, its indented blocks' and
  its code spans."""
  text = page.read_text()
  texts = [b.text for b in blocks(page)]
  indented = re.findall(r"(?:^(?: {4}|\t).*\n?)+", re.sub(r"```.*?```", "", text, flags=re.S),
                        flags=re.M)
  return texts + indented + inline_code(text)


@dataclasses.dataclass(frozen=True)
class FlagUse:
  program: str | None   # "simplified_flax.train", "experiments/benchmark.py"; None: prose
  flag: str
  where: str


def flag_uses(page: pathlib.Path) -> list[FlagUse]:
  """Every `--flag` a page names: with the program of the command it follows, or alone."""
  return flag_uses_in(code_texts(page), page.name)


def flag_uses_in(texts: list[str], where: str) -> list[FlagUse]:
  uses = []
  for text in texts:
    for command in commands(text) or [text]:
      for segment in re.split(r"&&|;|\|\||\||&(?!\w)", command):
        program = PROGRAM.search(segment)
        if program is None and re.search(
            r"\b(pip|pytest|gcloud|tfds|sphinx|git)\b|XLA_FLAGS|LIBTPU_INIT_ARGS", segment):
          continue   # another tool's flags
        if program is None and not segment.strip().startswith("--"):
          continue   # not a command of ours, not a flag on its own
        name = program and (program.group(1) or program.group(2))
        for flag, dotted in FLAG.findall(segment[program.end() if program else 0:]):
          if flag in ("config", "finetune") and dotted:
            continue   # a field, checked by config_field_uses
          uses.append(FlagUse(name, flag, where))
  return uses


def config_field_uses(page: pathlib.Path) -> set[str]:
  """Every config field a page names: `model.n_layer`, `config.data.name`,
  `--config.optimizer.learning_rate=...`, `--finetune.epochs=5`, an experiment's
  `--set=KEY=...` or `--vary=KEY=...`."""
  used = set()
  failing = {b.text for b in blocks(page) if b.options()[0].get("status", "0") != "0"}
  python = {b.text for b in blocks(page) if b.language == "python"}
  for text in code_texts(page):
    if text in failing:
      continue   # a command documented to fail may name a field that does not exist
    for word in re.split(r"[\s,()\[\]]+", text):
      word = word.strip("`'\".;:")
      match = FIELD.match(word)
      if match is None or match.group(1).endswith(FILE_SUFFIXES):
        pass
      elif text not in python or word.startswith("config."):   # not `model.apply` in code
        used.add(match.group(1).split("=")[0])
      used.update(SET_KEY.findall(word))
  return used


def config_docstring_commands() -> dict[str, list[str]]:
  """The commands (`python -m simplified_flax...`) of every config file's docstring."""
  found = {}
  for path in sorted((REPO / "configs").glob("*.py")):
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    found[path.name] = [c.strip() for c in commands(doc) if PROGRAM.search(c)]
  return found


def known_config_fields() -> set[str]:
  """Every dotted field of every config file under every switch that applies to it, and of
  the fine-tuning recipe (as `finetune.<field>`)."""
  from simplified_flax import config_files  # pylint: disable=import-outside-toplevel
  from simplified_flax.glue import training  # pylint: disable=import-outside-toplevel
  fields = set()
  for path in sorted((REPO / "configs").glob("*.py")):
    if path.stem == "__init__":
      continue
    for switches in ("", "cpu", "codeparrot", "codeparrot,cpu"):
      try:
        config = config_files.load(f"{path.stem}:{switches}")
      except ValueError:
        continue   # a switch that does not apply to this config (codeparrot on an encoder)
      fields.update(name for name, _ in config_files.dotted_items(config))
  fields.update(f"finetune.{name}" for name, _ in
                config_files.dotted_items(training.finetune_defaults()))
  return fields
