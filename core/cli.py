"""
core/cli.py -- the command line every script shares: flags that fail in one line, --help
with one default per flag, and numbers written for people.

  - ArgumentParser: a bad flag raises UserError (one `error:` line per job, exit 2, through
    run_cli) and a mistyped one is named with its nearest real flag ("did you mean");
  - HelpFormatter:  "(default: X)" exactly once per flag;
  - fmt_bytes / fmt_count / fmt_duration: 12.1 MB, 3.9M, 3m05s in every log line.
"""
import argparse
import difflib
import sys

from core.errors import UserError


def fmt_duration(seconds):
    """12 s, 3m05s, 1h02m: elapsed times and estimates in log lines."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def require_at_least_one(args, names):
    """One clear message for a count flag (steps, batch size, ...) below 1."""
    for name in names:
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got "
                            f"{getattr(args, name)}")


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
