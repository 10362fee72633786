"""
serve.py -- serving the shared GPT to many users at once: a paged-KV engine with
continuous batching, chunked prefill, recompute preemption, prefix caching, SLO-aware
scheduling and fault isolation. Split out by concept: the benchmark that measures the
engine against the two baselines it replaces (sequential generate(), and static batching:
serve_bench.static_batch_generate) is scripts/serve_bench.py (`python -m
scripts.serve_bench` hands it the command line); the OpenAI-compatible HTTP server around
the engine is serving/api_server.py, the protocol it speaks serving/openai_api.py.

    python serve.py --port 8000         # serve out/ckpt.pt on 127.0.0.1:8000
    python -m scripts.serve_bench       # 64 requests: sequential vs static vs engine

What it teaches, and what each technique saves / adds / sacrifices:
  - Sequential generate() (the reference): one request at a time. Decoding a token reads
    every weight to do 2 FLOPs per weight for ONE token: memory-bound, the hardware idles.
  - Static batching (FasterTransformer-era; the baseline in scripts/serve_bench.py): B requests
    padded to the longest prompt and run until the longest output is done. Saves weight
    reads (one pass serves B tokens); wastes the padded prompt tokens, every finished
    row's slot until the whole batch ends, and reserves KV for B · (longest prompt +
    longest output).
  - Continuous (iteration-level) batching (Orca, Yu et al. OSDI 2022): the batch is
    re-formed every step; a finished sequence leaves and a waiting one joins at once.
    Needs per-sequence lengths in attention (the paged cache, kvcache.py) -- no padding.
  - Chunked prefill (Sarathi-Serve, Agrawal et al. OSDI 2024): a step has a token budget;
    decodes go first (one token each), the rest of the budget carries chunks of prompts.
    Saves decode stalls behind a long prompt (ITL stays flat); adds more, smaller steps
    for a long prompt (its TTFT grows a little).
  - Recompute preemption (vLLM): when the block pool is full, the lowest-priority running
    sequence gives its blocks back and returns to the front of the queue with the tokens
    it already has; later its KV is recomputed (a prefill of prompt + output so far).
    Saves: admission can be optimistic, memory is used by running sequences only. Costs:
    the recomputation (and its latency), never correctness -- nothing is lost.
  - Prefix caching (kvcache.py): requests sharing a prefix reuse its KV blocks. Saves the
    prefill compute of the shared part (TTFT) and the memory of duplicates. n > 1 choices
    of one prompt wait for the first one's prefill, then share its blocks.
  - SLO-aware scheduling: requests carry a priority and a TTFT target; admission and
    preemption follow (priority, deadline) instead of arrival order (earliest deadline
    first). Saves goodput (requests meeting their SLOs) under overload; costs fairness:
    low-priority work waits.
  - Fault isolation: a batch mixes many users' requests, so one bad request must not fail
    the step for all. An exception in the forward is retried sequence by sequence to find
    whose it was; that one fails alone, the step reruns without it. Costs: len(batch) + 1
    extra forwards, only when something fails.
  - int8 KV (kvcache.py): ~3.5x less KV memory (fp32 model) for a small logit error.
  - A second KV tier (kvcache.KVTier, --kv-tier host|file): evicted prefix blocks are
    copied to host memory or a file and reloaded on a later hit instead of recomputed.
    Saves prefill compute on multi-turn sessions; costs the copies and the tier's memory.
  - The disaggregation seam: a prefill_only request parks after its first token;
    export_kv / import_kv move its blocks to another engine, which decodes it.
  - Structured output (serving/structured.py): a request's JSON schema, regex or choices
    compiled once to a byte-level automaton; each step its logits are masked to the
    tokens that keep the automaton alive (masks cached per state). Saves: every finished
    output valid. Costs: a mask per step (a cache hit: under a microsecond; a new state: a
    trie walk of the vocabulary, ~0.5 ms) and a model pushed off its own tokenization.
  - Many LoRA adapters in one batch (serving/multi_lora.py, --lora NAME=PATH): the base
    matmul shared by every row, each token's low-rank pair gathered by its adapter.
    Saves a model copy per adapter; costs a gather and thin matmuls per layer; the prefix
    cache keys blocks by adapter too (an adapter changes the K/V of the same prompt).

The engine drives the unmodified model: the step's tokens (decodes and prefill chunks of
all running sequences) are packed into one row, run through `model.layers` with a
PagedKVCache whose paged attention replaces each layer's attn_fn for the step. Greedy
outputs equal model.generate() per request, token for token (tests/test_serve.py).
"""
import argparse
import bisect
import dataclasses
import itertools
import math
import os
import random
import time

import torch

from core import data
from kvcache import (TIER_KINDS, BlockAllocator, KVTier, PagedKVCache, blocks_for,
                     extend_hash_chain)
from core.checkpoint import load_model
from model import sample_next
from core.cli import command_line, knob
from core.errors import UserError
from core.runtime import pick_device, run_cli
from serving import api_server, multi_lora, structured
from serving.requests import GREEDY_EPS, SamplingParams, decode_tokens

DEFAULT_CHECKPOINT = "out/ckpt.pt"
POLICIES = ("fcfs", "slo")
LOGPROBS_MODES = ("raw", "processed")     # Engine(logprobs_mode=): what a log-prob is of
WAITING, RUNNING, HELD, FINISHED = "waiting", "running", "held", "finished"
PREFILLED = "prefilled"    # prefill_only: first token sampled, blocks held for export_kv
# ----------------------------------------------------------------------------------------
# Requests

class PoolFull(RuntimeError):
    """import_kv found no room (KV blocks or a running slot): nothing changed, retry."""


