"""
Every command the docs show runs as written from the repo root. The commands of README.md
and docs/*.md -- fenced blocks and inline `python ...` / `torchrun ...` spans -- are
collected, and each one's script or module resolves and reads its own flags: the command
with --help appended exits 0 and prints its help (a flag that does not exist, or a value
its flag refuses, stops it first with exit 2: core/cli.py checks every flag before
argparse reaches --help), and every flag it shows is one that help lists (a flag of
another mode, or an abbreviation, fails too). torchrun's own flags go through torchrun's
parser; nothing is launched, trained or served. One subprocess (this file run as a
script, with tests/cli_probe.py's runner) reads them all, each distinct argv once.

How a command is read -- each rule a check of its own, never a silent skip:
  - fenced blocks other than ```python; in a block with `$ ` prompts only the prompted
    lines (the rest is output); a trailing backslash joins the next line; `# ...` is a
    comment; VAR=value prefixes are the environment.
  - `&&`, `;`, `|` and `&` separate commands: python/torchrun ones are checked here, and
    `pip install -r FILE` (FILE exists); other programs (tail, `.`) are the shell's.
  - `$T` is the `T="..."` defined on the same page; undefined, it fails.
  - a mode written `a|b|c` (no spaces) stands for each of a, b and c.
  - placeholders -- an ALL-CAPS word (NAME, FILE, NEW.pt, HOST:29500), `<...>`, `...`, a
    `[...]` that holds no flag -- end the part that is parsed, but every flag shown, even
    after one, must be in the help; `[--flag]` is a flag shown, checked like the others.
  - a script or module whose name is a placeholder (SCRIPT.py, scripts.NAME) is a template
    for every script, each of which tests/test_cli.py runs with --help; torchrun's flags
    around it are still checked.
  - not a script of the repo: `python -m pytest ARGS` (the test files it names exist),
    `python -m MODULE` of Python or an installed package (importable: venv), `python -c
    CODE` (compiles).
  - `python dir/x.py` runs with dir -- not the repo root -- first on sys.path, so every
    project module x.py imports must be found in dir: otherwise ModuleNotFoundError (why
    the folders' entry points are shown as `python -m dir.x`).
  - EXPECTED_TO_FAIL (the page shows the error) and WRITTEN_BY_THE_READER below.
"""
import ast
import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import sys
from dataclasses import dataclass, field

from torch.distributed.run import get_args_parser

from cli_probe import run
from harness import ROOT, run_python

# (page, text in the command) -> why the page shows it failing; the test checks it does.
EXPECTED_TO_FAIL = {
    ("docs/train.md", "train.py $T --dp zero4"):
        "shows the one error line of a value --dp refuses, under torchrun",
}
# (page, text in the command) -> why the script is not in the repo.
WRITTEN_BY_THE_READER = {
    ("docs/checkpoints.md", "python measure.py"):
        "the ```python block below it, saved by the reader as measure.py",
}

# A script with no --help (not a command line of its own) -> how its arguments are checked.
NO_HELP = {
    "tests/test_gpu.py": "a torchrun worker as well as a test file: it takes the four words "
                         "tests/test_gpu.py launches it with, and runs on --help",
}

PAGES = ["README.md"] + sorted(f"docs/{name}" for name in os.listdir(os.path.join(ROOT, "docs"))
                               if name.endswith(".md"))
LAUNCHERS = ("python", "python3", "torchrun")
ENV = re.compile(r"^[A-Za-z_]\w*=\S*$")
PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z0-9_]*(?:[.:]\w+)?|\.\.\.|…)$")


@dataclass
class Command:
    page: str
    line: int
    text: str
    script: list = field(default_factory=list)   # the script's argv, as parsed (a prefix)
    flags: list = field(default_factory=list)    # every flag it shows
    problems: list = field(default_factory=list)

    def where(self):
        return f"{self.page}:{self.line}: `{re.sub(r'  +# .*$', '', self.text)}`"


# ------------------------------------------------------------------ finding the commands
def is_command(text):
    words = text.split()
    while words and ENV.match(words[0]):
        words = words[1:]
    return bool(words) and words[0] in LAUNCHERS


