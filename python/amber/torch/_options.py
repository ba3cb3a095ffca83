"""A Checkpointer's (and a DCP Writer's) options, read once, at construction, into a
frozen object. Environment variables only supply defaults:

  AMBER_CAPTURE_BYTES      capture_bytes: tensors of at most this many bytes that no
                           saved optimizer owns are copied at save() (default 256 KiB)
  AMBER_DEVICE_PATH=1      every tensor through the accelerator path (amber.device),
                           CPU tensors too: the tests' way to cover it on any machine
  AMBER_DEVICE_ASYNC=1     the device selection of a save runs on a thread
  AMBER_DEVICE_REFERENCE=host  the device references in pinned host memory
"""

import os
from dataclasses import dataclass, field
from . import _presets
from ._capture import CAPTURE_BYTES
from ._sink import WriterOptions


@dataclass(frozen=True)
class Options:
    rules: tuple = _presets.EXACT
    policy_label: str = "exact"   # the preset's name, or the rules: what `amber info` shows
    writer: WriterOptions = field(default_factory=WriterOptions)
    rng: bool = True
    readonly: bool = False
    threads: int = 0
    capture_bytes: int = CAPTURE_BYTES
    device_path: bool = False
    device_async: bool = False
    device_host_ref: bool = False

    @property
    def has_units(self) -> bool:
        return _presets.have_units(self.rules)

    @classmethod
    def make(cls, policy=None, full_every=None, full_share=None, rng=True, readonly=False,
             threads=0, chunk_elems=0, keep_last=None, env=None) -> "Options":
        """The options of Checkpointer(...)'s arguments; `env` (default os.environ)
        supplies the defaults above."""
        env = os.environ if env is None else env
        if keep_last is not None and (not isinstance(keep_last, int) or isinstance(keep_last, bool)
                                      or keep_last < 1):
            raise ValueError(f"keep_last must be an int >= 1 or None, not {keep_last!r}")
        cb = env.get("AMBER_CAPTURE_BYTES")
        rules = _presets.rules(policy)
        _presets.check(policy, rules)
        label = policy if isinstance(policy, str) and policy in _presets.PRESETS else \
            "exact" if policy is None else ", ".join(rules)
        return cls(rules=rules, policy_label=label,
                   writer=WriterOptions(chunk_elems=chunk_elems or 0, full_every=full_every or 0,
                                        full_share=float(full_share or 0.0),
                                        keep_last=keep_last or 0),
                   rng=bool(rng), readonly=bool(readonly), threads=threads or 0,
                   capture_bytes=int(cb) if cb else CAPTURE_BYTES,
                   device_path=env.get("AMBER_DEVICE_PATH") == "1",
                   device_async=env.get("AMBER_DEVICE_ASYNC") == "1",
                   device_host_ref=env.get("AMBER_DEVICE_REFERENCE") == "host")
