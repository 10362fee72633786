"""
reproduce.py -- one command regenerates the trade-off table from the commands themselves.

Every figure in docs/tradeoffs.md is a number one of this repo's commands prints. This
script runs those commands -- the README's, in the README's order, at the README's sizes,
on the models the earlier commands make (the demo model first, then the draft model) --
reads each figure out of what the command printed, and writes the table with the date, the
machine and the commit it was measured on. A row whose command failed, or whose figure the
output no longer contains, says so in its cells: nothing is carried over from an old run.

    python reproduce.py                    # README sizes: docs/tradeoffs.md (1h16m
                                           #   on 2 CPU cores; progress lines as it goes)
    python reproduce.py --quick            # the same commands at tiny sizes (~2 min): every
                                           #   command still runs and every cell still fills
    python reproduce.py --only train_bench,lora --out /tmp/t.md   # some runs (others: "not run")
    python reproduce.py --list             # the runs, their commands, the rows each feeds

How it is built (the runs and rows: reproduction/tradeoffs.py):
  - a RUN is one command line (as the README writes it) plus its --quick twin and the
    FIGURES read from its output: each a regex whose first group is the figure as printed,
    or `cell(row label, column)` for the aligned tables most commands print;
  - a ROW is the technique's name and three cells (what it saves, what it adds, what it
    costs) written as templates: "{dp.zero2_state}/rank" is run `dp`'s figure `zero2_state`.
    Prose that is not measured stays prose; every number comes from a {placeholder}.

The runs, in the README's order (`--list` prints them with their commands), and roughly
what each takes at README sizes on 2 quiet cores:
    demo                 python train.py                                   ~6 min
    train_bench, dp      python -m scripts.train_bench (alone, torchrun 2)  ~1 min
    tp, sp, cp, ep       torchrun (2) parallel.py ... --check               ~20 s each
    v3, v3_aux           python train.py --preset v3 --steps 400 (2 ways)  ~5 min each
    plan                 python parallel.py plan (DeepSeek-V3's shape)     < 1 s
    pipeline             torchrun (4) -m parallelism.pipeline bench        ~1 min
    optim_bench, optim   python optim.py bench | compare                   ~5-7 min
    lora                 python lora.py compare                            ~3.5 min
    mla                  python -m scripts.mla_bench                       ~6 s
    serve, agent, preempt, prefix, int8   python -m scripts.serve_bench ...  ~1 min each
    router               python kv_router.py bench                         ~15 s
    streaming            python streaming.py measure --bos                 ~1.5 min
    curate, dedup, sweep python curate.py stats | dedup, -m scripts.curate_sweep  ~5 min
    ppl, task, calibration, uncertainty, contamination   evaluate.py, scripts.*   ~5 min
    disagg               torchrun (2) disagg.py bench                      ~30 s
    draft, spec          the draft model, then python spec_decode.py bench ~8 min
    quantize             python quantize.py compare                        ~9 min
    rl                   python rl.py compare                              ~5-10 min
    asserted             pytest on the tests behind the rows no command measures  ~3 min

What the figures mean, and how far they move between runs:
  - bytes (model state, KV per token, bytes sent, bits/weight) are counted from the tensors
    and the collectives: the same on every run and every machine with the same flags;
  - losses, accuracies and acceptance rates are seeded: the same on one machine and one
    torch build, run after run, interrupted and resumed or not (tests/test_train.py);
    another CPU or torch build moves the last digits (float summation order), another
    Python version trains on another corpus (its standard library);
  - times (step ms, speedups, TTFT) move with the machine and with what else it runs:
    ±10-30% between runs on a shared 2-core CPU, which is why every time here is a ratio
    to a reference measured in the same command, and the topic pages give the spread
    measured over repeats;
  - --quick figures come from models trained for a few steps: they test that the table's
    wiring holds (every command runs, every cell fills), not what a technique buys.

Costs: the full run is every topic's headline command back to back (the longest: the demo,
quantize.py compare, rl.py compare, spec_decode.py bench); it writes under --workdir (its
out/ folder is the commands' out/), never over the reader's out/ckpt.pt. Times in the table
are wall times on the machine named in its first line: compare ratios, not seconds.
"""
import concurrent.futures
import datetime
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from core.cli import ArgumentParser, HelpFormatter, add_knobs, fmt_duration, knob
from core.errors import UserError
from core.files import atomic_write
from core.runtime import run_cli
from reproduction.tradeoffs import ROWS, RUN_BY_NAME, RUNS

