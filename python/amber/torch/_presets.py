"""Policies: the presets by name, and `policy=` (a preset, a rule, a list of rules or a
dict {pattern: spec}) turned into the library's rules.

The lossy presets were chosen by measurement (bench/fidelity.py; docs/fidelity.md
has the tables). W = weights and every other float tensor, M = exp_avg (and SGD's
momentum), V = exp_avg_sq. Their rules:
  W: threshold:Nu@q8+lead, in units of the parameter's learning rate (amber.torch
     gives a parameter and its optimizer state the lr of its param group as their
     unit, at every save): stored once it moved N learning rates from what a
     restore gives; "+lead" stores it a step ahead of where it moves.
  M: budget:F:1e-3@q8: the F largest changes of each chunk; 1e-3 is a safety bound.
  V: threshold:0:R@q8+lead: within a share R of itself, leading its decay.
  "/SHARE:MULT" (lossy-capped): at most SHARE of a chunk per delta, never beyond
     MULT bounds, so that a delta's size is bounded by its rules.
Tensors without a learning rate (buffers, tensors no optimizer owns) are exact under
the W rule. The lr units and the lead fit Adam-type optimizers.
"""

import amber as _amber

EXACT = ("exact",)
# for runs resumed every 20-50 steps
LOSSY = (
    "threshold:1u@q8+lead",
    "*/exp_avg=budget:0.08:1e-3@q8",
    "*/momentum_buffer=budget:0.08:1e-3@q8",
    "*/exp_avg_sq=threshold:0:0.3@q8+lead",
    "*/max_exp_avg_sq=threshold:0:0.3@q8+lead",
)
# for runs resumed more often (every 10 steps)
LOSSY_FREQUENT = (
    "threshold:0.7u@q8+lead",
    "*/exp_avg=budget:0.25:1e-3@q8",
    "*/momentum_buffer=budget:0.25:1e-3@q8",
    "*/exp_avg_sq=threshold:0:0.2@q8+lead",
    "*/max_exp_avg_sq=threshold:0:0.2@q8+lead",
)
# smaller deltas whose error adds up faster: rarely resumed runs, exported checkpoints
LOSSY_COMPACT = (
    "threshold:1.5u@q8+lead",
    "*/exp_avg=budget:0.05:1e-3@q8",
    "*/momentum_buffer=budget:0.05:1e-3@q8",
    "*/exp_avg_sq=threshold:0:0.3@q8+lead",
    "*/max_exp_avg_sq=threshold:0:0.3@q8+lead",
)
# the size of each delta bounded by share caps, not only its mean
LOSSY_CAPPED = (
    "threshold:1u/0.15:8@q8+lead",
    "*/exp_avg=budget:0.1:1e-3@q8",
    "*/momentum_buffer=budget:0.1:1e-3@q8",
    "*/exp_avg_sq=threshold:0:0.3/0.1:16@q8+lead",
    "*/max_exp_avg_sq=threshold:0:0.3/0.1:16@q8+lead",
)
PRESETS: dict[str, tuple[str, ...]] = {
    "exact": EXACT, "lossy": LOSSY, "lossy-frequent": LOSSY_FREQUENT,
    "lossy-compact": LOSSY_COMPACT, "lossy-capped": LOSSY_CAPPED}


def rules(policy) -> tuple[str, ...]:
    """The library's rules for `policy`: None (exact), a preset's name, a rule
    "SPEC" or "PATTERN=SPEC", a list of those, or a dict {PATTERN: SPEC}."""
    if policy is None:
        return EXACT
    if isinstance(policy, str):
        return PRESETS.get(policy, (policy,))
    if isinstance(policy, dict):
        return tuple(f"{k}={v}" for k, v in policy.items())
    out = []
    for r in policy:
        out.extend(PRESETS.get(r, (r,)))
    return tuple(out)


def check(policy, rules_: tuple[str, ...]) -> None:
    """Raises ValueError, naming the presets, when a rule of `policy` is not one the
    library takes: at construction, before anything is created."""
    for r in rules_:
        try:
            _amber.check_policy(r)
        except (_amber.AmberError, TypeError) as e:
            why = e.message if isinstance(e, _amber.AmberError) else str(e)
            raise ValueError(
                f"policy {policy!r}: {why}. A policy is a preset ({', '.join(PRESETS)}), a "
                "rule [PATTERN=]SPEC, a list of those, or a dict {PATTERN: SPEC}") from None


def have_units(rules_: tuple[str, ...]) -> bool:
    """Whether a rule writes a number in units ("threshold:0.5u", "budget:0.1:2u")."""
    for r in rules_:
        parts = r.rpartition("=")[2].partition("@")[0].partition("/")[0].split(":")
        if (parts[0] == "threshold" and len(parts) > 1 and parts[1].endswith("u")) or \
                (parts[0] == "budget" and len(parts) > 2 and parts[2].endswith("u")):
            return True
    return False


def glob_escape(s: str) -> str:
    """`s` as a literal in a rule's pattern."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in s)


def step_rules(keys) -> list[str]:
    """The rules that keep the step counters of the optimizers at `keys` exact
    ("<key>/<param>/step", a float tensor in Adam): never lossy."""
    return [f"{glob_escape(k)}/*/step=exact" for k in keys]
