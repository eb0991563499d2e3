"""`spark-edge bench --load`: the bounded load test, against a running server or one per arm.

With `--url`, the load runs against that server (its API key from --api-key or
SPARK_EDGE_API_KEY). Without it, each arm of `--paths` is served in turn by `spark-edge serve`
on loopback (the arm's own data folder under $SPARK_EDGE_HOME/bench/arms, kept between runs so
a second run starts warm), loaded, and stopped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import click

from spark_edge.environment import API_KEY

if TYPE_CHECKING:  # the CLI imports this module at start: requests and the parser load when used
    from spark_edge.bench.load import LoadReport

DEFAULT_DURATION_S = 180


def load_options(f: Callable) -> Callable:
    for option in reversed(
        [
            click.option(
                "--load",
                is_flag=True,
                help="Run the load test instead: concurrent streaming clients for --duration seconds, "
                "zero errors expected, RSS against the plan, TTFT p50/p95 and throughput.",
            ),
            click.option("--clients", type=click.IntRange(1), default=4, show_default=True, help="--load: clients."),
            click.option(
                "--duration",
                type=click.FloatRange(1),
                default=DEFAULT_DURATION_S,
                show_default=True,
                help="--load: seconds during which clients start requests.",
            ),
            click.option(
                "--max-tokens",
                type=click.IntRange(1),
                default=64,
                show_default=True,
                help="--load: tokens generated per request.",
            ),
            click.option(
                "--prompt-words",
                type=click.IntRange(1),
                default=128,
                show_default=True,
                help="--load: random words per prompt.",
            ),
            click.option("--url", default=None, help="--load: a running server to load (default: serve each arm)."),
            click.option(
                "--api-key", default=None, envvar=API_KEY.name, help="--load with --url: the server's API key."
            ),
        ]
    ):
        f = option(f)
    return f


@contextmanager
def _served_arm(
    tag: str, checkpoint: Path, serve_args: tuple[str, ...], env: dict[str, str], home: Path, log_path: Path
) -> Iterator[str]:
    from spark_edge.bench.server_arm import spark_edge_launch
    from spark_edge.serving.server_process import ServerProcess, free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    launch = spark_edge_launch(tag, checkpoint, home, port, serve_args, env)
    # no log tail in the error: the log's path was printed when the arm started
    with ServerProcess(launch.cmd, f"{url}/health", log_path, launch.env, tail_lines=0) as server:
        server.wait_ready(900)
        yield url


def run_load_bench(
    model: Path | None,
    paths: str,
    out: Path,
    clients: int,
    duration: float,
    max_tokens: int,
    prompt_words: int,
    url: str | None,
    api_key: str | None,
    log: Callable[[str], None],
) -> dict[str, LoadReport]:
    """Run the load per arm (or once against --url); print the table, write JSON; exit 1 on any error."""
    from spark_edge.bench.load import format_load_table, run_load

    def load(target: str, key: str | None) -> LoadReport:
        return run_load(target, clients, duration, max_tokens, prompt_words, key, log=log)

    if url:
        reports = {url: load(url.rstrip("/"), api_key)}
    else:
        reports = _load_each_arm(model, paths, load, log)
    summary = {tag: r.as_dict() for tag, r in reports.items()}
    out.write_text(json.dumps({"load": summary}, indent=2) + "\n")
    click.echo(format_load_table(reports))
    click.echo(f"JSON: {out}")
    if any(r.errors or not r.requests for r in reports.values()):
        raise click.exceptions.Exit(1)
    return reports


def _load_each_arm(
    model: Path | None, paths: str, load: Callable[[str, str | None], LoadReport], log: Callable[[str], None]
) -> dict[str, LoadReport]:
    from spark_edge.bench.command import arm_checkpoint, parse_arm, run_log_dir
    from spark_edge.paths import spark_edge_home

    home = spark_edge_home() / "bench"
    log_dir = run_log_dir(home)
    reports = {}
    for tag in dict.fromkeys(p.strip() for p in paths.split(",") if p.strip()):
        path, serve_args, env = parse_arm(tag)
        checkpoint = arm_checkpoint(model, path, log)
        log(f"load: serving {tag} (log: {log_dir / f'{tag}-load.log'})")
        with _served_arm(tag, checkpoint, serve_args, env, home, log_dir / f"{tag}-load.log") as url:
            reports[tag] = load(url, None)
    return reports
