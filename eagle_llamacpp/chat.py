"""Chat prompts as the target's own GGUF chat template renders them, tokenized turn by turn so the
assistant's tokens are known exactly (training data, benchmark prompts, the demo)."""

from __future__ import annotations

import numpy as np

from . import _native as nat
from .draft import TargetModel


class ChatRenderer:
    """Renders messages with the GGUF's Jinja chat template and tokenizes them turn by turn, so the
    assistant's tokens (the ones a head is trained on) are known exactly."""

    def __init__(self, target: TargetModel):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        template = nat.meta_str(target.model, "tokenizer.chat_template", 1 << 17)
        if not template:
            raise nat.EagleError(f"{target.path.name} has no chat template (tokenizer.chat_template)")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self.template = env.from_string(template)
        self.target = target
        vocab = nat.llama_cpp.llama_model_get_vocab(target.model)
        self.bos = nat.llama_cpp.llama_vocab_bos(vocab)
        self.special = {"bos_token": target.piece(self.bos) if self.bos >= 0 else "",
                        "eos_token": target.piece(nat.llama_cpp.llama_vocab_eos(vocab))}

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        if not messages:
            return ""

        def raise_exception(msg):
            raise ValueError(msg)

        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                    raise_exception=raise_exception, **self.special)

    def tokens_and_mask(self, messages: list[dict], max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of the whole conversation, and 1 where a token belongs to an assistant reply.

        Each turn boundary is found by tokenizing the conversation up to it, so the tokens are
        exactly the whole conversation's tokens (tokenizers such as SentencePiece do not split at
        turn boundaries)."""
        tokens: list[int] = []
        mask: list[int] = []
        for i, m in enumerate(messages):
            full = self._tokenize(self.render(messages[:i + 1], add_generation_prompt=False))
            keep = _common_prefix(tokens, full)
            mask = mask[:keep] + [0] * (len(full) - keep)
            if m["role"] == "assistant":
                head = self._tokenize(self.render(messages[:i], add_generation_prompt=True))
                start = _common_prefix(head, full)
                mask[start:] = [1] * (len(full) - start)
            tokens = full
            if len(tokens) >= max_tokens:
                break
        return np.asarray(tokens[:max_tokens], np.int32), np.asarray(mask[:max_tokens], np.uint8)

    def prompt_tokens(self, messages: list[dict]) -> list[int]:
        """The prompt for the assistant's next reply, tokenized as the training data is."""
        return self._tokenize(self.render(messages, add_generation_prompt=True))

    def _tokenize(self, text: str) -> list[int]:
        tokens = self.target.tokenize(text, add_special=True)
        if len(tokens) >= 2 and tokens[0] == tokens[1] == self.bos:
            tokens = tokens[1:]  # the template wrote the BOS text itself
        return tokens


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n
