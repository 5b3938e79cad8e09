"""llama.cpp as reference rows in `specdec bench --llama-cpp DIR`: the peer to beat on CPUs.

    python -m specdec_tools.bench.llama_cpp build DIR [--isa native|avx2|avxvnni]    # once: pinned sdist -> DIR/bin/llama-*

The tools are built from the llama.cpp source vendored in the llama-cpp-python
sdist on PyPI (pinned by hash; nothing is installed or committed). GCC 12's
AMX header drops the tile-config setup, so a native build crashes with SIGILL
on any batch above one token: AMX is switched off (see ../shared/MODELS.md).
--isa avx2 builds for AVX2 alone (no AVX-512, AVX-VNNI or AMX), the peer of our
AVX2 kernel path (SPECDEC_ISA=avx2) when both run on an AVX-512 machine;
--isa avxvnni the same with AVX-VNNI on, the peer of SPECDEC_ISA=avxvnni.

The bench runs them on the registry's own GGUF files (the Q4 weights our
models are converted from) with the same prompt text, and reads their own
timings: llama-completion for plain decoding, llama-speculative-simple for
llama.cpp's speculative decoding with the registry's draft model, and
llama-lookup for its n-gram cache drafting (prompt lookup plus a dynamic
cache of earlier generations, kept in one file across the bench's requests:
llama.cpp's own cross-request memory, emptied where ours is), and llama-server
over HTTP with its prompt cache on (cache_prompt, its default), as a llama.cpp
user serves conversations: it keeps the last prompt's KV and reuses the part
a request shares with it (restarted where our caches are emptied, since
erasing its slot leaves its host-memory prompt cache). step_costs runs
llama-bench on the same GGUF files for llama.cpp's cost per pass.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from specdec_core.models.catalogue import REGISTRY
from specdec_core.models.paths import gguf_path

SDIST = "llama-cpp-python==0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
TOOLS = ("llama-completion", "llama-speculative-simple", "llama-lookup", "llama-bench", "llama-server", "llama-perplexity")
KINDS = ("plain", "speculative", "lookup", "server")  # what LlamaCpp.generate runs
SERVER_CONTEXT = 16384  # llama-server's KV cache, in tokens: the longest conversation the bench replays fits
SERVER_START_S = 300  # the longest wait for llama-server to load its model
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
ISA_FLAGS = {
    # AMX off for GCC 12's header (the module docstring)
    "native": ["-DGGML_NATIVE=ON", f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"],
    # Every x86 extension past AVX2 named off, whatever the host has: ggml's defaults could change under us.
    "avx2": ["-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_BMI2=ON",
             "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF",
             "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
             "-DGGML_AMX_BF16=OFF"],
}
# AVX2 and AVX-VNNI, the rest off: the peer of our avxvnni family.
ISA_FLAGS["avxvnni"] = [flag.replace("AVX_VNNI=OFF", "AVX_VNNI=ON") for flag in ISA_FLAGS["avx2"]]


def cmake_flags(isa: str) -> list[str]:
    """cmake's options for a Release build of the tools for `isa` (ISA_FLAGS)."""
    if isa not in ISA_FLAGS:
        raise ValueError(f"llama.cpp builds for one of {', '.join(ISA_FLAGS)}, not {isa!r}")
    return ["-DCMAKE_BUILD_TYPE=Release", *ISA_FLAGS[isa], "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
            "-DBUILD_SHARED_LIBS=OFF",
            "-DLLAMA_USE_PREBUILT_UI=OFF"]  # else llama-server's build downloads its web UI, unpinned; the API needs none


