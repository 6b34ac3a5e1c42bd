"""python -m loadtest.stack.plot_serving DIR/serving.json: the serving benchmark's plots, PNGs beside the JSON.

- cdf-<workload>.png: the CDFs of TTFT, TPOT and ITL of each mode, one figure per workload;
- goodput.png: SLO attainment and output tokens/s against the offered rate, per mode, with the
  attainment objective and each mode's goodput;
- tpot-over-time.png: the inter-token gaps of the requests decoding when the burst arrived, with the
  burst and in the replay without it, one panel per mode.

Apart from the benchmark because the GPU image has no matplotlib: plot here from the JSON brought back.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from loadtest.lib.percentiles import quantile  # noqa: E402

METRICS = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"))


def measured_modes(report: dict) -> dict[str, dict]:
    return {name: mode for name, mode in report["modes"].items() if mode["workloads"]}


def plot_cdfs(report: dict, folder: Path) -> list[Path]:
    modes = measured_modes(report)
    names = list(dict.fromkeys(w for mode in modes.values() for w in mode["workloads"]))
    written = []
    for workload in names:
        figure, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        for axis, (key, label) in zip(axes, METRICS):
            largest = 0.0
            for mode_name, mode in modes.items():
                points = mode["workloads"].get(workload, {}).get("cdf", {}).get(key)
                if points:
                    axis.plot(points, [i / (len(points) - 1) for i in range(len(points))], label=mode_name)
                    largest = max(largest, points[-1])
            objective = {"ttft_s": report["slo"]["ttft_s"], "tpot_s": report["slo"]["tpot_s"]}.get(key)
            title = f"{label}, {workload}" + (f" (objective {objective:g} s)" if objective else "")
            axis.set(title=title, xlabel="seconds", ylim=(0, 1.01))
            draw_objective(axis.axvline, objective, largest)
            axis.grid(alpha=0.3)
        axes[0].set_ylabel("fraction of requests")
        axes[0].legend()
        written.append(save(figure, folder / f"cdf-{file_part(workload)}.png"))
    return written


def plot_goodput(report: dict, folder: Path) -> list[Path]:
    figure, (attained, throughput) = plt.subplots(1, 2, figsize=(12, 4.2))
    drawn = False
    for name, mode in measured_modes(report).items():
        # The Poisson rates only (a report from before the trace's speeds has no family: all were Poisson).
        rows = sorted((w["offered_rps"], w) for w in mode["workloads"].values()
                      if w["offered_rps"] and w.get("family", "poisson") == "poisson")
        if not rows:
            continue
        drawn = True
        rates = [rate for rate, _ in rows]
        line, = attained.plot(rates, [w["slo_attainment"] for _, w in rows], marker="o",
                              label=f"{name} (goodput {mode['goodput_rps']:g} req/s)")
        if mode["goodput_rps"]:
            attained.axvline(mode["goodput_rps"], color=line.get_color(), linestyle=":", linewidth=1)
        throughput.plot(rates, [w["output_tokens_per_s"] for _, w in rows], marker="o", label=name)
    if not drawn:
        plt.close(figure)
        return []
    slo = report["slo"]
    attained.axhline(slo["attainment"], color="grey", linestyle="--", linewidth=1)
    attained.set(title=f"requests meeting TTFT <= {slo['ttft_s']:g} s and TPOT <= {slo['tpot_s']:g} s",
                 xlabel="offered requests/s", ylabel="fraction of requests sent", ylim=(-0.02, 1.02))
    throughput.set(title="output tokens/s", xlabel="offered requests/s")
    for axis in (attained, throughput):
        axis.grid(alpha=0.3)
        axis.legend()
    return [save(figure, folder / "goodput.png")]


def plot_tpot_over_time(report: dict, folder: Path) -> list[Path]:
    bursts = {name: mode["burst"] for name, mode in measured_modes(report).items() if mode.get("burst")}
    if not bursts:
        return []
    figure, axes = plt.subplots(len(bursts), 1, figsize=(12, 3.6 * len(bursts)), squeeze=False, sharex=True)
    for axis, (name, burst) in zip(axes[:, 0], bursts.items()):
        for run, color in (("without_burst", "tab:blue"), ("with_burst", "tab:red")):
            points = burst["itl_series"][run]
            axis.scatter([t for t, _ in points], [gap for _, gap in points], s=4, alpha=0.3, color=color,
                         label=run.replace("_", " "))
            axis.plot(*binned_p99(points), color=color, linewidth=1.5, label=f"{run.replace('_', ' ')}, P99 per bin")
        axis.axvline(burst["at_s"], color="black", linewidth=1, label="burst arrives")
        gaps = [gap for run in burst["itl_series"].values() for _, gap in run]
        draw_objective(axis.axhline, report["slo"]["tpot_s"], max(gaps, default=0.0))
        ratio = burst["p99_ratio"]
        axis.set(title=f"{name}: requests decoding at the burst: {len(burst['decoding_requests'])}; "
                       f"P99 TPOT with/without the burst: {'n/a' if ratio is None else f'{ratio:.2f}x'}",
                 ylabel="inter-token gap (s)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    axes[-1, 0].set_xlabel("seconds since the replay started")
    return [save(figure, folder / "tpot-over-time.png")]


def binned_p99(points: list[list[float]], bins: int = 30) -> tuple[list[float], list[float]]:
    """The P99 gap in each of `bins` equal time windows (their middles), so a spike reads at a glance."""
    if not points:
        return [], []
    start, end = points[0][0], points[-1][0] + 1e-9
    width = (end - start) / bins
    windows: dict[int, list[float]] = {}
    for at, gap in points:
        windows.setdefault(int((at - start) / width), []).append(gap)
    return ([start + (k + 0.5) * width for k in sorted(windows)],
            [quantile(windows[k], 0.99) for k in sorted(windows)])


def draw_objective(draw_line, objective: float | None, largest: float) -> None:
    """A dashed line at the objective, unless it lies far past the data (it would squash the curves)."""
    if objective and (not largest or objective <= 2 * largest):
        draw_line(objective, color="grey", linestyle="--", linewidth=1, label="objective")


def file_part(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "-" for c in name)


def save(figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot(report_path: Path) -> list[Path]:
    report = json.loads(report_path.read_text())
    folder = report_path.parent
    return plot_cdfs(report, folder) + plot_goodput(report, folder) + plot_tpot_over_time(report, folder)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.stack.plot_serving", description=__doc__.split("\n")[0])
    parser.add_argument("report", type=Path, help="serving.json written by loadtest.stack.bench_serving")
    args = parser.parse_args()
    for path in plot(args.report):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
