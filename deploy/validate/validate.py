"""Offline checks of deploy/: renders the Helm chart, lints it, keeps
deploy/kubernetes/ equal to its default rendering, validates every manifest
against the Kubernetes schemas (strict: unknown fields are errors), and
extracts the files the agent's init container installs for the shell tests.

The monitoring objects (values `monitoring.*`): the Prometheus Operator's
ServiceMonitor, PodMonitor and PrometheusRule are CRDs the Kubernetes schemas
do not know, so their structure is checked here instead (apiVersion, kind,
the fields used against the CRD's field names, selectors that match the
chart's tracker Service and agent pods and name ports they have, the rules
equal to deploy/prometheus/dray-alerts.yaml); the dashboard ConfigMap is
schema-validated like any other and must hold deploy/grafana's dashboard.
The chart's copies of the rule file and the dashboard (files/) must equal
deploy/prometheus/ and deploy/grafana/ (`--update` rewrites them), and every
metric the rules, their tests and the dashboard name must be registered in
the agent's or tracker's code; every alert's runbook_url must name a heading
of docs/operator-guide.md.

Run by scripts/validate-deploy.sh inside its pinned venv; not meant to be run
by hand. Exit status 1 with one line per problem on any failure.
"""

import argparse
import json
import pathlib
import re
import sys

import helm_python as helm
import kubernetes_validate
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy/helm/dray"
PLAIN = ROOT / "deploy/kubernetes"
RELEASE, NAMESPACE = "dray", "dray-system"
RULES = ROOT / "deploy/prometheus/dray-alerts.yaml"
RULE_TESTS = ROOT / "deploy/prometheus/dray-alerts.test.yaml"
DASHBOARD = ROOT / "deploy/grafana/dray-dashboard.json"
# deploy/ file -> the chart's copy, which .Files.Get reads.
COPIES = {RULES: CHART / "files/dray-alerts.yaml", DASHBOARD: CHART / "files/dray-dashboard.json"}
MONITORING_ON = {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True},
                 "prometheusRule": {"enabled": True}, "dashboard": {"enabled": True}}
# deploy/kubernetes/ is the chart with its defaults plus a Namespace object.
PLAIN_VALUES = {"namespace": {"create": True}}
# Other value sets whose rendering must also be valid.
VARIANTS = {
    "tls-provided": {"tls": {"mode": "provided"}},
    "tls-issue": {"tls": {"mode": "issue"}},
    "no-snapshotter": {"snapshotter": {"enabled": False}},
    "privileged-agent": {"agent": {"privileged": True, "priorityClassName": ""}},
    # No tracker: the agents find each other through the DHT alone; and
    # the DHT off.
    "no-tracker": {"tracker": {"replicas": 0}, "tls": {"mode": "issue"}},
    "no-dht": {"agent": {"dht": {"enabled": False}}},
    "custom": {
        "tracker": {"replicas": 5, "listenAddress": "[::]"},
        "registries": [{"name": "registry.internal:5000", "server": "http://registry.internal:5000"}],
        "agent": {"config": {"peer": {"upload_bytes_per_s": 125000000}}, "dualStack": True},
        "metrics": {"annotations": False},
    },
    # Every monitoring object on, with the defaults; and with the
    # settings changed (provided TLS: the tracker Secret's CA).
    "monitoring": {"monitoring": MONITORING_ON},
    "monitoring-custom": {
        "tls": {"mode": "provided"},
        "metrics": {"annotations": False},
        "monitoring": {
            **MONITORING_ON,
            "labels": {"release": "prometheus"},
            "serviceMonitor": {"enabled": True, "interval": "15s"},
            "prometheusRule": {"enabled": True, "runbookBaseUrl": "https://docs.example/dray/"},
            "dashboard": {"enabled": True, "namespace": "monitoring",
                          "labels": {"grafana_dashboard": "dray"},
                          "annotations": {"grafana_folder": "dray"}},
        },
    },
}
# The Prometheus Operator's kinds (monitoring.coreos.com/v1), checked by
# check_monitoring: the fields of each object the CRD allows at the levels the
# chart fills (a subset of the CRD's; unknown ones are errors, as in strict
# schema validation), and those the chart must set.
CRD_FIELDS = {
    "ServiceMonitor": {
        "spec": {"selector", "namespaceSelector", "endpoints", "jobLabel", "targetLabels",
                 "podTargetLabels", "sampleLimit", "attachMetadata"},
        "endpoint": {"port", "targetPort", "path", "scheme", "interval", "scrapeTimeout", "tlsConfig",
                     "relabelings", "metricRelabelings", "honorLabels", "honorTimestamps",
                     "bearerTokenSecret", "authorization", "basicAuth", "params", "followRedirects"},
        "endpoints": "endpoints",
    },
    "PodMonitor": {
        "spec": {"selector", "namespaceSelector", "podMetricsEndpoints", "jobLabel", "podTargetLabels",
                 "sampleLimit", "attachMetadata"},
        "endpoint": {"port", "targetPort", "path", "scheme", "interval", "scrapeTimeout", "tlsConfig",
                     "relabelings", "metricRelabelings", "honorLabels", "honorTimestamps",
                     "bearerTokenSecret", "authorization", "basicAuth", "params", "followRedirects"},
        "endpoints": "podMetricsEndpoints",
    },
    "PrometheusRule": {"spec": {"groups"}},
}
TLS_FIELDS = {"ca", "cert", "keySecret", "serverName", "insecureSkipVerify", "caFile", "certFile", "keyFile"}
RELABEL_FIELDS = {"sourceLabels", "separator", "targetLabel", "regex", "modulus", "replacement", "action"}
RULE_FIELDS = {"alert", "record", "expr", "for", "labels", "annotations", "keep_firing_for"}
DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")
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
        if doc.get("kind") in CRD_FIELDS:
            # Not in the Kubernetes schemas: check_monitoring checks these.
            continue
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


