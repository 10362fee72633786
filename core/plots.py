"""
core/plots.py -- figures without a plotting dependency: SVG written by hand with the standard
library, saved under out/plots/, and the same data rendered in the terminal. A part of the
foundation beside core/meters.py (drawing a result, not measuring or running one). Every plotted
point is one <circle class="point"> and every bar one <rect class="bar">, so a test can
count what was drawn (tests/test_evaluate.py). Used by evaluate.py and scripts/contamination.py.
"""
import os

PLOT_DIR = os.path.join("out", "plots")
PLOT_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")
_W, _H, _PAD = 640, 400, 60          # canvas and margin, pixels


def _esc(text):
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;") \
        .replace('"', "&quot;")


def _ticks(lo, hi, n=5):
    return [lo + (hi - lo) * i / (n - 1) for i in range(n)]


def _svg_frame(title, xlabel, ylabel, ylo, yhi, xticks):
    """Canvas, title, axes, y ticks and the given x ticks [(pixel x, label)]."""
    x0, x1, y0, y1 = _PAD, _W - _PAD / 2, _H - _PAD, _PAD / 2 + 10
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" '
           f'viewBox="0 0 {_W} {_H}" font-family="sans-serif" font-size="11">',
           f'<rect x="0" y="0" width="{_W}" height="{_H}" fill="white"/>',
           f'<text x="{_W / 2}" y="16" text-anchor="middle" font-size="13">{_esc(title)}</text>',
           f'<line x1="{x0}" y1="{y0}" x2="{x1}" y2="{y0}" stroke="black"/>',
           f'<line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y1}" stroke="black"/>',
           f'<text x="{(x0 + x1) / 2}" y="{_H - 12}" text-anchor="middle">{_esc(xlabel)}</text>',
           f'<text x="14" y="{(y0 + y1) / 2}" text-anchor="middle" '
           f'transform="rotate(-90 14 {(y0 + y1) / 2})">{_esc(ylabel)}</text>']
    for v in _ticks(ylo, yhi):
        py = y0 - (v - ylo) / ((yhi - ylo) or 1) * (y0 - y1)
        out.append(f'<text x="{x0 - 4}" y="{py + 4:.1f}" text-anchor="end">{v:.3g}</text>')
        out.append(f'<line x1="{x0}" y1="{py:.1f}" x2="{x1}" y2="{py:.1f}" stroke="#eee"/>')
    for px, label in xticks:
        out.append(f'<text x="{px:.1f}" y="{y0 + 14}" text-anchor="middle">{_esc(label)}</text>')
    return out, (x0, x1, y0, y1)


def _legend(names, x1, y1):
    out = []
    for i, name in enumerate(names):
        color, y = PLOT_COLORS[i % len(PLOT_COLORS)], y1 + 14 * i
        out.append(f'<rect x="{x1 - 150}" y="{y}" width="10" height="10" fill="{color}"/>')
        out.append(f'<text x="{x1 - 136}" y="{y + 9}">{_esc(name)}</text>')
    return out


def _save_svg(name, parts, directory):
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name if name.endswith(".svg") else name + ".svg")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(parts + ["</svg>"]) + "\n")
    return path


def _span(values, lo=None, hi=None):
    lo = min(values) if lo is None else lo
    hi = max(values) if hi is None else hi
    return (lo, hi) if hi > lo else (lo - 0.5, hi + 0.5)


