"""The grid of a `bema stabilize`/`sweep`/`ship` call: every (method, hyperparameter) config the
flags or a `--config grid.yaml` name, validated and counted before anything is read."""

from __future__ import annotations

import math
from pathlib import Path

from bema_cli import output
from bema_cli.errors import UsageError
from bema_cli.schedule import (
    AXES,
    DEFAULTS,
    EMA_FAMILY,
    METHODS,
    RECORD_NAMES,
    SHARED,
    Schedule,
    meta,
    run_name,
    swept_by,
    used_by,
)


def grid(methods: list[str], kappas: list | None = None, etas: list | None = None, **given) -> list[Schedule]:
    """Every combination of each method with the lists of the parameters it sweeps (each axis's list
    by its plural: `windows=[4, 8]`; the rest of `given`, the settings every config shares), validated,
    one per output run name. A list given for a parameter that no method of the grid sweeps is an
    error (None: not given, the default).

    Methods without bias correction (ema, dema, vanilla) record eta = inf, and BEMA with eta = inf
    (alpha = 0) is the EMA itself, so `--method bema,ema --eta 0.2,inf` writes that EMA once.
    """
    lists = {"kappa": kappas, "eta": etas} | {n: given.pop(plural(n)) for n in AXES if plural(n) in given}
    return _build(methods, lists, given)


def plural(name: str) -> str:
    """An axis's list as grid() takes it: kappas, windows, schedules."""
    return RECORD_NAMES[name] + "s"


def flag(name: str) -> str:
    return "--" + RECORD_NAMES[name].replace("_", "-")


def _build(methods: list[str], lists: dict, common: dict) -> list[Schedule]:
    if not methods:
        raise UsageError("--method: no method given")
    for name in AXES:
        users = meta(name)["swept_by"]
        if lists.get(name) is not None and not set(methods) & set(users):
            raise UsageError(
                f"{flag(name)}: applies to {', '.join(users)}, and the grid's methods ({', '.join(methods)}) include none"
            )
    kappas = lists.get("kappa") or [DEFAULTS["kappa"]]
    ema_like = set(methods) & set(EMA_FAMILY)
    for kappa in set(kappas) & ({0.0} | {k for k in kappas if k > 1}) if ema_like else ():
        output.warn(
            f"--kappa {kappa:g}: beta = 1 at every step, so the EMA is the current iterate (no averaging)"
            if kappa == 0
            else f"--kappa {kappa:g} > 1: the betas sum to a finite total, so the EMA never forgets theta0"
        )
    check_grid_size(grid_size(methods, lists))
    out: dict[str, Schedule] = {}
    for method in methods:
        for params in _configs(method, lists):
            s = Schedule(method=method, **params, **common).resolved()
            if method == "bema" and math.isinf(s.eta):  # alpha = 0: BEMA is the EMA, bit for bit
                s = Schedule(method="ema", **params, **common).resolved()
                output.log(
                    f"bema with --eta inf is {run_name(s)} (no bias correction): written once, as {run_name(s)}"
                )
            out.setdefault(run_name(s), s)
    return list(out.values())


def _configs(method: str, lists: dict) -> list[dict]:
    """A method's configs: its crossed axes' lists multiplied (a list not given: the default), times
    its `alone` axes' values one each (power: a sigma_rel or a power_gamma); the parameters it records
    without sweeping at their `unswept` value (ema's eta: inf), else the grid's first (vanilla's kappa)."""
    axes = swept_by(method)
    recorded = [n for n in used_by(method) if n in AXES and n not in axes]
    combos = [{n: _first(n, lists) if meta(n)["unswept"] is None else meta(n)["unswept"] for n in recorded}]
    for n in (n for n in axes if not meta(n)["alone"]):
        combos = [{**c, n: v} for c in combos for v in lists.get(n) or [DEFAULTS[n]]]
    alone = [{n: v} for n in axes if meta(n)["alone"] for v in lists.get(n) or ()] or [{}]
    return [{**c, **one} for c in combos for one in alone]


def _first(name: str, lists: dict):
    return (lists.get(name) or [DEFAULTS[name]])[0]


GRID_LIMIT = 4096  # configs in one grid: a sweep holds each one's state, stabilize writes each one


def grid_size(methods, lists: dict) -> int:
    """How many configs `grid` would build (before duplicates merge), counted without building them."""

    def count(method: str) -> int:
        axes = swept_by(method)
        crossed = math.prod(len(lists.get(n) or [None]) for n in axes if not meta(n)["alone"])
        return crossed * max(1, sum(len(lists.get(n) or ()) for n in axes if meta(n)["alone"]))

    return sum(count(m) for m in methods)


