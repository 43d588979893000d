"""The learner's modes hold the workers through the pool's lease, and reach the pool by a
few members.

The lease sequence (end the mode a caller left open, refuse, enter; on a worker's failure
break for good; always leave) is written once, in ``aps/learner/lease.py``; a mode takes a
lease (``async with pool.lease(...)``, or a ``Lease`` it keeps across calls). The pool's
parts (the slot table, recovery, the request service, the settings) are reached through the
pool's member that holds them, never through a property that forwards. These tests read the
mode modules' source and fail when a mode writes the sequence itself or the modes together
use more than :data:`MAX_MEMBERS` of the pool's members.
"""

from __future__ import annotations

import ast
from pathlib import Path

import aps
from aps.learner import Learner

LEARNER = Path(aps.__file__).parent / "learner"
MODES = ("lockstep.py", "detach.py", "rounds.py")

# The pool's lease sequence, by the names of its steps (public and private).
SEQUENCE = frozenset(
    {"enter", "leave", "end_abandoned", "_leave", "_refuse", "_abandoned", "break_for_good"}
)

# Where a mode may still break the workers by hand, and why: a failure noticed outside any
# lease. Keyed by (module, enclosing function).
ALLOWED = {
    ("detach.py", "publish"): (
        "publishing holds no lease (a chunk stream publishes from inside its loop), yet a "
        "worker that lost its first version can act no more"
    ),
}


def sequence_calls(source: str, module: str) -> list[str]:
    """The calls of ``source`` to a step of the lease sequence, as ``module:line function.step``,
    except those :data:`ALLOWED`."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = (
                child.name
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
                else function
            )
            if (
                isinstance(child, ast.Call)
                and isinstance(child.func, ast.Attribute)
                and child.func.attr in SEQUENCE
                and (module, function) not in ALLOWED
            ):
                found.append(f"{module}:{child.lineno} {function}.{child.func.attr}")
            visit(child, inner)

    visit(ast.parse(source), "<module>")
    return found


def test_no_mode_writes_the_lease_sequence() -> None:
    found = []
    for name in MODES:
        found += sequence_calls((LEARNER / name).read_text(), name)
    assert not found, "modes take pool.lease(...) instead:\n" + "\n".join(found)


def test_each_allowed_break_is_still_there() -> None:
    # An exception nobody needs any more goes: the list stays the few there are.
    for module, function in ALLOWED:
        tree = ast.parse((LEARNER / module).read_text())
        calls = [
            node
            for outer in ast.walk(tree)
            if isinstance(outer, ast.FunctionDef | ast.AsyncFunctionDef) and outer.name == function
            for node in ast.walk(outer)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "break_for_good"
        ]
        assert len(calls) == 1, (module, function)


def test_the_rule_catches_a_hand_written_lease() -> None:
    # The check itself must be able to fail, on each step, in any function but the allowed.
    source = (
        "class Mode:\n"
        "    async def run(self):\n"
        "        await self._pool.end_abandoned()\n"
        "        self._pool.enter(Mode.X, 'run')\n"
        "        try:\n"
        "            pass\n"
        "        except WorkerLost as exc:\n"
        "            pool.break_for_good(exc)\n"
        "        finally:\n"
        "            pool.leave(Mode.X)\n"
        "    async def publish(self):\n"
        "        pool.break_for_good(exc)\n"
    )
    assert sequence_calls(source, "mine.py") == [
        "mine.py:3 run.end_abandoned",
        "mine.py:4 run.enter",
        "mine.py:8 run.break_for_good",
        "mine.py:10 run.leave",
        "mine.py:12 publish.break_for_good",
    ]
    assert sequence_calls(source, "detach.py")[-1] == "detach.py:10 run.leave"
    assert sequence_calls("async with pool.lease(Mode.X, 'run'):\n    pass\n", "m.py") == []


# The pool as the modes see it: a few members, each one route to one part (the pump reads
# the slots for the streaming modes, so it counts as theirs).
MAX_MEMBERS = 12
POOL_USERS = (*MODES, "pump.py")


def pool_members(source: str) -> set[str]:
    """The pool members ``source`` reaches, as ``pool.X`` or ``self._pool.X``."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if (isinstance(owner, ast.Name) and owner.id == "pool") or (
            isinstance(owner, ast.Attribute)
            and owner.attr == "_pool"
            and isinstance(owner.value, ast.Name)
            and owner.value.id == "self"
        ):
            found.add(node.attr)
    return found


def used_members() -> dict[str, list[str]]:
    used: dict[str, list[str]] = {}
    for name in POOL_USERS:
        for member in pool_members((LEARNER / name).read_text()):
            used.setdefault(member, []).append(name)
    return used


def test_the_modes_use_at_most_twelve_pool_members() -> None:
    used = used_members()
    listing = "\n".join(f"{member}: {', '.join(names)}" for member, names in sorted(used.items()))
    assert len(used) <= MAX_MEMBERS, (
        f"the modes use {len(used)} pool members, more than {MAX_MEMBERS}; reach the pool's "
        f"parts through pool.slots, pool.recovery, pool.requests or pool.config:\n{listing}"
    )


def test_each_member_the_modes_use_is_the_pools_own() -> None:
    # No forwarding property hides behind a name: each member is the pool's, and the ones
    # that forwarded to the slot table or recovery are gone.
    pool = Learner("tcp://127.0.0.1:0", num_workers=1)._pool  # not started: nothing bound
    members = set(vars(pool)) | set(dir(type(pool)))  # without running a property
    assert sorted(set(used_members()) - members) == []
    forwarded = ("admitted", "counts", "offsets", "dropped", "former", "restarts", "was_reset")
    assert [name for name in forwarded if name in members] == []
    assert {"slots", "recovery", "requests", "lease", "exchange"} <= set(used_members())


def test_the_member_rule_can_fail() -> None:
    source = (
        "class Mode:\n"
        "    def run(self, pool, other):\n"
        "        self._pool.slots.admitted\n"
        "        pool.slots.counts\n"
        "        pool.lease(Mode.X, 'run')\n"
        "        other._pool.hidden\n"
        "        self.pool.not_the_pool\n"
    )
    assert pool_members(source) == {"slots", "lease"}
    thirteen = "\n".join(f"pool.member{i}" for i in range(MAX_MEMBERS + 1))
    assert len(pool_members(thirteen)) == MAX_MEMBERS + 1 > MAX_MEMBERS
