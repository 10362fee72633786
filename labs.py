"""
labs.py -- change a line, see what changes: every topic's knobs and breakages, applied to a
temporary copy of the repo, run and measured by one command.

A lab asks the question a reader asks while reading a technique ("what if Muon takes one
Newton-Schulz step?", "what if the residual of speculative sampling is not renormalised?")
and answers it the way this repo answers everything: by running it.

  - a KNOB lab changes a flag or a few lines and measures a figure before and after
    (`python labs.py run NAME`): the recorded values and the spread between runs are in the
    lab, with one sentence on why the figure moves;
  - a BREAK lab makes the technique wrong on purpose and names the tests that must catch
    it (`python labs.py check NAME`): they must fail on the patched copy -- with the named
    assertion -- and pass on an untouched copy. That is mutation testing: it proves the
    suite bites where this repo says it proves something.

    python labs.py list [TOPIC]          # every lab: name, kind, question
    python labs.py show NAME             # the lab: question, change, command, figures
    python labs.py run NAME              # measure before and after, side by side
    python labs.py check [TOPIC|NAME...] # every break lab (or some topics' or labs')
    python labs.py check --jobs 2        # two labs at a time (the same verdicts)

The labs live in labs/<topic>.md, plain Markdown a reader can open on GitHub. One lab:

    ## optim-muon-one-ns-step
    kind: knob
    question: What if Muon takes one Newton-Schulz step instead of five?
    command: python optim.py bench ...            (run in the copy's root, before and after)
    figure: orthogonality error (\\S+)             (a regex; its first group, as a number)
    before: 0.31
    after: 0.74
    spread: 0.05                                  (how far a rerun may land from the record)
    why: one step of the quintic leaves the small singular values far below the band.
    tests: tests/test_optim.py::test_x            (break labs: the tests that must fail)
    fires: assert ...                             (text the failing run must print)
    flags: --ns-steps 1                           (optional: appended to the "after" run)
    ```diff                                       (optional: the patch, a unified diff)
    --- a/optim.py
    +++ b/optim.py
    @@ ...
    ```

Costs: each lab copies the repo's files (a few MB: what git tracks plus the reader's own new
files, not what git ignores and never a virtual environment) into a temporary folder and
runs its command or its tests twice, in that copy and in an untouched copy: never the
reader's tree, never the reader's out/. The data cache (the trained tokenizers) is shared
between the copies of one invocation so the tokenizer is trained once.
"""
import concurrent.futures
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from core.cli import ArgumentParser, HelpFormatter, add_knobs, knob
from core.errors import UserError
from core.runtime import run_cli

ROOT = os.path.dirname(os.path.abspath(__file__))
LABS_DIR = os.path.join(ROOT, "labs")
KINDS = ("knob", "break")
# What a copy holds: the repo's code, tests, labs and docs -- not the reader's outputs, the
# caches, git's objects or bytecode (a copy is rebuilt for every lab, so it stays small).
# In a git checkout git says what to leave out (.gitignore: see copy_repo); SKIP is the
# fall-back for a tree without git (a tarball), and .git is never copied.
SKIP = {".git", "out", ".cache", "__pycache__", ".pytest_cache"}


# ----------------------------------------------------------------------------------------
# A lab

@dataclasses.dataclass
class Lab:
    name: str
    topic: str                # the labs/<topic>.md it came from
    kind: str                 # "knob" or "break"
    question: str
    command: str = ""         # the measurement (knob) -- also allowed for a break lab
    figure: str = ""          # regex, first group = the number measured
    before: str = ""          # recorded values, as the lab states them
    after: str = ""
    spread: str = ""          # how far a rerun may land from them
    why: str = ""
    tests: tuple = ()         # break labs: pytest node ids that must fail when patched
    fires: str = ""           # text the failing tests must print (the assertion that fires)
    flags: str = ""           # appended to the command for the "after" run
    patch: str = ""           # a unified diff against the current files, or ""
    text: str = ""            # the lab's whole Markdown section, for `show`


FIELDS = {f.name for f in dataclasses.fields(Lab)} - {"name", "topic", "patch", "text"}


