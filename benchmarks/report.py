"""Plots and docs/perf.md tables from the JSON results of kv_memory and throughput.

Each table is rendered between marker comments in docs/perf.md
(`<!-- bench:NAME -->` ... `<!-- /bench:NAME -->`); everything outside the markers is left as
it is. Plots are PNGs under docs/img/.

    .venv/bin/python -m benchmarks.report [--results results] [--doc docs/perf.md]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

IMG = Path("docs/img")
SERIES_SHOWN = ("paged-16", "contiguous", "oracle")


def replace_section(doc: str, name: str, body: str) -> str:
    """`doc` with the text between the `name` markers replaced by `body`."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if not pattern.search(doc):
        raise ValueError(f"docs have no {start} ... {end} section")
    return pattern.sub(lambda _: f"{start}\n{body.strip()}\n{end}", doc, count=1)


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def kv_memory_markdown(kv: dict[str, Any]) -> str:
    w = kv["workload"]
    rows = {r["allocator"]: r for r in kv["allocators"]}
    paged, contiguous = rows["paged-16"], rows["contiguous"]
    lines = [
        f"Trace: seed {w['seed']}, {w['conversations']} conversations, {w['requests']} turns "
        f"({w['follow_ups']} follow-ups, {w['parallel']} with n=4), mean prompt "
        f"{w['mean_prompt_len']:.0f} tokens, mean answer {w['mean_output_len']:.0f} tokens, "
        f"max_model_len {w['max_model_len']}, budget {paged['budget_tokens']} KV slots "
        "(token positions) for every allocator.",
        "",
        _row(
            [
                "allocator",
                "slots holding a token",
                "internal fragmentation",
                "reserved for later tokens",
                "running seqs (mean, budget-bound)",
                "peak running",
                "logical / physical blocks",
                "preemptions",
                "steps",
            ]
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in kv["allocators"]:
        lines.append(
            _row(
                [
                    f"{r['allocator']} (block {r['block_size']})",
                    f"**{100 * r['utilization']:.1f}%**",
                    f"{100 * r['internal_fragmentation']:.1f}%",
                    f"{100 * r['reserved_for_later']:.1f}%",
                    f"{r['mean_running_saturated']:.1f}",
                    r["peak_running"],
                    f"{r['logical_blocks_mean'] / r['physical_blocks_mean']:.2f}",
                    r["preemptions"],
                    r["steps"],
                ]
            )
        )
    ratio = paged["mean_running_saturated"] / contiguous["mean_running_saturated"]
    lines += [
        "",
        f"- Paged (block 16) keeps **{100 * paged['utilization']:.1f}%** of its reserved slots "
        f"holding tokens; contiguous with max_model_len reservation **"
        f"{100 * contiguous['utilization']:.1f}%**.",
        f"- Concurrent sequences at the same budget, while requests queue: paged "
        f"{paged['mean_running_saturated']:.1f}, contiguous "
        f"{contiguous['mean_running_saturated']:.1f}: **{ratio:.1f}x**.",
        "",
        "Users sharing one 512-token system prompt (paged, block 16, each with a private "
        "message from the trace's distribution): physical KV blocks of the prompts at their "
        "peak (all prompts computed, no answer finished).",
        "",
        _row(
            [
                "users",
                "shared (prefix cache)",
                "one copy + private suffixes",
                "vs ideal",
                "unshared",
                "saved",
            ]
        ),
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for s in kv["shared_prompt"]:
        lines.append(
            _row(
                [
                    s["users"],
                    s["shared_prompt_blocks"],
                    s["ideal_prompt_blocks"],
                    f"{s['vs_ideal']:.3f}",
                    s["unshared_prompt_blocks"],
                    f"{100 * s['saved']:.0f}%",
                ]
            )
        )
    lines += [
        "",
        "Parallel sampling: one 256-token prompt, 128-token answers, all due at once; peak "
        "KV blocks held (the ideal for n=4 in block 16: 16 prompt blocks + 4 x 8).",
        "",
        _row(["allocator", "n=4 (one request)", "4 independent requests"]),
        "|---|---:|---:|",
    ]
    by_alloc: dict[str, dict[str, int]] = {}
    for p in kv["parallel_sampling"]:
        by_alloc.setdefault(p["allocator"], {})[p["case"]] = p["peak_blocks"]
    for alloc, cases in by_alloc.items():
        lines.append(_row([alloc, cases["n=4"], cases["4 requests"]]))
    lines += [
        "",
        "![KV slots held vs holding a token](img/kv_memory_over_time.png)",
        "",
        "![Memory saved by sharing a system prompt](img/shared_prompt_savings.png)",
    ]
    return "\n".join(lines)


def throughput_markdown(tp: dict[str, Any]) -> str:
    # Results from before weight_dtype existed ran the weights in the activations' dtype.
    weights = tp.get("weight_dtype", tp["dtype"])
    lines = [
        f"Model {tp['model']}, {weights} weights, {tp['dtype']} activations, "
        f"{tp['threads']} torch thread(s), block "
        f"{tp['block_size']}, max_model_len {tp['max_model_len']}, {tp['conversations']} "
        f"conversations ({tp['runs'][0]['requests']} turns), rate runs at {tp['rate']} new "
        "conversations/s.",
        "",
        _row(
            [
                "run",
                "tokens/s",
                "requests/s",
                "mean decode batch",
                "latency p50",
                "latency p99",
                "TTFT p50",
                "prompt tokens computed",
                "prefix-cache tokens",
                "preemptions",
                "wall",
            ]
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in tp["runs"]:
        lines.append(
            _row(
                [
                    r["label"],
                    f"{r['tokens_per_s']:.1f}",
                    f"{r['requests_per_s']:.2f}",
                    f"{r['mean_batch']:.1f}",
                    f"{r['latency_p50_s']:.1f} s",
                    f"{r['latency_p99_s']:.1f} s",
                    f"{r['ttft_p50_s']:.1f} s",
                    r["prompt_tokens_computed"],
                    r["prefix_hit_tokens"],
                    r["preemptions"],
                    f"{r['elapsed_s']:.0f} s",
                ]
            )
        )
    lines += ["", "Paged / contiguous at the same budget and arrivals:", ""]
    for burst in (True, False):
        for paged in tp["runs"]:
            if paged["allocation"] != "paged" or not paged["prefix_caching"]:
                continue
            if paged["burst"] is not burst:
                continue
            for other in tp["runs"]:
                if (
                    other["allocation"] == "contiguous"
                    and other["burst"] is burst
                    and other["num_device_blocks"] == paged["num_device_blocks"]
                ):
                    lines.append(
                        f"- {paged['num_device_blocks']} blocks, "
                        f"{'burst' if burst else 'rate'}: tokens/s "
                        f"**{paged['tokens_per_s'] / other['tokens_per_s']:.2f}x**, "
                        f"requests/s {paged['requests_per_s'] / other['requests_per_s']:.2f}x"
                    )
    lines += [
        "",
        "Where the time goes (engine `StepTiming`, seconds summed over each run):",
        "",
        _row(
            [
                "run",
                "steps",
                "tokens computed / step",
                "forward ms / step",
                "forward",
                "schedule",
                "prepare",
                "sample",
                "postprocess",
                "outside forward",
            ]
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in tp["runs"]:
        t = r["timing_s"]
        total = sum(t.values())
        computed = r["prompt_tokens_computed"] + r["generated_tokens"]
        lines.append(
            _row(
                [
                    r["label"],
                    r["steps"],
                    f"{computed / r['steps']:.1f}",
                    f"{1000 * t['forward'] / r['steps']:.0f}",
                    f"{t['forward']:.1f}",
                    f"{t['schedule']:.2f}",
                    f"{t['prepare']:.2f}",
                    f"{t['sample']:.2f}",
                    f"{t['postprocess']:.2f}",
                    f"{100 * (1 - t['forward'] / total):.1f}%",
                ]
            )
        )
    lines += ["", "![Throughput vs KV budget](img/throughput_vs_budget.png)"]
    return "\n".join(lines)


def _pyplot() -> Any:
    """matplotlib's pyplot without a display, imported when a plot is drawn: importing it
    costs about a second, which the tables (and the tests that import them) do not need."""
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt

    return plt


def plot_kv_memory(kv: dict[str, Any], out: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(len(SERIES_SHOWN), 1, figsize=(8, 7), sharex=True, sharey=True)
    budget = kv["allocators"][0]["budget_tokens"]
    for ax, name in zip(axes, SERIES_SHOWN, strict=True):
        s = kv["series"][name]
        steps = range(len(s["reserved"]))
        ax.fill_between(steps, s["reserved"], step="post", alpha=0.35, label="reserved")
        ax.plot(steps, s["used"], drawstyle="steps-post", lw=1, label="holding a token")
        ax.axhline(budget, color="grey", ls="--", lw=0.8)
        ax.set_title(name, fontsize=10)
        ax.set_ylabel("KV slots")
    axes[0].legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("engine step")
    fig.suptitle("KV memory held vs used, same chat trace and budget (dashed)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def plot_shared_prompt(kv: dict[str, Any], out: Path) -> None:
    plt = _pyplot()
    rows = kv["shared_prompt"]
    users = [r["users"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(users, [r["unshared_prompt_blocks"] for r in rows], "o-", label="no sharing")
    ax.plot(users, [r["shared_prompt_blocks"] for r in rows], "o-", label="prefix cache")
    ax.plot(users, [r["ideal_prompt_blocks"] for r in rows], "k:", label="one copy + suffixes")
    for r in rows:
        ax.annotate(
            f"{100 * r['saved']:.0f}%",
            (r["users"], r["shared_prompt_blocks"]),
            textcoords="offset points",
            xytext=(0, -14),
            ha="center",
            fontsize=8,
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("users sharing a 512-token system prompt")
    ax.set_ylabel("physical KV blocks of the prompts")
    ax.set_title("Memory saved by sharing (labels: share saved)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def plot_throughput(tp: dict[str, Any], out: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for alloc in ("paged", "contiguous"):
        runs = sorted(
            (
                r
                for r in tp["runs"]
                if r["allocation"] == alloc and r["burst"] and r["prefix_caching"]
            ),
            key=lambda r: r["num_device_blocks"],
        )
        ax.plot(
            [r["num_device_blocks"] for r in runs],
            [r["tokens_per_s"] for r in runs],
            "o-",
            label=alloc,
        )
    ax.set_xlabel(f"KV budget (blocks of {tp['block_size']} tokens)")
    ax.set_ylabel("generated tokens/s")
    ax.set_title("Engine throughput vs KV budget (burst arrivals)")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("results"))
    parser.add_argument("--doc", type=Path, default=Path("docs/perf.md"))
    args = parser.parse_args()
    IMG.mkdir(parents=True, exist_ok=True)
    doc = args.doc.read_text()
    kv_path, tp_path = args.results / "kv_memory.json", args.results / "throughput.json"
    if kv_path.exists():
        kv = json.loads(kv_path.read_text())
        plot_kv_memory(kv, IMG / "kv_memory_over_time.png")
        plot_shared_prompt(kv, IMG / "shared_prompt_savings.png")
        doc = replace_section(doc, "kv_memory", kv_memory_markdown(kv))
    if tp_path.exists():
        tp = json.loads(tp_path.read_text())
        plot_throughput(tp, IMG / "throughput_vs_budget.png")
        doc = replace_section(doc, "throughput", throughput_markdown(tp))
    args.doc.write_text(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
