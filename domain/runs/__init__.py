"""Agent runs (stream "run-<tenant_id>-<run_id>"): `events`, `state`. A run is decided by
`domain.governance.decide` and folded by `Hierarchy`, beside its project's run policy."""
