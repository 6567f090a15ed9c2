"""Offline checks of deploy/: renders the Helm chart, lints it, keeps
deploy/kubernetes/ equal to its default rendering, validates every manifest
against the Kubernetes schemas (strict: unknown fields are errors), and
extracts the files the agent's init container installs for the shell tests.

Run by scripts/validate-deploy.sh inside its pinned venv; not meant to be run
by hand. Exit status 1 with one line per problem on any failure.
"""

import argparse
import pathlib
import sys

import helm_python as helm
import kubernetes_validate
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy/helm/dray"
PLAIN = ROOT / "deploy/kubernetes"
RELEASE, NAMESPACE = "dray", "dray-system"
# deploy/kubernetes/ is the chart with its defaults plus a Namespace object.
PLAIN_VALUES = {"namespace": {"create": True}}
# Other value sets whose rendering must also be valid.
VARIANTS = {
    "tls-provided": {"tls": {"mode": "provided"}},
    "no-snapshotter": {"snapshotter": {"enabled": False}},
    "privileged-agent": {"agent": {"privileged": True, "priorityClassName": ""}},
    # No tracker: the agents find each other through the DHT alone; and
    # the DHT off.
    "no-tracker": {"tracker": {"replicas": 0}},
    "no-dht": {"agent": {"dht": {"enabled": False}}},
    "custom": {
        "tracker": {"replicas": 5, "listenAddress": "[::]"},
        "registries": [{"name": "registry.internal:5000", "server": "http://registry.internal:5000"}],
        "agent": {"config": {"peer": {"upload_bytes_per_s": 125000000}}, "dualStack": True},
        "metrics": {"annotations": False},
    },
}
HEADER = (
    "# Generated from deploy/helm/dray by `scripts/validate-deploy.sh --update`; do not edit.\n"
    "# CI fails when this file differs from the chart's rendering.\n"
)


def render(values):
    """Template path -> rendered YAML text, empty renderings dropped."""
    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return {
        pathlib.Path(path).name: text
        for path, text in sorted(out.items())
        if path.endswith((".yaml", ".yml")) and text.strip()
    }


def documents(label, text):
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
        raise SystemExit(f"{label}: not valid YAML: {e}")
    return docs


def validate(label, docs, versions, problems):
    for doc in docs:
        what = f"{label}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        for version in versions:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                path = ".".join(str(p) for p in e.path) or "(top)"
                problems.append(f"{what} (Kubernetes {version}): at {path}: {e.message}")
            except kubernetes_validate.utils.SchemaNotFoundError as e:
                problems.append(f"{what} (Kubernetes {version}): no schema for this kind: {e}")
            except kubernetes_validate.utils.InvalidSchemaError as e:
                problems.append(f"{what} (Kubernetes {version}): {e}")


def extract(docs, out):
    """Writes the init container's script and every config file of the default
    rendering to `out`, for the shell checks."""
    out.mkdir(parents=True, exist_ok=True)
    for doc in docs:
        if doc.get("kind") == "ConfigMap":
            for key, text in doc.get("data", {}).items():
                (out / key).write_text(text)
        if doc.get("kind") == "DaemonSet":
            init = doc["spec"]["template"]["spec"]["initContainers"][0]
            env = {e["name"]: e["value"] for e in init["env"] if "value" in e}
            (out / "node-setup.env").write_text("".join(f"{k}='{v}'\n" for k, v in env.items()))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kube-version", action="append", required=True)
    p.add_argument("--update", action="store_true", help="rewrite deploy/kubernetes/ from the chart")
    p.add_argument("--extract", type=pathlib.Path, help="write the rendered config files here")
    p.add_argument("--only", nargs="+", type=pathlib.Path, help="validate just these manifest files")
    args = p.parse_args()
    problems = []

    if args.only:
        for f in args.only:
            validate(str(f), documents(str(f), f.read_text()), args.kube_version, problems)
        return report(problems)

    lint = helm.lint(str(CHART), PLAIN_VALUES, strict=True, namespace=NAMESPACE,
                     kube_version="v" + args.kube_version[0])
    for m in lint.get("messages", []):
        if m.get("severity", 0) >= 2:
            problems.append(f"helm lint: {m.get('path')}: {m.get('error')}")
    problems += [f"helm lint: {e}" for e in lint.get("errors") or []]

    plain = render(PLAIN_VALUES)
    if args.update:
        for old in PLAIN.glob("*.yaml"):
            old.unlink()
        for name, text in plain.items():
            (PLAIN / name).write_text(HEADER + text.lstrip("-\n"))
        print(f"wrote {len(plain)} files to {PLAIN.relative_to(ROOT)}/")
    want = {name: HEADER + text.lstrip("-\n") for name, text in plain.items()}
    have = {f.name: f.read_text() for f in PLAIN.glob("*.yaml")}
    for name in sorted(set(want) | set(have)):
        if want.get(name) != have.get(name):
            problems.append(f"deploy/kubernetes/{name} differs from the chart's rendering: "
                            "run scripts/validate-deploy.sh --update")

    all_docs = []
    for name, text in sorted(have.items()):
        docs = documents(f"deploy/kubernetes/{name}", text)
        all_docs += docs
        validate(f"deploy/kubernetes/{name}", docs, args.kube_version, problems)
    for variant, values in VARIANTS.items():
        for name, text in render(values).items():
            validate(f"chart[{variant}]/{name}", documents(name, text), args.kube_version, problems)
    if args.extract:
        extract(all_docs, args.extract)
    print(f"validated {len(all_docs)} objects in deploy/kubernetes/ and {len(VARIANTS)} chart "
          f"variants against Kubernetes {', '.join(args.kube_version)} (strict)")
    return report(problems)


def report(problems):
    for line in problems:
        print(f"INVALID: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
