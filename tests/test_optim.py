# optim.py: every hand-written optimizer equals torch.optim's, bit for bit, over 20 steps on
# the tiny GPT; Newton–Schulz lands singular values in the band and keeps the singular
# vectors; QK-clip scales each head's logits by exactly τ/S_max and keeps exploding logits
# near τ; sharded Muon over 2 real processes equals one process.
# This file is also the worker the torchrun test launches (see the bottom).
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import optim                                    # noqa: E402
from training import qk_clip                     # noqa: E402
from model import GPT, get_config               # noqa: E402
from core.errors import UserError  # noqa: E402

STEPS = 20


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.py: tiny tensors, one thread


def tiny_model(**overrides):
    return GPT(get_config("tiny", **overrides), seed=0)


def batch(step, cfg, B=4, T=16):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(cfg.vocab_size, (B, T + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def train(model, opt, steps=STEPS):
    for s in range(steps):
        model(*batch(s, model.config))[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def assert_same_training(make_hand, make_ref, select=lambda n, p: True, steps=STEPS):
    """Two identical models, one stepped by the hand optimizer, one by torch's: after
    `steps` steps the weights must be bit-for-bit equal (the hand versions do the same
    float operations in the same order as torch's single-tensor code), and have moved."""
    a, b = tiny_model(), tiny_model()
    init = {n: p.detach().clone() for n, p in a.named_parameters()}
    hand = make_hand([p for n, p in a.named_parameters() if select(n, p)])
    ref = make_ref([p for n, p in b.named_parameters() if select(n, p)])
    train(a, hand, steps), train(b, ref, steps)
    moved = 0.0
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=lambda m: f"{n}: {m}")
        moved = max(moved, (pa - init[n]).abs().max().item())
    assert moved > 1e-3, "the optimizer did not move the weights: the comparison is vacuous"


# ---- the lineage: SGD, momentum, Nesterov, RMSProp, Adam, AdamW ----------------------------

@pytest.mark.parametrize("kw", [dict(), dict(weight_decay=0.1), dict(momentum=0.9),
                                dict(momentum=0.9, dampening=0.5, weight_decay=0.01),
                                dict(momentum=0.9, nesterov=True)])
def test_sgd_equals_torch(kw):
    assert_same_training(lambda ps: optim.SGD(ps, lr=0.5, **kw),
                         lambda ps: torch.optim.SGD(ps, lr=0.5, foreach=False, **kw))


@pytest.mark.parametrize("kw", [dict(), dict(centered=True), dict(momentum=0.9),
                                dict(centered=True, momentum=0.5, weight_decay=0.01)])
def test_rmsprop_equals_torch(kw):
    assert_same_training(lambda ps: optim.RMSprop(ps, lr=1e-3, **kw),
                         lambda ps: torch.optim.RMSprop(ps, lr=1e-3, foreach=False, **kw))


@pytest.mark.parametrize("kw", [dict(), dict(weight_decay=0.1), dict(amsgrad=True),
                                dict(betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05,
                                     amsgrad=True)])
def test_adam_equals_torch(kw):
    assert_same_training(lambda ps: optim.Adam(ps, lr=3e-3, **kw),
                         lambda ps: torch.optim.Adam(ps, lr=3e-3, foreach=False, **kw))


@pytest.mark.parametrize("kw", [dict(), dict(weight_decay=0.0), dict(weight_decay=0.5),
                                dict(amsgrad=True, weight_decay=0.1, betas=(0.9, 0.95))])
def test_adamw_equals_torch(kw):
    assert_same_training(lambda ps: optim.AdamW(ps, lr=3e-3, **kw),
                         lambda ps: torch.optim.AdamW(ps, lr=3e-3, foreach=False, **kw))


def test_adamw_is_not_adam_with_l2():
    """Decoupled decay is a different algorithm: with the same weight_decay the weights
    differ from Adam's (so the two tests above cannot both pass by accident)."""
    a, b = tiny_model(), tiny_model()
    train(a, optim.AdamW(a.parameters(), lr=3e-3, weight_decay=0.5), 5)
    train(b, optim.Adam(b.parameters(), lr=3e-3, weight_decay=0.5), 5)
    assert (a.output.weight - b.output.weight).abs().max() > 1e-4


# ---- Muon --------------------------------------------------------------------------------

@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_equals_torch(adjust, nesterov):
    kw = dict(lr=0.02, momentum=0.95, nesterov=nesterov, adjust_lr_fn=adjust, weight_decay=0.1)
    assert_same_training(lambda ps: optim.Muon(ps, **kw), lambda ps: torch.optim.Muon(ps, **kw),
                         select=optim.is_hidden_matrix)


def test_hybrid_equals_torch_muon_plus_adamw():
    """build_optimizer("muon") = torch Muon on the hidden matrices + torch AdamW on the
    embedding, head (decayed) and norms (not decayed); set_lr keeps Muon's own lr."""
    a, b = tiny_model(), tiny_model()
    hybrid = optim.build_optimizer(a.named_parameters(), "muon", lr=3e-3, muon_lr=0.02,
                                   weight_decay=0.1, adjust_lr_fn="original")
    kinds = {g["algo"]: g["params"] for g in hybrid.param_groups}
    hidden = [p for n, p in a.named_parameters() if n.startswith("layers.") and p.dim() == 2]
    assert len(kinds["muon"]) == len(hidden) == 2 * 7
    named = dict(b.named_parameters())
    muon = torch.optim.Muon([p for n, p in named.items() if optim.is_hidden_matrix(n, p)],
                            lr=0.02, weight_decay=0.1, adjust_lr_fn="original")
    adamw = torch.optim.AdamW(
        [{"params": [named["tok_embeddings.weight"], named["output.weight"]]},
         {"params": [p for p in named.values() if p.dim() == 1], "weight_decay": 0.0}],
        lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    for s in range(STEPS):
        lr_factor = 0.5 + 0.5 * math.cos(math.pi * s / STEPS)     # a schedule, like train.py
        optim.set_lr(hybrid, 3e-3 * lr_factor)
        muon.param_groups[0]["lr"] = 0.02 * lr_factor
        for g in adamw.param_groups:
            g["lr"] = 3e-3 * lr_factor
        for model, opts in ((a, [hybrid]), (b, [muon, adamw])):
            model(*batch(s, model.config))[1].backward()
            for o in opts:
                o.step()
                o.zero_grad()
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=lambda m: f"{n}: {m}")
    state = hybrid.state_dict()                      # one optimizer, one state_dict
    assert len(state["state"]) == len(list(a.parameters()))


def test_hybrid_state_dict_resumes_exactly():
    """train.py's --resume: 5 steps, state_dict -> a fresh optimizer, 5 more steps ==
    10 steps straight (momentum, Adam moments and step counts all travel)."""
    def make(model):
        return optim.build_optimizer(model.named_parameters(), "muon", lr=3e-3, muon_lr=0.02)
    a, b = tiny_model(), tiny_model()
    opt_a = make(a)
    train(a, opt_a, 10)
    opt_b = make(b)
    train(b, opt_b, 5)
    saved = opt_b.state_dict()
    opt_b = make(b)
    opt_b.load_state_dict(saved)
    for s in range(5, 10):
        b(*batch(s, b.config))[1].backward()
        opt_b.step()
        opt_b.zero_grad()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def _ns_reference(sigma, steps=5):
    a, b, c = optim.NS_COEFFICIENTS
    x = sigma
    for _ in range(steps):
        x = a * x + b * x ** 3 + c * x ** 5
    return x


def _low_rank_plus_noise(m, n, gen):
    U = torch.linalg.qr(torch.randn(m, 4, generator=gen))[0]
    V = torch.linalg.qr(torch.randn(n, 4, generator=gen))[0]
    return U @ torch.diag(torch.tensor([10.0, 5.0, 2.0, 1.0])) @ V.T + \
        1e-3 * torch.randn(m, n, generator=gen)


@pytest.mark.parametrize("shape", [(64, 32), (32, 96), (48, 48), (160, 64)])
@pytest.mark.parametrize("kind", ["random", "low_rank_plus_noise"])
def test_newton_schulz_band_and_singular_vectors(shape, kind):
    gen = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    G = torch.randn(shape, generator=gen) if kind == "random" else _low_rank_plus_noise(*shape, gen)
    U, S, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    rel = S / S.norm()                           # what NS sees after the Frobenius division
    # "non-negligible": above 0.2% of ‖G‖_F in fp32; in bf16 above 1%, because rounding G
    # to bf16 (2^-9 per entry) itself adds directions of about that size, which NS then
    # amplifies like any other (we check: it does not mix them into the strong ones).
    for dtype, floor, off_tol in ((torch.float32, 2e-3, 1e-5), (torch.bfloat16, 1e-2, 3e-2)):
        keep = rel > floor
        assert keep.sum() >= 4
        O = optim.newton_schulz(G, dtype=dtype).double()
        assert O.shape == G.shape
        M = U.T @ O @ Vh.T                       # O in the input's singular bases
        d = M.diagonal()
        assert ((d[keep] > 0.5) & (d[keep] < 1.5)).all(), d[keep]
        off = M - torch.diag(d)
        # same singular vectors: M is diagonal on (and off) the kept directions
        check = torch.cat([off[keep], off[:, keep].T])
        assert check.abs().max() < off_tol, check.abs().max()
        if dtype == torch.float32:
            # nothing outside the input's row/column spaces: O = U M Vᵀ ...
            assert (O - U @ M @ Vh).norm() < 1e-4 * O.norm()
            # ... and each σ goes through σ ← aσ + bσ³ + cσ⁵ five times, on its own
            torch.testing.assert_close(d, _ns_reference(rel), rtol=1e-4, atol=1e-5)
            assert off.abs().max() < off_tol


# ---- QK-clip ------------------------------------------------------------------------------

def _max_logits(clip, x):
    """A forward through the QK-clip recorders; they keep the maxima for clip.apply()."""
    clip.maxima = [None] * len(clip.maxima)
    with torch.no_grad():
        clip.model(x)
    return torch.stack(clip.maxima)                                          # (L, H)


def test_recorder_is_exact_and_does_not_change_outputs():
    model = tiny_model(attn="math")
    x, y = batch(0, model.config)
    logits0 = model(x)[0]
    clip = qk_clip.QKClip(model, tau=1.0)
    torch.testing.assert_close(model(x)[0], logits0, rtol=0, atol=0)
    recorded = _max_logits(clip, x)
    # brute force: rebuild q, k of layer 0 by hand from the model's own weights
    attn, h = model.layers[0].attention, model.layers[0].attention_norm(model.tok_embeddings(x))
    from model import apply_rope
    B, T = x.shape
    cos, sin = model.rope(torch.arange(T))
    q = apply_rope(attn.wq(h).view(B, T, -1, attn.head_dim).transpose(1, 2), cos, sin)
    k = apply_rope(attn.wk(h).view(B, T, -1, attn.head_dim).transpose(1, 2), cos, sin)
    k = k.repeat_interleave(attn.n_head // attn.n_kv_head, dim=1)
    s = (q @ k.transpose(-2, -1)) / math.sqrt(attn.head_dim)
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
    torch.testing.assert_close(recorded[0], s.amax(dim=(0, 2, 3)).detach())


def measure(model, x, clip=None):
    """Per-head max logit (L, H) of model on x, through a probe QKClip removed afterwards;
    the recorded maxima of `clip` (the model's own, if any) are left as they were."""
    fns = [layer.attention.attn_fn for layer in model.layers]
    stash = list(clip.maxima) if clip is not None else None
    probe = qk_clip.QKClip(model, tau=1.0)
    with torch.no_grad():
        model(x)
    for layer, fn in zip(model.layers, fns):
        layer.attention.attn_fn = fn
    if clip is not None:
        clip.maxima = stash
    return torch.stack(probe.maxima)


def test_qk_clip_bounds_exploding_logits():
    """A large Muon lr drives the attention logits up: without QK-clip they pass 3τ and
    keep growing. With it (both GQA modes): every step, the factors are τ/S_max of the
    offending heads (per head, or the KV group's smallest), layer 0's logits scale by
    exactly those factors, and the max logit after each step stays within one update's
    growth of τ (K2 clips with the forward's S_max, before the update: here < 1.5τ)."""
    tau, steps, peaks = 1.0, 40, {}
    for gqa in ("off", "group", "query"):
        model = tiny_model()
        opt = optim.build_optimizer(model.named_parameters(), "muon", lr=0.01, muon_lr=0.05,
                                    weight_decay=0.0)
        clip = qk_clip.QKClip(model, tau=tau, gqa=gqa) if gqa != "off" else None
        peaks[gqa] = []
        for s in range(steps):
            x, y = batch(s % 2, model.config)
            model(x, y)[1].backward()
            opt.step()
            opt.zero_grad()
            logits = measure(model, x, clip)           # the updated weights, before the clip
            if gqa != "off":
                S = torch.stack(clip.maxima)
                factors = torch.stack(clip.apply())
                want = torch.where(S > tau, tau / S, torch.ones_like(S))
                if gqa == "group":                      # each head: its group's smallest
                    want = want.view(len(S), -1, 2).amin(-1).repeat_interleave(2, -1)
                torch.testing.assert_close(factors, want)
                post = measure(model, x, clip)
                # layer 0 sees the same input, so its logits scale exactly (deeper layers
                # also see the effect of the clip upstream)
                torch.testing.assert_close(post[0], logits[0] * factors[0], rtol=1e-4, atol=1e-5)
                logits = post
            peaks[gqa].append(logits.max().item())
    assert max(peaks["off"]) > 3 * tau, "the test did not make the logits explode"
    for gqa in ("group", "query"):
        assert max(peaks[gqa]) < 1.5 * tau, (gqa, peaks[gqa])
        assert sum(p > tau for p in peaks[gqa]) >= 10, "the clip was never needed"


def test_qk_clip_without_an_update_lands_exactly_on_tau():
    """The clip alone (no optimizer step between the forward and the clip): every head's
    max logit ends <= τ, offending heads exactly at τ ('query') / the group max at τ."""
    for gqa in ("group", "query"):
        model = tiny_model(n_layer=1)      # one layer: the clip changes nothing upstream
        attn = model.layers[0].attention
        with torch.no_grad():
            attn.wq.weight.mul_(torch.linspace(5, 60, 4).repeat_interleave(8)[:, None])
            attn.wk.weight.mul_(20)
        x = batch(0, model.config)[0]
        clip = qk_clip.QKClip(model, tau=2.0, gqa=gqa)
        pre = _max_logits(clip, x)
        assert pre.max() > 4
        clip.apply()
        post = measure(model, x, clip)
        assert post.max() <= 2.0 * (1 + 1e-5)
        if gqa == "query":
            torch.testing.assert_close(post, torch.minimum(pre, torch.tensor(2.0)))
        else:
            torch.testing.assert_close(post.view(2, 2).amax(-1),
                                       torch.minimum(pre.view(2, 2).amax(-1), torch.tensor(2.0)))


def test_qk_clip_gqa_modes_scale_the_right_rows():
    """n_head 4, n_kv_head 2: fake a recorded max of 2τ on head 1 only (KV group 0).
    group: heads 0, 1 and K head 0 scaled by √(1/2); query: only head 1's W_q by 1/2."""
    tau = 5.0
    for gqa, q_expect, k_expect in (("group", [2 ** -0.5] * 2 + [1, 1], [2 ** -0.5, 1]),
                                    ("query", [1, 0.5, 1, 1], [1, 1])):
        model = tiny_model()
        clip = qk_clip.QKClip(model, tau=tau, gqa=gqa)
        attn, hd = model.layers[0].attention, model.config.head_dim
        wq, wk = attn.wq.weight.detach().clone(), attn.wk.weight.detach().clone()
        clip.maxima[0] = torch.tensor([1.0, 2 * tau, 4.0, -3.0])
        master = {attn.wq.weight: wq.clone().double()}
        factors = clip.apply(copies=master)
        q_rows = torch.tensor(q_expect).repeat_interleave(hd)[:, None]
        k_rows = torch.tensor(k_expect).repeat_interleave(hd)[:, None]
        torch.testing.assert_close(attn.wq.weight, wq * q_rows)
        torch.testing.assert_close(attn.wk.weight, wk * k_rows)
        torch.testing.assert_close(master[attn.wq.weight], (wq * q_rows).double())
        assert clip.maxima == [None, None] and len(factors) == 1   # layer 1 recorded nothing


# ---- QK-clip on multi-head latent attention (mla.py) ---------------------------------------

MLA = dict(kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=5)


def mla_logits(model, x, layer=0):
    """(B, H, T, T) logits of an MLA layer (-inf where causally masked), by the paper's
    equation from the raw weights: (q_C,h·W_UK,h c + RoPE(q_R,h)·RoPE(k_R)) / √(d_nope+d_R),
    the rotary key k_R one vector for all heads."""
    from model import apply_rope
    attn = model.layers[layer].attention
    n, r, dv = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim
    h = model.tok_embeddings(x)
    for block in model.layers[:layer]:
        h = block(h, *model.rope(torch.arange(x.shape[1])))
    h = model.layers[layer].attention_norm(h)
    B, T = x.shape
    cos, sin = model.rope(torch.arange(T))
    q = attn.query_proj(attn.q_norm(attn.wq_a(h)) if hasattr(attn, "wq_a") else h)
    q = q.view(B, T, -1, n + r).transpose(1, 2)
    c = attn.kv_norm(attn.wkv_a(h)[..., :attn.kv_lora_rank])
    k_rope = apply_rope(attn.wkv_a(h)[:, None, :, attn.kv_lora_rank:], cos, sin)
    w_uk = attn.wkv_b.weight.view(-1, n + dv, attn.kv_lora_rank)[:, :n]
    k_nope = torch.einsum("btc,hnc->bhtn", c, w_uk)
    s = q[..., :n] @ k_nope.transpose(-2, -1)
    s = s + apply_rope(q[..., n:], cos, sin) @ k_rope.transpose(-2, -1)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return (s / math.sqrt(n + r)).masked_fill(~causal, -math.inf).detach()


@pytest.mark.parametrize("absorb", [False, True], ids=["unabsorbed", "absorbed"])
def test_qk_clip_mla_records_the_real_logits(absorb):
    """Both of mla.py's paths hand the recorder queries and keys whose q·k/√(width) are
    MLA's logits (the absorbed query is pre-scaled for its wider latent keys)."""
    from core import mla
    model = mla.set_absorb(tiny_model(**MLA, attn="math"), absorb)
    x = batch(0, model.config)[0]
    logits0 = model(x)[0]
    clip = qk_clip.QKClip(model, tau=1.0)
    torch.testing.assert_close(model(x)[0], logits0, rtol=0, atol=0)
    recorded = _max_logits(clip, x)
    for layer in range(2):
        want = mla_logits(model, x, layer).amax(dim=(0, 2, 3))
        torch.testing.assert_close(recorded[layer], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_lora_rank", [0, 8], ids=["wq", "wq_b"])
@pytest.mark.parametrize("gqa", ["group", "query"])
def test_qk_clip_mla_scales_head_specific_rows_never_the_shared_rope_key(q_lora_rank, gqa):
    """Fake maxima [1, 2τ, 4τ, -3] (γ = 1, 1/2, 1/4, 1): per head, q_C rows × √γ, q_R rows
    × γ, k_C rows of wkv_b × √γ; value rows, wkv_a (latent and shared rope key), the
    query latent and the other heads untouched; the master copies follow."""
    tau, gamma = 5.0, torch.tensor([1.0, 0.5, 0.25, 1.0])
    model = tiny_model(**MLA, q_lora_rank=q_lora_rank)
    attn = model.layers[0].attention
    n, r, dv = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim
    before = {k: v.detach().clone() for k, v in attn.state_dict().items()}
    qname = "wq_b.weight" if q_lora_rank else "wq.weight"
    master = {attn.wkv_b.weight: before["wkv_b.weight"].double()}
    clip = qk_clip.QKClip(model, tau=tau, gqa=gqa)
    clip.maxima[0] = torch.tensor([1.0, 2 * tau, 4 * tau, -3.0])
    factors = clip.apply(copies=master)
    torch.testing.assert_close(factors[0], gamma)
    q_rows = torch.cat([gamma.sqrt()[:, None].expand(4, n), gamma[:, None].expand(4, r)], 1)
    kv_rows = torch.cat([gamma.sqrt()[:, None].expand(4, n), torch.ones(4, dv)], 1)
    after = attn.state_dict()
    torch.testing.assert_close(after[qname], before[qname] * q_rows.reshape(-1, 1))
    torch.testing.assert_close(after["wkv_b.weight"],
                               before["wkv_b.weight"] * kv_rows.reshape(-1, 1))
    torch.testing.assert_close(master[attn.wkv_b.weight], after["wkv_b.weight"].double())
    for name in before:
        if name not in (qname, "wkv_b.weight"):     # wkv_a: its rope rows above all
            assert torch.equal(after[name], before[name]), name
    assert clip.maxima == [None, None] and len(factors) == 1


def test_qk_clip_mla_without_an_update_lands_exactly_on_tau():
    """One MLA layer with exploding heads (query rows, k_C rows and the rope key boosted):
    after the clip alone every logit of head h is γ_h times what it was -- the q_C·k_C and
    the q_R·k_R terms alike -- so offending heads peak exactly at τ, the others unchanged,
    and the shared rope key's weights are bit-for-bit what they were."""
    tau = 2.0
    model = tiny_model(**MLA, n_layer=1)
    attn = model.layers[0].attention
    with torch.no_grad():
        attn.wq.weight.mul_(torch.tensor([1.0, 8, 30, 60]).repeat_interleave(10)[:, None])
        attn.wkv_b.weight.mul_(10)
        attn.wkv_a.weight[attn.kv_lora_rank:].mul_(20)
    rope_key = attn.wkv_a.weight.detach().clone()
    x = batch(0, model.config)[0]
    clip = qk_clip.QKClip(model, tau=tau)
    pre = _max_logits(clip, x)[0]
    assert pre[0] < tau < pre[1] and pre.max() > 4 * tau    # head 0 healthy, others not
    logits = mla_logits(model, x)
    factors = clip.apply()[0]
    torch.testing.assert_close(mla_logits(model, x), logits * factors[None, :, None, None],
                               rtol=1e-4, atol=1e-4)
    post = measure(model, x, clip)[0]
    torch.testing.assert_close(post, torch.minimum(pre, torch.tensor(tau)), rtol=1e-5, atol=1e-5)
    assert torch.equal(attn.wkv_a.weight, rope_key)


@pytest.mark.slow
def test_qk_clip_mla_bounds_exploding_logits_under_muon():
    """MLA trained by Muon at a large lr: without QK-clip the max logit passes 3τ; with it,
    each step's factors are τ/S_max of the offending heads, layer 0's logits scale by
    exactly them (both terms of every head's logit), and the max stays within one
    update's growth of τ (< 2τ here)."""
    tau, peaks = 0.5, {}
    for mode in ("off", "clip"):
        model = tiny_model(**MLA)
        opt = optim.build_optimizer(model.named_parameters(), "muon", lr=0.01, muon_lr=0.05,
                                    weight_decay=0.0)
        clip = qk_clip.QKClip(model, tau=tau) if mode == "clip" else None
        peaks[mode] = []
        for s in range(40):
            x, y = batch(s % 2, model.config)
            model(x, y)[1].backward()
            opt.step()
            opt.zero_grad()
            logits = measure(model, x, clip)           # the updated weights, before the clip
            if clip is not None:
                S = torch.stack(clip.maxima)
                factors = torch.stack(clip.apply())
                torch.testing.assert_close(factors, torch.where(S > tau, tau / S,
                                                                torch.ones_like(S)))
                post = measure(model, x, clip)
                torch.testing.assert_close(post[0], logits[0] * factors[0], rtol=1e-4, atol=1e-5)
                logits = post
            peaks[mode].append(logits.max().item())
    assert max(peaks["off"]) > 3 * tau, "the test did not make the logits explode"
    assert max(peaks["clip"]) < 2 * tau, peaks["clip"]
    assert sum(p > tau for p in peaks["clip"]) >= 10, "the clip was never needed"


# ---- errors, builder, sharding --------------------------------------------------------------

def test_bad_inputs_raise_one_line_errors():
    model = tiny_model()
    norm = model.norm.weight
    with pytest.raises(UserError, match="2-D"):
        optim.Muon([norm])
    with pytest.raises(UserError, match="lr must be >= 0"):
        optim.AdamW(model.parameters(), lr=-1)
    with pytest.raises(UserError, match="betas"):
        optim.Adam(model.parameters(), betas=(0.9, 1.0))
    with pytest.raises(UserError, match="Nesterov"):
        optim.SGD(model.parameters(), nesterov=True)
    with pytest.raises(UserError, match="adjust_lr_fn"):
        optim.Muon([model.output.weight], adjust_lr_fn="bogus")
    with pytest.raises(UserError, match="unknown optimizer"):
        optim.build_optimizer(model.named_parameters(), "lion")
    with pytest.raises(UserError, match="> 0"):
        optim.build_optimizer(model.named_parameters(), "muon", lr=0)
    with pytest.raises(UserError, match="tau"):
        qk_clip.QKClip(model, tau=0)
    with pytest.raises(UserError, match="GQA"):
        qk_clip.QKClip(model, tau=1, gqa="key")
    with pytest.raises(UserError, match="empty"):
        optim.SGD([])
    with pytest.raises(UserError, match="matrix"):
        optim.newton_schulz(torch.ones(3))
    with pytest.raises(UserError, match="must be at least 1"):
        optim.parse_args(["--steps", "0"])


def test_sharding_assigns_every_matrix_once_and_balances():
    params = [torch.zeros(s) for s in [(64, 32), (32, 32), (32, 96), (16, 16), (64, 64)]]
    opt = optim.Muon(params, rank=1, world_size=2)
    assert set(opt.owner) == set(params) and set(opt.owner.values()) == {0, 1}
    load = [sum(p.numel() for p, r in opt.owner.items() if r == k) for k in (0, 1)]
    assert max(load) - min(load) <= max(p.numel() for p in params)
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(UserError, match="torchrun"):      # no process group here
        opt.step()
    assert not opt.state                                    # and nothing was half-updated


def test_tokens_to_target_interpolates_between_evaluations():
    curve = [(0, 5.0), (10, 3.0), (20, 2.0), (30, 1.0)]
    assert optim.tokens_to_target(curve, 2.5, 100) == pytest.approx(1500)
    assert optim.tokens_to_target(curve, 3.0, 100) == pytest.approx(1000)
    assert optim.tokens_to_target(curve, 0.5, 100) is None


def test_compare_runs_end_to_end(tmp_path):
    """The compare pipeline on a few steps of a 1-layer model (the real figures come from
    `python optim.py compare`): the best lr of each sweep is picked, the target is the
    worse best run's final loss, and tokens-to-target are read off the curves."""
    text = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(3000))
    path = tmp_path / "c.txt"
    path.write_text(text)
    res = optim.main(["compare", "--data", str(path), "--vocab-size", "300", "--n-layer", "1",
                      "--n-embd", "32", "--steps", "12", "--batch-size", "4", "--seq-len",
                      "32", "--warmup-steps", "2", "--eval-interval", "3", "--eval-iters", "2",
                      "--lrs", "3e-3,1e-2", "--muon-lrs", "1e-2,3e-2", "--threads", "1"])
    runs, tps = res["runs"], 4 * 32
    assert [r["name"] for r in runs] == ["adamw", "adamw", "muon", "muon"]
    assert all(r["lr"] == min(runs[:2], key=lambda r: r["final"])["lr"] for r in runs[2:])
    adamw, muon = (min(rs, key=lambda r: r["final"]) for rs in (runs[:2], runs[2:]))
    assert res["target"] == max(adamw["final"], muon["final"])
    for r, tokens in ((adamw, res["adamw"]), (muon, res["muon"])):
        assert [s for s, _ in r["curve"]] == [0, 3, 6, 9, 12]
        assert tokens == optim.tokens_to_target(r["curve"], res["target"], tps)
        assert 0 < tokens <= 12 * tps
    assert res["ratio"] == pytest.approx(res["adamw"] / res["muon"])


def test_bench_says_when_its_timings_cannot_be_trusted(capsys):
    """`optim.py bench` ends with core.runtime.TimingConditions' judgement: one warning line
    on a loaded machine (the load as measured; here a fake one), none on a quiet one."""
    from core.runtime import TimingConditions
    args = optim.parse_args(["bench", "--n-layer", "1", "--n-embd", "32", "--vocab-size", "64",
                             "--batch-size", "2", "--seq-len", "16", "--bench-steps", "2"])
    loaded = TimingConditions(reader=lambda: 7.5, cores=2)
    line = optim.bench(args, torch.device("cpu"), loaded)
    out = capsys.readouterr().out
    assert line.startswith("warning: ") and "load average 7.5 -> 7.5 on 2 cores" in line
    assert out.splitlines()[-1] == line and "contended" not in out
    quiet = TimingConditions(reader=lambda: 0.5, cores=2, max_spread=math.inf)
    assert optim.bench(args, torch.device("cpu"), quiet) is None
    assert "warning" not in capsys.readouterr().out


def test_sharded_muon_over_two_processes_equals_one_process():
    from harness import torchrun
    result = torchrun(os.path.abspath(__file__), ["sharded"], nproc=2, timeout=120)
    assert result.returncode == 0, result.output
    assert "sharded muon ok" in result.output, result.output


def _sharded_worker():
    """Each rank: the same model and the same gradients (as after DDP's all-reduce), a
    Muon sharded by matrix; after every step the weights must equal a one-process
    torch.optim.Muon bit for bit, and each rank must hold only its matrices' momentum."""
    import torch.distributed as dist
    from core.meters import comm
    from core.distributed import setup_runtime
    rt = setup_runtime("cpu")
    a, b = tiny_model(), tiny_model()
    pick = lambda m: [p for n, p in m.named_parameters() if optim.is_hidden_matrix(n, p)]
    sharded = optim.Muon(pick(a), lr=0.02, rank=rt.rank, world_size=rt.world_size)
    ref = torch.optim.Muon(pick(b), lr=0.02)
    for s in range(5):
        for model, opt in ((a, sharded), (b, ref)):
            model(*batch(s, model.config))[1].backward()
            opt.step()
            opt.zero_grad()
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb), "sharded Muon differs from one process"
    held = sum(st["momentum_buffer"].numel() for st in sharded.state.values())
    total = sum(p.numel() for p in pick(a))
    counts = torch.tensor([held])
    dist.all_reduce(counts)
    assert counts.item() == total and held < total, (held, total)
    sent = dict(((op, g), (c, w)) for op, g, c, p, w in comm.table())
    assert sent[("broadcast", "world")][0] == 5 * len(pick(a))
    if rt.rank == 0:
        print(f"sharded muon ok: rank 0 holds {held:,} of {total:,} momentum values", flush=True)


if __name__ == "__main__" and sys.argv[1:] == ["sharded"]:
    from core.runtime import run_cli
    run_cli(lambda argv: _sharded_worker())
