"""The reliability diagram of ``relign eval scorer=reader``: one self-contained SVG, no dependency.

The conventional picture (Guo et al. 2017; DeGroot and Fienberg 1983): the reader's top answers
binned by stated confidence, 10 equal-width bins as ``calib/ece`` uses. Top panel: each non-empty
bin's accuracy as a bar over the bin's width, its mean stated confidence as a dot at (confidence,
accuracy), and the diagonal where a calibrated reader's bars end. Bottom strip: how many samples
each bin holds, and apart from them, after a gap, the samples the reader found no answer in.
Those count in ``calib/ece`` as confidence 1 and wrong (``algorithms.scoring.top_answer``); they
are drawn apart, not in the last bin, so a reader that abstains is seen abstaining. The title's
ECE is over every sample, abstentions included: the number ``eval.json`` reports.

Every text is placed on a fixed grid with room for its longest value (counts up to 5 digits), and
the look is set by attributes, not classes, so the same markup reads alike inline in report.html
and opened on its own (``standalone``: with the SVG namespace). Hooks for tests and scripts:
``rect.rd-bar`` / ``circle.rd-dot`` / ``rect.rd-count`` per bin (``data-lo``, ``data-hi``,
``data-count``, ``data-accuracy``, ``data-confidence``), ``rect.rd-abstain`` (``data-count``),
``rect.rd-frame`` (the accuracy panel) and ``text.rd-*`` for every text.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from ..algorithms.scoring import Bin, ece, reliability_bins
from .util import PALETTE

W, H = 620, 430
X0, PW = 64, 300  # the plot's left edge and width: confidence 0..1
Y0, PH = 44, 250  # the accuracy panel's top and height: accuracy 1..0
CB, CH = 404, 48  # the count strip's baseline and its tallest bar
ABSTAIN_X = X0 + PW + 18  # the no-answer column, apart from the bins
LEGEND_X = X0 + PW + 70
FONT = 'font-family="sans-serif"'
MUTED, INK, GRID = "#57606a", "#24292f", "#d8dee4"
ACC, DOT, NONE = PALETTE[0], PALETTE[1], "#8c959f"


def _text(x: float, y: float, s: str, *, size: int = 10, anchor: str = "start", fill: str = MUTED, cls: str = "rd-text",
          extra: str = "") -> str:
    return (f'<text class="{cls}" x="{x:.1f}" y="{y:.1f}" {FONT} font-size="{size}" fill="{fill}" text-anchor="{anchor}"'
            f"{extra}>{html.escape(s)}</text>")


def reliability_svg(conf: Sequence[float], correct: Sequence[float], no_answer: Sequence[bool] | None = None, *,
                    bins: int = 10, standalone: bool = False) -> str:
    """The diagram of samples (``conf[i]``, ``correct[i]``, ``no_answer[i]``): the reader's top
    answer's confidence and correctness (an abstention's are 1 and 0), and whether it was none."""
    n = len(conf)
    no_answer = [bool(a) for a in (no_answer if no_answer is not None else [False] * n)]
    if not len(correct) == len(no_answer) == n:
        raise ValueError(f"{n} confidences, {len(correct)} outcomes, {len(no_answer)} no-answer flags")
    answered = [i for i in range(n) if not no_answer[i]]
    kept = reliability_bins([conf[i] for i in answered], [correct[i] for i in answered], bins)
    abstained = n - len(answered)
    total_ece = ece(conf, correct, bins)
    slot = PW / bins  # one bin's width in px, in both panels
    out = _header(n, abstained, total_ece, standalone)
    out += _accuracy_axes()
    out += _accuracy_marks(kept, slot)
    out += _count_strip(kept, abstained, slot)
    out += _legend(abstained)
    out.append("</svg>")
    return "".join(out) + ("\n" if standalone else "")


def _px(c: float) -> float:
    """The x of confidence ``c``."""
    return X0 + c * PW


def _py(a: float) -> float:
    """The y of accuracy ``a`` in the accuracy panel."""
    return Y0 + (1 - a) * PH


def _header(n: int, abstained: int, total_ece: float, standalone: bool) -> list[str]:
    """The ``<svg>`` opening tag, the white background and the title with the ECE over every sample."""
    ns = ' xmlns="http://www.w3.org/2000/svg"' if standalone else ""
    title = (f"ECE {total_ece:.3f} over {n} samples" + (f", {abstained} without an answer" if abstained else "")
             if n else "no samples")
    return [f'<svg{ns} class="reliability" viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" '
            f'aria-label="Reliability diagram: {html.escape(title)}">',
            f'<rect x="0" y="0" width="{W}" height="{H}" fill="#ffffff"/>',
            _text(16, 20, f"Reliability diagram: {title}", size=13, fill=INK, cls="rd-title", extra=' font-weight="600"')]


def _accuracy_axes() -> list[str]:
    """The accuracy panel: grid, ticks, the frame and the two axis labels."""
    out = []
    for k in range(6):
        v = k / 5
        out.append(f'<line x1="{X0}" x2="{X0 + PW}" y1="{_py(v):.1f}" y2="{_py(v):.1f}" stroke="{GRID}" stroke-width="0.6"/>')
        out.append(_text(X0 - 6, _py(v) + 3.5, f"{v:.1f}", anchor="end", cls="rd-tick"))
        out.append(_text(_px(v), Y0 + PH + 18, f"{v:.1f}", anchor="middle", cls="rd-tick"))
    out.append(f'<rect class="rd-frame" x="{X0}" y="{Y0}" width="{PW}" height="{PH}" fill="none" stroke="{MUTED}" '
               'stroke-width="0.8"/>')
    out.append(_text(20, Y0 + PH / 2, "accuracy of the bin", anchor="middle", cls="rd-axis",
                     extra=f' transform="rotate(-90 20 {Y0 + PH / 2:.1f})"'))
    out.append(_text(X0 + PW / 2, Y0 + PH + 34, "stated confidence of the reader's top answer", anchor="middle",
                     cls="rd-axis"))
    return out


def _accuracy_marks(kept: Sequence[Bin], slot: float) -> list[str]:
    """Each non-empty bin's accuracy bar, then the diagonal over the bars, then the confidence dots on top."""
    out = []
    for b in kept:
        if not b.count:
            continue
        tip = (f"{b.lo:.1f}-{b.hi:.1f}: {b.count} samples, accuracy {b.accuracy:.3f}, "
               f"mean stated confidence {b.confidence:.3f}")
        data = (f'data-lo="{b.lo:.2f}" data-hi="{b.hi:.2f}" data-count="{b.count}" data-accuracy="{b.accuracy!r}" '
                f'data-confidence="{b.confidence!r}"')
        out.append(f'<rect class="rd-bar" x="{_px(b.lo) + 1:.1f}" y="{_py(b.accuracy):.1f}" width="{slot - 2:.1f}" '
                   f'height="{PH * b.accuracy:.1f}" fill="{ACC}" fill-opacity="0.55" {data}>'
                   f"<title>{html.escape(tip)}</title></rect>")
    out.append(f'<line class="rd-diagonal" x1="{_px(0)}" y1="{_py(0)}" x2="{_px(1)}" y2="{_py(1)}" stroke="{INK}" '
               'stroke-width="1" stroke-dasharray="4 3"/>')
    for b in kept:
        if b.count:
            out.append(f'<circle class="rd-dot" cx="{_px(b.confidence):.1f}" cy="{_py(b.accuracy):.1f}" r="3.5" fill="{DOT}" '
                       f'data-count="{b.count}" data-confidence="{b.confidence!r}" data-accuracy="{b.accuracy!r}"/>')
    return out