def build(dest: Path, isa: str = "native", jobs: int = 2) -> Path:
    """Download the pinned sdist, build the tools for `isa` into dest/bin; returns that directory. Shows the
    build's progress."""
    flags = cmake_flags(isa)  # an unknown ISA stops before the download
    dest = dest.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        requirement = Path(tmp) / "requirements.txt"
        requirement.write_text(f"{SDIST} --hash=sha256:{SDIST_SHA256}\n")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--require-hashes",
             "-r", str(requirement), "-d", tmp],
            check=True,
        )
        (archive,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(archive) as sdist:
            sdist.extractall(tmp, filter="data")
        (source,) = Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp")
        build_dir = Path(tmp) / "build"
        subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), "-G", "Ninja", *flags], check=True)
        subprocess.run(["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *TOOLS], check=True)
        bin_dir = dest / "bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        for tool in TOOLS:
            (build_dir / "bin" / tool).replace(bin_dir / tool)
    return bin_dir


def find_tools(directory: Path, needed: tuple[str, ...] = TOOLS[:2]) -> Path:
    """The directory holding the `needed` tools: DIR itself or DIR/bin; says how to build them when missing."""
    for candidate in (directory, directory / "bin"):
        if all((candidate / tool).is_file() for tool in needed):
            return candidate
    raise FileNotFoundError(
        f"no llama.cpp tools ({', '.join(needed)}) in {directory} or {directory / 'bin'}; "
        f"build them with: python -m specdec_tools.bench.llama_cpp build {directory}"
    )


def registry_gguf(name: str) -> Path:
    """The GGUF file the registry converted model `name` from; says how to pull it when missing."""
    if name not in REGISTRY:
        raise LookupError(f"--llama-cpp needs registry models (their GGUF files); {name!r} is not one")
    path = gguf_path(REGISTRY[name].gguf_file)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; run: specdec pull {name}")
    return path


@dataclass
class BenchCosts:
    """llama-bench's figures, medians over its repetitions (as step_costs takes ours)."""

    pass_ms: dict[int, float]  # a prompt pass of k tokens over an empty cache (its test pp k)
    token_ms: float  # a generated token, one-token passes over a growing cache (its test tg n)
    build_commit: str
    cpu_info: str


def parse_llama_bench(text: str) -> BenchCosts:
    """llama-bench's `-o json` output: its pp tests and its one tg test."""
    tests = json.loads(text)
    (generation,) = [test for test in tests if test["n_gen"]]
    return BenchCosts(
        {test["n_prompt"]: _median_ms(test) for test in tests if not test["n_gen"]},
        _median_ms(generation) / generation["n_gen"], generation["build_commit"], generation["cpu_info"],
    )


def _median_ms(test: dict) -> float:
    return statistics.median(test["samples_ns"]) / 1e6


def llama_bench(
    tools: Path, model: Path, threads: int, prompt_lengths: list[int], gen_tokens: int, reps: int
) -> BenchCosts:
    """Run llama-bench on `model`: passes of each of `prompt_lengths` tokens, and `gen_tokens` tokens generated,
    each `reps` times."""
    cmd = [str(tools / "llama-bench"), "-m", str(model), "-t", str(threads), "-p", ",".join(map(str, prompt_lengths)),
           "-n", str(gen_tokens), "-r", str(reps), "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise RuntimeError(f"llama-bench failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return parse_llama_bench(done.stdout)


def llama_perplexity(tools: Path, model: Path, text: Path, context: int, chunks: int, threads: int) -> float:
    """llama-perplexity's final estimate on `model` over `text`: `chunks` windows of `context` tokens, each scored on
    its second half (quant_bench's `windowed_perplexity` measures ours the same way)."""
    cmd = [str(tools / "llama-perplexity"), "-m", str(model), "-f", str(text), "-c", str(context), "--chunks", str(chunks),
           "-t", str(threads), "-b", str(context)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr)
    if done.returncode or not found:
        raise RuntimeError(f"llama-perplexity failed ({done.returncode}):\n{(done.stdout + done.stderr)[-2000:]}")
    return float(found.group(1))


@dataclass
class Timing:
    """One llama.cpp generation, by its own clock."""

    new_tokens: int
    prefill_s: float
    decode_s: float
    text: str
    drafted: int | None = None
    accepted: int | None = None
    cached_tokens: int | None = None  # prompt tokens llama-server took from its prompt cache (its other tools: None)


_EVAL = re.compile(r"\b(prompt eval|eval) time\s*=\s*([\d.]+) ms /\s*(\d+) (?:tokens|runs)")
_SPEC = {
    "decoded": re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds"),
    "drafted": re.compile(r"n_drafted\s*=\s*(\d+)"),
    "accepted": re.compile(r"n_accept\s*=\s*(\d+)"),
    "prefill": re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds"),
}


def parse_completion(log: str, text: str) -> Timing:
    """Timings of llama-completion from its performance summary."""
    times = {kind: (float(ms) / 1000, int(n)) for kind, ms, n in _EVAL.findall(log)}
    if "eval" not in times:
        raise RuntimeError(f"llama-completion printed no eval timing:\n{log[-2000:]}")
    # Its eval count is the tokens decoded after the first, which prompt eval's last logits produced.
    decode_s, decoded = times["eval"]
    prefill_s, _ = times.get("prompt eval", (0.0, 0))
    return Timing(decoded + 1, prefill_s, decode_s, text)


ECHO_END = {"lookup": "\n\n\n\n", "speculative": "\n\n"}  # what each tool prints after its answer


def parse_speculative(log: str, text: str) -> Timing:
    """Timings and acceptance of llama-speculative-simple from its summary."""
    decoded = _SPEC["decoded"].search(log)
    if not decoded:
        raise RuntimeError(f"llama-speculative-simple printed no summary:\n{log[-2000:]}")
    prefill = _SPEC["prefill"].search(log)
    drafted, accepted = _SPEC["drafted"].search(log), _SPEC["accepted"].search(log)
    return Timing(
        int(decoded[1]), float(prefill[2]) if prefill else 0.0, float(decoded[2]), text,
        int(drafted[1]) if drafted else None, int(accepted[1]) if accepted else None,
    )


@dataclass
class LlamaCpp:
    """Runs one prompt through llama.cpp's tools, greedy, on `threads` threads."""

    tools: Path
    model: Path
    draft: Path | None
    threads: int
    gamma: int
    _cache_dir: tempfile.TemporaryDirectory | None = field(default=None, init=False, repr=False)
    _server: tuple[subprocess.Popen, str] | None = field(default=None, init=False, repr=False)  # process, URL

    @property
    def lookup_cache(self) -> Path:
        """llama-lookup's dynamic n-gram cache: one file across requests, removed with this object."""
        if self._cache_dir is None:
            self._cache_dir = tempfile.TemporaryDirectory(prefix="specdec-llama-lookup-")
        return Path(self._cache_dir.name) / "dynamic.bin"

    def forget(self) -> None:
        """Empty llama-lookup's memory of earlier generations and llama-server's prompt cache."""
        self.lookup_cache.unlink(missing_ok=True)
        self.close()

    def close(self) -> None:
        """Stop llama-server, if it runs."""
        if self._server is not None:
            self._server[0].terminate()
            self._server[0].wait(timeout=60)
            self._server = None

    def _server_url(self) -> str:
        """llama-server on a free loopback port, started on first use, with one slot and its prompt cache."""
        if self._server is not None and self._server[0].poll() is None:
            return self._server[1]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        process = subprocess.Popen(
            [str(self.tools / "llama-server"), "-m", str(self.model), "-t", str(self.threads), "-c", str(SERVER_CONTEXT),
             "-np", "1", "--host", "127.0.0.1", "--port", str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + SERVER_START_S
        while not _healthy(url):
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"llama-server did not start ({self.tools / 'llama-server'} -m {self.model})")
            time.sleep(0.5)
        self._server = (process, url)
        return url

    def _serve(self, prompt: str, max_tokens: int) -> Timing:
        """One greedy completion from llama-server, timed by its own clock (prefill: the tokens it did not have)."""
        request = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "seed": 0, "cache_prompt": True}
        post = urllib.request.Request(f"{self._server_url()}/completion", json.dumps(request).encode(),
                                      {"Content-Type": "application/json"})
        with urllib.request.urlopen(post, timeout=3600) as response:
            answer = json.loads(response.read())
        timings = answer["timings"]
        return Timing(timings["predicted_n"], timings["prompt_ms"] / 1000, timings["predicted_ms"] / 1000, answer["content"],
                      cached_tokens=timings.get("cache_n"))

    def generate(self, prompt: str, max_tokens: int, kind: str, context: int = 4096) -> Timing:
        """One greedy generation; `context` tokens of KV cache (prompt, output and drafts must fit)."""
        if kind not in KINDS:
            raise ValueError(f"llama.cpp runs one of {', '.join(KINDS)}, not {kind!r}")
        if kind == "server":
            return self._serve(prompt, max_tokens)
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as file:
            file.write(prompt + "\n")  # -f drops the file's last newline (common/arg.cpp): the prompt stays whole
            file.flush()
            common = ["-m", str(self.model), "-f", str(file.name), "-n", str(max_tokens), "-t", str(self.threads),
                      "--temp", "0", "--seed", "0", "-c", str(context),
                      "-b", str(context),  # llama-speculative-simple refuses a prompt longer than one batch
                      "--no-escape"]  # else the tools turn a prompt's backslash escapes (as in code) into tabs and newlines
            if kind == "speculative":
                if self.draft is None:
                    raise ValueError("llama.cpp speculative decoding needs the config's draft model (speculation.draft_model)")
                cmd = [str(self.tools / "llama-speculative-simple"), *common, "-md", str(self.draft),
                       "--spec-type", "draft-simple", "--spec-draft-n-max", str(self.gamma)]
            elif kind == "lookup":
                if not (self.tools / "llama-lookup").is_file():
                    raise FileNotFoundError(f"no llama-lookup in {self.tools}; rebuild the tools: "
                                            f"python -m specdec_tools.bench.llama_cpp build {self.tools.parent}")
                cmd = [str(self.tools / "llama-lookup"), *common, "--spec-draft-n-max", str(self.gamma),
                       "-lcd", str(self.lookup_cache)]
            else:
                cmd = [str(self.tools / "llama-completion"), *common, "-no-cnv", "--no-display-prompt"]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if done.returncode:
            raise RuntimeError(f"{Path(cmd[0]).name} failed ({done.returncode}):\n{done.stderr[-2000:]}")
        if kind == "plain":
            return parse_completion(done.stderr + done.stdout, done.stdout)
        # Both echo the prompt (after any BOS piece) before their answer, which only the answer's tokens may count;
        # after it llama-lookup prints two blank lines, llama-speculative-simple one.
        _, echoed, text = done.stdout.partition(prompt)
        if not echoed:
            raise RuntimeError(f"{Path(cmd[0]).name} did not echo the prompt; its output began: {done.stdout[:500]!r}")
        return parse_speculative(done.stderr + done.stdout, text.removesuffix(ECHO_END[kind]))


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec_tools.bench.llama_cpp", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build_parser = commands.add_parser("build", help="build llama.cpp's tools from the pinned PyPI sdist")
    build_parser.add_argument("dest", type=Path, help="directory to put bin/ in")
    build_parser.add_argument(
        "--isa", choices=list(ISA_FLAGS), default="native",
        help="native: this CPU's extensions but AMX; avx2: AVX2 alone, a peer of our AVX2 path on any x86 host",
    )
    build_parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs")
    args = parser.parse_args(argv)
    print(f"llama.cpp tools in {build(args.dest, args.isa, args.jobs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
