"""
Run each command line given on argv (e.g. "quantize.py gptq", "-m scripts.serve_bench") twice in this one process --
with --help, and with a mistyped flag -- and print one JSON object per command: the exit
statuses, each flag's help entry, and what the mistyped flag printed. tests/test_cli.py
starts it once for every script (importing torch once instead of thirty times).
"""
import contextlib
import io
import json
import os
import re
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(argv):
    """-> (exit status, everything printed) of `python argv...` (a script of the repo, or
    `-m package.module` as run from the repo root), run in this process."""
    out = io.StringIO()
    module = argv[1] if argv[0] == "-m" else None
    if module:
        argv = [os.path.join(ROOT, *module.split(".")) + ".py", *argv[2:]]
    sys.argv = list(argv)
    status = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            if module:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(os.path.join(ROOT, argv[0]), run_name="__main__")
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return status, out.getvalue()


def flag_entries(help_text):
    """The option entries of an argparse help: '  --steps N  help text...' with its
    continuation lines, whitespace collapsed; -h/--help itself left out."""
    entries = re.split(r"\n(?=  {1,4}-)", help_text)
    flat = [" ".join(e.split()) for e in entries]
    return [e for e in flat if e.startswith("-") and not e.startswith("-h")]


def main():
    sys.path.insert(0, ROOT)
    for spec in sys.argv[1:]:
        argv = spec.split()
        help_status, help_text = run(argv + ["--help"])
        typo_status, typo_text = run(argv + ["--stpes", "10"])
        print(json.dumps(dict(spec=spec, help_status=help_status, help=help_text,
                              flags=flag_entries(help_text), typo_status=typo_status,
                              typo=typo_text)), flush=True)


if __name__ == "__main__":
    main()
