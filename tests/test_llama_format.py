"""Tests for llama_format.py (and model.load_model on folders): export -> import is exact;
the safetensors file parses with an independent reader; a folder built here in Hugging
Face's rotate-half layout, checked against an independent rotate-half Llama forward,
imports to the same logits; tokenizer.json's merges reproduce tiktoken; what the GPT cannot
represent is one clear error."""
import json
import os
import random
import re
import struct
import subprocess
import sys
from dataclasses import asdict

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from core import data
from core import llama_format as lf
from harness import ROOT
from core import checkpoint as checkpoint_py
from core.checkpoint import load_model
from model import GPT, get_config
from core.errors import UserError

CASES = [("tiny", {}),                                        # GQA, untied
         ("tiny", dict(n_kv_head=4, tie_embeddings=True)),   # MHA, tied
         pytest.param("small", dict(tie_embeddings=True), marks=pytest.mark.slow),  # GQA, tied
         pytest.param("small", dict(n_kv_head=6), marks=pytest.mark.slow)]          # MHA, untied


@pytest.fixture(scope="module")
def enc(text_file):
    return data.get_tokenizer(text_file, 512)


def random_text(rng, n=60):
    alphabet = ["a", "Z", " ", "  ", "\n", "\t", "é", "ß", "日本", "🙂", "👨\u200d👩", "١٢",
                "123456", "'s", "'LL", "<", "|", "e\u0301", "\x00", "\U0010ffff", "def f(x):"]
    return "".join(rng.choice(alphabet) for _ in range(n))


def tiny_model(enc, seed=0, **kw):
    return GPT(get_config("tiny", vocab_size=enc.n_vocab, **kw), seed=seed).eval()


# ------------------------------------------------------------------ export -> import, exact
@pytest.mark.parametrize("preset,kw", CASES)
def test_export_import_round_trip_is_exact(enc, tmp_path, preset, kw):
    model = GPT(get_config(preset, vocab_size=enc.n_vocab, **kw), seed=3)
    lf.export_model(model, data.encoding_to_state(enc), tmp_path)
    back, ckpt = load_model(str(tmp_path))
    assert ckpt["config"] == asdict(model.config)
    a, b = model.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert ckpt["tokenizer"] == data.encoding_to_state(enc)
    enc2 = data.encoding_from_state(ckpt["tokenizer"])
    rng = random.Random(0)
    for _ in range(20):
        text = random_text(rng)
        assert enc2.encode(text, allowed_special="all") == enc.encode(text, allowed_special="all")


def test_config_json_names_every_field_of_the_math(enc, tmp_path):
    model = tiny_model(enc)
    lf.export_model(model, data.encoding_to_state(enc), tmp_path, dtype="bfloat16")
    hf = json.loads((tmp_path / "config.json").read_text())
    cfg = model.config
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["model_type"] == "llama"
    expected = dict(hidden_size=cfg.n_embd, intermediate_size=cfg.ffn_dim,
                    num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
                    num_key_value_heads=cfg.n_kv_head, head_dim=cfg.head_dim,
                    rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
                    vocab_size=cfg.vocab_size, max_position_embeddings=cfg.block_size,
                    tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
                    mlp_bias=False, torch_dtype="bfloat16", bos_token_id=enc.eot_token,
                    eos_token_id=enc.eot_token, rope_scaling=None)
    assert {k: hf[k] for k in expected} == expected