class Sequence:
    """One request inside the engine: its tokens (prompt + output so far), how many of
    them have their K/V in the cache, its block table, its timings and log-probs."""

    def __init__(self, seq_id, prompt_ids, params, arrival, device):
        self.id, self.params, self.arrival = seq_id, params, arrival
        self.tokens, self.num_prompt = list(prompt_ids), len(prompt_ids)
        # the SLO policy's deadline: when the first token is due
        self.deadline = arrival + (params.ttft_slo if params.ttft_slo is not None else math.inf)
        # num_computed: tokens whose K/V are in the cache. len(tokens) - num_computed is
        # what the next step must compute: 1 for a decode, more for a (re)prefill.
        self.status, self.num_computed = WAITING, 0
        # block_hashes: the chain hashes, computed once and kept across preemptions;
        # num_registered: how many of the table's blocks are in the prefix cache already
        self.block_table, self.block_hashes, self.num_registered = [], [], 0
        # the prefix cache names blocks by tokens AND adapter: an adapter's W_k, W_v make
        # other K/V for the same tokens (kvcache.extend_hash_chain's root)
        self.hash_root = f"lora:{params.adapter}".encode() if params.adapter else None
        self.adapter_slot = 0       # its row of the adapter stacks (0: the base model)
        # structured output: the compiled automaton and where this sequence stands in it
        self.constraint, self.constraint_state = None, None
        self.token_times, self.finish_time, self.finish_reason, self.text = [], None, None, None
        self.num_preemptions, self.num_cached_tokens, self.num_pushed = 0, None, 0
        self.logprobs = []          # per output token: (token, logprob, [(id, logprob)])
        self.prompt_logprobs = []   # the same for prompt tokens 1 .. num_prompt-1
        self.after, self.error = None, None    # held behind this sequence; failure message
        self.generator, self.prefill_only = None, False
        if params.temperature >= GREEDY_EPS:   # the stream of numbers generate(seed=) uses
            # One generator per sequence, not one per engine: a request's samples must not
            # depend on which other requests shared its steps. Unseeded: a fresh seed.
            seed = params.seed if params.seed is not None else random.getrandbits(62)
            self.generator = torch.Generator(device=device).manual_seed(seed)

    @property
    def output_ids(self):
        return self.tokens[self.num_prompt:]


def logprob_entry(logits, token, k):
    """(token, log p(token), the k most likely [(id, log p)]) from one row of raw logits:
    log_softmax of the model's own distribution, before temperature, penalties or bias
    (what a calibration measurement needs)."""
    # float(): a bf16 model's logits would round log-probs to 2-3 significant digits
    lp = torch.log_softmax(logits.float(), -1)
    top = lp.topk(k) if k else None
    pairs = list(zip(top.indices.tolist(), top.values.tolist())) if k else []
    return token, float(lp[token]), pairs


# ----------------------------------------------------------------------------------------
# The engine

