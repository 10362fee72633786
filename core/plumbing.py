"""
core/plumbing.py -- the few things every script needs and none of them teaches:

  1. process-group set-up from torchrun's environment (gloo on CPU, NCCL on CUDA;
     `python script.py` alone is a world of size 1 with no process group at all),
     device choice, seeding, rank-0 printing, one clear message for a user's mistake;
  2. the cost meters every technique in this repo is measured with, so that "ZeRO-2 saves
     X bytes and sends Y bytes" means the same thing in train.py, parallel.py and lora.py:
       - CommMeter:        bytes and calls per collective type and per process group,
                           counted by thin wrappers around every torch.distributed call;
       - model_state_bytes: parameters / gradients / optimizer state actually held by
                           this rank, summed from the tensors themselves;
       - ActivationMeter:  bytes of the tensors autograd saves for backward, seen through
                           torch.autograd.graph.saved_tensors_hooks;
       - StepTimer:        wall time per step (CUDA-synchronised), tokens/s.

  3. faults, each ending in one line that says what happened:
       - user errors (`run_cli`, `report_once`): one `error:` line per JOB, status 2.
         Every rank validates the same inputs, so several may meet the error and rank 0
         may be late: the ranks agree through torchrun's key-value store (it exists
         before the process group): the first rank to claim the error prints it, the
         others wait (≤ 10 s) until it has. Argument errors too (`ArgumentParser`).
         NANOSCALE_TEST_DELAY_RANK0=SECONDS (read only in run_cli) makes rank 0 late.
       - hangs: the process group's timeout bounds every collective, in two phases (as
         torchtitan does): generous for start-up and the first step (default 300 s on
         CPU, 600 s on GPU; torch's is 30 min), then tight once a step's time is known
         (`set_collective_timeout`; train.py --step-timeout), generous again around the
         long steps (`long_phase`: saves, evaluation). A heartbeat thread per rank writes
         (time, collectives entered) to the store each second, so a rank whose collective
         times out names the collective and the silent peers, then exits 3 for torchrun
         --max-restarts. (gloo raises in the waiting rank; NCCL's watchdog aborts instead.)
       - Ctrl-C (`GracefulStop`, `Interrupted`): the first SIGINT/SIGTERM is a request the
         loop honours at the end of its step (save, then exit 130 / 143); a second one, a
         second or more later, exits at once (torchrun's forward of the same Ctrl-C comes
         within milliseconds and counts as the first).
       - disks: `check_writable` before training; `os_reason` finds the OSError ("No space
         left on device") behind torch.save's RuntimeError.

Nothing here is clever on purpose: a meter that is hard to read cannot be trusted.
"""
import argparse
import datetime
import difflib
import math
import os
import pickle
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist


class UserError(ValueError):
    """A mistake the user can fix (bad flag, missing file, bad shape). Scripts print its
    message in one line instead of a traceback (see `run_cli`)."""


# ----------------------------------------------------------------------------------------
# Process groups, devices, seeds

@dataclass
class Runtime:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str = "none"          # "gloo", "nccl", or "none" for a single process
    timeout: float = 0.0           # seconds any collective may wait (0: no process group)

    @property
    def is_main(self):
        return self.rank == 0

    @property
    def distributed(self):
        return self.backend != "none"


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


DEFAULT_TIMEOUT = {"cpu": 300.0, "cuda": 600.0}   # seconds; torch's own default is 30 min


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


def setup_runtime(device="auto", timeout=None):
    """Read torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) and join
    the default process group. NCCL moves CUDA tensors, gloo moves CPU tensors, so the
    backend follows the device. Without torchrun nothing is initialised: world size 1.
    timeout: seconds a collective may wait for its peers (default DEFAULT_TIMEOUT); a
    heartbeat thread lets a timed-out rank say which peer stopped (see `Heartbeat`)."""
    if "RANK" not in os.environ:
        return Runtime(device=pick_device(device))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev = pick_device(device, local_rank)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    timeout = float(timeout or DEFAULT_TIMEOUT[dev.type])
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group(backend, store=job_store("pg"), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout),
                                device_id=dev if dev.type == "cuda" else None)
        comm.heartbeat = Heartbeat(job_store("heartbeat"), rank, world, timeout)
    return Runtime(rank, world, local_rank, dev, backend, timeout)


