"""The GPU tiers: every script's single-GPU path end to end, asserting the equalities its CPU
tests assert, on CUDA (`python -m pytest -m gpu`), and the torchrun equivalence checks with
NCCL on several GPUs (`python -m pytest -m multigpu`). Without the hardware they are skipped
with the reason shown (tests/conftest.py), so a CPU-only CI runs what it ran before.

On a GPU what changes is the backend (NCCL moves only CUDA tensors: a collective on a CPU
tensor that gloo accepted fails), the kernels (SDPA picks flash / memory-efficient
attention; bf16 and fp16 matmuls are native, not emulated) and what can be measured
(torch.cuda.max_memory_allocated next to the hook-counted activations). Tolerances are the
CPU tests' except where a CUDA kernel is not bitwise reproducible; each such place says why.

A few cheap cases also run with device "cpu" (test ids ending in `cpu`, not marked gpu): the
same bodies, exercised where no GPU is, so this file is known to run before a GPU session is
spent on it. The bottom of the file is the torchrun worker the world-size tests launch:

    torchrun --nproc_per_node=N tests/test_gpu.py {comm,train,parallel,pipeline,all} DEVICE TMP DATA
"""
import copy
import http.client
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import types
from dataclasses import asdict

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from core import data                                                       # noqa: E402
import evaluate                                                   # noqa: E402
import lora                                                       # noqa: E402
from compression import nf4                                                        # noqa: E402
import optim                                                      # noqa: E402
import parallel                                                   # noqa: E402
from parallelism import pipeline                                                   # noqa: E402
import rl                                                         # noqa: E402
import serve                                                      # noqa: E402
import spec_decode as sd                                          # noqa: E402
import train                                                      # noqa: E402
from harness import ROOT, in_repo, run_python, torchrun                    # noqa: E402
from kvcache import BlockAllocator, PagedKVCache, paged_logits    # noqa: E402
from core.checkpoint import load_model
from core.distributed import Runtime, setup_runtime
from model import GPT, KVCache, get_config, math_attention, sdpa_attention
from core.meters import ActivationMeter, comm, model_state_bytes, StepTimer
from core.runtime import print0
from parallelism.ring_attention import make_ring_attn_fn                      # noqa: E402

CUDA = pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")
CPU = pytest.param("cpu", id="cpu")          # the self-check: the same body, on this machine
ON_GPU, BOTH = [CUDA], [CUDA, CPU]
DP_MODES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
WORKER = "tests/test_gpu.py"


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.py: tiny tensors, one thread


def tiny_args(text_file, device, *extra):
    """tests/test_train.py's tiny run, on `device`."""
    return ["--preset", "tiny", "--data", text_file, "--batch-size", "4", "--seq-len", "32",
            "--log-interval", "1", "--eval-interval", "4", "--eval-iters", "2",
            "--sample-tokens", "0", "--warmup-steps", "2", "--device", device, *extra]


def tokens(cfg, b, t, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (b, t + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def byte_encoding():
    """256 bytes + <|endoftext|>: a tokenizer with no training (as tests/test_serve.py)."""
    return data.make_encoding({bytes([i]): i for i in range(256)})


# ----------------------------------------------------------------------------------------
# model.py and the meters (core/meters.py)

@pytest.mark.parametrize("device", BOTH)
def test_model_cache_generate_and_attention_kernels(device):
    """KV-cache decode == one full forward; greedy generate() == argmax of full forwards;
    SDPA (on CUDA: flash / memory-efficient kernels) == math attention, values and grads."""
    cfg = get_config("tiny")
    model = GPT(cfg, seed=3).to(device).eval()
    idx = tokens(cfg, 3, 40)[0].to(device)
    with torch.no_grad():
        full, _ = model(idx)
        cache = KVCache(cfg, 3, 40, device=device)
        parts = [model(idx[:, :11], cache=cache)[0]]
        parts += [model(idx[:, t:t + 1], cache=cache)[0] for t in range(11, 40)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=2e-5)
    prompt, seq = [5, 17, 42], [5, 17, 42]
    out = model.generate(prompt, 12, temperature=0)
    with torch.no_grad():
        for _ in range(12):
            seq.append(int(model(torch.tensor([seq], device=device))[0][0, -1].argmax()))
    assert out == seq[3:]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 9, 8, generator=g).to(device).requires_grad_()
               for h in (4, 2, 2))
    a, b = math_attention(q, k, v), sdpa_attention(q, k, v)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    grads_math = torch.autograd.grad(a.sum(), (q, k, v))
    for x, y in zip(grads_math, torch.autograd.grad(b.sum(), (q, k, v))):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", BOTH)
