"""How the unit templates are read: shared by the renderer and the wheel build hook
(hatch_build.py), which compiles the templates ahead of time with these same options.
No imports here, so the build hook can load this file on its own."""

# Line layout only: what each option does to whitespace must be the same when the
# templates are compiled at build time and when they are read from source.
TEMPLATE_OPTIONS = {
    "autoescape": False,  # unit files, not HTML; escaping is done by the units/syntax.py filters
    "trim_blocks": True,
    "lstrip_blocks": True,
    "keep_trailing_newline": True,
}
# Filters the templates use; Jinja2 checks at compile time that they exist, and looks
# them up by name when rendering (render.make_environment supplies them).
FILTER_NAMES = ("exec", "env", "value")
COMPILED_PACKAGE_DIR = "compiled_templates"
COMPILED_VERSION_FILE = "JINJA2_VERSION"  # in it: the Jinja2 version that compiled them
