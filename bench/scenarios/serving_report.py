"""The serving benchmark's record: plots (matplotlib PNG) and the generated section of docs/benchmarks.md.

Only the text between the serving section's markers is replaced (bench.report.write_section), so the rest of
the document is left as it is.
"""

from __future__ import annotations

import datetime
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib
import matplotlib.axis
import matplotlib.ticker

matplotlib.use("Agg")  # files only: no display on a server or in CI
import matplotlib.pyplot as plt
import numpy as np

from bench.loadgen import RPC_NAMES
from bench.report import section_markers, table, write_section

if TYPE_CHECKING:
    from bench.loadgen import BenchmarkOutput
    from bench.scenarios.serving import Results

SECTION = "serving"
DOC_BEGIN, DOC_END = section_markers(SECTION)
TARGET_CLIENTS = 16
TARGET_VS_OFFLINE = 0.9
TARGET_VS_NAIVE = 5.0
TARGET_ITL_SPREAD = 3.0


def stat(output: BenchmarkOutput, metric: str, which: str) -> float:
    values = output.summary[metric]
    assert isinstance(values, dict)
    return float(values[which])


def throughput(output: BenchmarkOutput) -> float:
    return float(output.summary["output_throughput"])  # type: ignore[arg-type]


def hf_rates(results: Results) -> dict[int, float]:
    if results.hf is None:
        return {}
    rows = results.hf["results"]
    assert isinstance(rows, list)
    return {int(row["batch"]): float(row["tok_s"]) for row in rows}


def cdf_level(levels: Sequence[int]) -> int:
    """The client count of the CDF plot and the targets: 16, or the nearest level measured."""
    return min(levels, key=lambda c: abs(math.log2(c) - math.log2(TARGET_CLIENTS)))


# --- plots -------------------------------------------------------------------------------------------------


def _clients_axis(ax: plt.Axes, levels: Sequence[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(levels), [str(c) for c in levels])
    ax.set_xlabel("concurrent clients (closed loop)")
    ax.grid(True, which="both", alpha=0.3)


def _log_ms(axis: matplotlib.axis.Axis) -> None:
    """A log scale labelled in plain numbers at 1, 2 and 5 of each decade (all minor labels overlap)."""
    axis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _pos: f"{value:g}"))
    axis.set_minor_formatter(matplotlib.ticker.NullFormatter())


def plot_throughput(results: Results, path: Path) -> None:
    levels = list(results.plan.levels)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(levels, [throughput(results.server[c]) for c in levels], "o-", label="textgen-serve (gRPC)")
    ax.plot(levels, [throughput(results.naive[c]) for c in levels], "s-", label="naive server (gRPC)")
    ax.plot(levels, [results.offline[c] for c in levels], "k--", label="engine offline, batch = clients")
    hf = hf_rates(results)
    if hf:
        ax.plot(
            levels,
            [hf[c] for c in levels],
            ":",
            color="tab:red",
            label="HF generate offline, batch = clients",
        )
    _clients_axis(ax, levels)
    ax.set_ylabel("output tokens / s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Throughput, {results.model['name']}: {results.plan.new_tokens} new tokens per request")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency(results: Results, path: Path) -> None:
    levels = list(results.plan.levels)
    panels = [("ttft_ms", "Time to first token"), ("itl_ms", "Inter-token latency")]
    if results.plan.rpc == "unary":  # the clients saw no tokens before the end
        panels = [("e2el_ms", "End-to-end latency")]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    for ax, (metric, title) in zip(axes[0], panels, strict=True):
        for name, outputs, marker in (("server", results.server, "o"), ("naive", results.naive, "s")):
            for which, style in (("median", "-"), ("p99", "--")):
                values = [stat(outputs[c], metric, which) for c in levels]
                ax.plot(levels, values, marker + style, label=f"{name} {which}")
        _clients_axis(ax, levels)
        ax.set_yscale("log")
        _log_ms(ax.yaxis)
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_cdf(results: Results, path: Path) -> None:
    clients = cdf_level(results.plan.levels)
    panels = [("ttft", "Time to first token"), ("latency", "End-to-end latency")]
    if results.plan.rpc == "unary":
        panels = panels[1:]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    for ax, (field, title) in zip(axes[0], panels, strict=True):
        for name, outputs in (("textgen-serve", results.server), ("naive server", results.naive)):
            values = np.sort([getattr(r, field) * 1e3 for r in outputs[clients].records if r.success])
            ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=name)
        ax.set_xscale("log")
        _log_ms(ax.xaxis)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{title}, {clients} clients")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_all(results: Results, images: Path) -> list[Path]:
    images.mkdir(parents=True, exist_ok=True)
    paths = [
        images / "serving_throughput.png",
        images / "serving_latency.png",
        images / "serving_latency_cdf.png",
    ]
    for plot, path in zip((plot_throughput, plot_latency, plot_cdf), paths, strict=True):
        plot(results, path)
    return paths


