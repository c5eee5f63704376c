"""Prompting a loaded model the way chat tools do: the tokenizer's chat template when it has one, sampling settings
that imply sampling, and streamed output without special tokens. The CLI's ``generate`` and ``chat`` are thin layers
over these."""
from __future__ import annotations

import dataclasses
import logging

import torch

from moeq.errors import MoeqError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Greedy unless asked otherwise: any of ``temperature``/``top_p``/``top_k`` turns sampling on (as it does in
    llama.cpp and vLLM), with the others at their usual defaults."""
    sample: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None

    def kwargs(self) -> dict:
        if not (self.sample or self.temperature is not None or self.top_p is not None or self.top_k is not None):
            return {"do_sample": False}
        return {"do_sample": True, "temperature": 0.8 if self.temperature is None else self.temperature,
                "top_p": 0.95 if self.top_p is None else self.top_p, "top_k": self.top_k or 0}


def load_tokenizer(path):
    """The tokenizer of a model folder or of a GGUF file moeq reads (a clear error when there is none usable)."""
    from pathlib import Path  # noqa: PLC0415

    from transformers import AutoTokenizer  # noqa: PLC0415

    from moeq.readers.gguf import gguf_file  # noqa: PLC0415

    try:
        g = gguf_file(Path(path))
        return AutoTokenizer.from_pretrained(g.parent, gguf_file=g.name) if g else AutoTokenizer.from_pretrained(path)
    except Exception as e:  # an untrusted folder parsed by transformers/tokenizers: the failure is the folder's
        raise MoeqError(f"{path}: no usable tokenizer ({type(e).__name__}: {e})") from None


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat_ids(tok, messages: list[dict]) -> list[int]:
    """Token ids of a conversation with the generation prompt: the tokenizer's chat template, or — for a tokenizer
    without one — ChatML as text (what llama.cpp's server falls back to)."""
    if has_chat_template(tok):
        return encode(tok, messages)[0].tolist()
    text = tok.apply_chat_template(messages, chat_template=CHATML, add_generation_prompt=True, tokenize=False)
    return tok(text).input_ids


def has_chat_template(tok) -> bool:
    return bool(getattr(tok, "chat_template", None))


def encode(tok, messages: list[dict] | str, chat: bool = True) -> torch.Tensor:
    """Token ids ``[1, T]`` for a prompt: with ``chat`` and a tokenizer chat template, the messages (a string is one
    user turn) rendered by the template with the generation prompt; otherwise the raw text."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if chat and has_chat_template(tok):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=False)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        return torch.as_tensor(ids).reshape(1, -1)
    text = "\n".join(m["content"] for m in messages)
    ids = tok(text, return_tensors="pt").input_ids
    if ids.numel() == 0:
        raise MoeqError("the prompt encodes to no tokens")
    return ids


def stop_ids(tok, model) -> list[int]:
    """Token ids that end a reply: the tokenizer's EOS and the generation config's."""
    ids = set()
    for v in (tok.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        ids.update(v if isinstance(v, (list, tuple)) else [] if v is None else [v])
    return sorted(ids)


def context_length(model) -> int | None:
    """The longest sequence the model supports (its config's ``max_position_embeddings``), or None if it says none."""
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    n = getattr(cfg, "max_position_embeddings", None)
    return n if isinstance(n, int) and n > 0 else None


def fit_context(model, prompt_tokens: int, max_new_tokens: int) -> int:
    """The new-token budget a prompt of ``prompt_tokens`` gets: a prompt longer than the model's context is refused
    (moeq does not silently drop the start of what the user wrote); a budget running past the context is cut to
    what fits, with a warning (as llama.cpp stops at its context size)."""
    ctx = context_length(model)
    if ctx is None:
        return max_new_tokens
    if prompt_tokens >= ctx:
        raise MoeqError(f"the prompt is {prompt_tokens} tokens, and the model's context is {ctx} "
                        "(max_position_embeddings): shorten the prompt")
    if prompt_tokens + max_new_tokens > ctx:
        log.warning("prompt %d + %d new tokens exceed the model's context of %d: generating at most %d",
                    prompt_tokens, max_new_tokens, ctx, ctx - prompt_tokens)
        return ctx - prompt_tokens
    return max_new_tokens
