"""llmgw-systemd-generator NORMAL_DIR [EARLY_DIR LATE_DIR]: this node's units from the
spec folder, at every boot and every daemon-reload (systemd.generator(7);
docs/generator.md). The I/O shell; fast_path.py and slow_path.py decide.

Fast path: when the spec files, the node, this installation and the scope are byte for
byte those the cache was made from, it writes the cached units, having imported only
os, sys, marshal, fast_path.py and spec/names.py. Otherwise it renders through
slow_path.py and
refreshes the cache. The launcher starts Python with -S (site's .pth files can cost
more than the whole fast path) and names the package directories itself. Whichever
path, an admin's unit of the same name wins, and nothing is written but the output and
the cache.
"""

from __future__ import annotations

import marshal
import os
import stat  # os has imported it already: free on the fast path
import sys

from llmgw_systemd import __version__
from llmgw_systemd.generator import fast_path as g
from llmgw_systemd.spec.names import is_node_name, is_spec_file

TYPE_CHECKING = False  # mypy reads this name as true
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from llmgw_systemd.generator.fast_path import Output

    Key = tuple[object, ...]  # see cache_key()

PROG = "llmgw-systemd-generator"
WAIT_FOR_PORT = "llmgw-wait-for-port"
KMSG = "/dev/kmsg"
JOURNAL_SOCKET = "/run/systemd/journal/socket"  # journald's native protocol
# Bump when the cache's layout changes; the key also holds this installation's files'
# identities and the interpreter's version (marshal's format can change with it).
CACHE_FORMAT = 1
# llmgw_systemd/, two levels up from this file: the cache key covers all of it.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["--version"]:
        sys.stdout.write(f"{PROG} {__version__}\n")
        return 0
    if len(args) not in (1, 3) or any(not a.startswith("/") for a in args):
        sys.stderr.write(f"usage: {PROG} NORMAL_DIR [EARLY_DIR LATE_DIR] (absolute paths; "
                         "systemd runs it at boot and at every daemon-reload)\n")
        return 2
    env = os.environ
    scope = g.USER if env.get("SYSTEMD_SCOPE") == g.USER else g.SYSTEM
    messages, status = run(args[0], scope, env)
    emit(messages, scope, env, args[0])
    return status


def run(normal: str, scope: str, env: Mapping[str, str]) -> tuple[tuple[g.Message, ...], int]:
    """Generate into normal; returns the messages to log and the exit status."""
    home = env.get("HOME", "") or os.path.expanduser("~")
    base = g.llmgw_dir(scope, env, home)
    spec_dir = f"{base}/replicas.d"
    try:
        names = sorted(n for n in os.listdir(spec_dir) if is_spec_file(n))
    except FileNotFoundError:
        return (), 0  # no specs here: this node uses the generator for nothing
    except OSError as exc:
        return ((g.ERROR, f"cannot read {spec_dir}: {exc.strerror}"),), 0
    if not names:
        return (), 0
    node, problem = node_name(base)
    if node is None:
        return ((g.ERROR, f"{problem}; nothing generated"),), 0
    bindir = os.path.dirname(os.path.realpath(sys.argv[0]))
    helper = f"{bindir}/{WAIT_FOR_PORT}"
    if not os.access(helper, os.X_OK):
        return ((g.ERROR, f"cannot find {WAIT_FOR_PORT} beside {bindir}/{PROG} (its own "
                 "installation); nothing generated"),), 0
    contents = tuple((f"{spec_dir}/{n}", read_or_none(f"{spec_dir}/{n}")) for n in names)
    key = cache_key(scope, bindir, node, contents)
    cache = g.cache_file(scope, env)
    output = load_cache(cache, key) if cache else None
    if output is None:
        output = render(contents, node, scope, helper, spec_dir)
        if cache and all(raw is not None for _, raw in contents):
            save_cache(cache, key, output)
    output = g.without_overridden(output, present(g.override_dirs(scope, env, home), output))
    try:
        write_output(normal, output)
    except OSError as exc:
        return (*output[1], (g.ERROR, f"cannot write into {normal}: {exc}")), 1
    return output[1], 0


