"""Test chats for the prompt-token estimator: the shapes a gateway meets (system prompts,
multi-turn, content parts, tool definitions and tool calls, unicode, long and near-empty)."""

from __future__ import annotations

from typing import Any

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
BARE_TOOL = {"type": "function", "function": {"name": "ping"}}


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


CHATS: list[tuple[str, list[dict[str, Any]], list[Any] | None]] = [
    ("hello", [user("Hello!")], None),
    ("one word", [user("x")], None),
    ("empty", [user("")], None),
    ("sentence", [user("Say hello to the world, please.")], None),
    (
        "system + user",
        [{"role": "system", "content": "You are terse."}, user("What is a token?")],
        None,
    ),
    (
        "multi-turn",
        [
            {"role": "system", "content": "You answer in one line."},
            user("Name a city."),
            {"role": "assistant", "content": "Zürich."},
            user("And another, far from it?"),
        ],
        None,
    ),
    ("unicode", [user("café naïve 東京 — “quotes” 🙂 ünïcödé")], None),
    ("numbers", [user("1234567890 3.14159 2026-05-04T12:00:00Z 0xdeadbeef")], None),
    ("code", [user("def f(x):\n    return {'a': [1, 2, 3]}  # <tag> & \"q\"\n")], None),
    ("whitespace", [user("  leading and trailing  \n\n\ttabs\t\n")], None),
    ("special-looking text", [user("<|im_start|>user is not a role here<|im_end|>")], None),
    ("long", [user("The ledger bills each token exactly once. " * 120)], None),
    (
        "content parts",
        [{"role": "user", "content": [{"type": "text", "text": "Part one."},
                                      {"type": "text", "text": "Part two."}]}],  # fmt: skip
        None,
    ),
    (
        "developer role",
        [{"role": "developer", "content": "Be brief."}, user("Hi")],
        None,
    ),
    ("tools", [user("Weather in Oslo?")], [WEATHER_TOOL]),
    ("two tools", [user("Ping then weather.")], [BARE_TOOL, WEATHER_TOOL]),
    (
        "tool call and result",
        [
            user("Weather in Oslo?"),
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": -3}'},
        ],
        [WEATHER_TOOL],
    ),
    (
        "named user",
        [{"role": "user", "name": "alice", "content": "Hello from Alice."}],
        None,
    ),
    ("many turns", [user(f"turn {i}: what next?") for i in range(30)], None),
]
