"""shared/config/ (schema.py, loading.py): defaults, the four layers in order of precedence, and errors that say where."""

import argparse
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from shared.config.loading import add_config_arguments, load_config

from shared.config.schema import Config, ConfigError, parse_cores
from shared.runtime.service_config import check_service
from tests.stack import REPO



def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return parser.parse_args(list(argv))


def write_toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "pdserve.toml"
    path.write_text(text)
    return str(path)


def test_defaults_validate():
    config = Config()
    config.validate()
    loaded = load_config(parse(), environ={})
    assert loaded.kv.page_size == 16 and loaded.model.path == "embedded"
    assert loaded.log.format == "auto" and loaded.decode.max_batch_size == 64


def test_precedence_default_file_env_flag(tmp_path):
    path = write_toml(tmp_path, "[kv]\npage_size = 32\n[router]\nheartbeat_timeout_s = 4\n")
    env = {"PDSERVE_KV_PAGE_SIZE": "48"}

    assert load_config(parse(), environ={}).kv.page_size == 16
    assert load_config(parse("--config", path), environ={}).kv.page_size == 32
    assert load_config(parse("--config", path), environ=env).kv.page_size == 48
    assert load_config(parse("--config", path, "--kv-page-size", "64"), environ=env).kv.page_size == 64
    # A flag wins over the file even without an env var; an env var wins over the default alone.
    assert load_config(parse("--config", path, "--kv-page-size", "64"), environ={}).kv.page_size == 64
    assert load_config(parse(), environ=env).kv.page_size == 48


def test_layers_apply_per_field(tmp_path):
    path = write_toml(tmp_path, "[kv]\npage_size = 32\ndecode_pages = 100\n[router]\nheartbeat_timeout_s = 4\n")
    config = load_config(parse("--config", path, "--decode-max-batch-size", "8"),
                         environ={"PDSERVE_KV_PREFILL_PAGES": "50", "PDSERVE_LOG_LEVEL": "debug"})
    assert (config.kv.page_size, config.kv.decode_pages, config.kv.prefill_pages) == (32, 100, 50)
    assert config.decode.max_batch_size == 8 and config.log.level == "debug"
    assert config.router.heartbeat_timeout_s == 4.0 and type(config.router.heartbeat_timeout_s) is float
    assert config.worker.heartbeat_interval_s == 0.5  # untouched fields keep their defaults


def test_config_file_from_environment(tmp_path):
    path = write_toml(tmp_path, '[model]\npath = "/models/x"\n')
    assert load_config(parse(), environ={"PDSERVE_CONFIG": path}).model.path == "/models/x"


def test_flags_for_every_section_exist():
    args = parse("--model-dtype", "bfloat16", "--router-grpc-address", "0.0.0.0:1", "--prefill-cpu-cores", "0-1",
                 "--defaults-max-tokens", "9", "--log-format", "json", "--worker-heartbeat-interval-s", "0.25")
    config = load_config(args, environ={})
    assert config.model.dtype == "bfloat16" and config.router.grpc_address == "0.0.0.0:1"
    assert config.prefill.cpu_cores == "0-1" and config.defaults.max_tokens == 9
    assert config.log.format == "json" and config.worker.heartbeat_interval_s == 0.25


def test_non_int_page_size_from_env_names_the_variable():
    with pytest.raises(ConfigError, match="PDSERVE_KV_PAGE_SIZE"):
        load_config(parse(), environ={"PDSERVE_KV_PAGE_SIZE": "sixteen"})


def test_non_int_from_flag_names_the_flag():
    with pytest.raises(ConfigError, match="--kv-page-size"):
        load_config(parse("--kv-page-size", "1.5"), environ={})


def test_wrong_type_in_file_names_the_file_and_key(tmp_path):
    path = write_toml(tmp_path, '[kv]\npage_size = "big"\n')
    with pytest.raises(ConfigError) as error:
        load_config(parse("--config", path), environ={})
    assert path in str(error.value) and "page_size" in str(error.value)


def test_bool_is_not_an_int_in_file(tmp_path):
    path = write_toml(tmp_path, "[kv]\npage_size = true\n")
    with pytest.raises(ConfigError, match="page_size"):
        load_config(parse("--config", path), environ={})


def test_unknown_section_names_the_file_and_section(tmp_path):
    path = write_toml(tmp_path, "[kvcache]\npage_size = 16\n")
    with pytest.raises(ConfigError) as error:
        load_config(parse("--config", path), environ={})
    assert path in str(error.value) and "kvcache" in str(error.value)


def test_unknown_key_names_the_file_and_key(tmp_path):
    path = write_toml(tmp_path, "[kv]\npage_sise = 16\n")
    with pytest.raises(ConfigError) as error:
        load_config(parse("--config", path), environ={})
    assert path in str(error.value) and "page_sise" in str(error.value)


def test_unreadable_or_invalid_file(tmp_path):
    with pytest.raises(ConfigError, match="missing.toml"):
        load_config(parse("--config", str(tmp_path / "missing.toml")), environ={})
    path = write_toml(tmp_path, "[kv\n")
    with pytest.raises(ConfigError, match="pdserve.toml"):
        load_config(parse("--config", path), environ={})


