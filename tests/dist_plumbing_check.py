"""Run under torchrun by test_plumbing.py: every meter wrapper must move the right data
AND record the right bytes. Exits non-zero (assertion) on any mismatch."""
import os
import sys

import torch
import torch.distributed as dist

from core.distributed import setup_runtime
from core.meters import comm
from core.runtime import print0, teardown_runtime

rt = setup_runtime("cpu")
r, n = rt.rank, rt.world_size
assert rt.backend == "gloo" and n >= 2

x = torch.full((1000,), float(r + 1))                      # 4000 bytes
comm.all_reduce(x)
assert torch.all(x == n * (n + 1) / 2)

out = torch.empty(1000 * n)
comm.all_gather_into_tensor(out, torch.full((1000,), float(r)))
assert torch.equal(out, torch.arange(n).repeat_interleave(1000).float())

shard = torch.empty(1000)
comm.reduce_scatter_tensor(shard, torch.ones(1000 * n))
assert torch.all(shard == n)

b = torch.full((10,), float(r))
comm.broadcast(b, src=0)
assert torch.all(b == 0)

# all-to-all with uneven splits: rank r sends (j+1) rows to rank j
send_sizes = [j + 1 for j in range(n)]
recv_sizes = [r + 1] * n
inp = torch.full((sum(send_sizes), 4), float(r))
outp = torch.empty(sum(recv_sizes), 4)
comm.all_to_all_single(outp, inp, recv_sizes, send_sizes)
assert torch.equal(outp[:, 0], torch.arange(n).repeat_interleave(r + 1).float())

# point to point in a ring
nxt, prv = (r + 1) % n, (r - 1) % n
recv = torch.empty(5)
reqs = [comm.isend(torch.full((5,), float(r)), nxt), comm.irecv(recv, prv)]
for q in reqs:
    q.wait()
assert torch.all(recv == prv)

rows = {(op, g): (calls, payload, wire) for op, g, calls, payload, wire in comm.table()}
assert rows[("all_reduce", "world")] == (1, 4000, int(2 * (n - 1) / n * 4000)), rows
assert rows[("all_gather", "world")] == (1, 4000, (n - 1) * 4000), rows
assert rows[("reduce_scatter", "world")] == (1, 4000 * n, int((n - 1) / n * 4000 * n)), rows
assert rows[("broadcast", "world")] == (1, 40, 40 if r == 0 else 0), rows
row_bytes = 16
assert rows[("all_to_all", "world")] == (1, sum(send_sizes) * row_bytes,
                                         (sum(send_sizes) - (r + 1)) * row_bytes), rows
assert rows[("send", "world")] == (1, 20, 20) and rows[("recv", "world")] == (1, 20, 0), rows

# a named subgroup shows up under its name
sub = dist.new_group([0, 1])
comm.name_group(sub, "pair")
if r < 2:
    y = torch.ones(3)
    comm.all_reduce(y, group=sub)
    assert torch.all(y == 2)
    assert ("all_reduce", "pair") in {(op, g) for op, g, *_ in comm.table()}
print0(comm.report())
print0(f"plumbing check ok on {n} ranks")
teardown_runtime()
sys.stdout.flush()
os._exit(0)   # skip interpreter teardown (see runtime.run_cli)
