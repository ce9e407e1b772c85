"""vllm.utils.network_utils: what the publisher's `tcp://*:0` bind uses."""
import ipaddress
import os


def get_ip():
    return os.environ.get("VLLM_HOST_IP", "127.0.0.1")


def is_valid_ipv6_address(address):
    try:
        ipaddress.IPv6Address(address)
        return True
    except ValueError:
        return False


def get_tcp_uri(ip, port):
    return f"tcp://[{ip}]:{port}" if is_valid_ipv6_address(ip) else f"tcp://{ip}:{port}"


def split_zmq_path(path):
    scheme, _, rest = path.partition("://")
    host, _, port = rest.rpartition(":")
    return scheme, host.strip("[]"), port
