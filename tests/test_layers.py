"""The import-direction rule of the design: each layer imports only from layers below it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import aps

ROOT = Path(aps.__file__).parent

# Lowest first. A module may import aps modules of its own layer or of a lower one.
LAYERS: list[tuple[str, ...]] = [
    ("aps.errors", "aps._typing", "aps._imports", "aps._buffers", "aps._version"),
    (
        "aps.messages",
        "aps.codec",
        "aps._wire",
        "aps._fast_pack",
        "aps._unpack",
        "aps.spaces",
        "aps.batching",
        "aps.framing",
    ),
    ("aps.transports",),
    ("aps.protocol", "aps.delivery", "aps.session", "aps._loop"),
    ("aps.sync", "aps.pg"),
    ("aps.policy", "aps._numpy_heads"),
    (
        "aps.vector",
        "aps.worker",
        "aps.learner",
        "aps.collect",
        "aps.gradients",
        "aps.pg.trainer",
        "aps.pg.simulate",
    ),
    ("aps.cluster_env", "aps.launch", "aps.cli", "aps.__main__", "aps.testing", "aps"),
    ("aps.integrations",),
]

# Transports move opaque frames: they may use the framing helper, never the message layer.
FORBIDDEN = {
    "aps.transports": (
        "aps.messages",
        "aps.codec",
        "aps._wire",
        "aps._fast_pack",
        "aps._unpack",
        "aps.spaces",
        "aps.batching",
    )
}


def layer_of(module: str) -> int:
    best, best_len = -1, -1
    for index, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best_len:
                best, best_len = index, len(name)
    assert best >= 0, f"{module} is in no layer; add it to LAYERS"
    return best


def module_name(path: Path) -> str:
    parts = ["aps", *path.relative_to(ROOT).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def aps_imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "aps")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "aps":
                found.update(f"aps.{a.name}" for a in node.names)
            elif node.module.startswith("aps."):
                found.add(node.module)
    return found


def test_imports_point_down() -> None:
    violations = []
    for path in sorted(ROOT.rglob("*.py")):
        me = module_name(path)
        for target in aps_imports(path):
            if target.startswith(me + ".") or target == me:
                continue  # a package importing its own submodules
            if layer_of(target) > layer_of(me):
                violations.append(f"{me} imports {target} (a higher layer)")
            for below, banned in FORBIDDEN.items():
                if me.startswith(below) and target.startswith(banned):
                    violations.append(f"{me} imports {target} (transports carry bytes only)")
    assert not violations, "\n".join(violations)


def test_rule_catches_an_upward_import() -> None:
    # The check itself must be able to fail.
    assert layer_of("aps.learner") > layer_of("aps.codec")
    assert layer_of("aps.transports.tcp") < layer_of("aps.session")


# The codec's parts sit below aps.codec, which assembles them: none of them imports it, and
# aps._wire, which they all share, imports none of the others.
CODEC_PARTS = {
    "aps._wire": ("aps.codec", "aps._fast_pack", "aps._unpack"),
    "aps._fast_pack": ("aps.codec", "aps._unpack"),
    "aps._unpack": ("aps.codec", "aps._fast_pack"),
}


def test_codec_parts_import_down() -> None:
    violations = []
    for me, banned in CODEC_PARTS.items():
        path = ROOT / f"{me.removeprefix('aps.')}.py"
        violations += [f"{me} imports {t}" for t in aps_imports(path) if t in banned]
    assert not violations, "\n".join(violations)


def test_importing_aps_loads_neither_torch_nor_websockets() -> None:
    code = "import sys, aps; print(sorted(m for m in ('torch', 'websockets') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# Inside the roles, each mode talks to the pool (learner) or is driven by the session loop
# (worker); no mode imports another, so a mode changes without touching the others.
MODES = {
    "aps.learner": ("aps.learner.lockstep", "aps.learner.detach", "aps.learner.rounds"),
    "aps.worker": ("aps.worker.steps", "aps.worker.collector", "aps.worker.rounds"),
}
ALLOWED = {("aps.worker.steps", "aps.worker.collector")}  # the step server hands rollouts on


def test_modes_do_not_import_each_other() -> None:
    violations = []
    for modes in MODES.values():
        for me in modes:
            path = ROOT / Path(*me.split(".")[1:]).with_suffix(".py")
            for target in aps_imports(path):
                if target in modes and target != me and (me, target) not in ALLOWED:
                    violations.append(f"{me} imports {target}")
    assert not violations, "\n".join(violations)
