import concurrent.futures
import io
import http.client
import json
import random
import re
import socket
import threading
import time
from dataclasses import asdict

import pytest
import torch

from core import data
import serve
from scripts import serve_bench
from harness import python_cmd, run_python, run_together
from model import GPT, get_config
from core.checkpoint import load_model
from core.cli import fmt_bytes
from core.errors import UserError
from serve import Engine, SamplingParams, decode_tokens
from scripts.serve_bench import static_batch_generate
from serving.api_server import make_server


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.py: tiny tensors, one thread


def byte_encoding():
    """A tokenizer with no training: the 256 bytes + <|endoftext|> (id 256)."""
    return data.make_encoding({bytes([i]): i for i in range(256)})


def tiny_model(seed=1, **kw):
    return GPT(get_config("tiny", **kw), seed=seed).eval()


def workload(cfg, n=10, seed=0, max_prompt=40, max_new=20):
    rng = random.Random(seed)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(rng.randint(1, max_prompt))]
               for _ in range(n)]
    return prompts, [rng.randint(1, max_new) for _ in prompts]


def assert_pool_clean(eng):
    """After all requests: nothing running or waiting, every block free or cached with
    refcount 0, allocator invariants hold."""
    assert not eng.has_work() and not eng.live
    eng.alloc.check(tables=[])
    assert all(rc == 0 for rc in eng.alloc.refcount)
    assert eng.alloc.num_free == eng.alloc.num_blocks


# ----------------------------------------------------------------------------------------
# The engine against model.generate()

ENGINE_CASES = {
    "continuous": dict(),
    "chunked_prefill_small_budget": dict(max_num_batched_tokens=5),
    "no_chunked_prefill": dict(chunked_prefill=False, max_num_batched_tokens=64),
    "forced_preemption_tiny_pool": dict(block_size=4, num_blocks=16),   # = one 64-token sequence
    "preemption_and_chunks": dict(block_size=4, num_blocks=17, max_num_batched_tokens=6),
    "few_seqs_slo_policy": dict(max_num_seqs=3, policy="slo"),
    "block_size_1": dict(block_size=1, num_blocks=300),
}


@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_engine_greedy_equals_generate(case):
    """Every request's greedy output equals its isolated generate(), token for token,
    however the engine batches, chunks, preempts; then the pool is clean."""
    model = tiny_model()
    prompts, ns = workload(model.config)
    ref = [model.generate(p, n, temperature=0) for p, n in zip(prompts, ns)]
    eng = Engine(model, **ENGINE_CASES[case])
    params = [SamplingParams(max_tokens=n, temperature=0, priority=i % 3)
              for i, n in enumerate(ns)]
    seqs = eng.generate(prompts, params)
    assert [s.output_ids for s in seqs] == ref
    assert all(s.finish_reason == "length" for s in seqs)
    if "preemption" in case:
        assert eng.stats["preemptions"] > 0           # the case really preempted
    if case == "chunked_prefill_small_budget":
        assert max(n for _, n, _, _, _ in eng.step_log) <= 5
    assert_pool_clean(eng)


def test_prefix_cache_hits_including_fully_cached_prompts():
    """Shared prefixes and repeated prompts (some exactly a whole number of blocks, i.e.
    fully covered by the cache): hits happen, the last block is recomputed, outputs still
    equal generate()."""
    model = tiny_model()
    cfg, rng, bs = model.config, random.Random(1), 4
    shared = [rng.randrange(cfg.vocab_size) for _ in range(16)]
    prompts = [shared + [rng.randrange(cfg.vocab_size) for _ in range(k)] for k in (0, 3, 8, 5)]
    ns = [10, 5, 7, 12]
    ref = [model.generate(p, n, temperature=0) for p, n in zip(prompts, ns)]
    eng = Engine(model, block_size=bs, num_blocks=64)
    first = eng.generate(prompts[:1], SamplingParams(max_tokens=ns[0], temperature=0))
    assert first[0].num_cached_tokens == 0
    for _ in range(2):
        seqs = eng.generate(prompts, [SamplingParams(max_tokens=n, temperature=0) for n in ns])
        assert [s.output_ids for s in seqs] == ref
        # prompt 0 (16 tokens = 4 full blocks) is fully cached: 3 blocks reused, 1 recomputed
        assert seqs[0].num_cached_tokens == 12
        assert all(s.num_cached_tokens >= 12 for s in seqs)
    assert eng.stats["cached_tokens"] > 0 and eng.alloc.hits > 0
    assert_pool_clean(eng)
    assert len(eng.alloc.evictable) > 0             # cached blocks outlive their requests


def test_prefix_cache_with_preemption_and_recompute():
    model = tiny_model()
    prompts, ns = workload(model.config, n=8, seed=3)
    prompts = prompts + prompts                                   # repeats hit the cache
    ns = ns + ns
    ref = [model.generate(p, n, temperature=0) for p, n in zip(prompts, ns)]
    eng = Engine(model, block_size=4, num_blocks=18, max_num_batched_tokens=9)
    seqs = eng.generate(prompts, [SamplingParams(max_tokens=n, temperature=0) for n in ns])
    assert [s.output_ids for s in seqs] == ref
    assert eng.stats["preemptions"] > 0
    assert_pool_clean(eng)


