"""What can be checked of deploy/ without a cluster: every YAML parses; the
Helm chart, rendered here (helm is not packaged for Debian 12, so a small
renderer for the subset of the template language the chart uses stands in),
and the plain sidecar example both have what a native-sidecar deployment
needs; the alert rules pass promtool's check and unit tests; every metric the
rules and the dashboard use is one a real turbokvd exports; turbokvd accepts
the flags the deployment gives it. Needs $TURBOKVD and $TURBOKV_CLI."""

import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import unittest
import urllib.request

import yaml

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
DEPLOY = os.path.join(ROOT, "deploy")
CHART = os.path.join(DEPLOY, "helm", "turbokv")


def render(template: str, values: dict, release: str = "demo") -> str:
    """Renders the Go-template subset the chart uses: {{ pipeline }} with
    .Values/.Release/.Chart/.Files.Get, toYaml, quote, nindent; if/end; and
    the {{- / -}} whitespace trims."""
    with open(os.path.join(CHART, "Chart.yaml")) as f:
        chart = yaml.safe_load(f)
    context = {"Values": values, "Release": {"Name": release, "Namespace": "default"},
               "Chart": {"Name": chart["name"], "AppVersion": chart["appVersion"]}}
    parts = re.split(r"({{-?.*?-?}})", template)
    # Trims: "{{-" eats the whitespace before, "-}}" the whitespace after.
    for i, part in enumerate(parts):
        if part.startswith("{{-") and i > 0:
            parts[i - 1] = parts[i - 1].rstrip()
        if part.endswith("-}}") and i + 1 < len(parts):
            parts[i + 1] = parts[i + 1].lstrip()

    def lookup(path: str):
        value = context
        for key in path.strip(".").split("."):
            value = value[key]
        return value

    def evaluate(pipeline: str):
        stages = [s.strip() for s in pipeline.split("|")]
        head = stages[0]
        if head.startswith(".Files.Get"):
            path = re.match(r'\.Files\.Get "(.*)"', head).group(1)
            with open(os.path.join(CHART, path)) as f:
                value = f.read().rstrip("\n")
        elif head.startswith("toYaml "):
            value = yaml.safe_dump(lookup(head[len("toYaml "):]), default_flow_style=False, sort_keys=True).rstrip("\n")
        else:
            value = lookup(head)
        for stage in stages[1:]:
            if stage == "quote":
                value = json.dumps(str(value))
            elif stage.startswith("nindent "):
                pad = " " * int(stage.split()[1])
                value = "\n" + "\n".join(pad + line if line else line for line in str(value).split("\n"))
            else:
                raise ValueError(f"unsupported function {stage!r}")
        return value

    out, emitting = [], [True]
    for part in parts:
        if not (part.startswith("{{") and part.endswith("}}")):
            if all(emitting):
                out.append(part)
            continue
        action = part.strip("{}").strip("-").strip()
        if action.startswith("if "):
            emitting.append(bool(evaluate(action[3:])))
        elif action == "end":
            emitting.pop()
        elif all(emitting):
            value = evaluate(action)
            out.append(str(value).lower() if isinstance(value, bool) else str(value))
    return "".join(out)


def load(path):
    with open(path) as f:
        return yaml.safe_load(f)


def rendered_chart(values=None):
    values = values or load(os.path.join(CHART, "values.yaml"))
    docs = []
    for path in sorted(glob.glob(os.path.join(CHART, "templates", "*.yaml"))):
        with open(path) as f:
            text = render(f.read(), values)
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return {doc["kind"]: doc for doc in docs}