@pytest.mark.parametrize(("environ", "setting"), [
    ({"PDSERVE_LOG_FORMAT": "xml"}, "log.format"),
    ({"PDSERVE_KV_PAGE_SIZE": "0"}, "kv.page_size"),
    ({"PDSERVE_MODEL_DTYPE": "int8"}, "model.dtype"),
    ({"PDSERVE_ROUTER_HEARTBEAT_TIMEOUT_S": "0.1"}, "heartbeat_timeout_s"),
])
def test_bad_value_is_refused_and_names_the_setting(environ, setting):
    with pytest.raises(ConfigError, match=setting):
        load_config(parse(), environ=environ)


@pytest.mark.parametrize("environ", [{"PDSERVE_PREFILL_CPU_CORES": "a-b"}, {"PDSERVE_DECODE_CPU_CORES": "a-b"}])
def test_bad_core_list_is_refused(environ):
    with pytest.raises(ConfigError, match="a-b"):
        load_config(parse(), environ=environ)


@pytest.mark.parametrize(("environ", "source"), [
    ({"PDSERVE_LOG_FORMAT": "xml"}, "PDSERVE_LOG_FORMAT"),
    ({"PDSERVE_DECODE_CPU_CORES": "a-b"}, "PDSERVE_DECODE_CPU_CORES"),
])
def test_validation_error_names_the_source(environ, source):
    with pytest.raises(ConfigError, match=source):
        load_config(parse(), environ=environ)


def test_parse_cores():
    assert parse_cores("0-2,5") == [0, 1, 2, 5]
    assert parse_cores("") == []
    assert parse_cores(" 3 , 1-1 ") == [3, 1]
    for bad in ("a-b", "1-x", "1-2-3", "-1", "0,,z"):
        with pytest.raises(ConfigError):
            parse_cores(bad)


def test_reversed_core_range_is_refused():
    with pytest.raises(ConfigError):
        parse_cores("3-1")


def test_example_file_loads_with_the_values_it_states():
    example = REPO / "deploy" / "pdserve.toml"
    config = load_config(parse("--config", str(example)), environ={})
    config.validate()
    stated = {(section, key): value for section, table in tomllib.loads(example.read_text()).items()
              for key, value in table.items()}
    assert {setting: getattr(getattr(config, setting[0]), setting[1]) for setting in stated} == stated
    # `make run` starts all three services from this file on one host: each needs its own ports.
    ports = [config.router.grpc_address, config.router.http_address, config.router.metrics_address,
             config.prefill.metrics_address, config.decode.metrics_address]
    assert len(set(ports)) == len(ports), ports


def test_colocated_refuses_mapping_weights_it_already_shares():
    config = load_config(parse(), environ={"PDSERVE_DECODE_WEIGHTS_FROM": "prefill-0"})
    check_service(config, "decode")
    with pytest.raises(ConfigError, match="decode.weights_from"):
        check_service(config, "colocated")


def test_colocated_refuses_a_spinning_decode():
    config = load_config(parse(), environ={"PDSERVE_DECODE_IDLE_SPIN_S": "0.5"})
    check_service(config, "decode")
    with pytest.raises(ConfigError, match="decode.idle_spin_s"):
        check_service(config, "colocated")
    with pytest.raises(ConfigError, match="must be >= 0"):
        load_config(parse(), environ={"PDSERVE_DECODE_IDLE_SPIN_S": "-1"})


def test_the_graph_sizes_end_at_the_decode_s_largest_batch():
    """Every batch the decode steps fits a CUDA graph (none runs eagerly, compiling kernels during
    requests), and none is captured larger than a step can be."""
    def sizes(environ):
        return load_config(None, environ).decode.graph_batch_sizes()
    assert sizes({}) == [1, 2, 4, 8, 16, 32, 64]
    assert sizes({"PDSERVE_DECODE_MAX_BATCH_SIZE": "100"}) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert sizes({"PDSERVE_DECODE_MAX_BATCH_SIZE": "24"}) == [1, 2, 4, 8, 16, 24]
    assert sizes({"PDSERVE_DECODE_MAX_BATCH_SIZE": "16", "PDSERVE_DECODE_CUDA_GRAPH_BATCH_SIZES": "16,4,4"}) == [4, 16]
    assert sizes({"PDSERVE_DECODE_CUDA_GRAPH_BATCH_SIZES": ""}) == []


def test_kv_transfer_is_checked_against_the_device_and_the_service():
    assert load_config(None, {"PDSERVE_KV_TRANSFER": "nixl"}).kv.transfer == "nixl"
    with pytest.raises(ConfigError, match="PDSERVE_KV_TRANSFER.*must be auto, shm, cuda_ipc or nixl"):
        load_config(None, {"PDSERVE_KV_TRANSFER": "rdma"})
    with pytest.raises(ConfigError, match="kv.transfer shm moves host memory, but the pools are on a GPU"):
        load_config(None, {"PDSERVE_KV_TRANSFER": "shm", "PDSERVE_MODEL_DEVICE": "cuda:1"})
    with pytest.raises(ConfigError, match="kv.transfer cuda_ipc moves GPU memory, but the pools are on cpu"):
        load_config(None, {"PDSERVE_KV_TRANSFER": "cuda_ipc"})
    with pytest.raises(ConfigError, match="kv.transfer nixl does not apply to services.colocated"):
        check_service(load_config(None, {"PDSERVE_KV_TRANSFER": "nixl"}), "colocated")