def fenced(lines):
    """-> [(line number, text)] of the commands in the page's fenced blocks."""
    found, block, language = [], None, None
    for number, line in enumerate(lines, 1):
        fence = re.match(r"^\s*```(\S*)", line)
        if fence and block is None:
            block, language = [], fence[1]
        elif fence:
            prompted = any(text.startswith("$ ") for _, text in block)
            for n, text in block if language not in ("python", "py") else []:
                if prompted and not text.startswith("$ "):
                    continue                                   # a line of output
                text = text.removeprefix("$ ").strip()
                if is_command(text) or re.match(r"^\w+=\"", text):
                    found.append((n, text))
            block = None
        elif block is not None:
            if block and block[-1][1].rstrip().endswith("\\"):  # continued: one command
                n, text = block.pop()
                line = text.rstrip()[:-1] + " " + line.strip()
                block.append((n, line))
            else:
                block.append((number, line.strip()))
    return found


def indented(lines):
    """-> [(line number, text)] of the commands in indented code blocks (four spaces, after
    a blank line or another such line, outside fences)."""
    found, inside, code = [], False, False
    for number, line in enumerate(lines, 1):
        if re.match(r"^\s*```", line):
            inside, code = not inside, False
        elif not inside:
            after_blank = number == 1 or not lines[number - 2].strip()
            code = line.startswith("    ") and (code or after_blank)
            text = line.strip().removeprefix("$ ")
            if code and found and found[-1][1].endswith("\\"):
                found[-1] = (found[-1][0], found[-1][1][:-1] + " " + text)
            elif code and is_command(text):
                found.append((number, text))
    return found


def inline(lines):
    """-> [(line number, text)] of the `python ...` / `torchrun ...` spans in the prose
    (and `T="..."` definitions); a span may wrap over lines of one paragraph."""
    prose, inside = [], False
    for line in lines:
        if re.match(r"^\s*```", line):
            inside = not inside
            prose.append("")
        else:
            prose.append("" if inside else line)
    text = "\n".join(prose)
    found = []
    for span in re.finditer(r"`([^`]+)`", text):
        body = " ".join(span[1].split())
        if "\n\n" not in span[1] and (is_command(body) or re.match(r"^\w+=\"", body)):
            found.append((text.count("\n", 0, span.start()) + 1, body))
    return found


def page_commands(page):
    """-> [Command] of one page: each alternative and each shell command of a line apart,
    `$VAR` expanded from the page's VAR="..." definitions."""
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        lines = f.read().split("\n")
    found = sorted(fenced(lines) + indented(lines) + inline(lines))
    defined = dict(m.groups() for _, text in found
                   for m in [re.match(r"^(\w+)=\"([^\"]*)\"", text)] if m)
    commands = []
    for line, text in found:
        if re.match(r"^\w+=\"", text):
            continue                                       # a definition, read above
        for one in alternatives(text):
            words, problem = shell_words(one, defined)
            commands += [Command(page, line, text, segment, problems=[problem] if problem
                                 else []) for segment in segments(words)]
    return commands


def alternatives(text):
    """'python quantize.py qat|prune|compare' -> one text per mode."""
    choice = re.search(r"(?<=\s)([a-z][\w-]*(?:\|[a-z][\w-]*)+)(?=\s|$)", text)
    if not choice:
        return [text]
    return [text[:choice.start()] + mode + text[choice.end():] for mode in choice[1].split("|")]


def shell_words(text, defined):
    """-> (the shell's words, with `&&`, `|`, ... as words of their own; a problem or None).
    `<...>` and a `[...]` without a flag become the placeholder PLACEHOLDER."""
    problem = None
    for name in re.findall(r"\$(\w+)", text):
        if name not in defined:
            problem = f"uses ${name}, which the page defines nowhere (write {name}=\"...\")"
    text = re.sub(r"\$(\w+)", lambda m: defined.get(m[1], "PLACEHOLDER"), text)
    text = re.sub(r"<[^<>]*>", "PLACEHOLDER", text)
    text = re.sub(r"\[([^\[\]]*)\]", lambda m: m[1] if m[1].startswith("-") else "PLACEHOLDER",
                  text)
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    return list(lexer), problem


