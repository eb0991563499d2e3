"""Session fixtures: the default model built once, and one real vLLM server for every engine test."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from spark_edge.checkpoints.default_model import DEFAULT_MODEL_ID
from spark_edge.errors import UnsupportedHostError
from spark_edge.probe.device import probe_device
from spark_edge.probe.weight_path_choice import select_weight_path
from spark_edge.serving.server_process import ServerProcess, free_port
from spark_edge.weight_paths.builder import build_checkpoint

SERVER_START_TIMEOUT_S = 900  # a cold start compiles the model: ~100 s here, more on a busy machine
SESSION_API_KEY = "sk-spark-edge-test-6f1d2c"  # the session's servers require it on /v1/*

# Knowledge is asserted through log-probs with a margin, never through free-form text: a 135M model's
# greedy continuation tips over on the rounding of the host's bf16 GEMMs (AMX tiles, AVX512-BF16 and
# AVX-512 without BF16 all round differently), while " Paris" stays the likely next token on all of them.
PARIS_PROMPT = "The capital of France is"
PARIS_TOP_K = 5  # " Paris" must be among the first this many next tokens ...
PARIS_MIN_LOGPROB = -2.5  # ... with at least this log-prob (p >= 0.08)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Image tests first: their time-to-ready ratios are measured before this session's own servers
    (started lazily, kept to the end) are alive beside them."""
    items.sort(key=lambda item: item.get_closest_marker("images") is None)  # stable: order kept within


# variables that change which kernels torch, oneDNN and vLLM take in every later child process
KERNEL_CHOICE_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "SPARK_EDGE_FORCED_ISA")


@pytest.fixture(autouse=True)
def no_kernel_choice_leaks() -> Iterator[None]:
    """A test that leaves a forced ISA in this process's environment would hand it to every server
    started after it (an AMX host's w4a8 engine then fails in oneDNN): fail that test, not the later ones."""
    before = {name: os.environ.get(name) for name in KERNEL_CHOICE_VARIABLES}
    yield
    after = {name: os.environ.get(name) for name in KERNEL_CHOICE_VARIABLES}
    assert after == before, f"the test changed this process's kernel choice: {before} -> {after}"


@pytest.fixture(scope="session")
def spark_edge_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("spark-edge-home")


@pytest.fixture(scope="session")
def bf16_checkpoint(spark_edge_home: Path) -> Path:
    """The default model dequantized to bf16, where `spark-edge serve` looks for it (read-only: copy to alter)."""
    return build_checkpoint(None, "bf16", spark_edge_home / "checkpoints" / f"{DEFAULT_MODEL_ID}-bf16").out


@pytest.fixture
def checkpoint_copy(bf16_checkpoint: Path, tmp_path: Path) -> Path:
    """A copy of the session's bf16 build, free to damage."""
    copy = tmp_path / "copy"
    shutil.copytree(bf16_checkpoint, copy)
    return copy


@pytest.fixture
def offline_w4a16_figures() -> dict:
    """An offline engine arm's figures as `spark_edge.bench.offline` prints them (for the report tests)."""
    return {
        "tg128_tps": 33.0,
        "pp512_tps": 280.0,
        "batched_seqs": 4,
        "batched_tg128_tps": 96.0,
        "profile_top_ops": [{"op": "spark_edge::int4_linear", "self_ms_per_step": 11.5, "calls_per_step": 124.8}],
    }


def flip_middle_byte(path: Path) -> None:
    """One bit of the file's middle byte inverted, size unchanged: only a digest can tell."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


def single_process_tp_group() -> Iterator[None]:
    """A fixture body: a single-process tensor-parallel group, what vLLM's layers ask for at
    construction; torn down afterwards unless something else had already set one up."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    with set_current_vllm_config(VllmConfig()):
        owned = not ps.model_parallel_is_initialized()
        if owned:
            ps.init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                backend="gloo",
                distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
            )
            ps.initialize_model_parallel(1, 1)
        yield
        if owned:
            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()


