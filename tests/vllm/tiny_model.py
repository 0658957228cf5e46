"""Build the tiny random-weight Llama that the `vllm` test tier serves (no weights can be
downloaded here). Run with the engine venv's Python: `python tests/vllm/tiny_model.py OUT_DIR`.

Everything is derived from this file (seeded weights, a corpus generated from a fixed word list,
a byte-level BPE trained on it), so the same source gives the same model and the fixture can cache
it under the hash of this file. It imports torch, transformers and tokenizers: the engine venv
has them, Tollgate's own venv need not.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SERVED_NAME = "tiny-llama-2026-05"
MAX_MODEL_LEN = 4096
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, with the tools (if any) rendered as JSON in a system turn: enough structure that the
# estimator must apply the template exactly as the engine does to count the same tokens.
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{%- if message['content'] is string %}{{ message['content'] }}"
    "{%- elif message['content'] is not none %}"
    "{%- for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{%- for call in message['tool_calls'] %}\n<tool_call>{{ call['function'] | tojson }}"
    "</tool_call>{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORD_TEXT = (
    "the of and to in is was for on that with as by at from it an be this are or which his "
    "have had not but were all they one their has been there who more when would can will "
    "about into time its only other new some could these two may first then do any like my "
    "now over such our man me even most made after also did many before must through back "
    "years where much your way well down should because each just those people how too little "
    "state good very make world still own see men work long get here between both life being "
    "under never day same another know while last might us great old year off come since "
    "against go came right used take three token model cache prefix tenant engine replica "
    "stream request billing ledger quota admission latency throughput hello world please say "
    "question answer summary translate explain function weather city temperature json value"
)
_WORDS = _WORD_TEXT.split()
_PUNCT = (".", ",", "?", "!", ":", ";", "\n", " -", " (", ")", '"', "'s", "123", "2026", "42")


def corpus(lines: int = 6000, seed: int = 13) -> list[str]:
    rng = random.Random(seed)
    # Made-up words from syllables, so that the BPE has enough distinct pairs to fill the vocab.
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ar", "en")]
    invented = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(3000)]
    out = []
    for _ in range(lines):
        n = rng.randint(4, 30)
        words = []
        for _ in range(n):
            w = rng.choice(_WORDS) if rng.random() < 0.6 else rng.choice(invented)
            if rng.random() < 0.1:
                w = w.capitalize()
            words.append(w)
            if rng.random() < 0.12:
                words.append(rng.choice(_PUNCT))
        out.append(" ".join(words))
    # A few non-ASCII lines so that multi-byte characters get merges too.
    out += ["café naïve Zürich 東京 ünïcödé — “quotes” 🙂"] * 20
    return out


def build(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = MAX_MODEL_LEN
    fast.save_pretrained(out)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=MAX_MODEL_LEN,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    (out / "tollgate-tiny-model.json").write_text(
        json.dumps({"served_name": SERVED_NAME, "max_model_len": MAX_MODEL_LEN}) + "\n"
    )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/vllm/tiny_model.py OUT_DIR")
    build(Path(sys.argv[1]))