ROOT = os.path.dirname(os.path.abspath(__file__))
TABLE = os.path.join(ROOT, "docs", "tradeoffs.md")
QUICK_TABLE = os.path.join(ROOT, "out", "tradeoffs-quick.md")    # never over the measured one
MISSING = "**?**"              # a figure the output did not contain: shown, never invented


# ----------------------------------------------------------------------------------------
# Running them

def shell_words(command):
    """The README's words -> what this interpreter runs: `python` is sys.executable (a
    venv works), `torchrun` is `python -m torch.distributed.run`, `X.py` is the repo's."""
    # Split as a shell would (quotes group words), but run without one: the commands hold
    # no pipes or variables, and no shell means nothing is ever interpreted twice.
    out = []
    for word in shlex.split(command):
        if word == "python":
            word = sys.executable
        elif word == "torchrun":
            # torchrun's console script belongs to whichever torch is first on PATH; the
            # module is the one this interpreter imports
            out += [sys.executable, "-m", "torch.distributed.run"]
            continue
        # the commands run in the workdir (their out/ is there), so a script name is
        # made absolute; `-m scripts.X` finds the repo through PYTHONPATH instead
        elif os.path.exists(os.path.join(ROOT, word.split("::")[0])) and (
                word.endswith(".py") or "::" in word):        # a script, or a test's id
            word = os.path.join(ROOT, word)
        out.append(word)
    return out


# A run is a subprocess, not a function call: the command is the README's own line, with
# its own interpreter state (threads, seeds, process groups) -- what a reader gets when
# they type it -- and a crash in one run cannot take the others with it.
def run_one(run, quick, workdir, timeout):
    """-> (status, output, seconds). The command runs in workdir (its out/ is there), the
    repo first on the import path (python -m scripts.X finds the repo's)."""
    # the reader's environment, plus the repo on the import path and gloo on loopback (as
    # tests/harness.py does: a sandbox may have no other interface for torchrun's ranks)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    t0 = time.perf_counter()
    try:
        # stderr into stdout: the log keeps the order the lines were printed in (progress
        # lines, warnings and the table interleaved as the reader would see them)
        r = subprocess.run(shell_words(run.quick if quick else run.command),
                           cwd=workdir, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=timeout)
        status, output = r.returncode, r.stdout
    except subprocess.TimeoutExpired as e:
        # what it printed before the kill is bytes here whatever text= says (Python's docs)
        partial = (e.stdout or b"").decode(errors="replace")
        status, output = 124, f"{partial}\ntimed out after {timeout:g} s"
    return status, output, time.perf_counter() - t0


# A reader that raises (a cell that is not a number where ratio() needs one) counts as a
# missing figure: the table shows the gap, the other figures of the run still fill.
def read_figures(run, output):
    """{name: figure as printed, or None where the output lacks it}."""
    # the figure stays the string the command printed ("920.1 KB", "1.16×"): its unit and
    # its digits are the command's, so the table and the log can be compared by eye
    got = {}
    for name, read in run.figures.items():
        try:
            got[name] = read(output)
        except (ValueError, IndexError):
            got[name] = None
    return got


