"""Every serve setting is declared once in cli.py (flag, environment variable, default, help); --help shows the
variables, the README's table is generated from the declarations, and a bad value from a variable is a usage
error naming it."""

from __future__ import annotations

from click.testing import CliRunner
from readme_tables import README, readme_as_generated
from readme_tables import main as readme_tables

from spark_edge import exit_codes
from spark_edge.cli import main, serve


def test_the_readme_table_is_what_cli_declares() -> None:
    assert readme_as_generated(README.read_text()) == README.read_text(), (
        "README.md's serve settings or exit code table is stale: run python scripts/readme_tables.py"
    )
    assert readme_tables(["--check"]) == 0


def test_every_serve_option_has_its_variable_shown_in_help() -> None:
    help_text = CliRunner().invoke(main, ["serve", "--help"], terminal_width=200).output
    options = [p for p in serve.params if p.param_type_name == "option" and p.name != "help"]
    assert {p.name for p in options} >= {"model", "weight_path", "port", "max_request_bytes"}
    for option in options:
        assert option.envvar == "SPARK_EDGE_" + option.name.upper(), option.name
        assert option.envvar in help_text, option.envvar


def test_a_bad_value_in_a_variable_is_a_usage_error_naming_it() -> None:
    for variable, value in (
        ("SPARK_EDGE_PORT", "abc"),
        ("SPARK_EDGE_WEIGHT_PATH", "w9"),
        ("SPARK_EDGE_MAX_REQUEST_BYTES", "12"),
    ):
        result = CliRunner().invoke(main, ["serve"], env={variable: value})
        assert result.exit_code == exit_codes.USAGE, (variable, result.output)
        assert f"env var: '{variable}'" in result.output, result.output
