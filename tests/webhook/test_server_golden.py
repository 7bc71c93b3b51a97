"""The HTTP half of the golden tests: every golden case through ``POST /mutate``.

Each case's namespace goes into the same ``NamespaceCache`` the watch feeds;
the answer's base64 JSONPatch is applied to the input pod with ``jsonpatch``
(as the API server applies it) and must give the same ``out.yaml`` as the pure
core. A second request with the patched pod (reinvocation) changes nothing.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.webhook.golden import Case, check_pod, discover
from tests.webhook.server_support import admission_review, check_answer, patched
from webhook.mutate import SKIP_INVALID_SETTING
from webhook.namespaces import NamespaceCache
from webhook.server import QUIET_SKIPS, create_app

CASES = discover()


def served(case: Case) -> TestClient:
    cache = NamespaceCache()
    cache.replace_all([case.namespace])
    return TestClient(create_app(case.config, cache, namespace_wait_seconds=0))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_http_answer_matches_golden(case: Case, update_golden: bool) -> None:
    if update_golden:
        pytest.skip("goldens are being rewritten from the pure core")
    expected = case.expected_result()
    with served(case) as client:
        review = admission_review(case.pod, namespace=case.namespace.name)
        answer = client.post("/mutate", json=review)
        assert answer.status_code == 200
        response = check_answer(answer.json(), review["request"]["uid"])
        pod = patched(case.pod, response)
        check_pod(case, pod)

        assert response["allowed"] is not expected["deny"]
        # a skipped pod's patch only marks it with its reason (check_pod compared the pod)
        assert ("patch" in response) is (pod != case.pod)
        warnings = response.get("warnings", [])
        if expected["deny"]:
            assert response["status"]["message"] == expected["message"]
        elif expected["injected"]:
            assert response["auditAnnotations"] == expected["audit_annotations"]
            assert warnings == expected["warnings"]
        elif expected["skip_reason"] in QUIET_SKIPS:
            assert warnings == expected["warnings"]
        elif expected["skip_reason"] == SKIP_INVALID_SETTING:
            assert warnings[1:] == expected["warnings"]
        else:
            assert warnings[0] == f"jitckpt: {expected['message']}"
        if not expected["injected"] and not expected["deny"]:
            registry = client.app.state.metrics.registry  # type: ignore[attr-defined]
            skipped = {"reason": expected["skip_reason"]}
            assert registry.get_sample_value("jitckpt_webhook_skipped_total", skipped) == 1

        again = check_answer(
            client.post("/mutate", json=admission_review(pod, uid="again")).json(), "again"
        )
        assert "patch" not in again
