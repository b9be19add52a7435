"""The decision of `bema ship` as one frozen record, and the views rendered from it alone.

`contest` and `decision.decide` make the decision; `Decision.of` reads it once, from the document
ship writes (ship.json, the `--json` document): what ships, the finalists on the report items, the
blocked candidate and its guard, the other tasks, the notes and the verdict sentence. The verdict
line and its notes (`lines`), the model card's evaluation table (`card_rows`) and "Why this model",
`bema report DIR`'s table (report.ship_table) and the `--json` document (the document it is read
from, checked by reading it) are all rendered from that record, so none tells another story.
"""

from __future__ import annotations

from dataclasses import dataclass

from bema_cli.decide.verdict import fmt_diff


@dataclass(frozen=True)
class Blocked:
    """An average that won on the metric and that a guard kept from shipping."""

    run: str
    kind: str  # "menu" or "fitted"
    guard: str  # the guard task that said no


@dataclass(frozen=True)
class Shipped:
    """What ships and the numbers that say why: made by `decision.decide`, changed by a blocking
    guard (`blocked`), written into the document as `decision` (`doc`) and read back (`of`)."""

    run: str
    step: int
    kind: str  # "vanilla", "menu" or "fitted"
    value: float  # on the report items
    vs_vanilla: dict | None = None  # the shipped average's difference and interval
    mdd: float | None = None  # the smallest difference the report items resolve
    corrected: float | None = None  # the shipped difference after the winner's-curse correction
    undecided: str | None = None  # why no average could be decided on (too few report items)
    blocked: Blocked | None = None

    def blocked_by(self, guard: str, vanilla_value: float) -> Shipped:
        """Vanilla ships: this average won on the metric and the guard task `guard` blocked it."""
        return Shipped(
            "vanilla", self.step, "vanilla", vanilla_value, blocked=Blocked(self.run, self.kind, guard)
        )

    def doc(self) -> dict:
        """As the document says it: the fields that are set, `blocked` a mapping."""
        out = {k: v for k, v in vars(self).items() if v is not None and k != "blocked"}
        if self.blocked is not None:
            out["blocked"] = dict(vars(self.blocked))
        return out

    @classmethod
    def of(cls, doc: dict) -> Shipped:
        """The record of a document's `decision`; KeyError/TypeError on one bema did not write."""
        blocked = doc.get("blocked")
        return cls(
            str(doc["run"]),
            int(doc["step"]),
            str(doc["kind"]),
            float(doc["value"]),
            doc.get("vs_vanilla"),
            doc.get("mdd"),
            doc.get("corrected"),
            doc.get("undecided"),
            Blocked(str(blocked["run"]), str(blocked["kind"]), str(blocked["guard"])) if blocked else None,
        )


@dataclass(frozen=True)
class Row:
    """One finalist on the report items: its value, 95% interval and difference to vanilla."""

    run: str
    kind: str  # "vanilla", "menu" or "fitted"
    value: float
    interval: tuple[float, float] | None
    vs_vanilla: dict | None


@dataclass(frozen=True)
class OtherTask:
    """A task other than the metric's, scored for the decision's candidate and vanilla (a guard)."""

    task: str
    metric: str
    candidate: str  # the candidate scored beside vanilla (the shipped one, or the one a guard blocked)
    value: float  # that candidate's
    vanilla: float
    vs_vanilla: dict | None


@dataclass(frozen=True)
class Decision:
    task: str
    metric: str
    higher_is_better: bool
    step: int
    report_items: int
    made: Shipped  # what ships, what a guard blocked, and their numbers
    verdict: str  # the one sentence every view says
    rows: tuple[Row, ...]  # the finalists on the report items, the fitted best last
    others: tuple[OtherTask, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def shipped(self) -> str:
        """The run that ships."""
        return self.made.run

    @property
    def kind(self) -> str:
        return self.made.kind

    @classmethod
    def of(cls, doc: dict) -> Decision:
        """The record of a ship document (ship.json, `--json`); KeyError/TypeError/ValueError on a
        document bema did not write."""
        chosen = doc["select"]
        rows = [
            Row(
                c["run"],
                "vanilla" if c["run"] == "vanilla" else "menu",
                float(c["value"]),
                _pair(c["interval"]),
                c["vs_vanilla"],
            )
            for c in chosen["candidates"]
        ]
        best = (doc.get("fitted") or {}).get("best")
        if best and best.get("vs_vanilla"):  # scored on the report items: vanilla's value + the difference
            vanilla = next(r.value for r in rows if r.run == "vanilla")
            value = vanilla + float(best["vs_vanilla"]["value"])
            rows.append(Row(best["run"], "fitted", value, _pair(best.get("interval")), best["vs_vanilla"]))
        others = [
            OtherTask(
                task,
                o["metric"],
                o["candidate"],
                float(o["shipped"]),
                float(o["vanilla"]),
                o.get("vs_vanilla"),
            )
            for task, o in (doc.get("other_tasks") or {}).items()
        ]
        notes = doc.get("notes", [])
        if not isinstance(doc["verdict"], str) or not isinstance(notes, list):
            raise TypeError("the verdict is not a sentence, or the notes not a list")
        decision = cls(
            chosen["task"],
            chosen["metric"],
            bool(chosen["higher_is_better"]),
            int(doc["step"]),
            int(chosen["selection"]["reported_on"]),
            Shipped.of(doc["decision"]),
            doc["verdict"],
            tuple(rows),
            tuple(others),
            tuple(str(n) for n in notes),
        )
        decision.row(decision.shipped)  # what ships is among the finalists
        return decision

    def row(self, run: str) -> Row:
        found = [r for r in self.rows if r.run == run]
        if not found:
            raise ValueError(f"{run!r} is not among the finalists")
        return found[0]

    def mark(self, row: Row) -> str:
        """What became of a finalist: shipped, blocked by a guard, or (a fit) not shipped."""
        if row.run == self.shipped:
            return "shipped"
        blocked = self.made.blocked
        if blocked and row.run == blocked.run:
            return f"blocked by the {blocked.guard} guard"
        return "fitted" if row.kind == "fitted" else ""

    def lines(self) -> list[str]:
        """The verdict and its notes, as the command prints them."""
        return [self.verdict, *(f"note: {n}" for n in self.notes)]

    def card_rows(self) -> list[dict]:
        """The card's evaluation table: the shipped model on the metric (a candidate a guard blocked
        beside it, not shipped), then each other task for the candidate scored there and vanilla."""
        out = []
        for row in self.rows:
            if row.run == self.shipped or self.mark(row).startswith("blocked"):
                this = row.run == self.shipped
                vs = f"vs vanilla {fmt_diff(row.vs_vanilla)}" if row.vs_vanilla else ""
                out.append(
                    {
                        "dataset": self.task,
                        "metric": self.metric,
                        "value": row.value,
                        "interval": row.interval,
                        "vs": vs if this else f"not shipped ({self.mark(row)}): {row.run} {vs}",
                    }
                )
        for o in self.others:
            this = o.candidate == self.shipped
            vs = f"{'' if this else 'not shipped: '}{o.candidate} vs vanilla {fmt_diff(o.vs_vanilla)}"
            out.append(
                {
                    "dataset": o.task,
                    "metric": o.metric,
                    "value": o.value if this else o.vanilla,
                    "interval": None,
                    "vs": vs if o.vs_vanilla else "",
                }
            )
        return out


def _pair(interval) -> tuple[float, float] | None:
    if interval is None:
        return None
    lo, hi = interval
    return float(lo), float(hi)