# --- markdown ----------------------------------------------------------------------------------------------


def _f(value: float, digits: int = 0) -> str:
    return "—" if math.isnan(value) else f"{value:.{digits}f}"


def throughputtable(results: Results) -> list[str]:
    hf = hf_rates(results)
    rows = []
    for c in results.plan.levels:
        served, naive, offline = (
            throughput(results.server[c]),
            throughput(results.naive[c]),
            results.offline[c],
        )
        rows.append(
            [
                str(c),
                _f(served),
                _f(naive),
                _f(offline),
                _f(hf.get(c, math.nan)),
                _f(served / offline, 2),
                _f(served / naive, 1),
                _f(float(results.server[c].summary["request_throughput"]), 2),  # type: ignore[arg-type]
            ]
        )
    header = [
        "clients",
        "textgen-serve tok/s",
        "naive server tok/s",
        "engine offline tok/s (batch = clients)",
        "HF generate tok/s (batch = clients)",
        "served ÷ offline",
        "served ÷ naive",
        "served req/s",
    ]
    return table(header, rows)


def latencytable(outputs: dict[str, BenchmarkOutput]) -> list[str]:
    rows = []
    for c, o in outputs.items():
        rows.append(
            [
                str(c),
                _f(stat(o, "ttft_ms", "mean"), 1),
                _f(stat(o, "ttft_ms", "median"), 1),
                _f(stat(o, "ttft_ms", "p99"), 1),
                _f(stat(o, "tpot_ms", "mean"), 2),
                _f(stat(o, "itl_ms", "median"), 2),
                _f(stat(o, "itl_ms", "p90"), 2),
                _f(stat(o, "itl_ms", "p99"), 2),
                _f(itl_spread(o), 1),
                _f(stat(o, "e2el_ms", "median"), 0),
                _f(stat(o, "e2el_ms", "p99"), 0),
            ]
        )
    header = [
        "load",
        "TTFT mean",
        "TTFT p50",
        "TTFT p99",
        "TPOT mean",
        "ITL p50",
        "ITL p90",
        "ITL p99",
        "ITL p99 ÷ p50",
        "E2EL p50",
        "E2EL p99",
    ]
    return table(header, rows)


def itl_spread(output: BenchmarkOutput) -> float:
    return stat(output, "itl_ms", "p99") / stat(output, "itl_ms", "median")


def near(value: float, digits: int, target: float) -> str:
    """`value` rounded to `digits`, with more digits while rounding would put it on the target's other side
    (0.8996 is shown as 0.8996, not as 0.90 beside "missed")."""

    def side(x: float) -> int:
        return (x > target) - (x < target)

    for extra in range(4):
        shown = f"{value:.{digits + extra}f}"
        if side(float(shown)) == side(value):
            break
    return shown


def targets(results: Results) -> list[str]:
    c = cdf_level(results.plan.levels)
    served = throughput(results.server[c])
    table_ratio = served / results.offline[c]
    vs_naive = served / throughput(results.naive[c])
    spread = itl_spread(results.arrivals)

    def verdict(ok: bool) -> str:
        return "**met**" if ok else "**missed**"

    if results.pairs:
        vs_offline = float(np.median([p.ratio for p in results.pairs]))
        how = (
            f"median of {len(results.pairs)} served runs, each ÷ the mean of the offline passes just before "
            "and after it: "
            + ", ".join(
                f"{p.served:.0f} ÷ ({p.before:.0f}, {p.after:.0f}) = {p.ratio:.2f}" for p in results.pairs
            )
            + f"; the table's cells, minutes apart: {table_ratio:.2f}"
        )
    else:
        vs_offline, how = table_ratio, "the table's cells"
    return [
        f"At {c} clients:",
        f"- served ÷ offline engine at batch {c}: **{near(vs_offline, 2, TARGET_VS_OFFLINE)}** "
        f"(target ≥ {TARGET_VS_OFFLINE}): " + verdict(vs_offline >= TARGET_VS_OFFLINE) + f" — {how}",
        f"- served ÷ naive server: **{near(vs_naive, 1, TARGET_VS_NAIVE)}×** "
        f"(target ≥ {TARGET_VS_NAIVE:g}×): " + verdict(vs_naive >= TARGET_VS_NAIVE),
        f"- server ITL p99 ÷ median while requests keep arriving (the steady-arrivals run): "
        f"**{near(spread, 1, TARGET_ITL_SPREAD)}** "
        f"(target ≤ {TARGET_ITL_SPREAD:g}): "
        + verdict(spread <= TARGET_ITL_SPREAD)
        + f"; in the closed loop at {c} clients, where requests join in waves: "
        f"{itl_spread(results.server[c]):.1f}",
    ]