def test_plumbing_meters_on_device(device):
    """ActivationMeter counts saved tensors (not weights) of CUDA tensors too, the CUDA
    allocator agrees, and model_state_bytes holds Adam's 16 B/param."""
    lin = torch.nn.Linear(100, 100, bias=False).to(device)
    x = torch.randn(8, 100, device=device, requires_grad=True)
    before = torch.cuda.memory_allocated() if device == "cuda" else 0
    with ActivationMeter(lin) as meter, StepTimer(device) as timer:
        out = torch.relu(lin(x))     # matmul saves x (and the weight: excluded); relu saves out
    assert meter.bytes == 2 * 8 * 100 * 4 and timer.seconds > 0
    if device == "cuda":             # out is the only new allocation (x existed before)
        assert torch.cuda.memory_allocated() - before >= 8 * 100 * 4
    out.sum().backward()
    opt = torch.optim.AdamW(lin.parameters())
    opt.step()
    n = lin.weight.numel()
    s = model_state_bytes(lin, opt)
    assert (s["params"], s["grads"], s["optimizer"]) == (4 * n, 4 * n, 8 * n)


# ----------------------------------------------------------------------------------------
# train.py: precisions, checkpointing, resume, the ledger and the allocator

@pytest.mark.parametrize("device,precision,checkpointing", [
    pytest.param("cuda", p, c, marks=pytest.mark.gpu, id=f"cuda-{p}-{c}") for p, c in (
        ("fp32", "none"), ("autocast-bf16", "none"), ("bf16", "none"), ("fp16", "none"),
        ("fp32", "selective"), ("fp32", "full"), ("autocast-bf16", "full"))]
    + [pytest.param("cpu", "fp32", "full", id="cpu")])
def test_train_learns_in_every_precision_and_mode(device, precision, checkpointing,
                                                 text_file, tmp_path, capsys):
    """train.py --device cuda: losses finite and falling, and the model-state ledger equal
    to the formula (it prints '!=' on any mismatch)."""
    hist = train.main(tiny_args(text_file, device, "--steps", "12", "--precision", precision,
                                "--checkpointing", checkpointing, "--lr", "3e-3",
                                "--ckpt", str(tmp_path / "c.pt"), "--save-interval", "0"))
    out = capsys.readouterr().out
    losses = hist["loss"]
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses
    assert "model state" in out and " == formula" in out and "!=" not in out, out
    assert f"device {device}" in out


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("device", ON_GPU)
def test_train_resume_reproduces_the_uninterrupted_run(device, precision, text_file, tmp_path):
    """Stop after 4 of 8 steps, resume: the losses continue as if never stopped. On the CPU
    they are bitwise equal (tests/test_train.py). Here --attn math, because the
    memory-efficient SDPA backward is not bitwise reproducible; a resume that lost any state
    (Adam's moments, the loss scale, the RNG, the data position) moves the loss by ~1e-2, far
    above the 1e-5 allowed for any CUDA reduction whose order is not fixed."""
    common = tiny_args(text_file, device, "--steps", "8", "--precision", precision,
                       "--attn", "math", "--save-interval", "100")
    straight = train.main(common + ["--ckpt", str(tmp_path / "a.pt")])
    half = train.main(common + ["--ckpt", str(tmp_path / "b.pt"), "--stop-after", "4"])
    assert len(half["loss"]) == 4
    resumed = train.main(common + ["--ckpt", str(tmp_path / "b.pt"), "--resume"])
    assert len(resumed["loss"]) == len(straight["loss"]) == 8
    for a, b in zip(resumed["loss"], straight["loss"]):
        assert abs(a - b) <= 1e-5 * abs(b), (resumed["loss"], straight["loss"])
    assert [s for s, _ in resumed["val"]] == [s for s, _ in straight["val"]]


def setup_on(device, precision):
    """tests/test_train.py's make_setup, on `device`."""
    cfg = get_config("tiny")
    args = train.parse_args(["--preset", "tiny", "--precision", precision, "--grad-clip", "0",
                             "--lr", "1e-3"])
    model = GPT(cfg, seed=0).to(device)
    master = None
    if precision in train.LOW_PRECISION:
        master = train.MasterWeights(model, train.LOW_PRECISION[precision])
    opt = torch.optim.AdamW(master.params if master else list(model.parameters()), lr=1e-3,
                            weight_decay=0.1)
    scaler = train.LossScaler(2.0 ** 10, 1000, enabled=precision == "fp16")
    return cfg, args, model, opt, scaler, master


@pytest.mark.parametrize("device,precision", [
    pytest.param("cuda", p, marks=pytest.mark.gpu, id=f"cuda-{p}")
    for p in ("fp32", "autocast-bf16", "bf16", "fp16")] + [pytest.param("cpu", "fp32", id="cpu")])
