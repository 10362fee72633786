"""
serving/ragged.py -- the data structures of spec_decode.py: a KV cache whose rows have their
own lengths (RaggedCache: in a batch, rows accept different numbers of drafts), the masks
that go with it (attend_mask: any visibility; causal_rows: causal, as one comparison), a
causal forward that takes plain decoding's path when the rows agree (causal_pass), ragged
token rows in (feed), and a step's draft tree in buffers refilled every step (Tree).
spec_decode.py drafts and verifies with them; they need only the model.
"""
from dataclasses import dataclass, field

import torch

from model import KVCache

# -- A KV cache with a length per row, and the attention mask that goes with it ----------

class RaggedCache(KVCache):
    """model.KVCache whose rows have their own lengths `lens`: row b writes at lens[b]..;
    later slots are stale, masked, overwritten later: a rollback is `lens[b] = n`."""

    def __init__(self, cfg, batch_size, max_len, device="cpu", dtype=torch.float32):
        super().__init__(cfg, batch_size, max_len, device, dtype)
        # KVCache.length: where GPT.forward starts its default positions and causal mask,
        # set by causal_pass when the rows agree; a forward given both ignores it
        self.lens = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.slots = None         # (where this forward writes, its key count): update

    def update(self, layer, k, v):
        B, H, T, _ = k.shape
        if layer == 0:            # every layer writes the same slots: worked out once
            lens = self.lens.tolist()     # one copy to Python: cheaper than .max(), int()
            # Rows at one length (B = 1): a slice write, as KVCache's. Ragged: (B, 1, T, 1)
            # slot indices, row b's at lens[b].., a scatter (past max_len it raises: the
            # caches have slack). Keys: up to max(lens) + T for all, a shorter row's stale
            # ones hidden by the mask, built from the same base (so its width S is this).
            write = lens[0] if min(lens) == max(lens) else (
                self.lens[:, None] + torch.arange(T, device=k.device))[:, None, :, None]
            self.slots = (write, max(lens) + T)
        write, end = self.slots
        if isinstance(write, int):
            self.k[layer, :, :, write:write + T] = k
            self.v[layer, :, :, write:write + T] = v
        else:     # widths from each tensor: MLA's "keys" (latents) and "values" (rope keys)
            self.k[layer].scatter_(2, write.expand(B, H, T, k.shape[-1]), k)
            self.v[layer].scatter_(2, write.expand(B, H, T, v.shape[-1]), v)
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, n):
        # GPT.forward's call after all layers: every row moves by T, pads included; the
        # callers that pad (feed, the feature drafters) set lens to the real lengths after
        self.lens += n

    def keep(self, b, base, nodes):
        """Row b: kept tree nodes (slots base + nodes) move to base, base+1, ... where plain
        decoding puts them (RoPE positions were already base + depth); the rest is dropped."""
        if nodes != list(range(len(nodes))):       # a chain is already in place
            src = base + torch.tensor(nodes, device=self.lens.device)
            dst = base + torch.arange(len(nodes), device=self.lens.device)
            # index_select copies the sources out first, so a kept node moving onto the slot
            # of another kept node is safe; cost: len(nodes) slots × layers × heads × width
            for buf in (self.k, self.v):
                buf[:, b].index_copy_(2, dst, buf[:, b].index_select(2, src))
        self.lens[b] = base + len(nodes)


def attend_mask(base, vis):
    """(B, 1, Nq, S) mask: row b's prefix (slots < base[b]) is seen by all; new entry j sits at
    slot base[b] + j, seen by query i iff vis[b, i, j] (causal, tree ancestors, block)."""
    B, Nq, Nk = vis.shape
    # rel = slot − base[b]: < 0 the row's prefix, 0..Nk-1 its new entries, ≥ Nk stale slots
    # (rows with base[b] < max(base) have some); S = max(base) + Nk, RaggedCache.update's end
    rel = torch.arange(max(base.tolist()) + Nk, device=base.device)[None, :] - base[:, None]
    # vis looked up at each slot's entry index, clamped for gather; out-of-range slots are
    # overruled next: the prefix always seen, stale slots never
    seen = vis.gather(2, rel.clamp(0, Nk - 1)[:, None, :].expand(B, Nq, -1))
    # the [:, None] head axis broadcasts over heads; True = may attend, the convention of
    # model.py's attention functions (masked_fill(~mask) and SDPA's boolean attn_mask)
    return ((seen & ((rel >= 0) & (rel < Nk))[:, None]) | (rel < 0)[:, None])[:, None]


def pad_rows(rows, device):
    """Ragged lists of token ids -> right-padded (B, N) tensor, lengths (B,). Pads sit after
    each row's tokens, so causal queries (causal_rows) never see them."""
    N = max(map(len, rows))
    # pad id 0: its K/V land past the row's real length (feed sets lens = base + n), stale
    # slots that the next write overwrites. One tensor, tokens then length: each
    # torch.tensor() of a Python list costs as much as a few tensor ops.
    both = torch.tensor([r + [0] * (N - len(r)) + [len(r)] for r in rows], device=device)
    return both[:, :N], both[:, N]


