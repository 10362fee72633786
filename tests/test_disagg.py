"""disagg.py: the KV bytes formula against the pool's own bytes per token; the wire format
round trip (encode -> receive) feeding a decode loop whose pool is too small for all the
imports at once (they wait, nothing is lost, outputs equal one engine's, aborts free);
two real ranks (gloo) in one launch (tests/dist_disagg_check.py); bad input one error."""
import queue
import random

import pytest
import torch

import disagg
from disagg import ABORT, DONE, KV, decode_loop, encode, kv_formula, receive
from harness import run_python, torchrun
from kvcache import PagedKVCache
from model import GPT, get_config
from serve import PREFILLED, Engine, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.py: tiny tensors, one thread

BS = 4
CONFIGS = {"gqa": get_config("tiny"),
           "mla": get_config("tiny", kv_lora_rank=16, qk_rope_head_dim=4)}


@pytest.mark.parametrize("arch", CONFIGS)
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
def test_formula_equals_the_pools_bytes_per_token(arch, kv_dtype):
    cfg = CONFIGS[arch]
    cache = PagedKVCache(cfg, 8, BS, kv_dtype=kv_dtype)
    assert kv_formula(cfg, kv_dtype, 1) == cache.bytes_per_token
    assert kv_formula(cfg, kv_dtype, 37) == 37 * cache.bytes_per_token
    if arch == "gqa" and kv_dtype == "float32":     # 2 · L · H_kv · D · 4
        assert kv_formula(cfg, kv_dtype, 1) == 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * 4


def prefilled(model, prompts, kv_dtype=None, seed=None):
    """A prefill engine run to PREFILLED on every prompt (prefill_only)."""
    eng = Engine(model, block_size=BS, num_blocks=128, kv_dtype=kv_dtype)
    temp = 0 if seed is None else 1.0
    for i, p in enumerate(prompts):
        eng.add_request(p, SamplingParams(max_tokens=8, temperature=temp, seed=seed,
                                          ignore_eos=True), seq_id=i, prefill_only=True)
    while eng.has_work():
        eng.step()
    assert all(s.status == PREFILLED for s in eng.live.values())
    return eng


def wire(tensors):
    """The `take` of a test: the sent tensors in order, shapes and dtypes checked."""
    it = iter(tensors)

    def take(shape, dtype):
        t = next(it)
        assert tuple(t.shape) == tuple(shape) and t.dtype == dtype
        return t
    return take


def test_wire_round_trip_is_bit_exact_and_sends_only_computed_slots():
    model = GPT(get_config("tiny"), seed=0).eval()
    prompt = list(range(1, 11))                     # 10 tokens: 3 blocks, 2 slots unused
    for kv_dtype, seed in (("int8", None), ("float32", 7)):
        eng = prefilled(model, [prompt], kv_dtype, seed)
        params = eng.live[0].params
        exported = eng.export_kv(0, release=False)
        tensors, kv_bytes = encode(exported, 0)
        assert kv_bytes == kv_formula(model.config, kv_dtype, 10)
        dec = Engine(model, block_size=BS, num_blocks=16, kv_dtype=kv_dtype)
        kind, rid, got = receive(dec, wire(tensors))
        assert (kind, rid) == (KV, 0)
        for name, t in exported["kv"].items():      # the computed slots, bit for bit
            assert torch.equal(got["kv"][name][:, :, :10], t[:, :, :10])
            assert got["kv"][name].shape == t.shape
        assert got["tokens"] == exported["tokens"]
        assert dec.import_kv(got, seq_id=0).params == params    # via JSON, not a pickle
        assert (got["generator"] is None) == (seed is None)
        if seed is not None:
            assert torch.equal(got["generator"], exported["generator"])


def test_decode_loop_imports_into_a_full_pool_and_aborts_free():
    # 6 prefilled requests reach a decode engine whose pool holds one max-length sequence
    # (64 tokens / 4 = 16 blocks): imports wait for blocks (PoolFull), none is lost, the
    # outputs equal one engine's; one request is cancelled while waiting to be imported
    model = GPT(get_config("tiny"), seed=0).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(20, 40))] for _ in range(6)]
    pre = prefilled(model, prompts)
    dec = Engine(model, block_size=BS, num_blocks=16)
    inbox = queue.Queue()
    for i in range(len(prompts)):
        tensors, _ = encode(pre.export_kv(i), i)
        inbox.put(receive(dec, wire(tensors)))
    inbox.put((ABORT, 5, None))
    inbox.put((DONE, -1, None))
    results, stats = decode_loop(dec, inbox)
    assert stats["import_waits"] > 0 and stats["aborted_waiting"] == 1
    assert sorted(results) == [0, 1, 2, 3, 4]
    ref = Engine(model, block_size=BS, num_blocks=128).generate(
        prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for i, (made, times, _) in results.items():
        first = ref[i].output_ids[0]
        assert [first] + made == ref[i].output_ids and len(times) == len(made) == 7
    for eng in (pre, dec):                          # both pools: all free or cached
        eng.alloc.check(tables=[])
        assert not eng.live and all(rc == 0 for rc in eng.alloc.refcount)


@pytest.mark.slow
def test_two_ranks_equal_one_engine_bytes_formula_pools_free():
    r = torchrun("tests/dist_disagg_check.py", nproc=2, timeout=400)
    assert r.returncode == 0, r.output
    assert r.output.count("ok ") >= 3, r.output
    for case in ("fp32 with aborts", "int8", "mla bf16"):
        assert f"ok {case}" in r.output, r.output


def test_bad_input_is_one_error():
    r = run_python("disagg.py", ["run", "--preset", "tiny"], timeout=120)   # no torchrun
    assert r.returncode == 2, r.output
    assert r.output.strip().splitlines() == [
        "error: disaggregation needs exactly 2 ranks (rank 0 prefills, rank 1 decodes): run "
        "`torchrun --standalone --nproc_per_node=2 disagg.py ...`, got world size 1"]
    with pytest.raises(disagg.UserError, match="long-frac"):
        disagg.main(["bench", "--long-frac", "2"])
