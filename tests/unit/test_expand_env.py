"""Strict ``$VAR`` expansion of configuration values (no store)."""

import pytest

from mooncake_diffusion.errors import ConfigError
from mooncake_diffusion.platform.settings import expand_env

pytestmark = pytest.mark.unit

ENV = {"HOST": "10.0.0.7", "PORT": "50051", "EMPTY": ""}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("$HOST:$PORT", "10.0.0.7:50051"),
        ("${HOST}:${PORT}", "10.0.0.7:50051"),
        ("x${EMPTY}y", "xy"),  # set but empty is set
        ("no variables", "no variables"),
        ("a $ alone, 5$", "a $ alone, 5$"),
    ],
)
def test_set_variables_are_expanded(value, expected):
    assert expand_env(value, "extra['master']", ENV) == expected


@pytest.mark.parametrize("value", ["$RV_UNSET_HOST:50051", "${RV_UNSET_HOST}", "$HOST$NOPE"])
def test_an_unset_variable_is_a_config_error_naming_it(value):
    with pytest.raises(ConfigError, match=r"extra\['master'\]: environment variable \w+ is not"):
        expand_env(value, "extra['master']", ENV)


def test_a_malformed_reference_is_a_config_error():
    with pytest.raises(ConfigError, match="not a valid variable reference"):
        expand_env("${1BAD}", "extra['host']", ENV)
