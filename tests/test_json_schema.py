"""JSON schemas before the grammar engine (localllm/generation/json_schema.py): objects with
`properties` are closed unless they say otherwise, and schemas that cannot be enforced are
refused up front with the keyword named."""

from __future__ import annotations

import pytest

from localllm.generation.json_schema import SchemaError, prepare_schema


def test_objects_with_properties_are_closed() -> None:
    s = prepare_schema({"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
        "properties": {"type": "object", "properties": {}},  # a key named like the keyword
        "open": {"type": "object", "properties": {}, "additionalProperties": True},
        "free": {"type": "object"},
        "c": {"const": {"properties": {"x": 1}}},  # a value, not a schema
    }, "$defs": {"d": {"properties": {"e": {}}}},
        "anyOf": [{"properties": {"f": {}}}]})
    assert s["additionalProperties"] is False
    p = s["properties"]
    assert p["a"]["additionalProperties"] is False
    assert p["a"]["properties"]["b"] == {"type": "integer"}
    assert p["properties"]["additionalProperties"] is False
    assert p["open"]["additionalProperties"] is True
    assert "additionalProperties" not in p["free"]
    assert p["c"] == {"const": {"properties": {"x": 1}}}
    assert s["$defs"]["d"]["additionalProperties"] is False
    assert s["anyOf"][0]["additionalProperties"] is False


@pytest.mark.parametrize("schema, needle", [
    ({"$ref": "#"}, "'$ref'"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}},
      "$ref": "#/$defs/a"}, "'$ref'"),
    ({"$ref": "#/$defs/missing"}, "names nothing"),
    ({"type": "string", "pattern": "^a{1000}{1000}$"}, "'pattern'"),
    ({"type": "object", "properties": {"s": {"type": "string", "pattern": "(ab"}}}, "'pattern'"),
])
def test_unenforceable_schemas_are_refused(schema, needle) -> None:
    with pytest.raises(SchemaError, match=needle.replace("$", r"\$")):
        prepare_schema(schema)


def test_recursion_through_a_value_is_fine() -> None:
    tree = {"type": "object", "properties": {
        "children": {"type": "array", "items": {"$ref": "#"}}}}
    assert prepare_schema(tree)["properties"]["children"]["items"] == {"$ref": "#"}
    # a branch of anyOf may end the recursion
    prepare_schema({"anyOf": [{"type": "null"}, {"$ref": "#"}]})


def test_key_tracker_refuses_a_repeated_key() -> None:
    from localllm.generation.json_keys import KeyTracker

    t = KeyTracker()
    assert t.feed(b'{"a": 1, "b": {"a": [{"a": "x\\"a\\""}], "c": ",\\"a"}, ')
    assert t.allows(b'"c"') and not t.allows(b'"a"') and not t.allows(b'"b":')
    assert t.feed(b'"')
    assert t.allows(b'a2"') and not t.allows(b'a"')
    assert t.feed(b'a2": 3}')
    # after the object closes, an enclosing array's new object starts with no keys
    u = KeyTracker()
    assert u.feed(b'[{"a": 1}, {') and u.allows(b'"a"')


@pytest.mark.parametrize("fmt", ["json", {"type": "object", "additionalProperties": {
    "type": "integer"}}])
def test_constraint_never_repeats_a_key(smollm2_path, fmt) -> None:
    import numpy as np

    from localllm.engine import Engine
    from localllm.generation.constraint import ConstrainedSampler, make_constraint
    from localllm.generation.sampling import Sampler, SamplerConfig

    tok = Engine(smollm2_path, n_ctx=64, n_slots=1, n_threads=1).tokenizer
    c = make_constraint(fmt, tok)
    for t in tok.encode('{"a": 1, "', add_special=False):
        assert c.allows(t) and c.accept(t)
    (a,) = tok.encode("a", add_special=False)
    assert c.allows(a) and c.accept(a)  # `"a` may go on ("ab"), but not close
    quote = [t for t in range(tok.vocab_size) if tok.token_to_piece(t).startswith(b'"')]
    mask = c.mask(tok.vocab_size)
    assert not any(mask[t] or c.allows(t) for t in quote)
    # a sampler that wants to close the key gets another token
    logits = np.zeros(tok.vocab_size, dtype=np.float32)
    logits[quote] = 10.0
    t = ConstrainedSampler(Sampler(SamplerConfig(temperature=0)), c)(logits, [])
    assert not tok.token_to_piece(t).startswith(b'"')
