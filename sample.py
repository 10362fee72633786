"""
sample.py -- talk to a trained model: a prompt in, a completion out, with the sampling knobs
every serving stack exposes.

    python sample.py                                   # type prompts; an empty line or Ctrl-D ends
    python sample.py --prompt "def " --num-samples 3   # one prompt, three samples, then exit
    python sample.py --temperature 0 --max-new-tokens 40          # greedy
    python sample.py --checkpoint out/lora/merged.pt   # any checkpoint: train.py's, a merged
                                                       # adapter, quantize.py's, a HF folder
    printf 'import os\\nclass A:\\n' | python sample.py # one prompt per line from a pipe

What the knobs do to the next-token distribution p = softmax(logits / T) (model.sample_next):
  temperature T   T → 0 is greedy (argmax), T = 1 the model's own distribution, T > 1
                  flatter (more surprising tokens, more mistakes);
  top-k           keep the k most likely tokens, renormalise (Fan et al. 2018);
  top-p           keep the smallest set whose probability reaches p (nucleus sampling,
                  Holtzman et al. 2020): adapts the cut to how peaked p is.
Each sample runs model.generate: one prefill over the prompt, then one cached decode step
per token. A typed "\\n" in a prompt is a newline (code prompts span lines). Same --seed,
same prompt -> the same completion.
"""
import argparse
import sys

import torch

from core import data
from core.checkpoint import load_model
from core.cli import command_line, knob
from core.errors import UserError
from core.runtime import pick_device, run_cli


def complete(model, enc, prompt, args, seed):
    """The completion of one prompt (text), or a UserError for a prompt that cannot fit."""
    # encode_ordinary, not encode: a typed "<|endoftext|>" stays plain text, never the
    # special token (tiktoken's encode would refuse it outright). The split pattern glues a
    # space to the word after it (core/data.py, SPLIT_PATTERN), so a prompt that ends in a
    # space, like "def ", ends on a lone-space token the model rarely saw before a word:
    # the first tokens may come out odd (what "token healing" in real servers repairs).
    ids = enc.encode_ordinary(prompt)
    if not ids:
        raise UserError("the prompt is empty after tokenization")
    # generate() refuses prompt + new tokens beyond block_size (the RoPE table and the
    # positions stop there), so a completion is cut to the room left: a 60-token prompt on
    # the 64-token `tiny` model gets at most 4 new tokens, whatever --max-new-tokens says.
    room = model.config.block_size - len(ids)
    if room < 1:
        raise UserError(f"the prompt is {len(ids)} tokens; the model's context is "
                        f"{model.config.block_size}: shorten it")
    # top_k 0 on the command line means "no cut", as None does for sample_next. The seed
    # drives a torch.Generator of generate's own (model.py), so the global RNG is not
    # touched: a fixed --seed repeats the text -- on one device type, since the CPU and CUDA
    # generators draw different streams from the same seed. eos_id: stop when the model
    # emits <|endoftext|>, the token that separates the training documents.
    new = model.generate(ids, min(args.max_new_tokens, room), temperature=args.temperature,
                         top_k=args.top_k or None, top_p=args.top_p, seed=seed,
                         eos_id=enc.eot_token if args.stop_at_eot else None)
    if new and new[-1] == enc.eot_token:
        new = new[:-1]                    # the end-of-text token is not text
    # Byte-level BPE: a completion cut inside a multi-byte UTF-8 character (the token
    # budget ran out there) decodes its partial bytes as U+FFFD, tiktoken's "replace".
    return enc.decode(new)


def answer(model, enc, prompt, args):
    """Print num_samples completions of one prompt; sample i uses seed + i."""
    # input() returns one line and code prompts span several: a typed backslash-n is a
    # newline (piped prompts follow the same rule, one prompt per line).
    prompt = prompt.replace("\\n", "\n")
    # Sample i uses seed + i: every sample its own stream, and any one is reproducible
    # alone (--seed S+i --num-samples 1 prints sample i again). At --temperature 0 every
    # sample is the same argmax path whatever the seed (tests/test_sample.py).
    for i in range(args.num_samples):
        text = complete(model, enc, prompt, args, args.seed + i)
        if args.num_samples > 1:
            print(f"---- sample {i + 1}/{args.num_samples} ----")
        print(prompt + text if args.echo else text, flush=True)


