"""The ChatML layout of the training data as token ids for rollouts, and the line between private thinking and
public text.

Every message renders as ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` with each piece encoded on its own, as
``data_prep.render`` does for the training data, so a context's ids do not depend on how a tokenizer would merge
across piece boundaries. Contents are encoded with special-token text split into plain tokens: a speaker who
types "<|im_end|>" cannot end a turn, which is also how the training data was made.

The simulator's thinking is private. ``split_thinking`` separates it from the utterance and never leaves a think
marker in the utterance; ``check_public`` is the guard that a transcript about to be shown to the other side
holds nothing but public ``{"role", "content"}`` messages free of think markers.
"""

import re

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK = "<think>"
END_THINK = "</think>"
ENDOFTEXT = "<|endoftext|>"

_MARKERS = re.compile(f"({re.escape(THINK)}|{re.escape(END_THINK)})")
_PUBLIC_KEYS = {"role", "content"}


class PrivilegedTextLeak(ValueError):
    """Raised when private text (thinking, or any field other than role/content) is about to reach the other side."""


def check_public(messages: list[dict]) -> None:
    """Raise ``PrivilegedTextLeak`` unless every message is a bare ``{"role", "content"}`` without think markers."""
    for index, message in enumerate(messages):
        extra = set(message) - _PUBLIC_KEYS
        if extra:
            raise PrivilegedTextLeak(f"message {index} carries non-public fields {sorted(extra)}")
        content = message["content"]
        if THINK in content or END_THINK in content:
            raise PrivilegedTextLeak(f"message {index} ({message['role']}) contains a think marker")


def flip_roles(messages: list[dict]) -> list[dict]:
    """Swap ``user`` and ``assistant`` (``system`` stays): between the training rendering's roles (the simulator
    speaks as ``user``) and the convention of user-simulator frameworks (tau2-bench's ``UserSimulator``: the
    simulator's turns are ``assistant`` messages, the agent's ``user``). Its own inverse."""
    swapped = {"user": "assistant", "assistant": "user", "system": "system"}
    return [{**message, "role": swapped[message["role"]]} for message in messages]


def strip_thinking(text: str) -> tuple[str | None, str]:
    """Split text that was generated outside a think block: ``(thinking or None, public text)``.

    Every ``<think>...</think>`` block (an unclosed one runs to the end) is thinking; a stray ``</think>`` means
    the writer was thinking up to there, so everything before it is thinking too."""
    segments: list[list] = []  # [is_thinking, text] in order
    inside = False
    for piece in _MARKERS.split(text):
        if piece == THINK:
            inside = True
        elif piece == END_THINK:
            if not inside:
                for segment in segments:
                    segment[0] = True
            inside = False
        elif inside or piece:
            segments.append([inside, piece])
    thoughts = [piece.strip() for thinking, piece in segments if thinking]
    public = "".join(piece for thinking, piece in segments if not thinking)
    return ("\n\n".join(t for t in thoughts if t) if thoughts else None), public.strip()


class ChatRenderer:
    """Token ids of chat contexts for a policy or a local counterpart model, with or without thinking."""

    def __init__(self, tokenizer, thinking: bool):
        self.tokenizer = tokenizer
        self.thinking = thinking
        im_start, im_end, think, endoftext = tokenizer.convert_tokens_to_ids([IM_START, IM_END, THINK, ENDOFTEXT])
        self._headers = {role: [im_start, *self._encode(f"{role}\n")] for role in ("system", "user", "assistant")}
        self._closing = [im_end, *self._encode("\n")]
        self._open_thinking = [think, *self._encode("\n")] if thinking else []
        self.stop_token_ids = (im_end, endoftext)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)

    def render_messages(self, messages: list[dict]) -> list[int]:
        """The ids of complete public messages, each closed by ``<|im_end|>\\n``."""
        ids: list[int] = []
        for message in messages:
            ids += self._headers[message["role"]]
            ids += self._encode(message["content"])
            ids += self._closing
        return ids

    def user_prompt(self, messages: list[dict]) -> list[int]:
        """The context from which the simulator generates the user's next turn."""
        return self._prompt(messages, "user")

    def assistant_prompt(self, messages: list[dict]) -> list[int]:
        """The context from which a local assistant model generates its next turn."""
        return self._prompt(messages, "assistant")

    def _prompt(self, messages: list[dict], role: str) -> list[int]:
        # the thinking template the training data follows (Qwen3.5's) opens the think block in the generation prompt
        return self.render_messages(messages) + self._headers[role] + self._open_thinking

    def split_thinking(self, text: str) -> tuple[str | None, str]:
        """Split a generated turn into ``(thinking, utterance)``; only the utterance may be shown to anyone.

        With thinking on, the text starts inside the think block opened by the prompt: it ends at the first
        ``</think>``, and without one the whole text is thinking and the utterance is empty. Think blocks found
        anywhere else are thinking as well, so no marker survives in the utterance."""
        text = text.strip()
        for stop in (IM_END, ENDOFTEXT):
            text = text.removesuffix(stop)
        return strip_thinking(THINK + text if self.thinking else text)
