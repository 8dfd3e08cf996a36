"""llama-cpp-python's response shapes on top of the engine: completions, chat, streaming, stops."""

from __future__ import annotations

import ctypes
import time
import uuid
from collections.abc import Iterator

from . import _native as nat
from .stats import SpecStats


class TextAssembler:
    """Turns generated tokens into text: whole UTF-8 characters only, held back while the text could
    still turn into a stop string, cut at the first stop string."""

    def __init__(self, piece, stop: list[str]):
        self.piece, self.stop = piece, [s for s in stop if s]
        self.raw = b""
        self.sent = 0       # characters already handed out
        self.stopped = False

    def feed(self, token: int) -> str:
        self.raw += self.piece(token)
        text = self.raw.decode("utf-8", errors="ignore")
        if len(self.raw) != len(text.encode()):  # an incomplete character at the end: wait
            return ""
        for s in self.stop:
            i = text.find(s)
            if i >= 0:
                self.stopped = True
                return self._emit(text, i)
        hold = max((len(s) - 1 for s in self.stop), default=0)
        # hold back a tail that is a prefix of some stop string
        safe = len(text)
        for k in range(min(hold, len(text)), 0, -1):
            if any(s.startswith(text[-k:]) for s in self.stop):
                safe = len(text) - k
                break
        return self._emit(text, safe)

    def flush(self) -> str:
        return "" if self.stopped else self._emit(self.raw.decode("utf-8", errors="replace"), None)

    def _emit(self, text: str, end: int | None) -> str:
        end = len(text) if end is None else end
        out = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out


class CompletionMixin:
    """create_completion / create_chat_completion for EagleLlama, shaped like llama-cpp-python's."""

    def _piece_bytes(self, token: int) -> bytes:
        buf = (ctypes.c_char * 256)()
        n = nat.llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        return bytes(buf[:max(n, 0)])

    def _run(self, prompt_tokens, max_tokens, sampling, stop) -> Iterator[tuple[str, str | None, dict]]:
        """Yields (text delta, finish_reason or None, usage+stats once finished)."""
        from .engine import Sampling  # the engine imports this module

        if max_tokens is None or max_tokens <= 0:  # llama-cpp-python: until the context is full
            max_tokens = self.n_ctx
        stats = SpecStats()
        text = TextAssembler(self._piece_bytes, [stop] if isinstance(stop, str) else list(stop or []))
        n_completion = 0
        finish = "length"
        if max_tokens > 0:
            gen = self.generate(prompt_tokens, max_tokens, sampling or Sampling(), stats)
            for tok in gen:
                if self.is_eog(tok):
                    finish = "stop"
                    break
                n_completion += 1
                delta = text.feed(tok)
                if text.stopped:
                    finish = "stop"
                    gen.close()
                    if delta:
                        yield delta, None, {}
                    break
                if delta:
                    yield delta, None, {}
            else:
                finish = self.last_finish_reason
        tail = text.flush()
        usage = {"prompt_tokens": len(prompt_tokens), "completion_tokens": n_completion,
                 "total_tokens": len(prompt_tokens) + n_completion}
        yield tail, finish, {"usage": usage, "speculative": stats.as_dict()}

    def create_completion(self, prompt: str | list[int], max_tokens: int | None = 16, temperature: float = 0.8,
                          top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05, seed: int | None = None,
                          stop: str | list[str] | None = None, stream: bool = False):
        from .engine import Sampling

        tokens = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        sampling = Sampling(temperature, top_k, top_p, min_p, seed)
        head = {"id": f"cmpl-{uuid.uuid4()}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_path}
        chunks = self._run(tokens, max_tokens, sampling, stop)
        if stream:
            return (dict(head, choices=[{"text": d, "index": 0, "logprobs": None, "finish_reason": f}], **extra)
                    for d, f, extra in chunks)
        text, finish, extra = "", None, {}
        for d, f, e in chunks:
            text, finish, extra = text + d, f, e
        return dict(head, choices=[{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}], **extra)

    def chat_prompt(self, messages: list[dict]) -> tuple[list[int], list[str]]:
        """Prompt tokens and extra stop strings from the GGUF's chat template (llama-cpp-python's
        Jinja2 formatter, so templates render exactly as there)."""
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        template = nat.meta_str(self.target.model, "tokenizer.chat_template", 1 << 17)
        if not template:
            raise nat.EagleError(f"{self.model_path} has no chat template (tokenizer.chat_template)")
        bos = nat.llama_cpp.llama_vocab_bos(self.vocab)
        eos = nat.llama_cpp.llama_vocab_eos(self.vocab)
        fmt = Jinja2ChatFormatter(template, eos_token=self._piece_bytes(eos).decode(errors="ignore"),
                                  bos_token=self._piece_bytes(bos).decode(errors="ignore") if bos >= 0 else "")
        res = fmt(messages=messages)
        tokens = self.tokenize(res.prompt, add_special=not getattr(res, "added_special", False))
        stop = res.stop if isinstance(res.stop, list) else [res.stop] if res.stop else []
        return tokens, stop

    def create_chat_completion(self, messages: list[dict], max_tokens: int | None = None, temperature: float = 0.2,
                               top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05, seed: int | None = None,
                               stop: str | list[str] | None = None, stream: bool = False):
        from .engine import Sampling

        tokens, template_stop = self.chat_prompt(messages)
        stop = ([stop] if isinstance(stop, str) else list(stop or [])) + template_stop
        sampling = Sampling(temperature, top_k, top_p, min_p, seed)
        head = {"id": f"chatcmpl-{uuid.uuid4()}", "created": int(time.time()), "model": self.model_path}
        chunks = self._run(tokens, max_tokens, sampling, stop)
        if stream:
            return self._chat_stream(head, chunks)
        text, finish, extra = "", None, {}
        for d, f, e in chunks:
            text, finish, extra = text + d, f, e
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
        return dict(head, object="chat.completion", choices=[choice], **extra)

    @staticmethod
    def _chat_stream(head, chunks):
        head = dict(head, object="chat.completion.chunk")
        yield dict(head, choices=[{"index": 0, "delta": {"role": "assistant"}, "logprobs": None,
                                   "finish_reason": None}])
        for d, f, extra in chunks:
            if d:
                yield dict(head, choices=[{"index": 0, "delta": {"content": d}, "logprobs": None,
                                           "finish_reason": None}])
            if f is not None:
                yield dict(head, choices=[{"index": 0, "delta": {}, "logprobs": None, "finish_reason": f}], **extra)
