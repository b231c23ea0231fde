"""The systemd generator's output as plain data, and the decisions of its fast path
(pure; no imports at all).

The generator runs at every boot and every daemon-reload, and when nothing changed this
module, os, sys and marshal are all it loads (docs/generator.md). So the output is plain
tuples, which marshal stores in the cache as they are: importing dataclasses or typing
would cost more than the whole fast path (measured: docs/generator.md).

    Unit    = (file name, text)
    Replica = (name, target, wanted_by, enable, (Unit, ...))
    Message = (level, text), level ERROR or NOTICE
    Output  = ((Replica, ...), (Message, ...))
"""

from __future__ import annotations

from llmgw_systemd.spec.names import is_node_name

TYPE_CHECKING = False  # mypy reads this name as true; Python never imports typing here
if TYPE_CHECKING:
    from collections.abc import Mapping

    Unit = tuple[str, str]
    Replica = tuple[str, str, str, bool, tuple[Unit, ...]]
    Message = tuple[str, str]
    Output = tuple[tuple[Replica, ...], tuple[Message, ...]]

ERROR, NOTICE = "error", "notice"
SYSTEM, USER = "system", "user"
# At most this many lines go to /dev/kmsg per run, the last saying how many more there
# were: the kernel drops a writer's lines beyond a burst of 10 (printk_devkmsg=ratelimit).
KMSG_MAX_LINES = 8
KMSG_MAX_BYTES = 900  # one kmsg record holds a little under 1 KiB of text
NULL_DEVICE = (1, 3)  # /dev/null: major, minor
# Deferred messages (a container's boot): the file, and the unit that prints it into the
# journal. Its name cannot be a replica's: those are llmgw-R.target and llmgw-R-X.service.
MESSAGES_FILE = "/run/llmgw-systemd/generator-messages"
MESSAGES_UNIT = "llmgw-systemd-generator.service"


def config_home(env: Mapping[str, str], home: str) -> str:
    """$XDG_CONFIG_HOME, else ~/.config (the XDG base directory rule)."""
    value = env.get("XDG_CONFIG_HOME", "")
    return value if value.startswith("/") else f"{home}/.config"


def llmgw_dir(scope: str, env: Mapping[str, str], home: str) -> str:
    """Where the specs and the node file live: /etc/llmgw, or the user's llmgw folder."""
    return "/etc/llmgw" if scope == SYSTEM else f"{config_home(env, home)}/llmgw"


def cache_file(scope: str, env: Mapping[str, str]) -> str | None:
    """The generator's cache: on /run (a tmpfs, gone at reboot) or in $XDG_RUNTIME_DIR."""
    if scope == SYSTEM:
        return "/run/llmgw-systemd/generator.cache"
    runtime = env.get("XDG_RUNTIME_DIR", "")
    return f"{runtime}/llmgw-systemd/generator.cache" if runtime.startswith("/") else None


def override_dirs(scope: str, env: Mapping[str, str], home: str) -> tuple[str, ...]:
    """Unit directories that take precedence over the generator's normal directory
    (systemd.unit(5) search order, systemd 252), where an admin's unit of the same name
    wins. The runtime control and transient directories hold no units of ours."""
    if scope == SYSTEM:
        return ("/etc/systemd/system", "/run/systemd/system")
    xdg_dirs = [d for d in env.get("XDG_CONFIG_DIRS", "").split(":") if d.startswith("/")]
    dirs = [f"{config_home(env, home)}/systemd/user",
            *(f"{d}/systemd/user" for d in (xdg_dirs or ["/etc/xdg"])),
            "/etc/systemd/user"]
    runtime = env.get("XDG_RUNTIME_DIR", "")
    if runtime.startswith("/"):
        dirs.append(f"{runtime}/systemd/user")
    dirs.append("/run/systemd/user")
    return tuple(dirs)


def node_from_file(text: str, file: str) -> tuple[str | None, str | None]:
    """(node name, None) from the node file's text, or (None, error): one name, blank
    lines and '#' comments ignored."""
    names = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    names = [n for n in names if n]
    if len(names) != 1:
        return None, (f"{file}: expected one node name; got {len(names)}"
                      + (f" ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
                         if names else ""))
    if not is_node_name(names[0]):
        return None, (f"{file}: expected a node's host name (letters, digits, '.', '_', '-'); "
                      f"got '{names[0]}'")
    return names[0], None