# ----------------------------------------------------------------------------------------
# The commands: a knob lab measured before and after its change, a break lab's tests run
# on the changed copy (they must fail) and on an untouched one (they must pass)

def cmd_list(labs):
    print(f"{'lab':<40} {'kind':<6} question")
    for lab in labs:
        print(f"{lab.name:<40} {lab.kind:<6} {lab.question}")
    topics = sorted({lab.topic for lab in labs})
    breaks = sum(lab.kind == "break" for lab in labs)
    print(f"\n{len(labs)} labs in {len(topics)} topics ({', '.join(topics)}): "
          f"{len(labs) - breaks} knob, {breaks} break")


def cmd_run(lab, ws, timeout):
    """Measure before (untouched copy) and after (the patch and/or flags): side by side,
    next to the recorded figures and the spread the lab states."""
    if not lab.command:
        raise UserError(f"lab {lab.name} has no command to run (a break lab: use check)")
    # before = the untouched copy with the command as written; after = the patched copy
    # (if the lab has a patch) with the lab's flags appended (if it has flags). Both in
    # copies: the command may write under out/, and the reader's out/ is theirs.
    after_cmd = f"{lab.command} {lab.flags}".strip()
    rows = []
    for label, copy, command in (("before", ws.untouched(), lab.command),
                                 ("after", ws.patched(lab), after_cmd)):
        t0 = time.perf_counter()
        status, out = run_in(copy, command, ws.cache, timeout)
        value = figure_of(lab, out)
        if status != 0 or value is None:
            tail = "\n".join(out.splitlines()[-15:])
            raise UserError(f"lab {lab.name}: the {label} run "
                            f"{'failed' if status else 'printed no figure'} "
                            f"(exit {status}); its last lines:\n{tail}")
        # the recorded value is the lab's claim; the measured one is this machine's today.
        # `within ±spread` is the check a reader does by eye, printed for them.
        rows.append((label, value, getattr(lab, label), time.perf_counter() - t0))
    print(f"{lab.name}: {lab.question}\n  command: {lab.command}"
          + (f"  (after: + {lab.flags})" if lab.flags else ""))
    spread = float(lab.spread)
    for label, value, recorded, seconds in rows:
        near = abs(value - float(recorded)) <= spread
        print(f"  {label:<7} measured {value:<12g} recorded {recorded:<10} "
              f"{'within' if near else 'OUTSIDE'} ±{lab.spread}  ({seconds:.0f} s)")
    print(f"  why: {lab.why}")
    return rows


def pytest_command(tests):
    # -o addopts= drops pytest.ini's -q/-ra/--durations (the output is searched, not read);
    # -x stops at the first failure: the first assertion that fires is the one named.
    return f"python -m pytest -x -p no:cacheprovider -o addopts= {' '.join(tests)}"


def check_one(lab, ws, timeout, control_passed=False):
    """A break lab's tests: they must fail on the patched copy, printing `fires`, and pass
    on the untouched one (already known when `control_passed`). -> (ok, one-line verdict)."""
    tests = " ".join(lab.tests)
    status, out = run_in(ws.patched(lab), pytest_command(lab.tests), ws.cache, timeout)
    if status == 0:
        return False, f"{lab.name}: the patched copy PASSED {tests} -- the suite does not bite"
    if lab.fires not in out:
        return False, (f"{lab.name}: the tests failed on the patched copy, but without "
                       f"{lab.fires!r} (another assertion or an error)")
    # The control: the same tests on the code as it is. Without it a lab could name a test
    # that fails anyway (a flaky one, or one broken by another change) and look caught.
    if not control_passed:
        status, out = run_in(ws.untouched(), pytest_command(lab.tests), ws.cache, timeout)
        if status != 0:
            return False, f"{lab.name}: {tests} fail on the untouched copy too"
    return True, f"{lab.name}: caught ({lab.fires!r}); passes untouched"


