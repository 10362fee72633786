"""
serving/structured.py -- constrained decoding, by hand: the model may only write JSON (any
object, or one that fits a JSON schema), one of a list of strings, or text that matches a
regular expression. vLLM and SGLang do this with a grammar backend (xgrammar, outlines);
here every piece is written out.

    python -m serving.structured        # mask cost per state on the repo's 4096-token BPE

How it works, and what each piece saves / adds / sacrifices:
  - A constraint is an automaton over BYTES, not characters: tokens are byte strings (a
    byte-level BPE token may hold half a UTF-8 character), so the automaton steps byte by
    byte and never decodes. Text must still be valid UTF-8, so every place that lets "any
    character" through (a JSON string, regex `.`, a class, \\D \\W \\S) spells the UTF-8
    encoding of its code points byte by byte: no overlong forms, no surrogates, nothing
    above U+10FFFF (the UTF-8 range split of RE2 and Rust's regex-syntax).
  - Regular constraints (regex, choice, JSON schema) compile to a Thompson NFA (Thompson
    1968), then to a DFA by subset construction (at most MAX_DFA_STATES states), pruned
    to the states that can still reach an accepting one. A schema of the subset below is
    regular (its nesting is finite): a DFA too, as in outlines (Willard & Louf 2023,
    "Efficient Guided Generation for Large Language Models"). Compiling costs 0.4 ms (a
    date regex: 15 states) to 6.5 ms (a nested 5-property schema: 292 states), so the
    Compiler keeps compiled constraints by spec; a step is then one table lookup a byte.
  - `json_object` (any object, any nesting) is not regular: brackets must balance. It is
    a pushdown automaton: a stack of open '{' / '[', at most MAX_DEPTH = 32 deep (an
    unbounded stack would make the states, and the mask cache, unbounded), plus small
    DFAs for the scalars. Its state is a tuple: hashable, so its masks cache too.
  - The mask: from a state, which tokens keep the automaton alive? Token by token, each
    token's bytes are fed from the state until one dies: 1.3-2.0 ms a state for the
    repo's 4096 tokens (18,921 bytes). A byte TRIE of the vocabulary walks a shared
    prefix once and drops a dead branch at its first byte (xgrammar: Dong et al. 2024):
    274-1,629 byte steps, 0.04-0.64 ms a state (`python -m serving.structured`, one CPU
    thread, on the states a random model visits). Costs the trie: 8,050 nodes, built once.
  - The cache: masks kept per automaton state in an LRU. Decoding revisits few states
    (inside a string, between values): 94-99% of the masks while sampling JSON or a regex
    are hits, ~0.3 us each. Costs V bytes per cached state (a torch.bool mask: 4.1 KB at
    V = 4096; xgrammar's bitmask would be V/8 = 512 B), DEFAULT_CACHE_STATES at most
    (16.8 MB per constraint at V = 4096).
  - Sacrifices. (1) The distribution: masking renormalises the model at EACH step over
    the allowed tokens, which is not the model conditioned on its whole output matching
    (Park et al. 2024, "Grammar-Aligned Decoding"); tests/test_structured.py measures
    both. (2) Whitespace: none outside strings but at most ONE space after ':' and ','
    (`{"a": 1, "b": [2]}` and `{"a":1,"b":[2]}` both pass): unbounded whitespace lets a
    model loop on spaces forever. (3) A schema's properties come in the schema's order,
    optional ones may be skipped (the outlines / xgrammar rule), extra keys never. (4)
    Strings and numbers are unbounded: max_tokens alone stops a model that never closes
    one (its output is then cut, not valid).

Wiring (serve.py, serving/openai_api.py): once per tokenizer `vocab =
Vocabulary.from_encoding(enc, size=cfg.vocab_size)` and `compiler = Compiler(vocab)`;
per request `c = compiler.json_object()` / `.json_schema(schema)` / `.regex(pattern)` /
`.choice(strings)` (a UserError is the client's 400); per sequence `state = c.start()`;
per step `row = mask_logits(row, c.allowed(state))` before temperature / top-k / top-p,
then `state = c.advance(state, token)`; `c.dead(state)` fails the request.
`generate_constrained` below is that loop.
"""
import json
import re
import time
from collections import OrderedDict

import torch

from core import data
from core.cli import command_line, fmt_bytes, knob
from core.errors import UserError
from core.runtime import run_cli

# Limits: each one exceeded is a one-line UserError naming it, never a crash or a hang.
MAX_DEPTH = 32              # nesting: json_object's stack, a schema, regex groups
MAX_SCHEMA_BYTES = 65536    # a schema's JSON text
MAX_ENUM = 256              # values of an enum, strings of a choice, properties, anyOf
MAX_CHOICE_BYTES = 65536    # all the choices together
MAX_PATTERN = 4096          # characters of a regex
MAX_REPEAT = 256            # m, n of {m,n}; minItems, maxItems
MAX_NFA_STATES = 200_000    # what a spec may expand to before determinization ...
MAX_DFA_STATES = 5_000      # ... and after it (a 256-entry row per state: ~2 KB)
DEFAULT_CACHE_STATES = 4096  # masks kept per constraint (LRU)
MAX_CODE_POINT, SURROGATES = 0x10FFFF, (0xD800, 0xDFFF)   # UTF-8 never encodes the latter

# ----------------------------------------------------------------------------------------
# A spec is a small tree of tuples, which the regex parser and the schema compiler both
# produce and one builder turns into an NFA:
#   ("bytes", b"...")       literal bytes        ("chars", ((lo, hi), ...))  one character
#   ("cat", [nodes])        concatenation        ("alt", [nodes])            alternation
#   ("rep", node, m, n)     m..n copies (n None: unbounded)
#   ("object", [(key, node, required)])   a JSON object, properties in this order


def char_ranges(ranges, negate=False):
    """A ("chars", ...) node: code-point ranges sorted and merged, the complement within
    0..U+10FFFF if negate, the surrogates cut out (they are not characters)."""
    merged = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:          # touches the previous one: extend it
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    if negate:          # the gaps between the merged ranges, and after the last one
        starts = [0] + [hi + 1 for _, hi in merged]
        ends = [lo - 1 for lo, _ in merged] + [MAX_CODE_POINT]
        merged = [(a, b) for a, b in zip(starts, ends) if a <= b]
    cut = [(a, b) for lo, hi in merged                  # each range minus D800..DFFF
           for a, b in ((lo, min(hi, SURROGATES[0] - 1)), (max(lo, SURROGATES[1] + 1), hi))]
    return ("chars", tuple((a, b) for a, b in cut if a <= b))


