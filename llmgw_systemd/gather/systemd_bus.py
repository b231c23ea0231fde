"""The one module that talks to systemd over D-Bus (through pydbus and its GLib
connection), behind a small interface: snapshot, watch, restart, close.

The traps it handles (docs/design.md §9):
- every call carries a timeout (property reads otherwise block for as long as the
  manager is gone);
- the connection never exits the process when the bus closes (GLib's default);
- signals are only triggers: the watcher re-reads state in bulk; Subscribe() is called
  again after every reconnect, or the manager sends no unit signals;
- no proxy per unit (pydbus introspects every object, ~10 ms each): ListUnitsByNames in
  one call, then raw Properties.GetAll calls;
- only the watched units' signals reach this process: one match rule per watched unit
  path (dbus-daemon filters), and from the manager only `Reloading`. A bulk read loads
  stopped units (UnitNew) and systemd unloads them again (UnitRemoved): neither signal is
  subscribed, so no read can cause the signals that trigger the next one
  (docs/supervisor.md, "D-Bus").
- connecting is bounded too: a stalled dbus-daemon accepts the socket and then never
  finishes the handshake.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from llmgw_systemd.errors import BusError
from llmgw_systemd.health.unit_state import JOB_UNKNOWN, UnitState, missing
from llmgw_systemd.units.plan import digest_in

SYSTEMD = "org.freedesktop.systemd1"
MANAGER_PATH = "/org/freedesktop/systemd1"
MANAGER_IFACE = "org.freedesktop.systemd1.Manager"
UNIT_IFACE = "org.freedesktop.systemd1.Unit"
SERVICE_IFACE = "org.freedesktop.systemd1.Service"
PROPS_IFACE = "org.freedesktop.DBus.Properties"
DEFAULT_TIMEOUT = 5.0
# dbus-daemon allows 512 match rules per connection on the system bus: past this many
# watched units, one broad rule and a filter here instead.
MAX_PATH_RULES = 200


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
        self._watched: frozenset[str] = frozenset()  # unit names whose signals matter
        self._path_subscriptions: dict[str, int] = {}  # unit path -> subscription id
        self._broad = False  # one PropertiesChanged rule for every unit, filtered here
        # The last state read per unit, and the ActiveState/SubState that signals carried
        # since: a first look after a signal needs no call to the (busy) manager.
        self._last: dict[str, UnitState] = {}
        self._hints: dict[str, tuple[str, str]] = {}

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
                cancel = Gio.Cancellable()
                timer = threading.Timer(self.timeout_ms / 1000, cancel.cancel)
                timer.daemon = True
                timer.start()
                try:
                    con = Gio.DBusConnection.new_for_address_sync(
                        Gio.dbus_address_get_for_bus_sync(kind, cancel),
                        Gio.DBusConnectionFlags.AUTHENTICATION_CLIENT |
                        Gio.DBusConnectionFlags.MESSAGE_BUS_CONNECTION, None, cancel)
                finally:
                    timer.cancel()
                con.set_exit_on_close(False)  # GLib would SIGTERM the whole process
                bus = pydbus.bus.Bus(con)  # pydbus's view of it; its proxies are not used
            except Exception as exc:
                if "cancel" in str(exc).lower():
                    exc = TimeoutError(f"no answer within {self.timeout_ms / 1000:g} s")
                raise BusError(f"cannot connect to the {self._which} bus: {exc}") from None
            self._con = bus.con
            self._subscriptions, self._path_subscriptions = [], {}  # died with the old one
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
        if not names:
            return {}
        rows = self._list_units(names)
        states: dict[str, UnitState] = {}
        with self._lock:
            dirty = set(self._dirty)
            if refresh:
                self._cache.clear()
        for name, _desc, load, active, sub, _following, path, _job_id, job_type, _job in rows:
            self._names_by_path[path] = name
            if load != "loaded":
                states[name] = UnitState(name, load, active, sub, job_type=job_type)
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
                invocation_id=bytes(unit.get("InvocationID") or b"").hex(),
                job_type=job_type,
                spec_digest=digest_in(service.get("Environment") or ()),
            )
        if properties:
            with self._lock:
                self._dirty -= {p for p, n in self._names_by_path.items() if n in states}
                for name, state in states.items():
                    self._last[name] = state
                    self._hints.pop(name, None)
        self._subscribe_paths()
        for name in names:
            states.setdefault(name, missing(name))
        return states

    def _list_units(self, names: Sequence[str]) -> list[tuple[Any, ...]]:
        """One ListUnitsByNames: (name, description, load, active, sub, following, object
        path, job id, job type, job path) per name; it loads units on demand."""
        from gi.repository import GLib

        (rows,) = self._call(MANAGER_PATH, MANAGER_IFACE, "ListUnitsByNames",
                             GLib.Variant("(as)", (list(names),)), "(a(ssssssouso))")
        return list(rows)

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

    def watch(self, names: Sequence[str], on_change: Callable[[str], None]) -> None:
        """Call on_change(unit path or '') from a background thread whenever systemd
        signals a change of one of the named units (or reloads); the caller re-reads
        state (signals are only triggers). Call again with new names at any time."""
        from gi.repository import GLib

        with self._lock:
            self._on_change = on_change
            self._watched = frozenset(names)
            con = self._connection()  # a new connection subscribes as it is made
            self._learn_paths(names)
            broad = len(self._watched) > MAX_PATH_RULES
            if not self._subscriptions or broad != self._broad:
                self._subscribe(con)
            else:
                self._subscribe_paths(con)
        if self._loop_thread is None:
            self._loop = GLib.MainLoop()
            self._loop_thread = threading.Thread(target=self._loop.run, name="dbus-signals",
                                                 daemon=True)
            self._loop_thread.start()

    def _subscribe(self, con: Any) -> None:
        from gi.repository import Gio

        for sub in [*self._subscriptions, *self._path_subscriptions.values()]:
            con.signal_unsubscribe(sub)
        self._path_subscriptions = {}
        self._subscriptions = [
            con.signal_subscribe(SYSTEMD, MANAGER_IFACE, "Reloading", MANAGER_PATH, None,
                                 Gio.DBusSignalFlags.NONE, self._on_manager),
        ]
        self._broad = len(self._watched) > MAX_PATH_RULES
        if self._broad:
            self._subscriptions.append(con.signal_subscribe(
                SYSTEMD, PROPS_IFACE, "PropertiesChanged", None, None,
                Gio.DBusSignalFlags.NONE, self._on_properties))
        self._subscribe_paths(con)
        self._manager_subscribe(con)

    def _manager_subscribe(self, con: Any) -> None:
        # Without Subscribe() the manager emits no unit signals at all. (Called on con
        # itself: _call would come back here through _connection on a closed one.)
        from gi.repository import GLib

        try:
            con.call_sync(SYSTEMD, MANAGER_PATH, MANAGER_IFACE, "Subscribe", None, None, 0,
                          self.timeout_ms, None)
        except GLib.Error as exc:
            if "AlreadySubscribed" not in str(exc.message):
                raise BusError(f"Subscribe: {exc.message}") from None

    def _learn_paths(self, names: Sequence[str]) -> None:
        """Object paths of watched units not seen yet, from one bulk call (systemd
        builds them; docs/supervisor.md, "D-Bus": never escape them by hand)."""
        unknown = sorted(set(names) - set(self._names_by_path.values()))
        if not unknown or len(self._watched) > MAX_PATH_RULES:
            return
        for row in self._list_units(unknown):
            self._names_by_path[row[6]] = row[0]

    def _subscribe_paths(self, con: Any = None) -> None:
        """One PropertiesChanged match rule per watched unit whose object path a bulk
        read has told us (ListUnitsByNames returns it even for units not loaded)."""
        from gi.repository import Gio

        with self._lock:
            if self._on_change is None or self._broad:
                return
            con = con or self._con
            if con is None or con.is_closed():
                return
            wanted = {p for p, n in self._names_by_path.items() if n in self._watched}
            for path in set(self._path_subscriptions) - wanted:
                con.signal_unsubscribe(self._path_subscriptions.pop(path))
            for path in wanted - set(self._path_subscriptions):
                self._path_subscriptions[path] = con.signal_subscribe(
                    SYSTEMD, PROPS_IFACE, "PropertiesChanged", path, None,
                    Gio.DBusSignalFlags.NONE, self._on_properties)

    def _on_properties(self, _con: Any, _sender: str, path: str, _iface: str, _signal: str,
                       params: Any) -> None:
        name = self._names_by_path.get(path)
        if self._on_change is None or name not in self._watched:
            return  # the broad rule (many units) brings others' signals too
        with self._lock:
            self._dirty.add(path)
            iface, changed = params.get_child_value(0).get_string(), params.get_child_value(1)
            if iface == UNIT_IFACE and name in self._last:
                active, sub = self._hints.get(name, (self._last[name].active_state,
                                                     self._last[name].sub_state))
                value = changed.lookup_value("ActiveState", None)
                active = value.get_string() if value is not None else active
                value = changed.lookup_value("SubState", None)
                sub = value.get_string() if value is not None else sub
                self._hints[name] = (active, sub)
        self._on_change(path)

    def from_signals(self, names: Sequence[str]) -> dict[str, UnitState] | None:
        """The named units as last read, with the states their signals carried since:
        a first look that costs no call. None if one of them was never read."""
        with self._lock:
            out: dict[str, UnitState] = {}
            for name in names:
                last = self._last.get(name)
                if last is None:
                    return None
                hint = self._hints.get(name)
                if hint is None or hint == (last.active_state, last.sub_state):
                    out[name] = last
                else:  # the job, if any, is the confirming read's to say
                    out[name] = replace(last, active_state=hint[0], sub_state=hint[1],
                                        job_type=JOB_UNKNOWN)
            return out

    def _on_manager(self, _con: Any, _sender: str, _path: str, _iface: str, _signal: str,
                    _params: Any) -> None:
        if self._on_change is not None:  # Reloading: any unit may have changed
            with self._lock:
                self._cache.clear()
                self._everything_changed = True
            self._on_change("")

    def resubscribe(self) -> None:
        """Subscribe() again: a manager that re-executed (daemon-reexec) has forgotten
        its subscribers and would send no more unit signals. Idempotent."""
        if self._on_change is not None:
            self._manager_subscribe(self._connection())  # match rules live in dbus-daemon

    def recover(self) -> None:
        """After a call failed: a connection that closed is made again (reconnect); on
        one still open (a manager too busy to answer in time) the manager is asked to
        Subscribe() again, since the one that timed out may never have reached it, and
        the next snapshot reads every unit. Raises BusError while it still does not
        answer."""
        with self._lock:
            closed = self._con is None or self._con.is_closed()
        if closed:
            self.reconnect()
            return
        with self._lock:
            self._everything_changed = True
        self.resubscribe()

    def reconnect(self) -> None:
        """Drop the connection; the next call connects (and subscribes) again."""
        with self._lock:
            self._cache.clear()  # signals were missed while disconnected
            self._last.clear()
            self._hints.clear()
            self._everything_changed = True
            if self._con is not None and not self._con.is_closed():
                self._con.close_sync(None)
            self._con = None

    def close(self) -> None:
        with self._lock:
            if self._loop is not None:
                self._loop.quit()
            if self._con is not None and not self._con.is_closed():
                for sub in [*self._subscriptions, *self._path_subscriptions.values()]:
                    self._con.signal_unsubscribe(sub)
                self._con.close_sync(None)
            self._con = None
            self._subscriptions = []
            self._path_subscriptions = {}
        if self._loop_thread is not None:
            self._loop_thread.join(timeout=5)
            self._loop_thread = None

