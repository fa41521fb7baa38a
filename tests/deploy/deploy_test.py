"""What can be checked of deploy/ without a cluster or a Docker daemon:

- the runtime image's package list covers every library the binaries load
  (deploy/docker/runtime-packages.sh, run here on the built binaries);
- every YAML parses; the Helm chart, rendered by gotemplate.py (helm is not
  packaged for Debian 12), and the plain example are native-sidecar
  deployments that pass Pod Security "restricted" (checked as assertions on
  the rendered objects), request no GPU for the sidecar unless it computes
  on one, and follow `helm create`'s conventions; values.yaml is documented
  and valid under values.schema.json;
- a non-root worker can use turbokvd's 0660 socket through the pod's
  fsGroup (real processes under the uids and groups the pod gives them);
- the chart's Redis (redis.deploy) is a restricted pod that only its
  release's turbokvd reaches, Redis takes its arguments (noeviction,
  maxmemory, appendonly) and keeps turbokvd's sessions across its own
  restart, and a second turbokvd takes them over;
- the alert rules pass promtool's check and unit tests, the unit tests cover
  every alert firing and not firing, and every runbook_url names a section
  of docs/OPERATIONS.md;
- every metric the rules and the dashboard use is one a real turbokvd
  exports, and turbokvd accepts the flags the deployments give it, the
  Redis tier's included.
Needs $TURBOKVD, $TURBOKV_CLI, promtool, redis-server and redis-cli."""

import base64
import contextlib
import copy
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request

import jsonschema
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gotemplate import Chart, TemplateError  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
DEPLOY = os.path.join(ROOT, "deploy")
CHART = os.path.join(DEPLOY, "helm", "turbokv")
RUNBOOK = "https://github.com/turbokv/turbokv/blob/main/docs/OPERATIONS.md"
# The chart's files/ (its own copies: a chart holds no symlink) and the files they copy, under deploy/.
CHART_FILES = {"alerts.yaml": "prometheus/alerts.yaml", "dashboard.json": "grafana/dashboard.json"}
# Metrics the dashboard reads from elsewhere: Prometheus' own, kube-state-metrics'.
EXTERNAL_METRICS = {"up", "kube_pod_container_resource_limits"}
# What a cluster with the Prometheus Operator serves, for .Capabilities.APIVersions.
MONITORING_APIS = ("monitoring.coreos.com/v1", "monitoring.coreos.com/v1/PodMonitor",
                   "monitoring.coreos.com/v1/PrometheusRule")


def load(path):
    with open(path) as f:
        return yaml.safe_load(f)


def chart_values_file():
    """values.yaml as it is, the worker's and turbokvd's images left empty."""
    return load(os.path.join(CHART, "values.yaml"))


def default_values():
    """values.yaml with the values it leaves to the user: the worker's image
    and turbokvd's (built from deploy/docker/Dockerfile, pushed to a registry
    of the user's)."""
    values = chart_values_file()
    values["worker"]["image"].update({"repository": "registry.example.com/inference-worker", "tag": "1.0.0"})
    values["turbokvd"]["image"].update({"repository": "registry.example.com/turbokvd", "tag": "0.1.0"})
    return values


def value_leaves(properties, prefix=""):
    """The dotted names of the chart's values under the schema's properties: an
    object the schema closes (additionalProperties false) is walked into, any
    other value (a Kubernetes object given whole, a map of labels) is one."""
    leaves = []
    for key, sub in properties.items():
        if sub.get("additionalProperties") is False:
            leaves += value_leaves(sub["properties"], f"{prefix}{key}.")
        else:
            leaves.append(prefix + key)
    return leaves


def quantity(text):
    """A Kubernetes quantity (cpu or memory) as a number."""
    number, unit = re.fullmatch(r"([0-9.]+)(m|Ki|Mi|Gi|Ti|k|M|G|T)?", str(text)).groups()
    scale = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
             "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}[unit]
    return float(number) * scale


def every_option_values():
    """values.yaml with every option the chart has switched on or set."""
    values = default_values()
    values.update({
        "nameOverride": "kv", "replicas": 3,
        "imagePullSecrets": [{"name": "regcred"}],
        "podAnnotations": {"example.com/owner": "ml-platform"},
        "podLabels": {"team": "ml"},
        "nodeSelector": {"nvidia.com/gpu.present": "true"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                                 "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "kv"}}}}]}},
        "priorityClassName": "inference", "serviceAccountName": "worker",
        "extraVolumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
    })
    worker = values["worker"]
    worker.update({
        "command": ["python3", "-m", "worker"], "args": ["--model=/models/llama"],
        "env": [{"name": "LOG_LEVEL", "value": "debug"}],
        "envFrom": [{"secretRef": {"name": "worker-secrets"}}],
        "ports": [{"name": "http", "containerPort": 8000}],
        "extraVolumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
    })
    worker["securityContext"] = {**worker["securityContext"], "runAsUser": 1000}
    turbokvd = values["turbokvd"]
    turbokvd.update({"device": "cuda:0", "threads": 6, "extraArgs": ["--max-sessions=2000"],
                     "env": [{"name": "MALLOC_ARENA_MAX", "value": "4"}]})
    turbokvd["image"]["tag"] = "0.1.1"
    turbokvd["snapshot"]["persistence"].update({"enabled": True, "storageClassName": "fast-ssd"})
    turbokvd["kvEvents"].update({"enabled": True, "topic": "kv@$(POD_IP)@demo-model", "dpRank": 2})
    values["podMonitor"]["additionalLabels"] = {"release": "kube-prometheus-stack"}
    values["test"]["image"].update({"repository": "mirror.example.com/grpc-health-probe", "pullPolicy": "Always"})
    values["prometheusRule"]["additionalLabels"] = {"release": "kube-prometheus-stack"}
    values["prometheusRule"]["runbookUrl"] = "https://wiki.example.com/turbokv/OPERATIONS.md"
    values["grafanaDashboard"].update({"namespace": "monitoring", "annotations": {"grafana_folder": "ML"}})
    return values


def redis_values():
    """values.yaml with the Redis tier in place of the disk tier and
    snapshots, and every redis.deploy option set."""
    values = default_values()
    values["turbokvd"]["spill"]["enabled"] = False
    values["turbokvd"]["snapshot"]["enabled"] = False
    values["imagePullSecrets"] = [{"name": "regcred"}]
    redis = values["redis"]
    redis.update({"budget": "12GiB", "lease": "6s", "timeout": "500ms"})
    redis["auth"].update({"existingSecret": "redis-credentials", "user": "turbokv"})
    deploy = redis["deploy"]
    deploy.update({"enabled": True, "maxmemory": "16gb"})
    deploy["image"].update({"repository": "mirror.example.com/redis", "tag": "7.0.15"})
    deploy["persistence"].update({"enabled": True, "storageClassName": "fast-ssd", "size": "48Gi"})
    return values


def rendered_objects(values=None, release="demo", api_versions=()):
    """The chart's manifests, in order, and the NOTES.txt text, on a cluster
    serving Kubernetes' own APIs and api_versions."""
    files = Chart(CHART).render(default_values() if values is None else values, release=release,
                                api_versions=api_versions)
    objects = [doc for name, text in files.items() if name != "NOTES.txt" for doc in yaml.safe_load_all(text) if doc]
    return objects, files["NOTES.txt"]


def rendered_chart(values=None, release="demo", api_versions=()):
    """{kind: object} of the chart's manifests (one of each kind), and the NOTES.txt text."""
    objects, notes = rendered_objects(values, release, api_versions)
    by_kind = {}
    for obj in objects:
        if obj["kind"] in by_kind:
            raise AssertionError(f"two {obj['kind']}s: use rendered_objects")
        by_kind[obj["kind"]] = obj
    return by_kind, notes


def redis_objects(objects):
    """{kind: object} of redis.deploy's objects among the chart's."""
    return {o["kind"]: o for o in objects if o["metadata"]["labels"].get("app.kubernetes.io/component") == "redis"}


def redis_deploy_values():
    """values.yaml with redis.deploy in place of the disk tier and snapshots."""
    values = default_values()
    values["turbokvd"]["spill"]["enabled"] = False
    values["turbokvd"]["snapshot"]["enabled"] = False
    values["redis"]["deploy"]["enabled"] = True
    return values


def worker_workload(objects):
    """The worker's Deployment or StatefulSet among the chart's objects (not Redis')."""
    redis = redis_objects(objects).values()
    return next(o for o in objects if o["kind"] in ("Deployment", "StatefulSet") and o not in redis)


def workload(objects):
    return objects.get("Deployment") or objects["StatefulSet"]


def seconds(duration):
    number, unit = re.fullmatch(r"(\d+)(ms|s|m|h)", duration).groups()
    return int(number) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]


