"""
model.py -- the one tiny GPT every file in this repo shares.

A Llama-style decoder (Touvron et al. 2023), small enough to train on two CPU cores:
  - RMSNorm before attention and before the MLP (Zhang & Sennrich 2019): no mean, no bias;
  - rotary position embeddings (RoPE, Su et al. 2021) applied to queries and keys;
  - grouped-query attention (GQA, Ainslie et al. 2023): n_kv_head ≤ n_head key/value heads,
    each shared by n_head/n_kv_head query heads -- the KV cache shrinks by that factor;
  - SwiGLU MLP (Shazeer 2020): w2(silu(w1 x) * w3 x);
  - optionally a mixture-of-experts MLP (core/moe.py: top-k softmax router + the Switch
    Transformer load-balancing loss, Fedus et al. 2021, with a dense reference that expert
    parallelism in parallel.py must reproduce exactly; as options, DeepSeek-V3's
    fine-grained experts with always-on shared experts, sigmoid affinities and loss-free
    balancing: a routing-only bias moved by each expert's load, no loss term);
  - optionally extra next-token heads (head k predicts token t+1+k), the seam that Medusa
    and multi-token prediction in spec_decode.py build on;
  - an untied output head by default (the embedding and the head are separate matrices).

  - optionally multi-head latent attention (core/mla.py, DeepSeek-V2/V3): keys and
    values from one low-rank latent per token, which is all the cache keeps.

The attention math is ONE replaceable function per layer (`Attention.attn_fn`, signature
`attn_fn(q, k, v, mask) -> out`), so ring attention (parallelism/ring_attention.py), paged
attention (kvcache.py) and tree attention (spec_decode.py) plug in without copying the block.

This file is the model only. Opening a checkpoint (train.py's file, a quantized one, a
Hugging Face folder) is core/checkpoint.py's `load_model`; nothing here reads a file.

Costs to keep in mind while reading (Ψ = parameters, L layers, d width, T tokens):
  - parameters: ≈ L·(4d² · (1+g)/2 + 3·d·ffn) + 2·V·d with g = n_kv_head/n_head;
  - training FLOPs ≈ 6Ψ per token + 12·L·d·T per token for attention (Kaplan et al.;
    nanoGPT's MFU estimate);
  - the KV cache costs 2·L·n_kv_head·head_dim·bytes per token of context: it is what
    makes decoding fast (no recomputation) and what serving runs out of.
"""
import math
from dataclasses import dataclass, fields
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

# The model's two options live in the foundation folder and never import this file: the
# blocks below hand them this file's pieces (the expert MLP to core/moe.py; the norm, the
# rotary embedding and the attention function to core/mla.py), so the imports run one way.
from core.mla import LatentAttention
from core.moe import MoE
from core.errors import UserError


# ----------------------------------------------------------------------------------------
# Config

