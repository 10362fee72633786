"""
spec_decode.py -- speculative decoding: several tokens per forward pass of the big model,
with exactly the big model's output distribution. Six drafters, one verifier, measured.

Run:  python spec_decode.py --method medusa --gamma 4 --temperature 0 | python spec_decode.py bench

Decoding one token reads every weight for ~2Ψ FLOPs: memory- (GPU) or overhead- (this CPU)
bound, so a pass over γ+1 tokens costs little more (here 13 tokens ≈ 1.35× one). A cheap
drafter proposes γ tokens, the target scores them in ONE pass, and a rejection rule keeps
its distribution exactly (Leviathan et al. 2023; Chen et al. 2023): accept draft x w.p.
min(1, p(x)/q(x)); at the first rejection draw from norm(max(0, p − q)); if all γ pass, a
bonus token from p. Acceptance α gives (1 − α^(γ+1))/(1 − α) tokens per target call, speedup
that / (γc + 1), c = draft/target cost. Each drafter adds (+) and costs (−):
  draft   small GPT (--preset draft), γ passes: + weights, KV cache; − large c on a CPU
  tree    1 + γ·width nodes in one tree-masked pass (SpecInfer; EAGLE-2): − dead branches
  medusa  heads on the target's top feature (Cai et al. 2024): no pass to draft; − blind
          to the drafts before them
  mtp     DeepSeek-V3's module (Sec. 2.2), chained: + one block and its KV cache
  eagle   a block regressing the target's feature (Li et al. 2024): − γ small passes
  dflash  a block drafter (z-lab 2025): one pass for all γ; − masks blind to each other
All are verified by the same exact rule (Medusa's "typical acceptance" is not exact).
Batch > 1: rows accept different numbers of tokens, so KV caches keep a length per row
(RaggedCache), which gpt-fast and most small implementations skip. Drafters learn from the
target's own outputs, cached in out/. Not covered: top-k/p, EAGLE-3's training-time test.
"""
import argparse
import hashlib
import os
import sys
import time
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from core import data
from core.checkpoint import load_model
from core.files import load_checkpoint
from model import Block, RMSNorm
from core.cli import command_line, fmt_bytes, fmt_duration, knob, require_at_least_one
from core.errors import UserError
from core.recipe import warmup_cosine
from core.runtime import print0, Progress, run_cli, TimingConditions
from serving.ragged import (attend_mask, causal_pass, causal_rows, feed, one_row, pad_rows,
                            RaggedCache, rows_at, Tree)

METHODS = ("draft", "tree", "medusa", "mtp", "eagle", "dflash")
DEFAULT_WIDTH = {"tree": 3, "medusa": 3}           # others draft a chain (width 1)
TRAIN = dict(pool=384, seq=96, batch=8, lr=3e-3)    # drafter training: self-distilled rows
# (pool rows of seq tokens, batch rows a step, AdamW's peak lr). TRAIN is part of the drafter
# cache's key (build_drafters): change a value and the cached drafters are retrained.


# -- Draft trees (serving/ragged.py's Tree): node 0 = the root (last committed token, unseen
# by the target), then breadth-first, `width` nodes per depth (a chain: width 1).

def grow_tree(drafter, roots, depth, width, temperature, gen, tree=None):
    """`depth` levels of `width` nodes. T = 0: the `width` best paths by summed log q
    (EAGLE-2's dynamic tree). T > 0: `width` i.i.d. samples from q of the first node of the
    level above, which alone grows further (SpecInfer: exact for i.i.d. siblings).
    tree: last step's, its buffers refilled (None: new ones)."""
    # node 0: the root, no parent, sees itself, path score 0, depth 0; the drafter's start
    # gives its children's logits, (B, 1, V). [lo, hi): the level whose children come next.
    # Drafter passes: start + depth - 1 extends (the last level is drawn, never fed).
    if tree is None:
        tree = Tree.empty(roots.shape[0], depth, width, roots.device)
    tree.begin(roots)
    logits, lo = drafter.start(tree), 0
    for d in range(1, depth + 1):
        hi = tree.n
        if d > 1:                                  # (B, hi - lo, V): children of lo..hi-1
            logits = drafter.extend(tree, lo, hi)
        if temperature > 0:
            # q at T: the draft distribution verify divides by, kept per node in tree.q.
            # With replacement: i.i.d. siblings (duplicates allowed), the case SpecInfer's
            # multi-round rule is exact for; only node lo (logits[:, 0]) grows further.
            q = (logits[:, 0].float() / temperature).softmax(-1)
            tok, par, score = torch.multinomial(q, width, replacement=True, generator=gen), lo, None
            tree.q.update({hi + j: q for j in range(width)})
        elif width == 1:
            # a chain at T = 0: the drafter's argmax; one node per level, so ranking paths by
            # summed log q (below) would pick the same token at the cost of a log-softmax
            tok, par, score = logits[:, 0].argmax(-1, keepdim=True), lo, None
        else:
            # EAGLE-2: rank every (node of the level, token) pair by the drafter's log q of
            # the whole path, so one confident branch may take all `width` children;
            # idx // V and idx % V unflatten a pair into (parent, token)
            cand = logits.float().log_softmax(-1) + tree.score[:, lo:hi, None]
            score, idx = cand.flatten(1).topk(width)
            par, tok = lo + idx // logits.shape[-1], idx % logits.shape[-1]
        tree.add(tok, par, score)
        lo = hi
    return tree


# -- Verification: the exact rule, one row at a time (numpy: tiny ops, no dispatch) -------

def residual(p, q, x):
    """After rejecting x: norm(max(0, p − q)); q None = one-hot at x: p without x, renormed."""
    # (q None: a deterministic draft, max(0, p − δ_x) is p with p[x] set to 0.) Drop the
    # normalisation, or resample from p, and tests/test_spec_decode.py's chi-square test of
    # the output distribution fails: it runs both broken variants to prove it.
    r = np.maximum(p - q, 0.0) if q is not None else np.where(np.arange(len(p)) == x, 0.0, p)
    total = r.sum()
    return r / total if total > 0 else p       # 0 only if p = q, when x was surely accepted


def draw(p, u):
    """Inverse-CDF sample from a normalised p with a uniform u."""
    # the min: with u close to 1, a cumsum that rounds to 0.9999999 would index past the end
    return min(int(np.searchsorted(np.cumsum(p), u, side="right")), len(p) - 1)


