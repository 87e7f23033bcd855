"""Configuration fields under their former names (and values under their former spellings): accepted for one release,
with a message naming the new name.

``RENAMED`` maps a former dotted name to its name in config/base.py, ``RENAMED_VALUES`` a field's former value to its
value now. A command line (``--config.OLD=value``), a sweep
file's parameters and a saved run's config.json (scripts/evaluate.py) are translated with it; a checkpoint's recorded
state fields too (run/persistence/resume_check.py). Remove an entry one release after its rename.
"""

from __future__ import annotations

import re
import sys

RENAMED = {
    "train.epsilon": "train.clip_range",
    "train.beta": "kl.beta",
    "train.use_reference_model": "kl.use_reference_model",
    "train.reference_model_mixup_alpha": "kl.reference_mixup_alpha",
    "train.reference_update_freq": "kl.reference_update_freq",
    "algorithm.kl_type": "kl.kind",
    "algorithm.kl_in_reward": "kl.in_reward",
    "algorithm.kl_controller": "kl.controller",
    "algorithm.target_kl": "kl.target",
    "algorithm.kl_horizon": "kl.horizon",
    "critic.cliprange_value": "critic.value_clip_range",
    "group_params.group_variance_threshold": "group_ppo.variance_threshold",
    "group_params.group_max_size": "group_ppo.max_segment_steps",
    "group_params.group_epsilon": "group_ppo.numerical_floor",
    "group_params.lam": "group_ppo.gae_lambda",
    "compile_unet": "compile_denoiser",
    "sample.eta": "sample.noise_level",
    "train.timestep_fraction": "train.step_fraction",
    "train.kl_threshold": "train.policy_kl_threshold",  # kl.* is the reference's KL; this bounds the policy's own
    "critic.clip_range": "critic.value_clip_range",  # train.clip_range bounds a ratio; this one values, in reward units
}
# a former field that replaces its new name's value in a saved config: a run saved before sample.eta and
# sample.noise_level became one field recorded both, DDIM's eta (what the pipeline's sampler reads, the evaluation
# of a Stable Diffusion run) and the flow step's level (unread there: the flow pipelines sample deterministically)
REPLACES_SAVED = {"sample.eta"}
RENAMED_SECTIONS = {"group_params": "group_ppo"}  # every other field of the section keeps its name
RENAMED_VALUES = {"critic.input": {"latent_x0": "latent_clean_hat"}}  # a field's former value -> its value now


def new_name(dotted: str) -> str | None:
    """The current name of a former field name, or None if ``dotted`` was not renamed."""
    if dotted in RENAMED:
        return RENAMED[dotted]
    section, _, rest = dotted.partition(".")
    if rest and section in RENAMED_SECTIONS:
        return f"{RENAMED_SECTIONS[section]}.{rest}"
    return None


def notice(old: str, new: str) -> str:
    return f"config field {old} is now {new}; the old name is accepted for one release (use {new})"


def value_notice(field: str, old, new) -> str:
    return f"{field}={old!r} is now {field}={new!r}; the old value is accepted for one release (use {new!r})"


_OVERRIDE = re.compile(r"^(--?config\.)([\w.]+)(=.*)?$")


def translate_argv(argv: list[str], say=lambda line: print(line, file=sys.stderr)) -> list[str]:
    """``argv`` with every ``--config.OLD[=value]`` override renamed to its current field, saying so once each."""
    out = []
    for arg in argv:
        match = _OVERRIDE.match(arg)
        new = new_name(match.group(2)) if match else None
        if new is not None:
            say(notice(match.group(2), new))
            arg = f"{match.group(1)}{new}{match.group(3) or ''}"
        field = new or (match.group(2) if match else None)
        value = (match.group(3) or "")[1:] if match else ""
        if value in RENAMED_VALUES.get(field, {}):
            say(value_notice(field, value, RENAMED_VALUES[field][value]))
            arg = f"{match.group(1)}{field}={RENAMED_VALUES[field][value]}"
        out.append(arg)
    return out


def translate_saved(config: dict) -> dict:
    """A saved config (nested dicts, e.g. a run's config.json) with former fields moved to their current names."""
    out = {section: dict(value) if isinstance(value, dict) else value for section, value in config.items()}
    for old_section, new_section in RENAMED_SECTIONS.items():
        if isinstance(out.get(old_section), dict):
            out.setdefault(new_section, {}).update(out.pop(old_section))
    for old, new in RENAMED.items():
        old_section, _, old_field = old.rpartition(".")
        old_section = RENAMED_SECTIONS.get(old_section, old_section)
        holder = out.get(old_section) if old_section else out
        if not isinstance(holder, dict) or old_field not in holder:
            continue
        value = holder.pop(old_field)
        new_section, _, new_field = new.rpartition(".")
        holder = out.setdefault(new_section, {}) if new_section else out
        if old in REPLACES_SAVED:
            holder[new_field] = value
        else:
            holder.setdefault(new_field, value)
    for field, values in RENAMED_VALUES.items():
        section, _, name = field.rpartition(".")
        holder = out.get(section) if section else out
        if isinstance(holder, dict) and isinstance(holder.get(name), str) and holder[name] in values:
            holder[name] = values[holder[name]]
    return out
