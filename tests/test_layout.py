"""The package's shape: no import circle anywhere, function-level imports included (a circle
patched with an import inside a function is still a circle: the layers depend on each other)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "structkv"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The structkv modules `path` imports, at any depth of its code."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("structkv")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("structkv"):
                continue
            subs = {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules}
            out |= subs if subs and len(subs) == len(node.names) else subs | {target}
    return {m for m in out if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(paths)
    return {m: _imports(p, modules) for m, p in paths.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = "done"
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_circle_in_the_package():
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_checker_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"p": {"p.x"}, "p.x": {"q"}, "q": set()}) is None
    graph = _graph()  # the lazy import the package once had: methods -> calibration -> compress -> methods
    graph["structkv.methods"].add("structkv.runtime.calibration")
    assert _cycle(graph) is not None


def test_library_code_does_not_import_the_harness_or_the_server():
    """The layers: the library (decoder, ops, modules, methods, the prefill loop, generation, text)
    never imports the harness (eval, bench), the server or the command line, which sit on top."""
    graph = _graph()
    above = ("structkv.harness", "structkv.serve", "structkv.cli")
    library = [m for m in graph if not m.startswith(above) and m != "structkv"]
    wrong = {m: sorted(n for n in graph[m] if n.startswith(above)) for m in library}
    assert not {m: n for m, n in wrong.items() if n}


def test_text_handling_lives_in_one_subpackage():
    names = {p.stem for p in ROOT.glob("*.py")}
    assert not names & {"tokenizer", "detokenize", "prompts", "chat", "data"}
    assert {p.stem for p in (ROOT / "text").glob("*.py")} >= {"tokenizer", "detokenize", "prompts", "chat"}


def _package(module: str) -> str:
    """The layer a module belongs to: its first subpackage (structkv.models.decoder -> models),
    or the module itself at the root (structkv.cli)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "structkv"


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Imports between packages: a module of one importing a module of another."""
    out: dict[str, set[str]] = {}
    for m, targets in graph.items():
        a = _package(m)
        out.setdefault(a, set())
        for n in targets:
            if (b := _package(n)) != a:
                out[a].add(b)
                out.setdefault(b, set())
    return out


def test_no_import_circle_between_packages():
    """The packages are layers (util, ops, text, distributed, models, modules, methods, runtime,
    harness and serve, then cli and the API): two of them importing each other, even through
    different modules, is a circle too."""
    graph = _package_graph(_graph())
    graph.pop("structkv", None)  # the API and the command line import everything and nothing imports them
    for targets in graph.values():
        targets.discard("structkv")
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_package_checker_finds_a_circle_through_different_modules():
    graph = _graph()
    graph["structkv.distributed.group"].add("structkv.models.decoder")  # models.empty -> distributed.sharding
    assert _cycle(_package_graph(graph)) is not None


def test_the_package_root_holds_the_api_and_the_command_line_only():
    """Engine modules live in the layer they belong to (runtime, util), not loose at the root."""
    command_line = {"cli"} if (ROOT / "cli" / "__init__.py").exists() else set()  # a package, a file per command
    assert {p.stem for p in ROOT.glob("*.py")} | command_line == {"__init__", "cli"}


def test_the_bottom_layers_import_nothing_above_them():
    """util imports no other part of structkv; ops only util; distributed only util."""
    graph = _package_graph(_graph())
    assert graph["util"] == set()
    assert graph["ops"] <= {"util"}
    assert graph["distributed"] <= {"util"}


def test_every_benchmark_script_is_in_the_index():
    """benchmarks/README.md names every script (the folder had no index)."""
    from pathlib import Path

    root = Path(__file__).parents[1] / "benchmarks"
    index = (root / "README.md").read_text()
    assert [p.name for p in sorted(root.glob("*.py")) if f"({p.name})" not in index] == []


def test_every_real_model_check_is_marked_slow():
    """A test that loads a real model (by name, or through a real-model fixture) carries the
    `slow` marker, so `pytest -m "not slow"` runs on the tiny models alone."""
    import ast
    from pathlib import Path

    from conftest import REAL_MODELS

    unmarked, here = [], "test_every_real_model_check_is_marked_slow"
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test_") or node.name == here:
                continue
            names = {a.arg for a in node.args.args}
            loads = any(isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "load" and n.args
                        and isinstance(n.args[0], ast.Constant) and n.args[0].value in ("smollm2", "gemma-3-270m")
                        for n in ast.walk(node))
            marked = any("slow" in ast.unparse(d) for d in node.decorator_list)
            if loads and not marked and not names & REAL_MODELS:
                unmarked.append(f"{path.name}::{node.name}")
    assert unmarked == []
