# Tests for serving/structured.py (constrained decoding): each automaton accepts exactly
# its language (JSON against json.loads and an independent schema checker written here;
# regexes against Python's re.fullmatch; UTF-8 against bytes.decode); the trie mask equals
# the token-by-token mask; sampled outputs are 100% valid; greedy equals a brute-force
# greedy; the sampled distribution is the model's renormalised at each step (chi-square),
# which is NOT the model conditioned on the whole output; unsatisfiable and hostile specs
# fail in one line at compile time, never hang; the mask cache hits and stays bounded.
import hashlib
import json
import random
import re

import numpy as np
import pytest
import torch

from core import data
from harness import http_json, served
from core.errors import UserError
from model import GPT, get_config
from serve import Engine
from serving import structured as st
from serving.requests import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")   # conftest.py: tiny tensors, one thread

ALPHABET = "ab\"\\/{}[]:,.-+0123456789eEtrufalsnxyz_ é日🙂\n\t\x01"
NO_SPACE = "".join(c for c in ALPHABET if not c.isspace())   # mutations add no whitespace


@pytest.fixture(scope="module")
def bpe():
    """A 400-token byte-level BPE trained in ~0.1 s on Python source and JSON samples with
    non-ASCII text, so tokens like '":', '"}' and pieces of multi-byte characters exist."""
    rng = random.Random(0)
    with open(json.__file__.replace("__init__.py", "encoder.py"), encoding="utf-8") as f:
        text = f.read()[:20000]
    samples = " ".join(json.dumps({"name": "Zoë 日本 🙂", "age": rng.randint(0, 99), "ok": True,
                                   "tags": ["a", "b"], "x": None, "v": [1.5e3, -2]},
                                  ensure_ascii=rng.random() < 0.3) for _ in range(60))
    enc = data.make_encoding(data.train_bpe([text, samples], 400))
    return st.Vocabulary.from_encoding(enc)


@pytest.fixture(scope="module")
def byte_vocab():
    """The 256 single bytes and <|endoftext|> (id 256)."""
    return st.Vocabulary.from_encoding(data.make_encoding({bytes([i]): i for i in range(256)}))


def matches(constraint, raw):
    """Feed bytes to the automaton: does it accept them whole?"""
    state = constraint.start()
    for byte in raw:
        state = constraint.automaton.step(state, byte)
        if state is None:
            return False
    return constraint.automaton.accepts(state)


def random_text(rng, n=6):
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, n)))


def mutations(text, rng, n):
    """Deleted, inserted, replaced characters (never whitespace outside what was there)."""
    out = []
    for _ in range(n):
        i, c = rng.randrange(len(text) + 1), rng.choice(NO_SPACE)
        out.append(rng.choice([text[:i] + text[i + 1:], text[:i] + c + text[i:],
                               text[:i] + c + text[i + 1:]]))
    return out


# ----------------------------------------------------------------------------------------
# The independent checker: a JSON-schema-subset validator over the PARSED value, sharing no
# code with the compiler. 1.0 is not an integer (stricter than draft 2020-12: the
# generator never writes one); an absent additionalProperties counts as false.

def validate(value, schema, path="$"):
    problems, types = [], schema.get("type")
    if "const" in schema and not json_equal(value, schema["const"]):
        problems.append(f"{path}: not the const")
    if "enum" in schema and not any(json_equal(value, e) for e in schema["enum"]):
        problems.append(f"{path}: not in the enum")
    if "anyOf" in schema and all(validate(value, s, path) for s in schema["anyOf"]):
        problems.append(f"{path}: no anyOf branch")
    types = [types] if isinstance(types, str) else types or []
    if types and not any(is_type(value, t) for t in types):
        return problems + [f"{path}: {type(value).__name__} is not {types}"]
    if isinstance(value, dict) and ("properties" in schema or "object" in types):
        props = schema.get("properties", {})
        problems += [f"{path}: {k} missing" for k in schema.get("required", []) if k not in value]
        problems += [f"{path}: extra {k}" for k in value if k not in props]
        for k in props.keys() & value.keys():
            problems += validate(value[k], props[k], f"{path}.{k}")
    if isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            problems += validate(v, schema["items"], f"{path}[{i}]")
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1e9):
            problems.append(f"{path}: {len(value)} items")
    return problems


def is_type(value, name):
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return {"object": isinstance(value, dict), "array": isinstance(value, list),
            "string": isinstance(value, str), "boolean": isinstance(value, bool),
            "null": value is None, "number": number,
            "integer": number and isinstance(value, int)}[name]


def json_equal(a, b):
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b and (type(a) is type(b) or all(isinstance(x, (int, float)) for x in (a, b)))


def in_schema_order(value, schema):
    """Keys come in the order of 'properties' (the generator's rule), at every level."""
    if "anyOf" in schema:
        return any(not validate(value, s) and in_schema_order(value, s) for s in schema["anyOf"])
    if isinstance(value, dict) and "properties" in schema:
        props = schema["properties"]
        return list(value) == [k for k in props if k in value] and \
            all(in_schema_order(v, props[k]) for k, v in value.items() if k in props)
    if isinstance(value, list) and "items" in schema:
        return all(in_schema_order(v, schema["items"]) for v in value)
    return True