class Engine:
    """Waiting and running queues, a KV block pool, and `step()`: schedule -> one forward
    over the packed batch -> sample -> finish/free. Single-threaded on purpose: the HTTP
    layer (serving/api_server.py) talks to it through its own thread's inbox.

    fault_hook: a test seam for fault isolation, None in service. Called as
    fault_hook("forward", seqs) before each forward and fault_hook("sample", [seq])
    before each sampling; whatever it raises is handled as a fault of those sequences.
    adapters: a serving.multi_lora.AdapterSet (serve.py --lora NAME=PATH): a request picks
    one by name (SamplingParams.adapter), and requests of different adapters share a batch."""

    def __init__(self, model, enc=None, block_size=16, num_blocks=1024,
                 max_num_batched_tokens=256, max_num_seqs=64, policy="fcfs",
                 prefix_caching=True, chunked_prefill=True, kv_dtype=None, eos_id=None,
                 clock=time.perf_counter, fault_hook=None, kv_tier="none",
                 kv_tier_blocks=1024, kv_tier_dir=None, adapters=None, logprobs_mode="raw"):
        cfg = model.config
        if policy not in POLICIES:
            raise UserError(f"unknown policy {policy!r}: use {' or '.join(POLICIES)}")
        if logprobs_mode not in LOGPROBS_MODES:
            raise UserError(f"unknown logprobs_mode {logprobs_mode!r}: use "
                            f"{' or '.join(LOGPROBS_MODES)}")
        if block_size < 1 or num_blocks < 1 or max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise UserError("block_size, num_blocks, max_num_seqs and max_num_batched_tokens "
                            "must all be >= 1")
        # A pool that cannot hold one max-length sequence would stall: that sequence
        # preempts everyone, then itself, and can never be admitted again -- step()'s
        # "no progress" error. Refused up front, with the number to use.
        if num_blocks * block_size < cfg.block_size:
            raise UserError(f"KV block pool too small: {num_blocks} blocks x {block_size} "
                            f"tokens = {num_blocks * block_size} slots cannot hold one "
                            f"max-length sequence ({cfg.block_size} tokens); raise "
                            f"--num-blocks to at least {blocks_for(cfg.block_size, block_size)}")
        # Likewise without chunking: a prompt longer than the budget could never start.
        if not chunked_prefill and max_num_batched_tokens < cfg.block_size:
            raise UserError(f"without chunked prefill a whole prompt must fit one step: "
                            f"--max-num-batched-tokens must be >= the context "
                            f"({cfg.block_size}), got {max_num_batched_tokens}")
        self.model, self.enc, self.cfg, self.clock = model.eval(), enc, cfg, clock
        self.fault_hook = fault_hook
        # vLLM's logprobs_mode: "raw" (OpenAI's: the model's own distribution, before
        # temperature and every adjustment) or "processed" (the law the token was drawn
        # from: adjusted logits / temperature) -- what an RL trainer's importance ratio needs
        self.logprobs_mode = logprobs_mode
        # Many LoRA adapters in one batch, never merged (serving/multi_lora.py): the adapted
        # linears are wrapped in place; each step tells them every token's adapter.
        self.lora = multi_lora.attach(model, adapters) if adapters is not None else None
        self.compiler = None        # structured output's automata, compiled on first use
        self.eos_id = eos_id if eos_id is not None else (enc.eot_token if enc else None)
        weight = model.output.weight
        self.device = weight.device
        self.block_size, self.policy, self.chunked_prefill = block_size, policy, chunked_prefill
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        # The pool is the engine's whole KV memory, allocated once: bytes_per_token (GQA:
        # 2·L·H_kv·D·bytes, + scales for int8) times num_blocks·block_size slots.
        self.cache = PagedKVCache(cfg, num_blocks, block_size, weight.dtype, weight.device,
                                  kv_dtype)
        # the second tier (kvcache.KVTier): evicted prefix blocks kept, not dropped
        tier = None if kv_tier == "none" else KVTier(self.cache, kv_tier, kv_tier_blocks,
                                                     kv_tier_dir)
        self.alloc = BlockAllocator(num_blocks, block_size, prefix_caching, tier)
        self.waiting, self.running, self.live = [], [], {}
        self.held = {}              # sequence id -> the sequences admitted after its prefill
        self.ids = itertools.count()
        self.stats = dict(steps=0, preemptions=0, aborted=0, failed=0, finished=0,
                          prompt_tokens=0, cached_tokens=0, reloaded_tokens=0,
                          computed_tokens=0,
                          output_tokens=0, max_waste=0, waste_sum=0, waste_samples=0,
                          peak_blocks=0, isolation_retries=0)
        self.step_log = []   # per step: seconds, tokens, decodes, context read, sequences

    # -- requests -------------------------------------------------------------------------
    def add_request(self, prompt, params=None, arrival=None, seq_id=None, after=None,
                    prefill_only=False):
        """prompt: a string (needs the tokenizer) or a list of token ids. after: a live
        Sequence with the same prompt (n > 1 choices): this one waits until that one's
        prompt is in the cache, then is admitted with its blocks as prefix-cache hits.
        prefill_only (the prefill side of disaggregation): once the prompt is computed and
        the first token sampled, the sequence stops in status PREFILLED, out of the
        queues, keeping its blocks, until `export_kv` (or `abort`) takes it out. If that
        first token already ends it (max_tokens=1, a stop), it finishes as usual."""
        params = (params or SamplingParams()).validate(self.cfg.vocab_size)
        if isinstance(prompt, str):
            if self.enc is None:
                raise UserError("a text prompt needs the engine's tokenizer (enc=...)")
            prompt = self.enc.encode_ordinary(prompt)   # user text never makes special tokens
        if not prompt:
            raise UserError("the prompt is empty")
        if any(not 0 <= t < self.cfg.vocab_size for t in prompt):
            raise UserError(f"prompt token ids must be in [0, {self.cfg.vocab_size})")
        # Checked at admission, not mid-decode: past block_size there is no position left
        # (the RoPE table has block_size rows), and a request must not fail halfway.
        if len(prompt) + params.max_tokens > self.cfg.block_size:
            raise UserError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens})"
                            f" exceeds the model's context of {self.cfg.block_size} tokens")
        slot = self._adapter_slot(params.adapter)
        constraint = self._constraint(params.structured)
        seq = Sequence(next(self.ids) if seq_id is None else seq_id, prompt, params,
                       self.clock() if arrival is None else arrival, self.device)
        seq.prefill_only, seq.adapter_slot = prefill_only, slot
        if constraint is not None:
            seq.constraint, seq.constraint_state = constraint, constraint.start()
        self.live[seq.id] = seq
        # Held only while the sibling's prompt is still being computed: admitted now, this
        # one would prefill the same prompt a second time. Once the sibling's prompt is in
        # the cache, a plain admission finds it as prefix-cache hits anyway.
        if (after is not None and self.alloc.prefix_caching and after.id in self.live
                and after.num_computed < after.num_prompt):
            seq.status, seq.after = HELD, after.id
            self.held.setdefault(after.id, []).append(seq)
        else:
            bisect.insort(self.waiting, seq, key=self._key)
        return seq

    def _adapter_slot(self, name):
        """The adapter stacks' row of a request's adapter (0: the base), or one UserError."""
        if name is None:
            return 0
        if self.lora is None:
            raise UserError(f"no LoRA adapters are loaded (asked for {name!r}): serve.py "
                            f"--lora NAME=PATH loads them")
        return self.lora.adapter_set.index(name)

    def _constraint(self, spec):
        """A request's structured-output spec -> its compiled automaton (serving/structured.py;
        the compiler keeps compiled specs, so a schema sent again compiles once), or None.
        A spec no token sequence can satisfy is one UserError here: a 400, never a hang."""
        if spec is None:
            return None
        if self.enc is None:
            raise UserError("structured output needs the engine's tokenizer (enc=...)")
        if self.compiler is None:           # built on first use: the vocabulary's byte trie
            self.compiler = structured.Compiler(
                structured.Vocabulary.from_encoding(self.enc, self.cfg.vocab_size))
        kind = spec["type"]
        constraint = (self.compiler.json_object() if kind == "json_object" else
                      self.compiler.json_schema(spec.get("schema"), spec.get("wrap"))
                      if kind == "json_schema"
                      else self.compiler.regex(spec.get("pattern")) if kind == "regex"
                      else self.compiler.choice(spec.get("choices")))
        if constraint.dead(constraint.start()):
            raise UserError(f"structured output ({kind}): no token of this vocabulary can "
                            f"begin an output that satisfies it")
        return constraint

    def _release_held(self, seq):
        """The sequences held behind seq join the waiting queue (in key order)."""
        for child in self.held.pop(seq.id, []):
            child.status = WAITING
            bisect.insort(self.waiting, child, key=self._key)

    def abort(self, seq_id):
        seq = self.live.get(seq_id)
        if seq is not None:
            self._finish(seq, "abort")
            self.stats["aborted"] += 1
        return seq

    def has_work(self):
        return bool(self.waiting or self.running)

    def reset_prefix_cache(self):
        """New weights (an RL trainer's sync): forget the cached K/V of the old ones, which
        would otherwise be served as prefix hits. Only between requests. -> blocks dropped."""
        if self.live:
            raise UserError(f"reset_prefix_cache with {len(self.live)} requests in flight: "
                            f"their K/V come from the old weights too; finish them first")
        return self.alloc.drop_cached()

    def generate(self, prompts, params=None):
        """In-process use: run a list of prompts to completion -> their Sequences
        (`.output_ids`, `.text`, `.finish_reason`, `.token_times`), in order."""
        if not isinstance(params, (list, tuple)):
            params = [params] * len(prompts)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        while self.has_work():
            self.step()
        return seqs

    def _key(self, seq):
        """Order of admission and of preemption (the last is preempted first). FCFS:
        arrival. SLO: priority, then earliest TTFT deadline (EDF). A preempted sequence
        keeps its key, so under FCFS it goes back to the front of the queue."""
        # seq.id last: keys are unique, so the order (and running[-1], the preemption
        # victim) never depends on insertion order -- runs are reproducible.
        if self.policy == "slo":
            return seq.params.priority, seq.deadline, seq.arrival, seq.id
        return seq.arrival, seq.id
    # -- scheduling -----------------------------------------------------------------------
    def _schedule(self):
        """-> [(seq, n_new_tokens)] for this step, within the token budget.
        1. running decodes first (1 token each), then running prefill chunks: growing a
           block table may need a block; if none is free, preempt the running sequence
           with the last key (taking it out of this step if it was scheduled already;
           possibly the sequence itself);
        2. if nothing was preempted, admit waiting sequences in key order while the budget,
           max_num_seqs and the free blocks allow, using prefix-cache hits."""
        budget, batch, preempted = self.max_num_batched_tokens, {}, False   # seq -> n
        # Decodes first (Sarathi-Serve's stall-free batching): a decode costs one token of
        # budget and its user is waiting on it; prompts fill what is left.
        decodes = [s for s in self.running if len(s.tokens) - s.num_computed == 1]
        prefills = [s for s in self.running if len(s.tokens) - s.num_computed > 1]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status != RUNNING:            # preempted earlier in this loop
                continue
            # a prefill longer than the remaining budget runs as a chunk of it
            n = min(len(seq.tokens) - seq.num_computed, budget)
            # No room for the chunk: free blocks by preempting from the back of the running
            # order until it fits (each preemption releases a whole table).
            while not self.alloc.grow(seq.block_table, seq.num_computed + n):
                victim = self.running[-1]        # the last key: lowest priority / newest
                if victim in batch:              # scheduled already: take it back out
                    budget += batch.pop(victim)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status == RUNNING:
                batch[seq] = n
                budget -= n
        # After a preemption the pool is known to be short: admitting now would only
        # preempt again next step (thrashing). Admission stops at the first sequence
        # that does not fit, so a large request is not starved by smaller ones behind it.
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            n = self._admit(seq, budget)
            if n is None:
                break
            batch[seq] = n
            budget -= n
        return list(batch.items())

    def _admit(self, seq, budget):
        """Admit the first waiting sequence if its first chunk fits: its prefix-cache hits
        (pool blocks acquired, second-tier blocks reloaded) and fresh blocks for the rest.
        -> the tokens it computes this step, or None (it stays first in the queue)."""
        # prompt log-probs need the logits of every prompt position: no cache hits
        scoring = len(seq.prompt_logprobs) < seq.num_prompt - 1 and \
            seq.params.prompt_logprobs is not None
        hits = [] if scoring else self.alloc.match_prefix(seq.tokens, seq.block_hashes,
                                                          seq.hash_root)
        tier = [] if scoring else self.alloc.match_tier(seq.tokens, seq.block_hashes, len(hits),
                                                        seq.hash_root)
        cached = (len(hits) + len(tier)) * self.block_size
        # A preempted sequence comes back here too: its own released blocks are often
        # still cached, so its "recompute" is mostly hits (prompt + output so far).
        n = len(seq.tokens) - cached
        if n > budget:
            if not self.chunked_prefill:
                return None
            n = budget
        if not self.alloc.can_allocate(blocks_for(cached + n, self.block_size) - len(hits),
                                       hits):
            return None
        self.waiting.pop(0)
        # Order matters: the hits are acquired (out of the LRU) before reload() and grow()
        # allocate, since an allocation may evict any block still at refcount 0.
        for block in hits:
            self.alloc.acquire(block)
        seq.block_table = list(hits) + self.alloc.reload(tier)
        self.alloc.grow(seq.block_table, cached + n)
        seq.num_computed, seq.status = cached, RUNNING
        # hits are registered already, and reload() registered the tier's blocks
        seq.num_registered = len(hits) + len(tier)
        # counted once: a preempted sequence's readmission must not inflate the hit rate
        if seq.num_cached_tokens is None:        # first admission: prefix-cache statistics
            seq.num_cached_tokens = cached
            self.stats["prompt_tokens"] += seq.num_prompt
            self.stats["cached_tokens"] += cached
            self.stats["reloaded_tokens"] += len(tier) * self.block_size
        bisect.insort(self.running, seq, key=self._key)
        return n

    def _preempt(self, seq):
        """Recompute preemption: give back every block, keep the tokens, requeue."""
        self.running.remove(seq)
        # With prefix caching its full blocks stay cached (released, not wiped), the tail
        # first in line for eviction: readmitted soon, it finds most of its K/V still there.
        self.alloc.release_table(seq.block_table)
        seq.num_computed, seq.num_registered, seq.status = 0, 0, WAITING
        seq.num_preemptions += 1
        self.stats["preemptions"] += 1
        bisect.insort(self.waiting, seq, key=self._key)

    def _finish(self, seq, reason):
        if seq.status == RUNNING:
            self.running.remove(seq)
        elif seq.status == WAITING:
            self.waiting.remove(seq)
        elif seq.status == HELD:
            self.held[seq.after].remove(seq)
        # every state's blocks go back (a WAITING or HELD table is empty: a no-op)
        self.alloc.release_table(seq.block_table)
        seq.status, seq.finish_reason, seq.finish_time = FINISHED, reason, self.clock()
        del self.live[seq.id]
        self._release_held(seq)            # its choices go on alone (no shared prefix)
        if self.enc is not None and seq.text is None:
            out = seq.output_ids
            if out and reason == "stop" and out[-1] in self._stop_ids(seq):
                out = out[:-1]             # <|endoftext|> / a stop token: not in the text
            seq.text = decode_tokens(self.enc, out)
        self.stats["finished"] += reason not in ("abort", "error", "exported")

    def _fail(self, seq, exc):
        """Fault isolation: this sequence alone ends, with its own error."""
        seq.error = f"{type(exc).__name__}: {exc}"
        self._finish(seq, "error")
        self.stats["failed"] += 1

    def _stop_ids(self, seq):
        eos = () if seq.params.ignore_eos or self.eos_id is None else (self.eos_id,)
        return eos + tuple(seq.params.stop_token_ids)

    # -- one step: schedule -> run -> post-process (nano-vllm's engine loop: a scheduler
    # decides which sequences run, a model runner computes, post-processing appends the
    # tokens and finishes sequences). Each phase below is one method.
    @torch.no_grad()
    def step(self):
        """Schedule, run the model once over the packed batch, sample where a sequence's
        computed tokens reached its end, finish what is done. -> the sequences that got a
        token this step, and those that failed (finish_reason "error")."""
        # schedule: which sequences run, and how many of their tokens (_schedule above)
        batch = self._schedule()
        if not batch:
            return self._nothing_scheduled()
        t0 = self.clock()
        # run: one forward over the packed batch; a fault fails only its own sequence
        batch, logits, rows, failed = self._run(batch)
        self._commit(batch)
        # post-process: score prompt positions and sample, then append and finish
        sampled, failed_sampling = self._sample_rows(logits, rows)
        # one timestamp for the step: every token sampled in it became available at once
        now = self.clock()
        self._append_tokens(sampled, now)
        self._account(batch, now - t0)
        return [seq for seq, _ in sampled] + failed + failed_sampling

    def _nothing_scheduled(self):
        """An empty schedule is fine only when there is no work; else someone must act."""
        parked = sum(s.status == PREFILLED for s in self.live.values())
        if self.has_work() and parked:     # the caller's to fix: export them
            raise PoolFull(f"{parked} prefilled sequences hold the blocks the queue "
                           f"needs: export_kv or abort them")
        if self.has_work():     # the start-up checks make this impossible: a bug
            raise RuntimeError("the scheduler made no progress")
        return []

    def _run(self, batch):
        """The model runner: the packed forward -> (the batch that ran, logits, rows,
        the sequences that failed). A fault is a request's, not the batch's: _isolate
        finds whose it was and reruns the step without them."""
        try:
            logits, rows = self._forward(batch)
        except Exception as e:      # whose fault? find out, then rerun without them
            return self._isolate(batch, e)
        return batch, logits, rows, []

    def _isolate(self, batch, error):
        """The packed forward raised. Run each sequence's part alone: the ones that still
        raise fail with their own error; the step is then rerun without them, so every
        other sequence computes exactly what it would have."""
        self.stats["isolation_retries"] += 1
        failed = []
        for seq, n in batch:
            # A probe writes this sequence's K/V into its own slots only, and the rerun
            # below writes them again: harmless. Its logits are dropped; num_computed is
            # not advanced here. Cost: len(batch) extra forwards, only on a failure.
            try:
                self._forward([(seq, n)])
            except Exception as e:
                failed.append(seq)
                self._fail(seq, e)
        if not failed:              # not reproducible alone: the batch itself is at fault
            for seq, _ in batch:
                self._fail(seq, error)
            return [], None, [], [s for s, _ in batch]
        # _fail finished the culprits (status FINISHED, blocks released): the rest rerun.
        # An error in this rerun is not caught: it propagates out of step().
        batch = [(s, n) for s, n in batch if s.status == RUNNING]
        logits, rows = self._forward(batch) if batch else (None, [])
        return batch, logits, rows, failed

    def _forward(self, batch):
        """The model on the packed step: (1, T) tokens with their own positions; the
        layers are the model's, attention is the paged one. Logits only where needed:
        the last token of sequences that are now complete (a mid-prompt chunk needs none),
        and prompt positions of requests asking for prompt log-probs.
        -> (logits, [(seq, prompt position or None for "sample here")])."""
        model = self.model
        if self.fault_hook is not None:
            self.fault_hook("forward", [seq for seq, _ in batch])
        # the packed row: each sequence's next n uncomputed tokens, in batch order -- the
        # order prepare() below lays out the slot mapping and the attention groups in
        ids = [t for seq, n in batch for t in seq.tokens[seq.num_computed:seq.num_computed + n]]
        picks, rows = self._logit_positions(batch)
        self.cache.prepare([(seq.block_table, seq.num_computed, n) for seq, n in batch])
        if self.lora is not None:       # every token's adapter (serving/multi_lora.py: BGMV)
            self.lora.set_rows([[seq.adapter_slot for seq, n in batch for _ in range(n)]],
                               logits_at=picks)
        idx = torch.tensor([ids], device=self.device)
        # GPT.forward; the layers attend through the paged cache (its `attention`).
        # logits_at: the head (V·D multiply-adds per position) runs on the picked rows
        # only -- one row for a 256-token prefill chunk instead of 256.
        logits, _ = model(idx, positions=self.cache.positions[None], cache=self.cache,
                          logits_at=picks)
        return (logits[0], rows) if picks else (None, [])

    @staticmethod
    def _logit_positions(batch):
        """Where the packed step needs logits: the last token of sequences that are now
        complete, and prompt positions of requests asking for prompt log-probs.
        -> (indices into the packed row, [(seq, prompt position or None)])."""
        picks, rows, end = [], [], 0
        for seq, n in batch:
            start = seq.num_computed
            if seq.params.prompt_logprobs is not None:
                # Position p's logits score prompt token p + 1, so p stops at num_prompt - 2.
                # Starting at len(prompt_logprobs) skips positions already scored.
                for p in range(max(start, len(seq.prompt_logprobs)),
                               min(start + n, seq.num_prompt - 1)):
                    picks.append(end + p - start)
                    rows.append((seq, p))
            end += n
            # all its tokens computed after this step: the last one's logits give the next
            # token. A mid-prompt chunk stops short of len(tokens) and samples nothing.
            if start + n == len(seq.tokens):
                picks.append(end - 1)
                rows.append((seq, None))
        return picks, rows

    def _commit(self, batch):
        """Only after the forward succeeded: the K/V of these n tokens are now in their
        slots, so the blocks they filled may be named in the prefix cache."""
        for seq, n in batch:
            seq.num_computed += n
            self._register_full_blocks(seq)
            if seq.num_computed >= seq.num_prompt:
                self._release_held(seq)    # its prompt's blocks are now in the cache

    def _register_full_blocks(self, seq):
        """Blocks that just became full (and hold computed K/V) join the prefix cache."""
        if not self.alloc.prefix_caching:
            return
        # num_computed // bs, not len(tokens) // bs: a block whose last slots hold
        # sampled-but-uncomputed tokens has no K/V for them yet and must not be shared
        bs, full = self.block_size, seq.num_computed // self.block_size
        extend_hash_chain(seq.block_hashes, seq.tokens, full, bs, seq.hash_root)
        for i in range(seq.num_registered, full):
            self.alloc.register(seq.block_table[i], seq.block_hashes[i],
                                seq.tokens[i * bs:(i + 1) * bs])
        seq.num_registered = max(seq.num_registered, full)

    def _sample_rows(self, logits, rows):
        """Post-processing, first half: each logits row either scores a prompt token
        (prompt log-probs), ends a scoring-only request (max_tokens 0: token None), or
        samples the sequence's next token. -> ([(seq, token or None)], failed): a row
        whose sampling raised fails its sequence alone."""
        sampled, failed = [], []
        for i, (seq, pos) in enumerate(rows):
            if pos is not None:            # a prompt position: score the next prompt token
                seq.prompt_logprobs.append(logprob_entry(logits[i], seq.tokens[pos + 1],
                                                         seq.params.prompt_logprobs))
            elif seq.params.max_tokens == 0:   # scoring only: the prompt is done
                sampled.append((seq, None))
            else:
                try:
                    sampled.append((seq, self._sample_one(seq, logits[i])))
                except Exception as e:     # this row's sampling alone failed
                    self._fail(seq, e)
                    failed.append(seq)
        return sampled, failed

    def _sample_one(self, seq, logits):
        """One token from one row of logits: bias, min_tokens and penalties applied (when
        asked for), then greedy (temperature < GREEDY_EPS) or model.sample_next with the
        sequence's own generator (a seeded request draws what generate(seed=...) draws)."""
        p = seq.params
        if self.fault_hook is not None:
            self.fault_hook("sample", [seq])
        if seq.constraint is not None and seq.constraint.dead(seq.constraint_state):
            raise UserError("structured output: the constraint reached a state no token of "
                            "this vocabulary can continue")
        row = self._process(seq, logits)
        if p.temperature < GREEDY_EPS:
            tok = int(row.argmax())
        else:
            # sample_next takes (B, V) rows; top_k 0 ("off" in SamplingParams) goes as None
            tok = int(sample_next(row[None], p.temperature, p.top_k or None, p.top_p,
                                  seq.generator)[0])
        # raw: the model's own probability of the token; processed: the sampler's, the
        # distribution it was drawn from (greedy: the adjusted logits at temperature 1)
        if p.logprobs is not None:
            if self.logprobs_mode == "processed" and p.temperature >= GREEDY_EPS:
                row = row / p.temperature
            seq.logprobs.append(logprob_entry(logits if self.logprobs_mode == "raw" else row,
                                              tok, p.logprobs))
        return tok

    def _process(self, seq, logits):
        """OpenAI's logit adjustments, in vLLM's order: logit_bias, the structured-output
        mask (-inf on tokens the automaton forbids), min_tokens (the stop tokens masked),
        then presence/frequency penalties over the output so far:
        logit[j] -= frequency · count[j] + presence · [count[j] > 0]."""
        p, out = seq.params, seq.output_ids
        early = len(out) < p.min_tokens
        if not (p.logit_bias or early or p.presence_penalty or p.frequency_penalty or
                seq.constraint is not None):
            return logits
        # clone(): for fp32 logits, .float() is the same tensor, not a copy, and the edits
        # below are in place -- without it the log-probs would read the adjusted logits
        row = logits.float().clone()
        for tok, bias in p.logit_bias:
            row[tok] += bias
        if seq.constraint is not None:     # structured output: only what keeps it alive
            row = structured.mask_logits(row, seq.constraint.allowed(seq.constraint_state))
        if early:
            stops = list(self._stop_ids(seq))
            # min_tokens yields to a constraint that can only end here (EOS alone allowed)
            if seq.constraint is None or \
                    torch.isfinite(row).sum() > torch.isfinite(row[stops]).sum():
                row[stops] = float("-inf")
        if out and (p.presence_penalty or p.frequency_penalty):
            # (V,) counts of each token in the output only, not the prompt (as vLLM
            # applies these two penalties); [:V] trims nothing unless an id were >= V
            count = torch.bincount(torch.tensor(out, device=row.device),
                                   minlength=row.shape[-1])[:row.shape[-1]].to(row.dtype)
            row -= p.frequency_penalty * count + p.presence_penalty * (count > 0).to(row.dtype)
        return row

    def _append_tokens(self, sampled, now):
        """Post-processing, second half: append each sampled token (stamped `now`), then
        finish the sequences it ends (stop token or string, length) and park a
        prefill_only one for export_kv (the disaggregation seam)."""
        for seq, tok in sampled:
            if tok is None:
                self._finish(seq, "length")
                continue
            seq.tokens.append(tok)
            seq.token_times.append(now)
            self.stats["output_tokens"] += 1
            try:         # (decoding its text for stop strings; its automaton's next state)
                if seq.constraint is not None:
                    seq.constraint_state = seq.constraint.advance(seq.constraint_state, tok)
                reason = self._stop_reason(seq, tok)
            except Exception as e:         # this sequence fails alone
                self._fail(seq, e)
                continue
            if reason:
                self._finish(seq, reason)
            elif seq.prefill_only:        # park it for export_kv: out of the queues
                self.running.remove(seq)
                seq.status = PREFILLED

    def _stop_reason(self, seq, tok):
        p = seq.params
        if tok in self._stop_ids(seq):
            return "stop"
        # Stop strings are matched on the decoded text (one may span several tokens).
        # The whole output is decoded at every token: O(n^2) over n tokens, fine at these
        # lengths; a long-output server would decode incrementally.
        if p.stop and self.enc is not None:
            text = decode_tokens(self.enc, seq.output_ids)
            cuts = [i for i in (text.find(s) for s in p.stop) if i >= 0]
            if cuts:
                seq.text = text[:min(cuts)]
                return "stop"
        if len(seq.output_ids) >= p.max_tokens or len(seq.tokens) >= self.cfg.block_size:
            return "length"
        return None

    def _account(self, batch, seconds):
        """Step log (roofline) and KV waste: slots reserved in a sequence's blocks but not
        holding a computed token -- paging keeps it < block_size per sequence."""
        st = self.stats
        st["steps"] += 1
        st["computed_tokens"] += sum(n for _, n in batch)
        n_dec = sum(n == 1 for _, n in batch)
        # the context the step's attention read (num_computed was advanced in step()):
        # with the tokens, what a roofline of the step needs -- the KV bytes read grow with ctx
        ctx = sum(seq.num_computed for seq, _ in batch)
        self.step_log.append((seconds, sum(n for _, n in batch), n_dec, ctx, len(batch)))
        for seq in self.running:
            waste = len(seq.block_table) * self.block_size - seq.num_computed
            st["max_waste"] = max(st["max_waste"], waste)
            st["waste_sum"] += waste
            st["waste_samples"] += 1
        st["peak_blocks"] = max(st["peak_blocks"], self.alloc.num_used)

    # -- the disaggregation seam: a prefilled sequence's KV out of one engine, into another
    def export_kv(self, seq_id, release=True):
        """The prefill side of prefill/decode disaggregation (DistServe, Zhong et al. 2024;
        Splitwise): a sequence added with prefill_only=True and now PREFILLED ->
        a plain dict (tensors, lists, numbers, strings: torch.save/send_object_list-able):
          tokens        prompt + the first sampled token
          num_prompt    prompt length
          num_computed  tokens whose K/V are in `kv` (= num_prompt: the first output
                        token's K/V are computed by the decode side's first step)
          kv            PagedKVCache.read_blocks of the sequence's blocks covering
                        num_computed tokens, in block-table order (on this cache's device)
          block_size, kv_dtype   what the importing cache must match
          params        the SamplingParams as a dict
          generator     the sampler's torch.Generator state (a seeded request continues
                        the same random stream), or None when greedy
          logprobs, prompt_logprobs   what was recorded so far
        release=True frees the blocks at once (kv is a copy); release=False keeps them
        until `abort(seq_id)`."""
        seq = self.live.get(seq_id)
        if seq is None or seq.status != PREFILLED:
            state = "not live" if seq is None else seq.status
            raise UserError(f"export_kv: sequence {seq_id!r} is {state}, not prefilled "
                            f"(add it with prefill_only=True and step until it is)")
        # The blocks holding computed K/V (the whole table: it was grown to num_prompt in
        # the prefill); the first output token has none yet -- the decode side computes
        # it in its first step. Payload: 2·L·H_kv·D·bytes per token (payload_bytes).
        n = blocks_for(seq.num_computed, self.block_size)
        # list() copies: the dict must not change when this engine later edits seq
        out = dict(tokens=list(seq.tokens), num_prompt=seq.num_prompt,
                   num_computed=seq.num_computed,
                   kv=self.cache.read_blocks(seq.block_table[:n]),
                   block_size=self.block_size, kv_dtype=self.cache.kv_dtype,
                   params=dataclasses.asdict(seq.params),
                   generator=seq.generator.get_state() if seq.generator else None,
                   logprobs=list(seq.logprobs), prompt_logprobs=list(seq.prompt_logprobs))
        if release:
            self._finish(seq, "exported")
        return out

    def can_import(self, exported):
        """Whether import_kv would find room now (blocks for the KV and a running slot)."""
        need = blocks_for(exported["num_computed"], self.block_size)
        return self.alloc.can_allocate(need) and len(self.running) < self.max_num_seqs

    def import_kv(self, exported, seq_id=None, arrival=None):
        """The decode side of disaggregation: export_kv's dict -> a live Sequence here,
        RUNNING, whose next step is a decode (the K/V of num_computed tokens written into
        freshly allocated blocks; its full blocks registered in the prefix cache). When
        there are no blocks or no running slot free it raises PoolFull and changes nothing:
        the caller retries after a step. Preempted later, it is recomputed here (the usual
        recompute preemption). token_times hold only the tokens produced on this engine."""
        # Every check comes before the first allocation: a refused import (UserError or
        # PoolFull) leaves the pool exactly as it was, so the caller can simply retry.
        params = SamplingParams.from_dict(exported["params"]).validate(self.cfg.vocab_size)
        tokens, n_done = list(exported["tokens"]), exported["num_computed"]
        if (exported["block_size"] != self.block_size
                or exported["kv_dtype"] != self.cache.kv_dtype):
            raise UserError(f"import_kv: blocks of {exported['block_size']} tokens in "
                            f"{exported['kv_dtype']}, this engine: {self.block_size} in "
                            f"{self.cache.kv_dtype}")
        if not 0 < n_done < len(tokens) <= self.cfg.block_size:
            raise UserError(f"import_kv: {n_done} computed of {len(tokens)} tokens (context "
                            f"{self.cfg.block_size}): nothing left to decode")
        if not self.can_import(exported):
            raise PoolFull(f"import_kv: {blocks_for(n_done, self.block_size)} blocks needed, "
                           f"{self.alloc.num_free} free; {len(self.running)} of "
                           f"{self.max_num_seqs} running slots taken: retry later")
        if seq_id is not None and seq_id in self.live:
            raise UserError(f"import_kv: sequence id {seq_id!r} is already live here")
        slot = self._adapter_slot(params.adapter)      # the decode side must hold it too
        seq = Sequence(next(self.ids) if seq_id is None else seq_id,
                       tokens[:exported["num_prompt"]], params,
                       self.clock() if arrival is None else arrival, self.device)
        seq.tokens, seq.num_computed, seq.num_cached_tokens = tokens, n_done, n_done
        seq.adapter_slot = slot
        if params.structured is not None:  # the automaton's state: replayed from the output
            seq.constraint = constraint = self._constraint(params.structured)
            seq.constraint_state = constraint.start()
            for tok in seq.output_ids:
                seq.constraint_state = constraint.advance(seq.constraint_state, tok)
        if seq.generator is not None and exported["generator"] is not None:
            seq.generator.set_state(exported["generator"])    # the same random stream
        seq.logprobs = list(exported["logprobs"])
        seq.prompt_logprobs = list(exported["prompt_logprobs"])
        # can_import held above, so grow cannot fail here. A payload of another shape (a
        # model of another config) makes write_blocks raise ValueError after grow: the
        # blocks just allocated are then not given back.
        self.alloc.grow(seq.block_table, n_done)
        self.cache.write_blocks(seq.block_table, exported["kv"])
        # imported prompts become prefix-cache hits for later requests on this engine too
        self._register_full_blocks(seq)
        seq.status, self.live[seq.id] = RUNNING, seq
        bisect.insort(self.running, seq, key=self._key)
        return seq

