# core/mla.py (and scripts/mla_bench.py): multi-head latent attention equals a per-head textbook computation from its own
# weights; the absorbed path equals the unabsorbed one in prefill and decode; the latent
# cache (dense, paged fp32/int8, the serving engine) decodes what the full forward
# computes; the caches' bytes per token equal (d_c + d_R)·L·bytes; it trains; bad
# configs are one-line errors.
import math
import random

import pytest
import torch

from core import mla
from scripts import mla_bench
from kvcache import BlockAllocator, PagedKVCache, blocks_for, paged_logits
from model import GPT, KVCache, apply_rope, get_config
from core.errors import UserError
from serve import Engine, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.py: tiny tensors, one thread

# tiny: 4 heads, d_h 8; d_c = 4·d_h, d_R = d_h/2 (DeepSeek-V2's proportions); odd widths
# in the second config so that no two widths can be confused
MLA = dict(kv_lora_rank=32, qk_rope_head_dim=4)
MLA_Q = dict(kv_lora_rank=12, qk_rope_head_dim=6, q_lora_rank=16, qk_nope_head_dim=10,
             v_head_dim=5)


def mla_model(seed=1, **kw):
    return GPT(get_config("tiny", **{**MLA, **kw}), seed=seed).eval()


def tokens(cfg, B, T, seed=0):
    return torch.randint(cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def textbook_mla(attn, x, cos, sin):
    """MLA by the paper's equations, head by head, explicit softmax: k_C = W_UK c,
    v = W_UV c, one rotary key for all heads, scale 1/√(d_nope + d_R)."""
    n, r, dv, H = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim, attn.n_head
    T = x.shape[1]
    q = attn.query_proj(attn.q_norm(attn.wq_a(x)) if hasattr(attn, "wq_a") else x)
    kv_a = attn.wkv_a(x)
    c = attn.kv_norm(kv_a[..., :attn.kv_lora_rank])                         # (B, T, d_c)
    k_rope = apply_rope(kv_a[:, None, :, attn.kv_lora_rank:], cos, sin)[:, 0]  # (B, T, d_R)
    w = attn.wkv_b.weight.view(H, n + dv, attn.kv_lora_rank)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    heads = []
    for h in range(H):
        qh = q[..., h * (n + r):(h + 1) * (n + r)]
        q_rope = apply_rope(qh[:, None, :, n:], cos, sin)[:, 0]
        k_nope, v = c @ w[h, :n].T, c @ w[h, n:].T
        scores = (qh[..., :n] @ k_nope.transpose(1, 2) + q_rope @ k_rope.transpose(1, 2))
        scores = (scores / math.sqrt(n + r)).masked_fill(~causal, -math.inf)
        heads.append(torch.softmax(scores, dim=-1) @ v)
    return attn.wo(torch.cat(heads, dim=-1))


@pytest.mark.parametrize("kw", [MLA, MLA_Q], ids=["q_direct", "q_latent"])
@pytest.mark.parametrize("attn_impl", ["sdpa", "math"])
def test_both_paths_equal_the_textbook_equations(kw, attn_impl):
    model = mla_model(**kw, attn=attn_impl)
    attn, T = model.layers[0].attention, 12
    x = torch.randn(3, T, model.config.n_embd)
    cos, sin = model.rope(torch.arange(T))
    want = textbook_mla(attn, x, cos, sin)
    for absorb in (False, True):
        attn.absorb = absorb
        torch.testing.assert_close(attn(x, cos, sin), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw", [MLA, MLA_Q], ids=["q_direct", "q_latent"])
def test_absorbed_equals_unabsorbed_in_prefill_and_decode(kw):
    """Whole-model logits: a prefill of 10 tokens then 6 one-token decodes through
    model.KVCache, once per path; and both equal the full forward (latent cache decode)."""
    model = mla_model(**kw)
    idx = tokens(model.config, 2, 16)
    full = model(idx)[0]
    for absorb in (False, True, None):                  # None: absorbed because cached
        mla.set_absorb(model, absorb)
        cache = KVCache(model.config, 2, 16)
        steps = [model(idx[:, :10], cache=cache)[0]]
        steps += [model(idx[:, t:t + 1], cache=cache)[0] for t in range(10, 16)]
        torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
        mla.set_absorb(model, absorb)
        torch.testing.assert_close(model(idx)[0], full, rtol=1e-5, atol=1e-5)   # prefill
    assert isinstance(model.layers[0].attention, mla.LatentAttention)
    assert cache.k.shape[-1] == model.config.kv_lora_rank            # the latent, nothing
    assert cache.v.shape[-1] == model.config.qk_rope_head_dim        # else, is cached


@pytest.mark.parametrize("case", ["causal", "prefix_2d", "paged_4d"])
def test_one_kv_head_as_rows_is_the_same_attention(case):
    """The absorbed path's layout (H query heads as rows of one KV head) against the
    model's explicit softmax with the KV head repeated per query head."""
    from model import math_attention
    g = torch.Generator().manual_seed(0)
    Tq, Tk = (7, 7) if case == "causal" else (3, 10)
    q, k, v = (torch.randn(2, 4, Tq, 6, generator=g), torch.randn(2, 1, Tk, 6, generator=g),
               torch.randn(2, 1, Tk, 5, generator=g))
    mask = {"causal": None,
            "prefix_2d": torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq),
            "paged_4d": torch.rand(2, 1, Tq, Tk, generator=g) < 0.7}[case]
    if mask is not None:
        mask[..., 0] = True                              # every query sees some key
    fn = mla.one_kv_head_as_rows(math_attention)
    torch.testing.assert_close(fn(q, k, v, mask), math_attention(q, k, v, mask))


def test_generate_uses_the_latent_cache_and_matches_the_full_forward():
    model = mla_model()
    prompt = tokens(model.config, 1, 7)[0].tolist()
    out = model.generate(prompt, 12, temperature=0)
    seq = prompt
    for _ in range(12):                                  # greedy without any cache
        seq = seq + [int(model(torch.tensor([seq]))[0][0, -1].argmax())]
    assert out == seq[len(prompt):]


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_paged_latent_cache_equals_dense(kv_dtype):
    """Ragged sequences packed in one row, prefilled in chunks through kvcache's paged
    pool of latent blocks, both paths: the logits of every position against a dense
    forward (fp32: 1e-5; int8 rounds the latent: close, same argmax nearly everywhere)."""
    model = mla_model(**MLA_Q)
    cfg, bs, rng = model.config, 4, random.Random(0)
    seqs = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in (9, 23, 14)]
    with torch.no_grad():
        dense = [model(torch.tensor([s]))[0][0] for s in seqs]
    n_blocks = sum(blocks_for(len(s), bs) for s in seqs)
    for absorb in (True, False):
        mla.set_absorb(model, absorb)
        cache = PagedKVCache(cfg, n_blocks, bs, kv_dtype=kv_dtype)
        paged = paged_logits(model, cache, BlockAllocator(n_blocks, bs), seqs, chunk=5)
        for a, b in zip(paged, dense):
            if kv_dtype == "float32":
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            else:
                assert (a - b).abs().max() < 0.05 * b.abs().max()
                assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


