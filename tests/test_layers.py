"""
The house in layers, asserted from the source so it cannot silently rot: every project
import at the top of its file, no import cycle, the foundation (model.py and what it
imports) small and free of topics, at most 18 scripts on top, no file over 1,000 lines,
every top-level script heavily commented; and the README's map and reading paths true to
the tree (files that exist, orders a reader can follow, line counts that add up).

    python tests/test_layers.py      # prints every figure and the README's reading paths
"""
import ast
import io
import os
import re
import sys
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("core", "training", "parallelism", "compression", "serving", "reproduction",
           "scripts")
MAX_TOP = 18                   # scripts a reader runs and reads as a lesson
MAX_CLOSURE = 1200             # lines of model.py with everything it imports (torch aside)
MAX_FILE = 1000
MIN_COMMENTS, MIN_BODY_COMMENTS = 30.0, 22.0   # comment lines per 100: all / outside the header


def project_files():
    """{module name: path relative to the repo}: the top level and the layer folders."""
    mods = {name[:-3]: name for name in os.listdir(ROOT) if name.endswith(".py")}
    for folder in FOLDERS:
        for name in os.listdir(os.path.join(ROOT, folder)):
            if name.endswith(".py"):
                mods[f"{folder}.{name[:-3]}"] = f"{folder}/{name}"
    return mods