def verify(P, tokens, parents, q, rand):
    """One row. P: (N, V) target distribution after each node (one-hot at T = 0: then only
    drafts equal to the argmax pass); q: node -> the draft distribution it was sampled from.
    From the root, try the current node's children in draft order: accept x w.p. min(1,
    p(x)/q(x)), else p ← residual and try the next sibling (SpecInfer's multi-round rule;
    one child: Leviathan's). -> (accepted path of nodes, next token, depth steps tried)."""
    kids = [[i for i in range(1, len(tokens)) if parents[i] == n] for n in range(len(tokens))]
    # tries counts depth steps, so α = accepted / tries is the per-position acceptance rate
    # that (1 − α^(γ+1))/(1 − α) assumes
    node, path, tries = 0, [], 0
    while kids[node]:
        tries, p = tries + 1, P[node]
        for c in kids[node]:
            x, qc = tokens[c], q.get(c)
            # rand() ∈ [0, 1) < p(x)/q(x) is "w.p. min(1, p/q)" without the min. At T = 0, P
            # is one-hot: p[x] is 1 for the target's argmax, 0 else -- greedy, exactly.
            if rand() < (p[x] if qc is None else p[x] / qc[x]):
                break
            # the next sibling is judged against what the target still owes after this
            # rejection, not against P[node] again
            p = residual(p, qc, x)
        else:                                   # every child rejected: draw from residual
            return path, draw(p, rand()), tries
        path, node = path + [c], c
    # P[node] = the target after the LAST accepted node; drawn from one position earlier
    # (the test's bad_bonus variant), the chi-square test fails
    return path, draw(P[node], rand()), tries   # reached a leaf: the bonus token, from p


@dataclass
class Stats:              # α = accepted / tries; τ = tokens per target call, per row
    rounds: int = 0       # target forward passes (one per step, whatever the batch)
    row_rounds: int = 0   # (row, step) verifications
    tries: int = 0        # depth steps tested (a node whose children were tried)
    accepted: int = 0     # draft tokens accepted
    drafter_calls: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    alpha = property(lambda s: s.accepted / max(s.tries, 1))
    # each verification of a row commits its accepted drafts + 1 (corrected or bonus) token
    tau = property(lambda s: (s.accepted + s.row_rounds) / max(s.row_rounds, 1))


def check_request(target, prompts, max_new_tokens, gamma, width):
    """One clear error for inputs speculative decoding cannot serve."""
    if gamma < 1:
        raise UserError(f"gamma must be at least 1 (draft tokens per step), got {gamma}")
    if width < 1 or not prompts or min(map(len, prompts)) < 1:
        raise UserError("every prompt needs at least one token, and width at least 1")
    longest = max(map(len, prompts))
    # A row short of its goal has len ≤ prompt + max_new - 1, so its deepest node (position
    # len - 1 + γ) stays inside the context; a finished row's may not (the target clamps).
    if longest + max_new_tokens + gamma > target.config.block_size:
        raise UserError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) + "
                        f"gamma ({gamma}) exceeds the context "
                        f"(block_size={target.config.block_size})")


@torch.no_grad()
def speculative_generate(target, drafter, prompts, max_new_tokens, gamma=4, width=1,
                         temperature=0.0, seed=0, stats=None):
    """prompts: lists of token ids (lengths may differ). -> (new tokens per row, target
    RaggedCache). Between steps the target's cache holds every committed token but the last
    (the root of the next tree), and feats[b, j + 1] = its top feature at position j."""
    check_request(target, prompts, max_new_tokens, gamma, width)
    stats = Stats() if stats is None else stats
    dev = target.output.weight.device
    dtype = target.output.weight.dtype
    # room for the prompt, the answer and one step's tree (with slack for rolled-back rows)
    cap = max(map(len, prompts)) + max_new_tokens + 3 * (gamma + 1) + gamma * width + 8
    gen = torch.Generator(device=dev).manual_seed(seed)     # the drafters' sampling
    rand = np.random.default_rng(seed).random               # the acceptance tests
    # seqs: the committed tokens per row; the drafter keeps a reference to these very lists
    # (Drafter.reset), so what accept_rows appends is what the drafter catches up on
    seqs = [list(p) for p in prompts]
    goal = [len(p) + max_new_tokens for p in prompts]
    cache = RaggedCache(target.config, len(seqs), cap, dev, dtype)
    # feats[b, 0] = 0 stands for f_-1: the first entry of a feature drafter has no feature
    # before it (tests/test_spec_decode.py rebuilds EAGLE's cache the same way)
    feats = torch.zeros(len(seqs), cap + 1, target.config.n_embd, device=dev, dtype=dtype)
    # the last prompt token is the first tree's root: the target first sees it in the tree
    # pass, whose output at the root is the verdict on depth 1
    if max(map(len, seqs)) > 1:                 # prefill all but the last prompt token
        h = feed(target, cache, [s[:-1] for s in seqs])[1]
        feats[:, 1:h.shape[1] + 1] = h
    drafter.reset(target, seqs, feats, cap)
    tree = Tree.empty(len(seqs), gamma, width, dev)     # every step's, refilled (grow_tree)
    # one target pass per step for the whole batch, however many tokens each row accepts
    while any(len(s) < g for s, g in zip(seqs, goal)):
        t0 = time.perf_counter()
        roots = torch.tensor([s[-1] for s in seqs], device=dev)
        tree = grow_tree(drafter, roots, gamma, width, temperature, gen, tree)
        t1 = time.perf_counter()
        base = cache.lens.clone()
        # ALL 1 + γ·width nodes of every row in one pass: each sees its row's prefix and its
        # own ancestors, so it gets the logits of the plain forward over prefix + its path
        # (tests/test_spec_decode.py: test_tree_attention_equals_decoding_each_path). A
        # node's RoPE position is base + its depth -- the one plain decoding would give it,
        # so siblings share one; its slot is base + its node index. A chain: causal.
        if tree.width == 1:
            logits, _, h = causal_pass(target, cache, tree.tokens, return_hidden=True)
        else:     # finished rows may run past the context: positions clamped (and undone)
            pos = (base[:, None] + torch.tensor(tree.depth, device=dev)).clamp(
                max=target.config.block_size - 1)
            logits, _, h = target(tree.tokens, positions=one_row(pos), cache=cache,
                                  mask=attend_mask(base, tree.vis), return_hidden=True)
        accept_rows(TreePass(tree, logits, h, base), Rows(seqs, goal, cache, feats),
                    temperature, rand, drafter, stats)
        stats.rounds += 1
        stats.draft_s += t1 - t0
        stats.verify_s += time.perf_counter() - t1
    stats.drafter_calls += drafter.calls
    # a row's last step may commit past its goal (up to γ extra tokens): cut at the goal
    return [s[len(p):g] for s, p, g in zip(seqs, prompts, goal)], cache


@dataclass
class TreePass:
    """What one target pass over the step's trees produced (speculative_generate)."""
    tree: Tree
    logits: torch.Tensor      # (B, N, V): the target's logits at every node
    hidden: torch.Tensor      # (B, N, d): its top features there (the feature drafters')
    base: torch.Tensor        # (B,): each row's cache length before the pass (the root slot)


@dataclass
class Rows:
    """The batch's state between steps: the committed tokens of each row (the drafter holds
    these very lists), where each row stops, the target's cache and its feature cache."""
    seqs: list
    goal: list
    cache: RaggedCache
    feats: torch.Tensor       # feats[b, j + 1] = the target's top feature at position j


