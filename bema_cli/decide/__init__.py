"""Deciding what to ship: selection statistics (select.py), fitted averages (fit.py), `bema ship`
(ship.py: sweep -> select -> fit -> write -> push, no logic of its own) and the Hub (push.py)."""
