"""The soak's network: each generator in a network namespace of its own, joined to the learner by a veth pair on one
bridge, all of it on this machine (no address outside it), so a fault can cut or slow one generator's link and no
other's.

Layout: a bridge in the root namespace holds the subnet's .1 (the learner binds its buffer there, redis-server too;
SUBNET unless told another, so that two soaks can run side by side); generator i's namespace has the subnet's
.(10+i) on its end of a veth pair whose other end is a port of the
bridge. A partition sets that root-side end down (packets are dropped, connections are not reset: what a pulled cable
or a dead switch port does); a slow link puts a token-bucket filter on it (`tc qdisc ... tbf`: the rate caps what
crosses, and the queue adds latency). netem, the usual tool for added delay, is not in every kernel (this machine's
has no sch_netem); tbf is.

Only what this module creates is removed (by the names it made, which carry the soak's tag), never another
namespace or link.
"""
import subprocess
from dataclasses import dataclass

SUBNET = "10.231.0"
"""The first three octets of the soak's private /24 (RFC 1918), unless the soak is given another (--subnet)."""


class NetworkError(RuntimeError):
    """The namespaces could not be made (not root, no `ip`, or the kernel refuses): the soak runs without its
    network faults only when told to (--no-netns)."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


@dataclass
class GeneratorLink:
    namespace: str
    outer: str
    """The root-side end of the veth pair (a bridge port): what a partition takes down."""
    inner: str
    """The end inside the namespace."""
    address: str


class SoakNetwork:
    """The bridge and one namespace per generator, made by `up()` and removed by `down()`."""

    def __init__(self, tag: str, generators: list, subnet: str = SUBNET):
        self.tag, self.generators, self.subnet = tag, list(generators), subnet
        self.address = f"{subnet}.1"
        """The bridge's address, where the learner (and redis-server) listen."""
        self.bridge = f"ar{tag}br"[:15]
        self.links: dict = {}

    def up(self) -> None:
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            ip("addr", "add", f"{self.address}/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for index, generator in enumerate(self.generators):
                self.links[generator] = self._join(index)
        except BaseException:
            self.down()
            raise

    def _join(self, index: int) -> GeneratorLink:
        namespace, outer, inner = f"asyncrl-{self.tag}-{index}", f"ar{self.tag}o{index}"[:15], f"ar{self.tag}i{index}"[:15]
        address = f"{self.subnet}.{10 + index}"
        ip("netns", "add", namespace)
        ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        ip("link", "set", inner, "netns", namespace)
        ip("link", "set", outer, "master", self.bridge)
        ip("link", "set", outer, "up")
        ip("-n", namespace, "addr", "add", f"{address}/24", "dev", inner)
        ip("-n", namespace, "link", "set", inner, "up")
        ip("-n", namespace, "link", "set", "lo", "up")
        return GeneratorLink(namespace, outer, inner, address)

    def command(self, generator: str, argv: list) -> list:
        """`argv` run inside the generator's namespace."""
        return ["ip", "netns", "exec", self.links[generator].namespace, *argv]

    def partition(self, generator: str, cut: bool) -> None:
        ip("link", "set", self.links[generator].outer, "down" if cut else "up")

    def slow(self, generator: str, slowed: bool, rate: str = "256kbit", latency_ms: int = 400) -> None:
        """A token bucket on both ends of the generator's link (each shapes what leaves it: the outer end the
        learner's replies, the inner end the generator's groups): `rate` caps it, and a queue of up to
        `latency_ms` delays what waits in it."""
        link = self.links[generator]
        for prefix, device in (([], link.outer), (["ip", "netns", "exec", link.namespace], link.inner)):
            if slowed:
                done = subprocess.run([*prefix, "tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate", rate,
                                       "burst", "16kbit", "latency", f"{latency_ms}ms"], capture_output=True, text=True)
                if done.returncode != 0:
                    raise NetworkError(f"tc tbf on {device}: {done.stderr.strip()}")
            else:
                subprocess.run([*prefix, "tc", "qdisc", "del", "dev", device, "root"], capture_output=True, text=True)

    def down(self) -> None:
        """Removes every namespace, link and the bridge this network made; each even when another is gone."""
        for index, generator in enumerate(self.generators):
            ip("link", "del", f"ar{self.tag}o{index}"[:15], check=False)
            ip("netns", "del", f"asyncrl-{self.tag}-{index}", check=False)
        ip("link", "del", self.bridge, check=False)
        self.links = {}
