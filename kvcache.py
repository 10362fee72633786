"""
kvcache.py -- the paged KV cache: how a serving engine stores the keys and values of many
sequences of unknown, different and growing lengths without wasting memory.

What it teaches (Kwon et al. 2023, "Efficient Memory Management for Large Language Model
Serving with PagedAttention" -- vLLM):
  - A contiguous cache (model.KVCache) must reserve, per sequence, room for the longest
    it may ever become: prompt + max_tokens, or the whole context. Most of it stays empty
    (the paper measures 60-80% of KV memory wasted in earlier systems).
  - Paging: one fixed pool of KV *blocks* of `block_size` token slots, shared by every
    sequence, like physical pages of virtual memory. Each sequence owns a *block table*
    (logical block i -> physical block id); token at position p lives in slot
    table[p // block_size] * block_size + p % block_size (the *slot mapping*). Blocks are
    handed out one at a time as a sequence grows, so the waste is < 1 block per sequence
    (vLLM: < 4%).
  - Paged attention: queries attend to keys that are scattered over the pool. Here we
    *gather* each sequence's keys/values through its block table into a dense tensor and
    call the model's own attention function with a mask (simple, and provably equal to
    dense attention); `paged_attention_blockwise` does what the real CUDA kernel does
    instead: walk the block table block by block with an online softmax, never
    materialising the gathered copy.
  - Prefix caching (vLLM "automatic prefix caching", SGLang RadixAttention): a *full*
    block is named by a hash chain, h_i = H(h_{i-1}, tokens of block i), so equal hashes
    mean equal prefixes, not just equal blocks. Blocks are reference-counted: sequences
    with a common prefix (a system prompt, a chat history) share the physical blocks; a
    released block keeps its contents and its hash and is evicted least-recently-used only
    when a fresh block is needed.
  - int8 KV quantization (per token and per KV head, symmetric absmax): 4·D bytes become
    D + 4 bytes per (token, head) -- about 3.5x less KV memory than fp32 at head_dim 32,
    paid for with a small, measured, error in attention.
  - Blocks as the unit of moving KV: `read_blocks`/`write_blocks` copy whole blocks out
    of and into the pool bit for bit (the payload a prefill engine sends a decode engine
    in disaggregated serving), and a second tier (KVTier: host memory or a memmapped
    file, as Mooncake's KV store) catches evicted prefix blocks so that a later hit
    reloads 2·L·H_kv·D·bytes per token instead of recomputing a forward over them.

What it costs: paging adds an indirection (block tables, a slot mapping per step, and, in
this gather version, one copy of the context's K/V per layer per step that a fused kernel
avoids); prefix caching adds hashing and bookkeeping and keeps dead blocks around until
evicted; int8 adds quantize/dequantize work and error; the tier adds a copy per eviction
and per reload, and host memory or disk.
"""
import dataclasses
import hashlib
import math
import os
import random
import tempfile
import time
from array import array
from collections import OrderedDict, deque

import numpy
import torch

from core.checkpoint import load_model
from model import ATTENTION_FUNCTIONS, GPT, get_config
from core.cli import ArgumentParser, HelpFormatter, add_knobs, knob
from core.errors import UserError
from core.runtime import run_cli, TimingConditions


# ----------------------------------------------------------------------------------------
# Prefix hashing: the hash of a full block covers everything before it.

def block_hash(parent, tokens):
    """h_i = sha256(h_{i-1} ‖ token ids of block i) (first 16 bytes). Chaining makes the
    hash a name for the whole prefix; a cryptographic hash makes a collision -- which would
    silently serve another prompt's keys -- practically impossible (vLLM added sha256
    for this reason in v0.8.3, vllm-project/vllm#15297, and made it the default in
    v0.10.2). Hits are also checked token by token."""
    # The parent goes in first: hashing a block's tokens alone would give one name to the
    # same tokens after two different prefixes, whose K/V differ (every key attended
    # to its whole prefix). The first block's parent is the empty string.
    h = hashlib.sha256(parent or b"")
    # fixed 8 bytes per id ("q" = int64): [1, 2] and [258] cannot serialise alike
    h.update(array("q", tokens).tobytes())
    # 128 bits: a collision becomes likely only after ~2^64 blocks (the birthday bound)
    return h.digest()[:16]


def extend_hash_chain(hashes, tokens, n_blocks, block_size, root=None):
    """Extend a sequence's list of chain hashes to cover its first n_blocks full blocks
    (each hash is computed once per sequence, when first needed). root: the first block's
    parent -- None, or what else the K/V depend on besides the tokens: a LoRA adapter
    changes W_k and W_v, so its requests must not share blocks with the base's (vLLM puts
    the adapter in the block hash's "extra keys" for the same reason)."""
    while len(hashes) < n_blocks:
        j = len(hashes)
        hashes.append(block_hash(hashes[-1] if hashes else root,
                                 tokens[j * block_size:(j + 1) * block_size]))
    return hashes