class Heartbeat:
    """Every `interval` seconds a daemon thread writes "time collectives-entered" under this
    rank's key. A stopped process (SIGSTOP, a debugger, swapped out) or a dead one stops
    beating; a live one that lags shows fewer collectives. Read by `diagnose` when a
    collective times out, to name the peers it waited for."""

    def __init__(self, store, rank, world, timeout, interval=1.0):
        self.store, self.rank, self.world = store, rank, world
        self.timeout, self.interval = timeout, interval
        self.beat()
        threading.Thread(target=self._run, name="heartbeat", daemon=True).start()

    def beat(self):
        self.store.set(str(self.rank), f"{time.time():.3f} {comm.calls}")

    def _run(self):
        while True:
            time.sleep(self.interval)
            try:
                self.beat()
            except Exception:     # the store is gone: the job is ending
                return

    def diagnose(self):
        """One phrase naming the peers this rank is probably waiting for."""
        silent, behind = [], []
        for r in range(self.world):
            if r == self.rank or not self.store.check([str(r)]):
                continue
            t, calls = self.store.get(str(r)).decode().split()
            age = time.time() - float(t)
            if age > 4 * self.interval:
                silent.append(f"rank {r} (no heartbeat for {age:.0f} s: stopped or dead)")
            elif int(calls) < comm.calls:
                behind.append(f"rank {r} (alive, at collective #{calls})")
        return ", ".join(silent + behind) or "no peer looks stopped (a mismatched collective?)"


def set_collective_timeout(seconds):
    """From now on every collective of the default process group waits at most `seconds`
    for its peers. torchtitan does the same after the first step (its train_timeout_seconds,
    100 s by default): start-up (rendezvous, the first forward, allocator warm-up) may take
    minutes, a step's time is known after one. gloo raises in the waiting rank when it runs
    out; NCCL's own watchdog thread aborts the communicator and, with
    TORCH_NCCL_ASYNC_ERROR_HANDLING=3 (the default), tears the process down at that same
    deadline -- before this repo's one-line diagnosis can print. -> whether it took effect
    (False without a process group, or on a torch without the seam)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:          # a private seam of c10d (torch >= 2.2); absent: one phase
        return False
    setter(datetime.timedelta(seconds=seconds), None)
    if comm.heartbeat is not None:
        comm.heartbeat.timeout = seconds
    return True


# Hang detection, second phase: after the first step the collective timeout tightens to
# train.py's --step-timeout, or by default to STEP_TIMEOUT_STEPS x the first step's time, never below
# STEP_TIMEOUT_FLOOR (a busy machine makes steps uneven) nor above --timeout. A frozen peer
# is then named in about a minute on a small run instead of after 300 s (torchrun's
# SIGTERM -> SIGKILL grace for a stopped process, 30 s, comes on top). Turn it to 0 to keep
# --timeout throughout and watch `train.py --dp ... --hang-at-step 20` wait five times longer.
STEP_TIMEOUT_FLOOR = 60.0
STEP_TIMEOUT_STEPS = 20


def tighten_after_first_step(rt, requested, first_step_seconds):
    """Hang detection's second phase (train.py calls it after the first step of every
    invocation): set the tight timeout. requested: --step-timeout (None: automatic, 0: one
    phase). -> the seconds set, or 0.0 when there is one phase only (one process,
    --step-timeout 0, a torch without the c10d seam)."""
    if not rt.distributed or requested == 0:
        return 0.0
    auto = max(STEP_TIMEOUT_FLOOR, STEP_TIMEOUT_STEPS * first_step_seconds)
    seconds = min(requested or auto, rt.timeout)
    if not set_collective_timeout(seconds):
        print0("hang detection: this torch cannot change a process group's timeout: "
               f"--timeout ({rt.timeout:g} s) holds for every step")
        return 0.0
    print0(f"hang detection: the first step took {first_step_seconds:.2f} s; from now on a "
           f"collective waits {seconds:g} s for a silent peer (saves and evaluations "
           f"{rt.timeout:g} s)")
    return seconds


class long_phase:
    """`with long_phase(start_timeout, step_timeout):` around a step that is longer than a
    training step -- a checkpoint save, an evaluation -- so that a slow disk or a long
    validation does not look like a frozen peer: its collectives wait the generous start-up
    timeout, and the tight one applies again after it. Both None/0: nothing changes."""

    def __init__(self, start_timeout, step_timeout):
        self.start, self.step = start_timeout, step_timeout

    def __enter__(self):
        if self.step:
            set_collective_timeout(self.start)
        return self

    def __exit__(self, *exc):
        if self.step:
            set_collective_timeout(self.step)
        return False


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


def fmt_duration(seconds):
    """12 s, 3m05s, 1h02m: elapsed times and estimates in log lines."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """One line now and then for a phase that takes more than a few seconds (building a
    cache, training a drafter, SFT before RL), so a first run is never silent:
        sft policy: 40% (240/600) | 31 s | eta 46 s
    printed on rank 0 at most every `every` seconds, and once at the end. The estimate
    assumes the remaining items cost what the done ones did on average."""

    def __init__(self, label, total, every=10.0, clock=time.time):
        self.label, self.total, self.every, self.clock = label, max(1, total), every, clock
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
        print0(f"{self.label}: {100 * done // self.total}% ({done}/{self.total}) | "
               f"{fmt_duration(elapsed)} | eta {left}" + (f" | now: {now_on}" if now_on else ""))


def require_at_least_one(args, names):
    """One clear message for a count flag (steps, batch size, ...) below 1."""
    for name in names:
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got "
                            f"{getattr(args, name)}")


class Interrupted(Exception):
    """Raised after a graceful stop on a signal (see GracefulStop): run_cli exits with the
    shell's convention, 128 + the signal number (SIGINT 130, SIGTERM 143)."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.status = 128 + signum


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than the process group's timeout (or its peer vanished)."""