@dataclass
class GPTConfig:
    vocab_size: int = 4096        # must match the tokenizer (core/data.py: 256 bytes + merges + 1)
    block_size: int = 256         # longest context the model accepts (RoPE table length)
    n_layer: int = 6
    n_head: int = 6
    n_kv_head: int = 2            # GQA: n_head % n_kv_head == 0; = n_head is plain MHA
    n_embd: int = 192
    ffn_hidden: int = 0           # 0 = SwiGLU's 8/3·d rounded up to `multiple_of`
    multiple_of: int = 32
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # Mixture of experts (core/moe.py: Router, MoE):
    n_expert: int = 0             # 0 = dense MLP; > 0 = mixture of experts in every block
    expert_top_k: int = 2
    moe_aux_coef: float = 0.01    # weight of the load-balancing loss in the training loss
    # DeepSeekMoE / DeepSeek-V3 (§2.1.2) options of the same MoE (core/moe.py):
    n_shared_expert: int = 0      # always-on experts, run as ONE SwiGLU n_shared·ffn_dim wide
    moe_score: str = "softmax"    # router affinities: "softmax" (Switch) or "sigmoid" (V3)
    moe_routed_scale: float = 1.0  # the routed experts' weights × this (V3: 2.5)
    moe_balance: str = "aux"      # "aux": Switch loss only; "loss_free": + V3's routing bias
    moe_bias_rate: float = 0.001  # γ of the loss-free bias update (V3: 0.001)
    n_extra_heads: int = 0        # extra next-token heads: head k predicts token t+1+k
    extra_heads_coef: float = 0.1
    tie_embeddings: bool = False
    attn: str = "sdpa"            # "sdpa" (fused kernel) or "math" (explicit softmax(QKᵀ)V)
    init_std: float = 0.02
    # Multi-head latent attention (core/mla.py; DeepSeek-V2 §2.1): keys and values come from
    # one low-rank latent per token, which is all the cache keeps (with the rope key).
    kv_lora_rank: int = 0         # d_c; 0 = GQA as above, > 0 = MLA
    q_lora_rank: int = 0          # MLA queries through their own latent of this rank; 0 = not
    qk_rope_head_dim: int = 0     # d_R: the decoupled RoPE part of each query/key head
    qk_nope_head_dim: int = 0     # the position-free part of each query/key head; 0 = head_dim
    v_head_dim: int = 0           # MLA value head size; 0 = head_dim

    @property
    def head_dim(self):
        return self.n_embd // self.n_head

    @property
    def mla(self):
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self):
        """Width that RoPE rotates: the whole head, or MLA's decoupled rope part."""
        return self.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def kv_cache_dims(self):
        """What a KV cache stores per token and layer: (heads, key width, value width).
        GQA: n_kv_head keys and values of head_dim. MLA: one "head" whose key slot holds
        the latent c_KV (d_c) and whose value slot holds the shared rope key (d_R) --
        the caches store them without knowing which attention they serve."""
        if self.mla:
            return 1, self.kv_lora_rank, self.qk_rope_head_dim
        return self.n_kv_head, self.head_dim, self.head_dim

    @property
    def ffn_dim(self):
        if self.ffn_hidden:
            return self.ffn_hidden
        hidden = int(8 * self.n_embd / 3)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def validate(self):
        # 0 means "off" (or "the default width") for these; a negative one would silently
        # mean off too (kv_lora_rank < 0 is GQA), so it is refused by name
        for name in ("ffn_hidden", "n_expert", "n_shared_expert", "kv_lora_rank", "q_lora_rank",
                     "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_extra_heads"):
            if getattr(self, name) < 0:
                raise UserError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise UserError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.n_kv_head < 1 or self.n_head % self.n_kv_head:
            raise UserError(f"n_head={self.n_head} is not divisible by n_kv_head="
                            f"{self.n_kv_head} (each KV head serves a whole group of heads)")
        if self.rope_dim % 2 or self.rope_dim < 1:
            raise UserError(f"the rotary part of each head ({self.rope_dim}) must be even and "
                            f"positive (MLA: set qk_rope_head_dim)")
        if self.n_expert and not 1 <= self.expert_top_k <= self.n_expert:
            raise UserError(f"expert_top_k={self.expert_top_k} must be in 1..n_expert="
                            f"{self.n_expert}")
        if self.moe_score not in ("softmax", "sigmoid"):
            raise UserError(f"moe_score must be softmax or sigmoid, got {self.moe_score!r}")
        if self.moe_balance not in ("aux", "loss_free"):
            raise UserError(f"moe_balance must be aux or loss_free, got {self.moe_balance!r}")
        if self.n_shared_expert and not self.n_expert:
            raise UserError("n_shared_expert needs a mixture of experts (n_expert > 0)")
        if self.attn not in ATTENTION_FUNCTIONS:
            raise UserError(f"unknown attention {self.attn!r}: use {list(ATTENTION_FUNCTIONS)}")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be positive, got {getattr(self, name)}")
        return self


PRESETS = {
    # tests: a training step in milliseconds
    "tiny": dict(block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, vocab_size=512),
    # the default demo: trains to readable samples on 2 CPU cores in minutes
    "small": dict(block_size=256, n_layer=6, n_head=6, n_kv_head=2, n_embd=192),
    # the speculative-decoding drafter: same tokenizer, ~1/3 of small's non-embedding size
    "draft": dict(block_size=256, n_layer=2, n_head=4, n_kv_head=2, n_embd=128),
    # small with a mixture of 8 experts (top-2) in every block
    "moe": dict(block_size=256, n_layer=4, n_head=6, n_kv_head=2, n_embd=192, n_expert=8,
                expert_top_k=2, ffn_hidden=256),
    # DeepSeek-V3's ideas at moe's size: fine-grained experts (16 routed experts 64 wide,
    # top-4, where moe has 8 × 256, top-2) + 1 shared expert, sigmoid affinities, loss-free
    # balancing with V3's tiny complementary aux loss (α = 1e-4), one MTP head, and
    # multi-head latent attention (core/mla.py) in V3's proportions: d_c = 4·d_h, d_R = d_h/2,
    # queries through their own latent. V3's MTP module is sequential: depth k joins the
    # previous depth's state with the embedding of token t+k and runs a full Transformer
    # block through the shared output head; our extra head (ExtraHead) sees only the final
    # hidden state and has its own output matrix -- the same seam (head 1 predicts t+2;
    # spec_decode.py drafts with it).
    "v3": dict(block_size=256, n_layer=4, n_head=6, n_kv_head=2, n_embd=192, n_expert=16,
               expert_top_k=4, ffn_hidden=64, n_shared_expert=1, moe_score="sigmoid",
               moe_balance="loss_free", moe_aux_coef=1e-4, moe_bias_rate=0.001,
               n_extra_heads=1, kv_lora_rank=128, qk_rope_head_dim=16, q_lora_rank=64),
}


