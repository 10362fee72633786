"""
parallelism/ring_attention.py -- context parallelism: ring attention with zigzag sharding.

The sequence itself is split over the C ranks of the cp group: every rank holds T/C
tokens of every sequence, everywhere in the model. Norms, MLPs, projections and the
loss are per token, so they need no communication at all (their weight gradients are
partial sums over the cp ranks, summed like data parallelism). Only attention mixes
tokens, and it is computed block by block (Liu et al. 2023, "Ring Attention with
Blockwise Transformers"): at step i rank r holds the K/V block of rank (r−i) mod C,
attends its own queries to it, and passes the block on to rank r+1 while it computes.
The partial results are merged with the online-softmax rule (Milakov & Gimelshein 2018;
FlashAttention, Dao et al. 2022), so the answer equals full causal attention exactly.

  saves: activations ∝ T/C per rank (the long-context wall: Llama 3 trained 128K-token
         sequences with cp 16: Llama 3 paper, Table 4); the T×T score matrix never exists, only a
         (T/C)×(T/C) block at a time, and none is kept for backward (recomputed from
         q, k, v, out and the log-sum-exp, as FlashAttention does).
  adds:  forward, per layer, each rank sends C−1 K/V blocks = (C−1)/C of the full K and V
         (2·B·H_kv·(T/C)·D elements per block: only the H_kv key/value heads travel, not
         the GQA copies). Backward sends the K/V blocks again (C−1) plus the dK/dV
         accumulators (C blocks, fp32), ≈ 2–3× the forward volume. The transfer of the
         next block is posted before the current one is computed, so it hides behind
         compute when a block's FLOPs (∝ (T/C)²·H·D) outlast its bytes
         (∝ (T/C)·H_kv·D): long sequences overlap well, short ones do not.
  zigzag: the causal mask makes plain chunks unfair: rank r sees r+1 non-empty blocks,
         so rank C−1 computes C blocks while rank 0 computes one, and the ring moves at
         the pace of the slowest rank (≈ 2C/(C+1)× the balanced time). Cut the sequence
         into 2C chunks and give rank r chunks r and 2C−1−r (Brandon et al. 2023
         "Striped Attention" make the same point; this zigzag layout is the one of
         zhuzilin/ring-flash-attention): every rank gets one early and one late chunk,
         computes its diagonal block and C−1 half blocks, and the work is equal.

A part of parallel.py (attention computed across ranks, the one layer that mixes tokens);
parallel.py --cp puts make_ring_attn_fn into every layer's attn_fn.
"""
import math

import torch
import torch.distributed as dist

from model import repeat_kv
from core.errors import UserError
from core.meters import comm


def cp_chunk_ids(cp_rank, cp_size, zigzag):
    """Which chunks of the sequence rank cp_rank holds, in local order. plain: chunk r of
    C; zigzag: chunks r and 2C−1−r of 2C (at C = 1 both are the whole sequence)."""
    if not 0 <= cp_rank < cp_size:
        raise UserError(f"cp rank {cp_rank} is not in 0..{cp_size - 1}")
    if zigzag and cp_size > 1:
        return [cp_rank, 2 * cp_size - 1 - cp_rank]
    return [cp_rank]


def _chunk_len(seq_len, cp_size, zigzag):
    n_chunks = 2 * cp_size if zigzag and cp_size > 1 else cp_size
    if seq_len % n_chunks:
        raise UserError(f"sequence length {seq_len} does not split into {n_chunks} equal "
                        f"chunks: context parallelism over {cp_size} ranks "
                        f"{'(zigzag: 2 chunks per rank) ' if n_chunks > cp_size else ''}"
                        f"needs a multiple of {n_chunks}")
    return seq_len // n_chunks


def cp_positions(seq_len, cp_rank, cp_size, zigzag, device=None):
    """Global positions of this rank's tokens, in local order: what RoPE and the causal
    mask need. Ascending in both layouts (r < 2C−1−r), which ring_attention relies on."""
    n = _chunk_len(seq_len, cp_size, zigzag)
    return torch.cat([torch.arange(c * n, (c + 1) * n, device=device)
                      for c in cp_chunk_ids(cp_rank, cp_size, zigzag)])


def cp_shard(x, dim, cp_rank, cp_size, zigzag):
    """This rank's tokens of x along dim (the sequence dimension)."""
    n = _chunk_len(x.shape[dim], cp_size, zigzag)
    return torch.cat([x.narrow(dim, c * n, n)
                      for c in cp_chunk_ids(cp_rank, cp_size, zigzag)], dim)