def test_validator_itself():
    s = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": [1, "x"]}},
         "required": ["a"]}
    assert validate({"a": 1, "b": 1.0}, s) == []
    assert validate({"a": 1.0}, s) and validate({"b": 1}, s) and validate({"a": 1, "c": 2}, s)
    assert validate({"a": True}, s) and validate({"a": 1, "b": True}, s)
    assert validate([1, 2], {"type": "array", "items": {"type": "integer"}, "maxItems": 1})


# ----------------------------------------------------------------------------------------
# UTF-8: the byte-level automata accept exactly the valid encodings

def test_utf8_sequences_are_exactly_the_encodings(byte_vocab):
    dot = st.Compiler(byte_vocab).regex(".*")          # any valid UTF-8 without '\n'
    rng = random.Random(1)
    edges = [0x7F, 0x80, 0x7FF, 0x800, 0xD7FF, 0xE000, 0xFFFF, 0x10000, 0x10FFFF]
    points = [c for c in edges + [rng.randrange(0x110000) for _ in range(3000)]
              if not 0xD800 <= c <= 0xDFFF and c != 10]
    for cp in points:
        assert matches(dot, chr(cp).encode()), hex(cp)
    # every 1- and 2-byte string, and random 3-5-byte ones: accepted iff they decode
    tries = [bytes([a, b]) for a in range(256) for b in range(256)]
    tries += [bytes(rng.choice(range(0x80, 0x100)) if rng.random() < 0.7 else rng.randrange(256)
                    for _ in range(rng.randint(3, 5))) for _ in range(4000)]
    tries += [chr(c).encode()[:k] for c in points[:500] for k in (1, 2, 3)]   # cut short
    tries += [b"\xed\xa0\x80", b"\xc0\x80", b"\xe0\x80\x80", b"\xf4\x90\x80\x80"]  # surrogate,
    tries += [b"\xf0\x80\x80\x80", b"\xf5\x80\x80\x80", b"\xef\xbf\xbf"]  # overlong, > U+10FFFF
    accepted = 0
    for raw in tries:
        try:
            ok = "\n" not in raw.decode("utf-8")
        except UnicodeDecodeError:
            ok = False
        assert matches(dot, raw) == ok, raw
        accepted += ok
    assert 2000 < accepted < len(tries) - 20000        # both sides well exercised


# ----------------------------------------------------------------------------------------
# Regex: the automaton against re.fullmatch (re.ASCII: \d \w \s are ASCII classes)

PATTERNS = [r"\d{4}-\d{2}-\d{2}", r"[a-z0-9_]+@[a-z]+\.(com|org)", r"(ab|a)*b?c{2,3}",
            r'"[^"]*"', r"\w+\s\W?", r"[^a-cé]{1,3}x", r".{0,3}", r"(?:\+|-)?\d+(\.\d*)?",
            r"[à-ÿ]+|日本|🙂+", r"a{,2}b{2,}c{0}", r"x\x41\u00e9\.\\", r"[]a]+[a-]?",
            r"\S\D\W", r"^(?:ab)$", r"a{}", r"(a|)+z?", r"[\d\s]*[^\w\s]"]


def random_walk(c, rng, stop=0.3, limit=10):
    """A random string of the DFA's language: random live bytes for a while, then the
    shortest way to an accepting state (breadth first), so every walk ends accepted."""
    state, out = c.start(), []
    while len(out) < limit and not (c.automaton.accepts(state) and rng.random() < stop):
        live = [b for b in range(256) if c.automaton.table[state][b] >= 0]
        if not live:
            break
        out.append(rng.choice(live))
        state = c.automaton.table[state][out[-1]]
    paths, todo = {state: b""}, [state]
    while not c.automaton.accepts(todo[0]):
        s = todo.pop(0)
        for b in range(256):
            t = c.automaton.table[s][b]
            if t >= 0 and t not in paths:
                paths[t] = paths[s] + bytes([b])
                todo.append(t)
    return bytes(out) + paths[todo[0]]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_regex_agrees_with_python_re(pattern, byte_vocab):
    c = st.Compiler(byte_vocab).regex(pattern)
    rng = random.Random(pattern)
    texts = [random_walk(c, rng).decode("utf-8") for _ in range(60)]   # valid UTF-8 always
    texts += [m for t in texts for m in mutations(t, rng, 3)]
    texts += [random_text(rng) for _ in range(200)]
    agree = [matches(c, t.encode()) == (re.fullmatch(pattern, t, re.ASCII) is not None)
             for t in texts]
    assert all(agree), [t for t, ok in zip(texts, agree) if not ok][:5]
    assert sum(matches(c, t.encode()) for t in texts) >= 30


# ----------------------------------------------------------------------------------------
# JSON: json_object against json.loads; schemas against the checker above

