"""The static checks flag deliberately broken connectors and pass a kvfail-mixin one.

The fixtures are read by AST only, so these tests need neither vLLM nor the fixtures'
imports to work at runtime.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfail.audit.inventory import discover
from kvfail.audit.source import SourceIndex
from kvfail.audit.static import FAIL, NA, PASS, Finding, audit_target

ROOT = Path(__file__).resolve().parents[2]
FIX = "tests.audit.fixtures"


@pytest.fixture(autouse=True)
def _repo_first_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Resolve ``tests.audit...`` to this checkout, not another ``tests`` package."""
    monkeypatch.syspath_prepend(str(ROOT))


def audit(spec: str) -> dict[str, Finding]:
    index = SourceIndex()
    (target,) = discover(index, selectors=[spec])
    assert target.installed, target.notes
    return {f.check: f for f in audit_target(target, index)}


def test_hardcoded_set_is_a_must_violation() -> None:
    f = audit(f"{FIX}.hardcoded_set:HardcodedSetConnector")
    assert f["stub"].status == FAIL
    assert f["stub"].violation == "MUST"
    assert f["stub"].spec.clause == "C1"
    assert f["block_channel"].status == FAIL
    assert f["reports"].status == FAIL
    ev = f["stub"].evidence[0]
    assert ev.path.endswith("hardcoded_set.py")
    assert ev.text == "return set()"


def test_assert_on_transfer_result_followed_into_worker() -> None:
    f = audit(f"{FIX}.asserts_success:AssertsSuccessConnector")
    cell = f["no_assert"]
    assert cell.status == FAIL
    assert cell.spec.clause == "C13"
    assert cell.spec.level == "MUST"
    assert "#39732" in cell.spec.resembles
    # Only the transfer check is evidence; the ``is not None`` guard is not.
    assert [e.text for e in cell.evidence] == [
        "assert transfer_result.success  # type: ignore[attr-defined]"
    ]


def test_done_without_result_is_flagged() -> None:
    f = audit(f"{FIX}.done_only:DoneOnlyConnector")
    cell = f["result_checked"]
    assert cell.status == FAIL
    assert cell.spec.clause == "C1"
    assert "fut.done()" in cell.evidence[0].text
    # It does override the block-level method with a real (non-constant) body.
    assert f["block_channel"].status == PASS


def test_no_override_has_no_channel() -> None:
    f = audit(f"{FIX}.no_override:NoOverrideConnector")
    assert f["block_channel"].status == FAIL
    assert f["request_channel"].status == FAIL
    assert f["reports"].status == FAIL
    assert f["reports"].violation == "MUST"
    assert f["hma"].status == NA


def test_raise_in_start_load_kv_is_flagged() -> None:
    f = audit(f"{FIX}.raises:RaisesConnector")
    assert f["no_raise"].status == FAIL
    assert f["no_raise"].spec.clause == "C13"
    assert 'raise RuntimeError("load failed")' in f["no_raise"].evidence[0].text
    assert f["reports"].status == PASS


@pytest.mark.parametrize("cls", ["MixinConnector", "DelegatingMixinConnector"])
def test_kvfail_mixin_is_compliant(cls: str) -> None:
    f = audit(f"{FIX}.mixin_good:{cls}")
    for check in ("reports", "block_channel", "request_channel", "stub", "fallback"):
        assert f[check].status == PASS, (check, f[check])
    for check in ("result_checked", "no_assert", "no_raise"):
        assert f[check].status == PASS, (check, f[check])
    assert not [c for c in f.values() if c.violation == "MUST"]
    # The evidence points into kvfail's own reporter, i.e. the mixin was credited.
    assert any(e.path.endswith("kvfail/reporter.py") for e in f["block_channel"].evidence)
    assert any(e.path.endswith("kvfail/reporter.py") for e in f["request_channel"].evidence)


def test_hma_connector_with_request_channel_passes_c5() -> None:
    f = audit(f"{FIX}.mixin_good:MixinConnector")
    assert f["hma"].status == PASS
    assert f["deadline"].status == PASS  # heuristic: deadline_s in the load path


def test_missing_module_is_rejected_not_a_row_of_dashes() -> None:
    """A typo in --connector must stop the audit (exit 2), not print an empty row."""
    with pytest.raises(ValueError, match=r"cannot import module 'no_such_pkg\.mod'"):
        discover(SourceIndex(), selectors=["no_such_pkg.mod:Conn"])


def test_unknown_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown connector"):
        discover(SourceIndex(), selectors=["NotAConnector"])
