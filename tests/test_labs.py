"""
labs.py and labs/*.md kept true: every lab parses, every lab's patch still applies to the
current files (a patch that no longer fits fails here, naming the lab), a copy of the tree
leaves out virtual environments and what git ignores but keeps the reader's files, a knob
lab's recorded figures come back, and a fixed subset of break labs -- about one per topic
family -- is caught by its tests on a patched copy and not on an untouched one (what
`python labs.py check` does for all of them, docs/labs.md).
"""
import os
import shutil
import subprocess

import pytest

import labs
from core.errors import UserError

# one break lab per topic family, the cheapest of each (the full check: docs/labs.md):
# the data, the model, training, the optimizer, parallelism, adapters, RL, serving
CHECKED = ["curate-min-rule-removes-at-the-threshold", "model-gqa-repeat-not-interleave",
           "train-accum-no-divide", "optim-ns-wrong-coefficient", "parallel-zb-w-overwrites",
           "lora-alpha-not-divided", "rl-k3-flipped", "spec-residual-not-renormalised"]
RUN = "optim-muon-one-ns-step"          # a knob lab whose command takes a few seconds


@pytest.fixture(scope="module")
def every_lab():
    return labs.all_labs()


def test_every_lab_parses_with_what_its_kind_needs(every_lab):
    assert len({lab.name for lab in every_lab}) == len(every_lab)
    for lab in every_lab:
        assert lab.question and lab.kind in labs.KINDS, lab.name
        if lab.kind == "break":
            assert lab.patch and lab.tests and lab.fires, lab.name
            assert all("::" in t or t.endswith(".py") for t in lab.tests), lab.name
        else:
            assert lab.command and lab.figure and (lab.patch or lab.flags), lab.name
            float(lab.before), float(lab.after), float(lab.spread)     # numbers


def test_every_patch_still_applies(every_lab, tmp_path):
    """Applied to a copy of just the files each patch touches: fast, and it fails with the
    lab's name when the code under a lab has changed."""
    for lab in every_lab:
        if not lab.patch:
            continue
        root = tmp_path / lab.name
        for path in labs.parse_patch(lab.patch):
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(os.path.join(labs.ROOT, path), root / path)
        labs.apply_patch(lab.patch, str(root), lab.name)
        for path in labs.parse_patch(lab.patch):      # and it changed something
            assert (root / path).read_text() != open(os.path.join(labs.ROOT, path)).read()


def test_a_stale_patch_is_one_line_naming_the_lab(tmp_path):
    (tmp_path / "f.py").write_text("a = 1\nb = 2\n")
    stale = "--- a/f.py\n+++ b/f.py\n@@ -1,1 +1,1 @@\n-a = 3\n+a = 4\n"
    with pytest.raises(UserError, match="lab old-one: its patch no longer applies to f.py"):
        labs.apply_patch(stale, str(tmp_path), "old-one")
    fresh = "--- a/f.py\n+++ b/f.py\n@@ -2,1 +2,1 @@\n-b = 2\n+b = 5\n"
    labs.apply_patch(fresh, str(tmp_path), "new-one")
    assert (tmp_path / "f.py").read_text() == "a = 1\nb = 5\n"


def test_a_lab_missing_a_field_is_refused_by_name(tmp_path):
    (tmp_path / "t.md").write_text("## t-broken\nkind: break\nquestion: what if?\n")
    with pytest.raises(UserError, match="t-broken.*needs a patch, tests and fires"):
        labs.parse_labs(str(tmp_path / "t.md"))


def test_the_subset_names_real_labs_of_several_topics(every_lab):
    by_name = {lab.name: lab for lab in every_lab}
    assert all(by_name[n].kind == "break" for n in CHECKED)
    assert len({by_name[n].topic for n in CHECKED}) == len(CHECKED)     # one per topic
    assert by_name[RUN].kind == "knob"


def reader_tree(root, git):
    """A reader's checkout in miniature: a tracked file, their own new file, a git-ignored
    folder, out/, and a virtual environment under a name no ignore rule knows (a 4 MB
    dummy in it, as torch would be). -> the paths a copy must have and must not have."""
    for rel, size in (("model.py", 0), ("mine.py", 0), ("scratch/big.bin", 1 << 20),
                      ("out/ckpt.pt", 1 << 20), ("env-3.12/pyvenv.cfg", 0),
                      ("env-3.12/lib/torch.so", 4 << 20)):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * size)
    (root / ".gitignore").write_text("scratch/\nout/\n")
    if git:      # tracked = in git's index; mine.py stays untracked, not ignored
        for command in (["init", "-q"], ["add", "model.py", ".gitignore"]):
            subprocess.run(["git", *command], cwd=root, env=labs.git_env(), check=True)
    kept = ["model.py", "mine.py", ".gitignore"]
    # without git there is no .gitignore to ask: scratch/ is copied, SKIP's out/ is not
    left = ["env-3.12", "out", ".git"] + (["scratch"] if git else [])
    return kept, left


@pytest.mark.parametrize("git", [True, False], ids=["git-checkout", "tarball"])
def test_a_copy_has_the_readers_files_and_no_venv_or_ignored_folder(tmp_path, git):
    """The reader's venv (found by its pyvenv.cfg, whatever its name) and what git ignores
    are never copied -- a venv with torch is ~1 GB per lab -- while tracked files and the
    reader's untracked ones are: a lab runs on their tree as it is."""
    if git and shutil.which("git") is None:
        pytest.skip("git is not installed: the tarball case covers the fall-back")
    kept, left = reader_tree(tmp_path / "tree", git)
    copy = labs.copy_repo(str(tmp_path / "copy"), root=str(tmp_path / "tree"))
    assert all(os.path.isfile(os.path.join(copy, rel)) for rel in kept), os.listdir(copy)
    assert not any(os.path.exists(os.path.join(copy, rel)) for rel in left), os.listdir(copy)


@pytest.mark.slow
def test_break_labs_are_caught_and_the_tree_is_untouched(capsys):
    before = {p: os.path.getmtime(os.path.join(labs.ROOT, p))
              for p in os.listdir(labs.ROOT) if p.endswith(".py")}
    # one control run for all, then each lab, two at a time (--jobs 2: the same verdicts)
    labs.main(["check", "--jobs", "2", *CHECKED])
    out = capsys.readouterr().out
    assert f"{len(CHECKED)} of {len(CHECKED)} break labs caught" in out, out
    assert all(f"ok   {name}: caught" in out for name in CHECKED), out
    after = {p: os.path.getmtime(os.path.join(labs.ROOT, p)) for p in before}
    assert after == before                           # the reader's files: not touched


@pytest.mark.slow
def test_a_knob_lab_reproduces_its_recorded_figures(capsys):
    rows = labs.main(["run", RUN])[0]
    lab = next(lab for lab in labs.all_labs() if lab.name == RUN)
    for label, measured, recorded, _ in rows:
        assert abs(measured - float(recorded)) <= float(lab.spread), (label, measured)
    assert "within" in capsys.readouterr().out
