"""Policies through the Checkpointer: every restored element is within the bound
of a threshold or budget policy at every step of a delta chain; rules apply to the
tensor names by pattern; the "lossy" presets keep their bounds; optimizer step
counters stay exact whatever the rules say."""

import pytest
import torch

import amber
from amber.torch import PRESETS, Checkpointer
from conftest import rules_bound, spec_bound


def within(restored, true, abs_bound, rel_bound):
    err = (restored.double() - true.double()).abs()
    bound = abs_bound + rel_bound * restored.double().abs()
    return bool((err <= bound * (1 + 1e-6) + 1e-12).all()), float(err.max())


def run(store, policy, steps=12, lr=1e-2, full_share=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    truth = {}
    with Checkpointer(store, policy=policy, rng=False, full_share=full_share) as ck:
        for step in range(1, steps + 1):
            model(torch.randn(32, 64)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            ck.save(step, {"model": model, "optim": opt})
            truth[step] = ({k: v.clone() for k, v in model.state_dict().items()},
                           {n: {k: v.clone() for k, v in opt.state[p].items()}
                            for n, p in model.named_parameters()})
        ck.wait()
        kinds = [c.kind for c in ck.steps()]
    return model, opt, truth, kinds


def restored(store, step):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with Checkpointer(store, rng=False, readonly=True) as ck:
        ck.load({"model": model, "optim": opt}, step=step)
    return model, opt


def test_threshold_bound_holds_at_every_step_of_the_chain(store):
    _, _, truth, kinds = run(store, "threshold:1e-3:1e-2")
    assert kinds.count("delta") >= 5
    for step, (msd, _) in truth.items():
        model, _ = restored(store, step)
        for k, v in model.state_dict().items():
            ok, worst = within(v, msd[k], 1e-3, 1e-2)
            assert ok, f"step {step} {k}: max error {worst}"


def test_rules_by_pattern_and_their_bounds(store):
    policy = {"model/*": "budget:0.05:2e-3", "optim/*/exp_avg": "threshold:1e-4",
              "*/exp_avg_sq": "threshold:0:0.05"}
    _, _, truth, _ = run(store, policy)
    with Checkpointer(store, rng=False, readonly=True) as ck:
        infos = {t.name: t.policy for t in ck.store.reader().tensors()}
    assert infos["model/0.weight"] == "budget:0.05:2e-3"
    assert infos["optim/0.weight/exp_avg"] == "threshold:1e-4"
    assert infos["optim/2.bias/exp_avg_sq"] == "threshold:0:0.05"
    assert infos["optim/2.bias/step"] == "exact"
    for step in (3, 12):
        model, opt = restored(store, step)
        msd, osd = truth[step]
        for k, v in model.state_dict().items():
            assert within(v, msd[k], 2e-3, 0)[0], (step, k)
        for n, p in model.named_parameters():
            s = opt.state[p]
            assert within(s["exp_avg"], osd[n]["exp_avg"], 1e-4, 0)[0], (step, n)
            assert within(s["exp_avg_sq"], osd[n]["exp_avg_sq"], 0, 0.05)[0], (step, n)
            assert torch.equal(s["step"], osd[n]["step"])


def preset_bound(name, preset="lossy", unit=0.0):
    """(ABS, REL) bound of tensor `name` under a preset: the last matching rule's."""
    return rules_bound(PRESETS[preset], name, unit)


@pytest.mark.parametrize("preset", ["lossy", "lossy-frequent", "lossy-compact", "lossy-capped"])
def test_lossy_presets_keep_their_bounds_and_exact_step_counters(store, preset):
    # full_share off: a chain of deltas even where the preset's deltas are dense
    # the presets' weight rule is in units of the learning rate (constant here)
    lr = 1e-3
    _, _, truth, kinds = run(store, preset, lr=lr, full_share=-1)
    assert kinds.count("delta") >= 5
    with amber.Store(store, readonly=True) as st:
        for step in (4, 12):
            model, opt = restored(store, step)
            msd, osd = truth[step]
            # what each file records is the preset's bound, units written out
            with st.reader(step) as r:
                recorded = {t.name: t.policy for t in r.tensors()}
            for name, spec in recorded.items():
                want = preset_bound(name, preset, lr) if "/step" not in name else (0.0, 0.0)
                assert spec_bound(spec) == pytest.approx(want, rel=1e-12), (step, name, spec)
            for k, v in model.state_dict().items():
                assert within(v, msd[k], *preset_bound(f"model/{k}", preset, lr))[0], (step, k)
            for n, p in model.named_parameters():
                for k, v in opt.state[p].items():
                    if k == "step":
                        assert torch.equal(v, osd[n][k])
                    else:
                        assert within(v, osd[n][k],
                                      *preset_bound(f"optim/{n}/{k}", preset, lr))[0], (step, n, k)


def test_step_counters_stay_exact_under_a_loose_global_rule(store):
    _, _, truth, _ = run(store, "threshold:100", steps=4)
    _, opt = restored(store, 4)
    assert all(float(s["step"]) == 4.0 for s in opt.state.values())


def test_exact_is_bit_exact(store):
    _, _, truth, _ = run(store, "exact", steps=5)
    for step in (2, 5):
        model, _ = restored(store, step)
        for k, v in model.state_dict().items():
            assert torch.equal(v, truth[step][0][k])


def test_units_follow_the_learning_rate_schedule_at_every_save(store):
    """A rule in units ("1u") is the param group's lr at each save: through the save
    plan (the second and later saves of one state's structure), every lr of a
    schedule is what that step's file records and what bounds its restore; two
    param groups keep their own lr; a buffer (no lr) stays exact."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.BatchNorm1d(128),
                                torch.nn.Linear(128, 8))
    opt = torch.optim.Adam([{"params": model[0].parameters(), "lr": 1e-2},
                            {"params": list(model[1].parameters()) + list(model[2].parameters()),
                             "lr": 3e-3}])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    truth, lrs = {}, {}
    with Checkpointer(store, policy="threshold:1u", rng=False, full_share=-1) as ck:
        for step in range(1, 9):
            model(torch.randn(32, 64)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            ck.save(step, {"model": model, "optim": opt})
            truth[step] = {k: v.clone() for k, v in model.state_dict().items()}
            lrs[step] = [g["lr"] for g in opt.param_groups]
            sched.step()
        ck.wait()
    with amber.Store(store, readonly=True) as st:
        for step in (2, 5, 8):
            lr0, lr1 = lrs[step]
            assert lr0 != lrs[1][0]
            with st.reader(step) as r:
                rec = {t.name: spec_bound(t.policy) for t in r.tensors()}
            assert rec["model/0.weight"] == pytest.approx((lr0, 0.0), rel=1e-12), step
            assert rec["optim/0.weight/exp_avg"] == pytest.approx((lr0, 0.0), rel=1e-12), step
            assert rec["model/2.weight"] == pytest.approx((lr1, 0.0), rel=1e-12), step
            assert rec["model/1.running_mean"] == (0.0, 0.0), step
            assert rec["optim/0.weight/step"] == (0.0, 0.0), step
            torch.manual_seed(1)
            back = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.BatchNorm1d(128),
                                       torch.nn.Linear(128, 8))
            with Checkpointer(store, rng=False, readonly=True) as ck:
                ck.load({"model": back}, step=step, strict=False)
            for k, v in back.state_dict().items():
                ok, worst = within(v, truth[step][k], *rec[f"model/{k}"])
                assert ok, f"step {step} {k}: max error {worst}"
