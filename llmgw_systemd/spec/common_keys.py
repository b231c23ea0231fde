"""The keys every engine has, one row each (pure): with each engine's own table
(spec/engines/) the whole of what a replica may say. The reader reads them only through
these rows; the README's tables come from them (scripts/manpages.py)."""

from __future__ import annotations

import re
from typing import Any

from llmgw_systemd.spec.document import KeyPath
from llmgw_systemd.spec.endpoint import is_host
from llmgw_systemd.spec.engines.table import ENGINES
from llmgw_systemd.spec.keys import (
    REQUIRED,
    Key,
    absolute_path,
    boolean,
    matching,
    seconds,
    shown_mapping,
)
from llmgw_systemd.spec.model import Node
from llmgw_systemd.spec.names import MAX_REPLICA_NAME, is_node_name, is_word
from llmgw_systemd.spec.policies import (
    DRAIN,
    EXIT_GRACE,
    GROUP_RESTART_KEYS,
    HEALTH_KEYS,
    RESTART_KEYS,
    STOP_MARGIN,
    DrainPolicy,
    GroupRestartPolicy,
    HealthCheck,
    RestartPolicy,
    read_group_restart,
    read_health,
    read_restart,
)
from llmgw_systemd.spec.reader import Reader, did_you_mean, kind

ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
USER_RE = re.compile(r"[a-z_][a-z0-9_-]{0,30}\$?\Z|[0-9]{1,10}\Z")
GPU_RE = re.compile(r"[0-9]+\Z|(GPU|MIG)-[A-Za-z0-9/-]+\Z")
# Environment variable names that say "this is a secret": such values belong in
# environment_file (root-only) because unit files are world-readable.
SECRET_NAME_RE = re.compile(r"TOKEN|SECRET|PASSW(OR)?D|API_?KEY|CREDENTIAL|PRIVATE_?KEY", re.I)
# Linux interface names: at most 15 bytes, no '/', ':' or white space (dev_valid_name).
IFNAME_RE = re.compile(r"[A-Za-z0-9_@.+-]{1,15}\Z")
# Set by the planner for every engine, from common keys.
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
GPUS_VAR = "CUDA_VISIBLE_DEVICES"
NO_ENV: tuple[tuple[str, str], ...] = ()
NO_GPUS: tuple[str, ...] = ()


def read_replica_name(reader: Reader, value: Any, path: KeyPath) -> str:
    name = reader.matching(value, path, is_word, "a replica name of lowercase letters, "
                           "digits and '-', starting with a letter or digit (it becomes "
                           "part of unit names)")
    if len(name) > MAX_REPLICA_NAME:
        raise reader.fail(path, f"expected a replica name of at most {MAX_REPLICA_NAME} "
                          f"characters (it becomes part of unit names); got {len(name)}")
    return name


def read_env(reader: Reader, value: Any, path: KeyPath) -> tuple[tuple[str, str], ...]:
    """NAME: value pairs; names that look like secrets are refused."""
    if not isinstance(value, dict):
        raise reader.fail(path, f"expected a mapping of NAME: value; got {kind(value)}")
    out: list[tuple[str, str]] = []
    for key, item in value.items():
        kpath = (*path, key)
        if not ENV_NAME_RE.match(key):
            raise reader.fail(kpath, f"expected an environment variable name "
                              f"([A-Za-z_][A-Za-z0-9_]*); got '{key}'", at_key=True)
        if SECRET_NAME_RE.search(key):
            raise reader.fail(kpath, f"'{key}' looks like a secret, and unit files are "
                              "world-readable; put it in environment_file instead",
                              at_key=True)
        if isinstance(item, bool) or not isinstance(item, (str, int, float)):
            raise reader.fail(kpath, f"expected a string value; got {kind(item)}"
                              + (" (quote it: 'true')" if isinstance(item, bool) else ""))
        out.append((key, item if isinstance(item, str) else str(item)))
    return tuple(out)


NODE_KEYS = (
    Key("name", matching(is_node_name, "a node's host name (letters, digits, '.', '_', "
                         "'-')"), REQUIRED, "what --node matches"),
    Key("address", matching(is_host, "an IP address or host name"),
        REQUIRED, "what peers dial"),
    Key("interface", matching(IFNAME_RE, "a network interface name (at most 15 characters, "
                              "no '/', ':' or spaces)"), None, "the NIC for collectives"),
    Key("env", read_env, NO_ENV, "this node's own environment"),
)