def accept_rows(step, rows, temperature, rand, drafter, stats):
    """Each row's verdict on its tree (verify: the exact acceptance rule), then the
    commit: the accepted path and the corrected or bonus token join the row, the cache
    keeps the path's K/V, the feature cache their hidden states."""
    tree, logits, h, base = step.tree, step.logits, step.hidden, step.base
    seqs, goal, cache, feats = rows.seqs, rows.goal, rows.cache, rows.feats
    if temperature == 0:                        # T = 0: the target's choice as a one-hot
        P = F.one_hot(logits.argmax(-1), logits.shape[-1]).double()
    else:                                       # fp64: p/q ratios and residuals, no fp32
        P = (logits.double() / temperature).softmax(-1)     # rounding in the probabilities
    # one device → host copy of (B, N, V) and of the sampled nodes' q; nodes without one
    # were picked by top-k (T = 0), and verify treats them as one-hot drafts
    P = P.cpu().numpy()
    Q = {n: q.double().cpu().numpy() for n, q in tree.q.items()}
    tokens = tree.tokens.tolist()
    parents = tree.parents.tolist()
    for b, start in enumerate(base.tolist()):
        # a finished row still rides in the batch (tensors stay rectangular): its slots of
        # this step are dropped, the drafter forgets its entries
        if len(seqs[b]) >= goal[b]:             # finished: undo this step for the row
            cache.lens[b] = start
            drafter.rollback(b)
            continue
        path, x, tries = verify(P[b], tokens[b], parents[b], {n: q[b] for n, q in Q.items()},
                                rand)
        # The root (written at slot start) and the accepted nodes move to start, start+1, ...;
        # the corrected or bonus token x is NOT cached: it is the next root. Their hidden
        # states are the features at positions start..start+len(path) (feats index + 1).
        cache.keep(b, start, [0] + path)
        feats[b, start + 1:start + 2 + len(path)] = h[b, [0] + path]
        seqs[b] += [tokens[b][n] for n in path] + [x]
        drafter.commit(b, path)
        stats.row_rounds += 1
        stats.tries += tries
        stats.accepted += len(path)


# -- Drafters: start(tree) catches up, -> the root's child logits (B, 1, V); -------------
# extend(tree, lo, hi) -> those of nodes lo..hi-1; commit(b, path) / rollback(b) after it.

class Drafter:
    """The protocol speculative_generate calls, by name: `reset` once per call, `start` and
    `extend` per step (grow_tree), then `commit` or `rollback` per row (accept_rows).
    `calls` counts the passes the drafter ran. Every drafter (ModelDrafter, MedusaHeads,
    FeatureDrafter, DFlashDrafter) implements all five; the base holds what they share."""

    def reset(self, target, seqs, feats, cap):
        """A new call: seqs are the rows' committed tokens (the caller appends to these very
        lists), feats the target's feature cache, cap the longest a row can get."""
        self.seqs, self.feats, self.calls = seqs, feats, 0

    def start(self, tree):
        """Catch up on the tokens committed since the last step; -> the logits (B, 1, V) of
        the children of each row's root (tree: this step's, its root filled in)."""
        raise NotImplementedError

    def extend(self, tree, lo, hi):
        """-> the children's logits (B, hi - lo, V) of tree nodes lo..hi-1."""
        raise NotImplementedError

    def commit(self, b, path):
        """Row b accepted these node ids: keep what the drafter cached for them."""
        raise NotImplementedError

    def rollback(self, b):
        """Row b is finished: forget this step's entries (root included)."""
        self.cache.lens[b] = self.base[b]

    def pending(self):
        """Each row's committed tokens, root included, that the drafter's cache lacks."""
        return [s[n:] for s, n in zip(self.seqs, self.cache.lens.tolist())]

    def open_round(self, tree):
        """After the catch-up: the root's slot base (node i goes to base + i), and for a
        chain (node i at depth i, causal) all its nodes' positions and mask at once: built
        once per step where a tree builds each level's (node_inputs)."""
        self.base = self.cache.lens - 1
        if tree.width == 1:
            self.pos, self.mask = causal_rows(self.base, tree.tokens.shape[1])

    def node_inputs(self, tree, lo, hi):
        """RoPE positions (B, hi − lo) of one level's nodes lo..hi-1 (root slot + depth, as
        the target's) and their attend-mask over the cache, max(base) + hi keys wide."""
        if tree.width == 1:
            S = self.mask.shape[-1] - tree.tokens.shape[1] + hi
            return self.pos[:, lo:hi], self.mask[:, :, lo:hi, :S]
        pos = (self.base + tree.depth[lo])[:, None].expand(-1, hi - lo)
        return pos, attend_mask(self.base, tree.vis[:, lo:hi, :hi])


class ModelDrafter(Drafter):
    """A small GPT with its own RaggedCache (draft, tree); tree passes as the target's."""

    def __init__(self, model):
        self.model = model

    def reset(self, target, seqs, feats, cap):
        super().reset(target, seqs, feats, cap)
        # the draft model's own K/V, in the same ragged layout as the target's
        w = self.model.output.weight
        self.cache = RaggedCache(self.model.config, len(seqs), cap, w.device, w.dtype)

    def start(self, tree):                     # pending: committed tokens not seen yet
        rows = self.pending()
        logits, _, n = feed(self.model, self.cache, rows)
        # base: the root's slot (the last token fed); fed = 1: of the tree, only node 0 is
        # in the cache so far. Each row's last real token's logits = the root's children
        # (rows of one length, as at B = 1: the last column, no gather).
        self.base, self.fed, self.calls = self.cache.lens - 1, 1, self.calls + 1
        if len({len(r) for r in rows}) == 1:
            return logits[:, -1:]
        return rows_at(logits, (n - 1)[:, None])

    def extend(self, tree, lo, hi):
        # levels are appended in node order, so node i sits at slot base + i and the mask's
        # new-entry columns are nodes 0..hi-1; positions: base + depth, as the target's
        if tree.width == 1:       # a chain: node lo goes to slot lens = base + lo, causal
            logits, _ = causal_pass(self.model, self.cache, tree.tokens[:, lo:hi])
        else:
            pos, mask = self.node_inputs(tree, lo, hi)
            logits, _ = self.model(tree.tokens[:, lo:hi], positions=one_row(pos), mask=mask,
                                   cache=self.cache)
        self.fed, self.calls = hi, self.calls + 1
        return logits

    def commit(self, b, path):                 # accepted drafts it has seen stay valid
        # The last level was drawn but never fed (fed = its first node id): an accepted leaf
        # there is fed at the next start, with x. A path rises in node order, so `n < fed`
        # keeps a prefix of it.
        self.cache.keep(b, int(self.base[b]), [0] + [n for n in path if n < self.fed])


class PerDepth(Drafter):
    """Depth-d distribution blind to the drafts before it (Medusa, DFlash): the tree is the
    best paths of a Cartesian product; nothing speculative is cached (no-op commit)."""

    def extend(self, tree, lo, hi):
        # no pass: every node of level d gets the same distribution for its children (depth
        # d + 1) whoever it is, so grow_tree's top-k at T = 0 picks best product paths
        d = tree.depth[lo]
        return self.depth_logits[:, d:d + 1].expand(-1, hi - lo, -1)

    def commit(self, b, path=None):
        pass                     # nothing speculative was cached: nothing to keep

    def rollback(self, b):
        pass                     # ... and nothing to forget


