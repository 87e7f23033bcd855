"""config/recipes.py: every recipe is a preset by name (``--config config/base.py:NAME``) and sets only what differs
from what it starts from (a preset, or another recipe); the presets of config/base.py alike from base()."""

from contextlib import contextmanager

import pytest
from ml_collections.config_dict import config_dict

from config.base import PRESETS, get_config
from config.recipes import RECIPES


@contextmanager
def recorded_assignments():
    """Every assignment to an existing ConfigDict field while inside: (key, value before, value after)."""
    seen, original = [], config_dict.ConfigDict.__setitem__

    def setitem(self, key, value):
        fields = object.__getattribute__(self, "_fields")
        before = fields[key].get() if isinstance(fields.get(key), config_dict.FieldReference) else fields.get(key)
        existed = key in fields
        original(self, key, value)
        if existed:
            after = self[key]
            seen.append((key, before, after.to_dict() if hasattr(after, "to_dict") else after))
    config_dict.ConfigDict.__setitem__ = setitem
    try:
        yield seen
    finally:
        config_dict.ConfigDict.__setitem__ = original


def restated(make) -> list:
    """The fields ``make()`` sets to the value they already hold."""
    with recorded_assignments() as seen:
        make()
    return [key for key, before, after in seen
            if (before.to_dict() if hasattr(before, "to_dict") else before) == after]


def test_a_restated_value_is_found():
    def recipe():
        config = get_config("grpo")
        config.kl.beta = 0.004  # grpo's already
        config.train.learning_rate = 1e-4
        return config

    assert restated(recipe) == ["beta"]


@pytest.mark.parametrize("name", sorted(PRESETS) + sorted(RECIPES))
def test_a_preset_or_recipe_sets_only_what_differs(name):
    assert restated(lambda: get_config(name)) == [], f"{name} restates the value of what it starts from"
    assert get_config(name).preset == name