def random_json(rng, depth=0):
    kind = rng.choice(["obj", "arr", "str", "num", "lit"] if depth < 4 else ["str", "num", "lit"])
    if kind == "obj":
        return {random_text(rng): random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    if kind == "arr":
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "num":
        return rng.choice([0, -7, 12345678901234567890, 0.5, -1.25e-7, 3e100])
    return random_text(rng) if kind == "str" else rng.choice([True, False, None])


def spellings(value):
    """Every spelling the whitespace policy allows: compact, a space after ':' and/or ',',
    non-ASCII raw or escaped."""
    return [json.dumps(value, separators=seps, ensure_ascii=ascii_only)
            for seps in ((",", ":"), (", ", ": "), (",", ": "), (", ", ":"))
            for ascii_only in (True, False)]


def nesting(v):
    inner = v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()
    return (1 + max(map(nesting, inner), default=0)) if isinstance(v, (dict, list)) else 0


def is_json_object(raw):
    try:
        v = json.loads(raw.decode("utf-8"))
    except ValueError:                               # UnicodeDecodeError included
        return False
    return isinstance(v, dict) and nesting(v) <= st.MAX_DEPTH


def test_json_object_agrees_with_json_loads(byte_vocab):
    c, rng = st.Compiler(byte_vocab).json_object(), random.Random(2)
    values = [{"k": random_json(rng)} for _ in range(60)] + [{}, {"": []}, {"a": {"b": {}}}]
    texts = [t for v in values for t in spellings(v)]
    assert all(matches(c, t.encode()) for t in texts)
    tried = [m for t in texts[::4] for m in mutations(t, rng, 4)]
    raws = [t.encode() for t in tried] + [(t.encode()[:i] + t.encode()[i + 1:])
                                          for t in texts[::8] for i in range(0, len(t), 3)]
    agree = [matches(c, raw) == is_json_object(raw) for raw in raws]
    assert all(agree), [r for r, ok in zip(raws, agree) if not ok][:5]
    assert 50 < sum(map(is_json_object, raws)) < len(raws) - 500
    # the whitespace policy, the top level, nesting at the limit
    for bad in ['{ "a":1}', '{"a":  1}', '{"a":1,  "b":2}', '{"a" :1}', '{"a":1 }', '{"a":1}\n',
                '[1]', '"x"', '[1, 2]', '{"a":[1,  2]}',
                '{"a":1,}', '{"a":01}', '{"a":1.}', '{"a":tru}', '{"a":"\x01"}', '{"a":NaN}']:
        assert not matches(c, bad.encode()), bad
    assert matches(c, ('{"a":' + "[" * 31 + "]" * 31 + "}").encode())
    assert not matches(c, ('{"a":' + "[" * 32 + "]" * 32 + "}").encode())


SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "zip": {"type": "string"}},
                    "required": ["city"]}},
     "required": ["name", "age"]},
    {"type": "object", "required": ["points"], "additionalProperties": False,
     "title": "annotations pass", "properties": {"points": {
         "type": "array", "minItems": 1, "maxItems": 3, "items": {
             "type": "object", "required": ["x", "y"],
             "properties": {"x": {"type": "number"}, "y": {"type": "number"}}}}}},
    {"type": "object", "required": ["kind"], "properties": {
        "id": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "flag": {"type": ["boolean", "null"]}, "kind": {"const": "v1"},
        "ratio": {"enum": [0.5, 1, "x", True, None]}}},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
                                      "c": {"type": "integer"}}},
]


def instance(schema, rng):
    """A random valid value, keys in the schema's order (the generator's rule)."""
    if "const" in schema or "enum" in schema:
        return schema["const"] if "const" in schema else rng.choice(schema["enum"])
    if "anyOf" in schema:
        return instance(rng.choice(schema["anyOf"]), rng)
    kind = schema["type"] if isinstance(schema["type"], str) else rng.choice(schema["type"])
    if kind == "object":
        return {k: instance(s, rng) for k, s in schema.get("properties", {}).items()
                if k in schema.get("required", []) or rng.random() < 0.5}
    if kind == "array":
        low = schema.get("minItems", 0)
        return [instance(schema["items"], rng)
                for _ in range(rng.randint(low, schema.get("maxItems", low + 3)))]
    return {"string": lambda: random_text(rng), "integer": lambda: rng.randint(-999, 999),
            "number": lambda: rng.choice([0, -3, 2.5, -1e-9, 6.02e23]),
            "boolean": lambda: rng.random() < 0.5, "null": lambda: None}[kind]()


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_json_schema_agrees_with_the_checker(index, byte_vocab):
    schema, rng = SCHEMAS[index], random.Random(index)
    c = st.Compiler(byte_vocab).json_schema(schema)
    values = [instance(schema, rng) for _ in range(40)]
    assert all(validate(v, schema) == [] for v in values)
    texts = [t for v in values for t in spellings(v)]
    assert all(matches(c, t.encode()) for t in texts)
    # soundness: whatever the automaton accepts parses, validates and keeps the order
    accepted = 0
    for text in (m for t in texts[::3] for m in mutations(t, rng, 6)):
        if matches(c, text.encode()):
            value = json.loads(text)
            assert validate(value, schema) == [] and in_schema_order(value, schema), text
            accepted += 1
    assert accepted > 5


