"""The raykv error hierarchy: pickling with message and attributes, subclass relationships."""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest

import raykv
from raykv.core import errors
from raykv.core.errors import (
    CapacityError,
    ConfigError,
    CudaError,
    ImportRejectedError,
    IntegrityError,
    InvalidArgumentError,
    NotFoundError,
    OutOfMemoryError,
    OutOfPagesError,
    PageCorruptError,
    RayKVError,
    ResourceBusyError,
    RoleNotFoundError,
    StateError,
    TransferError,
    TransferFailure,
    UnavailableError,
)

ALL_ERROR_CLASSES = sorted(
    (
        obj
        for obj in vars(errors).values()
        if inspect.isclass(obj) and issubclass(obj, RayKVError) and obj.__module__ == errors.__name__
    ),
    key=lambda cls: cls.__name__,
)

# One realistic instance per class, with the attributes each carries: (instance, message, attrs)
SAMPLES: dict[type, tuple[RayKVError, str, dict]] = {
    RayKVError: (RayKVError("generic failure", detail=3), "generic failure", {"detail": 3}),
    ConfigError: (
        ConfigError("tokens_per_block", "must be a positive int, got 0"),
        "tokens_per_block: must be a positive int, got 0",
        {"field": "tokens_per_block"},
    ),
    InvalidArgumentError: (
        InvalidArgumentError("tokens", "token ids must be in 0..2**31-1"),
        "tokens: token ids must be in 0..2**31-1",
        {"argument": "tokens"},
    ),
    NotFoundError: (NotFoundError("no such key", key=b"\x01" * 32), "no such key", {"key": b"\x01" * 32}),
    RoleNotFoundError: (
        RoleNotFoundError("layout has no buffer with role 'q' in layer 0", layer_id=0, role="q"),
        "layout has no buffer with role 'q' in layer 0",
        {"layer_id": 0, "role": "q"},
    ),
    StateError: (
        StateError("cache is closed", request_id=2**64 - 1),
        "cache is closed",
        {"request_id": 2**64 - 1},
    ),
    ResourceBusyError: (
        ResourceBusyError("3 requests still open", num_open=3),
        "3 requests still open",
        {"num_open": 3},
    ),
    CapacityError: (
        CapacityError("not enough room", needed=5, free=2),
        "not enough room",
        {"needed": 5, "free": 2},
    ),
    OutOfPagesError: (
        OutOfPagesError("no evictable page on GPU", tier=raykv.TierKind.GPU),
        "no evictable page on GPU",
        {"tier": raykv.TierKind.GPU},
    ),
    OutOfMemoryError: (OutOfMemoryError("mmap failed", nbytes=1 << 30), "mmap failed", {"nbytes": 1 << 30}),
    ImportRejectedError: (
        ImportRejectedError("missing parent", keys=(b"a" * 32,)),
        "missing parent",
        {"keys": (b"a" * 32,)},
    ),
    IntegrityError: (IntegrityError("checksum mismatch", index=4), "checksum mismatch", {"index": 4}),
    TransferError: (
        TransferError("peer closed the connection", reason=TransferFailure.CLOSED, peer="10.0.0.1:1234"),
        "peer closed the connection",
        {"reason": TransferFailure.CLOSED, "peer": "10.0.0.1:1234"},
    ),
    CudaError: (
        CudaError("cudaMemcpyAsync failed", cuda_error="cudaErrorIllegalAddress"),
        "cudaMemcpyAsync failed",
        {"cuda_error": "cudaErrorIllegalAddress"},
    ),
    PageCorruptError: (
        PageCorruptError("2 disk pages failed their checksum", positions=(0, 3)),
        "2 disk pages failed their checksum",
        {"positions": (0, 3)},
    ),
    UnavailableError: (
        UnavailableError("raykv-index-1 did not answer", reason="timeout", actors=("raykv-index-1",)),
        "raykv-index-1 did not answer",
        {"reason": "timeout", "actors": ("raykv-index-1",)},
    ),
}


def fresh(cls: type) -> RayKVError:
    """A private copy of the sample, so raising it does not touch the shared instance."""
    return copy.deepcopy(SAMPLES[cls][0])


def test_samples_cover_every_error_class():
    assert set(SAMPLES) == set(ALL_ERROR_CLASSES)
    exported = {name for name in raykv.__all__ if name.endswith("Error")}
    assert exported == {cls.__name__ for cls in ALL_ERROR_CLASSES}


@pytest.mark.parametrize("cls", ALL_ERROR_CLASSES, ids=lambda c: c.__name__)
def test_sample_has_message_and_attributes(cls):
    err, message, attrs = SAMPLES[cls]
    assert type(err) is cls
    assert str(err) == message
    assert err.message == message
    assert err.args == (message,)
    for name, value in attrs.items():
        assert getattr(err, name) == value


@pytest.mark.parametrize("proto", range(pickle.HIGHEST_PROTOCOL + 1))
@pytest.mark.parametrize("cls", ALL_ERROR_CLASSES, ids=lambda c: c.__name__)
def test_pickle_round_trip(cls, proto):
    err, message, attrs = SAMPLES[cls]
    back = pickle.loads(pickle.dumps(err, protocol=proto))
    assert type(back) is cls
    assert str(back) == message
    assert back.message == message
    assert back.args == err.args
    for name, value in attrs.items():
        assert getattr(back, name) == value
    assert vars(back) == vars(err)
    assert back == err and hash(back) == hash(err)