def segments(words):
    """The shell's commands in a list of words -> [argv] of those that name a launcher
    (VAR=value prefixes dropped); `pip install -r FILE` comes back too."""
    found, current = [], []
    for word in words + [";"]:
        if word in (";", "&", "&&", "|", "||"):
            while current and ENV.match(current[0]):
                current = current[1:]
            if current and (current[0] in LAUNCHERS or current[:2] == ["pip", "install"]):
                found.append(current)
            current = []
        else:
            current.append(word)
    return found


# ------------------------------------------------------------------ what each one runs
def read_command(command):
    """Fill command.script (the argv to probe, cut at the first placeholder) and
    command.flags, or add its problems; -> whether it needs the probe."""
    argv = command.script
    if argv[0] == "pip":
        need = [argv[i + 1] for i, word in enumerate(argv[:-1]) if word == "-r"]
        command.problems += [f"{name} does not exist" for name in need
                             if not os.path.exists(os.path.join(ROOT, name))]
        return False
    if argv[0] == "torchrun":
        argv = torchrun_script(command, argv[1:])
    else:
        argv = argv[1:]
    if not argv:
        return False
    if argv[0] == "-c":
        try:
            compile(argv[1], command.where(), "exec")
        except SyntaxError as e:
            command.problems.append(f"the -c code does not compile: {e}")
        return False
    name = argv[1] if argv[0] == "-m" else argv[0]
    if PLACEHOLDER.match(name.split(".")[-1] if argv[0] == "-m" else name.split(".")[0]):
        return False                        # a template: tests/test_cli.py runs each one
    if argv[0] == "-m" and not in_repo_module(name):
        return installed_module(command, name, argv[2:])
    if argv[0] != "-m" and not os.path.isfile(os.path.join(ROOT, name)):
        if not any(page == command.page and text in command.text
                   for page, text in WRITTEN_BY_THE_READER):
            command.problems.append(f"{name} is not a file of the repo")
        return False
    if argv[0] != "-m":
        command.problems += imports_from_its_folder(name)
        if name in NO_HELP:
            return False
    start = 2 if argv[0] == "-m" else 1
    command.flags = [w.split("=", 1)[0] for w in argv[start:]
                     if w.startswith("-") and not re.match(r"^-\d", w) and w != "-"]
    cut = next((i for i, w in enumerate(argv) if i >= start and PLACEHOLDER.match(w)), len(argv))
    if cut < len(argv) and argv[cut - 1].startswith("--"):
        cut -= 1                            # the flag whose value is the placeholder
    command.script = argv[:cut]
    return True


def torchrun_script(command, argv):
    """torchrun's argv -> the script's argv (python's: [script, ...] or [-m, module, ...]),
    torchrun's own flags parsed by torchrun's parser. A fragment naming no script
    (`torchrun --max-restarts=1`) has its flags parsed all the same."""
    given = argv if any(not w.startswith("-") for w in argv) else argv + ["SCRIPT.py"]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = get_args_parser().parse_args(given)
    except SystemExit:
        said = (err.getvalue().strip().splitlines() or ["(nothing)"])[-1]
        command.problems.append(f"torchrun refuses its flags: {said}")
        return []
    rest = list(args.training_script_args)
    return (["-m", args.training_script] if args.module else [args.training_script]) + rest


def in_repo_module(name):
    path = os.path.join(ROOT, *name.split("."))
    return os.path.isfile(path + ".py") or os.path.isfile(os.path.join(path, "__main__.py"))


def installed_module(command, name, args):
    """`python -m MODULE` outside the repo: importable; pytest's test files exist."""
    top = name.split(".")[0]
    if os.path.exists(os.path.join(ROOT, top)) or importlib.util.find_spec(top) is None:
        command.problems.append(f"no module {name} in the repo or installed")
    if name == "pytest":
        paths = [a.split("::")[0] for a in args if a.startswith("tests/")]
        command.problems += [f"{p} does not exist" for p in paths
                             if not os.path.exists(os.path.join(ROOT, p))]
    return False


