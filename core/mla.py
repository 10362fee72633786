"""
core/mla.py -- multi-head latent attention (MLA; DeepSeek-V2 §2.1, DeepSeek-V3 §2.1.1): the
KV cache holds one low-rank latent per token instead of every head's keys and values.

What it teaches:
  - Low-rank joint compression of keys and values: c_KV = RMSNorm(W_DKV x) of width d_c
    (kv_lora_rank), and every head's key and value are up-projections of it,
    k_C = W_UK c_KV, v = W_UV c_KV (both inside `wkv_b`). Only c_KV is cached.
  - Decoupled RoPE: a rotation between W_UK and the query would depend on the key's
    position, so W_UK could no longer be folded into the query (below). MLA therefore
    keeps the position-free part (d_nope per head) apart from a small rotary part: each
    head has its own rotary query q_R (d_R), and ONE rotary key k_R = RoPE(W_KR x),
    shared by all heads, is cached next to c_KV. Logit of head h:
    (q_C,h · k_C,h + q_R,h · k_R) / √(d_nope + d_R).
  - Absorption at inference (DeepSeek-V2 §2.1.2, "W_UK can be absorbed into W_Q, and W_UV
    into W_O"): q_C,h · (W_UK,h c) = (W_UK,hᵀ q_C,h) · c, so a query mapped into the
    latent space attends to the cached latents directly; and Σ_j p_j W_UV,h c_j =
    W_UV,h Σ_j p_j c_j, so the up-projection of values runs once, after attention. The
    attention then runs on (c_KV ‖ k_R) as a single KV head of width d_c + d_R (MQA-like),
    with c_KV as its value. Same outputs as the unabsorbed path (tests: 1e-5).
  - Queries may come through their own latent (q_lora_rank: W_DQ, RMSNorm, W_UQ): fewer
    parameters and activation memory in training; nothing changes in the cache.

What it saves and what it costs (L layers, d_h head size, n_kv GQA key/value heads):
  - KV bytes per token: (d_c + d_R)·L·bytes, against 2·n_kv·d_h·L·bytes for GQA/MHA.
    DeepSeek-V2's choice d_c = 4·d_h, d_R = d_h/2 caches 4.5·d_h per layer: GQA with 2.25
    KV heads, while every head keeps its own key and value (`python -m scripts.mla_bench` measures
    it).
  - Unabsorbed decode with a latent cache pays the up-projection of EVERY cached token at
    EVERY step: T·d_c·H·(d_nope + d_v) multiply-adds per layer, growing with the context.
    Absorbed decode pays per query H·d_nope·d_c (fold W_UK) + H·d_c·d_v (W_UV after), and
    per cached token H·(2·d_c + d_R) (scores and weighted sum on the latent): FLOPs per
    cached token traded for FLOPs per query. Prefill and training are the other way
    round (many queries, each attending at width d_c + d_R instead of d_nope + d_R), so
    training runs unabsorbed.
  - Even absorbed, a cached token costs H·(2·d_c + d_R) multiply-adds against GQA's
    H·2·d_h: 4.25x more at DeepSeek's proportions, for about the same bytes read. MLA
    raises decode's arithmetic intensity; it pays off where decode is bound by memory
    bandwidth and capacity (GPUs, long contexts, big batches), not on a compute-bound
    CPU at nano width, where `python -m scripts.mla_bench` measures it slower than GQA.
  - Sacrificed: keys and values are rank-d_c; one rotary key for all heads; two more
    matrices (down- and up-projection) per layer; the absorbed attention is wider per
    head than d_h, and int8 KV quantization now rounds the latent, not the keys.

The one seam for choosing the path: `LatentAttention.absorb` (None = absorbed exactly when
a cache is given, i.e. at inference; True / False force one path -- the tests and the
benchmark set it on every layer). QK-clip (training/qk_clip.py) records the per-head max
logit through `attn_fn` as for model.Attention: both paths hand attn_fn queries and keys whose
q·k/√(width) are MLA's real logits, and it rescales the head-specific rows (wq or wq_b,
the k_C rows of wkv_b), never the shared rotary key in wkv_a.

This file never imports model.py (model.py builds it): the pieces it shares with
model.Attention -- the RMSNorm class, the rotary embedding and the attention function --
come in as arguments, as core/moe.py takes the expert MLP.

Run:  python -m scripts.mla_bench   # KV bytes/token (measured from the caches, next to
                                    # the formula), decode time: MHA, GQA, MLA both paths

References: DeepSeek-AI 2024, "DeepSeek-V2" (§2.1); DeepSeek-AI 2024, "DeepSeek-V3
Technical Report" (§2.1.1); deepseek-ai/DeepSeek-V3 inference/model.py (the names, the
absorbed path); Su et al. 2021 (RoPE); Shazeer 2019 (MQA).
"""
import math

import torch
import torch.nn as nn

from core.errors import UserError


# ----------------------------------------------------------------------------------------
# The layer