def cmd_check(labs, ws, timeout, jobs=1):
    breaks = [lab for lab in labs if lab.kind == "break"]
    if not breaks:
        raise UserError("no break lab in that selection (python labs.py list)")
    # The controls first, all in ONE pytest run on the untouched copy: every named test
    # passing there is each lab's control at once, and it saves one interpreter start and
    # one collection per lab (half a full check's time). If that run fails, each lab runs
    # its own control below, so the FAIL line names the lab whose tests fail untouched.
    t0 = time.perf_counter()
    every_test = list(dict.fromkeys(t for lab in breaks for t in lab.tests))
    status, _ = run_in(ws.untouched(), pytest_command(every_test), ws.cache, timeout)
    controls_passed = status == 0
    print(f"[control {time.perf_counter() - t0:.0f} s] the {len(every_test)} named tests on "
          f"the untouched copy: {'pass' if controls_passed else 'FAIL (each lab reruns its own)'}",
          flush=True)
    # One line per lab as it finishes (a full check takes minutes): how many are done, how
    # long so far, and the verdict; the summary line last, and a failure ends in exit
    # status 2. --jobs N checks N labs at once: each lab has its own copy and its own pytest
    # process (threads only wait on them), and a verdict does not depend on timing, so
    # only the finishing order changes. Their tests then share the cores: keep N at 1 for a
    # lab whose tests have timeouts tuned to an idle machine.
    failed = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        checks = [pool.submit(check_one, lab, ws, timeout, controls_passed) for lab in breaks]
        for i, done in enumerate(concurrent.futures.as_completed(checks), 1):
            ok, line = done.result()
            failed += not ok
            print(f"[{i}/{len(breaks)} {time.perf_counter() - t0:.0f} s] "
                  f"{'ok  ' if ok else 'FAIL'} {line}", flush=True)
    print(f"{len(breaks) - failed} of {len(breaks)} break labs caught by their tests in "
          f"{time.perf_counter() - t0:.0f} s")
    if failed:
        raise UserError(f"{failed} break lab(s) not caught (see the FAIL lines above)")


# ----------------------------------------------------------------------------------------
# Copies of the repo, and running things in them

def git_env():
    """os.environ without GIT_*: git then asks the repo of its working folder."""
    # pytest run from a pre-commit hook inherits GIT_DIR / GIT_INDEX_FILE, which would
    # point git at the reader's repo instead of the folder asked about
    return {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}


def git_ignored(root):
    """The paths under root that git ignores (relative, "/"-separated; a folder git ignores
    whole is one entry), or None where root is not a git checkout or git is missing."""
    # Asked once per copy, not once per file: `--directory` names an ignored folder once
    # (.venv/, out/) instead of listing its thousands of files; -z keeps odd names unquoted.
    # Only a folder holding .git counts: a tarball unpacked inside some other repo (a
    # dotfiles home) must not take that repo's rules.
    if not os.path.exists(os.path.join(root, ".git")):
        return None
    try:
        r = subprocess.run(["git", "ls-files", "--others", "--ignored", "--exclude-standard",
                            "--directory", "-z"], cwd=root, env=git_env(), capture_output=True,
                           timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    paths = r.stdout.decode("utf-8", "surrogateescape").split("\0")
    return {p.rstrip("/") for p in paths if p}


def is_venv(path):
    """A virtual environment: the folder holds pyvenv.cfg (PEP 405), whatever its name."""
    return os.path.isfile(os.path.join(path, "pyvenv.cfg"))


def copy_repo(dest, root=ROOT):
    """The repo's files into dest: tracked and untracked ones, not what git ignores (not
    SKIP without git), never a virtual environment. -> dest."""
    # A copy, not a git worktree: a reader's uncommitted edits and new files are part of what
    # they want to try the lab on, and a tarball download has no .git at all. A venv is
    # skipped by its pyvenv.cfg, not its name: the README's .venv is ~1 GB with torch, and
    # copying it twice made `labs.py run` take minutes instead of seconds (docs/labs.md).
    ignored = git_ignored(root)

    def ignore(folder, names):
        rel = os.path.relpath(folder, root).replace(os.sep, "/")
        rel = "" if rel == "." else rel + "/"
        if ignored is None:
            skip = {n for n in names if n in SKIP or n.endswith(".pyc")}
        else:
            skip = {n for n in names if n == ".git" or rel + n in ignored}
        return skip | {n for n in names if is_venv(os.path.join(folder, n))}
    shutil.copytree(root, dest, ignore=ignore)
    return dest


def run_in(copy, command, cache, timeout):
    """Run a shell command in the copy's root, its caches in `cache`. -> (status, output)."""
    # PYTHONPATH = the copy: `python -c "import optim"` and `python -m scripts.X` must import
    # the PATCHED files, not the reader's; GLOO_SOCKET_IFNAME=lo as tests/harness.py does,
    # for a lab that starts torchrun in a sandbox; one thread keeps timings comparable.
    env = {**os.environ, "NANOSCALE_CACHE": cache, "PYTHONPATH": copy,
           "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS",
                                                                         "1")}
    # the reader's `python` is this interpreter (its packages): spelled out so a venv works
    command = re.sub(r"^python(3)?\b", lambda _: sys.executable, command)
    try:
        r = subprocess.run(command, shell=True, cwd=copy, env=env, capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout} s: {command}"
    return r.returncode, r.stdout + r.stderr


