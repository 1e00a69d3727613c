"""Sphinx configuration: MyST pages, API reference from the packages' docstrings (run from
source: every package's src/ goes on sys.path), the furo theme. Built by `nox -s docs` with
warnings as errors."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for src in sorted(ROOT.glob("packages/*/src")):
    sys.path.insert(0, str(src))

project = "apex, rebuilt"
author = "the apex-* maintainers"
copyright = "2026, the apex-* maintainers"  # noqa: A001 - Sphinx's name

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
]
source_suffix = {".md": "markdown"}
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "benchmark-results.md", "bench/**"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"undoc-members": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
intersphinx_mapping = {}  # no network at build time: links to torch are plain text

html_theme = "furo"
html_title = "apex, rebuilt"
html_static_path: list[str] = []
suppress_warnings = ["myst.xref_missing"]
