"""
reproduce.py: every run's command still runs (at --quick sizes) and every cell of the
trade-off table fills from what it printed; a figure that went missing is shown as missing,
never carried over; the table says when, where and at which commit it was measured.
"""
import re

import pytest

import reproduce
from reproduction import readers, tradeoffs
from core.errors import UserError


def test_readers_take_figures_from_tables_and_lines():
    out = ("bench: preset tiny, attention math, 4×32 tokens/step/rank\n"
           "baseline fp32                     920.1 KB       1.2 MB   1.00       10\n"
           "| rtn | int4 g32 | 4.750 | 146.3 KB |\n"
           "step 10 | val loss 6.1\nstep 20 | val loss 5.9\n")
    assert readers.cell("baseline fp32", 1)(out) == "1.2 MB"
    assert readers.cell("baseline fp32", 9)(out) is None           # no such column
    assert readers.md_cell("| rtn | int4 g32 |", 3)(out) == "146.3 KB"
    assert readers.grab(r"(\d+×\d+) tokens")(out) == "4×32"
    assert readers.last(r"val loss ([\d.]+)")(out) == "5.9"
    assert readers.ratio(readers.cell("baseline fp32", 0),
                           readers.cell("baseline fp32", 1))(out) == "0.77"
    assert readers.number("1,536") == 1536 and readers.number("2.5 MB") == 2.5e6
    ran = readers.test_result("tests/a.py::t")
    assert ran("../r/tests/a.py::t[x] PASSED [50%]\n../r/tests/a.py::t_b FAILED\n") == \
        "passed (1 case)"                        # t_b is another test
    assert ran("tests/a.py::t[x] PASSED\ntests/a.py::t[y] FAILED\n") is None
    assert ran("tests/a.py::t[x]\ntests/a.py::t[y]\n") == "collected"


def test_a_missing_figure_is_marked_and_listed_never_invented(tmp_path):
    path = tmp_path / "t.md"
    results = {"train_bench": {"status": 0, "seconds": 1.0,
                               "figures": {"base_state": "920.1 KB", "base_act": None}}}
    stamp = reproduce.provenance(quick=True, seconds=1.0, commit="abc1234")
    gaps = reproduce.write_table(str(path), results, stamp)
    text = path.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| fp32 baseline"))
    assert "920.1 KB" in row and reproduce.MISSING in row
    assert any("train_bench.base_act" in m for _, m in gaps)
    assert any("dp.ddp_state (not run)" in m for _, m in gaps)      # a run not made
    assert re.search(r"Measured by `python reproduce.py --quick` on \d{4}-\d\d-\d\d: .*"
                     r"CPU cores.*torch .*; commit abc1234; ", text)


def test_every_placeholder_names_a_figure_its_run_reads():
    for technique, *cells in tradeoffs.ROWS:
        for run, figure in re.findall(r"\{(\w+)\.(\w+)\}", "".join([technique, *cells])):
            assert run in tradeoffs.RUN_BY_NAME, (technique, run)
            assert figure == "cmd" or figure in tradeoffs.RUN_BY_NAME[run].figures, \
                (technique, run, figure)


def test_only_refuses_an_unknown_run_and_adds_what_a_run_needs():
    with pytest.raises(UserError, match="no run named nope"):
        reproduce.chosen_runs("lora,nope")
    assert [r.name for r in reproduce.chosen_runs("spec")] == ["demo", "draft", "spec"]


@pytest.mark.slow
def test_quick_runs_every_command_and_fills_every_cell(tmp_path, capsys):
    out = tmp_path / "tradeoffs.md"
    result = reproduce.main(["--quick", "--out", str(out)])
    failed = {name: r["status"] for name, r in result["results"].items() if r["status"]}
    assert not failed, (failed, capsys.readouterr().out[-3000:])
    assert set(result["results"]) == set(tradeoffs.RUN_BY_NAME)
    assert result["gaps"] == [], result["gaps"]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + len(tradeoffs.ROWS)                      # header + one per row
    assert reproduce.MISSING not in out.read_text()


def test_a_run_that_writes_over_the_demo_model_is_named(tmp_path):
    demo = tmp_path / "ckpt.pt"
    demo.write_bytes(b"demo")
    guard = reproduce.DemoGuard(str(demo))
    guard.check(tradeoffs.RUN_BY_NAME["demo"], [])
    guard.check(tradeoffs.RUN_BY_NAME["lora"], [])
    assert guard.changed_by == ""
    demo.write_bytes(b"another model")
    guard.check(tradeoffs.RUN_BY_NAME["quantize"], ["rl"])
    assert guard.changed_by == "quantize or rl"


def test_two_reproductions_merge_into_one_table_keeping_both_stamps(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    run = {"status": 0, "seconds": 1.0, "figures": {"base_state": "63.0 MB"}}
    reproduce.save_figures(str(a), {"train_bench": run}, "stamp A")
    reproduce.save_figures(str(b), {"mla": {**run, "figures": {"mla_bytes": "3,456"}}},
                           "stamp B")
    out = tmp_path / "t.md"
    result = reproduce.main(["--merge", f"{a},{b}", "--out", str(out)])
    text = out.read_text()
    assert "Runs train_bench: stamp A" in text and "Runs mla: stamp B" in text
    assert "63.0 MB" in text and "3,456" in text
    assert set(result["results"]) == {"train_bench", "mla"}
    with pytest.raises(UserError, match="cannot read"):
        reproduce.main(["--merge", str(tmp_path / "nope")])


def test_a_run_made_again_later_is_credited_to_the_later_stamp(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    run = {"status": 0, "seconds": 1.0, "figures": {"mla_bytes": "3,456"}}
    reproduce.save_figures(str(a), {"train_bench": run, "mla": run}, "stamp A")
    reproduce.save_figures(str(b), {"mla": {**run, "figures": {"mla_bytes": "9,999"}}},
                           "stamp B")
    out = tmp_path / "t.md"
    reproduce.main(["--merge", f"{a},{b}", "--out", str(out)])
    text = out.read_text()
    assert "Runs train_bench: stamp A" in text and "Runs mla: stamp B" in text
    assert "9,999" in text and "3,456" not in text


def test_assumed_runs_are_not_run_and_satisfy_what_needs_them():
    names = [r.name for r in reproduce.chosen_runs("spec", assume="demo,draft")]
    assert names == ["spec"]
    with pytest.raises(UserError, match="--assume: no run named nope"):
        reproduce.chosen_runs("", assume="nope")


def test_a_run_whose_need_never_comes_is_refused_not_waited_on(tmp_path):
    args = reproduce.parse_args(["--quick"])
    args.jobs = 1
    spec = tradeoffs.RUN_BY_NAME["spec"]                # needs demo and draft, neither here
    with pytest.raises(UserError, match="runs wait on runs that will not come: spec"):
        reproduce.run_all([spec], args, str(tmp_path), {}, 0.0, lambda *_: None)