def test_slo_policy_preempts_the_low_priority_sequence_even_if_already_scheduled():
    """A low-priority request is decoding when a high-priority one with a long prompt
    arrives; the pool (one max-length sequence) runs out while the newcomer prefills in
    small chunks: the low-priority one -- already scheduled for this step, decodes go
    first -- is taken back out and preempted, not the urgent one. Outputs stay exact."""
    model = tiny_model()
    rng = random.Random(7)
    low_prompt = [rng.randrange(model.config.vocab_size) for _ in range(10)]
    high_prompt = [rng.randrange(model.config.vocab_size) for _ in range(40)]
    eng = Engine(model, block_size=4, num_blocks=16, max_num_batched_tokens=8, policy="slo")
    low = eng.add_request(low_prompt, SamplingParams(max_tokens=40, temperature=0, priority=1))
    for _ in range(12):
        eng.step()
    high = eng.add_request(high_prompt, SamplingParams(max_tokens=20, temperature=0,
                                                       priority=0, ttft_slo=0.1))
    while eng.has_work():
        eng.step()
    assert low.num_preemptions > 0 and high.num_preemptions == 0
    assert low.output_ids == model.generate(low_prompt, 40, temperature=0)
    assert high.output_ids == model.generate(high_prompt, 20, temperature=0)
    assert_pool_clean(eng)


def test_blocks_filled_by_decoding_are_cached_for_the_next_turn():
    """Multi-turn reuse: a follow-up whose prompt is the previous prompt + its answer hits
    the blocks the first request filled while *decoding*, not only its prompt's."""
    model = tiny_model()
    prompt = list(range(3, 8))                          # 5 tokens, then 15 generated
    eng = Engine(model, block_size=4, num_blocks=32)
    first = eng.generate([prompt], SamplingParams(max_tokens=15, temperature=0))[0]
    history = prompt + first.output_ids                 # 20 tokens = 5 blocks
    follow = eng.generate([history + [9]], SamplingParams(max_tokens=5, temperature=0))[0]
    assert follow.num_cached_tokens == 16              # 4 full blocks whose KV was computed
    assert follow.output_ids == model.generate(history + [9], 5, temperature=0)
    assert_pool_clean(eng)