def source(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def imports(path, mods):
    """-> (project modules imported at the top level, 'line: module' of those imported
    anywhere else: inside a function, a class or an if)."""
    tree = ast.parse(source(path))
    top_nodes = {id(n) for n in tree.body}
    top, nested = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found = {n for n in names if n in mods}
        if id(node) in top_nodes:
            top |= found
        else:
            nested += [f"{path}:{node.lineno}: {m}" for m in sorted(found)]
    return top, nested


def graph():
    mods = project_files()
    edges, nested = {}, []
    for name, path in mods.items():
        edges[name], inner = imports(path, mods)
        nested += inner
    return mods, edges, nested


def cycles(edges):
    """Import cycles as lists of modules (depth-first search, each cycle reported once)."""
    found, state = [], {}

    def visit(v, stack):
        state[v] = "open"
        for w in sorted(edges[v]):
            if state.get(w) == "open":
                found.append(stack[stack.index(w):] + [w])
            elif w not in state:
                visit(w, stack + [w])
        state[v] = "done"
    for v in sorted(edges):
        if v not in state:
            visit(v, [v])
    return found


def closure(edges, start):
    seen, todo = set(), [start]
    while todo:
        v = todo.pop()
        if v not in seen:
            seen.add(v)
            todo.extend(edges[v])
    return seen


def lines(path):
    return len(source(path).splitlines())


def comment_density(path):
    """Comment-token lines plus docstring lines per 100 lines: (all, outside the module
    docstring) -- the card's "heavily commented" measured the same way in every file."""
    src = source(path)
    n = len(src.splitlines()) or 1
    comments = {t.start[0] for t in tokenize.generate_tokens(io.StringIO(src).readline)
                if t.type == tokenize.COMMENT}
    docs, header = set(), set()
    for node in ast.walk(ast.parse(src)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            span = set(range(body[0].lineno, body[0].end_lineno + 1))
            docs |= span
            if isinstance(node, ast.Module):
                header |= span
    marked = comments | docs
    return 100 * len(marked) / n, 100 * len(marked - header) / max(n - len(header), 1)


# ---------------------------------------------------------------------------- the layers

def test_every_project_import_is_at_the_top_of_its_file():
    _, _, nested = graph()
    assert nested == [], "imports inside a function, class or branch:\n" + "\n".join(nested)


def test_the_import_graph_has_no_cycle():
    _, edges, _ = graph()
    assert cycles(edges) == []


def test_the_foundation_imports_no_topic_and_model_py_stays_small():
    mods, edges, _ = graph()
    foundation = {m for m in mods if m.startswith("core.")} | {"model"}
    upward = {(m, t) for m in foundation for t in edges[m] if t not in foundation}
    assert upward == set(), f"the foundation imports a topic: {sorted(upward)}"
    reach = closure(edges, "model")
    assert sum(lines(mods[m]) for m in reach) <= MAX_CLOSURE, sorted(reach)
    # the GPT stands on torch, its two options and the errors module: no process groups,
    # meters or watchdog on the way to the first line of a transformer
    assert reach == {"model", "core.moe", "core.mla", "core.errors"}, sorted(reach)


def test_parts_are_imported_one_way():
    """A part (a file under a layer folder other than scripts/) never imports a top-level
    topic script: the topic imports its parts, never the other way round. Nothing imports
    scripts/: they are entry points."""
    mods, edges, _ = graph()
    top = {m for m in mods if "." not in m}
    parts = {m for m in mods if "." in m and not m.startswith("scripts.")}
    upward = {(m, t) for m in parts for t in edges[m] if t in top - {"model"}}
    assert upward == set(), sorted(upward)
    into_scripts = {(m, t) for m in mods if not m.startswith("scripts.")
                    for t in edges[m] if t.startswith("scripts.")}
    assert into_scripts == set(), sorted(into_scripts)


def test_a_small_set_of_scripts_on_top_and_no_file_over_the_limit():
    mods = project_files()
    top = [p for p in mods.values() if "/" not in p]
    assert len(top) <= MAX_TOP, sorted(top)
    big = {p: lines(p) for p in mods.values() if lines(p) > MAX_FILE}
    assert big == {}


def test_every_top_level_script_is_heavily_commented():
    thin = {}
    for path in project_files().values():
        if "/" not in path:
            everything, body = comment_density(path)
            if everything < MIN_COMMENTS or body < MIN_BODY_COMMENTS:
                thin[path] = f"{everything:.1f}/{body:.1f}"
    assert thin == {}, f"comment lines per 100 (all/body) under {MIN_COMMENTS}/{MIN_BODY_COMMENTS}"


# ---------------------------------------------------------------------------- the README

def readme():
    return source("README.md")


def readme_paths():
    """[(title, stated line count, [files in order])] from the README's reading paths."""
    section = readme().split("## Reading paths", 1)[1].split("\n## ", 1)[0]
    found = re.findall(r"^- \*\*(.+?)\*\* \(([\d,]+) lines\): (.+?)(?=^- \*\*|\Z)", section,
                       flags=re.M | re.S)
    return [(title, int(count.replace(",", "")), re.findall(r"`([\w/]+\.py)`", files))
            for title, count, files in found]


def module_of(path):
    return path[:-3].replace("/", ".")


def test_reading_paths_need_only_earlier_files_and_count_true_lines():
    mods, edges, _ = graph()
    paths = readme_paths()
    assert len(paths) >= 5
    for title, stated, files in paths:
        assert all(f in mods.values() for f in files), (title, files)
        for i, f in enumerate(files):
            earlier = {module_of(g) for g in files[:i]}
            missing = edges[module_of(f)] - earlier
            assert not missing, f"{title}: {f} imports {sorted(missing)}, not before it"
        assert stated == sum(lines(f) for f in files), (title, stated)


def test_the_map_names_every_file_and_folder():
    """Every top-level script has its line in the README's tree, and so has every folder;
    every file the tree names exists."""
    tree = readme().split("## The map", 1)[1].split("```", 2)[1]
    code = "\n".join(l for l in tree.splitlines() if not l.startswith(("tests/", "docs/")))
    named = set(re.findall(r"\b([\w]+\.py)\b", code))
    top = {p for p in project_files().values() if "/" not in p}
    assert top <= named, sorted(top - named)
    for folder in FOLDERS + ("docs", "tests"):
        assert f"{folder}/" in tree, folder
    everything = {os.path.basename(p) for p in project_files().values()}
    assert named <= everything, sorted(named - everything)


def print_report():
    mods, edges, nested = graph()
    reach = closure(edges, "model")
    print(f"{sum('/' not in p for p in mods.values())} top-level scripts, {len(mods)} modules, "
          f"{len(nested)} nested imports, {len(cycles(edges))} cycles, model.py closure "
          f"{sum(lines(mods[m]) for m in reach)} lines ({', '.join(sorted(reach))})")
    for path in sorted(p for p in mods.values() if "/" not in p):
        everything, body = comment_density(path)
        print(f"  {path:<16} {lines(path):5d} lines, comments {everything:.1f} / {body:.1f}")
    for title, stated, files in readme_paths():
        print(f"{title}: {sum(lines(f) for f in files):,} lines (README says {stated:,})")


if __name__ == "__main__":
    sys.exit(print_report())
