"""The naming rules every reader shares, import-free (pure): which files in a spec folder
are specs, and what a node name may be. The generator's fast path uses them before it
has imported anything else (docs/generator.md), the spec reader and the peer client
after; so each rule is written once, here."""

SPEC_SUFFIXES = (".yaml", ".yml")
_NODE_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
MAX_NODE_NAME = 253  # a host name's length at most
# Every member service carries the digest of its replica's units (units/plan.py,
# spec_digest) in this variable: its supervisor reads it from the unit, a rank's
# rendezvous wait from its own environment, an apply from the engine process's
DIGEST_VAR = "LLMGW_SPEC_DIGEST"
DIGEST_SHOWN = 8  # hex digits of a digest in a line for people: enough to tell versions apart
# The two units that restart a shard, llmgw-R-restart.service and llmgw-R-relaunch.service
# (units/plan.py): no command of a rank may be named so, or its unit would be one of them.
RESTART_UNITS = ("restart", "relaunch")


def is_spec_file(name: str) -> bool:
    """*.yaml and *.yml, not hidden: the one rule for every reader of a spec folder."""
    return name.endswith(SPEC_SUFFIXES) and not name.startswith(".")


def is_node_name(text: str) -> bool:
    """A node's host name: letters, digits, '.', '_', '-', starting and ending with a
    letter or digit, at most MAX_NODE_NAME characters."""
    return (0 < len(text) <= MAX_NODE_NAME and all(c in _NODE_CHARS for c in text)
            and text[0] not in "_.-" and text[-1] not in "_.-")

_WORD_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-")
MAX_REPLICA_NAME = 63  # a replica name is part of every unit name; a DNS label's length


def is_word(text: str) -> bool:
    """A name that becomes part of unit names (replicas, commands): lowercase letters,
    digits and '-', not first; such names need no escaping in a unit name."""
    return bool(text) and all(c in _WORD_CHARS for c in text) and text[0] != "-"


def is_replica_name(text: str) -> bool:
    return is_word(text) and len(text) <= MAX_REPLICA_NAME
