"""The systemd units in deploy/systemd: `systemd-analyze verify` accepts every one, and the
promises deploy/README.md makes about them hold.

verify runs in a throwaway root (`--root`): the units in its /etc/systemd/system, a copy of the
host's own units (sysinit.target, network-online.target, ...) beside them, and an empty
executable at every path an Exec line names, since verify refuses a command that is missing.
verify exits 0 on some bad values (it ignores the line and warns), so any warning that names one
of our units counts as a failure.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import typing
from pathlib import Path

import pytest

from services.router.server import FILES_BESIDE_HTTP
from shared.config.schema import Config, RouterConfig, parse_cores
from shared.control.messages import EXIT_REFUSED

UNIT_DIR = Path(__file__).resolve().parent.parent / "deploy" / "systemd"
UNITS = sorted(p.name for p in UNIT_DIR.iterdir() if p.suffix in (".service", ".target"))
PDSERVE_SERVICES = ["pdserve-router.service", "pdserve-prefill@.service", "pdserve-decode@.service",
                    "pdserve-colocated@.service"]
WORKERS = {"prefill": "pdserve-prefill@.service", "decode": "pdserve-decode@.service"}
SERVICES = [name for name in UNITS if name.endswith(".service")]
HOST_UNIT_DIRS = (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system"))

needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed (apt-get install -y systemd)")


def directives(name: str, text: str | None = None) -> dict[str, list[str]]:
    """'Section.Key' -> every value it is given, in order (a key may repeat)."""
    table: dict[str, list[str]] = {}
    section = ""
    for line in (text if text is not None else (UNIT_DIR / name).read_text()).splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        table.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return table


def environment(name: str) -> dict[str, str]:
    """The variables a unit's Environment= lines set."""
    pairs = (item.partition("=") for line in directives(name).get("Service.Environment", []) for item in line.split())
    return {key: value for key, _, value in pairs}


def config_variables() -> set[str]:
    """Every PDSERVE_<SECTION>_<FIELD> that shared/config/schema.py declares."""
    hints = typing.get_type_hints(Config)
    return {f"PDSERVE_{section.name}_{f.name}".upper()
            for section in dataclasses.fields(Config) for f in dataclasses.fields(hints[section.name])}


def instance_name(unit: str) -> str:
    """verify loads a template through an instance of it."""
    return unit.replace("@.", "@0.")


def verify(tmp_path: Path, replace: dict[str, str] | None = None, dropins: dict[str, str] | None = None) -> list[str]:
    """What `systemd-analyze verify` says against our units; `replace` swaps in other unit texts,
    `dropins` adds files under /etc/systemd/system by their path there."""
    root = tmp_path / "root"
    host_units = next((d for d in HOST_UNIT_DIRS if (d / "sysinit.target").exists()), None)
    if host_units is None:
        pytest.skip("no systemd unit folder with sysinit.target on this host")
    shutil.copytree(host_units, root / "usr/lib/systemd/system", symlinks=True)
    ours = root / "etc/systemd/system"
    ours.mkdir(parents=True)
    for name in UNITS:
        text = (replace or {}).get(name, (UNIT_DIR / name).read_text())
        (ours / name).write_text(text)
        for key in ("Service.ExecStart", "Service.ExecStop"):
            for command in directives(name, text).get(key, []):
                binary = root / command.split()[0].lstrip("-@:+!").lstrip("/")
                binary.parent.mkdir(parents=True, exist_ok=True)
                binary.write_text("#!/bin/sh\n")
                binary.chmod(0o755)
    for path, text in (dropins or {}).items():
        (ours / path).parent.mkdir(parents=True, exist_ok=True)
        (ours / path).write_text(text)
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", f"--root={root}", *map(instance_name, UNITS)],
        check=False, capture_output=True, text=True, timeout=60)
    problems = [line for line in result.stderr.splitlines() if "pdserve" in line.replace(str(root), "")]
    if result.returncode != 0:
        problems.append(f"systemd-analyze verify exited {result.returncode}: {result.stderr.strip()}")
    return problems


@pytest.mark.e2e
@needs_systemd_analyze
def test_systemd_analyze_verify_accepts_every_unit(tmp_path):
    assert verify(tmp_path) == []