def test_json_schema_refuses_what_the_schema_forbids(byte_vocab):
    people, optional = [st.Compiler(byte_vocab).json_schema(SCHEMAS[i]) for i in (0, 3)]
    assert not matches(people, b'{"age":1,"name":"x"}')       # valid, but not in order
    for bad in ['{"name":"x"}', '{"name":"x","age":1,"extra":1}',
                '{"name":"x","age":1.0}', '{"name":"x","age":1,"role":"root"}',
                '{"name":"x","age":1,"tags":["a","b","c","d"]}',
                '{"name":"x","age":1,"address":{}}']:
        assert not matches(people, bad.encode()) and validate(json.loads(bad), SCHEMAS[0]), bad
    for text, ok in [("{}", True), ('{"b":1}', True), ('{"a":1, "c":2}', True),
                     ('{,"b":1}', False), ('{"b":1,}', False), ('{"c":1,"a":2}', False),
                     ('{"a":1 ,"b":2}', False),
                     ('{"a": 1,  "b":2}', False), ('{"a":1, "b": 2, "c": 3}', True)]:
        assert matches(optional, text.encode()) == ok, text


# ----------------------------------------------------------------------------------------
# Masks: the trie walk equals the token-by-token reference

def constraints(vocab):
    comp = st.Compiler(vocab)
    return [comp.json_object(), comp.json_schema(SCHEMAS[0]), comp.json_schema(SCHEMAS[2]),
            comp.regex(r"[a-zé日]{1,5}( \d+)?"), comp.choice(["yes", "no", "maybe", "日本"])]


def reference_mask(c, state):
    """The slow mask: each token's bytes stepped through the automaton on their own."""
    mask = torch.zeros(c.vocab.size, dtype=torch.bool)
    for tok, spelled in enumerate(c.vocab.token_bytes):
        s = state if spelled and state != st.DONE else None
        for byte in spelled or b"":
            s = c.automaton.step(s, byte) if s is not None else None
        mask[tok] = s is not None
    mask[c.vocab.eos_id] = state != st.DONE and c.automaton.accepts(state)
    return mask


def test_trie_mask_equals_reference(bpe):
    """Every state of each DFA; json_object's states visited by a random model."""
    checked = 0
    for c in constraints(bpe):
        states = st.visited_states(c, outputs=12, max_tokens=30, seed=3)
        if isinstance(c.automaton, st.DFA):
            states = list(range(len(c.automaton.table)))
        steps = c.trie_steps
        for s in states + [st.DONE]:
            assert torch.equal(c.trie_mask(s), reference_mask(c, s)), s
        checked += len(states)
        assert c.trie_steps - steps < len(states) * bpe.total_bytes   # prefixes walked once
    assert checked > 300


# ----------------------------------------------------------------------------------------
# Sampling under the mask: every output valid; greedy equals brute force

def biased_model(vocab, seed):
    """Random logits, with tokens that close something ('"', '}', ']', EOS) favoured so
    that outputs end well before the cap."""
    g = torch.Generator().manual_seed(seed)
    pad = [False] * (vocab.size - len(vocab.token_bytes))
    closers = torch.tensor([b is not None and any(x in b for x in b'"}]')
                            for b in vocab.token_bytes] + pad)
    closers[vocab.eos_id] = True
    return lambda out: torch.randn(vocab.size, generator=g) * 2 + 3.0 * closers


def test_sampled_outputs_are_all_valid(bpe):
    enc_text = lambda ids: b"".join(bpe.token_bytes[t] for t in ids).decode("utf-8")
    comp = st.Compiler(bpe)
    checks = [(comp.json_object(), lambda t: isinstance(json.loads(t), dict))]
    checks += [(comp.json_schema(s), lambda t, s=s: validate(json.loads(t), s) == [])
               for s in SCHEMAS]
    checks += [(comp.regex(p), lambda t, p=p: re.fullmatch(p, t, re.ASCII) is not None)
               for p in (r"\d{4}-\d{2}-\d{2}", r"[a-zé日 ]{1,8}\.")]
    checks += [(comp.choice(["yes", "no", "日本"]), lambda t: t in ("yes", "no", "日本"))]
    texts = []
    for k, (c, ok) in enumerate(checks):
        g = torch.Generator().manual_seed(k)
        for i in range(12):
            ids, finished = st.generate_constrained(c, biased_model(bpe, 100 * k + i), 300, g)
            assert finished, (k, enc_text(ids)[:80])
            assert ok(enc_text(ids)), enc_text(ids)
            texts.append(enc_text(ids))
    assert len(texts) == 12 * len(checks) and len(set(texts)) > 60     # 100% valid, varied
    objects = [json.loads(t) for t in texts[:12]]                      # json_object's
    assert max(map(nesting, objects)) >= 2 and sum(map(len, texts)) / len(texts) > 15


def test_greedy_equals_brute_force_greedy(bpe):
    for k, c in enumerate(constraints(bpe)):
        model = lambda out: torch.randn(bpe.size, generator=torch.Generator().manual_seed(
            int(hashlib.sha256(repr((k, out)).encode()).hexdigest()[:8], 16)))
        fast, _ = st.generate_constrained(c, model, 25, greedy=True)
        state, slow = c.start(), []
        for _ in range(25):                           # the mask recomputed token by token
            tok = int(st.mask_logits(model(slow), reference_mask(c, state)).argmax())
            state = c.advance(state, tok)
            if state == st.DONE:
                break
            slow.append(tok)
        assert fast == slow and len(fast) > 0


# ----------------------------------------------------------------------------------------
# The distribution: renormalised at each step (chi-square), not conditioned on the whole

TOKENS = [b"a", b"b", b"ab", b"ba", b"c", b"x"]
EOS = len(TOKENS)


