"""
core/cli.py -- the command line every script shares: flags that fail in one line, --help
with one default per flag, and numbers written for people.

  - ArgumentParser: a bad flag raises UserError (one `error:` line per job, exit 2, through
    run_cli) and a mistyped one is named with its nearest real flag ("did you mean");
  - HelpFormatter:  "(default: X)" exactly once per flag;
  - Knob tables: each script states its settings once, a row per knob (flag, default,
    help: `knob`, `preset_knob`), and `command_line` turns the table into the parser;
  - fmt_bytes / fmt_count / fmt_duration: 12.1 MB, 3.9M, 3m05s in every log line.
"""
import argparse
import difflib
import sys
from dataclasses import dataclass

from core.errors import UserError


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag raises UserError (one `error:` line per job, exit 2, through
    run_cli) instead of printing usage on every rank and exiting. A mistyped flag is named
    (with the nearest real one), even before a positional mode: plain argparse would read
    `--stpes 10` as an unknown flag plus a mode "10" and complain about the mode."""

    def error(self, message):
        raise UserError(f"{self.prog}: {message} (see --help)")

    def parse_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        known = self._flags()
        for token in args:
            if token == "--":
                break
            name = token.split("=", 1)[0]
            # argparse takes unambiguous prefixes (--step for --steps): those are known
            if name.startswith("--") and not any(k.startswith(name) for k in known):
                near = difflib.get_close_matches(name, sorted(known), n=1)
                self.error(f"unknown flag {name}" + (f" (did you mean {near[0]}?)"
                                                     if near else ""))
        return super().parse_args(args, namespace)

    def _flags(self):
        """Every option string of this parser and of its subcommands."""
        flags, parsers = set(), [self]
        while parsers:
            parser = parsers.pop()
            for action in parser._actions:
                flags.update(action.option_strings)
                if isinstance(action, argparse._SubParsersAction):
                    parsers += list(action.choices.values())
        return flags


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with exactly one default per flag: argparse's "(default: X)" is added unless
    the help already says what happens by default, or the default is None (the help then
    says what "not given" means)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or "not given" in text or action.default is None:
            return text
        return super()._get_help_string(action)


def require_at_least_one(args, names):
    """One clear message for a count flag (steps, batch size, ...) below 1."""
    for name in names:
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got "
                            f"{getattr(args, name)}")


# ----------------------------------------------------------------------------------------
# Settings: each script states its knobs once, as a table of Knob rows (flag, default, help);
# one mechanism below turns the table into argparse flags, --help and the checks.

@dataclass(frozen=True)
class Knob:
    """One setting of a script, stated once: its flag(s), its default, its help. Made by
    `knob`; the type is the default's, so the table reads as flag -> value -> why."""
    flags: tuple            # ("--steps",) or several spellings: ("--checkpoint", "--ckpt")
    default: object
    help: str
    options: tuple = ()     # argparse's own extras, as (name, value) pairs: choices, dest...

    @property
    def dest(self):
        """The attribute on the parsed namespace: --n-layer -> args.n_layer."""
        return dict(self.options).get("dest") or self.flags[0].lstrip("-").replace("-", "_")

    def add_to(self, parser):
        options = dict(self.options)
        if self.default is False:          # an on/off switch
            options["action"] = "store_true"
        elif isinstance(self.default, type):   # no default: the help says what None means
            options.setdefault("type", self.default)
        elif self.default is not None and "action" not in options:
            options.setdefault("type", type(self.default))
        default = None if isinstance(self.default, type) else self.default
        parser.add_argument(*self.flags, default=default, help=self.help, **options)


def knob(flags, default, help, **options):
    """flags: "--steps", or "--checkpoint --ckpt" (the first names it). default: a value, whose
    type becomes the flag's (False: a switch); or a type (int, float, str) for a knob that
    has no default -- None, and its help says what "not given" means. options: argparse's
    choices, dest, metavar, nargs."""
    return Knob(tuple(flags.split()), default, help, tuple(options.items()))


def preset_knob(flags, kind, what, **options):
    """A model setting that the preset decides unless the flag is given: --n-layer 4 on
    --preset small is small with 4 layers (model.get_config ignores the Nones)."""
    return knob(flags, kind, f"override the preset's {what} (not given: the preset's)",
                **options)


def add_knobs(parser, knobs, title=None):
    """Every knob of a table as a flag, under a --help heading when `title` is given."""
    target = parser.add_argument_group(title) if title else parser
    for k in knobs:
        k.add_to(target)
    return parser


def command_line(description, groups, formatter=None, prog=None):
    """A parser from {heading: [knobs]}, in order: what every script's parse_args builds
    (prog: the name --help shows, when it is not the file's: python -m scripts.NAME)."""
    p = ArgumentParser(prog=prog, description=description,
                       formatter_class=formatter or HelpFormatter)
    for title, knobs in groups.items():
        add_knobs(p, knobs, title)
    return p


def given(args, knobs):
    """{dest: value} of the knobs the user gave (not None): the overrides of a preset."""
    return {k.dest: getattr(args, k.dest) for k in knobs if getattr(args, k.dest) is not None}


# ----------------------------------------------------------------------------------------
# Numbers written for people

def fmt_bytes(n):
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000  # decimal units, like the papers' "16 GB for 1B parameters"


def fmt_count(n):
    for unit in ("", "k", "M", "B", "T"):
        if abs(n) < 1000 or unit == "T":
            return f"{n:.1f}{unit}" if unit else f"{n:.0f}"
        n /= 1000


def fmt_duration(seconds):
    """12 s, 3m05s, 1h02m: elapsed times and estimates in log lines."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
