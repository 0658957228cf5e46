"""A simulated vLLM 0.33 replica: the OpenAI-compatible HTTP surface of `vllm serve` over an
honest engine model (paged KV, continuous batching, chunked prefill, preemption, prefix cache).

`tokenizer` (the word splitter), `state` (SimConfig, SimRecord, SimRequest), `kv` (BlockPool),
`scheduler` (Scheduler), `engine` (SimEngine), `metrics` (Prometheus), `chat_body` (parse_chat),
`responses` (bodies and stream frames), `server` (start_simulated_replica) and `cli`
(serve_forever). Nothing is re-exported here, so that the tokenizer can be imported without
aiohttp and the engine.
"""
