"""Tables (terminal + markdown), JSON and plots of a serve_bench run."""

from __future__ import annotations

from pathlib import Path

from host import save
from metrics import median_of
from rich.console import Console
from rich.table import Table

COLUMNS = [
    # (header, workload, path, scale, format)
    ("W1 ITL p50 ms (window)", "w1", ("itl_in_window", "p50"), 1e3, "{:.1f}"),
    ("W1 ITL p99 ms (window)", "w1", ("itl_in_window", "p99"), 1e3, "{:.1f}"),
    ("W1 max stall ms", "w1", ("itl_in_window", "max"), 1e3, "{:.0f}"),
    ("W1 ITL p50 ms (before)", "w1", ("itl_before", "p50"), 1e3, "{:.1f}"),
    ("W1 decode tok/s before", "w1", ("decode_tok_s_before",), 1, "{:.1f}"),
    ("W1 decode tok/s in window", "w1", ("decode_tok_s_in_window",), 1, "{:.1f}"),
    ("W1 long TTFT s", "w1", ("long_ttft_s",), 1, "{:.2f}"),
    ("W2 TTFT p50 s", "w2", ("ttft", "p50"), 1, "{:.2f}"),
    ("W2 TTFT p99 s", "w2", ("ttft", "p99"), 1, "{:.2f}"),
    ("W2 ITL p99 ms", "w2", ("itl", "p99"), 1e3, "{:.1f}"),
    ("W2 ITL max ms", "w2", ("itl", "max"), 1e3, "{:.0f}"),
    ("W2 output tok/s", "w2", ("output_tok_s",), 1, "{:.1f}"),
]
W1_PAIRS, W2_PAIRS = (
    [("chunked", "std"), ("chunked", "chunked-whole")],
    [("chunked", "std"), ("chunked", "native")],
)
RATIOS = [
    ("W1 max stall", "w1", ("itl_in_window", "max"), W1_PAIRS),
    ("W1 in-window decode tok/s", "w1", ("decode_tok_s_in_window",), W1_PAIRS),
    ("W2 output tok/s", "w2", ("output_tok_s",), W2_PAIRS),
    ("W2 TTFT p50", "w2", ("ttft", "p50"), W2_PAIRS),
]


def cell(result: dict, workload: str, path: tuple, scale: float, fmt: str) -> str:
    med, spread = median_of(result.get(workload, []), *path)
    if med != med:  # nan
        return "-"
    text = fmt.format(med * scale)
    return text + (f" ±{fmt.format(spread * scale / 2)}" if len(result.get(workload, [])) > 1 else "")


def tables(report: dict) -> tuple[Table, list[str]]:
    contenders = report["contenders"]
    table = Table(
        "contender", *[c[0] for c in COLUMNS], "peak RSS MiB", title="serve_bench (median ± half-range)"
    )
    md = ["| contender | " + " | ".join(c[0] for c in COLUMNS) + " | peak RSS MiB |"]
    md.append("|---" * (len(COLUMNS) + 2) + "|")
    for name, result in contenders.items():
        if "error" in result:
            row = [f"error: {result['error'][-120:]}"] + [""] * len(COLUMNS)
        else:
            row = [cell(result, *c[1:]) for c in COLUMNS] + [str(result["peak_rss_mib"])]
        table.add_row(name, *row)
        md.append(f"| {name} | " + " | ".join(x.replace("|", "/") for x in row) + " |")
    md += ["", "| ratio (median over median) | value |", "|---|---|"]
    for label, workload, path, pairs in RATIOS:
        for a, b in pairs:
            if all(n in contenders and "error" not in contenders[n] for n in (a, b)):
                num, _ = median_of(contenders[a][workload], *path)
                den, _ = median_of(contenders[b][workload], *path)
                ratio = f"{num / den:.2f}" if den else f"{num:.3g} / 0"
                md.append(f"| {label}: {a} / {b} | {ratio} |")
    md += ["", "| export | export s | graphs MiB |", "|---|---|---|"]
    md += [f"| {k} | {v['export_s']} | {v['graphs_mib']} |" for k, v in report["exports"].items()]
    return table, md


def plots(report: dict, stem: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ok = {n: r for n, r in report["contenders"].items() if "error" not in r and r["w1"]}
    paths = []
    fig, axes = plt.subplots(len(ok), 1, figsize=(10, 2.2 * max(len(ok), 1)), squeeze=False, sharex=True)
    for ax, (name, result) in zip(axes[:, 0], ok.items(), strict=True):
        tl = result["w1"][0]["timeline"]
        for i, times in enumerate(tl["streams"]):
            ax.plot(times, [i] * len(times), "|", markersize=6)
        if tl["window"][1] is not None:
            ax.axvspan(0, tl["window"][1], color="orange", alpha=0.25, label="long prompt prefill")
        ax.set_ylabel(name)
        ax.set_yticks([])
    axes[-1, 0].set_xlabel("seconds since the long prompt arrived (each mark: a decode token)")
    fig.suptitle("W1: decode streams while a long prompt is prefilled")
    fig.tight_layout()
    paths.append(stem.with_name(stem.name + "-w1-timeline.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, result in ok.items():
        gaps = np.sort(np.asarray([g for run in result["w2"] for g in run["itl_all"]]) * 1e3)
        if gaps.size:
            ax.plot(gaps, np.arange(1, gaps.size + 1) / gaps.size, label=name)
    ax.set_xscale("log")
    ax.set_xlabel("inter-token latency (ms)")
    ax.set_ylabel("CDF")
    ax.set_title("W2: inter-token latency")
    ax.legend()
    fig.tight_layout()
    paths.append(stem.with_name(stem.name + "-w2-itl-cdf.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def write_report(report: dict, results_dir: Path, tag: str) -> list[Path]:
    table, md = tables(report)
    Console(width=250).print(table)
    pngs = plots(report, results_dir / f"bench-{tag}")
    setup = report["setup"]
    head = [f"# serve_bench {tag}", "",
            f"Model {setup['model']}, B={setup['batch']}, S={setup['seq']}, C={setup['chunk']}, backend "
            f"{setup['backend']}; W1 {setup['w1']}; W2 {setup['w2']}; {report['repeats']} run(s); median ± half-range.",
            ""]  # fmt: skip
    lines = head + md + [""] + [f"![{p.stem}]({p.name})" for p in pngs]
    return [*save(results_dir, f"bench-{tag}", report, lines, echo=False), *pngs]
