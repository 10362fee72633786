import random

import pytest
import torch

from harness import python_cmd, run_together
from kvcache import (BlockAllocator, KVTier, PagedKVCache, block_hash, blocks_for, dequantize_int8,
                     extend_hash_chain, paged_attention_blockwise, paged_logits, payload_bytes,
                     quantize_int8)
from model import GPT, get_config, math_attention, sdpa_attention
from core.errors import UserError


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.py: tiny tensors, one thread


def dense_reference(q, k, v, context_len):
    """q: (H, n, D) = the last n positions of a context; k, v: (H_kv, L, D). Plain
    causal attention with the offset mask, the model's math_attention."""
    n = q.shape[1]
    mask = torch.ones(n, context_len, dtype=torch.bool).tril(context_len - n)
    return math_attention(q[None], k[None], v[None], mask)[0]


@pytest.mark.parametrize("block_size,n_head,n_kv_head,inner", [
    (4, 4, 2, sdpa_attention), (1, 4, 4, math_attention), (16, 6, 2, sdpa_attention),
    (5, 4, 1, math_attention)])
def test_paged_attention_equals_dense(block_size, n_head, n_kv_head, inner):
    """Ragged batch of decodes and prefill chunks, lengths on and around block boundaries,
    block tables shuffled over the pool: the write through the slot mapping, the gather
    through the block tables and the masked attention equal dense causal attention per
    sequence; so does the block-by-block online-softmax kernel."""
    cfg = get_config("tiny", n_head=n_head, n_kv_head=n_kv_head, n_embd=8 * n_head)
    D, g = cfg.head_dim, torch.Generator().manual_seed(block_size)
    # (context length after the step, new tokens this step)
    shapes = [(1, 1), (block_size, 1), (block_size + 1, 1), (2 * block_size, block_size),
              (37, 5), (40, 40), (3 * block_size + 2, 2), (23, 1)]
    n_blocks = sum(blocks_for(L, block_size) for L, _ in shapes) + 3
    cache = PagedKVCache(cfg, n_blocks, block_size, attn_fn=inner)
    perm = torch.randperm(n_blocks, generator=g).tolist()
    tables, ks, vs = [], [], []
    for L, _ in shapes:
        nb = blocks_for(L, block_size)
        tables.append(perm[:nb])
        perm = perm[nb:]
        ks.append(torch.randn(n_kv_head, L, D, generator=g))
        vs.append(torch.randn(n_kv_head, L, D, generator=g))
    # the past: positions before this step's tokens, written by an earlier step
    past = [(t, 0, L - n) for t, (L, n) in zip(tables, shapes) if L > n]
    idx = [i for i, (L, n) in enumerate(shapes) if L > n]
    cache.prepare(past)
    for layer in range(cfg.n_layer):
        cache.update(layer, torch.cat([ks[i][:, :shapes[i][0] - shapes[i][1]] for i in idx], 1)[None],
                     torch.cat([vs[i][:, :shapes[i][0] - shapes[i][1]] for i in idx], 1)[None])
    # the step: new tokens of every sequence, packed
    cache.prepare([(t, L - n, n) for t, (L, n) in zip(tables, shapes)])
    q = torch.randn(1, n_head, sum(n for _, n in shapes), D, generator=g)
    k_new = torch.cat([k[:, L - n:] for k, (L, n) in zip(ks, shapes)], 1)[None]
    v_new = torch.cat([v[:, L - n:] for v, (L, n) in zip(vs, shapes)], 1)[None]
    k_pool, v_pool = cache.update(1, k_new, v_new)
    out = cache.attention(q, k_pool, v_pool)
    at = 0
    for i, (L, n) in enumerate(shapes):
        ref = dense_reference(q[0, :, at:at + n], ks[i], vs[i], L)
        torch.testing.assert_close(out[0, :, at:at + n], ref, rtol=1e-5, atol=1e-5)
        blockwise = paged_attention_blockwise(q[0, :, at:at + n], k_pool, v_pool, tables[i],
                                              L, block_size)
        torch.testing.assert_close(blockwise, ref, rtol=1e-5, atol=1e-5)
        at += n