def utf8_sequences(lo, hi):
    """Code points lo..hi (no surrogates) as alternatives, each a tuple of byte ranges:
    U+0080..U+07FF -> ((0xC2, 0xDF), (0x80, 0xBF)). Exactly the valid encodings, no
    overlong ones. The range is cut (1) where the encoded length changes and (2) where a
    continuation byte would not run over its full 0x80..0xBF; then every byte position
    varies independently between the two ends' bytes (RE2's / regex-syntax's split)."""
    out, todo = [], [(lo, hi)]                      # todo: pieces that may still need a cut
    while todo:
        lo, hi = todo.pop()
        cut = next((b for b in (0x7F, 0x7FF, 0xFFFF) if lo <= b < hi), None)   # (1)
        for i in range(1, len(chr(lo).encode())):
            if cut is not None:
                break
            low = (1 << (6 * i)) - 1                # the bits of the last i bytes
            if lo & ~low != hi & ~low:              # the ends differ above them: (2)
                cut = lo | low if lo & low else (hi & ~low) - 1 if hi & low != low else None
        if cut is None:                             # aligned: byte k ranges over [a_k, b_k]
            out.append(tuple(zip(chr(lo).encode(), chr(hi).encode())))
        else:
            todo += [(lo, cut), (cut + 1, hi)]
    return out


# ----------------------------------------------------------------------------------------
# Thompson's construction: one NFA; states are ints, edges byte ranges or epsilons.

class NFA:
    def __init__(self):
        self.eps, self.edges = [], []     # per state: [target], [(lo byte, hi byte, target)]

    def new(self):
        if len(self.eps) >= MAX_NFA_STATES:         # a{256}{256}... must not eat the memory
            raise UserError(f"the constraint expands past MAX_NFA_STATES ({MAX_NFA_STATES})")
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1                    # its id: an index into both lists

    def build(self, node, start):
        """Add `node` from state `start`; -> its end state. A loop always returns to a
        fresh state, so alternatives may share `start`. A repeat builds its node again per
        copy (an NFA fragment cannot be reused): a{3} costs three a's."""
        kind = node[0]
        if kind == "bytes":                         # a chain, one state per byte
            for b in node[1]:
                self.edges[start].append((b, b, self.new()))
                start = len(self.eps) - 1
            return start
        if kind == "chars":                         # every alternative ends at one state
            end = self.new()
            for seq in (s for lo, hi in node[1] for s in utf8_sequences(lo, hi)):
                s = start
                for i, (a, b) in enumerate(seq):    # 1 to 4 byte ranges per sequence
                    nxt = end if i == len(seq) - 1 else self.new()
                    self.edges[s].append((a, b, nxt))
                    s = nxt
            return end
        if kind == "cat":
            for child in node[1]:
                start = self.build(child, start)
            return start
        if kind == "object":
            return self._object(node[1], start)
        end = self.new()
        if kind == "alt":                           # each branch from `start`, to `end`
            for child in node[1]:
                self.eps[self.build(child, start)].append(end)
            return end
        _, child, m, n = node                       # "rep": m copies, then ...
        for _ in range(m):
            start = self.build(child, start)
        self.eps[start].append(end)
        if n is None:                               # ... a loop (Kleene star), or
            loop = self.new()
            self.eps[start].append(loop)
            self.eps[self.build(child, loop)].append(loop)
            self.eps[loop].append(end)
        for _ in range(m, n or m):                  # ... n - m copies, each may end it
            start = self.build(child, start)
            self.eps[start].append(end)
        return end

    def _object(self, props, start):
        """'{' then the properties in order, optional ones skippable, a comma before all
        but the first one written. Two lanes: A[i] "nothing written before property i",
        B[i] "something written". Both enter property i (B through the comma) and leave it
        into lane B, so each value is built ONCE: linear size, where an alternation over
        "which property comes first" is quadratic and doubles at each nesting level."""
        start = self.build(("bytes", b"{"), start)
        lane_a = [start] + [self.new() for _ in props]
        lane_b = [self.new() for _ in range(len(props) + 1)]
        for i, (key, value, required) in enumerate(props):
            enter = self.new()                      # where "key": value begins
            self.eps[lane_a[i]].append(enter)       # the first one written: no comma
            self.eps[self.build(SEPARATOR, lane_b[i])].append(enter)
            after_key = self.build(("cat", [("bytes", key + b":"), OPTIONAL_SPACE]), enter)
            self.eps[self.build(value, after_key)].append(lane_b[i + 1])
            if not required:                        # skip it, in either lane
                self.eps[lane_a[i]].append(lane_a[i + 1])
                self.eps[lane_b[i]].append(lane_b[i + 1])
        close = self.new()                          # '{}' only if nothing was required
        self.eps[lane_a[-1]].append(close)
        self.eps[lane_b[-1]].append(close)
        return self.build(("bytes", b"}"), close)


# JSON's lexical pieces (RFC 8259) as specs, with the whitespace policy: at most one space
# after ':' and ',', none anywhere else.
OPTIONAL_SPACE = ("rep", ("bytes", b" "), 0, 1)
SEPARATOR = ("cat", [("bytes", b","), OPTIONAL_SPACE])
DIGIT, ONE_TO_NINE = char_ranges([(0x30, 0x39)]), char_ranges([(0x31, 0x39)])
HEX = char_ranges([(0x30, 0x39), (0x41, 0x46), (0x61, 0x66)])
# A string: any character but '"', '\\' and the controls U+0000..U+001F, or an escape.
# \uXXXX takes any 4 hex digits, as RFC 8259's grammar does (lone surrogates included).
ESCAPE = ("cat", [("bytes", b"\\"), ("alt", [
    char_ranges([(ord(c), ord(c)) for c in '"\\/bfnrt']), ("cat", [("bytes", b"u"),
                                                                   ("rep", HEX, 4, 4)])])])
