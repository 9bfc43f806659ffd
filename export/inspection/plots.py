"""Pictures (PNG, matplotlib's Agg canvas; no display, no pyplot global state)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import PowerNorm
from matplotlib.figure import Figure
from matplotlib.image import AxesImage
from torch import Tensor

from export.inspection.diversity import HeadStats, LayerDiversity
from export.inspection.layers import LayerStats

MASKED_COLOUR = "#d0d0d0"
PAD_LINE = "#e4002b"
# Square root colour scale: attention spread over many keys is mostly small weights, which a linear
# scale would draw as uniformly dark.
WEIGHT_NORM_GAMMA = 0.5
INCH_PER_TOKEN = 0.2
ANNOTATE_MAX_HEADS = 8
DPI = 110


def save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=DPI)
    return path


def _panel_inches(tokens: int) -> float:
    return max(2.5, tokens * INCH_PER_TOKEN + 1.0)


def _tick_fontsize(tokens: int) -> float:
    return 7.0 if tokens <= 32 else 5.5


def _draw_weights(
    ax: Axes, weights: np.ndarray, allowed: np.ndarray, labels: list[str], title: str
) -> AxesImage:
    """One [S,T] map; masked (causal or padding) cells grey, the padding boundary as a red line."""
    cmap = colormaps["viridis"].with_extremes(bad=MASKED_COLOUR)
    image = ax.imshow(
        np.ma.masked_where(~allowed, weights),
        cmap=cmap,
        norm=PowerNorm(WEIGHT_NORM_GAMMA, vmin=0.0, vmax=1.0),
        interpolation="nearest",
    )
    ticks = np.arange(len(labels))
    fontsize = _tick_fontsize(len(labels))
    ax.set_xticks(ticks, labels, rotation=90, fontsize=fontsize)
    ax.set_yticks(ticks, labels, fontsize=fontsize)
    ax.set_xlabel("key", fontsize=8)
    ax.set_ylabel("query", fontsize=8)
    ax.set_title(title, fontsize=9)
    pads = int(allowed.any(axis=0).argmax()) if allowed.any() else len(labels)
    if pads:
        ax.axvline(pads - 0.5, color=PAD_LINE, linestyle="--", linewidth=1)
        ax.axhline(pads - 0.5, color=PAD_LINE, linestyle="--", linewidth=1)
    return image


def _label_outer(ax: Axes, index: int, ncols: int, panels: int) -> None:
    """Every panel shows the same tokens: keep tick labels on the left column and on the lowest panel of
    each column (which is not the last row when the grid is not full)."""
    if index % ncols:
        ax.tick_params(labelleft=False)
        ax.set_ylabel("")
    if index + ncols < panels:
        ax.tick_params(labelbottom=False)
        ax.set_xlabel("")


def heatmap_grid(
    maps: list[tuple[str, Tensor]], allowed: Tensor, labels: list[str], ncols: int, title: str, path: Path
) -> Path:
    """Panels of attention maps [S,S] of one text, sharing one colour bar.

    Margins are sized from the longest token label instead of by a layout engine: measuring every tick
    label is what made these figures take seconds each.
    """
    nrows = math.ceil(len(maps) / ncols)
    side = _panel_inches(len(labels))
    margin = max(map(len, labels)) * _tick_fontsize(len(labels)) * 0.6 / 72 + 0.5  # tick labels + axis label
    top, right, gap = 0.9, 1.2, 0.35  # suptitle; colour bar; panel titles
    width, height = margin + ncols * side + right, margin + nrows * side + (nrows - 1) * gap + top
    fig = Figure(figsize=(width, height))
    fig.subplots_adjust(
        left=margin / width,
        right=1 - right / width,
        bottom=margin / height,
        top=1 - top / height,
        wspace=0.06,
        hspace=gap / side,
    )
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    mask = allowed.numpy()
    images = [
        _draw_weights(ax, w.numpy(), mask, labels, name) for ax, (name, w) in zip(axes, maps, strict=False)
    ]
    for index, ax in enumerate(axes):
        if index < len(maps):
            _label_outer(ax, index, ncols, len(maps))
        else:
            ax.set_axis_off()
    colour_bar = fig.add_axes((1 - 0.85 * right / width, 0.25, 0.15 / width, 0.5))
    fig.colorbar(images[0], cax=colour_bar, label="attention weight (sqrt scale)")
    fig.suptitle(
        f"{title}\ngrey: masked (future or padding); red dashed: end of padding",
        fontsize=11,
        y=1 - 0.1 / height,
        va="top",
    )
    return save(fig, path)


def layer_heatmaps(weights: Tensor, allowed: Tensor, labels: list[str], layer: int, path: Path) -> Path:
    """One layer, one text: weights [H,S,S], allowed [S,S]."""
    heads = weights.shape[0]
    maps = [(f"head {h}", weights[h]) for h in range(heads)]
    return heatmap_grid(maps, allowed, labels, math.ceil(math.sqrt(heads)), f"layer {layer} attention", path)


def padding_heatmaps(
    weights: Tensor, allowed: Tensor, labels: list[str], received: float, path: Path
) -> Path:
    """Every layer and head of a padded text: weights [L,H,S,S]; `received` is the weight padding got."""
    layers, heads = weights.shape[:2]
    maps = [(f"layer {li} head {h}", weights[li, h]) for li in range(layers) for h in range(heads)]
    title = f"padded text in a batch: most weight any query puts on padding = {received:.3g}"
    return heatmap_grid(maps, allowed, labels, heads, title, path)


def diversity_summary(
    diversity: list[LayerDiversity], heads: list[HeadStats], min_jsd: float, path: Path
) -> Path:
    """Per layer the heads' pairwise JSD; mean/max JSD per layer against the threshold; per head entropy
    against distance."""
    layers = len(diversity)
    fig = Figure(figsize=(max(10.0, 2.6 * layers), 8.0), layout="constrained")
    # Each layer's matrix spans two columns of the top row; the two summaries share the bottom row.
    top: list[str] = [f"layer {d.layer}" for d in diversity for _ in range(2)]
    bottom: list[str] = ["bars"] * layers + ["scatter"] * layers
    panels = fig.subplot_mosaic([top, bottom], height_ratios=[1, 1.3])  # type: ignore[list-item]
    vmax = max([2 * min_jsd, *(d.max_jsd for d in diversity if math.isfinite(d.max_jsd))])
    matrices = [panels[f"layer {d.layer}"] for d in diversity]
    images = [_draw_jsd(ax, d, vmax) for ax, d in zip(matrices, diversity, strict=True)]
    fig.colorbar(images[0], ax=matrices, shrink=0.8, label="JSD (bits)")
    fig.suptitle("pairwise Jensen–Shannon divergence between heads' attention", fontsize=11)
    _jsd_bars(panels["bars"], diversity, min_jsd)
    _entropy_distance(panels["scatter"], heads)
    return save(fig, path)


def _draw_jsd(ax: Axes, d: LayerDiversity, vmax: float) -> AxesImage:
    image = ax.imshow(d.pairwise_jsd, vmin=0.0, vmax=vmax, cmap="magma")
    ticks = np.arange(d.pairwise_jsd.shape[0])
    ax.set_xticks(ticks, [f"h{h}" for h in ticks], fontsize=7)
    ax.set_yticks(ticks, [f"h{h}" for h in ticks], fontsize=7)
    if len(ticks) <= ANNOTATE_MAX_HEADS:
        _annotate_cells(ax, d.pairwise_jsd, vmax)
    flag = " - ALL HEADS ALIKE" if d.flagged else " - NaN weights" if math.isnan(d.max_jsd) else ""
    ax.set_title(f"layer {d.layer}{flag}", fontsize=9, color=PAD_LINE if flag else "black")
    return image


def _jsd_bars(ax: Axes, diversity: list[LayerDiversity], min_jsd: float) -> None:
    x = np.arange(len(diversity))
    ax.bar(x - 0.2, [d.mean_jsd for d in diversity], 0.4, label="mean over head pairs")
    ax.bar(x + 0.2, [d.max_jsd for d in diversity], 0.4, label="most different pair")
    ax.axhline(min_jsd, color=PAD_LINE, linestyle="--", label=f"flag below {min_jsd:g}")
    ax.set_xticks(x, [f"layer {d.layer}" for d in diversity])
    ax.set_ylabel("JSD (bits)")
    ax.set_title("head diversity per layer", fontsize=10)
    ax.legend(fontsize=8)


def _entropy_distance(ax: Axes, heads: list[HeadStats]) -> None:
    layers = sorted({h.layer for h in heads})
    colours = colormaps["tab10"]
    for layer in layers:
        mine = [h for h in heads if h.layer == layer]
        ax.scatter(
            [h.entropy for h in mine],
            [h.distance for h in mine],
            label=f"layer {layer}",
            color=colours(layer % 10),
        )
        for h in mine:
            ax.annotate(
                f"L{h.layer}H{h.head}",
                (h.entropy, h.distance),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
    # Heads of an untrained model differ in the 4th decimal; without a minimum span matplotlib would
    # draw that as an offset axis with unreadable ticks.
    _min_span(ax.set_xlim, [h.entropy for h in heads], 0.5)
    _min_span(ax.set_ylim, [h.distance for h in heads], 0.5)
    ax.set_xlabel("mean attention entropy (bits): low = focused")
    ax.set_ylabel("mean distance attended back (tokens)")
    ax.set_title("what each head does", fontsize=10)
    ax.legend(fontsize=8)


def _annotate_cells(ax: Axes, values: np.ndarray, vmax: float) -> None:
    for (i, j), value in np.ndenumerate(values):
        colour = "black" if value > vmax / 2 else "white"
        ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7, color=colour)


def _min_span(set_limits: Callable[[float, float], object], values: list[float], span: float) -> None:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:  # a model with NaN everywhere: nothing to frame
        return
    low, high = min(finite), max(finite)
    margin = max(span - (high - low), 0.0) / 2 + 0.05 * (high - low)
    set_limits(low - margin, high + margin)


def layer_stats_plot(stats: list[LayerStats], path: Path) -> Path:
    """std and max |x| of the residual stream per layer, log scale; flagged layers in red."""
    fig = Figure(figsize=(max(6.0, 1.1 * len(stats)), 4.0), layout="constrained")
    ax = fig.add_subplot()
    x = np.arange(len(stats))
    ax.plot(x, [s.std for s in stats], marker="o", label="std")
    ax.plot(x, [s.max_abs for s in stats], marker="s", label="max |x|")
    for i, s in enumerate(stats):
        if s.flags:
            ax.axvspan(i - 0.4, i + 0.4, color=PAD_LINE, alpha=0.2)
            ax.annotate(
                ", ".join(s.flags),
                (i, 0.5),
                xycoords=("data", "axes fraction"),
                rotation=90,
                ha="center",
                va="center",
                fontsize=8,
                color=PAD_LINE,
            )
    ax.set_yscale("log")
    ax.set_xticks(x, [s.name for s in stats], rotation=30)
    ax.set_ylabel("value")
    ax.set_title("residual stream after each block (real tokens only); red: flagged", fontsize=10)
    ax.legend(fontsize=8)
    return save(fig, path)