@pytest.mark.parametrize("cls", ALL_ERROR_CLASSES, ids=lambda c: c.__name__)
def test_pickle_of_a_raised_error(cls):
    _, message, attrs = SAMPLES[cls]
    err = fresh(cls)
    try:
        try:
            raise err
        except RayKVError as exc:
            raise exc from RuntimeError("cause")
    except RayKVError as caught:
        back = pickle.loads(pickle.dumps(caught))
    assert type(back) is cls and str(back) == message
    for name, value in attrs.items():
        assert getattr(back, name) == value
    with pytest.raises(cls) as info:
        raise back
    assert str(info.value) == message


def test_pickle_preserves_attributes_that_matter():
    cfg = pickle.loads(pickle.dumps(ConfigError("max_util_for_resume", "must be in (0, 1], got 2")))
    assert cfg.field == "max_util_for_resume"
    assert str(cfg) == "max_util_for_resume: must be in (0, 1], got 2"
    busy = pickle.loads(pickle.dumps(ResourceBusyError("requests open", num_open=17)))
    assert busy.num_open == 17
    cuda = pickle.loads(pickle.dumps(CudaError("no torch", cuda_error="NO_TORCH")))
    assert cuda.cuda_error == "NO_TORCH"
    role = pickle.loads(pickle.dumps(RoleNotFoundError("no role", layer_id=3, role="k_scale")))
    assert (role.layer_id, role.role) == (3, "k_scale")


def test_errors_differ_by_type_message_and_attrs():
    assert ConfigError("a", "x") == ConfigError("a", "x")
    assert ConfigError("a", "x") != ConfigError("b", "x")
    assert ConfigError("a", "x") != InvalidArgumentError("a", "x")
    assert ResourceBusyError("busy", num_open=1) != ResourceBusyError("busy", num_open=2)
    assert OutOfPagesError("full") != CapacityError("full")


@pytest.mark.parametrize(
    "sub, base",
    [
        (OutOfPagesError, CapacityError),
        (OutOfMemoryError, CapacityError),
        (ConfigError, ValueError),
        (InvalidArgumentError, ValueError),
        (ImportRejectedError, ValueError),
        (IntegrityError, ImportRejectedError),
        (IntegrityError, ValueError),
        (NotFoundError, KeyError),
        (RoleNotFoundError, NotFoundError),
        (RoleNotFoundError, KeyError),
        (StateError, RuntimeError),
        (ResourceBusyError, StateError),
        (ResourceBusyError, RuntimeError),
    ],
)
def test_subclass_relationships(sub, base):
    assert issubclass(sub, base)
    with pytest.raises(base):
        raise fresh(sub)


@pytest.mark.parametrize("cls", ALL_ERROR_CLASSES, ids=lambda c: c.__name__)
def test_everything_is_a_raykv_error(cls):
    assert issubclass(cls, RayKVError) and issubclass(cls, Exception)


def test_capacity_and_transfer_are_not_argument_errors():
    assert not issubclass(CapacityError, ValueError)
    assert not issubclass(OutOfPagesError, ValueError)
    assert not issubclass(TransferError, ValueError)
    assert not issubclass(ConfigError, KeyError)


def test_key_errors_str_is_plain_message():
    err = RoleNotFoundError("layout has no layer 7", layer_id=7, role=None)
    assert str(err) == "layout has no layer 7"
    assert str(KeyError("layout has no layer 7")) == "'layout has no layer 7'"  # what we avoid
    assert str(NotFoundError("missing")) == "missing"
    assert str(pickle.loads(pickle.dumps(err))) == "layout has no layer 7"
    try:
        raise err
    except KeyError as caught:
        assert str(caught) == "layout has no layer 7"


@pytest.mark.parametrize("reason", list(TransferFailure), ids=lambda r: r.value)
def test_every_transfer_failure_makes_an_error_that_pickles(reason):
    err = TransferError(f"failed: {reason}", reason=reason, bad_keys=(b"k" * 32,))
    assert err.reason is reason and err.reason == reason.value and f"{err.reason}" == reason.value
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(err, protocol=proto))
        assert type(back) is TransferError and back == err
        assert back.reason is reason and back.bad_keys == (b"k" * 32,)


def test_transfer_error_needs_an_enum_reason():
    with pytest.raises(TypeError):
        TransferError("no reason")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        TransferError("a plain string", reason="timeout")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        TransferError("None", reason=None)  # type: ignore[arg-type]


def test_transfer_failure_values_are_unique_and_documented():
    values = [r.value for r in TransferFailure]
    assert len(set(values)) == len(values)
    doc = TransferFailure.__doc__ or ""
    for value in values:
        assert f"``{value}``:" in doc, value


def test_a_peer_reason_maps_onto_the_enum():
    assert TransferFailure.from_peer("limit") is TransferFailure.LIMIT
    for other in ("nonsense", None, 3, b"limit"):
        assert TransferFailure.from_peer(other) is TransferFailure.REFUSED


def test_the_api_reference_lists_every_error_and_reason() -> None:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    classes = [
        name
        for name, obj in vars(errors).items()
        if isinstance(obj, type) and issubclass(obj, Exception) and obj.__module__ == errors.__name__
    ]
    assert classes and all(f"`{name}`" in text for name in classes), classes
    assert all(f"`{r.value}`" in text for r in errors.TransferFailure)