def blocks_for(n_tokens, block_size):
    """ceil(n_tokens / block_size) in integers: the blocks n_tokens occupy."""
    return -(-n_tokens // block_size)


# ----------------------------------------------------------------------------------------
# The block allocator: reference counts, a free list, and the prefix cache.

class BlockAllocator:
    """Every physical block is in exactly one of three states:
      free     refcount 0, no hash       -- in `free` (handed out first);
      cached   refcount 0, has a hash    -- in `evictable` (an LRU): its K/V are still
                                            valid and a new sequence may reuse them;
      in use   refcount > 0              -- referenced by that many block tables (shared
                                            prefix blocks have refcount > 1).
    `allocate` takes a free block, else evicts the least-recently-released cached one --
    into the second tier when there is one (`tier`, a KVTier), from where `match_tier` and
    `reload` bring it back instead of recomputing it."""

    def __init__(self, num_blocks, block_size, prefix_caching=True, tier=None):
        if num_blocks < 1 or block_size < 1:
            raise UserError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, "
                            f"{block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = prefix_caching
        if tier is not None and not prefix_caching:
            raise UserError("a second KV tier keeps evicted prefix-cache blocks: it needs "
                            "prefix caching on")
        self.tier = tier
        self.refcount = [0] * num_blocks
        self.free = deque(range(num_blocks))
        self.evictable = OrderedDict()          # block -> None, oldest release first
        self.hash_of = [None] * num_blocks      # block -> its chain hash, if registered
        self.tokens_of = [None] * num_blocks    # block -> its token ids (verifies hits)
        self.block_of = {}                      # chain hash -> block
        self.hits = self.queries = self.evictions = 0

    @property
    def num_free(self):
        """Blocks a new allocation can get: free ones plus evictable cached ones."""
        return len(self.free) + len(self.evictable)

    @property
    def num_used(self):
        return self.num_blocks - self.num_free

    def allocate(self):
        """-> a block id with refcount 1, its old contents about to be overwritten."""
        # Never-hashed blocks first: a cached block is a possible future hit, so it is
        # kept until the pool has nothing else to give.
        if self.free:
            block = self.free.popleft()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)   # least recently used
            if self.tier is not None:                       # copy out before reuse
                self.tier.put(self.hash_of[block], self.tokens_of[block], block)
            # unregister before the caller writes new K/V into it: a lookup must never
            # find a block whose contents are no longer that prefix
            self._unregister(block)
            self.evictions += 1
        else:
            raise RuntimeError("KV block pool exhausted (the scheduler should have checked)")
        self.refcount[block] = 1
        return block

    def _unregister(self, block):
        """Its prefix no longer findable: the hash and tokens it was registered with gone."""
        del self.block_of[self.hash_of[block]]
        self.hash_of[block] = self.tokens_of[block] = None

    def acquire(self, block):
        """One more block table points at `block` (a prefix-cache hit)."""
        if self.refcount[block] == 0:
            del self.evictable[block]                       # KeyError = a bug
        self.refcount[block] += 1

    def release(self, block):
        """One block table fewer points at `block`; at 0 it is cached or freed."""
        if self.refcount[block] <= 0:
            raise RuntimeError(f"double free of block {block}")
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            # Only full, registered blocks can be hit again; a sequence's partial last
            # block (and every block with prefix caching off) goes straight back to free.
            if self.hash_of[block] is not None:
                self.evictable[block] = None                # keep the contents, LRU
            else:
                self.free.append(block)

    def drop_cached(self):
        """Forget every cached prefix: each cached block back to free, its hash unregistered
        (vLLM's reset_prefix_cache). For a change of weights -- an RL trainer's sync (rl.py
        --rollout engine): K/V written by the old weights are not the new model's, so a hit
        on them would sample from neither. Only with no block in use: a running sequence's
        K/V are as stale, and the caller must finish or abort it first. -> blocks dropped."""
        if any(self.refcount):
            raise RuntimeError("drop_cached with blocks in use: finish the sequences first")
        dropped = list(self.evictable)
        for block in dropped:
            self._unregister(block)
            self.free.append(block)
        self.evictable.clear()
        if self.tier is not None:           # the second tier holds old K/V too
            for h in list(self.tier.hashes()):
                self.tier.discard(h)
        return len(dropped)

    def cached_hashes(self, tier=False):
        """The router's view of this pool (the seam a cache-aware router reads): the set
        of chain hashes of every full block whose K/V are here, in use or cached (and,
        with tier=True, those in the second tier: reloadable, not recomputed). A chain
        hash names its whole prefix, so a prompt's longest cached prefix is its longest
        run of leading block hashes found in this set. A copy, safe to keep."""
        found = set(self.block_of)
        return found | self.tier.hashes() if tier and self.tier is not None else found

    def lookup(self, h, tokens):
        """The block holding the prefix with chain hash h, or None. No reference taken."""
        self.queries += 1
        block = self.block_of.get(h)
        # Token-by-token check as well as the hash: even a collision cannot serve another
        # prompt's keys. Costs block_size comparisons per hit, nothing next to a forward.
        if block is None or self.tokens_of[block] != tuple(tokens):
            return None
        self.hits += 1
        return block

    def register(self, block, h, tokens):
        """Block `block` is full and its K/V are written: make it findable. If another
        block already holds this prefix (two sequences computed it at the same time), the
        first one stays the cached copy and this one is freed normally when released."""
        if not self.prefix_caching or h in self.block_of or self.hash_of[block] is not None:
            return
        if self.tier is not None:
            self.tier.discard(h)            # recomputed: the tier's copy is now redundant
        self.block_of[h] = block
        self.hash_of[block], self.tokens_of[block] = h, tuple(tokens)

    # -- per-sequence helpers: a block table is a plain list of block ids ---------------
    def _reusable_blocks(self, tokens, hashes, root=None):
        """How many leading full blocks of `tokens` a cache hit may cover, with their chain
        hashes in `hashes` (extended as needed, from `root`): the last token is always left
        out."""
        # (len - 1) // bs, not len // bs: 12 tokens in blocks of 4 reuse 2 blocks, not 3
        # (tests/test_kvcache.py, test_prefix_match_leaves_the_last_token_to_compute)
        n = (len(tokens) - 1) // self.block_size
        extend_hash_chain(hashes, tokens, n, self.block_size, root)
        return n

    def match_prefix(self, tokens, hashes, root=None):
        """Cached blocks covering the longest prefix of `tokens` made of full blocks, with
        at least the last token left out: its logits are needed to sample the next token,
        so a prompt fully covered by the cache still recomputes its last block (the case
        that breaks nano-vllm, whose prefill then has zero tokens). `hashes` is the
        sequence's hash chain (extended here as needed, from its `root`)."""
        if not self.prefix_caching:
            return []
        bs, found = self.block_size, []
        for i in range(self._reusable_blocks(tokens, hashes, root)):
            block = self.lookup(hashes[i], tokens[i * bs:(i + 1) * bs])
            # The first miss ends the match: the cached part of a table must be a prefix,
            # since the prefill then starts at position len(found)·bs and runs to the end.
            if block is None:
                break
            found.append(block)
        return found

    def match_tier(self, tokens, hashes, start, root=None):
        """After match_prefix's `start` pool hits: the following full blocks the second
        tier holds (same last-token rule). -> [(hash, tokens)] for `reload`. (A block
        after them still in the pool is recomputed: rare, as the LRU evicts tails first.)"""
        if self.tier is None:
            return []
        bs, found = self.block_size, []
        for i in range(start, self._reusable_blocks(tokens, hashes, root)):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            if not self.tier.lookup(hashes[i], chunk):
                break
            found.append((hashes[i], chunk))
        return found

    def reload(self, entries):
        """Tier hits (match_tier) back into the pool. -> fresh blocks, refcount 1 (the
        caller's table holds them), registered, holding the K/V the tier kept. Every
        payload leaves the tier first: the evictions allocate() makes below put blocks
        into the tier and may push out its oldest entries -- never one of these."""
        payloads = [self.tier.pop(h) for h, _ in entries]
        blocks = []
        for (h, chunk), payload in zip(entries, payloads):
            block = self.allocate()
            self.tier.cache.write_blocks([block], payload)
            self.register(block, h, chunk)
            blocks.append(block)
        return blocks

    def can_allocate(self, n_new, hits=()):
        """Room for n_new fresh blocks after taking references on `hits` (a hit that sits
        in the evictable LRU stops being evictable once acquired)."""
        # a hit with refcount 0 is counted in num_free (evictable) but will not be free
        # once acquired: without the subtraction the pool could come up short mid-step
        return self.num_free - sum(self.refcount[b] == 0 for b in hits) >= n_new

    def grow(self, table, n_tokens):
        """Extend a block table to hold n_tokens; False (nothing allocated) if no room."""
        need = blocks_for(n_tokens, self.block_size) - len(table)
        # All or nothing: checked before the first allocate, so a refusal leaves no
        # half-grown table for the scheduler to unwind before it preempts.
        if need > self.num_free:
            return False
        # need <= 0: the table already covers n_tokens (e.g. inside the last block)
        table.extend(self.allocate() for _ in range(max(need, 0)))
        return True

    def release_table(self, table):
        """Release a sequence's blocks, last block first, so that among a chain's cached
        blocks the LRU evicts the tail before the shared head (as vLLM does)."""
        for block in reversed(table):
            self.release(block)
        # emptied, so releasing the same table twice is a no-op, not a double free
        table.clear()

    def check(self, tables=None):
        """Invariants (used by the tests after every random operation): each block in
        exactly one state, no duplicates, hash maps consistent, and -- given every live
        block table -- refcount == number of tables holding the block."""
        free, evict = list(self.free), list(self.evictable)
        assert len(free) == len(set(free)), "duplicate in free list"
        assert not set(free) & set(evict), "block both free and cached"
        for b in range(self.num_blocks):
            rc = self.refcount[b]
            assert rc >= 0, f"negative refcount on block {b}"
            assert (b in self.evictable) == (rc == 0 and self.hash_of[b] is not None)
            assert (b in set(free)) == (rc == 0 and self.hash_of[b] is None)
        for h, b in self.block_of.items():
            assert self.hash_of[b] == h, "hash map out of sync"
        assert sum(h is not None for h in self.hash_of) == len(self.block_of)
        if self.tier is not None:
            self.tier.check()
        if tables is not None:
            counts = [0] * self.num_blocks
            for t in tables:
                for b in t:
                    counts[b] += 1
            assert counts == self.refcount, "refcounts differ from the block tables"


