"""The Kubernetes manifests and the Dockerfile: their structure, and their commands run here.

No image is built and no cluster is used. The manifests are parsed, their references checked
against each other (Secrets, ports, the Service, the ConfigMap, the image), the worker's
shell command is expanded as its pod's shell would and parsed by aps's own command line, and
the learner script and the workers' command then run on this machine, with the mount paths
pointing at temporary directories: over TCP, and over TLS with a certificate like the
recipe's.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from aps.cli import _parser
from tests.test_launch_slurm import free_port

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "examples" / "k8s"
TOKEN_MOUNT, TLS_MOUNT = "/var/run/aps", "/var/run/aps-tls"


def load(name: str) -> dict[str, dict[str, Any]]:
    """The manifest's objects by kind (learner.yaml: Service and Job; workers-job.yaml: Job)."""
    docs = [doc for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]
    kinds = {doc["kind"]: doc for doc in docs}
    assert len(kinds) == len(docs), f"{name}: one object per kind"
    return kinds


def pod_of(job: dict[str, Any]) -> dict[str, Any]:
    pod: dict[str, Any] = job["spec"]["template"]["spec"]
    return pod


def container_of(job: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod_of(job)["containers"]
    return dict(container)


def environ_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def mounts_of(job: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any]]]:
    """Mount path -> (volume name, volume) for the job's container."""
    volumes = {v["name"]: v for v in pod_of(job)["volumes"]}
    return {
        m["mountPath"]: (m["name"], volumes[m["name"]]) for m in container_of(job)["volumeMounts"]
    }


LEARNER = load("learner.yaml")
WORKERS = load("workers-job.yaml")["Job"]