class MedusaHeads(nn.Module, PerDepth):
    """Head k = the target's LM head at h + SiLU(W_k h) (Medusa's ResBlock on the frozen top
    feature h) predicts the token k+1 ahead; W_k = 0 at init. Medusa's heads have LM heads
    of their own (model.ExtraHead); sharing one lets ONE matmul serve all heads, which
    matters here: a 4096×192 projection costs ~1/8 of a target step on this CPU."""

    def __init__(self, target, n_heads=4):
        super().__init__()
        d = target.config.n_embd
        self.proj = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(n_heads))
        # W_k = 0: every head starts as the target's own next-token head on h, a warm start
        # that training moves k tokens further ahead
        for w in self.proj:
            nn.init.zeros_(w.weight)
        self.shared = (target,)                # a tuple: not registered as our submodule

    def heads(self, h, k):                      # (…, d) -> (…, k, V): heads 1..k at once
        return self.shared[0].output(torch.stack([h + F.silu(w(h)) for w in self.proj[:k]], -2))

    def loss(self, target, x, y, h):
        K = len(self.proj)
        # head k at position t predicts token t+1+k = y[t + k]; positions t < T − K have
        # all K targets, so h[:, :-K]. One shared-head matmul over (B, T−K, K, d).
        want = torch.stack([y[:, k:y.shape[1] - K + k] for k in range(1, K + 1)], -1)
        return F.cross_entropy(self.heads(h[:, :-K], K).flatten(0, 2), want.flatten())

    def start(self, tree):
        depth = tree.depth[-1]
        if depth > len(self.proj):
            raise UserError(f"gamma={depth} needs {depth} Medusa heads, there are {len(self.proj)}")
        # feats[len(s) − 1] = f at position len(s) − 2, the newest feature the target has:
        # the root itself is still unseen. The target's own head on it gave the root's
        # distribution, head k gives depth k's: all γ depths in one call, before any draft.
        ends = torch.tensor([len(s) for s in self.seqs], device=self.feats.device)
        self.depth_logits = self.heads(rows_at(self.feats, ends[:, None] - 1)[:, 0], depth)
        self.calls += 1
        return self.depth_logits[:, :1]


class FeatureDrafter(nn.Module, Drafter):
    """MTP, EAGLE (and DFlash's body): block(s) on the frozen target, borrowing its embedding
    and output head, with their own KV cache. Entry k = (feature f_k-1, token t_k) at
    position k predicts t_k+1 (EAGLE: regresses f_k); drafting feeds its output back."""

    def __init__(self, target, kind="eagle", n_layer=1, n_in=2):
        super().__init__()
        # the target's block config, n_layer blocks of it, dense MLPs (no experts)
        self.kind, self.cfg = kind, replace(target.config, n_layer=n_layer, n_expert=0)
        d = self.cfg.n_embd                     # the target's width
        self.fc = nn.Linear(n_in * d, d, bias=False)     # [f; Emb(t)] → d; DFlash: f → d
        self.layers = nn.ModuleList(Block(self.cfg) for _ in range(n_layer))
        self.norm = RMSNorm(d, self.cfg.norm_eps)
        if kind == "mtp":
            self.norm_f, self.norm_e = RMSNorm(d), RMSNorm(d)
        self.shared = (target,)

    def body(self, x, pos, mask=None, cache=None):
        # clamped: pads and finished rows' drafts may pass the context (as in feed)
        cos, sin = self.shared[0].rope(one_row(pos.clamp(max=self.cfg.block_size - 1)))
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, cache, i)
        if cache is not None:                   # drafting (training passes no cache)
            # the layers do not advance a cache (GPT.forward does): all entries, pads too;
            # start and commit set the rows' real lengths afterwards
            cache.advance(x.shape[1])
            self.calls += 1
        return x

    def reset(self, target, seqs, feats, cap):
        super().reset(target, seqs, feats, cap)
        self.cache = RaggedCache(self.cfg, len(seqs), cap, feats.device, feats.dtype)

    def inputs(self, f, tok):
        e = self.shared[0].tok_embeddings(tok)
        if self.kind == "mtp":                  # DeepSeek-V3 eq. 21: normalise both halves
            f, e = self.norm_f(f), self.norm_e(e)
        return self.fc(torch.cat([f, e], -1))

    def logits(self, out):                      # EAGLE predicts the LM head's input itself
        return self.shared[0].output(out if self.kind == "eagle" else self.norm(out))

    def loss(self, target, x, y, h):
        # entries k = 1..T-1: (f_k-1, t_k) at position k, trained on t_k+1 = y[:, k] and,
        # for EAGLE, to regress f_k = h[:, k] -- drafting feeds its own f's back, so noise
        # in training stands in for the error it will see
        f = h[:, :-1]
        if self.kind == "eagle":                # EAGLE: U(-0.1, 0.1) noise on the features
            f = f + (torch.rand_like(f) - 0.5) * 0.2
        out = self.body(self.inputs(f, x[:, 1:]), torch.arange(1, x.shape[1], device=x.device))
        ce = F.cross_entropy(self.logits(out).flatten(0, 1), y[:, 1:].flatten())
        # EAGLE: smooth-L1 regression + 0.1 × classification, its paper's weighting
        return ce if self.kind == "mtp" else F.smooth_l1_loss(out, h[:, 1:]) + 0.1 * ce

    def start(self, tree):
        lens = self.cache.lens.clone()          # entries lens.. up to the root's
        toks, n = pad_rows(self.pending(), lens.device)
        # pending entries, the cache's end through the root, each with the TRUE feature
        pos, mask = causal_rows(lens, toks.shape[1])
        out = self.body(self.inputs(rows_at(self.feats, pos), toks), pos,  # feats[k] = f_k-1
                        mask, self.cache)
        self.cache.lens = lens + n
        self.open_round(tree)                   # base: the root's slot, as ModelDrafter's
        # node_out[:, i]: the drafter's output at tree node i -- for EAGLE its predicted
        # feature -- which node i's children take as their f; node 0 = the root
        self.node_out = rows_at(out, (n - 1)[:, None])
        return self.logits(self.node_out)

    def extend(self, tree, lo, hi):
        pos, mask = self.node_inputs(tree, lo, hi)
        # entry = (the parent's drafter output, the node's token): predicted features chain
        # down the tree; node_out grows in node order, so parent ids index it directly
        out = self.body(self.inputs(rows_at(self.node_out, tree.parents[:, lo:hi]),
                                    tree.tokens[:, lo:hi]), pos, mask, self.cache)
        self.node_out = torch.cat([self.node_out, out], 1)
        return self.logits(out)

    def commit(self, b, path):       # drafts were fed PREDICTED features: re-feed true ones
        self.cache.lens[b] = self.base[b] + 1