def test_train_step_state_formula_and_allocator(device, precision):
    """One train_step: model-state bytes == the formula (16 B/param in every precision), and
    on CUDA the allocator's view of the same step printed next to the meters:
      - bytes still allocated after forward - before forward ≈ the saved-tensor hooks' count
        (every saved storage is allocated in forward and held to backward; the allocator adds
        its rounding and the logits, which autograd does not save);
      - max_memory_allocated >= params + master + Adam state + activations, all live together
        at the end of forward."""
    cfg, args, model, opt, scaler, master = setup_on(device, precision)
    x, y = (t.to(device) for t in tokens(cfg, 4, 64))
    for _ in range(2):         # step 1 creates Adam's state; step 2 is measured with it
        model.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if device == "cuda" else 0
        with ActivationMeter(model) as meter, train.autocast_ctx(args, device):
            _, loss = model(x, y)
        held = (torch.cuda.memory_allocated() - before) if device == "cuda" else 0
        (loss * (scaler.scale if scaler.enabled else 1.0)).backward()
        found_inf = master.grads_to_master(1 / scaler.scale if scaler.enabled else 1.0) \
            if master else False
        assert not found_inf
        opt.step()
        if master:
            master.master_to_model()
    state = model_state_bytes(model, opt, master.params if master else ())
    n = model.num_params()
    per = {"params": 2, "grads": 2, "master": 4, "optimizer": 8} if master else \
        {"params": 4, "grads": 4, "master": 0, "optimizer": 8}
    for key, b in per.items():
        assert state[key] == b * n, (key, state[key], b * n)
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated()
        print(f"{precision}: state {state['total']:,} B | activations: hooks {meter.bytes:,} B,"
              f" allocator {held:,} B | max_memory_allocated {peak:,} B")
        assert 0.9 * meter.bytes <= held <= 2 * meter.bytes + (2 << 20), (held, meter.bytes)
        live = state["params"] + state["master"] + state["optimizer"] + meter.bytes
        assert peak >= live, (peak, live)


@pytest.mark.parametrize("attn", ["math", "sdpa"])
@pytest.mark.parametrize("device", ON_GPU)
def test_checkpointing_same_grads_fewer_bytes(device, attn):
    """tests/test_train.py's check on CUDA: selective and full recompute give the gradients
    of no recompute, and keep fewer bytes for backward."""
    x, y = (t.to(device) for t in tokens(get_config("tiny"), 4, 64))
    grads, act = {}, {}
    for mode in ("none", "selective", "full"):
        model = GPT(get_config("tiny", attn=attn), seed=0).to(device)
        train.apply_activation_checkpointing(model, mode)
        with ActivationMeter(model) as meter:
            _, loss = model(x, y)
        act[mode] = meter.bytes
        loss.backward()
        grads[mode] = [p.grad for p in model.parameters()]
    for mode in ("selective", "full"):
        for g, ref in zip(grads[mode], grads["none"]):
            torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6)
    assert act["full"] < act["selective"] < act["none"]


# ----------------------------------------------------------------------------------------
# A world of one, with NCCL: data_parallel.py's modes, parallel.py --check, pipeline.py
# bench (hand schedules vs torch.distributed.pipelining), the comm meter's wrappers. One
# torchrun launch of the worker at the bottom of this file.

# which script each part of the worker checks, and the verdict lines it must print
WORKER_PARTS = {"plumbing": "comm", "data_parallel": "train", "parallel": "parallel",
                "pipeline": "pipeline"}


def worker_verdicts(world, device, parts=tuple(WORKER_PARTS.values())):
    lines = []
    if "comm" in parts:
        lines.append(f"CHECK comm N={world} {device}")
    if "train" in parts:
        lines += [f"CHECK train --dp {m} N={world} {device}" for m in DP_MODES]
    if "parallel" in parts:
        lines.append(f"CHECK parallel N={world} {device}")
    if "pipeline" in parts:
        lines.append(f"CHECK pipeline bench N={world} {device}")
    return lines


@pytest.mark.slow
@pytest.mark.parametrize("device,script", [
    pytest.param("cuda", s, marks=pytest.mark.gpu, id=f"cuda-{s}") for s in WORKER_PARTS]
    + [pytest.param("cpu", "data_parallel", id="cpu-data_parallel")])
def test_world_of_one_process_group(device, script, text_file, tmp_path):
    """On CUDA: NCCL at a world of one, the script's collectives and P2P paths on CUDA
    tensors, against one process. On the CPU (gloo) the same launch checks the worker."""
    part = WORKER_PARTS[script]
    result = torchrun(WORKER, [part, device, tmp_path, text_file], nproc=1, timeout=600)
    assert result.returncode == 0, result.output[-4000:]
    assert f"({'nccl' if device == 'cuda' else 'gloo'})" in result.output, result.output[-4000:]
    for line in worker_verdicts(1, device, [part]):
        assert line in result.output, result.output[-4000:]


TORCHRUN_CASES = [
    ("rl.py", ["--ckpt", "none", "--preset", "tiny", "--algo", "grpo", "--steps", "1",
               "--group", "2", "--prompts", "2", "--sft-steps", "2", "--eval-problems", "4",
               "--eval-samples", "1", "--cache-dir", ""]),
    ("lora.py", ["--ckpt", "none", "--preset", "tiny", "--method", "qlora", "--steps", "2",
                 "--batch-size", "4", "--n-train", "100", "--eval-problems", "0"])]


@pytest.mark.slow
@pytest.mark.parametrize("script,args", TORCHRUN_CASES, ids=["rl", "lora"])
@pytest.mark.parametrize("device", ON_GPU)
def test_rl_and_lora_under_torchrun_nccl(device, script, args):
    """Their data-parallel code (the global sums, the gradient all-reduce) with NCCL, which
    takes CUDA tensors only, at a world of one."""
    result = torchrun(script, args + ["--device", device], nproc=1, timeout=300)
    assert result.returncode == 0, result.output[-4000:]
    assert "ledger" in result.output


