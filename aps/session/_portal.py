"""A blocking way into one event loop: the loop runs in the caller's thread during a call.

:class:`~aps.ClusterEnv` is a blocking API over the async :class:`~aps.learner.Learner`. The
obvious shape, a loop on a private thread that each call hands its coroutine to, pays two
thread hand-offs per call; on a 2-core host a round trip between two Python threads costs
about 40 µs, more than a tenth of a CartPole lockstep step (``benchmarks/portal.py``). So a
blocking call here *borrows* the loop: the caller's thread runs it until the call's coroutine
is done, which costs one restart of the loop and, in the main thread, a swap of the SIGINT
handler so that Ctrl-C cancels the call cleanly: about 8 µs a call on asyncio's loop.

Between calls the connections must still be served (heartbeats, handshakes, a step started
by ``step_async``), so a keeper thread runs the loop whenever no caller has for
:data:`GRACE` seconds, or at once when a coroutine was handed over to run in the background
(:meth:`Portal.submit`) or a caller's thread cannot run it (another thread is running it, or
the caller's thread runs an event loop of its own, as in Jupyter). A caller that finds the
keeper running asks it to stop and waits: one hand-off after each pause of the caller, none
in a tight loop of calls.

Who runs the loop is one state, guarded by one condition: ``None``, the keeper, or the
thread ident of the caller running it. Only the runner touches the loop, except
``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import queue
import signal
import threading
import time
from collections.abc import Coroutine
from typing import Any, Generic, Literal, TypeVar

from aps.errors import InvalidState
from aps.session._loop import new_event_loop

__all__ = ["GRACE", "Pending", "Portal"]

T = TypeVar("T")

GRACE = 0.01
"""Seconds without a caller before the keeper runs the loop (and how often it looks).