# ----------------------------------------------------------------------------------------
# The second tier: evicted prefix blocks kept in host memory or a file, not dropped.

TIER_KINDS = ("none", "host", "file")


class KVTier:
    """Where the pool's evicted prefix-cache blocks go (Mooncake's KV store over DRAM and
    SSD, Qin et al. 2024; vLLM's CPU offload; SGLang's HiCache): `put` copies a block
    the pool is about to reuse into a slot here, named by its chain hash; a later prompt
    with that prefix `pop`s it back into a fresh pool block -- a copy of 2·L·H_kv·D·bytes
    per token instead of a forward over the tokens. Exclusive of the pool (a prefix
    computed again discards its copy here); LRU when full (the oldest entry is dropped).

    kind "host": CPU tensors (on a GPU machine, host DRAM behind PCIe); "file": a
    numpy.memmap of an unlinked temporary file in `directory` (an SSD tier; the OS page
    cache sits in front of it). One byte store per pool part, (num_blocks, bytes per
    block) uint8, so every KV dtype (bf16 too, which numpy lacks) goes through bit exact.
    Saves: recomputing evicted prefixes. Costs: the copies (counted in bytes_in/out),
    host memory or disk, and a copy on the eviction path even for a block never reused."""

    def __init__(self, cache, kind, num_blocks, directory=None):
        if kind not in TIER_KINDS[1:]:
            raise UserError(f"unknown KV tier {kind!r}: use {', '.join(TIER_KINDS[1:])}")
        if type(num_blocks) is not int or num_blocks < 1:
            raise UserError(f"the KV tier needs >= 1 blocks, got {num_blocks!r}")
        self.cache, self.kind, self.num_blocks = cache, kind, num_blocks
        self.entries = OrderedDict()        # chain hash -> (slot, token ids), oldest first
        self.free = deque(range(num_blocks))
        # part -> (shape of one block, dtype): what read_blocks([b]) gives and pop returns
        self.shapes = {name: ((t.shape[0], t.shape[1], cache.block_size, t.shape[3]), t.dtype)
                       for name, t in cache.parts().items()}
        widths = {name: math.prod(shape) * torch.empty((), dtype=dtype).element_size()
                  for name, (shape, dtype) in self.shapes.items()}
        if kind == "host":
            self.store = {name: torch.zeros(num_blocks, w, dtype=torch.uint8)
                          for name, w in widths.items()}
        else:
            self.store = self._file_store(directory, widths)
        self.puts = self.reloads = self.drops = self.discards = 0
        self.bytes_in = self.bytes_out = 0

    def _file_store(self, directory, widths):
        """One unlinked temporary file in `directory` (gone when the process ends), one
        memmap per part in it; torch.from_numpy shares the mapping: writes go to it."""
        if not directory:
            raise UserError("a file KV tier needs a directory (--kv-tier-dir)")
        try:
            os.makedirs(directory, exist_ok=True)
            self.file = tempfile.TemporaryFile(dir=directory, prefix="kv_tier-")
            store, offset = {}, 0
            for name, w in widths.items():
                mm = numpy.memmap(self.file, numpy.uint8, "w+", offset, (self.num_blocks, w))
                store[name], offset = torch.from_numpy(mm), offset + self.num_blocks * w
            return store
        except OSError as e:
            raise UserError(f"cannot create the KV tier in {directory!r}: "
                            f"{e.strerror or e}") from None

    @property
    def nbytes(self):
        return sum(t.numel() for t in self.store.values())

    def hashes(self):
        return set(self.entries)

    def lookup(self, h, tokens):
        return h in self.entries and self.entries[h][1] == tuple(tokens)

    def put(self, h, tokens, block):
        """Copy pool block `block` (chain hash h) in; drop the oldest entry if full."""
        if not self.free:
            _, (slot, _) = self.entries.popitem(last=False)
            self.free.append(slot)
            self.drops += 1
        slot = self.free.popleft()
        for name, x in self.cache.read_blocks([block]).items():
            # .cpu(): the device -> host copy (PCIe on a GPU). Reinterpreted as raw bytes,
            # which needs a contiguous tensor: bf16 and int8 codes land in the uint8 store
            # bit for bit, no cast.
            self.store[name][slot] = x.cpu().contiguous().view(-1).view(torch.uint8)
            self.bytes_in += x.numel() * x.element_size()
        self.entries[h] = slot, tuple(tokens)
        self.puts += 1

    def pop(self, h):
        """Take entry h out. -> its payload, as PagedKVCache.read_blocks gave it."""
        slot, _ = self.entries.pop(h)
        out = {}
        for name, (shape, dtype) in self.shapes.items():
            # clone first: the slot is freed below and the next put overwrites it (for a
            # file tier, the clone is also the read from the memmap into memory)
            out[name] = self.store[name][slot].clone().view(dtype).view(shape)
            self.bytes_out += self.store[name].shape[1]
        self.free.append(slot)
        self.reloads += 1
        return out

    def discard(self, h):
        """The pool holds prefix h again (recomputed): forget this copy, free its slot."""
        if h in self.entries:
            self.free.append(self.entries.pop(h)[0])
            self.discards += 1

    def check(self):
        """Invariants: each slot is free or holds exactly one entry."""
        used, free = [slot for slot, _ in self.entries.values()], list(self.free)
        assert sorted(used + free) == list(range(self.num_blocks)), "a slot lost or doubled"


