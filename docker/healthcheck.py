"""The images' HEALTHCHECK: exit 0 when the server's /health answers 200 (the model is loaded)."""

from __future__ import annotations

import os
import sys
import urllib.request


def healthy(port: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=4) as response:
            return response.status == 200
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(0 if healthy(os.environ.get("SPARK_EDGE_PORT", "8000")) else 1)
