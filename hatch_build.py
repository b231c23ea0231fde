"""Wheel build hook: compile the Jinja2 unit templates into Python modules.

Parsing and compiling the templates costs llmgw-render ~7 ms per run on our machines,
a quarter of its budget over the bare imports (issue 2's benchmark); shipping them
compiled lets jinja2.ModuleLoader import them from bytecode instead. The template
sources ship too, and tests check both give identical units.
"""

from __future__ import annotations

import os
import runpy
import shutil
import tempfile
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class CompileTemplatesHook(BuildHookInterface):  # type: ignore[type-arg]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel" or version == "editable":
            return
        import jinja2

        settings = runpy.run_path(os.path.join(self.root, "llmgw_systemd", "units",
                                               "templating.py"))
        self._out = tempfile.mkdtemp(prefix="llmgw-templates-")
        env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(os.path.join(self.root, "templates")),
            **settings["TEMPLATE_OPTIONS"])
        # Placeholders: compiled code looks filters up by name when it renders.
        env.filters.update(dict.fromkeys(settings["FILTER_NAMES"], str))
        env.compile_templates(self._out, zip=None, ignore_errors=False)
        # Compiled templates import names from jinja2.runtime that differ between Jinja2
        # versions (RHEL 9 ships 2.11): units/render.py uses them only under the one that made them.
        with open(os.path.join(self._out, settings["COMPILED_VERSION_FILE"]), "w",
                  encoding="utf-8") as f:
            f.write(jinja2.__version__)
        target = f"llmgw_systemd/units/{settings['COMPILED_PACKAGE_DIR']}"
        build_data["force_include"][self._out] = target

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        out = getattr(self, "_out", None)
        if out:
            shutil.rmtree(out, ignore_errors=True)
