"""Observation -> the token ids appended after a model turn (token-in/token-out).

The trajectory loop keeps token ids: turn k+1's input is exactly turn k's input, plus
the ids the model generated, plus the ids of the observation. Only the observation is
templated and tokenized, never the history (re-templating a history drops or adds
separators, a drift that compounds every turn).

    enc = ObservationEncoder(tokenizer, tools=env.tools_schema())
    ids = enc.encode(obs)               # what follows the model's turn, up to and
                                        # including the next assistant generation prompt
    ids = enc.encode(obs, closed=False) # the turn hit its token limit: close it first
    enc.prompt_ids(messages)            # a whole first prompt (reset's messages)

With a chat template, the delta is what the template itself would add: a fixed dummy
conversation D = [user, assistant] is rendered as text and tokenized once (B); each
observation renders D + obs.messages with the generation prompt (F); the delta is
F minus its prefix B. Two checks make this exact or loud: F's text must start with B's
text, and F's ids with B's ids (a template that renders earlier messages differently
once more follow, or a BPE merge across the boundary, is a ConfigError naming the
template, never a silent drift). The model's turn ended with its stop token, which the
template also writes after the assistant's content; what the template writes after that
token (ChatML's "\\n" after <|im_end|>) is not generated, so it leads the delta. A
template whose assistant turns end with no stop token (a ChatML template on a tokenizer
whose EOS is <|endoftext|>) is refused until `stop_token_ids` names the one that ends a
turn: otherwise that separator would silently go missing.

Without a chat template, the observation is each message's content plus "\\n", as plain
text tokenized without special tokens. A token-id observation is passed through (each id
checked against the vocabulary). An empty one gives [].

Invariants: `encode` depends only on the observation (and the fixed tools/kwargs), so
equal observations give equal ids in every turn and every process; the ids of the
history are never recomputed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hybridflow.errors import ConfigError
from hybridflow.stages.env.protocol import Message, Observation, ObservationKind

__all__ = ["DUMMY_CONVERSATION", "ObservationEncoder"]

# Plain, short and ASCII so every template and tokenizer renders it; never shown to a model.
DUMMY_CONVERSATION: tuple[Message, ...] = (
    {"role": "user", "content": "Hi."},
    {"role": "assistant", "content": "Hello."},
)
_PATH = "tokenizer.chat_template"


class ObservationEncoder:
    def __init__(
        self,
        tokenizer: Any,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        stop_token_ids: Sequence[int] = (),
        use_chat_template: bool | None = None,
    ) -> None:
        """`stop_token_ids`: the ids that end a model turn besides the tokenizer's EOS
        (e.g. `<|im_end|>` where it is not the EOS). `use_chat_template`: None uses the
        tokenizer's template when it has one."""
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.kwargs = dict(chat_template_kwargs or {})
        has_template = bool(getattr(tokenizer, "chat_template", None))
        self.templated = has_template if use_chat_template is None else use_chat_template
        if self.templated and not has_template:
            raise ConfigError(
                _PATH, "use_chat_template is set but the tokenizer has no chat template"
            )
        eos = getattr(tokenizer, "eos_token_id", None)
        self.stop_ids = frozenset([*stop_token_ids, *([eos] if eos is not None else [])])
        self.vocab_size = len(tokenizer)
        if self.templated:
            self._base_text = self._render(list(DUMMY_CONVERSATION), generation_prompt=False)
            self._base_ids = self._tokenize(self._base_text)
            # what closes an assistant turn: its stop token and what the template writes after
            after = self._base_text[self._base_text.rfind(DUMMY_CONVERSATION[-1]["content"]) :]
            after = after[len(DUMMY_CONVERSATION[-1]["content"]) :]
            if after and not self.stop_ids.intersection(self._tokenize(after)):
                raise ConfigError(
                    _PATH,
                    f"the template ends an assistant turn with {after!r}, which holds none of "
                    f"the stop tokens {sorted(self.stop_ids)}: pass the id that ends a model "
                    "turn as stop_token_ids (e.g. <|im_end|> where the EOS is <|endoftext|>)",
                )
            stops = [i for i, t in enumerate(self._base_ids) if t in self.stop_ids]
            self._closing = self._base_ids[stops[-1] :] if after and stops else []
        else:
            self._base_text, self._base_ids, self._closing = "", [], []

    @property
    def after_stop_ids(self) -> list[int]:
        """The template's ids after the assistant's stop token (ChatML: the "\\n")."""
        return list(self._closing[1:])

    def encode(self, obs: Observation, *, closed: bool = True) -> list[int]:
        """The ids to append after a model turn. `closed`: whether that turn ended with a
        stop token; if not, the template's closing of an assistant turn comes first."""
        if obs.kind is ObservationKind.EMPTY:
            return []
        if obs.kind is ObservationKind.TOKENS:
            bad = [t for t in obs.token_ids if t >= self.vocab_size]
            if bad:
                raise ValueError(
                    f"observation token ids {bad[:4]} are outside the vocabulary "
                    f"(size {self.vocab_size})"
                )
            return list(obs.token_ids)
        if not self.templated:
            return self._tokenize("".join(m["content"] + "\n" for m in obs.messages))
        lead = self._closing[1:] if closed else self._closing
        return [*lead, *self._delta(list(obs.messages))]

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """A first prompt: `messages` templated with the tools and a generation prompt
        (without a template: the contents, one per line)."""
        msgs = [dict(m) for m in messages]
        if not self.templated:
            return self._tokenize("".join(str(m["content"]) + "\n" for m in msgs))
        return self._tokenize(self._render(msgs, generation_prompt=True))

    def _delta(self, messages: list[Message]) -> list[int]:
        text = self._render([*DUMMY_CONVERSATION, *messages], generation_prompt=True)
        if not text.startswith(self._base_text):
            raise ConfigError(
                _PATH,
                "the chat template is not prefix-stable: it renders a conversation "
                "differently once more messages follow it, so an observation cannot be "
                "appended to a history without re-templating it. Rendered alone:\n"
                f"  {self._base_text[-120:]!r}\nfollowed by the observation:\n"
                f"  {text[: len(self._base_text) + 40][-160:]!r}\n"
                "Use a template that renders each message on its own (ChatML does), or "
                "an environment that returns token ids.",
            )
        ids = self._tokenize(text)
        n = len(self._base_ids)
        if ids[:n] != self._base_ids:
            raise ConfigError(
                _PATH,
                "the tokenizer merges tokens across the end of an assistant turn: the ids "
                "of the conversation are not a prefix of the ids of the conversation plus "
                "an observation (first difference at token "
                f"{_first_difference(ids, self._base_ids)} of {n}). End each message of "
                "the template with a special token (e.g. <|im_end|>) or a separator the "
                "tokenizer never merges.",
            )
        return ids[n:]

    def _render(self, messages: list[Message], *, generation_prompt: bool) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=self.tools,
                tokenize=False,
                add_generation_prompt=generation_prompt,
                **self.kwargs,
            )
        except Exception as exc:  # jinja's TemplateError, raise_exception(): a config problem
            roles = [m.get("role") for m in messages]
            raise ConfigError(
                _PATH, f"the chat template cannot render messages with roles {roles}: {exc}"
            ) from exc
        if not isinstance(text, str):
            raise ConfigError(
                _PATH, f"apply_chat_template returned {type(text).__name__}, not text"
            )
        return text

    def _tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))
