"""The MkDocs hook (``hooks:`` in ``mkdocs.yml``) that adds the generated pages at every build.

The pages, and the drawing of the flow they show (``flow.py``), exist only in
the build, never as files in ``docs/``, so there is no copy that could fall
behind the code. A name the code defines with no
explanation stops the build (with ``--strict`` or not): the page would
otherwise ship a row that says nothing. Run from the repository root with
``python -m mkdocs`` (``make docs``), so that ``tools`` and the project's
packages import.
"""

from __future__ import annotations

from collections.abc import Callable

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

from tools.docsgen import demo_flags, flow, matrix, messages_page, metrics_page, settings_page

# The hand-written page that holds the demo's flag table at demo_flags.MARKER.
QUICKSTART = "quickstart.md"
# Where each generated page lands in the site, and what renders it.
PAGES: dict[str, Callable[[], str]] = {
    "reference/settings.md": settings_page.render,
    "reference/messages.md": messages_page.render,
    "reference/metrics.md": metrics_page.render,
    "compatibility.md": matrix.render,
}
# The generated files the pages show (as images), made at every build as the pages are.
ASSETS: dict[str, Callable[[], str]] = {
    "assets/flow.svg": flow.render,
}


def problems() -> list[str]:
    """Everything the generated pages cannot explain, in one list (empty: they are complete)."""
    found = [
        f"settings {section}: {name}"
        for section, names in settings_page.missing().items()
        for name in names
    ]
    found += [f"messages {item}" for item in messages_page.missing()]
    found += [f"metrics: {item}" for item in metrics_page.missing()]
    found += [f"matrix: {item}" for item in matrix.missing_tests()]
    return found


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add each generated page, once every name in it has its explanation, and each asset."""
    unexplained = problems()
    if unexplained:
        raise PluginError("generated docs pages are incomplete:\n  " + "\n  ".join(unexplained))
    for path, render in {**PAGES, **ASSETS}.items():
        files.append(File.generated(config, path, content=render()))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Put the demo's flag table, read from its parser, where the quick start marks it."""
    if page.file.src_uri != QUICKSTART:
        return markdown
    if demo_flags.MARKER not in markdown:
        raise PluginError(f"{QUICKSTART} lost its {demo_flags.MARKER} marker")
    return markdown.replace(demo_flags.MARKER, demo_flags.render())