# ------------------------------------------------------------------ an independent reader
def parse_safetensors(path):
    """A minimal safetensors reader written from the format's description alone."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    body = raw[8 + n:]
    header.pop("__metadata__", None)
    spans = sorted((e["data_offsets"], name) for name, e in header.items())
    assert spans[0][0][0] == 0 and spans[-1][0][1] == len(body)
    for (prev, _), (cur, _) in zip(spans, spans[1:]):
        assert prev[1] == cur[0]                        # contiguous: no gap, no overlap
    out = {}
    for name, e in header.items():
        a, b = e["data_offsets"]
        item = {"F32": 4, "BF16": 2, "F16": 2}[e["dtype"]]
        assert b - a == item * int(np.prod(e["shape"]))
        chunk = body[a:b]
        if e["dtype"] == "F32":
            arr = np.frombuffer(chunk, dtype="<f4")
        elif e["dtype"] == "F16":
            arr = np.frombuffer(chunk, dtype="<f2").astype(np.float32)
        else:                                           # bf16 = the top 16 bits of an f32
            arr = (np.frombuffer(chunk, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        out[name] = (e["dtype"], e["shape"], arr.reshape(e["shape"]))
    return n, out


def rotate_half_rows(w, n_heads):
    """The HF layout, spelled out: in each head, new row j takes old row 2j (j < d/2) or old
    row 2(j - d/2) + 1 (j >= d/2)."""
    d = w.shape[0] // n_heads
    order = [h * d + (2 * j if j < d // 2 else 2 * (j - d // 2) + 1)
             for h in range(n_heads) for j in range(d)]
    return w[order]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_safetensors_parse_with_an_independent_reader(enc, tmp_path, dtype):
    model = tiny_model(enc, seed=1)
    lf.export_model(model, data.encoding_to_state(enc), tmp_path, dtype=dtype)
    n, tensors = parse_safetensors(tmp_path / "model.safetensors")
    assert n % 8 == 0                                   # header padded: data aligned
    cfg, sd = model.config, model.state_dict()
    assert len(tensors) == 2 + 9 * cfg.n_layer + 1
    want = "F32" if dtype == "float32" else "BF16"
    for name, (dt, shape, arr) in tensors.items():
        assert dt == want
    ref = {"model.embed_tokens.weight": sd["tok_embeddings.weight"],
           "lm_head.weight": sd["output.weight"],
           "model.norm.weight": sd["norm.weight"],
           "model.layers.1.self_attn.q_proj.weight": rotate_half_rows(
               sd["layers.1.attention.wq.weight"], cfg.n_head),
           "model.layers.1.self_attn.k_proj.weight": rotate_half_rows(
               sd["layers.1.attention.wk.weight"], cfg.n_kv_head),
           "model.layers.1.self_attn.v_proj.weight": sd["layers.1.attention.wv.weight"],
           "model.layers.0.mlp.gate_proj.weight": sd["layers.0.feed_forward.w1.weight"],
           "model.layers.0.mlp.down_proj.weight": sd["layers.0.feed_forward.w2.weight"],
           "model.layers.0.post_attention_layernorm.weight": sd["layers.0.ffn_norm.weight"]}
    for name, w in ref.items():
        expect = w.to(getattr(torch, dtype)).float().numpy()
        assert tensors[name][1] == list(w.shape)
        assert np.array_equal(tensors[name][2], expect), name


# ------------------------------------------------------------------ the reference layout
def llama_logits(hf, cfg, idx):
    """Llama's forward as Hugging Face writes it (rotate_half RoPE, cos/sin repeated over
    the two halves), from HF-named tensors: independent of model.py."""
    d, H, Hkv = cfg.head_dim, cfg.n_head, cfg.n_kv_head
    T = idx.shape[1]
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.outer(torch.arange(T, dtype=torch.float64), inv)
    emb = torch.cat([ang, ang], -1)
    cos, sin = emb.cos().float(), emb.sin().float()

    def rotate_half(x):
        return torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * w

    x = hf["model.embed_tokens.weight"][idx]
    for i in range(cfg.n_layer):
        p = f"model.layers.{i}."
        h = norm(x, hf[p + "input_layernorm.weight"])
        q = (h @ hf[p + "self_attn.q_proj.weight"].T).view(1, T, H, d).transpose(1, 2)
        k = (h @ hf[p + "self_attn.k_proj.weight"].T).view(1, T, Hkv, d).transpose(1, 2)
        v = (h @ hf[p + "self_attn.v_proj.weight"].T).view(1, T, Hkv, d).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
        att = (q @ k.transpose(-1, -2)) / d ** 0.5
        att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(1, T, H * d)
        x = x + y @ hf[p + "self_attn.o_proj.weight"].T
        h = norm(x, hf[p + "post_attention_layernorm.weight"])
        gate, up = h @ hf[p + "mlp.gate_proj.weight"].T, h @ hf[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ hf[p + "mlp.down_proj.weight"].T
    x = norm(x, hf["model.norm.weight"])
    return x @ hf.get("lm_head.weight", hf["model.embed_tokens.weight"]).T


def write_reference_folder(path, model, enc, dtype=torch.float32):
    """A Hugging Face folder built by hand: HF names, q/k rows in rotate-half order, a
    config.json with only LlamaConfig's own fields."""
    cfg, sd = model.config, model.state_dict()
    hf = {"model.embed_tokens.weight": sd["tok_embeddings.weight"],
          "model.norm.weight": sd["norm.weight"], "lm_head.weight": sd["output.weight"]}
    for i in range(cfg.n_layer):
        g, p = f"layers.{i}.", f"model.layers.{i}."
        wq, wk = sd[g + "attention.wq.weight"], sd[g + "attention.wk.weight"]
        hf[p + "self_attn.q_proj.weight"] = rotate_half_rows(wq, cfg.n_head)
        hf[p + "self_attn.k_proj.weight"] = rotate_half_rows(wk, cfg.n_kv_head)
        hf[p + "self_attn.v_proj.weight"] = sd[g + "attention.wv.weight"]
        hf[p + "self_attn.o_proj.weight"] = sd[g + "attention.wo.weight"]
        hf[p + "mlp.gate_proj.weight"] = sd[g + "feed_forward.w1.weight"]
        hf[p + "mlp.up_proj.weight"] = sd[g + "feed_forward.w3.weight"]
        hf[p + "mlp.down_proj.weight"] = sd[g + "feed_forward.w2.weight"]
        hf[p + "input_layernorm.weight"] = sd[g + "attention_norm.weight"]
        hf[p + "post_attention_layernorm.weight"] = sd[g + "ffn_norm.weight"]
    hf = {k: v.to(dtype) for k, v in hf.items()}
    path.mkdir(exist_ok=True)
    lf.write_safetensors(str(path / "model.safetensors"), hf)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": cfg.n_embd, "intermediate_size": cfg.ffn_dim,
              "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
              "num_key_value_heads": cfg.n_kv_head, "rms_norm_eps": cfg.norm_eps,
              "rope_theta": cfg.rope_theta, "vocab_size": cfg.vocab_size,
              "max_position_embeddings": cfg.block_size, "hidden_act": "silu",
              "tie_word_embeddings": False}
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text(json.dumps(lf.tokenizer_json(data.encoding_to_state(enc))))
    return {k: v.float() for k, v in hf.items()}


