"""The house rules of the package layout, checked from the source: no import cycles between moeq's modules, no module
importing or reaching into another's private names (``from m import _x`` or ``m._x``), and the bottom layers (errors,
native, formats) importing nothing above them."""
import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "moeq"


def graph() -> tuple[dict[str, set[str]], list[tuple[str, str]]]:
    mods = {}
    for f in SRC.rglob("*.py"):
        name = ".".join(("moeq", *f.relative_to(SRC).with_suffix("").parts)).removesuffix(".__init__")
        mods[name] = f
    edges = {m: set() for m in mods}
    private = []
    for m, f in mods.items():
        tree = ast.parse(f.read_text())
        aliases = {}  # local name -> the moeq module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("moeq"):
                for a in node.names:
                    if f"{node.module}.{a.name}" in mods:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in mods and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):  # attribute access: module._private from another module
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and aliases[node.value.id] != m and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                private.append((m, f"{aliases[node.value.id]}.{node.attr}"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("moeq"):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    target = full if full in mods else node.module
                    if target in mods and target != m:
                        edges[m].add(target)
                    if a.name.startswith("_") and not a.name.startswith("__") and node.module != m:
                        private.append((m, full))
            elif isinstance(node, ast.Import):
                edges[m].update(a.name for a in node.names if a.name in mods and a.name != m)
    return edges, private


def test_no_import_cycles():
    edges, _ = graph()
    state: dict[str, int] = {}

    def visit(v, path):
        state[v] = 1
        for w in edges[v]:
            assert state.get(w) != 1, f"import cycle: {' -> '.join(path + [w])}"
            if w not in state:
                visit(w, path + [w])
        state[v] = 2

    for v in edges:
        if v not in state:
            visit(v, [v])


def test_no_private_imports_across_modules():
    _, private = graph()
    assert private == []


def test_bottom_layers_import_nothing_above_them():
    edges, _ = graph()
    allowed = {"moeq.errors": set(), "moeq.native": {"moeq.errors"}}
    for m, targets in edges.items():
        if m in allowed:
            assert targets <= allowed[m], (m, targets)
        if m.startswith("moeq.formats"):
            assert all(t.startswith(("moeq.formats", "moeq.native", "moeq.errors")) for t in targets), (m, targets)


TORCH_INTERNALS = {"_buffers", "_parameters", "_forward_hooks", "_forward_pre_hooks", "_apply", "_fields",
                   "_register_load_state_dict_pre_hook", "_register_state_dict_hook"}


def test_private_attributes_stay_with_their_owner():
    """A private attribute of another object (``obj._x``, not on ``self``/``cls``/``super()``) is read only in the
    file that sets it, or is one of torch's module internals; and moeq stores no ad-hoc ``_moeq*`` state on other
    libraries' modules (its state lives in its own objects: installed forwards, its modules' plan slots)."""
    bad = []
    for f in SRC.rglob("*.py"):
        tree = ast.parse(f.read_text())
        owned = {t.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
                 for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                 if isinstance(t, ast.Attribute)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("_moeq"):
                bad.append((f.name, node.value))
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            v = node.value
            if node.attr.startswith("_moeq"):
                bad.append((f.name, ast.unparse(node)))
            elif not ((isinstance(v, ast.Name) and v.id in ("self", "cls"))
                      or (isinstance(v, ast.Call) and ast.unparse(v.func) == "super")
                      or node.attr in owned or node.attr in TORCH_INTERNALS):
                bad.append((f.name, ast.unparse(node)))
    assert bad == []