def toy_logits(prefix):
    """A fixed random 'model' over the toy vocabulary: logits depend on the prefix."""
    seed = int(hashlib.sha256(repr(tuple(prefix)).encode()).hexdigest()[:8], 16)
    return torch.randn(EOS + 1, generator=torch.Generator().manual_seed(seed)) * 1.5


def exact(c, prefix=(), state=None, local=1.0, model=1.0):
    """{complete token sequence: (p renormalised per step, p of the unconstrained model)}."""
    state = c.start() if state is None else state
    p, allowed = toy_logits(prefix).double().softmax(-1), c.allowed(state).double()
    q = p * allowed / (p * allowed).sum()
    out = {}
    for tok in map(int, allowed.nonzero()):
        nxt = c.advance(state, tok)
        if nxt == st.DONE:
            out[prefix + (tok,)] = (local * float(q[tok]), model * float(p[tok]))
        else:
            out.update(exact(c, prefix + (tok,), nxt, local * float(q[tok]),
                             model * float(p[tok])))
    return out


def chi_square(expected, counts):
    """Pearson's statistic, cells expected < 5 pooled (as tests/test_spec_decode.py does);
    -> (statistic, critical value at p = 1e-4, Wilson-Hilferty)."""
    e, o = np.array(expected), np.array(counts, dtype=float)
    small = e < 5
    e, o = np.append(e[~small], e[small].sum()), np.append(o[~small], o[small].sum())
    stat, df = ((o - e) ** 2 / e).sum(), len(e) - 1
    return stat, df * (1 - 2 / (9 * df) + 3.719 * (2 / (9 * df)) ** 0.5) ** 3


def test_distribution_is_the_model_renormalised_per_step():
    c = st.Compiler(st.Vocabulary(TOKENS, EOS)).regex(r"[ab]{1,3}c?")
    table = exact(c)
    seqs = list(table)
    local = np.array([table[s][0] for s in seqs])
    conditioned = np.array([table[s][1] for s in seqs])
    conditioned /= conditioned.sum()                  # the model given that it matched
    assert len(seqs) > 30 and abs(local.sum() - 1) < 1e-9
    assert 0.5 * np.abs(local - conditioned).sum() > 0.1   # the two really differ
    g, n, counts = torch.Generator().manual_seed(0), 3000, dict.fromkeys(seqs, 0)
    for _ in range(n):
        out, finished = st.generate_constrained(c, toy_logits, 10, g)
        counts[tuple(out) + (EOS,)] += 1
    observed = [counts[s] for s in seqs]
    stat, crit = chi_square(local * n, observed)
    assert stat < crit, (stat, crit)
    stat, crit = chi_square(conditioned * n, observed)
    assert stat > crit, ("masking is not conditioning", stat, crit)


# ----------------------------------------------------------------------------------------
# Unsatisfiable and hostile specs: one line at compile time (or dead at start), no hang

def one_line_error(fn, *words):
    with pytest.raises(UserError) as e:
        fn()
    message = str(e.value)
    assert "\n" not in message and all(w in message for w in words), message
    return message


def test_unsatisfiable_constraints(byte_vocab):
    comp = st.Compiler(byte_vocab)
    one_line_error(lambda: comp.regex(r"[^\x00-\U0010ffff]"), "matches nothing")
    one_line_error(lambda: comp.regex(r"a[^\s\S]"), "matches nothing")
    one_line_error(lambda: comp.regex("[]"), "unterminated")
    no_z = st.Vocabulary([bytes([i]) for i in range(256) if i != ord("z")] + [None], 255)
    one_line_error(lambda: st.Compiler(no_z).regex("az"), "matches nothing")
    # every byte exists, but no token sequence spells "a" alone: dead at the start
    pairs = st.Compiler(st.Vocabulary([b"ab", b"c"], 2))
    c = pairs.regex("a")
    assert c.dead(c.start())
    one_line_error(lambda: st.generate_constrained(c, lambda out: torch.zeros(3), 5), "no token")


HOSTILE = [({"type": "object", "$ref": "#/x"}, "$ref"),
           ({"type": "object", "patternProperties": {}}, "patternProperties"),
           ({"type": "string", "format": "date"}, "format"),
           ({"oneOf": [{"type": "string"}]}, "oneOf"), ({"allOf": []}, "allOf"),
           ({"type": "string", "pattern": "a"}, "pattern"),
           ({"type": "number", "minimum": 0}, "minimum"),
           ({"type": "string", "items": {}}, "items"),
           ({"type": "object", "additionalProperties": True}, "additionalProperties"),
           ({"type": "array"}, "items"), ({"type": "array", "items": [{}]}, "items"),
           ({"type": "integer", "enum": list(range(5000))}, "MAX_ENUM"),
           ({"type": "date"}, "type"), ({}, "without 'type'"),
           ({"type": "object", "required": ["a"]}, "required"),
           ({"type": "array", "items": {"type": "null"}, "maxItems": 10 ** 6}, "MAX_REPEAT"),
           ({"type": "object", "properties": {"a": True}}, "boolean schemas"),
           ({"enum": [[1]]}, "enum values"), ({"enum": [float("nan")]}, "not JSON text"),
           ({"type": "string", "description": "x" * 2 ** 20}, "MAX_SCHEMA_BYTES")]


