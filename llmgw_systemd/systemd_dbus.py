"""The one module that talks to systemd over D-Bus (through pydbus and its GLib
connection), behind a small interface: snapshot, watch, restart, close.

The traps it handles (DESIGN.md section 9):
- every call carries a timeout (property reads otherwise block for as long as the
  manager is gone);
- the connection never exits the process when the bus closes (GLib's default);
- signals are only triggers: the watcher re-reads state in bulk; Subscribe() is called
  again after every reconnect, or the manager sends no unit signals;
- no proxy per unit (pydbus introspects every object, ~10 ms each): ListUnitsByNames in
  one call, then raw Properties.GetAll calls.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .errors import LlmgwError
from .unitstate import UnitState, missing

SYSTEMD = "org.freedesktop.systemd1"
MANAGER_PATH = "/org/freedesktop/systemd1"
MANAGER_IFACE = "org.freedesktop.systemd1.Manager"
UNIT_IFACE = "org.freedesktop.systemd1.Unit"
SERVICE_IFACE = "org.freedesktop.systemd1.Service"
PROPS_IFACE = "org.freedesktop.DBus.Properties"
DEFAULT_TIMEOUT = 5.0


class BusError(LlmgwError):
    """systemd could not be reached or refused a call."""


class SystemdBus:
    """A connection to the system manager, or with user=True to the caller's user
    manager (the session bus). Reconnects on demand after the bus went away."""

    def __init__(self, *, user: bool = False, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.user = user
        self.timeout_ms = int(timeout * 1000)
        self._lock = threading.RLock()
        self._con: Any = None
        self._subscriptions: list[int] = []
        self._on_change: Callable[[str], None] | None = None
        self._loop: Any = None
        self._loop_thread: threading.Thread | None = None

    # -- connection -------------------------------------------------------------------

    def _connection(self) -> Any:
        with self._lock:
            if self._con is not None and not self._con.is_closed():
                return self._con
            try:
                import pydbus  # PyGObject comes with it; only the supervisor needs them

                bus = pydbus.SessionBus() if self.user else pydbus.SystemBus()
            except Exception as exc:
                raise BusError(f"cannot connect to the {self._which} bus: {exc}") from None
            con = bus.con
            con.set_exit_on_close(False)  # GLib would SIGTERM the whole process
            self._con = con
            if self._on_change is not None:
                self._subscribe(con)
            return con

    @property
    def _which(self) -> str:
        return "session (user manager)" if self.user else "system"

    def _call(self, path: str, iface: str, method: str, args: Any = None,
              reply: str | None = None) -> Any:
        from gi.repository import GLib

        con = self._connection()
        try:
            result = con.call_sync(SYSTEMD, path, iface, method, args,
                                   GLib.VariantType.new(reply) if reply else None,
                                   0, self.timeout_ms, None)
        except GLib.Error as exc:
            if con.is_closed():
                with self._lock:
                    self._con = None
            raise BusError(f"{method} on {path}: {exc.message}") from None
        return result.unpack() if result is not None else None

    # -- the interface -----------------------------------------------------------------

    def snapshot(self, names: Sequence[str]) -> dict[str, UnitState]:
        """State of every named unit, read in bulk. Unknown units come back not-found."""
        from gi.repository import GLib

        if not names:
            return {}
        (rows,) = self._call(MANAGER_PATH, MANAGER_IFACE, "ListUnitsByNames",
                             GLib.Variant("(as)", (list(names),)),
                             "(a(ssssssouso))")
        states: dict[str, UnitState] = {}
        for name, _desc, load, active, sub, _following, path, *_job in rows:
            if load != "loaded":
                states[name] = UnitState(name, load, active, sub)
                continue
            unit = self._get_all(path, UNIT_IFACE)
            service = self._get_all(path, SERVICE_IFACE) if name.endswith(".service") else {}
            states[name] = UnitState(
                name=name, load_state=load, active_state=active, sub_state=sub,
                result=str(service.get("Result", "")),
                n_restarts=int(service.get("NRestarts", 0)),
                main_pid=int(service.get("MainPID", 0)),
                status_text=str(service.get("StatusText", "")),
                active_enter_usec=int(unit.get("ActiveEnterTimestampMonotonic", 0)),
                state_change_usec=int(unit.get("StateChangeTimestampMonotonic", 0)),
            )
        for name in names:
            states.setdefault(name, missing(name))
        return states

    def _get_all(self, path: str, iface: str) -> dict[str, Any]:
        from gi.repository import GLib

        (props,) = self._call(path, PROPS_IFACE, "GetAll", GLib.Variant("(s)", (iface,)),
                              "(a{sv})")
        return dict(props)

    def restart(self, unit: str) -> None:
        """Restart a unit (a replica's target restarts its whole shard)."""
        from gi.repository import GLib

        self._call(MANAGER_PATH, MANAGER_IFACE, "RestartUnit",
                   GLib.Variant("(ss)", (unit, "replace")), "(o)")

    def watch(self, on_change: Callable[[str], None]) -> None:
        """Call on_change(unit name or '') from a background thread whenever systemd
        signals a change; the caller re-reads state (signals are only triggers)."""
        from gi.repository import GLib

        with self._lock:
            fresh = self._con is None or self._con.is_closed()
            self._on_change = on_change
            con = self._connection()  # a new connection subscribes as it is made
            if not fresh:
                self._subscribe(con)
        if self._loop_thread is None:
            self._loop = GLib.MainLoop()
            self._loop_thread = threading.Thread(target=self._loop.run, name="dbus-signals",
                                                 daemon=True)
            self._loop_thread.start()

    def _subscribe(self, con: Any) -> None:
        from gi.repository import Gio

        for sub in self._subscriptions:
            con.signal_unsubscribe(sub)
        self._subscriptions = [
            con.signal_subscribe(SYSTEMD, PROPS_IFACE, "PropertiesChanged", None, None,
                                 Gio.DBusSignalFlags.NONE, self._on_properties),
            con.signal_subscribe(SYSTEMD, MANAGER_IFACE, None, MANAGER_PATH, None,
                                 Gio.DBusSignalFlags.NONE, self._on_manager),
        ]
        # Without Subscribe() the manager emits no unit signals at all.
        try:
            self._call(MANAGER_PATH, MANAGER_IFACE, "Subscribe")
        except BusError as exc:
            if "AlreadySubscribed" not in str(exc):
                raise

    def _on_properties(self, _con: Any, _sender: str, path: str, _iface: str, _signal: str,
                       _params: Any) -> None:
        if self._on_change is not None and path.startswith(MANAGER_PATH + "/unit/"):
            self._on_change(path)

    def _on_manager(self, _con: Any, _sender: str, _path: str, _iface: str, signal: str,
                    _params: Any) -> None:
        if self._on_change is not None and signal in (
                "UnitNew", "UnitRemoved", "JobRemoved", "Reloading", "StartupFinished"):
            self._on_change("")

    def resubscribe(self) -> None:
        """Subscribe() again: a manager that re-executed (daemon-reexec) has forgotten
        its subscribers and would send no more unit signals. Idempotent."""
        if self._on_change is not None:
            self._subscribe(self._connection())

    def reconnect(self) -> None:
        """Drop the connection; the next call connects (and subscribes) again."""
        with self._lock:
            if self._con is not None and not self._con.is_closed():
                self._con.close_sync(None)
            self._con = None

    def close(self) -> None:
        with self._lock:
            if self._loop is not None:
                self._loop.quit()
            if self._con is not None and not self._con.is_closed():
                for sub in self._subscriptions:
                    self._con.signal_unsubscribe(sub)
                self._con.close_sync(None)
            self._con = None
            self._subscriptions = []
        if self._loop_thread is not None:
            self._loop_thread.join(timeout=5)
            self._loop_thread = None


def unit_names_for(replicas: Iterable[tuple[str, Sequence[str]]]) -> list[str]:
    """Flatten (target, members) pairs into the unit list one snapshot reads."""
    names: list[str] = []
    for target, members in replicas:
        names.append(target)
        names.extend(members)
    return names
