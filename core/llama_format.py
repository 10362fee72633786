"""
core/llama_format.py -- this repo's GPT in and out of the Hugging Face Llama layout, with no new
dependency: safetensors written and read by hand, config.json mapped field by field, the
RoPE pair layout permuted, and the byte-level BPE tokenizer as a tokenizer.json.

The GPT (model.py) is architecturally Llama (Touvron et al. 2023): pre-RMSNorm, RoPE, GQA,
SwiGLU, no biases. So its weights ARE a `LlamaForCausalLM` up to names and one row
permutation:

  RoPE rotates pairs of coordinates of each head by the angle position·θ_i. Which
  coordinates form pair i is a convention:
    - model.py (and Meta's original Llama code): interleaved pairs (2i, 2i+1);
    - Hugging Face's `rotate_half`: halves, pairs (i, i + d/2).
  A query/key row of head h at index 2i (GPT) must sit at index i (HF), and 2i+1 at
  i + d/2. Since q·k sums over all coordinates, permuting the rows of W_q and W_k the same
  way inside every head changes nothing else: W_v, W_o, the MLP and the norms copy as
  they are. (The permutation is the one HF's convert_llama_weights_to_hf.py applies.)

What the format adds / costs / cannot hold
  + a model trained here opens in every tool that reads Llama checkpoints, and a small
    Llama-family model on disk runs through serve.py, lora.py, spec_decode.py here;
  + safetensors is data only: a header of JSON and raw bytes, nothing to execute (a pickle
    can run code when it is unpickled);
  - the layout has no place for a mixture of experts or extra (Medusa/MTP) heads: refused;
  - what the GPT cannot compute is refused on import, one line each: biases, rope_scaling,
    activations other than SiLU, head_dim ≠ hidden/heads, non-byte-level tokenizers.

safetensors: 8 bytes little-endian u64 N, then N bytes of JSON {name: {dtype, shape,
data_offsets: [begin, end)}, "__metadata__": {str: str}} (padded with spaces to a multiple
of 8 so the data starts aligned), then the tensors' raw little-endian bytes, back to back.
"""
import json
import mmap
import os
import re
import struct
import sys
from dataclasses import asdict, fields

import torch

from core import data
from model import GPT, GPTConfig
from core.errors import UserError

SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MAX_HEADER_BYTES = 100 * 2 ** 20      # the safetensors library's own limit
CONFIG_KEY = "nanoscale_config"       # our full GPTConfig, so export -> import is exact


# ----------------------------------------------------------------------------------------
# safetensors, by hand

def write_safetensors(path, tensors, metadata=None):
    """tensors: {name: tensor} written in that order, each tensor's bytes right after the
    previous one's (offsets are relative to the end of the header)."""
    if sys.byteorder != "little":
        raise UserError("safetensors is little-endian; writing it on a big-endian host is "
                        "not supported here")
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        dtype = {v: k for k, v in SAFETENSORS_DTYPES.items()}.get(t.dtype)
        if dtype is None:
            raise UserError(f"tensor {name}: dtype {t.dtype} is not one of F32, F16, BF16")
        blob = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": dtype, "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)          # the format allows trailing spaces: align data
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)
    os.replace(tmp, path)


def read_safetensors_header(path):
    """-> (header without __metadata__, metadata, data length), every claim checked against
    the file: the JSON parses, dtypes are known, each tensor's bytes = numel·itemsize, the
    ranges tile [0, data length) with no gap, overlap or trailing bytes."""
    size = os.path.getsize(path)
    if size < 8:
        raise UserError(f"{path}: {size} bytes, too short for a safetensors file (truncated?)")
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        if n > size - 8 or n > MAX_HEADER_BYTES:
            raise UserError(f"{path}: header length {n} exceeds the file ({size} bytes): "
                            "truncated, or not safetensors")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"{path}: the safetensors header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise UserError(f"{path}: the safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_len, end = size - 8 - n, 0
    for name, e in sorted(header.items(), key=lambda kv: _offsets(path, kv)[0]):
        begin, stop = _offsets(path, (name, e))
        if e.get("dtype") not in SAFETENSORS_DTYPES:
            raise UserError(f"{path}: tensor {name} has dtype {e.get('dtype')!r}; "
                            f"supported: {', '.join(SAFETENSORS_DTYPES)}")
        shape = e.get("shape")
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise UserError(f"{path}: tensor {name} has a bad shape {shape!r}")
        need = _numel(shape) * SAFETENSORS_DTYPES[e["dtype"]].itemsize
        if stop - begin != need:
            raise UserError(f"{path}: the header lies about {name}: shape {shape} in "
                            f"{e['dtype']} is {need} bytes, its offsets span {stop - begin}")
        if begin != end:
            raise UserError(f"{path}: tensor {name} starts at byte {begin}, the previous one "
                            f"ended at {end} (a gap or an overlap)")
        end = stop
    if end != data_len:
        raise UserError(f"{path}: the tensors end at byte {end} but the data is {data_len} "
                        f"bytes ({'truncated' if end > data_len else 'trailing bytes'})")
    return header, metadata, data_len


