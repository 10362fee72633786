# Tests for serving/multi_lora.py: many adapters in ONE batch (S-LoRA / Punica BGMV) give,
# row by row, what each adapter merged into its own copy of the model gives (lora.py's
# merge_and_unload is the reference); greedy generation is the same token for token; the
# gather really is per row; the packed (1, T) row of serve.py's engine works, head included;
# the user's mistakes are one-line UserErrors; detach gives the plain linears back.
import copy

import pytest
import torch
import torch.nn as nn

from harness import http_json, served
import lora
import serve
from core import data
from core.cli import fmt_bytes
from core.errors import UserError
from model import GPT, get_config
from serving import multi_lora
from serving.multi_lora import AdapterSet, MultiLoRALinear, attach, detach
from serving.requests import SamplingParams

TOL = 1e-5      # fp32: (W0 + sBA)x in one matmul vs W0 x + s·B(Ax): rounding only

# Three adapters of different methods, ranks, scales and targets: LoRA r=4 on every block
# linear; rsLoRA r=8 (α/√r) on wq, wv and the output head; VeRA (rank 16, its default on
# tiny: the largest wk's 16 outputs allow) with its shared pair folded into per-layer pairs.
ADAPTERS = {
    "math": dict(method="lora", rank=4, alpha=16.0, seed=1),
    "code": dict(method="lora", rank=8, alpha=8.0, rslora=True, seed=2,
                 targets="wq,wv,output"),
    "vera": dict(method="vera", seed=3, vera_d_init=1.0),   # d = 1: b's effect shows
}
NAMES = list(ADAPTERS)


def base_model(seed=0):
    torch.manual_seed(0)
    return GPT(get_config("tiny"), seed=seed).eval()


def trained(base, method, seed, **kw):
    """An adapted copy of `base` as training would leave it: B (VeRA: b) no longer 0, so
    the adapter changes the logits. -> (adapted model, spec)."""
    model = copy.deepcopy(base)
    spec = lora.apply_adapters(model, method, seed=seed, **kw)
    gen = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval(), spec


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The base, each adapter's file and its merged model (lora.py's merge), and the
    multi-adapter model with all three attached."""
    tmp = tmp_path_factory.mktemp("adapters")
    base = base_model()
    paths, merged = {}, {}
    for name, kw in ADAPTERS.items():
        kw = dict(kw)
        model, spec = trained(base, kw.pop("method"), **kw)
        paths[name] = str(tmp / f"{name}.pt")
        lora.save_adapter(model, spec, paths[name])
        merged[name] = lora.merge_and_unload(model).eval()
    multi = copy.deepcopy(base)
    aset = AdapterSet.from_files(multi, [f"{n}={paths[n]}" for n in NAMES])
    return dict(base=base, paths=paths, merged=merged, aset=aset, tmp=tmp,
                slot={n: aset.index(n) for n in NAMES})


def attached(world, kernel="gather"):
    model = copy.deepcopy(world["base"])
    return model, attach(model, world["aset"], kernel)


def tokens(rows, length, seed=0):
    return torch.randint(0, 512, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kernel", multi_lora.KERNELS)
@torch.no_grad()
def test_mixed_batch_equals_each_adapter_merged_row_by_row(world, kernel):
    model, batch = attached(world, kernel)
    order = [None, "math", "code", "vera", "vera", "code", None, "math"]   # None: the base
    slots = torch.tensor([0 if n is None else world["slot"][n] for n in order])
    x = tokens(len(order), 12)
    batch.set_rows(slots)                      # one slot per sequence, broadcast over T
    got = model(x)[0]
    batch.set_rows(slots[:, None].expand(x.shape))     # the same, one slot per token
    assert (model(x)[0] - got).abs().max() < TOL       # (other matmul shapes: rounding)
    plain = world["base"](x)[0]
    for i, name in enumerate(order):
        if name is None:       # slot 0 adds exact zeros: bit for bit the plain model
            assert torch.equal(got[i], plain[i])
            continue
        ref = world["merged"][name](x[i:i + 1])[0][0]
        assert (got[i] - ref).abs().max() < TOL, (name, (got[i] - ref).abs().max())
        assert (ref - plain[i]).abs().max() > 1e-2, name      # the adapter does matter


@torch.no_grad()
def test_packed_row_of_the_engine_with_logits_at(world):
    """serve.py's engine packs a step's sequences into ONE (1, T) row with their own
    positions and a block-diagonal causal mask, and asks for logits only at each
    sequence's last token: per-token slots, the head ('code' adapts it) cut to logits_at."""
    model, batch = attached(world)
    lengths, names = [5, 7, 4, 6], ["code", "math", None, "vera"]
    prompts = [tokens(1, n, seed=i)[0] for i, n in enumerate(lengths)]
    T = sum(lengths)
    mask = torch.zeros(T, T, dtype=torch.bool)
    positions, rows, picks, start = [], [], [], 0
    for n, name in zip(lengths, names):
        mask[start:start + n, start:start + n] = torch.ones(n, n, dtype=torch.bool).tril()
        positions += range(n)
        rows += [0 if name is None else world["slot"][name]] * n
        picks.append(start + n - 1)
        start += n
    batch.set_rows(torch.tensor([rows]), logits_at=picks)
    got = model(torch.cat(prompts)[None], positions=torch.tensor(positions), mask=mask,
                logits_at=picks)[0][0]
    for i, (p, name) in enumerate(zip(prompts, names)):
        ref_model = world["base"] if name is None else world["merged"][name]
        ref = ref_model(p[None])[0][0, -1]
        assert (got[i] - ref).abs().max() < TOL, name


