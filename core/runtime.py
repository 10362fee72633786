"""
core/runtime.py -- what every script needs around its lesson and none of them teaches:

  1. device choice, seeding, rank-0 printing and progress lines, and whether the times a
     command measured can be trusted (`TimingConditions`: the machine's load, the
     repeats' spread);
  2. faults, each ending in one line that says what happened:
       - user errors (`run_cli`, `report_once`): one `error:` line per JOB, status 2.
         Every rank validates the same inputs, so several may meet the error and rank 0
         may be late: the ranks agree through torchrun's key-value store (it exists
         before the process group): the first rank to claim the error prints it, the
         others wait (<= 10 s) until it has. Argument errors too (core/cli.py).
         NANOSCALE_TEST_DELAY_RANK0=SECONDS (read only in run_cli) makes rank 0 late.
       - a collective that timed out or lost its peer (core/distributed.py names the
         peers that look stopped): one line per surviving rank, status 3, for torchrun
         --max-restarts.
       - Ctrl-C (`GracefulStop`, `Interrupted`): the first SIGINT/SIGTERM is a request the
         loop honours at the end of its step (save, then exit 130 / 143); a second one, a
         second or more later, exits at once (torchrun's forward of the same Ctrl-C comes
         within milliseconds and counts as the first).

A single-process script needs nothing more; one that joins a process group adds
core/distributed.py (set-up, hang detection) on top of this file.
"""
import datetime
import os
import random
import signal
import statistics
import sys
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

from core.cli import fmt_duration
from core.errors import CollectiveFailure, Interrupted, UserError


def pick_device(name="auto", local_rank=0):
    """'auto' = the local rank's GPU when CUDA exists, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise UserError("--device cuda asked for, but torch sees no CUDA device")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if name == "cpu":
        return torch.device("cpu")
    raise UserError(f"unknown device {name!r}: use auto, cpu or cuda")


def attempt():
    """torchrun's restart count: 0 on the first attempt (and without torchrun)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def job_store(prefix, timeout=10.0):
    """A client of torchrun's key-value store, keys prefixed with the attempt number:
    the store outlives a crashed attempt, and a restarted rank must not read a dead
    peer's keys. Works before the process group exists (and without one)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store, _, _ = next(dist.rendezvous("env://", rank, world,
                                       timeout=datetime.timedelta(seconds=timeout)))
    return dist.PrefixStore(f"attempt-{attempt()}/{prefix}", store)


def teardown_runtime():
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def seed_everything(seed):
    """Seed Python, NumPy and torch (CPU and every GPU). Model weights do not depend on
    this: GPT.init_weights takes its own generator, so every rank builds the same model."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state():
    """Every RNG a training step may touch, so a resumed run draws the same numbers."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def print0(*args, **kwargs):
    """print on rank 0 only (every rank runs the same script; one log is enough)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


class Progress:
    """One line now and then for a phase that takes more than a few seconds (building a
    cache, training a drafter, SFT before RL), so a first run is never silent:
        sft policy: 40% (240/600) | 31 s | eta 46 s
        lora: 40% (80/200 steps) | 12 s | eta 18 s        (unit="steps")
    printed on rank 0 at most every `every` seconds, and once at the end. The estimate
    assumes the remaining items cost what the done ones did on average. Count in the unit
    that moves: a run of one method counts its steps, not its 0 of 1 methods."""

    def __init__(self, label, total, every=10.0, clock=time.time, unit=""):
        self.label, self.total, self.every, self.clock = label, max(1, total), every, clock
        self.unit = f" {unit}" if unit else ""
        self.t0 = self.last = clock()

    def update(self, done, now_on=""):
        """`done` items finished; `now_on` names the one starting (a bench's configuration)."""
        now = self.clock()
        if now - self.last < self.every and done < self.total:
            return
        self.last = now
        elapsed = now - self.t0
        # no estimate before the first item is done: nothing to base it on
        left = fmt_duration(elapsed / done * (self.total - done)) if done else "?"
        print0(f"{self.label}: {100 * done // self.total}% ({done}/{self.total}{self.unit}) | "
               f"{fmt_duration(elapsed)} | eta {left}" + (f" | now: {now_on}" if now_on else ""))


