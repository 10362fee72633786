"""
kv_router.py -- cache-aware routing across engine replicas: send a request to the replica
whose KV cache already holds the longest prefix of its prompt, balanced against load.

    python kv_router.py bench                    # 4 replicas, multi-turn agent sessions
    python kv_router.py bench --replicas 8 --sessions 32 --think-time 0.2
    python kv_router.py bench --help

What it teaches:
  - Serving at scale runs N engine replicas (data parallel), each with its own KV pool and
    its own prefix cache (kvcache.py). A cache hit happens only where the prefix was
    computed: a multi-turn agent session whose turn k lands on another replica than turn
    k-1 recomputes its whole history. Round-robin and least-loaded routing ignore where
    the KV is, so with N replicas a session finds its own history about 1/N of the time.
  - Cache-aware routing (SGLang's router, Zheng et al. 2024, "SGLang: Efficient Execution
    of Structured Language Model Programs"; the same idea in vLLM's production stack and
    NVIDIA Dynamo): the router keeps an approximate index of what each replica caches --
    the chain hashes of its full blocks (kvcache.block_hash, h_i = H(h_{i-1}, block i):
    one hash names a whole prefix, so the longest cached prefix of a prompt on a replica
    is its longest run of leading block hashes found there) -- and sends the request to
    the replica with the longest match.
  - The index is kept in sync by messages: after each step a replica reports the hashes
    its pool gained and lost (registered, evicted). Messages lag, so the index is stale
    by up to a step: a route made on a stale view is a miss (recomputation), never a
    wrong answer -- the replica checks its own cache token by token.
  - Balanced against load: following the cache alone piles hot prefixes on one replica.
    SGLang's rule, used here: when the load is imbalanced (max - min > an absolute
    threshold and max > a relative threshold x min) route to the least loaded replica;
    otherwise to the best match if it covers at least --cache-threshold of the prompt,
    else to the least loaded. A replica whose queue is at its limit (--max-queue) is
    skipped; when all are, the request waits at the router until one finishes: no
    request is lost or refused because a replica is full.

What it saves / adds / sacrifices (measured by `bench`, the three policies on the same
sessions): saves prefill compute and TTFT on workloads that share prefixes (the prefix
hit rate, the tokens recomputed); adds hashing every prompt at the router, an index of
every replica's cached blocks, the messages; sacrifices perfect balance (a long session
sticks to the replica that holds it) and, with a stale index, some hits.

The replicas run in this process, one after another, each as if it had a device of its
own: every replica has its own clock, advanced by the CPU time of its steps (a
discrete-event simulation: the next thing to happen -- an arrival, a message, or the
step of the replica whose clock is earliest -- happens next). So N replicas on one core
behave as N devices in parallel, and a loaded machine's neighbours are not counted.
"""
import argparse
import heapq
import itertools
import math
import random
import time
from collections import deque
from dataclasses import dataclass

import torch

from kvcache import extend_hash_chain
from core.cli import ArgumentParser, add_knobs, knob, require_at_least_one
from core.errors import UserError
from core.runtime import run_cli
from serve import FINISHED, Engine, SamplingParams
from serving.workloads import AgentSessions, BenchRequest, bench_model, length_range, pct

POLICIES = ("cache_aware", "least_loaded", "round_robin")


# ----------------------------------------------------------------------------------------
# Replicas and the messages they send

@dataclass
class CacheEvent:
    """What a replica tells the router after a step: the chain hashes its pool gained and
    lost since its last message, and the requests that finished (the router's load)."""
    time: float                     # the replica's clock when it sent this
    replica: int
    added: list
    evicted: list
    finished: list                  # request ids


