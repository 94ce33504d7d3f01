"""scripts/shape.py — the repository's shape, measured statically (ast, nothing imported): `python
scripts/shape.py`.

Role: the counts issue 24 asks to hold, each a function tests/test_shape.py asserts:
    - `line_counts`: non-blank lines of every .py file (top level, tests/, bench/, tasks/examples/,
      scripts/).
    - `line_widths`: the widths of the non-blank lines of the top-level modules (the code a reader
      reads), summed up by `width_summary` (mean, 90th percentile); `long_lines`: every line over
      MAX_WIDTH, in every .py file.
    - `import_cycles`: cycles among the top-level modules (every import, function-level ones
      included).
    - `calls_below_loop`: the shortest static call chain from the training loop (train.train) to a
      function.
    - `sample_files`: the files a reader follows one sample through, from the generator's sampling
      to the loss (the chains sampling -> the queue's put, the loop -> the queue's take and batch
      assembly, the loop -> loss).
    - `step_walk` / `returns`: the files met, in order, reading the trainer's step depth first from
      the loop, and how often the reading comes back into a file it had left (a loss assembled
      across two files makes a reader go back and forth between them).
    - `config_imports`: the project modules config.py imports (a leaf: none).
    - issue 40's front door: `top_level_python` (the .py files at the root: the core path alone),
      `top_level_entries` (what a clone shows at the root, dotfiles aside), `step_files` (the files
      read following one training step from the loop to the loss and the publish), `rollout_files`
      (one group's rollout, from sampling to the queue), `long_functions` (library functions over
      MAX_FUNCTION lines), `bench_share` (bench/'s files and its share of the Python lines),
      `doc_lines` and `broken_links` (README.md and docs/*.md).
Data contract: a module is "name" (a top-level file) or "package.name" (a file of a top-level
package such as tasks/); a function is "module.name" or "module.Class.method". A call edge is a call
or a reference (a function handed to another, e.g. functools.partial) resolved through the module's
own functions, `import m` / `from m import f` of a top-level module, and `self.method` inside a
class; calls on other objects are not followed (the graph under-approximates: a chain found is real,
a chain may exist that it does not see). May touch: nothing (reads the repository's files).
"""

from __future__ import annotations

import ast
import collections
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FOLDERS = ("", "tests", "bench", "tasks/examples", "scripts")
MAX_LINES = 450
MAX_WIDTH = 100  # characters per line, in every file (.ruff.toml's line-length)
WALK_SKIP = ("infra.tracing",)  # left out of the step's walk: the trace recorder, called everywhere
# left out of the files of one step too: the MoE routing replay, which a dense model's step passes
# through as a no-op (`replay.routed_by` yields None when the run records no routes)
STEP_SKIP = WALK_SKIP + ("trainer.replay",)
LOOP = "train.train"
PUBLISH = "sync.publish_model"  # the end of one training step: the new weights published
ROLLOUT = "rollout.Generator.run_group"  # one group's rollout, from its prompt to the queue
MAX_FUNCTION = 80  # lines of a library function, from its `def` to its last line
CORE = ("train.py", "rollout.py", "buffer.py", "sync.py", "losses.py")  # the five named scripts
LOSS = "losses.grpo_loss"  # the per-micro-batch loss
SAMPLE_CHAINS = (
    ("rollout.Generator.run_group", "buffer.put_group"),  # sampling -> onto the queue
    # off the queue (the hand-off between the two processes)
    (LOOP, "buffer.take_groups"),
    (LOOP, "buffer.collate"),  # into the training batch
    (LOOP, LOSS),
)  # into the loss


def python_files() -> list[Path]:
    """Every .py file of the project: its modules (packages included) and the FOLDERS beside
    them."""
    return sorted(
        {p for folder in FOLDERS for p in (REPO / folder).glob("*.py")}
        | set(module_paths().values())
    )


