"""Deciding what to ship: the request (request.py), selection statistics (select.py), the race
(race.py, menu.py), fitted averages (fit.py, search.py), the guards (guard.py), the decision and
its one record (contest.py, decision.py, outcome.py) and the dry run's budget (budget.py)."""