def without_overridden(output: Output, present: Mapping[str, str]) -> Output:
    """Drop every replica one of whose units an admin's directory holds (present: unit
    name -> its path there): systemd would load that file instead, so generating the
    rest would mix two sources. Says once per replica which file won."""
    kept: list[Replica] = []
    messages = list(output[1])
    for replica in output[0]:
        winner = next((present[name] for name, _ in replica[4] if name in present), None)
        if winner is None:
            kept.append(replica)
            continue
        messages.append((NOTICE, f"replica {replica[0]} skipped: {winner} takes precedence "
                         "over generated units; keep the replica in one place (its spec, or "
                         "units rendered by llmgw-render)"))
    return tuple(kept), tuple(messages)


def wants_links(output: Output) -> tuple[tuple[str, str], ...]:
    """(folder, target) for every enabled replica: link folder/target -> ../target, the
    enablement a generator gives (systemd.generator(7))."""
    return tuple((f"{wanted_by}.wants", target)
                 for _, target, wanted_by, enable, _ in output[0] if enable)


def log_target(scope: str, journal_stream: str | None, stderr_id: tuple[int, int] | None,
               stderr_is_tty: bool, *, kmsg_is_kernel: bool = True,
               journal_socket: bool = False) -> str:
    """Where messages go: 'journal' (stderr is the journal's stream, so it reads a
    priority prefix), 'kmsg' (a system generator whose stderr is not the journal: at
    early boot no journal runs yet, and journald reads the kernel's log later), else
    'stderr' (a terminal, a test, a user manager). systemd's own generators choose the
    same way (log_setup_generator()). In a container /dev/kmsg leads nowhere (no journald
    reads the kernel's log there; docs/generator.md): then 'journal-socket' when journald
    already listens (a daemon-reload), else 'deferred' (at boot: the messages wait in a
    file that a generated unit prints into the journal once it runs)."""
    if journal_stream and stderr_id is not None:
        device, _, inode = journal_stream.partition(":")
        if device.isdigit() and inode.isdigit() and (int(device), int(inode)) == stderr_id:
            return "journal"
    if scope == SYSTEM and not stderr_is_tty:
        if kmsg_is_kernel:
            return "kmsg"
        return "journal-socket" if journal_socket else "deferred"
    return "stderr"


def kmsg_is_kernel(virtualization: str, device: tuple[int, int] | None) -> bool:
    """Whether writing /dev/kmsg can reach a journal: never in a container (systemd tells
    generators so in $SYSTEMD_VIRTUALIZATION, since 251), nor when it is missing or
    /dev/null (device None, NULL_DEVICE); device: its (major, minor) when it is a
    character device, (0, 0) for anything else that takes writes."""
    return (not virtualization.startswith("container")
            and device is not None and device != NULL_DEVICE)


def log_lines(target: str, messages: tuple[Message, ...], prog: str) -> tuple[str, ...]:
    """The lines to write for the messages, for the given target."""
    priority = {ERROR: 3, NOTICE: 5}
    if target == "kmsg":
        lines = [f"<{priority[level]}>{prog}: {_clip(text)}" for level, text in messages]
        if len(lines) > KMSG_MAX_LINES:
            more = len(lines) - (KMSG_MAX_LINES - 1)
            lines = [*lines[:KMSG_MAX_LINES - 1],
                     f"<3>{prog}: and {more} more; run '{prog} /tmp/llmgw-out' in a "
                     "terminal to see them all"]
        return tuple(lines)
    if target in ("journal", "deferred"):
        return tuple(f"<{priority[level]}>{prog}: {text}" for level, text in messages)
    if target == "journal-socket":  # journald's native protocol: one datagram each
        return tuple(f"PRIORITY={priority[level]}\nSYSLOG_IDENTIFIER={prog}\n"
                     f"MESSAGE={prog}: {_one_line(text)}\n" for level, text in messages)
    return tuple(f"{prog}: {level}: {text}" for level, text in messages)


def _one_line(text: str) -> str:
    # a field of the native protocol ends at a newline (a file name may hold one)
    return "".join(c if c >= " " else f"\\x{ord(c):02x}" for c in text)


def messages_unit(prog: str, header: str) -> tuple[str, str]:
    """(file name, text) of the unit that prints deferred messages into the journal at
    boot, under the generator's own name: `journalctl -b -t llmgw-systemd-generator`."""
    return MESSAGES_UNIT, (
        f"{header}\n[Unit]\n"
        f"Description={prog}: what it said about the specs at boot\n"
        f"Documentation=man:{prog}(8)\n"
        f"ConditionPathExists={MESSAGES_FILE}\n\n"
        "[Service]\nType=oneshot\n"
        f"ExecStart=/usr/bin/cat {MESSAGES_FILE}\n"
        f"SyslogIdentifier={prog}\n")


def _clip(text: str) -> str:
    data = text.encode("utf-8", "replace")
    if len(data) <= KMSG_MAX_BYTES:
        return text
    return data[:KMSG_MAX_BYTES].decode("utf-8", "ignore") + "..."
