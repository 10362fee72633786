"""
core/runtime.py -- what every distributed script needs and none of them teaches:

  1. process-group set-up from torchrun's environment (gloo on CPU, NCCL on CUDA;
     `python script.py` alone is a world of size 1 with no process group at all),
     device choice, seeding, rank-0 printing and progress lines;
  2. faults, each ending in one line that says what happened:
       - user errors (`run_cli`, `report_once`): one `error:` line per JOB, status 2.
         Every rank validates the same inputs, so several may meet the error and rank 0
         may be late: the ranks agree through torchrun's key-value store (it exists
         before the process group): the first rank to claim the error prints it, the
         others wait (<= 10 s) until it has. Argument errors too (core/cli.py).
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

The collectives themselves go through core/meters.py's `comm`, which counts them: the
heartbeat reports that count, so a timed-out rank can say who fell behind.
"""
import datetime
import os
import random
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from core.cli import fmt_duration
from core.errors import Interrupted, UserError
from core.meters import comm


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
