"""`bema simulate`'s presentation: the results as a rich table and two figures (matplotlib
imported lazily), apart from the simulation itself (simulate.py)."""

from __future__ import annotations

import math

import numpy as np

from bema_cli.simulate import SimSettings

MAX_TABLE_ROWS = 20


def table(doc: dict) -> object:
    """Mean error per recorded step (at most ~20 rows; --json has all, with standard errors); best in bold."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    steps, est, th = doc["steps"], doc["estimators"], doc["theory"]
    stride = max(1, math.ceil(len(steps) / MAX_TABLE_ROWS))
    rows = sorted({*range(0, len(steps), stride), len(steps) - 1})
    s = doc["settings"]
    title = (
        f"mean |estimate - mu|^2 over {s['trials']} trials (dim {s['dim']}, lr {s['lr']}, sigma {s['sigma']}, "
        f"spectrum {s['spectrum']}; kappa {s['kappa']}, eta {s['eta']}, rho {s['rho']}, gamma {s['gamma']})"
    )
    rel = [v["stderr"][i] / v["mean"][i] for v in est.values() for i in rows if v["mean"][i] > 0]
    caption = (
        [f"showing {len(rows)} of {len(steps)} recorded steps (--json has all)"]
        if len(rows) < len(steps)
        else []
    )
    if rel and not any(math.isnan(r) for r in rel):
        caption.append(f"standard errors <= {100 * max(rel):.1f}% of the means")
    caption.append("exact: vanilla's exact expected error; CR: the Cramer-Rao-type bound")
    out = Table(title=title, caption="; ".join(caption), box=box.SIMPLE_HEAD)
    for col in ("step", *est, "exact", "CR"):
        out.add_column(col, justify="right", no_wrap=True)
    for i in rows:
        best = min(est, key=lambda m: est[m]["mean"][i])
        cells = [Text(f"{v['mean'][i]:.3g}", style="bold" if m == best else "") for m, v in est.items()]
        out.add_row(str(steps[i]), *cells, f"{th['vanilla_exact'][i]:.3g}", f"{th['cramer_rao'][i]:.3g}")
    return out


def plot_curves(doc: dict, path: str) -> None:
    """Fig. 2 style: expected squared distance to mu vs SGD step, log scale, theory lines dashed."""
    from bema_cli import figures

    steps = np.asarray(doc["steps"])
    fig = figures.new_figure(9.0, 5.5)
    ax = fig.add_subplot()
    for m, v in doc["estimators"].items():
        mean, se = np.asarray(v["mean"]), np.asarray(v["stderr"], dtype=float)
        style = figures.run_style(m)
        ax.plot(steps, mean, color=style["color"], lw=1.8, ls=style["ls"], label=figures.run_label(m))
        if np.isfinite(se).all():
            ax.fill_between(
                steps,
                np.maximum(mean - 2 * se, mean * 1e-3),
                mean + 2 * se,
                color=figures.run_color(m),
                alpha=0.18,
                lw=0,
            )
    ax.plot(steps, doc["theory"]["vanilla_exact"], color="black", ls=":", lw=1.5, label="vanilla, exact")
    ax.plot(steps, doc["theory"]["cramer_rao"], color="black", ls="-.", lw=1.2, label="Cramer-Rao bound")
    ax.set_yscale("log")
    ax.set_xlabel("SGD step s  (time T = lr * s)")
    ax.set_ylabel("E |estimate - mu|^2")
    s = doc["settings"]
    ax.set_title(
        f"Noisy quadratic: dim {s['dim']}, lr {s['lr']}, sigma {s['sigma']}, |theta0 - mu| {s['distance']}, "
        f"{s['trials']} trials\nkappa {s['kappa']}, eta {s['eta']}, rho {s['rho']}, gamma {s['gamma']} "
        f"(bands: +-2 standard errors)",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    fig.legend(loc="outside right upper")
    figures.save(fig, path, "--plot")


def plot_2d(traj: dict, st: SimSettings, path: str) -> None:
    """Fig. 1a style: one 2-D trajectory with the vanilla, EMA and BEMA paths over the loss contours."""
    from bema_cli import figures

    fig = figures.new_figure(7.5, 6.0)
    ax = fig.add_subplot()
    paths = traj["paths"]
    every = np.concatenate([p for p in paths.values()])
    lo, hi = every.min(axis=0), every.max(axis=0)
    pad = 0.08 * (hi - lo).max() + 1e-9
    x, y = np.meshgrid(np.linspace(lo[0] - pad, hi[0] + pad, 200), np.linspace(lo[1] - pad, hi[1] + pad, 200))
    a1, a2 = traj["eigenvalues"]
    ax.contour(x, y, 0.5 * (a1 * x**2 + a2 * y**2), levels=12, colors="0.8", linewidths=0.7)
    for m, p in paths.items():
        ax.plot(
            p[:, 0],
            p[:, 1],
            color=figures.run_color(m),
            lw=1.0 if m == "vanilla" else 1.8,
            alpha=0.6 if m == "vanilla" else 1.0,
            label=m,
        )
    # Fig. 1a's point: at the same step, where is each estimate? (EMA lags behind, BEMA does not)
    marks = [s for s in (10, 20, 40, 80, 160, 320, 640) if s <= st.steps]
    for s in marks:
        at = np.array([p[s] for p in paths.values()])
        ax.plot(at[:, 0], at[:, 1], color="0.3", ls=":", lw=0.8)
        ax.scatter(at[:, 0], at[:, 1], c=[figures.run_color(m) for m in paths], s=18, zorder=3)
        ax.annotate(
            f"s={s}",
            at[list(paths).index("ema") if "ema" in paths else 0],
            fontsize=8,
            xytext=(4, 4),
            textcoords="offset points",
        )
    ax.plot(*paths["vanilla"][0], "ko", ms=6, label="theta0 (start)")
    ax.plot(0, 0, "k*", ms=14, label="mu (optimum)")
    ax.set_aspect("equal", adjustable="datalim")
    ax.set_xlabel(f"theta[0]  (curvature {a1:g})")
    ax.set_ylabel(f"theta[1]  (curvature {a2:g})")
    ax.set_title(
        f"One SGD trajectory, {st.steps} steps (lr {st.lr}, sigma {st.sigma}, seed {st.seed})\n"
        f"kappa {st.kappa}, eta {st.eta}, rho {st.rho}, gamma {st.gamma}\ndots: the three estimates at the same step s",
        fontsize=10,
    )
    fig.legend(loc="outside right upper")
    figures.save(fig, path, "--plot-2d")
