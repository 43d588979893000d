"""The learner of examples/k8s: steps its workers' envs with random actions, then closes.

It stands in for a training script: replace the loop with yours. The manifest
(learner.yaml) configures it through the environment:

- ``APS_LISTEN``: where to listen, ``tcp://0.0.0.0:7000``;
- ``APS_NUM_WORKERS``: how many workers to wait for (the worker Job's ``completions``);
- ``APS_TOKEN_FILE``: the token, mounted from the ``aps-token`` Secret;
- ``APS_TLS_DIR``: where the optional ``aps-tls`` Secret is mounted; TLS when it holds
  ``tls.crt`` and ``tls.key``;
- ``APS_STEPS``: how many steps to run (default 1000).

``on_worker_lost="wait"`` lets a worker that Kubernetes restarts take over a dead one's envs.
"""

from __future__ import annotations

import os
import ssl
import time
from pathlib import Path

import aps
from aps.transports.tcp import TCPFactory


def main() -> None:
    listen = os.environ.get("APS_LISTEN", "tcp://0.0.0.0:7000")
    tls = Path(os.environ.get("APS_TLS_DIR", "/var/run/aps-tls"))
    if (tls / "tls.crt").exists():
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server.load_cert_chain(tls / "tls.crt", tls / "tls.key")
        # ClusterEnv takes no factory: listen on a scheme whose factory serves the certificate.
        aps.transports.register("tls", TCPFactory(server_ssl_context=server))
        listen = "tls://" + listen.partition("://")[2]
    envs = aps.ClusterEnv(
        listen,
        num_workers=int(os.environ.get("APS_NUM_WORKERS", "8")),
        token=Path(os.environ.get("APS_TOKEN_FILE", "/var/run/aps/token")).read_text().strip(),
        on_worker_lost="wait",
        reconnect_timeout=300,
        timeouts=aps.Timeouts(connect=600),  # worker pods may wait for nodes a while
    )
    try:
        envs.reset(seed=0)
        steps = int(os.environ.get("APS_STEPS", "1000"))
        started = time.perf_counter()
        for _ in range(steps):
            envs.step(envs.action_space.sample())
        rate = steps * envs.num_envs / (time.perf_counter() - started)
        print(
            f"{steps} steps of {envs.num_envs} envs on {len(envs.workers)} workers over "
            f"{listen.partition(':')[0]}: {rate:,.0f} env-steps/s"
        )
    finally:
        envs.close()


if __name__ == "__main__":
    main()