# ----------------------------------------------------------------------------------------
# The command line: every knob once, a row each (flag, default, help; core/cli.py turns the
# rows into flags). The model and engine tables are shared with scripts/serve_bench.py
# (the same engine from the same command line); the server's sit beside the HTTP layer (serving/api_server.py).

MODEL_KNOBS = [
    knob("--checkpoint", DEFAULT_CHECKPOINT, "written by train.py"),
    knob("--lora", str, "a LoRA adapter to serve beside the base, unmerged, as NAME=PATH "
         "(a lora.py --save file; repeatable): a request's `model` picks it by NAME (not "
         "given: the base model only)", action="append", metavar="NAME=PATH"),
    knob("--device", "cpu", "cpu, cuda or auto"),
    knob("--threads", 1, "torch CPU threads (1 is fastest on a busy 2-core machine; 0 = as many "
                         "as torch picks)"),
]


def engine_knobs(policy_help):
    """The engine's table. Only --policy's help is the caller's: serving defaults to slo,
    the benchmark runs both policies when it is not given."""
    return [
        knob("--block-size", 16, "tokens per KV block"),
        knob("--num-blocks", 1024, "KV blocks in the pool"),
        knob("--max-num-batched-tokens", 256, "token budget of one step (decodes + prefill "
                                              "chunks)"),
        knob("--max-num-seqs", 64, "running sequences at most"),
        knob("--policy", None, policy_help, choices=POLICIES),
        knob("--no-prefix-caching", False, "turn prefix caching off"),
        knob("--no-chunked-prefill", False, "a prompt must fit one step's budget whole"),
        knob("--kv-dtype", None, "KV pool dtype (not given: the model's)",
             choices=["float32", "bfloat16", "float16", "int8"]),
        knob("--kv-tier", "none", "second KV tier for evicted prefix blocks: host memory or a "
                                  "file", choices=TIER_KINDS),
        knob("--kv-tier-blocks", 1024, "blocks the tier holds"),
        knob("--kv-tier-dir", "out/serve/kv_tier", "directory of the file tier (an unlinked "
                                                   "temporary file)"),
    ]


