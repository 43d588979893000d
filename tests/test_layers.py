"""The import-direction rule of the design: each layer imports only from layers below it."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import aps

ROOT = Path(aps.__file__).parent

# Lowest first. A module may import aps modules of its own layer or of a lower one.
LAYERS: list[tuple[str, ...]] = [
    ("aps.errors", "aps._version", "aps._base", "aps.metrics.figures"),
    ("aps.wire",),
    ("aps.transports",),
    ("aps.session",),
    ("aps.sync", "aps.pg", "aps.correction"),
    ("aps.policy",),
    (
        "aps.vector",
        "aps.multiagent",
        "aps.worker",
        "aps.learner",
        "aps.collect",
        "aps.gradients",
        "aps.learner.trainer",
        "aps.learner.simulate",
        "aps.worker.sampling",
    ),
    (
        "aps.cluster_env",
        "aps.launch",
        "aps.cli",
        "aps.__main__",
        "aps.testing",
        "aps.metrics",
        "aps",
    ),
    ("aps.integrations",),
]

# Transports move opaque frames: they may use the framing helper, never the message layer.
FORBIDDEN = {
    "aps.transports": (
        "aps.wire.messages",
        "aps.wire.codec",
        "aps.wire.compression",
        "aps.wire.frame_delta",
        "aps.wire._wire",
        "aps.wire._fast_pack",
        "aps.wire._unpack",
        "aps.wire._specs",
        "aps.wire._layouts",
        "aps.wire.spaces",
        "aps.wire.batching",
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


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = ["aps", *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


# The one upward reference, for a name users write: ``aps.pg.NIGT`` is the trainer a layer up
# (aps/learner/trainer.py), named by aps.pg's module ``__getattr__`` (PEP 562) on first use of
# the name, so importing aps.pg imports no learner. Allowed there (and under the module's
# ``if TYPE_CHECKING:``, which names the same for type checkers) and nowhere else.
LAZY_NAMES = {("aps.pg", "aps.learner.trainer")}


def node_imports(node: ast.AST) -> set[str]:
    """The aps modules one ``import`` or absolute ``from ... import`` statement names."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name.split(".")[0] == "aps"}
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        if node.module == "aps":
            return {f"aps.{a.name}" for a in node.names}
        if node.module.startswith("aps."):
            return {node.module}
    return set()


def lazy_names_allowed(tree: ast.Module, me: str) -> set[int]:
    """The import statements inside ``me``'s module-level ``__getattr__`` or ``if
    TYPE_CHECKING:`` that name only what :data:`LAZY_NAMES` allows ``me``."""
    scopes = [
        statement
        for statement in tree.body
        if (isinstance(statement, ast.FunctionDef) and statement.name == "__getattr__")
        or (isinstance(statement, ast.If) and ast.unparse(statement.test) == "TYPE_CHECKING")
    ]
    return {
        id(node)
        for scope in scopes
        for node in ast.walk(scope)
        if node_imports(node) and all((me, t) in LAZY_NAMES for t in node_imports(node))
    }


def aps_imports(path: Path, root: Path = ROOT) -> set[str]:
    """The aps modules ``path`` imports anywhere, but for the lazy names it is allowed."""
    tree = ast.parse(path.read_text())
    allowed = lazy_names_allowed(tree, module_name(path, root))
    return {t for node in ast.walk(tree) if id(node) not in allowed for t in node_imports(node)}


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
    assert layer_of("aps.learner") > layer_of("aps.wire.codec")
    assert layer_of("aps.transports.tcp") < layer_of("aps.session")


# The codec's parts sit below aps.wire.codec, which assembles them: none of them imports it, and
# aps.wire._wire, which they all share, imports none of the others.
CODEC_PARTS = {
    "aps.wire._wire": ("aps.wire.codec", "aps.wire._fast_pack", "aps.wire._unpack"),
    "aps.wire._fast_pack": ("aps.wire.codec", "aps.wire._unpack"),
    "aps.wire._unpack": ("aps.wire.codec", "aps.wire._fast_pack"),
    "aps.wire._trees": ("aps.wire.codec",),
    "aps.wire._guards": ("aps.wire.codec",),
}