_NODE_NAME, _ADDRESS, _INTERFACE, _NODE_ENV = NODE_KEYS


def read_nodes(reader: Reader, value: Any, path: KeyPath) -> tuple[Node, ...]:
    items = reader.sequence(value, path, "nodes (rank = position, rank 0 leads)", min_len=1)
    nodes: list[Node] = []
    seen_names: dict[str, int] = {}
    seen_addresses: dict[str, int] = {}
    allowed = tuple(k.name for k in NODE_KEYS)
    required = tuple(k.name for k in NODE_KEYS if k.required)
    for rank, item in enumerate(items):
        npath = (*path, rank)
        data = reader.mapping(item, npath, allowed, required)
        node = Node(_NODE_NAME.read(reader, data, npath), _ADDRESS.read(reader, data, npath),
                    _INTERFACE.read(reader, data, npath), _NODE_ENV.read(reader, data, npath))
        if node.name in seen_names:
            raise reader.fail((*npath, "name"), f"duplicate node name '{node.name}' (already "
                              f"rank {seen_names[node.name]} of this replica)")
        if node.address in seen_addresses:
            raise reader.fail((*npath, "address"), f"duplicate address '{node.address}' "
                              f"(already rank {seen_addresses[node.address]} of this replica)")
        seen_names[node.name] = rank
        seen_addresses[node.address] = rank
        nodes.append(node)
    return tuple(nodes)


def read_gpus(reader: Reader, value: Any, path: KeyPath) -> tuple[str, ...]:
    items = reader.sequence(value, path, "GPU indexes or UUIDs")
    out: list[str] = []
    for i, item in enumerate(items):
        text = str(item) if isinstance(item, int) and not isinstance(item, bool) else item
        text = reader.matching(text, (*path, i), GPU_RE, "a GPU index (0, 1, ...) or UUID")
        if text in out:
            raise reader.fail((*path, i), f"GPU {text} is listed twice")
        out.append(text)
    return tuple(out)


NAME = Key("name", read_replica_name, REQUIRED, "replica name; part of every unit name")
def read_engine(reader: Reader, value: Any, path: KeyPath) -> str:
    return reader.choice(value, path, tuple(ENGINES))  # the table as it is now


ENGINE = Key("engine", read_engine, REQUIRED, "which engine runs it: "
             + ", ".join(f"`{e}`" for e in ENGINES))
ENABLE = Key("enable", boolean("whether the replica starts at boot"), False,
             "start at boot: the generator links the target into `multi-user.target.wants`; "
             "`llmgw-render --apply` enables and starts it. Without `--apply`, "
             "`llmgw-render` only accepts the key.")
NODES = Key("nodes", read_nodes, REQUIRED,
            "list of `{name, address, interface, env}`; `name` is what `--node` matches (the "
            "host name by default), `address` what peers dial (an IP address or DNS name; "
            "vLLM needs IPs). Rank = position; rank 0 leads. `interface` (optional) is the "
            "node's NIC for collective traffic, set as `GLOO_SOCKET_IFNAME` and "
            "`NCCL_SOCKET_IFNAME` on that node only: without it gloo binds whatever the host "
            "name resolves to (often 127.0.0.1) and a cross-node start fails with `Gloo "
            "connectFullMesh failed`. `env` (optional) is that node's own environment, which "
            "wins over the replica's.")
RENDEZVOUS_TIMEOUT = Key("rendezvous_timeout", seconds(1, 86400), 300,
                         "seconds a rank waits for the rendezvous point before its shard "
                         "fails (and retries under `restart`)")
PORT_RELEASE_TIMEOUT = Key("port_release_timeout", seconds(0, 3600), 30,
                           "seconds a command that binds a port waits for it to be free "
                           "before failing")
GPUS = Key("gpus", read_gpus, NO_GPUS, "GPU indexes or UUIDs, set as `CUDA_VISIBLE_DEVICES`")
ENV = Key("env", read_env, NO_ENV, "extra environment; names that look like secrets "
          "(`*TOKEN*`, `*SECRET*`, `*API_KEY*`, ...) are refused, because unit files are "
          "world-readable; so are the variables the units set themselves")
