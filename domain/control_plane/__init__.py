"""The control streams (tenant, prices, models, slo, fleet): `events`, `state` (`ControlView`,
whose `apply` is their evolve), `decide` (`decide_control`)."""