def test_random_configurations_fuzz():
    """Random block sizes, pool sizes (down to one max-length sequence), budgets, policies
    and priorities: every output equals generate(), the pool ends clean."""
    model = tiny_model()
    cfg = model.config
    for trial in range(12):
        rng = random.Random(trial)
        bs = rng.choice([1, 2, 3, 4, 8])
        prompts = [[rng.randrange(cfg.vocab_size) for _ in range(rng.randint(1, 50))]
                   for _ in range(6)]
        ns = [rng.randint(1, min(20, 64 - len(p))) for p in prompts]
        eng = Engine(model, block_size=bs, num_blocks=-(-64 // bs) + rng.randint(0, 10),
                     max_num_batched_tokens=rng.choice([3, 5, 8, 16, 64]),
                     max_num_seqs=rng.choice([2, 6]), policy=rng.choice(["fcfs", "slo"]))
        seqs = eng.generate(prompts, [SamplingParams(max_tokens=n, temperature=0,
                                                     priority=rng.randint(0, 2)) for n in ns])
        assert [s.output_ids for s in seqs] == [model.generate(p, n, temperature=0)
                                                for p, n in zip(prompts, ns)], trial
        assert_pool_clean(eng)


def test_seeded_sampling_equals_generate_with_the_same_seed():
    model = tiny_model()
    prompts, ns = workload(model.config, n=6, seed=5)
    kw = dict(temperature=0.9, top_k=40, top_p=0.9)
    ref = [model.generate(p, n, seed=100 + i, **kw) for i, (p, n) in enumerate(zip(prompts, ns))]
    eng = Engine(model, block_size=4, num_blocks=20)               # with preemption, too
    seqs = eng.generate(prompts, [SamplingParams(max_tokens=n, seed=100 + i, **kw)
                                  for i, n in enumerate(ns)])
    assert [s.output_ids for s in seqs] == ref
    assert_pool_clean(eng)


def test_int8_kv_engine_stays_close_to_generate():
    model = tiny_model()
    prompts, ns = workload(model.config, n=6, seed=2)
    ref = [model.generate(p, n, temperature=0) for p, n in zip(prompts, ns)]
    eng = Engine(model, block_size=8, num_blocks=40, kv_dtype="int8")
    seqs = eng.generate(prompts, [SamplingParams(max_tokens=n, temperature=0) for n in ns])
    agree = sum(a == b for s, r in zip(seqs, ref) for a, b in zip(s.output_ids, r))
    assert agree >= 0.8 * sum(ns)                  # approximate, but not garbage
    cfg = model.config                             # codes + one fp32 scale per (token, head)
    assert eng.cache.bytes_per_token == 2 * cfg.n_layer * cfg.n_kv_head * (cfg.head_dim + 4)


def test_stop_strings_eos_and_text():
    """Stop at <|endoftext|> (kept out of the text), at a stop string (text cut before
    it), at max_tokens; compared with generate() + decoding."""
    enc = byte_encoding()
    model = tiny_model(seed=9, vocab_size=enc.n_vocab)
    prompt = enc.encode_ordinary("def f(x):")
    full = model.generate(prompt, 30, temperature=0, eos_id=enc.eot_token)
    assert len(full) == 30 and enc.eot_token not in full
    text = decode_tokens(enc, full)
    eng = Engine(model, enc)
    # eos: pretend a generated token (its first occurrence, at k) is <|endoftext|>
    k = next(i for i in range(3, 30) if full[i] not in full[:i])
    eng_eos = Engine(model, enc, eos_id=full[k])
    s = eng_eos.generate([prompt], SamplingParams(max_tokens=30, temperature=0))[0]
    assert s.output_ids == full[:k + 1] and s.finish_reason == "stop"
    assert s.text == decode_tokens(enc, full[:k])
    # a stop string taken from the reference's own text
    stop = text[10:12]
    s = eng.generate([prompt], SamplingParams(max_tokens=30, temperature=0, stop=(stop,)))[0]
    assert s.finish_reason == "stop" and s.text == text[:text.find(stop)]
    assert s.output_ids == full[:len(s.output_ids)] and len(s.output_ids) < 30
    s = eng.generate(["def f(x):"], SamplingParams(max_tokens=7, temperature=0))[0]
    assert s.finish_reason == "length" and s.output_ids == full[:7]
    assert_pool_clean(eng)


def test_abort_frees_blocks():
    model = tiny_model()
    eng = Engine(model, block_size=4, num_blocks=64)
    a = eng.add_request(list(range(30)), SamplingParams(max_tokens=30, temperature=0))
    b = eng.add_request(list(range(5)), SamplingParams(max_tokens=30, temperature=0))
    eng.step()
    eng.step()
    assert eng.alloc.num_used > 0
    eng.abort(a.id)
    eng.abort(b.id)
    assert a.finish_reason == b.finish_reason == "abort"
    assert_pool_clean(eng)


def disaggregated(model, prompts, params, kv_dtype=None):
    """Prefill engine -> export_kv -> import_kv into a decode engine -> run to the end.
    -> (outputs in order, prefill engine, decode engine)."""
    pre = Engine(model, block_size=4, num_blocks=40, kv_dtype=kv_dtype)
    dec = Engine(model, block_size=4, num_blocks=40, kv_dtype=kv_dtype)
    seqs = [pre.add_request(p, sp, prefill_only=True) for p, sp in zip(prompts, params)]
    while pre.has_work():
        pre.step()
    final = []
    for s in seqs:
        if s.status == serve.PREFILLED:
            ex = pre.export_kv(s.id)
            assert set(ex["kv"]) == set(pre.cache.parts())
            assert ex["num_computed"] == s.num_prompt == len(ex["tokens"]) - 1
            torch.save(ex, io.BytesIO())                     # plain data, sendable
            s = dec.import_kv(ex)
            assert s.status == serve.RUNNING and len(s.tokens) - s.num_computed == 1
        final.append(s)
    while dec.has_work():
        dec.step()
    return [s.output_ids for s in final], pre, dec


@pytest.mark.parametrize("kind", ["greedy", "seeded", "int8"])
def test_export_import_continues_exactly_as_one_engine(kind):
    """Prefill on one engine, decode on another (the disaggregation seam): the outputs equal
    one engine's, token for token (greedy; seeded sampling: the generator's state travels;
    int8: the codes and scales travel as stored), and both pools end clean."""
    model = tiny_model()
    prompts, ns = workload(model.config, n=6, seed=4)
    ns[0] = 1                                                # finished by its prefill
    kw = dict(temperature=0.9, top_k=40) if kind == "seeded" else dict(temperature=0)
    params = [SamplingParams(max_tokens=n, seed=7 + i, **kw) for i, n in enumerate(ns)]
    kv = "int8" if kind == "int8" else None
    one = Engine(model, block_size=4, num_blocks=40, kv_dtype=kv).generate(prompts, params)
    outs, pre, dec = disaggregated(model, prompts, params, kv)
    assert outs == [s.output_ids for s in one]
    assert dec.stats["computed_tokens"] == sum(n - 1 for n in ns)   # decodes only
    assert_pool_clean(pre)
    assert_pool_clean(dec)
    assert dec.alloc.cached_hashes()                         # imported blocks registered


def test_abort_around_export_and_import_frees_blocks_on_both_sides():
    model = tiny_model()
    pre = Engine(model, block_size=4, num_blocks=16)
    dec = Engine(model, block_size=4, num_blocks=16)
    sp = SamplingParams(max_tokens=8, temperature=0)
    a = pre.add_request(list(range(40)), sp, prefill_only=True)     # 10 blocks each
    b = pre.add_request(list(range(40, 80)), sp, prefill_only=True)
    pre.step()
    assert a.status == serve.PREFILLED and b.status == serve.WAITING
    with pytest.raises(serve.PoolFull, match="export_kv or abort"):
        pre.step()                                           # a's blocks stop b
    with pytest.raises(UserError, match="not prefilled"):
        pre.export_kv(b.id)
    ex_a = pre.export_kv(a.id, release=False)               # still holding its blocks
    assert pre.alloc.num_used > 0
    pre.abort(a.id)                                          # aborted after export
    while pre.has_work():
        pre.step()
    ex_b = pre.export_kv(b.id)
    assert_pool_clean(pre)
    got = dec.import_kv(ex_a)
    assert not dec.can_import(ex_b)                          # 10 blocks > 16 - 10 free
    before = list(dec.alloc.refcount)
    with pytest.raises(serve.PoolFull, match="retry"):
        dec.import_kv(ex_b)
    assert dec.alloc.refcount == before                      # a refusal changes nothing
    dec.abort(got.id)                                        # aborted after import
    assert_pool_clean(dec)
    dec.import_kv(ex_b)                                      # the retry now fits
    while dec.has_work():
        dec.step()
    assert_pool_clean(dec)
    ex_a["block_size"] = 8
    with pytest.raises(UserError, match="blocks of 8"):
        dec.import_kv(ex_a)


def agent_outputs(model, sessions, **engine_kw):
    """Agent sessions (serve_bench's multi-turn workload) through one engine.
    -> ({(session, turn): (prompt, output)}, engine)."""
    eng = Engine(model, **engine_kw)
    _, done = serve_bench.run_sessions(eng, sessions)
    return {(r.session, r.turn): (r.prompt, s.output_ids) for r, s in done}, eng


def test_second_tier_reloads_give_the_same_outputs_as_recomputing(tmp_path):
    """Multi-turn sessions on a pool too small to keep every conversation: without a tier
    evicted prefixes are recomputed; with a host or a file tier they are reloaded. The
    outputs are the same in all three and equal generate() per turn; the reloads really
    happened; both tiers' accounting holds and the pool ends clean."""
    model = tiny_model(block_size=160)
    sessions = serve_bench.AgentSessions(model.config, None, sessions=5, turns=4,
                                         system_len=12, message_len=(4, 12),
                                         answer_len=(4, 10), seed=3)
    kw = dict(block_size=4, num_blocks=44, max_num_batched_tokens=48)
    ref, eng = agent_outputs(model, sessions, **kw)
    assert len(ref) == 20 and eng.stats["cached_tokens"] > 0
    for prompt, out in list(ref.values())[::3]:
        assert out == model.generate(prompt, len(out), temperature=0)
    for kind in ("host", "file"):
        got, eng = agent_outputs(model, sessions, kv_tier=kind, kv_tier_blocks=24,
                                 kv_tier_dir=str(tmp_path / "tier"), **kw)
        assert got == ref
        tier = eng.alloc.tier
        assert eng.stats["reloaded_tokens"] > 0 and tier.reloads > 0 and tier.puts > 0
        assert tier.bytes_out == tier.reloads * eng.cache.nbytes // eng.cache.num_blocks
        assert_pool_clean(eng)
        tier.check()
    with pytest.raises(UserError, match=">= 1 blocks"):
        Engine(model, kv_tier="host", kv_tier_blocks=0)
    with pytest.raises(UserError, match="needs prefix caching"):
        Engine(model, kv_tier="host", prefix_caching=False)


def test_bench_structured_and_adapter_workloads(tiny_checkpoint, capsys):
    """--workload structured: free text vs a JSON schema, the mask cache's hit rate and a
    fresh mask's cost; --workload adapters: base vs k adapters in one batch vs merged, and
    the memory per adapter (r·(in+out) numbers per adapted layer, 4 B each)."""
    common = ["--checkpoint", tiny_checkpoint, "--num-requests", "6", "--prompt-len", "8:12",
              "--output-len", "4:6"]
    serve_bench.main(common + ["--workload", "structured"])
    serve_bench.main(common + ["--workload", "adapters", "--adapters", "3",
                               "--adapter-rank", "4"])
    out = capsys.readouterr().out
    assert re.search(r"json_schema \d+ tok/s \([\d.]+x\); mask cache \d+% hits", out), out
    assert "base + 3 adapters (rank 4) mixed in every batch" in out
    model, _ = load_model(tiny_checkpoint)
    want = sum(4 * 4 * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in
               ("wq", "wk", "wv", "wo", "w1", "w2", "w3"))
    assert out.count(f"own {fmt_bytes(want)},") == 3, out


def test_bench_agent_workload_compares_tiers_in_process(tiny_checkpoint, tmp_path, capsys):
    runs = serve_bench.main([
        "--checkpoint", tiny_checkpoint, "--workload", "agent", "--sessions", "4",
        "--turns", "3", "--system-len", "8", "--message-len", "4:8", "--answer-len", "4:8",
        "--block-size", "4", "--pool-sizes", "16,24", "--tiers", "none,host,file",
        "--kv-tier-dir", str(tmp_path / "t"), "--clock", "cpu"])
    assert [(r["pool"], r["tier"]) for r in runs] == [
        (p, t) for p in (16, 24) for t in ("none", "host", "file")]
    assert all(r["outputs"] == runs[0]["outputs"] for r in runs)
    assert runs[1]["reloaded"] > 0 and runs[1]["recomputed"] < runs[0]["recomputed"]
    assert "same outputs" in capsys.readouterr().out
    with pytest.raises(UserError, match="--tiers"):
        serve_bench.main(["--checkpoint", tiny_checkpoint, "--workload", "agent",
                          "--tiers", "none,disk"])


def test_mixed_workload_is_seeded_and_mixes_lengths():
    cfg = get_config("tiny", block_size=256)
    a = serve_bench.mixed_workload(40, (4, 8), (150, 200), 0.25, (4, 8), 5.0, cfg, 0, seed=2)
    b = serve_bench.mixed_workload(40, (4, 8), (150, 200), 0.25, (4, 8), 5.0, cfg, 0, seed=2)
    assert a == b
    long = [r for r in a if len(r.prompt) >= 150]
    assert 0 < len(long) < 40 and all(not r.interactive for r in long)
    assert all(x.arrival < y.arrival for x, y in zip(a, a[1:]))


def test_static_batching_equals_generate():
    model = tiny_model()
    prompts, ns = workload(model.config, n=7, seed=9)
    out = static_batch_generate(model, prompts, max(ns))
    assert [o[:n] for o, n in zip(out, ns)] == [model.generate(p, n, temperature=0)
                                                 for p, n in zip(prompts, ns)]


def test_engine_rejects_bad_configuration_and_requests():
    model = tiny_model()
    with pytest.raises(UserError, match="pool too small"):
        Engine(model, block_size=4, num_blocks=15)            # 60 slots < context 64
    with pytest.raises(UserError, match="chunked prefill"):
        Engine(model, chunked_prefill=False, max_num_batched_tokens=32)
    with pytest.raises(UserError, match="policy"):
        Engine(model, policy="lifo")
    eng = Engine(model)
    for prompt, params in (([], None), ([1] * 60, SamplingParams(max_tokens=10)),
                           ([10 ** 6], None), ([1], SamplingParams(max_tokens=0)),
                           ([1], SamplingParams(top_p=0)), ("text", None)):
        with pytest.raises(UserError):
            eng.add_request(prompt, params)
    assert not eng.has_work()


# ----------------------------------------------------------------------------------------
# Fault isolation and the OpenAI sampling parameters, in the engine

def poison_hook(poisoned_ids, stage):
    """A fault_hook (the engine's documented test seam): raise in `stage` whenever a
    poisoned sequence takes part."""
    def hook(where, seqs):
        if where == stage and any(s.id in poisoned_ids for s in seqs):
            raise RuntimeError("poisoned request")
    return hook


@pytest.mark.parametrize("stage", ["forward", "sample"])
def test_a_poisoned_sequence_fails_alone(stage):
    """One sequence whose forward (or sampling) raises, batched with healthy ones and with
    preemption: it alone ends with finish_reason "error"; every other output equals its
    isolated generate(); the pool ends clean."""
    model = tiny_model()
    prompts, ns = workload(model.config, n=8, seed=11)
    ref = [model.generate(p, n, temperature=0) for p, n in zip(prompts, ns)]
    poisoned = {3}
    eng = Engine(model, block_size=4, num_blocks=24, max_num_batched_tokens=16,
                 fault_hook=poison_hook(poisoned, stage))
    seqs = [eng.add_request(p, SamplingParams(max_tokens=n, temperature=0), seq_id=i)
            for i, (p, n) in enumerate(zip(prompts, ns))]
    while eng.has_work():
        eng.step()
    assert seqs[3].finish_reason == "error" and "poisoned" in seqs[3].error
    assert [s.output_ids for i, s in enumerate(seqs) if i != 3] == ref[:3] + ref[4:]
    assert eng.stats["failed"] == 1
    assert (eng.stats["isolation_retries"] > 0) == (stage == "forward")
    assert_pool_clean(eng)


def test_sampling_params_are_checked_numerically_and_tiny_temperature_is_greedy():
    model = tiny_model()
    eng = Engine(model)
    for bad in (dict(temperature=float("nan")), dict(temperature=float("inf")),
                dict(temperature=-1e-9), dict(top_p=float("nan")), dict(top_k=-1),
                dict(presence_penalty=2.5), dict(frequency_penalty=float("-inf")),
                dict(logit_bias=((5, float("nan")),)), dict(logit_bias=((10 ** 6, 1.0),)),
                dict(min_tokens=17), dict(logprobs=21), dict(stop_token_ids=(-1,)),
                dict(seed=-1), dict(max_tokens=True)):
        with pytest.raises(UserError):
            eng.add_request([1, 2], SamplingParams(**bad))
    prompt = [5, 6, 7]
    # 1e-40 (a float32 subnormal) overflows logits / T to inf: below GREEDY_EPS it must be
    # argmax, as vLLM does (1e-30 would not overflow, and would not test the threshold)
    s = eng.generate([prompt], SamplingParams(max_tokens=12, temperature=1e-40))[0]
    assert s.output_ids == model.generate(prompt, 12, temperature=0)
    assert_pool_clean(eng)


def test_logprobs_equal_log_softmax_of_the_model():
    """Output and prompt log-probs (with top-k alternatives) equal log_softmax of the
    model's own logits over the whole sequence, to 1e-5, through chunked prefill and the
    paged cache; the top-k ids are the k largest."""
    model = tiny_model()
    prompt = list(range(7, 30))
    eng = Engine(model, block_size=4, num_blocks=32, max_num_batched_tokens=7)
    s = eng.generate([prompt], SamplingParams(max_tokens=9, temperature=0.8, seed=3,
                                              logprobs=4, prompt_logprobs=3))[0]
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([s.tokens]))[0][0].float(), -1)
    entries = s.prompt_logprobs + s.logprobs
    assert len(s.prompt_logprobs) == len(prompt) - 1 and len(s.logprobs) == 9
    for pos, (tok, value, top) in enumerate(entries):       # predicts token pos + 1
        assert tok == s.tokens[pos + 1]
        assert abs(value - lp[pos, tok].item()) < 1e-5
        want = lp[pos].topk(len(top))
        assert [t for t, _ in top] == want.indices.tolist()
        assert max(abs(v - w) for (_, v), w in zip(top, want.values.tolist())) < 1e-5
    scored = eng.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert scored.output_ids == [] and scored.finish_reason == "length"
    assert [e[:2] for e in scored.prompt_logprobs] == [e[:2] for e in s.prompt_logprobs]
    assert_pool_clean(eng)