class Replica:
    """One engine with a clock of its own. `vtime` is when the replica is next idle; while
    it steps, its clock reads vtime + the CPU time spent in the step so far (the engine
    stamps token times with it)."""

    def __init__(self, rid, make_engine):
        self.id = rid
        self.vtime = 0.0
        self._cpu0 = None
        self.known = set()          # the hashes the router was last told about
        # the engine's clock is this replica's virtual one: its token and finish times are
        # simulated device seconds, on the timeline the arrivals (passed in) live on
        self.engine = make_engine(self.now)

    def now(self):
        if self._cpu0 is None:      # between steps the clock stands still
            return self.vtime
        # process_time, not perf_counter: this process's CPU seconds only, so a neighbour
        # on a shared core does not stretch the step. It sums every thread of the process,
        # though: with --threads > 1 a step is charged its total CPU, more than its wall time
        return self.vtime + time.process_time() - self._cpu0

    def wake(self, t):
        """An idle replica's clock jumps to the arrival of its next request."""
        # only an idle one moves: a busy replica's clock is already >= t (simulate handles
        # an event only once every busy clock has reached it); max: an idle replica whose
        # last step ended after t cannot start the new request before that end
        if not self.engine.has_work():
            self.vtime = max(self.vtime, t)

    def step(self):
        """One engine step, timed; -> the message for the router."""
        self._cpu0 = time.process_time()
        out = self.engine.step()
        # the step's CPU time is charged to this replica alone, as if it had run on a
        # device of its own while the others waited their turn for the one CPU
        self.vtime = self.now()
        self._cpu0 = None
        # step() returns every sequence that sampled a token: only the FINISHED ones end
        return self.report([s.id for s in out if s.status == FINISHED])

    def report(self, finished):
        """The difference between the pool's cached hashes now and what the router was
        told last (BlockAllocator.cached_hashes: every full block with valid K/V). A
        production engine emits these events as it registers and evicts blocks; diffing
        the set once per step costs O(pool) here and leaves the engine untouched."""
        now = self.engine.alloc.cached_hashes()
        # 16 bytes per block (kvcache.block_hash), not its tokens; the two lists are
        # disjoint (the differences of the same two sets), so Router.apply may apply them
        # in either order
        event = CacheEvent(self.vtime, self.id, list(now - self.known),
                           list(self.known - now), finished)
        self.known = now
        return event


# ----------------------------------------------------------------------------------------
# The router