def causal_rows(base, N):
    """N new entries per row at slots base[b].. -> their positions (B, N) and attend-mask
    (B, 1, N, S), S = max(base) + N (RaggedCache.update's end): entry i of row b sees the
    slots up to its own, base[b] + i -- the row's prefix, the entries before it, itself --
    and no stale slot past them. attend_mask(base, causal vis), as one comparison."""
    pos = base[:, None] + torch.arange(N, device=base.device)
    slots = torch.arange(max(base.tolist()) + N, device=base.device)
    return pos, (slots <= pos[:, :, None])[:, None]


def one_row(pos):
    """(B, T) positions -> (T,) when B = 1. GPT.forward takes either, but a (T,) RoPE table
    broadcasts over batch and heads as it is, where apply_rope reshapes a (B, T) one in
    every layer: 4 tiny ops a layer, a few % of a draft model's step on this CPU."""
    return pos[0] if pos.shape[0] == 1 else pos


def rows_at(x, idx):
    """x: (B, S, d), idx: (B, N) -> (B, N, d) with x[b, idx[b, i]] (clamped into range)."""
    return x.gather(1, idx.clamp(0, x.shape[1] - 1)[..., None].expand(-1, -1, x.shape[-1]))


def causal_pass(model, cache, toks, **kw):
    """A GPT's forward over toks (B, T), each row's next T entries, causal (a chain, or
    right-padded rows), into its RaggedCache. Rows at one length are a plain KVCache: with
    .length set, GPT.forward builds its own positions and causal mask, plain decoding's
    path, nothing built here. Ragged rows: causal_rows', the positions clamped (a short
    row's pads or a finished row's drafts may pass the context, where GPT.forward raises;
    real tokens never do: check_request)."""
    lens = cache.lens.tolist()
    if min(lens) == max(lens):
        cache.length = lens[0]
        return model(toks, cache=cache, **kw)
    pos, mask = causal_rows(cache.lens, toks.shape[1])
    pos = pos.clamp(max=model.config.block_size - 1)
    return model(toks, positions=one_row(pos), mask=mask, cache=cache, **kw)


def feed(model, cache, rows):
    """Append ragged token rows to a GPT's RaggedCache (prefill, or catching a drafter up)."""
    (toks, n), base = pad_rows(rows, cache.lens.device), cache.lens.clone()
    logits, _, h = causal_pass(model, cache, toks, return_hidden=True)
    cache.lens = base + n         # undo advance()'s count of the pads
    # h: the final norm's output, the LM head's input -- "the feature" of every drafter here
    return logits, h, n


# -- Draft trees: node 0 = the root (last committed token, unseen by the target), then ---
# breadth-first, `width` nodes per depth (a chain: width 1).

@dataclass
class Tree:
    """A step's drafts, in buffers for all N = 1 + γ·width nodes made once per call and
    refilled each step (begin), a level at a time (add): ids and depths are fixed by (γ,
    width), and so are a chain's parents, so no step and no level rebuilds them (each tiny
    tensor op costs ~1% of a draft model step on this CPU)."""
    tokens: torch.Tensor          # (B, N) token ids (nodes past n: not drafted yet)
    parents: torch.Tensor         # (B, N) parent node, -1 for the root
    vis: torch.Tensor             # (B, N, N) vis[b, i, j]: j is i or an ancestor of i
    score: torch.Tensor           # (B, N) drafter log q of the path to the node (T = 0)
    depth: list                   # (N,) depth of each node, the same in every row
    width: int                    # nodes per level; 1 = a chain: vis, score None (causal)
    n: int = 1                    # nodes filled in so far (the root)
    q: dict = field(default_factory=dict)  # node -> q it was SAMPLED from (else one-hot)

    @classmethod
    def empty(cls, B, depth, width, device):
        N, depths = 1 + depth * width, [0] + [d for d in range(1, depth + 1) for _ in range(width)]
        tokens = torch.zeros(B, N, dtype=torch.long, device=device)
        if width == 1:                          # a chain: node i's parent is i − 1
            return cls(tokens, torch.arange(-1, N - 1, device=device).expand(B, N), None, None,
                       depths, width)
        # a tree: add writes each level's parents and vis rows (the root's stay: -1, itself)
        return cls(tokens, torch.full((B, N), -1, device=device), torch.eye(
            N, dtype=torch.bool, device=device).repeat(B, 1, 1), torch.zeros(B, N, device=device),
            depths, width)

    def begin(self, roots):
        """A new step from these roots (B,): every level below is drafted again (add)."""
        self.tokens[:, 0], self.n, self.q = roots, 1, {}
        return self

    def add(self, tok, par, score):
        """Fill the next level: tok (B, w) ids; a tree's par (B, w, or one int for all) are
        their parents' node ids, score (T = 0) their path log q. A chain needs only tok."""
        n, w = self.n, tok.shape[1]
        self.tokens[:, n:n + w], self.n = tok, n + w
        if self.width > 1:
            par = torch.full_like(tok, par) if isinstance(par, int) else par
            self.parents[:, n:n + w] = par
            # a new node's row of vis = its parent's (the parent's ancestors and the parent;
            # rows < n are this step's) plus itself; siblings never see each other
            rows = self.vis[:, n:n + w]
            rows.copy_(self.vis.gather(1, par[:, :, None].expand(-1, -1, self.vis.shape[2])))
            rows.diagonal(offset=n, dim1=1, dim2=2).fill_(True)
            if score is not None:
                self.score[:, n:n + w] = score