COLLECTIVE_FAILURE = re.compile(r"[Tt]imed out|timeout|Connection closed by peer|"
                                r"Connection reset by peer|Broken pipe")


def collective_failure(error):
    """gloo's exception for a collective that timed out or lost its peer, as one line:
    which rank, which collective, which peers look stopped. None for any other error."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if not isinstance(error, RuntimeError) or not COLLECTIVE_FAILURE.search(str(error)):
        return None
    what = "no answer within the timeout" if "imeout" in str(error) or "imed out" in \
        str(error) else "a peer closed its connection"
    who = comm.heartbeat.diagnose() if comm.heartbeat else "peers unknown"
    return (f"rank {dist.get_rank()}: {what} in {comm.waiting or 'a collective'} "
            f"(collective #{comm.calls} of this rank); waiting for {who}. Exiting with "
            f"status 3: under torchrun --max-restarts the group restarts")


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
    except RuntimeError as e:
        line = collective_failure(e)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr, flush=True)
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


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag raises UserError (one `error:` line per job, exit 2, through
    run_cli) instead of printing usage on every rank and exiting. A mistyped flag is named
    (with the nearest real one), even before a positional mode: plain argparse would read
    `--stpes 10` as an unknown flag plus a mode "10" and complain about the mode."""

    def error(self, message):
        raise UserError(f"{self.prog}: {message} (see --help)")

    def parse_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        known = self._flags()
        for token in args:
            if token == "--":
                break
            name = token.split("=", 1)[0]
            # argparse takes unambiguous prefixes (--step for --steps): those are known
            if name.startswith("--") and not any(k.startswith(name) for k in known):
                near = difflib.get_close_matches(name, sorted(known), n=1)
                self.error(f"unknown flag {name}" + (f" (did you mean {near[0]}?)"
                                                     if near else ""))
        return super().parse_args(args, namespace)

    def _flags(self):
        """Every option string of this parser and of its subcommands."""
        flags, parsers = set(), [self]
        while parsers:
            parser = parsers.pop()
            for action in parser._actions:
                flags.update(action.option_strings)
                if isinstance(action, argparse._SubParsersAction):
                    parsers += list(action.choices.values())
        return flags


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


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with exactly one default per flag: argparse's "(default: X)" is added unless
    the help already says what happens by default, or the default is None (the help then
    says what "not given" means)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or "not given" in text or action.default is None:
            return text
        return super()._get_help_string(action)