def check_sidecar(test: unittest.TestCase, deployment: dict):
    """A native-sidecar pod: the socket, probes, ports, volumes and env line up."""
    pod = deployment["spec"]["template"]
    spec = pod["spec"]
    test.assertLessEqual(deployment["spec"]["selector"]["matchLabels"].items(), pod["metadata"]["labels"].items())
    sidecar = next(c for c in spec["initContainers"] if c["name"] == "turbokvd")
    worker = spec["containers"][0]
    test.assertEqual(sidecar["restartPolicy"], "Always")  # native sidecar
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in sidecar["args"]}
    mounts = {m["name"]: m["mountPath"] for m in sidecar["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    socket_dir = mounts["turbokv-socket"]
    test.assertEqual(args["--listen"], f"unix://{socket_dir}/turbokv.sock")
    test.assertIn("emptyDir", volumes["turbokv-socket"])
    test.assertIn({"name": "turbokv-socket", "mountPath": socket_dir}, worker["volumeMounts"])
    # The spill dir is a volume of its own, bounded; the Redis tier, which
    # turbokvd refuses beside snapshots, comes with every one of its flags,
    # and with the spill dir too it sits under it.
    claims = [c["metadata"]["name"] for c in deployment["spec"].get("volumeClaimTemplates", [])]
    if "--redis-url" in args:
        for flag in ("--snapshot-dir", "--snapshot-deadline"):
            test.assertNotIn(flag, args)
        test.assertNotIn("turbokv-snapshot", volumes)
        test.assertNotIn("turbokv-snapshot", mounts)
        test.assertNotIn("turbokv-snapshot", claims)
        for flag in ("--redis-budget", "--redis-lease", "--redis-timeout"):
            test.assertIn(flag, args)
    if "--spill-dir" in args:
        test.assertEqual(args["--spill-dir"], mounts["turbokv-spill"])
        test.assertIn("sizeLimit", volumes["turbokv-spill"]["emptyDir"])
    else:
        test.assertIn("--redis-url", args)
        test.assertNotIn("turbokv-spill", volumes)
    # Snapshots on a volume of their own: an emptyDir here, or a claim per pod.
    if "--snapshot-dir" in args:
        test.assertEqual(args["--snapshot-dir"], mounts["turbokv-snapshot"])
        if "turbokv-snapshot" in claims:
            test.assertEqual(deployment["kind"], "StatefulSet")
            test.assertNotIn("turbokv-snapshot", volumes)
        else:
            test.assertIn("sizeLimit", volumes["turbokv-snapshot"]["emptyDir"])
    env = {e["name"]: e for e in worker["env"]}
    test.assertEqual(env["TURBOKV_TARGET"]["value"], args["--listen"])
    # Every $(VAR) in the args is an env var of the container.
    sidecar_env = {e["name"]: e for e in sidecar["env"]}
    for arg in sidecar["args"]:
        for name in re.findall(r"\$\((\w+)\)", arg):
            test.assertIn(name, sidecar_env, arg)
    health_port = int(args["--health-listen"].rsplit(":", 1)[1])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        test.assertEqual(sidecar[probe]["grpc"]["port"], health_port, probe)
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    test.assertEqual(ports["health"], health_port)
    test.assertEqual(ports["metrics"], int(args["--metrics-listen"].rsplit(":", 1)[1]))
    for container in (sidecar, worker):
        test.assertIn("memory", container["resources"]["limits"])
    # --threads: the CPU limit (through the downward API) or a number.
    if args["--threads"] == "$(TURBOKVD_THREADS)":
        field = sidecar_env["TURBOKVD_THREADS"]["valueFrom"]["resourceFieldRef"]
        test.assertEqual((field["containerName"], field["resource"]), ("turbokvd", "limits.cpu"))
        test.assertIn("cpu", sidecar["resources"]["limits"])
    else:
        test.assertGreater(int(args["--threads"]), 0)
    # The sidecar requests a GPU exactly when it computes on one; otherwise
    # it is kept from seeing the node's GPUs.
    gpu = args["--device"].startswith("cuda")
    for side in ("requests", "limits"):
        requested = [r for r in sidecar["resources"].get(side) or {} if r.startswith("nvidia.com/")]
        test.assertEqual(len(requested), 1 if gpu else 0, (side, args["--device"]))
    if not gpu:
        test.assertEqual(sidecar_env["NVIDIA_VISIBLE_DEVICES"]["value"], "void")
    # A drain can finish its calls and write every session before SIGKILL.
    deadline = seconds(args["--shutdown-deadline"]) + seconds(args.get("--snapshot-deadline", "0s"))
    test.assertGreater(spec["terminationGracePeriodSeconds"], deadline)
    return sidecar["args"]


def wait_listening(test: unittest.TestCase, daemon: subprocess.Popen, log_path: str):
    """Until turbokvd logs that it serves (a call made during its start-up
    can wait out the CLI's connect timeout: seen, and reported)."""
    for _ in range(600):
        with open(log_path) as f:
            if "listening on" in f.read():
                return
        test.assertIsNone(daemon.poll(), "turbokvd exited")
        time.sleep(0.05)
    test.fail("turbokvd did not start listening within 30 s")


def free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


class LocalTurbokvd:
    """A turbokvd started by local_turbokvd, and its CLI and /metrics."""

    def __init__(self, test, target, health, metrics, log_path):
        self.test, self.target, self.health, self.metrics, self.log_path = test, target, health, metrics, log_path

    def cli(self, *command, ok=True):
        run = subprocess.run([os.environ["TURBOKV_CLI"], f"--target={self.target}", *command],
                             capture_output=True, text=True, timeout=60)
        if ok:
            with open(self.log_path) as f:
                self.test.assertEqual(run.returncode, 0, run.stderr + f.read())
        return run.stdout.strip()

    def scrape(self):
        time.sleep(1.2)  # the gauges refresh every second
        return urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=5).read().decode()


@contextlib.contextmanager
def local_turbokvd(test, args, directory, redis_password=None, **overrides):
    """turbokvd with a deployment's flags, the socket, ports, sizes and
    directories moved to what this machine has (overrides: more of them, by
    flag without its dashes) and the env references filled in; with
    redis_password, $TURBOKV_REDIS_PASSWORD as the pod's Secret gives it.
    Drained on leaving; it must exit 0."""
    health, metrics = free_ports(2)
    local = {"--listen": f"unix://{directory}/turbokv.sock", "--health-listen": f"127.0.0.1:{health}",
             "--metrics-listen": f"127.0.0.1:{metrics}", "--memory-budget": "1GiB",
             "--spill-dir": f"{directory}/spill", "--spill-budget": "1GiB", "--snapshot-dir": f"{directory}/snapshots",
             **{f"--{flag.replace('_', '-')}": value for flag, value in overrides.items()}}
    env = {"TURBOKVD_THREADS": "2", "POD_IP": "127.0.0.1"}
    flags = []
    for flag, value in (a.split("=", 1) for a in args):
        value = re.sub(r"[$][(](\w+)[)]", lambda m: env[m.group(1)], value)
        flags.append(f"{flag}={local.get(flag, value)}")
    log_path = os.path.join(directory, "log")
    log = open(log_path, "w")
    daemon_env = {**os.environ}
    if redis_password is not None:
        daemon_env["TURBOKV_REDIS_PASSWORD"] = redis_password
    daemon = subprocess.Popen([os.environ["TURBOKVD"], *flags], stderr=log, env=daemon_env)
    try:
        wait_listening(test, daemon, log_path)
        yield LocalTurbokvd(test, local["--listen"], local["--health-listen"], local["--metrics-listen"], log_path)
    finally:
        daemon.send_signal(signal.SIGTERM)
        log.close()
        with open(log_path) as f:
            test.assertEqual(daemon.wait(timeout=60), 0, f.read())


def redis_password(objects):
    """The password in redis.deploy's Secret, as the kubelet gives it to the containers."""
    return base64.b64decode(redis_objects(objects)["Secret"]["data"]["password"]).decode()


class LocalRedis:
    """The chart's Redis container run here: its command and arguments, with
    the port and the data directory moved and $(REDIS_PASSWORD) filled in
    with `password`; ready when its readiness probe passes (redis-cli with
    the password in $REDISCLI_AUTH, as the container's env has it)."""

    def __init__(self, test, container, directory, password):
        self.test, self.container, self.directory = test, container, directory
        self.env = {**os.environ, "REDISCLI_AUTH": password}
        self.password = password
        self.port = free_ports(1)[0]
        self.process = None
        os.makedirs(directory, exist_ok=True)

    def start(self):
        args = [a.replace("$(REDIS_PASSWORD)", self.password) for a in self.container["args"]]
        args[args.index("--port") + 1] = str(self.port)
        args[args.index("--dir") + 1] = self.directory
        self.log = open(os.path.join(self.directory, "redis.log"), "a")
        self.process = subprocess.Popen([shutil.which(self.container["command"][0]), *args],
                                        stdout=self.log, stderr=subprocess.STDOUT)
        probe = self.container["readinessProbe"]["exec"]["command"]
        for _ in range(100):
            self.test.assertIsNone(self.process.poll(), "redis-server exited")
            if subprocess.run([probe[0], "-p", str(self.port), *probe[1:]], capture_output=True,
                              env=self.env).returncode == 0:
                return
            time.sleep(0.1)
        self.test.fail("redis-server did not pass its readiness probe within 10 s")

    def cli(self, *command):
        run = subprocess.run(["redis-cli", "-p", str(self.port), "-e", *command], capture_output=True, text=True,
                             timeout=30, env=self.env)
        self.test.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        return run.stdout.strip()

    def stop(self):
        """As the kubelet stops it: SIGTERM, on which Redis syncs its append-only file and exits 0."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=60)
        self.process = None
        self.log.close()
        self.test.assertEqual(code, 0)


def sample(exposition, name, **labels):
    """The value of the first sample of a metric that has these labels (among others), or None."""
    for match in re.finditer(rf"^{name}(?:{{(.*)}})? (\S+)$", exposition, re.M):
        if labels.items() <= dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or "")).items():
            return float(match.group(2))
    return None


RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}


def check_restricted(test: unittest.TestCase, pod: dict, containers=2):
    """Pod Security Standards, "restricted" (Kubernetes 1.29), baseline rules
    included, for a pod template of at least that many containers; plus a
    read-only root filesystem and a fixed non-root uid, gid and fsGroup,
    which this project asks for."""
    spec = pod["spec"]
    pod_context = spec.get("securityContext", {})
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        test.assertFalse(spec.get(field, False), field)
    for volume in spec.get("volumes", []):
        test.assertLessEqual(set(volume) - {"name"}, RESTRICTED_VOLUMES, volume["name"])
    for sysctl in pod_context.get("sysctls", []):
        test.assertIn(sysctl["name"], SAFE_SYSCTLS)
    test.assertNotEqual(pod_context.get("seccompProfile", {}).get("type"), "Unconfined")
    for annotation, value in pod["metadata"].get("annotations", {}).items():
        if annotation.startswith("container.apparmor.security.beta.kubernetes.io/"):
            test.assertNotEqual(value, "unconfined", annotation)
    for key in ("runAsUser", "runAsGroup", "fsGroup"):
        test.assertIsInstance(pod_context.get(key), int, key)
        test.assertGreater(pod_context[key], 0, key)
    test.assertEqual(pod_context.get("windowsOptions", {}).get("hostProcess", False), False)
    every = spec.get("initContainers", []) + spec["containers"] + spec.get("ephemeralContainers", [])
    test.assertGreaterEqual(len(every), containers)
    for container in every:
        context = container.get("securityContext", {})
        name = container["name"]
        merged = {**pod_context, **context}
        test.assertFalse(context.get("privileged", False), name)
        test.assertIs(context.get("allowPrivilegeEscalation"), False, name)
        capabilities = context.get("capabilities", {})
        test.assertIn("ALL", capabilities.get("drop", []), name)
        test.assertLessEqual(set(capabilities.get("add", [])), {"NET_BIND_SERVICE"}, name)
        test.assertIs(merged.get("runAsNonRoot"), True, name)
        test.assertNotEqual(merged.get("runAsUser"), 0, name)
        test.assertIn(merged.get("seccompProfile", {}).get("type"), ("RuntimeDefault", "Localhost"), name)
        test.assertIn(merged.get("procMount", "Default"), ("Default",), name)
        selinux = merged.get("seLinuxOptions", {})
        test.assertIn(selinux.get("type", ""), ("", "container_t", "container_init_t", "container_kvm_t"), name)
        test.assertFalse({"user", "role"} & set(selinux), name)
        test.assertNotEqual(merged.get("appArmorProfile", {}).get("type"), "Unconfined", name)
        test.assertIs(context.get("readOnlyRootFilesystem"), True, name)
        for port in container.get("ports", []):
            test.assertNotIn("hostPort", port, name)


class DeployTest(unittest.TestCase):
    def test_runtime_image_packages_cover_every_library(self):
        # The Dockerfile's runtime image installs what this script prints for
        # the built binaries: every library ldd lists must resolve to a
        # package (on a merged /usr, ldd's /lib/... paths are /usr/lib/... to
        # dpkg: looking them up as printed found 4 of 61 and left the rest out).
        script = os.path.join(DEPLOY, "docker", "runtime-packages.sh")
        binaries = [os.environ["TURBOKVD"], os.environ["TURBOKV_CLI"]]
        run = subprocess.run([script, *binaries], capture_output=True, text=True, timeout=120)
        self.assertEqual(run.returncode, 0, run.stderr)
        packages = run.stdout.split()
        listing = subprocess.run(["ldd", *binaries], capture_output=True, text=True, check=True).stdout
        libraries = set(re.findall(r"=> (/\S+)", listing)) | set(re.findall(r"^\s+(/\S+) \(", listing, re.M))
        # Checked the other way round: the files of the packages it names
        # hold every library (compared without the /usr prefix).
        def merged(path):
            return path[len("/usr"):] if path.startswith("/usr/") else path
        files = set()
        for package in packages:
            listed = subprocess.run(["dpkg", "-L", package], capture_output=True, text=True, check=True).stdout
            files |= {merged(line) for line in listed.splitlines()}
        for library in libraries:
            self.assertTrue({merged(library), merged(os.path.realpath(library))} & files, library)
        self.assertGreater(len(libraries), 20)
        names = {p.split(":")[0] for p in packages}
        for name in ("libc6", "libstdc++6", "libprotobuf32", "libabsl20220623"):
            self.assertIn(name, names)
        self.assertTrue(any(n.startswith("libgrpc++") for n in names), packages)
        # A library no package owns (a copy the loader is pointed at) fails
        # the build, naming it, instead of being skipped.
        with tempfile.TemporaryDirectory(prefix="turbokv-ldd-") as tmp:
            library = next(l for l in libraries if "libabsl_hash" in l)
            shutil.copy(library, tmp)
            run = subprocess.run([script, os.environ["TURBOKVD"]], capture_output=True, text=True, timeout=120,
                                 env={**os.environ, "LD_LIBRARY_PATH": tmp})
            self.assertEqual(run.returncode, 1, run.stdout)
            self.assertIn(os.path.join(tmp, os.path.basename(library)), run.stderr)
        with open(os.path.join(DEPLOY, "docker", "Dockerfile")) as f:
            dockerfile = f.read()
        self.assertIn("deploy/docker/runtime-packages.sh /out/bin/turbokvd /out/bin/turbokv > /out/runtime-packages.txt",
                      dockerfile)
        # The default command's socket directory exists in the image.
        self.assertIn("unix:///run/turbokv/turbokv.sock", dockerfile)
        self.assertRegex(dockerfile, r"install -d [^\n]*/run/turbokv ")

    def test_template_renderer_follows_go_and_helm(self):
        # What gotemplate.py must get right for the chart checks to mean
        # anything, against what helm and Go's text/template do.
        with tempfile.TemporaryDirectory(prefix="turbokv-tpl-") as tmp:
            os.mkdir(os.path.join(tmp, "templates"))
            with open(os.path.join(tmp, "Chart.yaml"), "w") as f:
                f.write("name: c\nversion: 1.0.0+a\nappVersion: '2'\n")

            def render(text, values):
                with open(os.path.join(tmp, "templates", "t.yaml"), "w") as f:
                    f.write(text)
                return Chart(tmp).render(values)["t.yaml"]
            self.assertEqual(render('{{ .Values.n }} {{ .Values.big }} {{ .Values.f }}', {"n": 3, "big": 2000000, "f": 0.5}),
                             "3 2e+06 0.5")
            with self.assertRaisesRegex(TemplateError, "incompatible types"):
                render("{{ if gt .Values.n 1 }}x{{ end }}", {"n": 3})
            self.assertEqual(render("{{ if gt (int .Values.n) 1 }}x{{ end }}", {"n": 3}), "x")
            self.assertEqual(render("a\n  {{- \"b\" }}\n{{ \"c\" -}}\n  d", {}), "ab\ncd")
            self.assertEqual(render('{{ or .Values.a "x" }} {{ and 1 0 }} {{ default "d" .Values.a }} {{ .Values.a }}',
                                    {"a": ""}), "x 0 d ")
            with self.assertRaisesRegex(TemplateError, "nil pointer"):
                render("{{ .Values.a.b }}", {})
            with self.assertRaisesRegex(TemplateError, "unsupported function 'tpl'"):
                render('{{ tpl "x" . }}', {})
            # lookup finds nothing, as helm template's; randAlphaNum is random.
            self.assertEqual(render('{{ if lookup "v1" "Secret" "ns" "s" }}found{{ else }}none{{ end }}', {}), "none")
            self.assertRegex(render("{{ randAlphaNum 12 | b64enc }}", {}), r"^[A-Za-z0-9+/]{16}$")
            self.assertNotEqual(render("{{ randAlphaNum 32 }}", {}), render("{{ randAlphaNum 32 }}", {}))
            self.assertEqual(render('{{- range $k, $v := .Values.m }}{{ $k }}={{ $v }};{{ end }}', {"m": {"b": 1, "a": 2}}),
                             "a=2;b=1;")
            self.assertEqual(render('{{ define "t" }}[{{ . }}]{{ end }}{{ include "t" "x" | indent 2 }}', {}), "  [x]")
            self.assertEqual(render('{{ toYaml .Values.m | nindent 2 }}', {"m": {"b": [1], "a": {}}}),
                             "\n  a: {}\n  b:\n  - 1")
            self.assertEqual(render('{{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 5 }}', {}),
                             "c-1.0")
            with self.assertRaisesRegex(TemplateError, "execution error: a and b"):
                render('x{{ if .Values.a }}{{ fail "a and b" }}{{ end }}', {"a": True})
            self.assertEqual(render('x{{ if .Values.a }}{{ fail "a and b" }}{{ end }}', {"a": False}), "x")
            # kindIs: Sprig's reflect kinds; nil (a null or a missing key) is "invalid".
            self.assertEqual(render('{{ kindIs "bool" .Values.t }} {{ kindIs "bool" .Values.f }} {{ kindIs "bool" .Values.z }}'
                                    ' {{ kindIs "invalid" .Values.z }} {{ kindIs "invalid" .Values.missing }}'
                                    ' {{ kindIs "float64" .Values.n }} {{ kindIs "string" .Values.s }}'
                                    ' {{ kindIs "map" .Values.m }} {{ kindIs "slice" .Values.l }} {{ kindIs "bool" .Values.s }}',
                                    {"t": True, "f": False, "z": None, "n": 1, "s": "", "m": {}, "l": []}),
                             "true true false true true true true true true false")
            # required: nil and "" stop the rendering with its message; 0 and false pass.
            for value in ({}, {"a": ""}):
                with self.assertRaisesRegex(TemplateError, "execution error: a is required"):
                    render('{{ required "a is required" .Values.a }}', value)
            self.assertEqual(render('{{ required "m" .Values.a }} {{ required "m" .Values.b }}', {"a": 0, "b": False}),
                             "0 false")
            # .Capabilities.APIVersions.Has: Kubernetes' own APIs, and what the render is given.
            with open(os.path.join(tmp, "templates", "t.yaml"), "w") as f:
                f.write('{{ .Capabilities.APIVersions.Has "apps/v1" }} {{ .Capabilities.APIVersions.Has "x.io/v1/K" }}')
            self.assertEqual(Chart(tmp).render({})["t.yaml"], "true false")
            self.assertEqual(Chart(tmp).render({}, api_versions=["x.io/v1/K"])["t.yaml"], "true true")
            # Templates in a subdirectory render under their relative name.
            os.mkdir(os.path.join(tmp, "templates", "tests"))
            with open(os.path.join(tmp, "templates", "tests", "u.yaml"), "w") as f:
                f.write("{{ .Release.Name }}")
            self.assertEqual(Chart(tmp).render({}, release="r")["tests/u.yaml"], "r")

    def test_every_yaml_parses(self):
        paths = [p for p in glob.glob(os.path.join(DEPLOY, "**", "*.yaml"), recursive=True)
                 if os.sep + "templates" + os.sep not in p]
        self.assertGreaterEqual(len(paths), 6)
        for path in paths:
            with self.subTest(path=os.path.relpath(path, DEPLOY)):
                with open(path) as f:
                    self.assertTrue(list(yaml.safe_load_all(f)))
        with open(os.path.join(DEPLOY, "grafana", "dashboard.json")) as f:
            json.load(f)

    def test_example_and_chart_are_native_sidecar_deployments(self):
        example = load(os.path.join(DEPLOY, "k8s", "sidecar.yaml"))
        example_args = check_sidecar(self, example)
        # The example is sized for a GPU node; the chart with its sizes renders its flags.
        values = default_values()
        values["turbokvd"]["memoryBudget"] = "24GiB"
        values["turbokvd"]["spill"]["budget"] = "72GiB"
        objects, _ = rendered_chart(values, api_versions=MONITORING_APIS)
        self.assertEqual(check_sidecar(self, objects["Deployment"]), example_args)
        monitor = objects["PodMonitor"]
        pod_labels = objects["Deployment"]["spec"]["template"]["metadata"]["labels"]
        self.assertLessEqual(monitor["spec"]["selector"]["matchLabels"].items(), pod_labels.items())
        endpoint = monitor["spec"]["podMetricsEndpoints"][0]
        self.assertEqual(endpoint["port"], "metrics")
        # The job the alerts and the dashboard select.
        self.assertIn({"action": "replace", "targetLabel": "job", "replacement": "turbokvd"}, endpoint["relabelings"])
        # The chart's files/ render as their sources (copies of them:
        # test_chart_holds_no_symlink_and_its_files_are_their_sources).
        self.assertEqual(objects["PrometheusRule"]["spec"], load(os.path.join(DEPLOY, "prometheus", "alerts.yaml")))
        dashboard = json.loads(objects["ConfigMap"]["data"]["turbokvd.json"])
        with open(os.path.join(DEPLOY, "grafana", "dashboard.json")) as f:
            self.assertEqual(dashboard, json.load(f))
        self.assertEqual(objects["ConfigMap"]["metadata"]["labels"]["grafana_dashboard"], "1")

    def test_chart_holds_no_symlink_and_its_files_are_their_sources(self):
        # Before: files/alerts.yaml and files/dashboard.json were symlinks
        # out of the chart, to deploy/prometheus and deploy/grafana, which
        # Argo CD refuses by default. They are copies now, kept byte for byte
        # the files they come from, so that neither can drift.
        links = [os.path.relpath(os.path.join(directory, name), CHART)
                 for directory, subdirectories, files in os.walk(CHART)
                 for name in subdirectories + files if os.path.islink(os.path.join(directory, name))]
        self.assertEqual(links, [], "the chart holds symlinks: make them copies")
        for name, source in CHART_FILES.items():
            with self.subTest(name):
                with open(os.path.join(CHART, "files", name), "rb") as f:
                    chart_copy = f.read()
                with open(os.path.join(DEPLOY, source), "rb") as f:
                    self.assertTrue(chart_copy == f.read(), f"deploy/helm/turbokv/files/{name} differs from "
                                    f"deploy/{source}: cp deploy/{source} deploy/helm/turbokv/files/{name}")
        # Every file of files/ is one of them, and the templates read it.
        self.assertEqual(sorted(os.listdir(os.path.join(CHART, "files"))), sorted(CHART_FILES))
        templates = ""
        for path in glob.glob(os.path.join(CHART, "templates", "**", "*"), recursive=True):
            if os.path.isfile(path):
                with open(path) as f:
                    templates += f.read()
        for name in CHART_FILES:
            self.assertIn(f'.Files.Get "files/{name}"', templates)

    def test_sidecar_requests_no_gpu_by_default(self):
        # Before: each pod asked for 2 GPUs, one for a sidecar that did not
        # use it (turbokvd computed only on the CPU then). The sidecar gets a
        # GPU only with device cuda:N, and then sees it.
        example = load(os.path.join(DEPLOY, "k8s", "sidecar.yaml"))
        objects, notes = rendered_chart()
        for deployment in (example, objects["Deployment"]):
            spec = deployment["spec"]["template"]["spec"]
            sidecar = spec["initContainers"][0]
            self.assertIn("--device=cpu", sidecar["args"])
            self.assertFalse([r for side in sidecar["resources"].values() for r in side if "gpu" in r])
        # The worker's own GPU stays its choice: the example's asks for one.
        self.assertEqual(example["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"], 1)
        self.assertIn("requests no GPU", notes)
        values = default_values()
        values["turbokvd"]["device"] = "cuda:0"
        values["turbokvd"]["gpuResource"] = "nvidia.com/mig-3g.71gb"
        sidecar = workload(rendered_chart(values)[0])["spec"]["template"]["spec"]["initContainers"][0]
        self.assertEqual(sidecar["resources"]["limits"]["nvidia.com/mig-3g.71gb"], 1)
        self.assertEqual(sidecar["resources"]["requests"]["nvidia.com/mig-3g.71gb"], 1)
        self.assertNotIn("NVIDIA_VISIBLE_DEVICES", {e["name"] for e in sidecar["env"]})

    def test_empty_memory_budget_leaves_the_flag_out(self):
        # memoryBudget "" is turbokvd's own default (on a GPU, an arena of
        # 80% of its free memory; on the CPU, 4 GiB), which --memory-budget=0
        # does not ask for: turbokvd refuses 0.
        with open(os.path.join(CHART, "values.schema.json")) as f:
            schema = json.load(f)
        for device, notes_say in (("cpu", "the default: 4GiB"), ("cuda:0", "80% of the GPU's free memory")):
            with self.subTest(device):
                values = default_values()
                values["turbokvd"].update({"device": device, "memoryBudget": ""})
                jsonschema.validate(values, schema)
                objects, notes = rendered_chart(values)
                args = check_sidecar(self, objects["Deployment"])
                self.assertFalse([a for a in args if a.startswith("--memory-budget")], args)
                self.assertIn(notes_say, notes)
        for budget in ("0", "0GiB", "0.0MiB"):
            values = default_values()
            values["turbokvd"]["memoryBudget"] = budget
            with self.assertRaises(jsonschema.ValidationError, msg=budget):
                jsonschema.validate(values, schema)
        self.assertIn("--memory-budget=1GiB", check_sidecar(self, rendered_chart()[0]["Deployment"]))
        # The flags without --memory-budget start turbokvd with the CPU's 4 GiB.
        values = default_values()
        values["turbokvd"]["memoryBudget"] = ""
        args = check_sidecar(self, rendered_chart(values)[0]["Deployment"])
        with tempfile.TemporaryDirectory(prefix="turbokv-deploy-") as tmp:
            with local_turbokvd(self, args, tmp) as daemon:
                exposition = daemon.scrape()
        self.assertEqual(sample(exposition, "turbokv_memory_budget_bytes", device="cpu"), 4 << 30, exposition)

    def test_pods_pass_pod_security_restricted(self):
        # Before: no securityContext anywhere, so the namespace's "restricted"
        # admission rejected the pod.
        example = load(os.path.join(DEPLOY, "k8s", "sidecar.yaml"))
        for name, deployment in (("example", example), ("chart defaults", workload(rendered_chart()[0])),
                                 ("chart, every option", workload(rendered_chart(every_option_values())[0]))):
            with self.subTest(name):
                check_restricted(self, deployment["spec"]["template"])
                spec = deployment["spec"]["template"]["spec"]
                # The writable paths are volumes: the socket, spill and snapshot dirs, the worker's /tmp.
                sidecar_mounts = {m["mountPath"] for m in spec["initContainers"][0]["volumeMounts"]}
                self.assertEqual(len(sidecar_mounts), 3)
                self.assertIn("/tmp", {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]})
        # The helm test pod, one container.
        check_restricted(self, {"metadata": {}, "spec": rendered_chart()[0]["Pod"]["spec"]}, containers=1)
        # With the Redis tier: the worker's pod, and Redis' own, whose one
        # writable path is its data volume.
        for name, values in (("redis.deploy", redis_deploy_values()), ("redis.deploy, every option", redis_values())):
            with self.subTest(name):
                objects, _ = rendered_objects(values)
                check_restricted(self, worker_workload(objects)["spec"]["template"])
                pod = redis_objects(objects)["StatefulSet"]["spec"]["template"]
                check_restricted(self, pod, containers=1)
                self.assertEqual([m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]], ["/data"])
        # The checks catch what they are for.
        broken = copy.deepcopy(example["spec"]["template"])
        del broken["spec"]["initContainers"][0]["securityContext"]["capabilities"]
        with self.assertRaises(AssertionError):
            check_restricted(self, broken)

    @unittest.skipUnless(os.geteuid() == 0, "switching uids needs root")
    def test_non_root_worker_uses_the_socket_through_fs_group(self):
        # What the pod gives the processes: turbokvd as uid 10001 and the
        # worker as another uid, each with the fsGroup (10001) as a
        # supplementary group, and the socket's emptyDir owned by that group
        # with the setgid bit (as the kubelet sets an fsGroup volume up).
        # turbokvd's primary group is made different here, so that only the
        # fsGroup mechanism can let the worker in.
        # Before: no fsGroup and no shared group, and the worker got
        # Permission denied on the 0660 socket.
        example = load(os.path.join(DEPLOY, "k8s", "sidecar.yaml"))
        pod = example["spec"]["template"]["spec"]["securityContext"]
        group = pod["fsGroup"]
        with tempfile.TemporaryDirectory(prefix="turbokv-fsgroup-") as tmp:
            os.chmod(tmp, 0o755)
            socket_dir = os.path.join(tmp, "run")
            os.mkdir(socket_dir)
            os.chown(socket_dir, 0, group)
            os.chmod(socket_dir, 0o2770)
            target = f"unix://{socket_dir}/turbokv.sock"
            log = open(os.path.join(tmp, "log"), "w")
            daemon = subprocess.Popen(["setpriv", f"--reuid={pod['runAsUser']}", "--regid=20001", f"--groups={group}",
                                       os.environ["TURBOKVD"], f"--listen={target}", "--metrics-listen=",
                                       "--health-listen="], stderr=log)
            try:
                def cli(uid, groups):
                    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", f"--groups={groups}",
                                           os.environ["TURBOKV_CLI"], f"--target={target}", "stats"],
                                          capture_output=True, text=True, timeout=60)
                wait_listening(self, daemon, os.path.join(tmp, "log"))
                status = os.stat(os.path.join(socket_dir, "turbokv.sock"))
                self.assertEqual((status.st_mode & 0o777, status.st_gid), (0o660, group))
                worker = cli(1000, str(group))
                self.assertEqual(worker.returncode, 0, worker.stderr)
                outsider = cli(1000, "1000")
                self.assertNotEqual(outsider.returncode, 0)
            finally:
                daemon.send_signal(signal.SIGTERM)
                self.assertEqual(daemon.wait(timeout=60), 0)
                log.close()

    def test_chart_follows_helm_create_conventions(self):
        objects, notes = rendered_chart(api_versions=MONITORING_APIS)
        self.assertEqual(set(objects), {"Deployment", "Service", "Pod", "PodMonitor", "PrometheusRule", "ConfigMap"})
        with open(os.path.join(CHART, "Chart.yaml")) as f:
            chart = yaml.safe_load(f)
        for kind, obj in objects.items():
            labels = obj["metadata"]["labels"]
            # The helm test pod has a name of its own, out of the worker's selectors.
            self.assertEqual(labels["app.kubernetes.io/name"], "turbokv-test" if kind == "Pod" else "turbokv", kind)
            self.assertEqual(labels["app.kubernetes.io/instance"], "demo", kind)
            self.assertEqual(labels["app.kubernetes.io/version"], chart["appVersion"], kind)
            self.assertEqual(labels["app.kubernetes.io/managed-by"], "Helm", kind)
            self.assertEqual(labels["helm.sh/chart"], f"turbokv-{chart['version']}", kind)
            self.assertTrue(obj["metadata"]["name"].startswith("demo-turbokv"), kind)
        deployment = objects["Deployment"]
        self.assertEqual(deployment["spec"]["selector"]["matchLabels"],
                         {"app.kubernetes.io/name": "turbokv", "app.kubernetes.io/instance": "demo"})
        self.assertIn("unix:///run/turbokv/turbokv.sock", notes)
        # A long release name is cut to a valid name; one holding the chart's name is not repeated.
        long_name = workload(rendered_chart(release="r" * 70)[0])["metadata"]["name"]
        self.assertEqual(len(long_name), 63)
        self.assertEqual(workload(rendered_chart(release="my-turbokv")[0])["metadata"]["name"], "my-turbokv")
        # One replica: no PodDisruptionBudget (it would block drains or do nothing).
        self.assertNotIn("PodDisruptionBudget", objects)

    def test_values_are_documented_and_checked_by_the_schema(self):
        with open(os.path.join(CHART, "values.schema.json")) as f:
            schema = json.load(f)
        jsonschema.Draft7Validator.check_schema(schema)
        # The file as it is (the worker's image empty: the chart, not the
        # schema, refuses that, naming the value).
        jsonschema.validate(chart_values_file(), schema)
        jsonschema.validate(default_values(), schema)
        jsonschema.validate(every_option_values(), schema)
        jsonschema.validate(redis_values(), schema)
        for url in ("redis://redis.cache.svc:6379/2", "redis://10.0.0.7", "unix:///run/redis/redis.sock?db=3"):
            values = default_values()
            values["redis"]["url"] = url
            jsonschema.validate(values, schema)
        bad = [("replicas", "two", "'two' is not of type 'integer'"),
               ("turbokvd.device", "gpu0", "does not match"),
               ("turbokvd.eviction", "fifo", "is not one of"),
               ("turbokvd.resources.requests.nvidia.com/gpu", 1, "should not be valid"),
               ("turbokvd.snapshot.deadline", 20, "is not of type 'string'"),
               ("turbokvd.snapshot.enabled", "yes", "is not of type 'boolean', 'null'"),
               ("worker.imag", "x", "Additional properties are not allowed ('imag' was unexpected)"),
               ("redis.url", "http://redis:6379", "does not match"),
               ("redis.url", "redis://redis:6379/cache", "does not match"),
               ("redis.budget", "3Gi", "does not match"),
               ("redis.lease", 10, "is not of type 'string'"),
               ("redis.timeout", "1", "does not match"),
               ("redis.deploy.enabled", "yes", "is not of type 'boolean'"),
               ("redis.deploy.maxmemory", "0", "does not match"),
               ("redis.deploy.maxmemory", "4GiB", "does not match"),
               ("redis.deploy.image.tag", 7.0, "is not of type 'string'"),
               ("redis.deploy.persistence.accessModes", ["ReadWriteSometimes"], "is not one of"),
               ("redis.deploy.maxmemoryPolicy", "allkeys-lru", "Additional properties are not allowed")]
        for path, value, message in bad:
            with self.subTest(path):
                values = default_values()
                *parents, last = path.replace("nvidia.com/gpu", "nvidia*com/gpu").split(".")
                node = values
                for key in parents:
                    node = node[key]
                node[last.replace("*", ".")] = value
                with self.assertRaises(jsonschema.ValidationError) as error:
                    jsonschema.validate(values, schema)
                self.assertIn(message, error.exception.message)
        # Every value the chart defines has a comment on the line above it in
        # values.yaml (Kubernetes objects given whole, like resources, are
        # described by their own key's comment).
        with open(os.path.join(CHART, "values.yaml")) as f:
            lines = f.read().split("\n")

        def documented(properties, start, end, indent, prefix):
            for key, sub in properties.items():
                pattern = re.compile(" " * indent + re.escape(key) + ":")
                line = next((i for i in range(start, end) if pattern.match(lines[i])), None)
                self.assertIsNotNone(line, f"{prefix}{key} is not in values.yaml")
                self.assertTrue(lines[line - 1].strip().startswith("#"), f"{prefix}{key} has no comment")
                if sub.get("additionalProperties") is False:
                    stop = next((i for i in range(line + 1, end) if lines[i].strip() and not lines[i].startswith(" " * (indent + 1))
                                 and not lines[i].lstrip().startswith("#")), end)
                    documented(sub["properties"], line + 1, stop, indent + 2, f"{prefix}{key}.")
        documented(schema["properties"], 0, len(lines), 0, "")

    def test_chart_with_every_option(self):
        values = every_option_values()
        objects, notes = rendered_chart(values, api_versions=MONITORING_APIS)
        self.assertEqual(set(objects), {"StatefulSet", "Service", "Pod", "PodDisruptionBudget", "PodMonitor",
                                        "PrometheusRule", "ConfigMap"})
        statefulset = objects["StatefulSet"]
        check_sidecar(self, statefulset)
        pod = statefulset["spec"]["template"]
        spec = pod["spec"]
        sidecar, worker = spec["initContainers"][0], spec["containers"][0]
        self.assertEqual(statefulset["metadata"]["name"], "demo-kv")
        self.assertEqual(pod["metadata"]["labels"]["team"], "ml")
        self.assertEqual(pod["metadata"]["annotations"], values["podAnnotations"])
        for key in ("imagePullSecrets", "nodeSelector", "tolerations", "affinity", "priorityClassName", "serviceAccountName"):
            self.assertEqual(spec[key], values[key], key)
        self.assertIs(spec["automountServiceAccountToken"], False)
        self.assertIn({"name": "models", "persistentVolumeClaim": {"claimName": "models"}}, spec["volumes"])
        self.assertEqual(worker["command"], values["worker"]["command"])
        self.assertEqual(worker["args"], values["worker"]["args"])
        self.assertIn({"name": "LOG_LEVEL", "value": "debug"}, worker["env"])
        self.assertEqual(worker["envFrom"], values["worker"]["envFrom"])
        self.assertEqual(worker["ports"], values["worker"]["ports"])
        self.assertIn({"name": "models", "mountPath": "/models", "readOnly": True}, worker["volumeMounts"])
        self.assertEqual(worker["securityContext"]["runAsUser"], 1000)
        self.assertEqual(sidecar["image"], "registry.example.com/turbokvd:0.1.1")
        self.assertEqual(sidecar["args"][-1], "--max-sessions=2000")
        # KV events on the pod's address, their ports named for a router to dial.
        for flag in ("--kv-events-endpoint=tcp://$(POD_IP):5557", "--kv-events-replay-endpoint=tcp://$(POD_IP):5558",
                     "--kv-events-topic=kv@$(POD_IP)@demo-model", "--kv-events-hashes=bytes",
                     "--kv-events-dp-rank=2"):
            self.assertIn(flag, sidecar["args"])
        self.assertLessEqual({"kv-events": 5557, "kv-replay": 5558}.items(),
                             {p["name"]: p["containerPort"] for p in sidecar["ports"]}.items())
        self.assertIn("--threads=6", sidecar["args"])
        self.assertIn({"name": "MALLOC_ARENA_MAX", "value": "4"}, sidecar["env"])
        self.assertEqual(sidecar["resources"]["limits"]["nvidia.com/gpu"], 1)
        claim = statefulset["spec"]["volumeClaimTemplates"][0]["spec"]
        self.assertEqual((claim["storageClassName"], claim["resources"]["requests"]["storage"]), ("fast-ssd", "4Gi"))
        # The StatefulSet's governing Service exists: the chart's headless one.
        self.assertEqual(statefulset["spec"]["serviceName"], objects["Service"]["metadata"]["name"])
        self.assertEqual(objects["Service"]["spec"]["clusterIP"], "None")
        self.assertIn("survive a node drain", notes)
        pdb = objects["PodDisruptionBudget"]
        self.assertEqual(pdb["spec"]["maxUnavailable"], 1)
        self.assertLessEqual(pdb["spec"]["selector"]["matchLabels"].items(), pod["metadata"]["labels"].items())
        # kube-prometheus-stack's default selectors match release=<its release>.
        for kind in ("PodMonitor", "PrometheusRule"):
            self.assertEqual(objects[kind]["metadata"]["labels"]["release"], "kube-prometheus-stack", kind)
        rules = [r for g in objects["PrometheusRule"]["spec"]["groups"] for r in g["rules"]]
        self.assertTrue(all(r["annotations"]["runbook_url"].startswith(values["prometheusRule"]["runbookUrl"] + "#")
                            for r in rules))
        dashboard = objects["ConfigMap"]["metadata"]
        self.assertEqual((dashboard["namespace"], dashboard["annotations"]), ("monitoring", {"grafana_folder": "ML"}))
        values["podDisruptionBudget"]["minAvailable"] = 2
        test_pod = objects["Pod"]["spec"]
        self.assertEqual(test_pod["imagePullSecrets"], values["imagePullSecrets"])
        self.assertEqual((test_pod["containers"][0]["image"], test_pod["containers"][0]["imagePullPolicy"]),
                         (f"mirror.example.com/grpc-health-probe:{values['test']['image']['tag']}", "Always"))
        self.assertEqual(rendered_chart(values)[0]["PodDisruptionBudget"]["spec"], {
            "minAvailable": 2, "selector": pdb["spec"]["selector"]})

    def test_chart_switches(self):
        values = default_values()
        for key in ("podMonitor", "prometheusRule", "grafanaDashboard"):
            values[key]["enabled"] = False
        for key in ("spill", "snapshot"):
            values["turbokvd"][key]["enabled"] = False
        values["worker"]["tmpDir"]["enabled"] = False
        objects, notes = rendered_chart(values, api_versions=MONITORING_APIS)
        self.assertEqual(set(objects), {"Deployment", "Service", "Pod"})
        spec = objects["Deployment"]["spec"]["template"]["spec"]
        self.assertEqual([v["name"] for v in spec["volumes"]], ["turbokv-socket"])
        self.assertFalse([a for a in spec["initContainers"][0]["args"] if a.startswith(("--spill", "--snapshot"))])
        self.assertIn("Snapshots are off", notes)

    def test_chart_installs_without_the_prometheus_operator(self):
        # Before: the defaults rendered a PodMonitor and a PrometheusRule,
        # and an install on a cluster without the operator's CRDs failed
        # ("no matches for kind PodMonitor"). They follow the cluster's APIs.
        objects, notes = rendered_chart()
        self.assertEqual(set(objects), {"Deployment", "Service", "Pod", "ConfigMap"})
        self.assertIn("No PodMonitor: the cluster serves no monitoring.coreos.com/v1 PodMonitor", notes)
        self.assertIn("No PrometheusRule", notes)
        objects, notes = rendered_chart(api_versions=MONITORING_APIS)
        self.assertEqual({"PodMonitor", "PrometheusRule"} & set(objects), {"PodMonitor", "PrometheusRule"})
        self.assertIn("scraped through PodMonitor demo-turbokv", notes)
        self.assertNotIn("No PodMonitor", notes)
        # Each is rendered by its own resource (a cluster may serve PodMonitor
        # without PrometheusRule); the group alone is not enough.
        for served, kinds in ((["monitoring.coreos.com/v1/PodMonitor"], {"PodMonitor"}),
                              (["monitoring.coreos.com/v1/PrometheusRule"], {"PrometheusRule"}),
                              (["monitoring.coreos.com/v1"], set())):
            with self.subTest(served=served):
                objects, _ = rendered_chart(api_versions=served)
                self.assertEqual({"PodMonitor", "PrometheusRule"} & set(objects), kinds)
        # Switched off, neither is rendered even where the APIs are served.
        values = default_values()
        values["podMonitor"]["enabled"] = values["prometheusRule"]["enabled"] = False
        objects, notes = rendered_chart(values, api_versions=MONITORING_APIS)
        self.assertFalse({"PodMonitor", "PrometheusRule"} & set(objects))
        self.assertNotIn("No PodMonitor", notes)

    def test_chart_requires_the_worker_image(self):
        # Before: registry.example.com/inference-worker:latest, an image that
        # does not exist, was installed as is. The schema takes the empty
        # defaults; the render fails naming the value.
        values = chart_values_file()
        self.assertEqual(values["worker"]["image"], {"repository": "", "tag": "", "pullPolicy": "IfNotPresent"})
        values["turbokvd"]["image"].update({"repository": "registry.example.com/turbokvd", "tag": "0.1.0"})
        with self.assertRaisesRegex(TemplateError, r"worker\.image\.repository is required"):
            rendered_objects(values)
        values["worker"]["image"]["repository"] = "registry.example.com/inference-worker"
        with self.assertRaisesRegex(TemplateError, r"worker\.image\.tag is required"):
            rendered_objects(values)
        values["worker"]["image"]["tag"] = "2.1"
        worker = workload(rendered_chart(values)[0])["spec"]["template"]["spec"]["containers"][0]
        self.assertEqual(worker["image"], "registry.example.com/inference-worker:2.1")

    def test_chart_requires_the_turbokvd_image(self):
        # Before: ghcr.io/turbokv/turbokvd:<appVersion>, an image nothing
        # here publishes, was installed as is and the pod never pulled it.
        # As for the worker's image, the schema takes the empty defaults and
        # the render fails, naming the value and saying how to build and
        # push the image.
        values = chart_values_file()
        self.assertEqual(values["turbokvd"]["image"], {"repository": "", "tag": "", "pullPolicy": "IfNotPresent"})
        values["worker"]["image"].update({"repository": "registry.example.com/inference-worker", "tag": "2.1"})
        build = re.escape("docker build -f deploy/docker/Dockerfile -t REGISTRY/turbokvd:TAG .")
        push = re.escape("docker push REGISTRY/turbokvd:TAG")
        for missing, other in (("repository", "tag"), ("tag", "repository")):
            with self.subTest(missing):
                values["turbokvd"]["image"].update({missing: "", other: "x"})
                with self.assertRaisesRegex(TemplateError, rf"turbokvd\.image\.{missing} is required: .*{build}.*{push}.*"
                                            r"--set turbokvd\.image\.repository=REGISTRY/turbokvd "
                                            r"--set turbokvd\.image\.tag=TAG"):
                    rendered_objects(values)
        values["turbokvd"]["image"].update({"repository": "registry.example.com/turbokvd", "tag": "0.1.0-rc1"})
        sidecar = workload(rendered_chart(values)[0])["spec"]["template"]["spec"]["initContainers"][0]
        self.assertEqual(sidecar["image"], "registry.example.com/turbokvd:0.1.0-rc1")
        # The unpublished image named nowhere in the chart: not in
        # values.yaml, the templates or the chart's README.
        for path in [os.path.join(CHART, "values.yaml"), os.path.join(CHART, "README.md")] + \
                glob.glob(os.path.join(CHART, "templates", "**", "*"), recursive=True):
            if os.path.isfile(path):
                with open(path) as f:
                    self.assertNotIn("ghcr.io/turbokv", f.read(), path)
        # The chart's README says it is required, how to build and push it,
        # and installs with it.
        with open(os.path.join(CHART, "README.md")) as f:
            readme = f.read()
        rows = dict(re.findall(r"^\| `([^`]+)` \| `[^`]*` \| (.+) \|$", readme, re.M))
        for key in ("repository", "tag"):
            self.assertTrue(rows[f"turbokvd.image.{key}"].startswith("**Required.**"), key)
        installing = readme.split("## Installing", 1)[1].split("\n## ", 1)[0]
        for text in ("docker build -f deploy/docker/Dockerfile", "docker push", "--set turbokvd.image.repository=",
                     "--set turbokvd.image.tag="):
            self.assertIn(text, installing)

    def test_chart_defaults_fit_a_small_node_and_request_a_gpu_only_when_asked(self):
        # Before: each pod requested 12 CPUs, 60 GiB and a GPU. Now the pod
        # fits a node of 2 CPUs and 8 GiB, with no GPU.
        pod = workload(rendered_chart()[0])["spec"]["template"]["spec"]
        containers = pod["initContainers"] + pod["containers"]
        requests = [c["resources"].get("requests", {}) for c in containers]
        self.assertLessEqual(sum(quantity(r.get("cpu", 0)) for r in requests), 2)
        self.assertLessEqual(sum(quantity(r.get("memory", 0)) for r in requests), 8 << 30)
        for container in containers:
            for side in ("requests", "limits"):
                self.assertFalse([r for r in container["resources"].get(side, {}) if "gpu" in r], container["name"])
        # turbokvd's memory limit holds its budget and the process.
        sidecar = pod["initContainers"][0]
        budget = next(a for a in sidecar["args"] if a.startswith("--memory-budget=")).split("=")[1]
        self.assertEqual(budget, "1GiB")
        self.assertGreaterEqual(quantity(sidecar["resources"]["limits"]["memory"]), quantity("1Gi") + quantity("2Gi"))
        # A GPU for the sidecar with device cuda:N, for the worker when its resources name one.
        values = default_values()
        values["turbokvd"]["device"] = "cuda:0"
        values["worker"]["resources"]["limits"]["nvidia.com/gpu"] = 1
        pod = workload(rendered_chart(values)[0])["spec"]["template"]["spec"]
        self.assertEqual(pod["initContainers"][0]["resources"]["requests"]["nvidia.com/gpu"], 1)
        self.assertEqual(pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"], 1)

    def test_helm_test_hook_asks_turbokvd_health(self):
        objects, _ = rendered_chart(api_versions=MONITORING_APIS)
        hook, service, deployment = objects["Pod"], objects["Service"], objects["Deployment"]
        self.assertEqual(hook["metadata"]["annotations"]["helm.sh/hook"], "test")
        self.assertEqual(hook["spec"]["restartPolicy"], "Never")
        container = hook["spec"]["containers"][0]
        self.assertTrue(container["image"].startswith("ghcr.io/grpc-ecosystem/grpc-health-probe:v"))
        flags = dict(a.split("=", 1) for a in container["args"])
        # grpc_health_probe -addr=<the headless Service>:<its health port> ...
        host, port = flags["-addr"].rsplit(":", 1)
        self.assertEqual(host, service["metadata"]["name"])
        service_port = next(p for p in service["spec"]["ports"] if p["port"] == int(port))
        # ... which lands on turbokvd's --health-listen port, in the worker's pods.
        template = deployment["spec"]["template"]
        sidecar = template["spec"]["initContainers"][0]
        self.assertEqual(service_port["targetPort"], "health")
        args = dict(a.split("=", 1) for a in check_sidecar(self, deployment))
        self.assertEqual({p["name"]: p["containerPort"] for p in sidecar["ports"]}["health"],
                         int(args["--health-listen"].rsplit(":", 1)[1]))
        self.assertLessEqual(service["spec"]["selector"].items(), template["metadata"]["labels"].items())
        # The hook pod is none of the worker's pods: no selector takes it in.
        labels = hook["metadata"]["labels"]
        values = default_values()
        values["replicas"] = 3
        pdb = rendered_chart(values)[0]["PodDisruptionBudget"]
        for selector in (deployment["spec"]["selector"]["matchLabels"], service["spec"]["selector"],
                         pdb["spec"]["selector"]["matchLabels"]):
            self.assertFalse(selector.items() <= labels.items(), selector)
        # That port of a turbokvd started with the chart's flags answers
        # grpc.health.v1 SERVING: the CLI's health check passes there (its
        # Stats call then is UNIMPLEMENTED, the listener serving health
        # alone), where a port with nothing behind it gets no answer.
        with tempfile.TemporaryDirectory(prefix="turbokv-deploy-") as tmp:
            with local_turbokvd(self, sidecar["args"], tmp) as daemon:
                for target, said in ((daemon.health, "UNIMPLEMENTED"), (f"127.0.0.1:{free_ports(1)[0]}", "no answer from")):
                    run = subprocess.run([os.environ["TURBOKV_CLI"], f"--target={target}", "--timeout=2s", "stats"],
                                         capture_output=True, text=True, timeout=60)
                    self.assertNotEqual(run.returncode, 0)
                    self.assertIn(said, run.stderr)
                    self.assertNotIn("no answer from" if said == "UNIMPLEMENTED" else "UNIMPLEMENTED", run.stderr)

    def test_chart_readme_documents_every_value(self):
        # The chart's README has a table of every value (the leaves of
        # values.schema.json's closed objects) with its default as in
        # values.yaml, and no value that does not exist.
        with open(os.path.join(CHART, "values.schema.json")) as f:
            schema = json.load(f)
        with open(os.path.join(CHART, "README.md")) as f:
            readme = f.read()
        rows = re.findall(r"^\| `([^`]+)` \| `([^`]*)` \| (.+) \|$", readme, re.M)
        names = [name for name, _, _ in rows]
        self.assertEqual(len(names), len(set(names)), "a value is listed twice")
        leaves = value_leaves(schema["properties"])
        self.assertEqual(set(names), set(leaves))
        values = chart_values_file()
        for name, default, meaning in rows:
            with self.subTest(name):
                node = values
                for key in name.split("."):
                    node = node[key]
                self.assertEqual(yaml.safe_load(default), node)
                self.assertGreater(len(meaning.strip()), 10)
        # The images: turbokvd's is built from deploy/docker/Dockerfile, and
        # its GPU path has not run in a pod.
        self.assertIn("deploy/docker/Dockerfile", readme)
        self.assertIn("untested on Kubernetes", readme)

    def test_chart_with_redis_deploy(self):
        objects, notes = rendered_objects(redis_deploy_values(), api_versions=MONITORING_APIS)
        redis = redis_objects(objects)
        self.assertEqual(set(redis), {"StatefulSet", "Service", "NetworkPolicy", "Secret"})
        self.assertEqual(sorted(o["kind"] for o in objects if o not in redis.values()),
                         ["ConfigMap", "Deployment", "Pod", "PodMonitor", "PrometheusRule", "Service"])
        deployment = worker_workload(objects)
        flags = dict(a.split("=", 1) for a in check_sidecar(self, deployment))
        statefulset, service = redis["StatefulSet"], redis["Service"]
        # turbokvd's --redis-url is the Service, in the release's namespace, on its port.
        port = service["spec"]["ports"][0]
        self.assertEqual(flags["--redis-url"], f"redis://{service['metadata']['name']}.default.svc:{port['port']}")
        self.assertEqual((flags["--redis-budget"], flags["--redis-lease"], flags["--redis-timeout"]), ("3GiB", "10s", "1s"))
        self.assertEqual(statefulset["spec"]["replicas"], 1)
        self.assertEqual(statefulset["spec"]["serviceName"], service["metadata"]["name"])
        pod = statefulset["spec"]["template"]
        labels = pod["metadata"]["labels"]
        self.assertLessEqual(service["spec"]["selector"].items(), labels.items())
        self.assertLessEqual(statefulset["spec"]["selector"]["matchLabels"].items(), labels.items())
        # The worker's selectors (its Deployment's, the PodMonitor's, a
        # PodDisruptionBudget's) do not take Redis' pod in.
        self.assertFalse(deployment["spec"]["selector"]["matchLabels"].items() <= labels.items())
        container = pod["spec"]["containers"][0]
        self.assertEqual(container["image"], "redis:7.0")
        self.assertEqual({p["name"]: p["containerPort"] for p in container["ports"]}[port["targetPort"]], 6379)
        # Redis' arguments, --option value pairs: what turbokvd needs of it.
        options = dict(zip(container["args"][::2], container["args"][1::2]))
        self.assertEqual(len(options) * 2, len(container["args"]))
        self.assertEqual((options["--maxmemory"], options["--maxmemory-policy"], options["--appendonly"]),
                         ("4gb", "noeviction", "yes"))
        self.assertEqual(options["--port"], "6379")
        self.assertEqual(container["readinessProbe"]["exec"]["command"], ["redis-cli", "-e", "ping"])
        # A password of its own, random, from its Secret: Redis's, its
        # probe's (redis-cli reads $REDISCLI_AUTH) and turbokvd's; protected
        # mode on.
        secret = redis["Secret"]
        self.assertRegex(redis_password(objects), r"^[A-Za-z0-9]{32}$")
        self.assertEqual((options["--requirepass"], options["--protected-mode"]), ("$(REDIS_PASSWORD)", "yes"))
        reference = {"secretKeyRef": {"name": secret["metadata"]["name"], "key": "password"}}
        self.assertEqual({e["name"]: e["valueFrom"] for e in container["env"]},
                         {"REDIS_PASSWORD": reference, "REDISCLI_AUTH": reference})
        turbokvd_env = {e["name"]: e.get("valueFrom") for e in deployment["spec"]["template"]["spec"]["initContainers"][0]["env"]}
        self.assertEqual(turbokvd_env["TURBOKV_REDIS_PASSWORD"], reference)
        self.assertNotIn("--redis-user", flags)
        # The append-only file on a bounded emptyDir.
        self.assertEqual(container["volumeMounts"], [{"name": "data", "mountPath": options["--dir"]}])
        self.assertEqual(pod["spec"]["volumes"], [{"name": "data", "emptyDir": {"sizeLimit": "16Gi"}}])
        self.assertNotIn("volumeClaimTemplates", statefulset["spec"])
        self.assertIn("limits", container["resources"])
        # Only the release's turbokvd pods reach Redis' port.
        policy = redis["NetworkPolicy"]["spec"]
        self.assertLessEqual(policy["podSelector"]["matchLabels"].items(), labels.items())
        self.assertEqual(len(policy["ingress"]), 1)
        self.assertEqual(policy["ingress"][0]["ports"], [{"port": 6379}])
        sources = policy["ingress"][0]["from"]
        self.assertEqual(len(sources), 1)
        self.assertEqual(set(sources[0]), {"podSelector"})
        self.assertLessEqual(sources[0]["podSelector"]["matchLabels"].items(),
                             deployment["spec"]["template"]["metadata"]["labels"].items())
        self.assertIn(f"Redis at {flags['--redis-url']}", notes)
        self.assertIn("Snapshots are off: the Redis tier keeps the sessions", notes)
        # The longest release name Helm takes (53): a StatefulSet name its
        # pods' revision label can hold (52), and labels of 63 characters at most.
        long = redis_objects(rendered_objects(redis_deploy_values(), release="r" * 53)[0])
        self.assertEqual(len(long["StatefulSet"]["metadata"]["name"]), 52)
        for kind, obj in long.items():
            self.assertTrue(obj["metadata"]["name"].endswith("-redis-auth" if kind == "Secret" else "-redis"), kind)
            self.assertLessEqual(len(obj["metadata"]["name"]), 63, kind)
            for value in obj["metadata"]["labels"].values():
                self.assertLessEqual(len(value), 63, kind)

    def test_chart_with_every_redis_option(self):
        values = redis_values()
        objects, _ = rendered_objects(values)
        statefulset = redis_objects(objects)["StatefulSet"]
        spec = statefulset["spec"]["template"]["spec"]
        container = spec["containers"][0]
        self.assertEqual(container["image"], "mirror.example.com/redis:7.0.15")
        self.assertEqual(spec["imagePullSecrets"], [{"name": "regcred"}])
        self.assertIn("16gb", container["args"])
        # The append-only file on a claim instead of the emptyDir.
        self.assertNotIn("volumes", spec)
        claim = statefulset["spec"]["volumeClaimTemplates"][0]
        self.assertEqual(claim["metadata"]["name"], container["volumeMounts"][0]["name"])
        self.assertEqual((claim["spec"]["storageClassName"], claim["spec"]["resources"]["requests"]["storage"],
                          claim["spec"]["accessModes"]), ("fast-ssd", "48Gi", ["ReadWriteOnce"]))
        args = worker_workload(objects)["spec"]["template"]["spec"]["initContainers"][0]["args"]
        for flag in ("--redis-budget=12GiB", "--redis-lease=6s", "--redis-timeout=500ms", "--redis-user=turbokv"):
            self.assertIn(flag, args)
        # The password from the Secret given: no Secret made; Redis and turbokvd read that one.
        self.assertNotIn("Secret", redis_objects(objects))
        reference = {"secretKeyRef": {"name": "redis-credentials", "key": "password"}}
        self.assertEqual({e["name"]: e["valueFrom"] for e in container["env"]}["REDIS_PASSWORD"], reference)
        turbokvd = worker_workload(objects)["spec"]["template"]["spec"]["initContainers"][0]
        self.assertEqual({e["name"]: e.get("valueFrom") for e in turbokvd["env"]}["TURBOKV_REDIS_PASSWORD"], reference)
        # turbokvd.snapshot.persistence.enabled left on while snapshots are
        # off (as they must be with Redis): the worker stays a Deployment,
        # with no snapshot claim; Redis' StatefulSet is the only one.
        values["turbokvd"]["snapshot"]["persistence"]["enabled"] = True
        objects, _ = rendered_objects(values)
        worker = worker_workload(objects)
        self.assertEqual(worker["kind"], "Deployment")
        check_sidecar(self, worker)
        self.assertEqual([o["kind"] for o in objects].count("StatefulSet"), 1)

    def test_chart_with_an_existing_redis(self):
        values = default_values()
        values["turbokvd"]["spill"]["enabled"] = False
        values["turbokvd"]["snapshot"]["enabled"] = False
        values["redis"]["url"] = "redis://redis.cache.svc:6379/2"
        objects, notes = rendered_chart(values)
        self.assertEqual(set(objects), {"Deployment", "Service", "Pod", "ConfigMap"})
        args = check_sidecar(self, objects["Deployment"])
        self.assertIn("--redis-url=redis://redis.cache.svc:6379/2", args)
        self.assertIn("Redis at redis://redis.cache.svc:6379/2", notes)
        self.assertNotIn("redis.deploy", notes)
        # No password given: none asked of turbokvd.
        self.assertNotIn("TURBOKV_REDIS_PASSWORD", {e["name"] for e in objects["Deployment"]["spec"]["template"]["spec"]
                                                    ["initContainers"][0]["env"]})

    def test_chart_refuses_snapshots_with_redis_and_two_redis_and_stacks_the_disk_on_it(self):
        # turbokvd refuses --snapshot-dir with --redis-url: snapshots asked
        # for (turbokvd.snapshot.enabled=true) beside the Redis tier are
        # refused before anything is installed, naming both values. Before:
        # snapshots went to turbokvd beside --redis-url, and a snapshot
        # loaded at the next start brought back a session another turbokvd
        # held since the drain. The spill dir goes with Redis: the disk
        # stacked between memory and Redis.
        for key, value in (("url", "redis://redis.cache.svc:6379"), ("deploy", {"enabled": True})):
            named = r"redis\.url" if key == "url" else r"redis\.deploy\.enabled"
            refusal = (rf"turbokvd\.snapshot\.enabled=true and {named} cannot go together: "
                       r"turbokvd refuses --snapshot-dir with --redis-url.*"
                       r"leave turbokvd\.snapshot\.enabled unset .* or set it to false$")
            for spill in (True, False):
                with self.subTest(key, spill=spill):
                    values = default_values()
                    values["turbokvd"]["spill"]["enabled"] = spill
                    values["turbokvd"]["snapshot"]["enabled"] = True
                    if key == "url":
                        values["redis"]["url"] = value
                    else:
                        values["redis"]["deploy"].update(value)
                    with self.assertRaisesRegex(TemplateError, refusal):
                        rendered_objects(values)
                    # Snapshots on claims refused alike (a StatefulSet otherwise).
                    values["turbokvd"]["snapshot"]["persistence"]["enabled"] = True
                    with self.assertRaisesRegex(TemplateError, refusal):
                        rendered_objects(values)
                    values["turbokvd"]["snapshot"]["persistence"]["enabled"] = False
                    values["turbokvd"]["snapshot"]["enabled"] = False
                    objects, _ = rendered_objects(values)
                    args = check_sidecar(self, worker_workload(objects))
                    self.assertIn("--redis-url", " ".join(args))
                    self.assertEqual(spill, any(a.startswith("--spill-dir=") for a in args))
        values = redis_deploy_values()
        values["redis"]["url"] = "redis://redis.cache.svc:6379"
        with self.assertRaisesRegex(TemplateError, r"redis\.url and redis\.deploy\.enabled are both set"):
            rendered_objects(values)

    def test_chart_with_only_the_redis_tier_set_leaves_snapshots_off(self):
        # Before: setting only redis.url (or redis.deploy.enabled) failed the
        # render, since snapshots were on by default and turbokvd refuses
        # --snapshot-dir with --redis-url (service/server.cc), and the values
        # table did not say so. turbokvd.snapshot.enabled is now unset
        # (null) by default: snapshots follow the Redis tier, on without it
        # and off with it; true asks for them (refused with the tier), false
        # turns them off.
        self.assertIsNone(chart_values_file()["turbokvd"]["snapshot"]["enabled"])
        for key, value in (("url", "redis://redis.cache.svc:6379/2"), ("deploy", {"enabled": True})):
            for persistence in (False, True):
                with self.subTest(key, persistence=persistence):
                    values = default_values()
                    values["turbokvd"]["snapshot"]["persistence"]["enabled"] = persistence
                    if key == "url":
                        values["redis"]["url"] = value
                    else:
                        values["redis"]["deploy"].update(value)
                    objects, notes = rendered_objects(values)
                    worker = worker_workload(objects)
                    args = check_sidecar(self, worker)
                    self.assertFalse([a for a in args if a.startswith("--snapshot")], args)
                    self.assertTrue([a for a in args if a.startswith("--redis-url=")], args)
                    # The disk tier stays on (stacked over Redis), as by default.
                    self.assertTrue([a for a in args if a.startswith("--spill-dir=")], args)
                    # No snapshot claim, so no StatefulSet for the worker.
                    self.assertEqual(worker["kind"], "Deployment")
                    self.assertIn("Snapshots are off: the Redis tier keeps the sessions", notes)
        # Without the Redis tier the default keeps snapshots on, and false
        # turns them off.
        args = check_sidecar(self, rendered_chart()[0]["Deployment"])
        self.assertTrue([a for a in args if a.startswith("--snapshot-dir=")], args)
        values = default_values()
        values["turbokvd"]["snapshot"]["enabled"] = False
        args = check_sidecar(self, rendered_chart(values)[0]["Deployment"])
        self.assertFalse([a for a in args if a.startswith("--snapshot")], args)
        # The schema takes the three.
        with open(os.path.join(CHART, "values.schema.json")) as f:
            schema = json.load(f)
        for enabled in (None, True, False):
            values = default_values()
            values["turbokvd"]["snapshot"]["enabled"] = enabled
            jsonschema.validate(values, schema)
        # The values table says what the default does beside the Redis
        # tier, and the Redis values say it.
        with open(os.path.join(CHART, "README.md")) as f:
            rows = dict(re.findall(r"^\| `([^`]+)` \| `[^`]*` \| (.+) \|$", f.read(), re.M))
        for name in ("turbokvd.snapshot.enabled", "redis.url", "redis.deploy.enabled"):
            for text in ("turbokvd.snapshot.enabled", "redis.url", "redis.deploy.enabled", "off"):
                if text != name:
                    self.assertIn(text, rows[name], name)

    def test_chart_redis_keeps_sessions_across_its_restart_for_another_turbokvd(self):
        # The chart's Redis, run here with its arguments: turbokvd a writes a
        # session through to it and drains (its tail flushed, its lease
        # released); Redis restarts from its append-only file; turbokvd b,
        # another pod, takes the session over whole at once.
        objects, _ = rendered_objects(redis_deploy_values())
        args = worker_workload(objects)["spec"]["template"]["spec"]["initContainers"][0]["args"]
        # No snapshots (turbokvd refuses --snapshot-dir with --redis-url): the
        # session comes back through Redis alone.
        self.assertFalse([a for a in args if a.startswith(("--snapshot", "--spill"))], args)
        container = redis_objects(objects)["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]
        with tempfile.TemporaryDirectory(prefix="turbokv-redis-") as tmp:
            for name in ("a", "b"):
                os.mkdir(os.path.join(tmp, name))
            password = redis_password(objects)
            redis = LocalRedis(self, container, os.path.join(tmp, "data"), password)
            try:
                redis.start()
                for key, value in (("maxmemory", str(4 << 30)), ("maxmemory-policy", "noeviction"),
                                   ("appendonly", "yes"), ("save", "")):
                    self.assertEqual(redis.cli("config", "get", key).split("\n"), [key, value] if value else [key])
                url = f"redis://127.0.0.1:{redis.port}"
                with local_turbokvd(self, args, os.path.join(tmp, "a"), password, redis_url=url) as a:
                    session = a.cli("create", "--layers=1", "--kv-heads=1", "--q-heads=1")
                    a.cli("append-random", session, "--tokens=100")  # a sealed page of 64 tokens and a tail
                self.assertGreater(int(redis.cli("dbsize")), 0)
                redis.stop()
                redis.start()
                with local_turbokvd(self, args, os.path.join(tmp, "b"), password, redis_url=url) as b:
                    self.assertRegex(b.cli("get", session), r"\blayer_tokens +100\n")
                    b.cli("attend-random", session, "--calls=1")
                    self.assertGreaterEqual(sample(b.scrape(), "turbokv_takeovers_total", result="ok"), 1)
            finally:
                redis.stop()

    def test_alert_rules_pass_promtool_and_every_alert_is_tested(self):
        directory = os.path.join(DEPLOY, "prometheus")
        for command in (["promtool", "check", "rules", "alerts.yaml"], ["promtool", "test", "rules", "alerts_test.yaml"]):
            run = subprocess.run(command, cwd=directory, capture_output=True, text=True, timeout=120)
            self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        rules = [r for g in load(os.path.join(directory, "alerts.yaml"))["groups"] for r in g["rules"]]
        names = {r["alert"] for r in rules}
        for name in ("TurbokvDown", "TurbokvAbsent", "TurbokvRestarted", "TurbokvServerErrors", "TurbokvClientErrors",
                     "TurbokvRemoteTierDown", "TurbokvDecodeLatencyHigh", "TurbokvSnapshotRestoreIncomplete"):
            self.assertIn(name, names)
        cases = [c for t in load(os.path.join(directory, "alerts_test.yaml"))["tests"] for c in t["alert_rule_test"]]
        self.assertEqual({c["alertname"] for c in cases if c["exp_alerts"]}, names, "an alert never fires in the tests")
        self.assertEqual({c["alertname"] for c in cases if not c["exp_alerts"]}, names, "an alert always fires in the tests")
        by_name = {r["alert"]: r for r in rules}
        # Server-caused errors by the daemon's own side label, not a list of codes.
        for name, side in (("TurbokvServerErrors", "server"), ("TurbokvClientErrors", "client")):
            self.assertIn(f'side="{side}"', by_name[name]["expr"])
            self.assertNotIn("code", by_name[name]["expr"])
        self.assertIn('up{job="turbokvd"} == 0', by_name["TurbokvDown"]["expr"])
        self.assertIn('absent(up{job="turbokvd"})', by_name["TurbokvAbsent"]["expr"])
        self.assertIn("process_start_time_seconds", by_name["TurbokvRestarted"]["expr"])
        self.assertEqual(by_name["TurbokvRemoteTierDown"]["expr"], 'turbokv_tier_up{job="turbokvd",tier="redis"} == 0')
        self.assertEqual((by_name["TurbokvRemoteTierDown"]["for"], by_name["TurbokvRemoteTierDown"]["labels"]),
                         ("2m", {"severity": "warning"}))
        self.assertIn('method="Decode"', by_name["TurbokvDecodeLatencyHigh"]["expr"])
        self.assertIn('turbokv_snapshot_restored_sessions{job="turbokvd",state=~"unverified|failed"}',
                      by_name["TurbokvSnapshotRestoreIncomplete"]["expr"])
        # Each runbook_url is a section of docs/OPERATIONS.md.
        with open(os.path.join(ROOT, "docs", "OPERATIONS.md")) as f:
            headings = re.findall(r"^#+ (.+)$", f.read(), re.M)
        anchors = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
        for rule in rules:
            url = rule["annotations"]["runbook_url"]
            page, _, anchor = url.partition("#")
            self.assertEqual(page, RUNBOOK, rule["alert"])
            self.assertIn(anchor, anchors, rule["alert"])

    def test_runbook_links_have_one_documented_base_the_chart_can_move(self):
        # Before: every runbook_url pointed at RUNBOOK, a home no document
        # named, and an operator could not tell where the links lead nor how
        # to point them at a fork. The base is one string, the same in the
        # rules, their tests, the chart's default and its template; the
        # docs name it and say how to move it (prometheusRule.runbookUrl, or
        # a sed of the rule file for a Prometheus without the operator).
        rules = [r for g in load(os.path.join(DEPLOY, "prometheus", "alerts.yaml"))["groups"] for r in g["rules"]]
        for rule in rules:
            self.assertEqual(rule["annotations"]["runbook_url"], f"{RUNBOOK}#{rule['alert'].lower()}", rule["alert"])
        with open(os.path.join(DEPLOY, "prometheus", "alerts_test.yaml")) as f:
            urls = re.findall(r"runbook_url: (\S+)", f.read())
        self.assertTrue(urls)
        self.assertEqual({u.partition("#")[0] for u in urls}, {RUNBOOK})
        self.assertEqual(chart_values_file()["prometheusRule"]["runbookUrl"], RUNBOOK)
        with open(os.path.join(CHART, "templates", "prometheusrule.yaml")) as f:
            self.assertEqual(re.findall(r'replace "([^"]+)" \.Values\.prometheusRule\.runbookUrl', f.read()), [RUNBOOK])
        # Named, with the way to move it, in the rule file's header, the
        # chart's README (outside the values table) and docs/OPERATIONS.md's
        # "Alerts", the runbooks' own section.
        with open(os.path.join(DEPLOY, "prometheus", "alerts.yaml")) as f:
            header = f.read().split("\ngroups:", 1)[0]
        with open(os.path.join(CHART, "README.md")) as f:
            readme = "\n".join(line for line in f.read().split("\n") if not line.startswith("|"))
        with open(os.path.join(ROOT, "docs", "OPERATIONS.md")) as f:
            alerts_section = f.read().split("\n## Alerts\n", 1)[1].split("\n### ", 1)[0]
        for name, text in (("alerts.yaml", header), ("chart README", readme), ("OPERATIONS.md", alerts_section)):
            with self.subTest(name):
                self.assertIn(RUNBOOK, text.replace("\n# ", " ").replace("\n", " "))
                self.assertIn("prometheusRule.runbookUrl", text)
                self.assertIn("sed ", text)
        # The sed of docs/OPERATIONS.md moves every link of the rule file,
        # which promtool still takes.
        command = re.search(r"^    (sed '[^']+') \\\n +deploy/prometheus/alerts\.yaml > ", alerts_section, re.M)
        self.assertIsNotNone(command, "no sed command in OPERATIONS.md's Alerts")
        expression = command.group(1)[len("sed '"):-1]
        moved = expression.split("|")[2]
        with tempfile.TemporaryDirectory(prefix="turbokv-runbook-") as tmp:
            path = os.path.join(tmp, "turbokvd.yaml")
            with open(path, "w") as f:
                subprocess.run(["sed", expression, os.path.join(DEPLOY, "prometheus", "alerts.yaml")], stdout=f,
                               check=True, timeout=60)
            run = subprocess.run(["promtool", "check", "rules", path], capture_output=True, text=True, timeout=120)
            self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
            self.assertEqual([r["annotations"]["runbook_url"] for g in load(path)["groups"] for r in g["rules"]],
                             [f"{moved}#{r['alert'].lower()}" for r in rules])
        # The chart moves every link to the base it is given, and NOTES.txt says where they point.
        values = default_values()
        fork = "https://git.example.com/ml/turbokv/-/blob/v0.1.0/docs/OPERATIONS.md"
        values["prometheusRule"]["runbookUrl"] = fork
        objects, notes = rendered_chart(values, api_versions=MONITORING_APIS)
        rendered = [r for g in objects["PrometheusRule"]["spec"]["groups"] for r in g["rules"]]
        self.assertEqual([r["annotations"]["runbook_url"] for r in rendered],
                         [f"{fork}#{r['alert'].lower()}" for r in rules])
        self.assertNotIn(RUNBOOK, json.dumps(objects["PrometheusRule"]))
        self.assertIn(f"runbook links: {fork}#<alert name in lower case>", notes)
        # A base of its own, with no fragment: the alerts add theirs.
        with open(os.path.join(CHART, "values.schema.json")) as f:
            schema = json.load(f)
        jsonschema.validate(values, schema)
        for bad in ("https://wiki.example.com/OPERATIONS.md#alerts", "wiki.example.com/OPERATIONS.md", ""):
            values["prometheusRule"]["runbookUrl"] = bad
            with self.assertRaises(jsonschema.ValidationError, msg=bad):
                jsonschema.validate(values, schema)

    def test_dashboard_panels_and_variables(self):
        with open(os.path.join(DEPLOY, "grafana", "dashboard.json")) as f:
            dashboard = json.load(f)
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        for name in ("namespace", "pod"):
            self.assertIn(name, variables)
        exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
        for expr in exprs:
            # Ranges follow the scrape interval and the zoom, not a fixed window.
            self.assertNotRegex(expr, r"\[\d+[smh]\]", expr)
            if "turbokv_" in expr or "process_" in expr or expr.startswith("up{"):
                self.assertIn('namespace=~"$namespace",pod=~"$pod"', expr)
        joined = "\n".join(exprs)
        for metric in ("up{", 'side', "process_start_time_seconds", "process_resident_memory_bytes",
                       "kube_pod_container_resource_limits", "turbokv_inflight_calls", "turbokv_executor_queued",
                       'turbokv_tier_up{job="turbokvd",namespace=~"$namespace",pod=~"$pod",instance=~"$instance",tier="redis"}',
                       "sum by (result) (rate(turbokv_takeovers_total{",
                       # The tier row: sessions per tier, bytes, demotions, promotions, rewrites.
                       "sum by (tier) (turbokv_tier_sessions{", "turbokv_tier_live_bytes{", "turbokv_tier_budget_bytes{",
                       "rate(turbokv_demotions_total{", "rate(turbokv_promotions_total{", "turbokv_tier_rewrites_total{"):
            self.assertIn(metric, joined)
        # The deprecated names are not what the dashboard reads.
        self.assertNotIn("turbokv_spill_", joined)
        # The tier row holds every tier panel: those below it, and nothing above it reads a tier metric.
        row = next(p for p in dashboard["panels"] if p["type"] == "row" and "Tiers" in p["title"])
        for panel in dashboard["panels"]:
            tiered = any(re.search(r"turbokv_(tier|takeovers|demotions|promotion)", t["expr"])
                         for t in panel.get("targets", []))
            self.assertEqual(tiered, panel["gridPos"]["y"] > row["gridPos"]["y"], panel["title"])
        self.assertIn("Tiers", " ".join(p["title"] for p in dashboard["panels"] if p["type"] == "row"))
        ids = [p["id"] for p in dashboard["panels"]]
        self.assertEqual(len(ids), len(set(ids)))

    def test_rules_and_dashboard_use_metrics_turbokvd_exports_and_flags_it_accepts(self):
        # Two turbokvds: the example's flags (the disk tier), and the chart's
        # with redis.deploy, against its Redis run here.
        example = load(os.path.join(DEPLOY, "k8s", "sidecar.yaml"))
        args = example["spec"]["template"]["spec"]["initContainers"][0]["args"]
        objects, _ = rendered_objects(redis_deploy_values())
        redis_args = worker_workload(objects)["spec"]["template"]["spec"]["initContainers"][0]["args"]
        redis_container = redis_objects(objects)["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]
        expositions = []
        with tempfile.TemporaryDirectory(prefix="turbokv-deploy-") as tmp:
            for name in ("disk", "redis", "data"):
                os.mkdir(os.path.join(tmp, name))
            with local_turbokvd(self, args, os.path.join(tmp, "disk")) as daemon:
                session = daemon.cli("create", "--layers=1", "--kv-heads=1", "--q-heads=1")
                daemon.cli("append-random", session, "--tokens=64")
                daemon.cli("attend-random", session, "--calls=2")
                daemon.cli("get", "missing", ok=False)
                expositions.append(daemon.scrape())
            password = redis_password(objects)
            redis = LocalRedis(self, redis_container, os.path.join(tmp, "data"), password)
            try:
                redis.start()
                with local_turbokvd(self, redis_args, os.path.join(tmp, "redis"), password,
                                    redis_url=f"redis://127.0.0.1:{redis.port}") as daemon:
                    session = daemon.cli("create", "--layers=1", "--kv-heads=1", "--q-heads=1")
                    daemon.cli("append-random", session, "--tokens=64")
                    # A session this daemon does not hold: a takeover, not found in Redis.
                    daemon.cli("attend-random", "missing", ok=False)
                    exposition = daemon.scrape()
                    self.assertEqual(sample(exposition, "turbokv_tier_up", tier="redis"), 1, exposition)
                    expositions.append(exposition)
            finally:
                redis.stop()
        exposition = "\n".join(expositions)
        # Sample names, and family names (a histogram's, without _bucket/_sum/_count).
        exported = set(re.findall(r"^(\w+?)(?:\{| )", exposition, re.M))
        exported |= set(re.findall(r"^# TYPE (\w+) ", exposition, re.M))
        used = set()
        rules = load(os.path.join(DEPLOY, "prometheus", "alerts.yaml"))
        exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
        with open(os.path.join(DEPLOY, "grafana", "dashboard.json")) as f:
            dashboard = json.load(f)
        exprs += [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
        exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if isinstance(v.get("query"), dict)]
        for expr in exprs:
            used |= set(re.findall(r"\b((?:turbokv|process|kube)_\w+|up)\s*[{\[]", expr))
            used |= set(re.findall(r"\b((?:turbokv|process)_\w+)", expr))
        self.assertGreaterEqual(len(used), 20)
        self.assertEqual(used - exported - EXTERNAL_METRICS, set())


if __name__ == "__main__":
    unittest.main()
