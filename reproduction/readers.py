"""
reproduction/readers.py -- reading a figure out of what a command printed: a table cell by
its row label and column, a regex's first group, the last match of a logged series, a
ratio or difference of two figures, a test's outcome. reproduction/tradeoffs.py names, for
every run, which reader takes which figure; nothing here runs a command.
"""
import re



def cell(label, column, after=None):
    """The `column`-th cell (0 = the first after the label) of the table line that starts
    with `label` -- cells are separated by two or more spaces, as our tables print them.
    `after`: search only below the first line containing this text (a second table)."""
    # Our tables align columns with runs of spaces and put single spaces inside a cell
    # ("920.1 KB"), so two or more spaces is the separator; the label is matched at the
    # start of the stripped line because the tables right-align some labels.
    def read(output):
        if after is not None:
            at = output.find(after)
            if at < 0:
                return None
            output = output[at:]
        for line in output.splitlines():
            if line.strip().startswith(label):
                rest = line.strip()[len(label):].strip()
                cells = re.split(r"\s{2,}", rest)
                return cells[column] if column < len(cells) else None
        return None
    return read


def md_cell(first_cells, column):
    """Cell `column` (0 = the first) of the Markdown table row that begins with
    `first_cells` (e.g. "| rtn | int4 g32 |"): the first such row."""
    def read(output):
        for line in output.splitlines():
            if line.startswith(first_cells):
                cells = [c.strip() for c in line.strip().strip("|").split("|")]
                return cells[column] if column < len(cells) else None
        return None
    return read


def grab(pattern):
    """The first group of the regex's first match (re.S off: one line at a time)."""
    def read(output):
        m = re.search(pattern, output)
        return m.group(1) if m else None
    return read


def last(pattern):
    """The first group of the regex's LAST match: the final value of a logged series."""
    def read(output):
        found = re.findall(pattern, output)
        return found[-1] if found else None
    return read


def combine(read_a, read_b, op, fmt):
    """op(a, b) of two figures printed with units, formatted; None if either is missing."""
    def read(output):
        a, b = read_a(output), read_b(output)
        if a is None or b is None:
            return None
        return fmt.format(op(number(a), number(b)))
    return read


def ratio(read_a, read_b, fmt="{:.2f}"):
    """a / b of two figures printed with units (KB, MB, ms): the same unit on both sides."""
    return combine(read_a, read_b, lambda a, b: a / b, fmt)


def difference(read_a, read_b, fmt="{:+.2f}"):
    """a − b of two printed figures (a loss against the reference row's)."""
    return combine(read_a, read_b, lambda a, b: a - b, fmt)


def test_result(node):
    """How the test (every case of a parametrised one) ended, from pytest -v's lines:
    "passed (N cases)"; "collected" under --collect-only (the --quick twin); None if any
    case failed or the test is not there -- a gap in the table, as a missing figure is.
    pytest names a test by its path from the folder it runs in (../../repo/tests/... from
    a workdir elsewhere), so the node id is found inside the line, ending at its name."""
    verdict = re.compile(re.escape(node) + r"(?:\[[^\]]*\])?(?: (PASSED|FAILED|ERROR)|$)")

    def read(output):
        found = [m.group(1) for line in output.splitlines()
                 if (m := verdict.search(line.strip()))]
        if not found or any(v in ("FAILED", "ERROR") for v in found):
            return None
        if all(v == "PASSED" for v in found):
            return f"passed ({len(found)} case{'s' * (len(found) > 1)})"
        if all(v is None for v in found):
            return "collected"
        return None
    return read


def number(text):
    """12.5 MB -> 12.5e6, 1,536 -> 1536, 63% -> 63: a printed figure as a float."""
    m = re.match(r"\s*([-+]?[\d,]*\.?\d+(?:e[-+]?\d+)?)\s*([KMGT]?)B?", text)
    if not m:
        raise ValueError(f"not a figure: {text!r}")
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}[m.group(2)]
    return float(m.group(1).replace(",", "")) * scale


# ----------------------------------------------------------------------------------------
# The runs, in the README's order


def table_figures(rows, columns):
    """{f"{key}_{col}": cell(label, i)} for every row label and named column."""
    return {f"{key}_{col}": cell(label, i) for key, label in rows.items()
            for col, i in columns.items()}
