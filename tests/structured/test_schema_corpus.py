"""The structured-output corpus is usable by both engines: every example validates against its
schema, passes fornax's schema check, and is accepted token by token, then EOS, by xgrammar and
llguidance on the default model's vocabulary."""

from __future__ import annotations

import json

import pytest

from fornax.engine.structured.schema_check import check_schema
from tests.structured.engines import llguidance_accepts, xgrammar_accepts
from tests.structured.schemas import PROMPTS, SCHEMAS

_IDS = [name for name, _, _ in SCHEMAS]


def test_corpus_shape():
    assert len(SCHEMAS) == 20
    assert len(set(_IDS)) == 20
    assert len(PROMPTS) == 3
    for prompt in PROMPTS:
        assert "{name}" in prompt and prompt.format(name="person")


@pytest.mark.parametrize(("name", "schema", "example"), SCHEMAS, ids=_IDS)
def test_example_is_valid(name, schema, example):
    jsonschema = pytest.importorskip("jsonschema")
    draft = jsonschema.Draft202012Validator
    draft.check_schema(schema)
    draft(schema, format_checker=draft.FORMAT_CHECKER).validate(example)
    check_schema(schema)


@pytest.mark.parametrize(("name", "schema", "example"), SCHEMAS, ids=_IDS)
def test_both_engines_accept_example(name, schema, example, vocab, xgr_compiler, llg_tokenizer):
    import llguidance

    text = json.dumps(example)
    assert len(vocab.encode(text)) < 150, "keep examples small enough for a 135M model"
    assert xgrammar_accepts(xgr_compiler.compile_json_schema(json.dumps(schema)), vocab, text)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    assert llguidance_accepts(llg_tokenizer, grammar, vocab)(text)
    # and neither accepts a truncated example, so acceptance above means something
    assert not xgrammar_accepts(xgr_compiler.compile_json_schema(json.dumps(schema)), vocab, text[:-1])
    assert not llguidance_accepts(llg_tokenizer, grammar, vocab)(text[:-1])