def imports_from_its_folder(script):
    """A script run by its path has its own folder first on sys.path (not the repo root,
    not the working folder): the project modules it imports must be there."""
    folder = os.path.dirname(os.path.join(ROOT, script))
    if os.path.samefile(folder, ROOT):
        return []                            # the root is where the project's modules are
    with open(os.path.join(ROOT, script), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    if any(isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) and ast.unparse(
            s.value.func) in ("sys.path.insert", "sys.path.append") for s in tree.body):
        return []                # it puts the repo root on sys.path itself (tests/test_gpu.py)
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names}
    names |= {node.module for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module}

    def found(where, top):
        return os.path.isfile(os.path.join(where, top + ".py")) or \
            os.path.isdir(os.path.join(where, top))
    missing = sorted({n.split(".")[0] for n in names if found(ROOT, n.split(".")[0])
                      and not found(folder, n.split(".")[0])})
    return [f"run by its path, it cannot import {', '.join(missing)} (ModuleNotFoundError): "
            f"run it as -m {script[:-3].replace('/', '.')}"] if missing else []


def help_flags(text):
    """Every option string an argparse help lists ('  -s N, --steps N  ...')."""
    flags = set()
    for line in text.splitlines():
        entry = re.match(r"^ {2,}(-\S.*?)(?: {2,}|$)", line)
        if entry:
            flags.update(re.findall(r"(?:^|, )(-{1,2}[A-Za-z0-9][\w-]*)", entry[1]))
    return flags


# ------------------------------------------------------------------ the test
def probe(argvs):
    """{argv as a tuple: (exit status, what it printed)} of each argv + --help, all in one
    subprocess."""
    result = run_python("tests/test_docs_commands.py", [json.dumps(argvs)], timeout=300)
    assert result.returncode == 0, result.output[-3000:]
    rows = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    return {tuple(row["argv"]): (row["status"], row["output"]) for row in rows}


def judge(command, status, output):
    """The problems of one probed command, EXPECTED_TO_FAIL read the other way round."""
    expected = [why for (page, text), why in EXPECTED_TO_FAIL.items()
                if page == command.page and text in command.text]
    first_error = next((line for line in output.splitlines() if "error" in line.lower()),
                       (output.strip().splitlines() or ["(nothing printed)"])[-1])
    if expected:
        return [] if status != 0 else [f"the page shows it failing ({expected[0]}), "
                                       "but it parses"]
    if status != 0 or "usage:" not in output:
        return [f"`{' '.join(command.script)} --help` exits {status}: {first_error[:300]}"]
    unknown = [flag for flag in command.flags if flag not in help_flags(output)]
    return [f"{', '.join(unknown)} not in `{' '.join(command.script)} --help`"] if unknown else []


def test_every_command_in_the_docs_runs_as_written():
    commands = [c for page in PAGES for c in page_commands(page)]
    assert len(commands) >= 200, len(commands)
    probed = [c for c in commands if read_command(c)]
    results = probe(sorted({tuple(c.script) for c in probed}))
    for command in probed:
        command.problems += judge(command, *results.get(tuple(command.script), (
            None, "error: the probe stopped before it (a script that ends its process?)")))
    failures = [f"{c.where()}: {problem}" for c in commands for problem in c.problems]
    assert failures == [], f"{len(failures)} doc commands do not run as written:\n" + \
        "\n".join(failures)
    # every entry of the lists above still names a command (a stale entry fails)
    for (page, text) in [*EXPECTED_TO_FAIL, *WRITTEN_BY_THE_READER]:
        assert any(c.page == page and text in c.text for c in commands), (page, text)
    for script in NO_HELP:
        assert any(script in c.text for c in commands), script


def main():
    """The probe: argv+--help of every JSON-listed argv, in this one process."""
    sys.path.insert(0, ROOT)
    for argv in json.loads(sys.argv[1]):
        try:
            status, output = run(argv + ["--help"])
        except Exception as e:            # a script that raised instead of exiting
            status, output = 1, f"{type(e).__name__}: {e}"
        print(json.dumps(dict(argv=argv, status=status, output=output)), flush=True)


if __name__ == "__main__":
    main()