@pytest.mark.parametrize("schedule", pipeline.SCHEDULES)
@pytest.mark.parametrize("device", ON_GPU)
def test_pipeline_one_process_schedules_equal_accumulation(device, schedule):
    """tests/test_pipeline.py's P=1 check on CUDA: run_schedule == gradient accumulation."""
    M, T, cfg = 4, 16, get_config("tiny", n_layer=2)
    d = torch.randint(0, cfg.vocab_size, (M, 2, T + 1), generator=torch.Generator().manual_seed(0))
    xs, ys = [b[:, :-1].to(device) for b in d], [b[:, 1:].to(device) for b in d]
    ref, ref_loss = GPT(cfg, seed=0).to(device), 0.0
    for x, y in zip(xs, ys):
        _, loss = ref(x, y)
        (loss / M).backward()
        ref_loss += loss.item() / M
    model = GPT(cfg, seed=0).to(device)
    cos, sin = model.rope(torch.arange(T, device=device))
    stages = pipeline.build_stages(model, schedule, 1, 0, pipeline.cross_entropy_loss, cos, sin)
    loss = pipeline.run_schedule(stages, pipeline.build_schedule(schedule, 1, M)[0], xs, ys,
                                 None, (2, T, cfg.n_embd), torch.float32, device)
    assert abs(loss - ref_loss) < 1e-5
    ref_params = dict(ref.named_parameters())
    for st in stages.values():
        for name, p in st.named_parameters():
            torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", ON_GPU)
def test_ring_of_one_is_full_causal_attention(device):
    """ring_attention.py's hand-written forward and backward on CUDA tensors."""
    g = torch.Generator().manual_seed(1)
    q, grad = (torch.randn(2, 4, 12, 8, generator=g).to(device) for _ in range(2))
    k, v = (torch.randn(2, 2, 12, 8, generator=g).to(device) for _ in range(2))
    ring_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    out = make_ring_attn_fn(None, torch.arange(12, device=device))(*ring_in, None)
    ref = math_attention(*ref_in)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out.backward(grad)
    ref.backward(grad)
    for a, b in zip(ring_in, ref_in):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------
# kvcache.py and serve.py: paged attention, the engine, the bench, the HTTP server

@pytest.mark.parametrize("device", BOTH)
def test_paged_cache_forward_equals_dense(device):
    """The unmodified GPT.forward through the paged cache (ragged sequences packed in one
    row, chunked prefill) == one dense forward per sequence (tests/test_kvcache.py)."""
    cfg = get_config("tiny")
    model = GPT(cfg, seed=2).to(device).eval()
    rng = random.Random(0)
    seqs = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in (1, 8, 9, 31, 64)]
    alloc = BlockAllocator(40, 8)
    paged = paged_logits(model, PagedKVCache(cfg, 40, 8, device=device), alloc, seqs, chunk=7)
    with torch.no_grad():
        for s, p in zip(seqs, paged):
            dense = model(torch.tensor([s], device=device))[0][0]
            torch.testing.assert_close(p, dense, rtol=0, atol=2e-5)
    assert alloc.num_free == 40


ENGINE_CASES = {"continuous": dict(),
                "chunked_prefill_small_budget": dict(max_num_batched_tokens=5),
                "forced_preemption_tiny_pool": dict(block_size=4, num_blocks=16),
                "int8_kv_close": dict(kv_dtype="int8")}


@pytest.mark.parametrize("device,case", [
    pytest.param("cuda", c, marks=pytest.mark.gpu, id=f"cuda-{c}") for c in ENGINE_CASES]
    + [pytest.param("cpu", "forced_preemption_tiny_pool", id="cpu")])
def test_engine_greedy_equals_generate(device, case):
    """Every request's greedy output == its isolated generate() on the same device, however
    the engine batches, chunks, preempts; the pool is clean after. int8 K/V: most tokens."""
    model = GPT(get_config("tiny"), seed=1).to(device).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(1, 40))] for _ in range(10)]
    ns = [rng.randint(1, 20) for _ in prompts]
    ref = [model.generate(p, n, temperature=0) for p, n in zip(prompts, ns)]
    eng = serve.Engine(model, **ENGINE_CASES[case])
    seqs = eng.generate(prompts, [serve.SamplingParams(max_tokens=n, temperature=0)
                                   for n in ns])
    got = [s.output_ids for s in seqs]
    if case == "int8_kv_close":
        same = sum(a == b for x, y in zip(got, ref) for a, b in zip(x, y))
        assert same >= 0.8 * sum(ns), (same, sum(ns))
    else:
        assert got == ref
    if "preemption" in case:
        assert eng.stats["preemptions"] > 0
    assert not eng.has_work() and eng.alloc.num_free == eng.alloc.num_blocks