# ----------------------------------------------------------------------------------------
# The mechanisms every training loop shares: one helper each, so "warmup + cosine" or
# "decay the matrices, not the norms" means the same thing in every file.

def warmup_cosine(step, total, warmup, peak, final):
    """The learning rate at `step` (0-based): linear warmup to `peak` over `warmup` steps
    ((step + 1)/warmup · peak), then half a cosine from peak down to `final` at step
    `total` (SGDR, Loshchilov & Hutter 2017; the GPT-3 / Chinchilla recipe)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return final + (peak - final) * 0.5 * (1 + math.cos(math.pi * progress))


def decay_groups(tensors, weight_decay):
    """AdamW parameter groups from (tensor, ndim of its parameter) pairs: decay the
    matrices, not the norms' gains and biases (the usual GPT recipe; AdamW, Loshchilov &
    Hutter 2019). ndim is passed separately because a sharded tensor may be flat."""
    return [{"params": [t for t, ndim in tensors if ndim >= 2], "weight_decay": weight_decay},
            {"params": [t for t, ndim in tensors if ndim < 2], "weight_decay": 0.0}]


def all_reduce_flat(tensors, group=None, divide_by=1):
    """Sum a list of tensors (gradients) over the group in ONE all-reduce of their
    concatenation (one bucket: one call's latency instead of one per tensor), divide by
    `divide_by` (the number of replicas, to average), and copy the result back."""
    several = dist.is_initialized() and dist.get_world_size(group) > 1
    if not tensors or (not several and divide_by == 1):
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    if several:
        comm.all_reduce(flat, group=group)
    if divide_by != 1:
        flat /= divide_by
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(part.view_as(t))


def atomic_write(path, write, mode="wb", before_replace=None):
    """write(f) into a fresh temporary file beside `path`, then os.replace it into place:
    a reader (another rank, the next run after a crash) sees the old file or the new one,
    never half of one. The temporary file is removed if writing fails. before_replace():
    called once the new file is complete (e.g. keep_generations moving the old one)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.tmp-")
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
        umask = os.umask(0o022)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)      # mkstemp's 0600 would hide it from other users
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_save(obj, path, keep=1):
    """torch.save(obj, path), atomically (atomic_write); keep > 1 keeps the previous
    keep - 1 files as path.1, path.2, ... (generation_paths)."""
    atomic_write(path, lambda f: torch.save(obj, f),
                 before_replace=lambda: keep_generations(path, keep))


# Safe loading, the other half of atomic_save: a checkpoint here holds data only (dicts,
# lists, numbers, strings, tensors), so torch.load(weights_only=True) reads it. A pickle
# may name any Python callable and unpickling calls it: a file from someone else, opened
# with weights_only=False, can run anything. core/checkpoint.py builds models on top.
CONVERT_HINT = "python -m core.checkpoint convert {path} NEW.pt"


