"""`python -m tollgate_llm.cli`: the `tollgate` command without its installed script (tests,
bench, the embedded fold worker)."""

from tollgate_llm.cli import main

main()