def cp_unshard(local_pieces, dim, cp_size, zigzag):
    """Inverse of cp_shard: the full tensor from every rank's piece (in rank order)."""
    if len(local_pieces) != cp_size:
        raise UserError(f"cp_unshard needs one piece per rank: {cp_size}, got "
                        f"{len(local_pieces)}")
    per_rank = len(cp_chunk_ids(0, cp_size, zigzag))
    chunks = [None] * (per_rank * cp_size)
    for rank, piece in enumerate(local_pieces):
        parts = piece.split(piece.shape[dim] // per_rank, dim)
        for c, part in zip(cp_chunk_ids(rank, cp_size, zigzag), parts):
            chunks[c] = part
    return torch.cat(chunks, dim)


def ring_work_counter():
    """A counter of the work this rank's ring-attention forwards did (the backward skips
    the same blocks): K/V blocks computed or skipped whole, and query-key pairs scored (per
    batch row and head). Pass one as `work=` to ring_attention / make_ring_attn_fn; the
    tests read it to show that zigzag balances the ranks and plain does not."""
    return {"blocks_computed": 0, "blocks_skipped": 0, "pairs_scored": 0}


def _visible_rectangle(q_pos, k_pos):
    """The part of a (queries × keys) block the causal mask leaves visible -> (row0, col1,
    needs_mask), or None for a block wholly in the future. Positions ascend, so the
    queries that see any key are a suffix [row0:] and the keys seen by any query a prefix
    [:col1]: under zigzag an off-diagonal block trims to exactly half, and only the
    diagonal block needs a mask (elsewhere every query comes after every key)."""
    row0 = int(torch.searchsorted(q_pos, k_pos[:1]))
    col1 = int(torch.searchsorted(k_pos, q_pos[-1:], right=True))
    if row0 == len(q_pos) or col1 == 0:
        return None
    return row0, col1, bool(q_pos[row0] < k_pos[col1 - 1])


def _ring_exchange(tensor, group, tag):
    """Post: send `tensor` to the next rank of the ring, receive the previous rank's into a
    new buffer. Peers are global ranks (the cp group may be any slice of the mesh). The
    tag keeps K/V and dK/dV apart on gloo (NCCL orders them by call). Returns (buffer,
    requests): wait on the requests before reading the buffer or reusing `tensor`."""
    ranks = dist.get_process_group_ranks(dist.group.WORLD if group is None else group)
    me = dist.get_rank(group)
    recv = torch.empty_like(tensor)          # gloo P2P needs contiguous tensors: both are
    ops = [dist.P2POp(dist.isend, tensor, ranks[(me + 1) % len(ranks)], group, tag),
           dist.P2POp(dist.irecv, recv, ranks[(me - 1) % len(ranks)], group, tag)]
    return recv, comm.batch_isend_irecv(ops)


def _wait(requests):
    for request in requests:
        request.wait()


def _ring_block_forward(q, k, v, mask, scale):
    """Attention of q to one K/V block, normalised within the block: (out_b, lse_b), with
    lse_b = log Σ_j exp(s_ij) the row's log-sum-exp. fp32; k, v already have q's heads."""
    scores = (q @ k.transpose(-2, -1)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # a row with no visible key has lse = −inf: give it weight 0, not exp(−inf + inf) = NaN
    probs = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])
    return probs @ v, lse


