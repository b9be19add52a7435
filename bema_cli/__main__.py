"""`python -m bema_cli`: the `bema` command where no console script was installed (a GPU machine's
image running `make gpu-check` from the checkout)."""

from bema_cli.cli import main

main()