@torch.no_grad()
def test_greedy_generation_token_for_token(world):
    """Several prompts in one batch, each with its adapter (and one on the base): greedy
    generate() through the KV cache equals each merged model generating alone."""
    model, batch = attached(world)
    names = ["vera", "math", None, "code"]
    prompts = tokens(len(names), 6, seed=7)
    batch.set_rows([0 if n is None else world["slot"][n] for n in names])
    out = model.generate(prompts, 16, temperature=0)
    for i, name in enumerate(names):
        ref_model = world["base"] if name is None else world["merged"][name]
        ref = ref_model.generate(prompts[i].tolist(), 16, temperature=0)
        assert out[i].tolist() == ref, name
        if name is not None:     # and the adapter changed what is generated
            assert world["base"].generate(prompts[i].tolist(), 16, temperature=0) != ref


@pytest.mark.parametrize("kernel", multi_lora.KERNELS)
@torch.no_grad()
def test_the_gather_is_per_row(world, kernel):
    """Rows and their indices moved together: the outputs move with them. Rows moved but
    indices not: the rows whose adapter changed give other outputs."""
    model, batch = attached(world, kernel)
    slots = torch.tensor([1, 2, 3, 0, 1, 2])
    x = tokens(len(slots), 10, seed=3)
    batch.set_rows(slots)
    out = model(x)[0]
    batch.set_rows(slots.roll(1))
    assert (model(x.roll(1, 0))[0] - out.roll(1, 0)).abs().max() < 1e-6
    batch.set_rows(slots)                       # indices NOT shifted with the rows
    wrong = model(x.roll(1, 0))[0]
    moved = slots.roll(1) != slots              # every row here: neighbours differ
    assert moved.all()
    per_row = (wrong - out.roll(1, 0)).abs().amax(dim=(1, 2))
    assert (per_row > 1e-2).all(), per_row


