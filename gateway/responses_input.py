"""Previous assistant messages in a Responses API input, as vLLM 0.32 cannot read all of them.

vLLM turns an input `message` item of the assistant (`ResponseOutputMessage`) into a chat message
from `item.content[0].text` (vllm/entrypoints/openai/responses/utils.py,
`_construct_message_from_response_item`): a first part that is a refusal (no `.text`) or an
empty content list raised AttributeError / IndexError, which the client saw as HTTP 500 (found
by tests/test_e2e_gateway_fuzz.py). Both are valid inputs under OpenAI's schema. The gateway
hands vLLM the same message with its parts joined into one text part (`readable_item`, which
gateway/vllm_patches.py's `read_earlier_assistant_messages` puts before vLLM's conversion):
output text as written, a refusal as its refusal text, no parts as an empty string.

Importing this module is cheap (no vLLM).
"""
from __future__ import annotations

from typing import Any


def _text(part: Any) -> str:
    return getattr(part, "text", None) or getattr(part, "refusal", None) or ""


def readable_item(item: Any) -> Any:
    """`item` (a Responses API input item) as vLLM can convert it: an assistant message whose
    first part is not output text, or that has no part, with its parts joined into one output
    text part; any other item as it is."""
    from openai.types.responses.response_output_message import ResponseOutputMessage
    from openai.types.responses.response_output_text import ResponseOutputText

    if isinstance(item, ResponseOutputMessage) and (
            not item.content or not isinstance(item.content[0], ResponseOutputText)):
        joined = ResponseOutputText(type="output_text", text="".join(map(_text, item.content)),
                                    annotations=[])
        return item.model_copy(update={"content": [joined]})
    return item