def prompt_chain(tokens, block_size):
    """The chain hashes a replica could hit for this prompt: its full blocks, the last
    token left out (BlockAllocator.match_prefix always recomputes the last token)."""
    # (n - 1) // bs: the count match_prefix looks up, so a router match of m blocks is what
    # the replica would hit, had its cache not changed since its last message. A 16-token
    # prompt with bs = 16 has an empty chain: it can never hit, whatever the route
    return extend_hash_chain([], tokens, (len(tokens) - 1) // block_size, block_size)


class Router:
    """Chooses a replica per request. The index: per replica, the set of chain hashes it
    reported cached (a hash set rather than SGLang's radix tree of tokens: with chained
    hashes a set lookup per block finds the same longest prefix). load: requests routed
    to a replica and not yet reported finished."""

    def __init__(self, n_replicas, policy="cache_aware", max_queue=64, balance_abs=8,
                 balance_rel=1.5, cache_threshold=0.1):
        if policy not in POLICIES:
            raise UserError(f"unknown routing policy {policy!r}: use one of "
                            f"{', '.join(POLICIES)}")
        if n_replicas < 1 or max_queue < 1:
            raise UserError(f"need at least 1 replica and --max-queue >= 1, got "
                            f"{n_replicas} and {max_queue}")
        if balance_abs < 0 or balance_rel < 1 or not 0 <= cache_threshold <= 1:
            raise UserError("need --balance-abs >= 0, --balance-rel >= 1 and "
                            "0 <= --cache-threshold <= 1")
        self.policy, self.max_queue = policy, max_queue
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.cache_threshold = cache_threshold
        # per replica, the chain hashes it reported: 16 bytes per cached block per replica
        # (+ the set's overhead), whatever the block size
        self.index = [set() for _ in range(n_replicas)]
        # the router's own count: +1 at routing, -1 when the message of the step that
        # finished the request arrives (the replica's queue is never read directly)
        self.load = [0] * n_replicas
        self.next_rr = 0            # round_robin: the replica whose turn is next
        self.messages = 0           # received, and hashes carried by them
        self.hashes_moved = 0
        self.waits = 0              # times the head request found every replica full
        self.peak_load = 0

    def apply(self, event):
        """A replica's message: its cached hashes gained and lost, its finished requests."""
        index = self.index[event.replica]
        # in place: after every message is delivered the index equals the replica's
        # cached_hashes() exactly (tests/test_kv_router.py checks it through evictions)
        index.difference_update(event.evicted)
        index.update(event.added)
        self.load[event.replica] -= len(event.finished)
        self.messages += 1
        self.hashes_moved += len(event.added) + len(event.evicted)

    def match(self, replica, chain):
        """Blocks of the prompt's prefix the index says `replica` holds."""
        # Stop at the first miss: block i's hash names blocks 0..i, and match_prefix on the
        # replica stops there too -- a later block still cached after an earlier one was
        # evicted is recomputed with it, so counting it would overstate the hit
        n = 0
        for h in chain:
            if h not in self.index[replica]:
                break
            n += 1
        return n

    def choose(self, chain):
        """-> the replica for a prompt with this hash chain, or None when every replica's
        queue is full (the request then waits here)."""
        # a replica at --max-queue is no candidate, under any policy
        open_ = [r for r in range(len(self.load)) if self.load[r] < self.max_queue]
        if not open_:
            self.waits += 1
            return None
        least = min(open_, key=lambda r: (self.load[r], r))     # ties: the lowest id
        if self.policy == "round_robin":        # the next open replica in turn
            # scan n replicas from next_rr on: open_ is not empty, so one is found; full
            # ones are skipped and keep their turn for the next round
            n = len(self.load)
            pick = next(r % n for r in range(self.next_rr, self.next_rr + n) if r % n in open_)
            self.next_rr = pick + 1
            return pick
        if self.policy == "least_loaded":
            return least
        # a new prefix: the least loaded, ties to the smallest cache (SGLang sends it to
        # the smallest tree), which spreads the sessions' caches over the replicas
        least = min(open_, key=lambda r: (self.load[r], len(self.index[r]), r))
        # SGLang's rule needs both gaps: the absolute one keeps small loads (2 vs 0) from
        # counting as imbalance; the relative one scales with the load. With an idle open
        # replica (min 0) the relative test holds for any max > 0: balance_abs alone
        # decides. Turn it to 0 and --balance-rel to 1 and any difference balances: the
        # cache is followed only when the loads are all equal, close to least_loaded
        loads = [self.load[r] for r in open_]
        if max(loads) - min(loads) > self.balance_abs and \
                max(loads) > self.balance_rel * min(loads):
            return least                        # imbalanced: balance first
        # the longest match; ties to the less loaded, then the lower id
        best = max(open_, key=lambda r: (self.match(r, chain), -self.load[r], -r))
        hit = self.match(best, chain)
        # `hit and`: a zero match is no match, even with --cache-threshold 0 -- the request
        # goes to `least` (ties to the smallest cache), not to `best` among equal zeros.
        # --cache-threshold 1: only a match of every full block counts
        if hit and hit >= self.cache_threshold * len(chain):
            return best
        return least

    def dispatched(self, replica):
        """The request went to `replica`: its load counts it until its finish is reported."""
        self.load[replica] += 1
        self.peak_load = max(self.peak_load, self.load[replica])


# ----------------------------------------------------------------------------------------
# Workloads: serving/workloads.AgentSessions (multi-turn agent sessions: each turn re-sends the
# whole conversation), or the constructed case below; both speak AgentSessions'
# interface: first_turns() -> [BenchRequest], next_turn(request, output ids, finish).

class PrefixGroups:
    """The constructed case: n_groups distinct shared prefixes, each followed by
    per_group different suffixes; one-turn requests `gap` seconds apart, the groups
    interleaved (a, b, c, a, b, c, ...), so round-robin spreads every group over the
    replicas while a cache-aware router keeps each group on one."""

    def __init__(self, n_groups, per_group, prefix_len, suffix_len, out_len, vocab, seed,
                 gap):
        rng = random.Random(seed)
        prefixes = [[rng.randrange(vocab) for _ in range(prefix_len)]
                    for _ in range(n_groups)]
        self.requests = []
        for i in range(n_groups * per_group):
            # group i % n_groups: interleaved, so consecutive requests never share a prefix
            prompt = prefixes[i % n_groups] + [rng.randrange(vocab) for _ in range(suffix_len)]
            # session=i: every request a one-turn session of its own (next_turn: None)
            self.requests.append(BenchRequest(prompt, out_len, i * gap, True, session=i))

    def first_turns(self):
        return list(self.requests)

    def next_turn(self, req, output_ids, finish):
        return None


# ----------------------------------------------------------------------------------------
# The simulation: arrivals, messages and replica steps, in time order

@dataclass
class Routed:
    id: int
    req: BenchRequest
    chain: list
    replica: int = -1
    # prompt tokens whose KV some replica had cached before this arrival -- evictions not
    # subtracted (simulate's `seen` only grows): one shared, unbounded cache's hit
    ideal_hit: int = 0
    seq: object = None              # the engine's Sequence


MESSAGE, ARRIVAL = 0, 1         # event kinds; at equal times a message goes first


def simulate(replicas, router, workload):
    """Run the workload to the end through the router. Events (time, kind, order,
    payload): kind MESSAGE = a replica's message, ARRIVAL = a request (at equal times the
    message first). A turn's follow-up is asked for when the message reporting its answer
    arrives (the client has the answer when the step that finished it ends), and comes
    the workload's think time later. -> [Routed] in arrival order."""
    # one block size for all: a chain hash names a prefix cut at this block size only
    bs = replicas[0].engine.block_size
    # queue: requests waiting at the router for an open replica (FIFO); done: every Routed
    # in arrival order (its index is its id and the engine's seq_id); seen: every hash any
    # replica has reported, for ideal_hit
    events, order, queue, done, seen = [], itertools.count(), deque(), [], set()
    for req in workload.first_turns():
        push(events, order, req.arrival, ARRIVAL, req)
    while events or queue or any(r.engine.has_work() for r in replicas):
        # The next thing to happen: the earliest event, or the step of the busy replica
        # whose clock is earliest. `<=`: an event at the very time a step would start goes
        # first, so that step already sees the message or the new request
        busy = [r for r in replicas if r.engine.has_work()]
        t_step = min((r.vtime for r in busy), default=math.inf)
        if events and events[0][0] <= t_step:
            t, kind, _, payload = heapq.heappop(events)
            if kind == MESSAGE:
                for nxt in deliver(router, workload, done, payload, t):
                    push(events, order, nxt.arrival, ARRIVAL, nxt)
            else:
                item = arrival(payload, len(done), bs, seen)
                done.append(item)
                queue.append(item)
            dispatch(queue, router, replicas, t)
        elif busy:
            rep = min(busy, key=lambda r: (r.vtime, r.id))
            event = rep.step()
            seen.update(event.added)
            # delivered when the step ends, no network delay modelled: push it at
            # event.time + d instead to see stale routes turn into misses
            push(events, order, event.time, MESSAGE, event)
        else:                                # only possible if a request can never fit
            raise RuntimeError("requests wait at the router but no replica has work")
    return done


def push(events, order, t, kind, payload):
    """An event onto the heap. `order` (a counter), unique, breaks ties before the
    payload: heapq would otherwise compare two payloads (dataclasses without an ordering:
    TypeError), and events of equal time and kind keep their push order: the run is
    deterministic."""
    heapq.heappush(events, (t, kind, next(order), payload))


def deliver(router, workload, done, event, t):
    """A replica's message reaches the router at t. -> the follow-up turns it triggers."""
    # the router learns a step's registrations, evictions and finishes only now, at the
    # step's end: the staleness of its index
    router.apply(event)
    follow_ups = []
    for rid in event.finished:                  # the client's next turn
        item = done[rid]
        nxt = workload.next_turn(item.req, item.seq.output_ids, t)
        if nxt is not None:
            follow_ups.append(nxt)
    return follow_ups


def arrival(req, rid, bs, seen):
    """A request reaches the router: its hash chain, and the hit one shared cache of
    everything reported so far (`seen`) would give it. -> its Routed record."""
    # hashing the prompt at the router: one sha256 per full block, per request
    chain = prompt_chain(req.prompt, bs)
    item = Routed(rid, req, chain)
    item.ideal_hit = bs * sum(1 for _ in _leading(chain, seen))
    return item


def dispatch(queue, router, replicas, t):
    """Route the requests waiting at the router, head first, while a replica is open."""
    # head first: None means every replica is full (whatever the chain), so nothing
    # behind the head could go either -- FIFO costs no throughput here
    while queue:
        r = router.choose(queue[0].chain)
        if r is None:                   # every replica full: wait for a finish
            return
        item = queue.popleft()
        item.replica = r
        router.dispatched(r)
        replicas[r].wake(t)             # before add_request: the clock the engine reads
        # arrival=t, the dispatch time: a request that waited at the router has that
        # wait left out of its TTFT (summarize measures from seq.arrival); pass
        # item.req.arrival to count it
        item.seq = replicas[r].engine.add_request(
            item.req.prompt, SamplingParams(max_tokens=item.req.out_len, temperature=0,
                                            ignore_eos=True), arrival=t, seq_id=item.id)


def _leading(chain, hashes):
    """The leading run of `chain` found in `hashes`: Router.match's first-miss rule."""
    for h in chain:
        if h not in hashes:
            return
        yield h


# ----------------------------------------------------------------------------------------
# Measuring: prefix hits, recomputation, TTFT

def summarize(reqs, replicas, router):
    """-> a row: prefix hit rate (prompt tokens served from a replica's cache), the
    hit rate one shared cache would have had, tokens recomputed although their KV was
    cached on some replica when the request was routed, TTFT percentiles (from each
    request's arrival, on its replica's clock), preemptions, requests per replica."""
    prompt = sum(len(r.req.prompt) for r in reqs)
    # num_cached_tokens: prompt tokens taken from the replica's prefix cache at its first
    # admission, whole blocks (a readmission after a preemption is not counted again)
    hit = sum(r.seq.num_cached_tokens for r in reqs)
    ideal = sum(r.ideal_hit for r in reqs)
    # both stamps on the serving replica's clock (seq.arrival = the dispatch time)
    ttft = [r.seq.token_times[0] - r.seq.arrival for r in reqs]
    per_replica = [sum(r.replica == i for r in reqs) for i in range(len(replicas))]
    # recomputed: max(0, ...) per request, since a request admitted after its arrival
    # (it waited at the router or in the engine's queue) can find more cached than `seen`
    # held when it arrived. computed: all tokens run through the model on every replica
    # (prefill chunks + decodes) -- what the hits save
    return dict(requests=len(reqs), prompt=prompt, hit=hit, hit_rate=hit / prompt,
                ideal_rate=ideal / prompt,
                recomputed=sum(max(0, r.ideal_hit - r.seq.num_cached_tokens) for r in reqs),
                computed=sum(rep.engine.stats["computed_tokens"] for rep in replicas),
                ttft=ttft, makespan=max(rep.vtime for rep in replicas),
                preemptions=sum(rep.engine.stats["preemptions"] for rep in replicas),
                per_replica=per_replica, messages=router.messages,
                hashes=router.hashes_moved)


def run_policy(model, workload, policy, args):
    """Fresh replicas (empty caches) and a fresh router; the whole workload through them.
    -> (summary row, {(session, turn): output ids})."""
    def make_engine(clock):
        return Engine(model, block_size=args.block_size, num_blocks=args.num_blocks,
                      max_num_batched_tokens=args.max_num_batched_tokens,
                      max_num_seqs=args.max_num_seqs, clock=clock)
    # fresh for every policy: each starts from empty caches and zero clocks, and the
    # workload replays the same seeded conversations (as long as the outputs agree)
    replicas = [Replica(i, make_engine) for i in range(args.replicas)]
    router = Router(args.replicas, policy, args.max_queue, args.balance_abs,
                    args.balance_rel, args.cache_threshold)
    reqs = simulate(replicas, router, workload)
    for rep in replicas:            # every block back: free or cached, refcount 0
        rep.engine.alloc.check(tables=[])
    return summarize(reqs, replicas, router), {(r.req.session, r.req.turn): r.seq.output_ids
                                               for r in reqs}


def print_table(rows):
    print(f"\n{'policy':<14}{'hit rate':>9}{'(1 cache)':>10}{'recomputed':>11}"
          f"{'computed':>9}{'TTFT p50/p99 ms':>17}{'makespan s':>11}{'preempt':>8}"
          f"  requests per replica")
    for name, s in rows:
        print(f"{name:<14}{s['hit_rate']:>9.1%}{s['ideal_rate']:>10.1%}{s['recomputed']:>11}"
              f"{s['computed']:>9}{pct(s['ttft'], 50) * 1e3:>9.1f}/"
              f"{pct(s['ttft'], 99) * 1e3:<7.1f}{s['makespan']:>11.2f}{s['preemptions']:>8}"
              f"  {s['per_replica']}")


def bench(args):
    torch.set_num_threads(args.threads)
    model = bench_model(args.checkpoint, args.preset, args.context, args.seed)
    cfg = model.config
    workload = AgentSessions(cfg, None, args.sessions, args.turns, args.system_len,
                             length_range(args.message_len, "message-len"),
                             length_range(args.answer_len, "answer-len"), args.think_time,
                             args.rate, args.seed)
    print(f"model: {args.checkpoint or 'random-init ' + args.preset} ({cfg.n_layer} layers, "
          f"context {cfg.block_size}); {args.replicas} replicas x {args.num_blocks} blocks of "
          f"{args.block_size} tokens; {args.sessions} agent sessions of up to {args.turns} "
          f"turns (a shared {args.system_len}-token system prompt, messages "
          f"{args.message_len}, answers {args.answer_len} tokens), think time "
          f"{args.think_time} s; max queue {args.max_queue} per replica")
    print("clock: each replica's own, advanced by the CPU time of its steps (the replicas "
          "as N devices in parallel; a loaded 2-core CPU)")
    rows, outs = [], {}
    for policy in POLICIES:
        row, outs[policy] = run_policy(model, workload, policy, args)
        rows.append((policy, row))
    print_table(rows)
    # arrival order differs between policies (timing): compare turn by turn
    same = sum(outs["cache_aware"][k] == outs["least_loaded"][k] == outs["round_robin"][k]
               for k in outs["cache_aware"])
    print(f"greedy outputs equal across the three policies: {same}/{len(outs['cache_aware'])}"
          f"; router messages (cache_aware) {rows[0][1]['messages']}, hashes carried "
          f"{rows[0][1]['hashes']}")
    ca, rr = rows[0][1], rows[2][1]          # POLICIES order: cache_aware ... round_robin
    print("\nledger row:")
    print(f"  cache-aware routing | prefix hit rate {ca['hit_rate']:.0%} vs {rr['hit_rate']:.0%}"
          f" round-robin, {rr['recomputed'] - ca['recomputed']} fewer tokens recomputed, TTFT "
          f"p50 {pct(ca['ttft'], 50) * 1e3:.0f} vs {pct(rr['ttft'], 50) * 1e3:.0f} ms | a hash "
          f"chain per prompt, an index of every replica's blocks, "
          f"{ca['hashes']} hashes in messages | balance (requests per replica "
          f"{ca['per_replica']})")
    return rows


# ----------------------------------------------------------------------------------------
# The command line

# Every knob once, a row each (flag, default, help; core/cli.py turns the rows into flags).
MODEL_KNOBS = [                 # the model and the replicas' engines
    knob("--checkpoint", None, "a model from train.py; None = a random-init --preset model"),
    knob("--preset", "tiny", "model preset without --checkpoint"),
    knob("--context", 256, "the --preset model's context (None = the preset's)"),
    knob("--threads", 1, "torch CPU threads"),
    knob("--replicas", 4, "engine replicas"),
    knob("--block-size", 16, "tokens per KV block"),
    knob("--num-blocks", 96, "KV blocks per replica"),
    knob("--max-num-batched-tokens", 256, "token budget of one engine step"),
    knob("--max-num-seqs", 16, "running sequences per replica"),
]

ROUTER_KNOBS = [                # Router's arguments: SGLang's balance rule and the queue cap
    knob("--max-queue", 16, "requests a replica may hold; beyond, requests wait at the router"),
    knob("--balance-abs", 8, "imbalanced when max - min load exceeds this ..."),
    knob("--balance-rel", 1.5, "... and max > this x min"),
    knob("--cache-threshold", 0.1, "least fraction of the prompt's blocks the best match must "
                                   "cover"),
]

WORKLOAD_KNOBS = [              # serving/workloads.AgentSessions' arguments
    knob("--sessions", 16, "agent sessions"),
    knob("--turns", 6, "turns per session at most"),
    knob("--system-len", 32, "tokens of the system prompt every session starts with"),
    knob("--message-len", "8:24", "new tokens per turn, LO:HI"),
    knob("--answer-len", "8:24", "answer tokens per turn, LO:HI"),
    knob("--think-time", 0.05, "seconds between an answer and the next turn"),
    knob("--rate", math.inf, "sessions starting per second, Poisson (inf = all at once)"),
    knob("--seed", 0, "workload and model seed"),
]


def build_parser():
    # argparse's formatter, not core.cli's: "(default: None)" by --checkpoint, as ever
    formatter = argparse.ArgumentDefaultsHelpFormatter
    p = ArgumentParser(description="Cache-aware routing across engine replicas vs "
                       "round-robin and least-loaded, on multi-turn agent sessions.",
                       formatter_class=formatter)
    sub = p.add_subparsers(dest="mode", required=True)
    b = sub.add_parser("bench", help="the three policies on one seeded workload",
                       formatter_class=formatter)
    add_knobs(b, MODEL_KNOBS)
    add_knobs(b, ROUTER_KNOBS, "router")
    add_knobs(b, WORKLOAD_KNOBS, "workload (serving/workloads.AgentSessions)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    require_at_least_one(args, ("replicas", "block_size", "num_blocks",
                                "max_num_batched_tokens", "max_num_seqs", "threads"))
    Router(args.replicas, "cache_aware", args.max_queue, args.balance_abs,    # its checks,
           args.balance_rel, args.cache_threshold)                        # before any work
    return bench(args)


if __name__ == "__main__":
    run_cli(main)