def svg_line_plot(name, series, title="", xlabel="", ylabel="", xlim=None, ylim=None,
                  directory=PLOT_DIR):
    """series: {label: [(x, y), ...]}. One polyline and one circle per point per series
    (NaN points are skipped). -> the path written."""
    points = {k: [(x, y) for x, y in v if x == x and y == y] for k, v in series.items()}
    xs = [x for v in points.values() for x, _ in v] or [0.0]
    ys = [y for v in points.values() for _, y in v] or [0.0]
    xlo, xhi = _span(xs, *(xlim or (None, None)))
    ylo, yhi = _span(ys, *(ylim or (None, None)))
    sx = lambda x: _PAD + (x - xlo) / (xhi - xlo) * (_W - 1.5 * _PAD)
    parts, (x0, x1, y0, y1) = _svg_frame(title, xlabel, ylabel, ylo, yhi,
                                         [(sx(v), f"{v:.3g}") for v in _ticks(xlo, xhi)])
    sy = lambda y: y0 - (y - ylo) / (yhi - ylo) * (y0 - y1)
    for i, (label, pts) in enumerate(points.items()):
        color = PLOT_COLORS[i % len(PLOT_COLORS)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{color}"/>')
        parts += [f'<circle class="point" cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" '
                  f'fill="{color}"><title>{_esc(label)}: ({x:.4g}, {y:.4g})</title></circle>'
                  for x, y in pts]
    return _save_svg(name, parts + _legend(points, x1, y1), directory)


def svg_bar_chart(name, labels, series, title="", xlabel="", ylabel="", ymax=None,
                  diagonal=False, directory=PLOT_DIR):
    """labels: one per category; series: {name: [value per category]} drawn as grouped
    bars, one rect per value (a histogram is one series). diagonal: the line from the
    bottom-left to the top-right corner (a reliability diagram's perfect calibration when
    the categories are equal-width confidence bins and ymax = 1). -> the path written."""
    values = [v for vs in series.values() for v in vs] or [0.0]
    yhi = ymax if ymax is not None else max(max(values), 1e-12)
    slot = (_W - 1.5 * _PAD) / max(len(labels), 1)
    parts, (x0, x1, y0, y1) = _svg_frame(
        title, xlabel, ylabel, 0.0, yhi,
        [(_PAD + slot * (i + 0.5), lab) for i, lab in enumerate(labels)])
    width = 0.8 * slot / max(len(series), 1)
    for s, (label, vs) in enumerate(series.items()):
        color = PLOT_COLORS[s % len(PLOT_COLORS)]
        for i, v in enumerate(vs):
            h = max(0.0, min(v, yhi)) / yhi * (y0 - y1) if v == v else 0.0
            x = _PAD + slot * (i + 0.1) + s * width
            parts.append(f'<rect class="bar" x="{x:.1f}" y="{y0 - h:.1f}" width="{width:.1f}" '
                         f'height="{h:.1f}" fill="{color}"><title>{_esc(label)} '
                         f'{_esc(labels[i])}: {v:.4g}</title></rect>')
    if diagonal:
        parts.append(f'<line x1="{x0}" y1="{y0}" x2="{x1}" y2="{y1}" stroke="gray" '
                     f'stroke-dasharray="4,3"/>')
    return _save_svg(name, parts + _legend(series, x1, y1), directory)


def terminal_plot(series, width=60, height=14, xlim=None, ylim=None):
    """The same {label: [(x, y)]} as a character grid: series i drawn with letter i."""
    points = {k: [(x, y) for x, y in v if x == x and y == y] for k, v in series.items()}
    xs = [x for v in points.values() for x, _ in v] or [0.0]
    ys = [y for v in points.values() for _, y in v] or [0.0]
    xlo, xhi = _span(xs, *(xlim or (None, None)))
    ylo, yhi = _span(ys, *(ylim or (None, None)))
    grid = [[" "] * width for _ in range(height)]
    for i, pts in enumerate(points.values()):
        for x, y in pts:
            col = round((x - xlo) / (xhi - xlo) * (width - 1))
            row = round((yhi - y) / (yhi - ylo) * (height - 1))
            if 0 <= col < width and 0 <= row < height:
                grid[row][col] = "abcdefghij"[i % 10]
    lines = [f"{yhi:8.3g} |" + "".join(grid[0])]
    lines += ["         |" + "".join(r) for r in grid[1:-1]]
    lines += [f"{ylo:8.3g} |" + "".join(grid[-1]), "         +" + "-" * width,
              f"          {xlo:<10.3g}{' ' * (width - 20)}{xhi:>10.3g}"]
    lines += [f"          {'abcdefghij'[i % 10]} = {k}" for i, k in enumerate(points)]
    return "\n".join(lines)


def terminal_bars(labels, series, width=40, vmax=None):
    """Horizontal bars, one line per (category, series)."""
    values = [v for vs in series.values() for v in vs if v == v] or [0.0]
    top = vmax if vmax is not None else max(max(values), 1e-12)
    wide = max(len(str(lab)) for lab in labels) if labels else 0
    lines = []
    for i, lab in enumerate(labels):
        for name, vs in series.items():
            v = vs[i] if vs[i] == vs[i] else 0.0
            bar = "#" * round(max(0.0, min(v, top)) / top * width)
            lines.append(f"{str(lab):>{wide}} {name[:12]:<12} |{bar:<{width}}| {vs[i]:.3g}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(__doc__.strip())
    print("\nplots.py is a library: `python -m scripts.calibration` draws with it.")
