"""The daemon's one event loop, in one thread: the HTTP servers, the peers' long-polls,
the probes, the watchdog and the timers all run on it as tasks, so the daemon's threads
are a small constant whatever the number of peers and probes (docs/supervisor.md,
"Threads"). Other threads hand it work through the methods below, never by touching
the loop's objects."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
_START_TIMEOUT = 5.0
_STOP_TIMEOUT = 5.0  # seconds for the tasks to end once cancelled, and the thread


class Runtime:
    def __init__(self, name: str = "loop",
                 on_error: Callable[[asyncio.AbstractEventLoop, dict[str, Any]], None]
                 | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        if on_error is not None:
            self.loop.set_exception_handler(on_error)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = threading.Event()

    def start(self) -> None:
        self._thread.start()
        if not self._started.wait(_START_TIMEOUT):
            raise RuntimeError("the event loop did not start")

    def spawn(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run `coroutine` as a task on the loop (from any thread)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def call(self, callback: Callable[..., object], *args: object) -> None:
        """Call `callback(*args)` on the loop soon (from any thread); nothing once the
        loop is closed."""
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(callback, *args)

    def stop(self) -> None:
        """Cancel every task, let them finish (bounded), close the loop, join."""
        if not self._thread.is_alive():
            return
        with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
            self.spawn(self._cancel_all()).result(_STOP_TIMEOUT)
        self.call(self.loop.stop)
        if threading.current_thread() is not self._thread:
            self._thread.join(_STOP_TIMEOUT)

    async def _cancel_all(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=_STOP_TIMEOUT / 2)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        try:
            self.loop.run_forever()
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()
