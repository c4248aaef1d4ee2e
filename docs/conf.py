"""Sphinx configuration of the documentation site: myst markdown pages, an API reference from
the docstrings. Build it from the repository root (warnings are errors, as in CI):

    python -m sphinx -W -b html docs docs/_build
"""
import os
import pathlib
import sys

from sphinx import addnodes

DOCS = pathlib.Path(__file__).resolve().parent
REPO = DOCS.parent
sys.path.insert(0, str(REPO))   # autodoc imports the checkout, installed or not

project = "simplified_flax"
extensions = ["myst_parser", "sphinx.ext.autodoc"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 4        # `page.md#a-heading` links, checked by the build
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
html_theme = "alabaster"


def _repository_files_as_downloads(app, doctree):
  """A link to a repository file outside docs/ (a result report, a source file) becomes a
  download of that file in the built site, as GitHub shows it beside the page. Runs before
  myst resolves the links, so a link to a file that does not exist still fails the build."""
  for node in list(doctree.findall(addnodes.pending_xref)):
    if node.get("reftype") != "myst" or node.get("refdomain") != "doc":
      continue
    if node["reftarget"] in app.env.found_docs:
      continue
    path = pathlib.Path(app.env.doc2path(node["reftarget"]))
    if not path.is_absolute():
      path = DOCS / path
    if path.is_file() and REPO in path.resolve().parents and not node.get("reftargetid"):
      download = addnodes.download_reference(
          "", "", *node.children, refdomain=None, reftype="myst", refexplicit=True,
          reftarget="/" + os.path.relpath(path.resolve(), DOCS),   # "/": from docs/
          refdoc=node.get("refdoc"), classes=["xref", "download"])
      node.replace_self(download)


def _docstrings_as_written(app, what, name, obj, options, lines):
  """The docstrings are plain text with markdown-style `code`, not reStructuredText: show them
  as written (a literal block), so that their shapes and equations never become markup."""
  if lines:
    lines[:] = ["::", ""] + ["   " + line for line in lines] + [""]


def setup(app):
  app.connect("doctree-read", _repository_files_as_downloads, priority=100)
  app.connect("autodoc-process-docstring", _docstrings_as_written)