def check_grid_size(count: int, where: str = "the grid") -> None:
    if count > GRID_LIMIT:
        raise UsageError(f"{where}: {count:,} configs, over the limit of {GRID_LIMIT:,}; split the grid")


# --config FILE: each method with its own parameter lists (mergekit-style), keys as on the command line
CONFIG_KEYS = {m: tuple(RECORD_NAMES[n] for n in swept_by(m)) for m in METHODS}
CONFIG_COMMON = tuple(RECORD_NAMES[n] for n in SHARED)
AXIS_OF = {RECORD_NAMES[n]: n for n in AXES}  # a config key's axis: "schedule" is merge_schedule


def grid_from_config(path: str, **common) -> list[Schedule]:
    """The grid a YAML file describes: `methods:` maps each method to its own parameter lists
    (a scalar is a list of one), beside optional shared settings (`gamma`, `rho`, `tau`, `phi`,
    `beta_min`, `preset`) that override `common`. Unlike the flags, lists do not cross methods:

        methods:
          bema: {kappa: [0.5], eta: [0.2, 0.5]}
          ema: {kappa: 0.5}
          wsm: {window: [4, 8], schedule: [minus-sqrt, linear]}
    """
    import yaml

    from bema_cli.errors import InputError

    try:
        doc = yaml.load(Path(path).expanduser().read_text(), Loader=_strict_loader(yaml))  # noqa: S506 (a SafeLoader)
    except OSError as exc:
        raise InputError(f"{path}: cannot read the grid config ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise InputError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    except RecursionError:
        raise InputError(f"{path}: nested too deeply for a grid config") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("methods"), dict) or not doc["methods"]:
        raise InputError(f"{path}: expected a mapping with a non-empty 'methods:' mapping")
    unknown = sorted(set(doc) - {"methods", *CONFIG_COMMON})
    if unknown:
        raise InputError(f"{path}: unknown key {unknown[0]!r} (allowed: methods, {', '.join(CONFIG_COMMON)})")
    common = {**common, **{k: _config_value(path, k, doc[k]) for k in CONFIG_COMMON if k in doc}}
    per_method = {}
    for method, params in doc["methods"].items():
        if method not in CONFIG_KEYS:
            raise InputError(f"{path}: unknown method {method!r} (choose from {', '.join(CONFIG_KEYS)})")
        params = params or {}
        if not isinstance(params, dict):
            raise InputError(f"{path}: methods.{method} must map parameter names to values or lists")
        bad = sorted(set(params) - set(CONFIG_KEYS[method]))
        if bad:
            allowed = ", ".join(CONFIG_KEYS[method]) or "none"
            raise InputError(
                f"{path}: methods.{method}.{bad[0]} is not a {method} parameter (allowed: {allowed})"
            )
        per_method[method] = {
            AXIS_OF[k]: [
                _config_value(path, f"methods.{method}.{k}", x) for x in (v if isinstance(v, list) else [v])
            ]
            for k, v in params.items()
        }
    # counted before anything is built: the grid's size over every method
    check_grid_size(sum(grid_size([m], lists) for m, lists in per_method.items()), path)
    out: dict[str, Schedule] = {}
    for method, lists in per_method.items():
        try:  # the flags' own range checks, said of the file
            built = _build([method], lists, common)
        except UsageError as exc:
            raise InputError(f"{path}: methods.{method}: {str(exc).lstrip('-')}") from None
        for s in built:
            out.setdefault(run_name(s), s)
    return list(out.values())


def _strict_loader(yaml):
    """yaml's SafeLoader, refusing a key given twice in one mapping (PyYAML keeps the last silently,
    which drops a grid member)."""

    class Strict(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"duplicate key {key!r} (line {key_node.start_mark.line + 1})",
                        key_node.start_mark,
                    )
                seen.add(key)
            return super().construct_mapping(node, deep)

    return Strict


WHOLE_KEYS = ("window", "swa_start", "tau", "phi")  # the flags that take whole numbers


def _config_value(path: str, where: str, value):
    """A YAML value as the flag would parse it: windows, steps, tau and phi whole numbers, schedule
    and preset names, the rest numbers ('inf' and .inf alike); its range is checked as the flag's."""
    from bema_cli.errors import InputError

    key = where.rsplit(".", 1)[-1]
    if key in ("schedule", "preset"):
        if not isinstance(value, str):
            raise InputError(f"{path}: {where}: a {key} name, got {value!r}")
        return value
    try:
        if isinstance(value, bool):
            raise ValueError
        if key in WHOLE_KEYS:
            if isinstance(value, float) or int(value) != float(value):
                raise ValueError
            return int(value)
        return float(value)
    except (TypeError, ValueError):
        kind = "a whole number" if key in WHOLE_KEYS else "a number"
        raise InputError(f"{path}: {where}: {kind}, got {value!r}") from None