def load_checkpoint(path, map_location="cpu", what="checkpoint", fix=None):
    """torch.load(path, weights_only=True), every failure one UserError naming the file.
    Shared by every script that opens a .pt file a user named (or a cache it wrote).
    fix: what to tell the user when the file holds objects (default: the convert command)."""
    if not os.path.exists(path):
        raise UserError(f"{what} {path!r} not found")
    if os.path.isdir(path):
        raise UserError(f"{what} {path!r} is a folder, not a file")
    try:
        with warnings.catch_warnings():      # "pickle protocol 4" chatter from plain pickles
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        if refused:
            raise UserError(
                f"{path} asks to run {refused[1]} when opened, which safe loading refuses "
                f"(weights_only=True). " + (fix or "If it is an older checkpoint of this repo "
                f"and you trust its source, convert it once: {CONVERT_HINT.format(path=path)}")
            ) from None
        raise UserError(f"{path} is not a PyTorch checkpoint of plain data (safe loading, "
                        "weights_only=True, cannot read it)") from None
    except KeyError:           # torch.load's "invalid load key": not a pickle at all
        raise UserError(f"{path} is not a PyTorch checkpoint (text, or another format)") \
            from None
    except EOFError:
        raise UserError(f"{path} is empty or truncated (not a PyTorch checkpoint)") from None
    except Exception as e:
        # Anything else the unpickler or the zip reader throws at a file that is not a
        # checkpoint -- RuntimeError, ValueError, OSError, but also IndexError ("pop from
        # empty list" for a text file whose first byte happens to be a pickle opcode),
        # struct.error, UnicodeDecodeError... -- is the same answer to the user: this file
        # is not a checkpoint. (KeyboardInterrupt and SystemExit are not Exceptions.)
        first = (str(e).splitlines() or [""])[0][:120] or type(e).__name__
        raise UserError(f"{path} is not a readable PyTorch checkpoint (truncated or another "
                        f"format: {first})") from None


def generation_paths(path, keep):
    """path (the newest), path.1, ..., path.{keep-1} (older generations)."""
    return [path] + [f"{path}.{i}" for i in range(1, keep)]


def keep_generations(path, keep):
    """Shift path -> path.1 -> path.2 ...; the oldest beyond `keep` is dropped."""
    paths = generation_paths(path, keep)
    for older, newer in zip(reversed(paths[1:]), reversed(paths[:-1])):
        if os.path.exists(newer):
            os.replace(newer, older)


