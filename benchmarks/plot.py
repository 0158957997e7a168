"""A PNG of speedup vs ideal per distribution (needs matplotlib: extra `bench`)."""

from __future__ import annotations


def have_matplotlib() -> bool:
  import importlib.util  # pylint: disable=g-import-not-at-top
  return importlib.util.find_spec("matplotlib") is not None


def speedup_plot(results: list[dict], path: str, title: str) -> None:
  """Writes a bar chart: per case (grouped by count distribution), the speedup
  of each implementation over the masked scan, with the ideal B*T/sum(n_i) as
  a black tick.

  Args:
    results: rows from `harness.run_case`.
    path: the PNG to write.
    title: the figure's title (say the device and whether pallas is interpreted).

  Example:
    >>> import os, tempfile
    >>> from benchmarks import cases, harness
    >>> results = harness.run_case(cases.Case("tanh_rnn", 8, 16, 2, "uniform"), ["xla"],
    ...                            repeats=1)
    >>> path = os.path.join(tempfile.mkdtemp(), "speedup.png")
    >>> if have_matplotlib():  # the `bench` extra
    ...   speedup_plot(results, path, "CPU, 2 cores")
  """
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  order = {"constant": 0, "uniform": 1, "recurrent_depth": 2, "geometric": 3,
           "bimodal": 4, "adversarial": 5}
  case_names = sorted({r["case"] for r in results},
                      key=lambda c: (order.get(next(r["counts"] for r in results
                                                    if r["case"] == c), 9), c))
  impls = [i for i in ("vmap_while", "xla", "pallas") if any(r["impl"] == i for r in results)]
  width = 0.8 / max(1, len(impls))
  fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(case_names)), 4.5))
  for j, impl in enumerate(impls):
    xs, ys = [], []
    for i, c in enumerate(case_names):
      row = next((r for r in results if r["case"] == c and r["impl"] == impl), None)
      if row is not None:
        xs.append(i + (j - (len(impls) - 1) / 2) * width)
        ys.append(row["speedup_vs_masked_scan"])
    ax.bar(xs, ys, width, label=impl)
  ideal = [next(r["ideal_speedup"] for r in results if r["case"] == c) for c in case_names]
  ax.scatter(range(len(case_names)), ideal, marker="_", s=900, color="black",
             label="ideal B*T/sum(n)", zorder=3)
  ax.axhline(1.0, color="gray", lw=0.8)
  ax.set_yscale("log")
  # Ticks at plain ratios ("1.5x", "2x"), not the log axis' default "2x10^0",
  # and no minor-tick labels beside them.
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top
  ticks = [0.25, 0.5, 0.75, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
  ax.yaxis.set_major_locator(ticker.FixedLocator(ticks))
  ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
  ax.yaxis.set_minor_formatter(ticker.NullFormatter())
  ax.set_ylabel("speedup over masked scan")
  ax.set_xticks(range(len(case_names)))
  def short(c):
    r = next(r for r in results if r["case"] == c)
    extra = (" tol" if r["tol"] is not None else "") + (" +bwd" if r["grad"] else "")
    return f"{r['block']}\nB={r['batch']} D={r['d']}\n{r['counts']}{extra}"
  ax.set_xticklabels([short(c) for c in case_names], fontsize=7)
  ax.set_title(title, fontsize=9, pad=24)
  # The legend in one row between the title and the axes, where no bar or
  # ideal tick can lie under it.
  ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(impls) + 1,
            frameon=False, markerscale=0.4)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
