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