def one_line(fn, *words):
    with pytest.raises(UserError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    return msg


def test_user_mistakes_are_one_line(world):
    base, tmp, paths = world["base"], world["tmp"], world["paths"]
    load = lambda *specs: AdapterSet.from_files(copy.deepcopy(base), list(specs))
    # an adapter trained on another base (same shapes: it would load and be noise)
    other, spec = trained(base_model(seed=1), "lora", seed=4, rank=4)
    lora.save_adapter(other, spec, str(tmp / "other.pt"))
    one_line(lambda: load(f"x={tmp / 'other.pt'}"), "another base")
    # DoRA and QLoRA are not a low-rank add on this W0
    for method in ("dora", "qlora"):
        m, spec = trained(base, method, seed=5, rank=4, quant_block=16)
        lora.save_adapter(m, spec, str(tmp / f"{method}.pt"))
        one_line(lambda: load(f"d={tmp / method}.pt"), method, "merged")
    one_line(lambda: load(f"x={tmp / 'missing.pt'}"), "not found")
    one_line(lambda: load(paths["math"]), "NAME=PATH")                 # no NAME=
    one_line(lambda: load(f"a={paths['math']}", f"a={paths['code']}"), "twice")
    one_line(lambda: world["aset"].index("nope"), "unknown", "'math'")
    # an expert of a mixture-of-experts sees a routed subset of the rows
    moe = GPT(get_config("tiny", n_expert=2, expert_top_k=1), seed=0)
    one_line(lambda: AdapterSet(moe, [multi_lora.random_adapter(moe, "e", 2, ["w1"], 0)]),
             "expert")
    model, batch = attached(world)
    one_line(lambda: attach(model, world["aset"]), "detach")
    with pytest.raises(ValueError):             # an engine bug, not a user's: a slot past n
        batch.set_rows([0, 4])


@torch.no_grad()
def test_detach_restores_the_plain_linears(world):
    base = world["base"]
    model, batch = attached(world)
    wrapped = {n: m for n, m in model.named_modules() if isinstance(m, MultiLoRALinear)}
    assert set(wrapped) == set(world["aset"].layers) and len(wrapped) == 2 * 7 + 1
    # the base stays shared and the checkpoint's names do not move: same fingerprint
    assert lora.base_fingerprint(model) == lora.base_fingerprint(base)
    weights = {n: m.weight for n, m in wrapped.items()}
    detach(model)
    x = tokens(3, 9, seed=5)
    for n, m in model.named_modules():
        assert type(m) is not MultiLoRALinear
        if n in weights:
            assert type(m) is nn.Linear and m.weight is weights[n]
    assert torch.equal(model(x)[0], base(x)[0])
    assert list(model.state_dict()) == list(base.state_dict())


def test_memory_per_adapter_is_r_in_plus_out(world):
    aset, base = world["aset"], world["base"]
    linears = {n: m for n, m in base.named_modules() if isinstance(m, nn.Linear)}
    for a in aset.adapters:
        r = a.rank
        want = sum(4 * r * (linears[n].in_features + linears[n].out_features)
                   for n in a.layers)
        assert a.nbytes == want, a.name
    assert [a.rank for a in aset.adapters] == [4, 8, 16]
    # every slot is padded to each layer's largest rank: 16 (VeRA) on the 14 block linears,
    # 8 ('code') on the head
    slot = sum(4 * (16 if n != "output" else 8) * (m.in_features + m.out_features)
               for n, m in linears.items() if n in aset.layers)
    assert aset.stacked_bytes() == slot


def test_main_prints_ratios_and_memory(capsys):
    multi_lora.main(["--preset", "tiny", "--repeats", "1", "--adapters", "2",
                     "--ranks", "4", "--shapes", "4x1"])
    out = capsys.readouterr().out
    cfg = get_config("tiny")
    per_layer = (4 * cfg.n_embd + 2 * (cfg.n_embd + cfg.n_kv_head * cfg.head_dim)
                 + 3 * (cfg.n_embd + cfg.ffn_dim))
    own = 4 * 4 * per_layer * cfg.n_layer
    assert f"own {fmt_bytes(own)}" in out
    for label in ("base", "merged (1 adapter)", "gather k=2", "segment k=2"):
        assert f"  {label} " in out, label


# ----------------------------------------------------------------------------------------
# In the engine and behind the HTTP API (serve.py --lora NAME=PATH)

def test_engine_serves_adapters_and_base_in_one_batch_with_separate_prefix_caches(world):
    """serve.Engine with the three adapters: requests of every adapter and of the base,
    submitted together (one batch, the SAME prompts for all, prefix caching on), each give
    token for token what that adapter merged and generating alone gives. The same prompt
    under two adapters must not share K/V blocks (an adapter changes W_k, W_v): the block
    hashes carry the adapter, so the second wave's cache hits stay within each adapter."""
    model = copy.deepcopy(world["base"])
    eng = serve.Engine(model, None, block_size=4, num_blocks=256, eos_id=-1,
                       adapters=world["aset"])
    prompts = [tokens(1, 10, seed=s)[0].tolist() for s in range(2)]
    want = {None: world["base"], **world["merged"]}
    for wave in range(2):           # the second wave hits the blocks the first one cached
        seqs = [(name, p, eng.add_request(p, SamplingParams(max_tokens=8, temperature=0,
                                                            adapter=name)))
                for p in prompts for name in want]
        while eng.has_work():
            eng.step()
        for name, p, seq in seqs:
            assert seq.output_ids == want[name].generate(p, 8, temperature=0), (wave, name)
    assert eng.stats["cached_tokens"] > 0                  # the second wave did hit
    outs = {name: seq.output_ids for name, p, seq in seqs if p == prompts[0]}
    assert len({tuple(o) for o in outs.values()}) == len(outs)   # the adapters matter
    with pytest.raises(UserError, match="unknown model or adapter 'nope'"):
        eng.add_request(prompts[0], SamplingParams(max_tokens=2, adapter="nope"))
    plain = serve.Engine(copy.deepcopy(world["base"]), None, eos_id=-1)
    with pytest.raises(UserError, match="no LoRA adapters are loaded"):
        plain.add_request(prompts[0], SamplingParams(max_tokens=2, adapter="math"))


def test_api_lists_the_adapters_and_routes_requests_by_model_name(world):
    """/v1/models lists the base and each adapter (with its parent); a completion's
    `model` picks the adapter, and the answer names it; an unknown name is a 404."""
    enc = data.make_encoding({bytes([i]): i for i in range(256)})
    model = copy.deepcopy(world["base"])
    eng = serve.Engine(model, enc, block_size=8, num_blocks=128, adapters=world["aset"])
    with served(eng, enc, "base") as srv:
        call = lambda method, path, body=None: http_json(srv, method, path, body)
        status, listing = call("GET", "/v1/models")
        assert status == 200
        assert [(m["id"], m["parent"]) for m in listing["data"]] == \
            [("base", None)] + [(n, "base") for n in NAMES]
        prompt = [5, 6, 7, 8, 9]
        for name in ["base", *NAMES]:
            status, out = call("POST", "/v1/completions", dict(
                model=name, prompt=prompt, max_tokens=6, temperature=0, ignore_eos=True))
            ref = (world["base"] if name == "base" else world["merged"][name]).generate(
                prompt, 6, temperature=0)
            assert status == 200 and out["model"] == name
            assert out["choices"][0]["text"] == serve.decode_tokens(enc, ref), name
        status, out = call("POST", "/v1/completions", dict(model="nope", prompt=prompt))
        assert status == 404 and "'math'" in out["error"]["message"]