def test_codec_parts_import_down() -> None:
    violations = []
    for me, banned in CODEC_PARTS.items():
        path = ROOT / Path(*me.split(".")[1:]).with_suffix(".py")
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


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Each aps module under ``root`` and the aps modules it imports, at any depth (functions
    included).

    ``from aps.x import y`` reaches ``aps.x.y`` when that is a module, else ``aps.x``; importing
    a module runs its packages' ``__init__`` too, so it reaches them as well (all but the
    top-level ``aps``, the façade that every import runs first, and the packages the
    importing module is itself inside).
    """
    modules = {module_name(path, root): path for path in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for me, path in modules.items():
        reached: set[str] = set()
        tree = ast.parse(path.read_text())
        typing_only = {  # imports under `if TYPE_CHECKING:` never run
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and ast.unparse(block.test).endswith("TYPE_CHECKING")
            for statement in block.body
            for n in ast.walk(statement)
        }
        allowed = lazy_names_allowed(tree, me)
        for node in ast.walk(tree):
            if id(node) in typing_only or id(node) in allowed:
                continue
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [
                    f"{node.module}.{a.name}"
                    if f"{node.module}.{a.name}" in modules
                    else node.module
                    for a in node.names
                ]
            for name in names:
                parts = name.split(".")
                if parts[0] != "aps":
                    continue
                reached.update(".".join(parts[:n]) for n in range(2, len(parts) + 1))
        # A module inside a package runs as part of it: the package is no edge of its own.
        graph[me] = {m for m in reached if m in modules and not me.startswith(m + ".")}
        graph[me].discard(me)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_even_through_function_level_imports() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_cycle_rule_catches_a_function_level_cycle(tmp_path: Path) -> None:
    # The check itself must be able to fail: a -> b at module level, b -> a in a function.
    graph = {"aps.a": {"aps.b"}, "aps.b": {"aps.a"}, "aps.c": {"aps.a"}}
    assert cycles(graph) == [["aps.a", "aps.b"]]
    # And the graph must see imports inside functions (and not those only type checkers run),
    # read from files as the real package is.
    package = tmp_path / "aps"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from aps.sub import b\n")
    (package / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from aps import c\n"
        "def late():\n    import aps.a\n"
    )
    method = "class Hidden:\n    def f(self):\n        from aps.sub import b\n"
    (package / "c.py").write_text(method)
    found = import_graph(package)
    assert found["aps.sub.b"] == {"aps.a"}  # the function's import; not the typing-only one
    assert cycles(found) == [["aps.a", "aps.sub.b"]]
    (package / "sub" / "b.py").write_text("def late():\n    pass\n")
    assert cycles(import_graph(package)) == []


# Transports describe themselves: outside aps/transports/ no code decides what to do by a
# scheme's name (a comparison, a membership test, a prefix test or a table keyed by scheme).
# Docstrings and default URL arguments name schemes freely; they decide nothing.
SCHEMES = frozenset({"tcp", "tls", "ws", "wss", "unix", "memory"})
SCHEME_RULE_EXEMPT = {
    # A relay of raw TCP bytes for the chaos tests: it is a TCP transport of its own.
    "aps.testing.chaos",
}


def _names_a_scheme(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        text = node.value.lower()
        return text in SCHEMES or ("://" in text and text.partition("://")[0] in SCHEMES)
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_names_a_scheme(element) for element in node.elts)
    return False


def scheme_decisions(source: str) -> list[int]:
    """The lines of ``source`` that decide behaviour by a scheme's name."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            named = any(map(_names_a_scheme, [node.left, *node.comparators]))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            named = node.func.attr in ("startswith", "endswith") and any(
                map(_names_a_scheme, node.args)
            )
        elif isinstance(node, ast.Dict):
            named = any(key is not None and _names_a_scheme(key) for key in node.keys)
        elif isinstance(node, ast.match_case):
            named = any(
                isinstance(n, ast.MatchValue) and _names_a_scheme(n.value)
                for n in ast.walk(node.pattern)
            )
        else:
            continue
        if named:
            lines.append(node.pattern.lineno if isinstance(node, ast.match_case) else node.lineno)
    return sorted(lines)


def test_scheme_names_decide_nothing_outside_the_transports() -> None:
    violations = []
    for path in sorted(ROOT.rglob("*.py")):
        me = module_name(path)
        if me.startswith("aps.transports") or me in SCHEME_RULE_EXEMPT:
            continue
        for line in scheme_decisions(path.read_text()):
            violations.append(f"{me}:{line} decides by a scheme's name; ask aps.transports")
    assert not violations, "\n".join(violations)


def test_scheme_rule_catches_each_kind_of_decision() -> None:
    # The check itself must be able to fail, and must let docstrings and defaults be.
    caught = [
        'if scheme in ("tcp", "tls"):\n    pass\n',
        'ok = url.startswith("ws://")\n',
        'urls = {"unix": "unix://"}\n',
        'match scheme:\n    case "memory":\n        pass\n',
        'ok = "TCP" == name\n',
    ]
    for source in caught:
        assert scheme_decisions(source) != [], source
    allowed = 'def f(listen="tcp://127.0.0.1:0"):\n    """Bind ``"unix://"``."""\n'
    assert scheme_decisions(allowed) == []


def test_the_root_holds_at_most_ten_modules() -> None:
    # The rest sit in the folder of their layer (aps/wire, aps/session, aps/policy, ...) or
    # of their role (aps/learner, aps/worker, ...).
    modules = sorted(path.name for path in ROOT.glob("*.py"))
    assert len(modules) <= 10, modules


# Folders whose modules span layers, and why.
SPANNING = {
    "metrics": "its figures are plain data at the bottom, read by the learner; the rest is top",
}


def test_each_folder_is_one_layer() -> None:
    for folder in sorted(p for p in ROOT.iterdir() if (p / "__init__.py").is_file()):
        if folder.name in SPANNING:
            continue
        layers = {layer_of(module_name(path)) for path in folder.rglob("*.py")}
        assert len(layers) == 1, f"aps/{folder.name} spans layers {sorted(layers)}"


@pytest.mark.parametrize("old, new", sorted(aps._MOVED.items()))
def test_a_moved_module_keeps_its_old_import_path(old: str, new: str) -> None:
    # Plug-ins import aps.framing (docs/recipes/plugins.md); the others were importable too.
    moved = importlib.import_module(old)
    assert moved is importlib.import_module(new)
    assert moved.__name__ == new


def test_the_lazy_name_is_the_trainer_and_importing_the_rules_imports_no_learner() -> None:
    # aps.pg's one allowed upward reference resolves to the trainer beside the learner's
    # modes, and only when the name is used.
    code = (
        "import sys, aps.pg; before = 'aps.learner.trainer' in sys.modules; "
        "from aps.learner.trainer import NIGT; print(before, aps.pg.NIGT is NIGT)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]
    # The allowance is narrow: the same import anywhere else in aps.pg is an upward import.
    tree = ast.parse("from aps.learner.trainer import NIGT\ndef __getattr__(n):\n    pass\n")
    assert lazy_names_allowed(tree, "aps.pg") == set()
