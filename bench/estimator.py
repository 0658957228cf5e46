"""What the real prompt-token estimator costs per admission (engine_adapter/tokenizers.py, on
the tiny test model's tokenizer and chat template), uncached and from its content cache, beside
the simulator's word splitter; and how far the splitter is from the real count on the same chats.

    python -m bench.estimator [--repeat 200]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import RESULTS_DIR, write_result  # noqa: E402
from tests.vllm.engine import engine_python, tiny_model  # noqa: E402
from tests.vllm.prompts import CHATS  # noqa: E402
from tollgate_llm.engine_adapter.simulator.tokenizer import count_prompt_tokens  # noqa: E402
from tollgate_llm.engine_adapter.tokenizers import ChatTemplateEstimator  # noqa: E402


def per_call_us(fn: object, repeat: int) -> float:
    best = float("inf")
    for _ in range(5):  # the best of 5 batches: the least disturbed by the other processes
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()  # type: ignore[operator]
        best = min(best, (time.perf_counter() - t0) / repeat)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    model_dir = tiny_model(engine_python())
    rows = []
    for name, messages, tools in CHATS:
        uncached = ChatTemplateEstimator.from_model_dir(model_dir, cache_size=0)
        cached = ChatTemplateEstimator.from_model_dir(model_dir)
        real = cached.prompt_tokens(messages, tools)
        splitter = count_prompt_tokens(messages)
        rows.append({
            "chat": name,
            "prompt_tokens": real,
            "splitter_tokens": splitter,
            "splitter_error_pct": round(100 * (splitter - real) / real, 1),
            "uncached_us": round(per_call_us(lambda u=uncached, m=messages, t=tools:
                                             u.prompt_tokens(m, t), args.repeat), 1),
            "cached_us": round(per_call_us(lambda c=cached, m=messages, t=tools:
                                           c.prompt_tokens(m, t), args.repeat), 1),
            "splitter_us": round(per_call_us(lambda m=messages: count_prompt_tokens(m),
                                             args.repeat), 1),
        })  # fmt: skip
    errors = sorted(r["splitter_error_pct"] for r in rows)
    result = {
        "benchmark": "estimator",
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "chats": len(rows),
        "note": "real estimator == vLLM prompt_tokens on every chat: "
        "tests/integration/test_estimator_vllm.py",
        "uncached_us_median": sorted(r["uncached_us"] for r in rows)[len(rows) // 2],
        "uncached_us_max": max(r["uncached_us"] for r in rows),
        "cached_us_median": sorted(r["cached_us"] for r in rows)[len(rows) // 2],
        "splitter_us_median": sorted(r["splitter_us"] for r in rows)[len(rows) // 2],
        "splitter_error_pct_min": errors[0],
        "splitter_error_pct_max": errors[-1],
        "rows": rows,
    }
    write_result(RESULTS_DIR / "estimator.json", result)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))


if __name__ == "__main__":
    main()