def tiny_checkpoint(path, block_size=256):
    """A random tiny model in train.py's checkpoint format with the byte tokenizer; its
    <|endoftext|> logit pinned to 0 so greedy answers run to max_tokens."""
    enc = byte_encoding()
    model = GPT(get_config("tiny", vocab_size=enc.n_vocab, block_size=block_size), seed=4)
    with torch.no_grad():
        model.output.weight[enc.eot_token] = 0
    torch.save(dict(config=asdict(model.config), model=model.state_dict(),
                    tokenizer=data.encoding_to_state(enc)), path)
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("device", ON_GPU)
def test_serve_bench_cli_baselines_match(device, tmp_path):
    """python -m scripts.serve_bench --device cuda: static batching and both engine policies reproduce
    sequential generate() for every request; the roofline section runs."""
    r = run_python("-m scripts.serve_bench", ["--checkpoint", tiny_checkpoint(tmp_path / "t.pt"),
                                "--device", device, "--num-requests", "8", "--prompt-len",
                                "4:20", "--output-len", "4:30", "--block-size", "4",
                                "--num-blocks", "80", "--max-num-batched-tokens", "32",
                                "--static-batch", "4"], timeout=300)
    assert r.returncode == 0, r.output[-4000:]
    for name in ("static", "fcfs", "slo"):
        assert f"greedy outputs of {name} == sequential generate(): 8/8" in r.output, r.output
    assert "decode roofline" in r.output


@pytest.mark.slow
@pytest.mark.parametrize("device", ON_GPU)
def test_http_server_on_device_answers_like_generate(device, tmp_path):
    """`python serve.py --device cuda --port 0` as a user starts it; a completion over a real
    socket == generate() of the same checkpoint on the same device; SIGTERM stops it."""
    ckpt = tiny_checkpoint(tmp_path / "t.pt")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": ROOT}
    p = subprocess.Popen([sys.executable, in_repo("serve.py"), "--checkpoint", ckpt,
                          "--device", device, "--port", "0"], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        seen, port = "", None
        while port is None:                 # the start-up line names the port it got
            line = p.stdout.readline()
            assert line, seen                # exited before serving
            seen += line
            port = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        conn = http.client.HTTPConnection("127.0.0.1", int(port.group(1)), timeout=120)
        prompt = "def add(a, b):"
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": prompt, "max_tokens": 12, "temperature": 0}),
            headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        body = json.loads(r.read())
        conn.close()
        assert r.status == 200, body
        model, ck = load_model(ckpt, device)
        enc = data.encoding_from_state(ck["tokenizer"])
        ids = model.eval().generate(enc.encode_ordinary(prompt), 12, temperature=0)
        assert body["choices"][0]["text"] == serve.decode_tokens(enc, ids)
    finally:
        p.send_signal(signal.SIGTERM)
        rest, _ = p.communicate(timeout=60)
    assert p.returncode == 0 and "ledger:" in rest, rest


# ----------------------------------------------------------------------------------------
# spec_decode.py, lora.py, optim.py, rl.py

@pytest.mark.parametrize("device", BOTH)
def test_spec_decode_every_method_equals_greedy(device):
    """tests/test_spec_decode.py on `device`: every drafter, chain and tree, reproduces plain
    greedy decoding token for token (fp64, as there: no near-ties between a batched
    verification pass and a one-token pass). The CPU self-check runs two methods."""
    target = GPT(get_config("tiny", init_std=0.3, vocab_size=64), seed=1).double().to(device).eval()
    draft = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype).to(device) * 0.01)
    methods = ["draft", "medusa", "mtp", "eagle", "dflash"] if device == "cuda" else \
        ["draft", "eagle"]
    built = {"medusa": lambda: sd.MedusaHeads(target, 4),
             "mtp": lambda: sd.FeatureDrafter(target, "mtp"),
             "eagle": lambda: sd.FeatureDrafter(target, "eagle"),
             "dflash": lambda: sd.DFlashDrafter(target, 6)}
    todo = {m: built[m]().double().to(device) for m in methods if m != "draft"}
    corpus = types.SimpleNamespace(train=np.random.default_rng(0).integers(0, 64, 4000))
    pool = sd.distill_pool(target, corpus, n_seq=48 if device == "cuda" else 16, seq=32,
                           prompt_len=8, chunk=48)
    drafters = {"draft": sd.ModelDrafter(draft), **sd.train_drafters(
        todo, target, pool, steps=40 if device == "cuda" else 10, batch=16, lr=3e-3)}
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12, 13, 14], [3]]
    want = [target.generate(p, 24, temperature=0) for p in prompts]
    for m in methods:
        for width in (1, 3):
            st = sd.Stats()
            got, _ = sd.speculative_generate(target, drafters[m], prompts, 24, gamma=4,
                                             width=width, temperature=0.0, stats=st)
            assert got == want, (m, width)
            assert st.tries >= st.accepted and st.row_rounds <= 24 * len(prompts)
            if m == "draft":             # the perturbed target agrees often: fewer target calls
                assert st.accepted > 0 and st.row_rounds < 24 * len(prompts)
    assert drafters["draft"].cache.k.device.type == device


