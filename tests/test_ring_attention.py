"""Context parallelism: ring attention with zigzag sharding. The fast tests run in this
process (the layouts, their errors, the block math, a ring of one); the distributed checks
live in dist_ring_check.py (each rank asserts) and are launched here with torchrun on 2
and 4 ranks."""
import math

import pytest
import torch

from parallelism.ring_attention import (_merge_partial_attention, _ring_block_forward,
                                        _visible_rectangle, cp_chunk_ids, cp_positions, cp_shard,
                                        cp_unshard, make_ring_attn_fn, ring_attention,
                                        ring_work_counter)
from harness import torchrun
from model import math_attention
from core.errors import UserError

CHECK = "tests/dist_ring_check.py"


def test_chunk_ids_zigzag_pairs_an_early_and_a_late_chunk():
    assert [cp_chunk_ids(r, 4, True) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [cp_chunk_ids(r, 4, False) for r in range(4)] == [[0], [1], [2], [3]]
    assert cp_chunk_ids(0, 1, True) == [0]          # one rank: the whole sequence


def test_positions_of_each_layout():
    assert cp_positions(8, 0, 2, True).tolist() == [0, 1, 6, 7]
    assert cp_positions(8, 1, 2, True).tolist() == [2, 3, 4, 5]
    assert cp_positions(8, 1, 2, False).tolist() == [4, 5, 6, 7]
    for C, zigzag in ((3, True), (4, True), (4, False)):
        T = 2 * C * 3
        every = torch.cat([cp_positions(T, r, C, zigzag) for r in range(C)])
        assert sorted(every.tolist()) == list(range(T))            # each token once
        for r in range(C):                                          # ring_attention's
            p = cp_positions(T, r, C, zigzag)                       # trimming needs this
            assert (p[1:] > p[:-1]).all()


@pytest.mark.parametrize("C", [1, 2, 3, 4])
@pytest.mark.parametrize("zigzag", [True, False])
@pytest.mark.parametrize("dim", [1, 2])
def test_shard_takes_the_positions_and_unshard_inverts_it(C, zigzag, dim):
    x = torch.randn(2, 24, 24, 3)
    pieces = [cp_shard(x, dim, r, C, zigzag) for r in range(C)]
    for r, piece in enumerate(pieces):
        assert torch.equal(piece, x.index_select(dim, cp_positions(24, r, C, zigzag)))
    assert torch.equal(cp_unshard(pieces, dim, C, zigzag), x)


def test_user_errors_say_what_is_needed():
    with pytest.raises(UserError, match="sequence length 6 .* needs a multiple of 4"):
        cp_positions(6, 0, 2, True)
    with pytest.raises(UserError, match="needs a multiple of 3"):
        cp_shard(torch.zeros(1, 7), 1, 0, 3, False)
    with pytest.raises(UserError, match="one piece per rank"):
        cp_unshard([torch.zeros(1, 4)], 1, 2, True)
    with pytest.raises(UserError, match="cp rank 2 is not in 0..1"):
        cp_chunk_ids(2, 2, True)
    q, kv = torch.zeros(1, 3, 4, 8), torch.zeros(1, 2, 4, 8)
    with pytest.raises(UserError, match="do not share"):
        ring_attention(q, kv, kv, None, True)
    with pytest.raises(UserError, match="explicit mask"):
        make_ring_attn_fn(None, torch.arange(4))(kv, kv, kv, torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(UserError, match="must be this rank's cp_positions"):
        make_ring_attn_fn(None, torch.tensor([0, 2, 1, 3]))


def test_online_softmax_merge_and_fully_masked_rows():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    scale = 1 / math.sqrt(8)
    full, full_lse = _ring_block_forward(q, k, v, None, scale)
    want = torch.softmax(q @ k.transpose(-2, -1) * scale, -1) @ v
    assert torch.allclose(full, want, atol=1e-6)
    # two disjoint key blocks merged = attention over their union
    a = _ring_block_forward(q, k[:, :, :2], v[:, :, :2], None, scale)
    b = _ring_block_forward(q, k[:, :, 2:], v[:, :, 2:], None, scale)
    out, lse = _merge_partial_attention(*a, *b)
    assert torch.allclose(out, full, atol=1e-6) and torch.allclose(lse, full_lse, atol=1e-6)
    # row 0 sees no key of this block: it must contribute nothing, and no NaN
    mask = torch.ones(5, 6, dtype=torch.bool)
    mask[0] = False
    masked, masked_lse = _ring_block_forward(q, k, v, mask, scale)
    assert torch.isfinite(masked).all() and (masked[:, :, 0] == 0).all()
    assert (masked_lse[:, :, 0] == float("-inf")).all()
    merged, merged_lse = _merge_partial_attention(*a, masked, masked_lse)
    assert torch.isfinite(merged).all()
    assert torch.allclose(merged[:, :, 0], a[0][:, :, 0]) and torch.equal(merged_lse[:, :, 0],
                                                                         a[1][:, :, 0])


@pytest.mark.parametrize("C", [2, 4, 8])
def test_zigzag_balances_the_causal_work_and_plain_does_not(C):
    """The blocks each rank would compute, from the layout alone (what ring_attention
    trims to): zigzag gives every rank the diagonal plus C−1 half blocks; plain gives rank
    r its r+1 blocks. The same total, spread evenly or not."""
    T = 4 * C
    work = {}
    for zigzag in (True, False):
        work[zigzag] = []
        for r in range(C):
            pairs, masked = 0, []
            for j in range(C):
                rect = _visible_rectangle(cp_positions(T, r, C, zigzag),
                                          cp_positions(T, j, C, zigzag))
                if rect is not None:
                    row0, col1, needs_mask = rect
                    pairs += (T // C - row0) * col1
                    masked.append(needs_mask)
            assert masked == [j == r for j in range(C) if j <= r or zigzag]
            work[zigzag].append(pairs)
    T_local = T // C
    assert work[True] == [T_local ** 2 + (C - 1) * T_local ** 2 // 2] * C
    assert work[False] == [(r + 1) * T_local ** 2 for r in range(C)]
    assert sum(work[True]) == sum(work[False])
    assert max(work[False]) / max(work[True]) == pytest.approx(2 * C / (C + 1))


@pytest.mark.parametrize("H, H_kv", [(4, 2), (4, 4)])
def test_a_ring_of_one_is_full_causal_attention(H, H_kv):
    """Without a process group the ring has one rank: the diagonal block only. Forward and
    the hand-written backward against math_attention under autograd."""
    torch.manual_seed(1)
    q, grad = torch.randn(2, H, 12, 8), torch.randn(2, H, 12, 8)
    k, v = torch.randn(2, H_kv, 12, 8), torch.randn(2, H_kv, 12, 8)
    ring_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    work = ring_work_counter()
    attn_fn = make_ring_attn_fn(None, torch.arange(12), work=work)
    out = attn_fn(*ring_in, None)
    ref = math_attention(*ref_in)
    assert torch.allclose(out, ref, atol=1e-5)
    out.backward(grad)
    ref.backward(grad)
    for a, b in zip(ring_in, ref_in):
        assert torch.allclose(a.grad, b.grad, atol=1e-5)
    assert work == dict(blocks_computed=1, blocks_skipped=0, pairs_scored=144)
    half = ring_attention(*(t.to(torch.bfloat16) for t in (q, k, v)), None, True)
    assert half.dtype == torch.bfloat16
    assert torch.allclose(half.float(), ref.detach(), atol=3e-2)


def ring_verdicts(label):
    """The lines every launch must print: errors refused, the ring equal to full
    attention, the work per rank, bf16, and a whole GPT in both layouts."""
    return [f"CHECK {label}: uneven sequence, bad heads, explicit mask -> UserError",
            f"CHECK {label}: ring attention == full causal attention (out, dq, dk, dv)",
            f"CHECK {label}: work per rank",
            f"CHECK {label}: bf16 in -> bf16 out",
            f"CHECK {label} zigzag: GPT with ring attention",
            f"CHECK {label} plain: GPT with ring attention"]


@pytest.mark.slow
def test_two_ranks_ring_equals_full_attention():
    result = torchrun(CHECK, nproc=2, timeout=120)
    assert result.returncode == 0, result.output[-4000:]
    for line in ring_verdicts("C=2 cp"):
        assert line in result.output, result.output[-4000:]


@pytest.mark.slow
def test_four_ranks_and_two_rings_of_two():
    result = torchrun(CHECK, nproc=4, timeout=180)
    assert result.returncode == 0, result.output[-4000:]
    for line in ring_verdicts("C=4 cp") + [
            "CHECK C=2 cp2: ring attention == full causal attention (out, dq, dk, dv)",
            "CHECK C=2 cp2 zigzag: GPT with ring attention"]:
        assert line in result.output, result.output[-4000:]
