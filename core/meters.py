"""
core/meters.py -- the cost meters every technique in this repo is measured with, so that
"ZeRO-2 saves X bytes and sends Y bytes" means the same thing in train.py, parallel.py and
lora.py:
  - CommMeter:         bytes and calls per collective type and per process group,
                       counted by thin wrappers around every torch.distributed call;
  - model_state_bytes: parameters / gradients / optimizer state actually held by
                       this rank, summed from the tensors themselves;
  - ActivationMeter:   bytes of the tensors autograd saves for backward, seen through
                       torch.autograd.graph.saved_tensors_hooks;
  - StepTimer:         wall time per step (CUDA-synchronised), tokens/s; gpu_peak_flops
                       for MFU. Whether such times can be trusted (the machine's load,
                       the repeats' spread) is core/runtime.py's TimingConditions: every
                       script judges its clock, not only those that read these meters.

Nothing here is clever on purpose: a meter that is hard to read cannot be trusted.
"""
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from core.cli import fmt_bytes


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


comm = CommMeter()   # the one meter every script shares: `from core.meters import comm`


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
