"""`[parallel]` (docs/parallel.md): defaults, and plain messages for wrong values."""

from __future__ import annotations

import pytest

from helios.config import ConfigError, load_config


def test_defaults_are_one_engine_without_events() -> None:
    par = load_config(overrides={}).parallel
    assert (par.data_parallel_size, par.data_parallel_mode, par.routing, par.kv_events, par.restart_ranks) == \
        (1, "internal", "cache_aware", False, True)


def test_values_are_read() -> None:
    par = load_config(overrides={"parallel": {"data_parallel_size": 3, "routing": "round_robin", "kv_events": True,
                                              "load_weight_tokens": 0}}).parallel
    assert (par.data_parallel_size, par.routing, par.kv_events, par.load_weight_tokens) == (3, "round_robin", True, 0)
    ext = load_config(overrides={"parallel": {"data_parallel_mode": "external", "data_parallel_size": 2,
                                              "data_parallel_rank": 1}}).parallel
    assert (ext.data_parallel_mode, ext.data_parallel_rank) == ("external", 1)


@pytest.mark.parametrize(("values", "words"), [
    ({"data_parallel_size": 0}, "data_parallel_size must be a positive integer"),
    ({"data_parallel_size": True}, "data_parallel_size must be a positive integer"),
    ({"data_parallel_mode": "hybrid"}, "data_parallel_mode must be one of internal, external"),
    ({"routing": "random"}, "routing must be one of cache_aware, round_robin"),
    ({"kv_events": "yes"}, "kv_events must be true or false"),
    ({"data_parallel_mode": "external", "data_parallel_size": 2, "data_parallel_rank": 2}, "is not below"),
    ({"data_parallel_rank": 1}, "is for data_parallel_mode = \"external\""),
    ({"unknown": 1}, "invalid configuration"),
    ({"tensor_parallel_size": 2, "data_parallel_size": 2}, "cannot both be above 1"),
])
def test_wrong_values_are_refused_in_words(values: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(overrides={"parallel": values})
    assert words in str(err.value)