@pytest.mark.parametrize("device", BOTH)
def test_lora_qlora_on_device(device):
    """Each adapter starts at the base (QLoRA: at the NF4-dequantized base, quantized on the
    device); lora.py compare on the device: trainable/grads/Adam bytes == the formulas, and
    merged weights == the unmerged adapters."""
    enc = byte_encoding()
    base = GPT(get_config("tiny", vocab_size=enc.n_vocab), seed=0).to(device)
    x = torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(1)).to(device)
    for method in ("lora", "qlora", "dora", "vera"):
        model = copy.deepcopy(base)
        lora.apply_adapters(model, method, rank=4, seed=7)
        ref = copy.deepcopy(base)
        if method == "qlora":
            with torch.no_grad():
                for _, m in lora.target_linears(ref, lora.ALL_LINEARS):
                    m.weight.copy_(nf4.NF4Weight(m.weight).dequantize())
        torch.testing.assert_close(model(x)[0], ref(x)[0], rtol=0, atol=1e-5)
    methods = "lora,qlora,dora,vera,loraplus" if device == "cuda" else "lora,qlora"
    rows = lora.main(["compare", "--ckpt", "none", "--preset", "tiny", "--methods", methods,
                      "--steps", "3", "--batch-size", "8", "--n-train", "200",
                      "--eval-problems", "16", "--warmup", "1", "--log-interval", "100",
                      "--device", device])
    assert [r["method"] for r in rows] == methods.split(",")
    for r in rows:
        assert r["trainable"] == r["formula"] and r["grads"] == 4 * r["trainable"]
        assert r["optim"] == 8 * r["trainable"] and r["merge_err"] < 1e-4, r


@pytest.mark.parametrize("device", BOTH)
def test_muon_and_adamw_equal_torch_on_device(device):
    """optim.py's Muon (Newton–Schulz in bf16) and AdamW == torch.optim.Muon / AdamW, bitwise,
    stepping the same gradients: each backward runs once and its gradients are copied to
    both models, so only the optimizers' arithmetic is compared (CUDA backward kernels need
    not be bitwise reproducible; the optimizers' matmuls are)."""
    kw = dict(lr=0.02, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw",
              weight_decay=0.1)
    for make_hand, make_ref, select in [
            (lambda ps: optim.Muon(ps, **kw), lambda ps: torch.optim.Muon(ps, **kw),
             optim.is_hidden_matrix),
            (lambda ps: optim.AdamW(ps, lr=3e-3), lambda ps: torch.optim.AdamW(
                ps, lr=3e-3, foreach=False), lambda n, p: True)]:
        a, b = (GPT(get_config("tiny"), seed=0).to(device) for _ in range(2))
        init = {n: p.detach().clone() for n, p in a.named_parameters()}
        hand = make_hand([p for n, p in a.named_parameters() if select(n, p)])
        ref = make_ref([p for n, p in b.named_parameters() if select(n, p)])
        for step in range(10):
            x, y = (t.to(device) for t in tokens(a.config, 4, 16, seed=step))
            a(x, y)[1].backward()
            for pa, pb in zip(a.parameters(), b.parameters()):
                pb.grad = pa.grad.clone()
            hand.step()
            ref.step()
            a.zero_grad(set_to_none=True)
            b.zero_grad(set_to_none=True)
        moved = 0.0
        for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=lambda m: f"{n}: {m}")
            moved = max(moved, (pa - init[n]).abs().max().item())
        assert moved > 1e-3


# tests/test_rl.py's data-parallel run: 1-digit problems and a short SFT give answers of
# varying length, some right (non-zero advantages), so every algorithm moves its own way;
# "dapo" divides by the global token count, so ranks sum to what one process computes
RL_COMPARE = ["compare", "--ckpt", "none", "--preset", "tiny", "--teacher-preset", "tiny",
              "--digits", "1", "--ops", "+-", "--max-new", "4", "--steps", "2", "--group", "4",
              "--sft-steps", "150", "--teacher-sft-steps", "300", "--eval-samples", "2",
              "--eval-problems", "20", "--norm", "dapo", "--lr", "1e-3", "--distill-lr", "1e-3",
              "--cache-dir", ""]


@pytest.mark.parametrize("device", ON_GPU)
def test_rl_sampling_and_two_steps_on_device(device, tmp_path):
    """rl.py: answers drawn on the GPU == answers drawn on the CPU (the Gumbel noise comes
    from per-prompt CPU generators), kept log-probs == a fresh forward; then two steps of
    every algorithm through rl.py compare on the device move the weights, each its own way."""
    enc = byte_encoding()
    cpu_model = GPT(get_config("tiny", vocab_size=enc.n_vocab), seed=0)
    model = copy.deepcopy(cpu_model).to(device)
    prompts, nl = [list(b"3+5="), list(b"12+7="), list(b"4-1=")], 10
    got, lp = rl.sample(model, prompts, 3, 1.0, 6, [11, 22, 33], nl)
    assert got == rl.sample(cpu_model, prompts, 3, 1.0, 6, [11, 22, 33], nl)[0]
    seq, mask, old = rl.pack([p for p in prompts for _ in range(3)], got, device, lp)
    torch.testing.assert_close(rl.token_logprobs(model, seq)[mask], old[mask], atol=1e-5, rtol=0)
    out = tmp_path / "rl.pt"
    rl.main(RL_COMPARE + ["--prompts", "4", "--device", device, "--save", str(out)])
    saved = torch.load(out, weights_only=True)
    assert set(saved) == set(rl.ALGOS)
    for algo, weights in saved.items():
        assert all(torch.isfinite(w).all() for w in weights.values() if w.is_floating_point()), algo
    for x, y in zip(rl.ALGOS, rl.ALGOS[1:]):
        assert any((saved[x][k] - saved[y][k]).abs().max() > 1e-4 for k in saved[x]
                   if saved[x][k].is_floating_point()), (x, y)


