"""Sphinx configuration of aiomp's documentation site.

Build it with warnings as errors, from the repository's root (tests/meta/test_docs.py
does, so the suite builds it)::

    python -m sphinx -W -b html docs docs/_build/html

Pages are Markdown (myst-parser); the API reference is autodoc over the docstrings, which
use Sphinx roles. Nothing here reaches the network (no intersphinx).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this tree's aiomp, installed or not

import aiomp  # noqa: E402

project = "aiomp"
author = "the aiomp authors"
copyright = "the aiomp authors, MIT licence"
version = release = aiomp.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# Markdown: `{eval-rst}` blocks and ```{toctree}``` fences; headings get anchors for links.
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3
# benchmarks/RESULTS.md (generated) goes from its title to H3 sections.
suppress_warnings = ["myst.header"]

# The API reference: members in source order, signatures as written (postponed annotations
# stay strings), and cupy, which aiomp.cuda imports only when used, never imported.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autodoc_mock_imports = ["cupy"]

html_theme = "alabaster"
html_title = f"aiomp {release}"
html_theme_options = {"description": "torch.multiprocessing rebuilt async-first"}