def node_name(base: str) -> tuple[str | None, str | None]:
    """The node file's name when the file exists, else this machine's host name."""
    path = f"{base}/node"
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(4096)
    except FileNotFoundError:
        host = os.uname().nodename
        if is_node_name(host):
            return host, None
        return None, f"this machine's host name '{host}' is not a node name; write it to {path}"
    except OSError as exc:
        return None, f"cannot read {path}: {exc.strerror}"
    return g.node_from_file(text, path)


def read_or_none(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def cache_key(scope: str, bindir: str, node: str,
              contents: tuple[tuple[str, bytes | None], ...]) -> Key:
    """Everything the output depends on: the inputs themselves, compared byte for byte
    (cheaper than hashing them, and no hash module to import)."""
    return (CACHE_FORMAT, __version__, sys.version, scope, bindir, node, installation(),
            contents)


def installation() -> tuple[tuple[str, int, int, int, int], ...]:
    """The identity of every file of the whole package (llmgw_systemd/, every subpackage,
    the templates), not only of this folder: a reinstall or an edited module (even of the
    same version) makes a new key. Byte code caches are left out: Python rewrites them as
    it pleases."""
    out = []
    folders = [PACKAGE_ROOT]
    while folders:
        folder = folders.pop()
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        if entry.name != "__pycache__":
                            folders.append(entry.path)
                    elif entry.is_file(follow_symlinks=False):
                        st = entry.stat(follow_symlinks=False)
                        out.append((entry.path, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                                    st.st_ino))
        except OSError:
            continue
    out.sort()
    return tuple(out)


def load_cache(path: str, key: Key) -> Output | None:
    """The cached output when the cache was made from exactly these inputs. Only a file
    that no one else can have written is read: marshal is not for untrusted bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not (_private(os.fstat(fd)) and _private(os.stat(os.path.dirname(path)))):
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            record = marshal.loads(f.read())  # noqa: S302 - ours alone, checked above
    except (OSError, EOFError, ValueError, TypeError):
        return None
    finally:
        os.close(fd)
    if not (isinstance(record, tuple) and len(record) == 2 and record[0] == key):
        return None
    output = record[1]
    return output if _is_output(output) else None


def _private(st: os.stat_result) -> bool:
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _is_output(value: object) -> bool:
    if not (isinstance(value, tuple) and len(value) == 2):
        return False
    replicas, messages = value
    return (isinstance(replicas, tuple) and isinstance(messages, tuple)
            and all(isinstance(r, tuple) and len(r) == 5 for r in replicas)
            and all(isinstance(m, tuple) and len(m) == 2 for m in messages))


def save_cache(path: str, key: Key, output: Output) -> None:
    """Best effort: a cache that cannot be written only costs the next run time."""
    folder = os.path.dirname(path)
    temp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        if not _private(os.stat(folder)):
            return
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(marshal.dumps((key, output)))  # type: ignore[arg-type]  # plain data
        os.replace(temp, path)
    except (OSError, ValueError):
        import contextlib

        with contextlib.suppress(OSError):
            os.unlink(temp)


def render(contents: tuple[tuple[str, bytes | None], ...], node: str, scope: str,
           helper: str, spec_dir: str) -> Output:
    """The slow path: the spec rules and templates, with yaml and jinja2. The launcher
    names the installation's package directories, where they usually are; only when
    they are elsewhere does this pay for site and its .pth files."""
    # A run of a few hundred milliseconds whose garbage reference counting frees: the
    # cyclic collector would only walk the objects of every import (yaml, jinja2, our
    # dataclasses) again and again, as in llmgw-render (cli._run).
    import gc

    gc.disable()
    try:
        from llmgw_systemd.generator.slow_path import generate
    except ImportError:
        if not sys.flags.no_site:
            raise
        import site

        site.main()
        from llmgw_systemd.generator.slow_path import generate
    from llmgw_systemd.units.plan import Manager

    return generate(contents, node, Manager(user=scope == g.USER, wait_for_port=helper),
                    spec_dir)


def present(dirs: Sequence[str], output: Output) -> dict[str, str]:
    """Unit name -> the admin's file of that name in the directories that take
    precedence, for the units about to be generated."""
    wanted = {name for replica in output[0] for name, _ in replica[4]}
    found: dict[str, str] = {}
    for folder in dirs:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in wanted.intersection(names):
            found.setdefault(name, f"{folder}/{name}")
    return found


def write_output(normal: str, output: Output) -> None:
    """Every unit into normal (each by rename, so a crash leaves no half-written unit),
    then the .wants links of enabled replicas."""
    os.makedirs(normal, mode=0o755, exist_ok=True)
    pid = os.getpid()
    for replica in output[0]:
        for name, text in replica[4]:
            temp = f"{normal}/.{name}.{pid}.tmp"
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o644)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(temp, f"{normal}/{name}")
    for folder, target in g.wants_links(output):
        os.makedirs(f"{normal}/{folder}", mode=0o755, exist_ok=True)
        link = f"{normal}/{folder}/{target}"
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(f"../{target}", link)


def emit(messages: tuple[g.Message, ...], scope: str, env: Mapping[str, str],
         normal: str) -> None:
    if scope == g.SYSTEM:
        _unlink_quietly(g.MESSAGES_FILE)  # what an earlier run deferred is said already
    if not messages:
        return
    try:
        st = os.fstat(2)
        stderr_id: tuple[int, int] | None = (st.st_dev, st.st_ino)
        tty = os.isatty(2)
    except OSError:
        stderr_id, tty = None, False
    try:
        kmsg = os.stat(KMSG)
        device: tuple[int, int] | None = (
            (os.major(kmsg.st_rdev), os.minor(kmsg.st_rdev))
            if stat.S_ISCHR(kmsg.st_mode) else (0, 0))
    except OSError:
        device = None
    target = g.log_target(scope, env.get("JOURNAL_STREAM"), stderr_id, tty,
                          kmsg_is_kernel=g.kmsg_is_kernel(
                              env.get("SYSTEMD_VIRTUALIZATION", ""), device),
                          journal_socket=os.path.exists(JOURNAL_SOCKET))
    lines = g.log_lines(target, messages, PROG)
    if target == "journal-socket" and _to_journal(lines):
        return
    if target == "deferred" and _defer(lines, normal):
        return
    if target == "kmsg":
        try:
            fd = os.open(KMSG, os.O_WRONLY | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError:
            lines = g.log_lines("stderr", messages, PROG)
        else:
            try:
                for line in lines:  # one write per record
                    os.write(fd, f"{line}\n".encode("utf-8", "replace"))
            except OSError:
                pass
            finally:
                os.close(fd)
            return
    try:
        sys.stderr.write("".join(f"{line}\n" for line in lines))
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _to_journal(datagrams: tuple[str, ...]) -> bool:
    """Each message to journald's native socket; False if it could not be reached."""
    import socket

    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            for datagram in datagrams:
                sock.sendto(datagram.encode("utf-8", "replace"), JOURNAL_SOCKET)
    except OSError:
        return False
    return True


def _defer(lines: tuple[str, ...], normal: str) -> bool:
    """The messages into a file on /run, and a unit in the generator's output that prints
    it into the journal once journald runs (a container's boot: nothing reads its
    /dev/kmsg). False if either could not be written."""
    from llmgw_systemd.units.header import BY_GENERATOR, MARKER

    name, text = g.messages_unit(PROG, f"{MARKER}\n{BY_GENERATOR}")
    try:
        folder = os.path.dirname(g.MESSAGES_FILE)
        os.makedirs(folder, mode=0o700, exist_ok=True)
        fd = os.open(g.MESSAGES_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8", errors="replace") as f:
            f.write("".join(f"{line}\n" for line in lines))
        write_output(normal, ((("messages", name, "multi-user.target", True,
                                ((name, text),)),), ()))
    except OSError:
        return False
    return True


def _unlink_quietly(path: str) -> None:
    # not contextlib.suppress: this runs on the fast path, which imports nothing more
    try:  # noqa: SIM105
        os.unlink(path)
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
