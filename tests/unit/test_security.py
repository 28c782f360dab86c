"""Unit tests for the token helpers in ``rlinf.control.security``."""
from __future__ import annotations

import argparse

import pytest

from rlinf.control.security import ClusterKeys, generate_token


def test_generated_tokens_survive_a_command_line():
    # A token pasted after "--token" must never be mistaken for an option.
    parser = argparse.ArgumentParser()
    parser.add_argument("--token")
    for _ in range(500):
        token = generate_token()
        assert not token.startswith("-")
        assert len(token) == 64  # 256 bits, hex
        assert parser.parse_args(["--token", token]).token == token


def test_tokens_are_fresh():
    assert len({generate_token() for _ in range(100)}) == 100


def test_keys_derive_deterministically_from_the_token():
    token = generate_token()
    a, b, other = ClusterKeys(token), ClusterKeys(token), ClusterKeys(generate_token())
    assert (a.server_public, a.client_secret, a.password) == (b.server_public, b.client_secret, b.password)
    assert a.server_public != other.server_public and a.password != other.password


def test_an_empty_token_is_refused():

    with pytest.raises(ValueError, match="non-empty"):
        ClusterKeys("")
