"""Publishing a decision: the model folder and its card (write.py), ship's records and their seal
(records.py), `bema verify` (verify.py) and the Hub (push.py). bema_cli/ship.py runs decide/, then
these."""
