"""`--plot DIR`: PNG charts (matplotlib, drawn only here; the command checks before the run
that it is installed)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from tollgate_llm.loadgen.clients import Attempt


def write_plots(directory: str, attempts: list[Attempt],
                kv_samples: list[tuple[float, str, str, float]], title: str) -> list[str]:
    import matplotlib  # present: the command checked before the run

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []

    # 1. latency over time: TTFT and end-to-end latency of each request by start time
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for label, pick, marker in (
        ("TTFT (streamed)", lambda a: a.ttft, "."),
        ("end-to-end (completed)", lambda a: a.latency if a.kind == "ok" else None, "x"),
    ):
        pts = [(a.t_start, pick(a)) for a in attempts if pick(a) is not None]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=6, marker=marker, label=label,
                       alpha=0.6)
    ax.set_yscale("log")
    ax.set_xlabel("request start (s since run start)")
    ax.set_ylabel("seconds")
    ax.set_title(f"Latency over time — {title}")
    ax.legend(loc="upper left")
    fig.tight_layout()
    path = out / "latency.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(str(path))

    # 2. admitted vs rejected by tier, per second
    buckets: dict[tuple[str, str], dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for a in attempts:
        outcome = "admitted" if a.status == 200 else "rejected" if a.status else "no response"
        buckets[(a.tier, outcome)][int(a.t_start)] += 1
    fig, ax = plt.subplots(figsize=(10, 4.5))
    horizon = int(max((a.t_start for a in attempts), default=0)) + 1
    for (tier, outcome), series in sorted(buckets.items()):
        xs = list(range(horizon))
        ax.plot(xs, [series.get(x, 0) for x in xs], label=f"{tier} {outcome}",
                linestyle="-" if outcome == "admitted" else "--")
    ax.set_xlabel("second of the run")
    ax.set_ylabel("requests / s")
    ax.set_title(f"Admitted vs rejected by tier — {title}")
    ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    path = out / "admissions.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(str(path))

    # 3. KV occupancy per replica, from tollgate_replica_kv_occupancy{replica,model}
    fig, ax = plt.subplots(figsize=(10, 4.5))
    series_kv: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for t, replica, _model, value in kv_samples:
        series_kv[replica].append((t, value))
    for replica, pts in sorted(series_kv.items()):
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=replica)
    if not series_kv:
        ax.text(0.5, 0.5, "no samples of tollgate_replica_kv_occupancy from /metrics",
                ha="center", transform=ax.transAxes)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("s since run start")
    ax.set_ylabel("KV-cache occupancy")
    ax.set_title(f"KV occupancy per replica — {title}")
    if series_kv:
        ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    path = out / "kv_occupancy.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(str(path))
    return written


