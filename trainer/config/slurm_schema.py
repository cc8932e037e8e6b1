"""The ``launch.slurm`` section: what the sbatch script asks Slurm for when ``launch.executor=slurm``.

    python -m trainer +parallel=fsdp mesh=[2] launch.executor=slurm launch.slurm.partition=debug \\
        launch.slurm.time=00:30:00

Each field is one ``#SBATCH`` line of the script (:mod:`trainer.launch.slurm` writes it); a field left null
leaves Slurm's own default (the cluster's default partition, account, QoS and time limit).
"""

from __future__ import annotations

from pydantic import Field, field_validator

from parallel.config import Section as _Section

# Slurm's --time forms: minutes, minutes:seconds, hours:minutes:seconds, days-hours[:minutes[:seconds]]
TIME_PATTERN = (r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+(:\d{1,2}(:\d{1,2})?)?"
                r"|UNLIMITED|unlimited|INFINITE)$")
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._,@+=-]*$"  # partitions, accounts, QoS: no spaces, no shell


class SlurmConfig(_Section):
    partition: str | None = Field(None, pattern=NAME_PATTERN, description="`#SBATCH --partition`: the partition "
                                  "(queue) to submit to; null = the cluster's default partition.")
    time: str | None = Field(None, pattern=TIME_PATTERN, description="`#SBATCH --time`: the job's time limit, as "
                             "Slurm writes it (`00:30:00`, `90` minutes, `1-12:00:00`); null = the partition's "
                             "default. "
                             "The run checkpoints before it (launch.slurm.signal_before_end_s).")
    account: str | None = Field(None, pattern=NAME_PATTERN, description="`#SBATCH --account` charged for the "
                                "job; null = the user's default account.")
    qos: str | None = Field(None, pattern=NAME_PATTERN, description="`#SBATCH --qos`: the quality of service; "
                            "null = the account's default.")
    job_name: str | None = Field(None, pattern=NAME_PATTERN, max_length=128,
                                 description="`#SBATCH --job-name`; null = the run's name (tracking.run_name).")
    # CPU: one launcher per node runs all its workers, so a node's cores are asked for by this one task.
    cpus_per_task: int | None = Field(None, ge=1, le=4096, description="`#SBATCH --cpus-per-task`: cores for the "
                                      "one task on each node (its launcher and all its workers); null = Slurm's "
                                      "default (one).")
    gpus_per_node: int | None = Field(None, ge=0, le=64, description="`#SBATCH --gpus-per-node`; null = none asked "
                                      "for (CPU runs). On GPU nodes set it to the workers per node (world size / "
                                      "launch.nnodes).")
    mem: str | None = Field(None, pattern=r"^\d+[KMGT]?$", description="`#SBATCH --mem`: memory per node (`64G`; "
                            "`0` = all of it); null = the partition's default.")
    # Time: the seconds a checkpoint needs (a minute or two for a large model), asked before the time limit.
    signal_before_end_s: int = Field(120, ge=0, le=86400, description="`#SBATCH --signal=B:USR1@<s>`: Slurm warns "
                                     "the job this many seconds before its time limit (or a preemption's grace "
                                     "ends); the run then saves a checkpoint and the job is requeued to resume from "
                                     "it. 0 = no warning.")
    requeue: bool = Field(True, description="`#SBATCH --requeue`: a preempted or warned job goes back to the queue "
                          "and resumes from its last checkpoint (train.checkpoint.resume=auto on the requeued run); "
                          "false = it ends.")
    rdzv_port: int = Field(29500, ge=1, le=65535, description="With launch.nnodes > 1: the port of the rendezvous "
                           "the first node of the allocation serves (its host name comes from Slurm).")
    extra: list[str] = Field(default_factory=list, description="More `#SBATCH` lines, each an sbatch option as "
                             "typed on its command line, quoted for Hydra: "
                             "`launch.slurm.extra=['--exclusive','--constraint=h100']`.")

    @field_validator("extra")
    @classmethod
    def _options_only(cls, lines: list[str]) -> list[str]:
        for line in lines:
            if not line.startswith("-") or any(c in line for c in "\n\r\0"):
                raise ValueError(f"{line!r} is not one sbatch option; write each as on sbatch's command line, "
                                 "e.g. launch.slurm.extra=['--exclusive']")
        return lines