class Server(ServerProcess):
    """`spark-edge serve ARGS` on a free port, launched at once; wait_ready() and stop() are ServerProcess's
    (errors carry the log's tail, stop() returns the exit code), with the test clients' helpers on top."""

    def __init__(
        self,
        args: list[str],
        home: Path,
        log_path: Path,
        env: dict[str, str] | None = None,
        api_key: str | None = None,
        wrap: list[str] | None = None,
        tls_ca: Path | None = None,
    ):
        """`wrap`: an argv prefix that execs the server (e.g. `sh -c 'echo $$ > cgroup.procs; exec "$@"' sh`);
        `tls_ca`: the server speaks HTTPS (its vLLM options say so), verified against this certificate."""
        self.home = home
        self.api_key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.port = free_port()
        self.url = f"{'https' if tls_ca else 'http'}://127.0.0.1:{self.port}"
        full_env = {**os.environ, "SPARK_EDGE_HOME": str(home), **(env or {})}
        if api_key:
            full_env["SPARK_EDGE_API_KEY"] = api_key
        cmd = [*(wrap or []), sys.executable, "-m", "spark_edge.cli", "serve", "--port", str(self.port), *args]
        super().__init__(
            cmd,
            f"{self.url}/health",
            log_path,
            full_env,
            append=False,
            poll_s=1,
            verify=str(tls_ca) if tls_ca else True,
        )
        self.start()

    def get(self, path: str, **kw) -> requests.Response:
        return requests.get(
            f"{self.url}{path}", headers=self.headers, timeout=kw.pop("timeout", 30), verify=self.verify, **kw
        )

    def post(self, path: str, body: dict, **kw) -> requests.Response:
        return requests.post(
            f"{self.url}{path}",
            json=body,
            headers=self.headers,
            timeout=kw.pop("timeout", 300),
            verify=self.verify,
            **kw,
        )

    def next_token_logprobs(self, prompt: str | list[str], model: str, k: int = PARIS_TOP_K) -> list[dict[str, float]]:
        """The top-k next tokens (decoded text -> log-prob) after each prompt, one generated token."""
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": k}
        reply = self.post("/v1/completions", body)
        assert reply.status_code == 200, reply.text
        choices = sorted(reply.json()["choices"], key=lambda c: c["index"])
        return [c["logprobs"]["top_logprobs"][0] for c in choices]

    def assert_knows_paris(self, model: str, prompts: int = 1) -> None:
        """ " Paris" after PARIS_PROMPT, with the margin above; `prompts` copies in one request (a batch)."""
        batch = [PARIS_PROMPT] * prompts if prompts > 1 else PARIS_PROMPT
        for top in self.next_token_logprobs(batch, model):
            assert " Paris" in top and top[" Paris"] >= PARIS_MIN_LOGPROB, f"next tokens: {top}"

    def wait_ready(self, timeout_s: float = SERVER_START_TIMEOUT_S) -> float:
        return super().wait_ready(timeout_s)


def running_server(
    name: str,
    args: list[str],
    home: Path,
    tmp_path_factory: pytest.TempPathFactory,
    env: dict[str, str] | None = None,
    tls_ca: Path | None = None,
) -> Iterator[Server]:
    """A fixture body: `spark-edge serve ARGS` with the session's API key, ready, stopped afterwards."""
    log = tmp_path_factory.mktemp("logs") / f"{name}.log"
    server = Server(args, home, log, env=env, api_key=SESSION_API_KEY, tls_ca=tls_ca)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def bf16_server(
    bf16_checkpoint: Path, spark_edge_home: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """`spark-edge serve` as the README runs it (the default model, bf16), shared by the whole session.

    The checkpoint fixture has already built the model where serve looks, so serve's own
    up-to-date check (sha256 against the manifest) is exercised, not a rebuild.
    """
    yield from running_server("bf16_server", ["--weight-path", "bf16"], spark_edge_home, tmp_path_factory)


@pytest.fixture(scope="session")
def w4a16_server(
    spark_edge_home: Path, bf16_server: Server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """`spark-edge serve --weight-path w4a16`: builds the default model's w4a16 checkpoint on first use.

    It depends on bf16_server only to be started after it, never beside a cold compile of it.
    """
    yield from running_server("w4a16_server", ["--weight-path", "w4a16"], spark_edge_home, tmp_path_factory)


@pytest.fixture(scope="session")
def vllm_gptq_kernel() -> None:
    """vLLM's GPTQ CPU kernel (cpu_gemm_wna16) as vLLM loads its ops here: its AVX2 build (_C_AVX2) has none."""
    from spark_edge.bench.kernels import vllm_wna16_available

    if not vllm_wna16_available():
        pytest.skip("vLLM's CPU ops on this CPU (_C_AVX2: no AVX-512) have no GPTQ kernel (cpu_gemm_wna16)")


@pytest.fixture(scope="session")
def w4a8_runs_here() -> None:
    """Before any server starts: where serve refuses w4a8 (exit 4; without AVX-512, vLLM's _C_AVX2 has no GPTQ
    kernel: tests/test_probe.py), its reason skips the w4a8 server's tests."""
    try:
        select_weight_path(probe_device(Path("/")), explicit="w4a8")
    except UnsupportedHostError as refused:
        pytest.skip(f"serve refuses w4a8 here: {refused}")


@pytest.fixture(scope="session")
def w4a8_server(
    w4a8_runs_here: None, spark_edge_home: Path, bf16_server: Server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """`spark-edge serve --weight-path w4a8`: vLLM's GPTQ path (the AMX W4A8 kernel where AMX is usable,
    its W4A16 vector kernel elsewhere with AVX-512)."""
    yield from running_server("w4a8_server", ["--weight-path", "w4a8"], spark_edge_home, tmp_path_factory)