# ----------------------------------------------------------------------------------------
# int8 KV: one scale per (token, KV head), symmetric absmax over head_dim.

def quantize_int8(x):
    """x (..., D) float -> (int8 codes, float32 scale (..., 1)); x ≈ codes · scale.
    Error per element ≤ scale/2 = absmax/254."""
    # /127, not /128: a symmetric range, so -x quantizes to exactly -codes, and -128 is
    # never used. The clamp keeps an all-zero vector (scale 0) from giving 0/0 = NaN.
    scale = x.detach().abs().amax(-1, keepdim=True).float().clamp(min=1e-8) / 127.0
    # D int8 codes + one fp32 scale = D + 4 bytes, vs 4·D in fp32: 3.6x less at D = 32
    return (x.float() / scale).round().clamp(-127, 127).to(torch.int8), scale


def dequantize_int8(codes, scale, dtype=torch.float32):
    return (codes.float() * scale).to(dtype)


# ----------------------------------------------------------------------------------------
# The pool and paged attention

def payload_bytes(payload):
    """Bytes of a KV payload (what moving it costs): for n tokens, 2·L·H_kv·D·bytes·n,
    plus 2·L·H_kv·4·n of scales when int8."""
    return sum(t.numel() * t.element_size() for t in payload.values())


@dataclasses.dataclass(frozen=True)
class Int8Pool:
    """One layer's int8 keys (or values) as `update` hands them to `attention`: the codes
    (H_kv, slots, d) and one float32 scale per (head, slot), (H_kv, slots, 1). A named type,
    so `gather` knows what it holds without guessing from a tuple's shape."""
    codes: torch.Tensor
    scale: torch.Tensor


@dataclasses.dataclass(frozen=True)
class AttentionGroup:
    """The sequences of one step that attend together (prepare() builds them; attention()
    reads them): their queries padded to the group's longest chunk, S rows of Tmax."""
    q_index: torch.Tensor     # (S·Tmax,) packed index of each padded query row
    keep: torch.Tensor        # positions in that list that are real (not padding)
    dest: torch.Tensor        # packed index each real row is written back to
    key_blocks: torch.Tensor  # (S·n_blocks,) block ids of the group's block tables
    mask: torch.Tensor        # (S, 1, Tmax, n_blocks·bs) causal + length mask