def line_counts() -> dict[str, int]:
    """Non-blank lines per file (what `grep -cv '^\\s*$'` counts), by path relative to the
    repository."""
    return {
        str(p.relative_to(REPO)): sum(1 for line in p.read_text().splitlines() if line.strip())
        for p in python_files()
    }


def line_widths(paths) -> list[int]:
    """The width in characters of every non-blank line of the files."""
    return [len(line) for p in paths for line in p.read_text().splitlines() if line.strip()]


def width_summary(widths: list[int]) -> tuple[float, int]:
    """(mean, 90th percentile by nearest rank: the width that 90% of the lines do not exceed)."""
    ranked = sorted(widths)
    return sum(ranked) / len(ranked), ranked[-(-9 * len(ranked) // 10) - 1]


def long_lines(limit: int = MAX_WIDTH) -> list[str]:
    """ "path:line" of every line wider than `limit`, in every .py file."""
    return [
        f"{p.relative_to(REPO)}:{number}"
        for p in python_files()
        for number, line in enumerate(p.read_text().splitlines(), 1)
        if len(line) > limit
    ]


def module_paths() -> dict[str, Path]:
    """The project's modules: "name" for a top-level file, "package.name" for a file of a top-level
    package (a folder with an __init__.py, e.g. tasks/), by module name."""
    paths = {p.stem: p for p in sorted(REPO.glob("*.py"))}
    for init in sorted(REPO.glob("*/__init__.py")):
        package = init.parent.name
        paths[package] = init
        paths |= {
            f"{package}.{p.stem}": p
            for p in sorted(init.parent.glob("*.py"))
            if p.stem != "__init__"
        }
    return paths


def top_level_modules() -> dict[str, ast.Module]:
    """Module name -> its tree, for every module of `module_paths`."""
    return {name: ast.parse(path.read_text()) for name, path in module_paths().items()}


def imported_modules(node: ast.AST, modules) -> set[str]:
    """The project modules an import statement imports (`from package import module` names the
    module)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
        inner = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
        return inner | ({node.module} if len(inner) < len(node.names) else set())
    return set()


def module_of(qualname: str, modules) -> str:
    """The module a "module.name" / "module.Class.method" lives in (the longest module name it
    starts with)."""
    parts = qualname.split(".")
    return next(
        ".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in modules
    )


def file_of(module: str) -> str:
    """ "tasks.envs" -> "tasks/envs.py"."""
    return str(module_paths()[module].relative_to(REPO))


def import_graph(modules: dict[str, ast.Module]) -> dict[str, set[str]]:
    """module -> the top-level modules it imports, anywhere in its body."""
    graph = {}
    for name, tree in modules.items():
        deps = set()
        for node in ast.walk(tree):
            deps |= imported_modules(node, modules)
        graph[name] = deps - {name}
    return graph


def config_imports(modules: dict[str, ast.Module]) -> list[str]:
    """The project modules config.py imports (a leaf config: none)."""
    return sorted(import_graph(modules).get("config", ()))


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
    """(alias -> module for `import m [as a]`, name -> "module.name" for `from m import name`),
    anywhere."""
    aliases, names = {}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules:
                    aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
            for a in node.names:
                if f"{node.module}.{a.name}" in modules:  # `from package import module`
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                else:
                    names[a.asname or a.name] = f"{node.module}.{a.name}"
    return aliases, names


def functions(modules: dict[str, ast.Module]) -> dict[str, tuple[str, str | None, ast.AST]]:
    """ "module.name" / "module.Class.method" -> (module, class name or None, node)."""
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
    return {name: set(calls) for name, calls in ordered_calls(modules).items()}


def ordered_calls(modules: dict[str, ast.Module]) -> dict[str, list[str]]:
    """function -> the known functions it calls or hands on, each once, in the order the code
    reads."""
    known = functions(modules)
    imports = {mod: imported_names(tree, modules) for mod, tree in modules.items()}
    graph = {}
    for qualname, (mod, cls, node) in known.items():
        aliases, names = imports[mod]
        edges = {}
        in_order = sorted(
            ast.walk(node), key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0))
        )
        for sub in in_order:
            target = None
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load):
                target = names.get(sub.id, f"{mod}.{sub.id}")
            elif isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name):
                if sub.value.id in aliases:
                    target = f"{aliases[sub.value.id]}.{sub.attr}"
                elif sub.value.id == "self" and cls is not None:
                    target = f"{mod}.{cls}.{sub.attr}"
            if target in known and target != qualname:
                edges.setdefault(target)
        graph[qualname] = list(edges)
    return graph


def step_walk(calls, modules, start: str = LOOP, skip=WALK_SKIP, to_file=file_of) -> list[str]:
    """The files a reader passes through, in order, following the trainer's step from the loop:
    depth first through the calls in the order the code reads, each function read once, coming back
    to the caller's file after each call into another file (so a file appears again each time the
    walk returns to it). Calls into `skip` (the trace recorder, which every file calls) are left
    out; `to_file` names a module's file."""
    walk, read = [], set()

    def enter(function):
        here = module_of(function, modules)
        if here in skip:
            return
        if not walk or walk[-1] != here:
            walk.append(here)
        if function in read:
            return
        read.add(function)
        for callee in calls.get(function, ()):
            enter(callee)
            if walk[-1] != here:
                walk.append(here)

    enter(start)
    return [to_file(module) for module in walk]


def returns(walk: list[str], hub: str = "train.py") -> int:
    """The times a walk comes back into a file it had left, other than the loop's own file (the hub
    that calls each part in turn, which a reader returns to by design)."""
    return sum(1 for i, file in enumerate(walk) if file != hub and file in walk[:i])


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


def calls_below_loop(
    graph, goal: str = LOSS, loop: str = LOOP
) -> tuple[int | None, list[str] | None]:
    """(calls from the loop down to `goal`, the chain); (None, None) if the graph finds no chain."""
    chain = shortest_chain(graph, loop, goal)
    return (len(chain) - 1, chain) if chain else (None, None)


def sample_files(graph, chains=SAMPLE_CHAINS, modules=None) -> list[str]:
    """The files the chains of one sample pass through (each chain must exist)."""
    modules = modules if modules is not None else top_level_modules()
    files = set()
    for start, goal in chains:
        chain = shortest_chain(graph, start, goal)
        if chain is None:
            raise LookupError(f"no static call chain {start} -> {goal}")
        files |= {file_of(module_of(name, modules)) for name in chain}
    return sorted(files)


def top_level_python() -> list[str]:
    """The Python files at the repository's root."""
    return sorted(p.name for p in REPO.glob("*.py"))


def tracked_files() -> list[str]:
    """The files a clone has (git's index: tracked or added), relative to the repository: a user's
    output folders (runs/, wandb/, checkpoints/) are not the project's."""
    import subprocess

    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    return sorted(name for name in listed if name and (REPO / name).is_file())


def top_level_entries() -> list[str]:
    """The files and folders a clone shows at its root, dotfiles aside (.ruff.toml, .ci/)."""
    names = {name.split("/")[0] for name in tracked_files()}
    return sorted((name for name in names if not name.startswith(".")), key=str.lower)


def truncated_at(calls, start: str, end: str) -> dict[str, list[str]]:
    """`calls` with `start`'s own calls cut after the first that is, or leads to, `end` (the step's
    walk ends at the publish)."""
    graph = {name: set(callees) for name, callees in calls.items()}
    own = calls[start]
    for i, callee in enumerate(own):
        if shortest_chain(graph, callee, end):
            return {**calls, start: own[: i + 1]}
    return calls


def step_files(
    calls, modules, start=LOOP, end=PUBLISH, skip=STEP_SKIP, to_file=file_of
) -> list[str]:
    """The files read following one training step, depth first from the loop to the loss and the
    publish (`step_walk` of the loop's calls up to `end`), each once, in the order first met."""
    walk = step_walk(truncated_at(calls, start, end), modules, start, skip, to_file)
    return list(dict.fromkeys(walk))


def rollout_files(calls, modules, start=ROLLOUT, skip=WALK_SKIP) -> list[str]:
    """The files read following one group's rollout (`step_walk` from `start`), each once."""
    return list(dict.fromkeys(step_walk(calls, modules, start, skip)))


def long_functions(modules, limit: int = MAX_FUNCTION) -> dict[str, int]:
    """ "module.function" (methods and nested functions too) -> its lines, for every function of
    the project's modules over `limit` lines (from its `def` to its last line)."""
    found = {}
    for name, tree in modules.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found[f"{name}.{node.name}"] = length
    return found


def bench_share(counts: dict[str, int]) -> tuple[int, float]:
    """(bench/'s Python files, as issue 40 counted them (31 when it was filed); their share of the
    project's Python lines)."""
    bench = [path for path in counts if path.startswith("bench/")]
    return len(bench), sum(counts[path] for path in bench) / sum(counts.values())


def doc_files() -> list[Path]:
    """README.md and the topics under docs/."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def doc_lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def broken_links(paths) -> list[str]:
    """ "file: target" for every relative Markdown link of `paths` whose file does not exist."""
    import re

    broken = []
    for path in paths:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (path.parent / target.split("#")[0]).exists():
                where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
                broken.append(f"{where}: {target}")
    return broken


def main() -> int:
    modules = top_level_modules()
    graph = call_graph(modules)
    counts = line_counts()
    over = {path: n for path, n in counts.items() if n > MAX_LINES}
    calls, chain = calls_below_loop(graph)
    deepest, deepest_chain = calls_below_loop(graph, "losses.aggregate")
    files = sample_files(graph, modules=modules)
    walk = step_walk(ordered_calls(modules), modules)
    cycles = import_cycles(import_graph(modules))
    mean_width, p90_width = width_summary(line_widths(sorted(module_paths().values())))
    long = long_lines()
    calls_in_order = ordered_calls(modules)
    step, rollout = step_files(calls_in_order, modules), rollout_files(calls_in_order, modules)
    long_defs = long_functions(modules)
    bench_files, bench_lines = bench_share(counts)
    rows = [
        (
            "files over %d non-blank lines" % MAX_LINES,
            len(over),
            ", ".join(f"{p} {n}" for p, n in over.items()),
        ),
        ("largest file", max(counts.values()), max(counts, key=counts.get)),
        ("mean line width, top-level modules", round(mean_width, 1), "characters, non-blank lines"),
        ("90th percentile line width, same", p90_width, "characters"),
        (f"lines over {MAX_WIDTH} characters", len(long), ", ".join(long)),
        ("import cycles", len(cycles), "; ".join(" <-> ".join(c) for c in cycles)),
        (f"calls below the loop to {LOSS}", calls, " -> ".join(chain or [])),
        ("... to the aggregation (losses.aggregate)", deepest, " -> ".join(deepest_chain or [])),
        ("files to follow one sample", len(files), ", ".join(files)),
        ("files in a walk of the trainer's step", len(set(walk)), " -> ".join(walk)),
        ("... returns to a file already left (but train.py)", returns(walk), ""),
        (
            "project modules config.py imports",
            len(config_imports(modules)),
            ", ".join(config_imports(modules)),
        ),
        ("top-level Python files", len(top_level_python()), ", ".join(top_level_python())),
        ("top-level entries (dotfiles aside)", len(top_level_entries()), ""),
        ("files to follow one training step", len(step), " -> ".join(step)),
        ("files to follow one rollout", len(rollout), " -> ".join(rollout)),
        (f"library functions over {MAX_FUNCTION} lines", len(long_defs), str(long_defs or "")),
        ("bench/ Python files", bench_files, f"{bench_lines:.0%} of the Python lines"),
        ("README.md lines", doc_lines(REPO / "README.md"), ""),
        ("broken links in README.md, docs/", len(broken_links(doc_files())), ""),
    ]
    width = max(len(r[0]) for r in rows)
    for what, value, detail in rows:
        print(f"{what:<{width}}  {value!s:>4}  {detail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
