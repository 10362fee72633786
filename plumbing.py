"""
plumbing.py -- the few things every script needs and none of them teaches:

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

Nothing here is clever on purpose: a meter that is hard to read cannot be trusted.
"""
import os
import random
import sys
import time
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


def setup_runtime(device="auto"):
    """Read torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) and join
    the default process group. NCCL moves CUDA tensors, gloo moves CPU tensors, so the
    backend follows the device. Without torchrun nothing is initialised: world size 1."""
    if "RANK" not in os.environ:
        return Runtime(device=pick_device(device))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev = pick_device(device, local_rank)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        # torchrun's key-value store outlives a crashed attempt: prefix our keys with the
        # attempt number, or a restarted rank may read a dead peer's address and fail.
        store, _, _ = next(dist.rendezvous("env://", rank, world))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend, store=dist.PrefixStore(f"attempt-{attempt}", store),
                                rank=rank, world_size=world,
                                device_id=dev if dev.type == "cuda" else None)
    return Runtime(rank, world, local_rank, dev, backend)


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


def require_at_least_one(args, names):
    """One clear message for a count flag (steps, batch size, ...) below 1."""
    for name in names:
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got "
                            f"{getattr(args, name)}")


def run_cli(main, argv=None):
    """Run main(argv); a UserError becomes one line on stderr and exit status 2 instead of a
    traceback from deep inside torch. The process group is torn down either way.

    After a run that joined a process group we leave with os._exit once our output is
    flushed: gloo's worker threads can still hold finished work objects whose tensors need
    the GIL, and releasing them during interpreter finalization aborts the process
    ("terminate called without an active exception", SIGABRT) well after every result was
    written — rare, but it failed whole torchrun jobs that had succeeded (see
    pytorch/pytorch#179291). Any other exception still ends with its traceback."""
    joined = False
    try:
        main(argv)
        status = 0
    except UserError as e:
        # every rank meets the same error (the checks are deterministic): rank 0 says it
        if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        status = 2
    finally:
        joined = dist.is_available() and dist.is_initialized()
        teardown_runtime()
    if joined:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    if status:
        sys.exit(status)


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

    def _record(self, op, group, payload, wire):
        row = self.rows[(op, self.group_names.get(group, "world" if group is None else "group"))]
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