def _merge_partial_attention(out_a, lse_a, out_b, lse_b):
    """Online softmax: two partial attentions over disjoint key sets -> the attention over
    their union. lse = log(e^lse_a + e^lse_b) (logaddexp is the max form: stable);
    out = e^(lse_a − lse)·out_a + e^(lse_b − lse)·out_b. A row with no keys on one side
    (lse −inf) takes the other side unchanged; each query sees itself in its own block, so
    after the first block no row is −inf on both sides."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = (torch.exp(lse_a - lse)[..., None] * out_a
           + torch.exp(lse_b - lse)[..., None] * out_b)
    return out, lse


def _ring_block_backward(q, k, v, dout, lse, delta, mask, scale):
    """FlashAttention backward for one block (Dao et al. 2022, Alg. 4), from the FINAL lse
    of each query (so P = exp(S − lse) is the true softmax restricted to this block):
    dV = Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP − D) with D = rowsum(dO ∘ O),
    dQ = dS K · scale, dK = dSᵀ Q · scale. fp32; k, v have q's heads."""
    scores = (q @ k.transpose(-2, -1)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.exp(scores - lse[..., None])
    dv = probs.transpose(-2, -1) @ dout
    dscores = probs * (dout @ v.transpose(-2, -1) - delta[..., None])
    return dscores @ k * scale, dscores.transpose(-2, -1) @ q * scale, dv


def _cp_rank_and_size(group):
    if not dist.is_initialized():              # one process, no group: a ring of one
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _ring_positions(T_local, C, zigzag, device):
    """Every rank's positions, (C, T_local): on the CPU for the trimming (no device sync)
    and on the device for the masks."""
    positions = torch.stack([cp_positions(T_local * C, j, C, zigzag) for j in range(C)])
    return positions, positions.to(device)


def _ring_block(kv, positions, on_device, rank, owner, n_rep):
    """What this rank's queries see of the K/V block of `owner`: (row0, col1, K, V, mask)
    with K, V the visible keys in fp32 and repeated to the query heads, the mask None
    when all of them are visible; None when the whole block is in the future."""
    rect = _visible_rectangle(positions[rank], positions[owner])
    if rect is None:
        return None
    row0, col1, needs_mask = rect
    mask = (on_device[rank, row0:, None] >= on_device[owner, None, :col1]
            if needs_mask else None)
    return (row0, col1, repeat_kv(kv[0, :, :, :col1].float(), n_rep),
            repeat_kv(kv[1, :, :, :col1].float(), n_rep), mask)


class RingAttention(torch.autograd.Function):
    """Causal attention over the whole sequence, the sequence split over the cp group.
    Saved for backward: q, k, v, out (local tokens only) and the fp32 lse per query."""

    @staticmethod
    def forward(ctx, q, k, v, group, zigzag, work):
        rank, C = _cp_rank_and_size(group)
        B, H, T_local, D = q.shape
        n_rep, scale = H // k.shape[1], 1.0 / math.sqrt(D)
        positions, on_device = _ring_positions(T_local, C, zigzag, q.device)
        q32 = q.float()
        out = torch.zeros_like(q32)
        lse = torch.full((B, H, T_local), float("-inf"), device=q.device)
        kv = torch.stack([k, v])                 # one message per step, in the input dtype
        for step in range(C):
            owner = (rank - step) % C            # step 0: our own block, the diagonal
            if step < C - 1:                     # post the next block's transfer first
                next_kv, requests = _ring_exchange(kv, group, tag=0)
            block = _ring_block(kv, positions, on_device, rank, owner, n_rep)
            if block is None:
                if work is not None:
                    work["blocks_skipped"] += 1
            else:
                row0, col1, k_blk, v_blk, mask = block
                out_b, lse_b = _ring_block_forward(q32[:, :, row0:], k_blk, v_blk, mask, scale)
                out[:, :, row0:], lse[:, :, row0:] = _merge_partial_attention(
                    out[:, :, row0:], lse[:, :, row0:], out_b, lse_b)
                if work is not None:
                    work["blocks_computed"] += 1
                    work["pairs_scored"] += (T_local - row0) * col1
            if step < C - 1:
                _wait(requests)
                kv = next_kv
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.zigzag = group, zigzag
        return out

    @staticmethod
    def backward(ctx, dout):
        # K/V go round the ring again, and the dK/dV accumulator of each block travels
        # with it, one step behind (ring-flash-attention's scheme): the rank holding block
        # j adds its contribution and passes the accumulator on; after C steps (C sends)
        # it is back home on rank j, complete. dQ stays local. Sent per rank: C−1 K/V
        # blocks (input dtype) + C dK/dV blocks (fp32, the accumulation precision).
        q, k, v, out, lse = ctx.saved_tensors
        rank, C = _cp_rank_and_size(ctx.group)
        B, H, T_local, D = q.shape
        n_kv = k.shape[1]
        n_rep, scale = H // n_kv, 1.0 / math.sqrt(D)
        positions, on_device = _ring_positions(T_local, C, ctx.zigzag, q.device)
        q32, dout32 = q.float(), dout.float()
        delta = (dout32 * out.float()).sum(-1)          # D_i = rowsum(dO ∘ O)
        dq = torch.zeros_like(q32)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # our own block's
        dkv_requests = next_dkv = None
        for step in range(C):
            owner = (rank - step) % C
            if step < C - 1:
                next_kv, kv_requests = _ring_exchange(kv, ctx.group, tag=0)
            block = _ring_block(kv, positions, on_device, rank, owner, n_rep)
            if block is not None:
                row0, col1, k_blk, v_blk, mask = block
                dq_b, dk_b, dv_b = _ring_block_backward(
                    q32[:, :, row0:], k_blk, v_blk, dout32[:, :, row0:], lse[:, :, row0:],
                    delta[:, :, row0:], mask, scale)
                dq[:, :, row0:] += dq_b
            if step > 0:        # the accumulator of this block, from the rank that held it
                _wait(dkv_requests)
                dkv = next_dkv
            if block is not None:    # GQA: a KV head's gradient sums over its n_rep
                dkv_b = torch.stack([dk_b, dv_b])        # query heads (repeat_kv order)
                dkv[:, :, :, :col1] += dkv_b.view(2, B, n_kv, n_rep, col1, D).sum(3)
            if C > 1:
                next_dkv, dkv_requests = _ring_exchange(dkv, ctx.group, tag=1)
            if step < C - 1:
                _wait(kv_requests)
                kv = next_kv
        if C > 1:               # the last hop brings our own block's dK/dV home
            _wait(dkv_requests)
            dkv = next_dkv
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q, k, v, group, zigzag, work=None):
    """Causal attention of this rank's queries over the whole sequence (equal to full
    softmax attention), the tokens laid out by cp_shard(..., zigzag) over `group`.
    q: (B, H, T_local, D); k, v: (B, H_kv, T_local, D), RoPE already applied at the
    tokens' global positions. The layout (zigzag or plain) is what every rank needs to know
    the positions of the block it receives, so it is passed instead of positions.
    group None: the default group (or, without torch.distributed, a ring of one).
    work: a ring_work_counter() to add this call's blocks and pairs to, or None."""
    if (q.dim() != 4 or k.shape != v.shape or k.dim() != 4
            or (q.shape[0], *q.shape[2:]) != (k.shape[0], *k.shape[2:])):
        raise UserError(f"ring attention wants q (B, H, T, D) and k, v (B, H_kv, T, D); got "
                        f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise UserError(f"{q.shape[1]} query heads do not share {k.shape[1]} KV heads evenly")
    return RingAttention.apply(q, k, v, group, zigzag, work)


def make_ring_attn_fn(group, positions, work=None):
    """An Attention.attn_fn (q, k, v, mask) -> out that runs ring attention over `group`:
    block.attention.attn_fn = make_ring_attn_fn(cp_group, positions). positions: this
    rank's cp_positions(seq_len, cp_rank, C, zigzag); only the layout is read from them
    (once, here), so the function serves any number of calls, layers and microbatches.
    work: a ring_work_counter() that every call adds to, or None."""
    rank, C = _cp_rank_and_size(group)
    seq_len, given = positions.numel() * C, positions.tolist()
    layouts = [z for z in (True, False) if seq_len % (2 * C if z and C > 1 else C) == 0
               and cp_positions(seq_len, rank, C, z).tolist() == given]
    if not layouts:
        raise UserError("make_ring_attn_fn: positions must be this rank's cp_positions"
                        "(seq_len, cp_rank, cp_size, zigzag)")
    zigzag = layouts[0]

    def ring_attn_fn(q, k, v, mask=None):
        if mask is not None:
            raise UserError("ring attention builds the causal mask from global positions: "
                            "an explicit mask (KV-cache decoding, tree attention) is not "
                            "supported under context parallelism")
        return ring_attention(q, k, v, group, zigzag, work)
    return ring_attn_fn


def ring_traffic_formula(b, n_kv_head, s, head_dim, C):
    """Sends of one ring-attention layer, forward + backward, per rank: (calls, bytes).
    Forward C−1 K/V blocks; backward the K/V blocks again (C−1) and the dK/dV
    accumulators (C hops, home included). One K/V block = 2·b·h_kv·s·d numbers (fp32)."""
    block = 2 * b * n_kv_head * s * head_dim * 4
    calls = (C - 1) + (C - 1) + C
    return calls, calls * block


if __name__ == "__main__":
    print(__doc__.strip())
    print("\nring_attention.py is a library: context parallelism runs as `torchrun "
          "--standalone --nproc_per_node=2 parallel.py --cp 2 --check` (see parallel.py --help).")
