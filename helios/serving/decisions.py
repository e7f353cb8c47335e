"""The one label scorer behind POST /v1/systemone and POST /v1/decisions (spec: System One decisions).

Each question is compiled into its own chat: a common state message (the system turn, identical for
every question of a request so later questions can reuse its prefix), then a user turn with the
question, its labelled options and an ``Answer:`` cue, then the template's assistant generation prompt
with thinking disabled where the template supports it (``enable_thinking=False``).

Labels are synthetic and single-token: ``Yes``/``No`` for binary questions, ``A``, ``B``, ... for
options. A label family is used only when every label is one vocabulary token *after the complete
rendered prompt*: tokenizing ``prompt_text + label`` must give exactly ``prompt_ids + [label_id]``, and
the label ids must be distinct. Families are tried in order (bare, then space-prefixed, then lower
case); when none fits, the request fails with 400.

Each question is one engine child with ``max_tokens=1`` that reads the labels' raw full-vocabulary
logprobs through ``logprob_token_ids`` (``ignore_eos`` keeps the entry even when EOS is sampled).
Questions run sequentially; the result carries each label's raw probability and the token counts,
and the protocol frontends turn them into their own answers.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Mapping, Sequence
from typing import Any

from helios.domain.conversation import ConversationRequest, ImagePart, Message, TextPart
from helios.domain.decisions import DecisionQuestion, QuestionScore
from helios.domain.generation import GenerationOptions
from helios.domain.sampling import SamplingRequest
from helios.engine.records import ImageInput
from helios.errors import BadRequest, InternalError
from helios.serving.pipeline import Service

STATE_PREAMBLE = "Evaluate the state below. Each question about it is answered with one label only."
BINARY_FAMILIES: tuple[tuple[str, str], ...] = (("Yes", "No"), (" Yes", " No"), ("yes", "no"), (" yes", " no"))
_OPTION_CANDIDATES = tuple(string.ascii_uppercase) + tuple(string.ascii_lowercase) + tuple(string.digits)
OPTION_PREFIXES = ("", " ")


class DecisionScorer:
    """Scores typed questions about one state with the loaded chat model. One per request."""

    def __init__(self, svc: Service) -> None:
        self.svc = svc
        info = svc.info
        if info.max_top_logprobs == 0:
            raise BadRequest("this model's core has no explicit-ID logprob inputs (logprob_token_ids); re-export "
                             "it with logprob outputs to serve decisions")
        if svc.chat_template is None:
            raise BadRequest("this model has no chat template, which decisions need")

    async def score(self, state: str, questions: Sequence[DecisionQuestion],
                    images: Mapping[str, ImagePart] | None = None) -> list[QuestionScore]:
        """``images``: System One image assets, marker text -> image; an image is presented wherever
        its marker stands in the state or a question's texts."""
        out = []
        for q in questions:  # sequentially: each question may reuse the state prefix of the one before
            out.append(await self.score_one(state, q, images or {}))
        return out

    async def score_one(self, state: str, question: DecisionQuestion,
                        images: Mapping[str, ImagePart] | None = None) -> QuestionScore:
        prompt_ids, labels, label_ids, inputs = await self._compile(state, question, images or {})
        svc = self.svc
        svc.output_budget(len(prompt_ids), 1)
        options = GenerationOptions(max_tokens=1, ignore_eos=True, num_top_logprobs=0,
                                    logprob_token_ids=tuple(label_ids))
        child = svc.engine_request(tuple(prompt_ids), svc.resolve_sampling(SamplingRequest(seed=0)), 1, options,
                                   prefix="dec", images=inputs)
        records: list[Any] = []
        num_prompt = num_output = num_cached = 0
        async with svc.generate([child], options) as streams:
            async for u in streams[0]:
                if u.finish is not None and u.finish.error is not None:
                    raise InternalError(u.finish.error)
                records.extend(u.logprobs or ())
                num_prompt, num_output, num_cached = u.num_prompt_tokens, u.num_output_tokens, u.num_cached_tokens
        if not records:
            raise InternalError("the scoring child produced no label logprobs")
        by_id = dict(records[-1].top)
        probabilities = tuple(math.exp(by_id[t]) if by_id[t] > -9999.0 else 0.0 for t in label_ids)
        return QuestionScore(probabilities, tuple(labels), num_prompt or len(prompt_ids), num_output, num_cached)

    # -- prompt compilation ------------------------------------------------------------------------
    async def _compile(self, state: str, q: DecisionQuestion, images: Mapping[str, ImagePart]
                       ) -> tuple[list[int], list[str], list[int], tuple[ImageInput, ...]]:
        families = self._families(q)
        if not families:
            raise BadRequest(f"this model offers fewer single-token labels than the {len(q.options)} options "
                             "of a question")
        for labels in families:
            rendered = await self.svc.render(self._conversation(state, q, labels, images), param="assets")
            text, ids = rendered.text, rendered.token_ids
            label_ids = await self._verify(text, ids, labels)
            if label_ids is not None:
                return ids, labels, label_ids, rendered.images
        raise BadRequest("the chat template leaves no distinct single-token answer labels after its generation "
                         "prompt; this model's template is incompatible with decisions")

    def _families(self, q: DecisionQuestion) -> list[list[str]]:
        if q.kind == "binary":
            return [list(f) for f in BINARY_FAMILIES]
        n = len(q.options)
        if n > len(_OPTION_CANDIDATES):
            return []
        bare = list(_OPTION_CANDIDATES[:n])
        return [[prefix + label for label in bare] for prefix in OPTION_PREFIXES]

    async def _verify(self, text: str, ids: list[int], labels: Sequence[str]) -> list[int] | None:
        """Each label must be exactly one token after the whole rendered prompt, and all distinct."""
        svc = self.svc
        label_ids: list[int] = []
        for label in labels:
            full = await svc.tokenize(text + label, add_special_tokens=False)
            if len(full) != len(ids) + 1 or full[: len(ids)] != ids:
                return None
            label_ids.append(full[-1])
        if len(set(label_ids)) != len(label_ids):
            return None
        return label_ids

    def _conversation(self, state: str, q: DecisionQuestion, labels: Sequence[str],
                      images: Mapping[str, ImagePart] | None = None) -> ConversationRequest:
        shown = [label.strip() for label in labels]
        if q.kind == "binary":
            body = (f"Question: {q.instructions}\n\n"
                    f"Reply {shown[0]} if it is true of the state, otherwise {shown[1]}.\nAnswer:")
        else:
            heading = "Levels, from lowest to highest:" if q.kind == "levels" else "Options:"
            what = "level" if q.kind == "levels" else "option"
            lines = "\n".join(f"{label}. {option}" for label, option in zip(shown, q.options, strict=True))
            body = (f"Question: {q.instructions}\n\n{heading}\n{lines}\n\n"
                    f"Reply with the label of the {what} that fits the state best.\nAnswer:")
        if images:
            # Images are presented in user turns only: the state moves ahead of the question in the
            # one user turn (still a prefix shared by every question of the request).
            messages = (
                Message("system", (TextPart(STATE_PREAMBLE),)),
                Message("user", _with_images(f"State:\n{state}\n\n{body}", images)),
            )
        else:
            messages = (
                Message("system", (TextPart(f"{STATE_PREAMBLE}\n\nState:\n{state}"),)),
                Message("user", (TextPart(body),)),
            )
        return ConversationRequest(messages=messages, chat_template_kwargs={"enable_thinking": False})


def _with_images(text: str, images: Mapping[str, ImagePart]) -> tuple[TextPart | ImagePart, ...]:
    """Text with an image at each of its markers, in order of appearance."""
    pattern = re.compile("|".join(re.escape(m) for m in images))
    parts: list[TextPart | ImagePart] = []
    pos = 0
    for match in pattern.finditer(text):
        if match.start() > pos:
            parts.append(TextPart(text[pos:match.start()]))
        parts.append(images[match.group()])
        pos = match.end()
    if pos < len(text):
        parts.append(TextPart(text[pos:]))
    return tuple(parts)