def check_no_ca_key_on_nodes(label, docs, ca_secret, problems):
    """No agent pod may reference the Secret holding the CA key: the node
    authorizer lets a kubelet read every Secret its pods reference, so a
    compromised node would mint any identity (issue 37)."""
    for doc in docs:
        if doc.get("kind") != "DaemonSet":
            continue
        name = doc.get("metadata", {}).get("name")
        volumes = doc["spec"]["template"]["spec"].get("volumes", [])
        secrets = [v["secret"].get("secretName") for v in volumes if "secret" in v]
        secrets += [src["secret"].get("name") for v in volumes if "projected" in v
                    for src in v["projected"].get("sources", []) if "secret" in src]
        if ca_secret in secrets:
            problems.append(f"{label}: DaemonSet/{name} mounts the CA Secret {ca_secret!r} (its key "
                            "lets a node mint any identity): the default must be tls.mode signer")


def check_monitoring(label, docs, values, problems):
    """The monitoring objects of one rendering with the monitoring values
    `values`: present exactly when enabled, well-formed, and pointing at the
    chart's own Service, pods and ports."""
    def bad(doc, msg):
        problems.append(f"{label}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}: {msg}")

    def unknown(doc, where, got, allowed):
        for key in sorted(set(got) - allowed):
            bad(doc, f"at {where}: unknown field {key!r}")

    mon = values.get("monitoring", {})
    on = {kind: mon.get(key, {}).get("enabled", False) for kind, key in
          (("ServiceMonitor", "serviceMonitor"), ("PodMonitor", "podMonitor"),
           ("PrometheusRule", "prometheusRule"))}
    dashboards = [d for d in docs if d.get("kind") == "ConfigMap"
                  and "dray-dashboard.json" in (d.get("data") or {})]
    found = {kind: [d for d in docs if d.get("kind") == kind] for kind in CRD_FIELDS}
    for kind, enabled in on.items():
        if len(found[kind]) != (1 if enabled else 0):
            problems.append(f"{label}: {len(found[kind])} {kind} objects with it "
                            f"{'on' if enabled else 'off'}")
    want_dash = mon.get("dashboard", {}).get("enabled", False)
    if len(dashboards) != (1 if want_dash else 0):
        problems.append(f"{label}: {len(dashboards)} dashboard ConfigMaps with it {'on' if want_dash else 'off'}")

    def matched(selector, kind, pods):
        """Objects of `kind` (their pod template's labels if `pods`) that the selector matches."""
        out = []
        for d in docs:
            if d.get("kind") != kind or d["metadata"].get("namespace") != NAMESPACE:
                continue
            labels = (d["spec"]["template"]["metadata"] if pods else d["metadata"]).get("labels", {})
            if selector and all(labels.get(k) == v for k, v in selector.items()):
                out.append(d)
        return out

    for kind, fields in CRD_FIELDS.items():
        for doc in found[kind]:
            meta, spec = doc.get("metadata", {}), doc.get("spec", {})
            if doc.get("apiVersion") != "monitoring.coreos.com/v1":
                bad(doc, f"apiVersion {doc.get('apiVersion')!r}, want monitoring.coreos.com/v1")
            unknown(doc, "(top)", doc, {"apiVersion", "kind", "metadata", "spec"})
            if not meta.get("name") or meta.get("namespace") != NAMESPACE:
                bad(doc, f"metadata needs a name and namespace {NAMESPACE}")
            for k, v in (mon.get("labels") or {}).items():
                if meta.get("labels", {}).get(k) != v:
                    bad(doc, f"lacks the label {k}: {v} of monitoring.labels")
            unknown(doc, "spec", spec, fields["spec"])
            if kind == "PrometheusRule":
                check_rules(doc, spec, mon.get("prometheusRule", {}).get("runbookBaseUrl", ""), bad)
                continue
            selector = spec.get("selector", {}).get("matchLabels")
            if spec.get("namespaceSelector") != {"matchNames": [NAMESPACE]}:
                bad(doc, f"namespaceSelector must name {NAMESPACE} alone")
            endpoints = spec.get(fields["endpoints"])
            if not endpoints:
                bad(doc, f"no spec.{fields['endpoints']}")
                continue
            if kind == "ServiceMonitor":
                targets = matched(selector, "Service", pods=False)
                ports = {p.get("name") for t in targets for p in t["spec"].get("ports", [])}
            else:
                targets = matched(selector, "DaemonSet", pods=True)
                ports = {p.get("name") for t in targets
                         for c in t["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])
                         if p.get("protocol", "TCP") == "TCP"}
            if len(targets) != 1:
                bad(doc, f"its selector {selector} matches {len(targets)} objects, want 1")
            for i, ep in enumerate(endpoints):
                where = f"spec.{fields['endpoints']}[{i}]"
                unknown(doc, where, ep, fields["endpoint"])
                if ep.get("port") not in ports:
                    bad(doc, f"at {where}: port {ep.get('port')!r} is none of {sorted(ports)}")
                if ep.get("path") != "/metrics":
                    bad(doc, f"at {where}: path {ep.get('path')!r}, want /metrics")
                if "interval" in ep and not DURATION.match(str(ep["interval"])):
                    bad(doc, f"at {where}: interval {ep['interval']!r} is not a Prometheus duration")
                for j, r in enumerate(ep.get("relabelings", [])):
                    unknown(doc, f"{where}.relabelings[{j}]", r, RELABEL_FIELDS)
                # The tracker serves /metrics over its TLS, the agent in plain HTTP.
                want = "https" if kind == "ServiceMonitor" else "http"
                if ep.get("scheme") != want:
                    bad(doc, f"at {where}: scheme {ep.get('scheme')!r}, want {want}")
                if want == "https":
                    tls = ep.get("tlsConfig") or {}
                    unknown(doc, f"{where}.tlsConfig", tls, TLS_FIELDS)
                    ca = tls.get("ca") or {}
                    ca = ca.get("secret") or ca.get("configMap") or {}
                    if not mon.get("serviceMonitor", {}).get("tlsConfig") and (
                            ca.get("key") != "ca.crt" or not ca.get("name") or not tls.get("serverName")):
                        bad(doc, f"at {where}.tlsConfig: needs ca.secret or ca.configMap (key ca.crt) "
                                 "and serverName")

    for doc in dashboards:
        meta = doc["metadata"]
        want_ns = mon.get("dashboard", {}).get("namespace") or NAMESPACE
        if meta.get("namespace") != want_ns:
            bad(doc, f"namespace {meta.get('namespace')!r}, want {want_ns!r}")
        labels = mon.get("dashboard", {}).get("labels", {"grafana_dashboard": "1"})
        for k, v in labels.items():
            if meta.get("labels", {}).get(k) != v:
                bad(doc, f"lacks the sidecar label {k}: {v!r}")
        try:
            if json.loads(doc["data"]["dray-dashboard.json"]) != json.loads(DASHBOARD.read_text()):
                bad(doc, f"does not hold {DASHBOARD.relative_to(ROOT)}")
        except json.JSONDecodeError as e:
            bad(doc, f"dray-dashboard.json is not JSON: {e}")


def check_rules(doc, spec, base, bad):
    """A PrometheusRule's groups: the rule file's, runbook URLs prefixed by `base`."""
    want = yaml.safe_load(RULES.read_text())["groups"]
    for group in want:
        for rule in group["rules"]:
            rule["annotations"]["runbook_url"] = base + rule["annotations"]["runbook_url"]
    if spec.get("groups") != want:
        bad(doc, f"its groups differ from {RULES.relative_to(ROOT)}")
    for group in spec.get("groups") or []:
        unknown_group = set(group) - {"name", "interval", "rules", "limit"}
        if unknown_group or not group.get("name"):
            bad(doc, f"group {group.get('name')!r}: needs a name, unknown fields {sorted(unknown_group)}")
        for rule in group.get("rules") or []:
            what = rule.get("alert") or rule.get("record")
            if set(rule) - RULE_FIELDS or not what or not isinstance(rule.get("expr"), str):
                bad(doc, f"rule {what!r}: needs alert or record and expr; unknown fields "
                         f"{sorted(set(rule) - RULE_FIELDS)}")
            if "for" in rule and not DURATION.match(str(rule["for"])):
                bad(doc, f"rule {what!r}: for {rule['for']!r} is not a Prometheus duration")


def registered_metrics():
    """Every metric name the agent and the tracker expose, from their code:
    each `register`/`register_with_unit` call, its unit, and the declared
    type of the field it registers (Counter: _total; Histogram: _bucket,
    _count, _sum; Gauge: the name)."""
    names = set()
    call = re.compile(r'\.register(?:_with_unit)?\(\s*"(\w+)",\s*"(?:[^"\\]|\\.)*",\s*'
                      r'(?:Unit::(?:Other\("(\w+)"\.into\(\)\)|(\w+)),\s*)?(?:m|self)\.(\w+)\.clone\(\)')
    for crate, prefix in (("agent/src", "dray_agent"), ("tracker/src", "dray_tracker")):
        for f in sorted((ROOT / crate).rglob("*.rs")):
            text = f.read_text()
            for name, other, unit, field in call.findall(text):
                unit = other or unit
                # The field's declaration: the first `field: ...` line naming a metric type.
                kind = next((k for line in re.findall(rf"\b{field}:\s*(.+)", text)
                             for k in re.findall(r"\b(Counter|Gauge|Histogram)\b", line)[-1:]), None)
                if not kind:
                    raise SystemExit(f"{f.relative_to(ROOT)}: no metric type for field {field}")
                base = f"{prefix}_{name}" + (f"_{unit.lower()}" if unit else "")
                names |= {"Counter": {f"{base}_total"}, "Gauge": {base},
                          "Histogram": {f"{base}_bucket", f"{base}_count", f"{base}_sum"}}[kind]
    return names


def label_values():
    """Every string literal of the agent's and tracker's code: label values."""
    return {m for crate in ("agent/src", "tracker/src") for f in (ROOT / crate).rglob("*.rs")
            for m in re.findall(r'"(\w+)"', f.read_text())}


DASHBOARD_VARS = {"$__rate_interval": "5m", "$__range": "1h", "$__interval": "1m", "$instance": ".*"}


def dashboard_exprs():
    """The dashboard's PromQL, its variables replaced by sample values."""
    dash = json.loads(DASHBOARD.read_text())
    panels = dash["panels"] + [p for row in dash["panels"] for p in row.get("panels", [])]
    out = []
    for panel in panels:
        for t in panel.get("targets", []):
            expr = t["expr"]
            for var in sorted(DASHBOARD_VARS, key=len, reverse=True):
                expr = expr.replace(var, DASHBOARD_VARS[var])
            if "$" in expr:
                raise SystemExit(f"{DASHBOARD.relative_to(ROOT)}: {panel['title']}: unknown variable in {expr}")
            out.append((panel["title"], expr))
    return out


def check_metric_names(problems, rules_out):
    """The rules, their tests and the dashboard name registered metrics and
    label values only; writes the dashboard's expressions as recording rules
    to `rules_out` for promtool to parse."""
    known, values = registered_metrics(), label_values()
    rules = yaml.safe_load(RULES.read_text())
    sources = [(f"{RULES.relative_to(ROOT)}: {r.get('alert') or r.get('record')}", r["expr"])
               for g in rules["groups"] for r in g["rules"]]
    tests = yaml.safe_load(RULE_TESTS.read_text())
    sources += [(f"{RULE_TESTS.relative_to(ROOT)}: input series", s["series"])
                for t in tests["tests"] for s in t.get("input_series", [])]
    dash = dashboard_exprs()
    sources += [(f"{DASHBOARD.relative_to(ROOT)}: {title}", e) for title, e in dash]
    for where, expr in sources:
        for name in sorted(set(re.findall(r"\bdray_\w+", expr))):
            if name not in known:
                problems.append(f"{where}: metric {name} is not registered by the agent or tracker")
        for label, value in re.findall(r'\b(\w+)="([^"]*)"', expr):
            if label not in ("instance", "job", "node") and value not in values:
                problems.append(f"{where}: label value {label}={value!r} is not in the agent's or tracker's code")
    rules_out.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:expr{i}", "expr": e} for i, (_, e) in enumerate(dash)]}]}))
    print(f"{len(known)} metric series names registered in the code; {len(sources)} expressions and "
          f"series of the rules, their tests and the dashboard name only those")


def check_runbooks(problems):
    """Every alert has a summary, a description, a severity and a runbook_url
    naming a heading of the operator guide."""
    guide = (ROOT / "docs/operator-guide.md").read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-")
               for h in re.findall(r"^#+ (.*)$", guide, re.M)}
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            if "alert" not in rule:
                continue
            where = f"{RULES.relative_to(ROOT)}: {rule['alert']}"
            notes = rule.get("annotations", {})
            if rule.get("labels", {}).get("severity") not in ("warning", "critical"):
                problems.append(f"{where}: severity must be warning or critical")
            if not notes.get("summary") or not notes.get("description"):
                problems.append(f"{where}: needs summary and description annotations")
            page, _, anchor = notes.get("runbook_url", "").partition("#")
            if page != "docs/operator-guide.md" or anchor not in anchors:
                problems.append(f"{where}: runbook_url {notes.get('runbook_url')!r} names no heading "
                                "of docs/operator-guide.md")


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
    p.add_argument("--dashboard-rules", type=pathlib.Path,
                   help="write the dashboard's expressions here as a rule file (for promtool)")
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

    for source, copy in COPIES.items():
        if args.update and copy.read_bytes() != source.read_bytes():
            copy.write_bytes(source.read_bytes())
            print(f"wrote {copy.relative_to(ROOT)}")
        if copy.read_bytes() != source.read_bytes():
            problems.append(f"{copy.relative_to(ROOT)} differs from {source.relative_to(ROOT)}: "
                            "run scripts/validate-deploy.sh --update")
    if args.dashboard_rules:
        check_metric_names(problems, args.dashboard_rules)
    check_runbooks(problems)

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
    check_monitoring("deploy/kubernetes", all_docs, PLAIN_VALUES, problems)
    check_no_ca_key_on_nodes("deploy/kubernetes", all_docs, "dray-ca", problems)
    for variant, values in VARIANTS.items():
        variant_docs = []
        for name, text in render(values).items():
            docs = documents(name, text)
            variant_docs += docs
            validate(f"chart[{variant}]/{name}", docs, args.kube_version, problems)
        check_monitoring(f"chart[{variant}]", variant_docs, values, problems)
    if args.extract:
        extract(all_docs, args.extract)
    print(f"validated {len(all_docs)} objects in deploy/kubernetes/ and {len(VARIANTS)} chart "
          f"variants against Kubernetes {', '.join(args.kube_version)} (strict); the monitoring "
          f"objects ({', '.join(CRD_FIELDS)}: CRDs, by their structure) on and off")
    return report(problems)


def report(problems):
    for line in problems:
        print(f"INVALID: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
