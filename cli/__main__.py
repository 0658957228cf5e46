"""`python -m cli`: the `tollgate` command without its installed script (tests, bench, the
embedded fold worker)."""

from cli import main

main()