def figure_of(lab, output):
    """The number the lab's figure regex finds (its first group), or None."""
    # the first match: a command that prints a table prints the row asked for first, or
    # the lab's regex is made specific enough (e.g. anchored on the row's label)
    m = re.search(lab.figure, output)
    if not m:
        return None
    try:
        return float(m.group(1).rstrip("%x,"))
    except (ValueError, IndexError):
        return None


class Workspace:
    """One untouched copy (reused by every lab of an invocation), a patched copy per lab,
    one shared data cache; everything under one temporary folder, removed at the end."""

    def __init__(self):
        self.root = tempfile.mkdtemp(prefix="nanoscale-labs-")
        self.cache = os.path.join(self.root, "cache")
        self.clean = None

    def untouched(self):
        if self.clean is None:
            self.clean = copy_repo(os.path.join(self.root, "untouched"))
        return self.clean

    def patched(self, lab):
        # a fresh copy per lab: two labs' patches never meet, and a lab whose command
        # writes files (a checkpoint under out/) cannot change the next lab's start
        copy = copy_repo(os.path.join(self.root, f"lab-{lab.name}"))
        if lab.patch:
            apply_patch(lab.patch, copy, lab.name)
        return copy

    def close(self):
        shutil.rmtree(self.root, ignore_errors=True)


# ----------------------------------------------------------------------------------------
# Patches: a unified diff applied by hand, exactly (the context must match)

def parse_patch(patch):
    """-> {path: [(old_start, old_lines, new_lines)]} from a unified diff."""
    # Written here rather than calling `patch` or `git apply`: neither is guaranteed on a
    # reader's machine (Windows, a bare container), and the format is 30 lines to read.
    # A hunk is its old lines (context + "-") and its new lines (context + "+").
    files, path, hunk = {}, None, None
    for line in patch.splitlines():
        if line.startswith("--- "):
            continue
        if line.startswith("+++ "):       # the file the hunks below change (git's b/ prefix)
            path = line[4:].split("\t")[0].strip()
            path = path[2:] if path.startswith("b/") else path
            files[path] = []
            continue
        m = re.match(r"@@ -(\d+)(?:,\d+)? \+\d+(?:,\d+)? @@", line)
        if m:
            hunk = (int(m.group(1)), [], [])
            files[path].append(hunk)
            continue
        # "\ No newline at end of file" and anything outside a hunk: not content
        if hunk is None or line[:1] not in (" ", "-", "+", ""):
            continue
        body = line[1:]
        if line.startswith("-"):          # only in the old file
            hunk[1].append(body)
        elif line.startswith("+"):        # only in the new one
            hunk[2].append(body)
        else:                             # context (an empty line: an empty context line)
            hunk[1].append(body)
            hunk[2].append(body)
    return files