def os_reason(error):
    """What the operating system said, for an OSError or any exception raised while
    handling one (torch.save reports a full disk as "unexpected pos ..." with the
    OSError "No space left on device" as its context). None when there is none."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror
        seen = seen.__cause__ or seen.__context__
    return None


def check_writable(folder, need_bytes):
    """Before training: can we create files in `folder`, and is there room for about
    need_bytes? One UserError saying which, instead of a traceback at the first save."""
    try:
        os.makedirs(folder, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-test-")
        os.close(fd)
        os.unlink(probe)
    except (FileExistsError, NotADirectoryError):
        raise UserError(f"cannot write checkpoints to {folder}: part of that path is a "
                        "file, not a folder") from None
    except OSError as e:
        raise UserError(f"cannot write checkpoints to {folder}: {e.strerror}") from None
    free = shutil.disk_usage(folder).free
    if free < need_bytes:
        raise UserError(f"{folder} has {fmt_bytes(free)} free; one checkpoint needs about "
                        f"{fmt_bytes(need_bytes)}: free some space or choose another --ckpt")


# ----------------------------------------------------------------------------------------
# Human-readable numbers

def fmt_bytes(n):
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000  # decimal units, like the papers' "16 GB for 1B parameters"


def fmt_count(n):
    for unit in ("", "k", "M", "B", "T"):
        if abs(n) < 1000 or unit == "T":
            return f"{n:.1f}{unit}" if unit else f"{n:.0f}"
        n /= 1000


# ----------------------------------------------------------------------------------------
# Communication meter: every collective the scripts call goes through these wrappers.
#
# Two numbers per call:
#   payload = bytes of the tensor this rank hands to the collective (the size of the
#             message in the formulas: "all-reduce the gradients" = Ψ elements);
#   wire    = bytes this rank actually sends with the bandwidth-optimal (ring) algorithm:
#             all-reduce 2(N-1)/N·S, all-gather and reduce-scatter (N-1)/N·S of the full
#             tensor, broadcast/send S, all-to-all (N-1)/N·S. This is what "DDP sends ≈2Ψ,
#             ZeRO-3 ≈3Ψ" (ZeRO paper, Sec. 7) counts.

class CommMeter:
    def __init__(self):
        self.group_names = {}
        self.calls = 0           # collectives entered by this rank (for the hang watchdog)
        self.waiting = None      # the last one entered: "all_reduce (world)"
        self.heartbeat = None    # setup_runtime's Heartbeat, once a process group exists
        self.reset()

    def reset(self):
        # (op, group) -> [calls, payload bytes, wire bytes]
        self.rows = defaultdict(lambda: [0, 0, 0])

    def name_group(self, group, name):
        """Give a process group a readable name ("tp", "dp", ...) for the ledger."""
        self.group_names[group] = name

    def name_mesh(self, mesh):
        """Name every dimension's group of a DeviceMesh after the dimension."""
        for dim_name in mesh.mesh_dim_names or ():
            self.name_group(mesh.get_group(dim_name), dim_name)

    def _group_size(self, group):
        return dist.get_world_size(group) if dist.is_initialized() else 1

    def _enter(self, op, group):
        name = self.group_names.get(group, "world" if group is None else "group")
        self.calls += 1
        self.waiting = f"{op} ({name})"
        return name

    def _record(self, op, group, payload, wire):
        row = self.rows[(op, self._enter(op, group))]
        row[0] += 1
        row[1] += payload
        row[2] += int(wire)

    @property
    def total_wire(self):
        return sum(r[2] for r in self.rows.values())

    def table(self):
        """Rows of the ledger: op, group, calls, payload bytes, wire bytes."""
        return [(op, g, *v) for (op, g), v in sorted(self.rows.items())]

    def report(self, title="communication (this rank)"):
        lines = [f"{title}:"]
        for op, g, calls, payload, wire in self.table():
            lines.append(f"  {op:<15} {g:<6} {calls:6d} calls  payload {fmt_bytes(payload):>10}"
                         f"  sent {fmt_bytes(wire):>10}")
        if len(lines) == 1:
            lines.append("  (none)")
        return "\n".join(lines)

    # -- the wrappers: same signatures as torch.distributed, plus the bookkeeping --------
    def barrier(self, group=None):
        """No bytes worth a row in the ledger; counted for the hang watchdog only."""
        self._enter("barrier", group)
        return dist.barrier(group=group)

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        n, s = self._group_size(group), _nbytes(tensor)
        self._record("all_reduce", group, s, 2 * (n - 1) / n * s)
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)

    def all_gather_into_tensor(self, output, input, group=None, async_op=False):
        n = self._group_size(group)
        self._record("all_gather", group, _nbytes(input), (n - 1) * _nbytes(input))
        return _all_gather(output, input, group=group, async_op=async_op)

    def reduce_scatter_tensor(self, output, input, op=dist.ReduceOp.SUM, group=None,
                              async_op=False):
        n = self._group_size(group)
        self._record("reduce_scatter", group, _nbytes(input), (n - 1) / n * _nbytes(input))
        return _reduce_scatter(output, input, op=op, group=group, async_op=async_op)

    def broadcast(self, tensor, src, group=None, async_op=False):
        sent = _nbytes(tensor) if dist.get_rank() == src else 0
        self._record("broadcast", group, _nbytes(tensor), sent)
        return dist.broadcast(tensor, src=src, group=group, async_op=async_op)

    def all_to_all_single(self, output, input, output_split_sizes=None,
                          input_split_sizes=None, group=None, async_op=False):
        n = self._group_size(group)
        s = _nbytes(input)
        if input_split_sizes is not None:   # what stays on this rank is not sent
            row = s // max(input.shape[0], 1)
            kept = input_split_sizes[dist.get_rank(group)] * row
        else:
            kept = s // n
        self._record("all_to_all", group, s, s - kept)
        return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                      group=group, async_op=async_op)

    def isend(self, tensor, dst, group=None):
        self._record("send", group, _nbytes(tensor), _nbytes(tensor))
        return dist.isend(tensor, dst=dst, group=group)

    def irecv(self, tensor, src, group=None):
        self._record("recv", group, _nbytes(tensor), 0)
        return dist.irecv(tensor, src=src, group=group)

    def batch_isend_irecv(self, p2p_ops):
        for p in p2p_ops:
            is_send = p.op in (dist.isend, dist.send)
            self._record("send" if is_send else "recv", p.group, _nbytes(p.tensor),
                         _nbytes(p.tensor) if is_send else 0)
        return dist.batch_isend_irecv(p2p_ops)


# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases have the old names.
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _local(t):
    """A DTensor's (FSDP2, DTensor TP) shard on this rank; any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t):
    t = _local(t)
    return t.numel() * t.element_size()


comm = CommMeter()   # the one meter every script shares: `from plumbing import comm`


# ----------------------------------------------------------------------------------------
# Memory meters

def tensor_bytes(tensors):
    """Bytes of distinct tensors (a tensor listed twice, e.g. tied weights, counts once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        total += _nbytes(t)
    return total


def model_state_bytes(model=None, optimizer=None, extra_params=()):
    """What this rank holds of the model state, measured from the tensors themselves:
    parameters, their gradients, and every tensor in the optimizer state (Adam's m and v,
    step counters, ...). `extra_params` are tensors held outside the model, e.g. fp32
    master weights in mixed precision; they are reported on their own line."""
    params = list(model.parameters()) if model is not None else []
    opt_tensors = []
    if optimizer is not None:
        for state in optimizer.state.values():
            opt_tensors += [v for v in state.values() if torch.is_tensor(v)]
    extra = list(extra_params)
    rows = {
        "params": tensor_bytes(params),
        "grads": tensor_bytes(p.grad for p in params + extra),
        "master": tensor_bytes(extra),
        # per-element state (Adam's m and v): the K·Ψ of the formulas
        "optimizer": tensor_bytes(t for t in opt_tensors if t.dim() > 0),
        # per-tensor bookkeeping (torch keeps Adam's step count as a 0-dim tensor per
        # parameter): a few bytes per tensor, not per element, so not in the formulas
        "opt_scalars": tensor_bytes(t for t in opt_tensors if t.dim() == 0),
    }
    rows["total"] = sum(rows.values())
    return rows


class ActivationMeter:
    """Count the bytes autograd keeps alive for the backward pass.

    Every tensor saved with save_for_backward passes through the pack hook of
    torch.autograd.graph.saved_tensors_hooks. We count each underlying storage once (q, k
    and v saved as views of one buffer are one allocation) and skip parameters (weights
    saved by a matmul are model state, not activations). Use as a context manager around
    the forward pass; read `.bytes` before backward frees them."""

    def __init__(self, model=None):
        self.model = model
        self.param_ptrs = self._param_ptrs()
        self.storages = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _param_ptrs(self):
        if self.model is None:
            return set()
        return {_local(p).untyped_storage().data_ptr() for p in self.model.parameters()}

    def _pack(self, t):
        storage = _local(t).untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.param_ptrs:
            # Parameters may have moved since the meter began (ZeRO-3 gathers a block's
            # weights into re-allocated memory just before its forward): look again.
            self.param_ptrs = self._param_ptrs()
        if ptr not in self.param_ptrs and ptr != 0:
            self.storages[ptr] = storage.nbytes()
        return t

    @property
    def bytes(self):
        return sum(self.storages.values())

    def __enter__(self):
        self.storages = {}
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


# ----------------------------------------------------------------------------------------
# Time

class StepTimer:
    """Wall time of a region; synchronises CUDA first so queued kernels are counted."""

    def __init__(self, device):
        self.device = torch.device(device)

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __enter__(self):
        self._sync()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self._sync()
        self.seconds = time.perf_counter() - self.t0


# Peak dense bf16 matmul throughput, for model-FLOPs utilisation (MFU = achieved model
# FLOP/s ÷ peak). Dense, no sparsity; from the vendors' data sheets.
GPU_PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12,
                       "A10": 125e12, "4090": 165e12, "B200": 2250e12}


def gpu_peak_flops(device):
    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in GPU_PEAK_BF16_FLOPS.items():
        if key in name:
            return flops
    return None


if __name__ == "__main__":
    print(__doc__.strip())
    print("\nplumbing.py is a library: every script imports it (process groups, meters, the "
          "command line's error handling); run train.py --help to start.")
