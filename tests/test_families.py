"""The typed family specs: each half's registry refuses a spec with a required hook missing, every registered spec
is complete and says what its adapter builds, and the two halves cover the same model types."""

from dataclasses import replace

import pytest

from planner.catalog import CATALOG, CONFIGS
from planner.contract.families import FAMILIES as PLANNER_FAMILIES
from planner.contract.families.family import registry
from runtime.models.families import FAMILIES as RUNTIME_FAMILIES
from runtime.models.vision import VisionEncoder


CONFIGS_OF = {f.model_type: next(iter(f.configs.values())) for f in PLANNER_FAMILIES.values() if f.configs}
"""One catalog config per family that has any."""


def _without(family, hook: str):
    """``family`` with ``hook`` missing: a spec field, or one of a vision encoder's hooks (``hooks.<name>``)."""
    if hook.startswith("hooks."):
        return replace(family, encoder=VisionEncoder(replace(family.encoder.hooks, **{hook[6:]: None})))
    return replace(family, **{hook: None})


@pytest.mark.parametrize("family, hook", [
    (PLANNER_FAMILIES["qwen3_vl"], "model_spec"), (PLANNER_FAMILIES["qwen3_vl"], "video"),
    (PLANNER_FAMILIES["qwen2_audio"], "configs"), (RUNTIME_FAMILIES["qwen3_vl"], "handoff_tensors"),
    (RUNTIME_FAMILIES["qwen2_audio"], "encoder"), (RUNTIME_FAMILIES["qwen2_vl"], "model_class"),
    (RUNTIME_FAMILIES["qwen3_vl"], "hooks.forward"), (RUNTIME_FAMILIES["qwen2_5_vl"], "hooks.image_normalization"),
], ids=lambda x: x if isinstance(x, str) else type(x).__name__)
def test_a_registry_refuses_a_spec_missing_a_required_hook(family, hook):
    with pytest.raises(ValueError, match=rf"family '{family.model_type}' \(\w+\) lacks .*{hook.split('.')[-1]}"):
        registry([_without(family, hook)])


def test_a_registry_refuses_two_specs_of_one_model_type():
    with pytest.raises(ValueError, match="two families claim model_type 'qwen2_vl'"):
        registry([RUNTIME_FAMILIES["qwen2_vl"], replace(RUNTIME_FAMILIES["qwen2_5_vl"], model_type="qwen2_vl")])


@pytest.mark.parametrize("family", [*PLANNER_FAMILIES.values(), *RUNTIME_FAMILIES.values()],
                         ids=lambda f: f"{type(f).__name__}-{f.model_type}")
def test_every_registered_spec_is_complete_under_its_model_type(family):
    assert family.missing_hooks() == []
    assert family.model_type in (PLANNER_FAMILIES if hasattr(family, "model_spec") else RUNTIME_FAMILIES)


def test_both_halves_cover_the_same_model_types_with_the_same_encoder():
    """Every family with an encoder runs on the runtime as the planner prices it; decoder-only ones are planned
    only."""
    planned = {t: f.encoder for t, f in PLANNER_FAMILIES.items() if f.encoder is not None}
    assert planned == {t: f.encoder.name for t, f in RUNTIME_FAMILIES.items()}
    assert all(RUNTIME_FAMILIES[t].model_class.__name__ == CONFIGS_OF[t]["architectures"][0] for t in planned)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_family_config_is_its_family_and_builds_the_declared_inputs(name):
    config = CONFIGS[name]
    family = next(f for f in PLANNER_FAMILIES.values() if name in f.configs)
    assert config["model_type"] == family.model_type
    spec = family.model_spec(config, name)
    assert spec.modules[0].name == family.encoder
    if spec.vision_input is not None:
        assert (spec.vision_input.min_pixels, spec.vision_input.max_pixels) == family.image_pixels
        assert spec.vision_input.video == family.video


def test_the_catalog_names_every_family_config_and_nothing_else():
    assert set(CATALOG) == set(CONFIGS)
    assert all(CATALOG[name].config is config for name, config in CONFIGS.items())
