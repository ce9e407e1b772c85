"""sglang.srt.utils.network: NetworkAddress, as the event publisher parses endpoints."""
from dataclasses import dataclass


@dataclass
class NetworkAddress:
    host: str
    port: int

    @classmethod
    def parse(cls, hostport):
        host, _, port = hostport.rpartition(":")
        return cls(host.strip("[]"), int(port))

    def to_tcp(self):
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"
