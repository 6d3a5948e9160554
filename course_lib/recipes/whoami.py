"""Print what the launcher told this worker, as JSON:
``python -m torch.distributed.run ... -m course_lib.recipes.whoami``.

Shows the difference between the global ``RANK`` and the ``LOCAL_RANK`` (the index on this node), and which
GPU each would name: the web script's ``set_device(get_rank())`` bug, in numbers. Also what else the launcher set
for the worker: its CPU thread budget (``OMP_NUM_THREADS``), whether the workers' store is the agent's
(``TORCHELASTIC_USE_AGENT_STORE``), and NCCL's error handling (``TORCH_NCCL_ASYNC_ERROR_HANDLING``); ``null``
where unset.
"""
import os

from course_lib.launch.commands import print_json

if __name__ == "__main__":
    env = {k: int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")}
    env["master"] = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"   # where init_process_group meets
    env["device_by_global_rank"] = f"cuda:{env['RANK']}"
    env["device_by_local_rank"] = f"cuda:{env['LOCAL_RANK']}"
    for name in ("OMP_NUM_THREADS", "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        env[name] = os.environ.get(name)
    print_json(env)                       # one write: two ranks sharing a stdout cannot split each other's line
