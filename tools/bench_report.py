"""Turn a benchmark run into the docs' results page: tables and PNG plots.

    python tools/bench_report.py OUT/bench [--docs docs]

Reads every ``<name>.json`` / ``<name>.md`` a ``bench_*.py --out DIR`` wrote (and ``sources.md``
there, if present, as the page's opening: which run each file came from). Files in the shared
format (``{"ceiling": ..., "rows": [...]}``, written by bench_utils.write) get one plot per
benchmark: TB/s per case for each implementation, with the copy bandwidth measured in the same
run drawn as the ceiling. Every file's markdown table goes on the page as it is. Writes
``docs/benchmark-results.md`` and ``docs/bench/*.png``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


# Extra keys that give a row's size, so that its plot is bandwidth against size.
SIZE_KEYS = (("numel", "elements"), ("H", "hidden size H"))


def size_key(rows: list[dict]) -> tuple[str, str] | None:
    for key, label in SIZE_KEYS:
        if rows and all(isinstance(r.get("extra", {}).get(key), (int, float)) for r in rows):
            return key, label
    return None


def plot(name: str, bench: str, rows: list[dict], ceiling: dict, out: Path) -> Path:
    """TB/s per implementation against size (log axis) when every row carries one, else grouped
    bars per case; the copy bandwidth of the same run as a dashed ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impls = list(dict.fromkeys(r["impl"] for r in rows))
    sized = size_key(rows)
    copy = ceiling["gbytes"] / ceiling["ms"]
    if sized:
        key, label = sized
        fig, ax = plt.subplots(figsize=(7.0, 4.2))
        for impl in impls:
            pts = sorted((r["extra"][key], r["tbps"]) for r in rows if r["impl"] == impl)
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(label)
    else:
        cases = list(dict.fromkeys(r["case"] for r in rows))
        fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(cases) + 3), 4.2))
        width = 0.8 / max(len(impls), 1)
        for k, impl in enumerate(impls):
            pts = {r["case"]: r["tbps"] for r in rows if r["impl"] == impl}
            xs = [i for i, c in enumerate(cases) if c in pts]
            ax.bar([x - 0.4 + width * (k + 0.5) for x in xs], [pts[cases[i]] for i in xs],
                   width=width, label=impl)  # fmt: skip
        ax.set_xticks(range(len(cases)), cases, rotation=20, ha="right", fontsize=8)
    ax.axhline(copy, color="black", linestyle="--", linewidth=1, label=f"copy {copy:.2f} TB/s")
    ax.set_ylabel("TB/s (bytes that must move / time)")
    ax.set_ylim(bottom=0, top=copy * 1.15)
    ax.set_title(f"{name}: {bench}")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path = out / f"{slug(name)}-{slug(bench)}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bench_dir", type=Path, help="the --out folder of the bench_*.py scripts")
    p.add_argument("--docs", type=Path, default=Path(__file__).resolve().parents[1] / "docs")
    args = p.parse_args()
    files = sorted(args.bench_dir.glob("*.json"))
    if not files:
        print(f"no benchmark results in {args.bench_dir}", file=sys.stderr)
        return 1
    img_dir = args.docs / "bench"
    img_dir.mkdir(parents=True, exist_ok=True)
    for old in img_dir.glob("*.png"):
        old.unlink()
    page = []
    sources = args.bench_dir / "sources.md"  # optional: which run each file came from
    if sources.is_file():
        page.append(sources.read_text().strip() + "\n")
    for f in files:
        name = f.stem
        data = json.loads(f.read_text())
        page.append(f"### {name}\n")
        md = f.with_suffix(".md")
        if md.is_file():
            # The page sits under the docs' own headings: a script's headings become bold lines.
            text = re.sub(r"(?m)^#{1,6}\s+(.*)$", r"**\1**", md.read_text().strip())
            page.append(text + "\n")
        if isinstance(data, dict) and "ceiling" in data and "rows" in data:
            rows = [r for r in data["rows"] if r.get("tbps") == r.get("tbps")]  # drop NaN
            for bench in dict.fromkeys(r["bench"] for r in rows):
                path = plot(name, bench, [r for r in rows if r["bench"] == bench],
                            data["ceiling"], img_dir)  # fmt: skip
                page.append(f"![{name}: {bench}](bench/{path.name})\n")
    (args.docs / "benchmark-results.md").write_text("\n".join(page))
    print(
        f"wrote {args.docs / 'benchmark-results.md'} and {len(list(img_dir.glob('*.png')))} plots"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
