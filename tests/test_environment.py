"""Every SPARK_EDGE_* variable is declared once, in spark_edge/environment.py, and read through it."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest
from click.testing import CliRunner

from spark_edge import environment
from spark_edge.cli import main
from spark_edge.settings import SETTINGS

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "spark_edge"
NAME = re.compile(r"SPARK_EDGE_[A-Z0-9_]+")
DECLARED = {v.name for v in environment.VARIABLES}


def _name_literals(path: Path) -> list[str]:
    """String literals in `path` that are a variable's name and nothing else (docstrings and messages may
    mention a name; code must take it from its declaration)."""
    found = []
    for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if token.type == tokenize.STRING and NAME.fullmatch(token.string.strip("'\"rbf")):
            found.append(f"{path.relative_to(REPO)}:{token.start[0]}: {token.string}")
    return found


def test_no_module_but_the_declarations_spells_a_variable_name() -> None:
    spelled = [
        hit for path in sorted(SRC.rglob("*.py")) if path.name != "environment.py" for hit in _name_literals(path)
    ]
    assert not spelled, "read these through spark_edge.environment:\n" + "\n".join(spelled)


def test_every_variable_the_repository_mentions_is_declared_or_retired() -> None:
    """The product, its images, deploy files, scripts and README: a typo or an undeclared variable fails here.
    (C++ macros named SPARK_EDGE_* are not variables; tests' own fault-injection switches are the tests'.)"""
    files = [*SRC.rglob("*.py"), *(REPO / "docker").rglob("*"), *(REPO / "deploy").rglob("*")]
    files += [*(REPO / "scripts").rglob("*"), *REPO.glob("Dockerfile.*"), REPO / "README.md", REPO / "Makefile"]
    unknown = set()
    for path in files:
        if path.is_file() and path.suffix not in (".cpp", ".h", ".png"):
            unknown |= set(NAME.findall(path.read_text(errors="replace"))) - DECLARED - set(environment.RETIRED)
    assert not unknown, f"declare these in spark_edge/environment.py: {sorted(unknown)}"


def test_each_serve_option_reads_the_variable_declared_for_it() -> None:
    options = {name: decorator(lambda: None).__click_params__[0] for name, decorator in SETTINGS.items()}
    declared = {v.name for v in environment.VARIABLES if v.audience == environment.SETTING}
    assert {option.envvar for option in options.values()} == declared
    for name, option in options.items():
        assert option.envvar == f"SPARK_EDGE_{name.upper()}"


def test_disabled_kernels_are_named_and_a_bad_name_is_refused() -> None:
    env = {environment.DISABLED_KERNELS.name: " int4_gemm_q8, int4_gemm_amx "}
    assert environment.disabled_kernels(env) == {"int4_gemm_q8", "int4_gemm_amx"}
    assert environment.disabled_kernels({}) == frozenset()
    with pytest.raises(ValueError, match="no kernel named int4_turbo"):
        environment.disabled_kernels({environment.DISABLED_KERNELS.name: "int4_gemm,int4_turbo"})


def test_every_kernel_name_is_an_op_of_the_native_library_or_a_switch_read_where_it_applies() -> None:
    sources = "".join(p.read_text() for p in (SRC / "kernels" / "native").glob("*.cpp"))
    switches = {
        "kleidiai": SRC / "kernels" / "native_switch.py",
        "attention_step": SRC / "runtime" / "fixes.py",
        "int8_packed_gemm": SRC / "vllm_methods" / "cpu_int8_table.py",
    }
    for kernel in environment.KERNELS[1:]:  # [0] names the library itself
        if kernel not in switches:
            assert re.search(rf"\b{kernel}\(", sources), kernel
    assert environment.KERNELS[0] == "spark_edge_int4"
    for kernel, reader in switches.items():
        assert f'kernel_enabled("{kernel}")' in reader.read_text(), kernel


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"SPARK_EDGE_NATIVE_GEMM": "0"},
            "SPARK_EDGE_NATIVE_GEMM was retired: use SPARK_EDGE_DISABLED_KERNELS=int4_gemm",
        ),
        ({"SPARK_EDGE_DISABLED_KERNELS": "tiles"}, "SPARK_EDGE_DISABLED_KERNELS: no kernel named tiles"),
    ],
)
def test_a_retired_variable_or_a_bad_kernel_name_is_a_usage_error_before_any_command(
    env: dict[str, str], message: str
) -> None:
    result = CliRunner().invoke(main, ["probe"], env=env)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