def get_config(preset="small", **overrides):
    """A preset plus overrides (None values are ignored, so argparse defaults pass through)."""
    if preset not in PRESETS:
        raise UserError(f"unknown preset {preset!r}: choose one of {', '.join(PRESETS)}")
    known = {f.name for f in fields(GPTConfig)}
    for key in overrides:
        if key not in known:
            raise UserError(f"unknown model setting {key!r}")
    values = {**PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None}}
    return GPTConfig(**values).validate()


# ----------------------------------------------------------------------------------------
# Building blocks

class RMSNorm(nn.Module):
    """x / rms(x) · g. Computed in fp32 whatever the input dtype: the mean of squares of
    bf16 numbers loses too many bits."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Zhang & Sennrich 2019: no mean subtraction and no bias (LayerNorm has both); the
        # scale g starts at 1. eps keeps a zero vector from dividing by zero; Llama uses
        # 1e-5 (cfg.norm_eps), and its export to Hugging Face carries the same value.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).type_as(x)


def rope_table(head_dim, length, theta):
    """cos and sin of position·θ_i for i < head_dim/2, θ_i = theta^(-2i/head_dim)."""
    # float64 for the table itself: position · θ_i reaches 10^4 rad at long contexts, and in
    # fp32 its rounding error alone would move the angle by ~1e-3 rad. Low i rotates fast
    # (θ_0 = 1 rad per position), high i barely moves: the pairs span many wavelengths.
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x, cos, sin):
    """Rotate each pair (x_2i, x_2i+1) by its angle. x: (B, H, T, D); cos/sin: (T, D/2) or
    (B, T, D/2) for per-sequence positions. The dot product q·k then depends only on the
    distance between the two positions."""
    if cos.dim() == 3:                       # (B, T, D/2) -> (B, 1, T, D/2)
        cos, sin = cos[:, None], sin[:, None]
    # Pairs are ADJACENT channels (Su et al.'s interleaved layout). Hugging Face's Llama
    # rotates the two halves instead (x_i with x_{i+D/2}); core/llama_format.py permutes the
    # rows of wq/wk on export and import so both layouts give the same logits.
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


def repeat_kv(x, n_rep):
    """GQA: (B, H_kv, T, D) -> (B, H_kv·n_rep, T, D), each KV head serving n_rep q heads."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def math_attention(q, k, v, mask=None):
    """softmax(q kᵀ / √d + mask) v, spelled out. q: (B, H, Tq, D); k, v: (B, H_kv, Tk, D).
    mask: None for the usual causal mask (Tq == Tk), else a bool tensor broadcastable to
    (B, H, Tq, Tk), True = may attend. Keeps the (Tq × Tk) score matrix per head alive for
    backward: the s²-term of the activation formula."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if mask is None:
        T = q.shape[-2]
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    # -inf, not a large negative number: exp(-inf) is exactly 0, so a masked key gets no
    # weight at all; the softmax runs in fp32 so bf16 scores do not lose the small ones.
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).type_as(q) @ v


def sdpa_attention(q, k, v, mask=None):
    """The same math through torch's fused scaled_dot_product_attention (flash/efficient
    kernels: the score matrix is never materialised)."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              enable_gqa=k.shape[1] != q.shape[1])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                          enable_gqa=k.shape[1] != q.shape[1])