def reference_decode(model, prompt, n, eos, presence=0.0, frequency=0.0, bias=(),
                     min_tokens=0, stop_ids=()):
    """The textbook version: the whole sequence through the model each step, OpenAI's
    adjustments spelled out, greedy."""
    tokens = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([tokens]))[0][0, -1].float()
        out = tokens[len(prompt):]
        for t, b in bias:
            logits[t] += b
        if len(out) < min_tokens:
            for t in (eos,) + tuple(stop_ids):
                logits[t] = float("-inf")
        for t in set(out):
            logits[t] -= frequency * out.count(t) + presence
        tokens.append(int(logits.argmax()))
        if tokens[-1] == eos or tokens[-1] in stop_ids:
            break
    return tokens[len(prompt):]


def test_penalties_bias_min_tokens_and_stop_token_ids_equal_the_textbook():
    model = tiny_model()
    prompt = [3, 1, 4, 1, 5]
    plain = model.generate(prompt, 20, temperature=0)
    eos = plain[4]                                # greedy would stop after 5 tokens
    eng = Engine(model, block_size=4, num_blocks=40, eos_id=eos)
    # min_tokens=12 makes greedy cycle through repeated tokens: what the penalties act on
    cases = [dict(presence=1.5, min_tokens=12), dict(frequency=0.7, min_tokens=12),
             dict(presence=-0.5, frequency=1.0, min_tokens=12),
             dict(bias=((plain[0], -100.0), (7, 5.0)), frequency=0.5), dict(min_tokens=12),
             dict(stop_ids=(plain[2],)), dict(min_tokens=6, stop_ids=(plain[2],))]
    outputs = []
    for case in cases:
        want = reference_decode(model, prompt, 20, eos, **case)
        outputs.append(want)
        params = SamplingParams(max_tokens=20, temperature=0,
                                presence_penalty=case.get("presence", 0.0),
                                frequency_penalty=case.get("frequency", 0.0),
                                logit_bias=case.get("bias", ()),
                                min_tokens=case.get("min_tokens", 0),
                                stop_token_ids=case.get("stop_ids", ()))
        got = eng.generate([prompt], params)[0]
        assert got.output_ids == want, case
        assert got.finish_reason == ("stop" if len(want) < 20 else "length"), case
    assert all(o != outputs[4] for o in outputs[:3])     # the penalties changed the output
    assert outputs[3] != plain and outputs[5] != plain[:5] and outputs[6] != outputs[5]
    assert eng.generate([prompt], SamplingParams(max_tokens=20, temperature=0))[0].output_ids \
        == plain[:5]
    assert_pool_clean(eng)