@needs_systemd_analyze
@pytest.mark.parametrize("broken", [
    ("Restart=on-failure", "Restat=on-failure"),     # a typo'd directive
    ("Restart=on-failure", "Restart=sometimes"),     # a bad value
    ("DeviceAllow=char-nvidia rw", "DeviceAllow=char-nvidia rx"),  # verify exits 0 on this one
    ("SystemCallFilter=@system-service", "SystemCallFilter=@system-services"),
])
@pytest.mark.e2e
def test_verify_catches_a_broken_unit(tmp_path, broken):
    """The check above can fail: a broken copy of the decode unit is reported."""
    old, new = broken
    text = (UNIT_DIR / WORKERS["decode"]).read_text()
    assert old in text
    assert verify(tmp_path, {WORKERS["decode"]: text.replace(old, new, 1)}) != []


@pytest.mark.parametrize("name", SERVICES)
def test_every_service_restarts_runs_as_its_own_user_and_is_hardened(name):
    unit = directives(name)
    assert unit["Service.Restart"] == ["on-failure"]
    assert unit["Service.User"] == ["pdserve"] and unit["Service.Group"] == ["pdserve"]
    for key, value in [("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"), ("ProtectHome", "yes"),
                       ("PrivateTmp", "yes"), ("ProtectKernelTunables", "yes"), ("ProtectControlGroups", "yes"),
                       ("RestrictSUIDSGID", "yes"), ("LockPersonality", "yes")]:
        assert unit.get(f"Service.{key}") == [value], key
    assert "Service.PrivateIPC" not in unit


@pytest.mark.parametrize("name", SERVICES)
def test_every_service_is_confined_further(name):
    unit = directives(name)
    for key, value in [("CapabilityBoundingSet", ""), ("SystemCallFilter", "@system-service"),
                       ("SystemCallErrorNumber", "EPERM"), ("RestrictNamespaces", "yes"),
                       ("ProtectKernelModules", "yes"), ("ProtectProc", "invisible"), ("UMask", "0077")]:
        assert unit.get(f"Service.{key}") == [value], key
    # Only the router binds ZeroMQ on tcp://, whose interface lookup opens a netlink socket.
    netlink = ["AF_NETLINK"] if name == "pdserve-router.service" else []
    assert unit["Service.RestrictAddressFamilies"] == [" ".join(["AF_UNIX", "AF_INET", "AF_INET6", *netlink])]
    assert len(unit["Service.MemoryMax"]) == 1 and re.fullmatch(r"\d+G", unit["Service.MemoryMax"][0])
    assert "Service.MemoryDenyWriteExecute" not in unit  # Triton's and CUDA's JIT


@pytest.mark.parametrize("name", [*WORKERS.values(), "pdserve-colocated@.service", "pdserve-router.service"])
def test_a_service_refused_is_not_restarted(name):
    assert directives(name)["Service.RestartPreventExitStatus"] == [str(EXIT_REFUSED)]


@pytest.mark.e2e
@needs_systemd_analyze
def test_an_instance_takes_its_memory_limit_from_a_drop_in(tmp_path):
    """deploy/README.md's way to change MemoryMax= (a value systemd does not expand variables in)."""
    dropin = "pdserve-decode@0.service.d/memory.conf"
    assert verify(tmp_path / "good", dropins={dropin: "[Service]\nMemoryMax=200G\n"}) == []
    assert verify(tmp_path / "bad", dropins={dropin: "[Service]\nMemoryMax=lots\n"}) != []  # read, so checked


@pytest.mark.parametrize("name", PDSERVE_SERVICES)
def test_pdserve_services_share_the_runtime_dir_and_the_model_cache(name):
    unit = directives(name)
    role = name.removeprefix("pdserve-").split("@")[0].removesuffix(".service")
    assert unit["Service.ExecStart"] == [
        f"/opt/pdserve/.venv/bin/python -m services.{role} --config /etc/pdserve/pdserve.toml"]
    assert unit["Service.EnvironmentFile"][0] == "/etc/pdserve/pdserve.env"
    assert unit["Service.RuntimeDirectory"] == ["pdserve"]
    assert unit["Service.RuntimeDirectoryMode"] == ["0700"]
    assert unit["Service.RuntimeDirectoryPreserve"] == ["yes"]  # one stopping must not delete the others' socket
    assert unit["Service.CacheDirectory"] == ["pdserve"]
    assert environment(name)["PDSERVE_MODEL_CACHE_DIR"] == "/var/cache/pdserve"
    assert unit["Unit.PartOf"] == ["pdserve.target"]
    # READY=1 and watchdog pings come from the services themselves (tests/test_lifecycle.py).
    assert unit["Service.Type"] == ["notify"] and unit["Service.NotifyAccess"] == ["main"]
    assert int(unit["Service.WatchdogSec"][0]) > 0


