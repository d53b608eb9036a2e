"""Buffer and coordinator settings (stdlib only, so `--help` and `--dry-run` never import torch)."""
from dataclasses import dataclass, field, fields
from typing import Optional

BACKENDS = ("zmq", "redis")
APPENDFSYNC = ("", "always", "everysec", "no")


@dataclass
class RedisConfig:
    """What only backend=redis reads: the server, its TLS files, the job's key namespace and the stream's leases."""

    url: str = "redis://127.0.0.1:6379/0"
    """The Redis server: redis://[user[:password]@]host:port/db, or rediss:// for TLS, or unix:// for a socket."""
    tls_ca_file: str = ""
    """CA bundle for rediss:// ("" = the system's)."""
    tls_cert_file: str = ""
    """Client certificate for rediss:// with mutual TLS."""
    tls_key_file: str = ""
    """Client key for rediss:// with mutual TLS."""
    namespace: str = ""
    """Key namespace of this job in Redis ("" = job.name); a generator must use the learner's."""
    lease_s: float = 120.0
    """An admitted group not delivered within this long is given back (a dead generator's capacity returns), in s."""
    reclaim_idle_s: float = 60.0
    """Entries a dead learner consumer left unacked this long are taken over, in s."""
    reconnect_s: float = 120.0
    """How long the learner and generators wait through a Redis outage (a restart) before they stop with an error
    naming it, in s."""
    appendfsync: str = ""
    """"" leaves the server's persistence as configured; always/everysec/no makes the learner turn AOF on with that
    fsync policy at startup. docs/redis.md says what each loses in a crash."""

    def __post_init__(self):
        if self.lease_s <= 0 or self.reclaim_idle_s <= 0:
            raise ValueError(f"buffer.redis.lease_s and buffer.redis.reclaim_idle_s must be > 0, got {self.lease_s}, "
                             f"{self.reclaim_idle_s}")
        if self.reconnect_s <= 0:
            raise ValueError(f"buffer.redis.reconnect_s must be > 0, got {self.reconnect_s}")
        if self.appendfsync not in APPENDFSYNC:
            raise ValueError(f"buffer.redis.appendfsync must be '', always, everysec or no, got {self.appendfsync!r}")

    def set_keys(self) -> list:
        """The keys that differ from their defaults, as `buffer.redis.<key>`."""
        default = RedisConfig()
        return [f"buffer.redis.{f.name}" for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)]


@dataclass
class BufferConfig:
    backend: str = "zmq"
    """Transport between generators and the learner. `zmq`: embedded in the learner process. `redis`: a durable
    stream in buffer.redis.url, shared by a learner and generators on any machines."""
    host: str = "127.0.0.1"
    """Address the learner's embedded buffer binds to and generators connect to. 127.0.0.1 keeps it local."""
    port: int = 47500
    """TCP port of the embedded buffer (one port per job; pick another to run two jobs on one machine)."""
    max_staleness: int = 2
    """η: never train on a group whose oldest token is more than this many learner steps old. 0 = synchronous."""
    groups_per_step: int = 16
    """Groups (prompts) per optimizer step. Admission paces generators in units of this."""
    admission_lead: Optional[int] = None
    """Pacing: how many learner versions ahead the fleet may start groups (None = max_staleness, AReaL's rule).
    Below η the fleet runs less far ahead, so the mean staleness sits near this lead instead of at η, while a group
    that arrives late (a slow generator, a long tail) is still trained up to η instead of dropped."""
    max_message_bytes: int = 16 * 1024 * 1024
    """Largest encoded group accepted, in bytes. Larger messages are rejected before decoding."""
    queue_groups: int = 256
    """Bound on groups waiting for the learner (zmq), in groups. Producers get back-pressure beyond it."""
    queue_mb: float = 512.0
    """Bound on the bytes of the groups waiting for the learner (zmq), in MiB; 0 bounds the queue in groups only.
    Back-pressure beyond it, as for queue_groups (an empty queue always takes one group)."""
    redis: RedisConfig = field(default_factory=RedisConfig)
    """backend=redis: the Redis server and the stream's leases (buffer.redis.*); a zmq job leaves them unset."""
    request_timeout_s: float = 30.0
    """How long a generator waits for one reply from the learner before it calls the learner dead, in seconds."""
    done_grace_s: float = 20.0
    """The end-of-job handshake (buffer/done.py), in s: after its last step the learner keeps answering until every
    generator has heard "done", for at most this long, and `asyncrl run` then gives each generator this long to
    exit on its own before stopping it."""

    @property
    def lead_steps(self) -> int:
        """The admission lead the coordinators use: admission_lead, or η."""
        return self.max_staleness if self.admission_lead is None else self.admission_lead

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"buffer.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.max_staleness < 0:
            raise ValueError(f"buffer.max_staleness must be >= 0, got {self.max_staleness}")
        if self.admission_lead is not None and not 0 <= self.admission_lead <= self.max_staleness:
            raise ValueError(f"buffer.admission_lead must be in [0, buffer.max_staleness={self.max_staleness}] (or "
                             f"unset: max_staleness), got {self.admission_lead}: generators admitted further ahead "
                             f"than η would sample groups the learner must drop")
        if self.groups_per_step < 1:
            raise ValueError(f"buffer.groups_per_step must be >= 1, got {self.groups_per_step}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"buffer.port must be in [0, 65535], got {self.port}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"buffer.max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if self.queue_mb < 0:
            raise ValueError(f"buffer.queue_mb must be >= 0, got {self.queue_mb}")
        if self.queue_groups < self.groups_per_step:
            raise ValueError(
                f"buffer.queue_groups ({self.queue_groups}) must be >= buffer.groups_per_step ({self.groups_per_step})"
            )
        if self.backend == "redis" and not self.redis.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"buffer.redis.url must start with redis://, rediss:// or unix://, got "
                             f"{self.redis.url.split('@')[-1]!r}")
        if self.backend != "redis" and self.redis.set_keys():
            raise ValueError(f"{self.redis.set_keys()[0]} is only read by buffer.backend=redis (this job's backend is "
                             f"{self.backend}); remove it or set buffer.backend=redis")
        if self.request_timeout_s <= 0:
            raise ValueError(f"buffer.request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.done_grace_s < 0:
            raise ValueError(f"buffer.done_grace_s must be >= 0, got {self.done_grace_s}")