class DFlashDrafter(PerDepth, FeatureDrafter):
    """Context fc(f_j) at positions j (causal, cached); a block [Emb(last token), masks] sees
    it and itself bidirectionally, mask i predicts its own position's token. Unlike DFlash
    (5 layers, features in every layer's K/V): an embedding per mask offset, fc_a([f_last;
    Emb(last)]) added to the block (one layer's mask queries could not fetch them: α 0.15)."""

    def __init__(self, target, block=5, n_layer=1):
        super().__init__(target, "dflash", n_layer, n_in=1)
        self.block, d = block, self.cfg.n_embd
        # block − 1 learned mask embeddings, one per offset 1..G−1 after the root
        self.mask_emb = nn.Parameter(torch.zeros(block - 1, d))
        self.fc_a = nn.Linear(2 * d, d, bias=False)

    def blocks(self, ctx_f, ctx_pos, n_ctx, roots, anchors, anchor_f, cache=None):
        """ctx_f (B, N, d) features at ctx_pos, the first n_ctx[b] real; roots (B, A) at
        positions anchors, anchor_f: the feature before each. -> outputs (B, A, G, d)."""
        (B, N), A, G, dev = ctx_pos.shape, anchors.shape[1], self.block, ctx_pos.device
        e = self.shared[0].tok_embeddings(roots)
        blk = torch.cat([e[:, :, None], self.mask_emb.expand(B, A, -1, -1)], 2)
        blk = blk + self.fc_a(torch.cat([anchor_f, e], -1))[:, :, None]
        blk_pos = (anchors[..., None] + torch.arange(G, device=dev)).flatten(1)
        # vis over (N context + A·G block entries), by row (query) and column (key):
        #   context rows: causal over real context entries, no block;
        #   block rows:   real context before its anchor, and its own block, bidirectional
        i, bid = torch.arange(N, device=dev), torch.arange(A * G, device=dev) // G
        real = i[None, :] < n_ctx[:, None]                                   # (B, N)
        ctx_ctx = real[:, None, :] & (i[:, None] >= i[None, :])              # causal
        before = ctx_pos[:, None, :] < anchors.repeat_interleave(G, 1)[:, :, None]
        vis = torch.cat([torch.cat([ctx_ctx, ctx_ctx.new_zeros(B, N, A * G)], 2),
                         torch.cat([real[:, None, :] & before,                # context
                                    (bid[:, None] == bid[None, :]).expand(B, -1, -1)], 2)], 1)
        # A pad of a row with no real context and nothing cached (a one-token prompt's first
        # step) would have an all-False row: a plain softmax over all −inf gives NaN, and
        # with 2+ layers its K/V would carry it into real rows (0 · NaN = NaN).
        vis |= torch.eye(N + A * G, dtype=torch.bool, device=dev)           # pads: themselves
        # training: vis as is; drafting: plus the cached context, seen by every entry
        mask = vis[:, None] if cache is None else attend_mask(cache.lens, vis)
        out = self.body(torch.cat([self.fc(ctx_f), blk.flatten(1, 2)], 1),
                        torch.cat([ctx_pos, blk_pos], 1), mask, cache)
        return out[:, N:].view(B, A, G, -1)

    def loss(self, target, x, y, h):
        (B, T), G, dev = x.shape, self.block, x.device
        # anchors in [1, T − G]: the feature before one (anchor − 1) exists and its block's
        # last target (anchor + G − 1) is in the row; T // 2G blocks per row (≥ 1)
        anchors = torch.randint(1, T - G + 1, (B, max(1, T // (2 * G))), device=dev)
        out = self.blocks(h, torch.arange(T, device=dev).expand(B, T), torch.full(
            (B,), T, device=dev), x.gather(1, anchors), anchors, rows_at(h, anchors - 1))
        want = x.gather(1, (anchors[..., None] + torch.arange(1, G, device=dev)).flatten(1))
        return F.cross_entropy(self.logits(out[:, :, 1:]).flatten(0, 2), want.flatten())

    def start(self, tree):
        roots, depth = tree.tokens[:, 0], tree.depth[-1]
        if depth > self.block - 1:
            raise UserError(f"gamma={depth} does not fit a DFlash block of {self.block}")
        lens = self.cache.lens.clone()
        root = torch.tensor([len(s) - 1 for s in self.seqs], device=lens.device)[:, None]
        n = root[:, 0] - lens                   # context: committed positions before root
        ctx_pos = lens[:, None] + torch.arange(int(n.max()), device=lens.device)
        out = self.blocks(rows_at(self.feats, ctx_pos + 1), ctx_pos, n, roots[:, None], root,
                          rows_at(self.feats, root), self.cache)   # feats[root] = f_root-1
        self.cache.lens = lens + n              # keep the context, drop pads and the block
        # masks 1..γ predict depths 1..γ (entry 0 carries the root's own token)
        self.depth_logits = self.logits(out[:, 0, 1:depth + 1])
        return self.depth_logits[:, :1]


# -- Training the drafters on the frozen target's features (cached under out/) -----------

@torch.no_grad()
def distill_pool(target, corpus, n_seq, seq, seed=0, prompt_len=16, chunk=64):
    """The target's own continuations of corpus prompts, half greedy, half at T = 1, and
    its features: self-distillation (Medusa-2) -- drafters learn what the target WILL say."""
    # prompts at random corpus offsets, continued `chunk` rows per generate call; chunks
    # alternate T = 0 and T = 1 (i // chunk % 2): greedy rows teach what T = 0 decoding
    # will draft against, sampled ones cover the T > 0 distribution
    starts = np.random.default_rng(seed).integers(0, len(corpus.train) - prompt_len, n_seq)
    x = torch.from_numpy(np.stack([corpus.train[s:s + prompt_len] for s in starts]).astype(
        np.int64)).to(target.output.weight.device)
    x = torch.cat([torch.cat([x[i:i + chunk], target.generate(
        x[i:i + chunk], seq - prompt_len, temperature=float(i // chunk % 2), seed=seed + i)], 1)
        for i in range(0, n_seq, chunk)])
    # the features once, for the whole pool: the target is frozen, so training needs no
    # target forward per step. Memory: n_seq · seq · n_embd floats.
    return x, torch.cat([target(x[i:i + chunk], return_hidden=True)[2]
                         for i in range(0, n_seq, chunk)])


def train_drafters(drafters, target, pool, steps, batch, lr, seed=0):
    """AdamW on each drafter (target frozen), `batch` pool rows a step, features precomputed."""
    opts = {m: torch.optim.AdamW(d.parameters(), lr, weight_decay=0.0) for m, d in drafters.items()}
    gen, t0 = torch.Generator().manual_seed(seed), time.perf_counter()
    for step in range(steps):
        # every drafter trains on the same rows each step; inputs x[:, :-1] with their
        # features h[:, :-1] (aligned by position), targets y = x[:, 1:]
        rows = torch.randint(0, pool[0].shape[0], (batch,), generator=gen)
        x, h, losses = pool[0][rows], pool[1][rows], []
        for m, d in drafters.items():
            for g in opts[m].param_groups:       # cosine decay to 10%, no warmup
                g["lr"] = warmup_cosine(step, steps, 0, lr, lr / 10)
            loss = d.train().loss(target, x[:, :-1], x[:, 1:], h[:, :-1])
            opts[m].zero_grad(set_to_none=True)
            loss.backward()
            opts[m].step()
            losses.append(f"{m} {loss.item():.3f}")
        if step % 50 == 0 or step == steps - 1:
            elapsed = time.perf_counter() - t0            # eta: mean step time × steps left
            left = elapsed / (step + 1) * (steps - step - 1)
            print0(f"  step {step:4d} of {steps} | {' | '.join(losses)} | "
                   f"{fmt_duration(elapsed)} | eta {fmt_duration(left)}")
    return {m: d.eval() for m, d in drafters.items()}


def check_vocab(target, target_ckpt, draft, draft_ckpt):
    """p(x)/q(x) compares two models' probabilities of the same token id: same vocabulary
    size and the same tokenizer (as the checkpoints record it), or a UserError."""
    if draft.config.vocab_size != target.config.vocab_size or (target_ckpt or {}).get(
            "tokenizer", 0) != draft_ckpt.get("tokenizer", 0):
        raise UserError(f"the drafter's vocabulary ({draft.config.vocab_size} tokens) differs from "
                        f"the target's ({target.config.vocab_size}): p(x)/q(x) needs one tokenizer")


def corpus_of(target, ckpt):                   # the target's corpus, same tokenizer
    return data.load_corpus(ckpt.get("args", {}).get("data"), target.config.vocab_size)


def build_drafters(methods, target, args, target_ckpt):
    """Each method's drafter: the draft checkpoint (draft, tree), or a module trained on the
    frozen target's features, loaded from --out-dir if one was trained for this target."""
    dev, built, todo = target.output.weight.device, {}, {}
    # The cache key: the drafter settings, TRAIN, and a fingerprint of the target (sha1 of
    # its LM head's bytes): retrain the target and its cached drafters stop matching. Only
    # the head is hashed -- a cheap stand-in for all the weights.
    key = {k: getattr(args, k) for k in ("train_steps", "heads", "dflash_block", "drafter_layers")}
    key.update(TRAIN, target=hashlib.sha1(target.output.weight.cpu().numpy().tobytes()).hexdigest())
    for m in methods:
        if m in ("draft", "tree"):
            if not os.path.exists(args.draft_ckpt):
                raise UserError(f"{args.draft_ckpt} not found: python train.py --preset draft "
                                f"--ckpt {args.draft_ckpt} --sample-tokens 0")
            model, ckpt = load_model(args.draft_ckpt, dev)    # a separately trained GPT
            check_vocab(target, target_ckpt, model, ckpt)
            built[m] = ModelDrafter(model.eval())
            continue
        built[m] = (MedusaHeads(target, args.heads) if m == "medusa" else DFlashDrafter(
            target, args.dflash_block, args.drafter_layers) if m == "dflash" else
            FeatureDrafter(target, m, args.drafter_layers)).to(dev).eval()
        path = os.path.join(args.out_dir, f"spec_{m}.pt")
        # data only (weights_only=True): a planted or corrupt file is one clear error
        saved = load_checkpoint(path, dev, what="drafter cache", fix="Delete it to retrain "
                                "the drafter.") if os.path.exists(path) else {}
        if not isinstance(saved, dict):
            raise UserError(f"{path} is not a drafter cache (delete it to retrain)")
        if saved.get("key") == key:             # trained for this target and these settings
            built[m].load_state_dict(saved["state"])
        else:
            todo[m] = built[m]
    if todo:
        # all methods to train share one pool and one loop (train_drafters)
        seq = min(TRAIN["seq"], target.config.block_size)   # rows fit the target's context
        print0(f"training {', '.join(todo)} on the frozen target's features ({args.train_steps}"
               f" steps × {TRAIN['batch']}×{seq} tokens), cached in {args.out_dir}/")
        t0, corpus = time.perf_counter(), corpus_of(target, target_ckpt)
        pool = distill_pool(target, corpus, TRAIN["pool"], seq, args.seed,
                            prompt_len=min(16, seq // 2))
        print0(f"  self-distilled pool: {pool[0].numel():,} tokens in "
               f"{time.perf_counter() - t0:.0f} s")
        train_drafters(todo, target, pool, args.train_steps, TRAIN["batch"], TRAIN["lr"], args.seed)
        os.makedirs(args.out_dir, exist_ok=True)
        for m, d in todo.items():
            torch.save({"key": key, "state": d.state_dict()},
                       os.path.join(args.out_dir, f"spec_{m}.pt"))
    return built


# -- Measuring: plain decoding and each method on the same prompts, target and run -------

def run_method(target, drafter, groups, args, T, gamma, width):
    """Each group of prompts decoded as one batch (drafter None: plain). -> (outs, s, Stats)"""
    stats, outs, t0 = Stats(), [], time.perf_counter()
    # plain = GPT.generate on the group as one tensor (equal-length prompts: bench windows,
    # or copies of one prompt); both paths run under the same seed and temperature
    for g in groups:
        outs += target.generate(torch.tensor(g), args.max_new_tokens, temperature=T,
                                seed=args.seed).tolist() if drafter is None else \
            speculative_generate(target, drafter, g, args.max_new_tokens, gamma, width, T,
                                 args.seed, stats)[0]
    return outs, time.perf_counter() - t0, stats if drafter is not None else None


def compared(target, entries, groups, args, T, draft=None):
    """Plain decoding and every entry (name, drafter, gamma, width) alternated --repeats
    times, the best time of each kept (on a shared CPU, the least disturbed run). ONE
    plain run is the baseline of the whole table, so each row's speedup is its tok/s over
    the plain row's printed beside it. draft (a GPT): its own plain decoding joins the
    alternation, its time per call kept in the plain row (print_costs' baseline for
    drafting). -> [plain row, one row per entry]."""
    best, times = {}, {}
    runs = [(target, None, 0, 1)] + [(target, d, g, w) for _, d, g, w in entries]
    if draft is not None:           # last: run_method's plain decoding, of the draft model
        runs.append((draft, None, 0, 1))
    # plain, m1, m2, ..., plain, m1, ...: a slow patch on the shared CPU then hits every
    # method alike, and the minimum keeps each one's least disturbed run
    for _ in range(args.repeats):
        for i, (model, drafter, gamma, width) in enumerate(runs):
            run = run_method(model, drafter, groups, args, T, gamma, width)
            times.setdefault(i, []).append(run[1])
            if i not in best or run[1] < best[i][1]:
                best[i] = run
    B = len(groups[0])
    # the plain row first: every other row divides by ITS time (the baseline printed above)
    plain = ledger_row("plain", 0, 1, T, B, *best[0])
    if draft is not None:           # the same calls as the target's: same prompts, lengths
        plain["draft_step_s"] = best[len(runs) - 1][1] / plain["calls"]
    rows = [plain] + [ledger_row(name, gamma, width, T, B, *best[i + 1], plain)
                      for i, (name, _, gamma, width) in enumerate(entries)]
    for i, row in enumerate(rows):  # every repeat's time: TimingConditions' spread
        row["repeats"] = times[i]
    return rows


def ledger_row(name, gamma, width, T, B, outs, secs, st, plain=None):
    """Measured α and tokens per target call τ next to (1 − α^(γ+1))/(1 − α); c = drafting
    time per step ÷ one plain decode step; speedup = plain time ÷ this time."""
    # calls, plain decoding: one target forward per token per group (len(outs) // B groups)
    row = dict(method=name, g=gamma, w=width, T=T, B=B, tps=sum(map(len, outs)) / secs,
               secs=secs, outs=outs, calls=len(outs) // B * max(map(len, outs)))
    if st is not None:
        a = st.alpha
        # formula: γ + 1 at α = 1, the limit of (1 − α^(γ+1))/(1 − α); c's denominator is one
        # plain decode step, i.e. about one target call. same: at T = 0 the output must equal
        # plain greedy token for token; at T > 0 it differs by design (other random draws).
        row.update(alpha=a, tau=st.tau, formula=(1 - a ** (gamma + 1)) / (1 - a) if a < 1 else
                   gamma + 1, calls=st.rounds, dfwd=st.drafter_calls / st.rounds,
                   dms=1e3 * st.draft_s / st.rounds, vms=1e3 * st.verify_s / st.rounds,
                   c=st.draft_s / st.rounds / (plain["secs"] / plain["calls"]),
                   speedup=plain["secs"] / secs, same=T == 0 and (  # T = 0: == plain greedy?
                       "yes" if outs == plain["outs"] else "NO") or "")
    return row


def print_ledger(rows, title):
    print0(f"\n{title}\nmethod   γ  w   T  B |     α τ meas formula | calls  dfwd draft ms     c"
           f" verify ms |  tok/s speedup  =greedy")
    for r in rows:
        if "alpha" in r:
            mid = (f"{r['g']:>3}{r['w']:>3}{r['T']:>4g}{r['B']:>3} | {r['alpha']:>5.2f} "
                   f"{r['tau']:>6.2f} {r['formula']:>7.2f} | {r['calls']:>5} {r['dfwd']:>5.1f} "
                   f"{r['dms']:>8.2f} {r['c']:>5.2f} {r['vms']:>9.2f}")
        else:                                   # plain decoding: one target call per token
            mid = f"  -  -{r['T']:>4g}{r['B']:>3} | {1:>12.2f} {1:>7.2f} | {r['calls']:>5}"
        print0(f"{r['method']:<7}{mid:<81} | {r['tps']:>6.0f} {r.get('speedup', 1):>6.2f}x  "
               f"{r.get('same', '')}")


def break_even_alpha(gamma, c_draft, c_verify):
    """α where a chain of γ drafts breaks even: a step commits (1 − α^(γ+1))/(1 − α) = 1 +
    α + … + α^γ tokens and costs γ·c_draft + c_verify plain target steps (drafting per
    token and the verify pass, measured), so the speedup is 1 where the two are equal
    (Leviathan et al. 2023, Thm 3.8, there c_verify = 1). -> α in [0, 1): 0.0 if α = 0
    gains already (cost ≤ 1); None if none does (cost ≥ γ + 1, the most a step commits)."""
    cost = gamma * c_draft + c_verify
    if cost <= 1 or cost >= gamma + 1:
        return 0.0 if cost <= 1 else None
    # α^γ + … + α + (1 − cost) rises on [0, 1] from < 0 to > 0: its one real root there
    return min(r.real for r in np.roots([1.0] * gamma + [1 - cost])
               if abs(r.imag) < 1e-9 and 0 <= r.real <= 1)


def print_costs(rows):
    """Beside each (T, B) group's plain decode: per method, drafting per level (one draft
    token of a chain; × the draft model's plain per-token time, where it drafts), one verify
    pass (× one plain target step), and the break-even α those costs give (chains)."""
    print0("\ncosts beside plain decoding (same run): drafting ms per draft token (×: over the "
           "draft model's plain ms/token), verify ms of one target pass (×: over one plain "
           "step); break-even α: (1 − α^(γ+1))/(1 − α) = γ·c_draft + c_verify, in steps\n"
           "method   γ  w   T  B | plain ms/step draft ms/tok | drafting      × | verify      × "
           "| break-even α measured α")
    for r in rows:
        if "alpha" not in r:        # a group's plain row: its step and the draft model's
            step, dstep = r["secs"] / r["calls"], r.get("draft_step_s")
            continue
        per_tok, verify = r["dms"] / 1e3 / r["g"], r["vms"] / 1e3
        over = per_tok / dstep if dstep and r["method"] in ("draft", "tree") else None
        even = break_even_alpha(r["g"], per_tok / step, verify / step) if r["w"] == 1 else "-"
        even = "none" if even is None else even if even == "-" else f"{even:.2f}"
        print0(f"{r['method']:<7}{r['g']:>3}{r['w']:>3}{r['T']:>4g}{r['B']:>3} | "
               f"{1e3 * step:>13.2f} {'-' if dstep is None else f'{1e3 * dstep:.2f}':>12} | "
               f"{1e3 * per_tok:>8.2f} {'-' if over is None else f'{over:.2f}x':>6} | "
               f"{1e3 * verify:>6.2f} {verify / step:>5.2f}x | {even:>12} {r['alpha']:>10.2f}")


def width_of(args, method):
    """--width, else the method's default: DEFAULT_WIDTH's, or 1 (a chain)."""
    return args.width or DEFAULT_WIDTH.get(method, 1)


def drafter_bytes(drafters):
    """fp32 bytes of the drafters' own parameters, each tensor once (by id): the draft model
    through .model; the target's borrowed head and embedding are not theirs (a tuple)."""
    return sum({id(p): 4 * p.numel() for d in drafters.values()
                for p in getattr(d, "model", d).parameters()}.values())


def prompts_and_grid(args, enc, target, ckpt):
    """-> (prompts, temperatures, batch sizes): generate decodes --batch-size copies of
    --prompt at --temperature; bench decodes windows of held-out text as prompts."""
    if args.mode == "generate":
        prompts = [enc.encode_ordinary(args.prompt)] * args.batch_size
        return prompts, [args.temperature], [args.batch_size]
    corpus = corpus_of(target, ckpt)
    starts = np.random.default_rng(args.seed).integers(
        0, len(corpus.val) - args.prompt_len, args.bench_prompts)
    prompts = [corpus.val[s:s + args.prompt_len].astype(np.int64).tolist() for s in starts]
    # B = 1: each prompt decoded alone; B = all: one batch, rows accepting differently
    return prompts, [float(t) for t in args.bench_temps.split(",")], [1, len(prompts)]


def measure_grid(target, entries, prompts, temps, batches, args, enc, draft=None):
    """Every (T, B) of the grid: a table of plain decoding and every entry (compared; draft:
    the draft model, whose plain decoding is timed too). generate also prints each method's
    text. -> the rows of all tables."""
    # warm-up: first calls allocate and dispatch (plain decoding first, as in the tables)
    warm = [(target, None, 0, 1)] + [(target, d, g, w) for _, d, g, w in entries]
    for model, drafter, gamma, width in warm + [(draft, None, 0, 1)] * (draft is not None):
        run_method(model, drafter, [prompts[:1]], args, 0.0, gamma, width)
    rows = []
    # bench: one progress line per (T, B) configuration, each a table of every method
    progress = Progress("spec bench", len(temps) * len(batches), every=0)
    for t_i, T in enumerate(temps):
        for b_i, B in enumerate(batches):
            if args.mode == "bench":
                progress.update(t_i * len(batches) + b_i, now_on=f"T={T:g}, B={B}")
            groups = [prompts[i:i + B] for i in range(0, len(prompts), B)]
            table = compared(target, entries, groups, args, T, draft)
            rows += table
            for row in table[1:] if args.mode == "generate" else ():
                print0(f"--- {row['method']}, T={T:g}: "
                       f"{enc.decode(prompts[0] + row['outs'][0])!r}")
    return rows


def drafting_cost_sweep(target, drafters, methods, prompts, args):
    """bench: drafting cost vs γ, sequential drafters (draft, EAGLE) vs one block (DFlash).
    -> its rows (none outside bench, or with --sweep '')."""
    sweep = [m for m in ("draft", "eagle", "dflash") if m in methods and args.mode == "bench"]
    if not (sweep and args.sweep):
        return []
    gammas = [int(g) for g in args.sweep.split(",")]
    return compared(target, [(m, drafters[m], g, 1) for g in gammas for m in sweep],
                    [prompts[:1]], args, 0.0)


# -- The command line: every knob once, a row each (flag, default, help; core/cli.py makes
# the flags, --help and the "did you mean" line from these tables) -------------------------

DECODING_KNOBS = [
    knob("mode", "generate", "generate: one --method; bench: plain decoding and every "
         "--methods", nargs="?", choices=["generate", "bench"]),
    knob("--method", "medusa", "generate: drafter", choices=METHODS),
    knob("--methods", ",".join(METHODS), "bench: methods to run"),
    knob("--gamma", 4, "draft tokens per step (tree depth)"),
    knob("--width", 0, f"tree width, 0 = {DEFAULT_WIDTH} else 1"),
    knob("--temperature", 0.0, "0 = greedy"),
    knob("--prompt", "def ", "generate: the prompt"),
    knob("--max-new-tokens", 64, "new tokens per prompt"),
    knob("--batch-size", 1, "generate: copies of the prompt"),
    knob("--seed", 0, "sampling and prompt seed"),
]

MODEL_KNOBS = [
    knob("--checkpoint --ckpt", "out/ckpt.pt", "the target (train.py; --ckpt: the old name)",
         dest="ckpt"),
    knob("--draft-checkpoint --draft-ckpt", "out/draft.pt", "draft model (--preset draft; "
         "--draft-ckpt: the old name)", dest="draft_ckpt"),
    knob("--out-dir", os.path.join("out", "spec_decode"), "where trained drafters are cached"),
    knob("--heads", 4, "Medusa heads (max gamma)"),
    knob("--dflash-block", 5, "DFlash block (max gamma + 1)"),
    knob("--drafter-layers", 1, "MTP/EAGLE/DFlash blocks"),
    knob("--train-steps", 400, f"drafter training, {TRAIN}"),
]

BENCH_KNOBS = [
    knob("--bench-prompts", 4, "prompts (the batch of B>1)"),
    knob("--prompt-len", 32, "bench: tokens per prompt"),
    knob("--bench-temps", "0,1", "bench: temperatures"),
    knob("--sweep", "1,2,4", "bench: gammas of the drafting-cost sweep"),
    knob("--repeats", 3, "timed runs per row (best kept)"),
    knob("--threads", 1, "torch CPU threads (steadier timing)"),
]

# None: the parser's own "options" heading, as argparse lists flags outside any group
KNOBS = {None: DECODING_KNOBS, "models and drafters": MODEL_KNOBS,
         "bench and run": BENCH_KNOBS}


def parse_args(argv=None):
    # argparse's own formatter: "(default: X)" on every flag, the "0 = ..." helps included
    p = command_line("Speculative decoding: six drafters, one exact verifier, a ledger.",
                     KNOBS, formatter=argparse.ArgumentDefaultsHelpFormatter)
    args = p.parse_args(argv)
    require_at_least_one(args, ("gamma", "max_new_tokens", "batch_size", "heads",
                                "train_steps", "repeats", "bench_prompts", "prompt_len",
                                "drafter_layers"))
    if args.width < 0 or args.dflash_block < 2 or args.temperature < 0:
        raise UserError("--width must be >= 0, --dflash-block >= 2, --temperature >= 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    target, ckpt = load_model(args.ckpt)
    # frozen: drafter training backpropagates through the borrowed LM head but builds no
    # gradient for the target's own weights
    target.eval().requires_grad_(False)
    enc = data.encoding_from_state(ckpt["tokenizer"])
    methods = args.methods.split(",") if args.mode == "bench" else [args.method]
    drafters = build_drafters(methods, target, args, ckpt)
    print0(f"target: {target.num_params():,} params | drafters: "
           f"{fmt_bytes(drafter_bytes(drafters))} | {args.threads} thread(s); timings: wall "
           f"clock on a shared CPU")
    prompts, temps, batches = prompts_and_grid(args, enc, target, ckpt)
    entries = [(m, drafters[m], args.gamma, width_of(args, m)) for m in methods]
    # the draft model (draft, tree): its own plain decoding is drafting's yardstick
    draft = next((d.model for d in drafters.values() if isinstance(d, ModelDrafter)), None)
    with TimingConditions() as conditions:      # the load as the timing starts and ends
        rows = measure_grid(target, entries, prompts, temps, batches, args, enc, draft)
        sweep = drafting_cost_sweep(target, drafters, methods, prompts, args)
    cmd = " ".join(["python spec_decode.py"] + (argv if argv is not None else sys.argv[1:]))
    print_ledger(rows, f"ledger ({cmd}); speedup = plain time / method time = method tok/s "
                       f"/ the plain row's above it, each the best of {args.repeats} "
                       f"alternated runs:")
    print_costs(rows)
    if sweep:
        print_ledger(sweep, "drafting cost vs γ (T=0, B=1, prompt 0): the draft model and "
                            "EAGLE pay one pass per draft token, DFlash one pass per step")
    # one line when the machine was too busy, or the repeats too far apart, to trust these
    conditions.report({f"{part}{r['method']} γ={r['g']} T={r['T']:g} B={r['B']}": r["repeats"]
                       for part, table in (("", rows), ("sweep: ", sweep)) for r in table},
                      out=print0)
    return rows


if __name__ == "__main__":
    run_cli(main)
