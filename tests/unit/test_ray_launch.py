"""The pure parts of `asyncrl ray` (launch/ray_job.py): its options, the rendezvous each rank gets, and where the
generators find the learner; the cluster itself is tests/integration/test_ray_real.py's."""

import pytest

from asyncrl.configs import load_config
from asyncrl.launch.cli import build_parser
from asyncrl.launch.ray_job import RayLaunchError, job_overrides, launch_of, rank_env


def parse(*argv):
    return build_parser().parse_args(["ray", *argv])


def test_options_parse_into_a_launch_and_bad_ones_are_refused_naming_the_option():
    launch = launch_of(parse("--generators", "3", "--nproc", "2", "--learner-resources", '{"learner_host": 1}',
                             "--autoscale", "1:4", "learner.lr=1e-6"))
    assert (launch.generators, launch.nproc, launch.learner_resources, launch.autoscale) == (3, 2, {"learner_host": 1},
                                                                                          "1:4")
    assert launch.gpus_per_rank is None  # decided from the cluster: 1 when it has GPUs
    with pytest.raises(RayLaunchError, match="--generator-resources must be a JSON object"):
        launch_of(parse("--generator-resources", '["gpu"]'))
    with pytest.raises(RayLaunchError, match="--generators and --nproc must be >= 1"):
        launch_of(parse("--generators", "0"))
    with pytest.raises(SystemExit):  # not JSON at all: argparse names the option
        parse("--learner-resources", "{learner_host: 1}")


def test_each_rank_gets_an_env_rendezvous_on_rank_zeros_node_and_one_rank_gets_none():
    assert rank_env(0, 1, "10.0.0.1", 29500) == {}
    env = rank_env(1, 4, "10.0.0.1", 29500)
    assert env == {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


def test_generators_find_the_zmq_buffer_and_the_weights_on_the_learners_node_and_redis_where_the_recipe_says():
    zmq = job_overrides(load_config(None, []), "10.0.0.7")
    assert zmq == ["weightsync.host=0.0.0.0", "weightsync.advertise=10.0.0.7", "buffer.host=10.0.0.7"]
    redis = job_overrides(load_config(None, ["buffer.backend=redis"]), "10.0.0.7")
    assert "buffer.host=10.0.0.7" not in redis and "weightsync.advertise=10.0.0.7" in redis


def test_ray_scale_refuses_an_empty_fleet_before_reaching_the_cluster(capsys):
    from asyncrl.launch.ray_job import cmd_ray_scale

    assert cmd_ray_scale(["scale", "job", "--generators", "0"]) == 2
    assert "--generators must be >= 1" in capsys.readouterr().err


def test_an_address_nobody_answers_is_a_clear_error_at_once_not_rays_minutes_of_retries(capsys):
    from asyncrl.launch.ray_job import cmd_ray_scale
    from tests.conftest import free_port

    address = f"127.0.0.1:{free_port()}"
    assert cmd_ray_scale(["scale", "job", "--generators", "2", "--address", address]) == 2
    assert f"no Ray cluster answers at --address {address}" in capsys.readouterr().err


def test_ctrl_c_while_supervising_sets_a_flag_and_a_second_one_raises():
    """The driver's supervise loop reads Ctrl-C from a flag (a SIGINT inside Ray's wait can be lost, launch/ray_job.py
    ::ctrl_c_flag); a second Ctrl-C raises at once; Python's handler is back after."""
    import os
    import signal
    import time

    from asyncrl.launch.ray_job import ctrl_c_flag

    before = signal.getsignal(signal.SIGINT)
    with ctrl_c_flag() as interrupted:
        os.kill(os.getpid(), signal.SIGINT)
        assert interrupted.wait(5)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler runs (and raises) as soon as the signal arrives
    assert signal.getsignal(signal.SIGINT) is before
