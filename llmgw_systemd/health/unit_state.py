"""What systemd says about one unit, as plain data (read by gather/systemd_bus.py, judged by
health). Timestamps are systemd's CLOCK_MONOTONIC microseconds; 0 means never."""

from __future__ import annotations

from dataclasses import dataclass

# job_type of a unit whose state came from its signals alone (the supervisor's first look,
# before the confirming read): the signal carries the state, not the job, so whether a stop
# was asked for is not known yet (a planned stop seen as deactivating with the last read's
# empty job once counted as a death)
JOB_UNKNOWN = "?"


@dataclass(frozen=True)
class UnitState:
    """One unit's state as one snapshot saw it."""

    name: str
    load_state: str  # loaded, not-found, masked, error, ...
    active_state: str  # active, activating, deactivating, inactive, failed, reloading
    sub_state: str  # running, start-pre, auto-restart, dead, failed, ...
    result: str = ""  # success, exit-code, signal, start-limit-hit, ... ("" for targets)
    n_restarts: int = 0
    main_pid: int = 0
    status_text: str = ""
    active_enter_usec: int = 0  # when it last became active (monotonic)
    state_change_usec: int = 0  # when its state last changed (monotonic)
    invocation_id: str = ""  # hex; new on every start of the unit ("" before the first)
    job_type: str = ""  # the job queued or running on it (stop, restart, ...), "" for none
    # the spec version its unit file carries as systemd holds it (a service's
    # Environment=, units/plan.py spec_digest; "" for none)
    spec_digest: str = ""

    @property
    def is_active(self) -> bool:
        return self.active_state in ("active", "reloading")

    @property
    def is_down(self) -> bool:
        return self.active_state in ("inactive", "failed")

    @property
    def died(self) -> bool:
        """Its process ended with nobody asking: waiting to start again (auto-restart), or
        stopping with no job on it (its ExecStop= cleaning up after the main process
        exited or was killed). Every stop someone asked for, a planned one, the
        supervisor's group restart or one passed on through BindsTo=, is a job."""
        return self.sub_state == "auto-restart" or (
            self.active_state == "deactivating" and self.job_type == "")


def missing(name: str) -> UnitState:
    """A unit systemd does not know (not rendered, or garbage-collected and unloadable)."""
    return UnitState(name, "not-found", "inactive", "dead")