ATTENTION_FUNCTIONS = {"sdpa": sdpa_attention, "math": math_attention}


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.wq = nn.Linear(cfg.n_embd, cfg.n_head * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * cfg.head_dim, cfg.n_embd, bias=False)
        self.attn_fn = ATTENTION_FUNCTIONS[cfg.attn]    # the replaceable part

    def forward(self, x, cos, sin, mask=None, cache=None, layer=0):
        B, T, _ = x.shape
        # Head counts come from the weights, not the config: tensor parallelism slices
        # wq/wk/wv by heads and this code keeps working on the local heads.
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:              # append this step's K/V, attend to all of them
            k, v = cache.update(layer, k, v)
        if cache is not None and cache.attention is not None:
            y = cache.attention(q, k, v, mask, self.attn_fn)    # e.g. paged: gather first
        else:
            y = self.attn_fn(q, k, v, mask)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) ⊙ w3 x). Three matrices instead of two, so the hidden size is
    8/3·d instead of 4·d to keep the parameter count of a classic 4·d GELU MLP."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.act_fn = swiglu       # replaceable: selective checkpointing wraps it

    def forward(self, x):
        return self.w2(self.act_fn(self.w1(x), self.w3(x)))


def swiglu(gate, up):
    """The MLP's elementwise middle; a function of its own so that selective activation
    checkpointing (train.py) can recompute it instead of storing its output."""
    return F.silu(gate) * up


def latent_attention(cfg):
    """Multi-head latent attention (core/mla.py: the latent, the absorbed inference path),
    built from this file's RMSNorm, RoPE and attention function -- the same pieces
    Attention uses, so an MLA model and a GQA model differ only in this layer."""
    return LatentAttention(cfg, norm=RMSNorm, rope=apply_rope,
                           attn_fn=ATTENTION_FUNCTIONS[cfg.attn])


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attention = latent_attention(cfg) if cfg.mla else Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        if cfg.n_expert:    # core/moe.py; the expert class is passed in (moe never imports us)
            self.feed_forward = MoE(cfg, FeedForward)
        else:
            self.feed_forward = FeedForward(cfg.n_embd, cfg.ffn_dim)
        # replaceable: run(fn, *args) -> fn(*args) by default; train.py's full activation
        # checkpointing sets it to its Checkpoint.apply (keep the inputs, recompute fn)
        self.run = None

    def forward(self, x, cos, sin, mask=None, cache=None, layer=0):
        if self.run is not None:
            return self.run(self.compute, x, cos, sin, mask, cache, layer)
        return self.compute(x, cos, sin, mask, cache, layer)

    def compute(self, x, cos, sin, mask=None, cache=None, layer=0):
        x = x + self.attention(self.attention_norm(x), cos, sin, mask, cache, layer)
        return x + self.feed_forward(self.ffn_norm(x))