def engine_from_args(model, enc, args, policy, adapters=None, clock=time.perf_counter):
    return Engine(model, enc, block_size=args.block_size, num_blocks=args.num_blocks,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  max_num_seqs=args.max_num_seqs, policy=policy,
                  prefix_caching=not args.no_prefix_caching,
                  chunked_prefill=not args.no_chunked_prefill, kv_dtype=args.kv_dtype,
                  clock=clock, kv_tier=args.kv_tier, kv_tier_blocks=args.kv_tier_blocks,
                  kv_tier_dir=args.kv_tier_dir, adapters=adapters)


def load_adapters(args, model):
    """--lora NAME=PATH ... -> a multi_lora.AdapterSet (each file read by
    core/adapter_file.py and checked against this base's fingerprint), or None."""
    if not args.lora:
        return None
    return multi_lora.AdapterSet.from_files(model, args.lora, base_name=args.model_name)


def load_served_model(args):
    """--threads applied, the checkpoint loaded with its tokenizer. -> (model, enc)."""
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if not os.path.exists(args.checkpoint):
        if args.checkpoint != DEFAULT_CHECKPOINT:      # the user named it: say so, no advice
            raise UserError(f"--checkpoint {args.checkpoint!r} not found")
        raise UserError(f"checkpoint {args.checkpoint!r} not found: train one with "
                        f"`python train.py` (writes it), or name one with --checkpoint")
    model, ckpt = load_model(args.checkpoint, pick_device(args.device))
    if "tokenizer" not in ckpt:
        raise UserError(f"{args.checkpoint} carries no tokenizer (not written by train.py?)")
    return model, data.encoding_from_state(ckpt["tokenizer"])


def build_parser():
    # argparse's formatter, not core.cli's: "(default: None)" by "not given" flags, as ever
    return command_line(
        "Serve the checkpoint over an OpenAI-compatible HTTP API. The benchmark (sequential "
        "generate() vs static batching vs the engine) runs on its own: python -m "
        "scripts.serve_bench --help.",
        {None: MODEL_KNOBS,
         "engine": engine_knobs("scheduling; not given: slo (FCFS order when requests carry "
                                "no priority)"),
         # the HTTP layer's knobs live beside it, in serving/api_server.py
         "server": api_server.SERVER_KNOBS},
        formatter=argparse.ArgumentDefaultsHelpFormatter)


def main(argv=None):
    """`python serve.py ...`: the engine behind the HTTP server until Ctrl-C."""
    args = build_parser().parse_args(argv)
    model, enc = load_served_model(args)
    engine = engine_from_args(model, enc, args, args.policy or "slo", load_adapters(args, model))
    return api_server.run_server(args, engine, enc)


if __name__ == "__main__":
    run_cli(main)
