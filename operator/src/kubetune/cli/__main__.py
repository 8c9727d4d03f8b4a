"""`python -m kubetune.cli`: the `kubetune` command without its console script."""

from kubetune.cli import main

main()