def fill(template, results):
    """Replace {run.figure} by the figure; a missing one by MISSING. -> (text, missing)."""
    missing = []

    def one(m):
        run, figure = m.group(1), m.group(2)
        r = results.get(run)
        # {run.cmd} is the command as the README writes it (never the --quick one: the
        # table names what a reader types, the provenance line says --quick)
        if figure == "cmd":
            return RUN_BY_NAME[run].command
        # not run (an --only selection), or run and not found: both a visible gap, with
        # the difference kept in the list under the table
        value = r["figures"].get(figure) if r else None
        if value is None:
            missing.append(f"{run}.{figure}" + ("" if r else " (not run)"))
            return MISSING
        return value
    text = re.sub(r"\{(\w+)\.(\w+)\}", one, template)
    return text, missing


# The first line under the title: a reader comparing the table with their own run needs
# the date (which code), the machine (which speed), torch (which kernels), the commit
# (which flags and defaults) -- "+ uncommitted changes" when the tree was edited.
def tree_commit():
    """The commit the runs are made from, taken once before the first run (a tree edited
    while a reproduction runs would otherwise stamp code the early runs never saw)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return (commit + (" + uncommitted changes" if dirty else "")) or "no git"
    except OSError:
        return "no git"


def provenance(quick, seconds, commit, jobs=1):
    """Date, machine and commit: what a reader needs to trust or distrust a row."""
    device = "CUDA " + torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    flags = (" --quick" if quick else "") + (f" --jobs {jobs}" if jobs > 1 else "")
    return (f"Measured by `python reproduce.py{flags}` on "
            f"{datetime.date.today().isoformat()}: {platform.platform()}, "
            f"{os.cpu_count()} CPU cores, {device}, Python {platform.python_version()}, "
            f"torch {torch.__version__}; commit {commit}; {fmt_duration(seconds)} in all"
            + (f"; {jobs} runs at a time shared the cores, so their time columns are "
               "contended (bytes, losses and counts are not)." if jobs > 1 else "."))


# The whole page is rewritten each time (after every run): no hand edits survive by
# design, so the table cannot drift from the commands that produce it.
def write_table(path, results, stamp):
    """The Markdown page; stamp: its provenance line(s). -> [(row, missing figures)] for
    the rows with a gap."""
    gaps, lines = [], []
    for technique, *cells in ROWS:
        filled = [fill(t, results) for t in (technique, *cells)]
        missing = [m for _, ms in filled for m in ms]
        if missing:
            gaps.append((filled[0][0], missing))
        lines.append("| " + " | ".join(text.replace("|", "\\|") for text, _ in filled) + " |")
    page = ("# The trade-off table\n\n"
            "Generated by `python reproduce.py` (do not edit by hand: rerun it). One row per "
            "technique: what it saves, what it adds, what it costs; every number is read from "
            "the output of the command named in the row. Memory and byte figures are exact; "
            "times are rough (read the ratios). The topic pages have the full tables. Back to "
            "the [README](../README.md).\n\n"
            + stamp + "\n\n"
            "| technique (command) | memory saved | communication / compute added | "
            "what it costs |\n|---|---|---|---|\n" + "\n".join(lines) + "\n")
    if gaps:
        page += (f"\n{MISSING} marks a figure the command did not print this time (its run "
                 "failed, was not run, or its output changed): "
                 + "; ".join(f"{row}: {', '.join(m)}" for row, m in gaps) + ".\n")
    # atomically: a reader opening the page while a long reproduction rewrites it sees the
    # previous version or the new one, never half a table
    atomic_write(path, lambda f: f.write(page), mode="w")
    return gaps


class DemoGuard:
    """The README's promise that no command writes over another's model, checked as the
    runs go: the demo's out/ckpt.pt is hashed when the demo finishes and after every later
    run; `changed_by` names the run(s) during which it first changed (with --jobs 2, the
    one that finished and the one still running)."""

    def __init__(self, path):
        self.path, self.digest, self.changed_by = path, None, ""

    def sha256(self):
        with open(self.path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()

    def check(self, run, still_running):
        # no file yet (the demo failed, or --only left it out), or already caught: nothing
        # to compare; the first change is the one to report, later ones follow from it
        if not os.path.exists(self.path) or self.changed_by:
            return
        digest = self.sha256()
        if run.name == "demo":
            self.digest = digest
        elif self.digest is not None and digest != self.digest:
            self.changed_by = " or ".join([run.name, *still_running])


def save_figures(workdir, results, stamp):
    """WORKDIR/figures.json: what this reproduction read so far, with its stamp -- what
    --merge combines when two reproductions (on one machine) split the runs between them."""
    record = {"stamp": stamp, "results": {name: {k: r[k] for k in ("status", "figures",
                                                                  "seconds")}
                                          for name, r in results.items()}}
    atomic_write(os.path.join(workdir, "figures.json"),
                 lambda f: json.dump(record, f, indent=1), mode="w")


def merge(folders, out):
    """One table from the figures.json of several workdirs (a later folder's run wins),
    each figure read again from the run's log; every reproduction's stamp is kept, naming
    the runs it made."""
    # Two reproductions on the same machine and commit can share the work (one runs the
    # first half, the other the second with --assume demo): their figures are one table,
    # and the page says which runs each stamp covers, so nothing is presented as one run
    # that was two.
    results, records = {}, []
    for folder in folders:
        path = os.path.join(folder, "figures.json")
        try:
            with open(path) as f:
                record = json.load(f)
        except (OSError, ValueError) as e:
            raise UserError(f"--merge: cannot read {path} ({e}): is {folder} the --workdir "
                            "of a reproduction?") from None
        for name, r in record["results"].items():
            # the figures are read again from the run's log with today's readers: a
            # reader fixed after the runs (a column miscounted) needs no rerun
            log = os.path.join(folder, "logs", f"{name}.log")
            if name in RUN_BY_NAME and os.path.exists(log):
                with open(log, errors="replace") as f:
                    r = {**r, "figures": read_figures(RUN_BY_NAME[name], f.read())}
            results[name] = r
        records.append(record)
    # each stamp names the runs whose figures the table took from it (a run a later folder
    # made again is that folder's)
    later = set()
    stamps = []
    for record in reversed(records):
        kept = [name for name in record["results"] if name not in later]
        later.update(record["results"])
        if kept:
            stamps.append(f"Runs {', '.join(kept)}: {record['stamp']}")
    gaps = write_table(out, results, "\n\n".join(reversed(stamps)))
    print(f"wrote {out} from {len(folders)} reproduction(s): {len(ROWS)} rows, {len(gaps)} "
          "with a missing figure")
    return {"results": results, "gaps": gaps, "out": out}


# ----------------------------------------------------------------------------------------
# Choosing the runs, and running them as their needs allow

# --only keeps the README's order and adds what a chosen run reads: `--only spec` runs the
# demo and the draft model first, as a reader following the README would have.
def run_names(text, flag):
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUN_BY_NAME]
    if unknown:
        raise UserError(f"{flag}: no run named {', '.join(unknown)} (runs: "
                        f"{', '.join(RUN_BY_NAME)})")
    return names


def chosen_runs(only, assume=""):
    # an assumed run is neither run nor needed: its files (the demo's out/ckpt.pt) are in
    # the workdir already, copied there by the reader
    assumed = set(run_names(assume, "--assume"))
    if not only:
        return [r for r in RUNS if r.name not in assumed]
    names = run_names(only, "--only")
    wanted = set(names)
    for name in names:                       # what they need runs first
        wanted |= set(RUN_BY_NAME[name].needs)
    return [r for r in RUNS if r.name in wanted - assumed]


# --jobs 1 (the default for the full run) keeps the timings uncontended; --quick uses both
# cores, since its timings mean nothing and the suite runs it. A thread per running job is
# enough: each waits on its subprocess, Python does no work meanwhile.
def run_all(runs, args, workdir, results, t0, after_each, assumed=()):
    """Every run, up to --jobs at a time, each once the runs it needs have finished; a line
    as each starts and ends (which run, elapsed, figures read, what is missing), and
    after_each(run, still_running) once its figures are in (the table is rewritten: an
    interrupted reproduction keeps what it measured)."""
    pending, running, done = list(runs), {}, 0
    logs = os.path.join(workdir, "logs")
    os.makedirs(logs, exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        while pending or running:
            for run in [r for r in pending if all(n in results or n in assumed
                                                   for n in r.needs)]:
                if len(running) == args.jobs:
                    break
                pending.remove(run)
                print(f"[{fmt_duration(time.perf_counter() - t0)}] start {run.name}: "
                      f"{run.quick if args.quick else run.command}", flush=True)
                running[pool.submit(run_one, run, args.quick, workdir, args.timeout)] = run
            if not running:      # nothing ready and nothing to wait for: a need never met
                raise UserError("runs wait on runs that will not come: "
                                f"{', '.join(r.name for r in pending)} (use --only or --assume)")
            finished, _ = concurrent.futures.wait(
                running, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in finished:
                run = running.pop(future)
                done += 1
                report(run, *future.result(), results, f"{done}/{len(runs)}", t0, logs)
                after_each(run, [r.name for r in running.values()])


def report(run, status, output, seconds, results, count, t0, logs):
    """Read the figures of a finished run into results, and say how it went."""
    figures = read_figures(run, output)
    results[run.name] = {"status": status, "figures": figures, "seconds": seconds}
    # every run's whole output beside its files: what a reader checks a figure against
    with open(os.path.join(logs, f"{run.name}.log"), "w") as f:
        f.write(output)
    # a run whose checkpoint came from a failed run fails too: say which one to look at
    failed = [n for n in run.needs if results.get(n, {}).get("status")]
    lost = [n for n, v in figures.items() if v is None]
    note = (f"exit {status}" + (f" (it needs {', '.join(failed)}, which failed)"
                                if failed else "") if status else
            f"{len(figures) - len(lost)}/{len(figures)} figures")
    print(f"[{fmt_duration(time.perf_counter() - t0)}] {count} {run.name}: {note} in "
          f"{fmt_duration(seconds)}" + (f"; missing: {', '.join(lost)}" if lost else ""),
          flush=True)
    if status:                  # the error is in the last lines: one error line, or
        # torchrun's report after it (the `error:` line above it is the one to read)
        print("    " + "\n    ".join(output.strip().splitlines()[-8:]), flush=True)


# ----------------------------------------------------------------------------------------
# The command line: every knob once, a row each (flag, default, help; core/cli.py makes
# the flags, --help and the "did you mean" line from this table)

KNOBS = [
    knob("--quick", False, "tiny sizes: every command runs in seconds (a smoke test of the "
         "table's wiring; its figures mean nothing)"),
    # --only is for a reader who changed one topic: rerun its rows, keep the rest marked
    # "not run" rather than stale (the page never mixes two runs' numbers silently)
    knob("--only", "", "comma list of run names (--list shows them); their rows fill, the "
         "rest say which runs were not run"),
    knob("--out", None, f"the table to write (default: {os.path.relpath(TABLE, ROOT)}; with "
         f"--quick: {os.path.relpath(QUICK_TABLE, ROOT)}, so a smoke test never overwrites "
         "the measured table)"),
    knob("--workdir", None, "where the commands run (their out/ is WORKDIR/out); default: "
         "out/reproduce, or a temporary folder with --quick (removed afterwards unless "
         "--keep)"),
    knob("--keep", False, "keep the --quick workdir"),
    # an hour: the longest full run (quantize.py compare, ~9 min here) with room for a
    # slower machine; a run past it is killed and its figures are marked missing
    knob("--timeout", 3600, "seconds one command may take", type=float),
    knob("--jobs", int, "runs at a time (default: 1, so that timings are not contended; 2 "
         "with --quick, whose timings mean nothing)"),
    knob("--assume", "", "comma list of runs whose files are already in WORKDIR/out (copied "
         "from another reproduction): not run, and the runs that need them go ahead"),
    knob("--merge", "", "comma list of workdirs: write one table from their figures.json "
         "(two reproductions that split the runs) and exit"),
    knob("--list", False, "print the runs and exit"),
]


def parse_args(argv=None):
    return add_knobs(ArgumentParser(
        description="Run every topic's headline command (README sizes, or tiny ones with "
        "--quick) and write the trade-off table from what they print, with the date, "
        "machine and commit.", formatter_class=HelpFormatter), KNOBS).parse_args(argv)


def list_runs():
    """--list: each run, the rows it feeds (the rows whose templates name it), its command."""
    for r in RUNS:
        rows = sum(f"{{{r.name}." in "".join(row) for row in ROWS)
        print(f"{r.name:<12} {rows:>2} row(s)  {r.command}")


def reproduce(args):
    """The runs --only and --assume choose, in --workdir, and the table written after each."""
    runs = chosen_runs(args.only, args.assume)
    assumed = set(run_names(args.assume, "--assume"))
    args.jobs = args.jobs or (2 if args.quick else 1)
    if args.jobs < 1:
        raise UserError(f"--jobs must be at least 1, got {args.jobs}")
    # The full run keeps its folder (out/reproduce: its checkpoints are worth reusing and
    # its logs worth reading); a --quick folder is scratch unless --keep or --workdir.
    workdir = args.workdir or (tempfile.mkdtemp(prefix="nanoscale-reproduce-") if args.quick
                               else os.path.join(ROOT, "out", "reproduce"))
    os.makedirs(workdir, exist_ok=True)
    out = args.out or (QUICK_TABLE if args.quick else TABLE)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    results, t0, commit = {}, time.perf_counter(), tree_commit()
    demo = DemoGuard(os.path.join(workdir, "out", "ckpt.pt"))
    if "demo" in assumed:                    # the demo model is there already: guard it
        demo.check(RUN_BY_NAME["demo"], [])

    def write():
        stamp = provenance(args.quick, time.perf_counter() - t0, commit, args.jobs)
        save_figures(workdir, results, stamp)
        return write_table(out, results, stamp)
    try:
        def after_each(run, still_running):
            demo.check(run, still_running)
            return write()
        run_all(runs, args, workdir, results, t0, after_each, assumed)
        gaps = write()
    finally:
        if args.quick and not args.keep and not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"wrote {out}: {len(ROWS)} rows, {len(gaps)} with a missing figure "
          f"({fmt_duration(time.perf_counter() - t0)})")
    check_outcome(demo, results, workdir)
    return {"results": results, "gaps": gaps, "out": out}


def check_outcome(demo, results, workdir):
    """A failed run is a failed reproduction: the table is written (with its gaps marked)
    and the exit status says so, so that a script or CI running this notices."""
    if demo.changed_by:
        raise UserError(f"out/ckpt.pt, the demo model every later run reads, changed during "
                        f"{demo.changed_by}: a command wrote over another's model")
    failed = sorted(name for name, r in results.items() if r["status"])
    if failed:
        kept = (f"; their logs: {os.path.join(workdir, 'logs')}" if os.path.isdir(workdir)
                else " (rerun with --keep to keep their logs)")
        raise UserError(f"{len(failed)} run(s) failed: {', '.join(failed)}{kept}")


def main(argv=None):
    args = parse_args(argv)
    if args.list:
        return list_runs()
    if args.merge:              # no runs: one table from reproductions already made
        return merge([d for d in args.merge.split(",") if d], args.out or TABLE)
    return reproduce(args)


if __name__ == "__main__":
    run_cli(main)
