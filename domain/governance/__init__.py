"""The hierarchy under a tenant and its budgets: `events`, `state` (`Hierarchy`), `decide`, and
`budgets` (`PathView`, the admission over a request's path)."""
