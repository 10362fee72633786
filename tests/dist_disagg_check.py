"""Run under torchrun with 2 ranks (tests/test_disagg.py launches it): prefill/decode
disaggregation on real ranks (gloo), one launch for every check. Each case serves a
workload disaggregated and asserts, on rank 0: greedy outputs == one engine's, token for
token; KV bytes sent == the formula per request, and the meter's bytes == KV + metadata +
control messages; rank 0's pool all free or cached; on rank 1 (reported back and checked
on both sides): every block free or cached at the end, nothing live, the aborted request
freed after its import. Prints one "ok <case>" line per case from rank 0."""
import random

import torch

from disagg import HEADER, kv_formula, serve_disaggregated
from model import GPT, get_config
from core.distributed import setup_runtime
from core.meters import comm
from core.runtime import run_cli
from serve import Engine, SamplingParams

BS = 4


def requests(cfg, n, seed):
    """Token-id prompts of mixed lengths; some with max_tokens=1 (done on rank 0)."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        plen = rng.choice([3, 9, 17, 30])
        out = 1 if i % 5 == 4 else rng.randint(2, 12)
        reqs.append(dict(id=i, prompt=[rng.randrange(cfg.vocab_size) for _ in range(plen)],
                         out_len=out, arrival=0.0, long=plen > 16))
    return reqs


def reference(model, reqs, kv_dtype):
    eng = Engine(model, block_size=BS, num_blocks=256, kv_dtype=kv_dtype)
    seqs = eng.generate([r["prompt"] for r in reqs],
                        [SamplingParams(max_tokens=r["out_len"], temperature=0,
                                        ignore_eos=True) for r in reqs])
    return {r["id"]: s.output_ids for r, s in zip(reqs, seqs)}


def case(rt, name, cfg, kv_dtype, decode_blocks, abort_prefilled=(), abort_sent=()):
    model = GPT(cfg, seed=0).eval()
    reqs = requests(cfg, 10, seed=len(name))
    for r in reqs:
        # A request aborted after its KV was sent must still be decoding when the abort
        # (posted right behind the KV) arrives: with a few tokens to go, a decode rank that
        # polls before the abort lands could finish it first -- a "too late" abort, no
        # freeing to check. The rest of its context keeps it running for dozens of steps.
        if r["id"] in abort_sent:
            r["out_len"] = cfg.block_size - len(r["prompt"])
    blocks = 256 if rt.rank == 0 else decode_blocks
    engine = Engine(model, block_size=BS, num_blocks=blocks, max_num_batched_tokens=32,
                    kv_dtype=kv_dtype)
    comm.reset()
    out, extra = serve_disaggregated(rt, engine, reqs, abort_prefilled, abort_sent, tag=name)
    engine.alloc.check(tables=[])                     # both ranks: nothing referenced
    assert not engine.live and all(rc == 0 for rc in engine.alloc.refcount)
    if rt.rank == 1:
        stats = extra
        assert stats["aborted_imported"] == len(abort_sent), stats
        assert stats["imported"] == stats["aborted_imported"] + sum(
            r["out_len"] > 1 and r["id"] not in abort_prefilled + abort_sent for r in reqs)
        return
    pool = extra
    assert pool == dict(num_free=decode_blocks, live=0, refs=0,
                        aborted_imported=len(abort_sent), imported=pool["imported"]), pool
    gone = set(abort_prefilled) | set(abort_sent)
    assert {rid for rid, rec in out.items() if rec["out"] is None} == gone
    ref = reference(model, reqs, kv_dtype)
    for rid, rec in out.items():
        assert rid in gone or rec["out"] == ref[rid], (name, rid, rec["out"], ref[rid])
    shipped = [r for r in reqs if r["id"] not in abort_prefilled and r["out_len"] > 1]
    for r in reqs:
        want = kv_formula(cfg, engine.cache.kv_dtype, len(r["prompt"])) if r in shipped else 0
        assert out[r["id"]]["kv_bytes"] == want, (name, r["id"])
    assert pool["imported"] == len(shipped)
    # the meter saw exactly: every shipped request's KV + metadata, one header per
    # control message (the aborts and DONE)
    meter = sum(v[2] for (op, _), v in comm.rows.items() if op == "send")
    wire = sum(out[r["id"]]["kv_bytes"] + out[r["id"]]["meta_bytes"] for r in shipped)
    assert meter == wire + (len(abort_sent) + 1) * HEADER * 8, (meter, wire)
    print(f"ok {name}: {len(out) - len(gone)} requests equal one engine's outputs, "
          f"{len(gone)} aborted and freed; KV bytes == formula "
          f"({kv_formula(cfg, engine.cache.kv_dtype, 1)} B/token); decode pool "
          f"{pool['num_free']}/{decode_blocks} free", flush=True)


def main(argv=None):
    torch.set_num_threads(1)
    rt = setup_runtime("cpu")
    tiny = get_config("tiny")
    case(rt, "fp32 with aborts", tiny, None, 256, abort_prefilled=(1,), abort_sent=(2,))
    case(rt, "int8, a decode pool of one sequence", tiny, "int8", 16)
    case(rt, "mla bf16", get_config("tiny", kv_lora_rank=16, qk_rope_head_dim=4), "bfloat16",
         256, abort_sent=(3,))


if __name__ == "__main__":
    run_cli(main)
