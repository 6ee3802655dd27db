"""Sphinx configuration of kvcopy's documentation (built with warnings as errors)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

import kvcopy  # noqa: E402 - the installed package, documented from its docstrings

project = "kvcopy"
release = version = kvcopy.__version__
copyright = "the kvcopy authors"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "kvcopy_settings"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "performance-tables.md"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
html_theme = "alabaster"
nitpicky = False
suppress_warnings = ["myst.xref_missing"]