Short against every deadline a connection has (heartbeats and handshakes take seconds), long
against the gap between two calls of a stepping loop.
"""

_KEEPER: Literal["keeper"] = "keeper"

# signal.signal wraps CPython's _signal.signal to turn handler numbers into enum members,
# which costs about 3 µs a call here (an Enum lookup that fails inside); every borrowed call
# in the main thread swaps the SIGINT handler twice, so it calls the C function where the
# interpreter has one (it has no type stubs, hence import_module). Both take and return the
# same handlers.
try:
    _set_handler: Any = importlib.import_module("_signal").signal
except (ImportError, AttributeError):
    _set_handler = signal.signal


_pid = os.getpid()
"""This process's id, refreshed in a forked child: the fork check of every call reads it
instead of asking the kernel (``os.getpid`` is a system call)."""


def _refresh_pid() -> None:
    global _pid
    _pid = os.getpid()


if hasattr(os, "register_at_fork"):  # where there is no fork, the id never changes
    os.register_at_fork(after_in_child=_refresh_pid)


def _wake() -> None:
    """A callback that does nothing: scheduling it wakes a sleeping selector."""


async def _stop_after(
    coroutine: Coroutine[Any, Any, T], loop: asyncio.AbstractEventLoop, runner: int
) -> T:
    """Await ``coroutine``, then stop ``loop`` if thread ``runner`` still runs it.

    Stopping from inside the task, rather than from its done callback, ends the borrowed run
    in the loop's turn that finishes the task: one turn (and one ``select``) fewer per call.
    """
    try:
        return await coroutine
    finally:
        if threading.get_ident() == runner:
            loop.stop()


class Pending(Generic[T]):
    """A coroutine handed over to run on the loop, awaited from another thread."""

    def __init__(self, portal: Portal) -> None:
        # A task plus a SimpleQueue is the cheapest hand-off measured between two threads
        # here (about two thirds of run_coroutine_threadsafe's cost per call).
        self._portal = portal
        self._done: queue.SimpleQueue[asyncio.Task[T]] = queue.SimpleQueue()
        self._task: asyncio.Task[T] | None = None

    def start(self, coroutine: Coroutine[Any, Any, T]) -> None:
        """On the loop: run ``coroutine`` as a task."""
        self._task = task = self._portal.loop.create_task(coroutine)
        task.add_done_callback(self._portal._finished)
        task.add_done_callback(self._done.put)

    def result(self) -> T:
        """Block until the coroutine ends; return its result or raise its error.

        Interrupting the wait (Ctrl-C) cancels the coroutine.
        """
        try:
            return self._done.get().result()
        except BaseException:
            task = self._task
            if task is not None and not task.done():
                self._portal.loop.call_soon_threadsafe(task.cancel)
            raise


class Portal:
    """One event loop for blocking callers: borrowed during calls, kept by a thread between."""

    def __init__(self, use_uvloop: bool | None) -> None:
        """Make the loop and start its keeper.

        Args:
            use_uvloop: ``True`` for uvloop. ``None`` (default) means asyncio's own loop:
                the loop restarts in the caller's thread for every call, and uvloop's
                restart in the main thread (it sets up its signal handling each time)
                costs several times asyncio's (``benchmarks/portal.py``).
        """
        self._pid = _pid
        self.loop = new_event_loop(bool(use_uvloop))
        self._lock = threading.Lock()  # the condition's lock; `with` on it skips a Python frame
        self._state = threading.Condition(self._lock)
        self._runner: int | Literal["keeper"] | None = None
        self._wanting = 0  # callers waiting for the keeper to stop
        self._handed = 0  # coroutines handed over and not done: the keeper must run them
        self._left = 0.0  # when a caller last stopped running the loop (time.monotonic)
        self._closing = False
        self._task: asyncio.Task[Any] | None = None  # a borrowed call's, in the main thread
        self._interrupted = False  # its Ctrl-C arrived
        self._keeper = threading.Thread(target=self._keep, name="aps-loop", daemon=True)
        self._keeper.start()

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the loop and return its result (or raise its error).

        The caller's thread runs the loop meanwhile, unless it cannot (see the module).
        Interrupting the call (Ctrl-C) cancels the coroutine.

        Raises:
            InvalidState: see :meth:`submit`.
        """
        running = asyncio._get_running_loop()
        self._check(coroutine, running)
        if running is not None:  # Jupyter's loop in this thread
            return self.submit(coroutine).result()
        me = threading.get_ident()
        with self._lock:
            if self._runner == _KEEPER:
                self._wanting += 1
                try:
                    self.loop.call_soon_threadsafe(self._keeper_stop)
                    while self._runner == _KEEPER:
                        self._state.wait()
                except BaseException:  # interrupted before it started
                    coroutine.close()
                    raise
                finally:
                    self._wanting -= 1
            borrowed = self._runner is None
            if borrowed:
                self._runner = me
        if not borrowed:  # another thread's call runs the loop
            return self.submit(coroutine).result()
        task = self.loop.create_task(_stop_after(coroutine, self.loop, me))
        try:
            self._run(task)
        finally:
            done = task.done()
            if not done:  # interrupted (Ctrl-C): the keeper sees the cancellation through
                task.cancel()
            with self._lock:
                self._runner = None
                self._left = time.monotonic() if done else 0.0
                if self._handed or not done:
                    self._state.notify_all()
        return task.result()

    def _run(self, task: asyncio.Task[Any]) -> None:
        """Run the loop in this thread until ``task`` is done (it stops the loop as it ends).

        In the main thread under Python's own SIGINT handler, Ctrl-C cancels the task at its
        next ``await``, as ``asyncio.Runner`` does, and ``KeyboardInterrupt`` is raised once
        the task has ended: raised where the signal lands, it could stop the learner's code
        halfway through an update. A second Ctrl-C raises at once. A program's own SIGINT
        handler is left in place.
        """
        loop = self.loop
        if threading.current_thread() is not threading.main_thread():
            loop.run_forever()
            return
        self._task, self._interrupted = task, False
        previous = _set_handler(signal.SIGINT, self._on_sigint)
        if previous is not signal.default_int_handler:  # the program's own: leave it be
            _set_handler(signal.SIGINT, previous)
            self._task = None
            loop.run_forever()
            return
        try:
            loop.run_forever()
        finally:
            _set_handler(signal.SIGINT, previous)
            self._task = None
        if self._interrupted:
            raise KeyboardInterrupt

    def _on_sigint(self, signum: int, frame: object) -> None:
        """SIGINT during a borrowed call in the main thread: cancel its task (see ``_run``)."""
        task = self._task
        if task is None or task.done() or self._interrupted:
            raise KeyboardInterrupt
        self._interrupted = True
        task.cancel()
        self.loop.call_soon_threadsafe(_wake)  # the selector may be asleep

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> Pending[T]:
        """Start ``coroutine`` on the loop now; the caller collects it with ``result()``.

        The keeper runs the loop while the caller does other work.

        Raises:
            InvalidState: the portal is closed (its env was closed), the call comes from
                a coroutine on the loop itself, or from a forked child of the process that
                made it.
        """
        self._check(coroutine, asyncio._get_running_loop())
        pending: Pending[T] = Pending(self)
        with self._state:
            self._handed += 1
            self._state.notify_all()
        self.loop.call_soon_threadsafe(pending.start, coroutine)
        return pending

    def _check(
        self, coroutine: Coroutine[Any, Any, Any], running: asyncio.AbstractEventLoop | None
    ) -> None:
        """Refuse a call from a fork, after close, or from this loop (``running``) itself."""
        if self.forked:
            coroutine.close()  # never awaited on purpose: no "was never awaited" warning
            raise InvalidState(
                f"this ClusterEnv belongs to process {self._pid}; process {os.getpid()} is a "
                "fork of it, where its event loop and connections do not run; make a new "
                "ClusterEnv in the child if it needs one"
            )
        if self.loop.is_closed() or self._closing:
            coroutine.close()
            raise InvalidState("this ClusterEnv is closed; create a new one to step again")
        if running is self.loop:
            coroutine.close()
            raise InvalidState("a blocking ClusterEnv method was called from its own event loop")

    def _finished(self, _: object) -> None:
        """On the loop: a handed-over coroutine ended."""
        with self._state:
            self._handed -= 1

    def _keeper_stop(self) -> None:
        """On the loop: stop it if the keeper runs it (a caller wants it)."""
        if threading.current_thread() is self._keeper:
            self.loop.stop()

    def _keep(self) -> None:
        """The keeper thread: run the loop whenever no caller has for a while."""
        with self._state:
            while not self._closing:
                idle = time.monotonic() - self._left >= GRACE
                if self._runner is None and not self._wanting and (self._handed or idle):
                    self._runner = _KEEPER
                    self._state.release()
                    try:
                        self.loop.run_forever()
                    finally:
                        self._state.acquire()
                        self._runner = None
                        self._state.notify_all()
                else:
                    # A timed wait, not a notification: a caller that leaves the loop does
                    # not wake this thread, which would cost a hand-off per call.
                    self._state.wait(GRACE)

    @property
    def forked(self) -> bool:
        """Whether this is a copy in a forked child: the keeper stayed in the parent."""
        return _pid != self._pid

    def close(self) -> None:
        """Stop the keeper and close the loop; idempotent. In a forked child, nothing.

        A child must not write to the loop's wake-up pipe: it is the parent's too.
        """
        if self.forked or self.loop.is_closed():
            return
        with self._state:
            self._closing = True
            if self._runner == _KEEPER:
                self.loop.call_soon_threadsafe(self._keeper_stop)
            self._state.notify_all()
        self._keeper.join()
        self.loop.close()
