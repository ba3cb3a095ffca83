"""What a new user meets first: mistakes that surface early with helpful errors (a
policy typo at construction, naming the presets, with nothing created; `amber ls` and
`amber verify` of a directory that holds no store), logs in the ecosystem's way
(logging.getLogger("amber"): DEBUG per save, INFO per load, WARNING for a damaged step
skipped), `amber info` showing the preset and rules people can read, and Lightning's
pointer files loaded as a module."""

import logging
import os
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import amber  # noqa: E402
from amber.torch import PRESETS, Checkpointer  # noqa: E402

AMBER = shutil.which("amber", path=os.path.dirname(sys.executable)) or "amber"


def amber_cli(*args):
    return subprocess.run([AMBER, *args], capture_output=True, text=True)


@pytest.mark.parametrize("policy", ["lossyy", ["exact", "threshold:abc"], {"*/w": "budget"}])
def test_a_policy_typo_fails_at_construction_naming_the_presets(tmp_path, policy):
    path = tmp_path / "runs" / "x"
    with pytest.raises(ValueError) as ei:
        Checkpointer(str(path), policy=policy)
    msg = str(ei.value)
    assert all(name in msg for name in PRESETS), msg
    assert "bad policy" in msg
    assert not (tmp_path / "runs").exists()  # nothing created
    from amber.dcp import Writer
    with pytest.raises(ValueError, match="lossy-capped"):
        Writer(str(path), policy=policy)


def test_logs_say_what_a_save_and_a_load_did(tmp_path, caplog):
    path = str(tmp_path / "s")
    w = torch.randn(1000)
    caplog.set_level(logging.DEBUG, logger="amber")
    with Checkpointer(path, rng=False) as ck:
        for step in (1, 2, 3):
            w += 1
            ck.save(step, {"w": w})
    saves = [r for r in caplog.records if r.name == "amber.torch" and "save()" in r.message]
    assert [r.levelno for r in saves] == [logging.DEBUG] * 3
    assert "step 3" in saves[-1].message and "planned" in saves[-1].message
    caplog.clear()
    with Checkpointer(path, rng=False) as ck:
        assert ck.load({"w": torch.zeros(1000)}) == 3
    info = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(info) == 1 and "loaded step 3" in info[0].message and path in info[0].message
    # a damaged latest step, skipped by fallback: a warning naming the store
    latest = sorted(f for f in os.listdir(path) if f.startswith("ckpt-"))[-1]
    data = bytearray(open(os.path.join(path, latest), "rb").read())
    data[len(data) // 2] ^= 0x20
    open(os.path.join(path, latest), "wb").write(bytes(data))
    caplog.clear()
    with Checkpointer(path, rng=False, readonly=True) as ck:
        assert ck.load({"w": torch.zeros(1000)}, fallback=True) == 2
    warn = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warn) == 1 and "skipped" in warn[0].message and path in warn[0].message


def test_amber_is_silent_unless_logging_is_configured(tmp_path):
    code = ("import torch; from amber.torch import Checkpointer\n"
            f"ck = Checkpointer({str(tmp_path / 's')!r}, rng=False)\n"
            "ck.save(1, {'w': torch.ones(3)}); ck.close()\n"
            f"ck = Checkpointer({str(tmp_path / 's')!r}, rng=False)\n"
            "ck.load({'w': torch.zeros(3)}); ck.close()\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "loaded step" not in p.stderr and "save()" not in p.stderr, p.stderr


def test_ls_and_verify_of_a_directory_that_is_not_a_store_fail(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("not a store")
    for cmd in ("ls", "verify"):
        p = amber_cli(cmd, str(tmp_path / "notes"))
        assert p.returncode == 1 and "is not an amber store" in p.stderr, (cmd, p.stderr)
        p = amber_cli(cmd, str(tmp_path / "missing"))
        assert p.returncode == 1 and "no store" in p.stderr, (cmd, p.stderr)
    # an empty store that a writer made is a store
    with Checkpointer(str(tmp_path / "empty")):
        assert amber_cli("ls", str(tmp_path / "empty")).returncode == 0


def test_info_shows_the_preset_and_rules_people_can_read(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3 / 3)  # a unit of lr: 3.3333e-04
    m(torch.randn(2, 64)).sum().backward()
    opt.step()
    path = str(tmp_path / "s")
    with Checkpointer(path, policy="lossy") as ck:
        ck.save(1, {"model": m, "optim": opt})
    p = amber_cli("info", path)
    assert p.returncode == 0, p.stderr
    assert "policy: lossy" in p.stdout, p.stdout
    assert "threshold:0.000333333:0@q8+lead" in p.stdout, p.stdout
    assert "0.00033333333333333" not in p.stdout  # no 17-digit numbers for people


def test_lightning_pointer_loads_as_a_module(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.callbacks import ModelCheckpoint
    from amber.integrations.lightning import AmberCheckpointIO, load_from_checkpoint

    class Tiny(pl.LightningModule):
        def __init__(self, width=4):
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Linear(width, 1)

        def training_step(self, batch, _):
            return self.net(batch).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)
    model = Tiny()
    trainer = pl.Trainer(max_steps=3, plugins=[AmberCheckpointIO()], logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ck"), save_last=True,
                                                    every_n_train_steps=1)])
    trainer.fit(model, data)
    last = str(tmp_path / "ck" / "last.ckpt")
    got = load_from_checkpoint(Tiny, last)
    assert isinstance(got, Tiny) and got.hparams.width == 4
    for a, b in zip(got.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert "load_from_checkpoint" in open(last).read()  # the pointer says how to load it
