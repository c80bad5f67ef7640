"""Tests of axlearn.common.cluster_env (a process's place in a multi-process run) and of
multi-process training as a cluster runs it: two processes of four devices each, placed by
SLURM's environment, train as one process of eight devices does."""

import re

import pytest

from axlearn.common import cluster_env
from axlearn.common.cluster_env import ProcessPlacement, process_placement
from axlearn.common.config import ConfigError
from tests.test_launch import _free_port, _losses, _main

# The environment `srun --nodes=2 --ntasks-per-node=4` gives task 5 (on the second node).
SLURM_TASK = {
    "SLURM_JOB_ID": "123456",
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_NODELIST": "gpu[003-004]",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
}

# The environment of pod 2 of a 4-completion indexed Job (Kubernetes sets the index).
K8S_POD = {
    "JOB_COMPLETION_INDEX": "2",
    "AXLEARN_NUM_PROCESSES": "4",
    "JAX_COORDINATOR_ADDRESS": "train-0.train:1234",
}


def test_without_flags_or_a_cluster_a_run_has_one_process():
    assert process_placement(environ={"HOME": "/root"}) is None


def test_flags_place_the_process_and_pick_its_gpu():
    placement = process_placement(
        coordinator_address="localhost:1234", num_processes=4, process_id=2,
        local_device_ids=cluster_env.parse_device_ids("2"), environ={},
    )
    assert placement == ProcessPlacement("localhost:1234", 4, 2, (2,), "flags")


def test_flags_win_over_the_cluster_environment():
    placement = process_placement(
        coordinator_address="host:1", num_processes=2, process_id=1, environ=SLURM_TASK
    )
    assert placement.source == "flags" and placement.num_processes == 2


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(coordinator_address="localhost:1234"), "needs --num_processes, --process_id too"),
        (dict(local_device_ids=(0,)), "--local_device_ids needs a multi-process run"),
        (dict(coordinator_address="h:1", num_processes=2, process_id=2), r"not in \[0, 2\)"),
        (dict(coordinator_address="h", num_processes=2, process_id=0), "must be host:port"),
    ],
)
def test_incomplete_or_impossible_flags_are_rejected(flags, message):
    with pytest.raises(ConfigError, match=message):
        process_placement(environ={}, **flags)


def test_a_slurm_task_is_placed_from_srun_s_environment():
    placement = process_placement(environ=SLURM_TASK)
    # The first node hosts the coordinator, on a port every task derives from the job id;
    # four tasks share a node and each sees all its GPUs: task 5 is its node's task 1.
    assert placement == ProcessPlacement("gpu003:64456", 8, 5, (1,), "SLURM")


def test_a_slurm_task_bound_to_one_gpu_uses_the_one_it_sees():
    placement = process_placement(environ=dict(SLURM_TASK, CUDA_VISIBLE_DEVICES="1"))
    assert placement.local_device_ids is None


def test_a_slurm_task_alone_on_its_node_uses_all_its_gpus():
    environ = dict(SLURM_TASK, SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="0")
    placement = process_placement(environ=dict(environ, SLURM_STEP_TASKS_PER_NODE="1(x2)"))
    assert placement.local_device_ids is None


def test_slurm_coordinator_port_or_address_can_be_set():
    port = process_placement(environ=dict(SLURM_TASK, JAX_COORDINATOR_PORT="5555"))
    address = process_placement(environ=dict(SLURM_TASK, JAX_COORDINATOR_ADDRESS="login:7"))
    assert (port.coordinator_address, address.coordinator_address) == ("gpu003:5555", "login:7")


def test_one_slurm_task_or_a_batch_script_is_one_process():
    assert process_placement(environ=dict(SLURM_TASK, SLURM_NTASKS="1", SLURM_PROCID="0")) is None
    outside_srun = {k: v for k, v in SLURM_TASK.items() if k != "SLURM_STEP_NODELIST"}
    assert process_placement(environ=outside_srun) is None


