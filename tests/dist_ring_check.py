"""Run under torchrun (2 or 4 ranks) by tests/test_ring_attention.py. Every rank builds the
same full q, k, v (seeded), computes the reference right here (model.math_attention on the
whole sequence, one process), takes its context-parallel shard, runs ring attention over
the cp group and asserts that its output and dq, dk, dv equal the reference's, sharded the
same way (fp32, atol 1e-5). It also asserts the bytes the meter recorded against the
formulas, the work per rank (zigzag balanced, plain not), a GPT training step with ring
attention in every layer (two microbatches forwarded before either backward, as a
pipeline schedule does), and one clear UserError on every rank for an uneven sequence.
Rank 0 prints the "CHECK ..." lines the test looks for. Exits non-zero on any mismatch.

    torchrun --nproc_per_node=C tests/dist_ring_check.py
"""
import os
import sys

import torch
import torch.distributed as dist

from parallelism.ring_attention import (cp_positions, cp_shard, cp_unshard, make_ring_attn_fn,
                                        ring_attention, ring_work_counter)
from model import GPT, get_config, math_attention
from core.distributed import setup_runtime
from core.errors import UserError
from core.meters import comm
from core.runtime import print0

B, D = 2, 8
ATOL = 1e-5


def sent(group_name):
    return comm.rows[("send", group_name)][2]


def close(got, want, what, atol=ATOL):
    err = (got.float() - want.float()).abs().max().item()
    assert err <= atol, (what, err)