def worker_argv(environ: dict[str, str], index: int, tls_dir: str | None = None) -> list[str]:
    """The worker pod's command line as its shell expands it (``exec`` prints instead)."""
    container = container_of(WORKERS)
    script = container["args"][0]
    assert script.startswith("exec aps worker ")
    script = script.replace("exec aps worker", "exec printf '%s\\n' aps worker", 1)
    if tls_dir is not None:
        script = script.replace(TLS_MOUNT, tls_dir)
    out = subprocess.run(
        [*container["command"], script],
        env={**environ_of(container), **environ, "JOB_COMPLETION_INDEX": str(index)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.splitlines()


def test_the_worker_command_is_a_valid_aps_worker_invocation() -> None:
    argv = worker_argv({}, index=2, tls_dir="/nonexistent")
    assert argv[:2] == ["aps", "worker"]
    args = _parser().parse_args(argv[1:])
    assert args.command == "worker"
    assert args.url == "tcp://aps-learner:7000"
    assert args.env == "CartPole-v1" and args.num_envs == 16
    assert args.seed == 2 * 16  # SEED + JOB_COMPLETION_INDEX * num_envs
    assert str(args.token_file) == f"{TOKEN_MOUNT}/token"
    assert args.tls_ca is None  # no aps-tls Secret mounted: plain TCP
    assert args.connect_timeout == 300


def test_workers_dial_with_tls_when_the_ca_is_mounted(tmp_path: Path) -> None:
    (tmp_path / "ca.crt").write_text("a CA\n")
    args = _parser().parse_args(worker_argv({}, index=0, tls_dir=str(tmp_path))[1:])
    assert args.tls_ca == str(tmp_path / "ca.crt")


def test_seeds_are_distinct_across_pods() -> None:
    completions = WORKERS["spec"]["completions"]
    seeds = [_parser().parse_args(worker_argv({}, i)[1:]).seed for i in range(completions)]
    num_envs = 16
    envs = {seed + j for seed in seeds for j in range(num_envs)}
    assert len(envs) == completions * num_envs


def test_the_workers_dial_the_learners_service() -> None:
    service, job = LEARNER["Service"], LEARNER["Job"]
    url = environ_of(container_of(WORKERS))["APS_LEARNER_URL"]
    host, port = re.fullmatch(r"tcp://([^:/]+):(\d+)", url).groups()  # type: ignore[union-attr]
    assert host == service["metadata"]["name"]
    (service_port,) = service["spec"]["ports"]
    assert service_port["port"] == int(port)
    # The Service selects the learner's pod and reaches its container port.
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    (container_port,) = container_of(job)["ports"]
    assert service_port["targetPort"] in (container_port["name"], container_port["containerPort"])
    listen = environ_of(container_of(job))["APS_LISTEN"]
    assert listen == f"tcp://0.0.0.0:{container_port['containerPort']}"


def test_the_learner_waits_for_as_many_workers_as_the_job_runs() -> None:
    environ = environ_of(container_of(LEARNER["Job"]))
    spec = WORKERS["spec"]
    assert int(environ["APS_NUM_WORKERS"]) == spec["completions"] == spec["parallelism"]
    assert spec["completionMode"] == "Indexed"  # JOB_COMPLETION_INDEX exists


@pytest.mark.parametrize("job", [LEARNER["Job"], WORKERS], ids=["learner", "workers"])
def test_the_token_and_tls_come_from_secrets(job: dict[str, Any]) -> None:
    mounts = mounts_of(job)
    _, token = mounts[TOKEN_MOUNT]
    assert token["secret"]["secretName"] == "aps-token"
    assert not token["secret"].get("optional", False)
    assert token["secret"]["items"] == [{"key": "token", "path": "token"}]
    _, tls = mounts[TLS_MOUNT]
    assert tls["secret"]["secretName"] == "aps-tls" and tls["secret"]["optional"] is True
    for _, volume in mounts.values():
        if "secret" in volume:
            assert volume["secret"]["defaultMode"] == 0o400
    # Files of mode 0400 belong to root: the non-root user reads them through fsGroup.
    context = pod_of(job)["securityContext"]
    assert context["runAsNonRoot"] is True and context["fsGroup"] == context["runAsUser"]
    # The token never appears as a value anywhere in the pod spec, only as a file path.
    assert "APS_TOKEN" not in environ_of(container_of(job))


def test_workers_never_mount_the_learners_key() -> None:
    _, tls = mounts_of(WORKERS)[TLS_MOUNT]
    assert [item["key"] for item in tls["secret"]["items"]] == ["ca.crt"]


def test_the_learner_runs_its_script_from_the_config_map() -> None:
    job = LEARNER["Job"]
    container = container_of(job)
    assert container["command"][0] == "python"
    script = Path(container["command"][1])
    _, volume = mounts_of(job)[str(script.parent)]
    assert volume["configMap"]["name"] == "aps-learner"
    assert (K8S / script.name).is_file()
    assert environ_of(container)["APS_TOKEN_FILE"] == f"{TOKEN_MOUNT}/token"
    assert environ_of(container)["APS_TLS_DIR"] == TLS_MOUNT
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"


def test_both_run_the_image_the_dockerfile_builds() -> None:
    images = {container_of(LEARNER["Job"])["image"], container_of(WORKERS)["image"]}
    assert len(images) == 1
    (image,) = images
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f"docker build -t {image} ." in dockerfile
    assert 'ENTRYPOINT ["aps"]' in dockerfile
    assert re.search(r"^USER 10001$", dockerfile, re.M)
    assert f"--uid {pod_of(WORKERS)['securityContext']['runAsUser']} " in dockerfile
    # Everything COPY takes exists, and .dockerignore lets it through.
    ignored = (ROOT / ".dockerignore").read_text().split()
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            for source in shlex.split(line)[1:-1]:
                assert (ROOT / source).exists(), source
                assert f"!{source.rstrip('/')}" in {i.rstrip("/") for i in ignored}, source
    # No torch unless asked for: aps itself does not depend on it.
    assert 'ARG TORCH=""' in dockerfile and 'if [ -n "$TORCH" ]; then' in dockerfile
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("torch") for d in project["dependencies"])


def make_certificates(directory: Path) -> bool:
    """A CA and a learner certificate for 127.0.0.1, as the TLS recipe makes them."""
    commands = [
        "openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=ca"
        " -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign"
        " -keyout ca.key -out ca.crt",
        "openssl req -newkey rsa:2048 -nodes -subj /CN=aps-learner -keyout tls.key -out l.csr",
        "openssl x509 -req -in l.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2"
        " -extfile ext -out tls.crt",
    ]
    (directory / "ext").write_text(
        "subjectAltName = DNS:aps-learner, IP:127.0.0.1\nauthorityKeyIdentifier = keyid, issuer\n"
    )
    for command in commands:
        done = subprocess.run(shlex.split(command), cwd=directory, capture_output=True)
        if done.returncode != 0:
            return False
    return True


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
def test_the_learner_script_and_worker_commands_run_here(tls: bool, tmp_path: Path) -> None:
    token_dir, tls_dir = tmp_path / "token", tmp_path / "tls"
    token_dir.mkdir()
    tls_dir.mkdir()
    (token_dir / "token").write_text("k8s-test-token\n")
    (token_dir / "token").chmod(0o600)  # the worker refuses a token file others may read
    if tls and not make_certificates(tls_dir):
        pytest.skip("openssl could not make certificates here")
    port = free_port()
    learner_env = {
        **os.environ,
        **environ_of(container_of(LEARNER["Job"])),
        "APS_LISTEN": f"tcp://127.0.0.1:{port}",
        "APS_NUM_WORKERS": "2",
        "APS_TOKEN_FILE": str(token_dir / "token"),
        "APS_TLS_DIR": str(tls_dir),
        "APS_STEPS": "20",
    }
    processes: list[subprocess.Popen[str]] = []
    try:
        learner = subprocess.Popen(
            [sys.executable, str(K8S / "learner.py")],
            env=learner_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        processes.append(learner)
        for index in range(2):
            argv = worker_argv(
                {"APS_LEARNER_URL": f"tcp://127.0.0.1:{port}"}, index, tls_dir=str(tls_dir)
            )
            argv = [
                str(token_dir / "token") if arg == f"{TOKEN_MOUNT}/token" else arg for arg in argv
            ]
            assert ("--tls-ca" in argv) == tls
            argv[argv.index("--num-envs") + 1] = "2"  # small, for this machine
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "aps", *argv[1:]],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        out, _ = learner.communicate(timeout=120)
        assert learner.returncode == 0, out
        assert re.search(rf"20 steps of 4 envs on 2 workers over {'tls' if tls else 'tcp'}:", out)
        for worker in processes[1:]:
            worker_out, _ = worker.communicate(timeout=30)
            assert worker.returncode == 0, worker_out  # the learner's goodbye ends them
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
