"""The hierarchy under a tenant and its budgets: `events`, `state` (`Hierarchy`), `decide`, and
`budgets` (`PathView`: what every level of a path holds) and `path_admission` (`reserve`,
the admission over a request's path)."""