def stepstable(results: Results) -> list[str]:
    """Per load, what the server's step histograms say the engine did (rows per step, time between steps)."""
    rows = []
    for c, o in [*results.server.items(), ("steady arrivals", results.arrivals)]:
        s = o.steps
        if s is None:
            continue
        rows.append(
            [
                str(c),
                f"{s.decode_steps} × {s.decode_ms:.1f} ms",
                f"{s.decode_rows:.1f}",
                f"{s.prefill_steps} × {s.prefill_ms:.1f} ms",
                f"{s.prefill_rows:.1f}",
                f"{s.busy:.2f}",
                f"{s.between_ms:.2f}",
            ]
        )
    header = [
        "load",
        "decode steps",
        "rows a decode step",
        "prefill steps",
        "sequences a prefill step",
        "engine busy",
        "ms between steps",
    ]
    return table(header, rows)


def metric_checks(results: Results) -> list[str]:
    rows = []
    for c, o in [*results.server.items(), ("steady arrivals", results.arrivals)]:
        bad = [f"{k.name} (client {k.client:.6g}, server {k.server:.6g})" for k in o.checks if not k.ok]
        rows.append([str(c), str(len(o.checks)), "all agree" if not bad else "; ".join(bad)])
    return table(["load", "checks", "result"], rows)