@pytest.mark.parametrize("schema, word", HOSTILE, ids=[w for _, w in HOSTILE])
def test_hostile_schemas_fail_in_one_line(schema, word, byte_vocab):
    one_line_error(lambda: st.Compiler(byte_vocab).json_schema(schema), word)


def test_hostile_nesting_and_inputs(byte_vocab):
    comp = st.Compiler(byte_vocab)
    deep = {"type": "null"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}}
    one_line_error(lambda: comp.json_schema(deep), "MAX_DEPTH")
    for _ in range(2000):                              # past json.dumps's own recursion limit
        deep = {"type": "object", "properties": {"a": deep}}
    one_line_error(lambda: comp.json_schema(deep), "MAX_DEPTH")
    for bad in ([], "x", True, None):
        one_line_error(lambda: comp.json_schema(bad), "must be an object")
    for pattern, word in [(r"(a)\1", "\\1"), ("(?=a)", "(?"), (r"\bx", "\\b"), ("a**", "second"),
                          ("a{300}", "MAX_REPEAT"), ("x" * 5000, "MAX_PATTERN"),
                          ("(" * 40 + ")" * 40, "MAX_DEPTH"), ("a)", "unbalanced"),
                          ("*a", "nothing to repeat"), ("a^b", "anchor"), (r"[z-a]", "range"),
                          (r"\x4", "escape"), ("(?P<n>a)", "(?"), ("\ud800", "surrogate"),
                          (r"(a|b)*a(a|b){13}", "MAX_DFA_STATES"), (3, "string")]:
        one_line_error(lambda: comp.regex(pattern), word)
    one_line_error(lambda: comp.choice([]), "guided_choice")
    one_line_error(lambda: comp.choice(["x"] * 300), "MAX_ENUM")
    one_line_error(lambda: comp.choice(["\ud800"]), "surrogate")


# ----------------------------------------------------------------------------------------
# The cache, the API's edges, and the report

def test_mask_cache_hits_and_stays_bounded(bpe):
    c = st.Constraint(st.JsonObjectAutomaton(bpe.spelled), bpe, cache_size=5)
    first = c.allowed(c.start())
    assert (c.hits, c.misses) == (0, 1) and c.allowed(c.start()) is first and c.hits == 1
    states = st.visited_states(c, outputs=6, max_tokens=30, seed=4)
    assert len(states) > 5
    for s in states:
        c.allowed(s)
        assert len(c.cache) <= 5
    misses = c.misses
    assert torch.equal(c.allowed(states[0]), reference_mask(c, states[0]))  # evicted: redone
    assert c.misses == misses + 1
    comp = st.Compiler(bpe)
    assert comp.json_schema(SCHEMAS[1]) is comp.json_schema(json.loads(json.dumps(SCHEMAS[1])))


def test_eos_and_advance(bpe):
    c = st.Compiler(bpe).choice(["no"])
    mask = c.allowed(c.start())
    assert not mask[bpe.eos_id] and mask.sum() >= 1
    state = c.start()
    for byte in b"no":                                 # single-byte tokens: ids = bytes here
        state = c.advance(state, byte)
    assert torch.equal(c.allowed(state), torch.arange(bpe.size) == bpe.eos_id)
    assert c.advance(state, bpe.eos_id) == st.DONE and not c.dead(st.DONE)
    for bad in (ord("x"), -1, bpe.size):
        with pytest.raises(ValueError):
            c.advance(c.start(), bad)
    padded = st.Vocabulary.from_encoding(data.make_encoding({bytes([i]): i for i in range(256)}),
                                         size=300)             # a model padding its vocabulary
    assert st.Compiler(padded).json_object().allowed(("", st.START, 0)).shape == (300,)


def test_report_runs(text_file, capsys):
    st.main(["--data", text_file, "--vocab-size", "300", "--outputs", "2", "--max-tokens", "12"])
    out = capsys.readouterr().out
    for name in ("json_object", "json_schema", "regex", "choice", "cache"):
        assert name in out, out
    one_line_error(lambda: st.main(["--outpts", "3"]), "did you mean --outputs")


# ----------------------------------------------------------------------------------------
# In the engine (serve.py) and behind the HTTP API: response_format and vLLM's guided_*

SCHEMA = {"type": "object", "required": ["ok", "pick"], "additionalProperties": False,
          "properties": {"ok": {"type": "boolean"}, "pick": {"enum": ["red", "green", "blue"]},
                         "n": {"type": "integer"}, "tags": {"type": "array", "maxItems": 2,
                                                            "items": {"type": "boolean"}}}}


@pytest.fixture(scope="module")
def engine_world():
    """A tiny model over the byte-level tokenizer (257 tokens in a 512-wide head: the
    padding ids are never allowed), and a greedy run's logits reference."""
    enc = data.make_encoding({bytes([i]): i for i in range(256)})
    model = GPT(get_config("tiny", block_size=128), seed=3).eval()
    return enc, model


