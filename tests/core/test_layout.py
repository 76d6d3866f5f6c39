"""The package layout (docs/design.md, Layout): floors, no import circle, a small top level."""

from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys

import attnpool

SRC = pathlib.Path(attnpool.__file__).parent

# The floors of docs/design.md's Layout section, bottom first: a module may import only from a lower
# floor, or from its own package. Keys are top-level modules or packages of attnpool.
FLOOR = {
    "errors": 0, "config": 1, "inputs": 2, "specs": 2, "arena": 3, "views": 4, "check": 5,
    "update": 6, "phases": 7, "pool": 8, "kv": 9, "lora": 10, "adapters": 10, "graphs": 10,
    "integrations": 11, "tools": 12, "__main__": 13, "__init__": 14,
}


def _modname(path: pathlib.Path) -> str:
    rel = path.relative_to(SRC).with_suffix("").parts
    if rel[-1] == "__init__":
        rel = rel[:-1]
    return ".".join(("attnpool", *rel))


def _imports(path: pathlib.Path) -> set[str]:
    """Every attnpool module ``path`` imports, lazily or for type checking included."""
    me = _modname(path)
    pkg = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                mod = ".".join([*base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            if not mod.startswith("attnpool"):
                continue
            names = [f"{mod}.{a.name}" for a in node.names]
            subs = [n for n in names if (SRC.parent / (n.replace(".", "/") + ".py")).exists()
                    or (SRC.parent / n.replace(".", "/")).is_dir()]
            out.update(subs or [mod])
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("attnpool"))
    return out - {me}


def _top(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _graph() -> dict[str, set[str]]:
    return {_modname(p): _imports(p) for p in SRC.rglob("*.py")}


def test_every_module_is_on_a_floor() -> None:
    for mod in _graph():
        assert _top(mod) in FLOOR, f"{mod} is not placed in the layout's floors"


def test_imports_point_down() -> None:
    for mod, deps in _graph().items():
        me = _top(mod)
        for dep in deps:
            them = _top(dep)
            if them == me:
                continue  # inside one package: the circle test below still applies
            assert FLOOR[them] < FLOOR[me], f"{mod} imports {dep} (floor {FLOOR[them]} >= {FLOOR[me]})"


def test_no_import_circle() -> None:
    graph = _graph()
    state: dict[str, int] = {}

    def visit(mod: str, trail: list[str]) -> None:
        state[mod] = 1
        for dep in sorted(graph.get(mod, ())):
            if state.get(dep) == 1:
                raise AssertionError("import circle: " + " -> ".join([*trail, mod, dep]))
            if dep in graph and not state.get(dep):
                visit(dep, [*trail, mod])
        state[mod] = 2

    for mod in sorted(graph):
        if not state.get(mod):
            visit(mod, [])


def test_nothing_in_src_imports_tests_or_benchmarks() -> None:
    outside = {p.stem for d in ("tests", "benchmarks") for p in (SRC.parents[1] / d).rglob("*.py")}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            for name in names:
                root = name.split(".")[0]
                assert root not in outside | {"tests", "benchmarks"}, f"{path} imports {name}"


def test_top_level_stays_small() -> None:
    modules = sorted(p.name for p in SRC.glob("*.py"))
    assert len(modules) <= 12, modules


def test_update_is_grouped_by_meaning() -> None:
    """update/: the contract at the top, one folder per way of writing (reference/, the
    torch path; host/, the CPU host route; triton/, the fused path), at most 10 entries."""
    entries = sorted(p.name for p in (SRC / "update").iterdir() if p.name != "__pycache__")
    assert len(entries) <= 10, entries
    assert {"reference", "host", "triton"} <= {p for p in entries if (SRC / "update" / p).is_dir()}
    assert not list((SRC / "update").glob("*.c")) and not list(SRC.rglob("*.cpp")), entries


def test_public_paths_import() -> None:
    for mod, names in {
        "attnpool.kv": ("KVCachePool", "KVCacheConfig", "KVKind", "KVLayout"),
        "attnpool.lora": ("LoRABatchPool", "LoRAConfig"),
        "attnpool.graphs": ("GraphRunner",),
        "attnpool.adapters.sdpa": ("attention", "paged_attention"),
        "attnpool.adapters.flash_attn": ("attention", "FlashAttnVersion", "load_fa4",
                                         "clear_kernel_cache", "FA3_MODULES"),
        "attnpool.adapters.mla": ("attention",),
        "attnpool.adapters.binding": ("Run", "bind"),
        "attnpool.adapters.flashinfer": ("GraphWrappers",),
        "attnpool.integrations.transformers": ("PagedGenerator",),
        "attnpool.tools.cli": ("main",),
    }.items():
        m = importlib.import_module(mod)
        for name in names:
            assert hasattr(m, name), f"{mod}.{name}"


def test_engine_integrations_import_no_other_integration() -> None:
    """Each engine's package under integrations/ (transformers, vllm, ...) imports only itself
    below integrations/, and the modules beside the packages that hold what the engines share
    (integrations/engine.py: sizes to a PoolConfig, the layers' shared facts, the filler
    skeleton); the adapter binding lives in adapters/."""
    for mod, deps in _graph().items():
        parts = mod.split(".")
        if len(parts) < 3 or parts[1] != "integrations":
            continue
        for dep in deps:
            them = dep.split(".")
            if len(them) > 2 and them[1] == "integrations":
                shared = (SRC / "integrations" / f"{them[2]}.py").is_file()
                assert shared or them[2] == parts[2], f"{mod} imports {dep}"


def test_core_never_loads_the_tools() -> None:
    code = ("import sys, attnpool\nfrom attnpool import BufferPool, KVCachePool, LoRABatchPool\n"
            "import attnpool.graphs, attnpool.adapters.sdpa\n"
            "bad = [m for m in sys.modules if m.startswith('attnpool.tools')]\n"
            "assert not bad, bad\nprint('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