@pytest.mark.parametrize("kv_dtype,atol", [("float32", 2e-5), ("bfloat16", 0.1), ("int8", 0.2)])
def test_unmodified_model_through_paged_cache_equals_dense_forward(kv_dtype, atol):
    """GPT.forward itself (positions + the paged cache + its attn_fn) over ragged sequences
    packed in one row, prefilled in chunks: logits equal one dense forward per sequence
    (exactly for fp32 K/V; within a bound for bf16 / int8, which must still be close)."""
    cfg = get_config("tiny")
    model = GPT(cfg, seed=2).eval()
    rng = random.Random(0)
    seqs = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in (1, 8, 9, 31, 64)]
    cache = PagedKVCache(cfg, 40, 8, kv_dtype=kv_dtype)
    alloc = BlockAllocator(40, 8)
    paged = paged_logits(model, cache, alloc, seqs, chunk=7)
    worst = 0.0
    with torch.no_grad():
        for s, p in zip(seqs, paged):
            dense = model(torch.tensor([s]))[0][0]
            worst = max(worst, (dense - p).abs().max().item())
            torch.testing.assert_close(p, dense, rtol=0, atol=atol)
    assert alloc.num_free == 40                      # paged_logits released everything
    if kv_dtype != "float32":
        assert worst > 1e-6                          # the quantized path really was used
    # the model's own attention function is back after the step
    assert all(layer.attention.attn_fn is sdpa_attention for layer in model.layers)


def test_int8_quantization_error_bound_and_memory():
    x = torch.randn(50, 2, 32) * torch.rand(50, 2, 1) * 10
    codes, scale = quantize_int8(x)
    assert codes.dtype == torch.int8 and scale.shape == (50, 2, 1)
    err = (dequantize_int8(codes, scale) - x).abs()
    assert (err <= scale / 2 + 1e-6).all()          # round to nearest: half a step at most
    # one scale per (token, KV head) vector, its own absmax / 127: a scale shared by the
    # whole tensor gives a quiet head the steps of the loudest (labs: kvcache.md)
    torch.testing.assert_close(scale, x.abs().amax(-1, keepdim=True) / 127.0)
    cfg = get_config("tiny")
    f32, i8 = PagedKVCache(cfg, 10, 4), PagedKVCache(cfg, 10, 4, kv_dtype="int8")
    per_head = cfg.n_layer * cfg.n_kv_head * 2
    assert f32.bytes_per_token == per_head * cfg.head_dim * 4
    assert i8.bytes_per_token == per_head * (cfg.head_dim + 4)   # codes + fp32 scale


def test_hash_chain_names_the_whole_prefix():
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    assert block_hash(None, a) == block_hash(None, a)
    assert block_hash(block_hash(None, a), b) != block_hash(block_hash(None, b), b)
    assert block_hash(None, [1, 2]) != block_hash(None, [2, 1])
    hashes = extend_hash_chain([], a + b + [9], 2, 4)
    assert hashes == [block_hash(None, a), block_hash(block_hash(None, a), b)]


def test_prefix_match_leaves_the_last_token_to_compute():
    """A prompt fully covered by cached blocks still recomputes its last block (its last
    token's logits are needed) -- the zero-length prefill nano-vllm trips on."""
    alloc, bs = BlockAllocator(8, 4), 4
    toks = list(range(12))                            # exactly 3 full blocks
    table = []
    alloc.grow(table, 12)
    hashes = extend_hash_chain([], toks, 3, bs)
    for i in range(3):
        alloc.register(table[i], hashes[i], toks[i * bs:(i + 1) * bs])
    assert alloc.match_prefix(toks, []) == table[:2]             # not all 3
    assert alloc.match_prefix(toks + [99], []) == table[:3]      # one more token: all 3
    assert alloc.match_prefix([0, 1, 2, 7, 4, 5, 6, 7, 8], []) == []   # differs in block 0
    # a lookup checks the tokens too, not only the hash
    alloc.tokens_of[table[0]] = (0, 1, 2, 42)
    assert alloc.match_prefix(toks, []) == []


def test_lru_evicts_oldest_released_and_tail_first():
    alloc, bs = BlockAllocator(6, 2), 2
    tables = []
    for base in (0, 100):                             # two sequences of 2 full blocks each
        toks = [base, base + 1, base + 2, base + 3]
        t = []
        alloc.grow(t, 4)
        h = extend_hash_chain([], toks, 2, bs)
        for i in range(2):
            alloc.register(t[i], h[i], toks[i * bs:(i + 1) * bs])
        tables.append(t)
    first, second = list(tables[0]), list(tables[1])
    alloc.release_table(tables[0])
    alloc.release_table(tables[1])
    alloc.check([])
    assert alloc.num_free == 6 and len(alloc.evictable) == 4
    got = [alloc.allocate() for _ in range(6)]
    # 2 never-used blocks first, then the LRU order: seq 0's tail, its head, seq 1's ...
    assert got[2:] == [first[1], first[0], second[1], second[0]]
    assert alloc.evictions == 4 and not alloc.block_of
    with pytest.raises(RuntimeError):
        alloc.allocate()                              # exhausted


def test_double_free_is_caught():
    alloc = BlockAllocator(2, 4)
    b = alloc.allocate()
    alloc.release(b)
    with pytest.raises(RuntimeError, match="double free"):
        alloc.release(b)


