"""The spec's nested policies (pure): restart, group_restart, health and drain, each a frozen
record beside the rows of its keys. A field's default is its row's default, so each
number is written once; the README shows them from the same rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmgw_systemd.spec.document import KeyPath
from llmgw_systemd.spec.keys import Key, integer, read_all, seconds, shown_mapping
from llmgw_systemd.spec.reader import Reader

# -- restart: systemd's own restarts of a shard's members -------------------------------

RESTART_KEYS = (
    Key("delay", seconds(1, 86400, "seconds between a failure and the restart"), 10,
        "RestartSec= of every member"),
    Key("burst", integer(1, 1000, "starts allowed within the interval"), 5,
        "StartLimitBurst="),
    Key("interval", seconds(1, 604800, "an interval in seconds"), 1200,
        "StartLimitIntervalSec="),
)
_DELAY, _BURST, _INTERVAL = RESTART_KEYS


@dataclass(frozen=True)
class RestartPolicy:
    """Restart=always after delay seconds; at most burst starts per interval."""

    delay: int = _DELAY.default
    burst: int = _BURST.default
    interval: int = _INTERVAL.default


def read_restart(reader: Reader, value: Any, path: KeyPath) -> RestartPolicy:
    policy = RestartPolicy(**read_all(reader, RESTART_KEYS, value, path))
    # burst starts need at least burst x delay seconds: with a shorter interval the
    # budget can never run out and a crash-looping shard restarts forever.
    if policy.interval <= policy.burst * policy.delay:
        raise reader.fail(path, f"restart.interval ({policy.interval} s) must be longer than "
                          f"burst x delay ({policy.burst} x {policy.delay} s), or the restart "
                          "budget never runs out")
    return policy


# -- group_restart: the supervisor's restarts of every rank together --------------------

GROUP_RESTART_KEYS = (
    Key("delay", seconds(0, 604800, "seconds before the first group restart"), 5,
        "the backoff before the first group restart in a window"),
    Key("max_delay", seconds(0, 604800, "the longest backoff in seconds"), 300,
        "the longest backoff"),
    Key("budget", integer(0, 604800, "group restarts allowed in the window"), 5,
        "group restarts allowed within the window"),
    Key("window", seconds(1, 604800, "a window in seconds"), 3600, "the budget's window"),
)
_G_DELAY, _G_MAX_DELAY, _G_BUDGET, _G_WINDOW = GROUP_RESTART_KEYS


@dataclass(frozen=True)
class GroupRestartPolicy:
    """A replica's group_restart (the supervisor's, health/group_restart.py): the delay
    before the nth restart in a window is delay x 2^(n-1), at most max_delay; at most
    budget restarts within window seconds. Here, not there: the render path reads it and
    need not import the supervisor's rules."""

    delay: int = _G_DELAY.default
    max_delay: int = _G_MAX_DELAY.default
    budget: int = _G_BUDGET.default
    window: int = _G_WINDOW.default


def read_group_restart(reader: Reader, value: Any, path: KeyPath) -> GroupRestartPolicy:
    policy = GroupRestartPolicy(**read_all(reader, GROUP_RESTART_KEYS, value, path))
    if policy.max_delay < policy.delay:
        raise reader.fail((*path, "max_delay"), f"expected at least delay ({policy.delay} s); "
                          f"got {policy.max_delay}")
    return policy


# -- health: how the supervisor judges the shards ----------------------------------------

GENERATION_KEYS = (
    Key("interval", seconds(1, 86400, "seconds between one-token completions"), 30,
        "seconds between one-token completions"),
    Key("timeout", seconds(1, 600, "a completion timeout in seconds"), 10,
        "how long a one-token completion may take"),
)
_GEN_INTERVAL, _GEN_TIMEOUT = GENERATION_KEYS


@dataclass(frozen=True)
class GenerationCheck:
    """A one-token completion asked of the serving rank, because /health can stay 200
    while generation fails (a dead mp peer, a lost Ray worker: docs/engines.md)."""

    interval: int = _GEN_INTERVAL.default
    timeout: int = _GEN_TIMEOUT.default


def read_generation(reader: Reader, value: Any, path: KeyPath) -> GenerationCheck | None:
    """`true` (the defaults), `false` (off), or {interval, timeout}."""
    if value is True or value is False:
        return GenerationCheck() if value else None
    return GenerationCheck(**read_all(reader, GENERATION_KEYS, value, path))


def read_probe_path(reader: Reader, value: Any, path: KeyPath) -> str:
    text = reader.string(value, path, "an HTTP path such as /health")
    if not text.startswith("/") or any(c in text for c in " ?#"):
        raise reader.fail(path, f"expected an HTTP path such as /health; got '{text}'")
    return text