@pytest.mark.parametrize(
    "node_list, first",
    [
        ("node001", "node001"),
        ("node001,node002", "node001"),
        ("node[001-015],host2", "node001"),
        ("node[007,009-010]", "node007"),
        ("rack1-n[2-3]-ib", "rack1-n2-ib"),
    ],
)
def test_the_first_host_of_a_slurm_node_list(node_list, first):
    assert cluster_env.first_slurm_host(node_list) == first


def test_a_pod_of_an_indexed_job_is_placed_from_its_environment():
    placement = process_placement(environ=K8S_POD)
    assert placement == ProcessPlacement("train-0.train:1234", 4, 2, None, "Kubernetes indexed Job")


@pytest.mark.parametrize(
    "missing, message",
    [
        ("AXLEARN_NUM_PROCESSES", "JOB_COMPLETION_INDEX is set but AXLEARN_NUM_PROCESSES is not"),
        ("JAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_ADDRESS is not set"),
    ],
)
def test_a_pod_missing_its_env_is_told_which_variable(missing, message):
    environ = {k: v for k, v in K8S_POD.items() if k != missing}
    with pytest.raises(ConfigError, match=message):
        process_placement(environ=environ)


def test_cluster_env_chooses_or_ignores_the_environment():
    both = dict(K8S_POD, **SLURM_TASK)
    assert process_placement(environ=both).source == "SLURM"
    assert process_placement(environ=both, cluster_env="kubernetes").source.startswith("Kube")
    assert process_placement(environ=both, cluster_env="none") is None
    with pytest.raises(ConfigError, match="--cluster_env must be one of"):
        process_placement(environ={}, cluster_env="mpi")


# ----- two processes as SLURM places them train as one process does -----

# gpt_test on fake data, 4 steps of 8 sequences of 64 tokens (one a device on 8 devices).
RUN = (
    "--config=gpt_test",
    "--data_dir=FAKE",
    "--jax_backend=cpu",
    "--config_override=max_step=4",
    "--config_override=input.global_batch_size=8",
    "--config_override=input.max_sequence_length=64",
    "--config_override=evalers['validation'].input.global_batch_size=8",
    "--config_override=evalers['validation'].input.max_sequence_length=64",
    "--config_override=summary_writer.write_every_n_steps=1",
    "--config_override=log_every_n_steps=1",
)


@pytest.mark.slow
def test_two_slurm_tasks_of_four_devices_train_as_one_process_of_eight(tmp_path):
    single = _main(*RUN, f"--trainer_dir={tmp_path / 'single'}", devices=8)
    assert single.returncode == 0, single.stderr[-3000:]
    port = str(_free_port())
    tasks = [
        _main(
            *RUN,
            f"--trainer_dir={tmp_path / 'tasks'}",
            devices=4,
            background=True,
            env=dict(
                SLURM_JOB_ID="1",
                SLURM_PROCID=str(i),
                SLURM_NTASKS="2",
                SLURM_LOCALID=str(i),
                SLURM_NODEID="0",
                SLURM_STEP_NODELIST="localhost",
                SLURM_STEP_TASKS_PER_NODE="2",
                JAX_COORDINATOR_PORT=port,
            ),
        )
        for i in range(2)
    ]
    outputs = [task.communicate(timeout=600)[0] for task in tasks]
    for task, output in zip(tasks, outputs):
        assert task.returncode == 0, output[-3000:]
    for i, output in enumerate(outputs):
        joined = f"Process {i} of 2 joined (SLURM, coordinator localhost:{port}), 4 local devices"
        assert joined in output
        assert re.search(r"Mesh \{.*'fsdp': 8.*\} over 8 cpu devices", output), output[-3000:]
    reference, together = _losses(tmp_path / "single"), _losses(tmp_path / "tasks")
    assert sorted(reference) == sorted(together) == [1, 2, 3, 4]
    for step, loss in reference.items():
        assert abs(together[step] - loss) <= 1e-5 * abs(loss), (step, together[step], loss)
