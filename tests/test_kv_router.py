"""kv_router.py: cache-aware routing beats round-robin where the answer is known, the
index the messages keep equals every replica's real cache, no request is lost when the
replicas are full, outputs equal model.generate() whatever the route, bad input is one
error."""
import pytest
import torch

import kv_router
from harness import run_python
from kv_router import PrefixGroups, Replica, Router, simulate, summarize
from model import GPT, get_config
from core.errors import UserError
from serve import Engine
from scripts.serve_bench import AgentSessions

pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.py: tiny tensors, one thread

BS = 4                                                 # tokens per KV block


@pytest.fixture(scope="module")
def model():
    return GPT(get_config("tiny"), seed=3).eval()


def run(model, workload, policy, n=2, num_blocks=64, max_queue=16, **engine):
    def make_engine(clock):
        return Engine(model, block_size=BS, num_blocks=num_blocks, clock=clock, **engine)
    replicas = [Replica(i, make_engine) for i in range(n)]
    router = Router(n, policy, max_queue=max_queue)
    reqs = simulate(replicas, router, workload)
    return reqs, replicas, router


def assert_exact_and_clean(model, reqs, replicas):
    """Every request answered, greedy outputs == model.generate(), pools all free or
    cached, no reference left."""
    for r in reqs:
        assert r.seq.finish_reason == "length"
        assert r.seq.output_ids == model.generate(r.req.prompt, r.req.out_len, temperature=0)
    for rep in replicas:
        assert not rep.engine.has_work() and not rep.engine.live
        rep.engine.alloc.check(tables=[])


def test_cache_aware_beats_round_robin_on_shared_prefixes(model):
    # 3 distinct 16-token prefixes x 4 requests each, interleaved, far apart in time; two
    # replicas. A prompt of 20 tokens can hit (20-1)//4 = 4 blocks = its whole prefix.
    # Cache-aware keeps each group on one replica: the first request misses, 3 hit.
    # Round-robin alternates replicas within a group (3 groups, 2 replicas): 2 miss, 2 hit.
    sessions = PrefixGroups(3, 4, prefix_len=16, suffix_len=4, out_len=2,
                             vocab=model.config.vocab_size, seed=0, gap=100.0)
    hits = {}
    for policy in ("cache_aware", "round_robin", "least_loaded"):
        reqs, replicas, router = run(model, sessions, policy)
        assert_exact_and_clean(model, reqs, replicas)
        hits[policy] = summarize(reqs, replicas, router)["hit"]
    assert hits["cache_aware"] == 3 * 3 * 16
    assert hits["round_robin"] == 3 * 2 * 16
    assert hits["cache_aware"] > hits["round_robin"]


def test_index_equals_the_replicas_caches_through_evictions(model):
    # small pools: blocks are evicted (LRU) while prefixes move; once every message is
    # delivered the router's index is exactly each replica's set of cached hashes
    sessions = PrefixGroups(4, 3, prefix_len=16, suffix_len=8, out_len=4,
                             vocab=model.config.vocab_size, seed=1, gap=0.01)
    reqs, replicas, router = run(model, sessions, "cache_aware", num_blocks=20)
    assert_exact_and_clean(model, reqs, replicas)
    assert sum(rep.engine.alloc.evictions for rep in replicas) > 0
    for i, rep in enumerate(replicas):
        assert router.index[i] == rep.engine.alloc.cached_hashes()
    assert router.load == [0, 0]


@pytest.mark.parametrize("policy", kv_router.POLICIES)
def test_no_request_lost_when_replicas_are_full(model, policy):
    # 8 requests at once, each replica holds 1 at a time and its pool one max-length
    # sequence (64 tokens / 4 = 16 blocks): requests wait at the router, none is lost
    sessions = PrefixGroups(2, 4, prefix_len=12, suffix_len=10, out_len=6,
                             vocab=model.config.vocab_size, seed=2, gap=0.0)
    reqs, replicas, router = run(model, sessions, policy, num_blocks=16, max_queue=1)
    assert len(reqs) == 8
    assert_exact_and_clean(model, reqs, replicas)
    assert router.waits > 0 and router.peak_load == 1


def test_multi_turn_sessions_hit_their_history(model):
    # turn k+1's prompt = turn k's prompt + answer + a new message: cache-aware routing
    # finds the whole history (up to the last partial block) on the replica that served k
    sessions = AgentSessions(model.config, None, sessions=4, turns=3, system_len=8,
                             message_len=(4, 8), answer_len=(3, 6), think_time=0.01)
    reqs, replicas, router = run(model, sessions, "cache_aware", n=3)
    assert_exact_and_clean(model, reqs, replicas)
    for r in reqs:
        if r.req.turn > 0:
            assert r.seq.num_cached_tokens == r.ideal_hit > 0


def test_bad_input_is_one_error(model):
    with pytest.raises(UserError, match="routing policy"):
        Router(2, "random")
    with pytest.raises(UserError, match="at least 1 replica"):
        Router(0)
    with pytest.raises(UserError, match="replicas"):
        kv_router.main(["bench", "--replicas", "0"])
    r = run_python("kv_router.py", ["bench", "--max-queue", "0"], timeout=120)
    assert r.returncode == 2, r.output
    assert r.output.strip().splitlines() == [r.output.strip().splitlines()[-1]]
    assert r.output.startswith("error:") and "max-queue" in r.output


def test_choice_follows_the_cache_unless_load_is_imbalanced():
    # replica 1 holds 3 of the prompt's 4 blocks, replica 2 one block; the rest nothing
    chain = [b"h0", b"h1", b"h2", b"h3"]
    router = Router(3, "cache_aware", max_queue=10, balance_abs=2, balance_rel=1.5)
    router.index[1].update(chain[:3])
    router.index[2].update(chain[:1])
    assert router.choose(chain) == 1                  # longest match
    router.load = [0, 2, 0]                           # within the thresholds: still 1
    assert router.choose(chain) == 1
    router.load = [0, 3, 1]                           # 3 - 0 > 2 and 3 > 1.5 x 0: balance
    assert router.choose(chain) == 0
    router.load = [10, 10, 9]                         # 0 and 1 full: the only open one
    assert router.choose(chain) == 2
    router.load = [10, 10, 10]
    assert router.choose(chain) is None and router.waits == 1
    router.load = [0, 0, 0]
    assert router.choose([b"x"]) == 0                 # no match: least loaded, smallest