class ExtraHead(nn.Module):
    """One extra next-token head (Medusa, Cai et al. 2024): a residual SiLU layer on the
    final hidden state, then its own vocabulary projection. Head k predicts token t+1+k."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.output = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, h):
        return self.output(h + F.silu(self.proj(h)))


# ----------------------------------------------------------------------------------------
# The KV cache: keys and values of every past position, so decoding one token costs one
# token's worth of compute instead of re-running the whole prefix.

class KVCache:
    """Contiguous per-layer buffers of shape (B, n_kv_head, max_len, head_dim). All rows of
    the batch share one length (kvcache.py's paged cache lifts that restriction).

    The cache protocol -- all that GPT.forward asks of a cache object, so the caches of
    kvcache.py (paged blocks) and spec_decode.py (a length per row) plug in:
      - `length`: positions already filled (an int). forward() starts its default
        positions and causal mask there; a cache that passes explicit positions and masks
        may keep it at 0. Rolling back rejected tokens = setting it lower;
      - `update(layer, k, v) -> (k_all, v_all)`: store this step's (B, H_kv, T, D) keys
        and values of that layer, return every key and value to attend to;
      - `advance(n)`: called once per forward after all layers, with T new tokens;
      - `attention`: None, or a function (q, k_all, v_all, mask, attn_fn) -> out that
        the layers call instead of attn_fn(q, k_all, v_all, mask) -- a cache whose keys
        are not (B, H_kv, T, D) tensors does its own attention (kvcache.PagedKVCache:
        gathers through the block tables, then runs the layer's attn_fn on the result).
    Shapes come from `cfg.kv_cache_dims`: (heads, key width, value width) -- for MLA
    (core/mla.py) the "keys" are the latents and the "values" the rope keys."""

    attention = None              # this cache's keys are plain tensors: the layer attends

    def __init__(self, cfg: GPTConfig, batch_size, max_len=None, device="cpu",
                 dtype=torch.float32, n_kv_head=None):
        self.max_len = max_len or cfg.block_size
        heads, k_dim, v_dim = cfg.kv_cache_dims
        shape = (cfg.n_layer, batch_size, n_kv_head or heads, self.max_len)
        self.k = torch.zeros(shape + (k_dim,), device=device, dtype=dtype)
        self.v = torch.zeros(shape + (v_dim,), device=device, dtype=dtype)
        self.length = 0           # positions already filled

    def update(self, layer, k, v):
        start, T = self.length, k.shape[2]
        self.k[layer, :, :, start:start + T] = k
        self.v[layer, :, :, start:start + T] = v
        return self.k[layer, :, :, :start + T], self.v[layer, :, :, :start + T]

    def advance(self, n):
        self.length += n

    @property
    def nbytes(self):
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


# ----------------------------------------------------------------------------------------
# The model

class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, seed: Optional[int] = 0):
        super().__init__()
        self.config = cfg.validate()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.output = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.extra_heads = nn.ModuleList(ExtraHead(cfg) for _ in range(cfg.n_extra_heads))
        cos, sin = rope_table(cfg.rope_dim, cfg.block_size, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.last_losses = {}     # the parts of the last training loss, for logging
        if seed is not None:
            self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed=0):
        """N(0, 0.02) everywhere, residual-output projections (wo, w2) scaled by 1/√(2L)
        (GPT-2) so the residual stream's variance does not grow with depth, norms at 1.
        Its own generator: the same seed gives the same weights on every rank, whatever
        else has consumed the global RNG."""
        gen = torch.Generator().manual_seed(seed)
        std = self.config.init_std
        for name, p in self.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
                continue
            scale = 1 / math.sqrt(2 * self.config.n_layer) if name.endswith(
                ("wo.weight", "w2.weight")) else 1.0
            p.copy_(torch.randn(p.shape, generator=gen) * std * scale)

    def num_params(self, non_embedding=False, active=False):
        """Parameters in all (the memory), or active=True: those one token's forward
        touches -- of the routed experts only top_k of n_expert per layer (the shared
        experts, the router and everything else always). DeepSeek-V3: 671B in all, 37B
        active; parallelism/planner.py's moe_params says the same from the shape (tested)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.tok_embeddings.weight.numel()
        cfg = self.config
        if active and cfg.n_expert:
            per_expert = 3 * cfg.n_embd * cfg.ffn_dim
            n -= cfg.n_layer * (cfg.n_expert - cfg.expert_top_k) * per_expert
        return n

    def flops_per_token(self, seq_len):
        """Training FLOPs per token: 6 per parameter that touches it (forward 2, backward
        4) plus the attention scores and weighted sum, 12·L·d·T (PaLM appendix B). MoE
        counts only the active experts."""
        cfg = self.config
        n = self.num_params(non_embedding=True, active=True)
        return 6 * n + 12 * cfg.n_layer * cfg.n_embd * seq_len

    def expert_loads(self):
        """(n_layer, n_expert): tokens each layer's experts received in the last forward
        (MoE.load). A training loop sums them over its micro-batches for update_expert_bias."""
        return torch.stack([layer.feed_forward.load for layer in self.layers])

    def update_expert_bias(self, loads):
        """Loss-free balancing after an optimizer step (Router.update_bias per layer), with
        the step's loads: (n_layer, n_expert), already summed over the data ranks."""
        for layer, load in zip(self.layers, loads):
            layer.feed_forward.router.update_bias(load, self.config.moe_bias_rate)

    def rope(self, positions):
        return self.rope_cos[positions], self.rope_sin[positions]

    def forward(self, idx, targets=None, positions=None, mask=None, cache=None,
                return_hidden=False, logits_at=None):
        """idx: (B, T) token ids. targets: (B, T) next tokens (-1 = ignore) -> also returns
        the loss. positions: (T,) or (B, T) absolute positions (default: continue after the
        cache, or 0..T-1). mask: None = causal, else a bool (…, T, T_total) attend-mask.
        cache: a KVCache, filled and advanced by T. logits_at: indices along T -- the head
        runs only there (a serving step needs the next token of a few positions, not
        V logits for every prompt token). Returns (logits, loss[, hidden])."""
        B, T = idx.shape
        start = cache.length if cache is not None else 0
        if positions is None:
            if start + T > self.config.block_size:
                raise UserError(f"sequence of {start + T} tokens is longer than the model's "
                                f"context (block_size={self.config.block_size})")
            positions = torch.arange(start, start + T, device=idx.device)
        elif int(positions.max()) >= self.config.block_size:
            raise UserError(f"position {int(positions.max())} is beyond the model's context "
                            f"(block_size={self.config.block_size})")
        if cache is not None and mask is None and start > 0 and T > 1:
            # New tokens attend to the whole cached prefix and causally among themselves.
            mask = torch.ones(T, start + T, dtype=torch.bool, device=idx.device).tril(start)
        elif cache is not None and mask is None and start > 0:
            mask = torch.ones(1, start + 1, dtype=torch.bool, device=idx.device)
        cos, sin = self.rope(positions)
        x = self.tok_embeddings(idx)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, cache, i)
        if cache is not None:
            cache.advance(T)
        h = self.norm(x)
        logits = self.output(h if logits_at is None else h[:, logits_at])
        loss = None
        if targets is not None:
            loss = self.loss(logits, targets, h)
        return (logits, loss, h) if return_hidden else (logits, loss)

    def loss(self, logits, targets, h):
        """Cross-entropy of the next token (+ the MoE balance loss, + the extra heads'
        losses, each with its coefficient). The parts are kept in `last_losses`."""
        ce = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)
        total, parts = ce, {"ce": ce.detach()}
        if self.config.n_expert:
            aux = sum(layer.feed_forward.aux_loss for layer in self.layers) / len(self.layers)
            total = total + self.config.moe_aux_coef * aux
            parts["moe_aux"] = aux.detach()
        extra, heads = self.extra_heads_loss(h, targets)
        total = total + extra
        parts.update(heads)
        self.last_losses = parts
        return total

    def extra_heads_loss(self, h, targets):
        """-> (coef · the mean of the extra heads' cross-entropies, each head's detached);
        head k at position t predicts token t+1+k = targets[t+k]. parallel.py's last
        pipeline stage adds the same."""
        total, parts = 0.0, {}
        for k, head in enumerate(self.extra_heads, start=1):
            extra = F.cross_entropy(head(h[:, :-k]).flatten(0, 1).float(),
                                    targets[:, k:].flatten(), ignore_index=-1)
            total = total + self.config.extra_heads_coef * extra / len(self.extra_heads)
            parts[f"head{k}"] = extra.detach()
        return total, parts

    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
                 seed=None, eos_id=None):
        """Autoregressive sampling with the KV cache: one forward over the prompt (prefill),
        then one token at a time (decode). prompt_ids: a list of ints, or a (B, T) tensor of
        equal-length prompts. Returns the new tokens (list, or (B, n) tensor). Stops early
        when every row has produced eos_id."""
        as_list = not torch.is_tensor(prompt_ids)
        device = self.output.weight.device
        idx = torch.tensor([prompt_ids] if as_list else prompt_ids.tolist(), device=device)
        if idx.shape[1] == 0:
            raise UserError("generate() needs a prompt of at least one token")
        if idx.shape[1] + max_new_tokens > self.config.block_size:
            raise UserError(f"prompt ({idx.shape[1]}) + max_new_tokens ({max_new_tokens}) "
                            f"exceeds the context (block_size={self.config.block_size})")
        gen = torch.Generator(device=device)
        gen.manual_seed(seed if seed is not None else torch.seed())
        cache = KVCache(self.config, idx.shape[0], idx.shape[1] + max_new_tokens,
                        device=device, dtype=self.output.weight.dtype)
        logits, _ = self(idx, cache=cache)
        new, done = [], torch.zeros(idx.shape[0], dtype=torch.bool, device=device)
        for i in range(max_new_tokens):
            nxt = sample_next(logits[:, -1], temperature, top_k, top_p, gen)
            new.append(nxt)
            if eos_id is not None:
                done |= nxt == eos_id
            if i == max_new_tokens - 1 or bool(done.all()):
                break                     # no forward for a token nobody will sample from
            logits, _ = self(nxt[:, None], cache=cache)
        out = torch.stack(new, dim=1) if new else idx[:, :0]
        return out[0].tolist() if as_list else out


def sample_next(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """One token per row from (B, V) logits. temperature 0 = greedy. top_k keeps the k most
    likely tokens; top_p keeps the smallest set whose probability reaches p (nucleus
    sampling, Holtzman et al. 2019). Shared by generate(), spec_decode.py and serve.py."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p   # keep the token that crosses p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