def apply_patch(patch, root, name="lab"):
    """Apply the diff to the files under root. A hunk whose old lines are not found --
    within a few lines of where the diff says, or anywhere if they occur once -- is one
    UserError naming the lab and the file: the lab no longer fits the code."""
    for path, hunks in parse_patch(patch).items():
        full = os.path.join(root, path)
        if not os.path.isfile(full):
            raise UserError(f"lab {name}: its patch changes {path}, which does not exist")
        # split("\n"), not splitlines(): the file's last newline (or its absence) survives
        # the round trip, so an untouched line ending is not a change
        with open(full, encoding="utf-8") as f:
            lines = f.read().split("\n")
        offset = 0            # how far earlier hunks of this file moved the later ones
        for start, old, new in hunks:
            at = find_hunk(lines, old, start - 1 + offset)
            if at is None:
                raise UserError(f"lab {name}: its patch no longer applies to {path} "
                                f"(near line {start}: {old[0].strip() if old else ''!r})")
            lines[at:at + len(old)] = new
            offset += len(new) - len(old)
        with open(full, "w", encoding="utf-8") as f:
            f.write("\n".join(lines))


def find_hunk(lines, old, guess):
    """The index where `old` (a list of lines) starts: the nearest to `guess` (the file
    may have moved by a few lines since the lab was written), or None."""
    # Exact text, anywhere in the file: a lab keeps applying while the code around it
    # grows comments or moves (labs are read next to a living repo), but not once the
    # lines it changes are themselves different -- then it must be rewritten, and the
    # suite says so. Several matches: the one nearest the line the diff was made at.
    n = len(old)
    hits = [i for i in range(len(lines) - n + 1) if lines[i:i + n] == old]
    if not hits:
        return None
    return min(hits, key=lambda i: abs(i - guess))


# ----------------------------------------------------------------------------------------
# The files that hold the labs: labs/<topic>.md, read line by line

def parse_labs(path):
    """-> [Lab] of one labs/<topic>.md. Sections start with '## NAME'; inside one,
    'key: value' lines set the fields and a ```diff block is the patch. Anything else
    (prose, other headings) is the reader's and is kept only in `text`."""
    topic = os.path.splitext(os.path.basename(path))[0]
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    # A tiny line-by-line state machine rather than a Markdown parser: the format is ours,
    # and a reader editing a lab should be able to predict exactly what is read. Two
    # states: inside a ```diff block (every line belongs to the patch, verbatim -- a patch
    # line may well look like "key: value") or outside (fields, prose, headings).
    labs, current, in_diff = [], None, False
    for line in lines:
        if in_diff:                         # inside the patch: everything verbatim
            if line.strip() == "```":
                in_diff = False
            else:
                current["patch"] += line + "\n"
            current["text"] += line + "\n"
            continue
        if line.startswith("## "):
            current = {"name": line[3:].strip(), "topic": topic, "patch": "", "text": ""}
            labs.append(current)
        if current is None:                 # the file's intro, before the first lab
            continue
        current["text"] += line + "\n"
        if line.strip() == "```diff":
            in_diff = True
            continue
        # Only known keys at the start of a line are fields: prose such as "Note: ..." or
        # an indented example stays prose. The last value of a key wins.
        key, sep, value = line.partition(":")
        if sep and key.strip() in FIELDS and not line.startswith(" "):
            current[key.strip()] = value.strip()
    return [make_lab(d, path) for d in labs]


def make_lab(fields, path):
    """A Lab from its fields, checked: a lab that cannot run is one line naming it."""
    lab = Lab(**{**fields, "tests": tuple(fields.get("tests", "").split())})
    where = f"{os.path.relpath(path, ROOT)}: lab {lab.name!r}"
    # Everything a later command needs is checked here, when the file is read: a lab with
    # a missing field fails `list` (and the suite, tests/test_labs.py) with its name, not
    # minutes into a `check` run with a KeyError.
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", lab.name):
        raise UserError(f"{where}: a name is lowercase words joined by '-'")
    if lab.kind not in KINDS:
        raise UserError(f"{where}: kind must be one of {', '.join(KINDS)}, got {lab.kind!r}")
    if not lab.question:
        raise UserError(f"{where}: no question")
    # A break lab without `fires` could be "caught" by any failure at all -- an import
    # error in the patch, a typo -- and prove nothing about the assertion it names.
    if lab.kind == "break" and not (lab.patch and lab.tests and lab.fires):
        raise UserError(f"{where}: a break lab needs a patch, tests and fires")
    if lab.kind == "knob":
        missing = [k for k in ("command", "figure", "before", "after", "spread", "why")
                   if not getattr(lab, k)]
        if missing or not (lab.patch or lab.flags):
            raise UserError(f"{where}: a knob lab needs {', '.join(missing) or 'a change'} "
                            "(a patch or flags)")
    return lab


