"""
training/qk_clip.py -- MuonClip's QK-clip (Kimi K2): `train.py --qk-clip TAU`. A part of
train.py, imported one way: the guard the loop applies after each optimizer step, on the
attention logits that Muon's full-size updates can grow (optim.py teaches Muon itself).

What it teaches
- Muon moves every direction of W_q and W_k at full size, and in long runs some heads'
  attention logits q·k/√d grow without bound (then the softmax saturates and the loss
  spikes). After each step, for every head whose largest logit in this step's forward
  passes S_max exceeded τ, multiply its W_q rows and W_k rows by √(τ/S_max) each: the
  head's logits q·k scale by τ/S_max exactly (RoPE is a rotation, so it commutes with the
  scaling). As in K2, S_max comes from the forward, before the update, so the next forward
  can exceed τ by what one update added; the clip then pulls it back (tests: logits scale
  exactly, and stay bounded near τ).

GQA: with n_kv_head < n_head one K head serves a group of Q heads, so scaling it also
shrinks the logits of the group's healthy heads. Two choices (gqa=...):
  "group" (default): per KV group, with the group's max S_g: W_q rows of the group's
    heads and its W_k rows by √(τ/S_g) each. Balanced like K2, but healthy heads of an
    offending group are clipped too. With n_kv_head == n_head: exactly K2's per head.
  "query": leave the shared W_k alone; W_q rows of each offending head × τ/S_h. Exact
    per head (K2 does this for MLA's shared rotary key: only the query gets the factor),
    but W_k is never reined in.

MLA (mla.LatentAttention; Kimi K2 §2.1): head h's logit is (q_C,h·k_C,h + q_R,h·k_R)/√d,
where q_C,h and q_R,h (rows of wq, or of wq_b) and k_C,h (head h's W_UK rows of wkv_b)
belong to head h alone, while the rotary key k_R (the last d_R rows of wkv_a) is ONE
vector shared by every head. K2's rule: q_C,h and k_C,h × √γ_h, q_R,h × γ_h, k_R left
alone. Both terms then scale by γ_h (√γ·√γ and γ·1): the logit scales by γ_h exactly,
as for a plain head. Splitting γ as √γ on q_R and √γ on k_R instead would scale k_R for
all heads at once -- shrinking the rotary term of heads that did not offend, as the
shared W_k of a GQA group does. The value rows of wkv_b (W_UV) and the latent itself
are not touched. The GQA mode plays no role: no key component but k_R is shared.

What it costs: a per-head max-logit recorder in the forward (one extra QKᵀ per layer in
our unfused form; a flash-attention kernel has the row max for free) and a rescale of
W_q, W_k rows after the step: no state; under data parallelism one all-reduce(max) of
n_head floats per layer.
"""
import math

import torch
import torch.distributed as dist

from core.errors import UserError
from core.meters import comm


def max_logit_per_head(q, k, mask=None):
    """max over batch, queries and allowed keys of q·k/√d, per query head: (H,) fp32."""
    # GQA: KV head j serves query heads j·r … j·r + r − 1 (model.repeat_kv's layout)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    # fp32, and the whole (B, H, Tq, Tk) score tensor: B·H·T²·4 bytes for a moment -- the
    # "one extra QKᵀ per layer" of the header, which a fused kernel would not pay
    scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if mask is None:                                     # causal, Tq == Tk
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    # -inf: a key the query may not see cannot be its max
    return scores.masked_fill(~mask, float("-inf")).amax(dim=(0, 2, 3))