@pytest.mark.parametrize(("variable", "closest"), [
    ("PDSERVE_KV_DTYPES", "PDSERVE_KV_DTYPE"),
    ("PDSERVE_ROUTER_GRPC_ADRESS", "PDSERVE_ROUTER_GRPC_ADDRESS"),
])
def test_a_variable_that_names_no_setting_is_refused_with_the_closest_one(variable, closest):
    with pytest.raises(ConfigError, match=f"{variable} names no setting; did you mean {closest}\\?"):
        load_config(parse(), environ={variable: "int8"})


def test_our_variables_that_are_not_settings_are_accepted():
    config = load_config(parse(), environ={"PDSERVE_PREFILL_SM_PERCENT": "30", "PDSERVE_KV_DTYPE": "int8"})
    assert config.kv.dtype == "int8"


@pytest.mark.e2e
@pytest.mark.parametrize("service", ["router", "prefill", "stack"])
def test_a_service_started_with_a_mistyped_variable_exits_2_naming_it(service, tmp_path):
    environ = {**os.environ, "PDSERVE_KV_DTYPES": "int8", "PDSERVE_ROUTER_RUNTIME_DIR": str(tmp_path / "run")}
    done = subprocess.run([sys.executable, "-m", f"services.{service}"], cwd=REPO, env=environ,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "PDSERVE_KV_DTYPES names no setting; did you mean PDSERVE_KV_DTYPE?" in done.stderr


def test_tensor_parallel_settings_that_cannot_work_together_are_refused():
    with pytest.raises(ConfigError, match="decode.weights_from maps a whole model"):
        load_config(None, {"PDSERVE_DECODE_WEIGHTS_FROM": "prefill-0", "PDSERVE_PREFILL_TENSOR_PARALLEL": "2"})
    load_config(None, {"PDSERVE_KV_TRANSFER": "nixl", "PDSERVE_DECODE_TENSOR_PARALLEL": "3"})  # pairs any sizes
    with pytest.raises(ConfigError, match="services.colocated runs one model in one process"):
        check_service(load_config(None, {"PDSERVE_DECODE_TENSOR_PARALLEL": "3"}), "colocated")
    with pytest.raises(ConfigError, match="prefill.tensor_parallel .from PDSERVE_PREFILL_TENSOR_PARALLEL.: 0 must be positive"):
        load_config(None, {"PDSERVE_PREFILL_TENSOR_PARALLEL": "0"})


@pytest.mark.e2e
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_tensor_parallel_size_the_model_cannot_be_split_by_exits_2_before_any_rank_starts(role, checkpoint,
                                                                                            tmp_path):
    """The embedded model has 9 attention heads: 2 ranks cannot share them."""
    environ = {**os.environ, "PDSERVE_ROUTER_RUNTIME_DIR": str(tmp_path / "run"), "PDSERVE_LOG_FORMAT": "json"}
    done = subprocess.run([sys.executable, "-m", f"services.{role}", f"--{role}-tensor-parallel", "2"], cwd=REPO,
                          env=environ, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "tensor_parallel 2 does not divide the model's 9 attention heads" in done.stdout + done.stderr
    assert "tensor-parallel ranks joined" not in done.stdout + done.stderr


def test_a_prefill_held_to_flashinfer_without_it_is_refused():
    """prefill.attention = flashinfer on a machine without FlashInfer or a Hopper GPU (this CPU) exits 2
    naming the setting, rather than serving with another kernel than the one asked for."""
    from shared.worker import main

    config = load_config(None, {"PDSERVE_PREFILL_ATTENTION": "flashinfer", "PDSERVE_MODEL_DEVICE": "cpu",
                                "PDSERVE_MODEL_PATH": "random:llama-tiny"})
    with pytest.raises(main.KernelsMissing, match="prefill.attention = flashinfer needs FlashInfer") as refused:
        main.load_model(config)
    assert refused.value.exit_code == 2
    with pytest.raises(ConfigError, match="must be auto, flashinfer, cudnn or sdpa"):
        load_config(None, {"PDSERVE_PREFILL_ATTENTION": "fa3"})


def test_prefill_attention_names_the_ways_the_model_layer_has():
    """shared/config/schema.py imports nothing of the model layer, so its list of ways is written out: it
    stays the attention module's ways and `auto`."""
    from shared.model.attention import PREFILL_WAYS

    for way in ("auto", *PREFILL_WAYS):
        assert load_config(None, {"PDSERVE_PREFILL_ATTENTION": way}).prefill.attention == way
    with pytest.raises(ConfigError, match="must be " + ", ".join(("auto", *PREFILL_WAYS[:-1])) + f" or {PREFILL_WAYS[-1]}"):
        load_config(None, {"PDSERVE_PREFILL_ATTENTION": "none"})
