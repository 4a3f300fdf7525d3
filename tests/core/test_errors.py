"""ferry's error tree: transient or terminal, one line, no secret, and the same after pickling."""

from __future__ import annotations

import pickle

import pytest

from ferry.errors import (
    AuthError,
    BrokerUnavailable,
    ConfigError,
    Conflict,
    FerryError,
    Forbidden,
    NotFound,
    OperationFailed,
    PreflightFailed,
    UsageError,
)


def test_every_error_says_whether_trying_again_may_help() -> None:
    assert BrokerUnavailable("x").retryable
    for cls in (ConfigError, UsageError, NotFound, AuthError, Forbidden, Conflict, PreflightFailed, OperationFailed):
        assert not cls("x").retryable, cls
    assert ConfigError("x").exit_code == UsageError("x").exit_code == 2 and NotFound("x").exit_code == 1


def test_a_password_in_a_message_or_hint_is_masked() -> None:
    err = FerryError("refused amqp://ferry:s3cret@h:5672/x", hint="sc://h:15002/;token=abc")
    assert "s3cret" not in str(err) and "abc" not in str(err) and "ferry:***@" in str(err)


def test_a_ferry_error_keeps_its_fields_when_pickled() -> None:
    err = BrokerUnavailable("east: no answer", hint="is it up?", stream="ORDERS", err_code=10059)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is BrokerUnavailable and str(back) == str(err)
    assert back.fields == {"stream": "ORDERS", "err_code": 10059} and back.retryable
    assert isinstance(pickle.loads(pickle.dumps(FerryError("x"))), FerryError)


def test_a_file_a_spark_task_cannot_read_is_named_with_the_executors_host_once() -> None:
    import socket

    from ferry.errors import Unreadable
    from ferry.spark.options import on_executor

    with pytest.raises(Unreadable) as info, on_executor(), on_executor():  # a task's step inside the task
        raise Unreadable("credentials: creds file /x.creds does not exist")
    assert (
        str(info.value)
        == f"credentials: creds file /x.creds does not exist (on Spark executor host {socket.gethostname()})"
    )
