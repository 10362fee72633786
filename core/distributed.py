"""
core/distributed.py -- the process group every distributed script joins, and what keeps a
stuck one from hanging forever:

  - set-up from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT):
    gloo on CPU, NCCL on CUDA; `python script.py` alone is a world of size 1 with no
    process group at all (`setup_runtime` -> Runtime);
  - hangs: the process group's timeout bounds every collective, in two phases (as
    torchtitan does): generous for start-up and the first step (default 300 s on CPU,
    600 s on GPU; torch's is 30 min), then tight once a step's time is known
    (`set_collective_timeout`; train.py --step-timeout), generous again around the long
    steps (`long_phase`: saves, evaluation). A heartbeat thread per rank writes (time,
    collectives entered) to the store each second, so a rank whose collective times out
    names the collective and the silent peers: `with setup_runtime(...) as rt:` turns
    gloo's error into one CollectiveFailure line, and run_cli (core/runtime.py) exits 3
    for torchrun --max-restarts. (gloo raises in the waiting rank; NCCL's watchdog aborts
    instead.)
  - all_reduce_flat: one all-reduce over a list of gradients (one bucket);
  - inject_fault: a rank that crashes or freezes on purpose (train.py --crash-at-step,
    --hang-at-step), what the watchdog and torchrun's restarts are tested against.

The collectives themselves go through core/meters.py's `comm`, which counts them: the
heartbeat reports that count, so a timed-out rank can say who fell behind.
"""
import datetime
import os
import re
import signal
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from core.errors import CollectiveFailure
from core.meters import comm
from core.runtime import attempt, job_store, pick_device, print0


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

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        """`with setup_runtime(...) as rt:` -- a collective that timed out or lost its peer
        leaves as one CollectiveFailure line naming the peers that look stopped (run_cli
        prints it on every surviving rank, exit 3); any other error passes through."""
        line = collective_failure(error)
        if line is not None:
            raise CollectiveFailure(line) from None
        return False


DEFAULT_TIMEOUT = {"cpu": 300.0, "cuda": 600.0}   # seconds; torch's own default is 30 min


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


COLLECTIVE_FAILURE = re.compile(r"[Tt]imed out|timeout|Connection closed by peer|"
                                r"Connection reset by peer|Broken pipe")


def collective_failure(error):
    """gloo's exception for a collective that timed out or lost its peer, as one line:
    which rank, which collective, which peers look stopped. None for any other error."""
    if error is None or not (dist.is_available() and dist.is_initialized()):
        return None
    if not isinstance(error, RuntimeError) or not COLLECTIVE_FAILURE.search(str(error)):
        return None
    what = "no answer within the timeout" if "imeout" in str(error) or "imed out" in \
        str(error) else "a peer closed its connection"
    who = comm.heartbeat.diagnose() if comm.heartbeat else "peers unknown"
    return (f"rank {dist.get_rank()}: {what} in {comm.waiting or 'a collective'} "
            f"(collective #{comm.calls} of this rank); waiting for {who}. Exiting with "
            f"status 3: under torchrun --max-restarts the group restarts")


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


# ----------------------------------------------------------------------------------------
# Faults on purpose: what the watchdog and the restart path are tested against

def inject_fault(rt, step, crash_at_step=None, hang_at_step=None):
    """train.py's --crash-at-step: the last rank leaves abruptly (first attempt only), like
    a lost node; --hang-at-step: it stops itself (SIGSTOP), like a frozen one. Under
    torchrun --max-restarts both show a restart and a resume."""
    # First attempt only: the restarted attempt must get past this step, or torchrun
    # would restart into the same crash until --max-restarts runs out.
    if rt.rank != rt.world_size - 1 or attempt() != "0":
        return
    if crash_at_step == step:
        print(f"rank {rt.rank}: crashing on purpose at step {step} (--crash-at-step)",
              flush=True)
        os._exit(1)         # no cleanup, no flush: what a lost node looks like to its peers
    if hang_at_step == step:
        print(f"rank {rt.rank} (pid {os.getpid()}): stopping itself at step {step} "
              "(--hang-at-step)", flush=True)
        # SIGSTOP cannot be caught: the process freezes with its sockets open, and its
        # peers wait in the next collective until --timeout ends the job (status 3).
        os.kill(os.getpid(), signal.SIGSTOP)
