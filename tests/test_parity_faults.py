"""The parity report measured on planted faults (tests/parity_faults.py): a node's ONNX value made 1e-3 wrong is
named first in its graph, one made four ulps wrong is not blamed, and a clean model has no divergent node.

The default run plants a few faults in the model with user lowerings (in its lowering, and in the models a clean
report compared) and in the zoo's ResNet (batch norm's five outputs, convolutions and their gradients); the slow
sweep plants 420 in 14 models, in the models the clean reports compared, and wants 97% named first
(``scripts/parity_fault_sweep.py`` prints the same figures with every miss, either way).
"""

from __future__ import annotations

import parity_faults
import pytest


@pytest.mark.parametrize("name, mode", [("user_rules", "compiled"), ("user_rules", "rerun"), ("resnet", "compiled")])
def test_planted_faults_are_named_first_and_ulps_are_not_blamed(name, mode):
    result = parity_faults.run_case(parity_faults.case(name), faults_count=4, ulp_count=2, seed=0, mode=mode)
    report = parity_faults.format_results([result])
    assert result.clean_blamed == [], report
    assert len(result.outcomes) == 4 and all(o.named_first for o in result.outcomes), report
    assert {o.site.kind for o in result.outcomes} >= {"forward", "backward"}
    assert len(result.ulp_outcomes) == 2 and not any(o.blamed for o in result.ulp_outcomes), report
    assert all(o.planted_node.own.max_abs > 0 for o in result.ulp_outcomes), "an ulp fault changed nothing"
    if name == "user_rules":  # one of each: the user's rules, single and multi-output
        assert {(o.site.origin, o.site.several) for o in result.outcomes} >= {("user", False), ("user", True)}, report
    else:
        assert any(o.site.several for o in result.outcomes), report


@pytest.mark.slow
def test_the_fault_sweep_names_97_percent_first_and_blames_no_clean_model():
    results = [parity_faults.run_case(parity_faults.case(name), faults_count=24, ulp_count=6, seed=0, mode="rerun")
               for name in parity_faults.DEFAULT_SWEEP]
    report = parity_faults.format_results(results)
    counted = [o for r in results for o in r.outcomes if not o.no_effect]
    assert len(counted) >= 300 and len(results) >= 10, report
    assert sum(o.named_first for o in counted) >= 0.97 * len(counted), report
    assert not any(o.blamed for r in results for o in r.ulp_outcomes), report
    assert all(r.clean_blamed == [] for r in results), report
