"""parallel.data_address is where every learner node's stage leader connects to the data
group: a host name or an IP address without a port. Anything else ("garbage!!", 999.1.1.1, an
empty string, 100,000 characters, a port, a newline) was "recipe OK" and failed on every node
at the run's start; the recipe now refuses it in one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_fr.config.parallel import MAX_HOST_CHARS, address_problem
from megatron_fr.config.run import load_run_config

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "cpu_demo.yaml"

BAD = {
    "garbage!!": "no host name",
    "999.1.1.1": "no IPv4 address",
    "1.2.3": "no IPv4 address",
    "": "empty",
    "a" * 100_000: "characters",
    "a" * (MAX_HOST_CHARS + 1): "characters",
    "127.0.0.1:80": "a port does not belong",
    "node1:29500": "a port does not belong",
    "a\nb": "control",
    "a b": "spaces",
    "nöde": "non-ASCII",
    "[::1]": "no IPv6 address",
    "-node": "no host name",
    "node-": "no host name",
    "a..b": "no host name",
    "x" * 64 + ".org": "no host name",  # a label past 63 characters
    "http://node1": "a port does not belong",
    "10.0.0.1/24": "no host name",
}
GOOD = ["10.0.0.5", "node001", "::1", "fe80::1", "gpu-node-3.cluster.local", "node_7", "x." * 3]


@pytest.mark.parametrize("address", list(BAD), ids=[repr(a[:20]) for a in BAD])
def test_an_address_that_names_no_host_is_refused_with_the_reason(address):
    problem = address_problem(address)
    assert problem is not None and BAD[address] in problem


@pytest.mark.parametrize("address", GOOD)
def test_a_host_name_or_an_ip_address_is_accepted(address):
    assert address_problem(address) is None


def test_the_recipe_refuses_it_in_one_line_naming_the_key():
    with pytest.raises(ValueError) as caught:
        load_run_config(RECIPE, ["parallel.data_address='127.0.0.1:80'"])
    message = str(caught.value)
    assert "parallel.data_address" in message and "\n" not in message
    with pytest.raises(ValueError) as caught:
        load_run_config(RECIPE, ["parallel.data_address=" + "a" * 100_000])
    assert len(str(caught.value)) < 400
    assert load_run_config(RECIPE, ["parallel.data_address=node7"]).parallel.data_address == "node7"
    assert load_run_config(RECIPE).parallel.data_address is None
