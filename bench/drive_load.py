"""Drive N non-streaming chat completions (16 tokens) at a running `tollgate serve`, concurrency C.
Usage: python bench/drive_load.py URL KEY N [C]"""

import asyncio
import sys
import time
from collections import Counter

import httpx


async def main(url: str, key: str, n: int, c: int) -> None:
    body = {
        "model": "llama-3.1-8b-2026-05",
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "Hello there, how are you?"}],
    }
    codes: Counter[int] = Counter()
    todo = iter(range(n))
    async with httpx.AsyncClient(
        base_url=url,
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
        limits=httpx.Limits(max_connections=c),
    ) as client:

        async def worker() -> None:
            for _ in todo:
                r = await client.post("/v1/chat/completions", json=body)
                codes[r.status_code] += 1

        t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(c)))
        dt = time.perf_counter() - t
    print(f"{n} requests in {dt:.1f}s ({n / dt:.0f}/s): {dict(codes)}")


if __name__ == "__main__":
    asyncio.run(
        main(
            sys.argv[1],
            sys.argv[2],
            int(sys.argv[3]),
            int(sys.argv[4]) if len(sys.argv) > 4 else 16,
        )
    )