@pytest.mark.parametrize("device", ON_GPU)
def test_evaluate_perplexity_on_device_equals_cpu(device, text_file, tmp_path):
    """evaluate.py ppl --device cuda: the same windows' loss and bits/byte as on the CPU."""
    ckpt = tiny_checkpoint(tmp_path / "t.pt", block_size=64)
    results = {}
    for dev in (device, "cpu"):
        results[dev] = evaluate.main(["ppl", "--checkpoint", ckpt, "--text", text_file,
                                      "--device", dev, "--max-tokens", "4096", "--bootstrap",
                                      "10", "--plots", str(tmp_path)])
    for key in ("loss", "bpb"):
        assert abs(results[device][key] - results["cpu"][key]) <= 1e-5 * results["cpu"][key]


# ----------------------------------------------------------------------------------------
# The multigpu tier: the same worker at world sizes 2, 4, 8 (those <= the GPUs), NCCL;
# lora.py and rl.py data parallel against one process, as tests/test_lora.py and
# tests/test_rl.py do on gloo.

def worlds():
    n = min(8, torch.cuda.device_count()) if torch.cuda.is_available() else 0
    return [w for w in (2, 4, 8) if w <= n]


@pytest.mark.slow
@pytest.mark.multigpu
def test_multigpu_worker_equals_one_process(text_file, tmp_path):
    for world in worlds():
        result = torchrun(WORKER, ["all", "cuda", tmp_path / str(world), text_file],
                          nproc=world, timeout=900)
        assert result.returncode == 0, result.output[-4000:]
        for line in worker_verdicts(world, "cuda"):
            assert line in result.output, result.output[-4000:]


def flat_tensors(saved, prefix=""):
    """Every tensor of a saved file, by its path of keys (lora.py --save: the adapter's
    tensors next to metadata; rl.py --save: {algo: state dict})."""
    out = {}
    for key, value in saved.items():
        if isinstance(value, dict):
            out.update(flat_tensors(value, f"{prefix}{key}."))
        elif torch.is_tensor(value):
            out[prefix + key] = value
    return out


@pytest.mark.slow
@pytest.mark.multigpu
def test_multigpu_lora_and_rl_data_parallel_equal_one_process(tmp_path):
    world = worlds()[-1]
    la = ["--ckpt", "none", "--preset", "tiny", "--method", "dora", "--steps", "4",
          "--n-train", "300", "--eval-problems", "0", "--warmup", "2", "--device", "cuda"]
    ra = RL_COMPARE + ["--device", "cuda"]
    for script, args, per_rank, flag in (("lora.py", la, 4, "--batch-size"),
                                         ("rl.py", ra, 2, "--prompts")):
        one = run_python(script, args + [flag, per_rank * world, "--save", tmp_path / "one.pt"],
                         timeout=600)
        assert one.returncode == 0, one.output[-4000:]
        many = torchrun(script, args + [flag, per_rank, "--save", tmp_path / "many.pt"],
                        nproc=world, timeout=600)
        assert many.returncode == 0, many.output[-4000:]
        a, b = (flat_tensors(torch.load(tmp_path / f, weights_only=True))
                for f in ("one.pt", "many.pt"))
        assert a.keys() == b.keys() and len(a) > 0
        for k in a:
            torch.testing.assert_close(a[k], b[k], atol=2e-5, rtol=1e-4,
                                       msg=lambda m: f"{script} {k}: {m}")


# ----------------------------------------------------------------------------------------
# The torchrun worker. Every rank asserts; rank 0 prints one CHECK line per verdict.

def check_comm(rt):
    """dist_plumbing_check.py's collectives, on rt's device: data moved right and the
    meter's bytes right (p2p needs a peer: skipped at a world of one)."""
    d, r, n = rt.device, rt.rank, rt.world_size
    comm.reset()
    x = torch.full((1000,), float(r + 1), device=d)
    comm.all_reduce(x)
    assert torch.all(x == n * (n + 1) / 2)
    out = torch.empty(1000 * n, device=d)
    comm.all_gather_into_tensor(out, torch.full((1000,), float(r), device=d))
    assert torch.equal(out, torch.arange(n, device=d).repeat_interleave(1000).float())
    shard = torch.empty(1000, device=d)
    comm.reduce_scatter_tensor(shard, torch.ones(1000 * n, device=d))
    assert torch.all(shard == n)
    b = torch.full((10,), float(r), device=d)
    comm.broadcast(b, src=0)
    assert torch.all(b == 0)
    if n > 1:
        recv = torch.empty(5, device=d)
        for q in [comm.isend(torch.full((5,), float(r), device=d), (r + 1) % n),
                  comm.irecv(recv, (r - 1) % n)]:
            q.wait()
        assert torch.all(recv == (r - 1) % n)
    rows = {(op, g): tuple(v) for op, g, *v in comm.table()}
    assert rows[("all_reduce", "world")] == (1, 4000, int(2 * (n - 1) / n * 4000)), rows
    assert rows[("all_gather", "world")] == (1, 4000, (n - 1) * 4000), rows
    assert rows[("reduce_scatter", "world")] == (1, 4000 * n, int((n - 1) / n * 4000 * n)), rows
    print0(f"CHECK comm N={n} {d.type}: all_reduce, all_gather, reduce_scatter, broadcast"
           f"{', send/recv' if n > 1 else ''} moved the right data and bytes ({rt.backend})")