def _count_strip(kept: Sequence[Bin], abstained: int, slot: float) -> list[str]:
    """The count strip: samples per bin, then the abstentions apart, all to the scale of the tallest."""
    tallest = max([abstained, *(b.count for b in kept)]) or 1
    out = [f'<line x1="{X0}" x2="{ABSTAIN_X + slot}" y1="{CB}" y2="{CB}" stroke="{MUTED}" stroke-width="0.8"/>',
           _text(X0 - 6, CB - CH / 2 + 3.5, "samples", anchor="end", cls="rd-axis")]
    for b in kept:
        if b.count:
            out += _count_bar(_px(b.lo), b.count, tallest, slot, ACC, "rd-count",
                              f'data-lo="{b.lo:.2f}" data-count="{b.count}"', f"{b.lo:.1f}-{b.hi:.1f}: {b.count} samples")
    if abstained:
        out += _count_bar(ABSTAIN_X, abstained, tallest, slot, NONE, "rd-abstain", f'data-count="{abstained}"',
                          f"{abstained} samples without an answer: confidence 1 and wrong in the ECE")
    out.append(_text(ABSTAIN_X + slot / 2, CB + 13, "no answer", size=9, anchor="middle", cls="rd-abstain-label"))
    return out


def _count_bar(x: float, count: int, tallest: int, slot: float, fill: str, cls: str, data: str, tip: str) -> list[str]:
    """One bar of the count strip at ``x``, ``count`` high against ``tallest``, with its count above it."""
    h = CH * count / tallest
    return [f'<rect class="{cls}" x="{x + 1:.1f}" y="{CB - h:.1f}" width="{slot - 2:.1f}" height="{h:.1f}" '
            f'fill="{fill}" {data}><title>{html.escape(tip)}</title></rect>',
            _text(x + slot / 2, CB - h - 3, str(count), size=9, anchor="middle", cls="rd-count-label")]


def _legend(abstained: int) -> list[str]:
    """The legend beside the plot, one line of text per row."""
    marks = {
        "bar": lambda y: f'<rect x="{LEGEND_X}" y="{y - 8}" width="12" height="9" fill="{ACC}" fill-opacity="0.55"/>',
        "dot": lambda y: f'<circle cx="{LEGEND_X + 6}" cy="{y - 4}" r="3.5" fill="{DOT}"/>',
        "diagonal": lambda y: (f'<line x1="{LEGEND_X}" x2="{LEGEND_X + 12}" y1="{y - 4}" y2="{y - 4}" stroke="{INK}" '
                               'stroke-dasharray="4 3"/>'),
        "abstain": lambda y: f'<rect x="{LEGEND_X}" y="{y - 8}" width="12" height="9" fill="{NONE}"/>',
    }
    out = []
    y = Y0 + 10
    for mark, lines in (("bar", ["accuracy of the bin"]), ("dot", ["mean stated confidence"]), ("diagonal", ["calibrated"]),
                        ("abstain", [f"no answer: {abstained}", "in the ECE as", "confidence 1, wrong"])):
        out.append(marks[mark](y))
        for line in lines:
            out.append(_text(LEGEND_X + 18, y, line, size=11, fill=INK, cls="rd-legend"))
            y += 18
    return out


__all__ = ["reliability_svg"]
