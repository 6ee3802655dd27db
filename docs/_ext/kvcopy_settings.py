"""The ``kvcopy-settings`` directive: the configuration table, generated from
kvcopy.config's settings so that names, variables, defaults and ranges cannot drift."""

from __future__ import annotations

import re

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective


def setting_texts() -> dict[str, str]:
    """Each setting's paragraph of kvcopy.config.Config's docstring, joined to one line."""
    from kvcopy.config import Config

    doc = Config.__doc__ or ""
    found: dict[str, str] = {}
    for match in re.finditer(r"^    (\w+): (.*?)(?=^    \w+: |\Z)", doc, re.S | re.M):
        found[match.group(1)] = " ".join(match.group(2).split())
    return found


def rows() -> list[tuple[str, str, str, str, str]]:
    from kvcopy.config import _SETTINGS

    texts = setting_texts()
    out = []
    for name, spec in _SETTINGS.items():
        if spec.boolean:
            default, values = str(bool(spec.default)), "True / False (0 / 1)"
        else:
            default = "None (per device)" if spec.default is None else f"{spec.default:,}"
            values = f"{spec.minimum:,}–{spec.maximum:,}"
            if spec.multiple_of > 1:
                values += f", multiple of {spec.multiple_of}"
            if spec.optional:
                values += ", or None"
        out.append((f"`{name}`", f"`{spec.env}`", default, values, texts.get(name, "")))
    return out


class SettingsTable(SphinxDirective):
    has_content = False

    def run(self) -> list[nodes.Node]:
        # the page is Markdown (MyST), so the nested text is a Markdown table
        lines = [
            "| setting | environment variable | default | values | what it does and trades |",
            "|---|---|---|---|---|",
        ]
        for row in rows():
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
        container = nodes.container()
        self.state.nested_parse(StringList(lines), self.content_offset, container)
        return container.children


def setup(app):  # noqa: ANN001, ANN201 - Sphinx's extension entry point
    app.add_directive("kvcopy-settings", SettingsTable)
    return {"parallel_read_safe": True}
