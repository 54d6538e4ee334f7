"""The verl plug-in (mismatch.integrations.verl) inside a venv where verl 0.9.x is really installed.

Needs `scripts/setup_verl_venv.sh` ($MISMATCH_VERL_VENV, or .venv-verl in the repo root); without
it the test skips with the reason. Its body (tests/verl_body.py) runs there in a subprocess
and prints one JSON; the assertions are here. Float32 through verl vs the float64 reference:
|Δloss| stays below ~1e-6 and the gradients agree to ~1e-6 of their scale, so 1e-4 is a wide
margin that any wrong weight, centering coefficient or normalizer (all O(0.1–1)) exceeds.

The configs are verl's real Hydra composition of ppo_trainer.yaml with a user's overrides, checked
by verl's own validate_config; what cannot run here (Ray, a model, a GPU) is left out and the losses
are called as verl's ppo_loss calls them (tests/verl_body.py). The MIS band is compared with verl's
own bypass-mode REINFORCE + token IS + token_k1 rejection (verl@v0.9.1:
verl/trainer/ppo/core_algos.py compute_policy_loss_bypass_mode) on a 64 × 256 batch, for bands
that are not symmetric under low ↔ 1/high: read upside down, they mask other tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("MISMATCH_VERL_VENV") or ROOT / ".venv-verl")
PYTHON = VENV / "bin" / "python"
NAMES = ("mismatch_mis", "mismatch_sc", "mismatch_sc+mis", "mismatch_sc+mis+topp")
TOL = 1e-4
BANDS = ("0.5_5.0", "0.2_1.5", "0.9_3.0")


@pytest.fixture(scope="module")
def result() -> dict:
    if not PYTHON.exists():
        pytest.skip(f"needs verl 0.9.x in {VENV} (run scripts/setup_verl_venv.sh, or set "
                    f"MISMATCH_VERL_VENV)")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(PYTHON), str(ROOT / "tests" / "verl_body.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_verl_registers_the_losses(result):
    assert result["verl_version"].startswith("0.9."), result["verl_version"]
    assert result["registered_by_import_verl"]
    assert set(result["arms"]) == set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_loss_matches_policy_loss_and_float64_reference(result, name):
    r, arm = result["arms"][name], name.removeprefix("mismatch_")
    assert r["loss"] == pytest.approx(r["policy_loss"], abs=1e-7)
    assert r["loss"] == pytest.approx(r["reference"], abs=TOL)
    assert abs(r["reference"]) > 1e-3  # a loss that is not trivially zero
    assert r["grad_max_abs_diff"] < TOL * r["grad_max_abs"]
    # verl's rollout_rs_threshold "0.8_1.6" moves the MIS band; SC without MIS ignores it
    assert r["band_loss"] == pytest.approx(r["band_reference"], abs=TOL)
    if "mis" in arm:
        assert abs(r["band_reference"] - r["reference"]) > 10 * TOL
    # the global token mean: a micro-batch with a third of the batch's tokens
    assert r["scaled_loss"] == pytest.approx(r["loss"] / 3, abs=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_metrics_carry_verl_rollout_corr_names(result, name):
    r, m = result["arms"][name], result["arms"][name]["metrics"]
    arm = name.removeprefix("mismatch_")
    assert all(k.startswith("rollout_corr/") for k in m), sorted(m)
    assert m["rollout_corr/kl"] == pytest.approx(r["ref_kl"], abs=1e-6)
    assert m["rollout_corr/k3_kl"] == pytest.approx(r["ref_k3"], abs=1e-6)
    masked = ("rollout_corr/rollout_rs_masked_fraction" if "mis" in arm
              else "rollout_corr/mis_masked_fraction")
    assert m[masked] == pytest.approx(r["ref_outside"], abs=1e-9)
    assert r["band_metrics"][masked] == pytest.approx(r["ref_outside_band"], abs=1e-9)
    assert r["ref_outside_band"] > r["ref_outside"]
    assert m["rollout_corr/valid_tokens"] == r["own_metrics"]["valid_tokens"] == 41  # 9+7+5+9+3+8
    if arm.startswith("sc"):
        assert "rollout_corr/head_mass_sampler" in m


@pytest.mark.parametrize("band", BANDS)
@pytest.mark.parametrize("path", ["same_config", "default_trainer"])
def test_mis_band_masks_what_verls_token_k1_masks(result, band, path):
    """same_config: mismatch_mis on the ActorConfig verl's own bypass-mode loss got (the band
    apply_bypass_mode copied): the band's orientation. default_trainer: the user's
    algorithm.rollout_correction band on verl's default (v1) trainer, validated by verl's main():
    the band reaches the loss. Both must mask exactly verl's tokens and give verl's loss."""
    r = result["bands"][band]
    verl, ours = r["verl"], r[path]
    assert verl["rs_mask_equals_loss_mask"]          # verl's rejection mask is its loss's mask
    assert 0.001 < verl["masked"] < 0.5, verl        # the band masks some tokens, not most
    # the band read upside down masks a different share: this comparison can tell them apart
    assert abs(r["upside_down_masked"] - verl["masked"]) > 0.001, r
    assert ours["tokens_differing"] == 0, (ours, verl)
    assert ours["masked"] == verl["masked"]
    # verl's metric is a float32 mean (the same count over the same tokens: rel. 1e-7)
    assert ours["masked_metric"] == pytest.approx(verl["masked_metric"], rel=1e-6)
    assert ours["loss"] == pytest.approx(verl["loss"], rel=1e-5, abs=1e-7)
    assert ours["grad_max_abs_diff"] < 1e-5 * verl["grad_max_abs"]


def test_verl_default_trainer_passes_no_band_to_the_actor(result):
    """Why the plug-in copies algorithm.rollout_correction to the actor: verl's v1 trainer does
    not, so the actor config a loss gets has no band of the user's (verl's default: None)."""
    assert result["errors"]["default_actor_threshold"] is None


def test_legacy_trainer_and_no_bypass_fail_in_one_line(result):
    errors = result["errors"]
    # verl's legacy trainer replaces the loss: a mismatch loss there would never run
    assert errors["legacy_loss_mode_after_bypass"] == "bypass_mode"
    assert "trainer.use_v1=true" in errors["legacy"]
    assert "algorithm.rollout_correction.bypass_mode=true" in errors["no_bypass"]
    assert "algorithm.rollout_correction.bypass_mode=true" in errors["loss_without_check"]
    assert "actor_rollout_ref.rollout.calculate_log_probs=true" in errors["no_rollout_log_probs"]
    for key in ("legacy", "no_bypass", "loss_without_check", "no_rollout_log_probs"):
        assert errors[key].startswith("mismatch_mis needs"), errors[key]


def test_errors_are_one_line(result):
    errors = {k: v for k, v in result["errors"].items()
              if k not in ("legacy_loss_mode_after_bypass", "default_actor_threshold")}
    assert "needs the sampler's top-k candidates" in errors["sc_without_candidates"]
    assert "token-mean" in errors["seq_mean"]
    assert "rollout_is=null" in errors["is_weights"]
    assert "algorithm.rollout_correction.rollout_is=null" in errors["verl_is_on"]
    assert "algorithm.rollout_correction.rollout_rs=token_k1" in errors["other_rs"]
    assert "rollout_rs_threshold" in errors["bad_band"]
    assert "mismatch_nope" in errors["unknown_name"]  # verl's own lookup error
    assert all(e and "\n" not in e for e in errors.values()), errors


def test_module_needs_verl_here():
    """In the project's own venv (no verl) the import says what is missing, in one line."""
    proc = subprocess.run([sys.executable, "-c", "import mismatch.integrations.verl"],
                          capture_output=True, text=True, env={**os.environ,
                                                               "PYTHONPATH": str(ROOT)})
    if proc.returncode == 0:
        pytest.skip("verl is installed in this venv too")
    assert "mismatch.integrations.verl needs verl (0.9.x)" in proc.stderr.splitlines()[-1]