def _offsets(path, item):
    name, e = item
    offs = e.get("data_offsets") if isinstance(e, dict) else None
    if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)
            and 0 <= offs[0] <= offs[1]):
        raise UserError(f"{path}: tensor {name} has bad data_offsets {offs!r}")
    return offs


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def read_safetensors(path):
    """-> ({name: tensor in its stored dtype}, metadata)."""
    if sys.byteorder != "little":
        raise UserError("safetensors is little-endian; reading it on a big-endian host is "
                        "not supported here")
    header, metadata, data_len = read_safetensors_header(path)
    start = os.path.getsize(path) - data_len
    out = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        for name, e in header.items():
            begin, stop = e["data_offsets"]
            dtype = SAFETENSORS_DTYPES[e["dtype"]]
            if stop == begin:
                out[name] = torch.empty(e["shape"], dtype=dtype)
                continue
            # one fresh, aligned copy per tensor, read through the map: the file is never
            # held twice in memory (and an odd-sized bf16 tensor cannot misalign the next)
            chunk = bytearray(mapped[start + begin:start + stop])
            out[name] = torch.frombuffer(chunk, dtype=dtype).reshape(e["shape"])
    return out, metadata


# ----------------------------------------------------------------------------------------
# Names and the RoPE permutation

def hf_names(cfg):
    """[(GPT state-dict name, HF name)] in the order HF writes them."""
    pairs = [("tok_embeddings.weight", "model.embed_tokens.weight")]
    for i in range(cfg.n_layer):
        g, h = f"layers.{i}.", f"model.layers.{i}."
        pairs += [(g + "attention.wq.weight", h + "self_attn.q_proj.weight"),
                  (g + "attention.wk.weight", h + "self_attn.k_proj.weight"),
                  (g + "attention.wv.weight", h + "self_attn.v_proj.weight"),
                  (g + "attention.wo.weight", h + "self_attn.o_proj.weight"),
                  (g + "feed_forward.w1.weight", h + "mlp.gate_proj.weight"),
                  (g + "feed_forward.w3.weight", h + "mlp.up_proj.weight"),
                  (g + "feed_forward.w2.weight", h + "mlp.down_proj.weight"),
                  (g + "attention_norm.weight", h + "input_layernorm.weight"),
                  (g + "ffn_norm.weight", h + "post_attention_layernorm.weight")]
    pairs.append(("norm.weight", "model.norm.weight"))
    if not cfg.tie_embeddings:
        pairs.append(("output.weight", "lm_head.weight"))
    return pairs


