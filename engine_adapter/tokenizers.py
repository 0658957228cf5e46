"""Prompt-token estimators for admission: the model's own tokenizer and chat template, rendered
the way vLLM renders a chat (so the estimate is the count the engine will report), or the
simulator's splitter for simulated replicas.

Each has `prompt_tokens(messages, tools=None) -> int`, the shape of the gateway's
`TokenEstimator` port (structural typing: nothing here imports api). The real one needs the
`tokenizers` package (`pip install 'tollgate-llm[tokenizer]'`, a ~3 MB wheel; no torch, no
transformers); the chat template is rendered with jinja2 in the sandbox and with the options
transformers uses, which is what vLLM calls.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import orjson

log = logging.getLogger("tollgate.tokenizers")


class PromptTokenEstimator(Protocol):
    def prompt_tokens(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None
    ) -> int:
        """The prompt tokens the engine will count for this chat, its template applied."""
        ...


class ChatTemplateEstimator:
    """A model's tokenizer.json and chat template, applied as vLLM 0.32 applies them to a chat.

    Recent answers are kept by content (the serialized messages and tools): the engine adapter
    asks again for the same request when it fits `max_tokens` to the context, and retries repeat
    a prompt; a hit costs one orjson.dumps instead of a render and an encode.
    """

    def __init__(
        self,
        tokenizer_json: Path,
        chat_template: str,
        special_tokens: Mapping[str, str] | None = None,
        *,
        cache_size: int = 4096,
    ) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(tokenizer_json))
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.chat_template = chat_template
        self._template = env.from_string(chat_template)
        self._special = dict(special_tokens or {})
        self._openai_content = _iterates_content(env, chat_template)
        self._developer_role = '"developer"' in chat_template or "'developer'" in chat_template
        self._cache: OrderedDict[bytes, int] = OrderedDict()
        self._cache_size = cache_size

    @classmethod
    def from_model_dir(cls, directory: str | Path, **kw: Any) -> ChatTemplateEstimator:
        """From a Hugging Face model directory: tokenizer.json, and the chat template from
        chat_template.jinja or tokenizer_config.json (as transformers looks them up)."""
        root = Path(directory)
        config: dict[str, Any] = {}
        if (root / "tokenizer_config.json").exists():
            config = json.loads((root / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        if (root / "chat_template.jinja").exists():
            template = (root / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if not isinstance(template, str):
            raise ValueError(f"{root} has no chat template")
        special = {
            name: value if isinstance(value, str) else value.get("content", "")
            for name, value in config.items()
            if name.endswith("_token") and isinstance(value, str | dict)
        }
        return cls(root / "tokenizer.json", template, special, **kw)

    def render(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None
    ) -> str:
        """The prompt text vLLM builds for this chat (generation prompt added)."""
        conversation = [self._message(m) for m in messages]
        return str(
            self._template.render(
                messages=conversation,
                tools=[_tool(t) for t in tools] if tools else None,
                documents=None,
                add_generation_prompt=True,
                **self._special,
            )
        )

    def prompt_tokens(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None
    ) -> int:
        key = orjson.dumps((messages, tools))
        cache = self._cache
        found = cache.get(key)
        if found is not None:
            cache.move_to_end(key)
            return found
        # vLLM encodes a rendered chat without adding special tokens: the template has them.
        count = len(self._tokenizer.encode(self.render(messages, tools), add_special_tokens=False))
        cache[key] = count
        if len(cache) > self._cache_size:
            cache.popitem(last=False)
        return count

    def _message(self, message: Mapping[str, Any]) -> dict[str, Any]:
        """One message as vLLM's chat parser hands it to the template (content parts as parts
        or joined text, per the template; tool-call fields kept)."""
        role = message.get("role")
        if role == "developer" and not self._developer_role:
            role = "system"
        content = message.get("content")
        parts: list[Any]
        if content is None:
            parts = []
        elif isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        else:
            parts = list(content)
        texts = [
            p.get("text", "") if isinstance(p, Mapping) else str(p)
            for p in parts
            if not isinstance(p, Mapping) or p.get("type", "text") == "text"
        ]
        out: dict[str, Any] = {"role": role}
        if self._openai_content and role != "tool":
            out["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            out["content"] = "\n".join(texts)
        if role == "assistant" and message.get("tool_calls"):
            out["tool_calls"] = [_tool_call(call) for call in message["tool_calls"]]
        if role == "tool" and "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
        return out


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' tojson: plain json.dumps, no HTML escaping (jinja2's own escapes <>&').
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tool_call(call: Any) -> Any:
    """An assistant's tool call as vLLM hands it to templates: `arguments` decoded from its JSON
    string into an object ({} when empty, malformed or not an object)."""
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    function = dict(call["function"])
    arguments = function.get("arguments")
    parsed: Any = {}
    if isinstance(arguments, dict):
        parsed = arguments
    elif isinstance(arguments, str) and arguments:
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            parsed = {}
    function["arguments"] = parsed if isinstance(parsed, dict) else {}
    return {**call, "function": function}


def _tool(tool: Any) -> Any:
    """A tool as vLLM's request model dumps it: the function's name, description and parameters
    (None when absent), `strict` and `defer_loading` only when set, other keys dropped."""
    if not isinstance(tool, Mapping):
        return tool
    function = tool.get("function") or {}
    dumped_fn = {
        "name": function.get("name"),
        "description": function.get("description"),
        "parameters": function.get("parameters"),
    }
    for optional in ("strict", "defer_loading"):
        if function.get(optional) is not None:
            dumped_fn[optional] = function[optional]
    if tool.get("defer_loading") is not None:  # vLLM copies it onto the function too
        dumped_fn.setdefault("defer_loading", tool["defer_loading"])
    dumped: dict[str, Any] = {"type": tool.get("type", "function"), "function": dumped_fn}
    if tool.get("defer_loading") is not None:
        dumped["defer_loading"] = tool["defer_loading"]
    return dumped


def _iterates_content(env: Any, template: str) -> bool:
    """Whether the template loops over a message's content (vLLM then passes content as a list
    of parts, "openai" format; otherwise as one string). A simplified form of vLLM's AST check:
    a `for` over `X.content` or `X['content']` where X is the loop variable over `messages`."""
    from jinja2 import nodes

    try:
        ast = env.parse(template)
    except Exception:  # noqa: BLE001 - vLLM falls back to "string" for what it cannot parse
        return False
    message_vars = {
        loop.target.name
        for loop in ast.find_all(nodes.For)
        if isinstance(loop.iter, nodes.Name)
        and loop.iter.name == "messages"
        and isinstance(loop.target, nodes.Name)
    }
    for loop in ast.find_all(nodes.For):
        it = loop.iter
        while isinstance(it, nodes.Filter | nodes.Test) and it.node is not None:
            it = it.node
        if isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const):
            key = it.arg.value
        elif isinstance(it, nodes.Getattr):
            key = it.attr
        else:
            continue
        if key == "content" and isinstance(it.node, nodes.Name) and it.node.name in message_vars:
            return True
    return False


def estimator_for(
    *, simulated: bool, model_dir: str | Path | None = None
) -> PromptTokenEstimator | None:
    """The estimator for a served model: the simulator's splitter for a simulated replica; for a
    real one the model's tokenizer and template when its directory is readable here (the
    `--tokenizer` flag, or the `root` vLLM reports in /v1/models) and `tokenizers` is installed.
    None when neither: the caller says so, and admission keeps its rough estimate."""
    if simulated:
        from tollgate_llm.engine_adapter.estimators import WordTokenEstimator

        return WordTokenEstimator()
    if model_dir is None or not (Path(model_dir) / "tokenizer.json").exists():
        return None
    try:
        return ChatTemplateEstimator.from_model_dir(model_dir)
    except ImportError:
        log.warning("`tokenizers` is not installed (pip install 'tollgate-llm[tokenizer]')")
        return None