def check_sidecar(test: unittest.TestCase, deployment: dict):
    pod = deployment["spec"]["template"]
    spec = pod["spec"]
    test.assertEqual(deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items(), True)
    sidecar = next(c for c in spec["initContainers"] if c["name"] == "turbokvd")
    worker = spec["containers"][0]
    test.assertEqual(sidecar["restartPolicy"], "Always")  # native sidecar
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in sidecar["args"]}
    socket_dir = [m for m in sidecar["volumeMounts"] if m["name"] == "turbokv-socket"][0]["mountPath"]
    test.assertEqual(args["--listen"], f"unix://{socket_dir}/turbokv.sock")
    volume = [v for v in spec["volumes"] if v["name"] == "turbokv-socket"][0]
    test.assertIn("emptyDir", volume)
    test.assertIn({"name": "turbokv-socket", "mountPath": socket_dir}, worker["volumeMounts"])
    # The spill dir is a volume of its own, bounded.
    spill = [m for m in sidecar["volumeMounts"] if m["name"] == "turbokv-spill"][0]["mountPath"]
    test.assertEqual(args["--spill-dir"], spill)
    spill_volume = [v for v in spec["volumes"] if v["name"] == "turbokv-spill"][0]
    test.assertIn("sizeLimit", spill_volume["emptyDir"])
    env = {e["name"]: e["value"] for e in worker["env"]}
    test.assertEqual(env["TURBOKV_TARGET"], args["--listen"])
    health_port = int(args["--health-listen"].rsplit(":", 1)[1])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        test.assertEqual(sidecar[probe]["grpc"]["port"], health_port, probe)
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    test.assertEqual(ports["health"], health_port)
    test.assertEqual(ports["metrics"], int(args["--metrics-listen"].rsplit(":", 1)[1]))
    for container in (sidecar, worker):
        test.assertIn("nvidia.com/gpu", container["resources"]["requests"])
        test.assertIn("memory", container["resources"]["limits"])
    deadline = int(args["--shutdown-deadline"].rstrip("s"))
    test.assertGreater(spec["terminationGracePeriodSeconds"], deadline)
    return sidecar["args"]


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
        check_sidecar(self, example)
        objects = rendered_chart()
        chart_args = check_sidecar(self, objects["Deployment"])
        self.assertEqual(chart_args, next(c for c in example["spec"]["template"]["spec"]["initContainers"])["args"])
        monitor = objects["PodMonitor"]
        pod_labels = objects["Deployment"]["spec"]["template"]["metadata"]["labels"]
        self.assertTrue(monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items())
        self.assertEqual(monitor["spec"]["podMetricsEndpoints"][0]["port"], "metrics")
        rules = load(os.path.join(DEPLOY, "prometheus", "alerts.yaml"))
        self.assertEqual(objects["PrometheusRule"]["spec"], rules)
        dashboard = json.loads(objects["ConfigMap"]["data"]["turbokvd.json"])
        self.assertEqual(dashboard["uid"], "turbokvd")

    def test_chart_switches_and_extra_args(self):
        values = load(os.path.join(CHART, "values.yaml"))
        values["podMonitor"]["enabled"] = False
        values["prometheusRule"]["enabled"] = False
        values["grafanaDashboard"]["enabled"] = False
        values["turbokvd"]["extraArgs"] = ["--threads=8"]
        objects = rendered_chart(values)
        self.assertEqual(set(objects), {"Deployment"})
        args = objects["Deployment"]["spec"]["template"]["spec"]["initContainers"][0]["args"]
        self.assertEqual(args[-1], "--threads=8")

    def test_alert_rules_pass_promtool(self):
        directory = os.path.join(DEPLOY, "prometheus")
        for command in (["promtool", "check", "rules", "alerts.yaml"], ["promtool", "test", "rules", "alerts_test.yaml"]):
            run = subprocess.run(command, cwd=directory, capture_output=True, text=True, timeout=120)
            self.assertEqual(run.returncode, 0, run.stdout + run.stderr)

    def test_rules_and_dashboard_use_metrics_turbokvd_exports_and_flags_it_accepts(self):
        example = load(os.path.join(DEPLOY, "k8s", "sidecar.yaml"))
        args = example["spec"]["template"]["spec"]["initContainers"][0]["args"]
        with tempfile.TemporaryDirectory(prefix="turbokv-deploy-") as tmp, socket.socket() as s1, socket.socket() as s2:
            s1.bind(("127.0.0.1", 0))
            s2.bind(("127.0.0.1", 0))
            health, metrics = s1.getsockname()[1], s2.getsockname()[1]
            s1.close()
            s2.close()
            # The deployment's flags, with the socket and ports moved somewhere free here.
            local = {"--listen": f"unix://{tmp}/turbokv.sock", "--health-listen": f"127.0.0.1:{health}",
                     "--metrics-listen": f"127.0.0.1:{metrics}", "--memory-budget": "1GiB",
                     "--spill-dir": f"{tmp}/spill", "--spill-budget": "1GiB"}
            flags = [f"{k}={local.get(k, v)}" for k, v in (a.split("=", 1) for a in args)]
            log = open(os.path.join(tmp, "log"), "w")
            daemon = subprocess.Popen([os.environ["TURBOKVD"], *flags], stderr=log)
            try:
                cli = [os.environ["TURBOKV_CLI"], f"--target={local['--listen']}"]
                session = subprocess.run(cli + ["create", "--layers=1", "--kv-heads=1", "--q-heads=1"],
                                         capture_output=True, text=True, timeout=60, check=True).stdout.strip()
                subprocess.run(cli + ["append-random", session, "--tokens=64"], capture_output=True, timeout=60, check=True)
                subprocess.run(cli + ["attend-random", session, "--calls=2"], capture_output=True, timeout=60, check=True)
                subprocess.run(cli + ["get", "missing"], capture_output=True, timeout=60)
                time.sleep(1.2)  # the gauges refresh every second
                exposition = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5).read().decode()
            finally:
                daemon.send_signal(signal.SIGTERM)
                log.close()
                with open(os.path.join(tmp, "log")) as f:
                    self.assertEqual(daemon.wait(timeout=30), 0, f.read())
        # Sample names, and family names (a histogram's, without _bucket/_sum/_count).
        exported = set(re.findall(r"^(turbokv_\w+?)(?:\{| )", exposition, re.M))
        exported |= set(re.findall(r"^# TYPE (turbokv_\w+) ", exposition, re.M))
        used = set()
        for path in (os.path.join(DEPLOY, "prometheus", "alerts.yaml"), os.path.join(DEPLOY, "grafana", "dashboard.json")):
            with open(path) as f:
                used |= set(re.findall(r"turbokv_\w+", f.read()))
        self.assertGreaterEqual(len(used), 10)
        self.assertEqual(used - exported, set())


if __name__ == "__main__":
    unittest.main()