def test_engine_samples_only_valid_outputs_under_preemption_and_prefix_caching(engine_world):
    """32 sampled requests (n-style: 4 prompts x 8 seeds) under a json_schema, through a
    pool small enough to preempt, prefix caching on: every finished output parses and
    passes the independent checker; every one finishes by EOS (the automaton's accept)
    or by max_tokens."""
    enc, model = engine_world
    eng = Engine(model, enc, block_size=4, num_blocks=32, max_num_seqs=16)
    prompts = ["Answer: ", "JSON please: ", "Answer: x", "{"]
    seqs = [eng.add_request(p, SamplingParams(max_tokens=48, temperature=1.0, seed=s,
                                              structured={"type": "json_schema",
                                                          "schema": SCHEMA}))
            for p in prompts for s in range(8)]
    while eng.has_work():
        eng.step()
    finished = [s for s in seqs if s.finish_reason == "stop"]
    assert len(finished) >= 24, [(s.finish_reason, s.error) for s in seqs]
    assert eng.stats["preemptions"] > 0 and eng.stats["cached_tokens"] > 0
    for s in finished:
        value = json.loads(bytes(s.output_ids[:-1]).decode())       # without the EOS
        validate(value, SCHEMA)
        assert in_schema_order(value, SCHEMA)


def test_engine_greedy_equals_the_slow_masked_loop(engine_world):
    """Greedy through the engine (batched, paged KV) == st.generate_constrained over the
    model's full forward each step, the mask applied to the logits computed from scratch."""
    enc, model = engine_world
    eng = Engine(model, enc, block_size=4, num_blocks=64)
    specs = [{"type": "json_object"}, {"type": "regex", "pattern": r"[a-c]{2,5}-\d\d"},
             {"type": "choice", "choices": ["yes", "no", "maybe"]},
             {"type": "json_schema", "schema": SCHEMA}]
    prompt = enc.encode_ordinary("Q: ")
    seqs = [eng.add_request(prompt, SamplingParams(max_tokens=30, temperature=0,
                                                   structured=spec)) for spec in specs]
    while eng.has_work():
        eng.step()
    for spec, seq in zip(specs, seqs):
        c = eng._constraint(spec)
        with torch.no_grad():
            want, done = st.generate_constrained(
                c, lambda out: model(torch.tensor([prompt + out]))[0][0, -1], 30, greedy=True)
        got = seq.output_ids[:-1] if seq.finish_reason == "stop" else seq.output_ids
        assert got == want and done == (seq.finish_reason == "stop"), spec


def test_unsatisfiable_and_unsupported_specs_are_refused_at_the_door(engine_world):
    enc, model = engine_world
    eng = Engine(model, enc, block_size=4, num_blocks=64)
    for spec, words in [({"type": "regex", "pattern": "[]"}, "unterminated character set"),
                        ({"type": "json_schema", "schema": {"$ref": "#/x"}}, "$ref"),
                        ({"type": "choice", "choices": []}, "guided_choice"),
                        ({"type": "xml"}, "structured must be")]:
        with pytest.raises(UserError, match=re.escape(words)):
            eng.add_request("x", SamplingParams(max_tokens=4, structured=spec))
    with pytest.raises(UserError, match="ignore_eos"):
        eng.add_request("x", SamplingParams(max_tokens=4, ignore_eos=True,
                                            structured={"type": "json_object"}))
    assert not eng.has_work()


