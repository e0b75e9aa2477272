"""The timeline picture of ``bench --engine vllm --overlap --plot PATH`` (needs the ``plot`` extra).

One panel per refit path (overlapped, paused): vLLM's engine steps (``execute_model``
through ``sample_tokens``) as bars on the top row, below them the controller's calls (``start_weight_update``,
``update_weights``, the readiness polls, ``finish_weight_update``) and, for the
overlapped refit, what vLLM's worker reported (receive in flight, post-processing,
swap). Milliseconds from the controller's ``start_weight_update`` call; the longest gap
between two steps (the stall) is marked.
"""

from __future__ import annotations

from typing import Any

from policyworker.errors import ConfigError

__all__ = ["plot_timelines", "require_matplotlib"]

_ROWS = ("engine steps", "start_weight_update", "update_weights", "ready polls", "finish_weight_update",
         "receive (worker)", "post-processing (worker)", "swap (worker)")
_COLORS = {"start_weight_update": "tab:gray", "update_weights": "tab:blue", "ready polls": "tab:olive",
           "finish_weight_update": "tab:red", "receive (worker)": "tab:cyan",
           "post-processing (worker)": "tab:purple", "swap (worker)": "tab:red"}


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` with a file-only backend; ConfigError naming the extra without it."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'policyworker[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _spans(timeline: dict[str, Any]) -> dict[str, tuple[float, float]]:
    spans = {name: (a, b) for name, (a, b) in timeline["calls"].items() if b > a}
    w = timeline["worker"]
    if "receive_end" in w:
        spans["receive (worker)"] = (w["receive_start"], w["receive_end"])
    if "prepare_end" in w:
        spans["post-processing (worker)"] = (w["receive_end"], w["prepare_end"])
    if "swap_end" in w:
        spans["swap (worker)"] = (w["swap_start"], w["swap_end"])
    return spans


def _longest_gap(passes: list[tuple[float, float]], start: float, end: float) -> tuple[float, float] | None:
    gaps = [(e1, s2) for (_, e1), (s2, _) in zip(passes, passes[1:]) if s2 > start and e1 < end]
    return max(gaps, key=lambda g: g[1] - g[0]) if gaps else None


def plot_timelines(result: dict[str, Any], path: str) -> None:
    """Write the PNG of ``result["timelines"]`` (the bench's JSON result) to ``path``."""
    plt = require_matplotlib()
    modes = [m for m in ("overlap", "paused") if m in result["timelines"]]
    fig, axes = plt.subplots(len(modes), 1, figsize=(11, 2.6 * len(modes)), squeeze=False)
    for ax, mode in zip(axes[:, 0], modes):
        tl = result["timelines"][mode]
        row = next(r for r in result["refits"] if r["version"] == tl["version"])
        ms = [(a * 1e3, b * 1e3) for a, b in tl.get("steps", tl["passes"])]
        y = {name: len(_ROWS) - 1 - i for i, name in enumerate(_ROWS)}
        ax.broken_barh([(a, max(b - a, 0.05)) for a, b in ms], (y["engine steps"] - 0.4, 0.8), color="black")
        for name, (a, b) in _spans(tl).items():
            ax.broken_barh([(a * 1e3, max((b - a) * 1e3, 0.3))], (y[name] - 0.35, 0.7), color=_COLORS[name])
        end = row["refit_seconds"] * 1e3
        gap = _longest_gap(ms, 0.0, end)
        if gap is not None:
            ax.axvspan(gap[0], gap[1], color="tab:orange", alpha=0.25)
        ax.axvline(0.0, color="gray", lw=0.5)
        ax.axvline(end, color="gray", lw=0.5)
        ax.set_yticks(list(y.values()), list(y))
        ax.tick_params(axis="y", labelsize=7)
        ax.set_xlim(-150, end + 150)
        ax.set_title(f"{'overlapped' if mode == 'overlap' else 'paused'} refit (version {tl['version']}): "
                     f"{end:.0f} ms, stall {row['stall_seconds'] * 1e3:.1f} ms (orange)", fontsize=9)
    axes[-1, 0].set_xlabel("ms from the start_weight_update call")
    fig.suptitle(f"vLLM engine steps during a refit: preset {result.get('preset', 'custom')}, "
                 f"{result.get('dtype', '')}, "
                 f"{result['load_streams']} streams of load", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