def test_reference_rotate_half_folder_imports_to_the_same_logits(enc, tmp_path):
    model = tiny_model(enc, seed=2)
    hf = write_reference_folder(tmp_path, model, enc)
    idx = torch.randint(0, enc.n_vocab, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(idx)[0]
        reference = llama_logits(hf, model.config, idx)
        # the hand-built layout is right: HF's math on it gives the GPT's logits ...
        torch.testing.assert_close(reference, ours, rtol=1e-4, atol=1e-5)
        imported, ckpt = load_model(str(tmp_path))
        # ... and importing it permutes back exactly
        torch.testing.assert_close(imported(idx)[0], ours, rtol=0, atol=0)
    assert ckpt["config"]["ffn_hidden"] == model.config.ffn_dim


def test_bf16_folder_imports_as_the_rounded_weights(enc, tmp_path):
    model = tiny_model(enc, seed=4)
    write_reference_folder(tmp_path, model, enc, dtype=torch.bfloat16)
    imported, _ = load_model(str(tmp_path))
    for k, w in model.state_dict().items():
        assert torch.equal(imported.state_dict()[k], w.bfloat16().float()), k


# ------------------------------------------------------------------ tokenizer.json
def hf_bpe_encode(tok, text):
    """What a merges-list BPE with ignore_merges does (HF tokenizers), from tokenizer.json
    alone: pre-split, spell bytes in GPT-2's alphabet, whole word if in the vocab, else
    merge the adjacent pair with the best (lowest) merge rank, leftmost first."""
    model = tok["model"]
    vocab, rank = model["vocab"], {tuple(m.split(" ")): i for i, m in enumerate(model["merges"])}
    b2u = lf.bytes_to_unicode()
    pattern = lf.regex_from_onig(tok["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"])
    ids = []
    for chunk in re.findall(pattern, text):
        word = "".join(b2u[b] for b in chunk.encode("utf-8"))
        if word in vocab:
            ids.append(vocab[word])
            continue
        parts = list(word)
        while len(parts) > 1:
            best = min(range(len(parts) - 1),
                       key=lambda i: rank.get((parts[i], parts[i + 1]), float("inf")))
            if (parts[best], parts[best + 1]) not in rank:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        ids += [vocab[p] for p in parts]
    return ids


def test_tokenizer_json_merges_reproduce_tiktoken(enc, text_file):
    tok = lf.tokenizer_json(data.encoding_to_state(enc))
    assert tok["added_tokens"][0]["content"] == data.EOT
    assert tok["added_tokens"][0]["id"] == enc.eot_token
    rng = random.Random(1)
    texts = [random_text(rng) for _ in range(30)] + [open(text_file).read()[:3000]]
    for text in texts:
        assert hf_bpe_encode(tok, text) == enc.encode_ordinary(text)


def test_gpt2_style_tokenizer_imports(tmp_path):
    """A ByteLevel pre-tokenizer with its own regex (GPT-2's layout) reads too."""
    ranks = {bytes([i]): i for i in range(256)}
    ranks[b"ab"] = 256
    tok = lf.tokenizer_json({"name": "x", "pat_str": lf.GPT2_SPLIT, "mergeable_ranks": ranks,
                             "special_tokens": {"<|endoftext|>": 257}})
    tok["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
    state = lf.tokenizer_state_from_json(tok, "tokenizer.json")
    enc = data.encoding_from_state(state)
    assert enc.encode_ordinary("abc ab") == [256, 99, 32, 256]


# ------------------------------------------------------------------ refusals, one line each
@pytest.fixture
def folder(enc, tmp_path):
    lf.export_model(tiny_model(enc), data.encoding_to_state(enc), tmp_path / "m")
    return tmp_path / "m"


def edit_json(path, **changes):
    obj = json.loads(path.read_text())
    obj.update(changes)
    path.write_text(json.dumps(obj))


@pytest.mark.parametrize("changes,message", [
    (dict(attention_bias=True), "attention_bias is true"),
    (dict(mlp_bias=True), "mlp_bias is true"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope_scaling"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(architectures=["MistralForCausalLM"], model_type="mistral"), "only LlamaForCausalLM"),
    (dict(head_dim=16), "head_dim 16"),
    (dict(intermediate_size=999),
     "gate_proj.weight has shape [96, 32], config.json implies [999, 32]"),
])
def test_config_the_gpt_cannot_represent_is_refused(folder, changes, message):
    edit_json(folder / "config.json", **changes)
    with pytest.raises(UserError, match=re.escape(message)):
        load_model(str(folder))


def test_non_byte_level_tokenizer_is_refused(folder):
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁"}
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(UserError, match="is not supported: byte-level BPE"):
        load_model(str(folder))
    tok["model"]["type"] = "Unigram"
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(UserError, match="model 'Unigram'"):
        load_model(str(folder))


def test_tokenizer_beyond_the_vocabulary_is_refused(folder):
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["added_tokens"].append({"id": 10_000, "content": "<|extra|>", "special": True})
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(UserError, match="token id 10000, beyond the model's vocab_size 512"):
        load_model(str(folder))


def test_broken_folders_are_one_clear_error(folder):
    st = folder / "model.safetensors"
    raw = st.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    st.write_bytes(raw[:len(raw) // 2])
    with pytest.raises(UserError, match="truncated"):
        load_model(str(folder))
    # a header that lies: the embedding claims twice its rows
    header["model.embed_tokens.weight"]["shape"][0] *= 2
    lie = json.dumps(header).encode()
    lie += b" " * (-len(lie) % 8)
    st.write_bytes(struct.pack("<Q", len(lie)) + lie + raw[8 + n:])
    with pytest.raises(UserError, match="the header lies about model.embed_tokens.weight"):
        load_model(str(folder))
    st.write_bytes(struct.pack("<Q", 10 ** 12) + raw[8:])
    with pytest.raises(UserError, match="header length 1000000000000 exceeds the file"):
        load_model(str(folder))
    st.write_bytes(struct.pack("<Q", 8) + b"not json" + raw[8 + n:])
    with pytest.raises(UserError, match="header is not JSON"):
        load_model(str(folder))
    st.unlink()
    with pytest.raises(UserError, match="no model.safetensors"):
        load_model(str(folder))
    (folder / "config.json").unlink()
    with pytest.raises(UserError, match="without config.json"):
        load_model(str(folder))


def test_moe_and_extra_heads_are_refused_on_export(enc, tmp_path):
    state = data.encoding_to_state(enc)
    with pytest.raises(UserError, match="mixture-of-experts model .* is not a Llama"):
        lf.export_model(tiny_model(enc, n_expert=4, ffn_hidden=32), state, tmp_path)
    with pytest.raises(UserError, match="extra next-token heads"):
        lf.export_model(tiny_model(enc, n_extra_heads=2), state, tmp_path)


@pytest.mark.slow
def test_export_command_line(enc, tmp_path):
    model = tiny_model(enc, seed=5)
    torch.save({"config": asdict(model.config), "model": model.state_dict(),
                "tokenizer": data.encoding_to_state(enc)}, tmp_path / "ckpt.pt")
    r = subprocess.run([sys.executable, "-m", "core.checkpoint", "export", "--checkpoint",
                        str(tmp_path / "ckpt.pt"), "--to", str(tmp_path / "hf")],
                       env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "model.safetensors" in r.stdout
    back, _ = load_model(str(tmp_path / "hf"))
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())


def test_checkpoint_help_lists_its_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        checkpoint_py.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "export" in out and "convert" in out