def report_once(line):
    """Print `line` on stderr once per job. One process: print it. Under torchrun: the
    first rank to claim it in the job's store prints, then waits (at most 10 s) until every
    rank has reached its own error; the others wait until it has printed. And every rank
    on this path exits 2 even when torchrun's SIGTERM comes first -- torchrun terminates
    the other ranks as soon as one exits, and without the handler they would show as
    killed by a signal (-15) instead of as the user error they all found."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        print(line, file=sys.stderr, flush=True)
        return
    signal.signal(signal.SIGTERM, lambda *_: os._exit(2))
    try:
        store = job_store("user-error")
        if store.add("claims", 1) == 1:
            print(line, file=sys.stderr, flush=True)
            store.set("printed", "1")
            world, deadline = int(os.environ["WORLD_SIZE"]), time.time() + 10
            while store.add("claims", 0) < world and time.time() < deadline:
                time.sleep(0.05)
        else:
            store.wait(["printed"], datetime.timedelta(seconds=10))
    except Exception:        # no store to agree through: better twice than never
        print(line, file=sys.stderr, flush=True)


def run_cli(main, argv=None):
    """Run main(argv); a UserError becomes one line on stderr and exit status 2 instead of a
    traceback from deep inside torch (once per job, see report_once); a collective that
    timed out becomes one line per surviving rank and status 3; Interrupted exits 130/143.

    After a run that joined a process group we leave with os._exit once our output is
    flushed: gloo's worker threads can still hold finished work objects whose tensors need
    the GIL, and releasing them during interpreter finalization aborts the process
    ("terminate called without an active exception", SIGABRT) well after every result was
    written — rare, but it failed whole torchrun jobs that had succeeded (see
    pytorch/pytorch#179291). Any other exception still ends with its traceback."""
    delay = os.environ.get("NANOSCALE_TEST_DELAY_RANK0")    # tests: rank 0 made late
    if delay and os.environ.get("RANK", "0") == "0":
        time.sleep(float(delay))
    joined = False
    try:
        main(argv)
        status = 0
    except UserError as e:
        report_once(f"error: {e}")
        status = 2
    except Interrupted as e:
        status = e.status
    except CollectiveFailure as e:     # said by core/distributed.py's Runtime
        print(f"error: {e}", file=sys.stderr, flush=True)
        os._exit(3)        # no teardown: it would wait for the peer that stopped
    finally:
        joined = dist.is_available() and dist.is_initialized()
        teardown_runtime()
    if joined:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    if status:
        sys.exit(status)


class GracefulStop:
    """Within `with GracefulStop() as stop:`, the first SIGINT or SIGTERM only sets
    stop.signum; the loop checks it at the end of each step (saves, then raises
    Interrupted). A second signal at least `window` s later exits at once (130 / 143)."""

    def __init__(self, window=1.0):
        self.window, self.signum, self.first = window, 0, 0.0

    def _handle(self, signum, frame):
        if self.signum and time.monotonic() - self.first >= self.window:
            print(f"{signal.Signals(signum).name} again: exiting now, without saving",
                  file=sys.stderr, flush=True)
            os._exit(128 + signum)
        if not self.signum:
            self.signum, self.first = signum, time.monotonic()

    def __enter__(self):
        self.previous = {}
        if threading.current_thread() is threading.main_thread():   # where signals land
            self.previous = {s: signal.signal(s, self._handle)
                             for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    print(__doc__.strip())
    print("\nruntime.py is a library: every script imports it (process groups, faults, the "
          "one-line errors); run train.py --help to start.")


# ----------------------------------------------------------------------------------------
# Can a timing be trusted? Two things a command sees for itself, judged in one place so
# that every bench's warning line means the same thing.

def load_average():
    """The 1-minute load average: tasks running or waiting for a core, averaged (Linux,
    macOS; os.getloadavg). None where the OS keeps none (Windows): no load judgement."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def spread(seconds):
    """Median / best of a measurement's repeats; 1.0 when every repeat took the same time.
    Noise on a shared machine only ever adds time, so the best is the least disturbed
    repeat, and the median says how far a typical one was pushed off it (the worst would
    flag a single stray page fault that the best-of-N already discards)."""
    return statistics.median(seconds) / min(seconds)


class TimingConditions:
    """Whether the times measured inside `with TimingConditions() as cond:` can be
    trusted, from what the command sees itself:
      - the machine's load, read as the timed part starts and as it ends: a load average
        above `max_load` x cores means more tasks wanted a core than there were cores
        (ours included), so our work waited its turn and the clock counted the others'.
        1.25, not 1: a process with a thread per core, alone but for the OS's own
        housekeeping, sits just above 1 per core, and a quarter more is real contention;
      - the spread of its own repeats (`spread`, median/best) above `max_spread`: the
        repeats disagree by more than the differences most of our tables report.
    cond.verdict(repeats) -> None, or ONE line saying why not; cond.report(repeats, out)
    prints that line when there is one. The reader and the core count are arguments, so
    a test shows a loaded or a quiet machine without touching the real one."""

    def __init__(self, reader=load_average, cores=None, max_load=1.25, max_spread=1.25):
        self.reader, self.cores = reader, cores or os.cpu_count() or 1
        self.max_load, self.max_spread = max_load, max_spread
        self.loads = []

    def __enter__(self):
        self.loads = [self.reader()]
        return self

    def __exit__(self, *exc):
        self.loads.append(self.reader())

    def verdict(self, repeats=None):
        """repeats: {row label: [seconds of each timed repeat]} (warm-up left out; a row
        with fewer than 2 repeats has no spread). -> None or the warning line."""
        reasons, loads = [], [x for x in self.loads if x is not None]
        if loads and max(loads) > self.max_load * self.cores:
            reasons.append(f"load average {' -> '.join(f'{x:.1f}' for x in loads)} on "
                           f"{self.cores} cores (over {self.max_load:g} per core: other "
                           f"jobs shared our cores)")
        spreads = {k: spread(v) for k, v in (repeats or {}).items() if len(v) > 1}
        worst = max(spreads, key=spreads.get, default=None)
        if worst is not None and spreads[worst] > self.max_spread:
            reasons.append(f"repeats of '{worst}' spread {spreads[worst]:.2f}x (median/best, "
                           f"over {self.max_spread:g}x)")
        if not reasons:
            return None
        return (f"warning: these timings may be off: {'; '.join(reasons)}. Read the ratios "
                f"with care, or rerun on a quiet machine")

    def report(self, repeats=None, out=print):
        """Print the verdict's line (rank 0 only: pass out=print0) when there is one."""
        line = self.verdict(repeats)
        if line:
            out(line)
        return line
