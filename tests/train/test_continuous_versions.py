"""grpo_train.continuous across transformers releases: the ContinuousBatchingConfig's page field
is `block_size` in 5.17 and `page_size` in 5.24 (`block_size` kept there as a deprecated alias);
the config is built from the fields the installed class has. Fake dataclasses stand for the
releases not installed; the installed class is built for real."""

from __future__ import annotations

import dataclasses

import pytest

from grpo_train import continuous


def fake(name: str, *fields: str):
    """A config dataclass with `fields` (each defaulting to None)."""
    return dataclasses.make_dataclass(name, [(f, object, None) for f in fields])


NEEDED = continuous.NEEDED_FIELDS
Config517 = fake("Config517", "block_size", *NEEDED)  # no page_size, no nccl setting
Config524 = fake("Config524", "page_size", *NEEDED, "disable_nccl_graph_mixing", "block_size")


def test_the_page_field_is_the_one_the_class_has():
    values = dict(num_blocks=7, seed=3, disable_nccl_graph_mixing=False)
    kw = continuous.config_kwargs(Config517, 32, **values)
    assert kw == {"block_size": 32, "num_blocks": 7, "seed": 3}  # the missing field left out
    Config517(**kw)
    kw = continuous.config_kwargs(Config524, 32, **values)
    assert kw == {"page_size": 32, **values}
    assert Config524(**kw).block_size is None  # not the deprecated alias


@pytest.mark.parametrize("fields, missing", [
    (NEEDED, "page_size or block_size"),
    (("page_size", *NEEDED[1:]), NEEDED[0]),
    (("block_size", *NEEDED[:-1]), NEEDED[-1])])
def test_a_missing_field_is_named(fields, missing):
    with pytest.raises(TypeError, match=f"Partial has no {missing}: the cache could not"):
        continuous.config_kwargs(fake("Partial", *fields), 32)


def test_cache_config_builds_on_the_installed_transformers():
    """The call the trainer makes: no TypeError, and pages of PAGE_SIZE tokens, enough for every
    sequence at full length (2 prompts of 5 and 40 tokens, G = 3, 30 new tokens)."""
    import transformers

    cfg = continuous.cache_config([5, 40], 3, 30, seed=11)
    assert isinstance(cfg, transformers.ContinuousBatchingConfig)
    fields = {f.name for f in dataclasses.fields(cfg)}
    page = cfg.page_size if "page_size" in fields else cfg.block_size
    assert page == continuous.PAGE_SIZE, transformers.__version__
    assert cfg.num_blocks == 3 * 2 + 1 + 3 * 3 + 1  # ceil(35 / 32) = 2, ceil(70 / 32) = 3
    assert (cfg.seed, cfg.max_requests_per_batch, cfg.allow_block_sharing) == (11, 6, False)


def test_a_config_without_pages_is_a_reason_not_a_failure(monkeypatch):
    """A release whose config lacks a field this path needs is refused before generation, with
    the version in the reason (the trainer logs it and runs padded)."""
    import torch
    import transformers

    monkeypatch.setattr(transformers, "ContinuousBatchingConfig", fake("NoPages", *NEEDED))
    reason = continuous.unsupported_reason(torch.nn.Linear(2, 2), None, {})
    assert reason.startswith(f"transformers {transformers.__version__}: NoPages has no "
                             "page_size or block_size: "), reason
