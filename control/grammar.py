"""Structured-output grammars: compiled with llguidance off the step loop, one matcher per
request, advanced with every token the request samples.

The gateway's frontend has already validated the spec with llguidance (vLLM's `guidance`
backend), so a compile error here is rare; it ends the request with FINISH_REASON_ERROR.
The grammar text is built as vLLM's `serialize_guidance_grammar` builds it, so what the
frontend validated is what is enforced.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

import llguidance

from .client_text import first_line

KINDS = ("json", "regex", "choice", "grammar", "json_object")
# llguidance parses at most 2000 alternatives in one row ("Current row has 3001 items; max is
# 2000"): a longer choice list compiles, then fails mid-generation; 65k of them panic the compiler.
MAX_CHOICES = 2000


class GrammarError(ValueError):
    """The spec does not compile; the message says why."""


@dataclass(slots=True, frozen=True)
class GrammarSpec:
    kind: str                      # one of KINDS
    text: str                      # the schema, regex, JSON list of choices or grammar; "" for json_object
    whitespace_flexible: bool = False
    disable_additional_properties: bool = False

    def problem(self) -> str | None:
        """Why the spec cannot be served, found before it is compiled."""
        if self.kind == "choice":
            try:
                choices = json.loads(self.text)
            except ValueError:
                return "structured output choice: not a JSON list of strings"
            if isinstance(choices, list) and len(choices) > MAX_CHOICES:
                return (f"structured output choice has {len(choices)} options, more than the {MAX_CHOICES} "
                        "this server's grammar engine can follow")
        return None

    def serialize(self) -> str:
        """llguidance's grammar text for this spec (vLLM's serialize_guidance_grammar)."""
        defaults = {"whitespace_flexible": self.whitespace_flexible}
        try:
            if self.kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=defaults)
            if self.kind == "json":
                schema: str | dict = self.text
                if self.disable_additional_properties:
                    schema = _close_objects(json.loads(self.text))
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
            if self.kind in ("regex", "choice", "grammar"):
                return llguidance.grammar_from(self.kind, self.text)
        except (ValueError, KeyError, TypeError) as e:
            raise GrammarError(f"invalid {self.kind} structured output: {e}") from None
        raise GrammarError(f"unknown structured output kind {self.kind!r}; allowed: {', '.join(KINDS)}")


def _close_objects(schema: object) -> object:
    """vLLM's disable_additional_properties: every object schema with properties and no
    additionalProperties gets additionalProperties = false (in place, recursively)."""
    if isinstance(schema, dict):
        for value in schema.values():
            _close_objects(value)
        if "additionalProperties" not in schema and (
                isinstance(schema.get("properties"), dict) or isinstance(schema.get("patternProperties"), dict)):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        for item in schema:
            _close_objects(item)
    return schema


class Grammar:
    """One request's grammar state: which tokens may come next, advanced token by token."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def bitmask(self) -> bytes:
        """The allowed next tokens: bit i of little-endian int32 words allows token id i
        (only EOS once the grammar is complete)."""
        return self._matcher.compute_bitmask()

    def accept(self, token_id: int) -> bool:
        """Advance with a sampled token; False if the grammar does not allow it."""
        return self._matcher.consume_token(token_id)

    @property
    def is_complete(self) -> bool:
        """Nothing but EOS can follow: the output is finished."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()


class GrammarCompiler:
    """Compiles specs against the model's tokenizer (its tokenizer.json; the `tokenizers`
    library inside llguidance reads it, so no transformers). The tokenizer is loaded on the first
    compile (~0.2 s for a 50k vocabulary), on the compiling thread."""

    def __init__(self, tokenizer_path: str | Path, vocab_size: int, eos_token_ids: list[int]) -> None:
        path = Path(tokenizer_path)
        self.tokenizer_file = path / "tokenizer.json" if path.is_dir() else path
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                try:
                    text = self.tokenizer_file.read_text()
                except OSError as e:
                    raise GrammarError(f"structured outputs need the model's tokenizer: cannot read "
                                       f"{self.tokenizer_file} ({e.strerror or e}); see --tokenizer") from None
                self._tokenizer = llguidance.LLTokenizer(
                    text, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None)
            return self._tokenizer

    def compile(self, spec: GrammarSpec) -> Grammar:
        """A fresh grammar for one request (blocking: run it on a worker thread)."""
        matcher = llguidance.LLMatcher(self.tokenizer, spec.serialize(), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {spec.kind} structured output: {first_line(matcher.get_error())}")
        return Grammar(matcher)