class QKClip:
    """QK-clip for one model. It wraps every layer's attn_fn (model.py's documented seam)
    with a recorder of the per-head max logit -- a running max over the forwards since the
    last clip, so gradient-accumulation micro-batches combine -- and `apply()`, after each
    optimizer step, rescales the offending heads' W_q / W_k. Its state (τ, the GQA mode,
    the maxima) lives here, not on the model's modules. MLA layers (mla.LatentAttention,
    recognised by their wkv_b) use the same seam: their attn_fn receives queries and keys
    whose q·k/√(width) are the real logits, in both of core/mla.py's paths."""

    def __init__(self, model, tau=100.0, gqa="group"):
        if not tau > 0:
            raise UserError(f"QK-clip threshold tau must be > 0, got {tau}")
        if gqa not in ("group", "query"):
            raise UserError(f"unknown GQA QK-clip mode {gqa!r}: group or query")
        self.model, self.tau, self.gqa = model, tau, gqa
        self.maxima = [None] * len(model.layers)    # per layer: (H,) max logit, or None
        self.clipped = self.heads = 0       # since take_report(): heads clipped, seen
        self.peak = None                    # ... and the largest logit before a clip
        for i, layer in enumerate(model.layers):
            layer.attention.attn_fn = self._recorder(i, layer.attention.attn_fn)

    def _recorder(self, i, inner):
        def attn_fn(q, k, v, mask=None):
            # no_grad: nothing enters the graph, nothing counts as an activation. A running
            # max: micro-batches combine, and full activation checkpointing's replay in
            # backward sees the same values again (a max of equals changes nothing).
            with torch.no_grad():
                s = max_logit_per_head(q, k, mask)
                prev = self.maxima[i]
                self.maxima[i] = s if prev is None else torch.maximum(prev, s)
            return inner(q, k, v, mask)
        return attn_fn

    @torch.no_grad()
    def apply(self, copies=None, group=None):
        """Call after optimizer.step(). copies: {model parameter: tensor} also scaled the
        same way (train.py's fp32 master weights). Under data parallelism the maxima are
        all-reduced (MAX) over `group` first (default: the world; under tensor parallelism
        pass the DP group) so every replica clips identically. Returns the per-layer (H,)
        logit factors (1 = untouched) of the layers that recorded, and resets the maxima."""
        factors = []
        for i, layer in enumerate(self.model.layers):
            S, self.maxima[i] = self.maxima[i], None
            # A layer with no forward since the last clip is skipped -- on every rank alike,
            # or the MAX all-reduces below would pair up wrongly and hang.
            if S is None:
                continue
            if dist.is_available() and dist.is_initialized():
                comm.all_reduce(S, op=dist.ReduceOp.MAX, group=group)
            self.note(S)
            factors.append(self._clip_layer(layer.attention, S, copies))
        return factors

    def note(self, S):
        """Count one layer's heads for the log: how many were above τ, the largest."""
        self.clipped += int((S > self.tau).sum())
        self.heads += S.numel()
        top = float(S.max())
        self.peak = top if self.peak is None else max(self.peak, top)

    def take_report(self):
        """-> "3/48 heads clipped, max logit 142.1 -> 100" for the steps since the
        last call (a clipped head's max logit lands on τ when no update intervenes), or
        None if no step clipped; then starts counting again."""
        report = None
        if self.clipped:
            report = (f"{self.clipped}/{self.heads} heads clipped, max logit "
                      f"{self.peak:.4g} -> {self.tau:.4g}")
        self.clipped = self.heads = 0
        self.peak = None
        return report

    def _clip_layer(self, attn, S, copies):
        gamma = torch.where(S > self.tau, self.tau / S, torch.ones_like(S))  # logit factor
        if hasattr(attn, "wkv_b"):
            return self._clip_latent(attn, gamma, copies)
        # head counts from the weights, as model.Attention does: under tensor parallelism
        # wq/wk hold the local heads only
        n_q, hd = S.numel(), attn.head_dim
        n_kv = attn.wk.weight.shape[0] // hd
        if self.gqa == "group":
            g = gamma.view(n_kv, n_q // n_kv).amin(dim=1)             # τ / (group's max)
            # √g on the group's Q rows and √g on its K rows: every logit of the group × g
            q_scale, k_scale = g.sqrt().repeat_interleave(n_q // n_kv), g.sqrt()
            factor = g.repeat_interleave(n_q // n_kv)
        else:
            q_scale, k_scale = gamma, torch.ones(n_kv, device=S.device)
            factor = gamma
        # per head -> per row: head h owns rows h·hd … (h+1)·hd − 1 of wq and wk (the
        # .view(B, T, -1, head_dim) in model.Attention)
        scale_rows(attn.wq.weight, q_scale.repeat_interleave(hd), copies)
        scale_rows(attn.wk.weight, k_scale.repeat_interleave(hd), copies)
        return factor

    @staticmethod
    def _clip_latent(attn, gamma, copies):
        """MLA, K2's rule (see above): per head, [q_C | q_R] rows × [√γ | γ], [k_C | v]
        rows of wkv_b × [√γ | 1]; wkv_a (the latent and the shared rotary key) untouched."""
        n_head = gamma.numel()

        def per_head(*parts):         # (factor per head, rows per head), ... -> (rows,)
            return torch.cat([f[:, None].expand(n_head, width) for f, width in parts],
                             dim=1).flatten()
        root, ones = gamma.sqrt(), torch.ones_like(gamma)
        q_rows = per_head((root, attn.qk_nope_head_dim), (gamma, attn.qk_rope_head_dim))
        kv_rows = per_head((root, attn.qk_nope_head_dim), (ones, attn.v_head_dim))
        scale_rows(attn.query_proj.weight, q_rows, copies)
        scale_rows(attn.wkv_b.weight, kv_rows, copies)
        return gamma


def scale_rows(w, scale, copies=None):
    """w (out, in) *= scale (out,) row by row, and the same on w's entry in copies."""
    # The factor is rounded to w's dtype once, and that same value scales the copy: a
    # 16-bit weight and its fp32 master stay the rounding of one another (a bf16 factor
    # is off by at most ~0.4%, far inside QK-clip's slack). copies is keyed by the
    # Parameter object itself (tensors hash by identity).
    rows = scale.to(w.dtype)[:, None]
    w.mul_(rows)
    if copies is not None and w in copies:
        copies[w].mul_(rows.to(copies[w].dtype))