HEALTH_KEYS = (
    Key("path", read_probe_path, "/health", "the serving rank's health endpoint"),
    Key("interval", seconds(1, 3600, "seconds between probes"), 5, "seconds between probes"),
    Key("timeout", seconds(1, 600, "a probe timeout in seconds"), 2, "a probe's timeout"),
    Key("timeouts", integer(1, 100, "a count of probes"), 3,
        "probes in a row that time out before a serving rank that answered counts as down "
        "when its metrics cannot tell (one refused, reset or 5xx is enough, and so is one "
        "slow while its engine took no step; one slow while its engine stepped never "
        "counts: busy, not down)"),
    Key("stability", seconds(0, 86400, "seconds a non-serving rank must stay up"), 30,
        "seconds a non-serving rank must stay up to count as ready"),
    Key("generation", read_generation, None, "the one-token completion check"),
    Key("stall_after", seconds(0, 86400, "seconds, or 0 for off"), 120,
        "seconds with work pending and not one engine step (read from the serving rank's "
        "metrics) before the replica counts as stalled and restarts as a group; also how "
        "long a failing generation check with the metrics unreadable may last. 0: off"),
)
(_PATH, _H_INTERVAL, _H_TIMEOUT, _H_TIMEOUTS, _STABILITY, _GENERATION,
 _STALL_AFTER) = HEALTH_KEYS


@dataclass(frozen=True)
class HealthCheck:
    """How the supervisor judges the shards: the serving rank's HTTP probe, and how long
    a non-serving rank must stay up before it counts as ready."""

    path: str = _PATH.default
    interval: int = _H_INTERVAL.default
    timeout: int = _H_TIMEOUT.default
    timeouts: int = _H_TIMEOUTS.default  # slow is not down: health/judge.py, slow_probe
    stability: int = _STABILITY.default
    generation: GenerationCheck | None = _GENERATION.default
    stall_after: int = _STALL_AFTER.default  # 0: off (health/progress.py)


def read_health(reader: Reader, value: Any, path: KeyPath) -> HealthCheck:
    return HealthCheck(**read_all(reader, HEALTH_KEYS, value, path))


# -- drain: a planned stop or restart takes the replica out of rotation first ------------

DRAIN_KEYS = (
    Key("delay", seconds(0, 3600, "seconds out of rotation before any process is "
                         "signalled"), 5,
        "seconds every supervisor reports the replica `draining` (not routable) before any "
        "process of a planned stop gets a signal: a gateway checking every 1-2 s has "
        "taken it out by then"),
    Key("timeout", seconds(0, 86400, "seconds the requests in flight may take to finish"),
        20, "how long the serving rank may finish what it has in flight (vLLM's "
        "`--shutdown-timeout`, SGLang's and a command's SIGTERM drain); a worker rank's "
        "planned stop waits as long for the serving rank to be drained"),
)
_D_DELAY, _D_TIMEOUT = DRAIN_KEYS
# Seconds of TimeoutStopSec= left after llmgw-stop-group's last SIGKILL: its reaping
# (3 s at most) and systemd's start of the helper, so the stop ends inactive by our
# SIGKILL, never by systemd's timeout (Result=timeout, counted as a failure).
STOP_MARGIN = 5
# Seconds an engine gets after its drain to exit by itself: in a CI run of the engine tier
# every process of a drained vLLM rank (serving or headless) was gone 4.2-6.4 s after
# SIGTERM, 8.1 s at most (llmgw-stop-group's own log line). What is left once its main
# process is gone is SIGKILLed at once, so this bounds only a slow exit.
EXIT_GRACE = 10


@dataclass(frozen=True)
class DrainPolicy:
    """A replica's drain (health/drain.py): on a planned stop, `delay` seconds out of
    rotation before any signal, then at most `timeout` seconds for the requests in
    flight."""

    delay: int = _D_DELAY.default
    timeout: int = _D_TIMEOUT.default

    @property
    def least_stop_timeout(self) -> int:
        """The shortest stop_timeout that holds a whole drain and then the SIGKILL."""
        return self.delay + self.timeout + STOP_MARGIN

    @property
    def stop_budget(self) -> int:
        """A planned stop from its first step to its last SIGKILL, and so stop_timeout
        (`TimeoutStopSec=`) when the spec does not set it: the drain's delay, its
        timeout, the engine's own exit (EXIT_GRACE) and the kill (STOP_MARGIN)."""
        return self.delay + self.timeout + EXIT_GRACE + STOP_MARGIN


def read_drain(reader: Reader, value: Any, path: KeyPath) -> DrainPolicy:
    return DrainPolicy(**read_all(reader, DRAIN_KEYS, value, path))


DRAIN = Key("drain", read_drain, DrainPolicy(),
            "a planned stop or restart of the replica on any node (`systemctl "
            "stop|restart` of its target, `llmgw-render --apply`, its removal, a node "
            "shutting down) first reports it `draining` on every node for `delay` s, then "
            "lets the serving rank finish what it has in flight for up to `timeout` s, and "
            "only then stops the ranks; failures never wait. `stop_timeout` must be at least "
            f"delay + timeout + {STOP_MARGIN} s (docs/supervisor.md, \"Drain\")",
            shown=shown_mapping(DRAIN_KEYS))
