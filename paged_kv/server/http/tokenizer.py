"""Tokenizers of the server: bytes for the embedded model, transformers' for a checkpoint."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

_ROLES = {"user": 258, "assistant": 259, "system": 260}
_SPECIALS = range(256, 261)
_PRINTABLE = bytes(range(33, 127))  # "!" to "~"


class ChatTemplateRefused(ValueError):
    """The model's chat template raised on the messages (many refuse a role they do not
    take, e.g. a system message): the client's input, answered 400 at ``messages``."""


class ByteTokenizer:
    """The embedded model's tokenizer: one id per byte (0-255) plus a few specials.

    ``<|bos|>`` = 256, ``<|eos|>`` = 257, ``<|user|>`` = 258, ``<|assistant|>`` = 259,
    ``<|system|>`` = 260 — all within `TinyLlama`'s default vocabulary of 2048. The ids past
    them (261 up to the vocabulary) decode to one printable ASCII character each, so what the
    (untrained) embedded model samples shows as visible text, never as an empty string.

    Examples
    --------
    >>> tok = ByteTokenizer()
    >>> tok.encode("hi")
    [104, 105]
    >>> tok.decode([104, 105, 257])
    'hi'
    >>> tok.decode([261, 262, 355])
    '!"!'
    """

    bos_token_id = 256
    eos_token_id = 257
    vocab_size = 261

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes of `text` as ids."""
        return list(text.encode())

    def decode(self, token_ids: Sequence[int]) -> str:
        """UTF-8 text of the byte ids; specials are skipped, ids past them are printable ASCII
        (``"!"`` + (id - 261) mod 94)."""
        return bytes(t if t < 256 else _PRINTABLE[(t - 261) % len(_PRINTABLE)]
                     for t in token_ids if t not in _SPECIALS).decode(errors="replace")

    def apply_chat_template(self, messages: Sequence[dict], *,
                            add_generation_prompt: bool = True) -> list[int]:
        """``<|bos|>`` then each message as ``<|role|>content\\n``, then ``<|assistant|>``
        (without `add_generation_prompt`: no ``<|assistant|>``, a warm-up's prompt)."""
        ids = [self.bos_token_id]
        for message in messages:
            ids += [_ROLES[message["role"]], *self.encode(message["content"] + "\n")]
        return [*ids, _ROLES["assistant"]] if add_generation_prompt else ids


class HFTokenizer:
    """A checkpoint's own transformers tokenizer and chat template (needs the hf extra)."""

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.eos_token_id = self._tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with the tokenizer's own special tokens (e.g. BOS)."""
        return list(self._tokenizer(text)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of `token_ids`, special tokens skipped, spaces as the tokens have them.

        No ``clean_up_tokenization_spaces`` (vLLM's choice too): its rules (``" ,"`` to
        ``","``, ``" 's"`` to ``"'s"``...) drop characters the model generated, and they
        change text already decoded once a later token arrives, so incremental decoding
        could not agree with decoding the whole."""
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=True,
                                      clean_up_tokenization_spaces=False)

    def apply_chat_template(self, messages: Sequence[dict], *,
                            add_generation_prompt: bool = True) -> list[int]:
        """The chat template's prompt for `messages`, ending where the assistant speaks
        (without `add_generation_prompt`: at the end of the last message, a warm-up's).

        Raises
        ------
        ValueError
            The tokenizer has no chat template; `ChatTemplateRefused` (a ValueError) when
            the template refused the messages (many raise on a role they do not take, e.g. a
            system message).
        """
        from jinja2 import TemplateError  # (transformers renders chat templates with jinja2)

        if not self._tokenizer.chat_template:
            raise ValueError("this model's tokenizer has no chat template; "
                             "use /v1/completions")
        try:
            text = self._tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)
        except TemplateError as exc:
            raise ChatTemplateRefused(f"the model's chat template refused them: {exc}") \
                from None
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])
