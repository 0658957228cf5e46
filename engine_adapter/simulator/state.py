"""What the simulated engine works on, without its behaviour: the replica's knobs (`SimConfig`),
the vocabulary it samples, one request in flight (`SimRequest`) and the ground truth it leaves
(`SimRecord`)."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any

BLOCK_SIZE = 16

# What the model samples from: each generated token is one of these words.
_WORDS = (
    " the of and to in is that for it as was with be by on not he this are or his from at which"
    " but have an they you were her she there been one all we their has would when if will more"
    " no out so said what up its about into than them can only other new some time could these"
    " two may then do first any my now such like our over man me even most made after also did"
    " many before must through back years where much your way well down should because each just"
    " those people how too little state good very make world still own see men work long get"
    " here between both life being under never day same another know while last might us great"
    " old year off come since against go came right used take three ."
)
_VOCAB = [" " + w if w != "." else "." for w in _WORDS.split()]
VOCAB_SIZE = len(_VOCAB)


def token_text(token_id: int) -> str:
    """The text of a generated token id."""
    return _VOCAB[token_id % VOCAB_SIZE]


# --- configuration and records -------------------------------------------------------------------


@dataclass
class SimConfig:
    """Knobs of one simulated replica. Times are milliseconds of simulated engine work."""

    model: str = "sim-model"
    seed: int = 0
    max_model_len: int = 8192
    block_size: int = BLOCK_SIZE
    num_gpu_blocks: int = 4096
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_num_queued_reqs: int | None = None
    scheduling_policy: str = "fcfs"  # fcfs | priority
    enable_prefix_caching: bool = True
    enable_prompt_tokens_details: bool = True
    enable_force_include_usage: bool = False
    step_base_ms: float = 15.0
    per_seq_ms: float = 0.3
    prefill_ms_per_1k_tokens: float = 30.0
    speed: float = 1.0
    mean_output_tokens: int = 128
    output_sigma: float = 1.0  # lognormal sigma of the EOS position: the heavy tail
    # A prompt that asks for an answer "in about N words" ends near N tokens (lognormal around
    # N with this sigma), as an instruction-following model roughly does: traffic generators
    # (`tollgate predictor generate`) give each tenant's answers their own length that way.
    length_follow_sigma: float = 0.15
    # LoRA (engine_adapter/simulator/lora.py), as vLLM's --enable-lora, --max-loras (its
    # default: 1) and --max-lora-rank (its default: 16).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError("scheduling_policy must be fcfs or priority")
        if self.max_model_len > self.num_gpu_blocks * self.block_size:
            # vLLM refuses to start when one max-length sequence does not fit in the KV cache;
            # without this check a long request could wait forever.
            raise ValueError(
                f"max_model_len {self.max_model_len} does not fit in "
                f"{self.num_gpu_blocks} blocks of {self.block_size}"
            )
        if self.speed <= 0:
            raise ValueError("speed must be positive")


@dataclass
class SimRecord:
    """Ground truth for one request. `completion_tokens` counts tokens written to the client."""

    request_id: str
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None  # stop | length | abort | error; None while in flight
    preemptions: int = 0
    generated_tokens: int = 0  # produced by the engine; > completion_tokens only after an abort
    stream: bool = False
    arrival_s: float = 0.0
    first_token_s: float | None = None
    finished_s: float | None = None
    priority: int = 0  # the scheduling priority it ran at (0 under fcfs, which ignores it)
    traceparent: str = ""  # the W3C traceparent it was sent with (vLLM continues that trace)
    adapter: str = ""  # the LoRA adapter it was asked for by name ("": the base model)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["finished"] = self.finish_reason is not None
        return d


# --- a request in flight -------------------------------------------------------------------------


class SimRequest:
    __slots__ = (
        "rid",
        "record",
        "token_ids",
        "prompt_len",
        "max_tokens",
        "eos_at",
        "priority",
        "seq",
        "salt",
        "num_computed",
        "blocks",
        "block_hashes",
        "generated",
        "cached_set",
        "finished",
        "finish_reason",
        "pending",
        "event",
        "rng",
        "fail_after",
        "drop_after",
        "arrival",
        "first_token_at",
        "last_token_at",
        "prompt_counted",
    )

    def __init__(self) -> None:
        self.num_computed = 0
        self.blocks: list[int] = []
        self.block_hashes: list[int] = []
        self.generated = 0
        self.cached_set = False
        self.finished = False
        self.finish_reason: str | None = None
        self.pending: list[str] = []  # texts produced but not yet taken by the HTTP handler
        self.event = asyncio.Event()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.prompt_counted = False

    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.seq)

    def __lt__(self, other: SimRequest) -> bool:
        return self.sort_key() < other.sort_key()
