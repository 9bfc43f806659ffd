"""The static page (`index.html`, no JavaScript) gathering every picture and table of an inspection."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from html import escape
from pathlib import Path

from export.inspection.diversity import HeadStats, LayerDiversity
from export.inspection.embeddings import Neighbours
from export.inspection.layers import LayerStats

# Relative error; SDPA and the explicit path differ by fp32 rounding: ~1e-7-1e-6 measured (demo, tiny models).
RECOMPUTE_TOLERANCE = 1e-4

STYLE = """
body { font-family: sans-serif; margin: 2em; max-width: 1400px; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #bbb; padding: 0.2em 0.6em; text-align: right; }
th { background: #eee; }
td.text { text-align: left; font-family: monospace; white-space: pre; }
.flag { color: #b00020; font-weight: bold; }
.ok { color: #007a33; }
img { max-width: 100%; border: 1px solid #ddd; margin: 0.5em 0; }
pre { background: #f6f6f6; padding: 0.6em; white-space: pre-wrap; }
"""


@dataclass(frozen=True)
class Images:
    attention: list[Path]  # one per layer
    padding: Path
    diversity: Path
    layers: Path


@dataclass(frozen=True)
class Findings:
    source: str  # where the checkpoint came from
    texts: list[str]
    truncated: list[bool]
    recompute: list[float]  # per layer, relative error
    padding_weight: float
    diversity: list[LayerDiversity]
    min_jsd: float
    heads: list[HeadStats]
    layers: list[LayerStats]
    jump: float
    neighbours: list[Neighbours]
    images: Images

    def problems(self) -> list[str]:
        """Everything flagged, one line each; empty when the model looks healthy."""
        found = [
            f"layer {i}: recomputed attention output differs by {e:.3g} (relative)"
            for i, e in enumerate(self.recompute)
            if not e <= RECOMPUTE_TOLERANCE
        ]
        if self.padding_weight > 0:  # masked scores underflow to exactly 0 after the softmax
            found.append(f"padding receives attention weight {self.padding_weight:.3g}")
        found += [
            f"layer {d.layer}: all heads attend alike (max pairwise JSD {d.max_jsd:.3g} bits)"
            for d in self.diversity
            if d.flagged
        ]
        found += [f"{s.name}: {', '.join(s.flags)}" for s in self.layers if s.flags]
        return found


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Cells are already HTML; callers escape text."""
    head = "".join(f"<th>{h}</th>" for h in header)
    body = "".join("<tr>" + "".join(row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _td(value: object, css: str = "") -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return f'<td class="{css}">{escape(text)}</td>' if css else f"<td>{escape(text)}</td>"


def _img(path: Path, out: Path, alt: str) -> str:
    return f'<img src="{escape(path.relative_to(out).as_posix())}" alt="{escape(alt)}">'


def _summary(findings: Findings) -> str:
    problems = findings.problems()
    if not problems:
        return '<p class="ok">Nothing flagged.</p>'
    return "<ul>" + "".join(f'<li class="flag">{escape(p)}</li>' for p in problems) + "</ul>"


def _texts(findings: Findings) -> str:
    rows = []
    for i, (text, cut) in enumerate(zip(findings.texts, findings.truncated, strict=True)):
        note = " (cut to --max-tokens)" if cut else ""
        rows.append(f"<p>Text {i + 1}{note}:</p><pre>{escape(text)}</pre>")
    return "".join(rows)


def _attention(findings: Findings, out: Path) -> str:
    errors = _table(
        ["layer", "max |recomputed - real output| / max |real output|"],
        [
            [_td(i), _td(e, "" if e <= RECOMPUTE_TOLERANCE else "flag")]
            for i, e in enumerate(findings.recompute)
        ],
    )
    pictures = "".join(
        _img(p, out, f"attention of layer {i}") for i, p in enumerate(findings.images.attention)
    )
    return (
        "<h2>Attention</h2>"
        "<p>Weights recorded from the model's own forward. Check: each layer's output recomputed from the "
        "recorded weights and V against the output of the normal (fast) path:</p>"
        + errors
        + pictures
        + "<h3>Padding</h3><p>The texts run as one left-padded batch. Rows of padding queries are all "
        "masked; the softmax would make them uniform, so they are zeroed here and shown grey. Most weight "
        f"any query puts on a padding key: <b>{findings.padding_weight:.3g}</b>.</p>"
        + _img(findings.images.padding, out, "attention of the padded text")
    )


def _diversity(findings: Findings, out: Path) -> str:
    layers = _table(
        ["layer", "mean pairwise JSD (bits)", "max pairwise JSD (bits)", "all heads alike?"],
        [
            [
                _td(d.layer),
                _td(d.mean_jsd),
                _td(d.max_jsd),
                _td("yes" if d.flagged else "no", "flag" if d.flagged else ""),
            ]
            for d in findings.diversity
        ],
    )
    heads = _table(
        ["layer", "head", "mean entropy (bits)", "mean distance (tokens)"],
        [[_td(h.layer), _td(h.head), _td(h.entropy), _td(h.distance)] for h in findings.heads],
    )
    return (
        "<h2>Head diversity</h2>"
        f"<p>A layer is flagged when even its most different pair of heads is below {findings.min_jsd:g} bit "
        "of Jensen–Shannon divergence. Only queries with at least two visible keys count.</p>"
        + _img(findings.images.diversity, out, "head diversity")
        + layers
        + heads
    )


def _layer_stats(findings: Findings, out: Path) -> str:
    rows = [
        [
            _td(s.name),
            _td(s.mean),
            _td(s.std),
            _td(s.max_abs),
            _td(s.nan),
            _td(s.inf),
            _td("" if s.ratio is None else s.ratio),
            _td(", ".join(s.flags) or "-", "flag" if s.flags else ""),
        ]
        for s in findings.layers
    ]
    return (
        "<h2>Residual stream per layer</h2>"
        "<p>Real tokens only. Flagged on NaN/Inf or when the std changes by more than "
        f"x{findings.jump:g}.</p>"
        + _table(["after", "mean", "std", "max |x|", "NaN", "Inf", "std ratio", "flags"], rows)
        + _img(findings.images.layers, out, "residual stream statistics")
    )


def _neighbours(findings: Findings) -> str:
    rows = [
        [
            _td(n.token, "text"),
            _td(n.token_id),
            _td("   ".join(f"{t} ({s:.2f})" for t, s in n.neighbours), "text"),
        ]
        for n in findings.neighbours
    ]
    return (
        "<h2>Embedding neighbours</h2><p>Cosine similarity in the token-embedding table (the output head "
        "when the embeddings are tied); whitespace shown as ␣ ↵ →.</p>"
        + _table(["token", "id", "nearest tokens (cosine)"], rows)
    )


def write_index(findings: Findings, out: Path) -> Path:
    """Write out/index.html; every image path must lie under `out`."""
    page = (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>textgen inspection: {escape(findings.source)}</title><style>{STYLE}</style></head><body>"
        f"<h1>Inspection of {escape(findings.source)}</h1>"
        + _summary(findings)
        + _texts(findings)
        + _attention(findings, out)
        + _diversity(findings, out)
        + _layer_stats(findings, out)
        + _neighbours(findings)
        + "</body></html>\n"
    )
    path = out / "index.html"
    path.write_text(page, encoding="utf-8")
    return path
