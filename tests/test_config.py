"""The --kda-* flag registry: argparse, environment and docs all come from KDAConfig's fields."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

import pytest

from sglang_kda import config
from sglang_kda.config import ConfigError, KDAConfig

REPO = Path(__file__).resolve().parents[1]


def test_every_field_is_a_registered_flag():
    flags = config.registry()
    assert [f.name for f in flags] == [f.name for f in fields(KDAConfig)]
    for f in flags:
        assert f.option == "--kda-" + f.name.replace("_", "-")
        assert f.env == "SGLANG_KDA_" + f.name.upper()
        assert f.help and f.values
        # the declared default passes its own parser unchanged
        assert getattr(KDAConfig(), f.name) == f.default


def test_argparse_is_generated_from_the_registry():
    parser = argparse.ArgumentParser()
    config.add_kda_args(parser)
    assert {a.option_strings[0] for a in parser._actions if a.dest != "help"} == set(
        config.options()
    )
    # absent flags stay absent; given ones are validated by KDAConfig
    assert config.config_from_args(parser.parse_args([])) == KDAConfig()
    ns = parser.parse_args(["--kda-pace-every", "4", "--kda-itl-target-ms=25"])
    assert config.config_from_args(ns) == KDAConfig(pace_every=4, itl_target_ms=25.0)
    with pytest.raises(ConfigError, match="--kda-pace-every"):
        config.config_from_args(parser.parse_args(["--kda-pace-every", "-1"]))


@pytest.mark.parametrize(
    "name,bad",
    [
        pytest.param("policy", "fast", id="policy"),
        pytest.param("kernel", "cuda", id="kernel"),
        pytest.param("max_n", "0", id="max-n"),
        pytest.param("checkpoint_every", "100", id="checkpoint-every-off-grid"),
        pytest.param("checkpoint_pool_size", "-1", id="pool-size"),
        pytest.param("eviction", "lfu", id="eviction"),
        pytest.param("twins", "yes", id="twins"),
        pytest.param("debug_integrity", "1", id="debug-integrity"),
        pytest.param("budget", "fast", id="budget"),
        pytest.param("itl_target_ms", "-1", id="itl-target"),
        pytest.param("pace_every", "x", id="pace-every"),
        pytest.param("prefill_max_slowdown", "0.5", id="max-slowdown-below-one"),
        pytest.param("prefill_max_slowdown", "nan", id="max-slowdown-nan"),
        pytest.param("ttft_deadline_ms", "0", id="ttft-deadline-zero"),
        pytest.param("deadline_ms_per_1k_tokens", "inf", id="deadline-per-1k"),
        pytest.param("reject_infeasible", "true", id="reject-infeasible"),
    ],
)
def test_bad_values_name_their_flag_from_env_too(name, bad):
    option = config.option_of(name)
    with pytest.raises(ConfigError, match=option):
        KDAConfig(**{name: bad})
    with pytest.raises(ConfigError, match=option):
        KDAConfig.from_env({config.env_of(name): bad})


def test_env_round_trip_keeps_types():
    cfg = KDAConfig(
        budget="serial",
        itl_target_ms="12.5",
        pace_every="3",
        checkpoint_every="128",
        eviction=" 0.5 ",
        cost_model="/tmp/x.json",
    )
    env = cfg.to_env()
    assert set(env) == {f.env for f in config.registry()}
    back = KDAConfig.from_env(env)
    assert back == cfg
    assert back.itl_target_ms == 12.5 and back.pace_every == 3 and back.eviction == "0.5"
    # variables of other sglang_kda settings are not flags and are ignored
    assert KDAConfig.from_env({"SGLANG_KDA_MODEL_DIR": "/x"}) == KDAConfig()


def test_budget_serial_needs_the_kda_policy():
    with pytest.raises(ConfigError, match="--kda-budget serial needs --kda-policy kda"):
        KDAConfig(budget="serial", policy="stock")


def test_unknown_kda_flag_lists_the_known_ones():
    from sglang_kda.launch_server import split_kda_args

    with pytest.raises(ConfigError, match="unknown flag --kda-nope") as e:
        split_kda_args(["--kda-nope", "1"])
    for option in config.options():
        assert option in str(e.value)


def test_docs_flags_table_matches_the_registry():
    """docs/flags.md carries the generated table; regenerate it with
    ``python -m sglang_kda.config --write-docs`` after changing a flag."""
    doc = (REPO / "docs" / "flags.md").read_text()
    assert config.TABLE_BEGIN in doc and config.TABLE_END in doc
    assert config.docs_with_table(doc) == doc, (
        "docs/flags.md is out of date: run `python -m sglang_kda.config --write-docs`"
    )
    for option in config.options():
        assert f"`{option}`" in doc


def test_markdown_command_prints_the_table(capsys):
    assert config.main(["--markdown"]) == 0
    assert capsys.readouterr().out == config.markdown_table()