def prompts_from_stdin():
    """Typed prompts (with a "> " cue on a terminal) or piped lines, until an empty line
    on a terminal or the end of the input."""
    # A generator: one line is read, answered and printed before the next is read, so a
    # terminal session and a pipe both see each completion as soon as it exists. On a
    # terminal an empty line quits; in a pipe blank lines are skipped and only the end of
    # the input stops, so a prompt file with blank separators works.
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            return
        if interactive and not line:
            return
        if line:
            yield line


# ----------------------------------------------------------------------------------------
# The command line: every knob once, a row each (flag, default, help; core/cli.py makes
# the flags, --help and the "did you mean" line from this table)

# The defaults match train.py's end-of-run sample (temperature 0.8, top-k 50), so the
# completions look like the one a training run prints (not the same text: train.py
# samples with its own --seed, 1337 by default).
KNOBS = [
    knob("--checkpoint", "out/ckpt.pt", "a checkpoint file or a Hugging Face Llama folder"),
    knob("--prompt", None, "one prompt, then exit; when not given: read prompts from stdin"),
    knob("--num-samples", 1, "completions per prompt"),
    knob("--max-new-tokens", 200, "tokens per completion (fewer if the context ends first)"),
    knob("--temperature", 0.8, "0 = greedy"),
    knob("--top-k", 50, "0 = no top-k cut"),
    knob("--top-p", float, "nucleus sampling mass in (0, 1]; when not given: no nucleus cut"),
    knob("--seed", 0, "sample i of a prompt uses seed + i"),
    knob("--echo", True, "print the prompt before its completion (--no-echo: the completion "
         "alone, e.g. to pipe it on)", action=argparse.BooleanOptionalAction),
    knob("--no-stop", True, "keep going past the end-of-text token (when not given: stop "
         "there)", dest="stop_at_eot", action="store_false"),
    knob("--device", "auto", "auto, cpu or cuda"),
    knob("--threads", 1, "CPU threads: decoding a small model is one small matmul after "
         "another, so more threads mostly add synchronisation (measured: 200 tokens of "
         "`small` in 1.5 s on 1 thread, 18 s on 2 busy cores)"),
]


def check_args(args):
    """The counts that must be >= 1 and the sampling knobs' ranges, one line each."""
    if args.num_samples < 1 or args.max_new_tokens < 1 or args.threads < 1:
        raise UserError("--num-samples, --max-new-tokens and --threads must be at least 1")
    # A negative T would flip the distribution (the least likely token first).
    if args.temperature < 0 or args.top_k < 0:
        raise UserError("--temperature and --top-k must be >= 0")
    # top_p 0 drops every token, the most likely one too (sample_next keeps a token while
    # the mass before it is below p): all -inf, NaN probabilities, and multinomial fails.
    # top_p 1 keeps everything (sample_next then skips the sort).
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1], got {args.top_p}")
    return args


def parse_args(argv=None):
    p = command_line("Sample completions from a checkpoint: one --prompt, or a prompt loop "
                     "on standard input.", {None: KNOBS}, prog="sample.py")
    return check_args(p.parse_args(argv))


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    # load_model reads a train.py checkpoint, a quantize.py one (dequantized back into a
    # plain GPT) or a Hugging Face folder (safetensors); files go through
    # torch.load(weights_only=True), so a checkpoint someone sent cannot run code on load.
    model, ckpt = load_model(args.checkpoint, pick_device(args.device))
    if "tokenizer" not in ckpt:
        raise UserError(f"{args.checkpoint} carries no tokenizer: sample.py needs one to "
                        "turn text into tokens")
    enc = data.encoding_from_state(ckpt["tokenizer"])
    # generate() already runs under no_grad; eval() is for modules that act differently
    # in training (none in this GPT today -- no dropout -- but a hand-added one would).
    model.eval()
    if args.prompt is not None:
        return answer(model, enc, args.prompt, args)
    for prompt in prompts_from_stdin():
        try:
            answer(model, enc, prompt, args)
        except UserError as e:            # a bad prompt ends that prompt, not the session
            print(f"error: {e}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    run_cli(main)
