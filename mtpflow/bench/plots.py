"""``mtpflow bench``'s PNG plots: throughput against block size, acceptance per position."""

from __future__ import annotations

from pathlib import Path

def _plots(result: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    vs = result["variants"]
    batches = sorted({v["batch_size"] for v in vs})
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for b in batches:
        pts = sorted(((v["block_size"], v["tokens_per_s"]) for v in vs
                      if v["batch_size"] == b and v["engine"] == "mtpflow" and v["kind"] not in ("null", "tree")
                      and not v["name"].startswith("mtpflow-default") and v["tokens_per_s"]["median"]),
                     key=lambda p: p[0])
        if pts:
            xs = [p[0] for p in pts]
            ys = [p[1]["median"] for p in pts]
            err = [[y - p[1]["min"] for y, p in zip(ys, pts)], [p[1]["max"] - y for y, p in zip(ys, pts)]]
            line = ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=f"mtpflow b{b}")
            color = line[0].get_color()
        else:
            color = None
        for v in vs:
            if v["batch_size"] == b and v["tokens_per_s"]["median"]:
                if v["kind"] == "target_only":
                    ax.axhline(v["tokens_per_s"]["median"], ls="--", color=color, alpha=0.7, label=f"mlx_lm b{b}")
                elif v["kind"] == "null":
                    ax.axhline(v["tokens_per_s"]["median"], ls=":", color=color, alpha=0.7, label=f"mtpflow null b{b}")
        spec = sorted((v["block_size"], v["tokens_per_s"]["median"]) for v in vs
                      if v["batch_size"] == b and v["kind"] == "mlx_lm_speculative" and v["tokens_per_s"]["median"])
        if spec:
            ax.plot([p[0] for p in spec], [p[1] for p in spec], marker="s", ls="-.", label=f"mlx_lm spec b{b}")
    ax.set_xlabel("block size (drafts + 1)")
    ax.set_ylabel("tokens / s (median over repeats)")
    ax.set_title(f"{Path(result['meta']['target']).name}: throughput")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    p = out / "tokens_per_s.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    files.append(p.name)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    any_line = False
    for v in vs:
        acc = v.get("acceptance_per_position") or []
        if acc:
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=v["name"])
            any_line = True
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance (fraction of row-rounds)")
    ax.set_ylim(0, 1.02)
    ax.set_title("acceptance per position")
    ax.grid(alpha=0.3)
    if any_line:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no drafting variant", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    p = out / "acceptance_per_position.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    files.append(p.name)
    return files