def interleaved_to_half(w, n_heads):
    """W_q or W_k rows, per head: (2i, 2i+1) pairs -> (i, i + d/2) pairs. Row 2i of a head
    goes to row i, row 2i+1 to row i + d/2."""
    out_dim, in_dim = w.shape
    d = out_dim // n_heads
    return w.reshape(n_heads, d // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def half_to_interleaved(w, n_heads):
    """The inverse: rows i and i + d/2 of each head become rows 2i and 2i+1."""
    out_dim, in_dim = w.shape
    d = out_dim // n_heads
    return w.reshape(n_heads, 2, d // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _rope_permutation(gpt_name, cfg):
    """How many heads the tensor's rows hold if RoPE touches it (W_q, W_k), else None."""
    if gpt_name.endswith("attention.wq.weight"):
        return cfg.n_head
    if gpt_name.endswith("attention.wk.weight"):
        return cfg.n_kv_head
    return None


# ----------------------------------------------------------------------------------------
# config.json

def hf_config(cfg, dtype, bos_eos_id):
    """Every field of LlamaConfig that determines the math, plus our own config for an
    exact round trip (HF keeps unknown keys as plain attributes)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.block_size,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "initializer_range": cfg.init_std,
        "bos_token_id": bos_eos_id,
        "eos_token_id": bos_eos_id,
        "torch_dtype": dtype,
        "use_cache": True,
        CONFIG_KEY: asdict(cfg),
    }


def _require(hf, key, path, default=None):
    if key not in hf:
        if default is None:
            raise UserError(f"{path}: config.json has no {key!r}")
        return default
    return hf[key]


def gpt_config_from_hf(hf, path):
    """config.json -> GPTConfig, refusing (one line each) what the GPT cannot compute."""
    archs = hf.get("architectures") or []
    if hf.get("model_type") != "llama" or (archs and "LlamaForCausalLM" not in archs):
        raise UserError(f"{path}: architecture {archs or hf.get('model_type')!r} is not "
                        "supported: only LlamaForCausalLM (model_type llama)")
    if hf.get("hidden_act", "silu") != "silu":
        raise UserError(f"{path}: hidden_act {hf['hidden_act']!r}: the GPT's MLP is SwiGLU "
                        "(silu) only")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise UserError(f"{path}: {key} is true: the GPT has no biases")
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling")
    if scaling or rope.get("rope_type", "default") != "default":
        raise UserError(f"{path}: rope_scaling {scaling or rope!r} is not supported: only "
                        "plain RoPE")
    n_embd = _require(hf, "hidden_size", path)
    n_head = _require(hf, "num_attention_heads", path)
    head_dim = hf.get("head_dim") or n_embd // n_head
    if head_dim * n_head != n_embd:
        raise UserError(f"{path}: head_dim {head_dim} × {n_head} heads ≠ hidden_size "
                        f"{n_embd}: the GPT needs head_dim = hidden_size / heads")
    cfg = GPTConfig(
        vocab_size=_require(hf, "vocab_size", path),
        block_size=hf.get("max_position_embeddings", 2048),
        n_layer=_require(hf, "num_hidden_layers", path),
        n_head=n_head,
        n_kv_head=hf.get("num_key_value_heads") or n_head,
        n_embd=n_embd,
        ffn_hidden=_require(hf, "intermediate_size", path),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
    ).validate()
    return _prefer_saved_config(cfg, hf.get(CONFIG_KEY))


def _prefer_saved_config(derived, saved):
    """Our export also stores the full GPTConfig (ffn_hidden=0 with multiple_of, attn, ...).
    Use it when it computes exactly the same model as the HF fields say, else ignore it."""
    if not isinstance(saved, dict) or set(saved) != {f.name for f in fields(GPTConfig)}:
        return derived
    try:
        cfg = GPTConfig(**saved).validate()
    except (TypeError, UserError):
        return derived
    math_fields = ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd",
                   "ffn_dim", "rope_theta", "norm_eps", "tie_embeddings", "n_expert",
                   "n_extra_heads")
    same = all(getattr(cfg, k) == getattr(derived, k) for k in math_fields)
    return cfg if same else derived


# ----------------------------------------------------------------------------------------
# tokenizer.json: byte-level BPE (GPT-2, Radford et al. 2019)

def bytes_to_unicode():
    """GPT-2's map from the 256 bytes to printable characters: byte-level BPE vocabularies
    are written as strings, so every byte needs a visible stand-in (space -> 'Ġ')."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def regex_for_onig(pat):
    """data.SPLIT_PATTERN writes code points as \\uXXXX / \\UXXXXXXXX (Python re and Rust
    regex); Oniguruma (HF tokenizers) reads \\x{...}, which Rust regex reads too."""
    return re.sub(r"(?<!\\)((?:\\\\)*)\\(?:u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8}))",
                  lambda m: f"{m[1]}\\x{{{int(m[2] or m[3], 16):x}}}", pat)


def regex_from_onig(pat):
    """The inverse: \\x{...} -> \\uXXXX / \\UXXXXXXXX (Python re has no \\x{...})."""
    def esc(m):
        cp = int(m[2], 16)
        return m[1] + (f"\\u{cp:04x}" if cp < 0x10000 else f"\\U{cp:08x}")
    return re.sub(r"(?<!\\)((?:\\\\)*)\\x\{([0-9a-fA-F]+)\}", esc, pat)


def bpe_merges(ranks):
    """Every split (a, b) of every multi-byte token t into two tokens, ordered by t's rank.
    tiktoken merges whichever adjacent pair's concatenation has the lowest rank; listing all
    the splits that spell t at t's priority lets a merges-list BPE make the same choices."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        for k in range(1, len(token)):
            if token[:k] in ranks and token[k:] in ranks:
                merges.append((rank, token[:k], token[k:]))
    return [(a, b) for _, a, b in merges]


def tokenizer_json(state):
    """data.encoding_to_state's dict -> the tokenizer.json object (HF tokenizers)."""
    b2u = bytes_to_unicode()

    def spell(token_bytes):
        return "".join(b2u[x] for x in token_bytes)
    ranks, specials = state["mergeable_ranks"], state["special_tokens"]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": i, "content": s, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}
                         for s, i in sorted(specials.items(), key=lambda kv: kv[1])],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex_for_onig(state["pat_str"])},
             "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": {spell(b): r for b, r in sorted(ranks.items(), key=lambda kv: kv[1])},
                  "merges": [f"{spell(a)} {spell(b)}" for a, b in bpe_merges(ranks)]},
    }