ENVIRONMENT_FILE: Key[str | None] = Key(
    "environment_file", absolute_path("an environment file"), None,
    "absolute path of a root-only `KEY=value` file (`EnvironmentFile=`): put `HF_TOKEN`, "
    "`VLLM_API_KEY` there")
STOP_TIMEOUT: Key[int | None] = Key(
    "stop_timeout", seconds(1, 86400), None,
    "`TimeoutStopSec=` of every member. A planned stop's drain (`drain`), the engine's "
    f"own exit and then the SIGKILL of what is left fit in it: by default it is "
    f"`drain.delay + drain.timeout + {EXIT_GRACE + STOP_MARGIN}` ({EXIT_GRACE} s for the "
    f"engine to exit after its drain, {STOP_MARGIN} for the kill); set, it must be at "
    f"least `drain.delay + drain.timeout + {STOP_MARGIN}`, and `llmgw-stop-group` SIGKILLs "
    "what is left inside it. A failure's stop (a member died, the supervisor's group "
    "restart) SIGKILLs at once.",
    shown=f"drain.delay + drain.timeout + {EXIT_GRACE + STOP_MARGIN} "
          f"({DrainPolicy().stop_budget})")
# The service account both packages create (packaging/sysusers); root only when said.
SERVICE_ACCOUNT = "llmgw"
ROOT_USERS = ("root", "0")
USER = Key("user", matching(USER_RE, "a user name ([a-z_][a-z0-9_-]*) or numeric UID"),
           SERVICE_ACCOUNT, "`User=` of every unit: the service account the packages "
           "create. `root` only when the spec says so, and llmgw-render then says so too: "
           "a model with `trust_remote_code`, a pickle in a checkpoint or a bug in the "
           "engine's HTTP server would own the node.")
GROUP: Key[str | None] = Key(
    "group", matching(USER_RE, "a group name ([a-z_][a-z0-9_-]*) or numeric GID"), None,
    "`Group=` of every unit", shown="the user's own")


def read_groups(reader: Reader, value: Any, path: KeyPath) -> tuple[str, ...]:
    items = reader.sequence(value, path, "group names")
    out = tuple(reader.matching(item, (*path, i), USER_RE, "a group name or numeric GID")
                for i, item in enumerate(items))
    for i, name in enumerate(out):
        if name in out[:i]:
            raise reader.fail((*path, i), f"group {name} is listed twice")
    return out


NO_GROUPS: tuple[str, ...] = ()
SUPPLEMENTARY_GROUPS = Key(
    "supplementary_groups", read_groups, NO_GROUPS, "`SupplementaryGroups=` of every unit: "
    "GPU nodes often give their device nodes to `video` or `render`")


def read_paths(reader: Reader, value: Any, path: KeyPath) -> tuple[str, ...]:
    items = reader.sequence(value, path, "absolute paths")
    return tuple(reader.abs_path(item, (*path, i), "a folder the units may write")
                 for i, item in enumerate(items))


NO_PATHS: tuple[str, ...] = ()
READ_WRITE_PATHS = Key(
    "read_write_paths", read_paths, NO_PATHS, "folders the units may write beyond their "
    "own state and cache directories (`ReadWritePaths=`), e.g. a model download folder; "
    "everything else is read-only to them")
# Device groups systemd resolves from /proc/devices when a unit starts (DeviceAllow=
# char-NAME), and nodes: taken from the NVIDIA and RDMA drivers' documentation and from
# nixpkgs' GPU services; no GPU or HCA here to check them on (docs/hardening.md).
DEVICE_SETS: dict[str, tuple[str, ...]] = {
    "nvidia": ("char-nvidiactl", "char-nvidia-frontend", "char-nvidia-uvm",
               "char-nvidia-caps", "/dev/nvidia-modeset"),
    "rdma": ("char-infiniband_verbs", "char-infiniband_mad", "/dev/infiniband/rdma_cm"),
}
NO_DEVICES = "none"