JSON_STRING = ("cat", [("bytes", b'"'), ("rep", ("alt", [
    char_ranges([(0x22, 0x22), (0x5C, 0x5C), (0, 0x1F)], negate=True), ESCAPE]), 0, None),
    ("bytes", b'"')])
JSON_INTEGER = ("cat", [("rep", ("bytes", b"-"), 0, 1), ("alt", [    # -0 yes, 01 no
    ("bytes", b"0"), ("cat", [ONE_TO_NINE, ("rep", DIGIT, 0, None)])])])
JSON_NUMBER = ("cat", [JSON_INTEGER,
                       ("rep", ("cat", [("bytes", b"."), ("rep", DIGIT, 1, None)]), 0, 1),
                       ("rep", ("cat", [char_ranges([(69, 69), (101, 101)]),              # e E
                                        ("rep", char_ranges([(43, 43), (45, 45)]), 0, 1),  # + -
                                        ("rep", DIGIT, 1, None)]), 0, 1)])
JSON_LITERALS = {"boolean": ("alt", [("bytes", b"true"), ("bytes", b"false")]),
                 "null": ("bytes", b"null")}
JSON_SCALAR = ("alt", [JSON_STRING, JSON_NUMBER, *JSON_LITERALS.values()])


# ----------------------------------------------------------------------------------------
# Subset construction: NFA -> DFA, then pruned to the states that can still accept.

class DFA:
    """table[state][byte] -> next state or -1; accepting[state]; terminal[state]: accepts
    and nothing may follow (a closed JSON string). The start is state 0."""

    def __init__(self, table, accepting):
        self.table, self.accepting, self.start = table, accepting, 0
        self.terminal = [acc and max(row) < 0 for row, acc in zip(table, accepting)]

    def step(self, state, byte):                    # a list lookup: the trie's inner loop
        nxt = self.table[state][byte]
        return None if nxt < 0 else nxt

    def accepts(self, state):
        return self.accepting[state]


def _closure(nfa, states):
    """Every NFA state reachable from `states` by epsilon edges."""
    seen, todo = set(states), list(states)
    while todo:
        for t in nfa.eps[todo.pop()]:
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return frozenset(seen)                          # hashable: the DFA state's name


def determinize(nfa, start, final, spelled):
    """Subset construction (Rabin & Scott 1959): a DFA state is the set of NFA states the
    bytes so far may have reached. A byte no token contains (not spelled[b]) is never
    taken: the DFA only goes where this vocabulary can write."""
    first = _closure(nfa, [start])
    index, sets, table = {first: 0}, [first], []
    while len(table) < len(sets):                   # each new set gets its row in turn
        edges = [e for s in sets[len(table)] for e in nfa.edges[s]]
        row = [-1] * 256                            # -1: this byte kills the match
        # the bytes where an edge begins or ends cut 0..255 into pieces on which each
        # edge is all or nothing: one target set per piece, not per byte
        cuts = sorted({lo for lo, _, _ in edges} | {hi + 1 for _, hi, _ in edges})
        for a, b in zip(cuts, cuts[1:]):
            targets = [t for lo, hi, t in edges if lo <= a <= hi]
            if targets:
                target = _closure(nfa, targets)
                if target not in index:
                    if len(sets) >= MAX_DFA_STATES:     # (a|b)*a(a|b){13} needs 2^14
                        raise UserError(f"the constraint needs over MAX_DFA_STATES "
                                        f"({MAX_DFA_STATES}) DFA states: simplify it")
                    index[target] = len(sets)
                    sets.append(target)
                row[a:b] = [index[target] if spelled[x] else -1 for x in range(a, b)]
        table.append(row)
    return _prune(table, [final in s for s in sets])   # accepting: holds the NFA's end


def _prune(table, accepting):
    """Keep only the edges into states from which an accepting one is reachable: then
    "alive" means "can still finish", and a mask never walks the model into a dead end
    (a[^\\s\\S] would otherwise let it write the 'a')."""
    back = [[] for _ in table]                      # the edges reversed
    for s, row in enumerate(table):
        for t in set(row) - {-1}:
            back[t].append(s)
    live, todo = list(accepting), [s for s, acc in enumerate(accepting) if acc]
    while todo:                                     # backwards from the accepting states
        for p in back[todo.pop()]:
            if not live[p]:
                live[p] = True
                todo.append(p)
    if not live[0]:                                 # nothing at all can be written
        raise UserError("the constraint matches nothing this vocabulary can write")
    return DFA([[t if t >= 0 and live[t] else -1 for t in row] for row in table], accepting)


def compile_dfa(node, spelled):
    """A spec -> its pruned DFA."""
    nfa = NFA()
    start = nfa.new()                               # state 0; build() returns the end
    return determinize(nfa, start, nfa.build(node, start), spelled)


# ----------------------------------------------------------------------------------------
# json_object: a pushdown automaton. State = (stack, mode, lex): stack a str of 'o' / 'a'
# (the open objects and arrays), mode the position below, lex the scalar DFA's state
# inside a key (mode KEY) or a scalar value (mode SCALAR).

START, OBJ_FIRST, OBJ_KEY, OBJ_KEY_NS, KEY, COLON, VALUE, VALUE_NS, ARR_FIRST, SCALAR, AFTER = \
    range(11)     # *_NS: the one space was taken; AFTER: a value is complete
OPEN, CLOSE, CLOSE_ARRAY, QUOTE, COMMA, COLON_B, SPACE = b'{}]",: '     # their byte values


