"""scripts/shape.py — the repository's shape, measured statically (ast, nothing imported): `python scripts/shape.py`.

Role: the counts issue 24 asks to hold, each a function tests/test_shape.py asserts:
    - `line_counts`: non-blank lines of every .py file (top level, tests/, bench/, examples/, scripts/).
    - `line_widths`: the widths of the non-blank lines of the top-level modules (the code a reader reads), summed
      up by `width_summary` (mean, 90th percentile); `long_lines`: every line over MAX_WIDTH, in every .py file.
    - `import_cycles`: cycles among the top-level modules (every import, function-level ones included).
    - `calls_below_loop`: the shortest static call chain from the training loop (train.train) to a function.
    - `sample_files`: the files a reader follows one sample through, from the generator's sampling to the loss
      (the chains sampling -> the queue's put, the loop -> the queue's take and batch assembly, the loop -> loss).
Data contract: a function is "module.name" or "module.Class.method". A call edge is a call or a reference (a
function handed to another, e.g. functools.partial) resolved through the module's own functions, `import m`
/ `from m import f` of a top-level module, and `self.method` inside a class; calls on other objects are not
followed (the graph under-approximates: a chain found is real, a chain may exist that it does not see).
May touch: nothing (reads the repository's files).
"""
from __future__ import annotations

import ast
import collections
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FOLDERS = ("", "tests", "bench", "examples", "scripts")
MAX_LINES = 450
MAX_WIDTH = 120  # characters per line, in every file
LOOP = "train.train"
LOSS = "losses.policy_loss"  # the per-micro-batch loss
SAMPLE_CHAINS = (("rollout.Generator.run_group", "buffer.put_group"),  # sampling -> onto the queue
                 (LOOP, "buffer.take_groups"),  # off the queue (the hand-off between the two processes)
                 (LOOP, "buffer.collate"),  # into the training batch
                 (LOOP, LOSS))  # into the loss


def python_files() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (REPO / folder).glob("*.py"))


def line_counts() -> dict[str, int]:
    """Non-blank lines per file (what `grep -cv '^\\s*$'` counts), by path relative to the repository."""
    return {str(p.relative_to(REPO)): sum(1 for line in p.read_text().splitlines() if line.strip())
            for p in python_files()}


def line_widths(paths) -> list[int]:
    """The width in characters of every non-blank line of the files."""
    return [len(line) for p in paths for line in p.read_text().splitlines() if line.strip()]


def width_summary(widths: list[int]) -> tuple[float, int]:
    """(mean, 90th percentile by nearest rank: the width that 90% of the lines do not exceed)."""
    ranked = sorted(widths)
    return sum(ranked) / len(ranked), ranked[-(-9 * len(ranked) // 10) - 1]


def long_lines(limit: int = MAX_WIDTH) -> list[str]:
    """"path:line" of every line wider than `limit`, in every .py file."""
    return [f"{p.relative_to(REPO)}:{number}" for p in python_files()
            for number, line in enumerate(p.read_text().splitlines(), 1) if len(line) > limit]


def top_level_modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text()) for p in sorted(REPO.glob("*.py"))}


def import_graph(modules: dict[str, ast.Module]) -> dict[str, set[str]]:
    """module -> the top-level modules it imports, anywhere in its body."""
    graph = {}
    for name, tree in modules.items():
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                deps |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                deps.add(node.module.split(".")[0])
        graph[name] = (deps & modules.keys()) - {name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def imported_names(tree: ast.Module, modules) -> tuple[dict[str, str], dict[str, str]]:
    """(alias -> module for `import m [as a]`, name -> "module.name" for `from m import name`), anywhere."""
    aliases, names = {}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules:
                    aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return aliases, names


def functions(modules: dict[str, ast.Module]) -> dict[str, tuple[str, str | None, ast.AST]]:
    """"module.name" / "module.Class.method" -> (module, class name or None, node)."""
    found = {}
    for mod, tree in modules.items():
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found[f"{mod}.{node.name}"] = (mod, None, node)
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        found[f"{mod}.{node.name}.{item.name}"] = (mod, node.name, item)
    return found


def call_graph(modules: dict[str, ast.Module]) -> dict[str, set[str]]:
    """function -> the known functions it calls or hands on (see the module docstring)."""
    known = functions(modules)
    imports = {mod: imported_names(tree, modules) for mod, tree in modules.items()}
    graph = {}
    for qualname, (mod, cls, node) in known.items():
        aliases, names = imports[mod]
        edges = set()
        for sub in ast.walk(node):
            target = None
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load):
                target = names.get(sub.id, f"{mod}.{sub.id}")
            elif isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name):
                if sub.value.id in aliases:
                    target = f"{aliases[sub.value.id]}.{sub.attr}"
                elif sub.value.id == "self" and cls is not None:
                    target = f"{mod}.{cls}.{sub.attr}"
            if target in known and target != qualname:
                edges.add(target)
        graph[qualname] = edges
    return graph


def shortest_chain(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """The shortest call chain start -> ... -> goal (breadth first), or None."""
    previous, frontier = {start: None}, collections.deque([start])
    while frontier:
        here = frontier.popleft()
        if here == goal:
            chain = []
            while here is not None:
                chain.append(here)
                here = previous[here]
            return chain[::-1]
        for nxt in sorted(graph.get(here, ())):
            if nxt not in previous:
                previous[nxt] = here
                frontier.append(nxt)
    return None


def calls_below_loop(graph, goal: str = LOSS, loop: str = LOOP) -> tuple[int | None, list[str] | None]:
    """(calls from the loop down to `goal`, the chain); (None, None) if the graph finds no chain."""
    chain = shortest_chain(graph, loop, goal)
    return (len(chain) - 1, chain) if chain else (None, None)


def sample_files(graph, chains=SAMPLE_CHAINS) -> list[str]:
    """The files the chains of one sample pass through (each chain must exist)."""
    files = set()
    for start, goal in chains:
        chain = shortest_chain(graph, start, goal)
        if chain is None:
            raise LookupError(f"no static call chain {start} -> {goal}")
        files |= {f"{name.split('.')[0]}.py" for name in chain}
    return sorted(files)


def main() -> int:
    modules = top_level_modules()
    graph = call_graph(modules)
    counts = line_counts()
    over = {path: n for path, n in counts.items() if n > MAX_LINES}
    calls, chain = calls_below_loop(graph)
    deepest, deepest_chain = calls_below_loop(graph, "losses.aggregate")
    files = sample_files(graph)
    cycles = import_cycles(import_graph(modules))
    mean_width, p90_width = width_summary(line_widths(sorted(REPO.glob("*.py"))))
    long = long_lines()
    rows = [("files over %d non-blank lines" % MAX_LINES, len(over), ", ".join(f"{p} {n}" for p, n in over.items())),
            ("largest file", max(counts.values()), max(counts, key=counts.get)),
            ("mean line width, top-level modules", round(mean_width, 1), "characters, non-blank lines"),
            ("90th percentile line width, same", p90_width, "characters"),
            (f"lines over {MAX_WIDTH} characters", len(long), ", ".join(long)),
            ("import cycles", len(cycles), "; ".join(" <-> ".join(c) for c in cycles)),
            (f"calls below the loop to {LOSS}", calls, " -> ".join(chain or [])),
            ("... to the aggregation (losses.aggregate)", deepest, " -> ".join(deepest_chain or [])),
            ("files to follow one sample", len(files), ", ".join(files))]
    width = max(len(r[0]) for r in rows)
    for what, value, detail in rows:
        print(f"{what:<{width}}  {value!s:>4}  {detail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
