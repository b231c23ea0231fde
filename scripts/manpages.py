"""Write the man pages (packaging/man/) and bash completions (packaging/completion/) of
every command from the commands' own definitions: click's for llmgw-render,
llmgw-systemd and llmgw-supervisor, argparse's for the two unit helpers. Options and
their help exist once, in the code; the prose around them is the table below. The
README's spec key tables come the same way from the key tables the spec reader uses
(the key rows of spec/common_keys.py and of each engine in spec/engines/).

    .venv/bin/python scripts/manpages.py [--check]

--check writes nothing and exits 1 if a file would change (tests/test_manpages.py runs it).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from llmgw_systemd import __version__
from llmgw_systemd.helpers import stop_group as stopgroup
from llmgw_systemd.helpers import wait_for_port as waitport
from llmgw_systemd.programs import render as render_program
from llmgw_systemd.programs import supervisor as supervisor_program
from llmgw_systemd.programs import systemd as systemd_program
from llmgw_systemd.spec.common_keys import COMMON_KEYS
from llmgw_systemd.spec.engines.table import ENGINES
from llmgw_systemd.spec.keys import Key

ROOT = Path(__file__).resolve().parents[1]
MAN_DIR = ROOT / "packaging" / "man"
COMPLETION_DIR = ROOT / "packaging" / "completion"
PATH_METAVARS = ("FILE", "DIR", "PATH", "SPEC", "SPEC...", "[SPEC]...")


@dataclass(frozen=True)
class Option:
    flags: tuple[str, ...]
    metavar: str | None  # None: a flag
    help: str


@dataclass(frozen=True)
class Command:
    name: str
    section: int
    summary: str
    synopsis: str
    options: tuple[Option, ...]
    description: tuple[str, ...]
    exit_status: tuple[tuple[str, str], ...]
    files: tuple[tuple[str, str], ...] = ()
    see_also: tuple[str, ...] = ()
    subcommands: dict[str, tuple[Option, ...]] = field(default_factory=dict)


def click_options(command: click.Command) -> tuple[Option, ...]:
    out = []
    for param in command.params:
        if not isinstance(param, click.Option) or param.hidden:
            continue
        metavar = None if param.is_flag else (param.metavar or param.name or "").upper()
        text = param.help or ""
        if param.show_default and param.default not in (None, False, ()):
            text += f" [default: {param.default}]"
        out.append(Option(tuple(param.opts), metavar, text))
    out.append(Option(("-h", "--help"), None, "Show the help and exit."))
    return tuple(out)


def argparse_options(parser: argparse.ArgumentParser) -> tuple[Option, ...]:
    out = []
    for action in parser._actions:  # argparse has no public list of them
        if not action.option_strings:
            continue
        takes = action.nargs != 0
        metavar = (action.metavar or action.dest.upper()) if takes else None
        out.append(Option(tuple(action.option_strings), str(metavar) if metavar else None,
                          (action.help or "").replace("%(prog)s", parser.prog)))
    return tuple(out)


GENERATOR_OPTIONS = (Option(("--version",), None, "Show the version and exit."),)

SEE_ALSO = ("llmgw-render(1)", "llmgw-systemd(1)", "llmgw-supervisor(1)",
            "llmgw-systemd-generator(8)", "systemctl(1)", "systemd.unit(5)")


def commands() -> list[Command]:
    status = systemd_program.systemd_group.commands["status"]
    return [
        Command(
            "llmgw-render", 1, "render LLM replica specs into systemd units for one node",
            "[OPTIONS] SPEC...", click_options(render_program.render_command),
            ("Reads the replica SPEC files (or folders of *.yaml files) and writes this "
             "node's units: per replica a target, its sidecar and engine services and a "
             "restart unit, linked so that the node's systemd starts, orders, restarts and "
             "stops the shard.",
             "Writes are atomic and all or nothing, a re-render with nothing changed "
             "touches no file, and only files carrying the marker line "
             "'# llmgw-systemd: generated unit (marker v1)' are ever rewritten or removed.",
             "With --apply it then makes systemd follow: it stops what loses its unit "
             "file, disables removed replicas, reloads, enables replicas whose spec says "
             "enable: true, restarts running replicas whose units changed and starts new "
             "enabled ones, printing one line per replica."),
            (("0", "done"), ("1", "a foreign file in the way, a full disk, a failing "
                             "systemctl step"), ("2", "bad input: the error names the file, "
                                                 "line and key path, or the option")),
            (("/etc/systemd/system", "where the units go (~/.config/systemd/user with "
              "--user)"), ("/etc/llmgw/replicas.d", "the usual place for specs")),
            SEE_ALSO),
        Command(
            "llmgw-systemd", 1, "operate llmgw-systemd shards on this node",
            "status [OPTIONS] [NAME]", click_options(systemd_program.systemd_group),
            ("status prints the health of this node's shards straight from systemd, over "
             "D-Bus, with no daemon needed. With --cluster it shows every rank of those "
             "replicas: this node's from systemd, each other node's as that node's own "
             "llmgw-supervisor reports it, or unknown with the reason when it cannot "
             "be asked or believed.",),
            (("0", "every shard (or rank) shown is ready"), ("1", "systemd cannot be reached"),
             ("2", "bad input"), ("3", "a shard (or rank) shown is not ready")),
            (("/etc/llmgw/replicas.d", "the specs read by default"),
             ("/etc/llmgw/tls", "node.crt, node.key and ca.crt for --cluster over TLS")),
            SEE_ALSO, {"status": click_options(status)}),
        Command(
            "llmgw-supervisor", 1, "watch shards over D-Bus and judge replica health",
            "[OPTIONS] [SPEC]...", click_options(supervisor_program.supervisor_command),
            ("One daemon per node. It reads the specs, watches this node's units over "
             "D-Bus, probes the serving rank, asks the other nodes' supervisors for their "
             "ranks, judges each replica ready, degraded or failed, restarts all ranks of "
             "a replica together when one half is broken, and serves the result as JSON "
             "(/v1/replicas, /v1/shards) and Prometheus metrics (/metrics).",
             "It ships as llmgw-supervisor.service, enabled but never started by the "
             "package."),
            (("0", "stopped by SIGTERM or SIGINT"), ("1", "cannot listen, or systemd is "
                                                   "unreachable at start"),
             ("2", "bad input")),
            (("/etc/llmgw/replicas.d", "the specs read by default"),
             ("/var/lib/llmgw-supervisor", "group restarts, kept across restarts"),
             ("/etc/llmgw/tls", "the node's TLS files, loaded by the unit")),
            SEE_ALSO),
        Command(
            "llmgw-wait-for-port", 1, "wait until addresses accept TCP connections",
            "[--timeout S] [--interval S] [--free] HOST:PORT...",
            argparse_options(waitport.build_parser()),
            ("The ExecStartPre= of ranks that meet at a rendezvous: exits 0 once every "
             "address accepts TCP connections, or with --free once nothing listens on "
             "those ports. Names are resolved afresh on every try. Under systemd it "
             "reports what it waits for as STATUS=; SIGTERM (a stop of the unit) ends it "
             "with status 0.",),
            (("0", "every address is there (or free); or stopped by SIGTERM"),
             ("1", "timed out: one line names what it waited for and how long"),
             ("2", "bad arguments")),
            see_also=SEE_ALSO),
        Command(
            "llmgw-stop-group", 1, "stop every process of a unit, SIGKILL after a grace",
            "--grace S [--main-first]", argparse_options(stopgroup.build_parser()),
            ("The ExecStop= of vLLM and Ray units: SIGTERM to every process of its own "
             "unit's control group (with --main-first, to the main process alone, as "
             "KillMode=mixed does), then SIGKILL to whatever is left after the grace, "
             "inside the stop, so a process that ignores SIGTERM still leaves the unit "
             "inactive rather than failed by TimeoutStopSec=.",),
            (("0", "the group is empty (or, with --main-first, the main process is gone)"),
             ("1", "processes survived SIGKILL, or no control group was found"),
             ("2", "bad arguments")),
            see_also=SEE_ALSO),
        Command(
            "llmgw-systemd-generator", 8, "make this node's llmgw units at boot and reload",
            "NORMAL_DIR [EARLY_DIR LATE_DIR]", GENERATOR_OPTIONS,
            ("A systemd generator (systemd.generator(7)): systemd runs it at boot and at "
             "every daemon-reload. It reads /etc/llmgw/replicas.d/*.yaml (a user "
             "manager's: $XDG_CONFIG_HOME/llmgw/replicas.d) and writes this node's units "
             "into NORMAL_DIR, the same bytes llmgw-render writes but for the header line "
             "that names their writer. A replica with enable: true is linked into "
             "multi-user.target (default.target for a user manager).",
             "The node's name is the one in /etc/llmgw/node, else the host name. A spec "
             "file with an error loses only its own replicas, with one line naming file, "
             "line and key path; two files that conflict both lose theirs. A unit of the "
             "same name in /etc/systemd/system wins, and the generator skips that replica. "
             "Messages go to the journal, or to /dev/kmsg early at boot.",
             "Run by hand into a scratch folder, it shows what it would generate and every "
             "problem with the specs."),
            (("0", "done, whatever the specs hold"), ("1", "NORMAL_DIR cannot be written"),
             ("2", "wrong arguments")),
            (("/etc/llmgw/replicas.d", "the specs"), ("/etc/llmgw/node", "this node's name"),
             ("/run/llmgw-systemd/generator.cache", "the output of the last run, reused "
              "while nothing changed")),
            ("systemd.generator(7)", "llmgw-render(1)", "systemctl(1)")),
    ]


def roff(text: str) -> str:
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\\&" + text if text[:1] in (".", "'") else text


def man_page(cmd: Command) -> str:
    lines = [f'.TH {cmd.name.upper()} {cmd.section} "" "llmgw-systemd {__version__}" '
             '"llmgw-systemd"',
             ".SH NAME", f"{roff(cmd.name)} \\- {roff(cmd.summary)}",
             ".SH SYNOPSIS", f".B {roff(cmd.name)}", roff(cmd.synopsis),
             ".SH DESCRIPTION"]
    for i, paragraph in enumerate(cmd.description):
        if i:
            lines.append(".PP")
        lines.append(roff(paragraph))
    sections = [("OPTIONS", cmd.options)] + [
        (f"OPTIONS OF {sub.upper()}", opts) for sub, opts in cmd.subcommands.items()]
    for title, options in sections:
        lines.append(f".SH {title}")
        for opt in options:
            flags = ", ".join(f"\\fB{roff(f)}\\fR" for f in opt.flags)
            lines += [".TP", flags + (f" \\fI{roff(opt.metavar)}\\fR" if opt.metavar else ""),
                      roff(opt.help)]
    lines.append(".SH EXIT STATUS")
    for code, meaning in cmd.exit_status:
        lines += [".TP", f"\\fB{code}\\fR", roff(meaning)]
    if cmd.files:
        lines.append(".SH FILES")
        for path, meaning in cmd.files:
            lines += [".TP", f"\\fI{roff(path)}\\fR", roff(meaning)]
    lines += [".SH SEE ALSO", ", ".join(f"\\fB{roff(s.split('(')[0])}\\fR({s.split('(')[1]}"
                                        for s in cmd.see_also if s.split("(")[0] != cmd.name)]
    return "\n".join(lines) + "\n"


def completion(cmd: Command) -> str:
    func = "_" + cmd.name.replace("-", "_")

    def words(options: tuple[Option, ...]) -> str:
        return " ".join(f for o in options for f in o.flags)

    def path_options(options: tuple[Option, ...]) -> str:
        return "|".join(f for o in options if o.metavar in PATH_METAVARS for f in o.flags)

    def value_options(options: tuple[Option, ...]) -> str:
        return "|".join(f for o in options if o.metavar and o.metavar not in PATH_METAVARS
                        for f in o.flags)

    def body(options: tuple[Option, ...], indent: str) -> list[str]:
        out = [f"{indent}case $prev in"]
        if path_options(options):
            out.append(f"{indent}    {path_options(options)}) "
                       'COMPREPLY=($(compgen -f -- "$cur")); return ;;')
        if value_options(options):
            out.append(f"{indent}    {value_options(options)}) COMPREPLY=(); return ;;")
        out += [f"{indent}esac",
                f'{indent}if [[ $cur == -* ]]; then',
                f'{indent}    COMPREPLY=($(compgen -W "{words(options)}" -- "$cur"))',
                f"{indent}else",
                f'{indent}    COMPREPLY=($(compgen -f -- "$cur"))',
                f"{indent}fi"]
        return out

    lines = [f"# bash completion for {cmd.name} (written by scripts/manpages.py from the "
             "command's own options)",
             f"{func}() {{",
             '    local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]}']
    if cmd.subcommands:
        subs = " ".join(cmd.subcommands)
        lines += ["    local sub=${COMP_WORDS[1]}",
                  "    if (( COMP_CWORD == 1 )); then",
                  f'        COMPREPLY=($(compgen -W "{subs} {words(cmd.options)}" -- "$cur"))',
                  "        return",
                  "    fi",
                  "    case $sub in"]
        for sub, options in cmd.subcommands.items():
            lines += [f"        {sub})", *body(options, "            "), "            ;;"]
        lines += ["    esac"]
    else:
        lines += body(cmd.options, "    ")
    lines += ["}", f"complete -o filenames -F {func} {cmd.name}"]
    return "\n".join(lines) + "\n"


README = ROOT / "README.md"
KEYS_BEGIN = ("<!-- spec keys: written by scripts/manpages.py from the key rows of "
              "spec/common_keys.py and spec/engines/ -->\n")
KEYS_END = "<!-- end of spec keys -->\n"


def key_table(keys: Sequence[Key[Any]]) -> list[str]:
    rows = ["| key | default | meaning |", "|---|---|---|"]
    rows += [f"| `{k.name}` | {k.shown_default()} | {k.meaning} |" for k in keys]
    return rows


def spec_keys() -> str:
    lines = ["Every engine:", "", *key_table(COMMON_KEYS)]
    for entry in ENGINES.values():
        lines += ["", f"`engine: {entry.name}`: {entry.summary}.", "", *key_table(entry.keys)]
    return "\n".join(lines) + "\n"


def readme() -> str:
    text = README.read_text(encoding="utf-8")
    head, rest = text.split(KEYS_BEGIN, 1)
    _, tail = rest.split(KEYS_END, 1)
    return f"{head}{KEYS_BEGIN}\n{spec_keys()}\n{KEYS_END}{tail}"


def outputs() -> dict[Path, str]:
    out: dict[Path, str] = {}
    for cmd in commands():
        out[MAN_DIR / f"{cmd.name}.{cmd.section}"] = man_page(cmd)
        out[COMPLETION_DIR / cmd.name] = completion(cmd)
    out[README] = readme()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    check = parser.parse_args().check
    stale = []
    for path, text in outputs().items():
        if path.exists() and path.read_text(encoding="utf-8") == text:
            continue
        stale.append(path)
        if not check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    for path in stale:
        print(f"{'stale' if check else 'wrote'}: {path.relative_to(ROOT)}")
    sys.exit(1 if check and stale else 0)


if __name__ == "__main__":
    main()