def test_api_response_format_and_guided_fields(engine_world):
    """Through HTTP: response_format json_schema on chat gives content that parses and
    validates; json_object; guided_choice and guided_regex on completions; an unsupported
    keyword is a 400 naming it; two constraints at once are a 400; the server goes on."""
    enc, model = engine_world
    eng = Engine(model, enc, block_size=8, num_blocks=128)
    with served(eng, enc, "tiny") as srv:
        call = lambda path, body: http_json(srv, "POST", path, body)
        chat = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=60,
                    temperature=0)
        status, out = call("/v1/chat/completions", dict(chat, response_format={
            "type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}))
        assert status == 200 and out["choices"][0]["finish_reason"] == "stop", out
        validate(json.loads(out["choices"][0]["message"]["content"]), SCHEMA)
        status, out = call("/v1/chat/completions", dict(chat, response_format={
            "type": "json_object"}))
        assert status == 200 and isinstance(json.loads(out["choices"][0]["message"]["content"]
                                                        if out["choices"][0]["finish_reason"]
                                                        == "stop" else "{}"), dict)
        comp = dict(model="tiny", prompt="Pick: ", max_tokens=20, temperature=0)
        status, out = call("/v1/completions", dict(comp, guided_choice=["alpha", "beta"]))
        assert status == 200 and out["choices"][0]["text"] in ("alpha", "beta")
        status, out = call("/v1/completions", dict(comp, guided_regex=r"\d{3}-[ab]"))
        assert status == 200 and re.fullmatch(r"\d{3}-[ab]", out["choices"][0]["text"])
        status, out = call("/v1/completions", dict(comp, guided_json={"type": "object",
                                                                      "patternProperties": {}}))
        assert status == 400 and "patternProperties" in out["error"]["message"]
        status, out = call("/v1/completions", dict(comp, guided_regex="a", guided_choice=["a"]))
        assert status == 400 and out["error"]["param"] == "guided_choice"
        # with n, log-probs, a stop string and penalties: every choice is still one of them
        status, out = call("/v1/completions", dict(comp, n=3, temperature=1.0, seed=5,
                                                   logprobs=2, stop=["zz"], presence_penalty=1.5,
                                                   guided_choice=["alpha", "beta", "gamma"]))
        assert status == 200 and len(out["choices"]) == 3
        for c in out["choices"]:
            assert c["text"] in ("alpha", "beta", "gamma") and c["finish_reason"] == "stop"
            assert len(c["logprobs"]["tokens"]) == len(c["logprobs"]["token_logprobs"]) > 0
        status, out = call("/v1/completions", comp)           # still serving
        assert status == 200


# ----------------------------------------------------------------------------------------
# Tool calls on chat completions: tools in the prompt, the call constrained, OpenAI's shapes

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "required": ["city"], "additionalProperties": False,
                   "properties": {"city": {"enum": ["Paris", "Lima"]},
                                  "unit": {"enum": ["C", "F"]}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "required": ["zone"],
                                       "properties": {"zone": {"type": "integer"}}}}}


@pytest.fixture(scope="module")
def tool_server(engine_world):
    """The byte-level tokenizer spends a token per byte of the tools' listing: a tiny
    model with a 1024-token context."""
    enc, _ = engine_world
    model = GPT(get_config("tiny", block_size=1024), seed=3).eval()
    with served(Engine(model, enc, block_size=16, num_blocks=256), enc, "tiny") as srv:
        yield srv


def post(srv, body, stream=False):
    return http_json(srv, "POST", "/v1/chat/completions", dict(body, stream=stream))


def check_call(call, tools):
    """One OpenAI tool call: its shape, a name among the tools, arguments (JSON text) that
    validate against that function's parameters (the independent checker)."""
    assert call["type"] == "function" and call["id"].startswith("call_")
    fn = {t["function"]["name"]: t["function"] for t in tools}[call["function"]["name"]]
    validate(json.loads(call["function"]["arguments"]), fn["parameters"])


def test_tool_choice_required_and_named_return_valid_calls(tool_server):
    chat = dict(model="tiny", messages=[{"role": "user", "content": "weather?"}],
                max_tokens=90, tools=[WEATHER, CLOCK], temperature=1.0)
    for seed in range(4):
        for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
            status, out = post(tool_server, dict(chat, tool_choice=choice, seed=seed))
            assert status == 200, out
            c = out["choices"][0]
            assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
            check_call(c["message"]["tool_calls"][0], chat["tools"])
            if isinstance(choice, dict):
                assert c["message"]["tool_calls"][0]["function"]["name"] == "get_time"


def test_tool_calls_stream_as_delta_tool_calls_and_round_trip(tool_server):
    chat = dict(model="tiny", messages=[{"role": "user", "content": "weather in Lima?"}],
                max_tokens=90, tools=[WEATHER], tool_choice="required", temperature=0)
    status, chunks = post(tool_server, chat, stream=True)
    assert status == 200
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert len(calls) == 1 and calls[0]["index"] == 0
    check_call({k: v for k, v in calls[0].items() if k != "index"}, chat["tools"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # the client sends the call back with the tool's answer: accepted, answered
    status, whole = post(tool_server, dict(chat, stream=False))
    call = whole["choices"][0]["message"]["tool_calls"][0]
    history = chat["messages"] + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": '{"temp": 21}'}]
    status, out = post(tool_server, dict(chat, messages=history, tool_choice="none",
                                         max_tokens=8))
    assert status == 200 and isinstance(out["choices"][0]["message"]["content"], str)
    assert "tool_calls" not in out["choices"][0]["message"]


def test_tool_choice_auto_and_bad_tools(tool_server):
    chat = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=12,
                tools=[WEATHER], temperature=0)
    status, out = post(tool_server, chat)              # auto: the model decides (content)
    assert status == 200 and out["choices"][0]["finish_reason"] in ("stop", "length")
    for bad, param in [(dict(chat, tools=[{"type": "function", "function": {"name": "a b"}}]),
                        "tools"),
                       (dict(chat, tool_choice={"type": "function",
                                                "function": {"name": "nope"}}), "tool_choice"),
                       (dict(chat, tool_choice="required",
                             response_format={"type": "json_object"}), "tool_choice"),
                       (dict(chat, messages=[{"role": "tool", "content": "x"}]), "messages"),
                       (dict(chat, functions=[]), "functions")]:
        status, out = post(tool_server, bad)
        assert status == 400 and out["error"]["param"] == param, (bad, out)


def test_the_official_openai_client_round_trip(tool_server):
    """The official `openai` package drives the tool-calling round trip end to end."""
    openai = pytest.importorskip("openai", reason="the openai package is not installed "
                                                  "(pip install openai to run this test)")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{tool_server.server_address[1]}/v1",
                           api_key="none")
    messages = [{"role": "user", "content": "weather in Paris?"}]
    first = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER],
                                           tool_choice="required", max_tokens=90)
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls"
    check_call(call.model_dump(), [WEATHER])
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    second = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER],
                                            max_tokens=8)
    assert second.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(model="tiny", messages=messages[:1],
                                            tools=[WEATHER], tool_choice="required",
                                            max_tokens=90, stream=True)
    parts = [c.choices[0].delta.tool_calls for c in stream if c.choices and
             c.choices[0].delta.tool_calls]
    assert len(parts) == 1 and parts[0][0].function.name == "get_weather"
