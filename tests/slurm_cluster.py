"""A real one-node SLURM cluster for the tests: slurmctld and slurmd started in a temporary folder.

Where SLURM is installed (`.ci/install-slurm` installs Debian's slurm-wlm) and the tests run as root, this
writes a slurm.conf of its own (its own ports, state, spool and log folders; no munge: auth/none; processes
tracked through their parents: proctrack/linuxproc), starts both daemons and waits until the node is idle.
Jobs see SLURM_CONF in their environment, so sbatch, srun, scontrol and scancel inside them find this
cluster, not a system one. `stop()` cancels what is left and ends the daemons by their PIDs.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "scancel", "squeue")
SBIN_PATH = f"{os.environ.get('PATH', '')}:/usr/sbin:/usr/local/sbin"
# A requeued job may start cred_expire + 1 s after its requeue (SLURM's guard against replayed launch
# credentials; 120 s by default, 5 at least); the scheduler's full pass runs every sched_interval s (60).
# Both shortened here, so that a requeued job starts within seconds.
CRED_EXPIRE_S = 5


# The paths the batch scripts of docs/clusters.md train on and write to.
DATA_PATH, OUTPUT_DIR = "/shared/flower_photos", "/shared/runs/flowers"


def sbatch_scripts(page: Path) -> list[str]:
    """Every batch script of a Markdown page: the ```bash blocks that start with #!/bin/bash."""
    blocks = re.findall(r"^```bash\n(.*?)^```", page.read_text(), flags=re.DOTALL | re.MULTILINE)
    return [block for block in blocks if block.startswith("#!/bin/bash\n")]


def for_this_machine(script: str, data: Path, out: Path, flags: list[str], nodes: int = 1) -> str:
    """A batch script as it can run here: one node and at most two tasks (or `nodes` of one task each), no
    GPUs; `data` and `out` for the page's paths; `flags` after the training command's own (later flags win)."""
    most_tasks = 2 if nodes == 1 else 1

    def resources(line: str) -> str:
        line = re.sub(r"--nodes=\d+", f"--nodes={nodes}", line)
        line = re.sub(r"--ntasks-per-node=(\d+)", lambda m: f"--ntasks-per-node={min(int(m.group(1)), most_tasks)}",
                      line)
        return re.sub(r" --(gpus-per-node|cpus-per-task)=\d+", "", line)

    if DATA_PATH not in script or OUTPUT_DIR not in script:
        raise ValueError(f"the script no longer trains on {DATA_PATH} into {OUTPUT_DIR}:\n{script}")
    lines = [resources(line) if line.startswith("#SBATCH") else line
             for line in script.replace("\\\n", " ").splitlines()]
    (training,) = [i for i, line in enumerate(lines) if "train_multi_gpu_using_launch.py" in line]
    command, background = re.fullmatch(r"(.*?)( &)?", lines[training].rstrip()).groups()
    lines[training] = " ".join([command, *flags]) + (background or "")
    return "\n".join(lines).replace(DATA_PATH, str(data)).replace(OUTPUT_DIR, str(out)) + "\n"


def why_no_cluster() -> str | None:
    """The reason the SLURM tests cannot run here, or None."""
    missing = [name for name in DAEMONS + CLIENTS if not shutil.which(name, path=SBIN_PATH)]
    if missing:
        return (f"needs SLURM ({', '.join(missing)} not found): as root on Debian or Ubuntu, .ci/install-slurm "
                "installs slurm-wlm")
    if os.geteuid() != 0:
        return "starts slurmctld and slurmd, which run jobs as root here: run these tests as root"
    return None


def this_node() -> dict[str, str]:
    """What slurmd finds on this machine (name, CPUs, sockets, cores, memory), as slurm.conf's node line."""
    found = subprocess.run([shutil.which("slurmd", path=SBIN_PATH), "-C"], capture_output=True, text=True,
                           check=True, timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S+)", found.splitlines()[0]))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def slurm_conf(root: Path, nodes: list[dict[str, str]]) -> str:
    """slurm.conf for `nodes` (slurmd -C's fields and NodeAddr each); the first keeps slurmctld too."""
    def hardware(node: dict[str, str]) -> str:
        return " ".join(f"{key}={node[key]}" for key in
                        ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore", "RealMemory"))

    names = ",".join(node["NodeName"] for node in nodes)
    return "\n".join([
        "ClusterName=tests",
        f"SlurmctldHost={nodes[0]['NodeName']}({nodes[0]['NodeAddr']})",
        f"SlurmctldPort={free_port()}",
        f"SlurmdPort={free_port()}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/none",
        "CredType=cred/none",
        f"AuthInfo=cred_expire={CRED_EXPIRE_S}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "MpiDefault=none",
        "MailProg=/bin/true",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/builtin",
        "SchedulerParameters=sched_interval=1",
        # A job in the partition "urgent" takes the cores of jobs in "tests", which go back in the queue.
        "PreemptType=preempt/partition_prio",
        "PreemptMode=REQUEUE",
        "KillWait=30",  # SLURM's default: SIGTERM, then SIGKILL 30 s later
        "ReturnToService=2",
        "JobAcctGatherType=jobacct_gather/none",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}/%n",  # %n: the node's name, one folder per slurmd
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root}/slurmd.%n.pid",
        f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'log'}/slurmd.%n.log",
        *(f"NodeName={node['NodeName']} NodeAddr={node['NodeAddr']} {hardware(node)} State=UNKNOWN"
          for node in nodes),
        # OverSubscribe=YES: jobs that ask for it (sbatch --oversubscribe) may share the node's cores.
        f"PartitionName=tests Nodes={names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES "
        "PriorityTier=1",
        f"PartitionName=urgent Nodes={names} MaxTime=INFINITE State=UP PriorityTier=2",
        "",
    ])


@dataclass
class SlurmCluster:
    root: Path
    nodes: list[str]
    env: dict[str, str]  # what a client (and, through sbatch, a job) needs: SLURM_CONF and PATH
    daemons: list[subprocess.Popen] = field(default_factory=list)
    client: list[str] = field(default_factory=list)  # the words before a client's: where it reaches slurmctld

    @property
    def node(self) -> str:
        return self.nodes[0]

    def command(self, *args: str, timeout: float = 30) -> str:
        """A SLURM client command (sbatch, scontrol, ...) against this cluster; its standard output."""
        done = subprocess.run([*self.client, *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise AssertionError(f"{' '.join(args)}: exit {done.returncode}\n{done.stdout}\n{done.stderr}")
        return done.stdout

    def sbatch(self, *args: str, env: dict[str, str] | None = None) -> int:
        """Submit a job: sbatch's options, then the script (or --wrap=COMMAND); the job id."""
        done = subprocess.run([*self.client, "sbatch", "--parsable", *args], env=env or self.env,
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, f"sbatch {' '.join(args)}: {done.stderr}"
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """The job's fields as `scontrol show job` gives them (JobState, Restarts, ExitCode, ...)."""
        return dict(re.findall(r"(\w+)=(\S*)", self.command("scontrol", "show", "job", "-o", str(job_id))))

    def wait_until_gone(self, job_id: int, timeout: float = 180) -> dict[str, str]:
        """Wait until the job has ended and its processes too (squeue no longer lists it); its fields."""
        deadline = time.monotonic() + timeout
        while job_id in self.jobs():
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still there after {timeout} s: {self.job(job_id)}")
            time.sleep(0.2)
        return self.job(job_id)

    def jobs(self) -> list[int]:
        return [int(job) for job in self.command("squeue", "-h", "-o", "%i").split()]

    def cancel(self, job_id: int, *options: str) -> None:
        """scancel, for a job that may have ended meanwhile (scancel's complaint about that does not matter)."""
        subprocess.run([*self.client, "scancel", *options, str(job_id)], env=self.env, capture_output=True,
                       timeout=30)

    def node_state(self, node: str | None = None) -> str:
        return re.search(r"State=(\S+)", self.command("scontrol", "show", "node", node or self.node)).group(1)

    def stop(self) -> None:
        """Cancel every job left (its processes killed at once), then end the daemons by their PIDs."""
        if self.daemons and all(daemon.poll() is None for daemon in self.daemons):
            for job in self.jobs():
                self.cancel(job, "--signal=KILL", "--full")
                self.cancel(job)
            deadline = time.monotonic() + 60
            while self.jobs() and time.monotonic() < deadline:
                time.sleep(0.5)
        for daemon in reversed(self.daemons):
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
        for daemon in self.daemons:
            try:
                daemon.wait(timeout=20)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


def start_cluster(root: Path, path: str) -> SlurmCluster:
    """Write the configuration under `root`, start slurmctld and slurmd, and wait until the node is idle.
    `path` is the PATH jobs get (put the Python that should run in them first)."""
    node = this_node()
    name = node["NodeName"]
    try:
        socket.gethostbyname(name)
    except OSError as err:  # jobs find their master by the node's name (the first host of the node list)
        raise AssertionError(f"this machine's name {name!r} does not resolve: add it to /etc/hosts") from err
    return started(root, path, [{**node, "NodeAddr": "127.0.0.1"}], on_node=lambda name: [])


def start_cluster_on(hosts: list, root: Path, path: str) -> SlurmCluster:
    """A cluster of one node per host of tests/two_hosts.py: slurmctld and the first slurmd on the first host,
    the other slurmd on the other, each daemon in its host's network and with its host name, /etc/hosts and
    core (`nsenter --net`, not `ip netns exec`, which would mount another /sys under slurmd). Clients reach
    slurmctld from inside the first host."""
    by_name = {host.name: host for host in hosts}
    nodes = [{"NodeName": host.name, "NodeAddr": host.address, "CPUs": "1", "Boards": "1", "SocketsPerBoard": "1",
              "CoresPerSocket": "1", "ThreadsPerCore": "1", "RealMemory": "2000"} for host in hosts]

    def on_node(name: str) -> list[str]:
        host = by_name[name]
        inside = (f"mount --bind /etc/netns/{host.namespace}/hosts /etc/hosts && hostname {host.name} && "
                  f'exec taskset -c {host.core} "$@"')
        return ["nsenter", f"--net=/run/netns/{host.namespace}", "unshare", "--mount", "--uts", "sh", "-c", inside,
                "sh"]

    return started(root, path, nodes, on_node)


def started(root: Path, path: str, nodes: list[dict[str, str]], on_node: Callable[[str], list[str]]) -> SlurmCluster:
    """slurmctld on the first node and a slurmd on each, `on_node(name)` the words that put a process there;
    returned once every node is idle."""
    for folder in ("state", "log", *(f"spool/{node['NodeName']}" for node in nodes)):
        (root / folder).mkdir(parents=True, exist_ok=True)
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, nodes))
    env = {**os.environ, "SLURM_CONF": str(conf), "PATH": path}
    names = [node["NodeName"] for node in nodes]
    cluster = SlurmCluster(root, names, env, client=on_node(names[0]))
    daemons = [("slurmctld", names[0], ["-D", "-i"]), *(("slurmd", name, ["-D", "-N", name]) for name in names)]
    for daemon, name, args in daemons:
        with open(root / "log" / f"{daemon}.{name}.out", "w") as out:
            cluster.daemons.append(subprocess.Popen(
                [*on_node(name), shutil.which(daemon, path=SBIN_PATH), *args, "-f", str(conf)], env=env, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + 60
    while True:
        if any(daemon.poll() is not None for daemon in cluster.daemons):
            cluster.stop()
            logs = "\n".join(out.read_text()[-2000:] for out in sorted((root / "log").glob("*.out")))
            raise AssertionError(f"a SLURM daemon ended while starting:\n{logs}")
        try:
            if all(cluster.node_state(name).startswith("IDLE") for name in names):
                return cluster
        except (AssertionError, subprocess.TimeoutExpired):
            pass  # slurmctld is not answering yet
        if time.monotonic() > deadline:
            cluster.stop()
            raise AssertionError(f"the nodes did not become idle within 60 s; see {root / 'log'}")
        time.sleep(0.3)


def processes_of(out: Path) -> list[int]:
    """The processes whose command line names `out` (a run's output folder), but this one: the launchers
    (srun, torchrun's agents) and the training processes of that run, whoever started them."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if str(out).encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found