def tokenizer_state_from_json(tok, path):
    """tokenizer.json -> data.encoding_to_state's dict, if it is byte-level BPE."""
    model = tok.get("model") or {}
    pre = tok.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    splits = [s for s in steps if s.get("type") == "Split"]
    supported = ("supported: byte-level BPE (model BPE + a ByteLevel pre-tokenizer, "
                 "GPT-2/Llama 3 style)")
    if model.get("type") != "BPE" or not byte_level or model.get("byte_fallback") \
            or tok.get("normalizer") or len(steps) != len(byte_level) + len(splits):
        raise UserError(f"{path}: tokenizer (model {model.get('type')!r}, pre-tokenizer "
                        f"{pre.get('type')!r}) is not {supported}")
    if splits:
        s = splits[0]
        if len(splits) > 1 or s.get("behavior") != "Isolated" or s.get("invert") \
                or "Regex" not in (s.get("pattern") or {}):
            raise UserError(f"{path}: pre-tokenizer split {s!r} is not {supported}")
        pat = regex_from_onig(s["pattern"]["Regex"])
    elif byte_level[0].get("use_regex", True):
        pat = GPT2_SPLIT
    else:
        raise UserError(f"{path}: the tokenizer never splits its input; {supported}")
    u2b = {c: b for b, c in bytes_to_unicode().items()}
    specials = {t["content"]: t["id"] for t in tok.get("added_tokens", []) if t.get("special")}
    ranks = {}
    for text, i in model.get("vocab", {}).items():
        if text in specials:
            continue
        if any(c not in u2b for c in text):
            raise UserError(f"{path}: token {text!r} is not written in GPT-2's byte alphabet; "
                            f"{supported}")
        ranks[bytes(u2b[c] for c in text)] = i
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise UserError(f"{path}: the vocabulary lacks {len(missing)} of the 256 single bytes "
                        "(byte-level BPE must encode any string)")
    ours = specials == {data.EOT: len(ranks)}
    n_vocab = max([*ranks.values(), *specials.values()]) + 1
    return {"name": f"{'nanoscale' if ours else 'hf'}_bpe_{n_vocab}", "pat_str": pat,
            "mergeable_ranks": ranks, "special_tokens": specials}


# ----------------------------------------------------------------------------------------
# The folder, both ways

def export_model(model, tokenizer_state, out_dir, dtype="float32"):
    """Write config.json, model.safetensors, tokenizer.json, tokenizer_config.json.
    Returns {file name: bytes}."""
    cfg = model.config
    if cfg.n_expert:
        raise UserError(f"a mixture-of-experts model ({cfg.n_expert} experts) is not a "
                        "Llama: LlamaForCausalLM has one dense MLP per layer")
    if cfg.n_extra_heads:
        raise UserError(f"the model has {cfg.n_extra_heads} extra next-token heads, which "
                        "LlamaForCausalLM has no place for")
    if dtype not in DTYPE_NAMES:
        raise UserError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPE_NAMES)}")
    state = model.state_dict()
    tensors = {}
    for gpt_name, hf_name in hf_names(cfg):
        w = state[gpt_name].detach().cpu()
        heads = _rope_permutation(gpt_name, cfg)
        if heads:
            w = interleaved_to_half(w, heads)
        tensors[hf_name] = w.to(DTYPE_NAMES[dtype]).contiguous()
    specials = tokenizer_state["special_tokens"]
    eos = specials.get(data.EOT, next(iter(specials.values()), None))
    os.makedirs(out_dir, exist_ok=True)
    write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors, {"format": "pt"})
    _write_json(os.path.join(out_dir, "config.json"), hf_config(cfg, dtype, eos))
    _write_json(os.path.join(out_dir, "tokenizer.json"), tokenizer_json(tokenizer_state))
    eos_text = next((s for s, i in specials.items() if i == eos), None)
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": eos_text,
        "eos_token": eos_text, "model_max_length": cfg.block_size,
        "clean_up_tokenization_spaces": False})
    names = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    return {n: os.path.getsize(os.path.join(out_dir, n)) for n in names}


