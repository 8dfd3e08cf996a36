"""Runs the patched llama-server on loopback: upstream's own decoding and speculation, side by side
with EAGLE-2 in the benchmark."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from ._native import EagleError, library_dir, use_extra_bufts


def repack_args() -> list[str]:
    """The same weight-repacking choice as the Python side (_native.use_extra_bufts)."""
    return [] if use_extra_bufts() else ["--no-repack"]


def _die_with_parent() -> None:
    """Runs in the child before exec (Linux): it gets SIGTERM when the thread that started it ends,
    even by SIGKILL (an out-of-memory kill), instead of living on with its model's memory."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """`llama-server -m target [extra args]`; complete() sends one /completion request."""

    def __init__(self, target: Path, extra_args: list[str], *, n_ctx: int = 2048, n_threads: int = 2,
                 n_parallel: int = 1, log_path: Path | None = None, timeout_s: float = 120.0,
                 bin_dir: Path | None = None):
        """bin_dir: another build's bin folder (default: the library eagle_llamacpp loads); its server
        then loads that folder's libraries, whatever build its RUNPATH names. On Linux the server ends
        with the thread that starts it, so start it from one that outlives it."""
        binary = Path(bin_dir or library_dir()) / "llama-server"
        if not binary.exists():
            raise EagleError(f"{binary} not found: build it first (make setup)")
        env = None
        if bin_dir is not None:
            env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(
                filter(None, [str(Path(bin_dir).resolve()), os.environ.get("LD_LIBRARY_PATH")])))
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [str(binary), "-m", str(target), "--host", "127.0.0.1", "--port", str(self.port),
               "-c", str(n_ctx), "-t", str(n_threads), "-tb", str(n_threads), "-np", str(n_parallel),
               "--no-warmup", *repack_args(), *extra_args]
        self.log = open(log_path, "w") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        self._wait_healthy(timeout_s, cmd)

    def _wait_healthy(self, timeout_s: float, cmd: list[str]) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EagleError(f"llama-server exited with {self.proc.returncode}: {' '.join(cmd)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        self.close()
        raise EagleError(f"llama-server did not become healthy in {timeout_s:.0f} s: {' '.join(cmd)}")

    def complete(self, tokens: list[int], n_predict: int) -> dict:
        """Greedy completion of prompt token ids; the response carries tokens and timings."""
        body = {"prompt": [int(t) for t in tokens], "n_predict": n_predict, "temperature": 0.0,
                "cache_prompt": False, "return_tokens": True, "stream": False}
        req = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=3600) as r:
            return json.loads(r.read())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log is not subprocess.DEVNULL:
            self.log.close()
