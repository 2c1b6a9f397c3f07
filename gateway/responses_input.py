"""Previous assistant messages in a Responses API input, as vLLM 0.32 cannot read all of them.

vLLM turns an input `message` item of the assistant (`ResponseOutputMessage`) into a chat message
from `item.content[0].text` (vllm/entrypoints/openai/responses/utils.py,
`_construct_message_from_response_item`): a first part that is a refusal (no `.text`) or an
empty content list raised AttributeError / IndexError, which the client saw as HTTP 500 (found
by tests/test_e2e_gateway_fuzz.py). Both are valid inputs under OpenAI's schema. The gateway
hands vLLM the same message with its parts joined into one text part: output text as written,
a refusal as its refusal text, no parts as an empty string.
"""
from __future__ import annotations

from typing import Any


def _text(part: Any) -> str:
    return getattr(part, "text", None) or getattr(part, "refusal", None) or ""


def install() -> None:
    """Wrap vLLM's conversion of input items (idempotent)."""
    from openai.types.responses.response_output_message import ResponseOutputMessage
    from openai.types.responses.response_output_text import ResponseOutputText
    from vllm.entrypoints.openai.responses import utils

    original = utils._construct_message_from_response_item
    if getattr(original, "ttserve", False):
        return

    def construct(item: Any, prev_msg: Any = None) -> Any:
        if isinstance(item, ResponseOutputMessage) and (
                not item.content or not isinstance(item.content[0], ResponseOutputText)):
            joined = ResponseOutputText(type="output_text", text="".join(map(_text, item.content)),
                                        annotations=[])
            item = item.model_copy(update={"content": [joined]})
        return original(item, prev_msg=prev_msg)

    construct.ttserve = True  # type: ignore[attr-defined]
    utils._construct_message_from_response_item = construct