def read_devices(reader: Reader, value: Any, path: KeyPath) -> tuple[str, ...]:
    """Device sets and /dev paths, or `none` alone."""
    items = reader.sequence(value, path, "device sets or /dev paths", min_len=1)
    out: list[str] = []
    for i, item in enumerate(items):
        text = reader.string(item, (*path, i), "a device set or a /dev path")
        if text == NO_DEVICES:
            if len(items) > 1:
                raise reader.fail((*path, i), "'none' stands alone: no device at all")
        elif text.startswith("/"):
            reader.abs_path(text, (*path, i), "a device node")
            if not text.startswith("/dev/"):
                raise reader.fail((*path, i), f"expected a device node under /dev; got "
                                  f"'{text}'")
        elif text not in DEVICE_SETS:
            raise reader.fail((*path, i), f"expected one of {', '.join(DEVICE_SETS)}, none, "
                              f"or a /dev path; got '{text}'"
                              f"{did_you_mean(text, tuple(DEVICE_SETS))}")
        if text in out:
            raise reader.fail((*path, i), f"'{text}' is listed twice")
        out.append(text)
    return tuple(out)


DEFAULT_DEVICES: tuple[str, ...] = ("nvidia",)
DEVICES = Key("devices", read_devices, DEFAULT_DEVICES,
              "the devices the units may open (`DevicePolicy=closed`, `DeviceAllow=`): "
              "`nvidia` (the control, UVM and capability devices and every GPU node), "
              "`rdma` (`/dev/infiniband`), explicit `/dev` paths, or `none` for a CPU-only "
              "replica; the usual pseudo-devices (`/dev/null`, `/dev/urandom`, ...) always",
              shown="`[nvidia]`")
HARDENING = Key("hardening", boolean("whether the units run in their sandbox"), True,
                "`off`: no sandbox for this replica's units (the service account stays); "
                "for one option a site must loosen, a drop-in is better "
                "(`systemctl edit llmgw-R-engine.service`, docs/hardening.md)", shown="`on`")
RESTART = Key("restart", read_restart, RestartPolicy(),
              "a dead member restarts the shard after `delay` s (at least 1); at most "
              "`burst` starts within `interval` s, then the shard stays failed. `interval` "
              "must exceed `burst x delay` or the budget could never run out.",
              shown=shown_mapping(RESTART_KEYS))
GROUP_RESTART = Key("group_restart", read_group_restart, GroupRestartPolicy(),
                    "how the supervisor restarts the ranks that follow a dead leader (see the "
                    "supervisor above)", shown=shown_mapping(GROUP_RESTART_KEYS))
HEALTH = Key("health", read_health, HealthCheck(),
             "the supervisor's checks (see above); `generation: {interval: 30, timeout: 10}` "
             "(or `true`) adds a one-token completion of the serving rank (`POST "
             "/v1/completions`, `max_tokens: 1`, the served model name): the rank is ready "
             "only while one succeeded for its current start within interval + 2 x timeout + "
             "1 s (a result is stamped when its check began). Turn "
             "it on for multi-node vLLM with mp, whose `/health` stays 200 after a peer died "
             "until a request fails, and wherever a hung engine must not count as ready; it "
             "costs one token per interval. `stall_after` (s, 0: off): the serving rank's "
             "engine with work pending and not one step for that long (read from its "
             "metrics: vLLM's, SGLang's with `--enable-metrics`, a command engine's "
             "`progress`) restarts the replica as a group; one still stepping while the "
             "one-token check times out behind real work stays ready, `busy` "
             "(docs/supervisor.md, \"Stalls\"). `timeouts`: health probes in a row that "
             "may time out before a serving rank that answered counts as down when its "
             "metrics cannot tell; one refused, reset or 5xx counts at once, one slow "
             "while its engine took no step counts at once, and one slow while its engine "
             "stepped never counts (`busy`: docs/supervisor.md, \"Slow is not down\").",
             shown=shown_mapping(HEALTH_KEYS))

COMMON_KEYS: tuple[Key[Any], ...] = (
    NAME, ENGINE, ENABLE, NODES, RENDEZVOUS_TIMEOUT, PORT_RELEASE_TIMEOUT, GPUS, ENV,
    ENVIRONMENT_FILE, STOP_TIMEOUT, USER, GROUP, SUPPLEMENTARY_GROUPS, READ_WRITE_PATHS,
    DEVICES, HARDENING, RESTART, GROUP_RESTART, HEALTH, DRAIN)
COMMON_KEY_NAMES = tuple(k.name for k in COMMON_KEYS)
