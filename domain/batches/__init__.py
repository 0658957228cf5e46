"""The Batch API's stream (stream_id = "batch-<batch id>"): `events`, `state`, `decide`,
`evolve`, and `files` (the input file's format, the output and error files)."""
