"""PNG figures of benchmark results (matplotlib, the `bench` extra): the W1 modes of
`nanopipe bench throughput`, with a profile's per-step breakdown when given, and W2's curves
per rate."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_pipeline(results: list[dict], out: str | Path, profile: dict | None = None) -> Path:
    """Bars of output tok/s per mode (and the peer's), each labelled with its GPU idle share;
    with a `nanopipe profile step` JSON, a second panel of GPU ms per decode step by category."""
    plt = _pyplot()
    panels = 2 if profile else 1
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    ax = axes[0][0]
    names = [r["mode"] for r in results]
    values = [r["output_tok_s"] for r in results]
    bars = ax.bar(names, values, color="tab:blue")
    for bar, r in zip(bars, results, strict=True):
        idle = r.get("gpu_idle_pct")
        label = f"{r['output_tok_s']:,.0f}" + ("" if idle is None else f"\nidle {idle:.0f}%")
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("output tok/s")
    ax.set_title("W1 offline throughput")
    ax.margins(y=0.2)
    if profile:
        ax2 = axes[0][1]
        cats = profile["gpu_ms_per_step"]
        ax2.barh(list(cats), list(cats.values()), color="tab:orange")
        ax2.set_xlabel("GPU ms per decode step")
        ax2.set_title(f"steps {profile['steps'][0]}-{profile['steps'][1]}: "
                      f"{profile['launches_per_step']:.0f} launches/step, "
                      f"busy {profile['gpu_busy_fraction']:.0%}")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return Path(out)


def plot_serving(results: list[dict], out: str | Path) -> Path:
    """Output tok/s, TTFT and ITL (p50 and p99) against the request rate."""
    plt = _pyplot()
    rates = [r["rate_req_s"] for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(rates, [r["output_tok_s"] for r in results], "o-")
    axes[0].set_ylabel("output tok/s")
    for ax, key, name in ((axes[1], "ttft", "TTFT"), (axes[2], "itl", "inter-token latency")):
        for q in ("p50", "p99"):
            ax.plot(rates, [r[f"{key}_ms_{q}"] for r in results], "o-", label=q)
        ax.set_ylabel(f"{name} (ms)")
        ax.legend()
    for ax in axes:
        ax.set_xlabel("request rate (req/s)")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    fig.suptitle("W2 online serving")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return Path(out)