def check_attention(group, name, zigzag, H, H_kv, T, dtype=torch.float32, atol=ATOL):
    """One case: out, dq, dk, dv against the one-process reference; bytes; work. Returns
    the query-key pairs this rank scored in the forward."""
    C, r = dist.get_world_size(group), dist.get_rank(group)
    gen = torch.Generator().manual_seed(1000 * T + 10 * H_kv + zigzag)
    q, grad = (torch.randn(B, H, T, D, generator=gen) for _ in range(2))
    k, v = (torch.randn(B, H_kv, T, D, generator=gen) for _ in range(2))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = math_attention(*full)
    ref_out.backward(grad)

    def shard(x):
        return cp_shard(x, 2, r, C, zigzag)

    local = [shard(t).to(dtype).requires_grad_() for t in (q, k, v)]
    comm.reset()
    work = ring_work_counter()
    out = ring_attention(*local, group, zigzag, work=work)
    T_local, elem = T // C, local[1].element_size()
    kv_block = 2 * B * H_kv * T_local * D * elem           # one K and one V block
    case = (name, "zigzag" if zigzag else "plain", H, H_kv, T, dtype)
    assert out.dtype == dtype, case
    assert sent(name) == (C - 1) * kv_block, (case, sent(name), (C - 1) * kv_block)
    stats = dict(work)
    if zigzag:      # the diagonal block, then C−1 half blocks: the same on every rank
        want = dict(blocks_computed=C, blocks_skipped=0,
                    pairs_scored=T_local ** 2 + (C - 1) * T_local ** 2 // 2)
    else:           # rank r: blocks of ranks 0..r; those of r+1..C−1 are in the future
        want = dict(blocks_computed=r + 1, blocks_skipped=C - 1 - r,
                    pairs_scored=(r + 1) * T_local ** 2)
    assert stats == want, (case, stats, want)

    comm.reset()
    out.backward(shard(grad).to(dtype))
    dkv_block = 2 * B * H_kv * T_local * D * 4                # accumulators travel in fp32
    want_sent = (C - 1) * kv_block + C * dkv_block
    assert sent(name) == want_sent, (case, "backward", sent(name), want_sent)

    close(out, shard(ref_out.detach()), (case, "out"), atol)
    for t, ref, what in zip(local, full, ("dq", "dk", "dv")):
        close(t.grad, shard(ref.grad), (case, what), atol)
    return stats["pairs_scored"]


def gather_tokens(x, group, zigzag):
    """Every rank's (B, H, T_local, D) piece -> the full sequence (through cp_unshard)."""
    C = dist.get_world_size(group)
    buf = torch.empty((C * x.shape[0], *x.shape[1:]), dtype=x.dtype)
    comm.all_gather_into_tensor(buf, x.contiguous(), group=group)
    return cp_unshard(list(buf.chunk(C)), 2, C, zigzag)


def check_group(group, name, seq_lens):
    C = dist.get_world_size(group)
    for zigzag in (True, False):
        for H, H_kv in ((4, 2), (4, 4)):
            for T in seq_lens:
                check_attention(group, name, zigzag, H, H_kv, T)
    print0(f"CHECK C={C} {name}: ring attention == full causal attention (out, dq, dk, dv) "
           f"for zigzag/plain, GQA/MHA, T in {seq_lens}; bytes sent == formula")

    # the full output, gathered back through cp_unshard, is the reference's
    T = seq_lens[-1]
    for zigzag in (True, False):
        gen = torch.Generator().manual_seed(5)
        q, k, v = (torch.randn(B, 4, T, D, generator=gen) for _ in range(3))
        r = dist.get_rank(group)
        out = ring_attention(*(cp_shard(t, 2, r, C, zigzag) for t in (q, k, v)), group, zigzag)
        close(gather_tokens(out, group, zigzag), math_attention(q, k, v), (name, "gathered"))

    # work balance: query-key pairs scored by each rank of the ring
    rows = []
    for zigzag in (True, False):
        mine = torch.tensor([float(check_attention(group, name, zigzag, 4, 2, T))])
        every = torch.empty(C)
        comm.all_gather_into_tensor(every, mine, group=group)
        rows.append(every.tolist())
    zigzag_pairs, plain_pairs = rows
    assert len(set(zigzag_pairs)) == 1, zigzag_pairs
    assert plain_pairs == [plain_pairs[0] * (i + 1) for i in range(C)], plain_pairs
    assert sum(zigzag_pairs) == sum(plain_pairs), (zigzag_pairs, plain_pairs)
    slowest = max(plain_pairs) / max(zigzag_pairs)
    assert abs(slowest - 2 * C / (C + 1)) < 1e-9, slowest
    print0(f"CHECK C={C} {name}: work per rank (query-key pairs scored, T={T}, per head): "
           f"zigzag {[int(p) for p in zigzag_pairs]}, plain {[int(p) for p in plain_pairs]}; "
           f"plain's slowest rank does {slowest:.2f}x zigzag's (2C/(C+1))")


def check_bf16(group, name):
    C = dist.get_world_size(group)
    check_attention(group, name, True, 4, 2, 8 * C, dtype=torch.bfloat16, atol=3e-2)
    print0(f"CHECK C={C} {name}: bf16 in -> bf16 out, K/V sent in bf16, fp32 inside")


def check_gpt(group, name, zigzag, T=16):
    """A whole tiny GPT with ring attention in every layer: two microbatches forwarded
    before either backward (as a pipeline schedule does), against one process."""
    C, r = dist.get_world_size(group), dist.get_rank(group)
    cfg = get_config("tiny", attn="math")
    ref, model = GPT(cfg, seed=0), GPT(cfg, seed=0)
    positions = cp_positions(T, r, C, zigzag)
    for block in model.layers:
        block.attention.attn_fn = make_ring_attn_fn(group, positions)
    gen = torch.Generator().manual_seed(11)
    batches = [tuple(torch.randint(0, cfg.vocab_size, (2, T), generator=gen) for _ in range(2))
               for _ in range(2)]
    ref_loss = sum(ref(x, y)[1] for x, y in batches)
    ref_loss.backward()
    # each rank's mean over its T/C tokens, ÷ C: the cp ranks' losses add up to the mean
    losses = [model(cp_shard(x, 1, r, C, zigzag), cp_shard(y, 1, r, C, zigzag),
                    positions=positions)[1] / C for x, y in batches]
    for loss in reversed(losses):
        loss.backward()
    total = sum(loss.detach() for loss in losses)
    comm.all_reduce(total, group=group)
    close(total, ref_loss.detach(), (name, "gpt loss"))
    for (param_name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        grad = p.grad.clone()
        comm.all_reduce(grad, group=group)           # partial sums over the cp ranks
        close(grad, p_ref.grad, (name, "gpt grad", param_name))
    print0(f"CHECK C={C} {name} {'zigzag' if zigzag else 'plain'}: GPT with ring attention, "
           f"2 microbatches forward then backward == one process (loss, every gradient)")


def check_errors(group, name):
    C, r = dist.get_world_size(group), dist.get_rank(group)
    for zigzag, T in ((True, 3 * C), (False, 3 * C + 1)):
        for call in (lambda: cp_positions(T, r, C, zigzag),
                     lambda: cp_shard(torch.zeros(1, T), 1, r, C, zigzag)):
            try:
                call()
                raise AssertionError(f"T={T} zigzag={zigzag} accepted")
            except UserError as e:
                assert f"needs a multiple of {2 * C if zigzag else C}" in str(e), str(e)
    try:
        ring_attention(torch.zeros(1, 3, 4, D), torch.zeros(1, 2, 4, D),
                       torch.zeros(1, 2, 4, D), group, True)
        raise AssertionError("3 query heads over 2 KV heads accepted")
    except UserError as e:
        assert "do not share" in str(e), str(e)
    try:
        make_ring_attn_fn(group, cp_positions(4 * C, r, C, True))(
            torch.zeros(1, 2, 4, D), torch.zeros(1, 2, 4, D), torch.zeros(1, 2, 4, D),
            torch.ones(4, 4, dtype=torch.bool))
        raise AssertionError("explicit mask accepted")
    except UserError as e:
        assert "explicit mask" in str(e), str(e)
    dist.barrier(group)            # nobody is stuck in a collective after the errors
    print0(f"CHECK C={C} {name}: uneven sequence, bad heads, explicit mask -> UserError on "
           f"every rank, no hang")


rt = setup_runtime("cpu")
world = dist.group.WORLD
comm.name_group(world, "cp")
C = rt.world_size
check_errors(world, "cp")
check_group(world, "cp", [8, 16, 24])
check_bf16(world, "cp")
for zigzag in (True, False):
    check_gpt(world, "cp", zigzag)
if C == 4:
    # two rings of 2 inside 4 ranks, {0, 2} and {1, 3}: group ranks are not global ranks,
    # as in a device mesh where cp is not the outermost dimension
    rings = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ring = rings[rt.rank % 2]
    comm.name_group(ring, "cp2")
    check_group(ring, "cp2", [8, 16])
    check_gpt(ring, "cp2", True)

# Every check passed. Leave without tearing down or running C++ destructors: a rare
# "terminate called without an active exception" abort at exit (gloo work freed during
# interpreter finalization) would otherwise fail a run whose assertions held.
dist.barrier()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