def test_allocator_random_operations_keep_invariants():
    """Random admissions (prompts drawn from a few shared prefixes, so prefix hits and
    shared blocks happen), growth, registration, releases, evictions; after every
    operation the invariants hold and refcounts equal the references from live tables.
    At the end every block is free or cached with refcount 0."""
    rng, bs = random.Random(0), 4
    alloc = BlockAllocator(40, bs)
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(0, 13))] for _ in range(4)]
    live = {}                     # id -> (tokens, hashes, table, n_registered)
    shared_seen = hits_seen = 0
    for step in range(3000):
        op = rng.random()
        if op < 0.35:             # admit
            toks = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 9))]
            hashes = []
            hits = alloc.match_prefix(toks, hashes)
            if alloc.can_allocate(blocks_for(len(toks), bs) - len(hits), hits):
                for b in hits:
                    alloc.acquire(b)
                table = list(hits)
                assert alloc.grow(table, len(toks))
                live[step] = [toks, hashes, table, len(hits)]
                hits_seen += len(hits)
        elif op < 0.7 and live:   # grow by a few tokens, register full blocks
            s = live[rng.choice(list(live))]
            more = [rng.randrange(50) for _ in range(rng.randint(1, 5))]
            if alloc.grow(s[2], len(s[0]) + len(more)):
                s[0] += more
                full = len(s[0]) // bs
                extend_hash_chain(s[1], s[0], full, bs)
                for i in range(s[3], full):
                    alloc.register(s[2][i], s[1][i], s[0][i * bs:(i + 1) * bs])
                s[3] = max(s[3], full)
        elif live:                # release
            alloc.release_table(live.pop(rng.choice(list(live)))[2])
        shared_seen += any(rc > 1 for rc in alloc.refcount)
        alloc.check([s[2] for s in live.values()])
    assert hits_seen > 0 and shared_seen > 0 and alloc.evictions > 0
    for s in live.values():
        alloc.release_table(s[2])
    alloc.check([])
    assert all(rc == 0 for rc in alloc.refcount) and alloc.num_free == alloc.num_blocks


@pytest.mark.slow
def test_cli_demo_runs_and_prints_ledger(tmp_path):
    r, bad = run_together([
        python_cmd("kvcache.py", "--checkpoint", tmp_path / "none.pt", "--num-seqs", "2"),
        python_cmd("kvcache.py", "--block-size", "0")], timeout=120)
    assert r.returncode == 0, r.output
    assert "random tiny" in r.output and "ledger rows:" in r.output
    assert "float32   max |Δlogit|" in r.output
    assert bad.returncode == 2 and "error:" in bad.output and "Traceback" not in bad.output


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
def test_read_write_blocks_round_trip_bit_exact(kv_dtype):
    """Blocks read out of one pool and written into other block ids of a second pool hold
    the same bits (int8 codes and scales as stored); the payload's size is the formula;
    a payload of another KV dtype is refused."""
    cfg = get_config("tiny")
    src = PagedKVCache(cfg, 8, 4, kv_dtype=kv_dtype)
    gen = torch.Generator().manual_seed(0)
    for t in src.parts().values():           # random contents in every part
        t.copy_(torch.randn(t.shape, generator=gen).mul(50).to(t.dtype))
    payload = src.read_blocks([5, 2, 7])
    heads, k_dim, v_dim = cfg.kv_cache_dims
    assert payload["k"].shape == (cfg.n_layer, heads, 12, k_dim)
    assert payload["v"].shape == (cfg.n_layer, heads, 12, v_dim)
    value = payload["k"].element_size()
    scales = 2 * cfg.n_layer * heads * 4 * 12 if kv_dtype == "int8" else 0
    assert payload_bytes(payload) == cfg.n_layer * heads * (k_dim + v_dim) * value * 12 + scales
    dst = PagedKVCache(cfg, 8, 4, kv_dtype=kv_dtype)
    dst.write_blocks([0, 6, 3], payload)
    for name, t in src.parts().items():
        s = t.view(t.shape[0], t.shape[1], 8, 4, -1)
        d = dst.parts()[name].view(t.shape[0], t.shape[1], 8, 4, -1)
        for a, b in ((5, 0), (2, 6), (7, 3)):
            assert torch.equal(s[:, :, a], d[:, :, b])
        fresh = PagedKVCache(cfg, 8, 4, kv_dtype=kv_dtype).parts()[name]
        assert torch.equal(d[:, :, 1], fresh.view_as(d)[:, :, 1])   # others untouched
    other = "float32" if kv_dtype != "float32" else "int8"
    with pytest.raises(ValueError, match="payload"):
        PagedKVCache(cfg, 8, 4, kv_dtype=other).write_blocks([0, 1, 2], payload)


