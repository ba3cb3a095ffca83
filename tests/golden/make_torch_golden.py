"""Writes tests/golden/torch-v1: a store written by amber.torch as of format
"amber.torch/1" (session 8, before optimizer state went through
torch.distributed.checkpoint.state_dict), and expected.safetensors + expected.json with
what loading each step must give. Run once; the files are committed and must load forever."""
import json, os, shutil, sys
import torch
from safetensors.torch import save_file

# Run with the project's .venv (scripts/setup --python), which has amber installed.
from amber.torch import Checkpointer

out = os.path.join(os.path.dirname(__file__), "torch-v1")
shutil.rmtree(out, ignore_errors=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(),
                            torch.nn.Linear(16, 4), torch.nn.BatchNorm1d(4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
expected = {}
meta = {}
with Checkpointer(os.path.join(out, "store"), policy="exact", rng=False) as ck:
    for step in range(1, 4):
        model(torch.randn(5, 8)).pow(2).mean().backward()
        opt.step(); opt.zero_grad(); sched.step()
        ck.save(step, {"model": model, "optim": opt, "sched": sched, "extra": {"data_pos": step * 5}})
        ck.wait()
        for k, v in model.state_dict().items():
            expected[f"{step}/model/{k}"] = v.clone()
        for i, (name, p) in enumerate(model.named_parameters()):
            for k, v in opt.state[p].items():
                expected[f"{step}/optim/{name}/{k}"] = v.clone().reshape(v.shape)
        meta[str(step)] = {"lr": opt.param_groups[0]["lr"], "sched": sched.state_dict()["last_epoch"],
                           "data_pos": step * 5}
save_file({k: v.contiguous() for k, v in expected.items()}, os.path.join(out, "expected.safetensors"))
json.dump(meta, open(os.path.join(out, "expected.json"), "w"), indent=1)
lock = os.path.join(out, "store", ".lock")
if os.path.exists(lock):
    os.remove(lock)
print(sorted(os.listdir(os.path.join(out, "store"))))
