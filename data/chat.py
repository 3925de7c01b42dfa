"""Multi-turn chats as token sequences: template segments with the assistant responses spliced in by token id.

The chat template is rendered once per conversation with a sentinel in place of every assistant message and cut
at the sentinels. ``segments[i]`` is the template text before response i (segment 0: system + first user turn +
generation prompt; later ones: the next user turn and generation prompt). The sequence is
``seg0 + resp0 + seg1 + resp1 + ...`` and the loss mask covers the responses only.

Responses are kept as token ids, never re-tokenised text: what the target generated (EOS included) is exactly
what it is trained on and what it sees in later turns. A response that ends with the end-of-turn token already
closes its turn, so that marker is cut from the start of the next segment and only re-added after a response
that stopped at the length cap.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.errors import DraftsmithError

SENTINEL = "@@DRAFTSMITH_RESPONSE_{}@@"


@dataclass
class ChatLayout:
    """One conversation. ``segments[i]``: template tokens before assistant turn i (len = n_turns), stored without
    the previous turn's end-of-turn marker; ``closers[i]``: that marker's id (None if the template writes none);
    ``responses[i]``: the dataset's own assistant tokens for turn i, end-of-turn included (None if it has none).
    """

    segments: list[list[int]]
    closers: list[int | None]
    responses: list[list[int] | None]

    @property
    def n_turns(self) -> int:
        return len(self.segments)

    def glue(self, i: int, previous_response: list[int], eos_ids: set[int]) -> list[int]:
        """Segment i as it follows ``previous_response``: a response that stopped without an end-of-turn token
        (length cap) gets the template's marker here, closing its turn as the template would."""
        closer = self.closers[i]
        if closer is None or (previous_response and previous_response[-1] in eos_ids):
            return self.segments[i]
        return [closer] + self.segments[i]


def _with_sentinels(messages: list[dict]) -> tuple[list[dict], list[str | None]]:
    """Messages with one assistant sentinel after each user turn (replacing the dataset's reply, if any)."""
    out, originals = [], []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            continue  # replaced by the sentinel inserted after the user turn it answers
        out.append(m)
        if m["role"] == "user":
            nxt = messages[i + 1] if i + 1 < len(messages) else None
            originals.append(nxt["content"] if nxt is not None and nxt["role"] == "assistant" else None)
            out.append({"role": "assistant", "content": SENTINEL.format(len(originals) - 1)})
    return out, originals


def chat_layout(tok, messages: list[dict], eos_ids: set[int]) -> ChatLayout:
    """Render ``messages`` (system?, user, [assistant], user, ...) with the tokenizer's chat template.

    ``eos_ids``: end-of-turn ids; a dataset response gets the end-of-turn token the template writes after it.
    Raises DraftsmithError when the template drops or rewrites assistant messages (they cannot be spliced).
    """
    msgs, originals = _with_sentinels(messages)
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    pieces, rest = [], text
    for i in range(len(originals)):
        head, sep, rest = rest.partition(SENTINEL.format(i))
        if not sep:
            raise DraftsmithError(
                f"the chat template does not render assistant message {i} verbatim, so "
                f"responses cannot be spliced into it"
            )
        pieces.append(head)
    pieces.append(rest)  # after the last response: only its end-of-turn marker matters
    eos_texts = {tok.decode([e]): e for e in sorted(eos_ids)}
    segments, closers, responses = [], [], []
    for i, content in enumerate(originals):
        closer = _end_marker(pieces[i], eos_texts) if i > 0 else None
        seg = pieces[i][len(tok.decode([closer])) :] if closer is not None else pieces[i]
        segments.append(encode(tok, seg))
        closers.append(closer)
        if content is None:
            responses.append(None)
            continue
        end = _end_marker(pieces[i + 1], eos_texts)
        responses.append(encode(tok, content) + ([end] if end is not None else []))
    return ChatLayout(segments, closers, responses)


def _end_marker(text: str, eos_texts: dict[str, int]) -> int | None:
    """The end-of-turn id whose text starts ``text``, if any."""
    for s, e in eos_texts.items():
        if s and text.startswith(s):
            return e
    return None


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"] if text else []
