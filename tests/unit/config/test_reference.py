"""The config reference page lists every key with the default the loader gives it and its docstring."""

import math

import yaml

from rltrain.config import RLConfig, dump_yaml
from rltrain.config.reference import Row, _one_line, render, sections


def _leaves(tree: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict) and value:
            out |= _leaves(value, path)
        else:
            out[path] = value
    return out


def _rows() -> dict[str, Row]:
    return {row.key: row for section in sections() for row in section.rows}


def test_every_key_of_the_resolved_default_config_has_a_row_with_its_default():
    # The independent reference: the default config as the loader dumps it (YAML), flattened.
    expected = _leaves(yaml.safe_load(dump_yaml(RLConfig())))
    rows = _rows()
    assert set(expected) <= set(rows), sorted(set(expected) - set(rows))
    for key, value in expected.items():
        shown = yaml.safe_load(rows[key].default.strip("`"))
        if isinstance(value, float):
            assert math.isclose(float(shown), value), key
        else:
            assert shown == value, key


def test_rows_beyond_the_defaults_are_the_keys_of_optional_and_named_sections():
    expected = set(_leaves(yaml.safe_load(dump_yaml(RLConfig()))))
    extra = set(_rows()) - expected
    # Keys under a section that defaults to null (model.tiny, data.generated, ...) or is a map by
    # name (cluster.resource_pools.<name>): the dump has the section's key alone.
    optional = {"model.tiny", "data.generated", "ref.parallel", "algorithm.rollout_correction"}
    named = {"cluster.resource_pools.<name>"}
    assert extra and all(any(k.startswith(p + ".") for p in optional | named) for k in extra), sorted(extra)
    assert {"model.tiny.hidden_size", "cluster.resource_pools.<name>.nnodes"} <= extra


def test_a_row_by_hand():
    assert _rows()["trainer.checkpoint.max_ckpt_to_keep"] == Row(
        key="trainer.checkpoint.max_ckpt_to_keep",
        type="int | None",
        default="`3`",
        doc="Complete checkpoints kept (oldest deleted first); null keeps all.",
    )
    # The critic builds its optimizer with verl's critic learning rate; the class default is the actor's.
    assert _rows()["critic.optim.lr"].default == "`1e-05`"
    assert _rows()["actor.optim.lr"].default == "`1e-06`"


def test_sections_in_field_order_with_their_docstring():
    paths = [s.path for s in sections()]
    assert paths[:5] == ["", "model", "model.tiny", "model.fused_kernel_options", "model.moe"]
    assert paths.index("actor.optim") < paths.index("ref") < paths.index("critic")
    timeouts = next(s for s in sections() if s.path == "trainer.timeouts")
    # The parent's field docstring, then the class docstring.
    field_doc, class_doc = timeouts.doc.split("\n\n")
    assert field_doc.startswith("How long each call to the workers and each collective may take")
    assert class_doc.startswith("How long the driver waits for each kind of call")


def test_table_cells_escape_pipes_outside_code_only():
    assert _one_line("a | b\n   ``x|y`` and `c|d`") == "a \\| b ``x|y`` and `c|d`"


def test_render_has_a_table_row_per_key():
    text = render()
    assert text.startswith("# Config reference\n")
    assert sum(line.startswith("| `") for line in text.splitlines()) == len(_rows())
    assert "| `trainer.checkpoint.max_ckpt_to_keep` | int \\| None | `3` | Complete checkpoints" in text
