"""The pre-auth budget: what connections that have not proved anything yet may hold.

Every connection a listener accepts spends one :class:`Ticket` of its listener's
:class:`PreauthBudget` from its first byte: while its TLS handshake runs, while its WebSocket
opening handshake runs, while it waits in the accept queue and, once the learner's gate
:meth:`~PreauthBudget.adopt`-ed the budget, until the peer proved the token. The budget is
shared by the transport and the gate, and knows neither the codec nor the messages: stages
are named by the owner of the connection, never inferred from bytes.

- At most ``limit`` tickets are held at once, and at most ``per_host`` idle ones (those
  that have not said hello) per source address.
- A connection past its deadline (``deadline`` seconds from accept) is aborted.
- A newcomer beyond a limit evicts an idle ticket: one from its own address when that
  address holds ``per_host`` idle ones; otherwise a probe that was answered and only waits
  to ask for the spaces first, then the oldest connection that said nothing from the
  address holding the most idle ones (the newcomer counted with its own). What is evicted
  is aborted at once (its socket closed, not left for the collector), so a flood of idle
  connections holds at most ``limit`` sockets, and a flood from several addresses cannot
  evict a newcomer from an address that holds fewer than they do: an honest peer gets its
  slot and keeps it until it says hello.
- When every ticket held is past its hello (real handshakes in progress), a newcomer gets a
  ticket marked :attr:`Ticket.busy`, up to ``limit`` of them: its owner turns it away (the
  learner says when to dial again); beyond those, :meth:`PreauthBudget.enter` returns
  ``None`` and the connection is closed at once.

Built-in listeners take a budget (``preauth=``) and create one otherwise; plug-in listeners
may expose one as a ``preauth`` attribute (read with :func:`budget_of`), and their
transports their ticket as ``preauth`` (read with :func:`ticket_of`). A listener without one
is still bounded: the learner's gate then keeps a budget of its own for its handshakes.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable

from aps.errors import ConfigError

__all__ = [
    "DEFAULT_DEADLINE",
    "DEFAULT_LIMIT",
    "DEFAULT_PER_HOST",
    "PROBE_DEADLINE",
    "PreauthBudget",
    "Stage",
    "Ticket",
    "budget_of",
    "ticket_of",
]

DEFAULT_LIMIT = 64
"""Connections that have not proved the token, at most, per listener."""

DEFAULT_PER_HOST = 16
"""Idle connections (no hello yet) from one source address, at most."""

DEFAULT_DEADLINE = 10.0
"""Seconds from accept to a proved token, by default (the learner's ``Timeouts.handshake``
replaces it when its gate adopts the budget)."""

PROBE_DEADLINE = 2.0
"""Seconds an answered probe (``aps check``) may take to ask for the spaces."""


class Stage(enum.IntEnum):
    """How far a connection got; lower stages are evicted first."""

    ANSWERED = 0
    """An authenticated probe that was answered and may still ask for the spaces."""
    IDLE = 1
    """Nothing said yet: TLS or WebSocket opening, the accept queue, waiting for the hello."""
    GREETED = 2
    """Said hello: a real handshake in progress, never evicted (its deadline still holds)."""


class Ticket:
    """One connection's share of a :class:`PreauthBudget`.

    Attributes:
        peer: the connection's address, for log lines.
        host: its source address, for the per-address limit.
        busy: entered while every ticket was past its hello; its owner turns it away.
        ended: why the budget ended it (``"evicted"``, ``"expired"``), ``None`` otherwise.
        arrival: its rank of arrival in its budget (lower: older).
    """

    __slots__ = (
        "_abort",
        "_budget",
        "_timer",
        "arrival",
        "busy",
        "ended",
        "host",
        "peer",
        "stage",
    )

    def __init__(
        self, budget: PreauthBudget, peer: str, host: str, abort: Callable[[], None], *, busy: bool
    ) -> None:
        self._budget = budget
        self._abort = abort
        self._timer: asyncio.TimerHandle | None = None
        self.peer = peer
        self.host = host
        self.busy = busy
        self.stage = Stage.IDLE
        self.ended: str | None = None
        self.arrival = budget._arrivals
        budget._arrivals += 1

    @property
    def held(self) -> bool:
        """Whether this ticket still counts against its budget."""
        return self._budget._holds(self)

    @property
    def deadline(self) -> float:
        """The budget's deadline, in seconds from accept."""
        return self._budget.deadline

    def on_abort(self, abort: Callable[[], None]) -> None:
        """Replace what aborting the connection does (it changes as the connection opens)."""
        self._abort = abort

    def greeted(self) -> None:
        """The peer said hello: its handshake is no longer evicted for newcomers."""
        if self.held:
            self.stage = Stage.GREETED

    def answered(self, deadline: float = PROBE_DEADLINE) -> None:
        """An authenticated probe was answered: evicted first, and aborted after ``deadline``."""
        if self.held:
            self.stage = Stage.ANSWERED
            self._arm(deadline)

    def release(self) -> None:
        """Stop counting this connection (it proved the token, or it ended); idempotent."""
        self._budget._release(self)

    def remaining(self) -> float:
        """Seconds left before the deadline aborts the connection (never below a millisecond)."""
        timer = self._timer
        if timer is None:
            return self._budget.deadline
        return max(timer.when() - asyncio.get_running_loop().time(), 0.001)

    def _arm(self, seconds: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(seconds, self._expire)

    def _expire(self) -> None:
        self._timer = None
        if self.held:
            self._budget._end(self, "expired")

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class PreauthBudget:
    """Connections that have not proved the token, counted from accept; see the module.

    Args:
        limit: tickets held at once.
        per_host: idle tickets held at once from one source address.
        deadline: seconds from accept before a connection that did not prove the token is
            aborted.

    Raises:
        ConfigError: a limit is not a positive int, or the deadline not a positive number.

    Attributes:
        evicted: connections aborted to make room for a newer one.
        expired: connections aborted at their deadline.
        refused: connections closed at once: every ticket, busy ones included, was taken.
    """

    def __init__(
        self,
        *,
        limit: int = DEFAULT_LIMIT,
        per_host: int = DEFAULT_PER_HOST,
        deadline: float = DEFAULT_DEADLINE,
    ) -> None:
        for name, value in (("limit", limit), ("per_host", per_host)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(
                    f"PreauthBudget({name}=...) must be a positive int, got {value!r}"
                )
        self.limit = limit
        self.per_host = per_host
        self.deadline = _check_deadline(deadline)
        self.holds_after_accept = False
        """Whether tickets stay held after ``accept()`` (set by :meth:`adopt`); otherwise a
        listener releases each ticket when it hands its transport out."""
        self._tickets: dict[Ticket, None] = {}  # in order of arrival: the oldest first
        self._busy: dict[Ticket, None] = {}
        self._arrivals = 0  # tickets entered so far: each one's rank of arrival
        self._report: Callable[[str], None] | None = None
        self.evicted = 0
        self.expired = 0
        self.refused = 0

    def adopt(self, *, deadline: float, report: Callable[[str], None]) -> None:
        """Hold tickets until the owner releases them, with ``deadline``; report endings.

        Called by the learner's gate, which releases a ticket once its peer proved the token
        and logs (in bursts) what ``report`` is told: one line per eviction or expiry.
        """
        self.deadline = _check_deadline(deadline)
        self._report = report
        self.holds_after_accept = True

    def note(self, text: str) -> None:
        """Report a connection the transport ended before the owner saw it (a bad first byte)."""
        if self._report is not None:
            self._report(text)

    @property
    def held(self) -> int:
        """Tickets held now, busy ones not included."""
        return len(self._tickets)

    def enter(self, peer: str, host: str, abort: Callable[[], None]) -> Ticket | None:
        """Count a connection just accepted from ``host``, making room if needed.

        ``abort`` closes the connection at once; the budget calls it when it evicts the
        connection or its deadline passes. Returns the ticket (perhaps :attr:`Ticket.busy`),
        or ``None`` when even the busy tickets are taken: close the connection at once.
        """
        if not self._make_room(host):
            if len(self._busy) >= self.limit:
                self.refused += 1
                return None
            ticket = Ticket(self, peer, host, abort, busy=True)
            self._busy[ticket] = None
        else:
            ticket = Ticket(self, peer, host, abort, busy=False)
            self._tickets[ticket] = None
        ticket._arm(self.deadline)
        return ticket

    def _make_room(self, host: str) -> bool:
        """Whether a newcomer from ``host`` may hold a ticket, evicting one if needed."""
        answered: Ticket | None = None
        idle: dict[str, list[Ticket]] = {}  # per address, the oldest first
        for ticket in self._tickets:
            if ticket.stage is Stage.IDLE:
                idle.setdefault(ticket.host, []).append(ticket)
            elif ticket.stage is Stage.ANSWERED and answered is None:
                answered = ticket
        from_host = idle.get(host, [])
        victim: Ticket | None = None
        if len(from_host) >= self.per_host:
            victim = from_host[0]
        elif len(self._tickets) >= self.limit:
            if answered is not None:
                victim = answered  # it got its answer: it goes first
            elif not idle:
                return False
            else:
                victim = self._fair_victim(idle, host)
        if victim is not None:
            self._end(victim, "evicted")
        return True

    @staticmethod
    def _fair_victim(idle: dict[str, list[Ticket]], host: str) -> Ticket:
        """The idle ticket to evict for a newcomer from ``host``.

        The oldest of the address that holds the most idle tickets (the newcomer counted
        with its own); between addresses holding as many, the one with the oldest ticket.
        Oldest-first alone lets a flood from a few addresses, each under its own limit,
        evict an honest newcomer from another address before it can say hello; this way an
        address with fewer idle connections than the others keeps them.
        """

        def share(address: str) -> tuple[int, int]:
            count = len(idle[address]) + (address == host)
            return count, -idle[address][0].arrival

        return idle[max(idle, key=share)][0]

    def _holds(self, ticket: Ticket) -> bool:
        return ticket in self._tickets or ticket in self._busy

    def _release(self, ticket: Ticket) -> None:
        ticket._disarm()
        self._tickets.pop(ticket, None)
        self._busy.pop(ticket, None)

    def _end(self, ticket: Ticket, why: str) -> None:
        """Abort ``ticket``'s connection now, count it and report it once."""
        self._release(ticket)
        ticket.ended = why
        if why == "evicted":
            self.evicted += 1
            text = (
                f"{ticket.peer}: Timeout: closed before proving the token, to make room for a "
                f"newer connection ({self.limit} at most, {self.per_host} idle per address)"
            )
        else:
            self.expired += 1
            text = (
                f"{ticket.peer}: Timeout: did not prove the token within {self.deadline} s of "
                "its connection; closed it"
            )
        try:
            ticket._abort()
        finally:
            # An answered probe that lingers is not a refused peer: it got its answer.
            if self._report is not None and ticket.stage is not Stage.ANSWERED:
                self._report(text)

    def __repr__(self) -> str:
        return (
            f"PreauthBudget(limit={self.limit}, per_host={self.per_host}, "
            f"deadline={self.deadline}, held={self.held})"
        )


def _check_deadline(value: float) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise ConfigError(
            f"a pre-auth deadline must be a positive number of seconds, got {value!r}"
        )
    return float(value)


def budget_of(listener: object) -> PreauthBudget | None:
    """The listener's pre-auth budget (its optional ``preauth`` attribute), if it has one."""
    budget = getattr(listener, "preauth", None)
    return budget if isinstance(budget, PreauthBudget) else None


def ticket_of(transport: object) -> Ticket | None:
    """The transport's pre-auth ticket (its optional ``preauth`` attribute), if it has one."""
    ticket = getattr(transport, "preauth", None)
    return ticket if isinstance(ticket, Ticket) else None