class JsonObjectAutomaton:
    """Any JSON object (RFC 8259) nested at most max_depth deep, whitespace as the policy
    says. Scalars are lexed by DFAs with maximal munch: a number ends at the first byte
    it cannot take, and that byte is read as what follows the value."""

    def __init__(self, spelled, max_depth=MAX_DEPTH):
        self.key = compile_dfa(JSON_STRING, spelled)        # 29 states (not minimised)
        self.scalar = compile_dfa(JSON_SCALAR, spelled)     # strings, numbers, literals
        self.max_depth, self.start = max_depth, ("", START, 0)

    def accepts(self, state):                       # the top-level object just closed
        return state[0] == "" and state[1] == AFTER

    def step(self, state, byte):
        stack, mode, lex = state
        if mode == KEY or mode == SCALAR:
            dfa = self.key if mode == KEY else self.scalar
            nxt = dfa.table[lex][byte]
            if nxt >= 0:            # still inside; a closed string moves on at once
                return (stack, COLON if mode == KEY else AFTER, 0) if dfa.terminal[nxt] \
                    else (stack, mode, nxt)
            # a complete number cannot take this byte: it ends, the byte follows it
            return self._after(stack, byte) if mode == SCALAR and dfa.accepting[lex] else None
        if mode == START:                           # the output is an object, nothing else
            return ("o", OBJ_FIRST, 0) if byte == OPEN else None
        if mode in (OBJ_FIRST, OBJ_KEY, OBJ_KEY_NS):     # a key, or '}' on an empty object
            if byte == QUOTE:
                return (stack, KEY, self.key.table[0][byte])
            if mode == OBJ_KEY and byte == SPACE:   # the one space after ','
                return (stack, OBJ_KEY_NS, 0)
            return (stack[:-1], AFTER, 0) if mode == OBJ_FIRST and byte == CLOSE else None
        if mode == COLON:
            return (stack, VALUE, 0) if byte == COLON_B else None
        if mode == VALUE and byte == SPACE:         # the one space after ':' or ','
            return (stack, VALUE_NS, 0)
        if mode == ARR_FIRST and byte == CLOSE_ARRAY:   # an empty array
            return (stack[:-1], AFTER, 0)
        if mode in (VALUE, VALUE_NS, ARR_FIRST):
            return self._value(stack, byte)
        return self._after(stack, byte)             # mode AFTER

    def _value(self, stack, byte):
        """A value's first byte: open a container (if the stack has room) or a scalar."""
        if byte in b"{[":
            if len(stack) >= self.max_depth:        # full: the model must close instead
                return None
            return (stack + "o", OBJ_FIRST, 0) if byte == OPEN else (stack + "a", ARR_FIRST, 0)
        nxt = self.scalar.table[0][byte]
        return None if nxt < 0 else (stack, SCALAR, nxt)

    def _after(self, stack, byte):
        """After a value: ',' or the innermost container's closer; nothing at depth 0."""
        if not stack:
            return None
        if byte == COMMA:                           # in an object a key comes next
            return (stack, OBJ_KEY if stack[-1] == "o" else VALUE, 0)
        closer = CLOSE if stack[-1] == "o" else CLOSE_ARRAY
        return (stack[:-1], AFTER, 0) if byte == closer else None


# ----------------------------------------------------------------------------------------
# Regex -> spec. The subset, with Python's `re` semantics under re.ASCII, matching the whole
# output: literals; escapes \d \w \s (ASCII) and \D \W \S (their complements: every other
# character, non-ASCII included), \. \\ \( and any escaped punctuation, \n \t \r \f \v \a,
# \xHH \uHHHH \UHHHHHHHH; classes [a-z0-9_] [^"] with escapes, ']' first is literal; `.`
# (any character but \n); groups ( ) (?: ); | * + ? {m} {m,} {,n} {m,n}; ^ at the start and
# $ at the end (no-ops: the anchors are implicit). Refused, one line each: backreferences,
# lookarounds, named groups, \b \A \Z, inline flags, lazy or possessive quantifiers.

CLASS_ESCAPES = {"d": [(48, 57)], "w": [(48, 57), (65, 90), (95, 95), (97, 122)],
                 "s": [(9, 13), (32, 32)]}  # [0-9], [0-9A-Z_a-z], [\t\n\v\f\r ]
CHAR_ESCAPES = {"n": 10, "t": 9, "r": 13, "f": 12, "v": 11, "a": 7}
HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}                  # how many hex digits follow
QUANTIFIER = re.compile(r"\{([0-9]*)(,([0-9]*))?\}")   # "{}" alone is literal text