def test_cached_hashes_name_the_blocks_in_use_or_cached():
    alloc, bs = BlockAllocator(3, 2), 2
    toks = [1, 2, 3, 4, 5]
    hashes = extend_hash_chain([], toks, 2, bs)
    table = []
    assert alloc.grow(table, len(toks))
    for i in range(2):
        alloc.register(table[i], hashes[i], toks[i * bs:(i + 1) * bs])
    assert alloc.cached_hashes() == set(hashes)
    alloc.release_table(table)
    assert alloc.cached_hashes() == set(hashes)          # cached, still findable
    for _ in range(3):
        table.append(alloc.allocate())                   # the free one, then 2 evictions
    assert alloc.cached_hashes() == set()


def fill_block(cache, block, h):
    """Write contents that are a function of the chain hash h into pool block `block`."""
    gen = torch.Generator().manual_seed(int.from_bytes(h[:8], "little") >> 1)
    payload = {name: torch.randn(t.shape[0], t.shape[1], cache.block_size, t.shape[3],
                                 generator=gen).mul(40).to(t.dtype)
               for name, t in cache.parts().items()}
    cache.write_blocks([block], payload)
    return payload


@pytest.mark.parametrize("kind,kv_dtype", [("host", "float32"), ("file", "bfloat16"),
                                           ("host", "int8")])
def test_tier_random_operations_conserve_blocks_and_reload_bit_exact(kind, kv_dtype, tmp_path):
    """Random admissions over shared prefixes with a pool too small for them: cached
    blocks are evicted into the tier, later hits reload them. After every operation the
    pool's and the tier's invariants hold; every eviction is a put; every entry put is
    reloaded, dropped (tier full), discarded (recomputed) or still there; no prefix is in both tiers; and every
    reloaded block holds the bits its prefix was written with."""
    rng, bs = random.Random(1), 4
    cfg = get_config("tiny")
    cache = PagedKVCache(cfg, 12, bs, kv_dtype=kv_dtype)
    tier = KVTier(cache, kind, 6, str(tmp_path / "tier"))
    alloc = BlockAllocator(12, bs, tier=tier)
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(4, 14))] for _ in range(5)]
    written, live, reloaded = {}, {}, 0          # hash -> payload; id -> (tokens, table)
    for step in range(1500):
        if rng.random() < 0.5 or not live:       # admit: pool hits, tier reloads, fresh
            toks = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 6))]
            hashes = []
            hits = alloc.match_prefix(toks, hashes)
            back = alloc.match_tier(toks, hashes, len(hits))
            if not alloc.can_allocate(blocks_for(len(toks), bs) - len(hits), hits):
                continue
            for b in hits:
                alloc.acquire(b)
            table = list(hits) + alloc.reload(back)
            for (h, _), b in zip(back, table[len(hits):]):
                got = cache.read_blocks([b])
                assert all(torch.equal(got[n], written[h][n]) for n in got), "reload differs"
                reloaded += 1
            start = len(table)
            assert alloc.grow(table, len(toks))
            extend_hash_chain(hashes, toks, len(toks) // bs, bs)
            for i in range(start, len(toks) // bs):      # "compute" and register full blocks
                written[hashes[i]] = fill_block(cache, table[i], hashes[i])
                alloc.register(table[i], hashes[i], toks[i * bs:(i + 1) * bs])
            live[step] = table
        else:
            alloc.release_table(live.pop(rng.choice(list(live))))
        alloc.check(list(live.values()))
        assert not alloc.cached_hashes() & tier.hashes(), "a prefix in both tiers"
        assert tier.puts == alloc.evictions
        assert tier.puts == tier.reloads + tier.drops + tier.discards + len(tier.entries)
    assert reloaded > 0 and tier.drops > 0 and tier.reloads == reloaded
    assert alloc.cached_hashes(tier=True) == alloc.cached_hashes() | tier.hashes()
    assert tier.bytes_in == tier.puts * payload_bytes(written[next(iter(written))])
    for t in live.values():
        alloc.release_table(t)
    alloc.check([])
    assert alloc.num_free == alloc.num_blocks


def test_tier_bad_input_is_one_user_error(tmp_path):
    cache = PagedKVCache(get_config("tiny"), 4, 4)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(UserError, match="cannot create the KV tier"):
        KVTier(cache, "file", 4, str(blocker / "tier"))
    for n in (0, -3):
        with pytest.raises(UserError, match=">= 1 blocks"):
            KVTier(cache, "host", n)
    with pytest.raises(UserError, match="unknown KV tier"):
        KVTier(cache, "disk", 4)
    with pytest.raises(UserError, match="needs prefix caching"):
        BlockAllocator(4, 4, prefix_caching=False, tier=KVTier(cache, "host", 4))
