"""Output of ``attnpool bench``: Markdown tables of medians and ratios, and the optional plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .words import plural


def _fmt_s(s: float) -> str:
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def ratio(x: float) -> str:
    """A ratio with two significant digits at least: ``0.56``, ``0.004``, ``4.1e-05`` (a
    fixed ``.2f`` prints every ratio under 0.005 as ``0.00``)."""
    return f"{x:.2f}" if x >= 0.1 else f"{x:.2g}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table (readable as plain text too)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def format_report(rep: dict[str, Any], baselines: set[str]) -> str:
    """Tables of medians with ``impl / baseline`` ratios, one per group, plus memory.

    ``baselines`` names the implementations the ratios divide by; ``rep["columns"]`` (when
    present) says what each column measures, listed under the tables, since a column's name
    alone (``attnpool-reference-static``) does not.
    """
    out = [f"machine: {json.dumps(rep['machine'])}"]
    rat = {(r["group"], r["case"], r["impl"]): r["ratio"] for r in rep["ratios"]}
    for group in ("init", "update"):
        rs = [r for r in rep["results"] if r["group"] == group]
        impls = list(dict.fromkeys(r["impl"] for r in rs))
        base = [i for i in impls if i in baselines]
        others = [i for i in impls if i not in base]
        med = {(r["case"], r["impl"]): r["median_s"] for r in rs}
        header = ["case", *impls, *(f"{i} / {base[0]}" for i in others if base)]
        rows = []
        for case in dict.fromkeys(r["case"] for r in rs):
            row = [case] + [_fmt_s(med[(case, i)]) if (case, i) in med else "-" for i in impls]
            row += [ratio(rat[(group, case, i)]) if (group, case, i) in rat else "-"
                    for i in others if base]
            rows.append(row)
        if rows:
            out += ["", f"{group} (median per call)", _table(header, rows)]
    mem = [[m["case"], f"{m['separate_nbytes'] / 2**20:.1f} MiB",
            f"{m['overlaid_nbytes'] / 2**20:.1f} MiB", ratio(m["ratio"])] for m in rep["memory"]]
    if mem:
        out += ["", "memory", _table(["case", "separate", "overlaid", "overlaid / separate"], mem)]
    about = rep.get("columns", {})
    seen = dict.fromkeys(r["impl"] for r in rep["results"])
    if any(i in about for i in seen):
        out += ["", "columns (ratios: column / baseline median; below 1: attnpool is faster or "
                "smaller)"]
        out += [f"  {i}: {about[i]}" for i in seen if i in about]
    why: dict[tuple[str, str], int] = {}
    for s in rep["skipped"]:
        why[(s["impl"], s["reason"])] = why.get((s["impl"], s["reason"]), 0) + 1
    out += [f"skipped {impl} ({plural(k, 'case')}): {reason}" for (impl, reason), k in why.items()]
    return "\n".join(out)


def plot(rep: dict[str, Any], path: str) -> None:
    """Per-step update time vs batch size, one panel per phase/page size, one line per path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = [r for r in rep["results"] if r["group"] == "update"]
    panels = list(dict.fromkeys(r["part"] for r in rs)) or ["(no update cases)"]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        for impl in dict.fromkeys(r["impl"] for r in rs):
            pts = sorted((r["bs"], r["median_s"] * 1e6) for r in rs
                         if r["impl"] == impl and r["part"] == panel)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        ax.set(title=panel, xlabel="batch size", ylabel="median us / step", yscale="log")
        ax.legend(fontsize=8)
    fig.suptitle(f"metadata update per step ({rep['machine']['device']})")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