def test_engine_greedy_equals_generate():
    """serve.Engine on an MLA model (continuous batching, chunked prefill, a small pool
    that forces preemption): every request's greedy output equals its generate()."""
    model = mla_model(**MLA_Q)
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(1, 30))] for _ in range(6)]
    ns = [rng.randint(1, 15) for _ in prompts]
    ref = [model.generate(p, n, temperature=0) for p, n in zip(prompts, ns)]
    eng = Engine(model, block_size=4, num_blocks=17, max_num_batched_tokens=6)
    seqs = eng.generate(prompts, [SamplingParams(max_tokens=n, temperature=0) for n in ns])
    assert [s.output_ids for s in seqs] == ref
    assert eng.stats["preemptions"] > 0                  # the case really preempted


@pytest.mark.parametrize("kw", [MLA, MLA_Q], ids=["q_direct", "q_latent"])
def test_cache_bytes_per_token_equal_the_formula(kw):
    cfg = get_config("tiny", **kw)
    d_c, d_r, L = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.n_layer
    dense = KVCache(cfg, batch_size=3, max_len=20)
    assert dense.nbytes == 3 * 20 * (d_c + d_r) * L * 4
    assert PagedKVCache(cfg, 5, 4).bytes_per_token == (d_c + d_r) * L * 4
    # int8: one byte per number plus an fp32 scale for the latent and one for the rope key
    assert PagedKVCache(cfg, 5, 4, kv_dtype="int8").bytes_per_token == (d_c + d_r + 8) * L
    assert mla_bench.formula_bytes_per_token(cfg, 4) == (d_c + d_r) * L * 4
    gqa = get_config("tiny")
    gqa_bytes = 2 * gqa.n_kv_head * gqa.head_dim * gqa.n_layer * 4
    assert mla_bench.formula_bytes_per_token(gqa, 4) == gqa_bytes


def test_trains_gradients_reach_every_weight_and_the_loss_falls():
    model = mla_model(**MLA_Q).train()
    for name, p in model.named_parameters():             # GPT.init_weights fits the names
        if p.dim() == 1:
            assert torch.equal(p, torch.ones_like(p)), name
    wo = model.layers[0].attention.wo.weight
    assert wo.std() < 0.75 * model.layers[0].attention.wkv_b.weight.std()   # 1/√(2L)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    idx = tokens(model.config, 4, 33)
    x, y = idx[:, :-1], idx[:, 1:]
    losses = []
    for step in range(15):
        loss = model(x, y)[1]
        loss.backward()
        if step == 0:
            for name, p in model.named_parameters():
                assert p.grad is not None and p.grad.abs().sum() > 0, name
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("bad", [dict(kv_lora_rank=16, qk_rope_head_dim=0),
                                 dict(kv_lora_rank=16, qk_rope_head_dim=3),
                                 dict(kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=-2),
                                 dict(kv_lora_rank=16, qk_rope_head_dim=4, v_head_dim=-1),
                                 dict(kv_lora_rank=16, qk_rope_head_dim=4, q_lora_rank=-8)])
def test_bad_mla_configs_are_one_line_errors(bad):
    with pytest.raises(UserError):
        GPT(get_config("tiny", **bad))


def test_cli_ledger_measures_what_the_formula_says(capsys):
    out = mla_bench.main(["--preset", "tiny", "--context", "12", "--new-tokens", "3",
                    "--repeats", "1"])
    for row in out["bytes"].values():
        assert row["dense"] == row["paged"] == row["formula"]
        assert row["paged_int8"] == row["formula_int8"]
    assert out["bytes"]["MLA"]["formula"] == (32 + 4) * 2 * 4
    assert out["same_tokens"]
    assert set(out["decode"]) == {"MHA", "GQA 2 kv heads", "MLA absorbed", "MLA unabsorbed"}
    assert "GQA with 2.25 kv heads" in capsys.readouterr().out
    with pytest.raises(UserError, match="--new-tokens"):
        mla_bench.main(["--preset", "tiny", "--new-tokens", "0"])
