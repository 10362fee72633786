"""
core/moe.py -- mixture of experts: the MLP of a block as many MLPs, each token sent to a few.
A part of the foundation: the routed MLP that model.py builds into a block when a config
asks for experts (the decoder around it stays in model.py).

  - the Switch router + load-balancing loss (Fedus et al. 2021): top-k of n_expert
    SwiGLU MLPs per token, softmax affinities, aux = E · Σ_i f_i · P_i added to the loss;
  - DeepSeek-V3's fine-grained routed + shared experts (DeepSeekMoE, Dai et al. 2024):
    many narrow experts, a larger k, plus always-on shared experts;
  - the sigmoid gate (DeepSeek-V3 eq. 13-15): each expert's affinity judged on its own,
    the chosen ones normalised over the top-k and scaled;
  - loss-free balancing (Wang et al. 2024; V3 §2.1.2): a routing-only bias per expert,
    moved by each expert's load after the optimizer step -- balance without a loss term;
  - a dense reference (every expert on every token) that the sparse forward and expert
    parallelism (parallel.py) are tested against.
  saves: FLOPs -- a token pays for k (+ shared) MLPs while the model holds n_expert;
  adds: memory for every expert, the router, and across devices an all-to-all each way;
  sacrifices: with the aux loss, a little language-model loss pulled toward balance;
    without balancing, idle experts (and, under expert parallelism, idle devices).

The seam with model.py: this file never imports it (model.py imports this one). MoE takes the
expert MLP's class as an argument,
`MoE(cfg, FeedForward)` in model.Block: any `expert_mlp(dim, hidden)` module works.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Router(nn.Module):
    """The gate of a mixture of experts: each token's affinities s for the experts, and its
    top-k experts with their weights.
      softmax (Switch, Mixtral): s = softmax(Wx); top-k on s; weights = the chosen s
        renormalised to sum to 1 (= Mixtral's softmax over the top-k logits);
      sigmoid (DeepSeek-V3 eq. 13-15): s_i = σ(w_i·x), each expert judged on its own; top-k
        on s + b; weights = the chosen s (without b) normalised over the top-k; both ×
        routed_scale (V3: 2.5).
    Loss-free balancing (Wang et al. 2024; V3 §2.1.2): b is a buffer, never a parameter: it
    decides WHICH experts a token goes to (a top-k index has no gradient), never how much
    they count, so balance costs no loss term pulling against the language model. After
    each optimizer step the training loop calls update_bias with the step's loads.
    The parameter is named `weight` (router.weight), as the nn.Linear it replaces."""

    def __init__(self, cfg):
        """cfg: a model.GPTConfig (n_expert, n_embd, moe_score, moe_routed_scale,
        moe_balance)."""
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_expert, cfg.n_embd))
        self.score = cfg.moe_score
        self.routed_scale = cfg.moe_routed_scale
        bias = torch.zeros(cfg.n_expert) if cfg.moe_balance == "loss_free" else None
        self.register_buffer("expert_bias", bias)     # in the checkpoint: training resumes

    def forward(self, x_flat):
        """The router logits (N, E); a module call, so hooks (quantize.py) see its input."""
        return F.linear(x_flat, self.weight)

    def gate(self, x_flat, top_k):
        """-> (each token's affinities normalised to sum to 1 (N, E) fp32 -- the P_i of the
        balance loss --, top-k weights (N, k), top-k expert ids (N, k))."""
        logits = self(x_flat).float()
        scores = logits.sigmoid() if self.score == "sigmoid" else logits.softmax(-1)
        choice = scores if self.expert_bias is None else scores + self.expert_bias.float()
        ids = choice.topk(top_k, dim=-1).indices
        weights = scores.gather(-1, ids)
        weights = weights / weights.sum(-1, keepdim=True) * self.routed_scale
        shares = scores if self.score == "softmax" else scores / scores.sum(-1, keepdim=True)
        return shares, weights, ids

    @torch.no_grad()
    def update_bias(self, load, rate):
        """Loss-free balancing, one step: b_i += γ·sign(mean load − load_i). load: (E,)
        tokens per expert over the whole optimizer step (summed over micro-batches, and over
        the data-parallel ranks first, so every rank's bias stays identical)."""
        load = load.to(self.expert_bias.device).float()
        self.expert_bias += rate * torch.sign(load.mean() - load).to(self.expert_bias.dtype)


class MoE(nn.Module):
    """Mixture of experts: a router picks top-k of n_expert SwiGLU MLPs per token, plus
    n_shared always-on experts (DeepSeekMoE, Dai et al. 2024).

    Compute per token is k (+ shared) MLPs while parameters are n_expert (+ shared): free
    FLOPs paid for in memory and, across devices, all-to-all. Fine-grained experts: many
    narrow ones and a larger k at the same FLOPs, more combinations to specialise. Shared
    experts learn once what every token needs. n_shared experts ffn_dim wide are ONE SwiGLU
    n_shared·ffn_dim wide (the same function), as DeepSeek-V3's code runs them.

    Balance loss (Switch Transformer, eq. 4): aux = E · Σ_i f_i · P_i, f_i the fraction of
    (token, slot) pairs sent to expert i, P_i its mean normalised affinity; 1 when uniform.
    With moe_balance="loss_free" it stays as the small complementary loss (V3: per sequence,
    α = 1e-4; ours: over the micro-batch, the statistics expert parallelism all-reduces).

    Kept from the last forward, for the loss and the training loops: `aux_loss` and `load`
    (tokens routed to each expert, (E,))."""

    def __init__(self, cfg, expert_mlp):
        """cfg: a model.GPTConfig. expert_mlp: the class of one expert, called as
        expert_mlp(dim, hidden) (model.FeedForward, the SwiGLU MLP): passed in so that this
        file need not import model.py, which imports it."""
        super().__init__()
        self.top_k = cfg.expert_top_k
        self.router = Router(cfg)
        self.experts = nn.ModuleList(expert_mlp(cfg.n_embd, cfg.ffn_dim)
                                     for _ in range(cfg.n_expert))
        self.shared_experts = None
        if cfg.n_shared_expert:
            self.shared_experts = expert_mlp(cfg.n_embd, cfg.n_shared_expert * cfg.ffn_dim)
        self.aux_loss = None
        self.load = None

    def gate(self, x_flat):
        """-> (normalised affinities (N, E) fp32, top-k weights (N, k), top-k expert ids
        (N, k)). Shared by the forwards below and by expert parallelism (parallel.py), so
        every path routes identically (it reads only .router and .top_k)."""
        return self.router.gate(x_flat, self.top_k)

    def route(self, x_flat):
        """-> (top-k weights (N, k), top-k expert ids (N, k), aux loss over these tokens);
        keeps this forward's tokens per expert in self.load."""
        probs, weights, ids = self.gate(x_flat)
        n_expert = probs.shape[-1]
        counts = torch.zeros(n_expert, device=x_flat.device).index_add_(
            0, ids.flatten(), torch.ones(ids.numel(), device=x_flat.device))
        self.load = counts
        aux = n_expert * (counts / ids.numel() * probs.mean(0)).sum()
        return weights.type_as(x_flat), ids, aux

    def shared(self, x_flat):
        """The shared experts' output (0 without them): every token, no routing."""
        return 0 if self.shared_experts is None else self.shared_experts(x_flat)

    def forward(self, x):
        """Sparse computation: each expert runs only on the tokens routed to it."""
        B, T, D = x.shape
        x_flat = x.reshape(-1, D)
        weights, ids, self.aux_loss = self.route(x_flat)
        out = torch.zeros_like(x_flat)
        for e, expert in enumerate(self.experts):
            token, slot = (ids == e).nonzero(as_tuple=True)
            if token.numel():
                out.index_add_(0, token, expert(x_flat[token]) * weights[token, slot, None])
        return (out + self.shared(x_flat)).view(B, T, D)

    def forward_dense(self, x):
        """The reference: every expert on every token, weighted by a gate that is zero for
        unchosen experts, plus the shared experts. Slow (n_expert MLPs per token) and
        obviously right; MoE.forward and expert parallelism are tested against it."""
        B, T, D = x.shape
        x_flat = x.reshape(-1, D)
        weights, ids, self.aux_loss = self.route(x_flat)
        gate = torch.zeros(x_flat.shape[0], len(self.experts), dtype=x.dtype, device=x.device)
        gate.scatter_add_(1, ids, weights)
        outs = torch.stack([expert(x_flat) for expert in self.experts], dim=1)  # (N, E, D)
        return ((gate[:, :, None] * outs).sum(1) + self.shared(x_flat)).view(B, T, D)


if __name__ == "__main__":
    print(__doc__.strip())
    print("\nmoe.py is a library: model.py builds it into every block of a model with "
          "n_expert > 0 (e.g. python train.py --preset moe or --preset v3).")
