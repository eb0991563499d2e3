"""One error hierarchy, one exit code per kind, mapped in one place: the command group."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from spark_edge import errors, exit_codes
from spark_edge.cli import main
from spark_edge.planning.memory_plan import PlanRefused

KINDS = [
    cls
    for cls in vars(errors).values()
    if isinstance(cls, type) and issubclass(cls, errors.SparkEdgeError) and cls is not errors.SparkEdgeError
] + [PlanRefused]  # beside the plan it carries


def test_every_kind_has_a_documented_code_of_its_own_meaning() -> None:
    assert len(KINDS) >= 6
    for kind in KINDS:
        assert kind.exit_code in exit_codes.MEANINGS and kind.exit_code not in (exit_codes.OK, exit_codes.FAILURE)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_the_command_group_prints_one_line_and_exits_with_the_kinds_code(kind: type) -> None:
    @main.command("raise-for-test")
    def raise_for_test() -> None:
        raise (kind("why it stopped", None) if kind is PlanRefused else kind("why it stopped"))

    try:
        result = CliRunner().invoke(main, ["raise-for-test"])
    finally:
        main.commands.pop("raise-for-test")
    assert result.exit_code == kind.exit_code
    assert result.output == "spark-edge: error: why it stopped\n"
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_an_unexpected_error_is_not_swallowed() -> None:
    @main.command("raise-for-test")
    def raise_for_test() -> None:
        raise RuntimeError("a bug")

    try:
        result = CliRunner().invoke(main, ["raise-for-test"])
    finally:
        main.commands.pop("raise-for-test")
    # a bug keeps its traceback (exit 1): only the errors a user can act on are one line
    assert result.exit_code == exit_codes.FAILURE and isinstance(result.exception, RuntimeError)