def test_the_router_may_open_a_file_for_every_connection_it_keeps():
    """systemd's default of 1,024 open files let about a thousand idle connections refuse new ones."""
    limit = int(directives("pdserve-router.service")["Service.LimitNOFILE"][0])
    assert limit >= RouterConfig().http_max_connections + FILES_BESIDE_HTTP


def test_router_sees_no_devices():
    unit = directives("pdserve-router.service")
    assert unit["Service.PrivateDevices"] == ["yes"]
    assert "Service.DeviceAllow" not in unit


@pytest.mark.parametrize("role", WORKERS)
def test_workers_are_instances_with_gpu_access_after_the_router(role):
    name = WORKERS[role]
    unit = directives(name)
    assert environment(name)[f"PDSERVE_{role.upper()}_WORKER_ID"] == f"{role}-%i"
    assert unit["Service.EnvironmentFile"] == ["/etc/pdserve/pdserve.env", f"/etc/pdserve/{role}-%i.env"]
    assert unit["Service.DevicePolicy"] == ["closed"]
    assert {"char-nvidia rw", "char-nvidiactl rw", "char-nvidia-uvm rw"} <= set(unit["Service.DeviceAllow"])
    assert unit["Service.LimitMEMLOCK"] == ["infinity"]
    assert "pdserve-router.service" in " ".join(unit["Unit.After"])
    assert "pdserve-router.service" in " ".join(unit["Unit.Wants"])


def env_file(name: str) -> dict[str, str]:
    lines = (line.partition("=") for line in (UNIT_DIR / name).read_text().splitlines() if "=" in line)
    return {key.strip(): value.strip() for key, _, value in lines if not key.startswith("#")}


def test_each_instance_takes_its_cores_port_and_gpu_from_its_own_file():
    """Nothing the template or the shared file sets could give two instances the same cores or port."""
    own = {role: [f"PDSERVE_{role.upper()}_CPU_CORES", f"PDSERVE_{role.upper()}_METRICS_ADDRESS",
                  "PDSERVE_MODEL_DEVICE"] for role in WORKERS}
    shared = env_file("pdserve.env.example")
    for role, name in WORKERS.items():
        assert "Service.CPUAffinity" not in directives(name)
        assert not set(own[role][:2]) & (set(environment(name)) | set(shared))
        assert set(own[role]) <= set(env_file(f"{role}-0.env.example"))
    prefill, decode = env_file("prefill-0.env.example"), env_file("decode-0.env.example")
    prefill_cores = set(parse_cores(prefill["PDSERVE_PREFILL_CPU_CORES"]))
    assert not prefill_cores & set(parse_cores(decode["PDSERVE_DECODE_CPU_CORES"]))
    assert prefill["PDSERVE_PREFILL_METRICS_ADDRESS"] != decode["PDSERVE_DECODE_METRICS_ADDRESS"]


def test_colocated_runs_its_instances_two_workers_on_disjoint_cores_of_its_affinity():
    name = "pdserve-colocated@.service"
    unit, env = directives(name), environment(name)
    assert (env["PDSERVE_PREFILL_WORKER_ID"], env["PDSERVE_DECODE_WORKER_ID"]) == ("prefill-%i", "decode-%i")
    assert sorted(unit["Unit.Conflicts"][0].split()) == ["pdserve-decode@%i.service", "pdserve-prefill@%i.service"]
    prefill, decode = (set(parse_cores(env[f"PDSERVE_{role}_CPU_CORES"])) for role in ("PREFILL", "DECODE"))
    assert prefill | decode <= set(parse_cores(unit["Service.CPUAffinity"][0])) and not prefill & decode
    assert {"char-nvidia rw", "char-nvidiactl rw", "char-nvidia-uvm rw"} <= set(unit["Service.DeviceAllow"])


def test_target_wants_the_router_and_instance_0_of_each_worker():
    wants = " ".join(directives("pdserve.target")["Unit.Wants"]).split()
    assert sorted(wants) == ["pdserve-decode@0.service", "pdserve-prefill@0.service", "pdserve-router.service"]


def test_every_pdserve_variable_names_a_config_field():
    """systemd passes a misspelt variable through silently, and the config would ignore it."""
    known = config_variables()
    examples = [p for p in UNIT_DIR.iterdir() if p.name.endswith(".env.example")]
    assert examples
    named = {line.lstrip("#").partition("=")[0].strip()
             for p in examples for line in p.read_text().splitlines() if line.lstrip("#").startswith("PDSERVE_")}
    named |= {key for name in PDSERVE_SERVICES for key in environment(name) if key.startswith("PDSERVE_")}
    assert named and named <= known, sorted(named - known)