def _write_json(path, obj):
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, ensure_ascii=False)
    os.replace(path + ".tmp", path)


def _read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise UserError(f"{path} is not a JSON object")
    return obj


def _read_weights(folder):
    """model.safetensors, or the shards a model.safetensors.index.json names."""
    single = os.path.join(folder, "model.safetensors")
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(single):
        return read_safetensors(single)[0]
    if not os.path.exists(index):
        raise UserError(f"{folder}: no model.safetensors (nor model.safetensors.index.json)")
    shards = sorted(set((_read_json(index).get("weight_map") or {}).values()))
    tensors = {}
    for shard in shards:
        if os.path.basename(shard) != shard:
            raise UserError(f"{index}: shard name {shard!r} points outside the folder")
        path = os.path.join(folder, shard)
        if not os.path.exists(path):
            raise UserError(f"{index} names {shard}, which is not in the folder")
        tensors.update(read_safetensors(path)[0])
    return tensors


def state_dict_from_hf(tensors, cfg, folder, reference):
    """HF names and rotate-half q/k -> the GPT's state dict (fp32), checking every name
    and shape against `reference` (the state dict of a GPT built from the config)."""
    biases = [n for n in tensors if n.endswith(".bias")]
    if biases:
        raise UserError(f"{folder}: the weights have biases ({biases[0]}, ...): the GPT has none")
    out = {}
    for gpt_name, hf_name in hf_names(cfg):
        if hf_name not in tensors:
            raise UserError(f"{folder}: the weights lack {hf_name}")
        w = tensors[hf_name]
        if tuple(w.shape) != tuple(reference[gpt_name].shape):
            raise UserError(f"{folder}: {hf_name} has shape {list(w.shape)}, config.json "
                            f"implies {list(reference[gpt_name].shape)}")
        heads = _rope_permutation(gpt_name, cfg)
        out[gpt_name] = (half_to_interleaved(w, heads) if heads else w).float().contiguous()
    if cfg.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    known = {h for _, h in hf_names(cfg)} | {"lm_head.weight"}
    extra = [n for n in tensors if n not in known and not n.endswith("rotary_emb.inv_freq")]
    if extra:
        raise UserError(f"{folder}: unexpected tensors ({extra[0]}, ...): not a plain Llama")
    return out


def load_folder(folder, device="cpu", need_tokenizer=True):
    """A Hugging Face Llama folder -> (GPT, checkpoint dict shaped like train.py's)."""
    config_path = os.path.join(folder, "config.json")
    if not os.path.exists(config_path):
        raise UserError(f"{folder} is a folder without config.json: not a Hugging Face "
                        "model folder (nor a checkpoint file)")
    cfg = gpt_config_from_hf(_read_json(config_path), config_path)
    tok_path = os.path.join(folder, "tokenizer.json")
    tokenizer = None
    if os.path.exists(tok_path):         # checked first: it is cheap, the weights are not
        tokenizer = tokenizer_state_from_json(_read_json(tok_path), tok_path)
        top = max([*tokenizer["mergeable_ranks"].values(), *tokenizer["special_tokens"].values()])
        if top >= cfg.vocab_size:
            raise UserError(f"{tok_path} has token id {top}, beyond the model's vocab_size "
                            f"{cfg.vocab_size}")
    elif need_tokenizer:
        raise UserError(f"{folder} has no tokenizer.json: the scripts here need the tokenizer "
                        "(byte-level BPE) next to the weights")
    model = GPT(cfg, seed=None)
    state = state_dict_from_hf(_read_weights(folder), cfg, folder, model.state_dict())
    model.load_state_dict(state)
    # like a native checkpoint, ckpt["model"] is a copy: changing the model leaves it alone
    state = {k: v.to(device) for k, v in state.items()}
    ckpt = {"config": asdict(cfg), "model": state, "format": "hf-llama", "source": folder}
    if tokenizer is not None:
        ckpt["tokenizer"] = tokenizer
    return model.to(device), ckpt