class PagedKVCache:
    """The KV pool of every layer: (n_layer, n_kv_head, num_blocks·block_size slots, D),
    one slot per token, block b = slots b·bs .. b·bs+bs-1. With kv_dtype="int8" the pool
    holds int8 codes plus a float32 scale per (slot, head).

    It drives the unmodified model: `Attention.forward` calls `update(layer, k, v)`, which
    writes this step's K/V into their slots and returns the layer's pools; those reach
    `attention(q, k_pool, v_pool, mask)` (the cache protocol's `attention`: the layers call
    it instead of their attn_fn), which does paged attention for the step's ragged batch, described
    by `prepare(...)`. The step's tokens of all sequences are packed into one row
    (B = 1, T = total new tokens), the way vLLM packs a batch: no padding in the MLP."""

    def __init__(self, cfg, num_blocks, block_size, dtype=torch.float32, device="cpu",
                 kv_dtype=None, attn_fn=None):
        self.cfg, self.num_blocks, self.block_size = cfg, num_blocks, block_size
        self.dtype, self.device = dtype, torch.device(device)
        self.kv_dtype = kv_dtype or str(dtype).replace("torch.", "")
        # the math after the gather: None = the calling layer's attn_fn (a test or a
        # benchmark may fix another, e.g. the explicit softmax -- not for MLA, whose
        # layers attend on the latent with their own function)
        if attn_fn is not None and cfg.mla:
            raise UserError("a fixed attention function would replace latent attention's "
                            "own (kv_lora_rank > 0): give none")
        self.inner = attn_fn
        # head-major: a block of one head is bs·D contiguous numbers, so a gathered
        # sequence comes out as (H_kv, L, D) with rows of keys contiguous -- what the
        # attention kernel wants without another copy. Widths from the config: GQA keys
        # and values, or MLA's latent and rope key (model.GPTConfig.kv_cache_dims).
        heads, k_dim, v_dim = cfg.kv_cache_dims
        shape = (cfg.n_layer, heads, num_blocks * block_size)
        if self.kv_dtype == "int8":
            self.k = torch.zeros(shape + (k_dim,), dtype=torch.int8, device=device)
            self.v = torch.zeros(shape + (v_dim,), dtype=torch.int8, device=device)
            self.k_scale = torch.ones(shape + (1,), device=device)
            self.v_scale = torch.ones(shape + (1,), device=device)
        else:
            kd = getattr(torch, self.kv_dtype, None)
            if not isinstance(kd, torch.dtype) or not kd.is_floating_point:
                raise UserError(f"unknown kv dtype {self.kv_dtype!r}: use int8, float32, "
                                f"bfloat16 or float16")
            self.k = torch.zeros(shape + (k_dim,), dtype=kd, device=device)
            self.v = torch.zeros(shape + (v_dim,), dtype=kd, device=device)
            self.k_scale = self.v_scale = None
        self.length = 0          # the model contract: GPT.forward reads it (positions are
        self.groups = []         # passed explicitly, so 0 keeps its masks out of the way)

    @property
    def nbytes(self):
        return payload_bytes(self.parts())

    @property
    def bytes_per_token(self):
        return self.nbytes // (self.num_blocks * self.block_size)

    def advance(self, n):
        pass                     # lengths live in the engine's sequences, not here

    # -- moving whole blocks: the seam of disaggregation and of the second tier ---------
    def parts(self):
        """The pool's tensors by name: k, v, and k_scale, v_scale when int8."""
        names = ("k", "v") + (("k_scale", "v_scale") if self.k_scale is not None else ())
        return {name: getattr(self, name) for name in names}

    def read_blocks(self, block_ids):
        """Copy blocks out of the pool. -> payload: a plain dict {name: tensor} for every
        part of `parts()`, each (n_layer, heads, len(block_ids)·block_size, width), in the
        order of block_ids, on the cache's device, in the pool's dtype (int8 codes and
        their float32 scales as stored: nothing is dequantized, so a round trip is bit
        exact). A copy: the blocks may be freed or overwritten right after."""
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        out = {}
        for name, t in self.parts().items():
            n_layer, heads, _, width = t.shape
            blocks = t.view(n_layer, heads, self.num_blocks, self.block_size, width)
            out[name] = blocks.index_select(2, ids).view(n_layer, heads, -1, width)
        return out

    def write_blocks(self, block_ids, payload):
        """The inverse of read_blocks: payload[name] (from this cache's read_blocks or an
        identical one's: same config, block size and KV dtype) goes into blocks block_ids,
        in order. Anything else is refused with a ValueError (never a silent cast)."""
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        parts = self.parts()
        if set(payload) != set(parts):
            raise ValueError(f"KV payload has parts {sorted(payload)}, this cache stores "
                             f"{sorted(parts)} (a different KV dtype?)")
        for name, t in parts.items():
            n_layer, heads, _, width = t.shape
            want = (n_layer, heads, len(ids) * self.block_size, width)
            x = payload[name]
            if tuple(x.shape) != want or x.dtype != t.dtype:
                raise ValueError(f"KV payload {name}: {tuple(x.shape)} {x.dtype}, expected "
                                 f"{want} {t.dtype}")
            blocks = t.view(n_layer, heads, self.num_blocks, self.block_size, width)
            x = x.to(self.device).reshape(n_layer, heads, len(ids), self.block_size, width)
            blocks.index_copy_(2, ids, x)

    def _slots(self, tables, positions):
        """slot = table[p // bs] · bs + p % bs, for (S, max_blocks) tables and (S, N)
        positions."""
        bs = self.block_size
        return tables.gather(1, positions // bs) * bs + positions % bs

    def prepare(self, seqs):
        """Describe one step. seqs: list of (block_table, start, n): this step computes
        positions start .. start+n-1 of that sequence (n = 1 for a decode, n > 1 for a
        prefill chunk) and its context afterwards is start + n tokens. Token order in the
        packed batch = the order of `seqs`. Builds the slot mapping for the writes and,
        per attention group (decodes, prefill chunks -- vLLM also runs these as two
        kernels), the query indices, the block ids to gather and the mask."""
        dev = self.device
        n_blocks = max(len(t) for t, _, _ in seqs)
        tables = torch.tensor([t + [0] * (n_blocks - len(t)) for t, _, _ in seqs],
                              dtype=torch.long, device=dev)
        starts = torch.tensor([s for _, s, _ in seqs], device=dev)
        ns = torch.tensor([n for _, _, n in seqs], device=dev)
        offsets = torch.cumsum(ns, 0) - ns                       # first packed index
        seq_of = torch.repeat_interleave(torch.arange(len(seqs), device=dev), ns)
        pos = starts[seq_of] + torch.arange(int(ns.sum()), device=dev) - offsets[seq_of]
        self.write_slots = self._slots(tables[seq_of], pos[:, None])[:, 0]
        self.positions = pos
        self.groups = []
        for rows in self._groups(seqs):
            rows = torch.tensor(rows, dtype=torch.long, device=dev)
            t_max, l_max = int(ns[rows].max()), int((starts + ns)[rows].max())
            tq = torch.arange(t_max, device=dev)
            valid = tq < ns[rows, None]                          # (S, Tmax)
            q_index = torch.where(valid, offsets[rows, None] + tq, 0)
            q_pos = torch.where(valid, starts[rows, None] + tq, 0)   # padded q: key 0 only
            # keys are gathered a whole block at a time (as the kernel reads them): the
            # group's first ceil(l_max / bs) table entries; positions past a sequence's
            # end (or in another sequence's padding) are masked out
            n_kb = blocks_for(l_max, self.block_size)
            kpos = torch.arange(n_kb * self.block_size, device=dev)
            mask = kpos <= q_pos[:, :, None]                     # causal, in absolute pos
            keep = valid.flatten().nonzero()[:, 0]               # real (not padded) queries
            self.groups.append(AttentionGroup(
                q_index=q_index.flatten(), keep=keep, dest=q_index.flatten()[keep],
                key_blocks=tables[rows, :n_kb].flatten(), mask=mask[:, None]))
        return self

    @staticmethod
    def _groups(seqs):
        """Row indices of the attention groups: prefill chunks together; decodes sorted by
        context length and, when it saves >= 20% of the padded key positions, cut in two
        (a group's keys are padded to its longest context)."""
        ctx = [s + n for _, s, n in seqs]
        dec = sorted((i for i, (_, _, n) in enumerate(seqs) if n == 1), key=ctx.__getitem__)
        groups = [[i for i, (_, _, n) in enumerate(seqs) if n > 1]]
        if dec:
            lens = [ctx[i] for i in dec]
            cost = [k * lens[k - 1] + (len(dec) - k) * lens[-1] for k in range(1, len(dec) + 1)]
            k = min(range(len(cost)), key=cost.__getitem__) + 1
            k = k if cost[k - 1] <= 0.8 * cost[-1] else len(dec)
            groups += [dec[:k], dec[k:]]
        return [g for g in groups if g]

    def update(self, layer, k, v):
        """k, v: (1, n_kv_head, T, D), the packed step. Write them to their slots; return
        the layer's pools (what `attention` reads)."""
        k, v, slots = k[0], v[0], self.write_slots                # (H_kv, T, D)
        # Written before `attention` reads the pools: the step's queries must see the
        # step's own keys (the causal mask includes the diagonal). index_copy_ along the
        # slot dimension scatters each token to the slot prepare() mapped it to.
        if self.k_scale is not None:
            # Quantized on write: the step's queries already read their own keys as int8,
            # so a prefill and the later decodes attend to exactly the same values.
            (kq, ks), (vq, vs) = quantize_int8(k), quantize_int8(v)
            self.k[layer].index_copy_(1, slots, kq)
            self.k_scale[layer].index_copy_(1, slots, ks)
            self.v[layer].index_copy_(1, slots, vq)
            self.v_scale[layer].index_copy_(1, slots, vs)
            return (Int8Pool(self.k[layer], self.k_scale[layer]),
                    Int8Pool(self.v[layer], self.v_scale[layer]))
        self.k[layer].index_copy_(1, slots, k.to(self.k.dtype))
        self.v[layer].index_copy_(1, slots, v.to(self.v.dtype))
        return self.k[layer], self.v[layer]

    def gather(self, pool, blocks, S):
        """Flat (S·n_blocks,) block ids -> (S, H_kv, n_blocks·bs, D) dense keys or values
        (dequantized if int8): one index_select over whole blocks (bs·D contiguous numbers
        per head), far cheaper on the CPU than indexing token by token."""
        def take(t):     # (H_kv, slots, d) -> (H_kv, S·n_blocks·bs, d)
            h, _, d = t.shape
            # (h, num_blocks, bs·d): a block of one head is one row, so index_select copies
            # whole blocks -- the copy a fused kernel avoids by reading through the table
            return t.view(h, self.num_blocks, -1).index_select(1, blocks).view(h, -1, d)
        if isinstance(pool, Int8Pool):
            x = dequantize_int8(take(pool.codes), take(pool.scale), self.dtype)
        else:
            x = take(pool).to(self.dtype)
        return x.view(x.shape[0], S, -1, x.shape[-1]).transpose(0, 1)

    def attention(self, q, k_pool, v_pool, mask=None, attn_fn=None):
        """Paged attention for the packed step. q: (1, H, T, D). For each group: pick the
        group's queries (padded to its longest chunk), gather its keys/values through the
        block tables, run the layer's attention function with the causal/length mask,
        scatter the real (unpadded) query rows back into packed order. The output's width
        is the attention's (MLA's latent attention returns d_c, not D)."""
        inner = self.inner or attn_fn or ATTENTION_FUNCTIONS[self.cfg.attn]
        out = None
        H, D = q.shape[1], q.shape[3]
        for group in self.groups:
            S = group.mask.shape[0]
            # (H, S·Tmax, D) -> (S, H, Tmax, D): a padded query row picks packed index 0,
            # attends to key 0 only (its mask row is never empty: no NaN), and is dropped
            # by `keep` below
            qg = q[0].index_select(1, group.q_index).view(H, S, -1, D).transpose(0, 1)
            k = self.gather(k_pool, group.key_blocks, S)
            v = self.gather(v_pool, group.key_blocks, S)
            og = inner(qg, k, v, group.mask)                         # (S, H, Tmax, D_out)
            og = og.transpose(0, 1).reshape(H, -1, og.shape[-1]).index_select(1, group.keep)
            # allocated at the first group, the one place the output width is known
            if out is None:
                out = q.new_empty(1, H, q.shape[2], og.shape[-1])
            out[0].index_copy_(1, group.dest, og)
        return out


def paged_attention_blockwise(q, k_pool, v_pool, table, context_len, block_size):
    """What the PagedAttention kernel computes, for one sequence, without gathering: walk
    the block table, and for each block of keys update an online softmax (Milakov &
    Gimelshein 2018; FlashAttention): running max m, running denominator l, running
    weighted sum acc; rescale both by exp(m_old - m_new) when the max grows.
    q: (H, Tq, D), the last Tq positions of a context of context_len tokens; pools in the
    PagedKVCache layout (H_kv, slots, D). Returns (H, Tq, D)."""
    H, Tq, D = q.shape
    # GQA: query head h reads KV head h // rep (model.py's repeat_interleave order)
    rep = H // k_pool.shape[0]
    q_pos = torch.arange(context_len - Tq, context_len)
    m = torch.full((H, Tq, 1), float("-inf"))
    l, acc = torch.zeros(H, Tq, 1), torch.zeros(H, Tq, D)
    # Block 0 always holds key 0, visible to every query, so m is finite after the first
    # iteration; were a row's first block all masked, exp(-inf - -inf) would be NaN.
    for i in range(blocks_for(context_len, block_size)):
        # the last block may be partial: only its first context_len - i·bs slots are keys
        kpos = torch.arange(i * block_size, min((i + 1) * block_size, context_len))
        slots = table[i] * block_size + kpos % block_size
        k = k_pool[:, slots].float().repeat_interleave(rep, 0)         # (H, b, D)
        v = v_pool[:, slots].float().repeat_interleave(rep, 0)
        s = q.float() @ k.transpose(1, 2) / math.sqrt(D)
        s = s.masked_fill(kpos[None, None, :] > q_pos[None, :, None], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        p = torch.exp(s - m_new)
        # exp(m - m_new) <= 1 rescales what was summed under the old max; every exp
        # argument is <= 0, so nothing overflows however large the scores
        correction = torch.exp(m - m_new)
        l = l * correction + p.sum(-1, keepdim=True)
        acc = acc * correction + p @ v
        m = m_new
    return (acc / l).to(q.dtype)


# ----------------------------------------------------------------------------------------
# Demo and ledger: `python kvcache.py` (uses the trained checkpoint when there is one)

@torch.no_grad()
def paged_logits(model, cache, alloc, seqs, chunk):
    """Run the unmodified GPT.forward over several sequences at once, packed in one row,
    prefilling each in chunks of `chunk` tokens through the paged cache. -> the logits of
    every position of every sequence (list of (T_i, V))."""
    tables, done, out = [[] for _ in seqs], [0] * len(seqs), [[] for _ in seqs]
    while any(d < len(s) for d, s in zip(done, seqs)):
        step = [(i, min(chunk, len(s) - done[i])) for i, s in enumerate(seqs) if done[i] < len(s)]
        for i, n in step:
            if not alloc.grow(tables[i], done[i] + n):
                raise UserError("the demo's block pool is too small")
        cache.prepare([(tables[i], done[i], n) for i, n in step])
        idx = torch.tensor([[t for i, n in step for t in seqs[i][done[i]:done[i] + n]]],
                           device=cache.device)
        # Explicit positions: in a packed row, token j is not at position j. Without them
        # GPT.forward would number the row 0..T-1 from cache.length (0), and RoPE would
        # rotate every sequence but the first at the wrong positions.
        logits, _ = model(idx, positions=cache.positions[None], cache=cache)
        at = 0
        for i, n in step:
            out[i].append(logits[0, at:at + n])
            at, done[i] = at + n, done[i] + n
    for t in tables:
        alloc.release_table(t)
    return [torch.cat(o) for o in out]


def check_paged_vs_dense(model, args, rng):
    """Ragged sequences packed in one row, prefilled in chunks through the paged cache, in
    each KV dtype: the logits against a dense forward. -> bytes per token by dtype."""
    cfg, bs = model.config, args.block_size
    lens = [rng.randint(cfg.block_size // 4, cfg.block_size) for _ in range(args.num_seqs)]
    seqs = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in lens]
    with torch.no_grad():
        dense = [model(torch.tensor([s]))[0][0] for s in seqs]
    # exactly the blocks the sequences need: a miscount in grow() or blocks_for shows up
    # here as "pool too small" rather than as wrong numbers
    n_blocks = sum(blocks_for(n, bs) for n in lens)
    print(f"\n{args.num_seqs} ragged sequences (lengths {lens}) packed in one row, prefilled in "
          f"chunks of {args.chunk}, block size {bs}: paged vs dense forward")
    rows = {}
    for kv in ("float32", "bfloat16", "int8"):
        cache = PagedKVCache(cfg, n_blocks, bs, kv_dtype=kv)
        paged = paged_logits(model, cache, BlockAllocator(n_blocks, bs), seqs, args.chunk)
        err = max((a - b).abs().max().item() for a, b in zip(paged, dense))
        agree = sum((a.argmax(-1) == b.argmax(-1)).sum().item() for a, b in zip(paged, dense))
        value_bytes = 1 if kv == "int8" else torch.finfo(getattr(torch, kv)).bits // 8
        scale_bytes = 4 if kv == "int8" else 0
        # GQA: key and value of head_dim per KV head; MLA: the latent and the rope key
        heads, k_dim, v_dim = cfg.kv_cache_dims
        f = cfg.n_layer * heads * ((k_dim + v_dim) * value_bytes + 2 * scale_bytes)
        rows[kv] = cache.bytes_per_token
        print(f"  {kv:<9} max |Δlogit| {err:.2e}   top-1 agreement {agree}/{sum(lens)}   "
              f"{cache.bytes_per_token} B/token (formula L·H_kv·((D_k + D_v)·bytes + 2·scale)"
              f" = {f})")
    return rows


def fragmentation(cfg, bs, rng):
    """The same lengths, a contiguous max-length reservation vs blocks. -> wasted share of
    the contiguous reservation."""
    lens = [rng.randint(1, cfg.block_size) for _ in range(256)]
    alloc = BlockAllocator(sum(blocks_for(n, bs) for n in lens), bs)
    tables = [[] for _ in lens]
    for t, n in zip(tables, lens):
        assert alloc.grow(t, n)
    slots = sum(map(len, tables)) * bs
    # Lengths uniform on 1..C: a max-length reservation wastes about 1 - (C + 1)/2C ≈ 50%,
    # while paging wastes only the unused tail of each last block, ≈ (bs - 1)/2 slots.
    contiguous_waste = 1 - sum(lens) / (256 * cfg.block_size)
    print(f"\nfragmentation, 256 sequences of 1..{cfg.block_size} tokens ({sum(lens)} tokens):")
    print(f"  contiguous, reserve the context ({cfg.block_size}) each: "
          f"{contiguous_waste:.0%} of the reservation wasted")
    print(f"  paged, block {bs}: {alloc.num_used} blocks = {slots} slots, "
          f"{1 - sum(lens) / slots:.1%} wasted = {(slots - sum(lens)) / 256:.1f} slots/sequence"
          f" (expected ≈ (bs-1)/2 = {(bs - 1) / 2})")
    return contiguous_waste


def prefix_sharing(cfg, bs, rng):
    """16 requests = a shared system prompt (up to 128 tokens) + their own 32 tokens.
    -> how many times less KV the shared blocks take."""
    shared = [rng.randrange(cfg.vocab_size) for _ in range(min(128, cfg.block_size // 2))]
    alloc, tables = BlockAllocator(1024, bs), []
    for _ in range(16):
        toks = shared + [rng.randrange(cfg.vocab_size) for _ in range(32)]
        hashes = []
        hits = alloc.match_prefix(toks, hashes)
        # the references are taken before grow(): an evictable hit must leave the LRU
        # before allocate() could evict it (the engine's order too)
        for b in hits:
            alloc.acquire(b)
        t = list(hits)
        alloc.grow(t, len(toks))
        extend_hash_chain(hashes, toks, len(toks) // bs, bs)
        for i in range(len(hits), len(toks) // bs):
            alloc.register(t[i], hashes[i], toks[i * bs:(i + 1) * bs])
        tables.append(t)
    alloc.check(tables)
    alone = 16 * blocks_for(len(shared) + 32, bs)
    print(f"\nprefix caching, 16 requests sharing a {len(shared)}-token prefix: "
          f"{alloc.num_used} blocks instead of {alone} ({alone / alloc.num_used:.1f}x less KV, "
          f"{alloc.hits} block hits = {alloc.hits * bs} prefill tokens skipped)")
    return alone / alloc.num_used


def gather_cost(cfg, bs):
    """The cost of paging: gather + attention vs attention on a contiguous cache, one
    decode step of S sequences on one layer. -> paged / dense time."""
    S, L = 32, min(192, cfg.block_size)
    if cfg.mla:          # the gather is the same; the shapes below are GQA's
        cfg = dataclasses.replace(cfg, kv_lora_rank=0)
    cache = PagedKVCache(cfg, S * blocks_for(L, bs) + 1, bs)
    # Block tables drawn as a random permutation: a long-running pool hands out scattered
    # blocks, so the gather reads them from all over memory, not in order.
    perm = torch.randperm(cache.num_blocks - 1)[:S * blocks_for(L, bs)].view(S, -1).tolist()
    cache.prepare([(t, L - 1, 1) for t in perm])
    q = torch.randn(1, cfg.n_head, S, cfg.head_dim)
    k = torch.randn(S, cfg.n_kv_head, L, cfg.head_dim)
    v = torch.randn(S, cfg.n_kv_head, L, cfg.head_dim)
    qd, full = q[0].transpose(0, 1)[:, :, None], torch.ones(S, 1, 1, L, dtype=torch.bool)
    repeats = {}
    dense_attention = ATTENTION_FUNCTIONS[cfg.attn]
    for name, fn in (("dense", lambda: dense_attention(qd, k, v, full)),
                     ("paged", lambda: cache.attention(q, cache.k[0], cache.v[0]))):
        fn()
        repeats[name] = []
        for _ in range(5):       # CPU time, best of 5: less disturbed by other jobs
            t0 = time.process_time()
            for _ in range(10):
                fn()
            repeats[name].append((time.process_time() - t0) / 10)
    timings = {name: min(runs) for name, runs in repeats.items()}
    ratio = timings["paged"] / timings["dense"]
    print(f"\npaged attention cost, decode of {S} sequences x {L} tokens, one layer: dense "
          f"{timings['dense'] * 1e3:.2f} ms, paged (gather + same attention) "
          f"{timings['paged'] * 1e3:.2f} ms = {ratio:.1f}x")
    # CPU seconds (process_time): a neighbour's work is not counted, so only the repeats'
    # own spread can say these are off (a loaded machine still evicts our caches)
    TimingConditions(reader=lambda: None).report(repeats)
    return ratio


def demo_model(args):
    """The trained checkpoint when there is one, else a random `tiny` GPT (seeded)."""
    if os.path.exists(args.checkpoint):
        model, _ = load_model(args.checkpoint)
        print(f"model: {args.checkpoint}")
    else:
        model = GPT(get_config("tiny"), seed=args.seed)
        print(f"model: random tiny ({args.checkpoint} not found; `python train.py` writes it)")
    return model.eval()


def print_ledger(waste, shared, kv_bytes, gather):
    """The three techniques' ledger rows: what each saves, adds and sacrifices."""
    print("\nledger rows:")
    print(f"  paged KV | waste < 1 block/seq vs {waste:.0%} for max-length reservation | "
          f"block tables, gather copy ({gather:.1f}x attention time here) | none (exact)")
    print(f"  prefix caching | {shared:.1f}x less KV for a shared prefix, its "
          f"prefill skipped | hashing, refcounts | dead blocks linger until LRU-evicted")
    print(f"  int8 KV | {kv_bytes['float32'] / kv_bytes['int8']:.1f}x less KV than fp32 | "
          f"quantize on write, dequantize on read | small logit error (above)")


# ----------------------------------------------------------------------------------------
# The command line: every knob once, a row each (flag, default, help; core/cli.py makes
# the flags, --help and the "did you mean" line from this table)

KNOBS = [
    knob("--checkpoint", "out/ckpt.pt", "trained model (python train.py); a random tiny "
         "model if missing"),
    knob("--block-size", 16, "tokens per KV block"),
    knob("--chunk", 48, "prefill chunk (tokens)"),
    knob("--num-seqs", 4, "ragged sequences in the check"),
    knob("--seed", 0, "lengths, tokens, tiny model"),
]


def parse_args(argv=None):
    p = ArgumentParser(description="The paged KV cache, measured: paged vs dense logits, int8 "
                                   "error, bytes per token, fragmentation, prefix sharing, "
                                   "the cost of the gather.", formatter_class=HelpFormatter)
    args = add_knobs(p, KNOBS).parse_args(argv)
    if args.block_size < 1 or args.chunk < 1 or args.num_seqs < 1:
        raise UserError("--block-size, --chunk and --num-seqs must be >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    # one thread: the paged/dense time ratio is then a per-core figure, steadier on a
    # shared machine than one that depends on how many cores were idle
    torch.set_num_threads(1)
    model = demo_model(args)
    cfg, bs, rng = model.config, args.block_size, random.Random(args.seed)
    kv_bytes = check_paged_vs_dense(model, args, rng)
    waste = fragmentation(cfg, bs, rng)
    shared = prefix_sharing(cfg, bs, rng)
    print_ledger(waste, shared, kv_bytes, gather_cost(cfg, bs))


if __name__ == "__main__":
    run_cli(main)