def test_n_choices_wait_for_the_first_prefill_and_share_its_blocks():
    """n = 4 choices of one 30-token prompt: the first prefills, the other three are held
    until its prompt is cached and then hit 7 of its blocks (28 tokens) each; seeded
    choices draw what generate(seed=...) draws."""
    model = tiny_model()
    prompt = [(7 * i) % 60 + 1 for i in range(30)]
    eng = Engine(model, block_size=4, num_blocks=64)
    params = [SamplingParams(max_tokens=10, temperature=0.9, seed=40 + j) for j in range(4)]
    first = eng.add_request(prompt, params[0])
    rest = [eng.add_request(prompt, p, after=first) for p in params[1:]]
    assert all(s.status == "held" for s in rest) and len(eng.waiting) == 1
    while eng.has_work():
        eng.step()
    assert first.num_cached_tokens == 0 and [s.num_cached_tokens for s in rest] == [28] * 3
    assert [s.output_ids for s in [first] + rest] == [
        model.generate(prompt, 10, temperature=0.9, seed=40 + j) for j in range(4)]
    aborted = eng.add_request(prompt + [1], params[0])
    held = eng.add_request(prompt + [1], params[1], after=aborted)
    eng.abort(held.id)                            # a held choice can be aborted
    eng.abort(aborted.id)
    assert_pool_clean(eng)


