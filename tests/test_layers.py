"""The layout is the architecture (DESIGN §1): no import cycle among our modules, no lower
layer importing a higher one, and the rooms of the write path reached only through the
engine's face from above it.

    errors < core < config, buffers, stats, iopool, progress, hdf5 < store < sources < assimilators
      < tiers < engine, stream, fsspec < namespace < fuse < control_client < daemon, warm < export
      < cli < testing

Every import counts, also one inside a function or under ``TYPE_CHECKING`` (a lazy or typing
import is still a dependency). A module may import lower layers and modules of its own unit;
units of the same layer do not import each other. A package of rooms behind one face
(``FACES``) is imported from outside through its face alone, by tests too.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYERS = [
    ["faultfs.errors"],
    ["faultfs.core"],
    ["faultfs.config", "faultfs.buffers", "faultfs.stats", "faultfs.iopool", "faultfs.progress",
     "faultfs.metrics", "faultfs.hdf5"],
    ["faultfs.store"],
    ["faultfs.sources"],
    ["assimilators"],
    ["faultfs.tiers"],
    ["faultfs.engine", "faultfs.stream", "faultfs.fsspec"],
    ["faultfs.namespace"],
    ["faultfs.fuse"],
    ["faultfs.control_client"],  # requests to a live mount: warm asks it what is staged
    ["faultfs.daemon", "faultfs.warm"],
    ["faultfs.export"],
    ["faultfs.cli", "faultfs.api"],
    ["faultfs.testing"],
]
RANK = {unit: rank for rank, layer in enumerate(LAYERS) for unit in layer}
# packages of private rooms behind one face (STYLE, "One face, private rooms"): a module outside
# such a package, tests included, imports the package, never one of its rooms
FACES = ["faultfs.stream.partition", "faultfs.stream.shuffle", "faultfs.testing.proxy",
         "faultfs.store.fsck", "faultfs.tiers.local", "faultfs.fsspec", "faultfs.hdf5"]
UNLAYERED = ("faultfs",)  # the package's own __init__ (its version) may be imported by anyone
# faces whose rooms tests may open, and why (code never may)
ROOMS_OPEN_TO_TESTS = {
    "faultfs.stream.partition": "its format and crash tests pin the sidecar's bytes and "
                                "patch the steps of a repartition",
    "faultfs.stream.shuffle": "its format tests pin the shuffle record's and the carried "
                              "rest's bytes, and its resume test counts the blocks a restart "
                              "reads and hashes",
    "faultfs.fsspec": "its landing tests drive a fault in flight piece by piece from a fake "
                      "source, a timing no reader through the face can set up",
    "faultfs.hdf5": "its tests replay h5py's reads through each planner and look at what it "
                    "keeps (a file's chunks, a group's walk, a crafted file's bounds), which "
                    "no read through the face shows",
}
WRITES = "faultfs.engine.writes"  # a package of rooms: the engine calls it, nothing above does
FACE_ONLY = ("faultfs.namespace", "faultfs.fuse")  # they call the engine, never a room of it


def unit_of(module: str) -> str | None:
    """The layered unit (package or module) ``module`` belongs to."""
    for unit in RANK:
        if module == unit or module.startswith(unit + "."):
            return unit
    return None


def our_modules() -> dict[str, pathlib.Path]:
    found = {}
    for base in ("faultfs", "assimilators"):
        for path in (ROOT / base).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports_of(module: str, source: str, known: set[str], *, is_package: bool = False) -> set[str]:
    """Our modules that ``module`` imports (each resolved to the longest known name)."""
    package = module if is_package else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != module:
                out.add(target)
    return out


def compiled_modules() -> set[str]:
    """Our C extensions (``setup.py``), by their sources: leaves that import none of ours."""
    return {".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / "faultfs").rglob("_*.c")}


def import_graph() -> dict[str, set[str]]:
    modules = our_modules()
    known = set(modules) | compiled_modules()
    return {m: imports_of(m, p.read_text(), known, is_package=p.name == "__init__.py")
            for m, p in modules.items()}


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in sorted(edges.items()):
        unit = unit_of(module)
        if unit is None:
            continue
        for target in sorted(targets):
            other = unit_of(target)
            if other is not None and other != unit and RANK[other] >= RANK[unit]:
                bad.append(f"{module} imports {target} ({other} is not below {unit})")
    return bad


def rooms_reached_past_their_face(edges: dict[str, set[str]], faces=FACES) -> list[str]:
    bad = []
    for module, targets in sorted(edges.items()):
        for face in faces:
            if module == face or module.startswith(face + "."):
                continue
            bad += [f"{module} imports {target}, a room of {face}: import the face"
                    for target in sorted(targets) if target.startswith(face + ".")]
    return bad


def our_tests() -> dict[str, pathlib.Path]:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts): p
            for p in (ROOT / "tests").rglob("*.py")}


def find_cycles(edges: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*stack[stack.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    return cycles


def imports_of_writes(edges: dict[str, set[str]], units: tuple[str, ...]) -> list[str]:
    """Imports of the write package (or any module of it) by modules of ``units``."""
    return [f"{module} imports {target}" for module, targets in sorted(edges.items())
            if unit_of(module) in units for target in sorted(targets)
            if target == WRITES or target.startswith(WRITES + ".")]


def reaches_writes(source: str) -> list[int]:
    """Lines of ``source`` that reach an attribute ``writes`` (``engine.writes...``)."""
    return sorted(node.lineno for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Attribute) and node.attr == "writes")


def test_every_module_has_a_layer():
    missing = sorted(m for m in our_modules() if m not in UNLAYERED and unit_of(m) is None)
    assert missing == [], f"modules outside every layer of DESIGN §1: {missing}"


def test_no_lower_layer_imports_a_higher_one():
    bad = upward_imports(import_graph())
    assert bad == [], "\n".join(bad)


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert cycles == [], "import cycles:\n" + "\n".join(cycles)


def test_callers_import_a_package_of_rooms_by_its_face():
    known = set(our_modules()) | compiled_modules()
    edges = import_graph()
    bad = rooms_reached_past_their_face(edges)
    tests = {m: imports_of(m, p.read_text(), known) for m, p in our_tests().items()}
    bad += rooms_reached_past_their_face(
        tests, [f for f in FACES if f not in ROOMS_OPEN_TO_TESTS])
    assert bad == [], "\n".join(bad)


def test_the_namespace_and_fuse_call_the_engine_never_a_room_of_its_writes():
    """Writes go through the engine's face, as reads do: the namespace and the FUSE layer
    import no module of ``engine/writes/``, and nothing above the engine reaches
    ``engine.writes`` (the test helpers excepted: they test the rooms)."""
    assert imports_of_writes(import_graph(), FACE_ONLY) == []
    reached = []
    for module, path in sorted(our_modules().items()):
        unit = unit_of(module)
        if unit is not None and RANK[unit] > RANK["faultfs.engine"] and unit != "faultfs.testing":
            reached += [f"{path.relative_to(ROOT)}:{line}"
                        for line in reaches_writes(path.read_text())]
    assert reached == [], "the engine's writes reached from above it:\n" + "\n".join(reached)


def test_the_checks_find_planted_violations():
    """The checks must be able to fail: planted upward, sideways and cyclic imports."""
    known = {"faultfs.core.chunks", "faultfs.engine", "faultfs.engine.tags", "faultfs.stream",
             "faultfs.engine.faults"}
    found = imports_of("faultfs.core.chunks",
                       "def f():\n    from faultfs.engine import tags\n", known)
    assert found == {"faultfs.engine", "faultfs.engine.tags"}
    assert imports_of("faultfs.engine.faults", "from .tags import Tag\n", known) == {
        "faultfs.engine.tags"}
    assert upward_imports({"faultfs.core.chunks": {"faultfs.engine.tags"}}) != []
    assert upward_imports({"faultfs.stream": {"faultfs.engine"}}) != []  # same layer
    assert upward_imports({"faultfs.engine.faults": {"faultfs.engine.tags"}}) == []
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a -> b -> c -> a"]
    assert find_cycles({"a": {"b"}, "b": set()}) == []
    faces = ["faultfs.stream.partition"]
    assert rooms_reached_past_their_face(
        {"faultfs.stream.torch": {"faultfs.stream.partition.sidecar"}}, faces) != []
    assert rooms_reached_past_their_face(
        {"faultfs.stream.torch": {"faultfs.stream.partition"},
         "faultfs.stream.partition": {"faultfs.stream.partition.plan"},
         "faultfs.stream.partition.plan": {"faultfs.stream.partition.sidecar"}}, faces) == []
    assert imports_of_writes({"faultfs.namespace.tree": {"faultfs.engine.writes.table"},
                              "faultfs.fuse.ops": {"faultfs.engine.writes"},
                              "faultfs.engine.engine": {"faultfs.engine.writes"}},
                             FACE_ONLY) == [
        "faultfs.fuse.ops imports faultfs.engine.writes",
        "faultfs.namespace.tree imports faultfs.engine.writes.table"]
    assert reaches_writes("def f(engine):\n    return engine.writes.view_size(1)\n") == [2]
    assert reaches_writes("# engine.writes.view_size\nx = 'engine.writes'\n") == []
