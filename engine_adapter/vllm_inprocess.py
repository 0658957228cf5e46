"""In-process engine: the `VLLMReplica.open_chat` contract around `vllm.AsyncLLM` (vLLM 0.33).

UNTESTED HERE: it needs a GPU and the `vllm` extra, neither of which the test machines have. vllm
is imported only in the constructor, so importing this module costs nothing. Chunks are built in
the same shape the HTTP server streams with continuous usage, so the gateway cannot tell the two
apart; see vllm-protocol.md §4 for the API it is written against.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from engine_adapter.exchange import ChatExchange, IteratorExchange


class VLLMInProcess:
    """One AsyncLLM in this process. `engine_args` are AsyncEngineArgs keyword arguments."""

    def __init__(self, replica_id: str, model: str, **engine_args: Any) -> None:
        from transformers import AutoTokenizer
        from vllm import SamplingParams
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM

        self.replica_id = replica_id
        self.model = engine_args.pop("served_model_name", model)
        self._sampling_params = SamplingParams
        self._delta = RequestOutputKind.DELTA
        self._tokenizer = AutoTokenizer.from_pretrained(model)
        self._engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, **engine_args))
        self._max_model_len = self._engine.model_config.max_model_len

    def shutdown(self) -> None:
        self._engine.shutdown()

    async def open_chat(
        self, body: dict[str, Any], *, request_id: str, cache_salt: str
    ) -> ChatExchange:
        # In process, cancelling the reading task aborts the engine request directly (the
        # generator's finally below), and every yielded chunk was delivered: nothing to drain.
        return IteratorExchange(self._generate(body, request_id, cache_salt))

    async def _generate(
        self, body: dict[str, Any], request_id: str, cache_salt: str
    ) -> AsyncIterator[dict[str, Any]]:
        prompt_ids = self._tokenizer.apply_chat_template(
            body["messages"], add_generation_prompt=True, tokenize=True
        )
        prompt = len(prompt_ids)
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        params = self._sampling_params(
            max_tokens=limit or self._max_model_len - prompt,
            temperature=body.get("temperature", 1.0),
            top_p=body.get("top_p", 1.0),
            seed=body.get("seed"),
            stop=body.get("stop"),
            ignore_eos=bool(body.get("ignore_eos")),
            output_kind=self._delta,
        )
        rid = f"chatcmpl-{request_id}"
        head = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model}  # fmt: skip

        def usage(n: int) -> dict[str, Any]:
            return {"prompt_tokens": prompt, "total_tokens": prompt + n, "completion_tokens": n,
                    "completion_tokens_details": None}  # fmt: skip

        completion = cached = 0
        finish: str | None = None
        first = True
        try:
            async for out in self._engine.generate(
                {"prompt_token_ids": prompt_ids, "cache_salt": cache_salt},
                params,
                rid,
                priority=int(body.get("priority", 0)),
            ):
                cached = out.num_cached_tokens or 0
                c = out.outputs[0]
                if first:
                    first = False
                    yield {**head, "choices": [{"index": 0, "delta": {"role": "assistant",
                           "content": ""}, "logprobs": None, "finish_reason": None}],
                           "usage": usage(0)}  # fmt: skip
                completion += len(c.token_ids)
                finish = c.finish_reason
                if finish == "error":
                    yield {"error": {"message": "Internal server error",
                           "type": "InternalServerError", "param": None, "code": 500}}  # fmt: skip
                    return
                yield {**head, "choices": [{"index": 0, "delta": {"content": c.text},
                       "logprobs": None, "finish_reason": finish, "token_ids": None}],
                       "usage": usage(completion)}  # fmt: skip
            yield {**head, "choices": [], "usage": {
                "prompt_tokens": prompt, "total_tokens": prompt + completion,
                "completion_tokens": completion,
                "prompt_tokens_details": {"cached_tokens": cached}}}  # fmt: skip
        finally:
            if finish is None:
                # aclose() or cancellation: the engine must stop and free the KV now.
                await self._engine.abort(rid)
