"""``saving`` and its answer are read as strictly as every other line: the shim reads the
answer inside the user's program, and a wrong step list would remove a copy still needed."""

from __future__ import annotations

import pytest

from shim import protocol

SAVING = protocol.Saving(step=40)


def _answer(fields: str) -> bytes:
    return ('{"v":1,"ok":true,' + fields + "}\n").encode()


def test_the_answer_round_trips_and_an_older_sidecars_error_is_an_error() -> None:
    answer = protocol.SavingAnswer(committed=20, dropped=(30,))
    assert protocol.decode_answer(protocol.encode(answer), SAVING) == answer
    assert protocol.decode_request(protocol.encode(SAVING)) == SAVING
    assert protocol.decode_answer(_answer('"committed":null'), SAVING) == protocol.SavingAnswer(
        committed=None
    )
    older = b'{"v":1,"ok":false,"error":"unknown op \'saving\'"}\n'
    assert isinstance(protocol.decode_answer(older, SAVING), protocol.ErrorAnswer)


@pytest.mark.parametrize(
    "fields",
    [
        '"committed":true,"dropped":[]',
        '"committed":1.0,"dropped":[]',
        '"committed":null,"dropped":[30,30]',
        '"committed":null,"dropped":[false]',
        '"committed":null,"dropped":[-1]',
        '"committed":null,"dropped":"30"',
        '"committed":null,"dropped":[' + ",".join(str(n) for n in range(65)) + "]",
    ],
)
def test_a_bad_answer_is_refused(fields: str) -> None:
    with pytest.raises(protocol.ProtocolError):
        protocol.decode_answer(_answer(fields), SAVING)


@pytest.mark.parametrize("line", [b'{"v":1,"op":"saving"}\n', b'{"v":1,"op":"saving","step":-2}\n'])
def test_a_bad_request_is_refused(line: bytes) -> None:
    with pytest.raises(protocol.ProtocolError):
        protocol.decode_request(line)