class RegexParser:
    """Recursive descent: alternation > quantified atom > atom."""

    def __init__(self, pattern):
        if not isinstance(pattern, str) or len(pattern) > MAX_PATTERN:
            raise UserError(f"a regex must be a string of at most MAX_PATTERN ({MAX_PATTERN}) "
                            f"characters")
        self.p, self.i, self.depth = pattern, 0, 0   # the pattern, the position, open groups

    def fail(self, why):
        raise UserError(f"regex {self.p[:40]!r}: {why} at position {self.i}")

    def parse(self):
        self.i = 1 if self.p.startswith("^") else 0
        body = self.p[:-1]
        if self.p.endswith("$") and (len(body) - len(body.rstrip("\\"))) % 2 == 0:
            self.p = body                           # an anchor, not an escaped "\$"
        node = self.alternation()
        if self.i < len(self.p):                    # alternation stopped at a stray ')'
            self.fail("unbalanced ')'")
        return node

    def peek(self):
        return self.p[self.i:self.i + 1]            # "" at the end

    def alternation(self):
        """Branches of quantified atoms, up to the end or a ')'."""
        branches = [[]]
        while self.peek() not in ("", ")"):
            if self.peek() == "|":
                self.i += 1
                branches.append([])
            else:
                branches[-1].append(self.quantified(self.atom()))
        return ("alt", [("cat", b) for b in branches])

    def counts(self):
        """A quantifier at self.i -> (m, n or None, its length), or None."""
        c, brace = self.peek(), QUANTIFIER.match(self.p, self.i)
        if c in ("*", "+", "?"):
            return (1 if c == "+" else 0), (1 if c == "?" else None), 1
        if brace is None or brace.group(0) == "{}":  # not a quantifier: a literal '{'
            return None
        lo, comma, hi = brace.group(1, 2, 3)
        return int(lo or 0), (int(hi) if hi else None) if comma else int(lo), len(brace.group(0))

    def quantified(self, node):
        found = self.counts()
        if found is None:
            return node
        m, n, length = found
        self.i += length
        if n is not None and m > n or max(m, n or 0) > MAX_REPEAT:   # copies cost states
            self.fail(f"a repeat needs m <= n <= MAX_REPEAT ({MAX_REPEAT})")
        if self.counts() is not None:               # a*? a*+ a**: lazy, possessive, double
            self.fail("a second quantifier (lazy, possessive, repeated) is not supported")
        return ("rep", node, m, n)

    def atom(self):
        if self.counts() is not None:               # "*a", "a|+b": as re says
            self.fail("nothing to repeat")
        c = self.peek()
        self.i += 1
        if c == "(":
            return self.group()
        if c == "[":
            return self.char_class()
        if c == ".":                                # any character but a newline, as in re
            return char_ranges([(10, 10)], negate=True)
        if c == "\\":
            return char_ranges(*self.escape())
        if c in "^$":
            self.fail(f"the anchor {c!r} is only supported at the ends")
        return ("bytes", c.encode("utf-8"))     # a lone surrogate: UnicodeEncodeError

    def group(self):
        if self.p.startswith("?:", self.i):         # non-capturing: the same language
            self.i += 2
        elif self.peek() == "?":
            self.fail("(?...) other than (?:...) is not supported")
        self.depth += 1
        if self.depth > MAX_DEPTH:                  # the recursion is bounded too
            self.fail(f"groups nested over MAX_DEPTH ({MAX_DEPTH})")
        node = self.alternation()
        if self.peek() != ")":
            self.fail("missing ')'")
        self.i, self.depth = self.i + 1, self.depth - 1
        return node

    def char_class(self):
        """[...] or [^...]: characters, ranges lo-hi, class escapes; ']' first and '-'
        first or last are literal, as in Python."""
        negate = self.peek() == "^"
        self.i += negate                            # a bool: skips the '^' if there
        ranges, start = [], self.i
        while self.i == start or self.peek() != "]":
            lo = self.member()
            if self.peek() == "-" and self.p[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                hi = self.member()                  # both ends single characters, in order
                if not len(lo) == len(hi) == 1 or not lo[0][0] == lo[0][1] <= hi[0][0] == hi[0][1]:
                    self.fail("bad character range")
                lo = [(lo[0][0], hi[0][0])]
            ranges += lo
        self.i += 1
        return char_ranges(ranges, negate)

    def member(self):
        """One member of a class -> its code-point ranges."""
        c = self.peek()
        if c == "":
            self.fail("unterminated character set")
        self.i += 1
        return list(char_ranges(*self.escape())[1]) if c == "\\" else [(ord(c), ord(c))]

    def escape(self):
        """After a backslash -> (code-point ranges, negated)."""
        c = self.peek()
        self.i += 1
        if c.lower() in CLASS_ESCAPES:              # \D \W \S: the uppercase negates
            return CLASS_ESCAPES[c.lower()], c.isupper()
        if c in CHAR_ESCAPES:
            return [(CHAR_ESCAPES[c],) * 2], False
        if c in HEX_ESCAPES:
            digits = self.p[self.i:self.i + HEX_ESCAPES[c]]
            self.i += len(digits)
            if not re.fullmatch(f"[0-9a-fA-F]{{{HEX_ESCAPES[c]}}}", digits) or \
                    int(digits, 16) > MAX_CODE_POINT:
                self.fail(f"bad \\{c} escape")
            return [(int(digits, 16),) * 2], False
        if c == "" or c.isalnum():                  # \1 \b \A \Z \p ...: not in the subset
            self.fail(f"the escape \\{c} is not supported (backreferences, \\b, \\A, \\Z ...)")
        return [(ord(c), ord(c))], False            # \. \\ \( ...: the character itself


# ----------------------------------------------------------------------------------------
# JSON schema -> spec. The subset: type (object, array, string, number, integer, boolean,
# null, or a list of them); properties, required, additionalProperties (absent or false:
# extra keys are never generated); items, minItems, maxItems; enum and const of literals
# (spelled compactly: the only spelling generated); anyOf. Annotations (title, description,
# default, ...) constrain nothing and are read past. Anything else: a UserError naming it.

ANNOTATIONS = {"title", "description", "$schema", "$id", "$comment", "default", "examples"}
KEYWORDS_OF = {"object": {"properties", "required", "additionalProperties"},
               "array": {"items", "minItems", "maxItems"}}
TYPES = {"string": JSON_STRING, "number": JSON_NUMBER, "integer": JSON_INTEGER,
         **JSON_LITERALS, "object": None, "array": None}    # None: built from the keywords
LITERAL_TYPE = {str: "string", bool: "boolean", int: "integer", float: "number",
                type(None): "null"}


def _refuse(path, why):
    raise UserError(f"json_schema at {path}: {why}")


def schema_tree(schema):
    """Check a schema's size, then compile it -> spec, or a one-line UserError."""
    if not isinstance(schema, dict):
        raise UserError(f"json_schema must be an object, got {type(schema).__name__}")
    try:
        size = len(json.dumps(schema))              # before walking it: a 1 MB one stops here
    except RecursionError:                          # json.dumps's own limit: ~1000 deep
        raise UserError(f"json_schema is nested deeper than MAX_DEPTH ({MAX_DEPTH})") from None
    except (TypeError, ValueError) as e:            # not JSON data, or a cycle
        raise UserError(f"json_schema is not plain JSON ({e})") from None
    if size > MAX_SCHEMA_BYTES:
        raise UserError(f"json_schema has {size} bytes, over MAX_SCHEMA_BYTES "
                        f"({MAX_SCHEMA_BYTES})")
    return _schema_node(schema, "$", 0)


def _schema_node(schema, path, depth):
    if not isinstance(schema, dict):
        _refuse(path, "a schema must be an object (boolean schemas are not supported)")
    if depth > MAX_DEPTH:
        _refuse(path, f"nested deeper than MAX_DEPTH ({MAX_DEPTH})")
    types = schema.get("type", [])
    types = [types] if isinstance(types, str) else types   # "null" or ["string", "null"]
    if not isinstance(types, list) or not set(types) <= set(TYPES):
        _refuse(path, f"'type' must be one of {', '.join(TYPES)} or a list of them")
    # every keyword is supported or refused by name: none is ever silently ignored
    allowed = {"type", "enum", "const", "anyOf"}.union(*(KEYWORDS_OF.get(t, ()) for t in types))
    for key in set(schema) - allowed - ANNOTATIONS:
        where = [t for t, words in KEYWORDS_OF.items() if key in words]
        _refuse(path, f"'{key}' is not supported" + (f" without type {where[0]}" if where else ""))
    if "enum" in schema or "const" in schema:
        return _enum_node(schema, types, path)
    if "anyOf" in schema:                           # an alternation: cheap in an NFA
        subs = schema["anyOf"]
        if types or not isinstance(subs, list) or not 0 < len(subs) <= MAX_ENUM:
            _refuse(path, f"'anyOf' must be a list of 1 to MAX_ENUM ({MAX_ENUM}) schemas, alone")
        return ("alt", [_schema_node(s, f"{path}.anyOf[{i}]", depth + 1)
                        for i, s in enumerate(subs)])
    if not types:                                   # "any value" would need json_object's stack
        _refuse(path, "a schema without 'type', 'enum', 'const' or 'anyOf' is not supported")
    return ("alt", [_object_node(schema, path, depth) if t == "object" else
                    _array_node(schema, path, depth) if t == "array" else TYPES[t] for t in types])


def _enum_node(schema, types, path):
    """enum / const: each literal spelled json.dumps(v, ensure_ascii=False, separators=(",",
    ":")), the only spelling generated; a literal whose type the 'type' excludes is dropped."""
    values = [schema["const"]] if "const" in schema else schema["enum"]
    if not isinstance(values, list) or not 0 < len(values) <= MAX_ENUM:
        _refuse(path, f"'enum' must be a list of 1 to MAX_ENUM ({MAX_ENUM}) values")
    if set(schema) - ANNOTATIONS - {"type", "enum", "const"}:
        _refuse(path, "'enum' or 'const' beside other constraints is not supported")
    spelled = set()
    for v in values:
        kind = LITERAL_TYPE.get(type(v))
        if kind is None:                            # objects, arrays: not literals
            _refuse(path, "enum values must be strings, numbers, booleans or null")
        if not types or kind in types or kind == "integer" and "number" in types:
            try:
                spelled.add(json.dumps(v, ensure_ascii=False, separators=(",", ":"),
                                       allow_nan=False).encode("utf-8"))
            except (ValueError, UnicodeEncodeError):    # NaN, Infinity, a lone surrogate
                _refuse(path, f"the enum value {v!r} is not JSON text")
    if not spelled:
        _refuse(path, "no enum value has the schema's type")
    return ("alt", [("bytes", s) for s in sorted(spelled)])


def _object_node(schema, path, depth):
    props, required = schema.get("properties", {}), schema.get("required", [])
    if schema.get("additionalProperties", False) is not False:
        _refuse(path, "'additionalProperties' other than false is not supported")
    if not isinstance(props, dict) or len(props) > MAX_ENUM:
        _refuse(path, f"'properties' must be an object of at most MAX_ENUM ({MAX_ENUM}) entries")
    if not isinstance(required, list) or \
            not all(isinstance(r, str) and r in props for r in required):
        _refuse(path, "'required' must list names from 'properties'")
    fields = []                                     # (key's JSON spelling, value, required)
    for name, sub in props.items():                 # in the schema's order: the output's
        try:
            key = json.dumps(name, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            _refuse(path, f"the property name {name!r} is not text")
        fields.append((key, _schema_node(sub, f"{path}.{name}", depth + 1), name in required))
    return ("object", fields)


def _array_node(schema, path, depth):
    """'[' (item (',' item){min-1, max-1})? ']', the comma with its optional space."""
    if not isinstance(schema.get("items"), dict):
        _refuse(path, "an array needs 'items' (one schema); tuple and any-value arrays are "
                      "not supported")
    low, high = schema.get("minItems", 0), schema.get("maxItems")
    if type(low) is not int or not (high is None or type(high) is int) or \
            not 0 <= low <= (MAX_REPEAT if high is None else high) <= MAX_REPEAT:
        _refuse(path, f"minItems, maxItems must be integers, 0 <= minItems <= maxItems <= "
                      f"MAX_REPEAT ({MAX_REPEAT})")
    item = _schema_node(schema["items"], f"{path}[]", depth + 1)   # copied per repeat
    if high == 0:                                   # maxItems 0: the empty array only
        return ("bytes", b"[]")
    more = ("rep", ("cat", [SEPARATOR, item]), max(low - 1, 0), None if high is None else high - 1)
    return ("cat", [("bytes", b"["), ("rep", ("cat", [item, more]), min(low, 1), 1),
                    ("bytes", b"]")])


# ----------------------------------------------------------------------------------------
# The vocabulary as a byte trie, built once per tokenizer and shared by every constraint.

class Vocabulary:
    """token_bytes[i]: token i's bytes, or None for a token never allowed (special tokens;
    an empty token would let the model loop without progress). eos_id: allowed exactly
    where the automaton accepts. size: the model's vocabulary, which may pad the
    tokenizer's: the ids past token_bytes are never allowed."""

    def __init__(self, token_bytes, eos_id, size=None):
        if size is not None and size < max(len(token_bytes), eos_id + 1):
            raise UserError(f"the model's vocabulary ({size}) is smaller than the tokenizer's")
        self.size, self.eos_id = max(size or 0, len(token_bytes), eos_id + 1), eos_id
        self.token_bytes = [bytes(b) if b and i != eos_id else None     # EOS: no bytes
                            for i, b in enumerate(token_bytes)]
        # the trie: children[node] = {byte: child node}, tokens[node] = the ids it spells
        self.children, self.tokens = [{}], [[]]
        for tok, b in enumerate(self.token_bytes):
            node = 0                                # the root: the empty prefix
            for byte in b or ():
                if byte not in self.children[node]:
                    self.children[node][byte] = len(self.children)
                    self.children.append({})
                    self.tokens.append([])
                node = self.children[node][byte]
            if b:
                self.tokens[node].append(tok)       # a list: two ids may spell the same bytes
        # the bytes some token contains: a constraint needing another one is refused
        present = set(b"".join(b for b in self.token_bytes if b))
        self.spelled = [byte in present for byte in range(256)]
        self.total_bytes = sum(len(b or b"") for b in self.token_bytes)   # the naive walk

    @classmethod
    def from_encoding(cls, enc, size=None):
        """From a tiktoken Encoding (core/data.py's make_encoding): EOS is <|endoftext|>;
        every other special token is never allowed."""
        specials = {enc.encode_single_token(s) for s in enc.special_tokens_set}
        return cls([None if i in specials else enc.decode_single_token_bytes(i)
                    for i in range(enc.n_vocab)], enc.encode_single_token(data.EOT), size)


# ----------------------------------------------------------------------------------------
# The constraint: automaton + vocabulary -> masks, cached per state.

DONE = ("done",)            # the state after EOS: accepting, nothing more allowed


class Constraint:
    """What the engine calls. States are hashable (a DFA's: an int; json_object's: a tuple).
      start() -> state; advance(state, token_id) -> state; accepts(state);
      allowed(state) -> (vocab.size,) torch.bool, cached: read it, never write into it;
      dead(state): not accepting and no token allowed -- the request must fail."""

    def __init__(self, automaton, vocab, cache_size=DEFAULT_CACHE_STATES):
        self.automaton, self.vocab, self.cache_size = automaton, vocab, cache_size
        self.cache = OrderedDict()                  # state -> mask, least recent first
        self.hits = self.misses = self.trie_steps = 0   # what the report and tests read

    def start(self):
        return self.automaton.start                 # the same for every sequence

    def accepts(self, state):
        return state == DONE or self.automaton.accepts(state)

    def feed(self, state, spelled):
        """The state after these bytes; None if the automaton dies (or no bytes)."""
        for byte in spelled or ():
            state = self.automaton.step(state, byte) if state not in (None, DONE) else None
        return state if spelled else None

    def advance(self, state, token_id):
        if token_id == self.vocab.eos_id and self.accepts(state):
            return DONE
        state = self.feed(state, self.vocab.token_bytes[token_id]
                          if 0 <= token_id < len(self.vocab.token_bytes) else None)
        if state is None:                           # an engine bug, not the user's
            raise ValueError(f"token {token_id} is not allowed here: was the mask applied?")
        return state

    def allowed(self, state):
        mask = self.cache.get(state)
        if mask is not None:                        # a hit: ~0.3 us, no walk
            self.hits += 1
            self.cache.move_to_end(state)           # most recently used
            return mask
        self.misses += 1
        mask = self.cache[state] = self.trie_mask(state)
        if len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)          # evict the least recently used
        return mask

    def dead(self, state):
        return not self.accepts(state) and not bool(self.allowed(state).any())

    def trie_mask(self, state):
        """Walk the trie from `state`, depth first: a child is visited only if its byte
        keeps the automaton alive, so a dead prefix prunes every token below it."""
        ids, step, steps = [], self.automaton.step, 0
        children, tokens = self.vocab.children, self.vocab.tokens
        todo = [(0, state)] if state != DONE else []    # (trie node, automaton state)
        while todo:
            node, s = todo.pop()
            steps += len(children[node])
            for byte, child in children[node].items():
                nxt = step(s, byte)
                if nxt is not None:                 # alive: its tokens pass, go deeper
                    ids += tokens[child]
                    if children[child]:
                        todo.append((child, nxt))
        self.trie_steps += steps
        mask = torch.zeros(self.vocab.size, dtype=torch.bool)
        mask[ids] = True
        mask[self.vocab.eos_id] = state != DONE and self.accepts(state)   # end only if valid
        return mask


def mask_logits(logits, allowed):
    """-inf on the forbidden tokens: softmax renormalises over the rest (exp(-inf) = 0),
    so temperature, top-k and top-p then act on the allowed tokens only."""
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def generate_constrained(constraint, next_logits, max_tokens, generator=None, greedy=False):
    """The decoding loop under a constraint: mask, pick, advance, until EOS. next_logits
    (tokens so far) -> (V,) logits. -> (tokens, without EOS; finished: EOS was picked)."""
    state, out = constraint.start(), []
    for _ in range(max_tokens):
        allowed = constraint.allowed(state)         # cached per state
        if not allowed.any():                       # dead: a vocabulary missing pieces
            raise UserError("the constraint reached a state no token can continue")
        row = mask_logits(next_logits(out).float(), allowed)
        tok = int(row.argmax()) if greedy else \
            int(torch.multinomial(row.softmax(-1), 1, generator=generator))   # renormalised
        state = constraint.advance(state, tok)
        if state == DONE:
            return out, True
        out.append(tok)
    return out, False                               # cut by max_tokens: maybe not valid


class Compiler:
    """Specs -> constraints, kept by spec in an LRU of `keep`: the same schema on every
    request compiles once and shares one mask cache (xgrammar's compiled grammars)."""

    def __init__(self, vocab, keep=64, cache_size=DEFAULT_CACHE_STATES):
        self.vocab, self.keep, self.cache_size = vocab, keep, cache_size
        self.compiled = OrderedDict()               # spec key -> Constraint, LRU first

    def _get(self, key, make):
        if key not in self.compiled:
            self.compiled[key] = Constraint(make(), self.vocab, self.cache_size)
            if len(self.compiled) > self.keep:      # bounded: clients choose the specs
                self.compiled.popitem(last=False)
        self.compiled.move_to_end(key)
        return self.compiled[key]

    def json_object(self):
        return self._get(("json_object",), lambda: JsonObjectAutomaton(self.vocab.spelled))

    def json_schema(self, schema, wrap=None):
        """wrap: (opening, closing) text around the JSON, e.g. a tool call's
        ("<tool_call>", "</tool_call>") (serving/openai_api.py's chat template)."""
        tree = schema_tree(schema)                  # the size is checked before anything
        if wrap is not None:
            if not (isinstance(wrap, (list, tuple)) and len(wrap) == 2 and
                    all(isinstance(w, str) for w in wrap)):
                raise UserError("json_schema's wrap must be two strings")
            tree = ("cat", [("bytes", wrap[0].encode()), tree, ("bytes", wrap[1].encode())])
        # the key keeps the properties' order: it is the output's order
        return self._get(("json_schema", json.dumps(schema), tuple(wrap or ())),
                         lambda: compile_dfa(tree, self.vocab.spelled))

    def regex(self, pattern):
        try:
            tree = RegexParser(pattern).parse()
        except UnicodeEncodeError:
            raise UserError("the regex holds a lone surrogate (not text)") from None
        return self._get(("regex", pattern), lambda: compile_dfa(tree, self.vocab.spelled))

    def choice(self, options):
        """vLLM's guided_choice: the output is exactly one of the strings."""
        if not isinstance(options, list) or not 0 < len(options) <= MAX_ENUM or \
                not all(isinstance(o, str) for o in options):
            raise UserError(f"guided_choice must be a list of 1 to MAX_ENUM ({MAX_ENUM}) "
                            f"strings")
        try:
            spelled = tuple(sorted({o.encode("utf-8") for o in options}))
        except UnicodeEncodeError:
            raise UserError("guided_choice holds a lone surrogate (not text)") from None
        if sum(map(len, spelled)) > MAX_CHOICE_BYTES:
            raise UserError(f"guided_choice is over MAX_CHOICE_BYTES ({MAX_CHOICE_BYTES})")
        tree = ("alt", [("bytes", s) for s in spelled])     # a trie once determinized
        return self._get(("choice",) + spelled, lambda: compile_dfa(tree, self.vocab.spelled))


# ----------------------------------------------------------------------------------------
# `python -m serving.structured`: what a mask costs per state, token by token vs trie vs
# cache, on the states a random model visits under four constraints.

DEMO_SCHEMA = {"type": "object", "required": ["name", "age"], "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "role": {"enum": ["admin", "user"]},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    "address": {"type": "object", "required": ["city"],
                "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}}}}
DEMO_REGEX = r"\d{4}-\d{2}-\d{2}( [A-Z][a-z]+)?"
DEMO_CHOICE = ["positive", "negative", "neutral", "mixed"]


def visited_states(constraint, outputs, max_tokens, seed):
    """The distinct states a random model (logits ~ N(0, 2^2)) visits under the constraint."""
    g, seen = torch.Generator().manual_seed(seed), {constraint.start(): None}
    model = lambda out: torch.randn(constraint.vocab.size, generator=g) * 2   # a random "model"
    for _ in range(outputs):
        state = constraint.start()
        for tok in generate_constrained(constraint, model, max_tokens, g)[0]:
            state = constraint.advance(state, tok)
            seen[state] = None                      # a dict: distinct, in visiting order
    return list(seen)


def measure_mask_cost(constraint, states, naive_states=20):
    """Seconds per state three ways, on the same states: token by token (each token's
    bytes fed from the state: the first naive_states only), the trie walk (the cache
    emptied first), a cache hit; the trie's byte steps per state; the allowed fraction."""
    clock = time.perf_counter
    t0 = clock()
    for s in states[:naive_states]:                 # naive: V walks, no prefix shared
        for spelled in constraint.vocab.token_bytes:
            constraint.feed(s, spelled)
    naive = (clock() - t0) / min(len(states), naive_states)
    constraint.cache.clear()
    steps, t0 = constraint.trie_steps, clock()
    masks = [constraint.allowed(s) for s in states]             # every one a miss: the walk
    trie, t0 = (clock() - t0) / len(states), clock()
    for s in states:                                            # every one a hit
        constraint.allowed(s)
    return {"states": len(states), "naive_s": naive, "trie_s": trie,
            "cached_s": (clock() - t0) / len(states),
            "trie_steps": (constraint.trie_steps - steps) / len(states),
            "allowed": sum(float(m.float().mean()) for m in masks) / len(masks)}


KNOBS = [
    knob("--data", None, "UTF-8 text the BPE is trained on; not given: the built-in corpus"),
    knob("--vocab-size", data.DEFAULT_VOCAB_SIZE, "the BPE's vocabulary (trained once, cached)"),
    knob("--outputs", 8, "random-model outputs per constraint, for the states measured"),
    knob("--max-tokens", 48, "tokens per output at most"),
    knob("--seed", 0, "sampling seed"),
]


def main(argv=None):
    args = command_line("Constrained decoding: a mask's cost per state, token by token vs "
                        "trie vs cache.", {None: KNOBS},
                        prog="python -m serving.structured").parse_args(argv)
    torch.set_num_threads(1)                        # the figures: one CPU thread
    vocab = Vocabulary.from_encoding(data.get_tokenizer(args.data, args.vocab_size))
    compiler, V = Compiler(vocab), vocab.size
    print(f"vocab {V} tokens ({vocab.total_bytes} bytes, a trie of {len(vocab.children)} nodes)"
          f" | cache {fmt_bytes(V)} a state as bool, {fmt_bytes(V / 8)} as bits; "
          f"{DEFAULT_CACHE_STATES} states: {fmt_bytes(V * DEFAULT_CACHE_STATES)}")
    print("constraint     automaton  compile states hits   naive     trie   cached  trie steps "
          "allowed")
    for name, make in [("json_object", compiler.json_object),
                       ("json_schema", lambda: compiler.json_schema(DEMO_SCHEMA)),
                       ("regex", lambda: compiler.regex(DEMO_REGEX)),
                       ("choice", lambda: compiler.choice(DEMO_CHOICE))]:
        t0 = time.perf_counter()
        c = make()                                  # compile: parse, NFA, DFA, prune
        ms = (time.perf_counter() - t0) * 1e3
        states = visited_states(c, args.outputs, args.max_tokens, args.seed)
        hit_rate = c.hits / (c.hits + c.misses)     # while decoding: masks reused
        cost = measure_mask_cost(c, states)
        kind = f"DFA {len(c.automaton.table)}" if isinstance(c.automaton, DFA) else "pushdown"
        print(f"{name:12s} {kind:>11s} {ms:6.1f}ms {cost['states']:6d} {hit_rate:4.0%} "
              f"{cost['naive_s'] * 1e3:5.2f}ms {cost['trie_s'] * 1e3:6.2f}ms "
              f"{cost['cached_s'] * 1e6:6.2f}us {cost['trie_steps']:11.0f} {cost['allowed']:7.1%}")
    print("hits: masks served by the cache while sampling; naive: each token's bytes fed from "
          "the state; trie: shared prefixes walked once, dead branches pruned; cached: a hit")


if __name__ == "__main__":
    run_cli(main)                                   # a UserError: one `error:` line, exit 2
