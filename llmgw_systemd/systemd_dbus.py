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
from collections.abc import Callable, Sequence
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
        # Per unit: (active state, sub state, properties). Properties are re-read only
        # when the state changed or a signal named the unit: a steady snapshot of 100
        # units is then one ListUnitsByNames call.
        self._cache: dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]] = {}
        self._dirty: set[str] = set()
        self._names_by_path: dict[str, str] = {}
        self._everything_changed = True

    # -- connection -------------------------------------------------------------------

    def _connection(self) -> Any:
        with self._lock:
            if self._con is not None and not self._con.is_closed():
                return self._con
            try:
                import pydbus  # PyGObject comes with it; only the supervisor needs them
                from gi.repository import Gio

                # A private connection, not GLib's shared one (pydbus.SessionBus() and
                # SystemBus()): once the bus goes away the shared connection stays closed
                # for good and keeps being handed back.
                kind = Gio.BusType.SESSION if self.user else Gio.BusType.SYSTEM
                con = Gio.DBusConnection.new_for_address_sync(
                    Gio.dbus_address_get_for_bus_sync(kind, None),
                    Gio.DBusConnectionFlags.AUTHENTICATION_CLIENT |
                    Gio.DBusConnectionFlags.MESSAGE_BUS_CONNECTION, None, None)
                con.set_exit_on_close(False)  # GLib would SIGTERM the whole process
                bus = pydbus.bus.Bus(con)  # pydbus's view of it; its proxies are not used
            except Exception as exc:
                raise BusError(f"cannot connect to the {self._which} bus: {exc}") from None
            self._con = bus.con
            if self._on_change is not None:
                self._subscribe(self._con)
            return self._con

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

    def snapshot(self, names: Sequence[str], *, refresh: bool = False,
                 properties: bool = True) -> dict[str, UnitState]:
        """State of every named unit, read in bulk. Unknown units come back not-found.
        refresh=True re-reads every unit's properties (a backstop for missed signals);
        properties=False takes states from the one bulk call and the rest (result,
        restarts, timestamps) from the last read, leaving changed units to read later:
        the fast first look after a signal."""
        from gi.repository import GLib

        if not names:
            return {}
        (rows,) = self._call(MANAGER_PATH, MANAGER_IFACE, "ListUnitsByNames",
                             GLib.Variant("(as)", (list(names),)),
                             "(a(ssssssouso))")
        states: dict[str, UnitState] = {}
        with self._lock:
            dirty = set(self._dirty)
            if refresh:
                self._cache.clear()
        for name, _desc, load, active, sub, _following, path, *_job in rows:
            self._names_by_path[path] = name
            if load != "loaded":
                states[name] = UnitState(name, load, active, sub)
                continue
            cached = self._cache.get(name)
            if cached is not None and (not properties or (
                    cached[:2] == (active, sub) and path not in dirty)):
                unit, service = cached[2], cached[3]
            else:
                unit = self._get_all(path, UNIT_IFACE)
                service = (self._get_all(path, SERVICE_IFACE) if name.endswith(".service")
                           else {})
                self._cache[name] = (active, sub, unit, service)
            states[name] = UnitState(
                name=name, load_state=load, active_state=active, sub_state=sub,
                result=str(service.get("Result", "")),
                n_restarts=int(service.get("NRestarts", 0)),
                main_pid=int(service.get("MainPID", 0)),
                status_text=str(service.get("StatusText", "")),
                active_enter_usec=int(unit.get("ActiveEnterTimestampMonotonic", 0)),
                state_change_usec=int(unit.get("StateChangeTimestampMonotonic", 0)),
            )
        if properties:
            with self._lock:
                self._dirty -= {p for p, n in self._names_by_path.items() if n in states}
        for name in names:
            states.setdefault(name, missing(name))
        return states

    def _get_all(self, path: str, iface: str) -> dict[str, Any]:
        from gi.repository import GLib

        (props,) = self._call(path, PROPS_IFACE, "GetAll", GLib.Variant("(s)", (iface,)),
                              "(a{sv})")
        return dict(props)

    def changed_units(self) -> set[str] | None:
        """Units that signalled a change since they were last read, or None when anything
        may have changed (a reload, a new connection): the caller then reads everything."""
        with self._lock:
            if self._everything_changed:
                self._everything_changed = False
                return None
            return {self._names_by_path[p] for p in self._dirty if p in self._names_by_path}

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
        # Without Subscribe() the manager emits no unit signals at all. (Called on con
        # itself: _call would come back here through _connection on a closed one.)
        from gi.repository import GLib

        try:
            con.call_sync(SYSTEMD, MANAGER_PATH, MANAGER_IFACE, "Subscribe", None, None, 0,
                          self.timeout_ms, None)
        except GLib.Error as exc:
            if "AlreadySubscribed" not in str(exc.message):
                raise BusError(f"Subscribe: {exc.message}") from None

    def _on_properties(self, _con: Any, _sender: str, path: str, _iface: str, _signal: str,
                       _params: Any) -> None:
        if self._on_change is not None and path.startswith(MANAGER_PATH + "/unit/"):
            with self._lock:
                self._dirty.add(path)
            self._on_change(path)

    def _on_manager(self, _con: Any, _sender: str, _path: str, _iface: str, signal: str,
                    _params: Any) -> None:
        if self._on_change is not None and signal in (
                "UnitNew", "UnitRemoved", "JobRemoved", "Reloading", "StartupFinished"):
            if signal in ("Reloading", "UnitRemoved", "UnitNew"):
                with self._lock:
                    self._cache.clear()  # a reload may change any unit's properties
                    self._everything_changed = True
            self._on_change("")

    def resubscribe(self) -> None:
        """Subscribe() again: a manager that re-executed (daemon-reexec) has forgotten
        its subscribers and would send no more unit signals. Idempotent."""
        if self._on_change is not None:
            self._subscribe(self._connection())

    def reconnect(self) -> None:
        """Drop the connection; the next call connects (and subscribes) again."""
        with self._lock:
            self._cache.clear()  # signals were missed while disconnected
            self._everything_changed = True
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

