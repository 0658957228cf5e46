"""The request stream (stream_id = request id): `events`, `state`, `decide`, `evolve`."""
