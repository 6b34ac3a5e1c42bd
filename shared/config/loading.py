"""Where the settings (shared/config/schema.py) come from.

Every field is read, lowest precedence first, from: its default, a TOML file (`--config`, or
`PDSERVE_CONFIG`; example in deploy/pdserve.toml), an environment variable
`PDSERVE_<SECTION>_<FIELD>`, and a command-line flag `--<section>-<field>`. Values are validated
once, at load, so a service never starts on a bad setting.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import tomllib
import typing
from pathlib import Path

from shared.config.schema import Config, ConfigError


def env_name(section: str, key: str) -> str:
    return f"PDSERVE_{section}_{key}".upper()


# PDSERVE_* variables that are not settings: the config file's path, the MPS script's SM shares
# (deploy/mps/run-on-one-gpu.sh), which its services inherit, and what a tensor-parallel worker's
# rank 0 tells the other ranks it starts (shared/worker/ranks.py).
OTHER_VARIABLES = frozenset({"PDSERVE_CONFIG", "PDSERVE_PREFILL_SM_PERCENT", "PDSERVE_DECODE_SM_PERCENT",
                             "PDSERVE_TP_RANK", "PDSERVE_TP_STORE"})


def check_variables(environ: typing.Mapping[str, str]) -> None:
    """A PDSERVE_* variable that names no setting is a typo (PDSERVE_KV_DTYPES=int8): refused,
    with the closest setting named, as an unknown flag is, rather than served with the default."""
    known = {env_name(section, f.name) for section, section_type in _sections()
             for f in dataclasses.fields(section_type)}
    for name in sorted(n for n in environ if n.startswith("PDSERVE_") and n not in known | OTHER_VARIABLES):
        closest = difflib.get_close_matches(name, sorted(known | OTHER_VARIABLES), n=1)
        hint = f"; did you mean {closest[0]}?" if closest else ""
        raise ConfigError(f"environment variable {name} names no setting{hint}")


def flag_name(section: str, key: str) -> str:
    return f"--{section}-{key}".replace("_", "-")


def _sections() -> typing.Iterator[tuple[str, type]]:
    for f in dataclasses.fields(Config):
        yield f.name, typing.get_type_hints(Config)[f.name]


def _apply(raw: object, f: dataclasses.Field, kind: type, where: str) -> object:
    value = _coerce(raw, kind, where)
    if "check" in f.metadata:
        rule, message = f.metadata["check"]
        try:
            ok = rule(value)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        if not ok:
            raise ConfigError(f"{where}: {value!r} {message}")
    return value


def _coerce(raw: object, kind: type, where: str) -> object:
    if isinstance(raw, str) and kind is not str:
        try:
            return {"True": True, "true": True, "1": True, "False": False, "false": False, "0": False}[raw] \
                if kind is bool else kind(raw)
        except (ValueError, KeyError):
            raise ConfigError(f"{where}: {raw!r} is not a {kind.__name__}") from None
    if kind is float and isinstance(raw, int) and not isinstance(raw, bool):
        return float(raw)
    if not isinstance(raw, kind) or (kind is int and isinstance(raw, bool)):
        raise ConfigError(f"{where}: {raw!r} is not a {kind.__name__}")
    return raw


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML config file (also PDSERVE_CONFIG)")
    for section, section_type in _sections():
        for f in dataclasses.fields(section_type):
            flags = [flag_name(section, f.name), *([f.metadata["flag"]] if "flag" in f.metadata else [])]
            parser.add_argument(*flags, dest=f"{section}.{f.name}",
                                default=None, metavar=typing.get_type_hints(section_type)[f.name].__name__.upper())


def load_config(args: argparse.Namespace | None = None, environ: typing.Mapping[str, str] = os.environ) -> Config:
    check_variables(environ)
    config = Config()
    path = getattr(args, "config", None) or environ.get("PDSERVE_CONFIG")
    table: dict = {}
    if path:
        try:
            table = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from None
        unknown = set(table) - {name for name, _ in _sections()}
        if unknown:
            raise ConfigError(f"{path}: unknown sections {sorted(unknown)}")
    for section, section_type in _sections():
        target = getattr(config, section)
        hints = typing.get_type_hints(section_type)
        fields = {f.name: f for f in dataclasses.fields(section_type)}
        unknown = set(table.get(section, {})) - set(fields)
        if unknown:
            raise ConfigError(f"{path}: unknown keys in [{section}]: {sorted(unknown)}")
        for name, f in fields.items():
            layers = [
                (table.get(section, {}).get(name), f"{path}"),
                (environ.get(env_name(section, name)), env_name(section, name)),
                (getattr(args, f"{section}.{name}", None) if args else None, flag_name(section, name)),
            ]
            for raw, source in layers:
                if raw is not None:
                    setattr(target, name, _apply(raw, f, hints[name], f"{section}.{name} (from {source})"))
    config.validate()
    return config
