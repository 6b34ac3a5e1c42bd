"""services/stack/topology.py: where `python -m services.stack` puts each worker (id, metrics port,
cores, GPU), and that a worker reads back exactly its own share. The processes themselves are
started in tests/test_scale_out.py."""

from __future__ import annotations

import argparse
import os
import socket

import pytest

from services.stack.preflight import bound_addresses, obstacles
from services.stack.topology import format_cores, plan_workers, split_cores
from shared.config.loading import add_config_arguments, load_config
from shared.config.schema import ConfigError, parse_cores, parse_devices
from shared.runtime.runtime_dir import claim_runtime_dir

SIXTEEN = list(range(16))


def plan(gpus: int = 0, cores: list[int] = SIXTEEN, **env: str):
    return plan_workers(load_config(None, {f"PDSERVE_{k.upper()}": v for k, v in env.items()}), cores, gpus)


def test_the_preflight_names_a_held_runtime_folder_and_each_taken_address(tmp_path):
    """What `python -m services.stack` checks before starting anything (services/stack/preflight.py)."""
    folder = str(tmp_path)
    config = load_config(None, {"PDSERVE_ROUTER_RUNTIME_DIR": folder, "PDSERVE_ROUTER_HTTP_ADDRESS": "",
                                "PDSERVE_ROUTER_ZMQ_ADDRESS": "tcp://127.0.0.1:5990"})
    workers = plan_workers(config, SIXTEEN, 0)
    assert set(bound_addresses(config, workers)) == {
        "router.grpc_address", "router.metrics_address", "router.zmq_address",
        "prefill-0's prefill.metrics_address", "decode-0's decode.metrics_address"}  # no HTTP API: nothing bound
    with socket.create_server(("127.0.0.1", 0)) as taken:
        config.router.grpc_address = f"127.0.0.1:{taken.getsockname()[1]}"
        config.router.metrics_address = config.decode.metrics_address = config.prefill.metrics_address = ""
        held = claim_runtime_dir(folder)
        try:
            assert obstacles(config, plan_workers(config, SIXTEEN, 0)) == [
                f"runtime folder {folder} is held by another router (pid {os.getpid()}), of another stack on this "
                f"host: stop that stack, or give this one a folder of its own (router.runtime_dir)",
                f"router.grpc_address {config.router.grpc_address}: Address already in use"]
        finally:
            held.close()
    assert obstacles(config, plan_workers(config, SIXTEEN, 0)) == []


def test_two_of_each_get_their_own_ids_ports_and_cores():
    workers = plan(stack_prefill="2", stack_decode="2")
    assert [w.name for w in workers] == ["prefill-0", "prefill-1", "decode-0", "decode-1"]
    # The decodes' range moves past the prefills' (the defaults 9401 and 9402 would overlap).
    assert [w.metrics_address for w in workers] == [f"127.0.0.1:{p}" for p in (9401, 9402, 9403, 9404)]
    assert [w.cores for w in workers] == [tuple(range(i, i + 4)) for i in (0, 4, 8, 12)]
    assert {w.device for w in workers} == {"cpu"}


def test_one_of_each_takes_the_halves_a_worker_alone_would():
    assert [w.cores for w in plan(cores=[0, 1, 2])] == [(0,), (1, 2)]  # pin_to_cores: lower [:1], upper [1:]
    assert [w.metrics_address for w in plan()] == ["127.0.0.1:9401", "127.0.0.1:9402"]


def test_a_role_with_its_own_cores_splits_them_and_leaves_the_rest_to_the_other():
    workers = plan(stack_prefill="2", stack_decode="3", prefill_cpu_cores="0-3")
    assert [w.cores for w in workers] == [(0, 1), (2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15)]


def test_fewer_cores_than_workers_are_shared_round_robin():
    assert [w.cores for w in plan(cores=[0, 1], stack_prefill="2", stack_decode="2")] == [(0,), (1,), (0,), (1,)]
    assert split_cores([4, 5, 6, 7, 8], 2) == [(4, 5), (6, 7, 8)]