def all_labs():
    """Every lab of labs/*.md, in file then section order; names are unique."""
    if not os.path.isdir(LABS_DIR):
        raise UserError(f"no labs folder at {LABS_DIR}")
    # sorted: `list` and `check` walk the topics in the same order on every machine
    labs = [lab for name in sorted(os.listdir(LABS_DIR)) if name.endswith(".md")
            for lab in parse_labs(os.path.join(LABS_DIR, name))]
    seen = set()                  # a name is how a reader asks for a lab: one lab each
    for lab in labs:
        if lab.name in seen:
            raise UserError(f"two labs are named {lab.name!r}")
        seen.add(lab.name)
    return labs


def select(labs, which):
    """None or []: all; a topic: its labs; a name: that lab; a list: the union, in the
    catalogue's order. Unknown: one line with the choices."""
    if not which:
        return labs
    asked = [which] if isinstance(which, str) else list(which)
    topics = sorted({lab.topic for lab in labs})
    for one in asked:
        if not any(one in (lab.name, lab.topic) for lab in labs):
            raise UserError(f"no lab or topic {one!r}: topics are {', '.join(topics)} "
                            "(python labs.py list shows every name)")
    return [lab for lab in labs if lab.name in asked or lab.topic in asked]


# ----------------------------------------------------------------------------------------
# The command line: every knob once, a row each (flag or positional, default, help;
# core/cli.py makes the flags, --help and the "did you mean" line from these tables)

TIMEOUT = knob("--timeout", 600, "seconds one command or test run may take", type=float)
# mode: (help, its knobs)
MODES = {
    "list": ("every lab (or one topic's)",
             [knob("which", None, "a topic (not given: all)", nargs="?")]),
    "show": ("one lab, whole", [knob("which", None, "the lab's name")]),
    "run": ("measure a lab before and after", [knob("which", None, "a lab's name"), TIMEOUT]),
    "check": ("break labs: their tests fail patched, pass untouched", [
        knob("which", None, "a lab's names or topics (none given: every break lab)",
             nargs="*"),
        TIMEOUT,
        knob("--jobs", 1, "break labs checked at once (each in its own copy and pytest "
             "process; the verdicts do not depend on it)"),
    ]),
}


def parse_args(argv=None):
    p = ArgumentParser(description="Labs: change a line of a technique in a temporary copy "
                       "of the repo, measure what moves (knob labs) or check that the tests "
                       "catch it (break labs).", formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    for mode, (help, knobs) in MODES.items():
        add_knobs(sub.add_parser(mode, help=help, formatter_class=HelpFormatter), knobs)
    args = p.parse_args(argv)
    if getattr(args, "jobs", 1) < 1:
        raise UserError(f"--jobs must be at least 1, got {args.jobs}")
    return args


def main(argv=None):
    args = parse_args(argv)
    labs = select(all_labs(), args.which)
    if args.mode == "list":
        return cmd_list(labs)
    if args.mode == "show":
        return print(labs[0].text.rstrip())
    # run and check need copies; the workspace (and every copy in it) is removed even
    # when a lab fails or the reader presses Ctrl-C
    ws = Workspace()
    try:
        if args.mode == "run":
            return [cmd_run(lab, ws, args.timeout) for lab in labs]
        return cmd_check(labs, ws, args.timeout, args.jobs)
    finally:
        ws.close()


if __name__ == "__main__":
    run_cli(main)
