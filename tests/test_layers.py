"""The layers: import-linter's contracts (pyproject.toml) hold, they catch a module importing from above
its layer, and the server runs without the tools' extra installed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import yaml

from tests.test_faults import free_port, spawned
from tests.test_server import MODEL

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specdec_core", "specdec_tools", "server", "specdec_cli", "loadtest")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter's `lint-imports` over the packages under `root`, with this repository's contracts."""
    command = [str(Path(sys.executable).with_name("lint-imports")), "--config", str(ROOT / "pyproject.toml")]
    return subprocess.run(command, cwd=root, env={"PYTHONPATH": str(root), "PATH": ""}, capture_output=True, text=True)


def test_the_layer_contracts_hold():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_core_module_importing_a_tool_breaks_them(tmp_path: Path):
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    sampling = tmp_path / "specdec_core" / "sampling.py"
    sampling.write_text(sampling.read_text() + "\nfrom specdec_tools.bench import plots  # noqa\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert "specdec_core.sampling -> specdec_tools.bench.plots" in result.stdout


def test_serve_runs_without_the_tools_extra(tmp_path: Path):
    """`specdec serve` with matplotlib and scipy uninstallable (as without `pip install specdec[tools]`):
    a None in sys.modules makes their import fail and find_spec say they are missing."""
    data = yaml.safe_load((ROOT / "configs/tiny-random.yaml").read_text())
    data["model"]["threads"] = 1
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(data))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    without_tools = ("import sys; sys.modules.update(matplotlib=None, scipy=None); "
                     "from specdec_cli.main import main; sys.exit(main())")
    cmd = [sys.executable, "-c", without_tools, "serve", "--config", str(config), "--port", str(port)]
    with spawned(cmd, f"{url}/health", tmp_path / "server.log"):
        response = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4}, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


def test_a_tool_without_its_extra_says_what_to_install(tmp_path: Path, prompts_file: Path):
    without_tools = ("import sys; sys.modules.update(matplotlib=None, scipy=None); "
                     "from specdec_cli.main import main; sys.exit(main())")
    cmd = [sys.executable, "-c", without_tools, "bench", "--config", str(ROOT / "configs/tiny-random.yaml"),
           "--drafters", "ngram", "--prompts", str(prompts_file), "--num-prompts", "1", "--max-tokens", "2", "--out", str(tmp_path / "out")]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode != 0
    assert "from the tools extra; install it with pip install '.[tools]'" in result.stderr
