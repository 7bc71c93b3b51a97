"""The pure mutation core against the golden cases, each one twice (idempotency)."""

from __future__ import annotations

import copy

import pytest

from tests.webhook.golden import Case, check_pod, check_result, discover, summarize, unused_files
from webhook import patch as patches
from webhook.mutate import SKIP_ALREADY_INJECTED, mutate
from webhook.status import drop_status_annotation, read_status, strip

CASES = discover()


def test_there_are_cases_of_every_kind() -> None:
    names = {c.name for c in CASES}
    assert {"pytorchjob-master", "pytorchjob-worker", "trainjob-node", "legacy-mode"} <= names
    assert len(CASES) >= 25


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_mutate_matches_golden(case: Case, update_golden: bool) -> None:
    pod = copy.deepcopy(case.pod)
    result = mutate(pod, case.namespace, case.config, require_opt_in=True)
    assert pod == case.pod, "mutate changed its input"
    check_pod(case, result.pod, update_golden)
    check_result(case, summarize(result), update_golden)

    # The patch is exactly the difference; when nothing was injected, at most the reason.
    assert patches.apply(case.pod, result.patch) == result.pod
    if not result.injected:
        assert result.skip_reason is not None and result.message
        assert [op["path"] for op in result.patch] in (
            [],
            ["/metadata/annotations"],
            ["/metadata/annotations/jitckpt.io~1reason"],
        )
        unmarked = copy.deepcopy(result.pod)
        drop_status_annotation(unmarked)
        assert unmarked == case.pod or result.patch == []

    # Idempotent: a second pass changes nothing.
    again = mutate(copy.deepcopy(result.pod), case.namespace, case.config, require_opt_in=True)
    assert again.patch == []
    assert again.pod == result.pod
    if result.injected:
        assert again.skip_reason == SKIP_ALREADY_INJECTED


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_status_records_exactly_what_was_added(case: Case) -> None:
    """Stripping by the status record gives back the input; the digest is the patch's."""
    result = mutate(case.pod, case.namespace, case.config, require_opt_in=True)
    status = read_status(result.pod)
    if not result.injected:
        assert status is None or result.skip_reason == SKIP_ALREADY_INJECTED
        return
    assert status is not None
    assert strip(result.pod, status) == case.pod
    assert status.patchSha256 == patches.spec_digest(case.pod, result.pod)
    assert result.audit_annotations["patch-sha256"] == status.patchSha256


def test_no_unused_golden_files() -> None:
    assert unused_files() == [], "golden files without a case: delete them"


@pytest.mark.parametrize("job", ["", "..", "a/b", "-x", "x" * 64])
def test_job_names_that_cannot_be_a_path_segment_are_not_injected(job: str) -> None:
    case = {c.name: c for c in CASES}["trainjob-node"]
    pod = copy.deepcopy(case.pod)
    pod["metadata"]["labels"].pop("jobset.sigs.k8s.io/jobset-name")
    pod["metadata"]["annotations"]["jobset.sigs.k8s.io/jobset-name"] = job
    result = mutate(pod, case.namespace, case.config)
    assert result.skip_reason == "not-trainer"
    assert result.patch == []
