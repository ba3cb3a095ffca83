"""One rank of the storage-tier tests at many ranks (tests/python/test_dist_tiers.py).

    python tiers_worker.py SCENARIO RANK WORLD INIT_FILE DIR [STEPS]

(STEPS: else $TIERS_STEPS, else 10.)

Each rank is a "host" of its own: its memory tier is DIR/host-RANK and AMBER_HOST is
h-RANK, so that its replica goes to another rank. The ranks train the tiny FSDP2
transformer of dist_worker.py with AdamW (policy exact: a restored state is the saved
one bit for bit) and save every step with Checkpointer(DIR/durable,
memory=DIR/host-RANK, replicas=1).

  train   loads (whatever a tier holds), then trains and saves up to STEPS, each
          rank appending "STEP DIGEST" of its shards to DIR/log-RANK as save()
          returns (so a job killed from outside leaves what each step saved);
          a pause between steps comes from $TIERS_SLEEP (seconds).
  load    loads and writes DIR/loaded-RANK.json: the step, its digest, the tier that
          served this rank and the TiersRestore's counts.
"""
import datetime
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from amber.torch import Checkpointer
from dist_worker import build, train_step


def digest(model, opt):
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.to_local().contiguous().numpy().tobytes())
    for s in opt.state.values():
        for k in sorted(s):
            v = s[k]
            v = v.to_local() if hasattr(v, "to_local") else v
            h.update(v.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main():
    scenario, rank, world, init, d = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
        sys.argv[4], sys.argv[5]
    steps = int(sys.argv[6]) if len(sys.argv) > 6 else int(os.environ.get("TIERS_STEPS", "10"))
    os.environ["AMBER_HOST"] = f"h-{rank}"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    model, opt = build(0)
    state = {"model": model, "optim": opt}
    ck = Checkpointer(f"{d}/durable", memory=f"{d}/host-{rank}", replicas=1)
    start = ck.load(state) or 0
    r = ck.restored
    if scenario == "load":
        with open(f"{d}/loaded-{rank}.json", "w") as f:
            json.dump({"step": start, "digest": digest(model, opt), "tier": ck.served_by,
                       "ranks_peer": r.ranks_peer if r else None,
                       "ranks_durable": r.ranks_durable if r else None}, f)
    else:
        sleep = float(os.environ.get("TIERS_SLEEP", "0"))
        torch.manual_seed(1000 + start)  # the data of the steps after `start`
        log = open(f"{d}/log-{rank}", "a")
        for step in range(start + 1, steps + 1):
            train_step(model, opt)
            ck.save(step, state)
            log.write(f"{step} {digest(model, opt)}\n")
            log.flush()
            if sleep:
                time.sleep(sleep)
    ck.close()
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