def mla_dims(cfg):
    """-> dict of MLA's widths, defaults resolved; UserError for a config that cannot
    build one (GPTConfig.validate checks the rotary part; the rest is checked here)."""
    dims = dict(n_head=cfg.n_head,
                d_c=cfg.kv_lora_rank,
                d_q=cfg.q_lora_rank,
                d_nope=cfg.qk_nope_head_dim or cfg.head_dim,
                d_rope=cfg.qk_rope_head_dim,
                d_v=cfg.v_head_dim or cfg.head_dim)
    widths = (dims["d_c"], dims["d_nope"], dims["d_rope"], dims["d_v"])
    if min(widths) < 1 or dims["d_q"] < 0:
        raise UserError(f"MLA needs positive widths (kv_lora_rank, qk_rope_head_dim, "
                        f"qk_nope_head_dim, v_head_dim; q_lora_rank >= 0), got "
                        f"kv_lora_rank={cfg.kv_lora_rank} q_lora_rank={cfg.q_lora_rank} "
                        f"qk_rope_head_dim={cfg.qk_rope_head_dim} "
                        f"qk_nope_head_dim={cfg.qk_nope_head_dim} v_head_dim={cfg.v_head_dim}")
    return dims


class LatentAttention(nn.Module):
    """MLA with DeepSeek-V3's names. Weights (H heads):
      wq (n_embd → H·(d_nope+d_R)), or wq_a (n_embd → q_lora_rank), q_norm and
        wq_b (→ H·(d_nope+d_R));
        per head the rows are [q_C (d_nope) | q_R (d_R)];
      wkv_a (n_embd → d_c + d_R): [the latent before kv_norm | the shared rotary key];
      kv_norm (RMSNorm of the latent);
      wkv_b (d_c → H·(d_nope+d_v)): per head [W_UK (d_nope rows) | W_UV (d_v rows)];
      wo (H·d_v → n_embd).
    All 2-D, so GPT.init_weights draws them from N(0, 0.02) and scales wo by 1/√(2L); the
    norms are 1-D and start at 1.

    forward(x, cos, sin, mask, cache, layer) is model.Attention's; cos/sin are d_R wide
    (GPT builds its RoPE table cfg.rope_dim wide). With a cache it stores (c_KV, k_R) as
    the protocol's (key, value) -- cfg.kv_cache_dims = (1, d_c, d_R) -- and hands the
    cache this layer's latent attention function, which any cache (dense, paged, int8)
    runs on what it gathered."""

    def __init__(self, cfg, norm, rope, attn_fn):
        """norm: the RMSNorm class (norm(width, eps)); rope: apply_rope(x, cos, sin);
        attn_fn: the model's attention function (q, k, v, mask) -> out."""
        super().__init__()
        d = mla_dims(cfg)
        self.rope = rope
        self.n_head = d["n_head"]
        self.kv_lora_rank = d["d_c"]
        self.qk_nope_head_dim = d["d_nope"]
        self.qk_rope_head_dim = d["d_rope"]
        self.v_head_dim = d["d_v"]
        qk_dim = d["d_nope"] + d["d_rope"]
        if d["d_q"]:
            self.wq_a = nn.Linear(cfg.n_embd, d["d_q"], bias=False)
            self.q_norm = norm(d["d_q"], cfg.norm_eps)
            self.wq_b = nn.Linear(d["d_q"], self.n_head * qk_dim, bias=False)
        else:
            self.wq = nn.Linear(cfg.n_embd, self.n_head * qk_dim, bias=False)
        self.wkv_a = nn.Linear(cfg.n_embd, d["d_c"] + d["d_rope"], bias=False)
        self.kv_norm = norm(d["d_c"], cfg.norm_eps)
        self.wkv_b = nn.Linear(d["d_c"], self.n_head * (d["d_nope"] + d["d_v"]), bias=False)
        self.wo = nn.Linear(self.n_head * d["d_v"], cfg.n_embd, bias=False)
        # DeepSeek's softmax scale: 1/√(d_nope + d_R), the width of the unabsorbed q·k
        self.scale = 1.0 / math.sqrt(qk_dim)
        # the replaceable part (as Attention); one_kv_head_as_rows only changes how the
        # absorbed path's single KV head is computed, not what
        self.attn_fn = one_kv_head_as_rows(attn_fn)
        self.absorb = None                              # the path seam: see the header

    @property
    def query_proj(self):
        """The linear whose output rows are the per-head queries [q_C | q_R] (QK-clip
        scales rows of it)."""
        return self.wq_b if hasattr(self, "wq_b") else self.wq

    def queries(self, x, cos, sin):
        """-> q_C (B, H, T, d_nope), q_R rotated (B, H, T, d_R)."""
        B, T, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if hasattr(self, "wq_b") else self.wq(x)
        q = q.view(B, T, -1, self.qk_nope_head_dim + self.qk_rope_head_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        return q_nope, self.rope(q_rope, cos, sin)

    def latent(self, x, cos, sin):
        """-> what the cache stores: c_KV (B, 1, T, d_c) and the rotated shared rope key
        (B, 1, T, d_R)."""
        c, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        return self.kv_norm(c)[:, None], self.rope(k_rope[:, None], cos, sin)

    def up_weights(self):
        """wkv_b as per-head W_UK (H, d_nope, d_c) and W_UV (H, d_v, d_c)."""
        w = self.wkv_b.weight.view(-1, self.qk_nope_head_dim + self.v_head_dim,
                                   self.kv_lora_rank)
        return w.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)

    def forward(self, x, cos, sin, mask=None, cache=None, layer=0):
        B, T, _ = x.shape
        q_nope, q_rope = self.queries(x, cos, sin)
        c, k_rope = self.latent(x, cos, sin)
        if cache is not None:              # store this step's latents, attend to all of them
            c, k_rope = cache.update(layer, c, k_rope)
        absorb = cache is not None if self.absorb is None else self.absorb
        if absorb:                         # queries in the latent space, attend on it
            q = self.absorbed_query(q_nope, q_rope)
            attend = self.absorbed_attention
        else:                              # per-head keys and values from the latents
            q = torch.cat([q_nope, q_rope], dim=-1)
            attend = self.unabsorbed_attention
        if cache is not None and cache.attention is not None:
            y = cache.attention(q, c, k_rope, mask, attend)     # e.g. paged: gather first
        else:
            y = attend(q, c, k_rope, mask)
        if absorb:                         # W_UV after attention: (B, H, T, d_c) -> d_v
            y = torch.einsum("bhtc,hvc->bhtv", y, self.up_weights()[1])
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))

    # -- the two latent attention functions: (q, c_all, k_rope_all, mask) -> out ---------
    # Both go through self.attn_fn (the model's sdpa or explicit softmax), whose scale is
    # 1/√(q's width): the unabsorbed q is d_nope + d_R wide, so that is DeepSeek's scale;
    # the absorbed query is pre-multiplied so its 1/√(d_c + d_R) lands on the same logits.
    # QK-clip's recorder, wrapped around attn_fn, therefore sees the real logits either way.

    def unabsorbed_attention(self, q, c, k_rope, mask=None):
        """The training path: up-project every latent to per-head k_C and v, append the
        shared rope key to each head's key, attend. -> (B, H, Tq, d_v)."""
        B, _, Tk, _ = c.shape
        kv = self.wkv_b(c[:, 0]).view(B, Tk, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.transpose(1, 2).split([self.qk_nope_head_dim, self.v_head_dim], -1)
        k = torch.cat([k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        return self.attn_fn(q, k, v, mask)

    def absorbed_query(self, q_nope, q_rope):
        """[W_UKᵀ q_C | q_R] per head, (B, H, T, d_c + d_R), scaled so that attn_fn's
        1/√(d_c + d_R) gives the logits' 1/√(d_nope + d_R)."""
        q_latent = torch.einsum("bhtn,hnc->bhtc", q_nope, self.up_weights()[0])
        q = torch.cat([q_latent, q_rope], dim=-1)
        return q * (self.scale * math.sqrt(q.shape[-1]))

    def absorbed_attention(self, q, c, k_rope, mask=None):
        """The inference path: one KV head (c_KV ‖ k_R), value c_KV. -> (B, H, Tq, d_c),
        the weighted latent that W_UV maps to each head's value afterwards."""
        return self.attn_fn(q, torch.cat([c, k_rope], dim=-1), c, mask)


def one_kv_head_as_rows(attn_fn):
    """attn_fn, but with a single KV head (the absorbed path) the H query heads become
    H·Tq query rows of one head: they all attend to the same keys and values, so this is
    the same attention, and the kernel reads each cached latent once instead of once per
    head (FlashMLA lays MLA decode out the same way; torch's sdpa with enable_gqa copies
    the keys H times on the CPU instead). Other shapes pass through unchanged."""
    def attention(q, k, v, mask=None):
        B, H, Tq, D = q.shape
        Tk = k.shape[2]
        if k.shape[1] != 1 or H == 1:
            return attn_fn(q, k, v, mask)
        if mask is None:                   # causal: query i sees keys 0 .. i + Tk - Tq
            mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(Tk - Tq)
        while mask.dim() < 4:              # broadcastable to (B, H, Tq, Tk) -> 4-D
            mask = mask[None]
        rows = mask.expand(mask.shape[0], H, Tq, Tk).reshape(mask.shape[0], 1, H * Tq, Tk)
        out = attn_fn(q.reshape(B, 1, H * Tq, D), k, v, rows)
        return out.view(B, H, Tq, -1)
    return attention


def set_absorb(model, absorb):
    """Choose the path on every MLA layer: True, False, or None (absorbed with a cache)."""
    for layer in model.layers:
        layer.attention.absorb = absorb
    return model
