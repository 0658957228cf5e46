"""Tollgate, the control and billing backend of a multi-tenant LLM API: the one installed package.

The repository keeps its folders at the root (`domain/`, `ledger/`, `streams/`, `api/`,
`engine_adapter/`, `migrations/`, `cli/`, `loadgen/`, `predictor/`); the distribution
`tollgate-llm` installs them as sub-packages of `tollgate_llm` (pyproject's `package-dir`), and
the entries here are links to them so that a checkout imports the same names as an install.
"""