def section(results: Results, images: Sequence[Path], doc: Path, argv_used: Sequence[str]) -> str:
    m, model, plan = results.machine, results.model, results.plan
    passes = f"{plan.repeats} pass{'' if plan.repeats == 1 else 'es'}" + (
        f" or as many as run {plan.offline_seconds:g} s" if plan.offline_seconds else ""
    )
    rel = [os.path.relpath(p, doc.parent) for p in images]
    hf = results.hf
    hf_line = (
        f"transformers {hf['transformers']}, torch {hf['torch']} (in bench/.venv-hf)"
        if hf
        else "not run (--skip-hf)"
    )
    invoked = " ".join([f"textgen-bench {SECTION}", *argv_used])
    arrivals = results.arrivals.config
    rate = arrivals.request_rate or math.nan
    lines: list[str] = [
        "## Serving: the gRPC server against its baselines",
        "",
        f"Generated {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC by `{invoked}` "
        f"in {results.seconds / 60:.1f} minutes. Rerun everything with `make bench` "
        f"(`.venv/bin/textgen-bench {SECTION}`; `--quick` for 1, 4 and 16 clients in one pass).",
        "",
        "### Machine",
        f"- CPU: {m['cpu']}, {m['cores']} cores; memory {m['memory']}; {m['os']}",
        f"- 1-minute load average: {m['load_1min']} (this benchmark alone accounts for about 2-3; more "
        "means other work shared the cores and the figures are low)",
        f"- Python {m['python']}, ONNX Runtime {m['onnxruntime']}, grpcio {m['grpcio']}; "
        f"HF baseline: {hf_line}",
        f"- {results.threads} ONNX Runtime / torch threads everywhere, ONNX Runtime spinning "
        f"{'on' if results.spinning else 'off'} in both servers and the offline engine; the load generator "
        "runs on the same machine as the server it drives and takes part of its CPU.",
        "",
        "### Workload",
        f"- Model `{model['name']}` ({model['dtype']}, quantization {model['quantization']}): "
        f"vocab {model['vocab_size']}, context {model['context_length']}, d_model {model['d_model']}, "
        f"{model['n_layers']} layers, {model['n_heads']} heads, d_ff {model['d_ff']}, "
        f"{model['positions']} positions.",
        f"- Every request: a prompt of {plan.input_len} random token ids (EOS excluded), "
        f"exactly {plan.new_tokens} new tokens (`ignore_eos`), greedy; the closed-loop clients call "
        + (
            "`GenerateStream` (a message per step)."
            if plan.rpc == "stream"
            else "the unary `Generate` (one reply per request: no TTFT or ITL is seen by the client; the "
            "steady-arrivals run still streams)."
        ),
        f"- Closed loop at {', '.join(map(str, plan.levels))} clients: textgen-serve gets "
        f"{plan.requests_per_client} requests per client, the naive server max(clients, "
        f"{plan.naive_requests}) (its rate does not depend on the clients, and each of its requests waits "
        "for all before it).",
        f"- Steady arrivals: textgen-serve under Poisson arrivals at {rate:.2f} requests/s (80% of its "
        f"streamed closed-loop rate at {cdf_level(plan.levels)} clients), max_new_tokens uniform in "
        f"{plan.new_tokens} × [{1 - arrivals.output_len_spread:g}, {1 + arrivals.output_len_spread:g}], "
        f"{arrivals.num_requests} requests: sequences join and leave the running batch all the time.",
        f"- textgen-serve runs with `--max-batch-size {results.max_batch}`; the offline engine is "
        "`serve.scheduling.offline.generate` on an engine of the same size, at batch = clients "
        f"(median of {passes}, after a warm-up), prefill included."
        + (
            f" For the served ÷ offline target, {plan.pairs} more served runs at {cdf_level(plan.levels)} "
            f"clients alternate with offline passes (median of {passes}; the server idle meanwhile), "
            "and each served run is compared with the mean of the offline passes just before and after it, "
            "so a steady drift of the machine cancels out."
            if results.pairs
            else ""
        ),
        "- The naive server (`bench/naive_server.py`) is the same bundle and service with one lock around a "
        "prefill + decode loop on a batch-1 engine.",
        "- HF transformers: `GPT2LMHeadModel.generate` (KV cache, greedy, `min_new_tokens` = new tokens) "
        "on a **random-weight GPT-2 of the same shape** (speed does not depend on the weights; no "
        "checkpoint is converted), at batch = clients, median of the same passes.",
        "",
        "### Commands",
        "```bash",
        *results.commands,
        str(hf["command"]) if hf else "# HF baseline skipped",
        "```",
        "",
        "### Targets",
        *targets(results),
        "",
        "### Throughput (output tokens/s)",
        *throughputtable(results),
        "",
        f"![throughput vs concurrency]({rel[0]})",
        "",
        "### Latency, textgen-serve (ms)",
        *latencytable(
            {f"{c} clients": o for c, o in results.server.items()}
            | {f"steady arrivals, {rate:.2f} req/s": results.arrivals}
        ),
        "",
        "### Latency, naive server (ms)",
        *latencytable({f"{c} clients": o for c, o in results.naive.items()}),
        "",
        "TTFT: request sent → first token received; TPOT: (latency − TTFT) ÷ (tokens − 1) per request; "
        "ITL: every gap between streamed tokens; E2EL: request sent → stream ended "
        "(the definitions of `vllm bench serve`).",
        "",
        f"![TTFT and ITL percentiles vs concurrency]({rel[1]})",
        "",
        f"![latency CDF at {cdf_level(results.plan.levels)} clients]({rel[2]})",
        "",
        "### The server's own metrics against the client's",
        f"Per level: {RPC_NAMES[plan.rpc]} request count and OK count, generated tokens (equal), and the "
        "server's mean TTFT (`textgen_time_to_first_token_seconds`) ≤ the client's"
        + (" (unary: its end-to-end latency)." if plan.rpc == "unary" else "."),
        "",
        *metric_checks(results),
        "",
        "### Inside the server: its engine steps",
        "From the server's step histograms over each run (`textgen_step_duration_seconds` by phase, tokens "
        "and first tokens): how full the decode steps ran, how prefills were grouped, the share of the run "
        "spent in engine steps and the time per step outside them (hand-off, admission, waiting for work or "
        "for the CPU).",
        "",
        *stepstable(results),
        "",
        f"Raw per-request records: `{os.path.relpath(results.results_dir, doc.parent)}/` (not committed).",
    ]
    return "\n".join(lines) + "\n"


def update_doc(results: Results, images: Sequence[Path], doc: Path, argv_used: Sequence[str]) -> None:
    write_section(doc, SECTION, section(results, images, doc, argv_used))
