"""Malformed and hostile AdmissionReviews: always a well-formed answer, never a 500.

The API server only sends what it validated, but the webhook's port is
reachable from inside the cluster. Whatever arrives, the answer is an
AdmissionReview: with the request's uid (allowed, with the reason as a
warning) when the uid can be read, else with an empty uid and an HTTP 4xx.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.webhook.server_support import admission_review, check_answer, fixture, patched
from tests.webhook.test_mutate_robust import paths
from webhook.config import WebhookConfig
from webhook.metrics import AdmissionMetrics
from webhook.mutate import NamespaceInfo
from webhook.namespaces import NamespaceCache
from webhook.server import create_app

MiB = 1024 * 1024
NAMESPACE = fixture("namespace-team-a.yaml")["metadata"]


def _answer_of(client: TestClient, content: bytes, uid: str | None) -> dict[str, Any]:
    answer = client.post("/mutate", content=content, headers={"content-type": "application/json"})
    assert answer.status_code in (200, 400, 413), answer.text
    assert answer.headers["content-type"] == "application/json"
    assert (answer.status_code == 200) == bool(uid)
    return check_answer(answer.json(), uid)


@pytest.fixture(scope="module")
def metrics() -> AdmissionMetrics:
    return AdmissionMetrics.create()


@pytest.fixture(scope="module")
def client(metrics: AdmissionMetrics) -> Iterator[TestClient]:
    cache = NamespaceCache()
    cache.replace_all(
        [
            NamespaceInfo(
                name="team-a", labels=NAMESPACE["labels"], annotations=NAMESPACE["annotations"]
            )
        ]
    )
    app = create_app(WebhookConfig(), cache, metrics=metrics, namespace_wait_seconds=0)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def internal_errors(metrics: AdmissionMetrics) -> float:
    """How often the mutation raised (the handler then admits unchanged)."""
    value: float = metrics.failed.labels(reason="internal")._value.get()
    return value


VALID = admission_review(fixture("pytorchjob-master.yaml"), uid="good-uid")


def review_with(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(VALID)
    _set(doc, path, value)
    return doc


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> None:
    """Put ``value`` at ``path`` inside ``doc`` (``_DELETE``: remove what is there)."""
    target = doc
    for key in path[:-1]:
        target = target[key]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value


_DELETE = object()


def edited(path: tuple[str, ...], value: Any) -> bytes:
    return json.dumps(review_with(path, value)).encode()


def _init_containers_only() -> dict[str, Any]:
    doc = review_with(("request", "object", "spec", "containers"), _DELETE)
    doc["request"]["object"]["spec"]["initContainers"] = VALID["request"]["object"]["spec"][
        "containers"
    ]
    return doc


OBJ = ("request", "object")
SPEC = (*OBJ, "spec")
UID = "good-uid"
SECRETS = {"group": "", "version": "v1", "resource": "secrets"}
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
NASTY: list[tuple[str, bytes, str | None]] = [
    ("invalid JSON", b'{"apiVersion": "admission.k8s.io/v1", "kind": ', None),
    ("empty body", b"", None),
    ("not UTF-8", b'{"kind": "\xff\xfe"}', None),
    ("NaN", b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "x": NaN}', None),
    ("a list", b"[1, 2, 3]", None),
    ("a string", b'"AdmissionReview"', None),
    ("null", b"null", None),
    ("a number", b"1e999", None),
    ("deeply nested", b"[" * 200_000 + b"]" * 200_000, None),
    ("deeply nested object", b'{"a":' * 100_000 + b"1" + b"}" * 100_000, None),
    ("wrong kind", edited(("kind",), "Pod"), None),
    ("v1beta1", edited(("apiVersion",), "admission.k8s.io/v1beta1"), None),
    ("no request", edited(("request",), _DELETE), None),
    ("request is a list", edited(("request",), []), None),
    ("missing uid", edited(("request", "uid"), _DELETE), None),
    ("uid not a string", edited(("request", "uid"), 7), None),
    ("empty uid", edited(("request", "uid"), ""), None),
    ("object is not a pod", edited((*OBJ, "kind"), "Secret"), UID),
    ("object is a string", edited(OBJ, "pod"), UID),
    ("object missing", edited(OBJ, _DELETE), UID),
    ("no containers", edited((*SPEC, "containers"), []), UID),
    ("containers not a list", edited((*SPEC, "containers"), {"a": 1}), UID),
    ("nameless container", edited((*SPEC, "containers"), [{"image": "x"}]), UID),
    ("null initContainers", edited((*SPEC, "initContainers"), None), UID),
    ("no spec", edited(SPEC, _DELETE), UID),
    ("labels not strings", edited((*OBJ, "metadata", "labels"), {"a": 1}), UID),
    ("metadata a list", edited((*OBJ, "metadata"), []), UID),
    ("volumes not a list", edited((*SPEC, "volumes"), "x"), UID),
    ("resource is a secret", edited(("request", "resource"), SECRETS), UID),
    ("subresource", edited(("request", "subResource"), "status"), UID),
    ("no namespace", edited(("request", "namespace"), _DELETE), UID),
    ("no operation", edited(("request", "operation"), _DELETE), UID),
    ("UPDATE", edited(("request", "operation"), "UPDATE"), UID),
    ("DELETE, null object", edited(OBJ, None).replace(b'"CREATE"', b'"DELETE"'), UID),
    # Found by the generator below: an empty JobSet name label (legal in Kubernetes).
    ("empty jobset name", edited((*OBJ, "metadata", "labels"), {JOBSET_NAME: ""}), UID),
    # Issue 22, class 7: a pod without spec.containers (init containers only) was a 500.
    ("containers missing", edited((*SPEC, "containers"), _DELETE), UID),
    ("init containers only", json.dumps(_init_containers_only()).encode(), UID),
    ("containers null", edited((*SPEC, "containers"), None), UID),
    ("spec a string", edited(SPEC, "x"), UID),
]


@pytest.mark.parametrize(("name", "body", "uid"), NASTY, ids=[n for n, _, _ in NASTY])
def test_nasty_request_gets_a_well_formed_answer(
    client: TestClient, metrics: AdmissionMetrics, name: str, body: bytes, uid: str | None
) -> None:
    before = internal_errors(metrics)
    response = _answer_of(client, body, uid)
    assert response["allowed"] is bool(uid)
    assert "patch" not in response
    if not uid:
        assert response["status"]["code"] == 400
    assert internal_errors(metrics) == before


def test_huge_body_with_a_uid_is_admitted_unchanged_without_reading_it_all(
    client: TestClient,
) -> None:
    review = copy.deepcopy(VALID)
    review["request"]["object"]["metadata"]["annotations"]["padding"] = "x" * (4 * MiB)
    response = _answer_of(client, json.dumps(review).encode(), "good-uid")
    assert response["allowed"] is True and "exceeds" in response["warnings"][0]


def test_huge_body_without_a_uid_is_413(client: TestClient) -> None:
    answer = client.post("/mutate", content=b"[" + b"0," * (2 * MiB) + b"0]")
    assert answer.status_code == 413
    response = check_answer(answer.json(), None)
    assert response["allowed"] is False and response["status"]["code"] == 413


def test_huge_chunked_body_is_cut_off_while_streaming(client: TestClient) -> None:
    """At the ASGI level: the app stops pulling body chunks once past the limit."""
    import asyncio

    pulled = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal pulled
        pulled += 1
        return {"type": "http.request", "body": b" " * MiB, "more_body": pulled < 64}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "https",
        "path": "/mutate",
        "raw_path": b"/mutate",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8443),
    }
    asyncio.run(client.app(scope, receive, send))  # type: ignore[arg-type]
    assert sent[0]["status"] == 413
    body = b"".join(m.get("body", b"") for m in sent[1:])
    check_answer(json.loads(body), None)
    assert pulled == 4  # 4 MiB read of 64 MiB offered: over 3 MiB, then stop


def test_wrong_method_and_path_answer_json(client: TestClient) -> None:
    assert client.get("/mutate").status_code == 405
    assert client.post("/nope", content=b"{}").status_code == 404


# ---- generated reviews ----------------------------------------------------------

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)
# Values that are often meaningful to the mutation: the keys it reads and
# strings it parses, so the generator reaches the deeper code paths.
ANNOTATION_KEYS = [
    "jitckpt.io/destination",
    "jitckpt.io/s3-secret",
    "jitckpt.io/grace-period-seconds",
    "jitckpt.io/inject",
    "jitckpt.io/mode",
    "jitckpt.io/save-steps",
    "jitckpt.io/local-size-limit",
    "jitckpt.io/status",
    "training.kubeflow.org/job-name",
    "jobset.sigs.k8s.io/jobset-name",
    "jobset.sigs.k8s.io/replicatedjob-name",
]
tricky_strings = st.sampled_from(
    [
        "",
        "false",
        "true",
        "0",
        "-1",
        "99999999999",
        "s3://b/p",
        "s3://../x",
        "pvc://c/p",
        "node",
        "pytorch",
    ]
) | st.text(max_size=20)
string_maps = st.dictionaries(
    st.sampled_from(ANNOTATION_KEYS) | st.text(max_size=8), tricky_strings, max_size=5
)
# (path inside request.object, replacement) pairs applied to the valid fixture.
POD_PATHS = [
    ("metadata", "labels"),
    ("metadata", "annotations"),
    ("metadata", "name"),
    ("spec", "containers"),
    ("spec", "initContainers"),
    ("spec", "volumes"),
    ("spec", "hostNetwork"),
    ("spec", "terminationGracePeriodSeconds"),
    ("spec", "containers", 0, "env"),
    ("spec", "containers", 0, "name"),
    ("spec", "containers", 0, "volumeMounts"),
    ("spec", "containers", 0, "lifecycle"),
]
# Label and annotation maps are mostly merged into the pod's own (so the pod
# stays a trainer pod and reaches the injection), sometimes replaced.
edits = st.lists(
    st.tuples(st.sampled_from([("metadata", "labels"), ("metadata", "annotations")]), string_maps)
    | st.tuples(st.sampled_from(POD_PATHS), string_maps | json_values | tricky_strings),
    max_size=3,
)
top_level_edits = st.lists(
    st.tuples(
        st.sampled_from(
            [("apiVersion",), ("kind",), ("request",), ("request", "uid"), ("request", "namespace"),
             ("request", "operation"), ("request", "object"), ("request", "resource")]
        ),
        json_values | st.sampled_from([_DELETE, "team-a", "CREATE", "AdmissionReview"]),
    ),
    max_size=1,
)  # fmt: skip


def _apply(doc: Any, path: tuple[Any, ...], value: Any, *, merge: bool = False) -> None:
    target = doc
    for key in path[:-1]:
        into_dict = isinstance(target, dict) and isinstance(target.get(key), dict | list)
        into_list = isinstance(target, list) and isinstance(key, int) and key < len(target)
        if into_dict or into_list:
            target = target[key]
        else:
            return
    last = path[-1]
    if isinstance(target, dict) and isinstance(last, str):
        if merge and isinstance(value, dict) and isinstance(target.get(last), dict):
            target[last] = {**target[last], **value}
        elif value is _DELETE:
            target.pop(last, None)
        else:
            target[last] = value
    elif isinstance(target, list) and isinstance(last, int) and last < len(target):
        target[last] = value


@settings(
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    case=st.tuples(
        st.sampled_from(
            [
                "pytorchjob-master.yaml",
                "pytorchjob-worker.yaml",
                "trainjob-node.yaml",
                "plain-pod.yaml",
            ]
        ),
        edits,
        st.just([]) | top_level_edits,
        st.none() | json_values,
    )
)
def test_generated_reviews_get_well_formed_answers(
    client: TestClient, metrics: AdmissionMetrics, case: tuple[str, list[Any], list[Any], Any]
) -> None:
    base, pod_edits, review_edits, raw = case
    pod = fixture(base)
    pod["metadata"]["namespace"] = "team-a"
    doc: Any = admission_review(pod, uid="gen-uid")
    for path, value in pod_edits:
        _apply(doc["request"]["object"], path, value, merge=path[-1] in ("labels", "annotations"))
    for path, value in review_edits:
        _apply(doc, path, value)
    if raw is not None and not review_edits and not pod_edits:
        doc = raw  # sometimes send arbitrary JSON instead of a review
    request = doc.get("request") if isinstance(doc, dict) else None
    uid = request.get("uid") if isinstance(request, dict) else None
    body = json.dumps(doc).encode()
    before = internal_errors(metrics)
    answer = client.post("/mutate", content=body)
    assert answer.status_code in (200, 400), answer.text
    response = check_answer(answer.json(), answer.json()["response"]["uid"] or None)
    injected = "auditAnnotations" in response  # a skip's patch only marks the reason
    event("injected" if injected else f"HTTP {answer.status_code}, not injected")
    if answer.status_code == 200:
        assert response["uid"] == uid
    if injected:
        result = patched(request["object"], response)  # type: ignore[index]
        assert any(
            c["name"] == "jitckpt-agent"
            for c in result["spec"].get("initContainers", []) + result["spec"]["containers"]
        )
    assert internal_errors(metrics) == before


# ---- generated pod shapes (issue 22, class 7) -------------------------------------


finite_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
finite_values = st.recursive(
    finite_scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)


@st.composite
def reshaped_reviews(draw: st.DrawFn) -> dict[str, Any]:
    """A valid review of a trainer pod whose shape was damaged anywhere: keys deleted,
    values replaced by other JSON types, lists emptied, at any depth of the review."""
    base = draw(
        st.sampled_from(["pytorchjob-master.yaml", "pytorchjob-worker.yaml", "trainjob-node.yaml"])
    )
    pod = fixture(base)
    pod["metadata"]["namespace"] = "team-a"
    doc = admission_review(pod, uid="shape-uid")
    for _ in range(draw(st.integers(1, 4))):
        candidates = [p for p in paths(doc["request"]) if p[0] != "uid"]
        if draw(st.booleans()):  # as often, a field of the pod's top levels (spec.containers)
            candidates = [p for p in candidates if len(p) <= 3] or candidates
        where = ("request", *draw(st.sampled_from(candidates)))
        value = draw(
            st.just(_DELETE) | st.sampled_from([None, [], {}, "", 0, True]) | finite_values
        )
        _set(doc, where, value)
    return doc


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(doc=reshaped_reviews())
def test_every_review_shape_gets_a_well_formed_answer(
    client: TestClient, metrics: AdmissionMetrics, doc: dict[str, Any]
) -> None:
    """Whatever part of the review is missing or of another type, the answer is a review
    echoing the uid with HTTP 200, and the mutation never raised (no internal error)."""
    before = internal_errors(metrics)
    answer = client.post("/mutate", content=json.dumps(doc).encode())
    assert answer.status_code == 200, answer.text
    response = check_answer(answer.json(), "shape-uid")
    if "patch" in response:
        patched(doc["request"]["object"], response)
    assert internal_errors(metrics) == before