# ----------------------------------------------------------------------------------------
# The HTTP server, over real sockets on 127.0.0.1

def server_model(enc):
    """Tiny, random, with a 256-token context; its <|endoftext|> logit is pinned to 0 so
    greedy streams run to max_tokens (random logits would end some after a few tokens)."""
    model = tiny_model(seed=4, vocab_size=enc.n_vocab, block_size=256)
    with torch.no_grad():
        model.output.weight[enc.eot_token] = 0
    return model


@pytest.fixture(scope="module")
def server():
    enc = byte_encoding()
    model = server_model(enc)
    eng = Engine(model, enc, block_size=8, num_blocks=600, max_num_seqs=32)
    srv = make_server(eng, enc, "127.0.0.1", 0, model_name="tiny", max_body_bytes=4096,
                      max_tokens_cap=200)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    srv.model, srv.enc = model, enc
    yield srv
    srv.shutdown()
    srv.server_close()
    srv.loop.stop()


def request(srv, method, path, body=None, raw=None):
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=60)
    payload = raw if raw is not None else (json.dumps(body) if body is not None else None)
    conn.request(method, path, body=payload, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    out = r.status, r.getheader("Content-Type"), r.read()
    conn.close()
    return out[0], out[1], json.loads(out[2]) if out[2] else None


def stream(srv, path, body, stop_after=None):
    """POST with stream: true; -> (events, saw [DONE]). stop_after=k closes the socket
    after k events (a client going away)."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=60)
    conn.request("POST", path, body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("Content-Type") == "text/event-stream"
    events, done = [], False
    while True:
        line = r.fp.readline()
        if not line:
            break
        line = line.decode().strip()
        if not line:
            continue
        assert line.startswith("data: ")
        if line == "data: [DONE]":
            done = True
            continue
        events.append(json.loads(line[6:]))
        if stop_after is not None and len(events) >= stop_after:
            break
    if conn.sock:
        conn.sock.close()
    conn.close()
    return events, done


def expected_text(srv, prompt_text, n):
    ids = srv.model.generate(srv.enc.encode_ordinary(prompt_text), n, temperature=0,
                             eos_id=srv.enc.eot_token)
    if ids and ids[-1] == srv.enc.eot_token:
        ids = ids[:-1]
    return decode_tokens(srv.enc, ids)


def wait_idle(srv, timeout=20):
    t = time.time()
    while time.time() - t < timeout:
        _, _, h = request(srv, "GET", "/health")
        if h["running"] == 0 and h["waiting"] == 0 and h["in_flight"] == 0:
            return h
        time.sleep(0.05)
    raise AssertionError(f"server not idle: {h}")


def test_completions_models_and_health(server):
    status, ctype, body = request(server, "POST", "/v1/completions",
                                  {"model": "tiny", "prompt": "def add(a, b):",
                                   "max_tokens": 12, "temperature": 0})
    assert status == 200 and ctype == "application/json"
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    choice = body["choices"][0]
    assert choice["text"] == expected_text(server, "def add(a, b):", 12)
    assert choice["finish_reason"] in ("length", "stop")
    assert body["usage"]["prompt_tokens"] == len("def add(a, b):")
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + \
        body["usage"]["completion_tokens"]
    status, _, models = request(server, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["tiny"]
    status, _, health = request(server, "GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["num_blocks"] == 600


def test_chat_completions(server):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi!"}]}]
    status, _, body = request(server, "POST", "/v1/chat/completions",
                              {"messages": messages, "max_tokens": 10, "temperature": 0})
    assert status == 200 and body["object"] == "chat.completion"
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant"
    prompt = "### System:\nBe brief.\n\n### User:\nHi!\n\n### Assistant:\n"
    want = expected_text(server, prompt, 10)
    assert msg["content"] == want.split("\n### ")[0]
    assert body["usage"]["prompt_tokens"] == len(prompt)


def test_streaming_completions_and_chat(server):
    body = {"prompt": "import os\n", "max_tokens": 25, "temperature": 0}
    _, _, whole = request(server, "POST", "/v1/completions", body)
    events, done = stream(server, "/v1/completions", {**body, "stream_options":
                                                      {"include_usage": True}})
    assert done and all(e["object"] == "text_completion" for e in events)
    text_events = [e for e in events if e["choices"]]
    assert "".join(e["choices"][0]["text"] for e in text_events) == whole["choices"][0]["text"]
    assert all(e["choices"][0]["finish_reason"] is None for e in text_events[:-1])
    assert text_events[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert events[-1]["usage"] == whole["usage"]
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 15,
            "temperature": 0}
    _, _, whole = request(server, "POST", "/v1/chat/completions", chat)
    events, done = stream(server, "/v1/chat/completions", chat)
    assert done and all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert content == whole["choices"][0]["message"]["content"]
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")


BAD_REQUESTS = [
    ("POST", "/v1/completions", None, '{"prompt": ', 400),                 # bad JSON
    ("POST", "/v1/completions", [1, 2], None, 400),                        # not an object
    ("POST", "/v1/completions", {}, None, 400),                            # missing prompt
    ("POST", "/v1/completions", {"prompt": 5}, None, 400),                 # wrong type
    ("POST", "/v1/completions", {"prompt": ""}, None, 400),                # empty
    ("POST", "/v1/completions", {"prompt": ["a", 5]}, None, 400),          # mixed prompts
    ("POST", "/v1/completions", {"prompt": [99999]}, None, 400),           # token id range
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": -1}, None, 400),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 0}, None, 400),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": "10"}, None, 400),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2.5}, None, 400),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": True}, None, 400),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 201}, None, 400),   # over cap
    ("POST", "/v1/completions", {"prompt": "x" * 300}, None, 400),         # > context
    ("POST", "/v1/completions", {"prompt": "x" * 100, "max_tokens": 200}, None, 400),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": -1}, None, 400),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": "hot"}, None, 400),
    ("POST", "/v1/completions", {"prompt": "x", "top_p": 0}, None, 400),
    ("POST", "/v1/completions", {"prompt": "x", "stop": 123}, None, 400),
    ("POST", "/v1/completions", {"prompt": "x", "stream": "yes"}, None, 400),
    ("POST", "/v1/completions", {"prompt": "x", "seed": "s"}, None, 400),
    ("POST", "/v1/completions", {"prompt": "x", "n": 0}, None, 400),
    ("POST", "/v1/completions", {"prompt": "x", "model": "gpt-4"}, None, 404),  # unknown model
    ("POST", "/v1/chat/completions", {}, None, 400),                       # no messages
    ("POST", "/v1/chat/completions", {"messages": "hi"}, None, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"content": "hi"}]}, None, 400),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, None, 400),
    ("POST", "/v1/completions", {"prompt": "x" * 5000}, None, 413),        # body too large
    ("POST", "/v1/nothing", {"prompt": "x"}, None, 404),
    ("GET", "/v1/completions", None, None, 405),
    ("DELETE", "/v1/models", None, None, 405),
]


def test_malformed_requests_get_json_4xx_and_server_keeps_serving(server):
    assert len(BAD_REQUESTS) >= 20
    for method, path, body, raw, want in BAD_REQUESTS:
        status, ctype, err = request(server, method, path, body, raw)
        assert status == want, (body, raw, status, err)
        assert ctype == "application/json" and isinstance(err["error"]["message"], str), err
    status, _, ok = request(server, "POST", "/v1/completions", {"prompt": "ok", "max_tokens": 3})
    assert status == 200 and ok["usage"]["completion_tokens"] >= 1
    wait_idle(server)


@pytest.mark.slow
def test_32_concurrent_streaming_clients(server):
    prompts = [f"client {i}: " for i in range(32)]
    start = threading.Barrier(32)          # all connect at once: a burst on the listen queue

    def one(i):
        start.wait()
        events, done = stream(server, "/v1/completions",
                              {"prompt": prompts[i], "max_tokens": 20, "temperature": 0})
        return done, "".join(e["choices"][0]["text"] for e in events)

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    assert all(done for done, _ in results)
    for i, (_, text) in enumerate(results):
        assert text == expected_text(server, prompts[i], 20)
    h = wait_idle(server)
    assert h["used_blocks"] == 0


def test_client_disconnect_aborts_and_frees_blocks(server):
    before = request(server, "GET", "/health")[2]["aborted"]
    events, done = stream(server, "/v1/completions",
                          {"prompt": "a long story", "max_tokens": 200, "temperature": 0,
                           }, stop_after=2)
    assert not done and len(events) == 2
    h = wait_idle(server)
    assert h["aborted"] == before + 1 and h["used_blocks"] == 0
    server.loop.engine.alloc.check(tables=[])


def test_queue_cap_answers_429():
    enc = byte_encoding()
    eng = Engine(server_model(enc), enc, block_size=8, num_blocks=64, max_num_seqs=1)
    srv = make_server(eng, enc, "127.0.0.1", 0, max_queue=1)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        body = {"prompt": "x", "max_tokens": 200, "temperature": 0}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(stream, srv, "/v1/completions", body)
            second = pool.submit(request, srv, "POST", "/v1/completions", body)
            t = time.time()
            while request(srv, "GET", "/health")[2]["in_flight"] < 2:
                assert time.time() - t < 20
                time.sleep(0.01)
            status, _, err = request(srv, "POST", "/v1/completions", body)
            assert status == 429 and "busy" in err["error"]["message"]
            assert first.result()[1] and second.result()[0] == 200
    finally:
        srv.shutdown()
        srv.server_close()
        srv.loop.stop()


# ----------------------------------------------------------------------------------------
# The command line

@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    enc = byte_encoding()
    model = tiny_model(seed=4, vocab_size=enc.n_vocab)
    path = tmp_path_factory.mktemp("ckpt") / "tiny.pt"
    torch.save(dict(config=asdict(model.config), model=model.state_dict(),
                    tokenizer=data.encoding_to_state(enc)), path)
    return str(path)


@pytest.mark.slow
def test_cli_start_up_errors_are_one_line(tiny_checkpoint, tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    cases = [(["--checkpoint", str(tmp_path / "missing.pt")], "not found"),
             (["--checkpoint", tiny_checkpoint, "--num-blocks", "3", "--block-size", "4"],
              "pool too small"),
             (["--checkpoint", tiny_checkpoint, "--port", str(port)], "already in use"),
             (["--checkpoint", tiny_checkpoint, "--kv-tier", "file", "--kv-tier-dir",
               str(blocker / "tier")], "cannot create the KV tier"),
             (["--checkpoint", tiny_checkpoint, "--kv-tier", "host", "--kv-tier-blocks", "0"],
              ">= 1 blocks")]
    try:
        results = run_together([python_cmd("serve.py", *argv) for argv, _ in cases],
                               timeout=120)
    finally:
        busy.close()
    for (_, message), r in zip(cases, results):
        assert r.returncode == 2, r.output
        assert message in r.output and "Traceback" not in r.output, r.output


def test_cli_bench_is_its_own_entry_point(tiny_checkpoint):
    """The benchmark is scripts/serve_bench.py (python -m scripts.serve_bench): its flags
    exist only there, and serve.py's only in serve.py, each refused by the other."""
    with pytest.raises(UserError, match="unrecognized arguments: bench"):
        serve.build_parser().parse_args(["--checkpoint", tiny_checkpoint, "bench"])
    with pytest.raises(UserError, match="--num-requests.*must be positive"):
        serve_bench.main(["--checkpoint", tiny_checkpoint, "--num-requests", "0"])
    assert "--num-requests" not in serve.build_parser().format_help()
    assert "--port" not in serve_bench.build_parser().format_help()


@pytest.mark.slow
def test_cli_bench_runs_baselines_and_matches_them(tiny_checkpoint):
    r = run_python("-m scripts.serve_bench", ["--checkpoint", tiny_checkpoint, "--num-requests", "8",
                                "--prompt-len", "4:20", "--output-len", "4:30",
                                "--block-size", "4", "--num-blocks", "40",
                                "--max-num-batched-tokens", "32", "--static-batch", "4",
                                "--clock", "cpu"], timeout=180)
    assert r.returncode == 0, r.output
    for name in ("static", "fcfs", "slo"):
        assert f"greedy outputs of {name} == sequential generate(): 8/8" in r.output, r.output
    assert "decode roofline" in r.output and "ledger rows:" in r.output
