"""The value-name table (config/fields.py) is the one list of the runtime's field names:
every tuple it builds, every name the compiler's kinds stand for and every field the
samples file reads is in it, and the modules that list sequence fields use its tuples."""

from __future__ import annotations

from hybridflow.config import fields


def test_every_named_tuple_is_in_the_table():
    named = (
        *fields.SEQUENCE_FIELDS,
        *fields.GENERATE_INPUTS,
        *fields.GENERATE_OUTPUTS,
        fields.METADATA,
        fields.SAMPLE_INDEX,
        fields.GROUP_INDEX,
    )
    assert [n for n in named if n not in fields.FIELDS] == []
    assert fields.SEQUENCE_FIELDS == fields.PROMPT_FIELDS + fields.RESPONSE_FIELDS


def test_the_compiler_kinds_and_the_samples_use_table_names():
    from hybridflow.pipeline.compiler.grammar import DATA_FIELDS, KINDS
    from hybridflow.pipeline.observe.samples import SAMPLE_FIELDS

    used = {f for kind in KINDS.values() for f in kind.fields} | set(DATA_FIELDS)
    assert sorted(used - set(fields.FIELDS)) == []
    assert sorted(set(SAMPLE_FIELDS) - set(fields.FIELDS)) == []


def test_sequence_lists_are_the_table_s():
    from hybridflow.pipeline.compiler import lowering
    from hybridflow.pipeline.sources.sft import SFTExamples
    from hybridflow.stages import common
    from hybridflow.stages.reward import function

    assert lowering.SEQ is fields.SEQUENCE_FIELDS
    assert SFTExamples.FIELDS[:4] == fields.SEQUENCE_FIELDS
    assert (*fields.SEQUENCE_FIELDS, fields.METADATA) == function._TEXT_FIELDS
    assert common.SEQUENCE_FIELDS == fields.SEQUENCE_FIELDS  # stages' own copy, for now


def test_the_data_sources_provide_table_names():
    from hybridflow.pipeline.sources.prompt_source import PromptSource
    from hybridflow.pipeline.sources.registry import SyntheticPrompts
    from hybridflow.pipeline.sources.rl import GroupedPrompts
    from hybridflow.pipeline.sources.sft import SFTExamples

    for source in (PromptSource, SyntheticPrompts, GroupedPrompts, SFTExamples):
        assert [n for n in source.FIELDS if n not in fields.FIELDS] == [], source.__name__
        assert source.FIELDS[:2] == fields.PROMPT_FIELDS, source.__name__
