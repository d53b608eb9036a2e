"""Authentication of asyncrl's ZeroMQ sockets (stdlib only: read by `asyncrl --help`)."""
from dataclasses import dataclass


@dataclass
class SecurityConfig:
    keys_dir: str = ""
    """ZeroMQ CURVE keys (made by `asyncrl keys DIR`): the buffer and the weight catch-up server then encrypt every
    connection and accept only clients whose public key is in DIR/clients/. The learner reads DIR/server.key_secret
    and DIR/clients/*.key; a generator reads DIR/server.key and DIR/clients/<client_name>.key_secret. "" = plain
    TCP, for loopback and trusted networks (a server bound to another address than loopback says so at start)."""
    client_name: str = "generator"
    """Which client certificate under keys_dir/clients/ this generator presents."""

    def __post_init__(self):
        if not self.client_name or "/" in self.client_name or self.client_name.startswith("."):
            raise ValueError(f"security.client_name must be a plain file name, got {self.client_name!r}")