def train_reference(argv, world, device):
    """One process, AdamW on the ranks' batches concatenated (tests/dist_train_check.py)."""
    args = train.parse_args(argv)
    run = train.build(args, Runtime(device=device))
    model, opt, corpus = run.model, run.optimizer, run.corpus
    losses = []
    for step in range(args.steps):
        optim.set_lr(opt, train.learning_rate(step, args))
        parts = [train.micro_batches(corpus, args, step, device, rank=r)[0] for r in range(world)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        loss, _, _ = train.train_step(train.Trainer(model, opt), [(x, y)], args, device)
        model.zero_grad(set_to_none=True)
        losses.append(loss)
    return losses, model.state_dict()


def check_train(rt, tmp, data_path):
    """Every --dp mode of train.py == one process: losses, final weights (1e-4 after 5
    AdamW steps, as tests/dist_train_check.py explains), state bytes vs the ZeRO formulas,
    bytes sent vs the expected (not fsdp: its collectives are PyTorch's)."""
    N, dev = rt.world_size, rt.device.type
    common = ["--preset", "tiny", "--data", data_path, "--batch-size", "2", "--seq-len", "32",
              "--steps", "5", "--warmup-steps", "2", "--eval-interval", "1000", "--eval-iters",
              "1", "--log-interval", "1", "--sample-tokens", "0", "--device", dev]
    ref_losses, ref_weights = train_reference(common, N, rt.device)
    for mode in DP_MODES:
        ckpt = os.path.join(tmp, f"{mode}-{N}", "ckpt.pt")
        hist = train.main(common + ["--dp", mode, "--ckpt", ckpt, "--save-interval", "5"])
        for a, b in zip(hist["loss"], ref_losses, strict=True):
            assert abs(a - b) <= 2e-5 * abs(b), (mode, hist["loss"], ref_losses)
        got = torch.load(ckpt, map_location=rt.device, weights_only=True)["model"]
        for name, w in ref_weights.items():
            assert (got[name] - w).abs().max().item() <= 1e-4, (mode, name)
        ledger = hist["ledger"]
        for key in ("params", "grads", "optimizer"):
            have, want = ledger["rows"][rt.rank][key], ledger["formula"][key]
            assert abs(have - want) <= 0.05 * want, (mode, key, have, want)
        if mode != "fsdp" and N > 1:
            have, want = ledger["rows"][rt.rank]["sent"], ledger["expected_sent"]
            assert abs(have - want) <= 0.10 * want, (mode, "sent", have, want)
        print0(f"CHECK train --dp {mode} N={N} {dev}: losses, weights, state bytes match one "
               f"process")


def check_parallel(rt, data_path):
    """parallel.py --check (every step's loss, gradients and weights vs one process) for the
    layouts tests/dist_parallel_check.py runs at this world size (one: the trivial layout)."""
    from dist_parallel_check import COMMON, LAYOUTS
    for flags in LAYOUTS.get(rt.world_size, [[]]):
        argv = COMMON + ["--data", data_path, "--device", rt.device.type] + flags
        parallel.train(parallel.parse_args(argv), rt)
        print0(f"LAYOUT OK {' '.join(flags) or 'dp=1'}")
    print0(f"CHECK parallel N={rt.world_size} {rt.device.type}: every layout equals one process")


def check_pipeline(rt):
    """pipeline.py bench: each hand schedule's loss == torch.distributed.pipelining's where
    torch ran it (tests/dist_pipeline_check.py --bench)."""
    P = rt.world_size
    rows = pipeline.main(["bench", "--microbatches", str(2 * P), "--steps", "1", "--seq-len",
                          "16", "--microbatch-size", "2", "--n-embd", "32", "--device",
                          rt.device.type])
    for row in rows:
        if row["torch_loss"] is not None:
            assert abs(row["hand_loss"] - row["torch_loss"]) <= 1e-5 * row["hand_loss"], row
    ran = [r["schedule"] for r in rows if r["torch_loss"] is not None]
    print0(f"CHECK pipeline bench N={P} {rt.device.type}: hand == torch for {ran or 'none'}")


def worker(what, device, tmp, data_path):
    rt = setup_runtime(device)
    print0(f"worker: {what} on {rt.world_size} rank(s), {rt.device.type} ({rt.backend})")
    if what in ("comm", "all"):
        check_comm(rt)
    if what in ("train", "all"):
        check_train(rt, tmp, data_path)
    if what in ("parallel", "all"):
        check_parallel(rt, data_path)
    if what in ("pipeline", "all"):
        check_pipeline(rt)
    torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)        # skip interpreter teardown (see runtime.run_cli)


if __name__ == "__main__":
    worker(*sys.argv[1:5])