def test_metrics_ports_skip_the_routers_and_stay_off_where_asked():
    workers = plan(router_metrics_address="127.0.0.1:9401", decode_metrics_address="", stack_prefill="2")
    assert [w.metrics_address for w in workers] == ["127.0.0.1:9402", "127.0.0.1:9403", ""]


def test_devices_by_hand_one_each_or_one_for_all():
    workers = plan(gpus=4, model_device="cuda:0", stack_prefill="2", stack_decode="2",
                   stack_devices="prefill=0,1 decode=cuda:2,3")
    assert [w.device for w in workers] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    workers = plan(gpus=2, model_device="cuda:0", stack_decode="2", stack_devices="decode=1")
    assert [w.device for w in workers] == ["cuda:0", "cuda:1", "cuda:1"]


def test_cuda_spreads_one_gpu_each_where_there_are_enough():
    assert [w.device for w in plan(gpus=4, model_device="cuda", stack_decode="2")] == ["cuda:0", "cuda:1", "cuda:2"]
    assert {w.device for w in plan(gpus=2, model_device="cuda", stack_decode="2")} == {"cuda:0"}
    assert {w.device for w in plan(gpus=4, model_device="cuda:3", stack_decode="2")} == {"cuda:3"}


@pytest.mark.parametrize("env, message", [
    (dict(stack_devices="decode=0"), "model.device is 'cpu'"),
    (dict(model_device="cuda:0", stack_decode="3", stack_devices="decode=0,1"), "gives decode 2 GPUs for 3"),
    (dict(model_device="cuda:0", stack_devices="decode=4"), "cuda:4 is not among the 4 GPUs"),
    (dict(model_device="cuda:0", stack_devices="decode=1", decode_weights_from="prefill-0"),
     "shares prefill-0's weights on its GPU only, cuda:0, but decode-0 is on cuda:1"),
    (dict(model_device="cuda", stack_decode="2", decode_weights_from="prefill-0"), "but decode-0 is on cuda:1"),
], ids=["GPUs for a CPU model", "wrong count", "no such GPU", "weights across GPUs", "weights across spread GPUs"])
def test_layouts_that_cannot_work_are_refused(env, message):
    with pytest.raises(ConfigError, match=message):
        plan(gpus=4, **env)


def test_shared_weights_on_the_owners_gpu_are_fine():
    workers = plan(gpus=2, model_device="cuda:1", stack_decode="2", decode_weights_from="prefill-0")
    assert {w.device for w in workers} == {"cuda:1"}


@pytest.mark.parametrize("spec", ["prefill=0 prefill=1", "prefill:0", "router=0", "decode=a", "decode="])
def test_bad_device_lists_are_config_errors(spec):
    with pytest.raises(ConfigError, match="bad device group"):
        parse_devices(spec)
    with pytest.raises(ConfigError, match="stack.devices"):
        load_config(None, {"PDSERVE_STACK_DEVICES": spec})


def test_each_worker_reads_back_its_own_share_through_flags_that_beat_the_forwarded_ones():
    """The launcher forwards its own command line to every worker, then the worker's settings."""
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    forwarded = ["--prefill", "2", "--decode", "2", "--prefill-cpu-cores", "0-7", "--prefill-worker-id", "mine"]
    [_, second, *_] = plan_workers(load_config(parser.parse_args(forwarded), {}), SIXTEEN, 0)
    config = load_config(parser.parse_args([*forwarded, *second.args()]), {})
    assert (config.stack.prefill, config.stack.decode) == (2, 2)
    assert (config.prefill.worker_id, parse_cores(config.prefill.cpu_cores)) == ("prefill-1", [4, 5, 6, 7])
    assert (config.prefill.metrics_address, config.model.device) == ("127.0.0.1:9402", "cpu")
    from_env = load_config(None, second.env())
    assert (from_env.prefill.worker_id, from_env.prefill.cpu_cores) == ("prefill-1", "4-7")


def test_core_lists_print_as_they_parse():
    for cores in [(0,), (0, 1, 2, 5), (3, 7, 8, 9, 12)]:
        assert tuple(parse_cores(format_cores(cores))) == cores
